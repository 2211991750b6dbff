"""The graph-parallel strategy: node blocks, all-gathered neighbour reads, same results.

Specification: ``DomainConfig(strategy="graph_partition")`` (or ``SPEC_MPNN_GP``) splits
the atoms into contiguous balanced index blocks, one per rank; every rank's neighbour list
holds the edges of its own atoms, with senders among all atoms; reading per-atom values
through those senders all-gathers them; outputs equal single device (float64: energy 1e-10
relative, forces and stress 1e-9 absolute) for unchanged models.
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from plain_models import MODELS
from test_dispatch import SYSTEM, Plain, assert_same, mesh_for, reference
from test_zoo_models import CUTOFF as ZOO_CUTOFF
from test_zoo_models import as_numpy, assert_distributed_matches, mesh_of, model, system
from test_zoo_models import reference as zoo_reference

import jaxdd
from jaxdd import DistributedModel, DomainConfig, ffi
from jaxdd.data import Batch
from jaxdd.decomposition.graph_partition import block_neighbor_list, node_blocks
from jaxdd.models.lj import LennardJones
from jaxdd.neighbors import neighbor_capacity, neighbor_list
from jaxdd.spec import SPEC_MPNN_GP, SPEC_MPNN_HALO, SPEC_UMA_HALO
from jaxdd.validate import trace_and_validate

CUTOFF = 5.0
GP = "graph_partition"


def gp_model(model, n_ranks, spec=None, **config):
    return DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((n_ranks, 1, 1)), strategy=GP, **config),
                            spec=spec)


# ----------------------------------------------------------------------------- node blocks


def test_blocks_are_contiguous_balanced_and_skip_padding_atoms():
    mask = np.ones(23, bool)
    mask[[4, 17, 22]] = False
    part, plan = node_blocks(np.zeros(23, int), mask, np.ones((1, 3), bool), 3)
    real = np.nonzero(mask)[0]
    sizes = plan.owned_counts()
    assert sizes.tolist() == [7, 7, 6]
    assert plan.layout.n_owned == 7 and plan.layout.n_ghost == 0
    assert np.concatenate([ids[ids >= 0] for ids in plan.local_ids]).tolist() == real.tolist()
    assert part.owner[~mask].tolist() == [-1, -1, -1]
    assert np.bincount(part.owner[mask]).tolist() == [7, 7, 6]


def test_more_ranks_than_atoms_leaves_ranks_empty():
    _, plan = node_blocks(np.zeros(3, int), np.ones(3, bool), np.zeros((1, 3), bool), 8)
    assert plan.owned_counts().tolist() == [1, 1, 1, 0, 0, 0, 0, 0]


def edge_set(receivers, senders, shifts):
    return Counter((int(r), int(s), *map(int, sh)) for r, s, sh in zip(receivers, senders, shifts))


@pytest.mark.slow
@pytest.mark.parametrize("pbc", [(True, True, True), (True, False, True)], ids=["periodic", "partial-pbc"])
def test_block_lists_together_are_the_single_device_list(pbc):
    rng = np.random.default_rng(0)
    cell = np.array([[9.0, 0.0, 0.0], [2.0, 8.5, 0.0], [-1.0, 1.5, 9.5]])  # triclinic
    atoms = jaxdd.AtomicData(positions=rng.uniform(-2, 11, (70, 3)), atomic_numbers=np.ones(70, int), cell=cell,
                             pbc=np.array(pbc))
    batch = Batch.from_data_list([atoms])
    nl, _ = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, cutoff=3.0)
    m = np.asarray(nl.mask)
    want = edge_set(np.asarray(nl.receivers)[m], np.asarray(nl.senders)[m], np.asarray(nl.shifts)[m])

    n_ranks = 3
    _, plan = node_blocks(batch.batch_idx, batch.atom_mask, batch.pbc, n_ranks)
    ids = plan.local_ids.reshape(-1)
    rows = np.where(ids >= 0, ids, 0)
    pos = jnp.asarray(np.asarray(batch.positions)[rows])
    mask = jnp.asarray(ids >= 0)
    sys_idx = jnp.zeros(ids.size, jnp.int32)
    n_block = plan.layout.n_owned
    cap = neighbor_capacity(pos, batch.cell, batch.pbc, sys_idx, mask, cutoff=3.0, headroom=1.0)
    build = jax.jit(block_neighbor_list, static_argnames=("n_block", "cutoff", "capacity", "format"))
    got = Counter()
    for r in range(n_ranks):
        b = build(pos, batch.cell, batch.pbc, sys_idx, mask, r, n_block=n_block, cutoff=3.0, capacity=cap)
        bm = np.asarray(b.mask)
        assert not bool(b.overflow)
        assert np.all(np.asarray(b.receivers)[bm] < n_block)
        got += edge_set(plan.local_ids[r][np.asarray(b.receivers)[bm]], ids[np.asarray(b.senders)[bm]],
                        np.asarray(b.shifts)[bm])
    assert got == want


# ----------------------------------------------------------------------------- configuration


def test_unknown_strategy_is_refused():
    with pytest.raises(ValueError, match="strategy must be one of"):
        DomainConfig(CUTOFF, strategy="graph")


def test_graph_parallel_spec_selects_the_strategy_by_itself():
    dm = DistributedModel(Plain("mpnn_segment_sum"), DomainConfig(CUTOFF, mesh=mesh_for((2, 1, 1))), spec=SPEC_MPNN_GP)
    assert dm.strategy == GP


def test_graph_parallel_spec_with_the_halo_strategy_is_refused():
    with pytest.raises(ValueError, match="strategy='graph_partition'"):
        DistributedModel(Plain("mpnn_segment_sum"), DomainConfig(CUTOFF, mesh=mesh_for((2, 1, 1)), strategy="halo"),
                         spec=SPEC_MPNN_GP)


def test_a_model_that_builds_its_own_graph_is_refused():
    with pytest.raises(ValueError, match="needs spatial domains"):
        gp_model(Plain("mpnn_segment_sum"), 2, spec=SPEC_UMA_HALO)


def test_dynamics_run_node_blocks_without_migration():
    """DomainParallel keeps each node block on its rank: no rebuilds, the one-device steps, the
    thermostat's chain (summed over the blocks) included."""
    from jaxdd.data.systems import lj_melt_data
    from jaxdd.dynamics import NoseHooverChain

    data = lj_melt_data(3, temperature=1.0, dtype=np.float64)
    nvt = NoseHooverChain(dt=0.005, temperature=1.0, period=0.5, kB=1.0)
    md = jaxdd.DomainParallel(gp_model(LennardJones(1.0, 1.0, 2.5), 2), nvt)
    state = md.run(md.init(data), 40)
    assert md.last_run.rebuilds == 0 and md.last_run.migrations == 0
    one = jaxdd.DomainParallel(DistributedModel(LennardJones(1.0, 1.0, 2.5), DomainConfig(2.5, skin=0.3,
                                                mesh=mesh_for((1, 1, 1)))), nvt)
    reference = one.run(one.init(data), 40)
    np.testing.assert_allclose(np.asarray(md.gather(state).positions), np.asarray(one.gather(reference).positions),
                               rtol=0, atol=1e-9)
    np.testing.assert_allclose(md.thermo(state)["conserved"], one.thermo(reference)["conserved"], rtol=1e-10)


# ----------------------------------------------------------------------------- results


@pytest.mark.parametrize("n_ranks", [3, pytest.param(8, marks=pytest.mark.slow)])
def test_message_passing_model_equals_single_device(n_ranks):
    dm = gp_model(Plain("mpnn_segment_sum"), n_ranks)
    assert_same(dm(SYSTEM, outputs=("energy", "forces")), reference("mpnn_segment_sum"))
    counts = dm.dispatch_report.counts
    assert counts["gather.all_nodes"] >= 3  # the sender features of every layer
    assert not [k for k in counts if "halo" in k]
    assert not dm.dispatch_report.fallbacks
    owned = dm.health.owned
    assert owned.sum() == 60 and owned.max() - owned.min() <= 1 and not dm.health.ghost.any()


@pytest.mark.slow
def test_a_two_dimensional_mesh_stacks_ranks_in_row_major_order():
    mesh = Mesh(np.array(jax.devices()[:6]).reshape(3, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    dm = DistributedModel(Plain("mpnn_segment_sum"), DomainConfig(CUTOFF, mesh=mesh, strategy=GP))
    assert_same(dm(SYSTEM, outputs=("energy", "forces")), reference("mpnn_segment_sum"))


@pytest.mark.slow
def test_halo_spec_runs_under_the_graph_parallel_strategy():
    dm = gp_model(Plain("mpnn_jraph"), 4, spec=SPEC_MPNN_HALO)
    assert_same(dm(SYSTEM, outputs=("energy", "forces")), reference("mpnn_jraph"))


@pytest.mark.slow
def test_stress_equals_single_device():
    want = as_numpy(jaxdd.compute(Plain("mpnn_segment_sum"), SYSTEM, outputs=("energy", "stress")))
    got = as_numpy(gp_model(Plain("mpnn_segment_sum"), 4)(SYSTEM, outputs=("energy", "stress")))
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)


def test_species_read_through_clamped_senders_equal_single_device():
    # LennardJones looks up each sender's species as kind[jnp.minimum(senders, n - 1)].
    rng = np.random.default_rng(5)
    data = jaxdd.AtomicData(positions=np.asarray(SYSTEM.positions) * 0.4, atomic_numbers=rng.choice([18, 36], 60),
                            cell=np.asarray(SYSTEM.cell) * 0.4, pbc=SYSTEM.pbc)
    model = LennardJones([[1.0, 1.1], [1.1, 1.2]], [[1.0, 0.8], [0.8, 0.6]], 2.5, species=(18, 36))
    want = jaxdd.compute(model, data, outputs=("energy", "forces"))
    dm = DistributedModel(model, DomainConfig(2.5, mesh=mesh_for((4, 1, 1)), strategy=GP))
    assert_same(dm(data, outputs=("energy", "forces")), want)
    assert dm.dispatch_report.counts["bound.all_nodes"] >= 1


class SenderScatter(Plain):
    """Aggregates messages onto senders as well as receivers (a symmetric update)."""

    def forward(self, **inputs):
        h = jax.nn.one_hot(inputs["species"], 4, dtype=inputs["vectors"].dtype)
        r = jnp.sqrt(jnp.sum(inputs["vectors"] ** 2, -1) + 1.0)
        w = jnp.where(inputs["edge_mask"], jnp.exp(-r), 0.0)[:, None]
        n = h.shape[0]
        msg = h[inputs["senders"]] * h[inputs["receivers"]] * w
        both = jax.ops.segment_sum(msg, inputs["receivers"], n) + jax.ops.segment_sum(msg, inputs["senders"], n)
        peak = jax.ops.segment_max(w[:, 0], inputs["senders"], n)
        atomic = jnp.sum(jnp.tanh(both), -1) + jnp.where(jnp.isfinite(peak), peak, 0.0) ** 2
        return {"energy": jax.ops.segment_sum(atomic, inputs["batch_idx"], inputs["n_systems"])}


def test_scatter_onto_senders_is_summed_across_ranks():
    want = jaxdd.compute(SenderScatter("mpnn_segment_sum"), SYSTEM, outputs=("energy", "forces"))
    dm = gp_model(SenderScatter("mpnn_segment_sum"), 4)
    assert_same(dm(SYSTEM, outputs=("energy", "forces")), want)
    assert dm.dispatch_report.counts["scatter_add.all_nodes"] == 1
    assert dm.dispatch_report.counts["scatter_max.all_nodes"] == 1


@pytest.mark.slow
def test_neighbour_list_overflow_grows_and_recompiles():
    dm = gp_model(Plain("mpnn_segment_sum"), 4)
    dm(SYSTEM, outputs=("energy",))
    squeezed = jaxdd.AtomicData(positions=np.asarray(SYSTEM.positions) * 0.8, atomic_numbers=SYSTEM.atomic_numbers,
                                cell=np.asarray(SYSTEM.cell) * 0.8, pbc=SYSTEM.pbc)
    got = dm(squeezed, outputs=("energy", "forces"))
    assert dm.health.recompiles >= 1
    assert_same(got, jaxdd.compute(Plain("mpnn_segment_sum"), squeezed, outputs=("energy", "forces")))


# ----------------------------------------------------------------------------- zoo models


def gp_zoo(name, sys_name, n_ranks):
    dm = DistributedModel(model(name), DomainConfig(ZOO_CUTOFF, mesh=mesh_of(n_ranks), strategy=GP))
    return as_numpy(dm(system(sys_name), outputs=("energy", "forces", "stress")))


@pytest.mark.slow
def test_behler_parrinello_matrix_list_equals_single_device():
    # BP reads a MATRIX list and tells padding slots by ``senders < n_atoms``.
    assert_distributed_matches(gp_zoo("bp", "molecules", 4), zoo_reference("bp", "molecules"))


@pytest.mark.slow
@pytest.mark.parametrize("sys_name", ["bulk-large", "molecules"])
@pytest.mark.parametrize("name", ["bp", "schnet", "nequip"])
def test_zoo_model_equals_single_device_on_8_ranks(name, sys_name):
    assert_distributed_matches(gp_zoo(name, sys_name, 8), zoo_reference(name, sys_name))


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in MODELS if n != "mpnn_mol_sum"])
def test_every_plain_model_equals_single_device(name):
    assert_same(gp_model(Plain(name), 8)(SYSTEM, outputs=("energy", "forces")), reference(name))


# ----------------------------------------------------------------------------- validator


@pytest.mark.slow
def test_validator_passes_the_graph_parallel_spec():
    report = trace_and_validate(lambda: model("schnet"), system("molecules"), world_size=4, spec=SPEC_MPNN_GP)
    assert report.ok, report.summary()
    assert report.attempts[0].handler_counts.get("gather.all_nodes", 0) > 0
    assert report.attempts[0].halo_completeness.matches


# ----------------------------------------------------------------------------- kernels


def kernel_case(name):
    from test_ffi_models import gt_crystal, lj_alloy, lj_models, make_gt

    from jaxdd.models.graph_transformer import SPEC_GRAPH_TRANSFORMER_HALO
    from jaxdd.models.lj_kernel import SPEC_LJ_KERNEL_HALO

    if name == "graph_transformer":
        return make_gt(), gt_crystal(3), SPEC_GRAPH_TRANSFORMER_HALO, 4.0
    return lj_models()[0], lj_alloy(3), SPEC_LJ_KERNEL_HALO, 2.5


@pytest.mark.slow
@pytest.mark.skipif(not ffi.available(), reason="compiled kernels not built (pip install -e .)")
@pytest.mark.parametrize("name", ["graph_transformer", "lj_kernel"])
def test_fused_kernel_with_its_adapter_sees_every_ranks_rows(name):
    model, data, spec, cutoff = kernel_case(name)
    want = jaxdd.compute(model, data, ("energy", "forces"))
    dm = DistributedModel(model, DomainConfig(cutoff, mesh=mesh_for((4, 1, 1)), strategy=GP), spec=spec)
    assert_same(dm(data, outputs=("energy", "forces")), want)
    assert any(k.startswith("custom_op.") for k in dm.dispatch_report.counts)
