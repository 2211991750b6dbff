"""Halo plans, built on the host: for every rank, which atoms it sends to which neighbour so
that afterwards each rank holds every periodic image within ``ghost_width`` of its block.

Plans are built LAMMPS-style: axis by axis (x, then y, then z), in both directions, each stage
forwarding the ghosts received in the stages before it (6 exchanges rather than 26), with
several hops along an axis when the ghost shell is wider than a block, and with periodic
images of a rank's own atoms when the cell is thinner than the shell (or, with
``periodic_search``, with no exchange along an axis the grid leaves whole: the ranks search
its periodic images themselves, as one device does). Bounds are inclusive
and include the receiver's own block, so an atom that sits inside a neighbour's block while
still owned elsewhere reaches that neighbour too. :func:`build_rank_plans` plans chosen ranks
only (one process's); :mod:`jaxdd.decomposition.replan` computes the same plan on the devices.
The plan's layout, routing and exchanges are :mod:`jaxdd.decomposition.halo`'s.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..neighbors.capacity import headroom
from .halo import Exchange, HaloLayout, HaloPlan, HaloRouting
from .partition import Partition, rank_coords, rank_of

__all__ = ["build_halo_plan", "build_rank_plans", "near_block"]


def build_halo_plan(
    part: Partition,
    ghost_width: float,
    *,
    capacity_factor: float = 1.2,
    capacity: tuple[int, tuple[int, ...]] | None = None,
    present: np.ndarray | None = None,
    periodic_search: bool = False,
) -> HaloPlan:
    """Plan the ghost shell of width ``ghost_width`` for a partition, every rank.

    Args:
        part: the partition (owners, blocks, frames).
        ghost_width: Å, the shell each rank holds around its block.
        capacity_factor: headroom on the exact needs when no ``capacity`` is given.
        capacity: (n_owned, per-exchange slots) to reuse (e.g. to keep the same compiled
            program); when any is too small the plan is returned with ``overflow`` set.
            Without it, capacities are the exact needs times ``capacity_factor``.
        present: [S] bool, the systems that have atoms (default: those of ``part``), which
            set the exchanges' hops.
        periodic_search: the ranks find the periodic images along the axes the grid leaves
            whole (one rank along them) themselves, with a neighbour search periodic along
            those axes, as one device searches its cell: no exchange (and no ghost image)
            along them. One rank then holds no ghost rows at all; a grid (1, 1, 2) only the
            shells along z.

    Returns:
        The :class:`~jaxdd.decomposition.halo.HaloPlan` of every rank (``ranks`` None).
    """
    grid = part.grid
    n_ranks = part.n_ranks
    coords = rank_coords(np.arange(n_ranks), grid)  # [P, 3]
    bounds = [part.bounds(r) for r in range(n_ranks)]  # (lo, hi), each [S, 3]
    reach = ghost_width / part.spacing  # [S, 3] ghost width in frame units
    block_width = part.thinnest()  # [S, 3]: the hops must cross the thinnest block
    present = _present(part) if present is None else present

    # What a rank holds: global ids, where each row lives ("origin": (-1, row) for owned
    # atoms, (exchange, slot) for ghosts, resolved to rows once capacities are known),
    # frame coordinates in the rank's frame, and integer lattice shift of the image.
    owned_ids = [np.flatnonzero(part.owner == r) for r in range(n_ranks)]
    needed_owned = max((len(i) for i in owned_ids), default=0)
    held = [
        _held(ids, np.stack([np.full(len(ids), -1), np.arange(len(ids))], 1), part.frac[ids],
              np.zeros((len(ids), 3), np.int64))
        for ids in owned_ids
    ]

    steps = []  # per exchange: (axis, direction, hop, pairs, wraps [P], sends {rank: held-like dict})
    for axis in range(3):
        if periodic_search and grid[axis] == 1:  # the ranks search this axis's images themselves
            continue
        periodic_any = bool(np.any(part.pbc[present, axis]))
        n_axis = grid[axis]
        hops = 1
        if present.any():
            ratio = reach[present, axis] / np.maximum(block_width[present, axis], 1e-300)
            need = np.ceil(np.minimum(ratio, 1e9) - 1e-12)
            # Along an open axis there is nothing past the last rank: at most n_axis - 1 hops,
            # however thin the blocks (atoms all in one plane give blocks of ~zero width).
            need = np.where(part.pbc[present, axis], need, np.minimum(need, n_axis - 1))
            hops = max(1, int(np.max(need)))
        axis_start = held
        arrivals = [[] for _ in range(n_ranks)]
        for direction in (1, -1):
            neighbour = coords[:, axis] + direction
            crosses = (neighbour < 0) | (neighbour >= n_axis)
            wraps = np.where(neighbour >= n_axis, -1, np.where(neighbour < 0, 1, 0))
            pairs = []
            for r in range(n_ranks):
                if crosses[r] and not periodic_any:
                    continue
                c = coords[r].copy()
                c[axis] = neighbour[r] % n_axis
                pairs.append((r, int(rank_of(c, grid))))
            pairs = tuple(pairs)
            if not pairs:
                continue
            previous = axis_start
            for hop in range(1, hops + 1):
                e = len(steps)
                sends, arrived = {}, [_held(*_empty()) for _ in range(n_ranks)]
                for r, dst in pairs:
                    src = previous[r]
                    sys = part.system[src["ids"]]
                    frac = src["frac"].copy()
                    frac[:, axis] += wraps[r]
                    lo, hi = bounds[dst]
                    # Inclusive on both sides: an atom exactly ghost-width from the block (or on
                    # its face) is sent. Sending one atom too many is harmless (the model masks by
                    # distance); missing one that a rounding puts on the bound would lose a pair.
                    sel = (
                        (part.pbc[sys, axis] | (wraps[r] == 0))
                        & (frac[:, axis] >= lo[sys, axis] - reach[sys, axis])
                        & (frac[:, axis] <= hi[sys, axis] + reach[sys, axis])
                    )
                    shift = src["shift"][sel].copy()
                    shift[:, axis] += wraps[r]
                    sends[r] = _held(src["ids"][sel], src["origin"][sel], frac[sel], shift)
                    n_sel = int(sel.sum())
                    arrived[dst] = _held(
                        src["ids"][sel], np.stack([np.full(n_sel, e), np.arange(n_sel)], 1), frac[sel], shift
                    )
                steps.append((axis, direction, hop, pairs, wraps, sends))
                for r in range(n_ranks):
                    arrivals[r].append(arrived[r])
                previous = arrived
        held = [_concat([held[r], *arrivals[r]]) for r in range(n_ranks)]

    needed_exchange = tuple(max((len(v["ids"]) for v in st[5].values()), default=0) for st in steps)
    fresh = tuple(headroom(n, capacity_factor) for n in needed_exchange)
    if capacity is None or len(tuple(capacity[1])) != len(steps):
        # No capacity given, or the exchange structure changed: size afresh.
        n_owned = headroom(needed_owned, capacity_factor) if capacity is None else max(capacity[0], 1)
        caps = fresh
    else:
        n_owned, caps = int(capacity[0]), tuple(int(c) for c in capacity[1])
    overflow = needed_owned > n_owned or any(n > c for n, c in zip(needed_exchange, caps))

    exchanges, offset = [], 0
    for (axis, direction, hop, pairs, _, _), cap in zip(steps, caps):
        exchanges.append(Exchange(axis, direction, hop, pairs, offset, cap))
        offset += cap
    layout = HaloLayout(grid=grid, n_owned=n_owned, exchanges=tuple(exchanges))
    starts = np.array([n_owned + ex.offset for ex in exchanges] + [0], np.int64)

    def rows_of(origin):
        return np.where(origin[:, 0] < 0, origin[:, 1], starts[origin[:, 0]] + origin[:, 1])

    send_idx = np.zeros((n_ranks, offset), np.int32)
    send_valid = np.zeros((n_ranks, offset), bool)
    send_system = np.zeros((n_ranks, offset), np.int32)
    wrap = np.zeros((n_ranks, len(steps)), np.int32)
    local_ids = np.full((n_ranks, layout.n_local), -1, np.int64)
    local_shifts = np.zeros((n_ranks, layout.n_local, 3), np.int64)
    for r in range(n_ranks):
        k = min(len(owned_ids[r]), n_owned)
        local_ids[r, :k] = owned_ids[r][:k]
    for e, (_, _, _, pairs, wraps, sends) in enumerate(steps):
        ex = exchanges[e]
        for r, dst in pairs:
            v = sends[r]
            # Beyond a too-small capacity slots are cut here, but such a plan is flagged
            # (overflow) and rebuilt larger before anything runs on it.
            m = min(len(v["ids"]), ex.capacity)
            ids = v["ids"][:m]
            sl = slice(ex.offset, ex.offset + m)
            send_idx[r, sl] = np.minimum(rows_of(v["origin"][:m]), layout.n_local - 1)
            send_valid[r, sl] = True
            send_system[r, sl] = part.system[ids]
            wrap[r, e] = wraps[r]
            start = n_owned + ex.offset
            local_ids[dst, start : start + m] = ids
            local_shifts[dst, start : start + m] = v["shift"][:m]
    routing = HaloRouting(send_idx=send_idx, send_valid=send_valid, send_system=send_system, wrap=wrap,
                          row_ids=np.asarray(local_ids, np.int32), row_shifts=np.asarray(local_shifts, np.int32))
    return HaloPlan(layout=layout, routing=routing, local_ids=local_ids, local_shifts=local_shifts,
                    needed_owned=needed_owned, needed_exchange=needed_exchange, overflow=bool(overflow))


def near_block(part: Partition, ghost_width: float, rank: int) -> np.ndarray:
    """The atoms with a periodic image near a rank's block, axis by axis in the partition frame.

    Args:
        part: the partition. ghost_width: Å, the shell around the block. rank: the rank.

    Returns:
        [V] bool: True for the atoms with an image within ``ghost_width`` of ``rank``'s block
        (a superset of what the rank can hold).
    """
    lo, hi = part.bounds(rank)
    system = part.system
    slack = 1e-9 + 1e-12 * np.abs(part.frac).max(initial=1.0)
    reach = (ghost_width / part.spacing)[system] + slack
    low, high = lo[system] - reach, hi[system] + reach
    f = part.frac
    periodic = part.pbc[system]
    # An image f + k (k integer) lies in [low, high] on periodic axes; f itself on open ones.
    hit = np.where(periodic, np.ceil(low - f) <= np.floor(high - f), (f >= low) & (f <= high))
    return (part.owner >= 0) & hit.all(axis=1)


def build_rank_plans(part: Partition, ghost_width: float, ranks, *, capacity_factor: float = 1.2,
                     capacity: tuple[int, tuple[int, ...]] | None = None, periodic_search: bool = False) -> HaloPlan:
    """The plan of ``ranks`` only: ``local_ids``, ``local_shifts`` and ``routing`` hold their
    rows, in the order of ``ranks`` (``HaloPlan.ranks``).

    Each rank's rows are those of :func:`build_halo_plan` on the whole partition: the
    exchanges select atoms one at a time and keep the order they are held in, so planning
    with only the atoms near the rank's block (:func:`near_block`) changes nothing the rank
    holds or sends. ``needed_exchange`` is then the most any rank sends that the planned
    ranks see, which equals the whole plan's once maximised over every rank (what several
    processes do, each planning its own ranks, before they agree on capacities).

    Args:
        part: the partition. ghost_width: Å, the shell each rank holds. ranks: distinct ranks
            of the grid, at least one. capacity_factor, capacity, periodic_search: as for
            :func:`build_halo_plan`.

    Returns:
        The :class:`~jaxdd.decomposition.halo.HaloPlan` of those ranks.
    """
    ranks = tuple(int(r) for r in ranks)
    if not ranks or any(not 0 <= r < part.n_ranks for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct ranks of the grid {part.grid} (0 to {part.n_ranks - 1}), "
                         f"at least one; got {ranks}")
    real = part.owner >= 0
    present = _present(part)  # of the whole partition: it sets the hops every rank plans with
    plans = []
    for r in ranks:
        near = dataclasses.replace(part, owner=np.where(near_block(part, ghost_width, r), part.owner, -1))
        plans.append((r, build_halo_plan(near, ghost_width, capacity_factor=capacity_factor, capacity=capacity,
                                         present=present, periodic_search=periodic_search)))
    layouts = {p.layout for _, p in plans}
    if len(layouts) > 1:  # no capacity given: each sized its own; size them alike
        n_owned = max(p.layout.n_owned for _, p in plans)
        caps = tuple(max(c) for c in zip(*(tuple(e.capacity for e in p.layout.exchanges) for _, p in plans)))
        return build_rank_plans(part, ghost_width, ranks, capacity_factor=capacity_factor, capacity=(n_owned, caps),
                                periodic_search=periodic_search)
    needed_owned = int(np.bincount(part.owner[real], minlength=part.n_ranks).max(initial=0))
    needed_exchange = tuple(max(n) for n in zip(*(p.needed_exchange for _, p in plans)))
    layout = plans[0][1].layout
    return HaloPlan(
        layout=layout,
        routing=jax.tree_util.tree_map(lambda *rows: np.stack(rows), *(
            jax.tree_util.tree_map(lambda x, r=r: x[r], p.routing) for r, p in plans)),
        local_ids=np.stack([p.local_ids[r] for r, p in plans]),
        local_shifts=np.stack([p.local_shifts[r] for r, p in plans]),
        needed_owned=needed_owned,
        needed_exchange=needed_exchange,
        overflow=needed_owned > layout.n_owned or any(n > e.capacity for n, e in zip(needed_exchange, layout.exchanges)),
        ranks=tuple(int(r) for r in ranks),
    )


def _present(part: Partition) -> np.ndarray:
    """[S] bool: the systems that have atoms."""
    present = np.zeros(part.lo.shape[0], bool)
    present[np.unique(part.system[part.owner >= 0])] = True
    return present


def _held(ids, origin, frac, shift) -> dict:
    return dict(ids=ids, origin=origin, frac=frac, shift=shift)


def _empty():
    return np.zeros(0, np.int64), np.zeros((0, 2), np.int64), np.zeros((0, 3)), np.zeros((0, 3), np.int64)


def _concat(parts: list[dict]) -> dict:
    return {key: np.concatenate([p[key] for p in parts]) for key in ("ids", "origin", "frac", "shift")}
