"""Programs of a dynamics run besides its loop: the forces of a placed state, per-atom terms,
neighbour counts and the kinetic energy (a plan rebuilt on the devices is
:mod:`jaxdd.engine.replan_program`)."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from ..decomposition.halo import halo_forward
from ..dispatch import DispatchReport
from ..engine.rank_forces import rank_forces
from ..engine.rank_neighbors import neighbor_needs, rank_neighbors
from ..engine.rank_program import RankRows, rank_evaluate, run_ranks

__all__ = ["evaluate", "pair_counts", "atom_terms", "kinetic"]


@eqx.filter_jit
def evaluate(model, arrays, fixed, static, stress):
    """The energy and forces of a placed state.

    Args:
      model: the model.
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.engine.placed.AtomRows`).
      fixed: the plan (:class:`~jaxdd.engine.placed.RankPlan`).
      static: the rank program.
      stress: also dE/dε.

    Returns:
      (energy [S] eV, forces [P, n_owned, 3] eV/Å, dE/dε summed [S, 3, 3] eV or 0, overflow,
      needed sizes).
    """
    axes = static.axes

    def rank_fn(model, report, a, f, cell, system_mask):
        f = dict(f, cell=cell, system_mask=system_mask)
        forces, per_system, nl, w = rank_forces(model, f, a.positions, a.system, static, report, virial=stress)
        virial = -w if stress else jnp.zeros(())
        overflow, needed = neighbor_needs(nl, axes)
        return per_system, forces, virial, overflow, needed

    ranked, replicated = fixed.split()
    return run_ranks(rank_fn, static, model=model, ranked=(arrays, ranked), replicated=replicated,
                     replicated_out=(True, False, True, True, True), report=DispatchReport(policy=static.spec.policy))[0]


@eqx.filter_jit
def pair_counts(arrays, fixed, static):
    """Neighbours of every owned row within the model's search cutoff, [P, n_owned] (0 on free rows).

    Args:
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.engine.placed.AtomRows`).
      fixed: the plan (:class:`~jaxdd.engine.placed.RankPlan`).
      static: the rank program.
    """
    def rank_fn(_, report, a, f, cell, system_mask):
        f = dict(f, cell=cell, system_mask=system_mask)
        positions = halo_forward(a.positions, static.layout, f["routing"], static.axes, cell=cell)
        nl = rank_neighbors(positions, f["local"], static, cell=cell, routing=f["routing"])
        n_local = positions.shape[0]
        counts = jax.ops.segment_sum(nl.mask.astype(jnp.int32), jnp.where(nl.mask, nl.receivers, n_local),
                                     num_segments=n_local + 1)
        return jnp.where(a.ids >= 0, counts[:static.layout.n_owned], 0)

    ranked, replicated = fixed.split()
    return run_ranks(rank_fn, static, ranked=(arrays, ranked), replicated=replicated)[0]


@eqx.filter_jit
def atom_terms(model, arrays, fixed, static):
    """(atomic energies [P, n_owned] eV, atomic virials [P, n_owned, 3, 3] eV) of the owned rows.

    Args:
      model: the model (with an ``atomic_energies`` output).
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.engine.placed.AtomRows`).
      fixed: the plan (:class:`~jaxdd.engine.placed.RankPlan`).
      static: the rank program.
    """
    def rank_fn(model, report, a, f, cell, system_mask):
        rows = RankRows(f["local"], a.positions, a.system, f["owned_rows"], f["routing"], cell, system_mask)
        _, out, _, _, _, _, w = rank_evaluate(model, rows, static, report, forces=False, virials=True)
        valid = a.ids >= 0
        e = jnp.where(valid, out["atomic_energies"][:static.layout.n_owned], 0.0)
        return e, jnp.where(valid[:, None, None], w, 0.0)

    ranked, replicated = fixed.split()
    return run_ranks(rank_fn, static, model=model, ranked=(arrays, ranked), replicated=replicated,
                     replicated_out=(False, False), report=DispatchReport(policy=static.spec.policy))[0]


@functools.partial(jax.jit, static_argnums=1)
def kinetic(arrays, n_sys: int):
    """(kinetic energy [S] eV in the widest float enabled, real atoms [S]) of the owned rows.

    Args:
      arrays: the per-rank rows (``velocities``, ``inv_mass``, ``ids``, ``system``).
      n_sys: number of systems S.
    """
    valid = arrays.ids >= 0
    wide = jnp.promote_types(arrays.velocities.dtype, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    v = arrays.velocities.astype(wide)
    inv = arrays.inv_mass.astype(wide)
    mv2 = jnp.where(valid, jnp.sum(v * v, axis=-1) / jnp.where(valid, inv, 1.0), 0.0)
    system = jnp.where(valid, arrays.system, n_sys).reshape(-1)
    ke = 0.5 * jnp.zeros(n_sys + 1, wide).at[system].add(mv2.reshape(-1))[:n_sys]
    counts = jnp.zeros(n_sys + 1, jnp.int32).at[system].add(valid.reshape(-1).astype(jnp.int32))[:n_sys]
    return ke, counts
