"""Halo plans and the two halo exchanges.

A plan says, for every rank, which atoms it sends to which neighbour so that afterwards
each rank holds every periodic image within ``ghost_width`` of its block. Plans are built
LAMMPS-style on the host: axis by axis (x, then y, then z), in both directions, each stage
forwarding the ghosts received in the stages before it (6 exchanges rather than 26), with
several hops along an axis when the ghost shell is wider than a block, and with periodic
images of a rank's own atoms when the cell is thinner than the shell (or, with
``periodic_search``, with no exchange along an axis the grid leaves whole: the ranks search
its periodic images themselves, as one device does). Bounds are inclusive
and include the receiver's own block, so an atom that sits inside a neighbour's block while
still owned elsewhere reaches that neighbour too. :func:`build_rank_plans` plans chosen ranks
only (one process's); :mod:`jaxdd.decomposition.replan` computes the same plan on the devices.

Layout of every per-atom array on a rank: ``[owned (n_owned) | ghosts of exchange 0 |
ghosts of exchange 1 | ...]``, each region of static capacity. The static part of a plan
(:class:`HaloLayout`) is hashable and keys the jit cache; the routing (:class:`HaloRouting`)
is traced, so a new plan with the same capacities does not recompile.

``halo_forward`` copies owner rows into ghost rows; ``halo_reverse`` sums ghost rows back
into their owners. The two are each other's transpose, so ``jax.grad`` through
``halo_forward`` routes ghost forces home.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..neighbors.capacity import headroom
from .partition import Partition, rank_coords, rank_of

__all__ = ["Exchange", "HaloLayout", "HaloRouting", "HaloPlan", "build_halo_plan", "build_rank_plans", "halo_forward",
           "halo_reverse", "near_block"]


@dataclasses.dataclass(frozen=True)
class Exchange:
    """One ppermute: along ``axis`` in ``direction`` (+1/-1), hop ``hop`` (1-based).

    pairs: (source rank, destination rank) of every rank that sends.
    offset: start of this exchange's slots within the send arrays (and, shifted by
    ``n_owned``, of its ghost rows on the receiver). capacity: slots per rank.
    """

    axis: int
    direction: int
    hop: int
    pairs: tuple[tuple[int, int], ...]
    offset: int
    capacity: int


@dataclasses.dataclass(frozen=True)
class HaloLayout:
    """Static shape of a plan: rank grid, owned capacity and the exchanges."""

    grid: tuple[int, int, int]
    n_owned: int
    exchanges: tuple[Exchange, ...]

    @property
    def n_ghost(self) -> int:
        return sum(e.capacity for e in self.exchanges)

    @property
    def n_local(self) -> int:
        """Rows of a per-atom array on a rank: owned + ghost capacity."""
        return self.n_owned + self.n_ghost

    def ghost_rows(self, e: int) -> range:
        """The local rows that receive exchange ``e``'s ghosts."""
        start = self.n_owned + self.exchanges[e].offset
        return range(start, start + self.exchanges[e].capacity)

    def reads(self, e: int) -> range:
        """The local rows exchange ``e`` sends from: hop 1 every row held when its axis
        began (owned rows and the earlier axes' ghosts), a later hop the ghosts of the hop
        before it in the same direction."""
        ex = self.exchanges[e]
        if ex.hop == 1:
            first = next(k for k, x in enumerate(self.exchanges) if x.axis == ex.axis)
            return range(0, self.ghost_rows(first).start)
        return self.ghost_rows(next(k for k, x in enumerate(self.exchanges)
                                    if (x.axis, x.direction, x.hop) == (ex.axis, ex.direction, ex.hop - 1)))

    @functools.cached_property
    def stages(self) -> tuple[tuple[int, ...], ...]:
        """The exchanges grouped into collectives: consecutive exchanges share one
        ``ppermute`` when none sends from another's ghost rows and their pairs together
        still pair each rank with one source and one destination (both directions of an
        axis split in two: every rank's two neighbours are the same rank). Halves the
        collectives of such grids; a rank that sends in only one of them sends zeros."""
        stages: list[list[int]] = []
        for e in range(len(self.exchanges)):
            if stages and self._joins(stages[-1] + [e]):
                stages[-1].append(e)
            else:
                stages.append([e])
        return tuple(tuple(s) for s in stages)

    def _joins(self, stage: list[int]) -> bool:
        """Whether the exchanges of ``stage`` can travel in one collective."""
        for k in stage:
            reads = self.reads(k)
            for other in stage:
                got = self.ghost_rows(other)
                if other != k and len(got) and got.start < reads.stop and reads.start < got.stop:
                    return False
        pairs = self.stage_pairs(tuple(stage))
        srcs, dsts = [a for a, _ in pairs], [b for _, b in pairs]
        return len(set(srcs)) == len(srcs) and len(set(dsts)) == len(dsts)

    def stage_pairs(self, stage: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        """The (source, destination) pairs of a stage's one collective."""
        return tuple(sorted(set().union(*(self.exchanges[k].pairs for k in stage))))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HaloRouting:
    """Traced routing of one rank (leading ``[P]`` axis while on the host).

    send_idx: [n_send] local row sent in each slot. send_valid: [n_send] bool.
    send_system: [n_send] system of the atom in each slot (for its cell's lattice vector).
    wrap: [n_exchanges] lattice vectors (along the exchange's axis) added to positions sent,
    -1, 0 or +1: non-zero where the exchange crosses a periodic boundary.
    row_ids: [n_local] int32 global atom index of every local row (-1: padding);
    row_shifts: [n_local, 3] int32 lattice image of each row relative to its owner's
    position (what tells a pair's two directed edges apart for a half list).
    """

    send_idx: jax.Array
    send_valid: jax.Array
    send_system: jax.Array
    wrap: jax.Array
    row_ids: jax.Array | None = None
    row_shifts: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class HaloPlan:
    """A built plan (host arrays). ``needed`` holds the exact sizes this partition needs.

    local_ids: [P, n_local] global atom index of every local row (-1: padding).
    ranks: the ranks whose rows the arrays hold, in order (None: every rank, 0..P-1).
    local_shifts: [P, n_local, 3] integer lattice shift of each row's image relative to the
    wrapped owner position.
    overflow: True when a capacity given to :func:`build_halo_plan` was too small; the
    arrays are then incomplete and ``needed`` says what would fit.
    """

    layout: HaloLayout
    routing: HaloRouting
    local_ids: np.ndarray
    local_shifts: np.ndarray
    needed_owned: int
    needed_exchange: tuple[int, ...]
    overflow: bool
    ranks: tuple[int, ...] | None = None

    @property
    def n_ranks(self) -> int:
        return self.local_ids.shape[0]

    @property
    def rank_ids(self) -> np.ndarray:
        """The global rank of each row block, [n_ranks]."""
        return np.arange(self.n_ranks) if self.ranks is None else np.asarray(self.ranks)

    def ghost_counts(self) -> np.ndarray:
        """Ghost rows in use per rank, [P]."""
        return (self.local_ids[:, self.layout.n_owned :] >= 0).sum(axis=1)

    def owned_counts(self) -> np.ndarray:
        return (self.local_ids[:, : self.layout.n_owned] >= 0).sum(axis=1)


def build_halo_plan(
    part: Partition,
    ghost_width: float,
    *,
    capacity_factor: float = 1.2,
    capacity: tuple[int, tuple[int, ...]] | None = None,
    present: np.ndarray | None = None,
    periodic_search: bool = False,
) -> HaloPlan:
    """Plan the ghost shell of width ``ghost_width`` (Å) for a partition.

    capacity: (n_owned, per-exchange slots) to reuse (e.g. to keep the same compiled
    program); when any is too small the plan is returned with ``overflow`` set. Without
    it, capacities are the exact needs times ``capacity_factor``. present: [S] bool, the
    systems that have atoms (default: those of ``part``), which set the exchanges' hops.
    periodic_search: the ranks find the periodic images along the axes the grid leaves
    whole (one rank along them) themselves, with a neighbour search periodic along those
    axes, as one device searches its cell: no exchange (and no ghost image) along them. One
    rank then holds no ghost rows at all; a grid (1, 1, 2) only the shells along z.
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
    return HaloPlan(
        layout=layout,
        routing=routing,
        local_ids=local_ids,
        local_shifts=local_shifts,
        needed_owned=needed_owned,
        needed_exchange=needed_exchange,
        overflow=bool(overflow),
    )


def near_block(part: Partition, ghost_width: float, rank: int) -> np.ndarray:
    """[V] bool: the atoms with a periodic image within ``ghost_width`` of ``rank``'s block,
    axis by axis in the partition frame (a superset of what the rank can hold)."""
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
    periodic_search: as for :func:`build_halo_plan`.
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


# --------------------------------------------------------------------------- exchanges


def halo_forward(x, layout: HaloLayout, routing: HaloRouting, axis_name, cell=None):
    """Owner rows → ghost rows. Call inside ``shard_map``; ``routing`` is this rank's.

    x: [n_owned, *F] owned rows. Returns [n_local, *F] with every ghost row a copy of its
    owner's row; when ``cell`` ([S, 3, 3]) is given, x are positions and each ghost gets its
    image's lattice shift. Padding rows are zero.
    """
    # Rows are concatenated, not written into a buffer: a caller that reads only the owned
    # rows (a slice of the concatenation) then leaves every exchange unused, and XLA drops it.
    # A stage's exchanges read only rows received before it, so they are sent together.
    parts = [x]
    for stage in layout.stages:
        held = jnp.concatenate(parts)
        # One gather for the stage's sends (they read owned rows and earlier ghosts): its
        # transpose is then one scatter-add, which XLA does in place (an add per exchange
        # would copy the whole buffer before each).
        gathered = held[_stage_rows(routing.send_idx, layout, stage)]
        sends = []
        for e, vals in zip(stage, _stage_split(gathered, layout, stage)):
            ex = layout.exchanges[e]
            sl = slice(ex.offset, ex.offset + ex.capacity)
            if cell is not None:
                lattice = cell[routing.send_system[sl], ex.axis]  # [cap, 3]
                vals = vals + routing.wrap[e].astype(x.dtype) * lattice
            valid = routing.send_valid[sl].reshape((-1,) + (1,) * (x.ndim - 1))
            sends.append(jnp.where(valid, vals, 0))
        parts.extend(_stage_exchange(sends, axis_name, layout.stage_pairs(stage)))
    return jnp.concatenate(parts)


def _stage_rows(rows, layout: HaloLayout, stage) -> jax.Array:
    """The stage's slots of a per-slot routing array (e.g. ``send_idx``), exchange after exchange."""
    parts = [rows[layout.exchanges[e].offset:layout.exchanges[e].offset + layout.exchanges[e].capacity] for e in stage]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _stage_split(values, layout: HaloLayout, stage) -> list:
    """``values`` of the stage's slots (as :func:`_stage_rows` orders them) cut per exchange."""
    if len(stage) == 1:
        return [values]
    return jnp.split(values, np.cumsum([layout.exchanges[e].capacity for e in stage])[:-1])


def _stage_exchange(sends: list, axis_name, pairs) -> list:
    """One collective for a stage's sends (a list of [cap_e, ...]); the received blocks."""
    if len(sends) == 1:
        return [_exchange(sends[0], axis_name, pairs)]
    got = _exchange(jnp.concatenate(sends), axis_name, pairs)
    cuts = np.cumsum([v.shape[0] for v in sends])[:-1]
    return jnp.split(got, cuts)


def _exchange(x, axis_name, pairs):
    """``ppermute`` along ``pairs``; an exchange every rank makes with itself (periodic
    images along an axis the grid does not split) is a copy, with no collective. A rank
    that sends nothing sends zeros (its slots are invalid), as ppermute gives it."""
    if all(src == dst for src, dst in pairs):
        return x
    return jax.lax.ppermute(x, axis_name, perm=pairs)


def halo_reverse(y, layout: HaloLayout, routing: HaloRouting, axis_name, combine: str = "add"):
    """Ghost rows → owners: each ghost row is added to its owner's row (the transpose of
    :func:`halo_forward` without lattice shifts). y: [n_local, *F]; returns [n_owned, *F].

    combine: ``"add"`` (partial sums), or ``"max"`` / ``"min"`` (partial extrema: the owner
    keeps the largest / smallest of its row and its ghosts' rows).
    """
    if combine not in ("add", "max", "min"):
        raise ValueError(f"halo_reverse: combine must be 'add', 'max' or 'min', got {combine!r}")
    if combine == "add":
        fill = jnp.zeros((), y.dtype)
    elif jnp.issubdtype(y.dtype, jnp.floating):
        fill = jnp.array(-jnp.inf if combine == "max" else jnp.inf, y.dtype)
    else:
        info = jnp.iinfo(y.dtype)
        fill = jnp.array(info.min if combine == "max" else info.max, y.dtype)
    buf = y
    for stage in reversed(layout.stages):
        # The stage's ghost blocks go back together; none of its adds lands in another's block.
        blocks = [buf[layout.ghost_rows(e).start:layout.ghost_rows(e).stop] for e in stage]
        backs = _stage_exchange(blocks, axis_name, tuple((dst, src) for src, dst in layout.stage_pairs(stage)))
        # One scatter-add for the stage (in place; see halo_forward), exchange after exchange.
        back = backs[0] if len(backs) == 1 else jnp.concatenate(backs)
        valid = _stage_rows(routing.send_valid, layout, stage).reshape((-1,) + (1,) * (y.ndim - 1))
        into = buf.at[_stage_rows(routing.send_idx, layout, stage)]
        buf = getattr(into, combine)(jnp.where(valid, back, fill))
    return buf[: layout.n_owned]
