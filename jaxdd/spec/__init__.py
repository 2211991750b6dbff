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
:mod:`.json_format` (reading spec files), :mod:`.presets`, :mod:`.frozen_map` and :mod:`.adapters`
(adapters of third-party helpers). What a model declares — the :class:`~jaxdd.BaseModel` protocol,
the species base, the :class:`~jaxdd.DDContext` and checkpoints — is :mod:`jaxdd.model`; its earlier
paths here (``jaxdd.spec.model`` ...) still import, with a DeprecationWarning.
"""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    """The earlier paths of the model protocol's modules (``jaxdd.spec.model`` ...): the modules
    of :mod:`jaxdd.model`, through the finder :mod:`jaxdd` installs (with a DeprecationWarning)."""
    if name in ("model", "protocol", "checkpoint", "context"):
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
