"""``DomainParallel``: molecular dynamics and minimisation of a ``DistributedModel``.

Atoms stay on the rank that owns them between plan rebuilds. One jitted call runs many steps
in a ``while_loop`` inside ``shard_map``: every step replays the halo plan on the new
positions (ghosts refreshed by ``halo_forward``), evaluates the forces through the dispatch
and advances the owned atoms. After each step the ranks agree (``pmax``) on the largest
displacement since the plan was built; when it passes ``min(migration_hysteresis, skin/2)``
the ghost shell may no longer hold every neighbour, so that step is discarded and the loop
exits. The devices then migrate the atoms (each goes to the rank whose block holds it, over
``ppermute``) and every rank plans its halo again (:mod:`jaxdd.decomposition.replan`); the host reads a
few sizes, and plans itself only when the blocks changed beyond what the plan's exchanges
cover. The loop resumes from the discarded step. A plan with nothing to outrun (node
blocks; one rank that searches its periodic images itself) is kept: the loop runs through.
A neighbour list that overflows exits the same way: its capacity grows and the loop
compiles again. No step is ever taken on an incomplete halo.

The host is visited only at those events, at thermo and trajectory output, and when the
requested number of steps is done. Wrapping into the cell happens at rebuilds (on periodic
axes); between rebuilds positions move freely, and :meth:`DomainParallel.gather` returns
the continuous (unwrapped) trajectory in the batch's own atom order.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..checks import integral
from ..data import AtomicData, Batch, as_batch
from ..dispatch import DispatchReport
from ..neighbors.capacity import Capacities
from ..engine.distributed import DistributedModel
from ..engine.rank_program import neighbor_needs, neighbor_stats, rank_evaluate, rank_neighbors
from ..decomposition.halo import Exchange, HaloLayout, HaloRouting, halo_forward
from ..decomposition.ranks import on_ranks, place_ranked
from ..neighbors import NeighborCapacity
from ..decomposition.replan import ReplanConfig, frame_of, rank_replan
from ..virials import refuse_broken
from .integrators import INTEGRATORS, KB_EV_PER_K, RankState, StepContext, cell_map
from .io import ExtXYZWriter, Progress, host_array, read_md_arrays, read_md_json

__all__ = ["DomainParallel", "MDState", "RunStats"]

# Why the device loop stopped. _REBUILD: the step just taken outran the plan and was
# discarded; _AHEAD: the step was kept, and the next one, extrapolated, would outrun it.
_RUNNING, _REBUILD, _OVERFLOW, _CONVERGED, _NONFINITE, _AHEAD, _TOO_FAST = 0, 1, 2, 3, 4, 5, 6
_REPLICATED = ("cell", "system_mask", "plan_cell")  # the plan's entries every rank holds whole


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


class DomainParallel:
    """Dynamics of ``dist_model`` with ``integrator`` (VelocityVerlet, Langevin, FIRE,
    NoseHooverChain, MTKBarostat, or one added with :func:`register_integrator`).

    dist_model: a :class:`~jaxdd.DistributedModel` whose ``DomainConfig.skin`` is > 0 (the
    skin is what lets the halo plan be replayed for several steps), or one of the
    graph-parallel strategy (node blocks: atoms stay on their rank, nothing goes stale). kB: Boltzmann constant
    for the thermo temperature (energy per temperature unit): by default the integrator's
    (``Langevin(kB=...)``), else eV/K; 1 in Lennard-Jones reduced units.
    """

    def __init__(self, dist_model: DistributedModel, integrator, *, kB: float | None = None):
        if not isinstance(dist_model, DistributedModel):
            raise ValueError(f"dist_model must be a jaxdd.DistributedModel, got {type(dist_model).__name__}")
        if not isinstance(integrator, tuple(INTEGRATORS.values())):
            raise ValueError(f"integrator must be one of {sorted(INTEGRATORS)} (or a class added with "
                             f"jaxdd.register_integrator), got {integrator!r}")
        cfg = dist_model.config
        # Node blocks (the graph-parallel strategy) are blocks of atom indices: no atom ever
        # leaves its rank and no plan goes stale, whatever the atoms do.
        self.node_blocks = dist_model.strategy == "graph_partition"
        # One rank that searches the periodic images itself holds no ghost rows and owns every
        # atom: its plan has nothing an atom could outrun either. Rebuilding it only to wrap
        # positions would end the device loop (each call of it touches its buffers afresh,
        # ~0.2 s for a 1,000-atom NequIP step on a CPU); the search wraps positions itself.
        #: True when no plan goes stale, so the device loop never leaves for a rebuild.
        self.keeps_plan = self.node_blocks or (dist_model.periodic_search and int(cfg.mesh.size) == 1)
        threshold = min(cfg.migration_hysteresis, cfg.skin / 2)
        if not self.node_blocks and not threshold > 0:
            raise ValueError(
                f"DomainParallel needs DomainConfig.skin > 0 and migration_hysteresis > 0 (got skin {cfg.skin}, "
                f"hysteresis {cfg.migration_hysteresis}): atoms may move up to half the skin before the halo plan "
                "is rebuilt; e.g. DomainConfig(cutoff, skin=0.3 * cutoff / 2.5)"
            )
        own = getattr(integrator, "kB", None)
        if kB is None:
            kB = own if own is not None else KB_EV_PER_K
        if not (isinstance(kB, (int, float)) and math.isfinite(kB) and kB > 0):
            raise ValueError(f"kB must be a positive number (energy per temperature unit), got {kB!r}")
        if own is not None and own != kB:
            raise ValueError(f"kB = {kB} differs from the integrator's kB = {own}: one temperature scale drives both "
                             "the thermostat and the thermo; pass kB to the integrator only")
        self.dist_model = dist_model
        self.integrator = integrator
        self.kB = float(kB)
        self.threshold = math.inf if self.keeps_plan else float(threshold)
        #: The longest move one step may make, in Å: the same on one rank and on many (a run
        #: whose plan never goes stale checks it too, so a time step far too large is refused
        #: whatever the device count).
        self.step_limit = float(threshold) if threshold > 0 else math.inf
        # A model that declares a neighbour skin masks by its own cutoff, so its list can be
        # kept (Verlet list) until some atom has moved half that skin.
        self.nl_skin = float(dist_model.model.model_config.neighbor_config.skin)
        self.grid = cfg.grid
        self.last_run: RunStats | None = None
        self._rebuilds = 0
        self._host_rebuilds = 0
        self._migrations = 0
        self._recompiles = 0
        self._rebalances = 0
        self._discarded = 0
        self._frame = None
        self._cuts = None  # a balanced partition's block boundaries, kept between rebalancing
        self._weights = None  # measured cost per atom [V] the next balanced partition shares out

    # ------------------------------------------------------------------ set-up

    def init(self, data: AtomicData | Batch) -> MDState:
        """A state at step 0: velocities from ``data`` (else zero), masses from ``data`` (else
        the standard atomic masses of the elements, amu), forces evaluated."""
        batch = as_batch(data)
        self.dist_model.model.validate_input(batch)
        dtype = batch.positions.dtype
        if batch.masses is None:
            from ase.data import atomic_masses

            z = np.asarray(batch.atomic_numbers)
            masses = np.where(np.asarray(batch.atom_mask), atomic_masses[np.clip(z, 0, len(atomic_masses) - 1)], 1.0)
            batch = batch.replace(masses=jnp.asarray(masses, dtype))
        if batch.velocities is None:
            batch = batch.replace(velocities=jnp.zeros_like(batch.positions))
        positions = np.asarray(batch.positions, np.float64)
        self._cuts = self._weights = None  # a new system: balanced blocks are placed for its atoms
        state = self._place(batch, positions, np.asarray(batch.velocities), None, step=0,
                            extra=self.integrator.init(batch), energy=None)
        if self._by_pairs():  # blocks balanced by atoms first; then by the pairs they measured
            self._weights = self.pair_weights(state)
            self._cuts = None
            state = self._place(batch, positions, np.asarray(batch.velocities), None, step=0,
                                extra=state.extra, energy=None)
        return self._with_forces(state)

    def _by_pairs(self) -> bool:
        cfg = self.dist_model.config
        return cfg.balance is not None and cfg.balance_by == "pairs" and not self.node_blocks

    def pair_weights(self, state: MDState) -> np.ndarray:
        """The cost per atom ``DomainConfig(balance_by="pairs")`` shares out: 1 + each atom's
        neighbour count within the model's search range, [V] in the batch's atom order,
        measured on the devices from the ranks' neighbour lists now."""
        counts = _pair_counts(state.arrays, state.fixed, self._static(state))
        return 1.0 + self._global_rows(state, counts)

    def _global_rows(self, state: MDState, rows) -> np.ndarray:
        """Per-rank rows [P, n, ...] in the batch's atom order (float64)."""
        return _atom_order(host_array(state.arrays["ids"]), host_array(rows), state.template.n_atoms)

    def _place(self, template: Batch, positions, velocities, forces, *, step, extra, energy) -> MDState:
        """Partition ``positions`` ([N, 3] Å, unwrapped), plan the halo and lay the atoms out
        on the ranks (velocities and forces in the batch's order; forces None: zeros)."""
        dm = self.dist_model
        batch = template.replace(positions=jnp.asarray(positions, template.positions.dtype))
        before = None if dm.capacities is None else dm.capacities.halo
        part, plan = dm.plan(batch, grid=self.grid, cuts=self._cuts, weights=self._weights)
        self.grid = part.grid  # fixed after the first partition, so plans keep their shapes
        self._cuts = part.cuts
        if before is not None and dm.capacities.halo != before:
            self._recompiles += 1  # a grown halo capacity is a new program shape
        inputs, local_positions = dm.rank_inputs(batch, part, plan)
        if dm.capacities.neighbors is None:
            dm.capacities = dataclasses.replace(dm.capacities, neighbors=dm.size_neighbors(inputs, local_positions))
        n_owned = plan.layout.n_owned
        ids = plan.local_ids[:, :n_owned]
        valid = ids >= 0
        # Every real atom is owned by exactly one rank (of this process's ranks: by one of
        # them exactly when the partition says so).
        owned_count = np.bincount(ids[valid], minlength=batch.n_atoms)
        mine = np.isin(part.owner, plan.rank_ids) & np.asarray(batch.atom_mask)
        if np.any(owned_count[mine] != 1) or np.any(owned_count[~mine] != 0):
            bad = np.flatnonzero(np.where(mine, owned_count != 1, owned_count != 0))
            raise RuntimeError(f"atoms {bad[:8].tolist()} are owned by {owned_count[bad[:8]].tolist()} ranks after "
                               "partitioning; every atom must have exactly one owner")
        safe = np.where(valid, ids, 0)
        dtype = template.positions.dtype

        def owned(x, fill=0.0):  # host rows; placed below, each process sending only its own
            x = np.asarray(x)
            return np.asarray(np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[safe], fill), dtype)

        masses = np.asarray(template.masses, np.float64)
        arrays = dict(
            positions=inputs.own_pos,
            image=np.asarray(np.where(valid[..., None], part.wraps[safe], 0), np.int32),
            velocities=owned(velocities),
            forces=owned(np.zeros_like(positions) if forces is None else forces),
            ids=np.asarray(np.where(valid, ids, -1), np.int32),
            system=inputs.own_sys,
            inv_mass=owned(1.0 / masses),
            reference=inputs.own_pos,
            atomic_numbers=np.asarray(np.where(valid, np.asarray(template.atomic_numbers)[safe], 0), np.int32),
            masses=owned(masses, 1.0),
            **({"charges": owned(template.charges)} if template.charges is not None else {}),
        )
        fixed = {k: getattr(inputs, k) for k in ("local", "owned_rows", "routing", "cell", "system_mask")}
        fixed["plan_cell"] = fixed["cell"]
        energy = jnp.zeros(template.n_systems, dtype) if energy is None else energy
        # Placed as the loop returns them (per-rank rows on their device, the rest
        # replicated), so fresh, rebuilt and running states share one compiled program.
        mesh = dm.config.mesh
        replicated = NamedSharding(mesh, P())
        arrays = place_ranked(arrays, mesh, plan.ranks)
        fixed = {k: jax.device_put(v, replicated) if k in _REPLICATED else place_ranked(v, mesh, plan.ranks)
                 for k, v in fixed.items()}
        energy = jax.device_put(energy, replicated)
        extra = jax.device_put(extra, replicated)
        self._frame = jax.device_put(_frame(template, dm.ghost_width, self._cuts), replicated)
        if not dm.capacities.migrate:  # sized once; it grows when a rebuild needs more (a new program)
            dm.capacities = dataclasses.replace(dm.capacities, migrate=8 + n_owned // 8)
        return MDState(step=step, energy=energy, extra=extra, arrays=arrays, fixed=fixed, template=template,
                       layout=plan.layout, ghost_width=dm.ghost_width,
                       virial=jax.device_put(jnp.zeros((template.n_systems, 3, 3), dtype), replicated))

    def _with_forces(self, state: MDState) -> MDState:
        stress = bool(self.integrator.needs_virial)
        for _ in range(self._max_regrowths()):
            energy, forces, virial, overflow, needed = _evaluate(self.dist_model.model, state.arrays, state.fixed,
                                                                 self._static(state), stress)
            if not bool(overflow):
                state.arrays = {**state.arrays, "forces": forces}
                state.energy = energy
                if stress:
                    state.virial = -virial.astype(energy.dtype)
                return state
            self._grow(needed)
        raise RuntimeError("neighbour lists still overflowed after repeated capacity increases")

    def _static(self, state: MDState):
        return self.dist_model.program(state.template.n_systems, ("energy", "forces"), state.layout)

    def _reach(self):
        """For an integrator that moves the cell: (ghost width of the plans, the model's
        neighbour range) in Å, which bound how far the cell may shrink before a plan or a
        neighbour list is stale; None otherwise."""
        if not self.integrator.moves_cell:
            return None
        nc = self.dist_model.model.model_config.neighbor_config
        return (float(self.dist_model.ghost_width), float(nc.search_cutoff))

    def _max_regrowths(self) -> int:
        spec = self.dist_model.spec
        return spec.compile.max_regrowths if spec.compile is not None else 8

    def _grow(self, needed) -> None:
        self.dist_model.grow_neighbors(neighbor_stats(needed))
        self._recompiles += 1

    # ------------------------------------------------------------------ running

    def run(self, state: MDState, n_steps: int, *, thermo_every: int = 0, trajectory=None,
            trajectory_every: int = 0, progress: bool = False, log=None, observers=()) -> MDState:
        """Advance ``n_steps`` steps (fewer if a minimiser converges).

        thermo_every: print (or pass to ``log``) the thermo of every system every N steps
        (0: never). trajectory: an extxyz path or an :class:`ExtXYZWriter`; the gathered
        system is appended every ``trajectory_every`` steps (and at the start when the
        file is new). progress: a progress line with atom-steps per second on stderr.
        observers: objects with an ``every`` (int > 0) attribute, each called as
        ``observer(md, state)`` after every step that is a multiple of its ``every`` (a
        :class:`~jaxdd.dynamics.HeatFlux`, or one of yours); one with a ``check(md)`` method
        has it called before the first step, to refuse a run it cannot observe. The input
        state is not modified.
        """
        n_steps = _count("n_steps", n_steps)
        thermo_every = _count("thermo_every", thermo_every)
        trajectory_every = _count("trajectory_every", trajectory_every)
        if trajectory is not None and trajectory_every == 0:
            raise ValueError("a trajectory needs trajectory_every > 0 (steps between frames)")
        observers = tuple(observers)
        for i, obs in enumerate(observers):
            every = getattr(obs, "every", None)
            if not callable(obs) or isinstance(every, bool) or not isinstance(every, int) or every <= 0:
                raise ValueError(f"observers[{i}] must be callable as observer(md, state) and have an int attribute "
                                 f"every > 0 (steps between calls); got {obs!r}")
            if callable(getattr(obs, "check", None)):
                obs.check(self)  # before any step runs
        writer = ExtXYZWriter(trajectory) if isinstance(trajectory, (str, Path)) else trajectory
        log = log if log is not None else _print_thermo
        rebalance_every = self.dist_model.config.balance_every if self.dist_model.config.balance == "dynamic" else 0
        marks = [m for m in (thermo_every, trajectory_every, rebalance_every, *(o.every for o in observers)) if m]
        show = progress and jax.process_index() == 0
        bar = Progress(n_steps, int(np.asarray(state.template.atom_mask).sum())) if show else None
        rebuilds0, recompiles0, migrations0, host0, rebalances0, discarded0 = (
            self._rebuilds, self._recompiles, self._migrations, self._host_rebuilds, self._rebalances,
            self._discarded)
        start, done = time.perf_counter(), 0
        state = self._fitting(dataclasses.replace(state))
        if writer is not None and writer.frames == 0:
            writer.write(self, state)
        while done < n_steps and not state.converged:
            # Run to the next output step (a multiple of thermo_every / trajectory_every).
            targets = [state.step + m - state.step % m for m in marks] + [state.step + n_steps - done]
            chunk = min(targets) - state.step
            before = state.step
            state = self._advance(state, chunk)
            done += state.step - before
            if rebalance_every and state.step % rebalance_every == 0 and state.step != before:
                state = self._rebalance(state)
            if thermo_every and (state.step % thermo_every == 0 or state.converged):
                log(state.step, self.thermo(state))
            if writer is not None and (state.step % trajectory_every == 0 or state.converged):
                writer.write(self, state)
            for obs in observers:
                if state.step % obs.every == 0:
                    obs(self, state)
            if bar is not None:
                bar.update(done)
        jax.block_until_ready(state.arrays["positions"])
        seconds = time.perf_counter() - start
        n_atoms = int(np.asarray(state.template.atom_mask).sum())
        self.last_run = RunStats(done, seconds, done * n_atoms / seconds if seconds > 0 else 0.0,
                                 self._rebuilds - rebuilds0, self._migrations - migrations0,
                                 self._recompiles - recompiles0, self._host_rebuilds - host0,
                                 self._rebalances - rebalances0, self._discarded - discarded0)
        if bar is not None:
            bar.close(self.last_run)
        return state

    def lower(self, state: MDState, n_steps: int = 1):
        """The lowered XLA program (a ``jax.stages.Lowered``) that advances ``state`` on the
        devices, the one :meth:`run` calls between plan rebuilds: for analysis
        (``.compile().cost_analysis()``, ``.memory_analysis()``, ``.as_text()``), not to call.
        Its loop body is one step, which XLA's cost analysis counts once: the flops and bytes
        of a step on one rank. n_steps: the loop's bound (a traced value)."""
        return _loop.lower(
            self.dist_model.model, state.arrays, state.energy, state.extra, state.virial, state.fixed,
            jnp.asarray(state.step, jnp.int32), jnp.asarray(_count("n_steps", n_steps), jnp.int32),
            self._static(state), self.integrator, self.threshold, self.step_limit, self.nl_skin,
            self._reach()).lowered

    def _advance(self, state: MDState, n: int) -> MDState:
        """Take ``n`` steps, leaving the device only to rebuild plans and grow capacities."""
        regrowths, fresh = 0, False
        while n > 0 and not state.converged:
            arrays, energy, extra, cell, virial, taken, reason, needed = _loop(
                self.dist_model.model, state.arrays, state.energy, state.extra, state.virial, state.fixed,
                jnp.asarray(state.step, jnp.int32), jnp.asarray(n, jnp.int32), self._static(state), self.integrator,
                self.threshold, self.step_limit, self.nl_skin, self._reach())
            taken = int(taken)
            reason = int(reason)
            state.arrays, state.energy, state.extra, state.virial = arrays, energy, extra, virial
            if self.integrator.moves_cell:
                state.fixed = {**state.fixed, "cell": cell}
                state.template = state.template.replace(cell=cell)
            state.step += taken
            n -= taken
            if reason == _CONVERGED:
                state.converged = True
            elif reason == _TOO_FAST:
                raise RuntimeError(
                    f"step {state.step + 1} would move an atom more than {self.step_limit:.4g} Å (half the skin, or "
                    "DomainConfig.migration_hysteresis) in one step: the time step is too large for these "
                    f"velocities and forces ({type(self.integrator).__name__}.dt = "
                    f"{getattr(self.integrator, 'dt', '?')}); reduce dt, or raise DomainConfig.skin if the "
                    "steps are meant to be this long")
            elif reason == _OVERFLOW:
                regrowths += 1
                if regrowths > self._max_regrowths():
                    raise RuntimeError("neighbour lists still overflowed after repeated capacity increases")
                self._grow(needed)
            elif reason in (_REBUILD, _NONFINITE, _AHEAD):
                # A stale halo, or a step a model refused on this plan (the distributed PME mesh
                # answers NaN for atoms that drifted past it): both ask for a new plan, as does a
                # next step that would outrun it (_AHEAD: this step was kept, none discarded).
                if reason != _AHEAD and taken == 0 and fresh:
                    raise RuntimeError(
                        f"an atom moved more than {self.threshold:.4g} Å (half the skin) in one step from a fresh "
                        "plan; the time step is too large for the skin: reduce dt or raise DomainConfig.skin"
                        if reason == _REBUILD else
                        f"the step is not finite at step {state.step + 1} (energy, forces, positions, "
                        "velocities, cell or the integrator's state), on a plan built from the step before: the model failed on these positions "
                        "(atoms too close? a time step too large?); the state passed to run() is unchanged")
                self._discarded += int(reason != _AHEAD)
                state = self._rebuild(state)
                fresh = True
                continue
            fresh = fresh and taken == 0
        return state

    def _rebuild(self, state: MDState) -> MDState:
        """Migrate atoms to the ranks whose blocks hold them now and rebuild the halo plan, on
        the devices. Capacities that no longer fit grow (a new program); the host plans only
        when the blocks have changed shape beyond what the plan's exchanges cover. Node
        blocks are planned again on the host (their blocks never change)."""
        self._rebuilds += 1
        if self.node_blocks:
            return self._rebuild_on_host(state)
        dm = self.dist_model
        mesh = dm.config.mesh
        layout = state.layout
        if self.integrator.moves_cell:  # blocks follow the cell: the frame of the cell now
            self._frame = jax.device_put(_frame(state.template, dm.ghost_width, self._cuts), NamedSharding(mesh, P()))
        for _ in range(self._max_regrowths() + 1):
            # Rows padded to the layout's, so a grown layout compiles one program, not two.
            arrays = _padded(state.arrays, layout.n_owned, mesh)
            cfg = ReplanConfig(layout=layout, n_migrate=dm.capacities.migrate, n_systems=state.template.n_systems,
                               axes=tuple(mesh.axis_names))
            arrays, plan, report = _replanned(arrays, state.fixed["cell"], state.fixed["system_mask"], self._frame,
                                              cfg, mesh, _carried(state.fixed["local"]), state.fixed["local"].pbc)
            report = jax.tree_util.tree_map(np.asarray, report)
            if bool(report["far"]) or bool(report["hops"]):
                return self._rebuild_on_host(state)
            needed = (int(report["owned"]), tuple(int(n) for n in report["exchange"]))
            fits = needed[0] <= layout.n_owned and all(n <= e.capacity for n, e in zip(needed[1], layout.exchanges))
            if fits and int(report["migrate"]) <= dm.capacities.migrate:
                self._migrations += int(report["migrated"])
                plan["plan_cell"] = state.fixed["cell"]
                return dataclasses.replace(state, arrays=arrays, fixed={**state.fixed, **plan}, layout=layout,
                                           ghost_width=dm.ghost_width)  # the width self._frame plans
            have = Capacities(layout.n_owned, tuple(e.capacity for e in layout.exchanges), migrate=dm.capacities.migrate)
            grown = have.grown(dm.growth_factor, owned=needed[0], exchange=needed[1], migrate=int(report["migrate"]))
            dm.capacities = dataclasses.replace(dm.capacities, owned=grown.owned, exchange=grown.exchange,
                                                migrate=grown.migrate)
            layout = _with_capacities(layout, grown)
            self._recompiles += 1
        raise RuntimeError("the halo plan still overflowed after repeated capacity increases")

    def _rebalance(self, state: MDState) -> MDState:
        """Cut the blocks again where the atoms are now (each an equal share along each axis)
        and plan on the host; the step and the dynamics are unchanged."""
        self._rebalances += 1
        self._rebuilds += 1
        self._cuts = None  # the next partition places them afresh
        self._weights = self.pair_weights(state) if self._by_pairs() else None
        return self._rebuild_on_host(state)

    def _fitting(self, state: MDState) -> MDState:
        """``state`` on a plan that holds every neighbour of this model: a plan built for a
        narrower ghost shell (another run's state, a checkpoint, a model since changed) is
        planned again on the host, and its forces evaluated with this model."""
        dm = self.dist_model
        if dm.ghost_width_covers(state.ghost_width):
            return state
        self._rebuilds += 1
        return self._with_forces(self._rebuild_on_host(state))

    def _rebuild_on_host(self, state: MDState) -> MDState:
        """The plan computed on the host from the gathered atoms (a partition afresh)."""
        self._host_rebuilds += 1
        positions, velocities, forces = self._global(state, "positions", "velocities", "forces")
        before = _rank_of_atom(state)
        new = self._place(state.template, positions, velocities, forces, step=state.step, extra=state.extra,
                          energy=state.energy)
        new.converged = state.converged
        new.virial = state.virial
        self._migrations += int(np.sum(_rank_of_atom(new) != before))
        return new

    def _global(self, state: MDState, *keys, unwrap: bool = True):
        """Per-rank arrays in the batch's atom order, float64 numpy (a collective with several
        processes). Positions are unwrapped, or with ``unwrap=False`` exactly the plan's frame."""
        t = state.template
        ids = host_array(state.arrays["ids"])
        out = []
        for key in keys:
            value = _atom_order(ids, host_array(state.arrays[key]), t.n_atoms)
            if key == "positions":
                image = _atom_order(ids, host_array(state.arrays["image"]), t.n_atoms) if unwrap else None
                value = _positions(t, value, image)
            out.append(value)
        return out

    # ------------------------------------------------------------------ results

    def gather(self, state: MDState) -> Batch:
        """The system now, as a Batch in the original atom order (positions unwrapped)."""
        positions, velocities = self._global(state, "positions", "velocities")
        dtype = state.template.positions.dtype
        return state.template.replace(positions=jnp.asarray(positions, dtype), velocities=jnp.asarray(velocities, dtype))

    def forces(self, state: MDState) -> np.ndarray:
        """Forces [V, 3] eV/Å on the current positions, in the original atom order."""
        return self._global(state, "forces")[0]

    def thermo(self, state: MDState) -> dict:
        """Per-system thermodynamics, numpy [S]: ``potential_energy``, ``kinetic_energy``,
        ``total_energy`` (eV), ``temperature`` (2 KE / (dof kB), dof = 3N - 3), ``conserved``
        (eV: the total energy plus the thermostat's and barostat's own, the quantity the
        integrator conserves; absent for Langevin and FIRE) and, when every system has a cell
        of non-zero volume, ``volume`` (Å³) and ``pressure`` (eV/Å³: 2 KE / 3V - tr(σ) / 3, σ
        the potential stress)."""
        t = state.template
        n_sys = t.n_systems
        # Reduced on the devices: no process gathers the velocities.
        ke, counts = (host_array(x) for x in _kinetic(state.arrays, n_sys))
        ke = ke.astype(np.float64)
        dof = np.maximum(3 * counts - 3, 1)
        pe = np.asarray(state.energy, np.float64)
        out = dict(potential_energy=pe, kinetic_energy=ke, total_energy=pe + ke, temperature=2 * ke / (dof * self.kB))
        own = getattr(self.integrator, "energy", None)
        if own is not None:
            out["conserved"] = pe + ke + np.asarray(own(state.extra, counts, t.cell), np.float64)
        volume = np.abs(np.linalg.det(np.asarray(t.cell, np.float64)))
        if np.all(volume[np.asarray(t.system_mask)] > 0):
            out["volume"] = volume
            if self.integrator.needs_virial:  # the state carries the virial of these positions
                stress = -np.asarray(state.virial, np.float64)
            else:
                _, _, stress, overflow, _ = _evaluate(self.dist_model.model, state.arrays, state.fixed,
                                                      self._static(state), True)
                if bool(overflow):  # positions still valid for the plan: grow and evaluate again
                    state = self._with_forces(state)
                    _, _, stress, _, _ = _evaluate(self.dist_model.model, state.arrays, state.fixed,
                                                   self._static(state), True)
            sigma = np.asarray(stress, np.float64) / np.where(volume > 0, volume, 1.0)[:, None, None]
            out["pressure"] = 2 * ke / (3 * np.where(volume > 0, volume, 1.0)) - np.trace(sigma, axis1=1, axis2=2) / 3
        return out

    def check_atom_terms(self) -> None:
        """Raise ValueError unless :meth:`atom_terms` can run here (the halo strategy and a
        model with an ``atomic_energies`` output); observers call it before the first step."""
        model = self.dist_model.model
        if self.node_blocks:
            raise ValueError("per-atom virials are assigned through each rank's full neighbour list of its owned atoms "
                             "(the halo strategy); this DistributedModel runs node blocks (graph-parallel). Build it "
                             "with DomainConfig(strategy='halo') for atom_terms and HeatFlux")
        if "atomic_energies" not in model.model_config.outputs:
            raise ValueError(f"{type(model).__name__} has no 'atomic_energies' output; per-atom terms need it")

    def atom_terms(self, state: MDState) -> dict:
        """Per-atom energies and virials of the owned rows, on the devices (nothing gathered).

        Returns a dict of per-rank arrays laid out as ``state.arrays`` ([P, n_owned, ...]):
        ``atomic_energies`` [P, n] eV and ``atomic_virials`` [P, n, 3, 3] eV (W_i, summing to
        the system's virial -dE/dε; :mod:`jaxdd.virials`), zero on free rows. The model
        must output ``atomic_energies`` and see positions only through edge vectors.
        """
        model = self.dist_model.model
        self.check_atom_terms()
        static = self.dist_model.program(state.template.n_systems, ("energy", "atomic_energies", "forces"),
                                         state.layout)
        energies, virials = _atom_terms(model, state.arrays, state.fixed, static)
        refuse_broken(virials, type(model).__name__, "atomic_virials")
        return dict(atomic_energies=energies, atomic_virials=virials)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path, state: MDState) -> Path:
        """Write ``state`` to the folder ``path`` (orbax arrays + ``md.json`` + ``spec.json``).

        Stored as the ranks hold it, each process writing its own devices' rows (nothing is
        gathered): the per-rank atom arrays, the halo plan and its layout, the energy, the
        integrator and its state (random streams are keyed by seed and step), capacities,
        the batch the run started from and the spec. Never overwrites.
        """
        import orbax.checkpoint as ocp

        path = Path(path).absolute()
        if path.exists() and any(path.iterdir()):
            raise FileExistsError(f"checkpoint folder {path} is not empty; choose a new path")
        _barrier("jaxdd.save.checked")  # every process has looked before any writes
        path.mkdir(parents=True, exist_ok=True)
        t = state.template
        tree = dict(
            ranked={**state.arrays, **_flat_plan(state.fixed)}, energy=state.energy, extra=state.extra,
            plan_cell=state.fixed["plan_cell"], virial=state.virial,
            **({"cuts": np.asarray(self._cuts)} if self._cuts is not None else {}),
            template={k: np.asarray(v) for k, v in _batch_fields(t).items()},
        )
        tree, empty = _without_empty(tree)
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(path / "arrays", tree)
        checkpointer.wait_until_finished()
        dm = self.dist_model
        meta = dict(
            step=state.step, converged=state.converged, dtype=str(np.dtype(t.positions.dtype)),
            integrator={"kind": type(self.integrator).__name__, **dataclasses.asdict(self.integrator)},
            n_ranks=dm.config.n_ranks, grid=list(self.grid), layout=_layout_json(state.layout),
            halo_capacity=[dm.capacities.owned, list(dm.capacities.exchange)], n_migrate=dm.capacities.migrate,
            nl_capacity=dataclasses.asdict(dm.capacities.neighbors), extra=sorted(state.extra),
            ghost_width=state.ghost_width, model=_fingerprint(dm.model), empty=empty,
        )
        if jax.process_index() == 0:  # orbax coordinates the arrays; the small files need one writer
            (path / "md.json").write_text(json.dumps(meta, indent=1))
            dm.spec.save(path / "spec.json")
        _barrier("jaxdd.save.done")
        return path

    def restore(self, path) -> MDState:
        """The state saved at ``path``. On the rank grid it was saved from, every rank reads
        back its own rows and plan, so the run continues bit for bit; on another, the saved
        atoms are read whole and partitioned afresh (the trajectory then agrees to round-off).
        A damaged checkpoint raises :class:`jaxdd.CheckpointError` naming the file at fault."""
        path = Path(path).absolute()
        meta, saved = read_md_json(path, INTEGRATORS)  # CheckpointError naming a damaged file
        if saved != self.integrator:
            raise ValueError(f"the checkpoint was written with {saved!r}, this DomainParallel runs {self.integrator!r}; "
                             "restore it with the same integrator")
        dm = self.dist_model
        if np.dtype(meta["dtype"]) == np.float64 and not jax.config.jax_enable_x64:
            raise ValueError(f"{path} holds a float64 run but JAX runs in float32 here; enable float64 before "
                             "restoring: jax.config.update('jax_enable_x64', True)")
        mesh = dm.config.mesh
        same = meta["n_ranks"] == dm.config.n_ranks and (dm.config.grid is None or list(dm.config.grid) == meta["grid"])
        ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
        replicated = NamedSharding(mesh, P())
        sharding_of = (lambda group: ranked if group == "ranked" and same else replicated)  # noqa: E731
        a = _with_empty(read_md_arrays(path / "arrays", sharding_of), meta.get("empty", {}), sharding_of)
        dtype = np.dtype(meta["dtype"])
        fields = {k: np.asarray(v) for k, v in a["template"].items()}
        template = Batch.unchecked(**{k: jnp.asarray(fields[k], dtype) if k in _FLOAT_FIELDS else jnp.asarray(fields[k])
                                      for k in fields}, **{k: None for k in _OPTIONAL_FIELDS if k not in fields},
                                   velocities=None, neighbors=None)
        extra = dict(a["extra"])
        energy = a["energy"]
        dm.model.validate_input(template)  # the saved atoms' species and fields suit this model
        # A balanced run's cuts fit its own grid; on another one the blocks are placed afresh.
        self._cuts = np.asarray(a["cuts"], np.float64) if "cuts" in a and same else None
        if same:
            self.grid = tuple(meta["grid"])
            dm.capacities = Capacities(
                owned=meta["halo_capacity"][0], exchange=meta["halo_capacity"][1], migrate=meta["n_migrate"],
                neighbors=NeighborCapacity(**{k: (tuple(v) if isinstance(v, list) else v)
                                              for k, v in meta["nl_capacity"].items()}))
            self._frame = jax.device_put(_frame(template, dm.ghost_width, self._cuts), replicated)
            arrays, fixed = _unflat_plan(a["ranked"], template, replicated)
            if "plan_cell" in a:
                fixed["plan_cell"] = jax.device_put(np.asarray(a["plan_cell"]), replicated)
            state = MDState(step=meta["step"], energy=energy, extra=extra, arrays=arrays, fixed=fixed,
                            template=template, layout=_layout_of(meta["layout"]), ghost_width=meta.get("ghost_width"),
                            virial=a["virial"] if "virial" in a else jax.device_put(
                                np.zeros((template.n_systems, 3, 3), dtype), replicated))
        else:
            held = {k: np.asarray(v) for k, v in a["ranked"].items()}
            n = template.n_atoms
            atoms = {k: _atom_order(held["ids"], held[k], n) for k in ("positions", "image", "velocities", "forces")}
            positions = _positions(template, atoms["positions"], atoms["image"])
            state = self._place(template, positions, atoms["velocities"], atoms["forces"], step=meta["step"],
                                extra=extra, energy=energy)
            if a.get("virial") is not None:
                state.virial = jax.device_put(np.asarray(a["virial"]), replicated)
        state.converged = bool(meta["converged"])
        if meta.get("model") != _fingerprint(dm.model):
            # Another model (weights, cutoff) than the one that wrote the checkpoint: its plan is
            # checked (planned again if too narrow) and its energy and forces are this model's.
            fitting = self._fitting(state)
            state = fitting if fitting is not state else self._with_forces(state)
        return state


def _fingerprint(model) -> dict:
    """What identifies a model in a checkpoint: its class, neighbour range and a digest of
    its array leaves (its weights)."""
    import hashlib

    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(model):
        if isinstance(leaf, (jax.Array, np.ndarray)):
            a = np.asarray(leaf)
            digest.update(f"{a.dtype}{a.shape}".encode())
            digest.update(np.ascontiguousarray(a).tobytes())
        elif isinstance(leaf, (bool, int, float, str)):
            digest.update(repr(leaf).encode())
    nc = model.model_config.neighbor_config
    return dict(kind=type(model).__name__, search_cutoff=None if nc is None else float(nc.search_cutoff),
                digest=digest.hexdigest())


_OPTIONAL_FIELDS = ("charges", "masses")
_FLOAT_FIELDS = ("positions", "cell", "charges", "masses")


def _batch_fields(batch: Batch) -> dict:
    """The batch's arrays by field name (absent optional fields, velocities and the neighbour
    list left out)."""
    names = ("positions", "atomic_numbers", "cell", "pbc", "batch_idx", "ptr", "atom_mask", "system_mask",
             *_OPTIONAL_FIELDS)
    return {k: getattr(batch, k) for k in names if getattr(batch, k) is not None}


def _without_empty(tree: dict) -> tuple[dict, dict]:
    """(``tree`` without its arrays of no elements, ``{"group/name": [shape, dtype]}`` of them).
    Orbax cannot save an empty array, and a plan with nothing to send (one rank, node
    blocks) has empty routing tables; they are written as their shape and dtype."""
    kept, empty = {}, {}
    for group, value in tree.items():
        if isinstance(value, dict):
            kept[group] = {}
            for name, x in value.items():
                if np.size(x) == 0:
                    empty[f"{group}/{name}"] = [list(np.shape(x)), str(np.dtype(x.dtype))]
                else:
                    kept[group][name] = x
        elif np.size(value) == 0:
            empty[group] = [list(np.shape(value)), str(np.dtype(value.dtype))]
        else:
            kept[group] = value
    return kept, empty


def _with_empty(arrays: dict, empty: dict, sharding_of) -> dict:
    """``arrays`` read back with the empty ones :func:`_without_empty` took out put back,
    each placed with ``sharding_of(group)``."""
    arrays = {k: dict(v) if isinstance(v, dict) else v for k, v in arrays.items()}
    for key, (shape, dtype) in empty.items():
        group, _, name = key.partition("/")
        x = jax.device_put(np.zeros(shape, np.dtype(dtype)), sharding_of(group))
        if name:
            arrays.setdefault(group, {})[name] = x
        else:
            arrays[group] = x
    return arrays


def _flat_plan(fixed: dict) -> dict:
    """The per-rank arrays of a plan by flat name (cell and system mask come from the batch)."""
    out = {f"local__{k}": v for k, v in _batch_fields(fixed["local"]).items()}
    if fixed["local"].velocities is not None:
        out["local__velocities"] = fixed["local"].velocities
    out.update({f"routing__{f.name}": getattr(fixed["routing"], f.name)
                for f in dataclasses.fields(fixed["routing"])})
    out["owned_rows"] = fixed["owned_rows"]
    return out


def _unflat_plan(ranked: dict, template: Batch, replicated) -> tuple[dict, dict]:
    """(atom arrays, plan) from :func:`_flat_plan`'s names, as :meth:`DomainParallel._place` lays them out."""
    arrays = {k: v for k, v in ranked.items() if "__" not in k and k != "owned_rows"}
    local = {k[len("local__"):]: v for k, v in ranked.items() if k.startswith("local__")}
    local = Batch.unchecked(**local, **{k: None for k in (*_OPTIONAL_FIELDS, "velocities") if k not in local},
                            neighbors=None)
    routing = HaloRouting(**{k[len("routing__"):]: v for k, v in ranked.items() if k.startswith("routing__")})
    cell = jax.device_put(np.asarray(template.cell), replicated)
    fixed = dict(local=local, owned_rows=ranked["owned_rows"], routing=routing, cell=cell, plan_cell=cell,
                 system_mask=jax.device_put(np.asarray(template.system_mask), replicated))
    return arrays, fixed


def _layout_json(layout: HaloLayout) -> dict:
    return dict(grid=list(layout.grid), n_owned=layout.n_owned,
                exchanges=[dict(axis=e.axis, direction=e.direction, hop=e.hop, pairs=[list(p) for p in e.pairs],
                                offset=e.offset, capacity=e.capacity) for e in layout.exchanges])


def _layout_of(data: dict) -> HaloLayout:
    return HaloLayout(grid=tuple(data["grid"]), n_owned=data["n_owned"], exchanges=tuple(
        Exchange(e["axis"], e["direction"], e["hop"], tuple(tuple(p) for p in e["pairs"]), e["offset"], e["capacity"])
        for e in data["exchanges"]))


def _with_capacities(layout: HaloLayout, capacities: Capacities) -> HaloLayout:
    """``layout`` with the owned rows and exchange slots of ``capacities``."""
    exchanges, offset = [], 0
    for ex, cap in zip(layout.exchanges, capacities.exchange):
        exchanges.append(dataclasses.replace(ex, offset=offset, capacity=cap))
        offset += cap
    return dataclasses.replace(layout, n_owned=capacities.owned, exchanges=tuple(exchanges))


def _frame(template: Batch, ghost_width: float, cuts=None):
    """The partition frame, in float64 where JAX has it (the host partition's precision)."""
    return frame_of(template.cell, template.pbc, ghost_width, np.float64 if jax.config.jax_enable_x64 else np.float32,
                    cuts)


def _padded(arrays: dict, n_owned: int, mesh) -> dict:
    """Per-rank rows ``[P, n, ...]`` padded to ``n_owned`` rows (free rows: id -1)."""
    n = arrays["ids"].shape[1]
    if n == n_owned:
        return arrays
    ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    pad = jax.jit(lambda a: {k: jnp.pad(v, [(0, 0), (0, n_owned - n)] + [(0, 0)] * (v.ndim - 2),
                                        constant_values=-1 if k == "ids" else 0) for k, v in a.items()},
                  out_shardings=ranked)
    return pad(arrays)


def _atom_order(ids, rows, n_atoms: int) -> np.ndarray:
    """Per-rank rows ``[P, n, ...]`` (atom ``ids`` [P, n], -1 on free rows) in the batch's atom
    order, float64 ``[n_atoms, ...]`` (zeros for atoms no row holds)."""
    ids = np.asarray(ids).reshape(-1)
    rows = np.asarray(rows, np.float64).reshape((ids.size,) + np.shape(rows)[2:])
    out = np.zeros((n_atoms,) + rows.shape[1:])
    out[ids[ids >= 0]] = rows[ids >= 0]
    return out


def _positions(template: Batch, frame, image=None) -> np.ndarray:
    """Positions [V, 3] Å from the plan's frame, unwrapped by the lattice ``image`` of each
    atom when given; padding rows keep the batch's own positions."""
    if image is not None:
        cell = np.asarray(template.cell, np.float64)
        system = np.clip(np.asarray(template.batch_idx), 0, cell.shape[0] - 1)
        frame = frame + np.einsum("vi,vij->vj", image, cell[system])
    return np.where(np.asarray(template.atom_mask)[:, None], frame, np.asarray(template.positions, np.float64))


def _rank_of_atom(state: MDState) -> np.ndarray:
    """The rank owning each atom of the batch, [V] (-1: padding)."""
    ids = host_array(state.arrays["ids"])
    out = np.full(state.template.n_atoms, -1)
    rank, row = np.nonzero(ids >= 0)
    out[ids[rank, row]] = rank
    return out


def _barrier(name: str) -> None:
    """Wait for every process (nothing with one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@functools.partial(jax.jit, static_argnums=1)
def _kinetic(arrays, n_sys: int):
    """(kinetic energy [S] in the widest float enabled, real atoms [S]) of the owned rows."""
    valid = arrays["ids"] >= 0
    wide = jnp.promote_types(arrays["velocities"].dtype, jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    v = arrays["velocities"].astype(wide)
    inv = arrays["inv_mass"].astype(wide)
    mv2 = jnp.where(valid, jnp.sum(v * v, axis=-1) / jnp.where(valid, inv, 1.0), 0.0)
    system = jnp.where(valid, arrays["system"], n_sys).reshape(-1)
    ke = 0.5 * jnp.zeros(n_sys + 1, wide).at[system].add(mv2.reshape(-1))[:n_sys]
    counts = jnp.zeros(n_sys + 1, jnp.int32).at[system].add(valid.reshape(-1).astype(jnp.int32))[:n_sys]
    return ke, counts


def _count(name, value) -> int:
    return integral(name, value, minimum=0)


def _print_thermo(step: int, thermo: dict) -> None:
    if jax.process_index() != 0:  # with several processes, one prints
        return
    keys = [k for k in ("potential_energy", "kinetic_energy", "total_energy", "temperature", "pressure", "volume",
                        "conserved") if k in thermo]
    for s in range(len(thermo["potential_energy"])):
        values = "  ".join(f"{k} {thermo[k][s]: .10g}" for k in keys)
        print(f"step {step:8d}  system {s}  {values}", file=sys.stdout, flush=True)


# ---------------------------------------------------------------------- device programs


def _split(fixed):
    """(the plan's per-rank arrays, the cell and system mask the same on every rank)."""
    return {k: fixed[k] for k in ("local", "owned_rows", "routing")}, (fixed["cell"], fixed["system_mask"])


def rank_forces(model, f, own_pos, own_sys, static, report, neighbors=None, virial=False):
    """(forces [n_owned, 3] eV/Å, energy [S] eV, neighbour list, virial) of one rank. A model
    that computes its forces itself (a kernel's direct forces: "forces" is an output and not
    an autograd output) is taken at its word, which costs one pass instead of a forward and a
    backward one; otherwise forces are minus the gradient of the energy. With ``virial`` the
    virial W = -dE/dε [S, 3, 3] eV summed over ranks comes too (from the strain gradient;
    None otherwise)."""
    direct = "forces" not in static.autograd and not virial
    per_system, out, _, nl, g_pos, g_strain, _ = rank_evaluate(
        model, f["local"], own_pos, own_sys, f["owned_rows"], f["routing"], f["cell"], f["system_mask"], static,
        report, forces=not direct, stress=virial, neighbors=neighbors)
    forces = out["forces"][:static.layout.n_owned] if direct else -g_pos
    w = -jax.lax.psum(g_strain, static.axes).astype(per_system.dtype) if virial else None
    return forces, per_system, nl, w


@eqx.filter_jit
def _evaluate(model, arrays, fixed, static, stress):
    """(energy [S], forces [P, n_owned, 3], dE/dε summed [S, 3, 3] or 0, overflow, needed)."""
    params, rest = eqx.partition(model, eqx.is_array)
    axes = static.axes
    report = DispatchReport(policy=static.spec.policy)

    def rank_fn(a, f, params, cell, system_mask):
        model = eqx.combine(params, rest)
        f = dict(f, cell=cell, system_mask=system_mask)
        forces, per_system, nl, w = rank_forces(model, f, a["positions"], a["system"], static, report, virial=stress)
        virial = -w if stress else jnp.zeros(())
        overflow, needed = neighbor_needs(nl, axes)
        return per_system, forces, virial, overflow, needed

    ranked, replicated = _split(fixed)
    return on_ranks(rank_fn, static.mesh, ranked=(arrays, ranked), replicated=(params, *replicated),
                    replicated_out=(True, False, True, True, True))


@eqx.filter_jit
def _pair_counts(arrays, fixed, static):
    """Neighbours of every owned row within the model's search cutoff, [P, n_owned]."""
    def rank_fn(a, f, cell, system_mask):
        f = dict(f, cell=cell, system_mask=system_mask)
        positions = halo_forward(a["positions"], static.layout, f["routing"], static.axes, cell=cell)
        nl = rank_neighbors(positions, f["local"], static, cell=cell, routing=f["routing"])
        n_local = positions.shape[0]
        counts = jax.ops.segment_sum(nl.mask.astype(jnp.int32), jnp.where(nl.mask, nl.receivers, n_local),
                                     num_segments=n_local + 1)
        return jnp.where(a["ids"] >= 0, counts[:static.layout.n_owned], 0)

    ranked, replicated = _split(fixed)
    return on_ranks(rank_fn, static.mesh, ranked=(arrays, ranked), replicated=replicated)


@eqx.filter_jit
def _atom_terms(model, arrays, fixed, static):
    """(atomic energies [P, n_owned], atomic virials [P, n_owned, 3, 3]) of the owned rows."""
    params, rest = eqx.partition(model, eqx.is_array)
    report = DispatchReport(policy=static.spec.policy)

    def rank_fn(a, f, params, cell, system_mask):
        model = eqx.combine(params, rest)
        _, out, _, _, _, _, w = rank_evaluate(
            model, f["local"], a["positions"], a["system"], f["owned_rows"], f["routing"], cell, system_mask, static,
            report, forces=False, virials=True)
        valid = a["ids"] >= 0
        e = jnp.where(valid, out["atomic_energies"][:static.layout.n_owned], 0.0)
        return e, jnp.where(valid[:, None, None], w, 0.0)

    ranked, replicated = _split(fixed)
    return on_ranks(rank_fn, static.mesh, ranked=(arrays, ranked), replicated=(params, *replicated),
                    replicated_out=(False, False))


@eqx.filter_jit
def _loop(model, arrays, energy, extra, virial, fixed, step0, n, static, integrator, threshold, step_limit, nl_skin,
          reach):
    """Up to ``n`` steps on device; stops early for a rebuild, an overflow or convergence.

    ``threshold``: how far (Å) atoms may move from their plan before it is rebuilt (inf when
    no plan goes stale). ``step_limit``: how far (Å) one step may move an atom at all (half
    the skin, on one device as on many): a longer step ends the loop (``_TOO_FAST``).

    With ``nl_skin`` > 0 the neighbour list is kept from step to step and rebuilt on device
    when an atom has moved ``nl_skin / 2`` since it was built. ``reach``: for an integrator
    that moves the cell, (ghost width, model's neighbour range) in Å: displacements are
    then measured from the reference positions carried with the cell, and the allowance
    shrinks with the cell (a plan of ghost width W covers W·s once lengths shrank by s).
    Returns (arrays, energy, extra, cell, virial, steps taken, reason, needed sizes)."""
    params, rest = eqx.partition(model, eqx.is_array)
    axes = static.axes
    report = DispatchReport(policy=static.spec.policy)
    reuse = nl_skin > 0
    moving = reach is not None
    want_virial = bool(integrator.needs_virial)

    def rank_fn(a, f, params, cell, system_mask, plan_cell, energy, extra, virial, step0, n):
        model = eqx.combine(params, rest)
        f = dict(f, cell=cell, system_mask=system_mask)
        valid = a["ids"] >= 0
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
            return jnp.einsum("ni,nij->nj", ref, m[a["system"]]), jnp.minimum(shrink, 1.0)

        def moved2(x, cell_now, ref, ref_cell):
            """Largest squared displacement since ``ref``, and how far lengths shrank since then."""
            ref, shrink = carried(ref, ref_cell, cell_now)
            return max_shift2(x, ref), shrink

        def neighbors(x, cell_now):
            return rank_neighbors(halo_forward(x, static.layout, f["routing"], axes, cell=cell_now), f["local"],
                                  static, cell=cell_now, routing=f["routing"])

        def evaluate(x, nl, cell_now):
            forces, per_system, nl, w = rank_forces(model, dict(f, cell=cell_now), x, a["system"], static, report,
                                                    neighbors=nl, virial=want_virial)
            return forces, per_system, w, nl

        def built(x, cell_now):
            """A list of the rows now, whether it overflowed on any rank and the sizes needed."""
            nl = neighbors(x, cell_now)
            return (nl,) + neighbor_needs(nl, axes)

        counts = jax.lax.psum(jax.ops.segment_sum(valid.astype(jnp.int32), a["system"], num_segments=n_sys), axes)

        def context(step):
            return StepContext(
                inv_mass=a["inv_mass"][:, None], ids=a["ids"], system=a["system"], valid=valid, step=step,
                n_atoms=counts,
                system_sum=lambda v: jax.lax.psum(
                    jax.ops.segment_sum(jnp.where(valid.reshape((-1,) + (1,) * (v.ndim - 1)), v, 0), a["system"],
                                        num_segments=n_sys), axes),
                global_max=lambda v: jax.lax.pmax(v, axes),
            )

        x0 = a["positions"]
        # A kept list carries whether it overflowed when built and the sizes it needed: its
        # capacities are checked (one collective) only at the steps that build it.
        verlet = (*built(x0, cell), x0, cell) if reuse else None
        _, _, needed0 = jax.eval_shape(built, x0, cell)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), needed0)
        state0 = RankState(x0, a["velocities"], a["forces"], energy, extra, cell, virial)
        done0 = integrator.converged(state0, context(step0))
        init = (jnp.int32(0), done0, jnp.where(done0, _CONVERGED, _RUNNING).astype(jnp.int32), (state0, verlet),
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
            new = integrator.step(state, ctx, forces_fn)
            # A model may refuse positions that drifted too far from their plan with NaN (the
            # distributed PME mesh does); a new plan fixes that.
            # The integrator's own state too: a diverging chain shows there first (conserved = inf).
            finite = (box["finite"] & jnp.all(jnp.isfinite(new.positions)) & jnp.all(jnp.isfinite(new.velocities))
                      & jnp.all(jnp.isfinite(new.cell))
                      & functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in
                                                           jax.tree_util.tree_leaves(new.extra)], jnp.asarray(True)))
            ref, shrink = carried(a["reference"], plan_cell, box["cell"])
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
            bad = far | box["overflow"] | blowup | too_fast
            soon = ~bad & (ahead2 > allowed**2)
            # A discarded step ends the loop, and the next call builds its list afresh, so
            # only the state needs selecting (the list is large, selecting it costs a copy).
            kept = (jax.tree_util.tree_map(lambda old, nw: jnp.where(bad, old, nw), state, new), box.get("verlet"))
            converged = ~bad & integrator.converged(kept[0], ctx)
            reason = jnp.where(box["overflow"], _OVERFLOW, jnp.where(too_fast, _TOO_FAST, jnp.where(far, _REBUILD, jnp.where(
                blowup, _NONFINITE, jnp.where(converged, _CONVERGED, jnp.where(soon, _AHEAD, _RUNNING))))))
            return (k + jnp.where(bad, 0, 1).astype(jnp.int32), bad | converged | soon, reason.astype(jnp.int32),
                    kept, box["needed"])

        k, _, reason, (state, _), needed = jax.lax.while_loop(cond, body, init)
        out = dict(a, positions=state.positions, velocities=state.velocities, forces=state.forces)
        return out, state.energy, state.extra, state.cell, state.virial, k, reason, needed

    ranked, replicated = _split(fixed)
    return on_ranks(rank_fn, static.mesh, ranked=(arrays, ranked),
                    replicated=(params, *replicated, fixed["plan_cell"], energy, extra, virial, step0, n),
                    replicated_out=(False, True, True, True, True, True, True, True))


def _carried(local: Batch) -> tuple[str, ...]:
    """The optional per-atom fields a plan's local batch carries (the spec's shard_fields)."""
    return tuple(f for f in ("charges", "masses", "velocities") if getattr(local, f) is not None)


@functools.partial(jax.jit, static_argnames=("cfg", "mesh", "fields"))
def _replanned(arrays, cell, system_mask, frame, cfg: ReplanConfig, mesh, fields: tuple[str, ...], pbc):
    """A rebuild on the devices (:func:`jaxdd.decomposition.replan.rank_replan`) and the plan's local rows:
    (arrays, plan) laid out as :meth:`DomainParallel._place` lays them out (the plan's
    ``local`` batch, ``owned_rows`` and ``routing``). Inputs depend on the owned rows only,
    so one program serves every rebuild of a layout. fields: the optional per-atom fields the local batch carries.
    pbc: [P, S, 3] the local batch's periodic axes, kept (none where ghost rows are explicit
    images; a single rank that searches its periodic cell itself keeps the cell's)."""
    axes = cfg.axes
    layout, n_sys = cfg.layout, cfg.n_systems

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
