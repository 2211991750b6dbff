"""Primitives with bodies: calls, custom derivatives, remat, scan, while and cond.

A body is entered (evaluated equation by equation through the dispatch) only when
something inside it needs a rule; otherwise the equation is re-bound exactly as traced, so
a ``custom_vjp`` keeps its hand-written derivative. A named call is first looked up as a
verb (:func:`~jaxdd.dispatch.register_rule` with a ``"namespace::op"`` name), then as a
custom op declared on the spec. Loops and branches whose predicate differs between ranks
are refused when their body communicates: ranks would issue different collectives.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..decision import Decision
from ..equations import is_literal, scan_counts, sub_jaxpr, where
from ..layouts import ROWS, Layout, join
from ..registry import register_rule, verb_rule
from ..report import DispatchError
from .custom_ops import custom_op

__all__ = ["call", "custom_derivative", "remat", "scan", "while_loop", "cond"]

# Loop carries are joined until their layouts stop changing; a layout lattice this small
# settles in two or three rounds.
_MAX_FIXPOINT_ROUNDS = 8


def call(ctx, eqn, ins) -> Decision:
    """jit / pjit / closed_call: verbs and named ops, else entered when their body needs a rule."""
    name = eqn.params.get("name")
    rule = verb_rule(name)
    if rule is not None:
        return rule(ctx, eqn, ins)
    rt = ctx.runtime
    if rt is not None and name in rt.ops:
        return custom_op(ctx, rt.ops[name], eqn, ins)
    jaxpr, consts = sub_jaxpr(eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")))
    # Integer scalars the caller fixes (jnp.where's fill index) are known inside too.
    known = {i: v.val for i, v in enumerate(eqn.invars)
             if is_literal(v) and np.ndim(v.val) == 0 and np.issubdtype(np.asarray(v.val).dtype, np.integer)}
    plan = ctx.analyse(jaxpr, ins, consts, known)
    if not plan.active:
        return Decision(plan.outs, notes=plan.notes)

    def apply(eqn, invals):
        return ctx.eval(jaxpr, consts, invals, ins, known)

    return Decision(plan.outs, apply)


for _name in ("pjit", "jit", "closed_call", "core_call"):
    register_rule(_name, call)


def custom_derivative(ctx, eqn, ins) -> Decision:
    """custom_jvp / custom_vjp: re-bound with their rule unless the body needs one. A
    ``custom_jvp`` whose body needs one keeps its rule: primal and JVP both go through the
    dispatch (e3x's norm takes a max over edges, and its rule is what keeps zero-length
    padding pairs finite). A ``custom_vjp`` whose body needs one is differentiated through
    its body. Either way the entry is counted (``enter.<primitive>``), not a fallback.
    """
    jaxpr, consts = sub_jaxpr(eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr")))
    plan = ctx.analyse(jaxpr, ins, consts)
    if not plan.active:
        return Decision(plan.outs, notes=plan.notes)  # the custom rule survives
    if eqn.primitive.name == "custom_jvp_call" and "jvp_jaxpr_fun" in eqn.params:
        return _custom_jvp_entered(ctx, eqn, ins, jaxpr, consts, plan)

    def apply(eqn, invals):
        return ctx.eval(jaxpr, consts, invals, ins)

    return Decision(plan.outs, apply, "enter." + eqn.primitive.name, plan.notes)


def _custom_jvp_entered(ctx, eqn, ins, jaxpr, consts, plan) -> Decision:
    """A ``custom_jvp`` rebuilt around the dispatch: its primal body and its JVP rule are each
    evaluated through it, tangents laid out like their primals (without index meaning)."""
    from jax.custom_derivatives import SymbolicZero

    nc, jvp_fun = eqn.params["num_consts"], eqn.params["jvp_jaxpr_fun"]
    primal_ins = tuple(ins[nc:])
    tangent_ins = tuple(lay.plain() if lay.kind is not None else dataclasses.replace(lay, index=None, columns=None)
                        for lay in primal_ins)

    def apply(eqn, invals):
        cvals, args = invals[:nc], invals[nc:]

        @jax.custom_jvp
        def body(*args):
            return ctx.eval(jaxpr, consts, [*cvals, *args], ins)

        def jvp(primals, tangents):
            zeros = [type(t) is SymbolicZero for t in tangents]
            jvp_jaxpr, jvp_consts, out_zeros = jvp_fun.call_wrapped(*zeros)
            nonzero = [t for t in tangents if type(t) is not SymbolicZero]
            layouts = primal_ins + tuple(lay for lay, z in zip(tangent_ins, zeros) if not z)
            out = ctx.eval(jvp_jaxpr, jvp_consts, [*primals, *nonzero], layouts)
            out_primals, out_tangents = out[:len(out_zeros)], iter(out[len(out_zeros):])
            return out_primals, [SymbolicZero(jax.typeof(p).to_tangent_aval()) if z else next(out_tangents)
                                 for p, z in zip(out_primals, out_zeros)]

        body.defjvp(jvp, symbolic_zeros=True)
        return list(body(*args))

    return Decision(plan.outs, apply, "enter." + eqn.primitive.name, plan.notes)


for _name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
    register_rule(_name, custom_derivative)


def remat(ctx, eqn, ins) -> Decision:
    """``remat`` / ``checkpoint``: the body entered when it needs a rule, under the same ``jax.checkpoint``."""
    jaxpr, consts = sub_jaxpr(eqn.params["jaxpr"])
    plan = ctx.analyse(jaxpr, ins)
    if not plan.active:
        return Decision(plan.outs, notes=plan.notes)
    prevent_cse = eqn.params.get("prevent_cse", True)
    policy = eqn.params.get("policy")

    def apply(eqn, invals):
        body = jax.checkpoint(lambda *a: ctx.eval(jaxpr, consts, a, ins), prevent_cse=prevent_cse, policy=policy)
        return list(body(*invals))

    return Decision(plan.outs, apply, "enter.remat", plan.notes)


for _name in ("remat", "remat2", "checkpoint"):
    register_rule(_name, remat)


@register_rule("scan")
def scan(ctx, eqn, ins) -> Decision:
    """A scan over layers is entered once; a scan over rank rows with a carry is recorded."""
    p = eqn.params
    jaxpr, consts = sub_jaxpr(p["jaxpr"])
    nc, nk = scan_counts(p)
    const_l, carry_l, xs_l = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
    notes = []
    xs_in = []
    over_rows = None  # the kind of rows the scan walks over (lax.map over atoms), if any
    for lay in xs_l:
        if lay.kind is not None and lay.axis == 0:
            if lay.kind in ROWS:
                over_rows = lay.kind
            xs_in.append(Layout(None, 0, lay.index))
        else:
            xs_in.append(lay.moved(lay.axis - 1) if lay.kind is not None else lay)
    if over_rows is not None and nk:
        notes.append(f"scan over the per-{over_rows.value} axis with a carry in {where(eqn)}: what the carry "
                     "accumulates over rows is rank-local")
    for _ in range(_MAX_FIXPOINT_ROUNDS):
        plan = ctx.analyse(jaxpr, tuple(const_l) + tuple(carry_l) + tuple(xs_in))
        joined = [join(c, o) for c, o in zip(carry_l, plan.outs[:nk])]
        if joined == carry_l:
            break
        carry_l = joined
    ys = [lay.moved(lay.axis + 1) if lay.kind is not None else
          (Layout(over_rows, 0, lay.index) if over_rows is not None else lay) for lay in plan.outs[nk:]]
    outs = tuple(carry_l) + tuple(ys)
    if not plan.active:
        return Decision(outs, notes=plan.notes + tuple(notes))
    layouts = tuple(const_l) + tuple(carry_l) + tuple(xs_in)

    def apply(eqn, invals):
        cvals, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

        def body(carry, x):
            res = ctx.eval(jaxpr, consts, list(cvals) + list(carry) + list(x), layouts)
            return res[:nk], res[nk:]

        carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"],
                                 reverse=p["reverse"], unroll=p.get("unroll", 1))
        return list(carry) + list(ys)

    return Decision(outs, apply, "enter.scan", plan.notes + tuple(notes))


@register_rule("while")
def while_loop(ctx, eqn, ins) -> Decision:
    """A while loop entered when its body or condition needs a rule (carry layouts joined to a fixed point).

    Refuses a loop whose condition differs between ranks while its body exchanges halos.
    """
    p = eqn.params
    cj, cc = sub_jaxpr(p["cond_jaxpr"])
    bj, bc = sub_jaxpr(p["body_jaxpr"])
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    cconst_l, bconst_l, carry_l = ins[:ncc], ins[ncc:ncc + nbc], list(ins[ncc + nbc:])
    for _ in range(_MAX_FIXPOINT_ROUNDS):
        bplan = ctx.analyse(bj, tuple(bconst_l) + tuple(carry_l))
        joined = [join(c, o) for c, o in zip(carry_l, bplan.outs)]
        if joined == carry_l:
            break
        carry_l = joined
    cplan = ctx.analyse(cj, tuple(cconst_l) + tuple(carry_l))
    notes = bplan.notes + cplan.notes
    if not (bplan.active or cplan.active):
        return Decision(tuple(carry_l), notes=notes)
    if cplan.outs[0].kind in ROWS or cplan.outs[0].local:
        raise DispatchError(
            f"a while loop in {where(eqn)} stops on a value that differs between ranks while its body needs "
            "halo exchanges: ranks would loop a different number of times. Reduce the condition over atoms first "
            "(e.g. jnp.max over atoms), which the dispatch turns into a collective"
        )
    b_l = tuple(bconst_l) + tuple(carry_l)
    c_l = tuple(cconst_l) + tuple(carry_l)

    def apply(eqn, invals):
        cvals, bvals, init = invals[:ncc], invals[ncc:ncc + nbc], invals[ncc + nbc:]

        def cond_fn(carry):
            return ctx.eval(cj, cc, list(cvals) + list(carry), c_l)[0]

        def body_fn(carry):
            return ctx.eval(bj, bc, list(bvals) + list(carry), b_l)

        return list(jax.lax.while_loop(cond_fn, body_fn, list(init)))

    return Decision(tuple(carry_l), apply, "enter.while", notes)


@register_rule("cond")
def cond(ctx, eqn, ins) -> Decision:
    """``cond`` / ``switch``: every branch entered under the joined output layouts when one needs a rule.

    Refuses a branch index that differs between ranks while a branch exchanges halos.
    """
    branches = eqn.params["branches"]
    plans = [ctx.analyse(b.jaxpr, tuple(ins[1:])) for b in branches]
    outs = list(plans[0].outs)
    for plan in plans[1:]:
        outs = [join(a, b) for a, b in zip(outs, plan.outs)]
    notes = tuple(n for plan in plans for n in plan.notes)
    if not any(plan.active for plan in plans):
        return Decision(tuple(outs), notes=notes)
    if ins[0].kind in ROWS or ins[0].local:
        raise DispatchError(
            f"a cond/switch in {where(eqn)} branches on a value that differs between ranks (e.g. one atom's "
            "value) while a branch needs halo exchanges: ranks would take different branches. Branch on a value "
            "reduced over atoms, or use jnp.where"
        )

    def apply(eqn, invals):
        index, ops = invals[0], invals[1:]
        fns = [(lambda *a, b=b: ctx.eval(b.jaxpr, b.consts, a, tuple(ins[1:])))
               for b in branches]
        return list(jax.lax.switch(index, fns, *ops))

    return Decision(tuple(outs), apply, "enter.cond", notes)
