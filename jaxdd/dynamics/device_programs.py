"""Programs of a dynamics run besides its loop: the forces of a placed state, per-atom terms,
neighbour counts, a plan rebuilt on the devices, and the kinetic energy."""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp

from ..data import Batch
from ..decomposition.halo import halo_forward
from ..decomposition.ranks import on_ranks
from ..decomposition.replan import ReplanConfig, rank_replan
from ..dispatch import DispatchReport
from ..engine.rank_neighbors import neighbor_needs, rank_neighbors
from ..engine.rank_program import RankRows, rank_evaluate, run_ranks
from .device_loop import rank_forces, split_plan

__all__ = ["evaluate", "pair_counts", "atom_terms", "replanned", "carried_fields", "kinetic"]


@eqx.filter_jit
def evaluate(model, arrays, fixed, static, stress):
    """The energy and forces of a placed state.

    Args:
      model: the model.
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.dynamics.state.MDState`).
      fixed: the plan (``MDState.fixed``).
      static: the rank program.
      stress: also dE/dε.

    Returns:
      (energy [S] eV, forces [P, n_owned, 3] eV/Å, dE/dε summed [S, 3, 3] eV or 0, overflow,
      needed sizes).
    """
    axes = static.axes

    def rank_fn(model, report, a, f, cell, system_mask):
        f = dict(f, cell=cell, system_mask=system_mask)
        forces, per_system, nl, w = rank_forces(model, f, a["positions"], a["system"], static, report, virial=stress)
        virial = -w if stress else jnp.zeros(())
        overflow, needed = neighbor_needs(nl, axes)
        return per_system, forces, virial, overflow, needed

    ranked, replicated = split_plan(fixed)
    return run_ranks(rank_fn, static, model=model, ranked=(arrays, ranked), replicated=replicated,
                     replicated_out=(True, False, True, True, True), report=DispatchReport(policy=static.spec.policy))[0]


@eqx.filter_jit
def pair_counts(arrays, fixed, static):
    """Neighbours of every owned row within the model's search cutoff, [P, n_owned] (0 on free rows).

    Args:
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.dynamics.state.MDState`).
      fixed: the plan (``MDState.fixed``).
      static: the rank program.
    """
    def rank_fn(_, report, a, f, cell, system_mask):
        f = dict(f, cell=cell, system_mask=system_mask)
        positions = halo_forward(a["positions"], static.layout, f["routing"], static.axes, cell=cell)
        nl = rank_neighbors(positions, f["local"], static, cell=cell, routing=f["routing"])
        n_local = positions.shape[0]
        counts = jax.ops.segment_sum(nl.mask.astype(jnp.int32), jnp.where(nl.mask, nl.receivers, n_local),
                                     num_segments=n_local + 1)
        return jnp.where(a["ids"] >= 0, counts[:static.layout.n_owned], 0)

    ranked, replicated = split_plan(fixed)
    return run_ranks(rank_fn, static, ranked=(arrays, ranked), replicated=replicated)[0]


@eqx.filter_jit
def atom_terms(model, arrays, fixed, static):
    """(atomic energies [P, n_owned] eV, atomic virials [P, n_owned, 3, 3] eV) of the owned rows.

    Args:
      model: the model (with an ``atomic_energies`` output).
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.dynamics.state.MDState`).
      fixed: the plan (``MDState.fixed``).
      static: the rank program.
    """
    def rank_fn(model, report, a, f, cell, system_mask):
        rows = RankRows(f["local"], a["positions"], a["system"], f["owned_rows"], f["routing"], cell, system_mask)
        _, out, _, _, _, _, w = rank_evaluate(model, rows, static, report, forces=False, virials=True)
        valid = a["ids"] >= 0
        e = jnp.where(valid, out["atomic_energies"][:static.layout.n_owned], 0.0)
        return e, jnp.where(valid[:, None, None], w, 0.0)

    ranked, replicated = split_plan(fixed)
    return run_ranks(rank_fn, static, model=model, ranked=(arrays, ranked), replicated=replicated,
                     replicated_out=(False, False), report=DispatchReport(policy=static.spec.policy))[0]


def carried_fields(local: Batch) -> tuple[str, ...]:
    """The optional per-atom fields a plan's local batch carries (the spec's shard_fields)."""
    return tuple(f for f in ("charges", "masses", "velocities") if getattr(local, f) is not None)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "fields"))
def replanned(arrays, cell, system_mask, frame, cfg: ReplanConfig, mesh, fields: tuple[str, ...], pbc):
    """A rebuild on the devices (:func:`jaxdd.decomposition.replan.rank_replan`) and the plan's local rows:
    (arrays, plan) laid out as :meth:`DomainParallel._place` lays them out (the plan's
    ``local`` batch, ``owned_rows`` and ``routing``). Inputs depend on the owned rows only,
    so one program serves every rebuild of a layout.

    Args:
      arrays: the per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.dynamics.state.MDState`).
      cell: [S, 3, 3] Å.
      system_mask: [S] real systems.
      frame: the partition frame (:func:`jaxdd.decomposition.replan.frame_of`).
      cfg: the rebuild's static shape.
      mesh: the device mesh of P ranks.
      fields: the optional per-atom fields the local batch carries (:func:`carried_fields`).
      pbc: [P, S, 3] the local batch's periodic axes, kept (none where ghost rows are explicit
        images; a single rank that searches its periodic cell itself keeps the cell's).

    Returns:
      (arrays, plan, report): the new rows, the plan's ``local``, ``owned_rows`` and
      ``routing``, and the rebuild's replicated report (:func:`~jaxdd.decomposition.replan.rank_replan`).
    """
    axes = cfg.axes
    layout, n_sys = cfg.layout, cfg.n_systems

    @jax.named_scope("jaxdd.replan")  # a profile tells rebuilds apart (bench/profile_table.py)
    def fn(arrays, pbc, cell, system_mask, frame):
        carried = {k: v for k, v in arrays.items() if k != "reference"}
        rows, routing, held, report = rank_replan(carried, frame, cfg)
        valid = held["ids"] >= 0
        forward = functools.partial(halo_forward, layout=layout, routing=routing, axis_name=axes)
        batch_idx = jnp.where(valid, held["system"], n_sys).astype(jnp.int32)
        # Every system's atom count, as on one device (ptr is a total): owned rows counted, summed.
        owned = jnp.where(valid & (jnp.arange(valid.shape[0]) < layout.n_owned), batch_idx, n_sys)
        counts = jax.lax.psum(jnp.zeros(n_sys + 1, jnp.int32).at[owned].add(1)[:n_sys], axes)
        dtype = rows["positions"].dtype
        local = Batch.unchecked(
            positions=jnp.zeros((layout.n_local, 3), dtype),
            atomic_numbers=forward(rows["atomic_numbers"]),
            cell=cell, pbc=pbc, batch_idx=batch_idx,
            ptr=jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts)]).astype(jnp.int32),
            atom_mask=valid, system_mask=system_mask,
            charges=forward(rows["charges"]) if "charges" in fields else None,
            masses=jnp.where(valid, forward(rows["masses"]), 1.0).astype(dtype) if "masses" in fields else None,
            velocities=forward(rows["velocities"]) if "velocities" in fields else None,
            neighbors=None)
        owned_rows = valid & (jnp.arange(layout.n_local) < layout.n_owned)
        return dict(rows, reference=rows["positions"]), local, owned_rows, routing, report

    new, local, owned_rows, routing, report = on_ranks(
        fn, mesh, ranked=(arrays, pbc), replicated=(cell, system_mask, frame),
        replicated_out=(False, False, False, False, True))
    return new, dict(local=local, owned_rows=owned_rows, routing=routing), report


@functools.partial(jax.jit, static_argnums=1)
def kinetic(arrays, n_sys: int):
    """(kinetic energy [S] eV in the widest float enabled, real atoms [S]) of the owned rows.

    Args:
      arrays: the per-rank rows (``velocities``, ``inv_mass``, ``ids``, ``system``).
      n_sys: number of systems S.
    """
    valid = arrays["ids"] >= 0
    wide = jnp.promote_types(arrays["velocities"].dtype, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    v = arrays["velocities"].astype(wide)
    inv = arrays["inv_mass"].astype(wide)
    mv2 = jnp.where(valid, jnp.sum(v * v, axis=-1) / jnp.where(valid, inv, 1.0), 0.0)
    system = jnp.where(valid, arrays["system"], n_sys).reshape(-1)
    ke = 0.5 * jnp.zeros(n_sys + 1, wide).at[system].add(mv2.reshape(-1))[:n_sys]
    counts = jnp.zeros(n_sys + 1, jnp.int32).at[system].add(valid.reshape(-1).astype(jnp.int32))[:n_sys]
    return ke, counts
