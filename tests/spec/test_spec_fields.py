"""Specification: every field of a spec changes what the engine does, or is refused.

``CompilePolicy.capacity_factor`` and ``growth_factor`` size and grow the capacities (the
domain config's ``capacity_factor`` wins when given); ``owned_only_outputs`` makes a key a
per-atom output; ``shard_fields`` names the per-atom fields the ranks receive;
``system_reductions=False`` and ``stress_via_strain=False`` are refused, naming the field.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import AtomicData, BaseModel, ModelConfig, NeighborConfig
from jaxdd.neighbors.capacity import Capacities
from jaxdd.data import as_batch
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.models.lj import LennardJones
from jaxdd.data.segments import per_system_sum
from jaxdd.spec import SPEC_LJ_HALO, CompilePolicy, DistributionSpec, MLIPSpec, OutputKind, SpecError
from jaxdd.data.systems import fcc_lattice

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 5.0
LJ = LennardJones(epsilon=0.0104, sigma=3.4, cutoff=CUTOFF)


def argon(n=3, seed=0) -> AtomicData:
    atoms = fcc_lattice(n, 5.26)
    rng = np.random.default_rng(seed)
    return AtomicData(atoms.positions + rng.normal(0, 0.05, atoms.positions.shape), np.full(len(atoms), 18),
                      np.asarray(atoms.cell), True, charges=rng.normal(0, 0.1, len(atoms)))


DATA = argon()
BATCH = as_batch(DATA)


def distributed(model=LJ, spec=None, grid=(2, 2, 2), **config) -> DistributedModel:
    mesh = default_mesh(jax.devices()[:math.prod(grid)])
    return DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=mesh, grid=grid, **config), spec)


# ----------------------------------------------------------------------------- capacities


def owned_capacity(dm: DistributedModel) -> int:
    dm.plan(BATCH)
    return dm.capacities.owned


def test_compile_policy_capacity_factor_sizes_the_capacities():
    default = owned_capacity(distributed(spec=SPEC_LJ_HALO))
    wide = owned_capacity(distributed(spec=SPEC_LJ_HALO.with_compile(capacity_factor=3)))
    assert wide > 2 * default
    assert wide == owned_capacity(distributed(spec=SPEC_LJ_HALO, capacity_factor=3))


def test_domain_config_capacity_factor_wins_over_the_compile_policy():
    spec = SPEC_LJ_HALO.with_compile(capacity_factor=3)
    assert owned_capacity(distributed(spec=spec, capacity_factor=1.0)) == owned_capacity(
        distributed(spec=SPEC_LJ_HALO, capacity_factor=1.0))


@pytest.mark.parametrize("growth", [1.5, 4.0])
def test_growth_factor_sets_how_far_an_overflowing_capacity_grows(growth):
    dm = distributed(spec=SPEC_LJ_HALO.with_compile(growth_factor=growth), capacity_factor=1.0)
    _, plan = dm.plan(BATCH)
    needed = plan.needed_owned
    dm.sizing.use(Capacities(1, (1,) * len(plan.layout.exchanges)))
    dm.plan(BATCH)
    assert dm.capacities.owned == math.ceil(needed * growth)
    assert dm.capacities.exchange == tuple(math.ceil(n * growth) for n in plan.needed_exchange)


# ----------------------------------------------------------------------------- outputs


def smooth_coordination(positions, cell, batch_idx, neighbors):
    """[V] each atom's smooth coordination number, by edge vector."""
    vec = jaxdd.edge_vectors(positions, cell, batch_idx, neighbors)
    r2 = jnp.sum(vec * vec, axis=-1)
    smooth = jnp.where(neighbors.mask & (r2 < CUTOFF**2), (1.0 - r2 / CUTOFF**2) ** 2, 0.0)
    return jax.ops.segment_sum(smooth, neighbors.receivers, positions.shape[0])


class EdgeModel(eqx.Module, BaseModel):
    """A wrapper reading positions, cell and the neighbour list; subclasses give ``forward``."""

    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, outputs, autograd):
        self.model_config = ModelConfig(
            outputs=frozenset(outputs), autograd_outputs=frozenset(autograd),
            autograd_inputs=frozenset({"positions", "cell"}), neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data, **kwargs):
        return dict(positions=data.positions, cell=data.cell, batch_idx=data.batch_idx, neighbors=data.neighbors,
                    n_systems=data.n_systems)


class PairWithCoordination(EdgeModel):
    """A smooth pair energy and a per-atom output: each atom's smooth coordination number."""

    def __init__(self):
        super().__init__({"energy", "forces", "coordination"}, {"forces"})

    def forward(self, positions, cell, batch_idx, neighbors, n_systems):
        coordination = smooth_coordination(positions, cell, batch_idx, neighbors)
        return {"energy": per_system_sum(0.01 * coordination, batch_idx, n_systems), "coordination": coordination}


UNDECLARED = MLIPSpec(distribution=SPEC_LJ_HALO.distribution,
                      output_kinds={"energy": OutputKind.PER_GRAPH, "forces": OutputKind.PER_NODE})


def test_owned_only_output_is_returned_per_atom_like_one_device():
    model = PairWithCoordination()
    spec = dataclasses.replace(UNDECLARED, owned_only_outputs=frozenset({"coordination"}))
    got = distributed(model, spec)(DATA, ("energy", "coordination"))
    want = jaxdd.compute(model, DATA, ("energy", "coordination"))
    assert got["coordination"].shape == (len(DATA.positions),)
    np.testing.assert_allclose(np.asarray(got["coordination"]), np.asarray(want["coordination"]), rtol=0, atol=1e-12)


def test_without_owned_only_outputs_the_same_key_is_refused_for_want_of_a_kind():
    with pytest.raises(ValueError, match="no OutputKind"):
        distributed(PairWithCoordination(), UNDECLARED)(DATA, ("energy", "coordination"))


def test_owned_only_output_declared_per_graph_is_refused():
    with pytest.raises(SpecError, match="owned-only"):
        dataclasses.replace(UNDECLARED, output_kinds={"coordination": OutputKind.PER_GRAPH},
                            owned_only_outputs=frozenset({"coordination"}))


# ----------------------------------------------------------------------------- shard fields


def rank_charges(spec):
    dm = distributed(spec=spec)
    inputs, _ = dm.rank_inputs(BATCH, *dm.plan(BATCH))
    return inputs.local.charges


def test_ranks_receive_the_shard_fields_only():
    assert rank_charges(SPEC_LJ_HALO) is not None
    narrow = dataclasses.replace(SPEC_LJ_HALO.distribution, shard_fields=("positions", "atomic_numbers"))
    assert rank_charges(dataclasses.replace(SPEC_LJ_HALO, distribution=narrow)) is None


@pytest.mark.parametrize("fields, match", [
    (("positions", "atomic_numbers", "spins"), "not per-atom Batch fields"),
    (("positions", "charges"), "atomic_numbers"),
])
def test_shard_fields_outside_the_batch_or_without_the_essentials_are_refused(fields, match):
    with pytest.raises(SpecError, match=match):
        DistributionSpec(shard_fields=fields)


# ----------------------------------------------------------------------------- refused fields


def test_system_reductions_false_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="system_reductions"):
        MLIPSpec(system_reductions=False)


def test_stress_via_strain_false_is_refused_naming_the_field():
    with pytest.raises(SpecError, match="stress_via_strain"):
        CompilePolicy(stress_via_strain=False)


# ----------------------------------------------------------------------------- per-atom virials

VIRIAL_SPEC = dataclasses.replace(SPEC_LJ_HALO, node_virial_key="atomic_virials")
VIRIAL_KEYS = ("energy", "stress", "atomic_virials")


def test_node_virial_key_gives_per_atom_virials_equal_to_ase():
    from ase.calculators.lj import LennardJones as AseLJ

    out = jaxdd.compute(LJ, DATA, VIRIAL_KEYS, spec=VIRIAL_SPEC)
    atoms = DATA.to_ase()
    atoms.calc = AseLJ(epsilon=0.0104, sigma=3.4, rc=CUTOFF, smooth=False)
    # ASE's per-atom stresses are -(per-atom virial) / V with the pair's virial split half and half.
    want = -atoms.get_stresses(voigt=False) * atoms.get_volume()
    got = np.asarray(out["atomic_virials"])
    assert got.shape == (len(atoms), 3, 3)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-9)
    np.testing.assert_allclose(got.sum(0), -np.asarray(out["stress"][0]) * atoms.get_volume(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("grid", [(2, 2, 2), (3, 2, 1)])
def test_per_atom_virials_distributed_equal_one_device(grid):
    want = np.asarray(jaxdd.compute(LJ, DATA, VIRIAL_KEYS, spec=VIRIAL_SPEC)["atomic_virials"])
    got = np.asarray(distributed(spec=VIRIAL_SPEC, grid=grid)(DATA, VIRIAL_KEYS)["atomic_virials"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_without_node_virial_key_per_atom_virials_are_unknown():
    with pytest.raises(ValueError, match="atomic_virials"):
        distributed(spec=SPEC_LJ_HALO)(DATA, VIRIAL_KEYS)


def test_per_atom_virials_of_a_matrix_list_model_are_refused():
    from jaxdd.models.bp import BehlerParrinello

    model = BehlerParrinello((18,), CUTOFF, max_neighbors=64, seed=0, dtype=jnp.float64)
    spec = dataclasses.replace(model.distribution_spec, node_virial_key="atomic_virials")
    with pytest.raises(ValueError, match="MATRIX"):
        jaxdd.compute(model, DATA, ("energy", "atomic_virials"), spec=spec)


class PairInAField(EdgeModel):
    """A pair energy plus an external field acting on positions directly (not by edge vector)."""

    def __init__(self):
        super().__init__({"energy", "forces", "stress"}, {"forces", "stress"})

    def forward(self, positions, cell, batch_idx, neighbors, n_systems):
        field = 1e-3 * jnp.sum(positions * positions, axis=1)
        atomic = 0.01 * smooth_coordination(positions, cell, batch_idx, neighbors) + field
        return {"energy": per_system_sum(atomic, batch_idx, n_systems)}


def test_per_atom_virials_of_an_energy_not_of_edge_vectors_are_refused():
    spec = dataclasses.replace(SPEC_LJ_HALO, node_virial_key="atomic_virials")
    with pytest.raises(ValueError, match="do not sum to its virial"):
        jaxdd.compute(PairInAField(), DATA, VIRIAL_KEYS, spec=spec)
