"""``trace_and_validate``: prove that a model distributed equals the model on one device.

Holds the attempt loop: the single-device reference (with the helper calls and dispatch rules
its program needs), the first sharded attempt and the auto-fix candidates tried after it.
Where the sharded runs happen is :mod:`~jaxdd.validate.devices`; how each is judged,
:mod:`~jaxdd.validate.verdict`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..data.checks import integral
from ..data import Batch, as_batch
from ..dispatch import DispatchReport, Runtime, call_model
from ..engine.driver import compute
from ..model.protocol import bucketed_atoms, default_order, model_config, systems_without_volume
from ..neighbors import neighbor_list
from ..ops import HaloStoragePolicy
from ..spec import SPEC_MPNN_HALO, MLIPSpec
from .compare import compare_outputs
from .devices import devices_for, sharded_runner
from .diagnostics import HelperRecorder, diagnose, watched_modules
from .factory import build_model, resolve_factory
from .op_calls import named_op_outputs
from .report import Attempt, TraceReport
from .rule import FixContext, FixRule
from .rules import FIX_RULES, FixRuleRegistry
from .sharded import ShardedResult
from .verdict import judge, next_action

__all__ = ["trace_and_validate", "FIX_RULES"]


def trace_and_validate(
    model_factory: Callable[[], Any] | str,
    sample_batch,
    *,
    world_size: int = 2,
    devices="auto",
    device: str | None = None,
    atol: float = 1e-5,
    rtol: float = 1e-4,
    auto_fix: bool = True,
    max_fix_attempts: int = 8,
    outputs=None,
    watch=None,
    progress: Callable[[str], None] | None = None,
    spec: MLIPSpec | None = None,
    fix_rules: FixRuleRegistry | None = None,
) -> TraceReport:
    """Run the model on one device and on ``world_size`` ranks; compare; fix the spec if it can.

    Args:
        model_factory: a zero-argument callable returning the wrapper, or its
            ``"module:qualname"`` (needed when the sharded runs happen in a child process).
        sample_batch: AtomicData or Batch.
        world_size: ranks of the sharded runs.
        devices: "auto" (this process's devices when there are ``world_size`` of them, else
            ``world_size`` virtual CPU devices in a child process), "subprocess", or a list of
            devices.
        device: the PyTorch guide's spelling, ``"cuda:0"``, ``"gpu:1"``, ``"cpu"`` (instead of
            ``devices``): ``world_size`` devices of that platform from that index; JAX runs one
            rank per device, so a GPU platform needs ``world_size`` GPUs, and ``"cpu"`` without
            enough CPU devices runs virtual ones in a child process.
        atol, rtol: an output passes when its partition-invariant difference is within either.
        auto_fix: whether to try the fix rules' candidate specs when the first attempt fails.
        max_fix_attempts: the most candidate specs tried.
        outputs: keys to compare (default: the model's active outputs).
        watch: module names whose functions are watched for undeclared per-system reductions
            (default: the modules the model's code reaches, other than jaxdd and the usual
            frameworks).
        progress: called with one line per attempt.
        spec: the spec to start from (default: the model's ``distribution_spec``, else
            ``SPEC_MPNN_HALO``); ``SPEC_MPNN_GP`` validates the graph-parallel strategy.
        fix_rules: the auto-fix rules to try, in order (default
            :data:`~jaxdd.validate.FIX_RULES`, to which :func:`~jaxdd.validate.register_fix_rule`
            adds); a :class:`~jaxdd.validate.FixRuleRegistry` or a sequence of
            :class:`~jaxdd.validate.FixRule`.

    Returns:
        The :class:`~jaxdd.validate.TraceReport`: every attempt, the best spec, and what to do next.
    """
    factory, factory_ref = resolve_factory(model_factory)
    world_size = integral("world_size", world_size, minimum=1)
    max_fix_attempts = integral("max_fix_attempts", max_fix_attempts, minimum=0)
    rules = _rule_registry(fix_rules)
    if device is not None:
        if not (isinstance(devices, str) and devices == "auto"):
            raise ValueError(f"pass devices or device, not both (got devices={devices!r}, device={device!r})")
        devices = devices_for(device, world_size)
    model = build_model(factory, factory_ref or repr(model_factory))
    cfg = model_config(model)
    batch = as_batch(sample_batch)
    left_out = {}
    if outputs is None:
        # The model's outputs, less those the sample's systems cannot have (said in the report).
        outputs = cfg.check_outputs(default_order(cfg.active_outputs))
        flat = systems_without_volume(batch) if "stress" in outputs else ()
        if len(flat):
            outputs = tuple(k for k in outputs if k != "stress")
            left_out["stress"] = (f"system(s) {np.asarray(flat)[:8].tolist()}{' ...' if len(flat) > 8 else ''} "
                                  "have no cell of non-zero volume")
    else:
        outputs = cfg.check_outputs(outputs)
    say = progress or (lambda line: None)

    if spec is not None and not isinstance(spec, MLIPSpec):
        raise ValueError(f"spec must be an MLIPSpec or None, got {spec!r}")
    run, where = sharded_runner(model, factory_ref, batch, outputs, world_size, devices)  # bad devices: before any run
    given = spec is not None
    spec = spec if given else model.distribution_spec
    try:
        reference = {k: np.asarray(v) for k, v in compute(model, batch, outputs).items()}
    except Exception as exc:  # the model fails on one device already: nothing to compare with
        a = Attempt(spec or SPEC_MPNN_HALO, "single-device reference", error=f"{type(exc).__name__}: {exc}",
                    diagnosis=diagnose(exc))
        say(a.line())
        return TraceReport(ok=False, spec=a.spec, attempts=[a], devices="none (the reference failed)",
                           next_action=f"FAIL — the single-device reference raised {a.error.splitlines()[0]}. "
                                       f"Diagnosis: {a.diagnosis}")
    watch = watched_modules(model) if watch is None else tuple(watch)
    calls = _record_helpers(model, batch, watch)
    ref_counts = _single_device_counts(model, batch)

    rationale = ("the given spec" if given else "the model's distribution_spec" if spec is not None
                 else "default halo spec (SPEC_MPNN_HALO)")
    spec = spec if spec is not None else SPEC_MPNN_HALO
    attempts: list[Attempt] = []
    results: list[ShardedResult] = []

    def attempt(spec: MLIPSpec, rationale: str) -> Attempt:
        res = run(spec)
        a = judge(spec, rationale, res, reference, atol, rtol, cfg, calls, batch)
        attempts.append(a)
        results.append(res)
        say(a.line())
        return a

    first = attempt(spec, rationale)
    if not first.passed and first.error is None and first.diagnosis is None and _reads_padding(
            model, batch, outputs, reference, atol, rtol):
        first.diagnosis = diagnose(padding=True)
    fix = None
    if not first.passed and auto_fix:
        program = _program_facts(model, batch, spec)
        # Each queued candidate carries the diagnoses of the fixes it builds on, so a chain
        # of fixes that passes reports every cause it removed.
        queue = [(rule, c, ()) for rule, c in _fixes(rules, first, results[-1], reference, world_size, program)]
        tried = {spec}
        while queue and len(attempts) - 1 < max_fix_attempts:
            rule, candidate, causes = queue.pop(0)
            if candidate.spec in tried:
                continue
            tried.add(candidate.spec)
            causes = causes + ((candidate.diagnosis,) if candidate.diagnosis else ())
            a = attempt(candidate.spec, f"auto-fix {rule}: {candidate.why}")
            if a.passed:
                fix = rule
                a.diagnosis = "; ".join(causes) or None  # confirmed: this run equals the single device
                break
            queue += [(r, c, causes) for r, c in _fixes(rules, a, results[-1], reference, world_size, program)]
    passed = [a for a in attempts if a.passed]
    best = passed[0] if passed else min(attempts, key=lambda a: (a.error is not None, a.max_rel_diff))
    report = TraceReport(ok=bool(passed), spec=best.spec, attempts=attempts, next_action="", fix_applied=fix,
                         devices=where, reference_counts=ref_counts, left_out=left_out)
    report.next_action = next_action(report, world_size)
    return report


# --------------------------------------------------------------------------- the reference


def _with_neighbors(model, batch: Batch) -> Batch:
    nc = model_config(model).neighbor_config
    nl, _ = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                          cutoff=nc.search_cutoff, half=nc.half_list, format=nc.format)
    return batch.replace(neighbors=nl)


def _record_helpers(model, batch: Batch, watch) -> list:
    """One eager forward with the watched helpers recorded (concrete inputs and outputs)."""
    if not watch:
        return []
    try:
        batch = _with_neighbors(model, batch)  # compiled: only the model's own forward runs eagerly
        with HelperRecorder(watch) as recorder, jax.disable_jit():
            model(batch)
        return recorder.calls
    except Exception:  # diagnostics are a courtesy; the comparison does not depend on them
        return []


def _single_device_counts(model, batch: Batch) -> dict[str, int]:
    """The dispatch rules the model's program needs, traced on one device (nothing is run)."""
    from jax.sharding import PartitionSpec as P

    report = DispatchReport(policy=HaloStoragePolicy())
    try:
        b = _with_neighbors(model, batch)
        mesh = Mesh(np.asarray(jax.devices()[:1]), ("dd",), axis_types=(AxisType.Auto,))

        def one(b):
            # One device owns every row, so its list's receivers are all owned.
            rt = Runtime(None, None, ("dd",), HaloStoragePolicy(), b.atom_mask, edge_owned=b.neighbors.mask,
                         receivers_owned=True, atom_mask=b.atom_mask)
            return call_model(model, b, rt, report)[0]

        jax.eval_shape(jax.shard_map(one, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False), b)
    except Exception:
        return {}
    return dict(report.counts)


def _reads_padding(model, batch: Batch, outputs, reference, atol, rtol) -> bool:
    """Whether the single-device outputs per system change when more padding atom rows are
    appended (rows with ``atom_mask`` False): the model then reads them, a value no rank has."""
    per_system = [k for k in ("energy", "stress") if k in reference]
    if not per_system:
        return False
    try:
        more = compute(model, batch.pad(2 * bucketed_atoms(batch) + 1), tuple(per_system))
    except Exception:  # noqa: BLE001 - a probe only: no diagnosis rather than a second failure
        return False
    diffs = compare_outputs({k: reference[k] for k in per_system}, {k: np.asarray(more[k]) for k in per_system},
                            atol, rtol)
    return not all(d.passed for d in diffs.values())


# --------------------------------------------------------------------------- fixing


def _rule_registry(fix_rules) -> FixRuleRegistry:
    if fix_rules is None:
        return FIX_RULES
    if isinstance(fix_rules, FixRuleRegistry):
        return fix_rules
    rules = tuple(fix_rules)
    if not all(isinstance(r, FixRule) for r in rules):
        raise ValueError(f"fix_rules must be a FixRuleRegistry or a sequence of FixRule, got {fix_rules!r}")
    return FixRuleRegistry(rules)


def _program_facts(model, batch: Batch, spec: MLIPSpec) -> dict:
    """What rules may read about the model's single-device program: the output shapes of the
    ops the spec adapts that the program calls (traced once, when a fix is looked for, and
    only when the spec adapts ops)."""
    names = [a.op.name for a in spec.distribution.custom_ops]
    return {"n_atoms": int(batch.n_atoms),
            "op_outputs": named_op_outputs(model, _with_neighbors(model, batch), names) if names else {}}


def _fixes(rules: FixRuleRegistry, a: Attempt, res: ShardedResult, reference, world_size, program: dict) -> list:
    """(rule name, FixCandidate) for a failed attempt, rules in order. Only attempts that ran
    to outputs are fixed: a run that raised is explained by its diagnosis instead."""
    if res.outputs is None:
        return []
    ctx = FixContext(a, res.outputs, reference, world_size, **program)
    return rules.propose(ctx)
