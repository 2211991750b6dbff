"""How the validator judges a sharded run: the :class:`~jaxdd.validate.Attempt` it makes
against the single-device outputs (compared, then diagnosed when it fails), and the report's
next action once every attempt is in."""

from __future__ import annotations

import numpy as np

from ..data import Batch
from ..model.base import ModelConfig
from ..spec import MLIPSpec
from .compare import compare_outputs
from .diagnostics import diagnose, helper_diagnostics
from .report import Attempt, TraceReport
from .sharded import ShardedResult

__all__ = ["judge", "next_action"]


def judge(spec: MLIPSpec, rationale: str, res: ShardedResult, reference, atol: float, rtol: float, cfg: ModelConfig,
          calls, batch: Batch) -> Attempt:
    """The attempt a sharded run makes: its outputs compared with the single device's, and why it failed.

    Args:
        spec: the spec the run used. rationale: why that spec was tried. res: the run's result.
        reference: output key → the single-device array. atol, rtol: an output passes within
            either. cfg: the model's config. calls: the helper calls recorded on one device.
        batch: the sample.

    Returns:
        The :class:`~jaxdd.validate.Attempt`: passed only when every output agrees and the
        dispatch followed every value (or the spec declares the values local).
    """
    a = Attempt(spec, rationale, handler_counts=res.counts, fallbacks=res.fallbacks, error=res.error,
                diagnosis=res.diagnosis, halo_completeness=res.halo, partition_health=res.health)
    if res.outputs is None:
        return a
    a.diffs = compare_outputs(reference, res.outputs, atol, rtol)
    a.max_abs_diff = max((d.abs for d in a.diffs.values()), default=0.0)
    a.max_rel_diff = max((d.rel for d in a.diffs.values()), default=0.0)
    # Strict: numbers that agree on this system do not make a guess safe on the next one, unless
    # the spec declares the values local (a deep halo: ranks compute their ghost rows themselves).
    declared_local = getattr(spec.distribution.policy, "deep", False)
    a.passed = all(d.passed for d in a.diffs.values()) and (declared_local or not res.fallbacks)
    if a.passed:
        return a
    if res.fallbacks and all(d.passed for d in a.diffs.values()) and not declared_local:
        a.diagnosis = diagnose(unfollowed=res.fallbacks)
        return a
    if any(not np.all(np.isfinite(v)) for v in res.outputs.values()) and all(
            np.all(np.isfinite(v)) for v in reference.values()):
        a.diagnosis = diagnose(nan=True)
    elif "forces" in a.diffs and not a.diffs["forces"].passed and "forces" not in cfg.autograd_outputs:
        a.diagnosis = diagnose(internal_forces=True)
    if res.owner is not None:
        declared = [h.target for h in spec.distribution.third_party_helpers]
        a.helper_diagnostics = helper_diagnostics(calls, batch.n_atoms, res.owner, declared)
    return a


def next_action(report: TraceReport, world_size: int) -> str:
    """The report's one line of what to do next: save the spec, or why no spec passed.

    Args:
        report: the attempts made (``ok``, ``spec`` and ``fix_applied`` set). world_size: ranks.

    Returns:
        ``"OK — ..."`` or ``"FAIL — ..."``, the cause that explains the first attempt best.
    """
    if report.ok:
        best = next(a for a in report.attempts if a.passed)
        if report.fix_applied:
            cause = f": {best.diagnosis}" if best.diagnosis else ""
            return (f"OK — passes on {world_size} ranks after auto-fix '{report.fix_applied}' (max rel diff "
                    f"{best.max_rel_diff:.1e}){cause}; save report.spec and load it with the model")
        return f"OK — distributed outputs equal single device on {world_size} ranks (max rel diff {best.max_rel_diff:.1e})"
    last = report.attempts[-1]
    first = report.attempts[0]
    if first.error is not None and first.diffs == {}:
        return f"FAIL — the sharded run raised {first.error}" + (f". Diagnosis: {first.diagnosis}" if first.diagnosis else "")
    halo = first.halo_completeness
    if halo is not None and not halo.matches:
        return (f"FAIL — the halo misses neighbours of atoms {list(halo.atoms)[:10]}: no spec change can recover "
                "missing edges. The engine builds ghost shells of at least the model's declared neighbour range "
                "(cutoff + skin), so either the model reads neighbours beyond its declared range (declare the true "
                "range in its NeighborConfig) or the decomposition lost these atoms: report it with the sample")
    undeclared = [h for a in report.attempts for h in a.helper_diagnostics if not h.declared]
    if undeclared:
        return (f"FAIL — undeclared per-system helper {undeclared[0].helper}: declare a PythonAdapter for it on "
                "spec.distribution.third_party_helpers with a replacement that uses jaxdd.system_sum")
    if first.diagnosis:
        return f"FAIL — {first.diagnosis}"
    worst = max(first.diffs.items(), key=lambda kv: kv[1].rel)[0] if first.diffs else "?"
    closest = report.spec
    tried = len(report.attempts) - 1
    return (f"FAIL — output {worst!r} differs (max rel diff {first.max_rel_diff:.1e}); auto-fix tried {tried} "
            f"variant(s), closest: {next(a.rationale for a in report.attempts if a.spec == closest)}"
            + (f"; first divergent dispatch rule counts {dict(last.handler_counts)}" if last.handler_counts else ""))
