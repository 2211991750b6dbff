"""What the validator returns: one :class:`Attempt` per spec tried, and a :class:`TraceReport`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..spec import MLIPSpec
from .compare import KeyDiff

__all__ = ["Attempt", "TraceReport", "HaloCompleteness", "HelperDiagnostic"]


@dataclasses.dataclass(frozen=True)
class HaloCompleteness:
    """Whether every owned atom sees on its rank exactly the neighbours it has on one device.

    matches: True when all do. checked: owned atoms compared. atoms: global indices of the
    atoms whose neighbour sets differ (first 20). missing / extra: edges (receiver, sender)
    absent on the rank / only on the rank (first 20 each).
    """

    matches: bool
    checked: int
    atoms: tuple[int, ...] = ()
    missing: tuple[tuple[int, int], ...] = ()
    extra: tuple[tuple[int, int], ...] = ()

    def __str__(self) -> str:
        if self.matches:
            return f"complete: all {self.checked} owned atoms see their single-device neighbours"
        return (f"INCOMPLETE: {len(self.atoms)}+ of {self.checked} atoms see other neighbours than on one device "
                f"(atoms {list(self.atoms)}; missing edges {list(self.missing)[:5]}, extra {list(self.extra)[:5]})")


@dataclasses.dataclass(frozen=True)
class HelperDiagnostic:
    """A call into a watched helper that reduces per-atom rows to per-system rows, whose
    per-rank results add up to the single-device result, and that no adapter declares."""

    helper: str  # "module:qualname"
    rows_in: int
    rows_out: int
    declared: bool

    def __str__(self) -> str:
        state = "declared" if self.declared else "NOT declared"
        return (f"{self.helper}: {self.rows_in} atom rows -> {self.rows_out} per-system rows, additive over atoms "
                f"({state} on the spec); under decomposition each rank sees only its own atoms")


@dataclasses.dataclass
class Attempt:
    """One distributed run under one spec, compared with the reference."""

    spec: MLIPSpec
    rationale: str
    passed: bool = False
    max_abs_diff: float = float("inf")
    max_rel_diff: float = float("inf")
    diffs: dict[str, KeyDiff] = dataclasses.field(default_factory=dict)
    handler_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    error: str | None = None
    diagnosis: str | None = None
    helper_diagnostics: tuple[HelperDiagnostic, ...] = ()
    halo_completeness: HaloCompleteness | None = None
    partition_health: Any = None

    def line(self) -> str:
        """One line: the verdict, the rationale and each output's relative difference (or the error)."""
        verdict = "pass" if self.passed else ("error" if self.error else "FAIL")
        worst = ", ".join(f"{k} {d.rel:.1e}" for k, d in self.diffs.items())
        return f"[{verdict}] {self.rationale}: {worst or self.error}"

    def to_dict(self) -> dict:
        """The JSON form of the attempt."""
        return {
            "spec": self.spec.to_dict(), "rationale": self.rationale, "passed": self.passed,
            "max_abs_diff": self.max_abs_diff, "max_rel_diff": self.max_rel_diff,
            "diffs": {k: d.to_dict() for k, d in self.diffs.items()}, "handler_counts": dict(self.handler_counts),
            "fallbacks": list(self.fallbacks), "error": self.error, "diagnosis": self.diagnosis,
            "helper_diagnostics": [str(h) for h in self.helper_diagnostics],
            "halo_completeness": None if self.halo_completeness is None else dataclasses.asdict(self.halo_completeness),
            "partition_health": None if self.partition_health is None else str(self.partition_health),
        }


@dataclasses.dataclass
class TraceReport:
    """ok: the distributed model matches. spec: the working spec (the closest one on failure).
    attempts: every spec tried, in order. next_action: one line starting ``OK —`` or ``FAIL —``.
    fix_applied: the auto-fix rule that made it pass, or None. devices: where the sharded runs
    happened (e.g. "8 virtual CPU devices in a child process"). left_out: outputs of the model
    not compared because the sample's systems cannot have them, each with the reason (stress
    of systems without a cell)."""

    ok: bool
    spec: MLIPSpec
    attempts: list[Attempt]
    next_action: str
    fix_applied: str | None = None
    devices: str = ""
    reference_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    left_out: dict[str, str] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        """The report as text: the next action, the devices, then one line per attempt."""
        rows = [self.next_action, f"sharded runs: {self.devices}"]
        rows += [f"not compared: {k} ({why})" for k, why in self.left_out.items()]
        rows += ["  " + a.line() for a in self.attempts]
        last = self.attempts[-1] if self.attempts else None
        if last is not None:
            if last.handler_counts:
                rows.append("  dispatch rules: " + ", ".join(f"{k} {v}" for k, v in sorted(last.handler_counts.items())))
            if last.halo_completeness is not None:
                rows.append(f"  halo: {last.halo_completeness}")
            rows += [f"  helper: {h}" for h in last.helper_diagnostics]
            rows += [f"  fallback: {f}" for f in last.fallbacks]
            if last.diagnosis:
                rows.append(f"  Diagnosis: {last.diagnosis}")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        """The JSON form of the report, its attempts included."""
        return {"ok": self.ok, "next_action": self.next_action, "fix_applied": self.fix_applied,
                "devices": self.devices, "spec": self.spec.to_dict(), "reference_counts": dict(self.reference_counts),
                "left_out": dict(self.left_out),
                "attempts": [a.to_dict() for a in self.attempts]}
