"""The validator's auto-fix rules about the storage policy and the all-reduced outputs."""

from __future__ import annotations

import numpy as np

from ..ops import HaloStoragePolicy
from ..spec import OutputKind
from .rule import FixCandidate, FixContext

__all__ = ["add_all_reduce", "drop_extra_all_reduce", "halo_correction_to_local"]

# Outputs the framework derives itself (psum of the energy, autograd): never all-reduced by a rule.
_AUTOGRAD = ("energy", "forces", "stress")


def halo_correction_to_local(ctx: FixContext) -> list[FixCandidate]:
    """A halo correction fired and outputs still differ: the model probably builds its own
    graph, so scatters stay local over a ghost shell as many layers deep as corrections fired.

    Args:
      ctx: the FixContext of the failed attempt.
    """
    spec = ctx.spec
    policy = spec.policy
    # Sums onto ghost-holding rows and onto the list's receivers both exchange.
    counts = ctx.attempt.handler_counts
    fired = counts.get("scatter_add.halo_correction", 0) + counts.get("scatter_add.owned_rows", 0)
    if not (isinstance(policy, HaloStoragePolicy) and policy.scatter_mode == "halo_correction" and fired):
        return []
    layers = max(fired, 1)
    return [FixCandidate(
        spec.with_policy(HaloStoragePolicy(scatter_mode="local", gather_mode="local", halo_layers=layers)),
        f"scatters stay local over a ghost shell {layers} layer(s) deep",
        f"the model's scatters do not follow the halo's edges (it builds its own graph): use "
        f"HaloStoragePolicy(scatter_mode='local', gather_mode='local', halo_layers={layers})")]


# What the dispatch writes when it could not follow a value (DispatchReport.fallbacks).
_UNFOLLOWED = ("unknown provenance", "left rank-local", "layout lost", "shape fallback")


def deep_halo_for_unfollowed_values(ctx: FixContext) -> list[FixCandidate]:
    """The dispatch reported values it could not follow (indices of unknown provenance, a
    layout lost) and outputs differ: run the model unchanged on each rank over a ghost shell as
    many layers deep as its scatters of such values (at least one), scatters and gathers local."""
    spec = ctx.spec
    policy = spec.policy
    unfollowed = [m for m in ctx.attempt.fallbacks if any(k in m for k in _UNFOLLOWED)]
    if not (isinstance(policy, HaloStoragePolicy) and policy.scatter_mode != "local" and unfollowed):
        return []
    layers = max(1, sum(1 for m in unfollowed if "scatter" in m))
    return [FixCandidate(
        spec.with_policy(HaloStoragePolicy(scatter_mode="local", gather_mode="local", halo_layers=layers)),
        f"scatters stay local over a ghost shell {layers} layer(s) deep (the dispatch could not follow "
        f"{len(unfollowed)} value(s))",
        f"the dispatch could not follow {len(unfollowed)} value(s) of the model (first: {unfollowed[0]}): use "
        f"HaloStoragePolicy(scatter_mode='local', gather_mode='local', halo_layers={layers}), or build the "
        "indices so the dispatch can follow them (docs/dispatch.md)")]


def add_all_reduce(ctx: FixContext) -> list[FixCandidate]:
    """Per-system outputs other than energy that differ by >= 1e-3 relative are per-rank
    partials: sum them across ranks.

    Args:
      ctx: the FixContext of the failed attempt.
    """
    spec, ref = ctx.spec, ctx.reference
    n_rows = np.shape(ref.get("forces", ()))[:1]
    keys = [k for k, d in ctx.attempt.diffs.items()
            if k not in _AUTOGRAD and k not in spec.all_reduce_outputs and d.rel >= 1e-3
            and spec.kind_of(k) in (OutputKind.PER_GRAPH, OutputKind.UNKNOWN)
            and np.ndim(ref[k]) >= 1 and np.shape(ref[k])[:1] != n_rows]
    if not keys:
        return []
    return [FixCandidate(spec.with_all_reduce(*keys), f"sum the per-rank partials of {keys} across ranks",
                         f"outputs {keys} are per-rank partial sums: list them in all_reduce_outputs")]


def drop_extra_all_reduce(ctx: FixContext) -> list[FixCandidate]:
    """Keys in ``all_reduce_outputs`` that come out about ``world_size`` times the reference
    were summed twice: drop them.

    Args:
      ctx: the FixContext of the failed attempt.
    """
    if ctx.outputs is None:
        return []
    spec, n = ctx.spec, ctx.world_size
    blown = []
    for k in spec.all_reduce_outputs:
        d = ctx.attempt.diffs.get(k)
        if d is None or d.passed or k not in ctx.outputs:
            continue
        scale = float(np.max(np.abs(ctx.reference[k]))) or 1.0
        ratio = float(np.max(np.abs(ctx.outputs[k]))) / scale
        if d.rel > 0.5 and abs(ratio - n) <= 0.25 * n:
            blown.append(k)
    if not blown:
        return []
    return [FixCandidate(spec.without_all_reduce(*blown), f"{blown} came out ~{n}x the reference: they were summed twice",
                         f"outputs {blown} are already complete on every rank: remove them from all_reduce_outputs")]
