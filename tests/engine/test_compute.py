"""Specification of jaxdd.compute: the single-device driver and the framework's autodiff.

Comparisons run in float64 (unless a test is about float32) on small Lennard-Jones
systems, mostly rattled triclinic fcc supercells of 3x3x3 conventional cells (108 atoms).
Systems of the same shape share one neighbour capacity (``CAPACITY``), so they share one
compiled program.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import AtomicData, Batch, NeighborCapacity
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import fcc_lattice

LATTICE = 1.6796
CUTOFF = 2.5
ALL = ("energy", "forces", "stress")
KEYS = ("energy", "atomic_energies", "forces", "stress")

# Two different triclinic shears of the cubic supercell (rows are lattice vectors).
SHEAR_A = np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [-0.1, 0.2, 1.0]])
SHEAR_B = np.array([[1.02, 0.05, 0.0], [-0.1, 0.97, 0.0], [0.12, -0.08, 1.03]])

# The shifted potential is continuous at the cutoff, so finite differences are clean.
LJ = LennardJones(1.0, 1.0, CUTOFF, shift=True)


def triclinic_atoms(shear, seed):
    atoms = fcc_lattice(3, LATTICE)
    atoms.set_cell(atoms.cell.array @ shear, scale_atoms=True)
    atoms.rattle(0.05, seed=seed)
    return atoms


SYSTEM_A = AtomicData.from_ase(triclinic_atoms(SHEAR_A, seed=1))
SYSTEM_B = AtomicData.from_ase(triclinic_atoms(SHEAR_B, seed=2))

# Room for both systems and for the small displacements of the finite differences.
CAPACITY = jaxdd.neighbor_capacity(
    SYSTEM_A.positions, SYSTEM_A.cell, SYSTEM_A.pbc, cutoff=CUTOFF, headroom=1.3
)


def run(data, model=LJ, outputs=KEYS, capacity=CAPACITY):
    out = jaxdd.compute(model, data, outputs, capacity=capacity)
    return {k: np.asarray(v) for k, v in out.items()}


_REFERENCE = {}


def reference_a():
    """Energy, atomic energies, forces and stress of system A (computed once)."""
    if not _REFERENCE:
        _REFERENCE.update(run(SYSTEM_A))
    return _REFERENCE


def with_positions(data, positions, cell=None):
    return data.replace(positions=positions, cell=data.cell if cell is None else cell)


def molecule():
    """A 32-atom fcc cluster with no cell at all: cell zeros, pbc False."""
    atoms = fcc_lattice(2, LATTICE)
    atoms.rattle(0.05, seed=4)
    return AtomicData(atoms.positions, atoms.numbers)


def brute_force_lj(positions, cutoff=CUTOFF):
    """Unshifted LJ (sigma = epsilon = 1) of an open cluster, by a direct pair sum."""
    d = positions[None, :, :] - positions[:, None, :]  # d[i, j] = r_j - r_i
    r2 = np.sum(d * d, axis=-1)
    pair = (r2 > 0) & (r2 < cutoff * cutoff)
    inv6 = np.where(pair, 1.0 / np.where(pair, r2, 1.0) ** 3, 0.0)
    energy = 0.5 * np.sum(4.0 * (inv6 * inv6 - inv6))
    # dV/dr / r for every pair; the force on i is sum_j (dV/dr / r) (r_j - r_i).
    coef = np.where(pair, (-48.0 * inv6 * inv6 + 24.0 * inv6) / np.where(pair, r2, 1.0), 0.0)
    forces = np.sum(coef[:, :, None] * d, axis=1)
    return energy, forces


# ------------------------------------------------------------------------- derivatives


def test_forces_are_minus_the_finite_difference_gradient_of_the_energy():
    h = 1e-5
    forces = reference_a()["forces"]
    positions = np.asarray(SYSTEM_A.positions)
    for atom in (0, 17, 54, 107):
        for axis in range(3):
            plus, minus = positions.copy(), positions.copy()
            plus[atom, axis] += h
            minus[atom, axis] -= h
            e_plus = run(with_positions(SYSTEM_A, plus))["energy"][0]
            e_minus = run(with_positions(SYSTEM_A, minus))["energy"][0]
            fd = -(e_plus - e_minus) / (2 * h)
            assert abs(forces[atom, axis] - fd) < 1e-6, (atom, axis, forces[atom, axis], fd)


def test_stress_is_the_finite_difference_strain_derivative_over_the_volume():
    h = 1e-5
    stress = reference_a()["stress"][0]
    positions = np.asarray(SYSTEM_A.positions)
    cell = np.asarray(SYSTEM_A.cell)
    volume = abs(np.linalg.det(cell[0]))
    for i in range(3):
        for j in range(i, 3):
            # A symmetric strain; off the diagonal it moves both (i, j) and (j, i).
            direction = np.zeros((3, 3))
            direction[i, j] = direction[j, i] = 1.0
            energies = []
            for step in (h, -h):
                deform = np.eye(3) + step * direction
                energies.append(run(with_positions(SYSTEM_A, positions @ deform, cell @ deform))["energy"][0])
            fd = (energies[0] - energies[1]) / (2 * h) / (volume * direction.sum())
            assert abs(stress[i, j] - fd) < 1e-6, (i, j, stress[i, j], fd)


# ----------------------------------------------------------------------- neighbour list


def test_too_small_starting_capacity_grows_and_gives_the_same_results():
    tiny = NeighborCapacity(max_edges=8, max_neighbors=2, max_candidates=4, search_range=(1, 1, 1))
    got = run(SYSTEM_A, capacity=tiny)
    for key in ALL:
        np.testing.assert_allclose(got[key], reference_a()[key], rtol=0, atol=1e-12, err_msg=key)


def test_results_do_not_depend_on_the_neighbour_skin():
    skinned = run(SYSTEM_A, model=LennardJones(1.0, 1.0, CUTOFF, shift=True, skin=0.5), capacity=None)
    ref = reference_a()
    np.testing.assert_allclose(skinned["energy"], ref["energy"], rtol=1e-13, atol=0)
    np.testing.assert_allclose(skinned["forces"], ref["forces"], rtol=0, atol=1e-11)
    np.testing.assert_allclose(skinned["stress"], ref["stress"], rtol=0, atol=1e-12)


def test_half_list_gives_the_same_results_as_the_full_list():
    full = reference_a()
    half = run(SYSTEM_A, model=LennardJones(1.0, 1.0, CUTOFF, shift=True, half_list=True), capacity=None)
    np.testing.assert_allclose(half["energy"], full["energy"], rtol=1e-13, atol=0)
    np.testing.assert_allclose(half["atomic_energies"], full["atomic_energies"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(half["forces"], full["forces"], rtol=0, atol=1e-11)
    np.testing.assert_allclose(half["stress"], full["stress"], rtol=0, atol=1e-12)


def test_positions_outside_the_cell_give_the_same_results_as_wrapped_ones():
    cell = np.asarray(SYSTEM_A.cell[0])
    images = np.array([[1, 0, 0], [-1, 2, 0], [0, 0, -3], [2, -1, 1], [-2, -2, -2]])
    moved = np.asarray(SYSTEM_A.positions).copy()
    for k, image in enumerate(images):
        moved[7 * k + 3] += image @ cell
    got = run(with_positions(SYSTEM_A, moved))
    ref = reference_a()
    np.testing.assert_allclose(got["energy"], ref["energy"], rtol=1e-13, atol=0)
    np.testing.assert_allclose(got["forces"], ref["forces"], rtol=0, atol=1e-11)
    np.testing.assert_allclose(got["stress"], ref["stress"], rtol=0, atol=1e-12)


# -------------------------------------------------------------------------- batches


def test_padded_batch_gives_the_unpadded_results_and_zeros_on_padding():
    n = SYSTEM_A.n_atoms
    padded = Batch.from_data(SYSTEM_A).pad(n + 6, 2)
    got = run(padded, capacity=None)
    ref = reference_a()
    np.testing.assert_allclose(got["energy"][:1], ref["energy"], rtol=1e-13, atol=0)
    np.testing.assert_allclose(got["forces"][:n], ref["forces"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["stress"][:1], ref["stress"], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(got["forces"][n:], 0.0)
    np.testing.assert_array_equal(got["energy"][1:], 0.0)
    np.testing.assert_array_equal(got["stress"][1:], 0.0)


def test_batch_of_two_systems_equals_each_system_alone():
    together = run(Batch.from_data_list([SYSTEM_A, SYSTEM_B]), capacity=None)
    alone = [reference_a(), run(SYSTEM_B)]
    n = SYSTEM_A.n_atoms
    np.testing.assert_allclose(together["energy"], [alone[0]["energy"][0], alone[1]["energy"][0]], rtol=1e-13, atol=0)
    np.testing.assert_allclose(together["forces"][:n], alone[0]["forces"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(together["forces"][n:], alone[1]["forces"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(together["stress"], np.concatenate([alone[0]["stress"], alone[1]["stress"]]), rtol=0, atol=1e-12)


# ------------------------------------------------------------------------ open systems


def test_stress_of_a_system_without_a_cell_is_refused_naming_the_system():
    with pytest.raises(ValueError, match=r"system\(s\) \[0\]"):
        jaxdd.compute(LennardJones(1.0, 1.0, CUTOFF), molecule(), ALL)


def test_energy_and_forces_of_a_system_without_a_cell_match_a_direct_pair_sum():
    data = molecule()
    got = run(data, model=LennardJones(1.0, 1.0, CUTOFF), outputs=("energy", "forces"), capacity=None)
    energy, forces = brute_force_lj(np.asarray(data.positions))
    assert got["energy"][0] == pytest.approx(energy, rel=1e-12)
    np.testing.assert_allclose(got["forces"], forces, rtol=0, atol=1e-10)


# --------------------------------------------------------------------------- requests


def test_unknown_output_key_is_refused_naming_it_and_listing_the_model_outputs():
    with pytest.raises(ValueError) as info:
        jaxdd.compute(LJ, SYSTEM_A, ("energy", "dipole"))
    message = str(info.value)
    assert "dipole" in message
    for key in ("energy", "atomic_energies", "forces", "stress"):
        assert repr(key) in message


def test_empty_output_request_is_refused():
    with pytest.raises(ValueError, match="outputs is empty"):
        jaxdd.compute(LJ, SYSTEM_A, ())


def test_a_single_output_may_be_given_as_a_string():
    got = jaxdd.compute(LJ, SYSTEM_A, "energy", capacity=CAPACITY)
    assert list(got) == ["energy"]
    np.testing.assert_allclose(np.asarray(got["energy"]), reference_a()["energy"], rtol=1e-13, atol=0)


def test_model_without_a_model_config_is_refused_naming_its_class():
    class NoConfig:
        def __call__(self, data):
            return {"energy": jnp.zeros(1)}

    with pytest.raises(ValueError, match="NoConfig"):
        jaxdd.compute(NoConfig(), SYSTEM_A)


def test_nan_position_is_refused_naming_the_atom_before_compute_is_reached():
    positions = np.asarray(SYSTEM_A.positions).copy()
    positions[5, 1] = np.nan
    with pytest.raises(ValueError, match=r"atoms \[5\]"):
        jaxdd.compute(LJ, AtomicData(positions, SYSTEM_A.atomic_numbers, SYSTEM_A.cell, SYSTEM_A.pbc))


# ---------------------------------------------------------------------------- dtypes


def test_float32_positions_give_float32_outputs_close_to_float64():
    single = AtomicData.from_ase(triclinic_atoms(SHEAR_A, seed=1), dtype=jnp.float32)
    got = jaxdd.compute(LJ, single, ALL)
    for key in ALL:
        assert got[key].dtype == jnp.float32, key
    ref = reference_a()
    for key in ALL:
        scale = np.abs(ref[key]).max()
        err = np.abs(np.asarray(got[key], np.float64) - ref[key]).max()
        assert err <= 1e-5 * scale, (key, err, scale)
