"""A primitive of one's own, given its distributed meaning with ``jaxdd.register_rule``.

``atom_sum`` is a JAX primitive (impl, abstract eval, lowering, transpose) that sums
per-atom values over the atom axis. The dispatch cannot know that it is a reduction over
atoms: without a rule its result is rank-local and ``DistributedModel`` refuses the energy.
With the rule below (mask ghost and pad rows, bind, ``psum``), the distributed energy and
forces equal ``jaxdd.compute`` in float64 on a periodic system over a (2, 2, 2) grid. The
same example is in docs/dispatch.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import ad, mlir

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors, register_rule
from jaxdd.dispatch import REPLICATED, Decision, DispatchError, DispatchReport, Dispatcher, Kind, Layout
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh

CUTOFF = 3.0


def make_atom_sum(name: str) -> Primitive:
    """A primitive summing ``x [n_atoms, *F]`` over atoms to ``[*F]`` (linear, so its JVP is
    itself and its transpose a broadcast)."""
    p = Primitive(name)
    p.def_impl(lambda x: jnp.sum(x, axis=0))
    p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape[1:], x.dtype))
    mlir.register_lowering(p, mlir.lower_fun(lambda x: jnp.sum(x, axis=0), multiple_results=False))
    ad.deflinear2(p, lambda ct, x: [jnp.broadcast_to(ct, x.aval.shape)])
    return p


atom_sum_p = make_atom_sum("test_atom_sum")


@register_rule(atom_sum_p)
def atom_sum_rule(ctx, eqn, in_layouts):
    """Over per-atom rows: each atom counted on its owner only, then summed over ranks."""
    (lay,) = in_layouts
    if lay.kind is not Kind.NODE or lay.axis != 0:
        return ctx.default(eqn, in_layouts)

    def apply(eqn, invals):
        (x,) = invals
        rt = ctx.runtime
        owned = rt.row_mask(Kind.NODE, x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
        partial = eqn.primitive.bind(jnp.where(owned, x, 0.0))
        return [jax.lax.psum(partial, rt.axis_names)]

    return Decision((REPLICATED,), apply, rule="atom_sum.psum", replicates=True)


class PairModel(BaseModel):
    """A smooth pair potential whose total is taken by ``sum_fn`` (one system)."""

    def __init__(self, sum_fn):
        self.sum_fn = sum_fn
        self.model_config = ModelConfig(
            outputs={"energy", "forces"}, autograd_outputs={"forces"}, autograd_inputs={"positions"},
            neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        nl = data.neighbors
        v = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.where(nl.mask, jnp.sum(v * v, axis=1), 1.0)
        smooth = jnp.where(nl.mask & (r2 < CUTOFF ** 2), (1.0 - r2 / CUTOFF ** 2) ** 2, 0.0)
        pair = jnp.exp(-r2) * smooth
        atomic = jax.ops.segment_sum(0.5 * pair, nl.receivers, num_segments=data.n_atoms)
        atomic = jnp.where(data.atom_mask, atomic, 0.0)
        return {"energy": self.sum_fn(atomic)[None]}


def lattice(n=8, spacing=2.0, seed=0):
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return jaxdd.AtomicData(positions=(k + rng.uniform(-0.2, 0.2, k.shape)) * spacing,
                            atomic_numbers=np.ones(len(k), int), cell=np.eye(3) * n * spacing,
                            pbc=np.array([True] * 3))


def distributed(model):
    return DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=default_mesh(jax.devices()[:8]), grid=(2, 2, 2)))


def test_a_registered_rule_makes_the_primitive_distribute_exactly():
    data = lattice()
    model = PairModel(atom_sum_p.bind)
    dist = distributed(model)
    got, ref = dist(data), jaxdd.compute(model, data)
    assert abs(float(got["energy"][0] - ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    assert float(jnp.max(jnp.abs(got["forces"] - ref["forces"]))) <= 1e-9
    assert dist.dispatch_report.counts["atom_sum.psum"] == 1


def test_without_a_rule_the_primitive_is_refused():
    unruled = make_atom_sum("atom_sum_without_rule")
    with pytest.raises(DispatchError, match="could not follow(.|\n)*atom_sum_without_rule .* has no dispatch rule"):
        distributed(PairModel(unruled.bind))(lattice())


def test_without_a_rule_the_dispatch_says_to_register_one():
    unruled = make_atom_sum("atom_sum_without_rule_note")
    closed = jax.make_jaxpr(unruled.bind)(jax.ShapeDtypeStruct((5, 3), jnp.float64))
    d = Dispatcher(None, DispatchReport(), (5, 7, 1))
    plan = d.analyse(closed.jaxpr, (Layout(Kind.NODE),))
    assert plan.outs[0].local  # rank-dependent, so an energy built from it is refused
    assert any("no dispatch rule" in n and "register_rule" in n for n in plan.notes)


def test_registering_a_different_rule_under_a_taken_name_needs_replace():
    p = make_atom_sum("atom_sum_twice")

    def first(ctx, eqn, ins):
        return ctx.default(eqn, ins)

    def second(ctx, eqn, ins):
        return ctx.default(eqn, ins)

    assert register_rule(p, first) is first
    assert register_rule(p.name, first) is first  # the same rule again is fine
    with pytest.raises(DispatchError, match="already registered"):
        register_rule(p, second)
    assert register_rule(p, second, replace=True) is second
    assert jaxdd.dispatch.registered_rules()["atom_sum_twice"] is second


def test_a_rule_must_be_callable_and_a_primitive_named():
    with pytest.raises(DispatchError, match="callable"):
        register_rule("atom_sum_not_callable", 3)
    with pytest.raises(DispatchError, match="Primitive or its name"):
        register_rule(42, lambda ctx, eqn, ins: None)


def test_every_intent_verb_and_the_pme_verb_have_registered_rules():
    import jaxdd.models.pme_grid  # noqa: F401  (registers its verb on import)
    from jaxdd.dispatch.intent import VERBS

    rules = jaxdd.dispatch.registered_rules()
    for name in VERBS + ("jaxdd::pme_energy",):
        assert name in rules, name
