"""The host work of a ``DistributedModel`` call: partition, halo plan, every rank's rows, and
the neighbour capacity those rows need.

Each function takes the :class:`~jaxdd.DistributedModel` whose settings (grid, ghost width,
strategy, spec) and capacities (:class:`~jaxdd.engine.rank_program.Sizing`) it plans with;
the model's methods of the same names call them.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING

import jax
import numpy as np

from ..data import Batch
from ..decomposition.graph_partition import block_capacity, node_blocks
from ..decomposition.halo import HaloPlan
from ..decomposition.halo_plan import build_halo_plan, build_rank_plans
from ..decomposition.partition import Partition, partition
from ..decomposition.ranks import agree_max, own_ranks
from ..model.protocol import bucketed_atoms, model_config
from ..neighbors import NeighborCapacity, neighbor_capacity
from ..neighbors.capacity import headroom as with_headroom
from .health import covers_every_atom, owned_and_ghosts
from .rank_neighbors import half_list_order
from .rank_program import Needs, RankInputs

if TYPE_CHECKING:  # annotations only: distributed imports this module
    from .distributed import DistributedModel

__all__ = ["plan", "search_pbc", "rank_inputs", "size_neighbors"]


def plan(dm: DistributedModel, batch: Batch, grid=None, *, bucketed: bool = False, cuts=None,
         weights=None) -> tuple[Partition, HaloPlan]:
    """Partition ``batch`` and plan its halo, the capacities growing if the plan needs more.

    Args:
      dm: the model planned for. batch: the atoms.
      grid: the rank grid (default ``DomainConfig.grid``, else the least-surface one).
      bucketed: round the owned rows and exchange slots up to capacity buckets
        (:func:`~jaxdd.neighbors.capacity_bucket`), as calls of the model do (halo strategy
        only: node blocks keep their exact size).
      cuts: relative block boundaries to keep ([S, 3, max(grid) + 1],
        :mod:`jaxdd.decomposition.partition`); None: equal slices, or balanced ones when
        ``DomainConfig.balance`` is set, by atoms or by ``weights`` [V] (a cost per atom).

    Returns:
      (partition, halo plan).
    """
    cfg, sizing = dm.config, dm.sizing
    if dm.strategy == "graph_partition":
        # Node blocks keep their exact size: padded block rows gave wrong NequIP energies on
        # molecules over 8 ranks (tests/decomposition/test_graph_parallel.py, slow set).
        part, halo_plan = node_blocks(batch.batch_idx, batch.atom_mask, batch.pbc, cfg.n_ranks)
        sizing.adopt_layout(halo_plan.layout)
        return part, halo_plan
    part = partition(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                     cfg.n_ranks, grid=grid if grid is not None else cfg.grid, cuts=cuts,
                     balance=cuts is None and cfg.balance is not None, weights=weights)
    # With several processes each plans only the ranks on its own devices; they agree on
    # the capacities (maxima of a few integers) so that every rank runs one program shape.
    ranks = own_ranks(cfg.mesh)
    first = None  # no capacities yet: the plan sizes them (agreed over processes)
    if ranks is not None and sizing.capacities is None:
        needs = build_rank_plans(part, dm.ghost_width, ranks, capacity_factor=dm.capacity_factor,
                                 periodic_search=dm.periodic_search)
        needs = agree_max([needs.needed_owned, *needs.needed_exchange])
        first = (with_headroom(needs[0], dm.capacity_factor),
                 tuple(with_headroom(n, dm.capacity_factor) for n in needs[1:]))

    def attempt(capacities):
        halo_plan = _plan_ranks(dm, part, ranks, first if capacities is None else capacities.halo)
        if not halo_plan.overflow:
            return halo_plan, None
        sizing.adopt_layout(halo_plan.layout)  # the sizes it was planned with grow to what it needs
        return halo_plan, Needs(owned=halo_plan.needed_owned, exchange=halo_plan.needed_exchange)

    halo_plan = sizing.run_until_fits(attempt, what="the halo plan")
    if bucketed:
        want = sizing.bucketed_halo(halo_plan.layout)
        if want != (halo_plan.layout.n_owned, tuple(e.capacity for e in halo_plan.layout.exchanges)):
            halo_plan = _plan_ranks(dm, part, ranks, want)
    sizing.adopt_layout(halo_plan.layout)
    _check_degenerate(dm, part, halo_plan)
    return part, halo_plan


def rank_inputs(dm: DistributedModel, batch: Batch, part: Partition, plan: HaloPlan) -> tuple[RankInputs, np.ndarray]:
    """The rows every rank reads for ``batch`` under ``plan``, on the host.

    Args:
      dm: the model planned for. batch: the atoms. part, plan: their partition and halo plan.

    Returns:
      (inputs, local_positions): a :class:`~jaxdd.engine.rank_program.RankInputs` of host arrays
      (``program`` unset; place it with :meth:`RankInputs.place`) and every rank's local
      rows' positions ``[P, n_local, 3]`` Å, ghost images included (to size neighbour lists).
    """
    n_owned = plan.layout.n_owned
    ids = plan.local_ids  # [P, n_local]
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    n_sys = batch.n_systems
    cell = np.asarray(batch.cell)
    positions = np.asarray(batch.positions, np.float64)
    wrapped = positions - np.einsum("vi,vij->vj", part.wraps, cell[part.system])
    own_ids = ids[:, :n_owned]
    own_valid = own_ids >= 0
    dtype = batch.positions.dtype
    own_pos = np.where(own_valid[..., None], wrapped[np.where(own_valid, own_ids, 0)], 0.0)
    own_sys = np.where(own_valid, part.system[np.where(own_valid, own_ids, 0)], 0)
    bidx = np.where(valid, np.asarray(batch.batch_idx)[safe], n_sys)
    owned_rows = valid & (np.arange(ids.shape[1]) < n_owned)[None, :]
    # ptr holds what it holds on one device, every system's atom count (a total, as the
    # dispatch treats it): a per-system normaliser read from it is right on every rank.
    real = np.asarray(batch.batch_idx)[np.asarray(batch.atom_mask, bool)]
    counts = np.broadcast_to(np.bincount(real, minlength=n_sys)[:n_sys], (len(ids), n_sys))
    ptr = np.concatenate([np.zeros((len(ids), 1), np.int64), np.cumsum(counts, axis=1)], axis=1)

    carried = set(dm.spec.distribution.shard_fields)  # the per-atom fields the spec sends to ranks

    def rows(field, fill):
        x = getattr(batch, field)
        if x is None or field not in carried:
            return None
        x = np.asarray(x)
        return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[safe], fill)

    local = Batch.unchecked(
        positions=np.zeros(ids.shape + (3,), dtype),  # filled by halo_forward on device
        atomic_numbers=rows("atomic_numbers", 0).astype(np.int32),
        cell=np.broadcast_to(cell, (len(ids),) + cell.shape),
        pbc=np.broadcast_to(search_pbc(dm, batch.pbc, part.grid), (len(ids), n_sys, 3)),
        batch_idx=bidx.astype(np.int32),
        ptr=ptr.astype(np.int32),
        atom_mask=valid,
        system_mask=np.broadcast_to(np.asarray(batch.system_mask), (len(ids), n_sys)),
        charges=rows("charges", 0.0),
        masses=rows("masses", 1.0),
        velocities=rows("velocities", 0.0),
    )
    # Where each global atom's owned row lands in the flattened [P * n_owned] outputs: its
    # owner's block, at its place among that owner's atoms in id order (the plan's order).
    # Rows up to the atom count's capacity bucket (cut off again on the host), so that the
    # program does not depend on the exact atom count.
    gather = np.full(bucketed_atoms(batch), part.n_ranks * n_owned)  # padding atoms → a zero row
    real = np.flatnonzero(part.owner >= 0)
    by_owner = real[np.argsort(part.owner[real], kind="stable")]
    first = np.searchsorted(part.owner[by_owner], part.owner[by_owner])
    gather[by_owner] = part.owner[by_owner] * n_owned + (np.arange(len(by_owner)) - first)
    inputs = RankInputs(
        local=jax.tree_util.tree_map(np.asarray, local),
        own_pos=np.asarray(own_pos, dtype),
        own_sys=np.asarray(own_sys, np.int32),
        owned_rows=np.asarray(owned_rows),
        routing=jax.tree_util.tree_map(np.asarray, plan.routing),
        cell=np.asarray(cell, dtype),
        system_mask=np.asarray(batch.system_mask),
        gather=np.asarray(gather, np.int32),
        n_atoms=batch.n_atoms,
    )
    local_positions = wrapped[safe] + np.einsum("pli,plij->plj", plan.local_shifts, cell[part.system[safe]])
    return inputs, local_positions

def size_neighbors(dm: DistributedModel, inputs: RankInputs, local_positions: np.ndarray,
                   headroom: float | None = None) -> NeighborCapacity:
    """The neighbour-list capacity every rank's list needs for these rows, with headroom.

    Args:
      dm: the model sized for.
      inputs, local_positions: as :func:`rank_inputs` returns them (host arrays).
      headroom: factor over the exact needs (default: the capacity factor).
    """
    headroom = dm.capacity_factor if headroom is None else headroom
    pos = np.asarray(local_positions)
    local = inputs.local
    n_owned = inputs.own_pos.shape[1]
    nc = model_config(dm.model).neighbor_config
    if dm.strategy == "graph_partition":
        n_ranks = pos.shape[0]
        return block_capacity(
            pos.reshape(-1, 3), np.asarray(inputs.cell), np.asarray(local.pbc[0]),
            np.asarray(local.batch_idx).reshape(-1), np.asarray(local.atom_mask).reshape(-1), n_ranks, n_owned,
            cutoff=nc.search_cutoff, headroom=headroom, max_neighbors=nc.max_neighbors or 1)
    if dm.periodic_search:  # sized as the ranks search: periodic along their local pbc, in the cell
        caps = [neighbor_capacity(pos[r], np.asarray(inputs.cell), np.asarray(local.pbc[r]),
                                  np.asarray(local.batch_idx[r]), np.asarray(local.atom_mask[r]),
                                  cutoff=nc.search_cutoff, headroom=headroom, n_receivers=n_owned,
                                  bond_cutoff=nc.bond_search_cutoff)
                for r in range(pos.shape[0])]
        if len(caps) == 1:
            return caps[0]  # one rank: sized exactly as on one device
    else:
        # Systems sized apart, as the ranks search them: a batch of molecules that overlap in
        # space (each in its own box) would otherwise count each other as neighbours.
        n_sys = int(local.cell.shape[1])
        # A half list is counted with the ranks' keys: the pairs a rank shares with its
        # ghosts split between the two ranks (by rows, it would count all of them).
        routing = inputs.routing
        caps = [
            neighbor_capacity(pos[r], np.broadcast_to(np.eye(3), (n_sys, 3, 3)), np.zeros((n_sys, 3), bool),
                              np.asarray(local.batch_idx[r]), np.asarray(local.atom_mask[r]),
                              cutoff=nc.search_cutoff, headroom=headroom, half=nc.half_list,
                              n_receivers=pos.shape[1] if dm.deep_halo else n_owned,
                              order=half_list_order(np.asarray(routing.row_ids[r]),
                                                    np.asarray(routing.row_shifts[r])) if nc.half_list else None,
                              bond_cutoff=nc.bond_search_cutoff)
            for r in range(pos.shape[0])
        ]
    cover = NeighborCapacity.covering(caps, nc.max_neighbors or 1)
    if nc.bond_cutoff is not None:
        cover = dataclasses.replace(cover, max_bonds=max(cover.max_bonds, nc.max_bonds or 1))
    if jax.process_count() == 1:
        return cover
    # Each process sized its own ranks; every rank needs the largest.
    sizes = agree_max([cover.max_edges, cover.max_neighbors, cover.max_candidates, *cover.search_range,
                       -1 if cover.max_bins is None else cover.max_bins, cover.max_bonds])
    return dataclasses.replace(cover, max_edges=int(sizes[0]), max_neighbors=int(sizes[1]),
                               max_candidates=int(sizes[2]), search_range=tuple(int(x) for x in sizes[3:6]),
                               max_bins=None if cover.max_bins is None else int(sizes[6]), max_bonds=int(sizes[7]))


def search_pbc(dm: DistributedModel, pbc, grid) -> np.ndarray:
    """The periodic axes of the ranks' neighbour search, [S, 3] bool, for a batch's ``pbc``
    ([S, 3]) split by ``grid``: none where ghost rows are the periodic images; the batch's
    own along the axes the grid leaves whole when the ranks search those images themselves
    (``dm.periodic_search``); all of them for node blocks, which search the whole cell."""
    pbc = np.asarray(pbc, bool)
    if dm.strategy == "graph_partition":
        return pbc
    if not dm.periodic_search:
        return np.zeros_like(pbc)
    return pbc & (np.asarray(grid) == 1)


def _plan_ranks(dm: DistributedModel, part: Partition, ranks, capacity) -> HaloPlan:
    """The plan of ``ranks`` (None: all) with ``capacity``; with several processes its
    needs are agreed over all of them."""
    if ranks is None:
        # A single rank owns every atom whatever they do: no headroom for imbalance.
        factor = 1.0 if dm.periodic_search and part.n_ranks == 1 else dm.capacity_factor
        return build_halo_plan(part, dm.ghost_width, capacity_factor=factor, capacity=capacity,
                               periodic_search=dm.periodic_search)
    halo_plan = build_rank_plans(part, dm.ghost_width, ranks, capacity_factor=dm.capacity_factor, capacity=capacity,
                                 periodic_search=dm.periodic_search)
    needs = agree_max([halo_plan.needed_owned, *halo_plan.needed_exchange])
    layout = halo_plan.layout
    overflow = needs[0] > layout.n_owned or any(n > e.capacity for n, e in zip(needs[1:], layout.exchanges))
    return dataclasses.replace(halo_plan, needed_owned=int(needs[0]),
                               needed_exchange=tuple(int(n) for n in needs[1:]), overflow=bool(overflow))


def _check_degenerate(dm: DistributedModel, part: Partition, halo_plan: HaloPlan) -> None:
    """Warn (or refuse, ``DomainConfig.require_nondegenerate``) when a ghost shell holds every atom."""
    if dm.strategy == "graph_partition":
        return  # no ghost shell to degenerate
    if covers_every_atom(part, halo_plan):
        owned, ghosts = owned_and_ghosts(halo_plan)
        r = int(np.argmax(owned + ghosts))
        msg = (
            f"the ghost shell of some ranks covers every atom (grid {part.grid}, ghost width "
            f"{dm.ghost_width} Å; the busiest rank holds {int(ghosts[r])} ghost rows for {int(owned[r])} owned "
            "atoms): decomposition gains nothing here; use fewer ranks or a larger system"
        )
        if dm.config.require_nondegenerate:
            raise ValueError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)
