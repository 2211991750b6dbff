"""One rank's neighbour list inside a rank program, and what the ranks' lists needed.

- :func:`rank_neighbors`: the list over a rank's local rows (ghosts included) for its program.
- :func:`neighbor_needs` / :func:`neighbor_stats`: whether any rank's list overflowed, and the
  sizes they needed, agreed over the ranks (on device) and read back as a
  :class:`~jaxdd.neighbors.NeighborStats` (host) for the capacities to grow by.
- :func:`half_list_order`: the keys by which a half list keeps each pair on one rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from ..decomposition.graph_partition import block_neighbor_list, gathered_inputs
from ..neighbors import NeighborStats, build_neighbor_list, local_neighbor_list
from .rank_bonds import owner_reverse

if TYPE_CHECKING:  # annotations only: rank_program imports this module
    from .rank_program import RankProgram

__all__ = ["rank_neighbors", "neighbor_needs", "neighbor_stats", "half_list_order"]


def neighbor_stats(needed: dict) -> NeighborStats:
    """The :class:`~jaxdd.neighbors.NeighborStats` of the sizes ``needed`` that :func:`neighbor_needs` returned."""
    return NeighborStats(
        edges=int(needed["edges"]),
        neighbors=int(needed["neighbors"]),
        candidates=int(needed["candidates"]),
        search_range=tuple(int(x) for x in np.asarray(needed["range"])),
        bins=int(needed["bins"]),
        bonds=int(needed["bonds"]),
    )


def neighbor_needs(nl, axes) -> tuple[jax.Array, dict]:
    """(overflow on any rank [] bool, the sizes the ranks' lists needed), both the same on every rank.

    Args:
      nl: this rank's neighbour list; call inside ``shard_map``.
      axes: the mesh axis names the ranks span.
    """
    needed = dict(
        edges=jax.lax.pmax(nl.n_edges, axes),
        neighbors=jax.lax.pmax(jnp.max(nl.num_neighbors), axes),
        candidates=jax.lax.pmax(nl.needed_candidates, axes),
        range=jax.lax.pmax(nl.needed_range, axes),
        bins=jax.lax.pmax(nl.needed_bins, axes),
        bonds=jax.lax.pmax(jnp.max(nl.bonds.count, initial=0) if nl.bonds is not None else jnp.zeros((), jnp.int32),
                           axes),
    )
    return jax.lax.pmax(nl.overflow.astype(jnp.int32), axes) > 0, needed


def half_list_order(row_ids, row_shifts):
    """The half-list keys of a rank's rows (``order`` of :func:`jaxdd.neighbors.build_neighbor_list`):
    the global atom id, and the image shift packed in one int32 (images within ±512 cells,
    10 bits per axis), so that the rows of one atom's images differ.

    Args:
      row_ids: [n_local] int32 global id of each row. row_shifts: [n_local, 3] int32 image
        shift of each row, in cell vectors (numpy or jax arrays).

    Returns:
      (key a [n_local], key b [n_local]) int32.
    """
    s = row_shifts + 512
    return row_ids, (s[:, 0] << 20) | (s[:, 1] << 10) | s[:, 2]


@jax.named_scope("jaxdd.neighbors")  # a profile tells the search apart (bench/profile_table.py)
def rank_neighbors(positions, local, program: RankProgram, cell=None, routing=None):
    """This rank's neighbour list over its local rows for the model's search cutoff; only owned
    rows are receivers unless the halo is deep. Under the graph-parallel strategy the search
    runs over every rank's rows (gathered here) in the real ``cell`` with the batch's pbc, and
    senders index the stacked rows. A half list keeps each pair on one rank: the edge from the
    row that the parity rule of :func:`jaxdd.neighbors.build_neighbor_list` picks by (global
    id, image shift), which needs this rank's ``routing``.

    Args:
      positions: [n_local, 3] Å local rows, ghosts included.
      local: the rank's local rows as a :class:`~jaxdd.Batch` (batch_idx, atom_mask, pbc).
      program: the rank program (search cutoff, capacity, format, strategy).
      cell: [S, 3, 3] Å; read by the graph-parallel strategy and a periodic search.
      routing: the rank's halo routing (its rows' ids and shifts); read by a half list and by bonds.
    """
    nl = _search(positions, local, program, cell, routing)
    if nl.bonds is not None and not program.deep:
        nl = owner_reverse(nl, routing, program.layout, program.axes)
    return nl


def _search(positions, local, program: RankProgram, cell, routing):
    """The list of :func:`rank_neighbors`, its bonds' reverses as the rank's own rows give them."""
    layout, n_sys = program.layout, program.n_systems
    if program.strategy == "graph_partition":
        all_pos, all_sys, all_mask = gathered_inputs(local, positions, program.axes)
        return block_neighbor_list(
            all_pos, jax.lax.stop_gradient(cell), local.pbc, all_sys, all_mask, jax.lax.axis_index(program.axes),
            layout.n_owned, cutoff=program.search_cutoff, capacity=program.nl_capacity, format=program.nl_format)
    if program.periodic_search:  # periodic along the axes the grid leaves whole, open along the others
        return build_neighbor_list(
            jax.lax.stop_gradient(positions), jax.lax.stop_gradient(cell), local.pbc, local.batch_idx, local.atom_mask,
            cutoff=program.search_cutoff, capacity=program.nl_capacity, format=program.nl_format,
            n_receivers=layout.n_owned, bond_cutoff=program.bond_cutoff)
    order = half_list_order(routing.row_ids, routing.row_shifts) if program.nl_half else None
    return local_neighbor_list(
        jax.lax.stop_gradient(positions), local.batch_idx, local.atom_mask, n_systems=n_sys,
        cutoff=program.search_cutoff, capacity=program.nl_capacity, format=program.nl_format,
        n_receivers=layout.n_local if program.deep else layout.n_owned, backend=program.nl_backend,
        half=program.nl_half, order=order, bond_cutoff=program.bond_cutoff)
