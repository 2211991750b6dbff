"""Integrators: one step of a rank's owned atoms, written as pure functions.

Units are ASE's: positions Å, energies eV, masses amu, time in Å·sqrt(amu/eV) (``ase.units.fs``
is 0.0982 of it), velocities Å per time unit; in Lennard-Jones reduced units (σ = ε = m = 1,
``kB=1``) the same code is the reduced-unit integrator. A step sees only its rank's owned
rows; whatever must be global (per-system sums, the convergence test) goes through the
collectives of the :class:`StepContext` it is handed.

Each integrator is a frozen dataclass (static configuration, part of the jit cache key) with

* ``init(batch)``: its own state (a dict of per-system arrays; empty for NVE);
* ``step(state, ctx, forces_fn)``: the next :class:`RankState`; ``forces_fn(positions,
  cell=None)`` returns ``(forces [n, 3], energy [S], virial [S, 3, 3] or None)`` and is
  called exactly once (``cell`` [S, 3, 3]: the cell the positions are in, when the step
  moved it);
* ``converged(state, ctx)``: a replicated bool that stops the loop early (FIRE);
* ``needs_virial`` (class attribute): the step reads ``state.virial`` (barostats), so every
  force evaluation also computes it; ``moves_cell``: the step changes ``state.cell``;
* optionally ``energy(extra, n_atoms, cell)``: the energy [S] of its own degrees of freedom
  (thermostat and barostat), added to the total energy as the thermo's ``conserved``.

:func:`register_integrator` makes a new integrator class known to ``DomainParallel`` and to
checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..data.checks import integral
from ..registry import Registry

__all__ = ["RankState", "StepContext", "Dynamics", "VelocityVerlet", "Langevin", "FIRE", "KB_EV_PER_K",
           "INTEGRATORS", "register_integrator", "verlet"]

KB_EV_PER_K = 8.617333262e-5  # Boltzmann constant (eV/K), as ase.units.kB


class RankState(NamedTuple):
    """One rank's owned atoms. positions, velocities, forces: [n_owned, 3]; energy: [S] eV
    (global, replicated); extra: the integrator's own state (replicated); cell: [S, 3, 3] Å
    (rows are lattice vectors; replicated); virial: [S, 3, 3] eV, W = -dE/dε of the last
    force evaluation summed over ranks (zeros unless the integrator ``needs_virial``)."""

    positions: jax.Array
    velocities: jax.Array
    forces: jax.Array
    energy: jax.Array
    extra: dict
    cell: jax.Array
    virial: jax.Array


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What a step may read besides the state (traced arrays; built inside the loop).

    inv_mass: [n, 1] 1/amu (0 on padding rows, which therefore never move). ids: [n] global
    atom index (-1 on padding). system: [n] system of each row. valid: [n] real rows.
    step: [] int, the number of the step being taken (0-based). n_atoms: [S] real atoms of
    each system (all ranks). system_sum: [n, ...] → [S, ...] summed over all ranks.
    global_max: [] → [] max over all ranks.
    """

    inv_mass: jax.Array
    ids: jax.Array
    system: jax.Array
    valid: jax.Array
    step: jax.Array
    n_atoms: jax.Array
    system_sum: Callable
    global_max: Callable

    def kinetic_tensor(self, velocities) -> jax.Array:
        """Σ m v_a v_b of each system, [S, 3, 3] (twice the kinetic energy tensor), of ``velocities`` [n, 3]."""
        mass = jnp.where(self.valid[:, None], 1.0 / jnp.where(self.valid[:, None], self.inv_mass, 1.0), 0.0)
        return self.system_sum(mass[:, :, None] * velocities[:, :, None] * velocities[:, None, :])

    def kinetic2(self, velocities) -> jax.Array:
        """Σ m v² of each system, [S] (twice the kinetic energy), of ``velocities`` [n, 3]."""
        mass = jnp.where(self.valid, 1.0 / jnp.where(self.valid, self.inv_mass[:, 0], 1.0), 0.0)
        return self.system_sum(mass * jnp.sum(velocities * velocities, axis=1))

    def dof(self) -> jax.Array:
        """Degrees of freedom of each system, [S]: 3N - 3 (as the thermo temperature)."""
        return jnp.maximum(3 * self.n_atoms - 3, 1)


def check_number(owner, name, value, *, positive=True, allow_zero=False):
    """``value`` as a float, or ValueError naming ``owner.name`` unless it is a finite real
    number (a Python or NumPy scalar, or a 0-d array) and, when ``positive``, > 0 (or >= 0
    with ``allow_zero``)."""
    ok = _real_scalar(value) and math.isfinite(float(value))
    ok = ok and (not positive or float(value) > 0 or (allow_zero and float(value) == 0))
    if not ok:
        bound = "" if not positive else " >= 0" if allow_zero else " > 0"
        raise ValueError(f"{owner}.{name} must be a finite number{bound}, got {value!r}")
    return float(value)


def _real_scalar(value) -> bool:
    """Whether ``value`` is one integer or floating number (not a bool, not complex)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.generic, np.ndarray, jax.Array)):
        return False
    dtype = np.asarray(value).dtype
    return np.ndim(value) == 0 and (np.issubdtype(dtype, np.integer) or np.issubdtype(dtype, np.floating))


def check_period(owner, name, period: float, dt: float, *, barostat: bool = False, least: float = 10.0):
    """Refuse a damping time ``period`` (time units, as ``dt``) shorter than ``least`` time
    steps (ValueError naming ``owner.name``): the chain or the rescaling then overshoots every
    step and the run diverges (a thermostat's period below dt zeroes the velocities within
    steps). barostat: the period damps the cell (the suggestion is 1,000 dt, not 100).
    Compared within a relative 1e-9, so ``least`` steps written in decimal (``period=0.21``
    with ``dt=0.021``, 9.9999999999 steps in floating point) pass."""
    if period < least * dt * (1.0 - 1e-9):
        suggest = (1000 if barostat else 100) * dt
        raise ValueError(
            f"{owner}.{name} = {period:g} is {period / dt:.3g} time steps (dt = {dt:g}); a damping time under "
            f"{least:g} dt makes the integration unstable. LAMMPS suggests about 100 dt for a thermostat's Tdamp "
            f"and 1,000 dt for a barostat's Pdamp: e.g. {name}={suggest:g}")


class Dynamics:
    """The defaults of a molecular-dynamics integrator: no state of its own, never
    converged, the cell fixed, no virial read. Subclasses override what they do."""

    needs_virial = False
    moves_cell = False

    def init(self, batch) -> dict:
        """The integrator's own state for a run of ``batch``: a dict of per-system arrays (empty here)."""
        return {}

    def converged(self, state: RankState, ctx: StepContext):
        """Whether the run may stop: a replicated bool (never, here).

        Args:
          state: the rank's RankState after the step.
          ctx: the StepContext (its collectives make the answer the same on every rank).
        """
        return jnp.asarray(False)

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One step of the rank's owned atoms.

        Args:
          state: the rank's RankState before the step (its ``virial`` read by a barostat).
          ctx: the StepContext.
          forces_fn: ``forces_fn(positions, cell=None) -> (forces, energy, virial)``, called
            once (``cell``: the cell the positions are in, when the step moved it).

        Returns:
          The RankState after the step (with the new cell, when the step moved it).
        """
        raise NotImplementedError(f"{type(self).__name__} defines no step")


def verlet(x, v, forces, ctx: StepContext, forces_fn, dt):
    """Velocity Verlet: a half kick, a drift, the forces at the new positions, a half kick.

    Args:
      x: [n, 3] Å positions. v: [n, 3] velocities. forces: [n, 3] eV/Å at ``x``.
      ctx: the StepContext (its ``inv_mass``).
      forces_fn: ``forces_fn(positions) -> (forces, energy, virial)``, called once.
      dt: the time step (a scalar of the positions' dtype).

    Returns:
      (positions, velocities, forces, energy [S] eV, virial or None) after the step.
    """
    v = v + 0.5 * dt * forces * ctx.inv_mass
    x = x + dt * v
    f, e, w = forces_fn(x)
    v = v + 0.5 * dt * f * ctx.inv_mass
    return x, v, f, e, w


@dataclasses.dataclass(frozen=True)
class VelocityVerlet(Dynamics):
    """NVE velocity Verlet. dt: time step (ASE time units, or τ in reduced units)."""

    dt: float

    def __post_init__(self):
        object.__setattr__(self, "dt", check_number("VelocityVerlet", "dt", self.dt))

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One velocity Verlet step from ``state``, with ``ctx`` and ``forces_fn`` as
        :meth:`Dynamics.step` takes them."""
        dt = jnp.asarray(self.dt, state.positions.dtype)
        x, v, f, e, w = verlet(state.positions, state.velocities, state.forces, ctx, forces_fn, dt)
        return state._replace(positions=x, velocities=v, forces=f, energy=e, virial=_kept(w, state))

    def energy(self, extra, n_atoms, cell):
        """The energy [S] of the integrator's own degrees of freedom: none for NVE (zeros).

        Args:
          extra: the integrator's state.
          n_atoms: [S] real atoms of each system.
          cell: [S, 3, 3] cells (Å).
        """
        return jnp.zeros(cell.shape[:1], cell.dtype)


def _kept(virial, state: RankState):
    return state.virial if virial is None else virial


@dataclasses.dataclass(frozen=True)
class Langevin(Dynamics):
    """NVT Langevin dynamics, BAOAB splitting (Leimkuhler & Matthews).

    dt: time step. temperature: target T (K with the default ``kB``; ε/k_B with ``kB=1``).
    friction: γ (1 / time unit). seed: random stream. kB: Boltzmann constant (energy / T).

    The noise of atom ``i`` at step ``n`` is drawn from ``fold_in(fold_in(key(seed), n), i)``:
    it depends on the atom's identity and the step only, so the trajectory is the same on
    any number of ranks and any partition.
    """

    dt: float
    temperature: float
    friction: float
    seed: int = 0
    kB: float = KB_EV_PER_K

    def __post_init__(self):
        object.__setattr__(self, "dt", check_number("Langevin", "dt", self.dt))
        object.__setattr__(self, "temperature", check_number("Langevin", "temperature", self.temperature, allow_zero=True))
        object.__setattr__(self, "friction", check_number("Langevin", "friction", self.friction, allow_zero=True))
        object.__setattr__(self, "kB", check_number("Langevin", "kB", self.kB))
        object.__setattr__(self, "seed", integral("Langevin.seed", self.seed, minimum=0))

    def noise(self, ctx: StepContext, dtype) -> jax.Array:
        """Standard normal [n, 3] of ``dtype``, keyed by (seed, step, atom id) from the StepContext ``ctx``."""
        key = jax.random.fold_in(jax.random.key(self.seed), ctx.step)
        draw = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(key, i), (3,), dtype))
        return draw(jnp.maximum(ctx.ids, 0))

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One BAOAB step from ``state``, with ``ctx`` and ``forces_fn`` as :meth:`Dynamics.step`
        takes them."""
        dtype = state.positions.dtype
        dt = jnp.asarray(self.dt, dtype)
        c1 = jnp.exp(jnp.asarray(-self.friction * self.dt, dtype))
        sigma = jnp.sqrt((1.0 - c1 * c1) * self.kB * self.temperature * ctx.inv_mass)  # [n, 1]
        v = state.velocities + 0.5 * dt * state.forces * ctx.inv_mass  # B
        x = state.positions + 0.5 * dt * v  # A
        v = c1 * v + sigma * self.noise(ctx, dtype)  # O
        v = jnp.where(ctx.valid[:, None], v, 0.0)
        x = x + 0.5 * dt * v  # A
        f, e, w = forces_fn(x)
        v = v + 0.5 * dt * f * ctx.inv_mass  # B
        return state._replace(positions=x, velocities=v, forces=f, energy=e, virial=_kept(w, state))


@dataclasses.dataclass(frozen=True)
class FIRE:
    """FIRE minimiser (Bitzek et al. 2006), per system, after ASE's ``FIRE``: masses are
    ignored, each system has its own time step and mixing, and no atom of a system moves
    further than ``max_step`` (Å) in total length per step.

    fmax: stop when every atom's force is below this (eV/Å). dt, dt_max: initial and largest
    time step. The rest are the usual FIRE constants.
    """

    fmax: float = 0.05
    dt: float = 0.1
    dt_max: float = 1.0
    max_step: float = 0.2
    n_min: int = 5
    f_inc: float = 1.1
    f_dec: float = 0.5
    alpha_start: float = 0.1
    f_alpha: float = 0.99

    needs_virial = False
    moves_cell = False

    def __post_init__(self):
        for name in ("fmax", "dt", "dt_max", "max_step", "f_inc", "f_dec", "alpha_start", "f_alpha"):
            object.__setattr__(self, name, check_number("FIRE", name, getattr(self, name)))
        object.__setattr__(self, "n_min", integral("FIRE.n_min", self.n_min, minimum=0))

    def init(self, batch) -> dict:
        """Per-system time step ``dt``, mixing ``alpha`` and downhill step count for ``batch``'s systems."""
        n_systems, dtype = batch.n_systems, batch.positions.dtype
        return dict(dt=jnp.full((n_systems,), self.dt, dtype), alpha=jnp.full((n_systems,), self.alpha_start, dtype),
                    n_positive=jnp.zeros((n_systems,), jnp.int32))

    def converged(self, state: RankState, ctx: StepContext):
        """Whether every atom's force is below ``fmax`` (a replicated bool).

        Args:
          state: the rank's RankState.
          ctx: the StepContext (its ``global_max`` takes the maximum over ranks).
        """
        f2 = jnp.where(ctx.valid, jnp.sum(state.forces**2, axis=1), 0.0)
        return ctx.global_max(jnp.max(f2, initial=0.0)) < self.fmax**2

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One FIRE step from ``state`` (velocities mixed towards the forces, time steps adapted,
        moves capped), with ``ctx`` and ``forces_fn`` as :meth:`Dynamics.step` takes them."""
        ex = state.extra
        f, v, sys = state.forces, state.velocities, ctx.system
        vf = ctx.system_sum(jnp.sum(f * v, axis=1))
        ff = ctx.system_sum(jnp.sum(f * f, axis=1))
        vv = ctx.system_sum(jnp.sum(v * v, axis=1))
        uphill = vf < 0  # ASE starts from v = 0, where vf = 0 neither mixes nor resets
        a = ex["alpha"]
        scale = jnp.sqrt(vv) / jnp.where(ff > 0, jnp.sqrt(ff), 1.0)
        v = jnp.where(uphill[sys][:, None], 0.0, (1 - a[sys])[:, None] * v + (a * scale)[sys][:, None] * f)
        grow = ~uphill & (ex["n_positive"] > self.n_min)
        dt = jnp.where(uphill, ex["dt"] * self.f_dec, jnp.where(grow, jnp.minimum(ex["dt"] * self.f_inc, self.dt_max),
                                                                 ex["dt"]))
        alpha = jnp.where(uphill, self.alpha_start, jnp.where(grow, a * self.f_alpha, a))
        n_positive = jnp.where(uphill, 0, ex["n_positive"] + 1)
        v = jnp.where(ctx.valid[:, None], v + dt[sys][:, None] * f, 0.0)
        dr = dt[sys][:, None] * v
        norm = jnp.sqrt(ctx.system_sum(jnp.sum(dr * dr, axis=1)))
        dr = dr * jnp.where(norm > self.max_step, self.max_step / jnp.where(norm > 0, norm, 1.0), 1.0)[sys][:, None]
        x = state.positions + dr
        f_new, e, w = forces_fn(x)
        return state._replace(positions=x, velocities=v, forces=f_new, energy=e, virial=_kept(w, state),
                              extra=dict(dt=dt, alpha=alpha, n_positive=n_positive))


#: Integrator classes by name: what ``DomainParallel`` accepts and checkpoints record.
INTEGRATORS: Registry[type] = Registry("integrator", ValueError)


def register_integrator(cls: type | None = None, *, replace: bool = False) -> type:
    """Make the frozen-dataclass integrator ``cls`` known to ``DomainParallel`` and to
    checkpoints (by its class name); usable as a class decorator.

    A class must provide ``init``, ``step`` and ``converged`` (see the module docstring);
    ``needs_virial`` and ``moves_cell`` default to False. A different class under a name
    already registered is refused unless ``replace=True`` (the same class defined again is
    allowed).

    Args:
      cls: the integrator class (None: return a decorator, ``@register_integrator(replace=True)``).
      replace: allow replacing a different class registered under the same name.

    Returns:
      ``cls``.
    """
    if cls is None:
        return lambda c: register_integrator(c, replace=replace)
    missing = [m for m in ("init", "step", "converged") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls) or missing:
        raise ValueError(f"an integrator must be a frozen dataclass with init, step and converged methods; "
                         f"{cls!r} {'misses ' + ', '.join(missing) if missing else 'is not a dataclass'}")
    return INTEGRATORS.register(cls.__name__, cls, replace=replace)


for _cls in (VelocityVerlet, Langevin, FIRE):
    register_integrator(_cls)
