"""Auto-fix rule ``add_scatter_outputs``: a custom op's per-atom output holds ghost partial sums.

An opaque kernel that scatters per-edge terms onto atoms (messages onto receivers, pair
forces onto both ends) leaves, under decomposition, partial sums on the ghost rows of its
per-atom output: the contributions of this rank's edges to atoms another rank owns. Only
``ScatterOutputs`` on the op's ``OpAdapter`` sends them home (``halo_reverse`` then
``halo_forward``); without it the owners miss those contributions and every output built
on them differs.

The rule tests that hypothesis directly: for each op of the spec that the model calls and
each of its per-atom outputs with no output transform, it proposes the spec with
``ScatterOutputs`` added there. The validator re-runs the model under it; only a candidate
whose distributed result then equals the single-device one is reported as the cause.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ops import ScatterOutputs
from ..spec import MLIPSpec, OpAdapter
from .rule import FixCandidate, FixContext

__all__ = ["add_scatter_outputs", "untransformed_per_atom_outputs", "with_scatter_outputs"]


def untransformed_per_atom_outputs(ctx: FixContext) -> list[tuple[str, int]]:
    """(op name, output index) of each per-atom output, without an output transform, of an op
    that the spec adapts and the model calls; in the spec's op order, then index order.

    Per-atom: the output has one row per atom of the sample on one device. An output that
    already has another transform (``AllReduceSum``, ...) is the author's explicit choice
    and is left alone.

    Args:
      ctx: the FixContext of the failed attempt.
    """
    found = []
    for adapter in ctx.spec.distribution.custom_ops:
        shapes = ctx.op_outputs.get(adapter.op.name)
        if shapes is None:  # the model does not call it: nothing to learn
            continue
        for index, shape in enumerate(shapes):
            if index not in adapter.output_transforms and tuple(shape[:1]) == (ctx.n_atoms,):
                found.append((adapter.op.name, index))
    return found


def with_scatter_outputs(spec: MLIPSpec, sites: Sequence[tuple[str, int]]) -> MLIPSpec:
    """``spec`` with ``ScatterOutputs()`` on each (op name, output index) of ``sites``; every
    other transform of those adapters is kept."""
    adapters = []
    for adapter in spec.distribution.custom_ops:
        indices = [i for name, i in sites if name == adapter.op.name]
        if indices:
            outputs = dict(adapter.output_transforms)
            outputs.update({i: ScatterOutputs() for i in indices})
            adapters.append(OpAdapter(adapter.op, dict(adapter.arg_transforms), outputs))
    return spec.with_custom_ops(*adapters) if adapters else spec


def _transforms(indices: Sequence[int]) -> str:
    return "{" + ", ".join(f"{i}: ScatterOutputs()" for i in indices) + "}"


def _said(sites: Sequence[tuple[str, int]], hypothesis: bool) -> str:
    """One clause per op: the hypothesis (``may hold ... try``) or the confirmed cause and fix
    (``holds ... add ... on its OpAdapter``)."""
    by_op: dict[str, list[int]] = {}
    for name, i in sites:
        by_op.setdefault(name, []).append(i)
    clauses = []
    for name, indices in by_op.items():
        one = len(indices) == 1
        which = f"output {indices[0]}" if one else "outputs " + ", ".join(map(str, indices))
        if hypothesis:
            clauses.append(f"op {name!r} {which} may hold ghost partial sums: try output_transforms={_transforms(indices)}")
        else:
            clauses.append(f"op {name!r} {which} {'holds' if one else 'hold'} ghost partial sums: add "
                           f"output_transforms={_transforms(indices)} on its OpAdapter")
    return "; ".join(clauses)


def add_scatter_outputs(ctx: FixContext) -> list[FixCandidate]:
    """One candidate per untransformed per-atom op output (the precise cause, when one output
    is missing its transform), then one with all of them (when several are).

    Args:
      ctx: the FixContext of the failed attempt.
    """
    sites = untransformed_per_atom_outputs(ctx)
    groups = [[s] for s in sites] + ([sites] if len(sites) > 1 else [])
    return [FixCandidate(with_scatter_outputs(ctx.spec, g), _said(g, True), _said(g, False)) for g in groups]
