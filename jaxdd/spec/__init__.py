"""Distribution specs: how a single-device model runs under domain decomposition.

A model author declares distribution on an :class:`MLIPSpec` instead of coding it into the
model: the storage policy, adapters for opaque kernels and third-party helpers, and the
kind of each output. Specs are immutable and hashable (usable as static ``jax.jit``
arguments) and persist as version-2 JSON, the format of the PyTorch system jaxdd
re-imagines, so files read the same::

    spec = MLIPSpec.load("my_model_spec.json")
    spec.save("copy.json")

The shipped presets (``SPEC_MPNN_HALO`` ...) are stored once as JSON under ``specs/`` and
loaded here. Every error is a :class:`~jaxdd.ops.SpecError` with a message to act on.

Modules: :mod:`.outputs` (:class:`OutputKind`), :mod:`.compile_policy`,
:mod:`.distribution` (:class:`DistributionSpec`, :class:`OpAdapter`), :mod:`.mlip_spec`,
:mod:`.json_format` (reading spec files), :mod:`.presets` and :mod:`.frozen_map`. Beside them the
rest of what a model declares: :mod:`.model` (the :class:`~jaxdd.BaseModel` protocol),
:mod:`.protocol` (what every path that calls a model agrees on), :mod:`.adapters` (helper
adapters), :mod:`.context` (:class:`~jaxdd.DDContext`) and :mod:`.checkpoint` (model checkpoints).
"""

from __future__ import annotations

from ..ops import SpecError
from .compile_policy import FORCE_STRATEGIES, CompilePolicy
from .distribution import DEFAULT_SHARD_FIELDS, PER_ATOM_FIELDS, DistributionSpec, OpAdapter
from .frozen_map import FrozenMap  # a name of jaxdd.spec before it became a package
from .json_format import SPEC_VERSION
from .mlip_spec import MLIPSpec
from .outputs import OutputKind, SpecWarning
from .presets import (
    PRESETS,
    SPEC_DFTD3_HALO,
    SPEC_EWALD_HALO,
    SPEC_LJ_HALO,
    SPEC_MPNN_GP,
    SPEC_MPNN_HALO,
    SPEC_PME_HALO,
    SPEC_UMA_HALO,
)

__all__ = [
    "SPEC_VERSION",
    "SpecError",
    "PER_ATOM_FIELDS",
    "SpecWarning",
    "OutputKind",
    "OpAdapter",
    "CompilePolicy",
    "DistributionSpec",
    "MLIPSpec",
    "FORCE_STRATEGIES",
    "DEFAULT_SHARD_FIELDS",
    "PRESETS",
    "SPEC_MPNN_HALO",
    "SPEC_LJ_HALO",
    "SPEC_UMA_HALO",
    "SPEC_EWALD_HALO",
    "SPEC_PME_HALO",
    "SPEC_DFTD3_HALO",
    "SPEC_MPNN_GP",
]
