"""The halo: its layout on a rank, its routing, a built plan, and the two exchanges.

Layout of every per-atom array on a rank: ``[owned (n_owned) | ghosts of exchange 0 |
ghosts of exchange 1 | ...]``, each region of static capacity. The static part of a plan
(:class:`HaloLayout`) is hashable and keys the jit cache; the routing (:class:`HaloRouting`)
is traced, so a new plan with the same capacities does not recompile. A :class:`HaloPlan`
holds both, as host arrays, for every rank; :mod:`jaxdd.decomposition.halo_plan` builds it on
the host and :mod:`jaxdd.decomposition.replan` computes the same routing on the devices.

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

__all__ = ["Exchange", "HaloLayout", "HaloRouting", "HaloPlan", "halo_forward", "halo_reverse"]


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
        """Ghost rows of a per-atom array on a rank: the exchanges' capacities summed."""
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
    overflow: True when a capacity given to
    :func:`~jaxdd.decomposition.halo_plan.build_halo_plan` was too small; the arrays are then
    incomplete and ``needed`` says what would fit.
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
        """Row blocks the arrays hold: the planned ranks."""
        return self.local_ids.shape[0]

    @property
    def rank_ids(self) -> np.ndarray:
        """The global rank of each row block, [n_ranks]."""
        return np.arange(self.n_ranks) if self.ranks is None else np.asarray(self.ranks)

    def ghost_counts(self) -> np.ndarray:
        """Ghost rows in use per rank, [P]."""
        return (self.local_ids[:, self.layout.n_owned :] >= 0).sum(axis=1)

    def owned_counts(self) -> np.ndarray:
        """Owned rows in use per rank, [P]."""
        return (self.local_ids[:, : self.layout.n_owned] >= 0).sum(axis=1)


# --------------------------------------------------------------------------- exchanges


@jax.named_scope("jaxdd.halo")  # a profile tells the exchanges apart (bench/profile_table.py)
def halo_forward(x, layout: HaloLayout, routing: HaloRouting, axis_name, cell=None):
    """Owner rows → ghost rows. Call inside ``shard_map``.

    Args:
        x: [n_owned, *F] owned rows (positions in Å when ``cell`` is given).
        layout: the plan's static layout. routing: this rank's routing.
        axis_name: the mesh axis (or axes) the ranks run along.
        cell: [S, 3, 3] Å, lattice vectors per system; when given, each ghost gets its
            image's lattice shift.

    Returns:
        [n_local, *F]: the owned rows, then every ghost row a copy of its owner's row.
        Padding rows are zero.
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


@jax.named_scope("jaxdd.halo")
def halo_reverse(y, layout: HaloLayout, routing: HaloRouting, axis_name, combine: str = "add"):
    """Ghost rows → owners: each ghost row is added to its owner's row (the transpose of
    :func:`halo_forward` without lattice shifts). Call inside ``shard_map``.

    Args:
        y: [n_local, *F] rows of a rank, ghost rows holding partial values.
        layout: the plan's static layout. routing: this rank's routing.
        axis_name: the mesh axis (or axes) the ranks run along.
        combine: ``"add"`` (partial sums), or ``"max"`` / ``"min"`` (partial extrema: the
            owner keeps the largest / smallest of its row and its ghosts' rows).

    Returns:
        [n_owned, *F]: each owned row combined with its ghosts' rows.
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
