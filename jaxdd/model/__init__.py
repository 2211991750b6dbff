"""The model protocol: what a model wrapper declares and how every path calls it.

A wrapper mixes in :class:`BaseModel` and declares a :class:`ModelConfig` (its outputs, the
neighbour list it needs); how it distributes is declared apart, on its spec
(:mod:`jaxdd.spec`). Modules:

* :mod:`.base` — :class:`BaseModel`, :class:`ModelConfig`, :class:`NeighborConfig`, :class:`ModelOutputs`;
* :mod:`.species` — :class:`SpeciesModel`, the base of element-resolved models on a neighbour list;
* :mod:`.protocol` — what every path that calls a model agrees on (requested outputs, padding rows);
* :mod:`.context` — :class:`DDContext`, what a model may ask about the decomposition it runs under;
* :mod:`.checkpoint` — checkpoints of model wrappers (parameters, spec beside them).

``jaxdd.model`` was an import path of :mod:`.base` before this package: its names are here too.
"""

from __future__ import annotations

from .base import AUTOGRAD_OUTPUTS, BaseModel, ModelConfig, ModelOutputs, NeighborConfig, NeighborListFormat
from .checkpoint import CheckpointError
from .context import DDContext, current_dd_context, dd_scope
from .species import SpeciesModel

__all__ = [
    "AUTOGRAD_OUTPUTS",
    "BaseModel",
    "CheckpointError",
    "DDContext",
    "ModelConfig",
    "ModelOutputs",
    "NeighborConfig",
    "NeighborListFormat",
    "SpeciesModel",
    "current_dd_context",
    "dd_scope",
]
