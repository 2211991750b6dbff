"""Elementwise primitives: the default rule, selects, per-rank type casts, and comparisons
of graph-parallel senders against the local row count."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..decision import Decision
from ..equations import bind, is_literal, shape_of
from ..layouts import ATOM_COUNT, Kind, Layout, merge_index
from ..registry import register_rule

__all__ = ["elementwise", "select_n", "index_bound", "pvary"]

# Primitives whose output holds their input's values, and those whose output indexes what
# their input indexed (a clamped index is still an index).
_VALUE_KEEPING = {"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier"}
_INDEX_KEEPING = _VALUE_KEEPING | {"clamp", "max", "min"}


def elementwise(ctx, eqn, ins) -> Decision:
    """Elementwise and unknown primitives: a tag survives where the output keeps its axis."""
    keep_index = eqn.primitive.name in _INDEX_KEEPING
    outs = []
    for v in eqn.outvars:
        shape = shape_of(v)
        found = []
        for lay, iv in zip(ins, eqn.invars):
            if lay.kind is None:
                continue
            ishape = shape_of(iv)
            if len(ishape) == len(shape) and lay.axis < len(shape) and ishape[lay.axis] == shape[lay.axis]:
                found.append((lay.kind, lay.axis))
        kinds = list(dict.fromkeys(found))
        index = None
        if keep_index or eqn.primitive.name in ("add", "sub"):
            index = owned_or_node(ctx, eqn, ins, range(len(ins)))
        if not kinds:
            outs.append(Layout(None, 0, index))
            continue
        kinds.sort(key=lambda ka: list(Kind).index(ka[0]))
        outs.append(Layout(kinds[0][0], kinds[0][1], index))
    return Decision(tuple(outs))


@register_rule("select_n")
def select_n(ctx, eqn, ins) -> Decision:
    """``jnp.where``: the cases' index meaning survives when they agree."""
    d = elementwise(ctx, eqn, ins)
    out = d.outs[0]
    return Decision((Layout(out.kind, out.axis, owned_or_node(ctx, eqn, ins, range(1, len(ins)))),))


def owned_or_node(ctx, eqn, ins, positions) -> Kind | None:
    """The index meaning of ``eqn``'s output from its inputs at ``positions``: the one they
    share. Indices of owned rows stay that only while every value stays owned or past the
    local rows: through a cast, a select among such values, or an add of a constant past the
    rows (jnp's wrap of negative indices, ``i + n``, never taken for an index >= 0)."""
    index = merge_index(ins[i].index for i in positions)
    if index is not Kind.OWNED_NODE:
        return index
    name = eqn.primitive.name
    if name in _VALUE_KEEPING:
        return index
    others = [eqn.invars[i] for i in positions if ins[i].index is not Kind.OWNED_NODE]
    if name == "select_n" or name == "add" and len(others) == 1:
        values = [ctx.constant(v) for v in others]
        if ctx.n_padded and all(x is not None and np.size(x) and np.min(x) >= ctx.n_padded for x in values):
            return index
    return Kind.NODE


def index_bound(ctx, eqn, ins) -> Decision:
    """Comparisons and clamps of graph-parallel senders against the local row count.

    A single-device model tells padding edges by ``senders < n`` and keeps indices in
    range by ``jnp.minimum(senders, n - 1)`` or a clip, with ``n`` its atom count. Senders
    index every rank's rows, so ``n`` (this rank's rows) becomes the stacked count there.
    """
    real = real_rows_test(ctx, eqn, ins)
    if real is not None:
        return real
    d = elementwise(ctx, eqn, ins)
    if not any(lay.index is Kind.ALL_NODES for lay in ins):
        return d
    last = eqn.primitive.name in ("min", "clamp")  # bounds are the last valid index, n - 1
    local = ctx.n_padded - 1 if last else ctx.n_padded
    at = [i for i, v in enumerate(eqn.invars) if is_literal(v) and np.ndim(v.val) == 0 and v.val == local
          and np.issubdtype(np.asarray(v.val).dtype, np.integer)]
    if not at:
        return d

    def apply(eqn, invals):
        invals = list(invals)
        rt = ctx.runtime
        for i in at:
            invals[i] = jnp.asarray(rt.n_all - 1 if last else rt.n_all, jnp.result_type(invals[i]))
        return bind(eqn, invals)

    return Decision(d.outs, apply, "bound.all_nodes", d.notes)


# (comparison, position of the row number) -> True: "is a real atom", False: "is not".
_REAL_TESTS = {("lt", 0): True, ("gt", 1): True, ("ge", 0): False, ("le", 1): False}


def real_rows_test(ctx, eqn, ins) -> Decision | None:
    """``idx < count_nonzero(atom_mask)`` (or ``count > idx``; ``>=`` for its negation) with
    ``idx`` atom row numbers: on one device, where padding rows come after the atoms, it asks
    whether row ``idx`` is a real atom (e3j's ``GraphCSR.mask_edges``, ``arange(n) < count``).
    Every rank numbers only its own rows, and the count is every rank's, so the comparison
    itself would mean something else; the question it asks is rewritten: this rank's atom
    mask at ``idx`` (:meth:`~jaxdd.dispatch.Runtime.real_rows`). None when ``eqn`` is not such a test."""
    if len(ins) != 2:
        return None
    counts = [i for i, lay in enumerate(ins) if lay.total == ATOM_COUNT]
    rows = [i for i, lay in enumerate(ins) if lay.index in (Kind.NODE, Kind.OWNED_NODE) and not lay.total]
    if len(counts) != 1 or len(rows) != 1:
        return None
    at = rows[0]
    positive = _REAL_TESTS.get((eqn.primitive.name, at))
    if positive is None or not np.issubdtype(eqn.invars[at].aval.dtype, np.integer):
        return None
    idx_lay = ins[at]
    out_shape = shape_of(eqn.outvars[0])
    kind = idx_lay.kind if idx_lay.kind is not None and len(shape_of(eqn.invars[at])) == len(out_shape) else None
    # arange(n_rows) < count is the atom mask itself.
    own_rows = kind is Kind.NODE and idx_lay.axis == 0 and _counts_rows(ctx, eqn.invars[at])
    out = Layout(kind, idx_lay.axis if kind else 0, real=own_rows, permuted=idx_lay.permuted)

    def apply(eqn, invals):
        real = ctx.runtime.real_rows(invals[at])
        return [jnp.broadcast_to(real if positive else ~real, out_shape)]

    return Decision((out,), apply, "compare.real_rows", resolves=True, confirms=(at,))


def _counts_rows(ctx, var) -> bool:
    x = ctx.constant(var)
    return x is not None and x.ndim == 1 and bool(np.all(x == np.arange(x.shape[0])))


for _name in ("lt", "le", "gt", "ge", "eq", "ne", "min", "clamp"):
    register_rule(_name, index_bound)


def pvary(ctx, eqn, ins) -> Decision:
    """Per-rank typing recorded by a trace with manual axis types: an identity on values."""
    return Decision(tuple(ins), lambda eqn, invals: list(invals), passive=True)


register_rule("pvary", pvary)
register_rule("pcast", pvary)
