"""The kind of each model output under decomposition (:class:`OutputKind`), and the warning
for an output whose kind is not declared."""

from __future__ import annotations

import enum
from typing import Any

from ..ops import SpecError

__all__ = ["OutputKind", "SpecWarning", "output_kind"]


class SpecWarning(UserWarning):
    """A spec is usable but incomplete (e.g. an output without a declared kind)."""


class OutputKind(str, enum.Enum):
    """Shape class of a model output under decomposition.

    PER_NODE: per atom, ``[n_atoms, *F]`` (``[n_padded, *F]`` on a rank).
    PER_GRAPH: per system, ``[n_systems, *F]``; per-rank partials are summed.
    GLOBAL: already correct on every rank; passed through.
    UNKNOWN: not declared; the shape decides (``shape[0] == n_padded``) with a warning.
    """

    PER_NODE = "per_node"
    PER_GRAPH = "per_graph"
    GLOBAL = "global"
    UNKNOWN = "unknown"


def output_kind(key: str, kind: Any) -> OutputKind:
    """``kind`` (an OutputKind or its value, e.g. ``"per_node"``) as an OutputKind; a
    SpecError naming the output ``key`` when it is none."""
    try:
        return OutputKind(kind)
    except ValueError:
        raise SpecError(
            f"output kind of {key!r} must be one of {[k.value for k in OutputKind]}, got {kind!r}"
        ) from None
