"""Nosé–Hoover chains (NVT) and the Martyna–Tobias–Klein barostat (NPT), integrated as
LAMMPS's ``fix nvt`` / ``fix npt`` integrate them (``fix_nh.cpp``: Shinoda, Shiga & Mikami
2004, Tuckerman et al. 2006), so a run started from the same atoms follows LAMMPS's
trajectory to round-off.

Every quantity is per system ([S]): each system of a batch has its own chain, barostat and
cell. The sums over atoms (kinetic energy, its tensor) go through the step context's
collectives, so a step is the same on any number of ranks. Units as in
:mod:`jaxdd.dynamics.integrators`; pressures in eV/Å³ (``ase.units.GPa`` converts), or
reduced units with ``kB=1``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..data.checks import integral
from ..engine.cells import carry_with_cell
from .integrators import (KB_EV_PER_K, Dynamics, RankState, StepContext, check_number, check_period,
                          register_integrator, verlet)

__all__ = ["NoseHooverChain", "MTKBarostat", "chain_half_step", "cell_volume", "check_barostat_cell"]

_COUPLINGS = ("iso", "aniso", "tri")


def chain_half_step(eta, eta_dot, eta_dotdot, ke2, target, kT, masses, dt: float, loops: int):
    """Half a step (dt/2) of a Nosé–Hoover chain on S systems, as LAMMPS's ``nhc_temp_integrate``.

    Args:
      eta, eta_dot, eta_dotdot: [S, M] the chain's positions, velocities and forces (the
        forces of links ≥ 1 are carried from the last call).
      ke2: [S] twice the kinetic energy of what the chain drives (Σ m v² of the atoms, or
        Σ W ω̇² of a barostat).
      target: [S] its target (dof·kB·T).
      kT: [S] or scalar.
      masses: [S, M] the links' masses Q.
      dt: the full time step (the chain advances dt/2).
      loops: the Suzuki–Yoshida-free sub-steps of LAMMPS's ``tloop``.

    Returns:
      ``(eta, eta_dot, eta_dotdot, scale)``: scale [S] multiplies the driven velocities.
    """
    m = eta.shape[1]
    et = [eta[:, i] for i in range(m)]
    ed = [eta_dot[:, i] for i in range(m)] + [jnp.zeros_like(eta_dot[:, 0])]  # a dummy last link at rest
    edd = [eta_dotdot[:, i] for i in range(m)]
    q = [masses[:, i] for i in range(m)]
    nc = 1.0 / loops
    dt2, dt4, dt8 = dt / 2, dt / 4, dt / 8

    def force0(ke2):
        return jnp.where(q[0] > 0, (ke2 - target) / jnp.where(q[0] > 0, q[0], 1.0), 0.0)

    edd[0] = force0(ke2)
    scale = jnp.ones_like(ke2)
    for _ in range(loops):
        for i in range(m - 1, 0, -1):
            f = jnp.exp(-nc * dt8 * ed[i + 1])
            ed[i] = (ed[i] * f + edd[i] * nc * dt4) * f
        f0 = jnp.exp(-nc * dt8 * ed[1])
        ed[0] = (ed[0] * f0 + edd[0] * nc * dt4) * f0
        factor = jnp.exp(-nc * dt2 * ed[0])
        scale = scale * factor
        ke2 = ke2 * factor * factor
        edd[0] = force0(ke2)
        et = [e + nc * dt2 * d for e, d in zip(et, ed)]
        ed[0] = (ed[0] * f0 + edd[0] * nc * dt4) * f0
        for i in range(1, m):
            f = jnp.exp(-nc * dt8 * ed[i + 1])
            edd[i] = (q[i - 1] * ed[i - 1] ** 2 - kT) / q[i]
            ed[i] = (ed[i] * f + edd[i] * nc * dt4) * f
    return jnp.stack(et, 1), jnp.stack(ed[:m], 1), jnp.stack(edd, 1), scale


def _chain_masses(n_links: int, first, kT, freq):
    """[S, M]: the first link's mass ``first`` [S], the others kT / freq²."""
    rest = kT / freq**2 * jnp.ones_like(first)
    return jnp.stack([first] + [rest] * (n_links - 1), 1)


def _chain_init(n_systems: int, n_links: int, freq: float, dtype) -> dict:
    # LAMMPS's setup(): links ≥ 1 start with the force (Q_{i-1} η̇_{i-1}² - kT) / Q_i = -freq² at rest.
    dd = np.zeros((n_systems, n_links))
    dd[:, 1:] = -(freq**2)
    z = np.zeros((n_systems, n_links))
    return dict(eta=jnp.asarray(z, dtype), eta_dot=jnp.asarray(z, dtype), eta_dotdot=jnp.asarray(dd, dtype))


def _chain_energy(eta, eta_dot, masses, first_kT, kT):
    """Σ ½ Q η̇² + L·kT·η₀ + Σ_{i≥1} kT·ηᵢ (LAMMPS's compute_scalar), [S]."""
    pot = first_kT * eta[:, 0] + kT * jnp.sum(eta[:, 1:], axis=1)
    return pot + 0.5 * jnp.sum(masses * eta_dot**2, axis=1)


class _Thermostat:
    """The particle chain shared by :class:`NoseHooverChain` and :class:`MTKBarostat`."""

    def _kT(self):
        return self.kB * self.temperature

    def _t_masses(self, dof):
        kT, freq = self._kT(), 1.0 / self.t_period
        return _chain_masses(self.chain, dof * kT / freq**2, kT, freq)

    def _thermostat(self, extra: dict, ke2, dof):
        """(extra with the chain advanced half a step, velocity scale [S])."""
        kT = self._kT()
        eta, ed, edd, scale = chain_half_step(extra["eta"], extra["eta_dot"], extra["eta_dotdot"], ke2, dof * kT,
                                              kT, self._t_masses(dof), self.dt, self.loops)
        return dict(extra, eta=eta, eta_dot=ed, eta_dotdot=edd), scale

    def _thermostat_energy(self, extra, dof):
        kT = self._kT()
        return _chain_energy(extra["eta"], extra["eta_dot"], self._t_masses(dof), dof * kT, kT)


def _common_checks(self, name: str, period: str):
    for f in ("dt", period):
        object.__setattr__(self, f, check_number(name, f, getattr(self, f)))
    object.__setattr__(self, "temperature", check_number(name, "temperature", self.temperature))
    object.__setattr__(self, "kB", check_number(name, "kB", self.kB))
    object.__setattr__(self, "chain", integral(f"{name}.chain", self.chain, minimum=1))
    object.__setattr__(self, "loops", integral(f"{name}.loops", self.loops, minimum=1))
    check_period(name, period, getattr(self, period), self.dt)


@register_integrator
@dataclasses.dataclass(frozen=True)
class NoseHooverChain(_Thermostat, Dynamics):
    """NVT with a Nosé–Hoover chain, as LAMMPS's ``fix nvt temp T T period``.

    dt: time step. temperature: target T (K with the default ``kB``). period: the
    thermostat's damping time (LAMMPS's Tdamp, ~100 dt). chain: links (LAMMPS's tchain, 3).
    loops: sub-steps of the chain per half step (tloop, 1). kB: Boltzmann constant.

    Conserved (thermo ``conserved``): E + Σ ½Qη̇² + N_f kT η₀ + Σ_{i≥1} kT ηᵢ, with
    N_f = 3N - 3 and Q₀ = N_f kT period², Qᵢ = kT period².
    """

    dt: float
    temperature: float
    period: float
    chain: int = 3
    loops: int = 1
    kB: float = KB_EV_PER_K

    @property
    def t_period(self) -> float:
        """The thermostat's damping time (``period``), under the name barostats use."""
        return self.period

    def __post_init__(self):
        _common_checks(self, "NoseHooverChain", "period")

    def init(self, batch) -> dict:
        """The chain at rest (``eta``, ``eta_dot``, ``eta_dotdot`` [S, chain]) for ``batch``'s systems."""
        return _chain_init(batch.n_systems, self.chain, 1.0 / self.period, batch.positions.dtype)

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One step from ``state`` (chain half step, velocity Verlet, chain half step), with
        ``ctx`` and ``forces_fn`` as :meth:`~jaxdd.dynamics.integrators.Dynamics.step` takes them."""
        dt = jnp.asarray(self.dt, state.positions.dtype)
        dof = ctx.dof().astype(state.positions.dtype)
        extra, s = self._thermostat(state.extra, ctx.kinetic2(state.velocities), dof)
        x, v, f, e, w = verlet(state.positions, state.velocities * s[ctx.system][:, None], state.forces, ctx,
                               forces_fn, dt)
        extra, s = self._thermostat(extra, ctx.kinetic2(v), dof)
        v = v * s[ctx.system][:, None]
        return state._replace(positions=x, velocities=v, forces=f, energy=e, extra=extra,
                              virial=state.virial if w is None else w)

    def energy(self, extra, n_atoms, cell):
        """The chain's energy [S] eV (Σ ½Qη̇² + N_f kT η₀ + Σ_{i≥1} kT ηᵢ), for the thermo's ``conserved``.

        Args:
          extra: the integrator's state (the chain).
          n_atoms: [S] real atoms of each system (N_f = 3N - 3).
          cell: [S, 3, 3] cells (Å; not read).
        """
        dof = jnp.maximum(3 * jnp.asarray(n_atoms) - 3, 1).astype(extra["eta"].dtype)
        return self._thermostat_energy(extra, dof)


@register_integrator
@dataclasses.dataclass(frozen=True)
class MTKBarostat(_Thermostat, Dynamics):
    """NPT: Martyna–Tobias–Klein barostat with Nosé–Hoover chains on the atoms and on the
    barostat, as LAMMPS's ``fix npt temp T T t_period {iso|aniso|tri} P P p_period``.

    dt: time step. temperature: target T. pressure: target P (eV/Å³; the off-diagonal
    targets of ``tri`` are 0). t_period, p_period: damping times (Tdamp ~100 dt, Pdamp
    ~1000 dt). couple: ``"iso"`` (the cell scales uniformly), ``"aniso"`` (x, y, z lengths
    separately), ``"tri"`` (also the tilts xy, xz, yz). chain, p_chain: links of the
    particle and barostat chains (3, 3); loops, p_loops: their sub-steps (1, 1). kB:
    Boltzmann constant.

    The cell moves: positions are mapped with it (fractional coordinates kept) and the
    blocks of the decomposition follow. Every system must be periodic on all three axes;
    ``aniso`` and ``tri`` need LAMMPS's restricted cell (a along x, b in the xy plane:
    lower-triangular rows; ``ase.cell.Cell.standard_form()`` gives it). Box flips of
    strongly tilted cells (LAMMPS's ``flip yes``) are not made: the cell keeps its shape.

    Conserved (thermo ``conserved``, LAMMPS's ``econserve``): E + the particle chain's
    energy (as NoseHooverChain) + Σ ½ W ω̇² + P (V - V₀) + the barostat chain's energy, with
    W = (N + 1) kT p_period² and the barostat chain's first link counted at kT per
    barostatted component (3 iso and aniso, 6 tri; its dynamics hold iso at one kT), as
    LAMMPS's ``compute_scalar``.
    """

    dt: float
    temperature: float
    pressure: float
    t_period: float
    p_period: float
    couple: str = "iso"
    chain: int = 3
    p_chain: int = 3
    loops: int = 1
    p_loops: int = 1
    kB: float = KB_EV_PER_K

    needs_virial = True
    moves_cell = True

    def __post_init__(self):
        _common_checks(self, "MTKBarostat", "t_period")
        object.__setattr__(self, "p_period", check_number("MTKBarostat", "p_period", self.p_period))
        check_period("MTKBarostat", "p_period", self.p_period, self.dt, barostat=True)
        object.__setattr__(self, "pressure", check_number("MTKBarostat", "pressure", self.pressure, positive=False))
        object.__setattr__(self, "p_chain", integral("MTKBarostat.p_chain", self.p_chain, minimum=1))
        object.__setattr__(self, "p_loops", integral("MTKBarostat.p_loops", self.p_loops, minimum=1))
        if self.couple not in _COUPLINGS:
            raise ValueError(f"MTKBarostat.couple must be one of {_COUPLINGS}, got {self.couple!r}")

    # ---------------------------------------------------------------- set-up

    def init(self, batch) -> dict:
        """Both chains at rest, the cell's rates ``omega_dot`` [S, 6] zero and the reference volume ``vol0`` [S] Å³.

        Args:
          batch: the Batch of the run; every real system must be periodic on all axes (and, for
            ``aniso`` and ``tri``, in LAMMPS's restricted triclinic form).
        """
        check_barostat_cell(batch, "MTKBarostat", restricted=self.couple != "iso")
        n, dtype = batch.n_systems, batch.positions.dtype
        pfreq = 1.0 / self.p_period
        extra = _chain_init(n, self.chain, 1.0 / self.t_period, dtype)
        p = _chain_init(n, self.p_chain, pfreq, dtype)
        extra.update(etap=p["eta"], etap_dot=p["eta_dot"], etap_dotdot=p["eta_dotdot"])
        volume = np.abs(np.linalg.det(np.asarray(batch.cell, np.float64)))
        extra.update(omega_dot=jnp.zeros((n, 6), dtype), vol0=jnp.asarray(volume, dtype))
        return extra

    # ---------------------------------------------------------------- pieces of fix_nh.cpp

    def _w(self, n_atoms):
        """Barostat mass W = (N + 1) kT / p_freq², [S] (LAMMPS's setup())."""
        return (n_atoms + 1) * self._kT() * self.p_period**2

    def _p_masses(self, like):
        kT, freq = self._kT(), 1.0 / self.p_period
        return _chain_masses(self.p_chain, kT / freq**2 * jnp.ones_like(like), kT, freq)

    def _p_target(self):
        """What the barostat chain holds Σ W ω̇² at: kT for iso (one degree of freedom), else
        kT per barostatted component (3 aniso, 6 tri), as LAMMPS's nhc_press_integrate."""
        return self._kT() * (1 if self.couple == "iso" else int(self._flags().sum()))

    def _flags(self):
        return np.array([True] * 3 + [self.couple == "tri"] * 3)

    def _barostat_thermostat(self, extra, w):
        """nhc_press_integrate: the barostat's chain half a step; ω̇ scaled."""
        od = extra["omega_dot"]
        flags = jnp.asarray(self._flags())
        ke2 = jnp.sum(jnp.where(flags, w[:, None] * od * od, 0.0), axis=1)
        kT = self._kT()
        eta, ed, edd, scale = chain_half_step(extra["etap"], extra["etap_dot"], extra["etap_dotdot"], ke2,
                                              self._p_target() * jnp.ones_like(ke2), kT, self._p_masses(ke2),
                                              self.dt, self.p_loops)
        return dict(extra, etap=eta, etap_dot=ed, etap_dotdot=edd, omega_dot=od * scale[:, None])

    def _p_current(self, kin, virial, volume):
        """The pressure the barostat reads, Voigt [S, 6] (xx, yy, zz, yz, xz, xy) from
        (Σ m v v + W) / V, coupled as LAMMPS's couple()."""
        p = (kin + virial) / volume[:, None, None]
        diag = jnp.stack([p[:, 0, 0], p[:, 1, 1], p[:, 2, 2]], 1)
        if self.couple == "iso":
            diag = jnp.repeat(jnp.mean(diag, axis=1, keepdims=True), 3, axis=1)
        off = jnp.stack([p[:, 1, 2], p[:, 0, 2], p[:, 0, 1]], 1)
        return jnp.concatenate([diag, off], 1)

    def _omega_dot(self, od, p_cur, volume, kin, n_atoms, w):
        """nh_omega_dot: ω̇ += dt/2 · force on the cell."""
        dt2 = self.dt / 2
        mtk1 = jnp.trace(kin, axis1=1, axis2=2) / (3 * n_atoms)
        f_diag = ((p_cur[:, :3] - self.pressure) * volume[:, None] + mtk1[:, None]) / w[:, None]
        f_off = p_cur[:, 3:] * volume[:, None] / w[:, None]
        f = jnp.concatenate([f_diag, jnp.where(self.couple == "tri", f_off, 0.0)], 1)
        return od + f * dt2

    def _v_press(self, v, od, n_atoms, system):
        """nh_v_press: the barostat's half-step scaling of the velocities."""
        mtk2 = jnp.sum(od[:, :3], axis=1) / (3 * n_atoms)
        factor = jnp.exp(-self.dt / 4 * (od[:, :3] + mtk2[:, None]))[system]  # [n, 3]
        v = v * factor
        if self.couple == "tri":
            o = od[system]
            vx = v[:, 0] - self.dt / 2 * (v[:, 1] * o[:, 5] + v[:, 2] * o[:, 4])
            vy = v[:, 1] - self.dt / 2 * v[:, 2] * o[:, 3]
            v = jnp.stack([vx, vy, v[:, 2]], 1)
        return v * factor

    def _remap(self, cell, od):
        """The cell after dt/2 of ḣ = ω̇ h (LAMMPS's remap(), time-symmetric splitting)."""
        dto = self.dt / 2
        if self.couple == "iso":
            return cell * jnp.exp(dto * od[:, 0])[:, None, None]
        h = [cell[:, 0, 0], cell[:, 1, 1], cell[:, 2, 2], cell[:, 2, 1], cell[:, 2, 0], cell[:, 1, 0]]
        tri = self.couple == "tri"

        # Both halves of the tilt update read the lengths from before the step: LAMMPS's
        # remap() rescales boxlo/boxhi and sets h from them only after both halves.
        ly, lz = h[1], h[2]

        def tilts(h):
            h = list(h)
            e = jnp.exp(dto / 8 * od[:, 0])
            h[4] = (h[4] * e + dto / 4 * (od[:, 5] * h[3] + od[:, 4] * lz)) * e
            e = jnp.exp(dto / 4 * od[:, 1])
            h[3] = (h[3] * e + dto / 2 * od[:, 3] * lz) * e
            e = jnp.exp(dto / 4 * od[:, 0])
            h[5] = (h[5] * e + dto / 2 * od[:, 5] * ly) * e
            e = jnp.exp(dto / 8 * od[:, 0])
            h[4] = (h[4] * e + dto / 4 * (od[:, 5] * h[3] + od[:, 4] * lz)) * e
            return h

        if tri:
            h = tilts(h)
        e = [jnp.exp(dto * od[:, i]) for i in range(3)]
        h[0], h[1], h[2] = h[0] * e[0], h[1] * e[1], h[2] * e[2]
        if not tri:  # tilts not barostatted keep their ratio to the length they lean along
            h[5], h[4], h[3] = h[5] * e[1], h[4] * e[2], h[3] * e[2]
        if tri:
            h = tilts(h)
        z = jnp.zeros_like(h[0])
        return jnp.stack([jnp.stack([h[0], z, z], 1), jnp.stack([h[5], h[1], z], 1),
                          jnp.stack([h[4], h[3], h[2]], 1)], 1)

    # ---------------------------------------------------------------- the step

    def step(self, state: RankState, ctx: StepContext, forces_fn) -> RankState:
        """One step of LAMMPS's ``fix npt`` from ``state`` (chains and cell rates half steps around
        velocity Verlet, the cell remapped twice), with ``ctx`` and ``forces_fn`` as
        :meth:`~jaxdd.dynamics.integrators.Dynamics.step` takes them."""
        dtype = state.positions.dtype
        dt = jnp.asarray(self.dt, dtype)
        sys = ctx.system
        n_atoms = jnp.maximum(ctx.n_atoms, 1).astype(dtype)
        dof = ctx.dof().astype(dtype)
        w = self._w(n_atoms)
        extra = self._barostat_thermostat(state.extra, w)
        extra, s = self._thermostat(extra, ctx.kinetic2(state.velocities), dof)
        v = state.velocities * s[sys][:, None]
        kin = ctx.kinetic_tensor(v)
        volume = cell_volume(state.cell)
        od = self._omega_dot(extra["omega_dot"], self._p_current(kin, state.virial, volume), volume, kin, n_atoms, w)
        v = self._v_press(v, od, n_atoms, sys)
        v = v + 0.5 * dt * state.forces * ctx.inv_mass
        cell1 = self._remap(state.cell, od)
        x = carry_with_cell(state.positions, state.cell, cell1, sys)
        x = x + dt * v
        cell2 = self._remap(cell1, od)
        x = carry_with_cell(x, cell1, cell2, sys)
        f, e, virial = forces_fn(x, cell2)
        v = v + 0.5 * dt * f * ctx.inv_mass
        v = self._v_press(v, od, n_atoms, sys)
        kin = ctx.kinetic_tensor(v)
        volume = cell_volume(cell2)
        od = self._omega_dot(od, self._p_current(kin, virial, volume), volume, kin, n_atoms, w)
        extra, s = self._thermostat(dict(extra, omega_dot=od), jnp.trace(kin, axis1=1, axis2=2), dof)
        v = v * s[sys][:, None]
        extra = self._barostat_thermostat(extra, w)
        v = jnp.where(ctx.valid[:, None], v, 0.0)
        return state._replace(positions=x, velocities=v, forces=f, energy=e, extra=extra, cell=cell2, virial=virial)

    def energy(self, extra, n_atoms, cell):
        """The energy [S] eV of both chains, the barostat's kinetic energy and P (V - V₀).

        Args:
          extra: the integrator's state.
          n_atoms: [S] real atoms of each system.
          cell: [S, 3, 3] cells (Å).
        """
        dtype = extra["eta"].dtype
        n = jnp.maximum(jnp.asarray(n_atoms), 1).astype(dtype)
        dof = jnp.maximum(3 * n - 3, 1)
        kT = self._kT()
        e = self._thermostat_energy(extra, dof)
        od = extra["omega_dot"]
        flags = jnp.asarray(self._flags())
        e = e + 0.5 * jnp.sum(jnp.where(flags, self._w(n)[:, None] * od * od, 0.0), axis=1)
        e = e + self.pressure * (jnp.abs(jnp.linalg.det(jnp.asarray(cell, dtype))) - extra["vol0"])
        return e + _chain_energy(extra["etap"], extra["etap_dot"], self._p_masses(n), kT * int(self._flags().sum()), kT)


def cell_volume(cell):
    """|det cell| [S] Å³ of cells [S, 3, 3]; 1 for the cells of padding systems (zero
    volume, no atoms), so it can divide."""
    v = jnp.abs(jnp.linalg.det(cell))
    return jnp.where(v > 0, v, 1.0)


def check_barostat_cell(batch, owner: str, *, restricted: bool) -> None:
    """Raise ValueError unless every real system of ``batch`` is periodic on all axes (and,
    with ``restricted``, its cell is LAMMPS's restricted triclinic form); ``owner`` names the
    integrator in the message."""
    pbc = np.asarray(batch.pbc, bool).reshape(-1, 3)
    cell = np.asarray(batch.cell, np.float64).reshape(-1, 3, 3)
    real = np.asarray(batch.system_mask, bool)
    for s in np.flatnonzero(real):
        if not pbc[s].all():
            raise ValueError(f"{owner} changes the cell, so every system must be periodic on all three axes; system "
                             f"{s} has pbc {pbc[s].tolist()}. Run NVT (NoseHooverChain) for slabs and clusters")
        if abs(np.linalg.det(cell[s])) <= 0:
            raise ValueError(f"{owner}: system {s} has a cell of zero volume")
        upper = cell[s][np.triu_indices(3, 1)]
        if restricted and np.any(np.abs(upper) > 1e-12 * np.abs(cell[s]).max()):
            raise ValueError(
                f"{owner}(couple='aniso' or 'tri') needs each cell in LAMMPS's restricted triclinic form (a along x, "
                f"b in the xy plane: cell[0, 1] = cell[0, 2] = cell[1, 2] = 0); system {s} has cell "
                f"{cell[s].tolist()}. Rotate the atoms first: cell, rotation = atoms.cell.standard_form(); "
                "atoms.set_cell(cell, scale_atoms=True)")
