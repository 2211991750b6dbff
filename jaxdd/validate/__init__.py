"""The validator: prove that a model distributed equals the model on one device.

``trace_and_validate(factory, sample)`` runs the plain model on one device and the
distributed model on a real mesh (``shard_map`` over ``world_size`` devices, virtual CPU
devices in a child process when there are fewer), compares every output with a
partition-invariant metric, tries rule-based fixes of the spec (a registry of rules,
``FIX_RULES``, that ``register_fix_rule`` extends), and explains failures (halo
completeness, undeclared per-system helpers, an op output missing ``ScatterOutputs``,
errors translated into a diagnosis).
Command line: ``python -m jaxdd.validate MODULE:FACTORY``.
"""

from .compare import KeyDiff, compare_outputs, diff
from .diagnostics import HelperRecorder, diagnose, halo_completeness, helper_diagnostics, watched_modules
from .factory import ModelFactoryError
from .ghost_sums import add_scatter_outputs, untransformed_per_atom_outputs, with_scatter_outputs
from .op_calls import named_op_outputs
from .report import Attempt, HaloCompleteness, HelperDiagnostic, TraceReport
from .rule import FixCandidate, FixContext, FixRule
from .rules import FIX_RULES, FixRuleRegistry, register_fix_rule
from .runner import trace_and_validate

__all__ = [
    "Attempt",
    "FIX_RULES",
    "FixCandidate",
    "FixContext",
    "FixRule",
    "FixRuleRegistry",
    "HaloCompleteness",
    "HelperDiagnostic",
    "HelperRecorder",
    "KeyDiff",
    "ModelFactoryError",
    "TraceReport",
    "add_scatter_outputs",
    "compare_outputs",
    "diagnose",
    "diff",
    "halo_completeness",
    "helper_diagnostics",
    "named_op_outputs",
    "register_fix_rule",
    "trace_and_validate",
    "untransformed_per_atom_outputs",
    "watched_modules",
    "with_scatter_outputs",
]
