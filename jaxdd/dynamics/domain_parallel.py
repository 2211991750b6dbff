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
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..data.checks import integral
from ..data import AtomicData, Batch, as_batch
from ..data.cell_widths import cell_widths
from ..engine.distributed import DistributedModel
from ..engine.rank_program import Needs
from ..engine.run_placement import Placement
from ..model.protocol import minimum_image_cutoff
from . import checkpoints, observables
from .device_loop import AHEAD, CONVERGED, NARROW, NONFINITE, OVERFLOW, REBUILD, TOO_FAST, advance
from .device_programs import evaluate
from .integrators import INTEGRATORS, KB_EV_PER_K
from .io import ExtXYZWriter, Progress
from .state import MDState, RunStats

__all__ = ["DomainParallel", "MDState", "RunStats"]


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
        #: Where the atoms are laid out (grid, balanced cuts, partition frame) and the events so far.
        self.placement = Placement(dist_model, moves_cell=bool(integrator.moves_cell), node_blocks=self.node_blocks)
        self.last_run: RunStats | None = None

    @property
    def grid(self) -> tuple:
        """The rank grid ``(nx, ny, nz)``: the configured one until the first partition, which
        fixes it (a ``grid=None`` config is resolved there), so plans keep their shapes."""
        return tuple(self.placement.grid) if self.placement.grid is not None else None

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
        place = self.placement
        place.cuts = place.weights = None  # a new system: balanced blocks are placed for its atoms
        state = MDState.start(place.place(batch, positions, np.asarray(batch.velocities)), step=0,
                              extra=self.integrator.init(batch))
        if self._by_pairs():  # blocks balanced by atoms first; then by the pairs they measured
            place.weights = self.pair_weights(state)
            place.cuts = None
            state = state.replace(placed=place.place(batch, positions, np.asarray(batch.velocities)))
        return self.with_forces(state)

    def _by_pairs(self) -> bool:
        cfg = self.dist_model.config
        return cfg.balance is not None and cfg.balance_by == "pairs" and not self.node_blocks

    def program(self, state: MDState):
        """The :class:`~jaxdd.engine.rank_program.RankProgram` that evaluates ``state``'s energy and forces."""
        return self.dist_model.program(state.template.n_systems, ("energy", "forces"), state.layout)

    def with_forces(self, state: MDState) -> MDState:
        """``state`` with the energy, forces (and virial, when the integrator reads it) of its positions."""
        stress = bool(self.integrator.needs_virial)

        def attempt(_):
            energy, forces, virial, overflow, needed = evaluate(self.dist_model.model, state.rows, state.plan,
                                                                self.program(state), stress)
            return (energy, forces, virial), Needs.of_neighbors(overflow, needed)

        energy, forces, virial = self.dist_model.sizing.run_until_fits(attempt)
        return state.replace(rows=state.rows.replace(forces=forces), energy=energy,
                             **({"virial": -virial.astype(energy.dtype)} if stress else {}))

    def fitting(self, state: MDState) -> MDState:
        """``state`` on a plan that holds every neighbour of this model: a plan built for a
        narrower ghost shell (another run's state, a checkpoint, a model since changed) is
        planned again on the host, and its forces evaluated with this model."""
        dm = self.dist_model
        if dm.ghost_width_covers(state.ghost_width):
            return state
        self.placement.counters.rebuilds += 1
        return self.with_forces(state.replace(placed=self.placement.rebuild_on_host(state.placed)))

    # ------------------------------------------------------------------ running

    def run(self, state: MDState, n_steps: int, *, thermo_every: int = 0, trajectory=None,
            trajectory_every: int = 0, progress: bool = False, log=None, observers=()) -> MDState:
        """Advance ``n_steps`` steps (fewer if a minimiser converges). The input state is not modified.

        Args:
          state: the state to start from.
          n_steps: steps to take.
          thermo_every: print (or pass to ``log``) the thermo of every system every N steps
            (0: never).
          trajectory: an extxyz path or an :class:`ExtXYZWriter`; the gathered system is
            appended every ``trajectory_every`` steps (and at the start when the file is new).
          trajectory_every: steps between trajectory frames (> 0 with a ``trajectory``).
          progress: a progress line with atom-steps per second on stderr.
          log: called as ``log(step, thermo)`` at each thermo step; None:
            :func:`~jaxdd.dynamics.observables.print_thermo`.
          observers: objects with an ``every`` (int > 0) attribute, each called as
            ``observer(md, state)`` after every step that is a multiple of its ``every`` (a
            :class:`~jaxdd.dynamics.HeatFlux`, or one of yours); one with a ``check(md)``
            method has it called before the first step, to refuse a run it cannot observe.

        Returns:
          The state after the steps.
        """
        n_steps = integral("n_steps", n_steps, minimum=0)
        thermo_every = integral("thermo_every", thermo_every, minimum=0)
        trajectory_every = integral("trajectory_every", trajectory_every, minimum=0)
        if trajectory is not None and trajectory_every == 0:
            raise ValueError("a trajectory needs trajectory_every > 0 (steps between frames)")
        observers = _checked_observers(self, observers)
        writer = ExtXYZWriter(trajectory) if isinstance(trajectory, (str, Path)) else trajectory
        log = log if log is not None else observables.print_thermo
        rebalance_every = self.dist_model.config.balance_every if self.dist_model.config.balance == "dynamic" else 0
        marks = [m for m in (thermo_every, trajectory_every, rebalance_every, *(o.every for o in observers)) if m]
        show = progress and jax.process_index() == 0
        bar = Progress(n_steps, int(np.asarray(state.template.atom_mask).sum())) if show else None
        counts0, regrowths = dataclasses.replace(self.placement.counters), self.dist_model.sizing.regrowths
        start, done = time.perf_counter(), 0
        state = self.fitting(state)
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
                weights = self.pair_weights(state) if self._by_pairs() else None
                state = state.replace(placed=self.placement.rebalance(state.placed, weights))
            if thermo_every and (state.step % thermo_every == 0 or state.converged):
                log(state.step, self.thermo(state))
            if writer is not None and (state.step % trajectory_every == 0 or state.converged):
                writer.write(self, state)
            for obs in observers:
                if state.step % obs.every == 0:
                    obs(self, state)
            if bar is not None:
                bar.update(done)
        jax.block_until_ready(state.rows.positions)
        seconds = time.perf_counter() - start
        n_atoms = int(np.asarray(state.template.atom_mask).sum())
        now = self.placement.counters
        self.last_run = RunStats(done, seconds, done * n_atoms / seconds if seconds > 0 else 0.0,
                                 now.rebuilds - counts0.rebuilds, now.migrations - counts0.migrations,
                                 self.dist_model.sizing.regrowths - regrowths, now.host_rebuilds - counts0.host_rebuilds,
                                 now.rebalances - counts0.rebalances, now.discarded - counts0.discarded)
        if bar is not None:
            bar.close(self.last_run)
        return state

    def lower(self, state: MDState, n_steps: int = 1):
        """The lowered XLA program (a ``jax.stages.Lowered``) that advances ``state`` on the
        devices, the one :meth:`run` calls between plan rebuilds: for analysis
        (``.compile().cost_analysis()``, ``.memory_analysis()``, ``.as_text()``), not to call.
        Its loop body is one step, which XLA's cost analysis counts once: the flops and bytes
        of a step on one rank. n_steps: the loop's bound (a traced value)."""
        return advance.lower(
            self.dist_model.model, state.rows, state.energy, state.extra, state.virial, state.plan,
            jnp.asarray(state.step, jnp.int32), jnp.asarray(integral("n_steps", n_steps, minimum=0), jnp.int32),
            self.program(state), self.integrator, self.threshold, self.step_limit, self.nl_skin,
            _reach(self), _width_limit(self, state)).lowered

    def _advance(self, state: MDState, n: int) -> MDState:
        """Take ``n`` steps, leaving the device only to rebuild plans and grow capacities."""
        fresh = False
        while n > 0 and not state.converged:
            taken = 0

            def chunk(_):  # steps kept before an overflow stay taken; the rest run on grown capacities
                nonlocal n, taken, state
                rows, energy, extra, cell, virial, k, reason, needed = advance(
                    self.dist_model.model, state.rows, state.energy, state.extra, state.virial, state.plan,
                    jnp.asarray(state.step, jnp.int32), jnp.asarray(n, jnp.int32), self.program(state),
                    self.integrator, self.threshold, self.step_limit, self.nl_skin, _reach(self),
                    _width_limit(self, state))
                k, reason = int(k), int(reason)
                placed = state.placed.replace(rows=rows)
                if self.integrator.moves_cell:
                    placed = placed.with_cell(cell)
                state = state.replace(placed=placed, energy=energy, extra=extra, virial=virial, step=state.step + k)
                n -= k
                taken += k
                return reason, Needs.of_neighbors(reason == OVERFLOW, needed)

            reason = self.dist_model.sizing.run_until_fits(chunk)
            if reason == CONVERGED:
                state = state.replace(converged=True)
            elif reason == NARROW:
                raise RuntimeError(_narrow_message(self, state))
            elif reason == TOO_FAST:
                raise RuntimeError(
                    f"step {state.step + 1} would move an atom more than {self.step_limit:.4g} Å (half the skin, or "
                    "DomainConfig.migration_hysteresis) in one step: the time step is too large for these "
                    f"velocities and forces ({type(self.integrator).__name__}.dt = "
                    f"{getattr(self.integrator, 'dt', '?')}){_cell_hint(self.integrator)}; reduce dt, or raise "
                    "DomainConfig.skin if the steps are meant to be this long")
            elif reason in (REBUILD, NONFINITE, AHEAD):
                # A stale halo, or a step a model refused on this plan (the distributed PME mesh
                # answers NaN for atoms that drifted past it): both ask for a new plan, as does a
                # next step that would outrun it (AHEAD: this step was kept, none discarded).
                if reason != AHEAD and taken == 0 and fresh:
                    raise RuntimeError(
                        f"an atom moved more than {self.threshold:.4g} Å (half the skin) in one step from a fresh "
                        f"plan; the time step is too large for the skin{_cell_hint(self.integrator)}: reduce dt or "
                        "raise DomainConfig.skin" if reason == REBUILD else
                        f"the step is not finite at step {state.step + 1} (energy, forces, positions, "
                        "velocities, cell or the integrator's state), on a plan built from the step before: the model "
                        "failed on these positions (atoms too close? a time step too large?); the state passed to "
                        "run() is unchanged")
                self.placement.counters.discarded += int(reason != AHEAD)
                state = state.replace(placed=self.placement.rebuild(state.placed))
                fresh = True
                continue
            fresh = fresh and taken == 0
        return state

    # ------------------------------------------------------------------ results

    def gather(self, state: MDState) -> Batch:
        """The system of ``state``, as a Batch in the original atom order (positions unwrapped)."""
        positions, velocities = self.placement.global_rows(state.placed, "positions", "velocities")
        dtype = state.template.positions.dtype
        return state.template.replace(positions=jnp.asarray(positions, dtype), velocities=jnp.asarray(velocities, dtype))

    def forces(self, state: MDState) -> np.ndarray:
        """Forces [V, 3] eV/Å on the positions of ``state``, in the original atom order."""
        return self.placement.global_rows(state.placed, "forces")[0]

    def thermo(self, state: MDState) -> dict:
        """Per-system thermodynamics of ``state``, numpy [S]: :func:`jaxdd.dynamics.observables.thermo`."""
        return observables.thermo(self, state)

    def check_atom_terms(self) -> None:
        """Raise ValueError unless :meth:`atom_terms` can run here: :func:`jaxdd.dynamics.observables.check_atom_terms`."""
        observables.check_atom_terms(self)

    def atom_terms(self, state: MDState) -> dict:
        """Per-atom energies and virials of the owned rows of ``state``:
        :func:`jaxdd.dynamics.observables.atom_terms`."""
        return observables.atom_terms(self, state)

    def pair_weights(self, state: MDState) -> np.ndarray:
        """Each atom's cost 1 + its neighbour count in ``state``, [V]:
        :func:`jaxdd.dynamics.observables.pair_weights`."""
        return observables.pair_weights(self, state)

    # ------------------------------------------------------------------ checkpoints

    def save(self, path, state: MDState) -> Path:
        """Write ``state`` to the folder ``path``: :func:`jaxdd.dynamics.checkpoints.save`."""
        return checkpoints.save(self, path, state)

    def restore(self, path) -> MDState:
        """The state saved at ``path``: :func:`jaxdd.dynamics.checkpoints.restore`."""
        return checkpoints.restore(self, path)


def _checked_observers(md: DomainParallel, observers) -> tuple:
    """``observers`` as a tuple, each checked (callable, an int ``every`` > 0) and its
    ``check(md)`` called, before any step runs. Args: md: the run. observers: the objects."""
    observers = tuple(observers)
    for i, obs in enumerate(observers):
        every = getattr(obs, "every", None)
        if not callable(obs) or isinstance(every, bool) or not isinstance(every, int) or every <= 0:
            raise ValueError(f"observers[{i}] must be callable as observer(md, state) and have an int attribute "
                             f"every > 0 (steps between calls); got {obs!r}")
        if callable(getattr(obs, "check", None)):
            obs.check(md)
    return observers


def _reach(md: DomainParallel):
    """For an integrator that moves the cell: (ghost width of the plans, the model's
    neighbour range) in Å, which bound how far the cell may shrink before a plan or a
    neighbour list is stale; None otherwise. Args: md: the run."""
    if not md.integrator.moves_cell:
        return None
    nc = md.dist_model.model.model_config.neighbor_config
    return (float(md.dist_model.ghost_width), float(nc.search_cutoff))


def _width_limit(md: DomainParallel, state: MDState):
    """For an integrator that moves the cell and a model with minimum-image displacements:
    (twice its range in Å, the systems' periodic axes), the least width the device loop lets
    a periodic cell reach; None otherwise. Args: md: the run. state: its state."""
    reach = minimum_image_cutoff(md.dist_model.model)
    if reach is None or not md.integrator.moves_cell:
        return None
    return 2.0 * float(reach), tuple(tuple(bool(p) for p in row) for row in np.asarray(state.template.pbc))


def _narrow_message(md: DomainParallel, state: MDState) -> str:
    """Why a run stopped before a step that made the cell too narrow for its model."""
    model = md.dist_model.model
    limit, _ = _width_limit(md, state)
    cell = np.asarray(state.template.cell, np.float64)
    widths = np.round(cell_widths(cell), 4).tolist()
    return (f"step {state.step + 1} would bring a periodic width of the cell to {limit:g} Å or less, twice "
            f"{type(model).__name__}'s minimum-image cutoff ({limit / 2:g} Å), where its displacements would miss or "
            f"double count images; the cell has shrunk under {type(md.integrator).__name__} to "
            f"{cell.round(4).tolist()} Å (widths {widths} Å) at step {state.step}; the state passed to run() is "
            "unchanged. Use a larger cell (repeat it), a pressure that keeps it wider, or a model on jaxdd's "
            "neighbour lists, which handle any cell")


def _cell_hint(integrator) -> str:
    """For an integrator that moves the cell, its barostat period in time steps: a short one
    moves the atoms with the cell, and the step guard would otherwise name dt alone."""
    p_period, dt = getattr(integrator, "p_period", None), getattr(integrator, "dt", None)
    if not getattr(integrator, "moves_cell", False) or not p_period or not dt:
        return ""
    return (f", or the cell changes too fast: p_period = {p_period:g} is {p_period / dt:.3g} time steps "
            f"(LAMMPS suggests about 1,000 dt for a barostat's Pdamp: lengthen it)")
