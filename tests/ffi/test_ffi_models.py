"""Models built on the FFI kernels: the kernel Lennard-Jones and the graph transformer.

On one device each equals its pure-jnp counterpart; under decomposition (8 virtual
devices, two rank grids) each equals one device: energy to 1e-10 relative, forces to
1e-9 absolute. The graph transformer's kernel is opaque to the dispatch: without its
OpAdapter the sharded result diverges (and the validator says so), with it it passes.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import ffi
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.models.graph_transformer import SPEC_GRAPH_TRANSFORMER_HALO, GraphTransformer
from jaxdd.models.lj import LennardJones
from jaxdd.models.lj_kernel import SPEC_LJ_KERNEL_HALO, LennardJonesKernel
from jaxdd.ops import ScatterOutputs
from jaxdd.spec import SPEC_MPNN_HALO, MLIPSpec
from jaxdd.data.systems import fcc_lattice
from jaxdd.validate import trace_and_validate

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled kernels not built (pip install -e .)")

OUTPUTS = ("energy", "forces", "stress")
GRIDS = [(2, 2, 2), (4, 2, 1)]
GT_SPECIES = (1, 6, 8)
GT_CUTOFF = 4.0


def lj_alloy(n_cells=4):
    """A rattled two-species LJ fcc crystal (a = 1.68 σ): 256 atoms at 4 cells, 1,372 at 7 (large
    enough that no rank of eight sees every atom)."""
    atoms = fcc_lattice(n_cells, 1.6796)
    atoms.numbers = np.random.default_rng(0).choice((18, 36), len(atoms))
    atoms.rattle(0.05, seed=1)
    return jaxdd.AtomicData.from_ase(atoms)


def lj_models():
    params = dict(sigma=[[1.0, 1.1], [1.1, 1.2]], epsilon=[[1.0, 0.8], [0.8, 0.6]], cutoff=2.5, shift=True,
                  species=(18, 36))
    return LennardJonesKernel(**params), LennardJones(**params)


def gt_crystal(n_cells=6):
    """Rattled fcc (a = 3 Å) of mixed H, C, O: 108 atoms at 3 cells, 864 at 6 (18 Å box, large
    enough that no rank of eight sees every atom)."""
    atoms = fcc_lattice(n_cells, 3.0)
    atoms.numbers = np.random.default_rng(0).choice(GT_SPECIES, len(atoms))
    atoms.rattle(0.1, seed=1)
    return jaxdd.AtomicData.from_ase(atoms)


def make_gt():
    """The validator's factory: the graph transformer on the compiled kernel."""
    return GraphTransformer(GT_SPECIES, GT_CUTOFF)


class GraphTransformerWithoutAdapter(GraphTransformer):
    """The same model, its spec missing the kernel's OpAdapter."""

    @property
    def distribution_spec(self):
        return SPEC_MPNN_HALO


def make_gt_without_adapter():
    return GraphTransformerWithoutAdapter(GT_SPECIES, GT_CUTOFF)


def mesh8():
    if len(jax.devices()) < 8:  # one GPU (bench/gpu_check.sh) is one device
        pytest.skip(f"needs 8 devices (the suite's virtual CPU devices); JAX has {len(jax.devices())}")
    return Mesh(np.asarray(jax.devices()[:8]), ("dd",), axis_types=(AxisType.Auto,))


def assert_same(got, ref, stress=True):
    d_energy = np.max(np.abs(np.asarray(got["energy"] - ref["energy"]))) / np.max(np.abs(np.asarray(ref["energy"])))
    assert d_energy <= 1e-10, d_energy
    assert np.max(np.abs(np.asarray(got["forces"] - ref["forces"]))) <= 1e-9
    if stress:
        assert np.max(np.abs(np.asarray(got["stress"] - ref["stress"]))) <= 1e-9


# ----------------------------------------------------------------------------- kernel LJ


def test_kernel_lj_declares_its_forces_and_stress_as_model_outputs():
    model, _ = lj_models()
    assert model.model_config.autograd_outputs == frozenset()
    assert {"forces", "stress"} <= model.model_config.outputs
    assert model.distribution_spec.kind_of("forces").value == "per_node"
    (adapter,) = model.distribution_spec.distribution.custom_ops
    assert adapter.op.name == "jaxdd_ffi::lj_pair"
    assert all(isinstance(t, ScatterOutputs) for t in adapter.output_transforms.values())


def test_kernel_lj_equals_the_jnp_lj_on_one_device():
    kernel, plain = lj_models()
    data = lj_alloy()
    outputs = ("energy", "atomic_energies", "forces", "stress")
    got, ref = jaxdd.compute(kernel, data, outputs=outputs), jaxdd.compute(plain, data, outputs=outputs)
    assert_same(got, ref)
    assert np.max(np.abs(np.asarray(got["atomic_energies"] - ref["atomic_energies"]))) <= 1e-10


def test_kernel_lj_spec_survives_a_json_round_trip():
    assert MLIPSpec.from_json(SPEC_LJ_KERNEL_HALO.to_json()) == SPEC_LJ_KERNEL_HALO


@pytest.mark.slow
def test_kernel_direct_forces_under_decomposition_equal_one_device():
    # forces and stress are model outputs here (not autograd): DistributedModel returns the
    # kernel's own, and its program never runs the backward kernel.
    kernel, plain = lj_models()
    data = lj_alloy(7)
    dm = DistributedModel(kernel, DomainConfig(2.5, mesh=mesh8(), grid=(2, 2, 2)))
    got = dm(data, outputs=("energy", "forces", "stress"))
    assert_same(got, jaxdd.compute(plain, data, outputs=("energy", "forces", "stress")))
    hlo = dm.lower(data, ("energy", "forces", "stress")).compile().as_text()
    assert "lj_forward" in hlo and "lj_backward" not in hlo


@pytest.mark.slow
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_kernel_lj_under_decomposition_equals_one_device(grid):
    kernel, _ = lj_models()
    data = lj_alloy(7)
    dm = DistributedModel(kernel, DomainConfig(2.5, mesh=mesh8(), grid=grid))
    assert_same(dm(data, outputs=OUTPUTS), jaxdd.compute(kernel, data, outputs=OUTPUTS))
    assert dm.dispatch_report.counts["custom_op.jaxdd_ffi::lj_pair"] == 1


# ---------------------------------------------------------------------- graph transformer


def test_graph_transformer_kernel_equals_its_jnp_backend_on_one_device():
    data = gt_crystal(3)
    got = jaxdd.compute(make_gt(), data, outputs=OUTPUTS)
    ref = jaxdd.compute(GraphTransformer(GT_SPECIES, GT_CUTOFF, backend="jnp"), data, outputs=OUTPUTS)
    assert_same(got, ref)


def test_graph_transformer_spec_declares_scatter_outputs_on_the_kernel():
    (adapter,) = SPEC_GRAPH_TRANSFORMER_HALO.distribution.custom_ops
    assert adapter.op.name == "jaxdd_ffi::attention_message"
    assert dict(adapter.output_transforms) == {0: ScatterOutputs()}
    assert GraphTransformer(GT_SPECIES, backend="jnp").distribution_spec == SPEC_MPNN_HALO


def test_graph_transformer_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match=r"backend must be one of \['ffi', 'jnp'\]"):
        GraphTransformer(GT_SPECIES, backend="warp")


@pytest.mark.slow
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_graph_transformer_under_decomposition_equals_one_device(grid):
    data = gt_crystal()
    dm = DistributedModel(make_gt(), DomainConfig(GT_CUTOFF, mesh=mesh8(), grid=grid))
    assert_same(dm(data, outputs=OUTPUTS), jaxdd.compute(make_gt(), data, outputs=OUTPUTS))
    assert dm.dispatch_report.counts["custom_op.jaxdd_ffi::attention_message"] == 2


@pytest.mark.slow
def test_graph_transformer_without_its_adapter_diverges_under_decomposition():
    data = gt_crystal()
    dm = DistributedModel(make_gt(), DomainConfig(GT_CUTOFF, mesh=mesh8(), grid=(2, 2, 2)), spec=SPEC_MPNN_HALO)
    got, ref = dm(data, outputs=("energy",)), jaxdd.compute(make_gt(), data, outputs=("energy",))
    assert abs(float(got["energy"][0] - ref["energy"][0])) > 1e-3 * abs(float(ref["energy"][0]))


@pytest.mark.slow
def test_validator_fails_the_transformer_without_its_adapter_and_passes_it_with():
    data = gt_crystal()
    without = trace_and_validate(make_gt_without_adapter, data, world_size=8, atol=1e-9, rtol=1e-10,
                                 auto_fix=False)
    assert not without.ok
    assert without.attempts[0].diffs["energy"].rel > 1e-3
    with_adapter = trace_and_validate(make_gt, data, world_size=8, atol=1e-9, rtol=1e-10, auto_fix=False)
    assert with_adapter.ok, with_adapter.summary()
