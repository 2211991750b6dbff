"""Specification of the dispatch: unchanged single-device models run distributed.

The models live in ``plain_models.py`` and import nothing from jaxdd; the wrapper below
only hands them edge vectors and indices. Every distributed result is compared in float64
with ``jaxdd.compute`` of the same wrapper on one device: energy to 1e-10 relative, forces
to 1e-9 absolute, on grids (2,2,2) and (3,2,1), with a one-cutoff halo and
``halo_correction``, and with ``local`` scatters over a ghost shell (layers × cutoff) deep.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
import plain_helpers
import plain_models
from jaxdd import BaseModel, ModelConfig, NeighborConfig
from jaxdd.spec.adapters import AdapterRegistry, MethodAdapter, PythonAdapter
from jaxdd.dispatch import DispatchError, DispatchWarning, Dispatcher, DispatchReport, Kind, Layout, REPLICATED, TOTAL
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.neighbors import edge_vectors
from jaxdd.ops import HaloRefreshPolicy, HaloStoragePolicy
from jaxdd.spec import SPEC_MPNN_HALO, MLIPSpec

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = plain_models.CUTOFF
MODELS = plain_models.MODELS
DEFAULT_MODELS = ["mpnn_segment_sum", "mpnn_jraph", "e3nn_equivariant", "flax_scan", "custom_vjp_mpnn", "sum_readout"]


class Plain(eqx.Module, BaseModel):
    """Wraps a plain model ``fn(params, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems)``."""

    params: Any
    fn: Callable = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, name: str, seed: int = 0):
        init, fn, _ = MODELS[name]
        self.params = jax.jit(init)(jax.random.PRNGKey(seed))  # one program, not one per operation
        self.fn = fn
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}),
            neighbor_config=NeighborConfig(cutoff=CUTOFF),
        )

    def adapt_input(self, batch):
        nl = batch.neighbors
        return dict(
            vectors=edge_vectors(batch.positions, batch.cell, batch.batch_idx, nl),
            senders=nl.senders, receivers=nl.receivers, edge_mask=nl.mask,
            species=jnp.clip(batch.atomic_numbers - 1, 0, 3), batch_idx=batch.batch_idx,
            n_systems=batch.n_systems,
        )

    def forward(self, **inputs):
        return {"energy": self.fn(self.params, **inputs)}


def random_system(box, n_atoms, seed, pbc=True, min_dist=1.2):
    """Random atoms of species 1..4 in a cubic box, no pair closer than ``min_dist``."""
    rng = np.random.default_rng(seed)
    pos = []
    while len(pos) < n_atoms:
        p = rng.uniform(0, box, 3)
        if pos:
            d = np.asarray(pos) - p
            if pbc:
                d -= box * np.round(d / box)
            if np.min(np.linalg.norm(d, axis=1)) < min_dist:
                continue
        pos.append(p)
    return jaxdd.AtomicData(positions=np.asarray(pos), atomic_numbers=rng.integers(1, 5, n_atoms),
                            cell=np.eye(3) * box, pbc=np.array([pbc] * 3))


SYSTEM = random_system(14.0, 60, seed=3)


def mesh_for(grid):
    n = int(np.prod(grid))
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


def spec_for(mode, layers):
    if mode == "halo_correction":
        return SPEC_MPNN_HALO
    return SPEC_MPNN_HALO.with_policy(HaloStoragePolicy(scatter_mode="local", gather_mode="local", halo_layers=layers))


_REFERENCE = {}


def reference(name, data=SYSTEM):
    key = (name, id(data))
    if key not in _REFERENCE:
        _REFERENCE[key] = jaxdd.compute(Plain(name), data, outputs=("energy", "forces"))
    return _REFERENCE[key]


def distributed(name, grid, mode="halo_correction", data=SYSTEM, spec=None):
    model = Plain(name)
    spec = spec or spec_for(mode, MODELS[name][2])
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for(grid), grid=grid), spec=spec)
    return dm, dm(data, outputs=("energy", "forces"))


@functools.lru_cache(maxsize=None)
def halo_run(name, grid):
    """``distributed(name, grid)`` with the default spec, built once: the tests that read its
    dispatch report share the compiled model."""
    return distributed(name, grid)


def assert_same(got, ref):
    e_ref = np.asarray(ref["energy"])
    assert np.max(np.abs(np.asarray(got["energy"]) - e_ref) / np.abs(e_ref)) <= 1e-10
    assert np.max(np.abs(np.asarray(got["forces"]) - np.asarray(ref["forces"]))) <= 1e-9


# ----------------------------------------------------------------------------- the six models


def scatters_in_program(name):
    """Message scatters as they appear in the traced program (a scan body holds one for all layers)."""
    return 1 if name == "flax_scan" else MODELS[name][2]


def _halo_cases():
    """Every default model on the uneven grid (3, 2, 1); on (2, 2, 2), where every axis is
    split, in the slow set (the default suite splits every axis for mpnn_segment_sum in the
    refresh, stress and deep-halo tests below)."""
    for name in DEFAULT_MODELS:
        yield pytest.param(name, (3, 2, 1), id=f"{name}-3x2x1")
        yield pytest.param(name, (2, 2, 2), id=f"{name}-2x2x2", marks=pytest.mark.slow)


@pytest.mark.parametrize("name, grid", list(_halo_cases()))
def test_unchanged_model_with_halo_correction_equals_single_device(name, grid):
    dm, got = halo_run(name, grid)
    assert_same(got, reference(name))
    # Every message sum is onto the list's receivers (owned atoms): owners' sums copied to ghosts.
    assert dm.dispatch_report.counts["scatter_add.owned_rows"] == scatters_in_program(name)
    assert not dm.dispatch_report.fallbacks


@pytest.mark.parametrize("name", ["mpnn_segment_sum", pytest.param("sum_readout", marks=pytest.mark.slow)])
def test_unchanged_model_with_local_scatters_and_deep_halo_equals_single_device(name):
    dm, got = distributed(name, (2, 2, 2), mode="local")
    assert_same(got, reference(name))
    assert dm.ghost_width == pytest.approx(MODELS[name][2] * CUTOFF)
    assert dm.dispatch_report.counts["scatter_add.local"] == scatters_in_program(name)
    assert "scatter_add.halo_correction" not in dm.dispatch_report.counts


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 2), (3, 2, 1)], ids=["2x2x2", "3x2x1"])
@pytest.mark.parametrize("name", DEFAULT_MODELS)
def test_every_model_with_local_scatters_and_deep_halo_equals_single_device(name, grid):
    _, got = distributed(name, grid, mode="local")
    assert_same(got, reference(name))


def test_refresh_only_policy_equals_single_device():
    dm, got = distributed("mpnn_segment_sum", (2, 2, 2), spec=SPEC_MPNN_HALO.with_policy(HaloRefreshPolicy()))
    assert_same(got, reference("mpnn_segment_sum"))
    assert dm.dispatch_report.counts["scatter_add.refresh"] == 3


@pytest.mark.slow  # batches under decomposition stay in the default suite through test_distributed's "batch" case
def test_batch_of_two_systems_equals_single_device():
    batch = jaxdd.Batch.from_data_list([SYSTEM, random_system(12.0, 40, seed=8)])
    _, got = distributed("mpnn_segment_sum", (2, 2, 2), data=batch)
    assert_same(got, reference("mpnn_segment_sum", batch))


def test_stress_equals_single_device():
    model = Plain("mpnn_segment_sum")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    got = dm(SYSTEM, outputs=("energy", "stress"))
    ref = jaxdd.compute(model, SYSTEM, outputs=("energy", "stress"))
    assert np.max(np.abs(np.asarray(got["stress"]) - np.asarray(ref["stress"]))) <= 1e-9


def test_readout_reduction_is_masked_and_summed_across_ranks():
    dm, _ = halo_run("sum_readout", (3, 2, 1))
    assert dm.dispatch_report.counts["reduce.sum"] == 1


def test_scan_over_layers_is_entered_once():
    dm, _ = halo_run("flax_scan", (3, 2, 1))
    assert dm.dispatch_report.counts["enter.scan"] == 1


def test_custom_vjp_without_halo_rules_inside_keeps_its_derivative_rule():
    dm, _ = halo_run("custom_vjp_mpnn", (3, 2, 1))
    assert not any(k.startswith("enter.custom") for k in dm.dispatch_report.counts)


# ----------------------------------------------------------------------------- helpers and adapters


def test_an_undeclared_per_system_helper_is_refused_naming_its_line():
    with pytest.raises(DispatchError, match=r"could not follow(.|\n)*cumsum(.|\n)*plain_helpers.py:\d+"):
        distributed("mpnn_mol_sum", (2, 2, 2))


def test_allowed_unfollowed_values_run_and_warn_and_the_answer_is_wrong():
    # What allow_unfollowed=True is for: a value the user checked; this one is wrong indeed.
    grid = (2, 2, 2)
    dm = DistributedModel(Plain("mpnn_mol_sum"), DomainConfig(CUTOFF, mesh=mesh_for(grid), grid=grid,
                                                              allow_unfollowed=True),
                          spec=spec_for("halo_correction", MODELS["mpnn_mol_sum"][2]))
    with pytest.warns(DispatchWarning, match="allow_unfollowed=True(.|\n)*cumsum"):
        got = dm(SYSTEM, outputs=("energy", "forces"))
    ref = reference("mpnn_mol_sum")
    assert abs(float(got["energy"][0] - ref["energy"][0])) > 1e-3 * abs(float(ref["energy"][0]))
    assert any("cumsum" in m for m in dm.dispatch_report.fallbacks)


def dd_mol_sum(values, batch_idx, n_systems):
    """Distribution-aware replacement of plain_helpers.mol_sum."""
    return jaxdd.system_sum(values, batch_idx, n_systems)


def test_python_adapter_replaces_the_helper_while_traced():
    spec = SPEC_MPNN_HALO.with_helpers(PythonAdapter("plain_helpers", "mol_sum", replacement=dd_mol_sum))
    original = plain_helpers.mol_sum
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)
        dm, got = distributed("mpnn_mol_sum", (2, 2, 2), spec=spec)
    assert_same(got, reference("mpnn_mol_sum"))
    assert dm.dispatch_report.counts["verb.system_sum"] == 1
    assert plain_helpers.mol_sum is original  # restored after tracing


def test_distributed_setup_receives_the_context_and_can_install_adapters():
    seen = []

    class Hooked(Plain):
        def distributed_setup(self, ctx):
            seen.append(ctx)
            ctx.adapters.install(PythonAdapter("plain_helpers", "mol_sum", replacement=dd_mol_sum))

    model = Hooked("mpnn_mol_sum")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    got = dm(SYSTEM, outputs=("energy", "forces"))
    assert_same(got, reference("mpnn_mol_sum"))
    (ctx,) = seen
    assert ctx.active and ctx.world_size == 8 and ctx.n_owned > 0 and ctx.n_padded > ctx.n_owned
    assert ctx.adapters.list_active() == ()  # everything restored when tracing ended


def test_adapter_install_is_all_or_nothing():
    registry = AdapterRegistry()
    original = plain_helpers.mol_sum
    good = PythonAdapter("plain_helpers", "mol_sum", replacement=dd_mol_sum)
    bad = MethodAdapter("plain_helpers", "NoSuchClass", "method", replacement=dd_mol_sum)
    with pytest.raises(jaxdd.SpecError, match="NoSuchClass"):
        registry.install(good, bad)
    assert plain_helpers.mol_sum is original
    assert registry.list_active() == ()


def test_adapters_restore_in_reverse_order():
    registry = AdapterRegistry()
    original = plain_helpers.mol_sum
    first = PythonAdapter("plain_helpers", "mol_sum", replacement=dd_mol_sum)
    second = PythonAdapter("plain_helpers", "mol_sum", replacement=plain_models.cosine_cutoff)
    registry.install(first, second)
    assert registry.list_active() == (first, second)
    assert plain_helpers.mol_sum is plain_models.cosine_cutoff
    registry.restore()
    assert plain_helpers.mol_sum is original


# ----------------------------------------------------------------------------- provenance


def test_equal_edge_and_node_counts_classify_by_provenance():
    n = 6

    def fn(h, senders, receivers, batch_idx):
        msg = h[senders] * 2.0
        agg = jax.ops.segment_sum(msg, receivers, num_segments=n)
        per_edge = jnp.sum(msg)
        per_system = jax.ops.segment_sum(agg, batch_idx, num_segments=1)
        return agg, per_edge, per_system

    idx = jax.ShapeDtypeStruct((n,), jnp.int32)
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((n, 3), jnp.float64), idx, idx, idx)
    layouts = [Layout(Kind.NODE), Layout(Kind.EDGE, 0, Kind.NODE), Layout(Kind.EDGE, 0, Kind.NODE),
               Layout(Kind.NODE, 0, Kind.GRAPH)]
    d = Dispatcher(None, DispatchReport(), (n, n, 1))
    agg, per_edge, per_system = d.out_layouts(closed, layouts)
    assert agg.kind is Kind.NODE
    assert per_edge == Layout(total=TOTAL)  # the same on every rank: a total over every rank's edges
    assert per_system.kind is Kind.GRAPH
    assert not d.report.fallbacks


@pytest.mark.slow
def test_distributed_model_with_equal_edge_and_node_capacities_equals_single_device():
    data = random_system(14.0, 40, seed=5, min_dist=2.2)
    dm = DistributedModel(Plain("mpnn_segment_sum"), DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    batch = jaxdd.data.as_batch(data)
    _, plan = dm.plan(batch)
    cap = dm.size_neighbors(*dm.rank_inputs(batch, *dm.plan(batch)))
    n_local = plan.layout.n_local
    assert cap.max_edges <= n_local, "precondition: the needed edges fit in n_local slots"
    import dataclasses

    dm.sizing.use(dataclasses.replace(dm.capacities, neighbors=dataclasses.replace(cap, max_edges=n_local)))
    got = dm(data, outputs=("energy", "forces"))
    assert dm.capacities.neighbors.max_edges == n_local  # no growth happened: the counts were equal
    assert_same(got, reference("mpnn_segment_sum", data))


def test_shape_fallback_is_recorded():
    n = 5

    def fn(h):
        flat = h.reshape(-1) * 2.0  # merging the atom axis loses its layout
        return jnp.sum(flat.reshape(n, 3)[:, 0])

    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((n, 3), jnp.float64))
    d = Dispatcher(None, DispatchReport(), (n, 7, 1))
    d.out_layouts(closed, [Layout(Kind.NODE)])
    plan = d.analyse(closed.jaxpr, (Layout(Kind.NODE),))
    assert any("shape fallback" in note for note in plan.notes)


def test_parameters_as_long_as_the_atom_axis_are_not_taken_for_atoms():
    n = 5

    def fn(h, w):
        return jnp.sum(h @ (w @ jnp.ones((n,))))  # w: [3, n] weights contracted over their n columns

    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((n, 3), jnp.float64), jax.ShapeDtypeStruct((3, n), jnp.float64))
    d = Dispatcher(None, DispatchReport(), (n, 7, 1))
    plan = d.analyse(closed.jaxpr, (Layout(Kind.NODE), REPLICATED))
    assert not any("shape fallback" in note for note in plan.notes)
    assert sum(dd.rule == "reduce.sum" for dd in plan.decisions) == 1  # the sum over atoms only


def test_cond_on_a_per_atom_value_around_halo_rules_is_refused():
    class Branchy(Plain):
        def forward(self, **inputs):
            h = inputs["vectors"][:, 0]
            agg = jax.ops.segment_sum(h, inputs["receivers"], num_segments=inputs["species"].shape[0])
            flag = agg[0] > 0  # one atom's value: differs between ranks
            out = jax.lax.cond(flag, lambda a: jax.ops.segment_sum(a, inputs["receivers"], a.shape[0]),
                               lambda a: a, h)
            return {"energy": jax.ops.segment_sum(out, jnp.zeros_like(inputs["receivers"]), 1)}

    dm = DistributedModel(Branchy("mpnn_segment_sum"), DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    with pytest.raises(DispatchError, match="differs between ranks"):
        dm(SYSTEM, outputs=("energy",))


# ----------------------------------------------------------------------------- verbs and context


def test_intent_verbs_are_the_single_device_meaning_outside_a_dd_scope():
    x = jnp.arange(6.0).reshape(3, 2)
    idx = jnp.array([0, 1, 1])
    np.testing.assert_array_equal(jaxdd.system_sum(x, idx, 2), jax.ops.segment_sum(x, idx, 2))
    np.testing.assert_array_equal(jaxdd.system_sum(x, idx, 2, scope="local"), jax.ops.segment_sum(x, idx, 2))
    for verb in (jaxdd.to_local, jaxdd.refresh_neighbors, jaxdd.scatter_to_owners, jaxdd.autograd_target):
        np.testing.assert_array_equal(verb(x), x)


def test_current_dd_context_is_inert_outside_a_dd_scope():
    ctx = jaxdd.current_dd_context()
    assert not ctx.active and ctx.world_size == 1 and ctx.rank == 0 and ctx.adapters is None


def test_verbs_under_decomposition_equal_single_device():
    class Explicit(Plain):
        def forward(self, **inputs):
            n = inputs["species"].shape[0]
            r = jnp.linalg.norm(jnp.where(inputs["edge_mask"][:, None], inputs["vectors"], 1.0), axis=1)
            w = jnp.where(inputs["edge_mask"], jnp.exp(-r), 0.0)
            # Scatter onto senders (possibly ghosts) by hand: to_local keeps the dispatch out,
            # scatter_to_owners sends the ghost partials home.
            partial = jax.ops.segment_sum(w, jaxdd.to_local(inputs["senders"]), num_segments=n)
            h = jnp.tanh(jaxdd.scatter_to_owners(partial))
            m = jax.ops.segment_sum(jaxdd.refresh_neighbors(h)[inputs["senders"]] * w, inputs["receivers"],
                                    num_segments=n)
            return {"energy": jaxdd.system_sum(jnp.sin(m), inputs["batch_idx"], inputs["n_systems"])}

    model = Explicit("mpnn_segment_sum")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    got = dm(SYSTEM, outputs=("energy", "forces"))
    assert_same(got, jaxdd.compute(model, SYSTEM, outputs=("energy", "forces")))
    counts = dm.dispatch_report.counts
    assert counts["verb.scatter_to_owners"] == 1 and counts["verb.refresh_neighbors"] == 1
    assert counts["verb.system_sum"] == 1 and counts["verb.to_local"] == 1
    assert counts["scatter_add.owned_rows"] == 1  # only the receiver scatter the dispatch saw


def test_halo_layers_round_trips_through_json():
    spec = spec_for("local", 3)
    again = MLIPSpec.from_json(spec.to_json())
    assert again == spec and again.policy.halo_layers == 3
    assert "halo_layers" not in SPEC_MPNN_HALO.to_json()


@pytest.mark.parametrize("layers", [0, 1.5, True])
def test_halo_layers_must_be_a_positive_int(layers):
    with pytest.raises(jaxdd.SpecError, match=f"halo_layers must be an integer >= 1, got {layers}"):
        HaloStoragePolicy(halo_layers=layers)


def test_halo_layers_given_as_a_whole_float_are_stored_as_an_int():
    assert type(HaloStoragePolicy(halo_layers=2.0).halo_layers) is int


# ----------------------------------------------------------------------------- control flow and named ops


class ControlFlow(Plain):
    """Layers in a fori_loop, a remat'd message function and a cond on a replicated flag, all
    around halo-correcting scatters. With a traced trip count the loop is a while loop
    (energy only: JAX cannot reverse-differentiate it); with a static one, a scan."""

    traced_bound: bool = eqx.field(static=True, default=False)

    def __init__(self, name, traced_bound=False):
        super().__init__(name)
        self.traced_bound = traced_bound

    def forward(self, **inputs):
        n = inputs["species"].shape[0]
        v, mask, s, r = inputs["vectors"], inputs["edge_mask"], inputs["senders"], inputs["receivers"]
        r2 = jnp.where(mask, jnp.sum(v * v, axis=1), 1.0)
        env = jnp.where(mask, jnp.exp(-r2 / 4.0), 0.0)
        h0 = jnp.ones((n, 4)) * jnp.asarray([0.3, 0.5, 0.7, 0.9], v.dtype)  # a carry started from constants

        @jax.checkpoint
        def layer(h):
            return h + 0.2 * jax.ops.segment_sum(jnp.tanh(h[s]) * env[:, None], r, num_segments=n)

        n_layers = jnp.asarray(2) + (inputs["n_systems"] - 1) if self.traced_bound else 2
        h = jax.lax.fori_loop(0, n_layers, lambda i, h: layer(h), h0)
        flag = jnp.sum(jnp.asarray([0.3, 0.5])) > 0  # replicated: the same on every rank
        h = jax.lax.cond(flag, layer, lambda h: h, h)
        atomic = jnp.sum(jnp.sin(h), axis=1)
        return {"energy": jax.ops.segment_sum(atomic, inputs["batch_idx"], num_segments=inputs["n_systems"])}


def test_loop_remat_and_cond_around_scatters_equal_single_device():
    model = ControlFlow("mpnn_segment_sum")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((3, 2, 1)), grid=(3, 2, 1)))
    got = dm(SYSTEM, outputs=("energy", "forces"))
    assert_same(got, jaxdd.compute(model, SYSTEM, outputs=("energy", "forces")))
    counts = dm.dispatch_report.counts
    assert counts["enter.scan"] == 1 and counts["enter.cond"] == 1 and counts["enter.remat"] >= 2


def test_while_loop_around_scatters_equals_single_device():
    model = ControlFlow("mpnn_segment_sum", traced_bound=True)
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))))
    got = dm(SYSTEM, outputs=("energy",))
    ref = jaxdd.compute(model, SYSTEM, outputs=("energy",))
    assert abs(float(got["energy"][0] - ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    assert dm.dispatch_report.counts["enter.while"] == 1


@jaxdd.register_op("dispatchtest::aggregate")
def _aggregate(h, senders, receivers, env):
    """An opaque kernel: messages summed onto receivers (a fused kernel in real life)."""
    return jax.ops.segment_sum(jnp.tanh(h[senders]) * env[:, None], receivers, num_segments=h.shape[0])


@jaxdd.register_op("dispatchtest::owned_square")
def _owned_square(x):
    return x * x


@jaxdd.register_op("dispatchtest::identity")
def _identity(x):
    return x


@jaxdd.register_op("dispatchtest::system_partial")
def _system_partial(x, batch_idx):
    return jax.ops.segment_sum(x, batch_idx, num_segments=1)


class OpaqueKernels(Plain):
    def forward(self, **inputs):
        n = inputs["species"].shape[0]
        v, mask = inputs["vectors"], inputs["edge_mask"]
        env = jnp.where(mask, jnp.exp(-jnp.where(mask, jnp.sum(v * v, axis=1), 1.0) / 4.0), 0.0)
        h = jnp.ones((n, 4)) * jnp.asarray([0.3, 0.5, 0.7, 0.9], v.dtype)
        ops = jaxdd.ops.get_op
        for _ in range(2):
            h = h + ops("dispatchtest::aggregate")(h, inputs["senders"], inputs["receivers"], env)
        sq = ops("dispatchtest::identity")(ops("dispatchtest::owned_square")(h))  # owned rows, then halo again
        atomic = jnp.sum(jnp.sin(sq), axis=1) * (inputs["batch_idx"] < inputs["n_systems"])
        return {"energy": ops("dispatchtest::system_partial")(atomic, inputs["batch_idx"])}


def opaque_spec():
    from jaxdd.ops import AllReduceSum, GatherInputs, ScatterOutputs, SliceOwned
    from jaxdd.spec import OpAdapter

    return SPEC_MPNN_HALO.with_custom_ops(
        OpAdapter("dispatchtest::aggregate", output_transforms={0: ScatterOutputs()}),
        OpAdapter("dispatchtest::owned_square", arg_transforms={0: SliceOwned()}),
        OpAdapter("dispatchtest::identity", arg_transforms={0: GatherInputs()}),
        OpAdapter("dispatchtest::system_partial", arg_transforms={0: SliceOwned(), 1: SliceOwned()},
                  output_transforms={0: AllReduceSum()}),
    )


def test_registered_ops_get_their_adapters_transforms():
    model = OpaqueKernels("mpnn_segment_sum")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))), spec=opaque_spec())
    got = dm(SYSTEM, outputs=("energy", "forces"))
    assert_same(got, jaxdd.compute(model, SYSTEM, outputs=("energy", "forces")))
    counts = dm.dispatch_report.counts
    assert counts["custom_op.dispatchtest::aggregate"] == 2
    assert counts["custom_op.dispatchtest::system_partial"] == 1
    assert "scatter_add.halo_correction" not in counts  # the kernels are opaque: only their adapters act


def test_registered_op_without_its_output_transform_is_wrong():
    from jaxdd.ops import AllReduceSum, GatherInputs, SliceOwned
    from jaxdd.spec import OpAdapter

    spec = SPEC_MPNN_HALO.with_custom_ops(
        OpAdapter("dispatchtest::aggregate"),  # ScatterOutputs forgotten
        OpAdapter("dispatchtest::owned_square", arg_transforms={0: SliceOwned()}),
        OpAdapter("dispatchtest::identity", arg_transforms={0: GatherInputs()}),
        OpAdapter("dispatchtest::system_partial", arg_transforms={0: SliceOwned(), 1: SliceOwned()},
                  output_transforms={0: AllReduceSum()}),
    )
    model = OpaqueKernels("mpnn_segment_sum")
    got = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 2))), spec=spec)(SYSTEM, outputs=("energy",))
    ref = jaxdd.compute(model, SYSTEM, outputs=("energy",))
    assert abs(float(got["energy"][0] - ref["energy"][0])) > 1e-6 * abs(float(ref["energy"][0]))


# ----------------------------------------------------------------------------- adapter kinds


def _tripled(self_or_x, x=None):
    return 3.0 * (self_or_x if x is None else x)


def test_method_adapter_swaps_and_restores_an_inherited_method():
    registry = AdapterRegistry()
    registry.install(MethodAdapter("plain_helpers", "DerivedReadout", "scale", replacement=_tripled))
    assert plain_helpers.DerivedReadout().scale(1.0) == 3.0
    assert plain_helpers.Readout().scale(1.0) == 2.0  # only the named class changes
    registry.restore()
    assert "scale" not in plain_helpers.DerivedReadout.__dict__
    assert plain_helpers.DerivedReadout().scale(1.0) == 2.0


def test_module_forward_adapter_swaps_call():
    from jaxdd.spec.adapters import ModuleForwardAdapter

    registry = AdapterRegistry()
    with registry.installed([ModuleForwardAdapter("plain_helpers", "Readout", replacement=_tripled)]):
        assert plain_helpers.Readout()(1.0) == 3.0
    assert plain_helpers.Readout()(1.0) == 2.0


def test_jit_adapter_installs_a_jitted_replacement():
    from jaxdd.spec.adapters import JitAdapter

    original = plain_helpers.doubled
    registry = AdapterRegistry()
    with registry.installed([JitAdapter("plain_helpers", "doubled", replacement=_tripled)]):
        assert float(plain_helpers.doubled(jnp.asarray(1.0))) == 3.0
        assert hasattr(plain_helpers.doubled, "lower")  # a jax.jit function, like the original
    assert plain_helpers.doubled is original


@jaxdd.register_op("dispatchtest::double_full")
def _double_full(x):
    return 2.0 * x


def test_graph_parallel_transforms_gather_all_rows_and_slice_own_rows_back():
    from jax.sharding import PartitionSpec as P

    from jaxdd.dispatch import Runtime
    from jaxdd.ops import GatherInputsFull, SliceOutputsOwned
    from jaxdd.spec import OpAdapter

    adapter = OpAdapter("dispatchtest::double_full", arg_transforms={0: GatherInputsFull()},
                        output_transforms={0: SliceOutputsOwned()})
    n_ranks, n_own = 4, 3
    x = jnp.arange(n_ranks * n_own * 2, dtype=jnp.float64).reshape(n_ranks, n_own, 2)
    closed = jax.make_jaxpr(lambda a: jaxdd.ops.get_op("dispatchtest::double_full")(a))(x[0])

    def rank(xr):
        rt = Runtime(None, None, ("dd",), HaloStoragePolicy(), jnp.ones(n_own, bool), ops={str(adapter.op): adapter})
        d = Dispatcher(rt, DispatchReport(), (n_own, 0, 1))
        (y,) = d.run_closed(closed, [xr[0]], [Layout(Kind.NODE)])
        return y[None]

    y = jax.shard_map(rank, mesh=mesh_for((n_ranks, 1, 1)), in_specs=P("dd"), out_specs=P("dd"),
                      check_vma=False)(x)
    assert y.shape == (n_ranks, n_own + 1, 2)  # own rows, then the full array's padding row
    np.testing.assert_array_equal(y[:, :n_own], 2.0 * x)
    np.testing.assert_array_equal(y[:, n_own], 0.0)


class TwoColumnScatter(Plain):
    """Aggregates messages into [atoms, 2, F] by (receiver, sender parity): two index columns."""

    def forward(self, **inputs):
        n = inputs["species"].shape[0]
        v, mask, s, r = inputs["vectors"], inputs["edge_mask"], inputs["senders"], inputs["receivers"]
        env = jnp.where(mask, jnp.exp(-jnp.where(mask, jnp.sum(v * v, axis=1), 1.0) / 4.0), 0.0)
        h = jnp.ones((n, 3)) * jnp.asarray([0.2, 0.4, 0.6], v.dtype)
        for _ in range(2):
            table = jnp.zeros((n, 2, 3), v.dtype).at[r, inputs["species"][s] % 2].add(jnp.tanh(h[s]) * env[:, None])
            h = h + jnp.sum(table, axis=1)
        atomic = jnp.sum(jnp.sin(h), axis=1)
        return {"energy": jax.ops.segment_sum(atomic, inputs["batch_idx"], num_segments=inputs["n_systems"])}


def test_scatter_with_two_index_columns_into_atom_rows_equals_single_device():
    model = TwoColumnScatter("mpnn_segment_sum")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 2, 1)), grid=(2, 2, 1)))
    got = dm(SYSTEM, outputs=("energy", "forces"))
    assert_same(got, jaxdd.compute(model, SYSTEM, outputs=("energy", "forces")))
    assert dm.dispatch_report.counts["scatter_add.owned_rows"] == 2
    assert not dm.dispatch_report.fallbacks  # the receiver column is known by provenance


def test_index_columns_keep_their_provenance():
    def fn(table, receivers, kind, x):
        return table.at[receivers, kind].add(x)

    n = 6
    closed = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((n, 2, 3), jnp.float64), jax.ShapeDtypeStruct((n,), jnp.int32),
                                jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n, 3), jnp.float64))
    d = Dispatcher(None, DispatchReport(), (n, n, 1))  # edges as many as rows: shape cannot decide
    (out,) = d.out_layouts(closed, [REPLICATED, Layout(Kind.EDGE, 0, Kind.NODE), Layout(Kind.EDGE), Layout(Kind.EDGE)])
    assert out.kind is Kind.NODE and out.axis == 0
    assert not d.analyse(closed.jaxpr, (REPLICATED, Layout(Kind.EDGE, 0, Kind.NODE), Layout(Kind.EDGE),
                                        Layout(Kind.EDGE))).notes
