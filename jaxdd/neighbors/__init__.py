"""Neighbour lists with static shapes: a cell list that runs on device under ``jit``.

The builder bins atoms in the fractional coordinates of each system's cell, sorts the
bin keys, and for every atom scans a static block of neighbouring bins. Every array has a
fixed capacity (:class:`NeighborCapacity`); when a capacity is too small the builder sets
``overflow`` and reports the sizes it needed, and the host grows the capacity and builds
again (:func:`neighbor_list`). Nothing is ever dropped silently.

Conventions (shared by every model and by the domain decomposition):

* An edge ``e`` has a ``receiver`` (the atom whose neighbourhood it belongs to), a
  ``sender`` and an integer image ``shift``; its vector points from the receiver to the
  sender's image::

      vec[e] = positions[senders[e]] - positions[receivers[e]] + shifts[e] @ cell

  This is ASE's ``neighbor_list('ijS')`` with ``i = receiver``, ``j = sender``.
* Shifts are relative to the positions as given: atoms outside the cell on periodic axes
  are wrapped for the search only, so wrapping the input changes no edge vector.
* A full list holds both ``(i, j, S)`` and ``(j, i, -S)``; a half list keeps the one with
  ``i < j`` (or ``i == j`` and ``S`` lexicographically positive: periodic self-images).
* COO edges are sorted by receiver. Padding entries point one past the last atom
  (index ``n_atoms``) with a zero shift and ``mask`` False.
* Edges never join atoms of different systems of a batch.

Modules: :mod:`~jaxdd.neighbors.formats` (the list, its layout and capacity),
:mod:`~jaxdd.neighbors.geometry` (binning cell, edge vectors), :mod:`~jaxdd.neighbors.cell_list`
(the bin search), :mod:`~jaxdd.neighbors.build` (the builders), :mod:`~jaxdd.neighbors.bonds`
(bonds, their reverses and triplets, for angle models), :mod:`~jaxdd.neighbors.sizing`
(host-side sizing), :mod:`~jaxdd.neighbors.inputs` (input checks) and
:mod:`~jaxdd.neighbors.capacity` (the sizing and growth rule of every capacity).
"""

from .bonds import (BondList, bond_partners, bond_vectors, gather_bonds, reverse_bonds, triplet_cosines,
                    triplet_mask)
from .build import build_neighbor_list, local_neighbor_list, neighbor_list
from .formats import (BUCKET_MIN, NEIGHBOR_BACKENDS, NeighborCapacity, NeighborList, NeighborListFormat, NeighborStats,
                      capacity_bucket)
from .geometry import edge_vectors, effective_cell
from .sizing import PAIR_COUNT_SLOTS, neighbor_capacity

__all__ = [
    "NeighborListFormat",
    "NeighborCapacity",
    "NeighborStats",
    "NeighborList",
    "BondList",
    "bond_partners",
    "bond_vectors",
    "gather_bonds",
    "reverse_bonds",
    "triplet_cosines",
    "triplet_mask",
    "build_neighbor_list",
    "neighbor_capacity",
    "neighbor_list",
    "edge_vectors",
    "effective_cell",
    "local_neighbor_list",
    "capacity_bucket",
    "BUCKET_MIN",
    "NEIGHBOR_BACKENDS",
    "PAIR_COUNT_SLOTS",
]
