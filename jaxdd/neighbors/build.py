"""Building neighbour lists: on device under ``jit`` (:func:`build_neighbor_list`), over a
rank's open-boundary rows (:func:`local_neighbor_list`), and from the host with sizing and
growth on overflow (:func:`neighbor_list`).

Every build has the static shapes of its :class:`~jaxdd.neighbors.NeighborCapacity`; when a
capacity is too small the list says so (``overflow``) with the sizes it needed, and nothing
is dropped silently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import programs
from ..data.checks import integral
from ..data import is_concrete
from .bonds import build_bonds
from .capacity import run_until_fits
from .cell_list import candidate_mask
from .formats import NeighborCapacity, NeighborList, NeighborListFormat
from .inputs import check_bond_cutoff, check_cutoff, check_order, normalise_inputs
from .sizing import neighbor_capacity

__all__ = ["build_neighbor_list", "local_neighbor_list", "neighbor_list"]


def build_neighbor_list(
    positions, cell, pbc, batch_idx=None, atom_mask=None, *,
    cutoff: float,
    capacity: NeighborCapacity,
    half: bool = False,
    format: NeighborListFormat = NeighborListFormat.COO,
    n_receivers: int | None = None,
    order=None,
    bond_cutoff: float | None = None,
) -> NeighborList:
    """Build a neighbour list on device; traceable under ``jit`` (keyword args static but ``order``).

    Pairs with distance < cutoff are listed. Check ``overflow`` (or use
    :func:`neighbor_list`, which grows and rebuilds). Called outside a trace it runs as one
    compiled program per shape and configuration.

    Args:
      positions: [n_atoms, 3] Å.
      cell: [S, 3, 3] Å, rows are lattice vectors.
      pbc: [S, 3] bool.
      batch_idx: [n_atoms] system of each atom (default all 0).
      atom_mask: [n_atoms] bool, False for padding rows (default all True).
      cutoff: Å.
      capacity: the static sizes of the build.
      half: list each pair once.
      format: COO edges only, or a MATRIX table as well.
      n_receivers: only rows [0, n_receivers) are receivers (default all; under
        decomposition, the owned rows), and the work scales with them.
      order: for a half list without periodic axes, two [n_atoms] int32 keys that decide
        which row of a pair lists it, e.g. global atom id and image under decomposition: the
        row of lower (key a, key b), compared lexicographically, when the two keys a have
        the same parity, else the row of higher. The parity spreads the pairs between two
        sets of rows (two ranks) about evenly; the lower key alone would give them all to
        the set holding the lower ids. Default: the lower row index, and the positive image
        shift.
      bond_cutoff: Å, 0 < bond_cutoff <= cutoff, or None: the list then carries ``bonds``
        (:class:`~jaxdd.neighbors.BondList`, ``capacity.max_bonds`` slots per row; full
        MATRIX lists only).

    Returns:
      The :class:`~jaxdd.neighbors.NeighborList` (``overflow`` set when a capacity was too
      small, with the sizes it needed).
    """
    check_cutoff(cutoff)
    format = NeighborListFormat(format)
    bond_cutoff = check_bond_cutoff(bond_cutoff, cutoff, format, half)
    if n_receivers is not None:
        n_receivers = integral("build_neighbor_list: n_receivers", n_receivers, minimum=0)
    inputs = tuple(x if x is None or isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
                   for x in (positions, cell, pbc, batch_idx, atom_mask))
    if order is not None:  # checked here, where a host pbc is still concrete
        order = check_order(order, inputs[0].shape[0], half, inputs[2])
    kw = dict(cutoff=float(cutoff), capacity=capacity, half=bool(half), format=format, n_receivers=n_receivers,
              bond_cutoff=bond_cutoff)
    if not is_concrete(*jax.tree_util.tree_leaves((inputs, order))):
        return _build(*inputs, **kw, order=order)  # inside the caller's program
    return _build_jit(*inputs, **kw, order=order)


def _build(positions, cell, pbc, batch_idx, atom_mask, *, cutoff, capacity, half, format, n_receivers, order,
           bond_cutoff=None):
    """The build of :func:`build_neighbor_list`, its arguments checked (traced, or jitted as ``_build_jit``)."""
    positions, cell, pbc, batch_idx, atom_mask = normalise_inputs(positions, cell, pbc, batch_idx, atom_mask)
    n = positions.shape[0]

    mask, aux = candidate_mask(
        positions, cell, pbc, batch_idx, atom_mask,
        cutoff=cutoff, half=half, capacity=capacity, n_receivers=n_receivers, order=order,
    )
    c = mask.shape[1]
    per_atom = jnp.sum(mask, axis=1, dtype=jnp.int32)  # [R]
    n_edges = jnp.sum(per_atom, dtype=jnp.int32)

    # Row-major compaction keeps the edges sorted by receiver.
    (idx,) = jnp.nonzero(mask.reshape(-1), size=capacity.max_edges, fill_value=0)
    valid = jnp.arange(capacity.max_edges) < n_edges
    recv = (idx // c).astype(jnp.int32)
    slot = idx % c
    send = aux["order"][aux["sorted_pos"][recv, slot]]
    shift = aux["image"][recv, aux["which"][recv, slot]] - aux["wraps"][send] + aux["wraps"][recv]
    senders = jnp.where(valid, send, n).astype(jnp.int32)
    receivers = jnp.where(valid, recv, n).astype(jnp.int32)
    shifts = jnp.where(valid[:, None], shift, 0).astype(jnp.int32)

    needed_candidates = jnp.max(aux["total"], initial=0)
    overflow = (
        (aux["bins_used"] > capacity.table_size(n))
        | (needed_candidates > c)
        | jnp.any(aux["need"] > jnp.asarray(capacity.search_range))
    )
    nl = _assemble(senders, receivers, shifts, valid, per_atom, n_edges, n, capacity, format, overflow,
                   needed_candidates=needed_candidates, needed_range=aux["need"], needed_bins=aux["bins_used"])
    return _with_bonds(nl, positions, cell, batch_idx, bond_cutoff, capacity)


def _with_bonds(nl: NeighborList, positions, cell, batch_idx, bond_cutoff, capacity) -> NeighborList:
    """``nl`` with its bonds (none when ``bond_cutoff`` is None); a row with more bonds than
    ``capacity.max_bonds`` sets ``overflow``."""
    if bond_cutoff is None:
        return nl
    bonds = build_bonds(positions, cell, batch_idx, nl.matrix, nl.matrix_shifts, bond_cutoff=bond_cutoff,
                        max_bonds=capacity.max_bonds)
    overflow = nl.overflow | (jnp.max(bonds.count, initial=0) > capacity.max_bonds)
    return dataclasses.replace(nl, bonds=bonds, overflow=overflow)


def _assemble(senders, receivers, shifts, valid, per_atom, n_edges, n, capacity, format, overflow, *,
              needed_candidates, needed_range, needed_bins) -> NeighborList:
    """A NeighborList from COO edges grouped by receiver (the MATRIX table built from them);
    ``overflow`` is the search's own, the edge and neighbour slots are checked here."""
    matrix = matrix_shifts = None
    per_atom = jnp.pad(per_atom, (0, n - per_atom.shape[0]))
    if format is NeighborListFormat.MATRIX:
        kk = capacity.max_neighbors
        row_start = jnp.cumsum(per_atom) - per_atom
        safe = jnp.minimum(receivers, n - 1) if n else receivers
        col = jnp.arange(capacity.max_edges) - row_start[safe]
        col = jnp.where(valid & (col < kk), col, kk)  # out of range: dropped
        matrix = jnp.full((n, kk), n, jnp.int32).at[receivers, col].set(senders, mode="drop")
        matrix_shifts = jnp.zeros((n, kk, 3), jnp.int32).at[receivers, col].set(shifts, mode="drop")
    overflow = (
        overflow
        | (n_edges > capacity.max_edges)
        | ((format is NeighborListFormat.MATRIX) & (jnp.max(per_atom, initial=0) > capacity.max_neighbors))
    )
    return NeighborList(senders=senders, receivers=receivers, shifts=shifts, mask=valid, matrix=matrix,
                        matrix_shifts=matrix_shifts, num_neighbors=per_atom, n_edges=n_edges,
                        needed_candidates=jnp.asarray(needed_candidates).astype(jnp.int32),
                        needed_range=jnp.asarray(needed_range).astype(jnp.int32),
                        needed_bins=jnp.asarray(needed_bins).astype(jnp.int32), overflow=overflow)



_build_jit = programs.track(jax.jit(_build, static_argnames=("cutoff", "capacity", "half", "format", "n_receivers",
                                                              "bond_cutoff")))


def local_neighbor_list(positions, batch_idx, atom_mask, *, n_systems: int, cutoff: float,
                        capacity: NeighborCapacity, half: bool = False,
                        format: NeighborListFormat = NeighborListFormat.COO, n_receivers: int | None = None,
                        backend: str = "jnp", order=None, bond_cutoff: float | None = None) -> NeighborList:
    """The neighbour list of atoms with open boundaries (no periodic axis, no cell), as a
    rank builds it over its owned rows and ghost images; traceable under ``jit``.

    Args:
      positions: [n, 3] Å.
      batch_idx: [n] int32 system of each atom.
      atom_mask: [n] bool, False for padding rows.
      n_systems: systems of the batch.
      cutoff: Å.
      capacity, half, format, n_receivers: as in :func:`build_neighbor_list`.
      backend: ``"jnp"`` (the bin search of :func:`build_neighbor_list`, any device) or
        ``"kernel"`` (the compiled cell list of :mod:`jaxdd.ffi.neighbors`: CPU, or CUDA
        GPUs with the CUDA kernels built; much faster, same pairs; only its edge and
        neighbour slots can overflow).
      order: for a half list, the two [n] int32 keys that decide which row of a pair lists
        it (see :func:`build_neighbor_list`).
      bond_cutoff: Å, or None: the bonds of the receiver rows (see :func:`build_neighbor_list`).

    Returns:
      The :class:`~jaxdd.neighbors.NeighborList`, its shifts all zero (``zero_shifts``).
    """
    if backend not in ("kernel", "jnp"):
        raise ValueError(f"backend must be 'kernel' or 'jnp' here, got {backend!r}")
    if backend == "jnp":
        dtype = positions.dtype
        nl = build_neighbor_list(
            positions, jnp.broadcast_to(jnp.eye(3, dtype=dtype), (n_systems, 3, 3)), jnp.zeros((n_systems, 3), bool),
            batch_idx, atom_mask, cutoff=cutoff, capacity=capacity, half=half, format=format, n_receivers=n_receivers,
            order=order, bond_cutoff=bond_cutoff)
        return dataclasses.replace(nl, zero_shifts=True)
    from ..ffi.neighbors import cell_list

    check_cutoff(cutoff)
    format = NeighborListFormat(format)
    bond_cutoff = check_bond_cutoff(bond_cutoff, cutoff, format, half)
    n = positions.shape[0]
    senders, receivers, shifts, per_atom, n_edges = cell_list(
        positions, jnp.asarray(batch_idx, jnp.int32), jnp.asarray(atom_mask, bool), cutoff=float(cutoff),
        max_edges=capacity.max_edges, n_receivers=n_receivers, n_systems=n_systems, half=half, order=order)
    valid = jnp.arange(capacity.max_edges) < n_edges
    zero = jnp.zeros((), jnp.int32)
    nl = _assemble(senders, receivers, shifts, valid, per_atom, n_edges, n, capacity, format, jnp.zeros((), bool),
                   needed_candidates=zero, needed_range=jnp.zeros(3, jnp.int32), needed_bins=zero)
    nl = _with_bonds(nl, positions, jnp.broadcast_to(jnp.eye(3, dtype=positions.dtype), (n_systems, 3, 3)),
                     jnp.asarray(batch_idx, jnp.int32), bond_cutoff, capacity)
    return dataclasses.replace(nl, zero_shifts=True)


def neighbor_list(
    positions, cell, pbc, batch_idx=None, atom_mask=None, *,
    cutoff: float,
    half: bool = False,
    format: NeighborListFormat = NeighborListFormat.COO,
    capacity: NeighborCapacity | None = None,
    max_rebuilds: int = 8,
    bond_cutoff: float | None = None,
) -> tuple[NeighborList, NeighborCapacity]:
    """Build a complete neighbour list from the host: size, build, grow on overflow.

    Args:
      positions, cell, pbc, batch_idx, atom_mask, cutoff, half, format: as in
        :func:`build_neighbor_list` (Å).
      capacity: the capacity to start from (default: sized by
        :func:`~jaxdd.neighbors.neighbor_capacity`).
      max_rebuilds: builds tried before giving up.
      bond_cutoff: Å, or None: the list carries bonds (see :func:`build_neighbor_list`).

    Returns:
      (the list, the capacity it was built with: reuse it to avoid re-jitting).

    Raises:
      RuntimeError: the list still overflowed after ``max_rebuilds`` builds.
    """
    args = (positions, cell, pbc, batch_idx, atom_mask)
    if capacity is None:
        capacity = neighbor_capacity(*args, cutoff=cutoff, half=half, bond_cutoff=bond_cutoff)
    held = {"capacity": capacity}

    def attempt():
        nl = build_neighbor_list(*args, cutoff=cutoff, capacity=held["capacity"], half=half, format=format,
                                 bond_cutoff=bond_cutoff)
        return (nl, held["capacity"]), (nl.stats() if bool(nl.overflow) else None)

    def grow_to(needed):
        held["capacity"] = held["capacity"].grown(needed)

    # max_rebuilds builds in all: the first and max_rebuilds - 1 growths.
    return run_until_fits(attempt, grow_to, max_regrowths=max(int(max_rebuilds) - 1, 0), what="the neighbour list")
