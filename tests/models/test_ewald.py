"""Specification of Ewald electrostatics (``jaxdd.models.ewald.Ewald``).

Physics against outside references: Madelung constants of NaCl, CsCl and zincblende (per
nearest-neighbour distance, unit charges) to 1e-8, Madelung energies at accuracy 1e-12 against
the CODATA 2018 Coulomb constant to 1e-10, and pymatgen's ``EwaldSummation`` on
rattled triclinic cells, neutral and charged (uniform background). Under decomposition the
outputs equal ``jaxdd.compute``: energy to 1e-10 relative, forces and stress to 1e-9 absolute.

One batch holds every small system (three primitive crystals, two rattled triclinic cells),
so one compiled program serves the physics tests; the systems are helpers for test_pme.py too.
"""

from __future__ import annotations

import functools
import math
import warnings

import ase.build
import ase.units
import jax
from jax.test_util import check_grads
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import AtomicData, Batch
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.engine.driver import neighbor_list_for
from jaxdd.models.ewald import COULOMB, Ewald
from jaxdd.neighbors import neighbor_capacity

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 6.0
KEYS = ("energy", "forces", "stress")

# name: (structure, nearest-neighbour distance Å, Madelung constant per that distance)
MADELUNG = {
    "NaCl": (ase.build.bulk("NaCl", "rocksalt", a=5.64), 5.64 / 2, 1.7475645946334),
    "CsCl": (ase.build.bulk("CsCl", "cesiumchloride", a=4.12), 4.12 * math.sqrt(3) / 2, 1.7626747730712),
    "ZnS": (ase.build.bulk("ZnS", "zincblende", a=5.41), 5.41 * math.sqrt(3) / 4, 1.6380550533890),
}
SHEAR = np.array([[1.0, 0.12, 0.05], [0.0, 1.0, 0.09], [0.0, 0.0, 1.0]])


def crystal(name) -> AtomicData:
    atoms = MADELUNG[name][0]
    return AtomicData(atoms.positions, atoms.numbers, atoms.cell.array, [True] * 3, charges=[1.0, -1.0])


def rattled(net_charge=0.0, seed=0) -> AtomicData:
    """Conventional rock salt (8 ions) sheared into a triclinic cell and rattled by 0.15 Å;
    charges ±1 scaled unevenly, plus ``net_charge`` e spread over the cations."""
    atoms = ase.build.bulk("NaCl", "rocksalt", a=5.64, cubic=True)
    atoms.set_cell(atoms.cell.array @ SHEAR, scale_atoms=True)
    atoms.rattle(0.15, seed=seed)
    q = np.where(atoms.numbers == 11, 1.0, -1.0) * np.linspace(0.8, 1.2, len(atoms))
    q = q - q.mean() + np.where(atoms.numbers == 11, net_charge / 4, 0.0)
    return AtomicData(atoms.positions, atoms.numbers, atoms.cell.array, [True] * 3, charges=q)


def ion_box(n=4, seed=0) -> AtomicData:
    """n³ ions (half +1, half -1 at random) on a rattled grid in a triclinic cell of ~2.8 n Å."""
    rng = np.random.default_rng(seed)
    cell = n * np.array([[2.8, 0.0, 0.0], [0.3, 2.7, 0.0], [-0.25, 0.4, 2.75]])
    grid = (np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3) + 0.5) / n
    q = np.array([1.0, -1.0] * (n ** 3 // 2))
    rng.shuffle(q)
    return AtomicData(grid @ cell + rng.normal(0, 0.25, (n ** 3, 3)), np.where(q > 0, 11, 17), cell, [True] * 3,
                      charges=q)


SYSTEMS = {**{name: functools.partial(crystal, name) for name in MADELUNG},
           "rattled": rattled, "charged": functools.partial(rattled, net_charge=0.6)}


@functools.cache
def small_batch() -> Batch:
    return Batch.from_data_list([make() for make in SYSTEMS.values()])


def index_of(name) -> int:
    return list(SYSTEMS).index(name)


@functools.cache
def ewald_outputs():
    out = jaxdd.compute(Ewald(CUTOFF), small_batch(), KEYS + ("atomic_energies",))
    return {k: np.asarray(v) for k, v in out.items()}


def rows_of(name):
    ptr = np.asarray(small_batch().ptr)
    i = index_of(name)
    return slice(int(ptr[i]), int(ptr[i + 1]))


def madelung_of(energy, name) -> float:
    """Madelung constant from the energy (eV) of a two-ion primitive cell with unit charges."""
    return -energy * MADELUNG[name][1] / COULOMB


def pymatgen_reference(data: AtomicData):
    """(energy eV, forces [n, 3] eV/Å) of pymatgen's EwaldSummation, converged to 14 figures."""
    pymatgen_ewald = pytest.importorskip("pymatgen.analysis.ewald", reason="pymatgen is the optional Ewald reference")
    from pymatgen.core import Lattice, Structure

    structure = Structure(Lattice(np.asarray(data.cell)[0]), np.asarray(data.atomic_numbers).tolist(),
                          np.asarray(data.positions), coords_are_cartesian=True,
                          site_properties={"charge": np.asarray(data.charges).tolist()})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pymatgen notes that charged cells get a background
        ewald = pymatgen_ewald.EwaldSummation(structure, acc_factor=14.0, compute_forces=True)
        return ewald.total_energy, np.asarray(ewald.forces)


def mesh_of(n_ranks) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:n_ranks]), ("dd",), axis_types=(AxisType.Auto,))


def assert_distributed_matches(model, data, grid, want=None):
    """DistributedModel on ``grid`` equals jaxdd.compute (energy 1e-10 relative, forces and stress 1e-9)."""
    want = want if want is not None else jaxdd.compute(model, data, KEYS)
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, mesh=mesh_of(math.prod(grid)), grid=grid))
    got = dm(data, KEYS)
    np.testing.assert_allclose(np.asarray(got["energy"]), np.asarray(want["energy"]), rtol=1e-10, atol=0)
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(want["forces"]), rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got["stress"]), np.asarray(want["stress"]), rtol=0, atol=1e-9)
    return dm


# --------------------------------------------------------------------------- physics


@pytest.mark.parametrize("name", list(MADELUNG))
def test_madelung_constant_to_1e_8(name):
    energy = ewald_outputs()["energy"][index_of(name)]
    assert madelung_of(energy, name) == pytest.approx(MADELUNG[name][2], rel=1e-8)


@pytest.mark.parametrize("name", list(MADELUNG))
def test_madelung_energy_at_accuracy_1e_12_is_that_of_the_codata_2018_coulomb_constant_to_1e_10(name):
    # E = -M k / r0 for the two-ion cell; k = e / (4π ε0 Å) from ASE's CODATA 2018 units (an
    # outside value): a constant written to fewer digits is off by ~3e-8 here.
    units = ase.units.create_units("2018")
    k = units["_e"] / (4 * math.pi * units["_eps0"] * 1e-10)
    _, r0, madelung = MADELUNG[name]
    assert precise_crystal_energies()[list(MADELUNG).index(name)] == pytest.approx(-madelung * k / r0, rel=1e-10)


@functools.cache
def precise_crystal_energies() -> np.ndarray:
    batch = Batch.from_data_list([crystal(name) for name in MADELUNG])
    return np.asarray(jaxdd.compute(Ewald(CUTOFF, accuracy=1e-12), batch, ("energy",))["energy"])


def test_forces_vanish_on_the_sites_of_perfect_crystals():
    for name in MADELUNG:
        np.testing.assert_allclose(ewald_outputs()["forces"][rows_of(name)], 0.0, atol=1e-10)


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_energy_and_forces_match_pymatgen_ewald_summation(name):
    energy, forces = pymatgen_reference(SYSTEMS[name]())
    # pymatgen's Coulomb constant (14.39964548 eV Å / e²) is 1e-10 from ours; the tolerance is
    # that of the Ewald accuracy 1e-8.
    assert ewald_outputs()["energy"][index_of(name)] == pytest.approx(energy, rel=1e-7)
    np.testing.assert_allclose(ewald_outputs()["forces"][rows_of(name)], forces, rtol=0, atol=1e-6)


def test_atomic_energies_add_up_to_each_systems_energy():
    out = ewald_outputs()
    sums = [out["atomic_energies"][rows_of(name)].sum() for name in SYSTEMS]
    np.testing.assert_allclose(sums, out["energy"], rtol=1e-12)


@pytest.mark.parametrize("name", ["rattled", "charged"])
def test_virial_trace_is_minus_the_energy_as_coulomb_energy_scales_as_one_over_length(name):
    # E(λ r, λ h) = E / λ, so Σ_i dE/dε_ii = -E: trace(stress) V = -E.
    out = ewald_outputs()
    i = index_of(name)
    volume = abs(np.linalg.det(np.asarray(small_batch().cell)[i]))
    assert np.trace(out["stress"][i]) * volume == pytest.approx(-out["energy"][i], rel=1e-7)


@pytest.mark.slow
def test_forces_pass_check_grads():
    data = rattled()
    model = Ewald(CUTOFF, kmax_index=(4, 4, 4))
    batch = Batch.from_data(data)
    capacity = neighbor_capacity(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                                 cutoff=CUTOFF, headroom=1.5)

    @jax.jit
    def energy(positions):
        moved = batch.replace(positions=positions)
        return model(moved.replace(neighbors=neighbor_list_for(model, moved, capacity)))["energy"][0]

    check_grads(energy, (batch.positions,), order=1, modes=("rev",), eps=1e-4, atol=1e-6, rtol=1e-6)


def test_reciprocal_vectors_are_sized_from_each_batch():
    model = Ewald(CUTOFF)
    model.validate_input(Batch.from_data(crystal("CsCl")))
    small = model.sizes.value
    model.validate_input(Batch.from_data(ion_box(4)))
    # |n_a| <= k_max |a_a| / 2π along each lattice vector.
    assert model.sizes.value == model.kmax_index_for(np.asarray(ion_box(4).cell)) and model.sizes.value > small


# --------------------------------------------------------------------------- decomposition


# Agreement between ranks and one device needs no tight truncation: ε = 1e-5 keeps k few.
@pytest.mark.slow
def test_distributed_equals_single_device_on_an_uneven_grid_in_a_triclinic_cell():
    assert_distributed_matches(Ewald(CUTOFF, accuracy=1e-5), ion_box(4), (3, 2, 1))


@pytest.mark.slow
def test_distributed_batch_of_two_cells_equals_single_device():
    data = Batch.from_data_list([ion_box(4, seed=1), rattled(net_charge=0.6)])
    assert_distributed_matches(Ewald(CUTOFF, accuracy=1e-5), data, (2, 2, 2))


# --------------------------------------------------------------------------- errors


def test_a_batch_without_charges_is_refused():
    data = crystal("NaCl").replace(charges=None)
    with pytest.raises(ValueError, match="charges"):
        jaxdd.compute(Ewald(CUTOFF), data)


def test_a_cell_not_periodic_in_three_dimensions_is_refused():
    data = crystal("NaCl").replace(pbc=jnp.asarray([True, True, False]))
    with pytest.raises(ValueError, match="periodic along all three axes"):
        jaxdd.compute(Ewald(CUTOFF), data)


@pytest.mark.parametrize("accuracy", [0.0, 1.0, -1e-8, "1e-8"])
def test_an_accuracy_outside_zero_one_is_refused(accuracy):
    with pytest.raises(ValueError, match="accuracy"):
        Ewald(CUTOFF, accuracy=accuracy)


@pytest.mark.parametrize("cutoff", [0.0, -6.0, float("inf"), None])
def test_a_cutoff_that_is_not_a_positive_length_is_refused(cutoff):
    with pytest.raises(ValueError, match="cutoff"):
        Ewald(cutoff)


def test_a_model_called_before_sizing_says_how_to_size_it():
    with pytest.raises(ValueError, match="kmax_index"):
        Ewald(CUTOFF)(Batch.from_data(crystal("NaCl")))
