"""Specification of DFT-D3(BJ) dispersion (``jaxdd.models.dftd3``).

The oracle is the ``dftd3`` package (the Python API of simple-dftd3), run on the same
structure in bohr with the same real-space cutoffs (``set_realspace_cutoff(disp2, disp3,
cn)``); tests that need it skip, saying so, when it is not installed. Agreement is asked to
1e-8 hartree (energy, virial) and 1e-8 hartree/bohr (gradient); the model reproduces the
package to round-off. The published PBE-D3(BJ) energy of water needs no package.

The systems: water (in a vacuum box, not periodic) and a sheared, rattled 2x2x2 supercell
of the CO2 crystal (96 atoms, triclinic, periodic). The pair model has ranges of 9 Å
(pairs) and 7 Å (coordination numbers); the three-body model 6, 5 and 5 Å (pairs,
coordination numbers, triangles). Compiling takes seconds, so both systems go into one
padded batch (3 padding atoms, one empty system), evaluated once per model by
``jaxdd.compute``: each system of it is compared with the oracle alone, which also
specifies batching, and the whole batch is the reference of the distributed runs
(``DistributedModel`` against ``jaxdd.compute`` in float64: energy to 1e-10 relative,
forces, stress and atomic energies to 1e-9 absolute).

The default suite checks the three-body term on water alone and distributes the pair
model on one uneven grid; the slow set adds the three-body term on the crystal, another
grid, the distributed three-body model and the deep halo.
"""

from __future__ import annotations

import fnmatch
import functools
import importlib.resources
import math
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import AtomicData, Batch
from jaxdd.model.context import DDContext
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.models.dftd3 import BOHR, DFTD3, FUNCTIONALS, HARTREE
from jaxdd.ops import HaloStoragePolicy
from jaxdd.spec import SPEC_DFTD3_HALO

# Small systems replicate every rank's whole neighbourhood; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

WATER_BOHR = np.array([[0.0, 0.0, -0.1294], [0.0, 1.4941, 1.0274], [0.0, -1.4941, 1.0274]])
WATER_NUMBERS = np.array([8, 1, 1])
WATER_PBE_D3BJ = -3.5951240446e-4  # hartree (simple-dftd3)

CUTOFF, CN_CUTOFF = 9.0, 7.0
PAIR = DFTD3("pbe", cutoff=CUTOFF, cn_cutoff=CN_CUTOFF)
# Triplets cost V·K² for K neighbours within the list's range: shorter ranges keep K near 60.
ATM = DFTD3("pbe", cutoff=6.0, cn_cutoff=5.0, three_body=True, three_body_cutoff=5.0, species=(1, 6, 8))
KEYS = ("energy", "forces", "stress", "atomic_energies")
SHEAR = np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [-0.1, 0.1, 1.0]])
DEEP = HaloStoragePolicy(scatter_mode="local", gather_mode="local")


def oracle():
    return pytest.importorskip(
        "dftd3.interface", reason="the dftd3 package (simple-dftd3, pip install dftd3) is the D3 oracle")


# ----------------------------------------------------------------------------- systems


def water(box=None) -> AtomicData:
    if box is None:
        return AtomicData(positions=WATER_BOHR * BOHR, atomic_numbers=WATER_NUMBERS)
    return AtomicData(positions=WATER_BOHR * BOHR + box / 2, atomic_numbers=WATER_NUMBERS, cell=np.eye(3) * box,
                      pbc=False)


def co2_crystal(n=2, seed=0) -> AtomicData:
    """Solid CO2 (Pa-3, a = 5.624 Å, O at ±0.1185 along each molecule's <111> axis), an
    n×n×n supercell sheared by SHEAR and rattled by 0.05 Å; periodic, triclinic."""
    a, x = 5.624, 0.1185
    centres = np.array([[0, 0, 0], [0, 0.5, 0.5], [0.5, 0, 0.5], [0.5, 0.5, 0]])
    axes = np.array([[1, 1, 1], [-1, 1, -1], [1, -1, -1], [-1, -1, 1]])
    frac = np.concatenate([[c, c + x * u, c - x * u] for c, u in zip(centres, axes)]) % 1.0
    frac = np.concatenate([(frac + s) / n for s in np.ndindex(n, n, n)])
    cell = np.eye(3) * a * n @ SHEAR
    positions = frac @ cell + np.random.default_rng(seed).normal(scale=0.05, size=frac.shape)
    numbers = np.tile([6, 8, 8], 4 * n**3)
    return AtomicData(positions=positions, atomic_numbers=numbers, cell=cell, pbc=True)


def as_numpy(outputs) -> dict:
    return {k: np.asarray(v) for k, v in outputs.items()}


def system_batch() -> Batch:
    """Water in a 12 Å box, then the crystal, then 3 padding atoms and an empty system."""
    batch = Batch.from_data_list([water(box=12.0), co2_crystal()])
    return batch.pad(batch.n_atoms + 3, 3)


SYSTEMS = {"water": 0, "crystal": 1}
MODELS = {"pair": PAIR, "atm": ATM}


@functools.cache
def batch_outputs(model_name: str) -> dict:
    return as_numpy(jaxdd.compute(MODELS[model_name], system_batch(), KEYS))


def system_outputs(model_name: str, system: str) -> dict:
    """The outputs of one system of the batch, shaped as if it had been evaluated alone."""
    s = SYSTEMS[system]
    out = batch_outputs(model_name)
    ptr = np.asarray(system_batch().ptr)
    rows = slice(ptr[s], ptr[s + 1])
    return {"energy": out["energy"][s:s + 1], "forces": out["forces"][rows], "stress": out["stress"][s:s + 1],
            "atomic_energies": out["atomic_energies"][rows]}


@functools.cache
def water_alone(model_name: str) -> dict:
    return as_numpy(jaxdd.compute(MODELS[model_name], water(), ("energy", "forces")))


def dftd3_reference(data: AtomicData, model: DFTD3) -> dict:
    """Energy (hartree), gradient (hartree/bohr) and virial (hartree) from the dftd3 package,
    with the model's cutoffs and three-body term."""
    interface = oracle()
    numbers = np.asarray(data.atomic_numbers)
    positions = np.asarray(data.positions) / BOHR
    if data.pbc is not None and np.any(np.asarray(data.pbc)):
        disp = interface.DispersionModel(numbers, positions, np.asarray(data.cell).reshape(3, 3) / BOHR,
                                         np.asarray(data.pbc).reshape(3))
    else:
        disp = interface.DispersionModel(numbers, positions)
    disp.set_realspace_cutoff(model.pair_cutoff / BOHR, model.three_body_cutoff / BOHR, model.cn_cutoff / BOHR)
    return disp.get_dispersion(interface.RationalDampingParam(method="pbe", atm=model.three_body), grad=True)


def in_atomic_units(out: dict, data: AtomicData) -> dict:
    """The model's outputs as the dftd3 package reports them (the virial of periodic cells)."""
    au = {"energy": out["energy"][0] / HARTREE, "gradient": -out["forces"] * BOHR / HARTREE}
    if "stress" in out and np.all(np.asarray(data.pbc)):
        au["virial"] = out["stress"][0] * abs(np.linalg.det(np.asarray(data.cell).reshape(3, 3))) / HARTREE
    return au


def assert_matches_dftd3(got: dict, want: dict):
    assert abs(got["energy"] - want["energy"]) < 1e-8, (got["energy"], want["energy"])
    np.testing.assert_allclose(got["gradient"], want["gradient"], rtol=0, atol=1e-8)
    if "virial" in got:
        np.testing.assert_allclose(got["virial"], want["virial"], rtol=0, atol=1e-8)


def mesh_of(n: int) -> Mesh:
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.cache
def distributed(model_name: str, grid: tuple[int, int, int]):
    model = MODELS[model_name]
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, mesh=mesh_of(math.prod(grid)), grid=grid))
    return dm, as_numpy(dm(system_batch(), KEYS))


def assert_distributed_equals_single(got: dict, want: dict):
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    for key in ("forces", "stress", "atomic_energies"):
        np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-9, err_msg=key)


# ----------------------------------------------------------------------------- against dftd3


def test_water_energy_is_the_published_pbe_d3bj_value():
    assert abs(system_outputs("pair", "water")["energy"][0] / HARTREE - WATER_PBE_D3BJ) < 1e-12


def test_water_energy_and_gradient_match_dftd3():
    assert_matches_dftd3(in_atomic_units(system_outputs("pair", "water"), water()), dftd3_reference(water(), PAIR))


def test_molecular_crystal_energy_gradient_and_virial_match_dftd3():
    assert_matches_dftd3(in_atomic_units(system_outputs("pair", "crystal"), co2_crystal()),
                         dftd3_reference(co2_crystal(), PAIR))


def test_water_three_body_energy_and_gradient_match_dftd3_atm():
    got = in_atomic_units(water_alone("atm"), water())
    want = dftd3_reference(water(), ATM)
    assert_matches_dftd3(got, want)
    # The ATM term of one water is 3e-10 hartree: compare it on its own too (the pair
    # energy of water does not depend on these cutoffs).
    pair = system_outputs("pair", "water")["energy"][0] / HARTREE
    assert abs((got["energy"] - pair) - (want["energy"] - WATER_PBE_D3BJ)) < 1e-14


@pytest.mark.slow
def test_molecular_crystal_with_three_body_term_matches_dftd3_atm():
    assert_matches_dftd3(in_atomic_units(system_outputs("atm", "crystal"), co2_crystal()),
                         dftd3_reference(co2_crystal(), ATM))


@pytest.mark.parametrize("functional", sorted(FUNCTIONALS))
def test_functional_parameters_are_those_of_dftd3(functional):
    interface = oracle()
    s6, s8, a1, a2 = FUNCTIONALS[functional]
    disp = interface.DispersionModel(WATER_NUMBERS, WATER_BOHR)
    named = disp.get_dispersion(interface.RationalDampingParam(method=functional), grad=False)["energy"]
    ours = disp.get_dispersion(interface.RationalDampingParam(s6=s6, s8=s8, a1=a1, a2=a2, s9=0.0), grad=False)["energy"]
    assert named == ours


def test_atomic_energies_sum_to_the_energy_of_each_system():
    out = batch_outputs("pair")
    batch = system_batch()
    per_system = np.bincount(np.asarray(batch.batch_idx), out["atomic_energies"], minlength=batch.n_systems)
    np.testing.assert_allclose(per_system[:3], out["energy"], rtol=1e-13, atol=0)


def test_padding_atoms_and_systems_get_zeros():
    out = batch_outputs("pair")
    padding = ~np.asarray(system_batch().atom_mask)
    assert np.all(out["atomic_energies"][padding] == 0) and np.all(out["forces"][padding] == 0)
    assert out["energy"][2] == 0


# ----------------------------------------------------------------------------- distributed


def test_distributed_equals_single_device_on_an_uneven_grid():
    _, got = distributed("pair", (3, 2, 1))
    assert_distributed_equals_single(got, batch_outputs("pair"))


def test_ghosts_read_their_owners_coordination_numbers_through_the_scatter_exchange():
    dm, _ = distributed("pair", (3, 2, 1))
    # Two scatter-adds onto receivers (owned atoms): the coordination numbers and the pair
    # energies. Each copies its owners' sums to their ghosts, so a pair's sender (a ghost)
    # contributes its complete CN while the shell is one neighbour range deep.
    assert dm.dispatch_report.counts["scatter_add.owned_rows"] == 2
    assert dm.ghost_width == pytest.approx(max(CUTOFF, CN_CUTOFF))


def test_the_dispatch_distributes_the_model_without_guessing():
    dm, _ = distributed("pair", (3, 2, 1))
    assert dm.dispatch_report.fallbacks == []


@pytest.mark.slow
def test_distributed_equals_single_device_on_a_cubic_grid():
    _, got = distributed("pair", (2, 2, 2))
    assert_distributed_equals_single(got, batch_outputs("pair"))


@pytest.mark.slow
def test_distributed_three_body_term_equals_single_device():
    dm, got = distributed("atm", (4, 2, 1))
    assert_distributed_equals_single(got, batch_outputs("atm"))
    assert dm.dispatch_report.fallbacks == []
    # Triangles read the CN of ghost corners too: still only the two exchanged scatters.
    assert dm.dispatch_report.counts["scatter_add.owned_rows"] == 2


# ----------------------------------------------------------------------------- halo depth


def test_one_neighbour_range_is_enough_when_ghosts_read_their_owners_coordination_numbers():
    assert PAIR.required_ghost_width(SPEC_DFTD3_HALO.policy) == max(CUTOFF, CN_CUTOFF)
    assert ATM.required_ghost_width(SPEC_DFTD3_HALO.policy) == 6.0


def test_ghosts_that_count_their_own_neighbours_need_the_interaction_range_plus_the_cn_range():
    assert PAIR.required_ghost_width(DEEP) == CUTOFF + CN_CUTOFF
    model = DFTD3(cutoff=5.0, cn_cutoff=4.0, three_body=True, three_body_cutoff=6.0)
    assert model.required_ghost_width(DEEP) == 6.0 + 4.0


def test_a_deep_halo_shallower_than_that_is_refused_naming_cn_cutoff():
    ctx = DDContext(active=True, policy=DEEP, halo_layers=1)
    with pytest.raises(ValueError, match="cn_cutoff = 16 Å, but it is 9 Å.*halo_layers=2"):
        PAIR.distributed_setup(ctx)


def test_a_deep_halo_of_two_neighbour_ranges_is_accepted():
    PAIR.distributed_setup(DDContext(active=True, policy=DEEP, halo_layers=2))


@pytest.mark.slow
def test_distributed_model_with_a_too_shallow_deep_halo_is_refused():
    model = DFTD3(cutoff=4.0, cn_cutoff=3.0)
    spec = SPEC_DFTD3_HALO.with_policy(DEEP)
    dm = DistributedModel(model, DomainConfig(cutoff=4.0, mesh=mesh_of(2), grid=(2, 1, 1)), spec=spec)
    with pytest.raises(ValueError, match="cn_cutoff"):
        dm(two_waters(), ("energy",))


@pytest.mark.slow
def test_a_deep_halo_of_two_layers_equals_single_device():
    model = DFTD3(cutoff=4.0, cn_cutoff=3.0)
    spec = SPEC_DFTD3_HALO.with_policy(HaloStoragePolicy(scatter_mode="local", gather_mode="local", halo_layers=2))
    dm = DistributedModel(model, DomainConfig(cutoff=4.0, mesh=mesh_of(2), grid=(2, 1, 1)), spec=spec)
    assert_distributed_equals_single(as_numpy(dm(two_waters(), KEYS)), as_numpy(jaxdd.compute(model, two_waters(), KEYS)))


def two_waters() -> AtomicData:
    xyz = WATER_BOHR * BOHR
    return AtomicData(positions=np.concatenate([xyz + [1.0, 2.0, 2.0], xyz + [4.5, 2.5, 2.0]]),
                      atomic_numbers=np.tile(WATER_NUMBERS, 2), cell=np.eye(3) * 8.0, pbc=True)


# ----------------------------------------------------------------------------- arguments


def test_model_distributes_under_the_dftd3_preset():
    assert PAIR.distribution_spec is SPEC_DFTD3_HALO


def test_element_without_reference_data_is_refused_naming_atomic_numbers():
    data = AtomicData(positions=np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 3.0]]), atomic_numbers=[8, 95])
    with pytest.raises(ValueError, match=r"atomic_numbers of atoms \[1\] are \[95\]"):
        jaxdd.compute(PAIR, data)


def test_unknown_functional_is_refused_naming_functional():
    with pytest.raises(ValueError, match="functional 'pbe-x'.*known"):
        DFTD3("pbe-x")


def test_functional_names_ignore_case_and_accept_dftd3_spellings():
    assert DFTD3("B3-LYP").functional == "b3lyp"


def test_damping_other_than_becke_johnson_is_refused_naming_damping():
    with pytest.raises(ValueError, match="damping must be 'bj'"):
        DFTD3("pbe", damping="zero")


@pytest.mark.parametrize("name", ["cutoff", "cn_cutoff", "three_body_cutoff"])
def test_non_positive_range_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=f"DFTD3 {name} must be a positive"):
        DFTD3(**{name: 0.0})


def test_neighbour_list_reaches_the_largest_of_the_three_ranges():
    assert DFTD3(cutoff=5.0, cn_cutoff=8.0).cutoff == 8.0
    assert DFTD3(cutoff=5.0, cn_cutoff=4.0, three_body=True, three_body_cutoff=6.0).cutoff == 6.0


def test_reference_data_ships_as_package_data_of_jaxdd_models():
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["jaxdd.models"]
    assert any(fnmatch.fnmatch("data/dftd3_bj.npz", p) for p in patterns)
    assert importlib.resources.files("jaxdd.models").joinpath("data", "dftd3_bj.npz").is_file()


def test_species_outside_the_models_species_are_refused_naming_atomic_numbers():
    with pytest.raises(ValueError, match=r"atomic_numbers of atoms \[0\] are \[7\].*species \(1, 6, 8\)"):
        jaxdd.compute(ATM, AtomicData(positions=np.zeros((1, 3)), atomic_numbers=[7]))
