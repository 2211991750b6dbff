"""The device loop of dynamics: many steps in one ``while_loop`` inside ``shard_map``, leaving
only when the plan goes stale, a capacity overflows, a step is not finite or too long, or a
minimiser converges (the reason it left is one of the integers below)."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from ..data.cell_widths import cell_widths
from ..dispatch import DispatchReport
from ..decomposition.halo import halo_forward
from ..engine.cells import cell_map
from ..engine.rank_forces import rank_forces
from ..engine.rank_neighbors import neighbor_needs, rank_neighbors
from ..engine.rank_program import run_ranks
from .integrators import RankState, StepContext

__all__ = ["advance", "RUNNING", "REBUILD", "OVERFLOW", "CONVERGED", "NONFINITE", "AHEAD",
           "TOO_FAST", "NARROW"]

# Why the device loop stopped. REBUILD: the step just taken outran the plan and was
# discarded; AHEAD: the step was kept, and the next one, extrapolated, would outrun it;
# NARROW: the step made a periodic width of the cell too narrow for a minimum-image model
# (discarded).
RUNNING, REBUILD, OVERFLOW, CONVERGED, NONFINITE, AHEAD, TOO_FAST, NARROW = 0, 1, 2, 3, 4, 5, 6, 7


@eqx.filter_jit
def advance(model, arrays, energy, extra, virial, fixed, step0, n, static, integrator, threshold, step_limit, nl_skin,
            reach, width_limit=None):
    """Up to ``n`` steps on device; stops early for a rebuild, an overflow or convergence.

    Args:
      model: the model.
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.engine.placed.AtomRows`).
      energy: [S] eV potential energy of the current positions.
      extra: the integrator's own state (thermostat chains, ...).
      virial: [S, 3, 3] eV, W = -dE/dε of the current positions, or None.
      fixed: the plan (:class:`~jaxdd.engine.placed.RankPlan`).
      step0: int32 steps taken before this call.
      n: int32 most steps to take.
      static: the rank program.
      integrator: the integrator (static).
      threshold: how far (Å) atoms may move from their plan before it is rebuilt (inf when
        no plan goes stale).
      step_limit: how far (Å) one step may move an atom at all (half the skin, on one
        device as on many): a longer step ends the loop (``TOO_FAST``).
      nl_skin: > 0: the neighbour list is kept from step to step and rebuilt on device when
        an atom has moved ``nl_skin / 2`` (Å) since it was built.
      reach: for an integrator that moves the cell, (ghost width, model's neighbour range)
        in Å: displacements are then measured from the reference positions carried with
        the cell, and the allowance shrinks with the cell (a plan of ghost width W covers
        W·s once lengths shrank by s); None otherwise.
      width_limit: for a moving cell and a minimum-image model, (least width Å, [S][3]
        periodic axes as nested tuples): a step that brings a periodic width of a real system
        down to it is discarded and ends the loop (``NARROW``); None: no limit.

    Returns:
      (rows, energy, extra, cell, virial, steps taken, reason, needed sizes): ``reason``
      one of ``RUNNING``, ``REBUILD``, ``OVERFLOW``, ... above.
    """
    axes = static.axes
    reuse = nl_skin > 0
    moving = reach is not None
    want_virial = bool(integrator.needs_virial)

    def rank_fn(model, report, a, f, cell, system_mask, plan_cell, energy, extra, virial, step0, n):
        f = dict(f, cell=cell, system_mask=system_mask)
        valid = a.ids >= 0
        n_sys = static.n_systems

        def local_shift2(x, ref):
            moved = jnp.where(valid[:, None], x - ref, 0.0)
            return jnp.max(jnp.sum(moved * moved, axis=1), initial=0.0)

        def max_shift2(x, ref):
            return jax.lax.pmax(local_shift2(x, ref), axes)

        def carried(ref, ref_cell, cell_now):
            """Reference positions ``ref`` taken along with the cell since ``ref_cell``, and the
            least factor by which any length shrank since then (1 when the cell is fixed)."""
            if not moving:
                return ref, jnp.ones((), ref.dtype)
            m = cell_map(ref_cell, cell_now, system_mask)  # identity for padding systems
            # The least factor by which any length shrank: the smallest singular value of m.
            shrink = jnp.min(jnp.linalg.svd(m, compute_uv=False))
            return jnp.einsum("ni,nij->nj", ref, m[a.system]), jnp.minimum(shrink, 1.0)

        def moved2(x, cell_now, ref, ref_cell):
            """Largest squared displacement since ``ref``, and how far lengths shrank since then."""
            ref, shrink = carried(ref, ref_cell, cell_now)
            return max_shift2(x, ref), shrink

        def neighbors(x, cell_now):
            return rank_neighbors(halo_forward(x, static.layout, f["routing"], axes, cell=cell_now), f["local"],
                                  static, cell=cell_now, routing=f["routing"])

        def evaluate(x, nl, cell_now):
            forces, per_system, nl, w = rank_forces(model, dict(f, cell=cell_now), x, a.system, static, report,
                                                    neighbors=nl, virial=want_virial)
            return forces, per_system, w, nl

        def built(x, cell_now):
            """A list of the rows now, whether it overflowed on any rank and the sizes needed."""
            nl = neighbors(x, cell_now)
            return (nl,) + neighbor_needs(nl, axes)

        counts = jax.lax.psum(jax.ops.segment_sum(valid.astype(jnp.int32), a.system, num_segments=n_sys), axes)

        def context(step):
            return StepContext(
                inv_mass=a.inv_mass[:, None], ids=a.ids, system=a.system, valid=valid, step=step,
                n_atoms=counts,
                system_sum=lambda v: jax.lax.psum(
                    jax.ops.segment_sum(jnp.where(valid.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0), a.system,
                                        num_segments=n_sys), axes),
                global_max=lambda v: jax.lax.pmax(v, axes),
            )

        x0 = a.positions
        # A kept list carries whether it overflowed when built and the sizes it needed: its
        # capacities are checked (one collective) only at the steps that build it.
        verlet = (*built(x0, cell), x0, cell) if reuse else None
        _, _, needed0 = jax.eval_shape(built, x0, cell)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), needed0)
        state0 = RankState(x0, a.velocities, a.forces, energy, extra, cell, virial)
        done0 = integrator.converged(state0, context(step0))
        init = (jnp.int32(0), done0, jnp.where(done0, CONVERGED, RUNNING).astype(jnp.int32), (state0, verlet),
                zeros)

        def cond(carry):
            k, stop = carry[0], carry[1]
            return (k < n) & ~stop

        def body(carry):
            k, _, _, (state, verlet), _ = carry
            box = {}

            def forces_fn(x, cell_now=None):
                cell_now = state.cell if cell_now is None else cell_now
                box["cell"] = cell_now
                nl = None
                if reuse:
                    nl, overflow, needed, ref, ref_cell = verlet
                    d2, shrink = moved2(x, cell_now, ref, ref_cell)
                    # A pair beyond cutoff + skin when listed is now at least shrink·(cutoff + skin) - 2d.
                    allowed = 0.5 * (nl_skin - (1.0 - shrink) * (reach[1] if moving else 0.0))
                    stale = (d2 > allowed**2) | (allowed <= 0)
                    # Every rank takes the same branch (stale is agreed), so the rebuild may
                    # hold collectives. A kept list keeps its flag: the list built before the
                    # loop is first checked here, and a later one that overflowed ended the loop.
                    nl, overflow, needed = jax.lax.cond(
                        stale, lambda: built(x, cell_now), lambda: (nl, overflow, needed))
                    box["verlet"] = (nl, overflow, needed, jnp.where(stale, x, ref), jnp.where(stale, cell_now, ref_cell))
                forces, per_system, w, nl = evaluate(x, nl, cell_now)
                if not reuse:
                    overflow, needed = neighbor_needs(nl, axes)
                box.update(overflow=overflow, needed=needed,
                           finite=jnp.all(jnp.isfinite(per_system)) & jnp.all(jnp.isfinite(forces)))
                return forces, per_system, w

            ctx = context(step0 + k)
            with jax.named_scope("jaxdd.integrate"):  # the model, list and halo inside keep their own scopes
                new = integrator.step(state, ctx, forces_fn)
            # A model may refuse positions that drifted too far from their plan with NaN (the
            # distributed PME mesh does); a new plan fixes that.
            # The integrator's own state too: a diverging chain shows there first (conserved = inf).
            finite = (box["finite"] & jnp.all(jnp.isfinite(new.positions)) & jnp.all(jnp.isfinite(new.velocities))
                      & jnp.all(jnp.isfinite(new.cell))
                      & functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in
                                                           jax.tree_util.tree_leaves(new.extra)], jnp.asarray(True)))
            ref, shrink = carried(a.reference, plan_cell, box["cell"])
            # Where the next step would take the atoms, this step's move extrapolated: a plan it
            # would outrun is rebuilt now, rather than after a step evaluated in vain (a wrong
            # guess costs a rebuild one step early, or the discarded step as before).
            ahead = 2 * new.positions - state.positions
            # One collective agrees on all three: the largest displacement, the largest one
            # ahead, and whether any rank is not finite.
            d2, ahead2, broken, step2 = jax.lax.pmax(jnp.stack([
                local_shift2(new.positions, ref), local_shift2(ahead, ref),
                jnp.where(finite, 0.0, 1.0).astype(new.positions.dtype),
                local_shift2(new.positions, state.positions)]), axes)
            nonfinite = broken > 0
            too_fast = finite & (step2 > step_limit**2)
            # The plan's shell of W Å is W·shrink Å now; what it must hold beyond the model's
            # reach is twice the displacement.
            allowed = threshold - (1.0 - shrink) * (reach[0] / 2 if moving else 0.0)
            far = (d2 > allowed**2) | (allowed <= 0)
            blowup = nonfinite & ~box["overflow"]
            narrow = jnp.asarray(False)
            if width_limit is not None:
                limit, periodic = width_limit
                narrow = jnp.any(system_mask[:, None] & jnp.asarray(periodic)
                                 & (cell_widths(new.cell) <= limit))
            bad = far | box["overflow"] | blowup | too_fast | narrow
            soon = ~bad & (ahead2 > allowed**2)
            # A discarded step ends the loop, and the next call builds its list afresh, so
            # only the state needs selecting (the list is large, selecting it costs a copy).
            kept = (jax.tree_util.tree_map(lambda old, nw: jnp.where(bad, old, nw), state, new), box.get("verlet"))
            converged = ~bad & integrator.converged(kept[0], ctx)
            reason = jnp.where(box["overflow"], OVERFLOW, jnp.where(narrow, NARROW, jnp.where(
                too_fast, TOO_FAST, jnp.where(far, REBUILD, jnp.where(blowup, NONFINITE, jnp.where(
                    converged, CONVERGED, jnp.where(soon, AHEAD, RUNNING)))))))
            return (k + jnp.where(bad, 0, 1).astype(jnp.int32), bad | converged | soon, reason.astype(jnp.int32),
                    kept, box["needed"])

        k, _, reason, (state, _), needed = jax.lax.while_loop(cond, body, init)
        out = a.replace(positions=state.positions, velocities=state.velocities, forces=state.forces)
        return out, state.energy, state.extra, state.cell, state.virial, k, reason, needed

    ranked, replicated = fixed.split()
    return run_ranks(rank_fn, static, model=model, ranked=(arrays, ranked),
                     replicated=(*replicated, fixed.plan_cell, energy, extra, virial, step0, n),
                     replicated_out=(False, True, True, True, True, True, True, True),
                     report=DispatchReport(policy=static.spec.policy))[0]
