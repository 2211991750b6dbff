"""Specification of jaxdd.data.systems: the built-in fcc lattice and LAMMPS LJ melt."""

import math

import numpy as np
import pytest

from jaxdd.data import AtomicData
from jaxdd.data.systems import (
    LAMMPS_MELT_ENERGY_PER_ATOM,
    fcc_lattice,
    lj_melt,
    lj_melt_data,
    melt_lattice_constant,
)


def kinetic_temperature(atoms):
    """Reduced temperature sum(m v²) / (3N - 3), k_B = 1."""
    m = atoms.get_masses()[:, None]
    v = atoms.get_velocities()
    return float(np.sum(m * v * v)) / (3 * len(atoms) - 3)


# ------------------------------------------------------------------------------ lattices


def test_melt_has_32000_atoms_at_default_size():
    assert len(lj_melt()) == 32_000


def test_melt_number_density_is_0_8442():
    atoms = lj_melt(5)
    assert len(atoms) / atoms.get_volume() == pytest.approx(0.8442, rel=1e-12)


def test_melt_lattice_constant_is_cube_root_of_4_over_density():
    assert melt_lattice_constant(0.8442) == pytest.approx((4 / 0.8442) ** (1 / 3), rel=1e-15)


def test_nearest_neighbour_distance_is_a_over_sqrt2():
    a = melt_lattice_constant()
    d = lj_melt(3).get_all_distances(mic=True)
    nearest = d[~np.eye(len(d), dtype=bool)].min(initial=np.inf)
    assert nearest == pytest.approx(a / math.sqrt(2), rel=1e-12)


def test_melt_is_fully_periodic_cube_of_unit_masses():
    atoms = lj_melt(2)
    a = melt_lattice_constant()
    assert atoms.pbc.all()
    np.testing.assert_allclose(atoms.cell.array, np.diag([2 * a] * 3), rtol=1e-15)
    np.testing.assert_array_equal(atoms.get_masses(), np.ones(32))


def test_fcc_lattice_takes_three_cell_counts():
    atoms = fcc_lattice((1, 2, 3), 4.0, symbol="Cu")
    assert len(atoms) == 4 * 1 * 2 * 3
    assert set(atoms.get_chemical_symbols()) == {"Cu"}
    np.testing.assert_allclose(atoms.cell.lengths(), [4.0, 8.0, 12.0])


def test_fcc_atoms_lie_inside_the_cell():
    frac = fcc_lattice(3, 1.5).get_scaled_positions(wrap=False)
    assert frac.min() >= 0 and frac.max() < 1


def test_lammps_reference_is_the_published_figure():
    assert LAMMPS_MELT_ENERGY_PER_ATOM == -6.773368053234


# ------------------------------------------------------------------------------ velocities


def test_melt_without_temperature_is_at_rest():
    assert not lj_melt(2).has("momenta")


def test_melt_velocities_have_zero_net_momentum():
    atoms = lj_melt(4, temperature=3.0, seed=87287)
    np.testing.assert_allclose(atoms.get_momenta().sum(axis=0), 0.0, atol=1e-11)


def test_melt_velocities_have_the_requested_temperature():
    atoms = lj_melt(4, temperature=3.0, seed=87287)
    assert kinetic_temperature(atoms) == pytest.approx(3.0, rel=1e-12)


def test_melt_velocities_follow_the_seed():
    v0 = lj_melt(2, temperature=1.0, seed=1).get_velocities()
    np.testing.assert_array_equal(v0, lj_melt(2, temperature=1.0, seed=1).get_velocities())
    assert not np.allclose(v0, lj_melt(2, temperature=1.0, seed=2).get_velocities())


def test_melt_data_carries_dtype_masses_and_velocities():
    data = lj_melt_data(2, temperature=1.5, dtype=np.float32)
    assert isinstance(data, AtomicData)
    assert data.positions.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(data.masses), 1.0)
    assert data.velocities is not None and data.velocities.shape == (32, 3)


# ------------------------------------------------------------------------------ arguments


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(n_cells=0), "n_cells"),
        (dict(n_cells=-2), "n_cells"),
        (dict(n_cells=2.5), "n_cells"),
        (dict(n_cells=True), "n_cells"),
        (dict(n_cells=(2, 2)), "n_cells"),
        (dict(n_cells=(2, 0, 2)), "n_cells"),
        (dict(density=0.0), "density"),
        (dict(density=-0.8), "density"),
        (dict(density=float("nan")), "density"),
        (dict(density="dense"), "density"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=-3.0), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_bad_melt_arguments_raise_value_error_naming_them(kwargs, name):
    with pytest.raises(ValueError, match=name):
        lj_melt(**{"n_cells": 2, **kwargs})


@pytest.mark.parametrize("a", [0.0, -1.0, float("nan")])
def test_bad_lattice_constant_raises_value_error_naming_it(a):
    with pytest.raises(ValueError, match="lattice_constant"):
        fcc_lattice(2, a)
