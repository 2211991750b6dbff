"""The device programs of a LAMMPS callback: LAMMPS's positions into the plan's rows, forces,
energy and virial out, with the neighbour lists kept on the devices between callbacks.

Both programs run on atoms placed on the ranks (:class:`~jaxdd.engine.placed.Placed`: per-rank
rows ``[P, n_owned, ...]`` and the plan), through the same rank functions as
``DomainParallel``'s loop (:func:`~jaxdd.engine.rank_forces.rank_forces`).
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ..decomposition.halo import halo_forward
from ..dispatch import DispatchReport
from ..engine.cells import cell_map
from ..engine.rank_forces import rank_forces
from ..engine.rank_neighbors import neighbor_needs, rank_neighbors
from ..engine.rank_program import RankRows, rank_evaluate, run_ranks

__all__ = ["StepSettings", "built_lists", "callback_step"]


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The static settings of :func:`callback_step` (part of its compile key).

    threshold: how far (Å) an atom may move from the plan's reference positions before the
    plan is stale (inf when no plan goes stale). ghost_width: the plan's ghost shell (Å).
    nl_skin: the model's neighbour skin (Å); > 0 keeps the list between callbacks.
    search_cutoff: the model's cutoff + nl_skin (Å). virial: compute the global virial.
    atom_terms: compute per-atom energies and virials (the program's outputs then include
    ``atomic_energies``).
    """

    threshold: float
    ghost_width: float
    nl_skin: float
    search_cutoff: float
    virial: bool
    atom_terms: bool

    @property
    def keeps_list(self) -> bool:
        """Whether the neighbour list is kept between callbacks (a model with a skin)."""
        return self.nl_skin > 0 and not self.atom_terms


def _carried(x, old, new, system_mask):
    """Positions ``x`` [n, 3] of the box ``old`` [1, 3, 3] carried to ``new`` at the same
    fractional coordinates, and the least factor by which any length shrank (<= 1). LAMMPS
    has one box: one matrix for every row (no per-row gather of [n, 3, 3])."""
    m = cell_map(old, new, system_mask)[0]
    shrink = jnp.min(jnp.linalg.svd(m, compute_uv=False))
    return x @ m, jnp.minimum(shrink, 1.0)


def _largest2(x, ref, valid, axes):
    """The largest squared distance |x - ref|² over the valid rows of every rank."""
    moved = jnp.where(valid[:, None], x - ref, 0.0)
    return jax.lax.pmax(jnp.max(jnp.sum(moved * moved, axis=1), initial=0.0), axes)


@eqx.filter_jit
def built_lists(arrays, fixed, static):
    """Every rank's neighbour list of the rows of a placed state, built afresh.

    Args:
      arrays: the per-rank rows ``[P, n_owned, ...]`` (``positions`` in the plan's frame).
      fixed: the plan (:class:`~jaxdd.engine.placed.RankPlan`).
      static: the rank program.

    Returns:
      The kept list as :func:`callback_step` takes it: (lists ``[P, ...]``, overflow on any
      rank, the sizes needed, the positions [P, n_owned, 3] Å and cell [S, 3, 3] Å it was
      built for).
    """
    def rank_fn(_, report, a, f, cell, system_mask):
        x = a.positions
        local = halo_forward(x, static.layout, f["routing"], static.axes, cell=cell)
        nl = rank_neighbors(local, f["local"], static, cell=cell, routing=f["routing"])
        overflow, needed = neighbor_needs(nl, static.axes)
        return nl, overflow, needed, x, cell

    ranked, replicated = fixed.split()
    return run_ranks(rank_fn, static, ranked=(arrays, ranked), replicated=replicated,
                     replicated_out=(False, True, True, False, True))[0]


def callback_step(model, arrays, fixed, kept, x_in, rows_of, slot_of, origin, cell, prev_cell, pbc, static,
                  settings: StepSettings):
    """One force evaluation at LAMMPS's positions, on the plan of a placed state.

    Each owned row takes its atom's LAMMPS position relative to the box origin, unwrapped to
    the image nearest the row's last position (carried with the cell when it moved), so rows
    move continuously whatever LAMMPS wraps. The ranks then agree whether an atom is further
    than the plan allows from where the plan was built (``far``: the result is not to be
    used; plan again and repeat), and whether this move, taken once more, would be
    (``ahead``: plan again before the next callback).

    Args:
      model: the model.
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.engine.placed.AtomRows`).
      fixed: the plan (:class:`~jaxdd.engine.placed.RankPlan`).
      kept: the neighbour lists from :func:`built_lists` or the last call (None when the
        settings keep none).
      x_in: [N, 3] Å LAMMPS's positions of its local atoms, in its order.
      rows_of: [P, n_owned] int32 the index in ``x_in`` of each row's atom (-1 on free rows).
      slot_of: [N] int32 the flattened ``[P * n_owned]`` row of each LAMMPS atom.
      origin: [3] Å LAMMPS's box origin (``boxlo``).
      cell: [1, 3, 3] Å the box now (rows lattice vectors).
      prev_cell: [1, 3, 3] Å the box of the rows' current positions.
      pbc: [1, 3] bool periodic axes.
      static: the rank program.
      settings: a :class:`StepSettings`.

    Returns:
      A dict: ``positions`` [P, n_owned, 3] Å the rows' new positions; ``forces`` [N, 3]
      eV/Å in LAMMPS's order; ``energy`` [S] eV; ``virial`` [S, 3, 3] eV (W = -dE/dε, zeros
      unless asked); ``far``, ``ahead``, ``overflow`` bools, and ``flags`` [3] the three
      stacked; ``needed`` (the sizes the lists needed); ``kept`` (the lists for the next call, or None); with ``atom_terms``,
      ``atomic_energies`` [N] eV and ``atomic_virials`` [N, 3, 3] eV in LAMMPS's order.

    ``kept`` is donated: its buffers become the returned lists' (updated in place, not
    copied: they are the largest arrays of the call), and the ones passed in are spent.
    """
    return _step((model, arrays, fixed, x_in, rows_of, slot_of, origin, cell, prev_cell, pbc, static, settings,
                  np.ones((), np.int32)), kept)


@functools.partial(eqx.filter_jit, donate="all-except-first")
def _step(held, kept):
    """:func:`callback_step`, ``kept`` donated (the first argument, everything else, is not)."""
    model, arrays, fixed, x_in, rows_of, slot_of, origin, cell, prev_cell, pbc, static, settings, trips = held
    axes = static.axes
    keep = settings.keeps_list

    def rank_fn(model, report, a, f, kept_rows, rows_of, cell, system_mask, plan_cell, prev_cell, pbc, x_in, origin,
                kept_flags, trips):
        valid = a.ids >= 0
        system = a.system
        f = dict(f, cell=cell, system_mask=system_mask)

        def evaluate(prev_rows, kept_rows, kept_flags, report):
            # The image of LAMMPS's position nearest the row's last one (LAMMPS wraps atoms into
            # its box when it re-neighbours; the plan's frame keeps them continuous).
            prev, _ = _carried(prev_rows, prev_cell, cell, system_mask)
            raw = x_in[jnp.maximum(rows_of, 0)] - origin
            frac = (raw - prev) @ jnp.linalg.inv(cell[0])
            frac = frac - jnp.where(pbc[0], jnp.round(frac), 0.0)
            x = jnp.where(valid[:, None], prev + frac @ cell[0], prev_rows)

            # The plan holds every neighbour while no atom has moved threshold from its reference
            # (a shell planned W wide is W·shrink wide once the cell's lengths shrank by shrink).
            ref, shrink = _carried(a.reference, plan_cell, cell, system_mask)
            allowed = settings.threshold - (1.0 - shrink) * settings.ghost_width / 2
            d2 = _largest2(x, ref, valid, axes)
            ahead2 = _largest2(2 * x - prev, ref, valid, axes)
            far = (d2 > allowed**2) | (allowed <= 0)
            ahead = ahead2 > allowed**2

            nl = None
            if keep:
                overflow, needed, nl_cell = kept_flags
                nl_x = kept_rows[1]
                nl_ref, nl_shrink = _carried(nl_x, nl_cell, cell, system_mask)
                nl_allowed = 0.5 * (settings.nl_skin - (1.0 - nl_shrink) * settings.search_cutoff)
                stale = (_largest2(x, nl_ref, valid, axes) > nl_allowed**2) | (nl_allowed <= 0)

                def build():
                    local = halo_forward(x, static.layout, f["routing"], axes, cell=cell)
                    new = rank_neighbors(local, f["local"], static, cell=cell, routing=f["routing"])
                    return (new,) + neighbor_needs(new, axes)

                nl, overflow, needed = jax.lax.cond(stale, build, lambda: (kept_rows[0], overflow, needed))
                kept_rows = (nl, jnp.where(stale, x, nl_x))
                kept_flags = (overflow, needed, jnp.where(stale, cell, nl_cell))

            out = {}
            if settings.atom_terms:
                rows = RankRows(f["local"], x, system, f["owned_rows"], f["routing"], cell, system_mask)
                ev = rank_evaluate(model, rows, static, report, forces=True, virials=True)
                forces, energy = -ev.g_pos, ev.per_system
                w = -jax.lax.psum(ev.g_strain, axes).astype(energy.dtype)
                n_own = static.layout.n_owned
                out["atomic_energies"] = jnp.where(valid, ev.outputs["atomic_energies"][:n_own], 0.0)
                out["atomic_virials"] = jnp.where(valid[:, None, None], ev.atomic_virials, 0.0)
                nl = ev.neighbors
            else:
                forces, energy, nl, w = rank_forces(model, f, x, system, static, report, neighbors=nl,
                                                    virial=settings.virial)
                if w is None:
                    w = jnp.zeros((static.n_systems, 3, 3), energy.dtype)
            if not keep:
                overflow, needed = neighbor_needs(nl, axes)
            ranked_out = dict(out, positions=x, forces=forces)  # free rows are never read (slot_of)
            flags = dict(energy=energy, virial=w, far=far, ahead=ahead, overflow=overflow, needed=needed)
            return ranked_out, flags, kept_rows, kept_flags

        # The evaluation is the body of a while loop that runs ``trips`` (one) times, the rows'
        # positions carried, as in DomainParallel's device loop: XLA then computes what the plan
        # alone decides (the halo's index arithmetic, in the backward pass too) once, outside
        # the loop. In a program without the loop it fuses that arithmetic into the per-edge
        # gathers that read it and repeats it once per edge (LJ melt on one CPU core: the
        # per-edge force fusion 11 ms instead of 3 ms).
        # The loop's initial outputs: zeros shaped as the body's (traced with a report of its own).
        spare = DispatchReport(policy=static.spec.policy)
        shapes = jax.eval_shape(lambda r: evaluate(r, kept_rows, kept_flags, spare)[:2], a.positions)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

        def body(carry):
            k, prev_rows, _, kept_rows, kept_flags = carry
            ranked_out, flags, kept_rows, kept_flags = evaluate(prev_rows, kept_rows, kept_flags, report)
            return k + 1, ranked_out["positions"], (ranked_out, flags), kept_rows, kept_flags

        init = (jnp.int32(0), a.positions, zeros, kept_rows, kept_flags)
        _, _, (ranked_out, flags), kept_rows, kept_flags = jax.lax.while_loop(lambda c: c[0] < trips, body, init)
        return ranked_out, flags, kept_rows, kept_flags

    ranked, replicated = fixed.split()
    kept_rows, kept_flags = (None, None) if kept is None else ((kept[0], kept[3]), (kept[1], kept[2], kept[4]))
    rows, flags, kept_rows, kept_flags = run_ranks(
        rank_fn, static, model=model, ranked=(arrays, ranked, kept_rows, rows_of),
        replicated=(*replicated, fixed.plan_cell, prev_cell, pbc, x_in, origin, kept_flags, trips),
        replicated_out=(False, True, False, True), report=DispatchReport(policy=static.spec.policy))[0]
    # Back to LAMMPS's order: one gather of the flattened rows (across devices when several).
    # One small array the host reads each call: far, ahead, overflow.
    out = dict(flags, positions=rows["positions"], flags=jnp.stack([flags["far"], flags["ahead"], flags["overflow"]]))
    for key in ("forces", "atomic_energies", "atomic_virials"):
        if key in rows:
            flat = rows[key].reshape((-1,) + rows[key].shape[2:])
            out[key] = flat[slot_of]
    out["kept"] = None if kept is None else (kept_rows[0], kept_flags[0], kept_flags[1], kept_rows[1], kept_flags[2])
    return out
