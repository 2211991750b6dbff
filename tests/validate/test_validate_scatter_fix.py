"""Specification of the auto-fix rule ``add_scatter_outputs`` and of the fix-rule registry.

A custom op whose per-atom output sums per-edge terms onto receivers leaves ghost partial
sums under decomposition; when its ``OpAdapter`` forgets ``ScatterOutputs`` the validator
must name the op, the output index and the fix, and return the corrected spec.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jaxdd
from jaxdd.neighbors import edge_vectors
from jaxdd.ops import ScatterOutputs
from jaxdd.spec import SPEC_MPNN_HALO, MLIPSpec, OpAdapter, OutputKind
from jaxdd.validate import (FIX_RULES, Attempt, FixCandidate, FixContext, FixRule, FixRuleRegistry, KeyDiff,
                            named_op_outputs, register_fix_rule, trace_and_validate)
from test_dispatch import CUTOFF, random_system

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

OP = "validatetest::gated_messages"
SYSTEM = random_system(12.0, 40, seed=5)


@jaxdd.register_op(OP)
def _gated_messages(h, senders, receivers, env):
    """An opaque kernel with two per-atom outputs: a gate computed row by row (ghost rows
    are copies of their owners: no transform) and messages summed onto receivers (ghost rows
    hold partial sums: ScatterOutputs)."""
    gate = jax.nn.sigmoid(h)
    messages = jax.ops.segment_sum(jnp.tanh(h[senders]) * env[:, None], receivers, num_segments=h.shape[0])
    return gate, messages


class GatedMPNN(jaxdd.BaseModel):
    """Two message-passing layers through the op; energy a sum of sines, forces by autograd."""

    def __init__(self, spec: MLIPSpec, outputs=("energy", "forces")):
        self.spec = spec
        self.model_config = jaxdd.ModelConfig(
            outputs=frozenset(outputs), autograd_outputs=frozenset({"forces"}),
            autograd_inputs=frozenset({"positions"}), neighbor_config=jaxdd.NeighborConfig(cutoff=CUTOFF))

    @property
    def distribution_spec(self):
        return self.spec

    def adapt_input(self, batch):
        nl = batch.neighbors
        return dict(vectors=edge_vectors(batch.positions, batch.cell, batch.batch_idx, nl), senders=nl.senders,
                    receivers=nl.receivers, edge_mask=nl.mask, species=batch.atomic_numbers,
                    batch_idx=batch.batch_idx, n_systems=batch.n_systems)

    def forward(self, vectors, senders, receivers, edge_mask, species, batch_idx, n_systems):
        r2 = jnp.where(edge_mask, jnp.sum(vectors * vectors, axis=1), 1.0)
        env = jnp.where(edge_mask, jnp.exp(-r2 / 4.0), 0.0)
        h = jnp.ones((species.shape[0], 4), vectors.dtype) * jnp.asarray([0.3, 0.5, 0.7, 0.9], vectors.dtype)
        op = jaxdd.ops.get_op(OP)
        for _ in range(2):
            gate, messages = op(h, senders, receivers, env)
            h = h + gate * messages
        real = batch_idx < n_systems
        atomic = jnp.where(real, jnp.sum(jnp.sin(h), axis=1), 0.0)
        out = {"energy": jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)}
        if "partial_z" in self.model_config.outputs:  # a per-rank partial, left undeclared
            z = jnp.where(real, species.astype(vectors.dtype), 0.0)
            out["partial_z"] = jaxdd.system_sum(z, batch_idx, n_systems, scope="local")
        return out


RIGHT = SPEC_MPNN_HALO.with_custom_ops(OpAdapter(OP, output_transforms={1: ScatterOutputs()}))
FORGOTTEN = SPEC_MPNN_HALO.with_custom_ops(OpAdapter(OP))  # ScatterOutputs forgotten


def forgotten():
    return GatedMPNN(FORGOTTEN)


def forgotten_with_a_partial():
    return GatedMPNN(FORGOTTEN.with_output_kinds(partial_z=OutputKind.PER_GRAPH),
                     outputs=("energy", "forces", "partial_z"))


def right_with_a_partial():
    spec = RIGHT.with_output_kinds(partial_z=OutputKind.PER_GRAPH)
    return GatedMPNN(spec, outputs=("energy", "forces", "partial_z"))


# ----------------------------------------------------------------------------- the rule, run


def test_forgotten_scatter_outputs_is_named_and_fixed(tmp_path):
    report = trace_and_validate(forgotten, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    first = report.attempts[0]
    assert not first.passed and not first.diffs["forces"].passed  # the symptom: forces differ

    assert report.ok and report.fix_applied == "add_scatter_outputs", report.summary()
    # The gate (output 0) was tried first and failed: only the hypothesis that passes is the cause.
    assert [a.passed for a in report.attempts] == [False, False, True]
    assert "output 0" in report.attempts[1].rationale and report.attempts[1].diagnosis is None
    why = report.attempts[-1].diagnosis
    assert why == (f"op '{OP}' output 1 holds ghost partial sums: add output_transforms={{1: ScatterOutputs()}} "
                   "on its OpAdapter")
    assert why in report.next_action and report.next_action.startswith("OK —")
    assert f"Diagnosis: {why}" in report.summary()

    # The corrected spec: ScatterOutputs on output 1 only, everything else as it was.
    (adapter,) = report.spec.distribution.custom_ops
    assert adapter.op.name == OP and dict(adapter.output_transforms) == {1: ScatterOutputs()}
    assert report.spec == RIGHT

    # Saved and loaded, it validates at once: the distributed result equals the single device.
    report.spec.save(tmp_path / "spec.json")
    fixed = MLIPSpec.load(tmp_path / "spec.json")
    again = trace_and_validate(forgotten, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10, spec=fixed, auto_fix=False)
    assert again.ok and again.fix_applied is None and len(again.attempts) == 1, again.summary()


def test_a_failure_with_another_cause_is_not_blamed_on_scatter_outputs():
    # The op is declared right; the model's per-rank partial is what is wrong. The rule's
    # guess (ScatterOutputs on the gate) is tried, fails, and is not reported.
    report = trace_and_validate(right_with_a_partial, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied == "add_all_reduce", report.summary()
    assert report.spec.all_reduce_outputs == {"partial_z"} and report.spec.distribution == RIGHT.distribution
    tried = [a for a in report.attempts if "add_scatter_outputs" in a.rationale]
    assert tried and not any(a.passed for a in tried)
    assert "ScatterOutputs" not in report.next_action and "ScatterOutputs" not in report.attempts[-1].diagnosis
    assert "partial_z" in report.attempts[-1].diagnosis


@pytest.mark.slow
def test_two_causes_are_fixed_together_and_both_named():
    report = trace_and_validate(forgotten_with_a_partial, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied == "add_all_reduce", report.summary()
    assert report.spec.distribution == RIGHT.distribution and report.spec.all_reduce_outputs == {"partial_z"}
    why = report.attempts[-1].diagnosis
    assert why.startswith(f"op '{OP}' output 1 holds ghost partial sums") and "'partial_z'" in why
    assert why in report.next_action


# ----------------------------------------------------------------------------- the rule, unit


def _ctx(spec, op_outputs, n_atoms=SYSTEM.n_atoms):
    failed = Attempt(spec, "given", diffs={"forces": KeyDiff(0.3, 0.3, False)})
    return FixContext(failed, {}, {}, 2, n_atoms, op_outputs)


def test_the_single_device_program_shows_each_ops_outputs():
    from jaxdd.neighbors import neighbor_list

    b = jaxdd.data.as_batch(SYSTEM)
    nl, _ = neighbor_list(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, cutoff=CUTOFF)
    shapes = named_op_outputs(forgotten(), b.replace(neighbors=nl), [OP, "validatetest::never_called"])
    assert shapes == {OP: ((SYSTEM.n_atoms, 4), (SYSTEM.n_atoms, 4))}


def test_rule_proposes_each_untransformed_per_atom_output_then_all():
    rule = FIX_RULES["add_scatter_outputs"]
    n = SYSTEM.n_atoms
    cands = list(rule.propose(_ctx(FORGOTTEN, {OP: ((n, 4), (n, 4), (1,))})))  # output 2: per system
    assert [dict(c.spec.distribution.custom_ops[0].output_transforms) for c in cands] == [
        {0: ScatterOutputs()}, {1: ScatterOutputs()}, {0: ScatterOutputs(), 1: ScatterOutputs()}]
    assert cands[2].diagnosis == (f"op '{OP}' outputs 0, 1 hold ghost partial sums: add output_transforms="
                                  "{0: ScatterOutputs(), 1: ScatterOutputs()} on its OpAdapter")
    # A declared output is left as it is; ops the model never calls and specs without ops
    # give nothing to try.
    (only,) = rule.propose(_ctx(RIGHT, {OP: ((n, 4), (n, 4))}))
    assert dict(only.spec.distribution.custom_ops[0].output_transforms) == {0: ScatterOutputs(), 1: ScatterOutputs()}
    assert list(rule.propose(_ctx(FORGOTTEN, {}))) == []
    assert list(rule.propose(_ctx(SPEC_MPNN_HALO, {OP: ((n, 4),)}))) == []


def test_rule_keeps_other_transforms_of_the_adapter():
    from jaxdd.ops import AllReduceSum, SliceOwned

    spec = SPEC_MPNN_HALO.with_custom_ops(
        OpAdapter(OP, arg_transforms={0: SliceOwned()}, output_transforms={0: AllReduceSum()}))
    n = SYSTEM.n_atoms
    (cand,) = FIX_RULES["add_scatter_outputs"].propose(_ctx(spec, {OP: ((n, 4), (n, 4))}))
    (adapter,) = cand.spec.distribution.custom_ops
    assert dict(adapter.arg_transforms) == {0: SliceOwned()}
    assert dict(adapter.output_transforms) == {0: AllReduceSum(), 1: ScatterOutputs()}


# ----------------------------------------------------------------------------- the registry


def test_the_builtin_rules_in_order():
    assert list(FIX_RULES) == ["add_scatter_outputs", "halo_correction_to_local", "deep_halo_for_unfollowed_values",
                               "add_all_reduce", "drop_extra_all_reduce"]
    assert "add_all_reduce" in FIX_RULES and all(isinstance(r, FixRule) for r in FIX_RULES.rules())


def test_a_user_rule_is_registered_in_order_and_proposes_candidates():
    registry = FixRuleRegistry(FIX_RULES.rules())

    def mine(ctx):
        return [FixCandidate(ctx.spec.with_all_reduce("x"), "a guess", "x was a partial")]

    registry.register("mine", mine, before="add_all_reduce")
    assert list(registry)[3:5] == ["mine", "add_all_reduce"]
    assert registry.register("mine", mine).propose is mine  # the same rule again: allowed
    with pytest.raises(ValueError, match="'mine' is already registered.*replace=True"):
        registry.register("mine", lambda ctx: [])
    proposed = registry.propose(_ctx(SPEC_MPNN_HALO, {}))
    assert [(name, c.why) for name, c in proposed] == [("mine", "a guess")]
    assert registry.unregister("mine").name == "mine" and "mine" not in registry
    assert "mine" not in FIX_RULES  # a copy: the global registry is untouched


def test_a_rule_that_raises_is_skipped_with_a_warning():
    def broken(ctx):
        raise KeyError("boom")

    registry = FixRuleRegistry([FixRule("broken", broken)])
    with pytest.warns(RuntimeWarning, match="fix rule 'broken' raised KeyError"):
        assert registry.propose(_ctx(SPEC_MPNN_HALO, {})) == []


def test_register_fix_rule_adds_to_the_global_registry():
    rule = register_fix_rule("validatetest_rule", lambda ctx: [], description="nothing")
    try:
        assert list(FIX_RULES)[-1] == "validatetest_rule" and FIX_RULES["validatetest_rule"] is rule
    finally:
        FIX_RULES.unregister("validatetest_rule")
    with pytest.raises(ValueError, match="identifier"):
        FixRule("not a name", lambda ctx: [])


def test_fix_rules_argument_must_be_rules():
    with pytest.raises(ValueError, match="fix_rules must be"):
        trace_and_validate(forgotten, SYSTEM, fix_rules=["add_all_reduce"])


# ----------------------------------------------------------------------------- unfollowed values


class ModuloIndexed(eqx.Module, jaxdd.BaseModel):
    """Two message-passing steps whose edge indices pass through ``% n_atoms`` (an arithmetic
    the dispatch does not follow: the indices lose what they point at)."""

    model_config: jaxdd.ModelConfig = eqx.field(static=True)

    def __init__(self):
        self.model_config = jaxdd.ModelConfig(
            outputs=frozenset({"energy", "forces"}), autograd_outputs=frozenset({"forces"}),
            autograd_inputs=frozenset({"positions"}), neighbor_config=jaxdd.NeighborConfig(cutoff=3.0))

    def adapt_input(self, data, **kwargs):
        return dict(data=data)

    def forward(self, data):
        nl, n = data.neighbors, data.n_atoms
        senders, receivers = nl.senders % (n + 1), nl.receivers % (n + 1)
        v = jaxdd.edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.sum(v * v, axis=1)
        smooth = jnp.where(nl.mask, (1.0 - r2 / 9.0) ** 2, 0.0)
        density = jax.ops.segment_sum(smooth, receivers, n)
        messages = smooth * jnp.tanh(density.at[senders].get(mode="fill", fill_value=0.0))
        atomic = jax.ops.segment_sum(messages, receivers, n) + 0.1 * density**2
        return {"energy": jnp.sum(jnp.where(data.atom_mask, atomic, 0.0))[None]}


def test_values_the_dispatch_cannot_follow_get_a_deep_halo_and_pass():
    report = trace_and_validate(ModuloIndexed, SYSTEM, world_size=2, atol=1e-9, rtol=1e-10)
    assert not report.attempts[0].passed and report.attempts[0].fallbacks
    assert report.ok and report.fix_applied == "deep_halo_for_unfollowed_values", report.summary()
    assert report.spec.policy.scatter_mode == "local" and report.spec.policy.halo_layers >= 1
