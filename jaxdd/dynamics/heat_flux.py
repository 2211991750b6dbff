"""The microscopic heat flux of each system, recorded during a run (``HeatFlux``).

    J = Σᵢ eᵢ vᵢ + Σᵢ Wᵢ · vᵢ      [S, 3] eV·Å per time unit (ε·σ/τ in reduced units)

eᵢ: the energy of atom i, its potential energy (the model's ``atomic_energies``) plus
½ mᵢ vᵢ² unless ``include_kinetic=False``. Wᵢ [3, 3]: its virial (:mod:`jaxdd.engine.virials`),
the per-atom terms of the system's virial -dE/dε, and (Wᵢ · vᵢ)_a = Σ_b Wᵢ_ab vᵢ_b. This
is LAMMPS's ``compute heat/flux`` (Σ eᵢvᵢ - Σ Sᵢvᵢ, its per-atom stress Sᵢ = -Wᵢ), the
flux of the Green–Kubo thermal conductivity (divide by the volume for a current density).

For a pair potential J = d/dt Σᵢ rᵢ eᵢ without periodic images (derivation at
:func:`heat_flux`). For a many-body model (a neighbourhood energy, a message-passing
network) it is the flux of its per-atom virials, as LAMMPS's with ``stress/atom``: the
exact potential term needs each atom's energy differentiated by every edge (Fan et al.,
PRB 92, 094301 (2015); Langer et al., PRB 108, L100302 (2023)).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ..data.checks import integral
from ..engine.host import host_array

__all__ = ["HeatFlux", "heat_flux"]

_HEADER = ("# heat flux J = sum_i e_i v_i + sum_i W_i . v_i per system, in energy * length / time "
           "(eV*Angstrom per ASE time unit, or epsilon*sigma/tau in LJ reduced units); e_i = {energy}\n"
           "# step system Jx Jy Jz\n")


def heat_flux(energies, virials, velocities, masses, system, n_systems: int, include_kinetic: bool = True):
    """The heat flux J [S, 3] of each system from per-atom terms (any number of rows).

    Args:
      energies: [n] eV potential energy of each atom. virials: [n, 3, 3] eV per-atom virials
      (edge-vector index first, gradient index second; :mod:`jaxdd.engine.virials`). velocities:
      [n, 3] Å per time unit. masses: [n] amu (read only with ``include_kinetic``). system:
      [n] system of each row; rows outside ``[0, n_systems)`` (padding) are left out.
      n_systems: S. include_kinetic: eᵢ also holds ½ mᵢ vᵢ² (LAMMPS's ke + pe).

    Returns:
      [S, 3] eV·Å / time unit: Σᵢ eᵢ vᵢ + Σᵢ Σ_b Wᵢ_ab vᵢ_b over each system's rows, summed
      in float64 when it is enabled.
    """
    wide = jnp.promote_types(jnp.result_type(velocities), jnp.float64 if jax.config.jax_enable_x64 else jnp.float32)
    v = jnp.asarray(velocities, wide)
    e = jnp.asarray(energies, wide)
    if include_kinetic:
        e = e + 0.5 * jnp.asarray(masses, wide) * jnp.sum(v * v, axis=-1)
    # Why +W·v, contracted over the gradient index: for a pair potential φ split half-half,
    # eᵢ = ½mᵢvᵢ² + ½Σⱼ φ(rᵢⱼ) with rᵢⱼ = rⱼ - rᵢ and fᵢⱼ = ∇φ(rᵢⱼ) (so Fᵢ = Σⱼ fᵢⱼ),
    # Newton gives ėᵢ = ½Σⱼ fᵢⱼ·(vᵢ + vⱼ), and swapping i and j (rᵢⱼ, fᵢⱼ change sign)
    # d/dt Σᵢ rᵢeᵢ = Σᵢ eᵢvᵢ + Σᵢ rᵢėᵢ = Σᵢ eᵢvᵢ - ¼Σᵢⱼ rᵢⱼ (fᵢⱼ·(vᵢ + vⱼ)). The edge j → i
    # carries ½φ, so its gradient is ½fᵢⱼ and Wᵢ = -½Σⱼ rᵢⱼ ⊗ fᵢⱼ (edge vector first):
    # Σᵢ Σ_b Wᵢ_ab vᵢ_b is the last sum. The velocity meets the gradient (∂e/∂r_e · ṙ_e),
    # which matters for the asymmetric virials of many-body models. With periodic images
    # the rᵢⱼ are the images' and J is still the flux, but no longer d/dt Σᵢ rᵢeᵢ of the
    # unwrapped positions (which puts a pair across the boundary an image apart).
    per_atom = e[:, None] * v + jnp.einsum("nab,nb->na", jnp.asarray(virials, wide), v)
    system = jnp.asarray(system)
    real = (system >= 0) & (system < n_systems)
    # Padding rows go to an extra segment that is dropped (segment ids must be in range).
    segment = jnp.where(real, system, n_systems)
    per_atom = jnp.where(real[:, None], per_atom, 0.0)
    return jax.ops.segment_sum(per_atom, segment, num_segments=n_systems + 1)[:n_systems]


@functools.partial(jax.jit, static_argnums=(6, 7))
def _ranked_flux(energies, virials, velocities, masses, system, ids, n_systems, include_kinetic):
    """:func:`heat_flux` of per-rank rows [P, n, ...] (free rows: ids = -1), reduced over the
    ranks on the devices; [S, 3] comes back."""
    rows = energies.size
    system = jnp.where(ids >= 0, system, -1)
    return heat_flux(energies.reshape(rows), virials.reshape(rows, 3, 3), velocities.reshape(rows, 3),
                     masses.reshape(rows), system.reshape(rows), n_systems, include_kinetic)


class HeatFlux:
    """An observer of :meth:`DomainParallel.run` recording the heat flux J of every system.

    every: steps between records (int > 0). path: a text file to append ``step system Jx Jy
    Jz`` to, one line per system per record, under a ``#`` header naming the units (written
    when the file is new or empty: a restarted run continues its file); process 0 writes.
    include_kinetic: eᵢ holds ½ mᵢ vᵢ² as well as the potential energy (see :func:`heat_flux`).

    The model must output ``atomic_energies`` and see positions only through edge vectors
    (:meth:`DomainParallel.atom_terms`). Sums run on the devices; only [S, 3] per record
    reaches the host. ``steps`` [T] and ``values`` [T, S, 3] (eV·Å / time unit) hold the records.

    Usage: ``flux = HeatFlux(every=10); md.run(state, 1000, observers=[flux]); flux.values``.
    """

    def __init__(self, every: int, path=None, include_kinetic: bool = True):
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every <= 0:
            raise ValueError(f"HeatFlux.every must be an int > 0 (steps between records), got {every!r}")
        self.every = int(every)
        self.path = None if path is None else Path(path)
        self.include_kinetic = bool(include_kinetic)
        self._steps: list[int] = []
        self._values: list[np.ndarray] = []

    @property
    def steps(self) -> np.ndarray:
        """[T] the step of each record."""
        return np.asarray(self._steps, np.int64)

    @property
    def values(self) -> np.ndarray:
        """[T, S, 3] J of each system at each record (eV·Å / time unit)."""
        if not self._values:
            return np.zeros((0, 0, 3))
        return np.stack(self._values)

    def __call__(self, md, state) -> np.ndarray:
        """Record and return J [S, 3] of ``state`` (a collective: every process calls it)."""
        flux = self.compute(md, state)
        step = integral("state.step", state.step, minimum=0)
        self._steps.append(step)
        self._values.append(flux)
        if self.path is not None and jax.process_index() == 0:
            self._write(step, flux)
        return flux

    def check(self, md) -> None:
        """Raise ValueError unless ``md`` can give per-atom terms (called by ``run`` before its
        first step: a graph-parallel run is refused before it has run any)."""
        md.check_atom_terms()

    def compute(self, md, state) -> np.ndarray:
        """J [S, 3] (float64 numpy) of ``state`` without recording it, from the per-atom terms of
        ``md`` (a DomainParallel)."""
        terms = md.atom_terms(state)
        rows = state.rows
        flux = _ranked_flux(terms["atomic_energies"], terms["atomic_virials"], rows.velocities,
                            rows.masses, rows.system, rows.ids, state.template.n_systems,
                            self.include_kinetic)
        return host_array(flux).astype(np.float64)

    def _write(self, step: int, flux: np.ndarray) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", encoding="utf-8") as handle:
            if new:
                kinetic = " + kinetic" if self.include_kinetic else ""
                handle.write(_HEADER.format(energy=f"potential{kinetic} energy of atom i"))
            for s, (jx, jy, jz) in enumerate(flux):
                handle.write(f"{step} {s} {jx:.17g} {jy:.17g} {jz:.17g}\n")
