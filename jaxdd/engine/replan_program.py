"""A halo plan rebuilt on the devices: the atoms migrate to the ranks whose blocks hold them
(:func:`jaxdd.decomposition.replan.rank_replan`) and each rank's local rows are laid out again,
as :meth:`~jaxdd.engine.run_placement.Placement.place` lays them out on the host."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..data import Batch
from ..decomposition.halo import halo_forward
from ..decomposition.ranks import on_ranks
from ..decomposition.replan import ReplanConfig, rank_replan
from .placed import AtomRows

__all__ = ["replanned", "carried_fields"]


def carried_fields(local: Batch) -> tuple[str, ...]:
    """The optional per-atom fields a plan's local batch carries (the spec's shard_fields)."""
    return tuple(f for f in ("charges", "masses", "velocities") if getattr(local, f) is not None)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "fields"))
def replanned(arrays, cell, system_mask, frame, cfg: ReplanConfig, mesh, fields: tuple[str, ...], pbc):
    """A rebuild on the devices (:func:`jaxdd.decomposition.replan.rank_replan`) and the plan's local rows:
    (rows, plan) laid out as :meth:`~jaxdd.engine.run_placement.Placement.place` lays them out
    (the plan's ``local`` batch, ``owned_rows`` and ``routing``). Inputs depend on the owned
    rows only, so one program serves every rebuild of a layout.

    Args:
      arrays: the :class:`~jaxdd.engine.placed.AtomRows` ``[P, n_owned, ...]``.
      cell: [S, 3, 3] Å.
      system_mask: [S] real systems.
      frame: the partition frame (:func:`jaxdd.decomposition.replan.frame_of`).
      cfg: the rebuild's static shape.
      mesh: the device mesh of P ranks.
      fields: the optional per-atom fields the local batch carries (:func:`carried_fields`).
      pbc: [P, S, 3] the local batch's periodic axes, kept (none where ghost rows are explicit
        images; a single rank that searches its periodic cell itself keeps the cell's).

    Returns:
      (rows, plan, report): the new :class:`~jaxdd.engine.placed.AtomRows`, the plan's ``local``, ``owned_rows`` and
      ``routing``, and the rebuild's replicated report (:func:`~jaxdd.decomposition.replan.rank_replan`).
    """
    axes = cfg.axes
    layout, n_sys = cfg.layout, cfg.n_systems

    @jax.named_scope("jaxdd.replan")  # a profile tells rebuilds apart (bench/profile_table.py)
    def fn(arrays, pbc, cell, system_mask, frame):
        carried = {k: v for k, v in arrays.as_dict().items() if k != "reference"}
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
        return AtomRows(**rows, reference=rows["positions"]), local, owned_rows, routing, report

    new, local, owned_rows, routing, report = on_ranks(
        fn, mesh, ranked=(arrays, pbc), replicated=(cell, system_mask, frame),
        replicated_out=(False, False, False, False, True))
    return new, dict(local=local, owned_rows=owned_rows, routing=routing), report
