"""Specification of the validator: it proves a distributed model right, fixes wrong specs, explains failures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.spec import SPEC_MPNN_HALO, OutputKind
from jaxdd.validate import ModelFactoryError, diagnose, diff, halo_completeness, trace_and_validate
from test_dispatch import CUTOFF, SYSTEM, Plain, mesh_for, random_system

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def make_mpnn():
    return Plain("mpnn_segment_sum")


def make_mol_sum():
    return Plain("mpnn_mol_sum")


class WithCharges(Plain):
    """A small MPNN that also reports per-system totals: one complete, one a per-rank partial."""

    def __init__(self):
        super().__init__("sum_readout")
        self.model_config = jaxdd.ModelConfig(
            outputs={"energy", "forces", "total_z", "partial_z"}, autograd_outputs={"forces"},
            autograd_inputs={"positions"}, neighbor_config=jaxdd.NeighborConfig(cutoff=CUTOFF))

    def forward(self, **inputs):
        out = super().forward(**inputs)
        z = inputs["species"].astype(inputs["vectors"].dtype) * (inputs["batch_idx"] < inputs["n_systems"])
        out["total_z"] = jax.ops.segment_sum(z, inputs["batch_idx"], num_segments=inputs["n_systems"])
        out["partial_z"] = jaxdd.system_sum(z, inputs["batch_idx"], inputs["n_systems"], scope="local")
        return out


class OwnGraph(jaxdd.BaseModel):
    """Builds its own all-pairs graph from positions (an internal-graph backbone); open boundaries."""

    def __init__(self):
        self.model_config = jaxdd.ModelConfig(
            outputs={"energy", "forces"}, autograd_outputs={"forces"}, autograd_inputs={"positions"},
            neighbor_config=jaxdd.NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data):
        return dict(pos=data.positions, mask=data.atom_mask, batch_idx=data.batch_idx, n_systems=data.n_systems)

    def forward(self, pos, mask, batch_idx, n_systems):
        n = pos.shape[0]
        i = jnp.repeat(jnp.arange(n), n)
        j = jnp.tile(jnp.arange(n), n)
        d = pos[j] - pos[i]
        r2 = jnp.sum(d * d, axis=1)
        ok = (i != j) & mask[i] & mask[j] & (r2 < CUTOFF**2)
        env = jnp.where(ok, (1 - jnp.where(ok, r2, 0.0) / CUTOFF**2) ** 2, 0.0)
        h = jnp.ones((n,), pos.dtype)
        for _ in range(2):
            h = h + jax.ops.segment_sum(jnp.tanh(h[j]) * env, i, num_segments=n)
        atomic = jnp.where(mask, jnp.sin(h), 0.0)
        return {"energy": jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)}


CLUSTER = random_system(16.0, 70, seed=11, pbc=False)


@pytest.mark.slow
def test_correct_model_passes_without_fixes():
    report = trace_and_validate(make_mpnn, SYSTEM, world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied is None and len(report.attempts) == 1
    assert report.next_action.startswith("OK —")
    assert report.attempts[0].halo_completeness.matches
    assert report.attempts[0].handler_counts["scatter_add.owned_rows"] == 3
    assert report.reference_counts["scatter_add.owned_rows"] == 3


@pytest.mark.slow
def test_halo_correction_to_local_fixes_a_backbone_with_its_own_graph():
    report = trace_and_validate(OwnGraph, CLUSTER, world_size=2, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied == "halo_correction_to_local"
    assert report.spec.policy.scatter_mode == "local" and report.spec.policy.halo_layers == 2
    assert not report.attempts[0].passed


@pytest.mark.slow
def test_add_all_reduce_fixes_an_undeclared_per_rank_partial():
    spec = SPEC_MPNN_HALO.with_output_kinds(total_z=OutputKind.PER_GRAPH, partial_z=OutputKind.PER_GRAPH)

    class Model(WithCharges):
        @property
        def distribution_spec(self):
            return spec

    report = trace_and_validate(Model, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied == "add_all_reduce"
    assert report.spec.all_reduce_outputs == {"partial_z"}


@pytest.mark.slow
def test_drop_extra_all_reduce_fixes_a_world_size_blow_up():
    spec = SPEC_MPNN_HALO.with_output_kinds(total_z=OutputKind.PER_GRAPH, partial_z=OutputKind.PER_GRAPH)
    spec = spec.with_all_reduce("total_z", "partial_z")

    class Model(WithCharges):
        @property
        def distribution_spec(self):
            return spec

    report = trace_and_validate(Model, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied == "drop_extra_all_reduce"
    assert report.spec.all_reduce_outputs == {"partial_z"}


@pytest.mark.slow
def test_undeclared_per_system_helper_is_named():
    report = trace_and_validate(make_mol_sum, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    assert not report.ok
    (diag,) = report.attempts[0].helper_diagnostics
    assert diag.helper == "plain_helpers:mol_sum" and not diag.declared
    assert report.next_action.startswith("FAIL —") and "plain_helpers:mol_sum" in report.next_action


def test_broken_halo_is_incomplete_and_names_atoms():
    dist = DistributedModel(make_mpnn(), DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    dist.ghost_width = 0.5 * CUTOFF  # forced below the cutoff
    halo = halo_completeness(dist, SYSTEM)
    assert not halo.matches and halo.atoms and halo.missing
    assert "INCOMPLETE" in str(halo)


def test_intact_halo_is_complete_on_an_uneven_grid():
    dist = DistributedModel(make_mpnn(), DomainConfig(CUTOFF, mesh=mesh_for((3, 2, 1)), grid=(3, 2, 1)))
    halo = halo_completeness(dist, SYSTEM)
    assert halo.matches and halo.checked == SYSTEM.n_atoms


@pytest.mark.slow
def test_sharded_runs_move_to_a_child_process_when_devices_are_short():
    report = trace_and_validate("test_validate:make_mpnn", SYSTEM, world_size=2, devices="subprocess",
                                atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert "child process" in report.devices


def test_child_process_needs_an_importable_factory():
    with pytest.raises(ValueError, match="module:qualname"):
        trace_and_validate(lambda: make_mpnn(), SYSTEM, world_size=2, devices="subprocess")


def test_the_guides_device_spelling_runs_the_ranks_on_that_platforms_devices():
    report = trace_and_validate(make_mpnn, SYSTEM, world_size=2, device="cpu:0", atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.devices == "2 cpu device(s) in this process"


@pytest.mark.parametrize("device", ["cuda:0", "gpu"])
def test_the_guides_cuda_device_without_gpus_is_refused_showing_the_jaxdd_form(device):
    if jax.devices()[0].platform == "gpu":
        pytest.skip("this process has GPUs")
    with pytest.raises(ValueError, match=f"device='{device}' asks for world_size=2 ranks.*devices='subprocess'"):
        trace_and_validate(make_mpnn, SYSTEM, world_size=2, device=device)


def test_a_device_that_names_no_platform_is_refused_naming_the_jaxdd_form():
    with pytest.raises(ValueError, match="device must be like 'cuda:0'.*got 'cuda0'.*devices='auto'"):
        trace_and_validate(make_mpnn, SYSTEM, world_size=2, device="cuda0")


def test_a_factory_that_returns_no_model_is_refused_naming_it():
    with pytest.raises(ModelFactoryError, match="model factory .*returned 42 .*not a model wrapper"):
        trace_and_validate(lambda: 42, SYSTEM)


def test_unregistered_op_is_diagnosed():
    class Broken(Plain):
        def forward(self, **inputs):
            return {"energy": jaxdd.ops.get_op("nowhere::kernel")(inputs["vectors"])}

    report = trace_and_validate(lambda: Broken("mpnn_segment_sum"), SYSTEM, world_size=2)
    assert not report.ok and "not registered" in report.next_action


def test_metric_is_partition_invariant():
    ref = np.array([[1.0, 2.0], [3.0, 4.0]])
    assert diff(ref, ref[::-1]) == (0.0, 0.0)  # rows reordered: equal
    assert diff(ref, ref + 1e-3)[0] == pytest.approx(1e-3)
    assert diff(ref, np.full_like(ref, np.nan))[0] == float("inf")


def test_symptoms_have_diagnoses():
    assert "safe norms" in diagnose(nan=True)
    assert "gradient taken inside the model" in diagnose(internal_forces=True)
    assert "capacity_factor" in diagnose(RuntimeError("neighbour lists still overflowed after 8 capacity increases"))
