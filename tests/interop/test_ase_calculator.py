"""Specification of ``jaxdd.interop.ase.Calculator``: a jaxdd model driven by ASE.

Reference: ASE's own ``LennardJones(sigma, epsilon, rc, smooth=False)``, which is jaxdd's
``LennardJones(sigma, epsilon, cutoff, shift=True)``, on a rattled 108-atom periodic argon
crystal (σ = 3.4 Å, ε = 0.0104 eV, r_c = 8.5 Å), in float64: energy to 1e-10 relative,
forces and stress to 1e-9 absolute. The distributed calculator runs on 2 virtual devices
and must reproduce the single-device one, in single evaluations, relaxations and dynamics.

A distributed call compiles once per system shape and output keys, so the distributed
model is built once for the module and every test reads the same crystal shape.
"""

import ase
import jax
import numpy as np
import pytest
from ase import units
from ase.calculators.calculator import PropertyNotImplementedError, all_changes
from ase.calculators.lj import LennardJones as AseLJ
from ase.md.verlet import VelocityVerlet
from ase.optimize import LBFGS

import jaxdd
import jaxdd.interop.ase
from jaxdd.interop.ase import Calculator
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import fcc_lattice, maxwell_boltzmann_velocities

# Two ranks over 108 atoms: each rank's ghost shell holds the whole crystal; expected here.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

SIGMA, EPSILON, CUTOFF = 3.4, 0.0104, 8.5  # Å, eV, Å
LATTICE = 5.26  # Å
ALL = ["energy", "forces", "stress", "energies"]
MODEL = LennardJones(SIGMA, EPSILON, CUTOFF, shift=True)


def crystal(seed=3, amplitude=0.05):
    atoms = fcc_lattice(3, LATTICE, symbol="Ar")  # 108 atoms
    atoms.rattle(amplitude, seed=seed)
    return atoms


def ase_lj():
    return AseLJ(sigma=SIGMA, epsilon=EPSILON, rc=CUTOFF, smooth=False)


@pytest.fixture(scope="module")
def distributed():
    return DistributedModel(MODEL, DomainConfig(CUTOFF, mesh=default_mesh(jax.devices()[:2])))


def evaluate(calc, atoms):
    """Energy, per-atom energies, forces and stress of ``atoms`` from one evaluation."""
    atoms = atoms.copy()
    atoms.calc = calc
    calc.calculate(atoms, ALL, all_changes)
    return dict(
        energy=atoms.get_potential_energy(),
        energies=atoms.get_potential_energies(),
        forces=atoms.get_forces(),
        stress=atoms.get_stress(),
    )


def test_rattled_crystal_matches_ase_lennard_jones():
    atoms = crystal()
    got = evaluate(Calculator(MODEL), atoms)
    ref = evaluate(ase_lj(), atoms)
    assert isinstance(got["energy"], float)
    assert got["stress"].shape == (6,) and got["forces"].shape == (108, 3)
    assert all(np.asarray(v).dtype == np.float64 for v in got.values())
    assert abs(got["energy"] - ref["energy"]) <= 1e-10 * abs(ref["energy"])
    np.testing.assert_allclose(got["energies"], ref["energies"], rtol=0, atol=1e-10)
    np.testing.assert_allclose(got["forces"], ref["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"], ref["stress"], rtol=0, atol=1e-9)


def test_compressed_crystal_has_negative_stress_like_ase():
    # The sign convention: squeezing the crystal makes the diagonal stress negative.
    atoms = crystal()
    atoms.set_cell(atoms.cell * 0.97, scale_atoms=True)
    atoms.calc = Calculator(MODEL)
    stress = atoms.get_stress()
    assert (stress[:3] < 0).all()
    atoms.calc = ase_lj()
    np.testing.assert_allclose(stress, atoms.get_stress(), rtol=0, atol=1e-9)


def test_distributed_calculator_equals_the_single_device_one(distributed):
    atoms = crystal()
    calc = Calculator(distributed)
    assert calc.distributed
    got = evaluate(calc, atoms)
    ref = evaluate(Calculator(MODEL), atoms)
    assert abs(got["energy"] - ref["energy"]) <= 1e-10 * abs(ref["energy"])
    for key in ("energies", "forces", "stress"):
        np.testing.assert_allclose(got[key], ref[key], rtol=0, atol=1e-9, err_msg=key)


def test_lbfgs_relaxes_with_the_distributed_calculator_to_the_ase_minimum(distributed):
    start = crystal(seed=11, amplitude=0.15)
    ours, ref = start.copy(), start.copy()
    ours.calc = Calculator(distributed)
    ref.calc = ase_lj()
    assert LBFGS(ours, logfile=None).run(fmax=1e-4, steps=200)
    assert LBFGS(ref, logfile=None).run(fmax=1e-4, steps=200)
    assert np.abs(ours.get_forces()).max() < 1e-3
    assert ours.get_potential_energy() == pytest.approx(ref.get_potential_energy(), rel=1e-9)
    start.calc = ase_lj()
    assert ours.get_potential_energy() < start.get_potential_energy()


def test_velocity_verlet_with_the_distributed_calculator_tracks_the_single_device_run(distributed):
    atoms = crystal(seed=5)
    atoms.set_velocities(maxwell_boltzmann_velocities(atoms.get_masses(), 60 * units.kB, seed=0))
    single, dist = atoms.copy(), atoms.copy()
    single.calc = Calculator(MODEL)
    dist.calc = Calculator(distributed)
    for a in (single, dist):
        VelocityVerlet(a, timestep=5 * units.fs).run(10)
    assert np.abs(dist.positions - atoms.positions).max() > 0.01  # the atoms did move
    np.testing.assert_allclose(dist.positions, single.positions, rtol=0, atol=1e-9)
    np.testing.assert_allclose(dist.get_velocities(), single.get_velocities(), rtol=0, atol=1e-9)
    assert dist.get_potential_energy() == pytest.approx(single.get_potential_energy(), rel=1e-10)


def test_the_model_is_asked_only_for_what_ase_requests_and_results_are_cached(monkeypatch):
    asked = []

    def spy(model, data, outputs, **kwargs):
        asked.append(tuple(outputs))
        return jaxdd.compute(model, data, outputs, **kwargs)

    monkeypatch.setattr(jaxdd.interop.ase, "compute", spy)
    atoms = crystal()
    atoms.calc = Calculator(MODEL)
    atoms.get_forces()
    atoms.get_forces()
    atoms.get_potential_energy()
    assert asked == [("energy", "forces")]  # no stress unless asked; the energy comes along
    atoms.positions[0, 0] += 0.01
    atoms.get_forces()
    assert asked == [("energy", "forces")] * 2


def test_stress_of_atoms_without_a_cell_is_refused():
    molecule = ase.Atoms("Ar3", positions=[[0, 0, 0], [3.8, 0, 0], [1.9, 3.3, 0]])
    molecule.calc = Calculator(MODEL)
    with pytest.raises(PropertyNotImplementedError, match="stress needs a cell of non-zero volume"):
        molecule.get_stress()


def test_outputs_restrict_the_implemented_properties():
    calc = Calculator(MODEL, outputs=("energy", "forces"))
    assert calc.implemented_properties == ["energy", "free_energy", "forces"]
    atoms = crystal()
    atoms.calc = calc
    with pytest.raises(PropertyNotImplementedError):
        atoms.get_stress()


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (("LennardJones",), {}, r"model must be a jaxdd model wrapper .* or a jaxdd.DistributedModel, got str"),
        ((LennardJones,), {}, "pass an instance"),
        ((MODEL,), dict(outputs=("dipole",)), r"outputs \['dipole'\]"),
        ((MODEL,), dict(dtype=np.int32), "dtype must be a floating dtype"),
    ],
    ids=["not-a-model", "model-class", "unknown-output", "integer-dtype"],
)
def test_bad_constructor_arguments_are_refused(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        Calculator(*args, **kwargs)


def test_predicted_charges_reach_ase_per_atom():
    from jaxdd.models.qeq import ChargeEquilibration

    model = ChargeEquilibration((1, 8), cutoff=4.0, features=8)
    water = ase.Atoms("OH2", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]], cell=np.eye(3) * 8, pbc=True)
    water.calc = Calculator(model)
    want = jaxdd.compute(model, jaxdd.AtomicData.from_ase(water), ("energy", "charges"))["charges"]
    assert "charges" in water.calc.implemented_properties
    np.testing.assert_allclose(water.get_charges(), np.asarray(want), rtol=0, atol=1e-12)
    assert abs(water.get_charges().sum()) < 1e-12  # a neutral molecule


@pytest.mark.slow
def test_chgnet_magnetic_moments_reach_ase_per_atom():
    chgnet = pytest.importorskip("jaxdd.models.chgnet")
    try:
        model = chgnet.CHGNet.load("0.3.0")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    from ase.build import bulk

    oxide = bulk("FeO", "rocksalt", a=4.3)
    oxide.calc = Calculator(model)
    want = jaxdd.compute(model, jaxdd.AtomicData.from_ase(oxide), ("energy", "magmoms"))["magmoms"]
    np.testing.assert_allclose(oxide.get_magnetic_moments(), np.asarray(want), rtol=0, atol=1e-12)
    assert oxide.get_magnetic_moments()[0] > 1.0  # iron carries a moment, oxygen hardly
