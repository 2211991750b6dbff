"""What a dynamics run reports about a state: thermodynamics, per-atom energies and virials,
and each atom's neighbour count (the cost balanced blocks share out). Each function takes the
:class:`~jaxdd.dynamics.DomainParallel` ``md`` and a state of it; its methods of the same
names call them."""

from __future__ import annotations

import sys

import jax
import numpy as np

from ..engine.atom_order import atom_order
from ..engine.host import host_array
from ..engine.rank_program import Needs
from ..engine.virials import refuse_broken
from .device_programs import atom_terms as device_atom_terms
from .device_programs import evaluate, kinetic, pair_counts
from .state import MDState

__all__ = ["thermo", "check_atom_terms", "atom_terms", "pair_weights", "print_thermo"]


def thermo(md, state: MDState) -> dict:
    """Per-system thermodynamics, numpy [S]: ``potential_energy``, ``kinetic_energy``,
    ``total_energy`` (eV), ``temperature`` (2 KE / (dof kB), dof = 3N - 3), ``conserved``
    (eV: the total energy plus the thermostat's and barostat's own, the quantity the
    integrator conserves; absent for Langevin and FIRE) and, when every system has a cell
    of non-zero volume, ``volume`` (Å³) and ``pressure`` (eV/Å³: 2 KE / 3V - tr(σ) / 3, σ
    the potential stress).

    Args:
      md: the :class:`~jaxdd.dynamics.DomainParallel` running ``state``.
      state: its state.
    """
    t = state.template
    n_sys = t.n_systems
    # Reduced on the devices: no process gathers the velocities.
    ke, counts = (host_array(x) for x in kinetic(state.rows, n_sys))
    ke = ke.astype(np.float64)
    dof = np.maximum(3 * counts - 3, 1)
    pe = np.asarray(state.energy, np.float64)
    out = dict(potential_energy=pe, kinetic_energy=ke, total_energy=pe + ke, temperature=2 * ke / (dof * md.kB))
    own = getattr(md.integrator, "energy", None)
    if own is not None:
        out["conserved"] = pe + ke + np.asarray(own(state.extra, counts, t.cell), np.float64)
    volume = np.abs(np.linalg.det(np.asarray(t.cell, np.float64)))
    if np.all(volume[np.asarray(t.system_mask)] > 0):
        out["volume"] = volume
        if md.integrator.needs_virial:  # the state carries the virial of these positions
            stress = -np.asarray(state.virial, np.float64)
        else:
            def attempt(_):  # positions still valid for the plan: an overflow grows and evaluates again
                _, _, stress, overflow, needed = evaluate(md.dist_model.model, state.rows, state.plan,
                                                          md.program(state), True)
                return stress, Needs.of_neighbors(overflow, needed)

            stress = md.dist_model.sizing.run_until_fits(attempt)
        sigma = np.asarray(stress, np.float64) / np.where(volume > 0, volume, 1.0)[:, None, None]
        out["pressure"] = 2 * ke / (3 * np.where(volume > 0, volume, 1.0)) - np.trace(sigma, axis1=1, axis2=2) / 3
    return out


def check_atom_terms(md) -> None:
    """Raise ValueError unless :meth:`atom_terms` can run on ``md`` (the halo strategy and a
    model with an ``atomic_energies`` output); observers call it before the first step."""
    model = md.dist_model.model
    if md.node_blocks:
        raise ValueError("per-atom virials are assigned through each rank's full neighbour list of its owned atoms "
                         "(the halo strategy); this DistributedModel runs node blocks (graph-parallel). Build it "
                         "with DomainConfig(strategy='halo') for atom_terms and HeatFlux")
    if "atomic_energies" not in model.model_config.outputs:
        raise ValueError(f"{type(model).__name__} has no 'atomic_energies' output; per-atom terms need it")


def atom_terms(md, state: MDState) -> dict:
    """Per-atom energies and virials of the owned rows, on the devices (nothing gathered).

    The model must output ``atomic_energies`` and see positions only through edge vectors.

    Args:
      md: the :class:`~jaxdd.dynamics.DomainParallel` running ``state``.
      state: its state.

    Returns:
      A dict of per-rank arrays laid out as ``state.rows`` ([P, n_owned, ...]):
      ``atomic_energies`` [P, n] eV and ``atomic_virials`` [P, n, 3, 3] eV (W_i, summing to
      the system's virial -dE/dε; :mod:`jaxdd.engine.virials`), zero on free rows.
    """
    model = md.dist_model.model
    check_atom_terms(md)
    static = md.dist_model.program(state.template.n_systems, ("energy", "atomic_energies", "forces"),
                                     state.layout)
    energies, virials = device_atom_terms(model, state.rows, state.plan, static)
    refuse_broken(virials, type(model).__name__, "atomic_virials")
    return dict(atomic_energies=energies, atomic_virials=virials)


def pair_weights(md, state: MDState) -> np.ndarray:
    """The cost per atom ``DomainConfig(balance_by="pairs")`` shares out: 1 + each atom's
    neighbour count within the model's search range, [V] in the batch's atom order,
    measured on the devices from the ranks' neighbour lists of ``state`` under ``md``."""
    counts = pair_counts(state.rows, state.plan, md.program(state))
    return 1.0 + atom_order(host_array(state.rows.ids), host_array(counts), state.template.n_atoms)


def print_thermo(step: int, thermo: dict) -> None:
    """Print one line per system of ``thermo`` (as :func:`thermo` returns it) at ``step``, on
    stdout, from one process: what :meth:`DomainParallel.run` logs by default.

    Args:
      step: the step number. thermo: the per-system values by name.
    """
    if jax.process_index() != 0:  # with several processes, one prints
        return
    keys = [k for k in ("potential_energy", "kinetic_energy", "total_energy", "temperature", "pressure", "volume",
                        "conserved") if k in thermo]
    for s in range(len(thermo["potential_energy"])):
        values = "  ".join(f"{k} {thermo[k][s]: .10g}" for k in keys)
        print(f"step {step:8d}  system {s}  {values}", file=sys.stdout, flush=True)
