"""What the dispatch did to one traced program, and how it complains.

:class:`DispatchReport` counts the rules that fired and lists the fallbacks (guesses and
rank-local operations); :class:`DispatchError` refuses what cannot be distributed;
:func:`unfollowed_error` refuses a model whose values it could not follow (the default), and
:class:`DispatchWarning` (issued by :func:`warn_fallbacks`) lists them when the user allowed it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

__all__ = ["DispatchError", "DispatchWarning", "DispatchReport", "warn_fallbacks", "unfollowed_error"]


class DispatchError(ValueError):
    """A model does something the dispatch cannot distribute; the message says what and where."""


class DispatchWarning(UserWarning):
    """The dispatch had to guess (shape fallback) or left an operation rank-local, and the user
    allowed it (``DomainConfig(allow_unfollowed=True)``)."""


@dataclasses.dataclass
class DispatchReport:
    """What the dispatch did to one traced program.

    counts: rule name → times applied (``scatter_add.halo_correction``, ``reduce.sum`` ...).
    fallbacks: places where shape decided a layout, or an operation over atoms was left
    rank-local (each may be wrong under decomposition). policy: the storage policy used.
    """

    policy: object = None
    counts: Counter = dataclasses.field(default_factory=Counter)
    fallbacks: list = dataclasses.field(default_factory=list)

    def count(self, rule: str) -> None:
        """Count one application of ``rule`` (its name, e.g. ``"reduce.sum"``)."""
        self.counts[rule] += 1

    def note(self, message: str) -> None:
        """Record ``message`` as a fallback (once)."""
        if message not in self.fallbacks:
            self.fallbacks.append(message)

    def fired(self, prefix: str) -> int:
        """Total applications of the rules whose names start with ``prefix``."""
        return sum(n for k, n in self.counts.items() if k.startswith(prefix))

    def __str__(self) -> str:
        rows = [f"dispatch under {self.policy}:"]
        rows += [f"  {k}: {n}" for k, n in sorted(self.counts.items())] or ["  no rule fired"]
        rows += [f"  fallback: {m}" for m in self.fallbacks]
        return "\n".join(rows)


#: What to do about values the dispatch could not follow, said once for errors and warnings.
_WHAT_TO_DO = ("Say what they are: an intent verb (jaxdd.system_sum for a per-system sum, jaxdd.to_local for a "
               "deliberately rank-local value), a helper adapter on the spec (OpAdapter / PythonAdapter), or a "
               "rule for the primitive (jaxdd.register_rule); see docs/dispatch.md")


def unfollowed_error(report: DispatchReport, model_name: str) -> DispatchError:
    """The error refusing a program whose values the dispatch could not follow: each place
    with the user's file and line, and what to declare.

    Args:
      report: the program's DispatchReport (its ``fallbacks``).
      model_name: the model, for the message.
    """
    listing = "".join(f"\n  - {m}" for m in report.fallbacks)
    return DispatchError(
        f"{model_name} under decomposition: the dispatch could not follow these values, so the result could "
        f"differ from one device:{listing}\n{_WHAT_TO_DO}. DomainConfig(allow_unfollowed=True) runs it anyway "
        "(check it with jaxdd.validate)."
    )


def warn_fallbacks(report: DispatchReport, model_name: str) -> None:
    """One :class:`DispatchWarning` listing the fallbacks of a traced program (none if there are
    none); for a model run with ``DomainConfig(allow_unfollowed=True)``.

    Args:
      report: the program's DispatchReport (its ``fallbacks``).
      model_name: the model, for the message.
    """
    if report.fallbacks:
        listing = "\n  ".join(report.fallbacks)
        warnings.warn(f"{model_name} under decomposition (allow_unfollowed=True): the dispatch had to guess or leave "
                      f"operations rank-local:\n  {listing}\nCheck the result with jaxdd.validate. {_WHAT_TO_DO}.",
                      DispatchWarning, stacklevel=4)  # the caller of DistributedModel
