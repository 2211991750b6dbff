"""The frame of a benchmark of a published potential: jaxdd's MD against the torch package that
ships it, on equal pinned cores (``bench/sevennet_md.py``, ``bench/chgnet_md.py``).

A benchmark states a :class:`Bench`: its models, the torch package, its crystal of ``n`` and its
two run functions, one per side (jaxdd in this interpreter, the torch sides in one that has the
package). This module runs every configuration in a child process bound to its cores, kills a
child that passes the memory budget (reported failed, and the benchmark goes on), computes the
ratios, prints the table and the target, and grows the cell for ``--largest``.

The torch sides: ``torch-ase``, the package's ASE calculator (its own neighbour list every step)
driving ``ase.md.VelocityVerlet``; ``torch-bare``, the package's model on a graph built once (no
neighbour list, no integration: the floor of what its model costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mace_md import _memory_kb, _start_peak  # noqa: E402  (importable without jax: the torch side uses it)
from mlip_md import CPU_XLA_FLAGS, DT_FS  # noqa: E402

SIDES = ("jaxdd", "torch-ase", "torch-bare")
BUDGET_GB = 24.0
LARGEST_STEPS = 2  # steps of each --largest run: only whether it fits is asked there
DEFAULT_TORCH_PYTHON = "/work/venv-torch/bin/python"


@dataclasses.dataclass(frozen=True)
class Bench:
    """What a benchmark of one potential family states.

    name: the benchmark (its JSON record's ``benchmark``). script: its file (children run it with
    ``--worker``). package: the torch package (``"sevenn"``). torch_modules: what its interpreter
    must import. models: the published models. atoms: number of atoms of the cell of ``n``.
    sizes: default ``n``s. title: the table's heading. target: (ratio, atoms, sides, devices):
    jaxdd >= ratio × the fastest of ``sides`` at ``atoms`` on one core, and 2 devices >= devices ×
    1 device (None: no device target). install: how to install the torch side.
    """

    name: str
    script: str
    package: str
    torch_modules: tuple
    models: tuple
    atoms: Callable[[int], int]
    sizes: tuple
    title: str
    target: tuple
    install: str

    def target_text(self) -> str:
        ratio, atoms, sides, devices = self.target
        which = sides[0] if len(sides) == 1 else f"the faster of {' and '.join(sides)}"
        text = f"jaxdd >= {ratio}x {self.package} ({which}) at {atoms:,} atoms on one core"
        return text + (f"; 2 devices >= {devices}x 1 device" if devices else "")


def jaxdd_md(potential, atoms, cores: int, steps: int, skin: float) -> dict:
    """``steps`` of jaxdd's NVE velocity Verlet (dt ``DT_FS``) of ``atoms`` under ``potential`` on
    ``cores`` virtual CPU devices (grid (cores, 1, 1)), timed after a warm-up run of the same length.

    Returns: the row's figures (speed, warm-up, rebuilds, energies, working memory per atom).
    """
    import jax
    import numpy as np
    from ase.units import fs

    import jaxdd
    from jaxdd.dynamics import DomainParallel, VelocityVerlet
    from jaxdd.engine import DistributedModel, DomainConfig, default_mesh

    if len(jax.devices()) < cores:  # a smaller mesh would be timed under this one's name
        raise RuntimeError(f"{cores} devices asked for, JAX has {len(jax.devices())}")
    dtype = np.float32
    data = jaxdd.AtomicData.from_ase(atoms, dtype=dtype)
    data = data.replace(velocities=jax.numpy.asarray(atoms.get_velocities(), dtype))
    mesh = default_mesh(jax.devices()[:cores])
    dm = DistributedModel(potential, DomainConfig(potential.model_config.neighbor_config.cutoff, skin=skin,
                                                  grid=(cores, 1, 1), mesh=mesh))
    md = DomainParallel(dm, VelocityVerlet(DT_FS * fs))
    t0 = time.perf_counter()
    md.run(md.init(data), steps)  # compiles; the same start and length, so capacities grow here
    warmup = time.perf_counter() - t0
    setup_peak = _memory_kb("VmHWM")
    base = _start_peak()
    state = md.init(data)
    first = md.thermo(state)
    state = md.run(state, steps)
    stats = md.last_run
    last = md.thermo(state)
    peak = _memory_kb("VmHWM")
    return dict(side="jaxdd", seconds=stats.seconds, atom_steps_per_second=stats.atom_steps_per_second,
                warmup_seconds=warmup, rebuilds=stats.rebuilds, recompiles=stats.recompiles,
                mesh_devices=int(mesh.size), pe_first=float(first["potential_energy"][0]),
                pe_last=float(last["potential_energy"][0]), memory_kb_per_atom=(peak - base) / len(atoms),
                peak_mb=max(setup_peak, peak) / 1024)


def torch_md(side: str, atoms, steps: int, calculator=None, call=None) -> dict:
    """``steps`` of a torch side after one warm-up step: ``calculator`` driving ASE's velocity
    Verlet (torch-ase), or ``call()`` -> energy (eV) on a graph built once (torch-bare).

    Returns: the row's figures (speed, energies, working memory per atom, torch threads).
    """
    import torch
    from ase.units import fs

    if side == "torch-ase":
        from ase.md.verlet import VelocityVerlet

        atoms.calc = calculator
        dyn = VelocityVerlet(atoms, DT_FS * fs)
        pe_first = atoms.get_potential_energy()
        dyn.run(1)  # warm-up
        setup_peak = _memory_kb("VmHWM")
        base = _start_peak()
        t0 = time.perf_counter()
        dyn.run(steps)
        seconds = time.perf_counter() - t0
        pe_last = atoms.get_potential_energy()
    else:
        pe_first = call()  # warm-up
        setup_peak = _memory_kb("VmHWM")
        base = _start_peak()
        t0 = time.perf_counter()
        for _ in range(steps):
            pe_last = call()
        seconds = time.perf_counter() - t0
    peak = _memory_kb("VmHWM")
    return dict(side=side, seconds=seconds, atom_steps_per_second=steps * len(atoms) / seconds,
                warmup_seconds=None, rebuilds=None, recompiles=None, pe_first=float(pe_first),
                pe_last=float(pe_last), memory_kb_per_atom=(peak - base) / len(atoms),
                peak_mb=max(setup_peak, peak) / 1024, torch_threads=torch.get_num_threads())


def torch_python(bench: Bench) -> str | None:
    """The torch sides' interpreter: ``$JAXDD_TORCH_PYTHON``, this one if it has the package,
    or the default torch environment if it exists; None if none of them."""
    if os.environ.get("JAXDD_TORCH_PYTHON"):
        return os.environ["JAXDD_TORCH_PYTHON"]
    if all(importlib.util.find_spec(m) is not None for m in bench.torch_modules):
        return sys.executable
    return DEFAULT_TORCH_PYTHON if Path(DEFAULT_TORCH_PYTHON).exists() else None


def has_modules(python: str, modules) -> bool:
    """Whether ``python`` can import ``modules`` (looked up, not imported: fast)."""
    probe = f"import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in {tuple(modules)!r}))"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def budget_mb(budget_gb: float) -> float:
    """The memory a child may reach, MB: the budget, but at most 90 % of this machine's memory
    (past that the kernel's out-of-memory killer may pick another process than the child)."""
    total = float("inf")
    try:
        with open("/proc/meminfo") as f:
            total = next(float(l.split()[1]) / 1024 for l in f if l.startswith("MemTotal:"))
    except (OSError, StopIteration):
        pass
    return min(budget_gb * 1024, 0.9 * total)


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((float(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:")), 0.0)
    except OSError:
        return 0.0


def watched(cmd: list, env: dict, cores: set, limit_mb: float) -> tuple[int, str, str, str | None]:
    """Run ``cmd`` bound to ``cores``, killing it if its resident memory passes ``limit_mb``.
    Returns (exit status, stdout, stderr, why it was killed or None)."""
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        # Output to files: pipes nobody reads while the child runs would fill and stop it.
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env,
                                preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
        killed = None
        while True:
            try:
                proc.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                rss = _rss_mb(proc.pid)
                if rss > limit_mb:
                    proc.kill()
                    proc.wait()
                    killed = f"exceeded the memory budget: {rss / 1024:.2f} GB > {limit_mb / 1024:.2f} GB"
                    break
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), killed


def pinned(bench: Bench, side: str, model: str, n: int, cores: int, steps: int, python: str | None = None,
           limit_mb: float = BUDGET_GB * 1024, xla_defaults: bool = False) -> dict:
    """One configuration in a child process bound to ``cores`` cores: the jaxdd side in this
    interpreter, the torch sides in ``python``."""
    use = set(sorted(os.sched_getaffinity(0))[:cores])
    spec = json.dumps(dict(side=side, model=model, n=n, cores=cores, steps=steps))
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # the worker sets its own
    env.update(OMP_NUM_THREADS=str(cores), MKL_NUM_THREADS=str(cores))
    if side == "jaxdd" and not xla_defaults:
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = " ".join([flags, *(f for f in CPU_XLA_FLAGS if f.split("=")[0] not in flags)]).strip()
    exe = sys.executable if side == "jaxdd" else python
    atoms = bench.atoms(n)
    head = dict(side=side, model=model, n=n, n_atoms=atoms, cores=len(use), steps=steps)
    rc, out, err, killed = watched([exe, bench.script, "--worker", spec], env, use, limit_mb)
    if rc != 0 or killed:
        # A side that cannot run a size (out of memory, killed) is a result of the comparison,
        # not the end of the benchmark.
        why = killed or (f"killed by signal {-rc} (SIGKILL: most often the kernel's out-of-memory killer)"
                         if rc < 0 else f"exit status {rc}")
        print(f"{side} {model} on {cores} core(s), {atoms} atoms failed ({why}); its stderr ends:\n"
              f"{err[-1500:]}", file=sys.stderr, flush=True)
        return dict(head, failed=why, atom_steps_per_second=None, seconds=None, warmup_seconds=None,
                    memory_kb_per_atom=None, peak_mb=None)
    return dict(json.loads(out.strip().splitlines()[-1]), **head)


def add_ratios(group: list) -> None:
    """Per jaxdd row of one model and size: ``ratios``, jaxdd over each torch side on as many
    cores (side → ratio); ``speedup``, jaxdd on N devices over jaxdd on one (None where missing)."""
    ok = [r for r in group if not r.get("failed")]
    one = next((r["atom_steps_per_second"] for r in ok if r["side"] == "jaxdd" and r["cores"] == 1), None)
    for r in group:
        r["ratios"], r["speedup"] = {}, None
        if r["side"] != "jaxdd" or r.get("failed"):
            continue
        r["ratios"] = {t["side"]: r["atom_steps_per_second"] / t["atom_steps_per_second"] for t in ok
                       if t["side"] != "jaxdd" and t["cores"] == r["cores"]}
        r["speedup"] = r["atom_steps_per_second"] / one if one and r["cores"] > 1 else None


def target_line(bench: Bench, rows) -> str:
    """The target and whether it is met, part by part ("not measured" where a run is missing)."""
    ratio, atoms, sides, devices = bench.target
    vs_torch = {}
    for r in rows:
        measured = [v for s, v in r.get("ratios", {}).items() if s in sides]
        if r["side"] == "jaxdd" and r["cores"] == 1 and r["n_atoms"] == atoms and measured:
            vs_torch[r["model"]] = min(measured)  # over the fastest of the target's sides
    parts, states = [], []  # each part True (met), False (not met) or None (not measured)
    if vs_torch:
        missing = [m for m in bench.models if m not in vs_torch]
        states.append(False if min(vs_torch.values()) < ratio else None if missing else True)
        parts.append(f"{bench.package}: " + ", ".join(f"{m} {v:.2f}x" for m, v in vs_torch.items())
                     + (f"; {', '.join(missing)} not measured" if missing else ""))
    else:
        states.append(None)
        parts.append(f"{bench.package}: not measured (needs jaxdd and {'/'.join(sides)} at {atoms:,} atoms on one "
                     "core)")
    if devices:
        speedups = [(r["speedup"], r["model"], r["n_atoms"]) for r in rows
                    if r["side"] == "jaxdd" and r["cores"] == 2 and r.get("speedup")]
        if speedups:
            low, model, n_atoms = min(speedups)
            states.append(low >= devices)
            parts.append(f"2 devices: lowest {low:.2f}x 1 device ({model}, {n_atoms:,} atoms)")
        else:
            states.append(None)
            parts.append("2 devices: not measured")
    state = "NOT met" if False in states else "not measured" if None in states else "met"
    return f"target ({bench.target_text()}): {state}: {'; '.join(parts)}"


def largest(bench: Bench, model: str, side: str, start: int, limit_mb: float, python, xla_defaults: bool) -> dict:
    """Grow n from ``start`` (by a quarter, at least 1, each try) until ``side`` fails or passes
    ``limit_mb`` on one core: the last n that ran (None if ``start`` did not), and every try."""
    tries, n, best = [], start, None
    while True:
        row = pinned(bench, side, model, n, 1, LARGEST_STEPS, python, limit_mb, xla_defaults)
        over = not row.get("failed") and row["peak_mb"] > limit_mb
        tries.append(dict(n=n, n_atoms=bench.atoms(n), peak_mb=row["peak_mb"], failed=row.get("failed")))
        print(f"largest: {side:10s} {model:9s} {bench.atoms(n):8,d} atoms: "
              + (f"failed ({row['failed']})" if row.get("failed") else f"peak {row['peak_mb']:,.0f} MB"), flush=True)
        if row.get("failed") or over:
            return dict(model=model, side=side, n=best, n_atoms=bench.atoms(best) if best else None, tries=tries)
        best, n = n, max(n + 1, round(n * 1.25))


def parse_args(bench: Bench, argv=None):
    """The command line shared by the benchmarks of published potentials."""
    from timing import check_args  # imports jax: not in the torch sides' interpreter

    sizes = ",".join(map(str, bench.sizes))
    p = argparse.ArgumentParser(description=f"{bench.title}: jaxdd against {bench.package} (torch).")
    p.add_argument("--models", default=",".join(bench.models),
                   help=f"comma-separated, of {', '.join(bench.models)} (default all)")
    p.add_argument("--sizes", default=sizes, help=f"cells of n (comma-separated n; default {sizes}: "
                                                  f"{' and '.join(f'{bench.atoms(n):,}' for n in bench.sizes)} atoms)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--cores", default="1,2", help=f"comma-separated core counts (torch threads) of the {bench.package} "
                                                  "sides (default 1,2)")
    p.add_argument("--devices", default="1,2", help="comma-separated device counts of jaxdd, each on as many cores "
                                                    "(default 1,2)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated sides to run, of {', '.join(SIDES)} "
                                                            "(default all)")
    p.add_argument("--torch-python", default=None, metavar="PATH",
                   help=f"interpreter with torch and {bench.package} for the torch sides (default $JAXDD_TORCH_PYTHON, "
                        f"this one if it has them, else {DEFAULT_TORCH_PYTHON})")
    p.add_argument("--budget-gb", type=float, default=BUDGET_GB,
                   help=f"memory a child may use before it is killed and reported failed (default {BUDGET_GB:g}; "
                        "at most 90%% of the machine's)")
    p.add_argument("--largest", action="store_true",
                   help="also grow n for each model and side on one core until it fails or passes the budget")
    p.add_argument("--xla-defaults", action="store_true",
                   help=f"keep XLA's CPU defaults for jaxdd (else {' '.join(CPU_XLA_FLAGS)})")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    check_args(p, args, positive=("steps",), choices={"models": bench.models, "sides": SIDES})
    for name in ("sizes", "cores", "devices"):
        try:
            values = tuple(dict.fromkeys(int(v) for v in getattr(args, name).split(",") if v.strip()))
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            p.error(f"--{name} must be comma-separated positive integers, got {getattr(args, name)!r}")
        setattr(args, name, values)
    available = len(os.sched_getaffinity(0))
    for name in ("cores", "devices"):
        if max(getattr(args, name)) > available:
            p.error(f"--{name} asks for {max(getattr(args, name))} cores but this process may use {available}")
    if not args.budget_gb > 0:
        p.error(f"--budget-gb must be positive, got {args.budget_gb}")
    return args


def format_table(bench: Bench, rows, notes) -> str:
    """The rows as text: speed, times, memory, jaxdd over each torch side and over one device."""
    torch_sides = [s for s in SIDES if s != "jaxdd"]
    cols = (["model", "side", "atoms", "cores", "atom-steps/s", "seconds", "warm-up s", "work kB/atom", "peak MB"]
            + [f"jaxdd / {s}" for s in torch_sides] + ["vs 1 device"])
    lines = []
    for r in rows:
        head = [r["model"], r["side"], f"{r['n_atoms']:,}", str(r["cores"])]
        if r.get("failed"):
            lines.append(head + ["failed"] + ["-"] * (len(cols) - 5))
            continue
        ratios = r.get("ratios") or {}
        lines.append(head + [f"{r['atom_steps_per_second']:,.0f}", f"{r['seconds']:.2f}",
                             f"{r['warmup_seconds']:.1f}" if r.get("warmup_seconds") is not None else "-",
                             f"{r['memory_kb_per_atom']:.1f}", f"{r['peak_mb']:,.0f}"]
                     + [f"{ratios[s]:.2f}x" if s in ratios else "-" for s in torch_sides]
                     + [f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"])
    from timing import text_table

    return text_table(cols, lines, notes)


def main(bench: Bench, run_jaxdd, run_torch, argv=None) -> int:
    """The benchmark's command (or, with ``--worker SPEC``, one child's run)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        kw = json.loads(argv[1])
        side = kw.pop("side")
        if side == "jaxdd":
            import jax

            jax.config.update("jax_num_cpu_devices", kw["cores"])  # before the potential touches a device
            row = run_jaxdd(**kw)
        else:
            import torch

            torch.set_num_threads(kw["cores"])
            row = run_torch(side=side, **kw)
        print(json.dumps(row), flush=True)
        return 0
    args = parse_args(bench, argv)
    notes = []
    python = args.torch_python or torch_python(bench)
    sides = list(args.sides)
    if any(s != "jaxdd" for s in sides) and (python is None or not has_modules(python, bench.torch_modules)):
        notes.append(f"{bench.package} not run: {python or 'no interpreter'} lacks {', '.join(bench.torch_modules)} "
                     f"(--torch-python, $JAXDD_TORCH_PYTHON; {bench.install})")
        sides = [s for s in sides if s == "jaxdd"]
    if not sides:
        print("nothing to run: " + "; ".join(notes), file=sys.stderr)
        return 1
    if len(sides) < len(SIDES):
        notes.append(f"sides run: {', '.join(sides)}")
    limit = budget_mb(args.budget_gb)
    if limit < args.budget_gb * 1024:
        notes.append(f"memory budget {args.budget_gb:g} GB is over 90% of this machine's: children are killed at "
                     f"{limit / 1024:.1f} GB")
    rows = []
    for model in args.models:
        for n in args.sizes:
            group = []
            configs = [(s, c) for s in sides if s != "jaxdd" for c in args.cores]
            configs += [("jaxdd", d) for d in args.devices if "jaxdd" in sides]
            for side, cores in configs:
                row = pinned(bench, side, model, n, cores, args.steps, python, limit, args.xla_defaults)
                speed = (f"failed: {row['failed']}" if row.get("failed")
                         else f"{row['atom_steps_per_second']:,.0f} atom-steps/s")
                print(f"{model:9s} {side:10s} {row['n_atoms']:6d} atoms {cores} core(s): {speed}", flush=True)
                if row.get("failed"):
                    notes.append(f"{side} {model} failed at {row['n_atoms']:,} atoms, {cores} core(s): {row['failed']}")
                group.append(row)
            add_ratios(group)
            rows += group
    print(f"\n{bench.title} ({args.steps} steps); jaxdd on N devices on N cores (grid (N, 1, 1)), {bench.package} with "
          f"N torch threads on N cores")
    print(format_table(bench, rows, notes))
    print(target_line(bench, rows))
    found = []
    if args.largest:
        start = max(args.sizes)
        for model in args.models:
            for side in sides:
                found.append(largest(bench, model, side, start, limit, python, args.xla_defaults))
        print(f"\nlargest cell run within {limit / 1024:.1f} GB on one core ({LARGEST_STEPS} steps), from n = {start}:")
        for f in found:
            print(f"  {f['model']:9s} {f['side']:10s} "
                  + (f"n = {f['n']}: {f['n_atoms']:,} atoms" if f["n"] else f"none (n = {start} already failed)"))
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(benchmark=bench.name, models=list(args.models), steps=args.steps,
                                     budget_gb=args.budget_gb, results=rows, largest=found, notes=notes,
                                     target=target_line(bench, rows)))
    return 0
