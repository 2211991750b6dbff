"""Primitives community models use whose meaning the other rule modules leave to the default:
the documented elementwise allow-list, identities, ``split`` and small linear algebra.

Every primitive the dispatch meets should have a rule somebody decided on. Those for which
the elementwise rule (:func:`~jaxdd.dispatch.rules.elementwise.elementwise`) is the right
meaning — each output entry depends only on the entries of the inputs at the same position,
so a distributed axis survives wherever the output keeps it — are listed in
:data:`ELEMENTWISE_PRIMITIVES` and registered with that rule, so the allow-list and the
registry are one thing. The rest get rules of their own here:

- ``stop_gradient``, ``optimization_barrier``: identities; each output keeps its input's
  layout, index meaning included.
- ``split``: like ``slice`` for each piece; along the distributed axis only the first piece
  keeps the rows where they were.
- ``unstack`` (``a, b = x``, ``for row in x``; JAX 0.11 and later): like a one-row ``slice``
  then a ``squeeze`` for each piece, so index rows taken apart (``receivers, senders =
  jnp.stack([r, s])``) keep what each pointed at.
- ``lu``, ``triangular_solve``, ``custom_linear_solve`` (``jnp.linalg.solve``): solved
  independently for every atom or edge when rows are a batch axis or right-hand-side columns
  (fractional coordinates of many vectors against one cell); a matrix whose rows are atoms
  couples every rank's rows, which the dispatch cannot re-interpret: left rank-local and recorded.

``tests/dispatch/test_dispatch_coverage.py`` checks a corpus of community models against the registry.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..decision import Decision
from ..equations import shape_of, where
from ..layouts import REPLICATED, ROWS, Kind, Layout, columns_axis, merge_index
from ..registry import register_rule
from .elementwise import elementwise

__all__ = ["ELEMENTWISE_PRIMITIVES", "identity", "split", "unstack", "lu", "triangular_solve", "custom_linear_solve"]

#: Primitives whose distributed meaning is the elementwise rule: every output entry is a
#: function of the input entries at the same position (scalars broadcast), so no row moves
#: and none is combined with another. Comparisons, ``min``, ``clamp`` and ``select_n`` are not
#: here: they have rules of their own (index bounds, index meaning through ``jnp.where``).
ELEMENTWISE_PRIMITIVES: frozenset[str] = frozenset({
    # arithmetic
    "add", "sub", "mul", "div", "rem", "neg", "abs", "sign", "max", "pow", "integer_pow", "square", "sqrt",
    "rsqrt", "cbrt", "nextafter",
    # exponentials, logarithms, trigonometry
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "sin", "cos", "tan", "asin", "acos", "atan",
    "atan2", "sinh", "cosh", "asinh", "acosh", "atanh",
    # special functions
    "erf", "erfc", "erf_inv", "lgamma", "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a",
    "random_gamma_grad", "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "zeta",
    # rounding and classification
    "floor", "ceil", "round", "is_finite",
    # logical and bitwise
    "not", "and", "or", "xor", "shift_left", "shift_right_arithmetic", "shift_right_logical", "population_count",
    "clz",
    # complex parts
    "real", "imag", "conj", "complex",
    # casts and copies (the index meaning of an index array survives them)
    "convert_element_type", "copy",
})

for _name in sorted(ELEMENTWISE_PRIMITIVES):
    register_rule(_name, elementwise)


def identity(ctx, eqn, ins) -> Decision:
    """An identity on values: each output has its input's layout, index meaning included."""
    return Decision(tuple(ins))


register_rule("stop_gradient", identity)
register_rule("optimization_barrier", identity)


@register_rule("split")
def split(ctx, eqn, ins) -> Decision:
    """``jnp.split``: each piece as a ``slice`` of it. Across the distributed axis every piece
    keeps the rows (and index columns cut with it); along it only the first piece does.
    """
    (lay,) = ins
    axis, sizes = eqn.params["axis"], tuple(eqn.params["sizes"])
    offsets = np.cumsum((0,) + sizes[:-1])
    if lay.kind is None:
        return Decision(tuple(Layout(None, 0, lay.index) for _ in sizes))
    if axis != lay.axis:
        across = columns_axis(lay, shape_of(eqn.invars[0]))
        if axis != across:  # cut across the rows elsewhere: each piece keeps the layout, columns gone with it
            lay = dataclasses.replace(lay, columns=None, columns_axis=None) if lay.columns else lay
            return Decision(tuple(lay for _ in sizes))
        return Decision(tuple(_columns_of(lay, int(o), s) for o, s in zip(offsets, sizes)))
    outs, notes = [], []
    for o, s in zip(offsets, sizes):
        if o == 0:
            outs.append(lay)
            continue
        outs.append(Layout(None, 0, lay.index))
        if lay.kind in ROWS and not notes:
            notes.append(f"split of the per-{lay.kind.value} axis in {where(eqn)}: every piece after the first "
                         "has its rows renumbered, layout lost")
    return Decision(tuple(outs), notes=tuple(notes))


@register_rule("unstack")
def unstack(ctx, eqn, ins) -> Decision:
    """Each piece ``x[i]`` along ``axis``, that axis gone. Across the distributed axis every
    piece keeps the rows (and the index an index row held); along it the rows are taken apart.
    """
    (lay,) = ins
    axis, n = eqn.params["axis"], len(eqn.outvars)
    if lay.kind is None:
        return Decision(tuple(Layout(None, 0, lay.index, lay.local) for _ in range(n)))
    if axis == lay.axis:
        notes = ()
        if lay.kind in ROWS:
            notes = (f"unstack of the per-{lay.kind.value} axis in {where(eqn)}: each piece is one rank-local "
                     "row, layout lost",)
        return Decision(tuple(Layout(None, 0, lay.index, local=True) for _ in range(n)), notes=notes)
    across = columns_axis(lay, shape_of(eqn.invars[0]))
    moved = lay.axis - (axis < lay.axis)
    return Decision(tuple(Layout(lay.kind, moved, lay.columns[i] if across == axis else lay.index)
                          for i in range(n)))


def _columns_of(lay: Layout, offset: int, size: int) -> Layout:
    """The layout of columns ``offset:offset + size`` of an array cut along its columns' axis."""
    if not lay.columns:
        return lay
    cols = lay.columns[offset:offset + size]
    if size == 1:  # one index column (pairs[:, :1]): what it points at
        return Layout(lay.kind, lay.axis, cols[0])
    return dataclasses.replace(lay, columns=cols, index=merge_index(cols) if None not in cols else None)


def _on_matrix_axes(lay: Layout, ndim: int) -> bool:
    """True when ``lay`` distributes one of the two matrix axes (the last two) of an operand."""
    return lay.kind is not None and lay.axis >= ndim - 2


def _couples_rows(eqn, what: str, kind: Kind) -> tuple[str, ...]:
    return (f"{eqn.primitive.name} in {where(eqn)} {what} over per-{kind.value} rows: a linear system coupling "
            "every rank's rows has no distributed meaning here, left rank-local",)


@register_rule("lu")
def lu(ctx, eqn, ins) -> Decision:
    """An LU factorisation, once per matrix of a batch: a batch axis of rows stays; a matrix
    whose rows or columns are atoms couples every rank's rows (recorded).
    """
    (lay,) = ins
    ndim = len(shape_of(eqn.invars[0]))
    n_out = len(eqn.outvars)
    if lay.kind is None:
        return Decision((REPLICATED,) * n_out)
    if _on_matrix_axes(lay, ndim):
        if lay.kind in ROWS:
            return Decision((REPLICATED,) * n_out, notes=_couples_rows(eqn, "factorises a matrix", lay.kind))
        return Decision((REPLICATED,) * n_out)  # a per-system matrix is the same on every rank
    return Decision((lay.plain(),) * n_out)


@register_rule("triangular_solve")
def triangular_solve(ctx, eqn, ins) -> Decision:
    """``a x = b`` (or ``x a = b``) with ``a`` triangular: each right-hand side, and each matrix
    of a batch, on its own. The solution keeps ``b``'s rows unless they are the axis solved along.
    """
    a, b = ins
    nd_a, nd_b = len(shape_of(eqn.invars[0])), len(shape_of(eqn.invars[1]))
    along = nd_b - 2 if eqn.params["left_side"] else nd_b - 1  # b's axis the solve runs along
    if a.kind in ROWS and _on_matrix_axes(a, nd_a):
        return Decision((REPLICATED,), notes=_couples_rows(eqn, "solves with a matrix", a.kind))
    if b.kind in ROWS and b.axis == along:
        return Decision((REPLICATED,), notes=_couples_rows(eqn, "solves along", b.kind))
    if b.kind is not None:
        return Decision((b.plain(),))
    if a.kind is not None and not _on_matrix_axes(a, nd_a):
        return Decision((a.plain(),))  # batch axes of a and b are the same axes
    return Decision((REPLICATED,))


@register_rule("custom_linear_solve")
def custom_linear_solve(ctx, eqn, ins) -> Decision:
    """``lax.custom_linear_solve`` (``jnp.linalg.solve``): the solution ``x`` has the layout of
    ``b``, as long as the operator and its solvers need no rule — applied to per-row values they
    then act on each row alone. An operator that does need one (a sum over atoms: a system
    coupling every rank's rows) is recorded and left rank-local; the equation is bound as traced.
    """
    lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
    n_consts = sum(lengths)
    b = tuple(ins[n_consts:])
    notes, start = [], 0
    for n, closed in zip(lengths, jaxprs):
        consts, start = tuple(ins[start:start + n]), start + n
        if closed is None:
            continue
        plan = ctx.analyse(closed.jaxpr, consts + b, closed.consts)
        notes.extend(plan.notes)
        if plan.active:
            kind = next((lay.kind for lay in consts + b if lay.kind in ROWS), Kind.NODE)
            return Decision((REPLICATED,) * len(eqn.outvars),
                            notes=tuple(notes) + _couples_rows(eqn, "solves a system", kind))
    return Decision(tuple(lay.plain() for lay in b), notes=tuple(notes))
