"""The zoo's angle model (``jaxdd.models.angle_mpnn``): bond features updated from angles,
symmetrised through reverse bonds. On one device its forces are the energy's gradient;
distributed in float64 on triclinic cells it equals one device (energy 1e-10 relative,
forces and stress 1e-9 absolute), and it passes the validator at world size 4 with no fix."""

from __future__ import annotations

import functools

import ase
import numpy as np
import pytest

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.models.angle_mpnn import AngleMPNN
from jaxdd.validate import trace_and_validate

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF, BOND_CUTOFF = 3.5, 2.6
KEYS = ("energy", "forces", "stress")


def make_model():
    return AngleMPNN((1, 8), cutoff=CUTOFF, bond_cutoff=BOND_CUTOFF, features=4)


@functools.lru_cache(maxsize=None)
def sample(pbc=(True, True, True)) -> jaxdd.AtomicData:
    """64 H and O atoms on a jittered lattice in a triclinic cell (about 5 bonds per atom)."""
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3)
    cell = np.array([[7.2, 0.0, 0.0], [1.1, 7.4, 0.0], [-0.8, 0.7, 7.6]])
    frac = (grid + 0.5 + rng.uniform(-0.12, 0.12, grid.shape)) / 4
    atoms = ase.Atoms(numbers=rng.choice([1, 8], len(grid)), positions=frac @ cell, cell=cell, pbc=pbc)
    return jaxdd.AtomicData.from_ase(atoms)


@functools.lru_cache(maxsize=None)
def model():
    return make_model()


@functools.lru_cache(maxsize=None)
def reference(pbc):
    return {k: np.asarray(v) for k, v in jaxdd.compute(model(), sample(pbc), KEYS).items()}


def test_forces_are_minus_the_gradient_of_the_energy():
    data, pbc = sample(), (True, True, True)
    forces = reference(pbc)["forces"]
    direction = np.random.default_rng(3).normal(size=forces.shape)
    h = 1e-5
    pos = np.asarray(data.positions)
    energy = [float(jaxdd.compute(model(), data.replace(positions=pos + s * h * direction), ("energy",))["energy"][0])
              for s in (1, -1)]
    assert abs((energy[0] - energy[1]) / (2 * h) + np.sum(forces * direction)) <= 1e-6 * max(1.0, np.abs(forces).max())
    assert np.abs(forces).max() > 1e-3


# The (2, 2, 1) periodic grid and the validator run with the slow set; the (3, 2, 1) slab keeps
# bonds and angles crossing rank faces along two axes in the default suite.
@pytest.mark.parametrize("grid, pbc", [pytest.param((2, 2, 1), (True, True, True), marks=pytest.mark.slow),
                                       ((3, 2, 1), (True, True, False))], ids=["2x2x1-periodic", "3x2x1-slab"])
def test_distributed_equals_single_device_on_a_triclinic_cell(grid, pbc):
    dm = DistributedModel(model(), DomainConfig(cutoff=CUTOFF, grid=grid))
    got = {k: np.asarray(v) for k, v in dm(sample(pbc), KEYS).items()}
    want = reference(pbc)
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)
    # Per-bond rows are read at partners that may be ghosts: refreshed from their owners, never guessed.
    assert dm.dispatch_report.fallbacks == [] and dm.dispatch_report.counts["gather.refresh"] >= 2


@pytest.mark.slow
def test_it_passes_the_validator_at_world_size_4_with_no_fix():
    report = trace_and_validate(make_model, sample(), world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None


@pytest.mark.slow
def test_the_ranks_grow_the_bond_width_when_atoms_gain_bonds():
    data = sample()
    dm = DistributedModel(model(), DomainConfig(cutoff=CUTOFF, grid=(2, 2, 1)))
    dm(data, ("energy",))
    width = dm.capacities.neighbors.max_bonds
    # 0.75 × the lattice: the third shell comes inside the bond cutoff (28 bonds at most, from 14).
    squeezed = data.replace(positions=np.asarray(data.positions) * 0.75, cell=np.asarray(data.cell) * 0.75)
    got = dm(squeezed, ("energy", "forces"))
    assert dm.capacities.neighbors.max_bonds > width and dm.health.recompiles >= 1
    want = jaxdd.compute(model(), squeezed, ("energy", "forces"))
    np.testing.assert_allclose(np.asarray(got["energy"]), np.asarray(want["energy"]), rtol=1e-10, atol=0)
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(want["forces"]), rtol=0, atol=1e-9)


def test_in_a_sum_with_a_pair_model_it_adds_its_own_energy():
    from jaxdd.models.composite import SumModel
    from jaxdd.models.species_pair import SpeciesPair

    pair = SpeciesPair((1, 8), cutoff=4.5)
    data, pbc = sample(), (True, True, True)
    got = jaxdd.compute(SumModel(model(), pair), data, ("energy", "forces"))
    alone = jaxdd.compute(pair, data, ("energy", "forces"))
    want = reference(pbc)
    np.testing.assert_allclose(np.asarray(got["energy"]), want["energy"] + np.asarray(alone["energy"]), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(got["forces"]), want["forces"] + np.asarray(alone["forces"]), atol=1e-10)


def test_node_blocks_refuse_bonds_naming_why():
    with pytest.raises(ValueError, match="bond_cutoff.*halo strategy"):
        DistributedModel(model(), DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1), strategy="graph_partition"))
