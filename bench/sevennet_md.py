"""Benchmark: molecular dynamics of SevenNet, jaxdd against sevenn (torch), on equal pinned cores.

    python bench/sevennet_md.py [--models 7net-0,7net-l3i5] [--sizes 5,8] [--steps 20] [--cores 1,2]
                                [--devices 1,2] [--sides jaxdd,torch-ase,torch-bare] [--torch-python PATH]
                                [--budget-gb 24] [--largest] [--xla-defaults] [--json PATH]

The published checkpoints 7net-0 (SevenNet_0__11Jul2024) and 7net-l3i5, float32, on diamond Si
(a = 5.43 Å, the cubic 8-atom cell repeated n×n×n: ``--sizes 5,8`` gives 1,000 and 4,096 atoms,
rattled by 0.01 Å, Maxwell–Boltzmann velocities at 300 K), ``--steps`` steps (default 20) of
NVE velocity Verlet at dt = 1 fs. The sides:

* jaxdd: ``SevenNet.from_checkpoint`` (weights read without torch) under ``DomainParallel`` with
  ``VelocityVerlet``, its on-device MD loop, neighbour skin 1 Å, on N virtual CPU devices pinned
  to N cores (``--devices 1,2``; grid (N, 1, 1)); one warm-up run (compilation) and a timed run
  from a fresh start;
* torch-ase: sevenn's ``SevenNetCalculator`` (float32, its own neighbour list every step)
  driving ``ase.md.VelocityVerlet``; one warm-up step;
* torch-bare: sevenn's model on a graph built once (``unlabeled_atoms_to_graph``), ``--steps``
  calls of its forward and backward (energy, forces and stress); one warm-up call. No
  neighbour list and no integration: the floor of what sevenn's model costs.

The torch sides run with as many torch threads as cores (``--cores 1,2``). Every configuration
is a child process bound to its cores; the torch ones run in a separate interpreter that has
torch and sevenn (``--torch-python``, or ``$JAXDD_TORCH_PYTHON``; default: this interpreter if
it has both, else ``/work/venv-torch/bin/python``), the jaxdd ones in this one (which needs
only the ``sevenn`` wheel's files: ``pip install --no-deps sevenn``). A side that fails, is
killed (out of memory) or grows past ``--budget-gb`` (default 24 GB, at most 90 % of the
machine's memory; the child is killed there) is reported as failed and the benchmark goes on.

Printed: atom-steps per second (atoms × steps / wall seconds of the timed run), the warm-up
time, the working memory per atom of the timed run as ``bench/mace_md.py`` measures it (peak
resident memory during it minus resident memory just before, kB/atom), the peak resident
memory of the child, jaxdd over the faster sevenn side on the same number of cores, and
jaxdd on N devices over jaxdd on one. Target: jaxdd >= 2.0x sevenn for 7net-0 and l3i5 at
1,000 atoms on one core; 2 devices >= 1.7x 1 device.

``--largest`` then grows n (by about a quarter per try, from the largest of ``--sizes``) for
each model and side on one core until the side fails or its peak memory passes the budget,
with 2 steps a run, and prints the largest cell each side ran. It can take long (a run of
the largest cells on one core is minutes).

Every jaxdd child runs with ``bench/mlip_md.py``'s XLA flags (XLA's CPU operations on the
thread that runs them, XLA's own fusion emitter; about twice as fast on pinned cores there);
``--xla-defaults`` keeps XLA's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sevennet"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py and the scripts beside

# Importable by the torch interpreter too (no jax at their import): the working-memory measure
# of mace_md, so both benchmarks report it alike, and the crystal and XLA flags of mlip_md.
from mace_md import _memory_kb, _start_peak  # noqa: E402
from mlip_md import CPU_XLA_FLAGS, DT_FS, diamond  # noqa: E402

MODELS = ("7net-0", "7net-l3i5")
SIDES = ("jaxdd", "torch-ase", "torch-bare")
SKIN = 1.0  # Å
BUDGET_GB = 24.0
LARGEST_STEPS = 2  # steps of each --largest run: only whether it fits is asked there
TARGET_TORCH, TARGET_ATOMS, TARGET_DEVICES = 2.0, 1000, 1.7
TARGET = (f"jaxdd >= {TARGET_TORCH}x sevenn for 7net-0 and l3i5 at {TARGET_ATOMS:,} atoms on one core; "
          f"2 devices >= {TARGET_DEVICES}x 1 device")
DEFAULT_TORCH_PYTHON = "/work/venv-torch/bin/python"


def torch_python() -> str | None:
    """The interpreter of the torch sides: ``$JAXDD_TORCH_PYTHON``, this one if it has torch and
    sevenn, or the default torch environment if it exists; None if none of them."""
    import importlib.util

    if os.environ.get("JAXDD_TORCH_PYTHON"):
        return os.environ["JAXDD_TORCH_PYTHON"]
    if all(importlib.util.find_spec(m) is not None for m in ("torch", "sevenn", "e3nn")):
        return sys.executable
    return DEFAULT_TORCH_PYTHON if Path(DEFAULT_TORCH_PYTHON).exists() else None


def has_sevenn(python: str) -> bool:
    """Whether ``python`` can import torch and sevenn (looked up, not imported: fast)."""
    probe = "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in ('torch', 'sevenn')))"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def run_jaxdd(model: str, n: int, cores: int, steps: int) -> dict:
    """``steps`` of jaxdd's MD on ``cores`` virtual CPU devices (grid (cores, 1, 1)), after a warm-up run."""
    import jax

    jax.config.update("jax_num_cpu_devices", cores)
    import numpy as np
    from ase.units import fs

    import jaxdd
    from jaxdd.dynamics import DomainParallel, VelocityVerlet
    from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
    from jaxdd.models.sevennet import SevenNet

    if len(jax.devices()) < cores:  # a smaller mesh would be timed under this one's name
        raise RuntimeError(f"{cores} devices asked for, JAX has {len(jax.devices())}")
    atoms = diamond(8 * n**3)
    potential = SevenNet.from_checkpoint(model, skin=SKIN, dtype=np.float32)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float32)
    data = data.replace(velocities=jax.numpy.asarray(atoms.get_velocities(), np.float32))
    mesh = default_mesh(jax.devices()[:cores])
    dm = DistributedModel(potential, DomainConfig(potential.model_config.neighbor_config.cutoff, skin=SKIN,
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


def run_torch(model: str, n: int, cores: int, steps: int, side: str) -> dict:
    """``steps`` of sevenn with ``cores`` torch threads: its ASE calculator under ASE's velocity
    Verlet (torch-ase) or its model on a graph built once (torch-bare), after one warm-up step."""
    import torch
    from ase.units import fs

    torch.set_num_threads(cores)
    sys.path.insert(0, str(DATA))
    import make_reference  # the sevenn checkpoints of the reference data, sevenn's float32 calculator

    atoms = diamond(8 * n**3)
    calc = make_reference.calculator(model, None, "float32")
    if side == "torch-ase":
        from ase.md.verlet import VelocityVerlet

        atoms.calc = calc
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
        from sevenn import _keys as KEY
        from sevenn.atom_graph_data import AtomGraphData
        from sevenn.train.dataload import unlabeled_atoms_to_graph

        graph = AtomGraphData.from_numpy_dict(unlabeled_atoms_to_graph(atoms, calc.cutoff, with_shift=False))

        def call():
            # A copy per call: the model writes its outputs and the gradient flag into the graph.
            out = calc.model(graph.clone())
            return float(out[KEY.PRED_TOTAL_ENERGY]), out[KEY.PRED_FORCE].detach()

        pe_first, _ = call()  # warm-up
        setup_peak = _memory_kb("VmHWM")
        base = _start_peak()
        t0 = time.perf_counter()
        for _ in range(steps):
            pe_last, _ = call()
        seconds = time.perf_counter() - t0
    peak = _memory_kb("VmHWM")
    return dict(side=side, seconds=seconds, atom_steps_per_second=steps * len(atoms) / seconds,
                warmup_seconds=None, rebuilds=None, recompiles=None, pe_first=pe_first, pe_last=pe_last,
                memory_kb_per_atom=(peak - base) / len(atoms), peak_mb=max(setup_peak, peak) / 1024,
                torch_threads=torch.get_num_threads())


def worker(spec: str) -> int:
    kw = json.loads(spec)
    side = kw.pop("side")
    row = run_jaxdd(**kw) if side == "jaxdd" else run_torch(side=side, **kw)
    print(json.dumps(row), flush=True)
    return 0


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


def pinned(side: str, model: str, n: int, cores: int, steps: int, python: str | None = None,
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
    head = dict(side=side, model=model, n=n, n_atoms=8 * n**3, cores=len(use), steps=steps)
    rc, out, err, killed = watched([exe, __file__, "--worker", spec], env, use, limit_mb)
    if rc != 0 or killed:
        # A side that cannot run a size (out of memory, killed) is a result of the comparison,
        # not the end of the benchmark.
        why = killed or (f"killed by signal {-rc} (SIGKILL: most often the kernel's out-of-memory killer)"
                         if rc < 0 else f"exit status {rc}")
        print(f"{side} {model} on {cores} core(s), {8 * n**3} atoms failed ({why}); its stderr ends:\n"
              f"{err[-1500:]}", file=sys.stderr, flush=True)
        return dict(head, failed=why, atom_steps_per_second=None, seconds=None, warmup_seconds=None,
                    memory_kb_per_atom=None, peak_mb=None)
    return dict(json.loads(out.strip().splitlines()[-1]), **head)


def add_ratios(group: list) -> None:
    """Per row of one model and size: ``ratio``, jaxdd over the faster sevenn side on as many
    cores; ``speedup``, jaxdd on N devices over jaxdd on one (None where a side is missing)."""
    ok = [r for r in group if not r.get("failed")]
    one = next((r["atom_steps_per_second"] for r in ok if r["side"] == "jaxdd" and r["cores"] == 1), None)
    for r in group:
        r["ratio"] = r["speedup"] = None
        if r["side"] != "jaxdd" or r.get("failed"):
            continue
        torch = [t["atom_steps_per_second"] for t in ok if t["side"] != "jaxdd" and t["cores"] == r["cores"]]
        r["ratio"] = r["atom_steps_per_second"] / max(torch) if torch else None
        r["speedup"] = r["atom_steps_per_second"] / one if one and r["cores"] > 1 else None


def target_line(rows) -> str:
    """The target and whether it is met, part by part ("not measured" where a run is missing)."""
    vs_torch = {r["model"]: r["ratio"] for r in rows if r["side"] == "jaxdd" and r["cores"] == 1
                and r["n_atoms"] == TARGET_ATOMS and r.get("ratio") is not None}
    speedups = [(r["speedup"], r["model"], r["n_atoms"]) for r in rows
                if r["side"] == "jaxdd" and r["cores"] == 2 and r.get("speedup")]
    parts, states = [], []  # each part True (met), False (not met) or None (not measured)
    if vs_torch:
        missing = [m for m in MODELS if m not in vs_torch]
        states.append(False if min(vs_torch.values()) < TARGET_TORCH else None if missing else True)
        parts.append("sevenn: " + ", ".join(f"{m} {v:.2f}x" for m, v in vs_torch.items())
                     + (f"; {', '.join(missing)} not measured" if missing else ""))
    else:
        states.append(None)
        parts.append(f"sevenn: not measured (needs jaxdd and a sevenn side at {TARGET_ATOMS:,} atoms on one core)")
    if speedups:
        low, model, atoms = min(speedups)
        states.append(low >= TARGET_DEVICES)
        parts.append(f"2 devices: lowest {low:.2f}x 1 device ({model}, {atoms:,} atoms)")
    else:
        states.append(None)
        parts.append("2 devices: not measured")
    state = "NOT met" if False in states else "not measured" if None in states else "met"
    return f"target ({TARGET}): {state}: {'; '.join(parts)}"


def largest(model: str, side: str, start: int, limit_mb: float, python, xla_defaults: bool) -> dict:
    """Grow n from ``start`` (by a quarter, at least 1, each try) until ``side`` fails or passes
    ``limit_mb`` on one core: the last n that ran (None if ``start`` did not), and every try."""
    tries, n, best = [], start, None
    while True:
        row = pinned(side, model, n, 1, LARGEST_STEPS, python, limit_mb, xla_defaults)
        over = not row.get("failed") and row["peak_mb"] > limit_mb
        tries.append(dict(n=n, n_atoms=8 * n**3, peak_mb=row["peak_mb"], failed=row.get("failed")))
        print(f"largest: {side:10s} {model:9s} {8 * n**3:8,d} atoms: "
              + (f"failed ({row['failed']})" if row.get("failed") else f"peak {row['peak_mb']:,.0f} MB"), flush=True)
        if row.get("failed") or over:
            return dict(model=model, side=side, n=best, n_atoms=8 * best**3 if best else None, tries=tries)
        best, n = n, max(n + 1, round(n * 1.25))


def parse_args(argv=None):
    from timing import check_args

    p = argparse.ArgumentParser(description="SevenNet molecular dynamics: jaxdd against sevenn (torch).")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} (default both)")
    p.add_argument("--sizes", default="5,8", help="cubic 8-atom diamond cells repeated n×n×n, comma-separated n "
                                                  "(default 5,8: 1,000 and 4,096 atoms)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    p.add_argument("--cores", default="1,2", help="comma-separated core counts (torch threads) of the sevenn sides "
                                                  "(default 1,2)")
    p.add_argument("--devices", default="1,2", help="comma-separated device counts of jaxdd, each on as many cores "
                                                    "(default 1,2)")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated sides to run, of {', '.join(SIDES)} (default all; the ratio is over the "
                        "faster sevenn side run)")
    p.add_argument("--torch-python", default=None, metavar="PATH",
                   help="interpreter with torch and sevenn for the torch sides (default $JAXDD_TORCH_PYTHON, this "
                        f"one if it has them, else {DEFAULT_TORCH_PYTHON})")
    p.add_argument("--budget-gb", type=float, default=BUDGET_GB,
                   help=f"memory a child may use before it is killed and reported failed (default {BUDGET_GB:g}; "
                        "at most 90%% of the machine's)")
    p.add_argument("--largest", action="store_true",
                   help="also grow n for each model and side on one core until it fails or passes the budget")
    p.add_argument("--xla-defaults", action="store_true",
                   help=f"keep XLA's CPU defaults for jaxdd (else {' '.join(CPU_XLA_FLAGS)})")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    check_args(p, args, positive=("steps",), choices={"models": MODELS, "sides": SIDES})
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


def format_table(rows, notes) -> str:
    cols = ["model", "side", "atoms", "cores", "atom-steps/s", "seconds", "warm-up s", "work kB/atom", "peak MB",
            "jaxdd / sevenn", "vs 1 device"]
    lines = []
    for r in rows:
        head = [r["model"], r["side"], f"{r['n_atoms']:,}", str(r["cores"])]
        if r.get("failed"):
            lines.append(head + ["failed"] + ["-"] * 6)
            continue
        lines.append(head + [f"{r['atom_steps_per_second']:,.0f}", f"{r['seconds']:.2f}",
                             f"{r['warmup_seconds']:.1f}" if r.get("warmup_seconds") is not None else "-",
                             f"{r['memory_kb_per_atom']:.1f}", f"{r['peak_mb']:,.0f}",
                             f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-",
                             f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"])
    from timing import text_table

    return text_table(cols, lines, notes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    notes = []
    python = args.torch_python or torch_python()
    sides = list(args.sides)
    if any(s != "jaxdd" for s in sides) and (python is None or not has_sevenn(python)):
        notes.append(f"sevenn not run: {python or 'no interpreter'} lacks torch or sevenn (--torch-python, "
                     "$JAXDD_TORCH_PYTHON; pip install torch==2.13.0 sevenn==0.13.0)")
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
                row = pinned(side, model, n, cores, args.steps, python, limit, args.xla_defaults)
                speed = (f"failed: {row['failed']}" if row.get("failed")
                         else f"{row['atom_steps_per_second']:,.0f} atom-steps/s")
                print(f"{model:9s} {side:10s} {row['n_atoms']:6d} atoms {cores} core(s): {speed}", flush=True)
                if row.get("failed"):
                    notes.append(f"{side} {model} failed at {row['n_atoms']:,} atoms, {cores} core(s): {row['failed']}")
                group.append(row)
            add_ratios(group)
            rows += group
    print(f"\nSevenNet NVE ({args.steps} steps, dt {DT_FS} fs, 300 K), diamond Si a = 5.43 Å, float32; jaxdd on "
          "N devices on N cores (grid (N, 1, 1)), sevenn with N torch threads on N cores; jaxdd / sevenn: over the "
          "faster sevenn side on as many cores")
    print(format_table(rows, notes))
    print(target_line(rows))
    found = []
    if args.largest:
        start = max(args.sizes)
        for model in args.models:
            for side in sides:
                found.append(largest(model, side, start, limit, python, args.xla_defaults))
        print(f"\nlargest cell run within {limit / 1024:.1f} GB on one core ({LARGEST_STEPS} steps), from n = {start}:")
        for f in found:
            print(f"  {f['model']:9s} {f['side']:10s} "
                  + (f"n = {f['n']}: {f['n_atoms']:,} atoms" if f["n"] else f"none (n = {start} already failed)"))
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(benchmark="sevennet_md", models=list(args.models), steps=args.steps,
                                     budget_gb=args.budget_gb, results=rows, largest=found, notes=notes,
                                     target=target_line(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
