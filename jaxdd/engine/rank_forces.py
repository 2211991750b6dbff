"""The forces on one rank's owned atoms, as every driver's device program takes them."""

from __future__ import annotations

import jax

from .rank_program import RankRows, rank_evaluate

__all__ = ["rank_forces"]


def rank_forces(model, f, own_pos, own_sys, static, report, neighbors=None, virial=False):
    """(forces [n_owned, 3] eV/Å, energy [S] eV, neighbour list, virial) of one rank.

    A model that computes its forces itself (a kernel's direct forces: "forces" is an output
    and not an autograd output) is taken at its word, which costs one pass instead of a forward
    and a backward one; otherwise forces are minus the gradient of the energy. Call inside
    :func:`~jaxdd.engine.rank_program.run_ranks`.

    Args:
      model: the model on this rank.
      f: this rank's plan (``local``, ``owned_rows``, ``routing``, ``cell`` [S, 3, 3] Å,
        ``system_mask`` [S]), as :meth:`~jaxdd.engine.placed.RankPlan.split` hands it over
        with the cell and mask added.
      own_pos: [n_owned, 3] Å owned positions (in the partition's wrapped frame).
      own_sys: [n_owned] system of each owned row.
      static: the rank program.
      report: the dispatch report the trace writes to.
      neighbors: a kept neighbour list to reuse; None builds one.
      virial: also the virial W = -dE/dε [S, 3, 3] eV summed over ranks (from the strain
        gradient; None otherwise).

    Returns:
      (forces, energy, neighbour list, virial or None).
    """
    direct = "forces" not in static.autograd and not virial
    rows = RankRows(f["local"], own_pos, own_sys, f["owned_rows"], f["routing"], f["cell"], f["system_mask"])
    per_system, out, _, nl, g_pos, g_strain, _ = rank_evaluate(
        model, rows, static, report, forces=not direct, stress=virial, neighbors=neighbors)
    forces = out["forces"][:static.layout.n_owned] if direct else -g_pos
    w = -jax.lax.psum(g_strain, static.axes).astype(per_system.dtype) if virial else None
    return forces, per_system, nl, w
