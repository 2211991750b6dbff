"""The six kernel transforms: what the framework does to one input or output of an opaque
kernel (a named op declared on a spec by an :class:`~jaxdd.spec.OpAdapter`) under
decomposition. Immutable and hashable, like the policies.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .errors import SpecError
from .tagged import Tagged

__all__ = ["Transform", "GatherInputs", "GatherInputsFull", "SliceOwned", "ScatterOutputs", "AllReduceSum",
           "SliceOutputsOwned", "TRANSFORMS"]


@dataclasses.dataclass(frozen=True)
class Transform(Tagged):
    """What the framework does to one kernel input (before) or output (after); written to JSON
    as its ``type`` and its fields."""

    tag_key: ClassVar[str] = "type"
    type: ClassVar[str] = ""


@dataclasses.dataclass(frozen=True)
class GatherInputs(Transform):
    """Owned-only input ``[n_owned, *F]`` → halo-padded ``[n_padded, *F]`` (forward exchange)."""

    type: ClassVar[str] = "gather_inputs"


@dataclasses.dataclass(frozen=True)
class GatherInputsFull(Transform):
    """Sharded input → full ``[n_global + 1, *F]`` on every rank (all-gather; graph-parallel)."""

    type: ClassVar[str] = "gather_inputs_full"


@dataclasses.dataclass(frozen=True)
class SliceOwned(Transform):
    """Halo-padded input → owned rows ``[n_owned, *F]``, so each atom counts exactly once."""

    type: ClassVar[str] = "slice_owned"


@dataclasses.dataclass(frozen=True)
class ScatterOutputs(Transform):
    """Per-atom output with ghost partial sums → ``halo_reverse`` then ``halo_forward``."""

    type: ClassVar[str] = "scatter_outputs"


@dataclasses.dataclass(frozen=True)
class AllReduceSum(Transform):
    """Per-rank partial → sum over all ranks (``psum``).

    replicated_consumer: every rank consumes the reduced value identically (e.g. a
    replicated PME charge mesh that each rank transforms whole), so every rank's
    cotangent of the sum is the same. The backward pass then needs no collective: it is
    ``n_ranks`` times the rank's own cotangent, which equals the ``psum`` of the ranks'
    equal cotangents (jaxdd differentiates each rank's share ``E / n_ranks`` of a
    replicated energy, so this is the PyTorch system's identity backward). The op is then
    differentiable in reverse mode only. Leave it False when any rank uses the sum in a
    rank-dependent way (e.g. interpolating it at its own atoms): the gradient would be wrong.
    """

    replicated_consumer: bool = False
    type: ClassVar[str] = "all_reduce_sum"

    def __post_init__(self):
        if not isinstance(self.replicated_consumer, bool):
            raise SpecError(f"AllReduceSum.replicated_consumer must be a bool, got {self.replicated_consumer!r}")


@dataclasses.dataclass(frozen=True)
class SliceOutputsOwned(Transform):
    """Full ``[n_global + 1, F]`` output → this rank's ``[n_owned + 1, F]`` rows."""

    type: ClassVar[str] = "slice_outputs_owned"


#: JSON ``type`` → transform class.
TRANSFORMS: dict[str, type[Transform]] = {
    cls.type: cls
    for cls in (GatherInputs, GatherInputsFull, SliceOwned, ScatterOutputs, AllReduceSum, SliceOutputsOwned)
}
