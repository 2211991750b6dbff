"""Stochastic cell rescaling (Bernetti & Bussi, J. Chem. Phys. 153, 114107, 2020) with
stochastic velocity rescaling (Bussi, Donadio & Parrinello 2007): NPT that reaches the
isothermal-isobaric volume distribution with first-order cell dynamics.

Anisotropic (``couple="aniso"``): each axis's log-length εₐ diffuses on its own,
dεₐ = β_T/(3τ_P)·(Pₐₐ - P) dt + √(2 kT β_T / (3 V τ_P)) dWₐ (Itô; the drift of the
entropy of the measure dLₓdL_ydL_z and the Itô term of the volume-dependent diffusion
cancel), the cell's x, y, z components scaled by exp(εₐ), velocities by exp(-εₐ). Its work
is accounted from the ratio of the backward and forward Gaussian moves (the effective
energy of the isotropic scheme, in ε).

The step is the time-reversible Trotter splitting of the paper's reference code
(``barotype T`` with scaled velocities): half a thermostat, half a kick, the volume move
(positions and cell scaled by s, velocities by 1/s), the drift, forces, half a kick, half a
thermostat. The work of the thermostat and barostat is accumulated (``extra["heat"]``), so
``K + U + P·V + heat`` is conserved up to the integration error: the thermo's
``conserved``. Random numbers are drawn per system from (seed, step), the same on every
rank, so a trajectory does not depend on the decomposition.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..data.checks import integral
from .integrators import (KB_EV_PER_K, Dynamics, RankState, StepContext, check_number, check_period,
                          register_integrator)
from .nose_hoover import cell_volume, check_barostat_cell

__all__ = ["CRescale"]


@register_integrator
@dataclasses.dataclass(frozen=True)
class CRescale(Dynamics):
    """NPT by stochastic cell rescaling with a velocity-rescaling thermostat.

    dt: time step. temperature: target T. pressure: target P (eV/Å³, or reduced units).
    t_period: the thermostat's relaxation time τ_T. p_period: the barostat's τ_P.
    compressibility: the isothermal compressibility β_T the barostat assumes (1/pressure:
    Å³/eV; ~0.3 for the LJ liquid in reduced units, ~70 for water, ~1 for metals); it sets
    how fast the volume relaxes, not the distribution. seed: random stream. kB: Boltzmann
    constant. couple: ``"iso"`` (the cell scales uniformly) or ``"aniso"`` (its x, y, z
    components scale separately, each driven by its diagonal pressure Pₐₐ; needs LAMMPS's
    restricted cell, as MTKBarostat's). Every system must be periodic on all axes.
    """

    dt: float
    temperature: float
    pressure: float
    t_period: float
    p_period: float
    compressibility: float
    seed: int = 0
    kB: float = KB_EV_PER_K
    couple: str = "iso"

    needs_virial = True
    moves_cell = True

    def __post_init__(self):
        for name in ("dt", "temperature", "t_period", "p_period", "compressibility", "kB"):
            object.__setattr__(self, name, check_number("CRescale", name, getattr(self, name)))
        object.__setattr__(self, "pressure", check_number("CRescale", "pressure", self.pressure, positive=False))
        for name in ("t_period", "p_period"):
            check_period("CRescale", name, getattr(self, name), self.dt, barostat=name == "p_period")
        object.__setattr__(self, "seed", integral("CRescale.seed", self.seed, minimum=0))
        if self.couple not in ("iso", "aniso"):
            raise ValueError(f"CRescale.couple must be 'iso' or 'aniso', got {self.couple!r}")

    def init(self, batch) -> dict:
        """The accumulated work ``heat`` [S] at zero.

        Args:
          batch: the Batch of the run; every real system must be periodic on all axes (and, for
            ``aniso``, in LAMMPS's restricted triclinic form).
        """
        check_barostat_cell(batch, "CRescale", restricted=self.couple == "aniso")
        return dict(heat=jnp.zeros((batch.n_systems,), batch.positions.dtype))

    def _key(self, step, draw: int):
        return jax.random.fold_in(jax.random.fold_in(jax.random.key(self.seed), step), draw)

    def _thermostat(self, v, heat, ctx: StepContext, draw: int):
        """Half a step (dt/2) of stochastic velocity rescaling, per system."""
        dtype = v.dtype
        kT = self.kB * self.temperature
        ndeg = ctx.dof().astype(dtype)
        ke = 0.5 * ctx.kinetic2(v)
        target = 0.5 * ndeg * kT
        f = jnp.exp(jnp.asarray(-0.5 * self.dt / self.t_period, dtype))
        k_r, k_g = jax.random.split(self._key(ctx.step, draw))
        r = jax.random.normal(k_r, ke.shape, dtype)
        rest = jnp.maximum(ndeg - 1, 1e-30)
        # Σ of ndeg - 1 squared normals = 2·Gamma((ndeg - 1) / 2).
        squares = jnp.where(ndeg > 1, 2.0 * jax.random.gamma(k_g, rest / 2, dtype=dtype), 0.0)
        new = ke + (1 - f) * (target * (squares + r * r) / ndeg - ke) + 2 * r * jnp.sqrt(
            jnp.maximum(ke * target / ndeg * (1 - f) * f, 0.0))
        alpha = jnp.sqrt(jnp.where(ke > 0, jnp.maximum(new, 0.0) / jnp.where(ke > 0, ke, 1.0), 1.0))
        return v * alpha[ctx.system][:, None], heat + ke - alpha * alpha * ke

    def _force(self, volume, kin2, virial):
        """λ-space force of the barostat, λ = √V: -2λ(P - P_int - kT / 2V), [S]."""
        kT = self.kB * self.temperature
        p_int = (jnp.trace(virial, axis1=1, axis2=2) + kin2) / (3 * volume)
        return -2 * jnp.sqrt(volume) * (self.pressure - p_int - 0.5 * kT / volume)

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One step from ``state`` (velocity rescaling, a stochastic volume or per-axis move
        inside velocity Verlet, velocity rescaling), with ``ctx`` and ``forces_fn`` as
        :meth:`~jaxdd.dynamics.integrators.Dynamics.step` takes them."""
        dtype = state.positions.dtype
        dt = jnp.asarray(self.dt, dtype)
        kT = self.kB * self.temperature
        sys = ctx.system
        heat = state.extra["heat"]
        v, heat = self._thermostat(state.velocities, heat, ctx, 0)
        v = v + 0.5 * dt * state.forces * ctx.inv_mass
        if self.couple == "aniso":
            x, v, cell, f, e, virial, heat = self._aniso_move(state, ctx, v, heat, forces_fn)
            v = v + 0.5 * dt * f * ctx.inv_mass
            v, heat = self._thermostat(v, heat, ctx, 2)
            v = jnp.where(ctx.valid[:, None], v, 0.0)
            return state._replace(positions=x, velocities=v, forces=f, energy=e, cell=cell, virial=virial,
                                  extra=dict(heat=heat))
        # The volume move: λ = √V diffuses with D = kT β_T / (4 τ_P).
        volume = cell_volume(state.cell)
        diffusion = 0.25 * kT * self.compressibility / self.p_period
        force = self._force(volume, ctx.kinetic2(v), state.virial)
        noise = jax.random.normal(self._key(ctx.step, 1), volume.shape, dtype)
        d_lambda = diffusion / kT * force * dt + jnp.sqrt(2 * diffusion * dt) * noise
        scale = jnp.exp(2 * jnp.log1p(d_lambda / jnp.sqrt(volume)) / 3)
        heat = heat + 0.5 * d_lambda * force - 0.25 * diffusion / kT * dt * force**2 + 0.5 * kT * jnp.log(volume)
        r1 = scale[sys][:, None]
        vf = 1.0 / r1
        x = r1 * state.positions + 0.5 * (r1 + vf) * v * dt
        cell = state.cell * scale[:, None, None]
        v = v * vf
        f, e, virial = forces_fn(x, cell)
        volume = cell_volume(cell)
        force = self._force(volume, ctx.kinetic2(v), virial)
        heat = heat + 0.5 * d_lambda * force + 0.25 * diffusion / kT * dt * force**2 - 0.5 * kT * jnp.log(volume)
        v = v + 0.5 * dt * f * ctx.inv_mass
        v, heat = self._thermostat(v, heat, ctx, 2)
        v = jnp.where(ctx.valid[:, None], v, 0.0)
        return state._replace(positions=x, velocities=v, forces=f, energy=e, cell=cell, virial=virial,
                              extra=dict(heat=heat))

    def _aniso_move(self, state, ctx, v, heat, forces_fn):
        """The drift with each axis's log-length moved by its own Gaussian step; returns
        (positions, velocities, cell, forces, energy, virial, heat)."""
        dtype = v.dtype
        dt = jnp.asarray(self.dt, dtype)
        kT = self.kB * self.temperature
        sys = ctx.system
        rate = self.compressibility / (3 * self.p_period)

        def drift_and_diffusion(cell, velocities, virial):
            volume = cell_volume(cell)
            kin = ctx.kinetic_tensor(velocities)
            p_diag = (jnp.diagonal(kin, axis1=1, axis2=2) + jnp.diagonal(virial, axis1=1, axis2=2)) / volume[:, None]
            return rate * (p_diag - self.pressure), kT * rate / volume, volume  # [S, 3], [S], [S]

        a0, d0, v0 = drift_and_diffusion(state.cell, v, state.virial)
        noise = jax.random.normal(self._key(ctx.step, 1), a0.shape, dtype)
        d_eps = a0 * dt + jnp.sqrt(2 * d0 * dt)[:, None] * noise  # [S, 3]
        r1 = jnp.exp(d_eps)
        vf = 1.0 / r1
        x = r1[sys] * state.positions + 0.5 * (r1 + vf)[sys] * v * dt
        cell = state.cell * r1[:, None, :]  # each lattice vector's x, y, z components
        v = v * vf[sys]
        f, e, virial = forces_fn(x, cell)
        a1, d1, v1 = drift_and_diffusion(cell, v, virial)
        # -kT ln(T_backward / T_forward) of the Gaussian moves, and the entropy -kT ln V of
        # the measure: what the effective energy gains.
        log_ratio = (jnp.sum((d_eps - a0 * dt) ** 2, axis=1) / (4 * d0 * dt)
                     - jnp.sum((d_eps + a1 * dt) ** 2, axis=1) / (4 * d1 * dt) - 1.5 * jnp.log(d1 / d0))
        heat = heat - kT * log_ratio - kT * jnp.log(v1 / v0)
        return x, v, cell, f, e, virial, heat

    def energy(self, extra, n_atoms, cell):
        """P·V + the accumulated work of thermostat and barostat, [S] eV.

        Args:
          extra: the integrator's state (``heat``).
          n_atoms: [S] real atoms of each system (not read).
          cell: [S, 3, 3] cells (Å).
        """
        volume = jnp.abs(jnp.linalg.det(jnp.asarray(cell, extra["heat"].dtype)))
        return self.pressure * volume + extra["heat"]


