"""The validator: prove that a model distributed equals the model on one device.

``trace_and_validate(factory, sample)`` runs the plain model on one device and the
distributed model on a real mesh (``shard_map`` over ``world_size`` devices, virtual CPU
devices in a child process when there are fewer), compares every output with a
partition-invariant metric, tries rule-based fixes of the spec, and explains failures
(halo completeness, undeclared per-system helpers, errors translated into a diagnosis).
Command line: ``python -m jaxdd.validate MODULE:FACTORY``.
"""

from .compare import KeyDiff, compare_outputs, diff
from .diagnostics import HelperRecorder, diagnose, halo_completeness, helper_diagnostics, watched_modules
from .report import Attempt, HaloCompleteness, HelperDiagnostic, TraceReport
from .runner import FIX_RULES, ModelFactoryError, trace_and_validate

__all__ = [
    "Attempt",
    "FIX_RULES",
    "HaloCompleteness",
    "HelperDiagnostic",
    "HelperRecorder",
    "KeyDiff",
    "ModelFactoryError",
    "TraceReport",
    "compare_outputs",
    "diagnose",
    "diff",
    "halo_completeness",
    "helper_diagnostics",
    "trace_and_validate",
    "watched_modules",
]
