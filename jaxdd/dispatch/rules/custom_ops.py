"""Named ops declared on the spec: an opaque kernel's arguments and outputs transformed.

An :class:`~jaxdd.spec.OpAdapter` names a registered op (:func:`jaxdd.ops.register_op`)
and the transforms of its arguments (``GatherInputs``, ``SliceOwned``,
``GatherInputsFull``) and outputs (``ScatterOutputs``, ``AllReduceSum``,
``SliceOutputsOwned``). The kernel is re-bound whole (its derivative rule included), or
traced again when a transform changed an argument's shape.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...ops import (AllReduceSum, GatherInputs, GatherInputsFull, GraphParallelPolicy, ScatterOutputs,
                    SliceOutputsOwned, SliceOwned)
from ..decision import Decision
from ..equations import bind, shape_of, sub_jaxpr
from ..layouts import REPLICATED, Kind, Layout, rows_of
from ..report import DispatchError

__all__ = ["custom_op", "custom_op_graph_parallel"]


def custom_op(ctx, adapter, eqn, ins) -> Decision:
    """A named op with an :class:`~jaxdd.spec.OpAdapter`: its argument and output transforms.

    Args:
      ctx, eqn, ins: as for every dispatch rule (:data:`~jaxdd.dispatch.registry.Rule`).
      adapter: the op's OpAdapter.
    """
    jaxpr, _ = sub_jaxpr(eqn.params["jaxpr"])
    plan = ctx.analyse(jaxpr, ins)
    outs = list(plan.outs)
    for pos, tr in adapter.output_transforms.items():
        if pos >= len(outs):
            raise DispatchError(f"OpAdapter for {adapter.op}: output position {pos} but the op returns {len(outs)}")
        if isinstance(tr, ScatterOutputs):
            outs[pos] = Layout(Kind.NODE, 0)
        elif isinstance(tr, AllReduceSum):
            outs[pos] = REPLICATED
        elif isinstance(tr, SliceOutputsOwned):
            outs[pos] = Layout(Kind.NODE, 0)
    for pos in adapter.arg_transforms:
        if pos >= len(ins):
            raise DispatchError(f"OpAdapter for {adapter.op}: argument position {pos} but the op takes {len(ins)}")
    rt = ctx.runtime
    if isinstance(getattr(rt, "policy", None), GraphParallelPolicy):
        return custom_op_graph_parallel(ctx, adapter, eqn, ins, tuple(outs))

    def arg(x, tr):
        if isinstance(tr, GatherInputs):
            return rt.gather_inputs(x)
        if isinstance(tr, SliceOwned):
            return x[: rt.n_owned]
        if isinstance(tr, GatherInputsFull):
            return rt.gather_full(x)
        raise DispatchError(f"{type(tr).__name__} is an output transform; OpAdapter for {adapter.op} lists it "
                            "under arg_transforms")

    def out(y, tr):
        if isinstance(tr, ScatterOutputs):
            return rt.halo_correct(y)
        if isinstance(tr, AllReduceSum):
            return rt.all_reduce_sum(y, tr.replicated_consumer)
        if isinstance(tr, SliceOutputsOwned):  # this rank's block of the gathered rows, then the padding row
            start = jax.lax.axis_index(rt.axis_names) * rt.n_owned
            return jnp.concatenate([jax.lax.dynamic_slice_in_dim(y, start, rt.n_owned, axis=0), y[-1:]])
        raise DispatchError(f"{type(tr).__name__} is an input transform; OpAdapter for {adapter.op} lists it "
                            "under output_transforms")

    def apply(eqn, invals):
        invals = [arg(x, adapter.arg_transforms[i]) if i in adapter.arg_transforms else x
                  for i, x in enumerate(invals)]
        if any(getattr(x, "shape", None) != getattr(v.aval, "shape", None) for x, v in zip(invals, eqn.invars)):
            # A transform changed a shape (owned rows only): trace the kernel again on it.
            outvals = jax.tree_util.tree_leaves(adapter.op(*invals))
        else:
            outvals = bind(eqn, invals)
        return [out(y, adapter.output_transforms[i]) if i in adapter.output_transforms else y
                for i, y in enumerate(outvals)]

    reduced = any(isinstance(tr, AllReduceSum) for tr in adapter.output_transforms.values())
    return Decision(tuple(outs), apply, f"custom_op.{adapter.op}", replicates=reduced)


def custom_op_graph_parallel(ctx, adapter, eqn, ins, outs) -> Decision:
    """A kernel under graph parallelism sees every rank's rows: per-atom arguments
    (untransformed or ``GatherInputs``, whose halo meaning is "the rows the local edges
    read") arrive stacked in rank order and atom indices in that numbering, so senders
    and receivers agree. Per-atom results in that frame come back as this rank's block:
    ``ScatterOutputs`` sums every rank's partials (reduce-scatter), an untransformed one
    is sliced. ``SliceOwned``, ``GatherInputsFull``, ``SliceOutputsOwned`` and
    ``AllReduceSum`` keep their meaning.

    Args:
      ctx, eqn, ins: as for every dispatch rule (:data:`~jaxdd.dispatch.registry.Rule`).
      adapter: the op's OpAdapter.
      outs: the layouts of the op's outputs.
    """
    rt = ctx.runtime
    shapes = [shape_of(v) for v in eqn.invars]
    out_rows = [shape_of(v)[:1] for v in eqn.outvars]

    def arg(i, x):
        tr = adapter.arg_transforms.get(i)
        lay = ins[i]
        if isinstance(tr, SliceOwned):
            return x[: rt.n_owned]
        if isinstance(tr, GatherInputsFull):
            return rt.gather_full(x)
        if tr is not None and not isinstance(tr, GatherInputs):
            raise DispatchError(f"{type(tr).__name__} is an output transform; OpAdapter for {adapter.op} lists "
                                "it under arg_transforms")
        if rows_of(lay.index) is Kind.NODE:  # this rank's row numbers → stacked numbering (padding: one past)
            offset = jax.lax.axis_index(rt.axis_names) * rt.n_padded
            x = jnp.where(x < rt.n_padded, x + offset.astype(x.dtype), rt.n_all).astype(x.dtype)
        if lay.kind is Kind.NODE:
            x = rt.all_nodes(x, lay.axis)
        return x

    def out(i, y):
        tr = adapter.output_transforms.get(i)
        if isinstance(tr, AllReduceSum):
            return rt.all_reduce_sum(y, tr.replicated_consumer)
        if isinstance(tr, (GatherInputs, GatherInputsFull, SliceOwned)):
            raise DispatchError(f"{type(tr).__name__} is an input transform; OpAdapter for {adapter.op} lists it "
                                "under output_transforms")
        stacked = y.ndim > 0 and out_rows[i] and y.shape[0] != out_rows[i][0] and y.shape[0] >= rt.n_all
        if isinstance(tr, ScatterOutputs) and stacked:
            return rt.reduce_scatter(y)
        if isinstance(tr, SliceOutputsOwned) or stacked:  # this rank's block, then any rows after the stack
            start = jax.lax.axis_index(rt.axis_names) * rt.n_padded
            return jnp.concatenate([jax.lax.dynamic_slice_in_dim(y, start, rt.n_padded, axis=0), y[rt.n_all:]])
        return y

    def apply(eqn, invals):
        invals = [arg(i, x) for i, x in enumerate(invals)]
        if any(getattr(x, "shape", None) != shape for x, shape in zip(invals, shapes)):
            outvals = jax.tree_util.tree_leaves(adapter.op(*invals))  # traced again on the stacked rows
        else:
            outvals = bind(eqn, invals)
        return [out(i, y) for i, y in enumerate(outvals)]

    reduced = any(isinstance(tr, AllReduceSum) for tr in adapter.output_transforms.values())
    return Decision(outs, apply, f"custom_op.{adapter.op}", replicates=reduced)
