"""Storage policies, the six kernel transforms, and the named-op registry.

A *storage policy* (:mod:`jaxdd.ops.policies`) says how per-atom arrays live on each
rank; a *transform* (:mod:`jaxdd.ops.transforms`) says what the framework does to one
input or output of an opaque kernel under decomposition; a *named op*
(:mod:`jaxdd.ops.registry`, ``"namespace::op"``) is a kernel the dispatch cannot see into,
declared on a spec by an :class:`~jaxdd.spec.OpAdapter`; :mod:`jaxdd.ops.sharding` matches
the per-rank types of a kernel's arguments. Everything here is immutable and hashable, so
specs holding them can be static arguments of ``jax.jit``. All errors are :class:`SpecError`.
"""

from .errors import SpecError
from .policies import POLICIES, GraphParallelPolicy, HaloRefreshPolicy, HaloStoragePolicy, StoragePolicy
from .registry import OpHandle, get_op, op_providers, register_op, register_op_namespace, registered_ops
from .sharding import match_varying, varying_axes
from .transforms import (TRANSFORMS, AllReduceSum, GatherInputs, GatherInputsFull, ScatterOutputs,
                         SliceOutputsOwned, SliceOwned, Transform)

__all__ = [
    "SpecError",
    "StoragePolicy",
    "HaloStoragePolicy",
    "HaloRefreshPolicy",
    "GraphParallelPolicy",
    "POLICIES",
    "Transform",
    "GatherInputs",
    "GatherInputsFull",
    "SliceOwned",
    "ScatterOutputs",
    "AllReduceSum",
    "SliceOutputsOwned",
    "TRANSFORMS",
    "OpHandle",
    "register_op",
    "get_op",
    "registered_ops",
    "register_op_namespace",
    "op_providers",
    "varying_axes",
    "match_varying",
]
