"""Reductions over atoms or edges: masked, then reduced across ranks.

``reduce_sum/max/min/and/or`` and a ``dot_general`` contracting a rank-row axis (``x.T @ y``
over atoms) count each row on its owner only (ghost and pad rows masked) and end in
``psum``/``pmax``/``pmin``; a max or min has a derivative across ranks (:func:`across_ranks`).
Cumulative ops and ``argmax``/``argmin`` along rank rows have
no distributed meaning: they are left rank-local and recorded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..decision import Decision
from ..equations import bind, shape_of, where
from ..layouts import ATOM_COUNT, REPLICATED, ROWS, Kind, Layout
from ..masks import along, identity_of
from ..registry import register_rule
from .elementwise import elementwise

__all__ = ["reduce", "cumulative", "arg", "dot_general", "across_ranks"]

_COLLECTIVES = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin, "or": jax.lax.pmax,
                "and": jax.lax.pmin}


def across_ranks(op: str, x, axes: tuple[int, ...], axis_names):
    """``reduce_<op>`` of ``x`` over ``axes``, then over every rank: max or min with a derivative.

    ``pmax``/``pmin`` have none in JAX; here the tangent goes to the entries equal to the
    answer on every rank, shared equally among ties, as ``jnp.max`` shares it on one device.
    Args: op: ``"max"`` or ``"min"``; x: this rank's values, rows it does not own already set to
    the op's identity; axes: the axes reduced; axis_names: the mesh axes of the ranks.
    """
    local = jax.lax.reduce_max if op == "max" else jax.lax.reduce_min
    collective = jax.lax.pmax if op == "max" else jax.lax.pmin

    @jax.custom_jvp
    def extremum(x):
        return collective(local(x, axes), axis_names)

    @extremum.defjvp
    def _jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        out = extremum(x)
        hit = x == jnp.expand_dims(out, axes)
        count = jax.lax.psum(jnp.sum(hit, axis=axes, dtype=x.dtype), axis_names)
        share = jax.lax.psum(jnp.sum(jnp.where(hit, t, 0.0), axis=axes), axis_names)
        return out, share / count

    return extremum(x)


@register_rule("reduce_*")
def reduce(ctx, eqn, ins) -> Decision:
    """``reduce_<op>`` over some axes: a collective when a rank-row axis is among them."""
    if "axes" not in eqn.params:  # reduce_precision and the like: elementwise
        return elementwise(ctx, eqn, ins)
    (lay,) = ins[:1]
    axes = tuple(eqn.params["axes"])
    shape = shape_of(eqn.invars[0])
    notes = ()
    kind = lay.kind
    if kind is None and lay.local and not lay.deliberate:  # rank data whose layout was lost; parameters never are
        guessed = [(a, ctx.fallback_kind(shape[a])) for a in axes]
        guessed = [(a, k) for a, k in guessed if k is not None]
        if len(guessed) == 1 and shape:
            a, kind = guessed[0]
            lay = Layout(kind, a)
            notes = (f"{eqn.primitive.name} over an axis of {shape[a]} rows with no provenance taken as "
                     f"per-{kind.value} (shape fallback) in {where(eqn)}",)
    if kind is None or lay.axis not in axes:
        if kind is None:
            return Decision((REPLICATED,), notes=notes)
        shift = sum(1 for a in axes if a < lay.axis)
        return Decision((Layout(kind, lay.axis - shift),), notes=notes)
    if kind is Kind.GRAPH:  # per-system rows are the same on every rank
        return Decision((REPLICATED,), notes=notes)
    op = eqn.primitive.name[len("reduce_"):]
    collective = _COLLECTIVES.get(op)
    if collective is None:
        notes += (f"reduce_{op} over per-{kind.value} rows left rank-local in {where(eqn)} (no collective for it)",)
        return Decision((REPLICATED,), notes=notes)
    axis, permuted = lay.axis, lay.permuted
    # count_nonzero(atom_mask), atom_mask.sum(): the count of real atoms, which a test of row
    # numbers against it may be rewritten for (jaxdd.dispatch.provenance).
    out = Layout(total=ATOM_COUNT) if op == "sum" and lay.real and kind is Kind.NODE else REPLICATED

    def apply(eqn, invals):
        rt = ctx.runtime
        x = invals[0]
        mask = along(rt.row_mask(kind, x.shape[axis], permuted), x.ndim, axis)
        x = jnp.where(mask, x, identity_of(op, x.dtype))
        if op in ("max", "min") and jnp.issubdtype(x.dtype, jnp.inexact):
            return [across_ranks(op, x, axes, rt.axis_names)]
        (out,) = bind(eqn, [x])
        if op in ("or", "and"):
            return [collective(out.astype(jnp.int32), rt.axis_names).astype(out.dtype)]
        return [collective(out, rt.axis_names)]

    return Decision((out,), apply, f"reduce.{op}", notes, replicates=True)


@register_rule("cum*")
def cumulative(ctx, eqn, ins) -> Decision:
    """``cumsum`` and friends along rank rows: left rank-local and recorded."""
    lay = ins[0]
    if lay.kind in ROWS and eqn.params.get("axis") == lay.axis:
        return Decision((lay.plain(),), notes=(
            f"{eqn.primitive.name} runs along per-{lay.kind.value} rows in {where(eqn)}: left rank-local, which is "
            "wrong under decomposition unless the model accounts for it (use system_sum or an adapter)",))
    return elementwise(ctx, eqn, ins)


def arg(ctx, eqn, ins) -> Decision:
    """``argmax``/``argmin``: over rank rows a local row index (recorded); else the axis moves."""
    lay = ins[0]
    if lay.kind in ROWS and lay.axis in tuple(eqn.params["axes"]):
        return Decision((REPLICATED,), notes=(
            f"{eqn.primitive.name} over per-{lay.kind.value} rows in {where(eqn)} gives a local row index: "
            "left rank-local",))
    if lay.kind is None:
        return Decision((REPLICATED,))
    shift = sum(1 for a in eqn.params["axes"] if a < lay.axis)
    return Decision((Layout(lay.kind, lay.axis - shift),))


register_rule("argmax", arg)
register_rule("argmin", arg)


@register_rule("dot_general")
def dot_general(ctx, eqn, ins) -> Decision:
    """A contraction: over a rank-row axis it is a reduction over atoms (masked, ``psum``)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = ins
    lshape, rshape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    notes = []
    sides = [lhs, rhs]
    for i, (lay, shape, contract) in enumerate(((lhs, lshape, lc), (rhs, rshape, rc))):
        if lay.kind is None and lay.local and not lay.deliberate and len(contract) == 1:
            k = ctx.fallback_kind(shape[contract[0]])
            if k is not None:
                sides[i] = Layout(k, contract[0])
                notes.append(f"dot_general contracting {shape[contract[0]]} rows with no provenance taken as "
                             f"per-{k.value} (shape fallback) in {where(eqn)}")
    lhs, rhs = sides
    reduce_side = None
    for i, (lay, contract) in enumerate(((lhs, lc), (rhs, rc))):
        if lay.kind in ROWS and lay.axis in contract:
            reduce_side = (i, lay)
            break
    n_lhs_free = len(lshape) - len(lc) - len(lb)

    def out_axis(lay, side):
        if lay.kind is None or lay.kind in ROWS and reduce_side is not None:
            return None
        own_c, own_b = (lc, lb) if side == 0 else (rc, rb)
        if lay.axis in own_c:
            return None
        if lay.axis in own_b:
            return own_b.index(lay.axis)
        shape = lshape if side == 0 else rshape
        free = [d for d in range(len(shape)) if d not in own_c and d not in own_b]
        return len(lb) + (0 if side == 0 else n_lhs_free) + free.index(lay.axis)

    candidates = [(lay.kind, out_axis(lay, s)) for s, lay in enumerate((lhs, rhs))]
    candidates = [(k, a) for k, a in candidates if a is not None]
    out = Layout(*candidates[0]) if candidates else REPLICATED
    if len(set(candidates)) > 1:
        notes.append(f"dot_general of two distributed operands in {where(eqn)}: kept the first operand's layout")
    if reduce_side is None:
        return Decision((out,), notes=tuple(notes))
    side, lay = reduce_side

    def apply(eqn, invals):
        rt = ctx.runtime
        invals = list(invals)
        x = invals[side]
        mask = along(rt.row_mask(lay.kind, x.shape[lay.axis], lay.permuted), x.ndim, lay.axis)
        invals[side] = jnp.where(mask, x, jnp.zeros((), x.dtype))
        (y,) = bind(eqn, invals)
        return [jax.lax.psum(y, rt.axis_names)]

    return Decision((out,), apply, "reduce.dot_general", tuple(notes), replicates=True)
