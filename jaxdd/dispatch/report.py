"""What the dispatch did to one traced program, and how it complains.

:class:`DispatchReport` counts the rules that fired and lists the fallbacks (guesses and
rank-local operations); :class:`DispatchError` refuses what cannot be distributed;
:class:`DispatchWarning` (issued by :func:`warn_fallbacks`) says the dispatch had to guess.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter

__all__ = ["DispatchError", "DispatchWarning", "DispatchReport", "warn_fallbacks"]


class DispatchError(ValueError):
    """A model does something the dispatch cannot distribute; the message says what and where."""


class DispatchWarning(UserWarning):
    """The dispatch had to guess (shape fallback) or left an operation rank-local."""


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
        self.counts[rule] += 1

    def note(self, message: str) -> None:
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


def warn_fallbacks(report: DispatchReport, model_name: str) -> None:
    """One :class:`DispatchWarning` listing the fallbacks of a traced program (none if there are none)."""
    if report.fallbacks:
        listing = "\n  ".join(report.fallbacks)
        warnings.warn(f"{model_name} under decomposition: the dispatch had to guess or leave operations rank-local:\n  "
                      f"{listing}\nCheck the result with jaxdd.validate, or say it explicitly with the intent verbs "
                      "(jaxdd.system_sum, jaxdd.to_local ...) or a helper adapter on the spec.", DispatchWarning,
                      stacklevel=4)  # the caller of DistributedModel
