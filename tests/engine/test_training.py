"""Specification of training under decomposition: ``DistributedModel.prepare`` does the host
work once, ``DistributedModel.apply(model, prepared)`` is a pure function of the model's
parameters, and the parameter gradients of a loss over energies, forces and stress equal
those on one device (float64, 1e-9 relative) for the zoo's SchNet, NequIP and
Behler-Parrinello, on the grid (3, 2, 1) (and (2, 2, 2) in the slow set, with NequIP: its
second-order programs take about a minute to compile).

The system: a rattled fcc arrangement of H, C, N, O (3 x 3 x 3 cells, 108 atoms, 12.3 Å box),
which every rank of both grids must decompose (blocks of 4.1 to 6.2 Å against a 5 Å cutoff).
"""

from __future__ import annotations

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxdd
from jaxdd import AtomicData, BaseModel, ModelConfig, NeighborConfig
from jaxdd.data.segments import per_system_sum
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.models.bp import BehlerParrinello
from jaxdd.models.mpnn import SchNet
from jaxdd.models.nequip import NequIP
from jaxdd.engine.rank_program import RankInputs
from jaxdd.data.systems import fcc_lattice

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 5.0
SPECIES = (1, 6, 7, 8)
KEYS = ("energy", "forces", "stress")
FACTORIES = {
    "schnet": lambda: SchNet(SPECIES, CUTOFF, seed=0, dtype=jnp.float64),
    "nequip": lambda: NequIP(SPECIES, CUTOFF, seed=0, dtype=jnp.float64),
    "bp": lambda: BehlerParrinello(SPECIES, CUTOFF, max_neighbors=48, seed=0, dtype=jnp.float64),
}


def bulk(seed=0) -> AtomicData:
    atoms = fcc_lattice(3, 4.1)
    rng = np.random.default_rng(seed)
    positions = atoms.positions + rng.normal(0.0, 0.1, atoms.positions.shape)
    return AtomicData(positions, rng.choice(SPECIES, len(atoms)), np.asarray(atoms.cell), True)


DATA = bulk()


def loss(out) -> jax.Array:
    """A training loss: energy per atom, forces and stress, squared (against zero targets)."""
    n = out["forces"].shape[0]
    return (jnp.sum((out["energy"] / n) ** 2) + jnp.mean(out["forces"] ** 2)
            + jnp.sum(out["stress"] ** 2))


def distributed(model, grid) -> DistributedModel:
    mesh = default_mesh(jax.devices()[:int(np.prod(grid))])
    return DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=mesh, grid=grid))


def single_device_grads(model):
    return eqx.filter_value_and_grad(lambda m: loss(jaxdd.compute(m, DATA, KEYS)))(model)


def assert_same_gradients(got, want, rel=1e-9):
    """Every parameter's gradient equal within ``rel`` of that parameter's largest gradient."""
    got_leaves = jax.tree_util.tree_leaves(eqx.filter(got, eqx.is_inexact_array))
    want_leaves = jax.tree_util.tree_leaves(eqx.filter(want, eqx.is_inexact_array))
    assert len(got_leaves) == len(want_leaves) > 0
    worst = 0.0
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g), np.asarray(w)
        scale = max(float(np.abs(w).max(initial=0.0)), 1e-300)
        worst = max(worst, float(np.abs(g - w).max(initial=0.0)) / scale)
    assert worst <= rel, f"parameter gradients differ by {worst:.3g} relative"
    assert any(np.abs(np.asarray(w)).max() > 0 for w in want_leaves)  # not trivially zero


@pytest.mark.parametrize("grid", [pytest.param((2, 2, 2), marks=pytest.mark.slow), (3, 2, 1)], ids=["2x2x2", "3x2x1"])
@pytest.mark.parametrize("name", [pytest.param("schnet", marks=pytest.mark.slow),
                                  pytest.param("nequip", marks=pytest.mark.slow), "bp"])
def test_parameter_gradients_equal_single_device(name, grid):
    model = FACTORIES[name]()
    dm = distributed(model, grid)
    prepared = dm.prepare(DATA, KEYS)
    value, grads = eqx.filter_value_and_grad(lambda m: loss(dm.apply(m, prepared)))(model)
    want_value, want = single_device_grads(model)
    assert abs(float(value) - float(want_value)) <= 1e-10 * abs(float(want_value))
    assert_same_gradients(grads, want)


@functools.lru_cache(maxsize=None)
def prepared_schnet(grid):
    """(SchNet, its DistributedModel on ``grid``, DATA prepared), shared by the tests of apply:
    one model, one program per grid."""
    model = FACTORIES["schnet"]()
    dm = distributed(model, grid)
    return model, dm, dm.prepare(DATA, KEYS)


def test_prepared_apply_equals_a_call():
    model, dm, prepared = prepared_schnet((2, 2, 2))
    assert isinstance(prepared, RankInputs)
    got, want = dm.apply(model, prepared), dm(DATA, KEYS)
    for key in KEYS:
        np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]))


def test_apply_under_jit_takes_parameters_as_arguments():
    model, dm, prepared = prepared_schnet((2, 2, 2))
    params, static = eqx.partition(model, eqx.is_array)
    apply = jax.jit(lambda p, x: dm.apply(eqx.combine(p, static), x))
    one = apply(params, prepared)
    scaled = jax.tree_util.tree_map(lambda x: x * 1.01 if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    two = apply(scaled, prepared)
    want = dm.apply(eqx.combine(scaled, static), prepared)
    assert float(jnp.abs(one["energy"] - two["energy"]).max()) > 0  # new parameters, new energy
    np.testing.assert_allclose(np.asarray(two["forces"]), np.asarray(want["forces"]), rtol=0, atol=1e-12)


def test_apply_refuses_what_prepare_did_not_return():
    dm = distributed(FACTORIES["schnet"](), (2, 1, 1))
    with pytest.raises(TypeError, match="DistributedModel.prepare"):
        dm.apply(dm.model, jaxdd.data.as_batch(DATA))


def small_neighbor_capacity(prepared):
    nl = prepared.program.nl_capacity
    small = dataclasses.replace(prepared.program, nl_capacity=dataclasses.replace(nl, max_edges=nl.max_edges // 4))
    return dataclasses.replace(prepared, program=small)


def test_apply_raises_instead_of_dropping_pairs_when_capacities_do_not_fit():
    model, dm, prepared = prepared_schnet((2, 1, 1))
    altered = small_neighbor_capacity(prepared)
    with pytest.raises(RuntimeError, match="overflowed its capacity"):
        dm.apply(model, altered)


def test_apply_under_jit_gives_nan_instead_of_dropping_pairs():
    model, dm, prepared = prepared_schnet((2, 1, 1))
    altered = small_neighbor_capacity(prepared)
    out = eqx.filter_jit(dm.apply)(model, altered)
    assert np.isnan(np.asarray(out["energy"])).all() and np.isnan(np.asarray(out["forces"])).all()


def test_apply_refuses_a_model_with_another_cutoff():
    _, dm, prepared = prepared_schnet((2, 1, 1))
    with pytest.raises(ValueError, match="prepared for"):
        dm.apply(SchNet(SPECIES, CUTOFF + 1.0, seed=0, dtype=jnp.float64), prepared)


class NnxPairEnergy(nnx.Module, BaseModel):
    """A flax.nnx wrapper: a smooth pair energy with a trainable depth per species pair."""

    def __init__(self):
        self.depth = nnx.Param(jnp.linspace(0.5, 1.5, len(SPECIES) ** 2, dtype=jnp.float64))
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "forces", "stress"}), autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}), neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data, **kwargs):
        return dict(positions=data.positions, z=data.atomic_numbers, cell=data.cell, batch_idx=data.batch_idx,
                    neighbors=data.neighbors, n_systems=data.n_systems)

    def forward(self, positions, z, cell, batch_idx, neighbors, n_systems):
        species = jnp.searchsorted(jnp.asarray(SPECIES), z)
        vec = jaxdd.edge_vectors(positions, cell, batch_idx, neighbors)
        r2 = jnp.sum(vec * vec, axis=-1)
        inside = neighbors.mask & (r2 < CUTOFF**2)
        depth = self.depth[...][species[neighbors.receivers] * len(SPECIES) + species[neighbors.senders]]
        pair = jnp.where(inside, depth * jnp.exp(-r2 / 4.0) * (1.0 - r2 / CUTOFF**2) ** 2, 0.0)
        atomic = jax.ops.segment_sum(0.5 * pair, neighbors.receivers, positions.shape[0])
        return {"energy": per_system_sum(atomic, batch_idx, n_systems)}


def test_flax_nnx_parameter_gradients_equal_single_device():
    model = NnxPairEnergy()
    graphdef, state = nnx.split(model)
    dm = distributed(model, (3, 2, 1))
    prepared = dm.prepare(DATA, KEYS)
    got = jax.grad(lambda s: loss(dm.apply(nnx.merge(graphdef, s), prepared)))(state)
    want = jax.grad(lambda s: loss(jaxdd.compute(nnx.merge(graphdef, s), DATA, KEYS)))(state)
    assert_same_gradients(got, want)
