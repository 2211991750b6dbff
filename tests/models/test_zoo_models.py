"""Specification of the model zoo's machine-learning potentials: Behler-Parrinello, SchNet
and NequIP (``jaxdd.models.bp``, ``.mpnn``, ``.nequip``).

Every model is checked on one device with ``jaxdd.compute`` (shapes, per-system sums,
forces against finite differences of the energy, Newton's third law, seeds, float32) and
distributed with ``DistributedModel`` against ``jaxdd.compute`` in float64: energy to 1e-10
relative, forces and stress to 1e-9 absolute.

Systems: a rattled fcc arrangement of H, C, N and O at about 28 neighbours per atom within
the 5 Å cutoff (256 atoms in the default suite, 1,372 in the slow one), and a padded batch
of small molecules, each in its own vacuum box without periodicity.

Compiling a model takes seconds, so models, neighbour-list capacities and reference
results are built once and shared (module-level caches): tests that read the same system
with the same model and output keys run the same compiled program.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ase.build
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import Batch, neighbor_capacity
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.models.bp import BehlerParrinello
from jaxdd.models.mpnn import SchNet
from jaxdd.models.nequip import NequIP
from jaxdd.models.qeq import ChargeEquilibration
from jaxdd.models.uma_like import InternalGraphBackbone
from jaxdd.spec import SPEC_MPNN_HALO
from jaxdd.data.systems import fcc_lattice

# Small systems replicate every rank's whole neighbourhood; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 5.0
SPECIES = (1, 6, 7, 8)
KEYS = ("energy", "forces", "stress", "atomic_energies")
LATTICE = 4.1  # fcc, ~28 neighbours within 5 Å
MOLECULES = ("H2O", "CH4", "NH3", "C2H6", "CH3OH", "HCOOH", "C6H6", "CO2", "CH3CN")

FACTORIES = {
    # 48 neighbour slots hold the 35 neighbours of the most crowded atom of these systems.
    "bp": lambda seed=0, dtype=jnp.float64: BehlerParrinello(SPECIES, CUTOFF, max_neighbors=48, seed=seed, dtype=dtype),
    "schnet": lambda seed=0, dtype=jnp.float64: SchNet(SPECIES, CUTOFF, seed=seed, dtype=dtype),
    "nequip": lambda seed=0, dtype=jnp.float64: NequIP(SPECIES, CUTOFF, seed=seed, dtype=dtype),
    "qeq": lambda seed=0, dtype=jnp.float64: ChargeEquilibration(SPECIES, CUTOFF, seed=seed, dtype=dtype),
    "uma_like": lambda seed=0, dtype=jnp.float64: InternalGraphBackbone(SPECIES, CUTOFF, seed=seed, dtype=dtype),
}
# The machine-learning potentials specified one by one here; charge equilibration and the
# internal-graph backbone have their own module and join the distributed sweeps below.
NAMES = ["bp", "schnet", "nequip"]


# ----------------------------------------------------------------------------- systems


def mixed_bulk(n_cells, seed=0):
    """Rattled fcc (a = 4.1 Å) of randomly mixed H, C, N, O; periodic, cubic."""
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.numbers = np.random.default_rng(seed).choice(SPECIES, len(atoms))
    atoms.rattle(0.15, seed=seed + 1)
    return atoms


def molecule_list(seed=0):
    """Small molecules, each turned at random, in its own vacuum box (for stress), pbc False."""
    rng = np.random.default_rng(seed)
    out = []
    for name in MOLECULES:
        mol = ase.build.molecule(name)
        mol.rotate(rng.uniform(0, 360), rng.normal(size=3), center="COM")
        mol.center(vacuum=4.0)
        mol.pbc = False
        out.append(mol)
    return out


@functools.lru_cache(maxsize=None)
def system(name, dtype=jnp.float64):
    """A Batch: "bulk" (256 atoms), "bulk-large" (1,372 atoms) or "molecules" (padded by 3
    atoms and one empty system)."""
    if name == "bulk":
        return Batch.from_ase(mixed_bulk(4), dtype=dtype)
    if name == "bulk-large":
        return Batch.from_ase(mixed_bulk(7), dtype=dtype)
    if name == "molecules":
        batch = Batch.from_ase(molecule_list(), dtype=dtype)
        return batch.pad(batch.n_atoms + 3, batch.n_systems + 1)
    raise KeyError(name)


@functools.lru_cache(maxsize=None)
def capacity(name):
    """One neighbour-list capacity per system, with room for moved atoms: calls on moved or
    rotated copies reuse the compiled program."""
    b = system(name)
    return neighbor_capacity(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, cutoff=CUTOFF, headroom=1.5)


@functools.lru_cache(maxsize=None)
def model(name, seed=0, dtype=jnp.float64):
    return FACTORIES[name](seed=seed, dtype=dtype)


def as_numpy(outputs):
    return {k: np.asarray(v) for k, v in outputs.items()}


def run(m, data, cap):
    return as_numpy(jaxdd.compute(m, data, KEYS, capacity=capacity(cap)))


@functools.lru_cache(maxsize=None)
def reference(name, sys_name):
    return run(model(name), system(sys_name), sys_name)


def mesh_of(n_ranks):
    return Mesh(np.asarray(jax.devices()[:n_ranks]), ("dd",), axis_types=(AxisType.Auto,))


def run_distributed(name, sys_name, grid):
    """(DistributedModel after one call, its energy, forces and stress)."""
    dm = DistributedModel(model(name), DomainConfig(CUTOFF, mesh=mesh_of(math.prod(grid)), grid=grid))
    return dm, as_numpy(dm(system(sys_name), outputs=("energy", "forces", "stress")))


distributed = functools.lru_cache(maxsize=None)(run_distributed)


def assert_distributed_matches(got, want):
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0, err_msg="energy")
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9, err_msg="forces")
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9, err_msg="stress")


def rotation(seed):
    q, r = np.linalg.qr(np.random.default_rng(seed).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    return q * np.sign(np.linalg.det(q))  # proper rotation


# ----------------------------------------------------------------------------- declarations


@pytest.mark.parametrize("name", NAMES)
def test_model_declares_energy_outputs_autograd_forces_and_a_full_list(name):
    cfg = model(name).model_config
    assert cfg.outputs == {"energy", "atomic_energies", "forces", "stress"}
    assert cfg.autograd_outputs == {"forces", "stress"}
    assert cfg.autograd_inputs == {"positions", "cell"}
    nc = cfg.neighbor_config
    assert nc.cutoff == CUTOFF and not nc.half_list and nc.skin == 0.0
    # BP reads its dense per-atom table from the framework's MATRIX list (grown on overflow).
    expected = jaxdd.NeighborListFormat.MATRIX if name == "bp" else jaxdd.NeighborListFormat.COO
    assert nc.format is expected


@pytest.mark.parametrize("name", NAMES)
def test_model_declares_the_mpnn_halo_preset(name):
    assert model(name).distribution_spec is SPEC_MPNN_HALO


@pytest.mark.parametrize("name", NAMES)
def test_atoms_of_an_unlisted_species_are_named(name):
    atoms = mixed_bulk(2)
    atoms.numbers[5] = 16
    with pytest.raises(ValueError, match=r"atoms \[5\].*\[16\]"):
        jaxdd.compute(model(name), jaxdd.AtomicData.from_ase(atoms), ("energy",))


@pytest.mark.parametrize("factory", [BehlerParrinello, SchNet, NequIP])
@pytest.mark.parametrize("kwargs, match", [(dict(species=(1, 1)), "distinct"), (dict(cutoff=0.0), "cutoff"),
                                           (dict(species=(1, 7.9999999)), "species must be an integer >= 1, got 7.99")])
def test_bad_constructor_arguments_are_refused(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_gives_the_same_parameters(name):
    a = jax.tree_util.tree_leaves(FACTORIES[name](seed=3))
    b = jax.tree_util.tree_leaves(FACTORIES[name](seed=3))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", NAMES)
def test_different_seed_gives_a_different_energy(name):
    other = run(model(name, seed=1), system("bulk"), "bulk")
    assert abs(other["energy"][0] - reference(name, "bulk")["energy"][0]) > 1e-6


@pytest.mark.parametrize("name", NAMES)
def test_parameters_are_in_the_requested_dtype(name):
    for dtype in (jnp.float32, jnp.float64):
        leaves = jax.tree_util.tree_leaves(model(name, dtype=dtype))
        assert {x.dtype for x in leaves} == {jnp.dtype(dtype)}


# ----------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("name", NAMES)
def test_outputs_have_the_documented_shapes(name):
    batch = system("molecules")
    out = reference(name, "molecules")
    assert out["energy"].shape == (batch.n_systems,)
    assert out["atomic_energies"].shape == (batch.n_atoms,)
    assert out["forces"].shape == (batch.n_atoms, 3)
    assert out["stress"].shape == (batch.n_systems, 3, 3)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("sys_name", ["bulk", "molecules"])
def test_outputs_are_finite(name, sys_name):
    for key, value in reference(name, sys_name).items():
        assert np.all(np.isfinite(value)), key


@pytest.mark.parametrize("name", NAMES)
def test_atomic_energies_sum_to_the_energy_of_each_system(name):
    batch = system("molecules")
    out = reference(name, "molecules")
    sums = np.bincount(np.asarray(batch.batch_idx), out["atomic_energies"], minlength=batch.n_systems + 1)
    np.testing.assert_allclose(sums[: batch.n_systems], out["energy"], rtol=1e-12, atol=1e-12)
    assert np.any(out["energy"][:-1] != 0)


@pytest.mark.parametrize("name", NAMES)
def test_padding_atoms_and_systems_get_zero_energy_and_forces(name):
    batch = system("molecules")
    out = reference(name, "molecules")
    pad = ~np.asarray(batch.atom_mask)
    assert pad.sum() == 3
    assert np.all(out["atomic_energies"][pad] == 0) and np.all(out["forces"][pad] == 0)
    assert out["energy"][-1] == 0


# NequIP in the default suite; for BP and SchNet it follows there from the list never joining
# systems (test_neighbors.py) and their per-system sums (test_atomic_energies_sum_...).
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == "nequip" else pytest.mark.slow) for n in NAMES])
def test_a_molecule_in_a_batch_has_its_energy_alone(name):
    mol = molecule_list()[6]  # benzene: the most neighbours of the list
    alone = as_numpy(jaxdd.compute(model(name), jaxdd.AtomicData.from_ase(mol), ("energy", "forces")))
    batch = system("molecules")
    rows = np.asarray(batch.batch_idx) == 6
    out = reference(name, "molecules")
    np.testing.assert_allclose(out["energy"][6], alone["energy"][0], rtol=1e-12)
    np.testing.assert_allclose(out["forces"][rows], alone["forces"], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_forces_are_minus_the_gradient_of_the_energy(name):
    batch = system("bulk")
    forces = reference(name, "bulk")["forces"]
    direction = np.random.default_rng(11).normal(size=forces.shape)
    h = 1e-4
    pos = np.asarray(batch.positions)
    e_plus = run(model(name), batch.replace(positions=pos + h * direction), "bulk")["energy"][0]
    e_minus = run(model(name), batch.replace(positions=pos - h * direction), "bulk")["energy"][0]
    slope = (e_plus - e_minus) / (2 * h)
    expected = -np.sum(forces * direction)
    assert abs(slope - expected) <= 1e-6 * max(1.0, abs(expected)), (slope, expected)


@pytest.mark.parametrize("name", NAMES)
def test_forces_are_not_trivially_zero(name):
    assert np.abs(reference(name, "bulk")["forces"]).max() > 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_total_force_vanishes_on_a_periodic_system(name):
    total = reference(name, "bulk")["forces"].sum(axis=0)
    assert np.abs(total).max() <= 1e-10


@pytest.mark.parametrize("name", NAMES)
def test_float32_model_on_float32_positions_gives_float32_outputs_close_to_float64(name):
    m32 = model(name, dtype=jnp.float32)
    out32 = run(m32, system("bulk", jnp.float32), "bulk")
    for key in KEYS:
        assert out32[key].dtype == np.float32, key
        assert np.all(np.isfinite(out32[key])), key
    # The same parameters in float64: the float32 run agrees to single precision.
    m64 = jax.tree_util.tree_map(lambda x: x.astype(jnp.float64), m32)
    out64 = run(m64, system("bulk"), "bulk")
    np.testing.assert_allclose(out32["energy"], out64["energy"], rtol=1e-5)
    scale = np.abs(out64["forces"]).max()
    np.testing.assert_allclose(out32["forces"], out64["forces"], rtol=0, atol=1e-3 * scale)


def test_nequip_energy_is_invariant_and_forces_rotate_with_the_molecules():
    batch = system("molecules")
    rot = rotation(5)
    shift = np.array([1.3, -0.7, 2.1])
    real = np.asarray(batch.atom_mask)
    pos = np.asarray(batch.positions)
    moved = np.where(real[:, None], pos @ rot.T + shift, pos)
    got = run(model("nequip"), batch.replace(positions=moved), "molecules")
    want = reference("nequip", "molecules")
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"] @ rot.T, rtol=0, atol=1e-9)


def test_nequip_energy_changes_under_a_non_rigid_deformation():
    batch = system("molecules")
    pos = np.asarray(batch.positions)
    stretched = pos * np.array([1.05, 1.0, 1.0])
    got = run(model("nequip"), batch.replace(positions=stretched), "molecules")
    assert np.abs(got["energy"][:-1] - reference("nequip", "molecules")["energy"][:-1]).max() > 1e-6


def test_bp_table_narrower_than_the_crowdest_atom_grows_instead_of_dropping_neighbours():
    benzene, water = molecule_list()[6], molecule_list()[0]  # 11 and 2 neighbours per atom
    data = Batch.from_ase([benzene, water])
    narrow = BehlerParrinello(SPECIES, CUTOFF, max_neighbors=4)
    wide = BehlerParrinello(SPECIES, CUTOFF, max_neighbors=32)
    start = neighbor_capacity(data.positions, data.cell, data.pbc, data.batch_idx, data.atom_mask, cutoff=CUTOFF)
    start = dataclasses.replace(start, max_neighbors=4)
    got = as_numpy(jaxdd.compute(narrow, data, ("energy", "forces"), capacity=start))
    want = as_numpy(jaxdd.compute(wide, data, ("energy", "forces")))
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-12)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-12)


@pytest.mark.slow
def test_bp_distributed_table_grows_when_atoms_gain_neighbours():
    batch = system("bulk")
    dm = DistributedModel(model("bp"), DomainConfig(CUTOFF, mesh=mesh_of(2)))
    dm(batch, outputs=("energy",))
    squeezed = batch.replace(positions=np.asarray(batch.positions) * 0.85, cell=np.asarray(batch.cell) * 0.85)
    got = as_numpy(dm(squeezed, outputs=("energy", "forces")))
    assert dm.health.recompiles >= 1
    want = as_numpy(jaxdd.compute(model("bp"), squeezed, ("energy", "forces")))
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- distributed


@pytest.mark.parametrize("name", NAMES)
def test_distributed_bulk_on_2x2x1_equals_single_device(name):
    _, got = distributed(name, "bulk", (2, 2, 1))
    assert_distributed_matches(got, reference(name, "bulk"))


@pytest.mark.parametrize("name", NAMES)
def test_distributed_model_needs_no_dispatch_fallback(name):
    dm, _ = distributed(name, "bulk", (2, 2, 1))
    report = dm.dispatch_report
    assert report.fallbacks == []
    assert report.counts["segment_reduce.add"] >= 1


@pytest.fixture
def release_compiled_programs():
    yield
    jax.clear_caches()


SLOW_GRIDS = [(2, 2, 1), (4, 1, 1), (2, 2, 2), (4, 2, 1)]


@pytest.mark.slow
@pytest.mark.usefixtures("release_compiled_programs")
@pytest.mark.parametrize("grid", SLOW_GRIDS, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("sys_name", ["bulk-large", "molecules"])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_distributed_equals_single_device_on_every_grid(name, sys_name, grid):
    if sys_name == "bulk-large":
        assert system(sys_name).n_atoms >= 1000
    _, got = run_distributed(name, sys_name, grid)
    assert_distributed_matches(got, reference(name, sys_name))


@pytest.mark.slow
@pytest.mark.usefixtures("release_compiled_programs")
@pytest.mark.parametrize("name", NAMES)
def test_float64_parameters_on_float32_positions_give_float32_outputs(name):
    out = run(model(name), system("bulk", jnp.float32), "bulk")
    for key in KEYS:
        assert out[key].dtype == np.float32, key
        assert np.all(np.isfinite(out[key])), key
    np.testing.assert_allclose(out["energy"], reference(name, "bulk")["energy"], rtol=1e-5)
