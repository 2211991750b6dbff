"""The state of a running simulation and the statistics of a run."""

from __future__ import annotations

import dataclasses

import jax

from ..data import Batch

__all__ = ["MDState", "RunStats", "Counters"]


@dataclasses.dataclass
class MDState:
    """A running simulation (host object holding device arrays).

    step: steps taken. energy: [S] eV potential energy of the current positions.
    converged: a minimiser reached its force threshold. ``arrays`` are the per-rank rows
    ([P, n_owned, ...]: ``positions`` in the plan's wrapped frame, ``image`` the lattice
    vectors wrapping removed, ``velocities``, ``forces``, ``ids`` global atom index or -1,
    ``system``, ``inv_mass``, ``reference`` the positions the plan was built from, and the
    atoms' ``atomic_numbers``, ``masses`` and ``charges``); ``fixed`` is the plan (routing,
    the local rows' batch, cell); ``layout`` its static shape; ``ghost_width`` (Å) the
    ghost shell the plan was built for, checked against the model before the plan is used.
    ``virial``: [S, 3, 3] eV, W = -dE/dε of the current positions (zeros unless the
    integrator reads it). The current cell is ``template.cell`` (it moves under a barostat);
    ``fixed["plan_cell"]`` is the cell the plan was built in.
    """

    step: int
    energy: jax.Array
    extra: dict
    arrays: dict
    fixed: dict
    template: Batch
    layout: object = None
    converged: bool = False
    ghost_width: float | None = None
    virial: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class RunStats:
    """The last :meth:`DomainParallel.run`: steps, wall seconds, atom-steps per second,
    plan rebuilds, atoms that migrated to another rank at those rebuilds, recompilations
    for capacity growth, the rebuilds that were planned on the host (the others ran on
    the devices), the times the blocks were cut again to balance the ranks
    (``DomainConfig(balance="dynamic")``; each is a host rebuild too), and the steps
    evaluated, discarded and taken again on a new plan (an atom outran the plan, or the
    model refused the positions on it; a rebuild the last step's move foresaw discards none)."""

    steps: int
    seconds: float
    atom_steps_per_second: float
    rebuilds: int
    migrations: int
    recompiles: int
    host_rebuilds: int = 0
    rebalances: int = 0
    discarded: int = 0


@dataclasses.dataclass
class Counters:
    """Events of a :class:`~jaxdd.dynamics.DomainParallel` since it was made (host counts):
    plan rebuilds, those planned on the host, atoms that migrated to another rank,
    rebalancings, and steps evaluated and discarded."""

    rebuilds: int = 0
    host_rebuilds: int = 0
    migrations: int = 0
    rebalances: int = 0
    discarded: int = 0
