"""``trace_and_validate``: prove that a model distributed equals the model on one device."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..checks import integral
from ..adapters import reference_of, resolve_reference
from ..data import Batch, as_batch
from ..dispatch import DispatchReport, DispatchWarning, Runtime, call_model
from ..driver import bucketed_atoms, compute, default_order, model_config, systems_without_volume
from ..neighbors import neighbor_list
from ..ops import HaloStoragePolicy, SpecError
from ..spec import SPEC_MPNN_HALO, MLIPSpec
from .compare import compare_outputs
from .diagnostics import HelperRecorder, diagnose, halo_completeness, helper_diagnostics, watched_modules
from .op_calls import named_op_outputs
from .report import Attempt, HaloCompleteness, TraceReport
from .rule import FixContext, FixRule
from .rules import FIX_RULES, FixRuleRegistry

__all__ = ["trace_and_validate", "FIX_RULES", "ModelFactoryError"]


class ModelFactoryError(ValueError):
    """The model factory cannot build a model: it raised, or returned something that is not a
    model wrapper. The message names the factory and the cause."""


@dataclasses.dataclass
class _Result:
    """What one sharded run produced (in this process or a child)."""

    outputs: dict[str, np.ndarray] | None = None
    error: str | None = None
    diagnosis: str | None = None
    counts: dict[str, int] = dataclasses.field(default_factory=dict)
    fallbacks: tuple[str, ...] = ()
    health: str | None = None
    halo: HaloCompleteness | None = None
    owner: np.ndarray | None = None


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

    model_factory: a zero-argument callable returning the wrapper, or its ``"module:qualname"``
    (needed when the sharded runs happen in a child process). sample_batch: AtomicData or Batch.
    devices: "auto" (this process's devices when there are ``world_size`` of them, else
    ``world_size`` virtual CPU devices in a child process), "subprocess", or a list of devices.
    device: the PyTorch guide's spelling, ``"cuda:0"``, ``"gpu:1"``, ``"cpu"`` (instead of
    ``devices``): ``world_size`` devices of that platform from that index; JAX runs one rank per
    device, so a GPU platform needs ``world_size`` GPUs, and ``"cpu"`` without enough CPU devices
    runs virtual ones in a child process.
    atol, rtol: an output passes when its partition-invariant difference is within either.
    outputs: keys to compare (default: the model's active outputs). watch: module names whose
    functions are watched for undeclared per-system reductions (default: the modules the
    model's code reaches, other than jaxdd and the usual frameworks). progress: called with
    one line per attempt. spec: the spec to start from (default: the model's
    ``distribution_spec``, else ``SPEC_MPNN_HALO``); ``SPEC_MPNN_GP`` validates the
    graph-parallel strategy. fix_rules: the auto-fix rules to try, in order (default
    :data:`~jaxdd.validate.FIX_RULES`, to which :func:`~jaxdd.validate.register_fix_rule` adds);
    a :class:`~jaxdd.validate.FixRuleRegistry` or a sequence of :class:`~jaxdd.validate.FixRule`.
    """
    factory, factory_ref = resolve_factory(model_factory)
    world_size = integral("world_size", world_size, minimum=1)
    max_fix_attempts = integral("max_fix_attempts", max_fix_attempts, minimum=0)
    rules = _rule_registry(fix_rules)
    if device is not None:
        if not (isinstance(devices, str) and devices == "auto"):
            raise ValueError(f"pass devices or device, not both (got devices={devices!r}, device={device!r})")
        devices = _devices_for(device, world_size)
    model = _build_model(factory, factory_ref or repr(model_factory))
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
    run, where = _runner(model, factory_ref, batch, outputs, world_size, devices)  # bad devices: before any run
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
    results: list[_Result] = []

    def attempt(spec: MLIPSpec, rationale: str) -> Attempt:
        res = run(spec)
        a = _judge(spec, rationale, res, reference, atol, rtol, cfg, calls, batch)
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
    report.next_action = _next_action(report, world_size)
    return report


# --------------------------------------------------------------------------- the reference


def resolve_factory(model_factory):
    """(the factory callable, a reference to it) of a ``model_factory``: a callable, or a
    ``"module:function"`` string resolved by import (what a worker process receives)."""
    if isinstance(model_factory, str):
        fn = resolve_reference(model_factory, "model_factory")
        if not callable(fn):
            raise SpecError(f"model_factory {model_factory!r} is not callable")
        return fn, model_factory
    if not callable(model_factory):
        raise ValueError(f"model_factory must be a callable or a 'module:qualname' string, got {model_factory!r}")
    return model_factory, reference_of(model_factory)


def _build_model(factory, name: str):
    """``factory()``, checked to be a model wrapper; ModelFactoryError naming ``name`` otherwise."""
    try:
        model = factory()
    except Exception as exc:
        cause = (str(exc).strip().splitlines() or [""])[0]
        raise ModelFactoryError(f"model factory {name} raised {type(exc).__name__}"
                                + (f": {cause}" if cause else "") + "; fix it so that it builds the model") from exc
    try:
        model_config(model)
    except ValueError:
        shown = repr(model)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ModelFactoryError(f"model factory {name} returned {shown} ({type(model).__name__}), not a model "
                                "wrapper: it has no ModelConfig in .model_config; return an instance of a "
                                "jaxdd.BaseModel subclass") from None
    return model


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


# --------------------------------------------------------------------------- sharded runs


_PLATFORMS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}


def _devices_for(device: str, world_size: int):
    """The ``devices`` of :func:`trace_and_validate` for a ``device`` string as the PyTorch guide
    writes it (``"cuda:0"``, ``"gpu"``, ``"cpu:0"``): ``world_size`` devices of that platform,
    from that index; ``"subprocess"`` for CPU when this process has too few CPU devices."""
    name, _, index = str(device).partition(":")
    platform = _PLATFORMS.get(name.strip().lower())
    if platform is None or (index and not index.strip().isdigit()):
        raise ValueError(f"device must be like 'cuda:0', 'gpu', 'cpu' or 'tpu:0', got {device!r}; the jaxdd form is "
                         "devices='auto', devices='subprocess' or devices=[jax devices]")
    start = int(index) if index else 0
    try:
        present = jax.devices(platform)
    except RuntimeError:
        present = []
    chosen = present[start:start + world_size]
    if len(chosen) == world_size:
        return chosen
    if platform == "cpu":
        return "subprocess"  # virtual CPU ranks in a child process, as devices="auto" does
    raise ValueError(
        f"device={device!r} asks for world_size={world_size} ranks from {platform} device {start}, but this process has "
        f"{len(present)} {platform} device(s): JAX runs one rank per device (it has no virtual ranks on one GPU). "
        f"On a machine with {world_size} of them pass devices=jax.devices('{platform}')[:{world_size}]; to validate "
        "without them, devices='subprocess' runs the ranks on virtual CPU devices")


def _runner(model, factory_ref, batch, outputs, world_size, devices):
    """(spec -> _Result, a description of where the runs happen)."""
    if jax.process_count() > 1 and (devices != "auto" or world_size != jax.device_count()):
        raise ValueError(
            f"with {jax.process_count()} processes the sharded runs use every device of the run: world_size must be "
            f"{jax.device_count()} (got {world_size}) and devices 'auto' (got {devices!r})")
    if devices == "auto":
        devices = jax.devices() if len(jax.devices()) >= world_size else "subprocess"
    if devices == "subprocess":
        if factory_ref is None:
            raise ValueError(
                f"this process has {len(jax.devices())} device(s), fewer than world_size={world_size}, so the sharded "
                "runs need a child process, which needs the factory as an importable 'module:qualname' (a module-level "
                "function, not a lambda or a local function)"
            )
        return (lambda spec: _in_child(factory_ref, batch, spec, outputs, world_size),
                f"{world_size} virtual CPU devices in a child process (this process has {len(jax.devices())})")
    devices = list(devices)[:world_size]
    if len(devices) < world_size:
        raise ValueError(f"devices has {len(devices)} entries, fewer than world_size={world_size}")
    kind = devices[0].platform
    where = f"across {jax.process_count()} processes" if jax.process_count() > 1 else "in this process"
    return (lambda spec: run_sharded(model, batch, spec, outputs, devices), f"{world_size} {kind} device(s) {where}")


def run_sharded(model, batch: Batch, spec: MLIPSpec, outputs, devices) -> _Result:
    """One distributed run of ``model`` on ``devices`` under ``spec``, with its diagnostics."""
    from ..engine.distributed import DistributedModel, DomainConfig

    res = _Result()
    mesh = Mesh(np.asarray(devices), ("dd",), axis_types=(AxisType.Auto,))
    nc = model_config(model).neighbor_config
    try:
        # Run to the end even where the dispatch could not follow a value, so that the numbers
        # can be compared and a fix found; _judge still fails such an attempt (strict).
        dist = DistributedModel(model, DomainConfig(cutoff=nc.cutoff, skin=nc.skin, mesh=mesh, allow_unfollowed=True),
                                spec=spec)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DispatchWarning)  # reported through the attempt instead
            warnings.simplefilter("ignore", RuntimeWarning)
            out = dist(batch, outputs)
        res.outputs = {k: np.asarray(v) for k, v in out.items()}
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        res.diagnosis = diagnose(exc)
        dist = locals().get("dist")
    if dist is None:
        return res
    report = dist.dispatch_report
    if report is not None:
        res.counts = dict(report.counts)
        res.fallbacks = tuple(report.fallbacks)
    res.health = None if dist.health is None else str(dist.health)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the run above already planned this batch
            res.halo = halo_completeness(dist, batch)
            res.owner = dist.plan(batch)[0].owner
    except Exception:
        pass
    return res


def _in_child(factory_ref: str, batch: Batch, spec: MLIPSpec, outputs, world_size: int) -> _Result:
    with tempfile.TemporaryDirectory(prefix="jaxdd-validate-") as tmp:
        tmp = Path(tmp)
        save_batch(batch, tmp / "batch.npz")
        (tmp / "request.json").write_text(json.dumps({
            "factory": factory_ref, "spec": spec.to_dict(), "outputs": list(outputs), "world_size": world_size,
        }))
        env = dict(os.environ)
        env["JAX_NUM_CPU_DEVICES"] = str(world_size)
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_ENABLE_X64"] = "1" if np.asarray(batch.positions).dtype == np.float64 else "0"
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-m", "jaxdd.validate._worker", str(tmp)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / "result.json").exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return _Result(error=f"child process failed (exit {proc.returncode}): {tail[0]}",
                           diagnosis="the factory must be importable in a fresh process with the same sys.path")
        return read_result(tmp)


def save_batch(batch: Batch, path: Path) -> None:
    fields = {k: np.asarray(getattr(batch, k)) for k in ("positions", "atomic_numbers", "cell", "pbc", "batch_idx",
                                                           "ptr", "atom_mask", "system_mask", "charges", "masses",
                                                           "velocities") if getattr(batch, k) is not None}
    np.savez(path, **fields)


def load_batch(path: Path) -> Batch:
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files}
    return Batch.unchecked(**{k: jax.numpy.asarray(v) for k, v in fields.items()})


def write_result(res: _Result, tmp: Path) -> None:
    if res.outputs is not None:
        np.savez(tmp / "outputs.npz", **res.outputs)
    if res.owner is not None:
        np.save(tmp / "owner.npy", res.owner)
    (tmp / "result.json").write_text(json.dumps({
        "error": res.error, "diagnosis": res.diagnosis, "counts": res.counts, "fallbacks": list(res.fallbacks),
        "health": res.health, "halo": None if res.halo is None else dataclasses.asdict(res.halo),
    }))


def read_result(tmp: Path) -> _Result:
    data = json.loads((tmp / "result.json").read_text())
    outputs = None
    if (tmp / "outputs.npz").exists():
        with np.load(tmp / "outputs.npz") as z:
            outputs = {k: z[k] for k in z.files}
    halo = None
    if data["halo"] is not None:
        h = data["halo"]
        halo = HaloCompleteness(h["matches"], h["checked"], tuple(h["atoms"]), tuple(map(tuple, h["missing"])),
                                tuple(map(tuple, h["extra"])))
    owner = np.load(tmp / "owner.npy") if (tmp / "owner.npy").exists() else None
    return _Result(outputs, data["error"], data["diagnosis"], data["counts"], tuple(data["fallbacks"]), data["health"],
                   halo, owner)


# --------------------------------------------------------------------------- judging and fixing


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


def _judge(spec, rationale, res: _Result, reference, atol, rtol, cfg, calls, batch) -> Attempt:
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


def _fixes(rules: FixRuleRegistry, a: Attempt, res: _Result, reference, world_size, program: dict) -> list:
    """(rule name, FixCandidate) for a failed attempt, rules in order. Only attempts that ran
    to outputs are fixed: a run that raised is explained by its diagnosis instead."""
    if res.outputs is None:
        return []
    ctx = FixContext(a, res.outputs, reference, world_size, **program)
    return rules.propose(ctx)


def _next_action(report: TraceReport, world_size: int) -> str:
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
