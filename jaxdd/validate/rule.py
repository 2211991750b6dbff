"""What an auto-fix rule of the validator is: it reads a failed attempt and proposes specs.

A rule is a pure function ``propose(ctx) -> iterable of FixCandidate``. The validator runs
each candidate spec; the first that passes wins, and its ``diagnosis`` becomes the report's
explanation of what was wrong with the starting spec. A candidate that fails is evidence
against its hypothesis and is never reported as the cause.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from ..spec import MLIPSpec
from .report import Attempt

__all__ = ["FixCandidate", "FixContext", "FixRule"]


@dataclasses.dataclass(frozen=True)
class FixContext:
    """Everything a rule may read about one failed attempt.

    attempt: the failed attempt (its ``spec``, per-output ``diffs``, dispatch ``handler_counts``).
    outputs: what the distributed run returned (key -> array), None when it raised.
    reference: the single-device outputs (key -> array).
    world_size: number of ranks of the sharded runs.
    n_atoms: atoms of the sample (rows of a per-atom array on one device).
    op_outputs: named op ("namespace::op") the model's single-device program calls -> the
        shape of each of its outputs, in output order (first call of the op).
    """

    attempt: Attempt
    outputs: Mapping[str, np.ndarray] | None
    reference: Mapping[str, np.ndarray]
    world_size: int
    n_atoms: int = 0
    op_outputs: Mapping[str, tuple[tuple[int, ...], ...]] = dataclasses.field(default_factory=dict)

    @property
    def spec(self) -> MLIPSpec:
        """The spec of the failed attempt (the one a candidate modifies)."""
        return self.attempt.spec


@dataclasses.dataclass(frozen=True)
class FixCandidate:
    """One spec to try. why: the hypothesis, shown in the attempt's rationale. diagnosis: what
    was wrong and how to fix it, stated as fact once the candidate passes."""

    spec: MLIPSpec
    why: str
    diagnosis: str | None = None


@dataclasses.dataclass(frozen=True)
class FixRule:
    """A named auto-fix rule. propose(ctx) -> candidates, best first; none when it does not apply.
    description: one line for the docs and listings."""

    name: str
    propose: Callable[[FixContext], Iterable[FixCandidate]]
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"a fix rule's name must be an identifier, got {self.name!r}")
        if not callable(self.propose):
            raise ValueError(f"fix rule {self.name!r}: propose must be callable, got {self.propose!r}")
