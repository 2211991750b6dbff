"""Built-in example systems, as ``ase.Atoms`` (so they go to ASE as well as to jaxdd).

* :func:`fcc_lattice` — a cubic fcc supercell of any element.
* :func:`lj_melt` — the classic LAMMPS Lennard-Jones melt (``bench/in.lj``: ``lattice fcc
  0.8442``, ``region box block 0 20 0 20 0 20``, ``velocity all create 3.0 87287``), in LJ
  reduced units (σ = ε = m = k_B = 1).
* :func:`lj_melt_data` — the same melt as an :class:`~jaxdd.AtomicData`.
* :func:`lj_slab`, :func:`lj_droplet` — uneven systems (a film under vacuum, a drop in a
  periodic box) for load balancing.

Positions are listed cell by cell (x slowest, z fastest), four basis atoms per cell.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .checks import integral

__all__ = [
    "LAMMPS_MELT_ENERGY_PER_ATOM",
    "LJ_MELT_DENSITY",
    "fcc_lattice",
    "lj_melt",
    "lj_melt_data",
    "lj_droplet",
    "lj_slab",
    "maxwell_boltzmann_velocities",
    "melt_lattice_constant",
]

#: Potential energy per atom (ε) of the perfect melt lattice at step 0, 20×20×20 cells,
#: ``pair_style lj/cut 2.5`` without shift. Source: LAMMPS lj/cut, in.lj melt benchmark
#: (the table of external references in the project's oracle notes).
LAMMPS_MELT_ENERGY_PER_ATOM = -6.773368053234

#: Reduced number density of the LAMMPS melt (atoms per σ³).
LJ_MELT_DENSITY = 0.8442

# Fractional coordinates of the four atoms of the conventional fcc cell.
_FCC_BASIS = np.array([[0.0, 0.0, 0.0], [0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.5, 0.5, 0.0]])


# ----------------------------------------------------------------------------- checks


def _positive_int(name: str, value) -> int:
    # bool is an int subclass; True cells would be a silent 1.
    return integral(name, value, minimum=1)


def _positive_float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return value


def _cells(n_cells) -> tuple[int, int, int]:
    """``n_cells`` as three positive ints (an int means the same count on every axis)."""
    try:
        counts = tuple(n_cells)
    except TypeError:  # one count for every axis
        counts = (n_cells,) * 3
    if len(counts) != 3:
        raise ValueError(f"n_cells must be a positive integer or 3 positive integers, got {n_cells!r}")
    return tuple(_positive_int("n_cells", c) for c in counts)


# ----------------------------------------------------------------------------- lattices


def fcc_lattice(n_cells, lattice_constant: float, symbol: str = "Ar"):
    """A fully periodic cubic fcc supercell.

    Args:
      n_cells: conventional cells per axis, an int or 3 ints.
      lattice_constant: edge a of the conventional cell (Å, or σ in reduced units).
      symbol: the chemical symbol of every atom.

    Returns:
      ``ase.Atoms`` with 4 · n_x · n_y · n_z atoms, cell diag(n_x a, n_y a, n_z a),
      nearest-neighbour distance a / sqrt(2); masses are ASE's defaults for ``symbol``.
    """
    import ase

    counts = _cells(n_cells)
    a = _positive_float("lattice_constant", lattice_constant)
    grid = np.stack(np.meshgrid(*(np.arange(c) for c in counts), indexing="ij"), axis=-1).reshape(-1, 1, 3)
    frac_in_cells = (grid + _FCC_BASIS[None]).reshape(-1, 3)  # [4 n_cells, 3], in cell units
    return ase.Atoms(
        symbols=[symbol] * frac_in_cells.shape[0],
        positions=frac_in_cells * a,
        cell=np.diag(np.asarray(counts, dtype=np.float64) * a),
        pbc=True,
    )


def melt_lattice_constant(density: float = LJ_MELT_DENSITY) -> float:
    """Edge (σ) of the fcc cell holding 4 atoms at number ``density`` (σ⁻³): (4/ρ)^(1/3)."""
    return (4.0 / _positive_float("density", density)) ** (1.0 / 3.0)


def maxwell_boltzmann_velocities(masses: np.ndarray, temperature: float, seed: int) -> np.ndarray:
    """Velocities [N, 3] at exactly ``temperature`` (k_B = 1) with zero net momentum.

    Gaussian draws of variance T/m, the centre-of-mass velocity removed, then rescaled so that
    sum(m v²) / (3N - 3) = T (LAMMPS's count of degrees of freedom for ``compute temp``).

    Args:
      masses: [N] atom masses.
      temperature: the temperature T (k_B = 1: in the units of m v²).
      seed: the seed of numpy's random stream.

    Returns:
      [N, 3] velocities.
    """
    masses = np.asarray(masses, dtype=np.float64)
    n = masses.shape[0]
    if n < 2:
        raise ValueError(f"a temperature needs at least 2 atoms (3N - 3 > 0), got {n}")
    rng = np.random.default_rng(seed)
    v = rng.standard_normal((n, 3)) * np.sqrt(temperature / masses)[:, None]
    v -= (masses @ v) / masses.sum()
    current = np.sum(masses[:, None] * v * v) / (3 * n - 3)
    return v * np.sqrt(temperature / current)


def lj_melt(n_cells=20, density: float = LJ_MELT_DENSITY, temperature: float | None = None, seed: int = 0):
    """The LAMMPS LJ melt in reduced units: an fcc lattice of unit-mass atoms.

    Args:
      n_cells: fcc cells per axis (int or 3 ints; 20 gives the benchmark's 32,000 atoms).
      density: number density ρ (σ⁻³); lattice constant (4/ρ)^(1/3) σ.
      temperature: if given (ε/k_B, e.g. 3.0 as in ``velocity all create 3.0 87287``), the
        atoms get Maxwell-Boltzmann velocities (σ/τ) with zero net momentum, rescaled to exactly
        this temperature over 3N - 3 degrees of freedom. The random stream is numpy's from
        ``seed``, not LAMMPS's, so the velocities differ from a LAMMPS run with the same seed.
      seed: non-negative int.

    Returns:
      ``ase.Atoms`` (symbol Ar, masses 1). Velocities are in reduced units: ASE's
      ``get_temperature()`` (kelvin, eV-based) does not apply to them.
    """
    counts = _cells(n_cells)
    a = melt_lattice_constant(density)
    if temperature is not None:
        temperature = _positive_float("temperature", temperature)
    seed = integral("seed", seed, minimum=0)
    atoms = fcc_lattice(counts, a, symbol="Ar")
    atoms.set_masses(np.ones(len(atoms)))
    if temperature is not None:
        atoms.set_velocities(maxwell_boltzmann_velocities(atoms.get_masses(), temperature, int(seed)))
    return atoms


def lj_melt_data(n_cells=20, density: float = LJ_MELT_DENSITY, temperature: float | None = None,
                 seed: int = 0, dtype=None):
    """:func:`lj_melt` as an :class:`~jaxdd.AtomicData` of float ``dtype`` (JAX's default when None).

    Args:
      n_cells, density, temperature, seed: as for :func:`lj_melt`.
      dtype: the float dtype of the arrays.
    """
    from . import AtomicData

    return AtomicData.from_ase(lj_melt(n_cells, density, temperature, seed), dtype=dtype)


def lj_slab(n_cells=(6, 6, 4), vacuum: float = 0.6, pbc=(True, True, False), density: float = LJ_MELT_DENSITY,
            temperature: float | None = None, seed: int = 0):
    """A film of the LJ melt lattice in a cell whose upper ``vacuum`` fraction along z is empty.

    Args:
      n_cells: fcc cells of the film (int or 3 ints).
      vacuum: fraction of the cell's height above the film, in [0, 1).
      pbc: periodic axes (default a (T, T, F) slab).
      density, temperature, seed: as for :func:`lj_melt`.

    Returns:
      ``ase.Atoms`` (reduced units, masses 1).
    """
    if isinstance(vacuum, bool) or not isinstance(vacuum, numbers.Real) or not 0 <= vacuum < 1:
        raise ValueError(f"vacuum must be a fraction in [0, 1), got {vacuum!r}")
    atoms = lj_melt(n_cells, density, temperature, seed)
    cell = np.array(atoms.cell)
    cell[2] /= 1.0 - float(vacuum)
    atoms.set_cell(cell)
    atoms.pbc = tuple(bool(p) for p in pbc)
    return atoms


def lj_droplet(radius: float = 6.0, box: float = 24.0, density: float = LJ_MELT_DENSITY,
               temperature: float | None = None, seed: int = 0, jitter: float = 0.1, centre=(0.5, 0.5, 0.5)):
    """A sphere of the LJ melt lattice in a periodic cubic box, each atom displaced at random
    (a liquid drop has no lattice planes).

    Args:
      radius: the sphere's radius (σ), below ``box / 2``.
      box: the edge of the cubic box (σ).
      density, temperature, seed: as for :func:`lj_melt`.
      jitter: the typical random displacement of an atom (σ).
      centre: the sphere's centre as a fractional position in the box.

    Returns:
      ``ase.Atoms`` (positions wrapped into the box).
    """
    radius, box = _positive_float("radius", radius), _positive_float("box", box)
    if 2 * radius >= box:
        raise ValueError(f"a droplet of radius {radius} does not fit a box of {box}: radius must be below box / 2")
    n = int(math.ceil(2 * radius / melt_lattice_constant(density))) + 1
    atoms = lj_melt(n, density, temperature, seed)
    centre_of_lattice = np.array(atoms.cell).sum(axis=0) / 2
    keep = np.linalg.norm(atoms.positions - centre_of_lattice, axis=1) <= radius
    atoms = atoms[keep]
    atoms.positions += box * np.asarray(centre, np.float64) - centre_of_lattice
    if jitter:
        atoms.positions += np.random.default_rng(seed).normal(0.0, float(jitter) / np.sqrt(3), atoms.positions.shape)
    atoms.set_cell(np.eye(3) * box)
    atoms.pbc = True
    atoms.wrap()
    if temperature is not None:
        atoms.set_velocities(maxwell_boltzmann_velocities(atoms.get_masses(), float(temperature), int(seed)))
    return atoms
