"""Shape ops: where the distributed axis goes through broadcasts, reshapes, transposes,
slices, concatenation, padding, sorting; and ``iota`` (the shape fallback's one guess).

A rule keeps the tag when the rows stay where they were; when rows are renumbered (a
non-prefix slice, a sort, a merged axis) the layout is lost, and that is recorded.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..decision import Decision
from ..equations import shape_of, where
from ..layouts import REPLICATED, ROWS, Kind, Layout, columns_axis, merge_index
from ..registry import register_rule
from .elementwise import elementwise

__all__ = ["broadcast_in_dim", "reshape", "squeeze", "transpose", "slice_", "dynamic_slice", "dynamic_update_slice",
           "concatenate", "stack", "pad", "iota", "sort", "is_iota"]


def _lost(lay: Layout, why: str = "") -> Decision:
    """One output whose layout is lost (untagged, in ``lay``'s index space); ``why`` is noted
    when ``lay`` was per-row (a fallback the report shows)."""
    return Decision((Layout(None, 0, lay.index),), notes=(why,) if why and lay.kind in ROWS else ())


@register_rule("broadcast_in_dim")
def broadcast_in_dim(ctx, eqn, ins) -> Decision:
    """A tagged axis keeps its tag where the broadcast keeps its length."""
    lay = ins[0]
    if lay.kind is None:
        return _lost(lay)
    dims = eqn.params["broadcast_dimensions"]
    ishape, oshape = shape_of(eqn.invars[0]), eqn.params["shape"]
    a = dims[lay.axis]
    if oshape[a] != ishape[lay.axis]:
        return _lost(lay)
    return Decision((Layout(lay.kind, a, lay.index),))


@register_rule("reshape")
def reshape(ctx, eqn, ins) -> Decision:
    """The tagged axis keeps its tag where the reshape leaves it whole; merged or split, the layout is lost."""
    lay = ins[0]
    if lay.kind is None:
        return _lost(lay)
    ishape, oshape = shape_of(eqn.invars[0]), tuple(eqn.params["new_sizes"])
    before = int(np.prod(ishape[: lay.axis], dtype=np.int64))
    for j in range(len(oshape)):
        if int(np.prod(oshape[:j], dtype=np.int64)) == before and oshape[j] == ishape[lay.axis]:
            return Decision((Layout(lay.kind, j, lay.index),))
    return _lost(lay, f"reshape {ishape}->{oshape} merges the per-{lay.kind.value} axis in {where(eqn)}: layout lost")


@register_rule("squeeze")
def squeeze(ctx, eqn, ins) -> Decision:
    """The tagged axis keeps its tag, renumbered past the squeezed axes."""
    lay = ins[0]
    dims = tuple(eqn.params["dimensions"])
    if lay.kind is None or lay.axis in dims:
        return _lost(lay)
    return Decision((Layout(lay.kind, lay.axis - sum(1 for d in dims if d < lay.axis), lay.index),))


@register_rule("transpose")
def transpose(ctx, eqn, ins) -> Decision:
    """The tagged axis keeps its tag at its new position."""
    lay = ins[0]
    if lay.kind is None:
        return Decision((lay,))
    return Decision((Layout(lay.kind, tuple(eqn.params["permutation"]).index(lay.axis), lay.index),))


@register_rule("slice")
def slice_(ctx, eqn, ins) -> Decision:
    """A prefix of the rows keeps every row where it was; any other slice renumbers them."""
    lay = ins[0]
    if lay.kind is None:
        return _lost(lay)
    a = lay.axis
    start, limit = eqn.params["start_indices"][a], eqn.params["limit_indices"][a]
    strides = eqn.params.get("strides") or (1,) * len(eqn.params["start_indices"])
    full = shape_of(eqn.invars[0])[a]
    if start == 0 and strides[a] == 1:
        across = columns_axis(lay, shape_of(eqn.invars[0]))
        if across is not None and across != a:
            c0, c1 = eqn.params["start_indices"][across], eqn.params["limit_indices"][across]
            if c1 - c0 == 1:  # one index column (pairs[:, 0]): what it points at
                return Decision((Layout(lay.kind, a, lay.columns[c0]),))
        return Decision((lay,))
    return _lost(lay, f"slice [{start}:{limit}:{strides[a]}] of the per-{lay.kind.value} axis ({full} rows) in "
                 f"{where(eqn)}: rows renumbered, layout lost")


@register_rule("dynamic_slice")
def dynamic_slice(ctx, eqn, ins) -> Decision:
    """A slice that keeps the whole tagged axis keeps its layout; any other picks rank-local rows."""
    lay = ins[0]
    if lay.kind is None:
        return _lost(lay)
    if eqn.params["slice_sizes"][lay.axis] == shape_of(eqn.invars[0])[lay.axis]:
        return Decision((lay,))
    return _lost(lay, f"dynamic_slice of the per-{lay.kind.value} axis in {where(eqn)} picks rank-local rows: "
                 "layout lost")


@register_rule("dynamic_update_slice")
def dynamic_update_slice(ctx, eqn, ins) -> Decision:
    """The operand's layout."""
    return Decision((ins[0],))


@register_rule("concatenate")
def concatenate(ctx, eqn, ins) -> Decision:
    """Rows appended after tagged rows keep their place; index columns side by side keep
    what each column points at.
    """
    dim = eqn.params["dimension"]
    first = ins[0]
    oshape = shape_of(eqn.outvars[0])
    if dim == len(oshape) - 1 and oshape[dim] <= 8 and any(lay.index is not None or lay.columns for lay in ins):
        # Index columns side by side (x.at[receivers, kind]): keep what each column points at.
        columns = ()
        for lay, v in zip(ins, eqn.invars):
            width = shape_of(v)[dim]
            columns += lay.columns if lay.columns and len(lay.columns) == width else (lay.index,) * width
        d = elementwise(ctx, eqn, ins)
        return Decision((dataclasses.replace(d.outs[0], columns=columns),), notes=d.notes)
    if first.kind is not None and first.axis == dim:
        return Decision((first,))
    # Per-system rows are the same on every rank: put after other rows they are just replicated.
    along = [lay for lay in ins if lay.kind in ROWS and lay.axis == dim]
    if along:
        return Decision((REPLICATED,), notes=(
            f"concatenate puts per-{along[0].kind.value} rows after other rows in {where(eqn)}: layout lost",))
    if first.kind is not None and all((lay.kind, lay.axis) == (first.kind, first.axis) for lay in ins):
        # Arrays distributed alike, side by side along another axis (jnp.concatenate([s[None],
        # r[None]])): the rows stay, and so does an index meaning every input shares.
        index, notes = _shared_index(ins, eqn)
        out = Layout(first.kind, first.axis, index)
        if oshape[dim] <= 8 and any(lay.index is not None for lay in ins):
            # Index arrays as rows ([2, n_edges]): keep what each row points at.
            columns = ()
            for lay, v in zip(ins, eqn.invars):
                width = shape_of(v)[dim]
                same = columns_axis(lay, shape_of(v)) == dim
                columns += lay.columns if same else (lay.index,) * width
            out = dataclasses.replace(out, columns=columns, columns_axis=dim)
        return Decision((out,), notes=notes)
    return elementwise(ctx, eqn, ins)


def _shared_index(ins, eqn) -> tuple[Kind | None, tuple[str, ...]]:
    """The index meaning of index arrays put together as rows: theirs when they all share one,
    else none (and a note saying so)."""
    indices = {lay.index for lay in ins}
    merged = merge_index(indices)  # owned rows beside other node rows: node rows
    if len(indices) == 1 or (merged is not None and None not in indices):
        return merged, ()
    return None, (f"{eqn.primitive.name} of indices into different kinds {sorted(str(i) for i in indices)} as rows "
                  f"in {where(eqn)}: index meaning lost; put them side by side as columns (axis=-1) instead",)


@register_rule("stack")
def stack(ctx, eqn, ins) -> Decision:
    """``jnp.stack``: each input gains a new axis, then they sit side by side along it. Index
    arrays stacked as the last axis (``jnp.stack([senders, receivers], -1)``) keep what each
    column points at; stacked as rows they keep their index kind when all inputs share it.
    """
    axis = eqn.params["axis"]
    oshape = shape_of(eqn.outvars[0])
    grown = [lay if lay.kind is None else Layout(lay.kind, lay.axis + (lay.axis >= axis), lay.index, columns=None)
             for lay in ins]
    rows = [lay for lay in grown if lay.kind is not None]
    out = rows[0] if rows else Layout(None, 0, ins[0].index, any(lay.local for lay in ins))
    for lay in grown[1:]:
        if lay.kind is not None and (lay.kind, lay.axis) != (out.kind, out.axis) and out.kind is not None:
            return Decision((REPLICATED,), notes=(
                f"stack of values distributed along different axes in {where(eqn)}: layout lost",))
    index, notes = _shared_index(ins, eqn)
    if axis == len(oshape) - 1 and oshape[axis] <= 8 and any(lay.index is not None for lay in ins):
        return Decision((dataclasses.replace(out, index=index, columns=tuple(lay.index for lay in ins)),))
    if out.kind is not None and oshape[axis] <= 8 and any(lay.index is not None for lay in ins):
        # Index arrays stacked as rows (jnp.stack([receivers, senders])): keep what each row points at.
        return Decision((dataclasses.replace(out, index=index, columns=tuple(lay.index for lay in ins),
                                             columns_axis=axis),), notes=notes)
    if notes:
        out = dataclasses.replace(out, index=None)
    return Decision((dataclasses.replace(out, columns=None),), notes=notes)


@register_rule("pad")
def pad(ctx, eqn, ins) -> Decision:
    """Padding after the tagged rows keeps them in place; any other shifts them and the layout is lost."""
    lay = ins[0]
    if lay.kind is None:
        return Decision((REPLICATED,))
    lo, _, interior = eqn.params["padding_config"][lay.axis]
    if lo == 0 and interior == 0:
        return Decision((lay,))
    return Decision((REPLICATED,), notes=(f"pad shifts the per-{lay.kind.value} rows in {where(eqn)}: layout lost",))


@register_rule("iota")
def iota(ctx, eqn, ins) -> Decision:
    """An ``iota`` as long as the local rows (or edges) is taken for their indices: a recorded guess."""
    shape, dim = tuple(eqn.params["shape"]), eqn.params["dimension"]
    kind = ctx.fallback_kind(shape[dim])
    if kind is None:
        return Decision((REPLICATED,))
    return Decision((Layout(kind, dim, kind),), notes=(
        f"iota of {shape[dim]} rows taken as per-{kind.value} indices (shape fallback) in {where(eqn)}",), guess=True)


@register_rule("sort")
def sort(ctx, eqn, ins) -> Decision:
    """A sort along edge rows (``argsort(senders)``, mlip's ``Graph.sort_edges``) reorders this
    rank's edges among themselves: every edge lives on exactly one rank, so the outputs are
    this rank's edges in another order (``permuted``), index values still pointing where they
    did, and an ``iota`` sorted with them (``argsort``'s payload) the permutation. Outside a
    deep halo that is all: a sum over permuted edges counts every row, since each is this
    rank's own. Along atom rows, or in a deep halo, the layout is lost (recorded).
    """
    dim = eqn.params["dimension"]
    tagged = [lay for lay in ins if lay.kind in ROWS and lay.axis == dim]
    if not tagged:
        return elementwise(ctx, eqn, ins)
    deep = ctx.runtime is not None and not ctx.runtime.receivers_owned
    if all(lay.kind is Kind.EDGE for lay in tagged) and not deep:
        n = shape_of(eqn.invars[0])[dim]
        outs, confirms = [], []
        for i, (lay, v) in enumerate(zip(ins, eqn.invars)):
            if not lay.local and is_iota(ctx, v, dim, n):  # argsort's payload: the permutation
                outs.append(Layout(Kind.EDGE, dim, Kind.EDGE, permuted=True))
                confirms.append(i)
            elif lay.kind is Kind.EDGE and lay.axis == dim:
                outs.append(Layout(Kind.EDGE, dim, lay.index, permuted=True))
            else:
                return Decision((REPLICATED,) * len(eqn.outvars), notes=(
                    f"sort along the per-edge axis in {where(eqn)} carries a value that is not per edge: "
                    "layout lost",))
        return Decision(tuple(outs), confirms=tuple(confirms))
    return Decision((REPLICATED,) * len(eqn.outvars), notes=(
        f"sort along the per-{tagged[0].kind.value} axis in {where(eqn)} reorders rows: layout lost",))


def is_iota(ctx, var, dim: int, n: int) -> bool:
    """Whether ``var`` is the constant ``0, 1, ..., n - 1`` along ``dim`` (a constant the dispatcher ``ctx`` knows)."""
    x = ctx.constant(var)
    if x is None or x.ndim <= dim or x.shape[dim] != n:
        return False
    ramp = np.arange(n).reshape((1,) * dim + (-1,) + (1,) * (x.ndim - dim - 1))
    return bool(np.all(x == ramp))
