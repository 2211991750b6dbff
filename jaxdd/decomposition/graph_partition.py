"""Graph-parallel strategy: contiguous node blocks, no spatial halo.

``DomainConfig(cutoff, strategy="graph_partition")`` (or a spec with
:class:`~jaxdd.ops.GraphParallelPolicy`, as ``SPEC_MPNN_GP``) splits the atoms of a batch
into one contiguous, balanced block of indices per rank instead of spatial domains:

- rank ``r`` owns the real atoms ``[r * n_block, (r + 1) * n_block)`` of the batch (in batch
  order, padding atoms skipped), so its per-atom arrays hold only those rows;
- the geometry is gathered once per call to build the rank's neighbour list, whose receivers
  are its own block (local rows) and whose senders index *all* ranks' rows stacked in rank
  order (``[P * n_block]``; padding ``P * n_block``);
- a model reading per-atom values through those senders (``h[senders]``) makes the dispatch
  all-gather the values first, once per read, which is the per-layer feature all-gather;
  the backward pass of that all-gather is the reduce-scatter that brings neighbour forces home.

Nothing is exchanged by halo rules: a scatter onto receivers is rank-local, and reductions
over atoms are masked and summed across ranks as in the halo strategy. The plan is the halo
machinery's with an empty ghost shell, so the engine, outputs and validator are shared.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .halo import HaloLayout, HaloPlan, HaloRouting
from ..neighbors import NeighborCapacity, NeighborList, NeighborListFormat, build_neighbor_list, neighbor_capacity
from .partition import Partition

__all__ = ["node_blocks", "block_neighbor_list", "block_capacity", "STRATEGIES"]

STRATEGIES = ("halo", "graph_partition")


def node_blocks(batch_idx, atom_mask, pbc, n_ranks: int) -> tuple[Partition, HaloPlan]:
    """Contiguous balanced blocks of the real atoms, as a plan with no ghost shell.

    Block sizes differ by at most one atom; ``n_block = ceil(n_real / n_ranks)`` rows per
    rank (at least one). The partition's frame fields are unused (``frac`` is zero, no
    wrapping: positions stay as given and the neighbour search handles periodicity).

    Args:
      batch_idx: [V] system of each atom.
      atom_mask: [V] real atoms.
      pbc: [S, 3] bool.
      n_ranks: number of ranks P.

    Returns:
      ``(partition, plan)``: the owner of each atom, and a :class:`HaloPlan` whose ranks
      each hold ``n_block`` owned rows and no ghosts.
    """
    batch_idx = np.asarray(batch_idx)
    atom_mask = np.asarray(atom_mask, bool)
    pbc = np.asarray(pbc, bool).reshape(-1, 3)
    n_sys = pbc.shape[0]
    real = np.nonzero(atom_mask)[0]
    n_block = max(1, math.ceil(real.size / n_ranks))
    # Balanced: the first (n_real mod P) ranks take one atom more than the others.
    base, extra = divmod(real.size, n_ranks)
    sizes = np.array([base + (r < extra) for r in range(n_ranks)], np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    owner = np.full(batch_idx.shape[0], -1, np.int64)
    local_ids = np.full((n_ranks, n_block), -1, np.int64)
    for r in range(n_ranks):
        ids = real[starts[r]:starts[r + 1]]
        owner[ids] = r
        local_ids[r, : ids.size] = ids
    v = batch_idx.shape[0]
    part = Partition(
        grid=(n_ranks, 1, 1),
        owner=owner,
        frac=np.zeros((v, 3)),
        wraps=np.zeros((v, 3), np.int64),
        lo=np.zeros((n_sys, 3)),
        hi=np.ones((n_sys, 3)),
        spacing=np.ones((n_sys, 3)),
        pbc=pbc,
        system=np.clip(batch_idx, 0, n_sys - 1),
    )
    routing = HaloRouting(
        send_idx=np.zeros((n_ranks, 0), np.int32),
        send_valid=np.zeros((n_ranks, 0), bool),
        send_system=np.zeros((n_ranks, 0), np.int32),
        wrap=np.zeros((n_ranks, 0), np.int32),
        row_ids=np.asarray(local_ids, np.int32),
        row_shifts=np.zeros((n_ranks, n_block, 3), np.int32),
    )
    plan = HaloPlan(
        layout=HaloLayout(grid=(n_ranks, 1, 1), n_owned=n_block, exchanges=()),
        routing=routing,
        local_ids=local_ids,
        local_shifts=np.zeros((n_ranks, n_block, 3), np.int64),
        needed_owned=int(sizes.max(initial=0)),
        needed_exchange=(),
        overflow=False,
    )
    return part, plan


def _rolled(x, rank, n_block):
    """Rows of ``x`` ([P * n_block, ...]) starting at ``rank``'s block, so that block comes first."""
    return jnp.roll(x, -rank * n_block, axis=0)


def block_neighbor_list(positions, cell, pbc, batch_idx, atom_mask, rank, n_block: int, *, cutoff: float,
                        capacity: NeighborCapacity, format: NeighborListFormat = NeighborListFormat.COO
                        ) -> NeighborList:
    """The neighbour list of one rank's block, over every rank's rows.

    Receivers are local rows ``[0, n_block)`` (padding ``n_block``); senders and matrix
    entries index the ``P * n_block`` stacked rows (padding ``P * n_block``). Traceable.

    Args:
      positions: [P * n_block, 3] Å, all ranks' rows in rank order.
      cell: [S, 3, 3] Å.
      pbc: [S, 3] bool.
      batch_idx, atom_mask: [P * n_block] system of each row and its real atoms.
      rank: this rank (int or traced).
      n_block: rows per rank.
      cutoff: neighbour cutoff (Å).
      capacity: the list's static sizes (:func:`block_capacity`).
      format: COO edge arrays or a per-atom MATRIX (:class:`NeighborListFormat`).

    Returns:
      The :class:`NeighborList` of the block's receivers.
    """
    n_all = positions.shape[0]
    nl = build_neighbor_list(
        _rolled(positions, rank, n_block), cell, pbc, _rolled(batch_idx, rank, n_block),
        _rolled(atom_mask, rank, n_block), cutoff=cutoff, capacity=capacity, format=format, n_receivers=n_block,
    )
    offset = rank * n_block

    def stacked(i):  # index in the rolled rows → index in the stacked rows
        return jnp.where(i < n_all, (i + offset) % n_all, n_all).astype(jnp.int32)

    matrix = matrix_shifts = None
    if nl.matrix is not None:
        matrix, matrix_shifts = stacked(nl.matrix[:n_block]), nl.matrix_shifts[:n_block]
    return NeighborList(
        senders=stacked(nl.senders),
        receivers=jnp.where(nl.mask, nl.receivers, n_block).astype(jnp.int32),
        shifts=nl.shifts,
        mask=nl.mask,
        matrix=matrix,
        matrix_shifts=matrix_shifts,
        num_neighbors=nl.num_neighbors[:n_block],
        n_edges=nl.n_edges,
        needed_candidates=nl.needed_candidates,
        needed_range=nl.needed_range,
        needed_bins=nl.needed_bins,
        overflow=nl.overflow,
    )


def block_capacity(positions, cell, pbc, batch_idx, atom_mask, n_ranks: int, n_block: int, *, cutoff: float,
                   headroom: float, max_neighbors: int = 1) -> NeighborCapacity:
    """Static neighbour-list sizes that fit every rank's block (host, numpy).

    Args:
      positions, cell, pbc, batch_idx, atom_mask: every rank's rows, as in
        :func:`block_neighbor_list`.
      n_ranks: number of ranks P.
      n_block: rows per rank.
      cutoff: neighbour cutoff (Å).
      headroom: factor over the counts measured now, for the atoms to move.
      max_neighbors: neighbour slots per atom it has at least (MATRIX format).

    Returns:
      A :class:`NeighborCapacity` covering every rank's block.
    """
    caps = [
        neighbor_capacity(np.roll(positions, -r * n_block, axis=0), cell, pbc, np.roll(batch_idx, -r * n_block),
                          np.roll(atom_mask, -r * n_block), cutoff=cutoff, headroom=headroom, n_receivers=n_block)
        for r in range(n_ranks)
    ]
    return NeighborCapacity.covering(caps, max_neighbors)


def gathered_inputs(local, positions, axis_names):
    """(positions, batch_idx, atom_mask) of every rank's rows, stacked in rank order; call
    inside ``shard_map``. Positions leave the differentiated graph: the list is a constant."""
    def all_rows(x):
        return jax.lax.all_gather(x, axis_names, tiled=True)

    return all_rows(jax.lax.stop_gradient(positions)), all_rows(local.batch_idx), all_rows(local.atom_mask)
