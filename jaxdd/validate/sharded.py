"""One sharded run of the validator: the model distributed over a mesh of devices under a spec,
and what the run produced (:class:`ShardedResult`: outputs or the error, the dispatch rules it
used, the partition's health and the halo's completeness)."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
from jax.sharding import AxisType, Mesh

from ..data import Batch
from ..dispatch import DispatchWarning
from ..model.protocol import model_config
from ..spec import MLIPSpec
from .diagnostics import diagnose, halo_completeness
from .report import HaloCompleteness

__all__ = ["ShardedResult", "run_sharded"]


@dataclasses.dataclass
class ShardedResult:
    """What one sharded run produced (in this process or a child).

    outputs: output key → array (None when the run raised). error: ``"Type: first line"`` of
    what it raised; diagnosis: what the error means. counts: dispatch rule → times used;
    fallbacks: values the dispatch could not follow. health: the partition's health.
    halo: the halo's completeness. owner: [V] rank that owns each atom row (-1: padding).
    """

    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None
    diagnosis: str | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    health: str | None = None
    halo: HaloCompleteness | None = None
    owner: np.ndarray | None = None


def run_sharded(model, batch: Batch, spec: MLIPSpec, outputs, devices) -> ShardedResult:
    """One distributed run of ``model`` on ``devices`` under ``spec``, with its diagnostics.

    Args:
        model: the model wrapper. batch: the sample. spec: the distribution spec to run under.
        outputs: the output keys to compute. devices: the mesh's devices, one rank each.

    Returns:
        The run's :class:`ShardedResult`; an exception of the run is caught into its ``error``.
    """
    from ..engine.distributed import DistributedModel, DomainConfig

    res = ShardedResult()
    mesh = Mesh(np.asarray(devices), ("dd",), axis_types=(AxisType.Auto,))
    nc = model_config(model).neighbor_config
    try:
        # Run to the end even where the dispatch could not follow a value, so that the numbers
        # can be compared and a fix found; judging still fails such an attempt (strict).
        dist = DistributedModel(model, DomainConfig(cutoff=nc.cutoff, skin=nc.skin, mesh=mesh, allow_unfollowed=True),
                                spec=spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DispatchWarning)  # reported through the attempt instead
            warnings.simplefilter("ignore", RuntimeWarning)
            out = dist(batch, outputs)
        res.outputs = {k: np.asarray(v) for k, v in out.items()}
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        res.diagnosis = diagnose(exc)
        dist = locals().get("dist")
    if dist is None:
        return res
    report = dist.dispatch_report
    if report is not None:
        res.counts = dict(report.counts)
        res.fallbacks = tuple(report.fallbacks)
    res.health = None if dist.health is None else str(dist.health)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the run above already planned this batch
            res.halo = halo_completeness(dist, batch)
            res.owner = dist.plan(batch)[0].owner
    except Exception:
        pass
    return res
