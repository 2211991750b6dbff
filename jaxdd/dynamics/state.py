"""The state of a running simulation (an immutable pytree) and the statistics of a run."""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..engine.placed import Placed

__all__ = ["MDState", "RunStats"]


def _from_placed(name: str, doc: str) -> property:
    """A read-only property of :class:`MDState` that reads a field of its ``placed``.

    Args:
      name: the :class:`~jaxdd.engine.placed.Placed` field.
      doc: the property's docstring.

    Returns:
      the property.
    """
    return property(operator.attrgetter(f"placed.{name}"), doc=doc)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MDState:
    """A running simulation: an immutable pytree of device arrays (:meth:`replace` makes a
    changed copy; assigning a field raises).

    placed: the atoms on the ranks (:class:`~jaxdd.engine.placed.Placed`: their rows, the
    plan, the batch, the layout and the ghost shell the plan was built for). energy: [S] eV
    potential energy of the current positions. extra: the integrator's own state (a dict of
    per-system arrays, its keys the integrator's). virial: [S, 3, 3] eV, W = -dE/dε of the
    current positions (zeros unless the integrator reads it). step (static): steps taken.
    converged (static): a minimiser reached its force threshold. The current cell is
    ``template.cell`` (it moves under a barostat); ``plan.plan_cell`` is the cell the plan
    was built in.
    """

    placed: Placed
    energy: jax.Array
    extra: dict
    virial: jax.Array
    step: int = dataclasses.field(metadata=dict(static=True))
    converged: bool = dataclasses.field(default=False, metadata=dict(static=True))

    @classmethod
    def start(cls, placed: Placed, *, step: int, extra: dict, energy=None, virial=None,
              converged: bool = False) -> MDState:
        """A state of the atoms ``placed``, the rest placed replicated on their mesh.

        Args:
          placed: the :class:`~jaxdd.engine.placed.Placed` atoms.
          step: steps taken.
          extra: the integrator's own state.
          energy: [S] eV potential energy of the positions; None: zeros.
          virial: [S, 3, 3] eV; None: zeros.
          converged: a minimiser reached its force threshold.
        """
        t = placed.template
        dtype = t.positions.dtype
        replicated = NamedSharding(placed.plan.cell.sharding.mesh, P())
        energy = jnp.zeros(t.n_systems, dtype) if energy is None else energy
        virial = jnp.zeros((t.n_systems, 3, 3), dtype) if virial is None else virial
        return cls(placed=placed, energy=jax.device_put(energy, replicated), extra=jax.device_put(extra, replicated),
                   virial=jax.device_put(virial, replicated), step=step, converged=converged)

    def replace(self, **changes) -> MDState:
        """A copy with ``changes`` applied: field names of the state, or of its
        :class:`~jaxdd.engine.placed.Placed` (``rows``, ``plan``, ``template``, ``layout``,
        ``ghost_width``), which replace those of ``placed``."""
        moved = {k: changes.pop(k) for k in list(changes) if k in Placed.names()}
        if moved:
            changes["placed"] = changes.get("placed", self.placed).replace(**moved)
        return dataclasses.replace(self, **changes)

    rows = _from_placed("rows", "The per-rank rows ``[P, n_owned, ...]`` (:class:`~jaxdd.engine.placed.AtomRows`).")
    plan = _from_placed("plan", "The halo plan (:class:`~jaxdd.engine.placed.RankPlan`).")
    template = _from_placed("template", "The batch the run started from (a :class:`~jaxdd.data.Batch`), with the "
                            "current cell.")
    layout = _from_placed("layout", "The plan's static :class:`~jaxdd.decomposition.halo.HaloLayout`.")
    ghost_width = _from_placed("ghost_width", "The ghost shell (Å) the plan was built for (float or None).")
    arrays = _from_placed("rows", ':attr:`rows`, under its earlier name (``state.arrays["ids"]`` reads a row field).')
    fixed = _from_placed("plan", ':attr:`plan`, under its earlier name (``state.fixed["cell"]`` reads a plan field).')


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
