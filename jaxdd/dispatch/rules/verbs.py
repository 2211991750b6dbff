"""The distributed meaning of the intent verbs of :mod:`jaxdd.dispatch.intent`.

Each verb is a named ``jax.jit`` whose body is its single-device meaning; these rules,
registered under the verbs' names, give the meaning under decomposition instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..decision import Decision
from ..equations import bind, shape_of, where
from ..layouts import REPLICATED, ROWS, Kind, Layout
from ..masks import along
from ..registry import register_rule
from ..report import DispatchError

__all__ = ["to_local", "autograd_target", "system_sum", "system_sum_local", "refresh_neighbors", "scatter_to_owners"]


@register_rule("jaxdd::to_local")
def to_local(ctx, eqn, ins) -> Decision:
    """The value with its layout forgotten: no rule fires on what is computed from it."""
    return Decision((Layout(None, 0, local=True, deliberate=True),), bind, "verb.to_local")


@register_rule("jaxdd::autograd_target")
def autograd_target(ctx, eqn, ins) -> Decision:
    """An identity: positions handed to the model are already what forces are taken against."""
    return Decision((ins[0],), bind, "verb.autograd_target")


def _system_sum(ctx, eqn, ins, total: bool) -> Decision:
    lay = ins[0]
    rows = lay.kind if lay.kind in ROWS else None

    def apply(eqn, invals):
        rt = ctx.runtime
        values, index = invals
        if rows is not None:  # each atom (edge) counted on its owner's rank only
            mask = along(rt.row_mask(rows, values.shape[lay.axis]), values.ndim, lay.axis)
            values = jnp.where(mask, values, jnp.zeros((), values.dtype))
        (y,) = bind(eqn, [values, index])
        return [jax.lax.psum(y, rt.axis_names) if rows is not None and total else y]

    if total:
        return Decision((Layout(Kind.GRAPH, 0),), apply, "verb.system_sum", replicates=rows is not None)
    return Decision((Layout(local=rows is not None),), apply, "verb.system_sum_local")


@register_rule("jaxdd::system_sum")
def system_sum(ctx, eqn, ins) -> Decision:
    """Owned rows only, summed over ranks: the same per-system sums on every rank."""
    return _system_sum(ctx, eqn, ins, total=True)


@register_rule("jaxdd::system_sum_local")
def system_sum_local(ctx, eqn, ins) -> Decision:
    """Owned rows only, this rank's share (no communication)."""
    return _system_sum(ctx, eqn, ins, total=False)


def _per_atom(ctx, eqn, ins) -> Layout:
    """The layout of a per-atom verb argument: its own, or rows the caller says are atoms."""
    lay = ins[0]
    if lay.kind is Kind.NODE:
        return lay
    rows = shape_of(eqn.invars[0])[:1]
    if not rows or rows[0] < ctx.n_padded:
        raise DispatchError(
            f"{eqn.params.get('name')} takes per-atom values with one row per local atom ({ctx.n_padded}); got shape "
            f"{shape_of(eqn.invars[0])} in {where(eqn)}")
    return Layout(Kind.NODE, 0)


@register_rule("jaxdd::refresh_neighbors")
def refresh_neighbors(ctx, eqn, ins) -> Decision:
    """Ghost rows re-read from their owners."""
    lay = _per_atom(ctx, eqn, ins)
    return Decision((lay,), lambda eqn, invals: [ctx.runtime.halo_refresh(invals[0], lay.axis)],
                    "verb.refresh_neighbors")


@register_rule("jaxdd::scatter_to_owners")
def scatter_to_owners(ctx, eqn, ins) -> Decision:
    """Ghost partial sums added into their owners, then refreshed."""
    lay = _per_atom(ctx, eqn, ins)
    return Decision((lay,), lambda eqn, invals: [ctx.runtime.halo_correct(invals[0], lay.axis)],
                    "verb.scatter_to_owners")
