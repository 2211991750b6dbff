"""Plan rebuilds on the devices: atoms migrate to their new owners and each rank plans its
own halo, so a rebuild never gathers the system on a host.

:func:`rank_replan` runs inside ``shard_map`` on one rank's owned rows. It

1. wraps positions into the cell on periodic axes (keeping the lattice image each atom
   left, so trajectories stay continuous);
2. finds every atom's new block (open axes span the atoms' extent, agreed with
   ``pmin``/``pmax``) and sends the atoms that left over ``ppermute``, axis by axis, one
   block per axis as LAMMPS does (an atom further away is reported, not dropped);
3. sorts the owned rows by global id, as the host partition does;
4. selects the ghosts of every exchange of the plan's :class:`~jaxdd.decomposition.halo.HaloLayout` from
   what the rank holds, exactly as :func:`jaxdd.decomposition.halo_plan.build_halo_plan` does on the host
   (the same bounds, stages and row order), and routes them.

Capacities are static: when the atoms no longer fit (owned rows, migration slots or an
exchange's slots) or the blocks have become thinner than the plan has hops for, the result
says so and the caller grows the capacities (a new program) or plans on the host. The
input state is never modified, so a refused rebuild can be repeated with larger shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..neighbors import effective_cell
from ..data.periodic import wrap_fractional
from .halo import HaloLayout, HaloRouting
from .partition import rank_coords, rank_of
from .ranks import on_ranks

__all__ = ["Frame", "ReplanConfig", "frame_of", "hops_per_axis", "rank_replan", "replan"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Frame:
    """The partition frame of a batch (replicated arrays; see :mod:`jaxdd.decomposition.partition`).

    cell: [S, 3, 3] Å. inv: [S, 3, 3] positions (Å) → frame coordinates (fractions on
    periodic axes, Å along the effective cell's unit vectors on open ones). pbc: [S, 3].
    reach: [S, 3] the ghost width in frame units. cuts: [S, 3, max(grid) + 1] relative
    block boundaries of a balanced partition (:func:`jaxdd.decomposition.partition.balanced_cuts`),
    or None for equal slices.
    """

    cell: jax.Array
    inv: jax.Array
    pbc: jax.Array
    reach: jax.Array
    cuts: jax.Array | None = None


def frame_of(cell, pbc, ghost_width: float, dtype, cuts=None) -> Frame:
    """The :class:`Frame` of a batch, computed on the host as :func:`jaxdd.decomposition.partition.partition` does.

    Args:
      cell: [S, 3, 3] Å.
      pbc: [S, 3] bool.
      ghost_width: the halo's width (Å).
      dtype: of the frame's arrays (the positions' dtype).
      cuts: [S, 3, max(grid) + 1] a balanced partition's relative block boundaries; None:
        equal slices.
    """
    cell = np.asarray(cell, np.float64).reshape(-1, 3, 3)
    pbc = np.asarray(pbc, bool).reshape(-1, 3)
    ceff = np.where(pbc[:, :, None], cell, np.asarray(effective_cell(cell, pbc), np.float64))
    inv = np.linalg.inv(ceff)
    spacing = 1.0 / np.linalg.norm(inv, axis=1)
    return Frame(cell=np.asarray(cell, dtype), inv=np.asarray(inv, dtype), pbc=pbc,
                 reach=np.asarray(ghost_width / spacing, dtype),
                 cuts=None if cuts is None else np.asarray(cuts, dtype))


@dataclasses.dataclass(frozen=True)
class ReplanConfig:
    """The static shape of a device rebuild (hashable).

    layout: the halo layout to plan into (its exchanges, hops and capacities). n_migrate:
    slots per direction for atoms changing rank along one axis. axes: the mesh axis names.
    """

    layout: HaloLayout
    n_migrate: int
    n_systems: int
    axes: tuple[str, ...]


def hops_per_axis(layout: HaloLayout) -> tuple[int, int, int]:
    """Hops the layout's exchanges make along each axis (0: no exchange on that axis)."""
    hops = [0, 0, 0]
    for ex in layout.exchanges:
        hops[ex.axis] = max(hops[ex.axis], ex.hop)
    return tuple(hops)


def rank_replan(owned: dict, frame: Frame, cfg: ReplanConfig):
    """Migrate and plan one rank; call inside ``shard_map``.

    Args:
      owned: this rank's rows ``[n, ...]`` with n ≤ ``layout.n_owned``: ``positions`` [n, 3] Å,
        ``ids`` [n] int32 global atom index (-1 on free rows), ``system`` [n] int32, ``image``
        [n, 3] int32 lattice vectors removed so far, and any other per-atom arrays
        (velocities, masses, ...), which travel with their atoms.
      frame: the batch's partition frame (:func:`frame_of`), replicated.
      cfg: the rebuild's static shape.

    Returns:
      ``(owned, routing, rows, report)``: ``owned`` the new rows ``[n_owned, ...]``
      (wrapped, migrated, sorted by id); ``routing`` this rank's :class:`HaloRouting`;
      ``rows`` the plan's local rows (``ids`` [n_local] -1 on free rows, ``system``
      [n_local]); ``report`` replicated sizes the ranks needed (``owned``, ``migrate``,
      ``exchange`` [n_exchanges]), ``far`` (an atom moved more than one block along an axis),
      ``hops`` (blocks became thinner than the plan's hops cover) and ``migrated`` (atoms
      that changed rank). Whenever a need exceeds its capacity the returned plan is
      incomplete and must not be used.
    """
    layout, axes = cfg.layout, cfg.axes
    grid = layout.grid
    n_ranks = int(np.prod(grid))
    n_owned, n_sys = layout.n_owned, cfg.n_systems
    host_coords = rank_coords(np.arange(n_ranks), grid)  # [P, 3], for the static exchange tables
    coords = jnp.asarray(host_coords, jnp.int32)
    rank = jax.lax.axis_index(axes)
    me = coords[rank]
    grid_a = jnp.asarray(grid)
    wide = jnp.promote_types(frame.inv.dtype, owned["positions"].dtype)
    inv, cell, reach = (jnp.asarray(a, wide) for a in (frame.inv, frame.cell, frame.reach))
    pbc = jnp.asarray(frame.pbc)

    rows = {k: _pad(v, n_owned, -1 if k == "ids" else 0) for k, v in owned.items()}
    valid = rows["ids"] >= 0
    sys = jnp.where(valid, rows["system"], 0)

    # 1. Wrap on periodic axes (the host partition's arithmetic).
    pos = rows["positions"].astype(wide)
    frac = jnp.einsum("vi,vij->vj", pos, inv[sys])
    periodic = pbc[sys] & valid[:, None]
    frac, w = wrap_fractional(frac, periodic)
    rows["positions"] = (pos - jnp.einsum("vi,vij->vj", w, cell[sys])).astype(owned["positions"].dtype)
    rows["image"] = rows["image"] + w.astype(rows["image"].dtype)

    # 2. Blocks: open axes span the atoms' extent over all ranks.
    seg = jnp.where(valid, sys, n_sys)
    fmin = jax.lax.pmin(jax.ops.segment_min(jnp.where(valid[:, None], frac, jnp.inf), seg, n_sys + 1)[:n_sys], axes)
    fmax = jax.lax.pmax(jax.ops.segment_max(jnp.where(valid[:, None], frac, -jnp.inf), seg, n_sys + 1)[:n_sys], axes)
    present = jnp.isfinite(fmin[:, 0])  # [S] systems with atoms
    pad = jnp.maximum(1e-9 * jnp.maximum(jnp.abs(fmax), 1.0), 1e-9)
    lo = jnp.where(pbc | ~present[:, None], 0.0, fmin)
    hi = jnp.where(pbc | ~present[:, None], 1.0, fmax + pad)
    # The host partition's block rule (partition.block_of): a boundary belongs to the block
    # above it; clipped. Equal slices of width w, or the balanced cuts' edges.
    g_max = max(grid)
    if frame.cuts is None:
        width = (hi - lo) / grid_a
        block = jnp.clip(jnp.floor((frac - lo[sys]) / width[sys]), 0, grid_a - 1).astype(jnp.int32)
    else:
        edges = lo[..., None] + jnp.asarray(frame.cuts, wide) * (hi - lo)[..., None]  # [S, 3, G + 1]
        k = np.arange(g_max + 1)[None, :]
        interior = jnp.asarray((k >= 1) & (k < np.asarray(grid)[:, None]))  # [3, G + 1]
        block = jnp.sum(interior & (frac[:, :, None] >= edges[sys]), axis=2)
        block = jnp.clip(block, 0, grid_a - 1).astype(jnp.int32)
        real = jnp.asarray(k[:, :-1] < np.asarray(grid)[:, None])  # [3, G]
        width = jnp.min(jnp.where(real, jnp.diff(edges, axis=2), jnp.inf), axis=2)  # the thinnest block
    rows["_frac"], rows["_block"] = frac, block
    rows["_from"] = jnp.full(valid.shape, rank, jnp.int32)

    # The plan's hops must still span the ghost width (blocks of open axes change size).
    ratio = reach / jnp.maximum(width, 1e-300)
    need = jnp.ceil(jnp.minimum(ratio, 1e9) - 1e-12)
    need = jnp.where(pbc, need, jnp.minimum(need, grid_a - 1))
    need = jnp.max(jnp.where(present[:, None], need, 1.0), axis=0)
    planned = jnp.asarray(hops_per_axis(layout))
    hops_short = jnp.any((planned > 0) & (need > planned))

    # 3. Migration, axis by axis, one block at a time.
    far = jnp.zeros((), bool)
    need_migrate = jnp.zeros((), jnp.int32)
    need_owned = jnp.sum(valid.astype(jnp.int32))
    for axis in range(3):
        n = grid[axis]
        if n == 1:
            continue
        v = rows["ids"] >= 0
        d = rows["_block"][:, axis] - me[axis]
        per = pbc[jnp.where(v, rows["system"], 0), axis]
        plus = v & ((d == 1) | (per & (d == 1 - n)))
        minus = v & ~plus & ((d == -1) | (per & (d == n - 1)))
        far = far | jnp.any(v & (d != 0) & ~plus & ~minus)
        arrived = []
        for go, step in ((plus, 1), (minus, -1)):
            count = jnp.sum(go.astype(jnp.int32))
            need_migrate = jnp.maximum(need_migrate, count)
            packed = _pack(rows, go, cfg.n_migrate)
            perm = [(int(r), int(rank_of(_moved(c, axis, step, n), grid))) for r, c in enumerate(host_coords)]
            arrived.append(jax.lax.ppermute(packed, axes, perm=perm))
        rows = dict(rows, ids=jnp.where(plus | minus, -1, rows["ids"]))
        merged = {k: jnp.concatenate([rows[k], arrived[0][k], arrived[1][k]]) for k in rows}
        need_owned = jnp.maximum(need_owned, jnp.sum((merged["ids"] >= 0).astype(jnp.int32)))
        rows = _by_id(merged, n_owned)

    # 4. Owned rows sorted by global id (the host plan's order); each migration stage above
    # ends sorted, so only a grid without one sorts here.
    if all(g == 1 for g in grid):
        rows = _by_id(rows, n_owned)
    frac = rows.pop("_frac")
    rows.pop("_block")
    n_moved = jnp.sum(((rows.pop("_from") != rank) & (rows["ids"] >= 0)).astype(jnp.int32))
    ids, system = rows["ids"], jnp.where(rows["ids"] >= 0, rows["system"], 0)

    # 5. The ghost shell, exchange by exchange, as build_halo_plan selects it.
    n_local = layout.n_local
    l_frac = jnp.zeros((n_local, 3), wide).at[:n_owned].set(frac)
    l_ids = jnp.full((n_local,), -1, ids.dtype).at[:n_owned].set(ids)
    l_sys = jnp.zeros((n_local,), system.dtype).at[:n_owned].set(system)
    l_shift = jnp.zeros((n_local, 3), jnp.int32)
    n_send = sum(ex.capacity for ex in layout.exchanges)
    send_idx = jnp.zeros((n_send,), jnp.int32)
    send_valid = jnp.zeros((n_send,), bool)
    send_system = jnp.zeros((n_send,), jnp.int32)
    wraps = []
    need_exchange = []
    axis_start = {}
    for ex in layout.exchanges:
        axis_start.setdefault(ex.axis, n_owned + ex.offset)
    by_key = {(ex.axis, ex.direction, ex.hop): ex for ex in layout.exchanges}
    for ex in layout.exchanges:
        if ex.hop == 1:
            src = np.arange(0, axis_start[ex.axis])
        else:
            prev = by_key[(ex.axis, ex.direction, ex.hop - 1)]
            src = np.arange(n_owned + prev.offset, n_owned + prev.offset + prev.capacity)
        dst_of = np.full(n_ranks, -1)
        for s, t in ex.pairs:
            dst_of[s] = t
        c_axis = host_coords[:, ex.axis] + ex.direction
        wrap_of = np.where(c_axis >= grid[ex.axis], -1, np.where(c_axis < 0, 1, 0))
        dst = jnp.asarray(dst_of)[rank]
        wr = jnp.asarray(wrap_of, jnp.int32)[rank]
        sends = dst >= 0
        s_sys = l_sys[src]
        fa = l_frac[src, ex.axis] + wr
        c_dst = coords[jnp.maximum(dst, 0), ex.axis]
        if frame.cuts is None:
            lo_d = lo[s_sys, ex.axis] + c_dst * width[s_sys, ex.axis]
            hi_d = lo[s_sys, ex.axis] + (c_dst + 1) * width[s_sys, ex.axis]
        else:
            lo_d = edges[s_sys, ex.axis, c_dst]
            hi_d = edges[s_sys, ex.axis, c_dst + 1]
        r_ax = reach[s_sys, ex.axis]
        # Inclusive bounds, as the host plan's (halo_plan.build_halo_plan): an atom on the bound is sent.
        sel = (sends & (l_ids[src] >= 0) & (pbc[s_sys, ex.axis] | (wr == 0))
               & (fa >= lo_d - r_ax) & (fa <= hi_d + r_ax))
        count = jnp.sum(sel.astype(jnp.int32))
        need_exchange.append(jax.lax.pmax(count, axes))
        cap = ex.capacity
        slot = jnp.cumsum(sel.astype(jnp.int32)) - 1
        target = jnp.where(sel & (slot < cap), slot, cap)
        idx = jnp.zeros((cap + 1,), jnp.int32).at[target].set(jnp.asarray(src, jnp.int32))[:cap]
        ok = jnp.arange(cap) < jnp.minimum(count, cap)
        send_idx = send_idx.at[ex.offset:ex.offset + cap].set(idx)
        send_valid = send_valid.at[ex.offset:ex.offset + cap].set(ok)
        send_system = send_system.at[ex.offset:ex.offset + cap].set(jnp.where(ok, l_sys[idx], 0))
        wraps.append(jnp.where(sends, wr, 0))
        shifted = l_frac[idx].at[:, ex.axis].add(wr.astype(wide))
        payload = (jnp.where(ok[:, None], shifted, 0.0), l_ids[idx], l_sys[idx], ok,
                   l_shift[idx].at[:, ex.axis].add(wr))
        g_frac, g_ids, g_sys, g_ok, g_shift = jax.lax.ppermute(payload, axes, perm=ex.pairs)
        start = n_owned + ex.offset
        l_frac = jax.lax.dynamic_update_slice_in_dim(l_frac, g_frac, start, axis=0)
        l_ids = jax.lax.dynamic_update_slice_in_dim(l_ids, jnp.where(g_ok, g_ids, -1), start, axis=0)
        l_sys = jax.lax.dynamic_update_slice_in_dim(l_sys, jnp.where(g_ok, g_sys, 0), start, axis=0)
        l_shift = jax.lax.dynamic_update_slice_in_dim(l_shift, jnp.where(g_ok[:, None], g_shift, 0), start, axis=0)

    routing = HaloRouting(send_idx=send_idx, send_valid=send_valid, send_system=send_system,
                          wrap=jnp.stack(wraps).astype(jnp.int32) if wraps else jnp.zeros((0,), jnp.int32),
                          row_ids=l_ids.astype(jnp.int32), row_shifts=l_shift)
    report = dict(
        owned=jax.lax.pmax(need_owned, axes),
        migrate=jax.lax.pmax(need_migrate, axes),
        exchange=jnp.stack(need_exchange) if need_exchange else jnp.zeros((0,), jnp.int32),
        far=jax.lax.pmax(far.astype(jnp.int32), axes) > 0,
        hops=hops_short,
        migrated=jax.lax.psum(n_moved, axes),
    )
    return rows, routing, dict(ids=l_ids, system=l_sys), report


@functools.partial(jax.jit, static_argnames=("cfg", "mesh"))
def replan(owned: dict, frame: Frame, cfg: ReplanConfig, mesh):
    """:func:`rank_replan` on every rank of ``mesh``.

    Args:
      owned: the owned arrays ``[P, n, ...]``, one block per rank (as in :func:`rank_replan`).
      frame: the batch's partition frame (:func:`frame_of`).
      cfg: the rebuild's static shape.
      mesh: the device mesh of P ranks.

    Returns:
      ``((owned, routing, rows), report)``: per-rank blocks stacked on ``[P]``, the report
      replicated.
    """
    def fn(owned, frame):
        out = rank_replan(owned, frame, cfg)
        return out[:3], out[3]

    return on_ranks(fn, mesh, ranked=(owned,), replicated=(frame,), replicated_out=(False, True))


def _moved(c: np.ndarray, axis: int, step: int, n: int) -> np.ndarray:
    c = c.copy()
    c[axis] = (c[axis] + step) % n
    return c


def _pad(x, n: int, fill):
    if x.shape[0] > n:
        raise ValueError(f"{x.shape[0]} owned rows do not fit a layout of {n}")
    if x.shape[0] == n:
        return x
    return jnp.concatenate([x, jnp.full((n - x.shape[0],) + x.shape[1:], fill, x.dtype)])


def _pack(rows: dict, go, n: int) -> dict:
    """The rows where ``go`` holds, in order, in ``n`` slots (free slots: ids -1)."""
    slot = jnp.cumsum(go.astype(jnp.int32)) - 1
    target = jnp.where(go & (slot < n), slot, n)
    out = {}
    for k, v in rows.items():
        fill = -1 if k == "ids" else 0
        out[k] = jnp.full((n + 1,) + v.shape[1:], fill, v.dtype).at[target].set(v)[:n]
    return out


def _by_id(rows: dict, n: int) -> dict:
    """The first ``n`` rows in order of global id, free rows (-1) last."""
    ids = rows["ids"]
    key = jnp.where(ids >= 0, ids, jnp.iinfo(ids.dtype).max)
    order = jnp.argsort(key, stable=True)[:n]
    return {k: v[order] for k, v in rows.items()}
