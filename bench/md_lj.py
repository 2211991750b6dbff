"""Benchmark: molecular dynamics of the LAMMPS LJ melt, jaxdd against LAMMPS.

    python bench/md_lj.py [--n-cells 20] [--steps 100] [--devices 1,2] [--dtypes float32,float64]
                          [--repeats 3] [--lammps lmp | --no-lammps] [--lammps-suffix opt] [--json PATH]
                          [--profile DIR]

The problem is the LAMMPS distribution's ``bench/in.lj``: fcc lattice at density 0.8442 (20×20×20 cells,
32,000 atoms by default), velocities at T = 1.44, ``pair_style lj/cut 2.5`` (no shift),
neighbour skin 0.3, NVE velocity Verlet with dt = 0.005 τ, in LJ reduced units
(σ = ε = m = 1). The initial velocities come from numpy's random stream, not LAMMPS's, so
the trajectories differ after step 0; the step-0 potential energy (perfect lattice) is the
same.

For each device count and dtype, ``DomainParallel`` runs the melt once to compile its
programs and settle its capacities (warm-up, same start and length), then ``--repeats``
timed runs, each from a fresh start; the fastest is reported (as LAMMPS's fastest of as many
runs), so that a slow phase of a shared machine does not decide a ratio. It reports atom-steps per second, plan rebuilds, and the potential
energy per atom at the first and last step. On a CPU the devices are virtual
(``jax_num_cpu_devices``), and each run takes place in a child process bound to as many
cores as it has devices: one XLA CPU device (its intra-op threads, the kernels' threads)
would otherwise use every core of the machine.

Two force paths: ``jnp`` (``jaxdd.models.lj.LennardJones``, plain jax.numpy, forces by
autodiff) and ``fused`` (``jaxdd.models.lj_kernel.LennardJonesKernel``: the fused C++ FFI
kernel, whose direct forces the dynamics take), the latter when the build has the compiled
library (``--paths``). Both search neighbours with the compiled cell list on CPU devices and
list each pair once, as LAMMPS's ``newton on`` half list does (under decomposition on one
of the two ranks holding it, evenly across a cut; the ghost end's share goes home each step). Plan
rebuilds run on the devices.

LAMMPS runs in the same benchmark run when ``lmp`` is on the PATH (``lmp -in in.lj`` on one core,
``mpirun -np N lmp -in in.lj`` on N), ``--repeats`` times right before each jaxdd row, on
that row's core count: each jaxdd figure is divided by the fastest of the LAMMPS runs beside
it (N devices against N MPI ranks), so that both sides of a ratio are measured in the same
phase of a machine whose speed drifts within minutes. Otherwise the figures measured on
this machine and recorded in the project's oracle notes are used, labelled as not measured
in this run. The targets: the best jaxdd path reaches 0.8x LAMMPS, and the jnp path 0.3x,
on every core count.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

# float64 runs need x64; float32 runs are made float32 by their data. Importing jaxdd does not
# start JAX's backends, so the device count can still be set in main().
jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.dynamics import DomainParallel, VelocityVerlet  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM, lj_melt_data  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py
from timing import check_args, run_pinned, write_record  # noqa: E402

CUTOFF = 2.5
SKIN = 0.3
#: Extra width of the ghost shell (DomainConfig.skin). The neighbour list keeps LAMMPS's skin
#: of 0.3 (rebuilt on device when an atom has moved 0.15); a wider shell lets atoms move
#: further before they migrate and the halo plan is rebuilt (about once in 100 steps of the
#: 32,000-atom melt, against three with a shell of 1.0; each rebuild leaves the compiled loop
#: and builds the neighbour lists afresh), at the price of more ghost atoms per rank.
HALO_SKIN = 2.0
DT = 0.005
TEMPERATURE = 1.44
DTYPES = ("float32", "float64")
PATHS = ("jnp", "fused")
#: XLA's CPU backend (jax 0.10) hands elementwise fusions to YNNPACK by default; on the jnp
#: path's [edges]-long LJ expressions that is about twice as slow as XLA's own emitter (the
#: profile: one YNNPACK fusion took 24 ms of a 60 ms step). The benchmark turns it off for
#: its runs unless XLA_FLAGS already names the option (--xla-defaults keeps XLA's default).
CPU_XLA_FLAGS = "--xla_cpu_experimental_ynn_fusion_type="
TARGET = 0.8  # best jaxdd path / LAMMPS on equal cores
JNP_TARGET = 0.3  # the jnp path / LAMMPS on equal cores

#: LAMMPS (Debian package ``lammps``) on this 2-core machine, 32,000-atom melt, 100 steps:
#: atom-steps per second by core count. Source: the speed references of the oracle notes.
LAMMPS_REFERENCE = {1: 2.3e6, 2: 4.4e6}
REFERENCE_LABEL = "reference (oracles.md), not measured in this run"

IN_LJ = """\
# 3d Lennard-Jones melt
units           lj
atom_style      atomic
lattice         fcc 0.8442
region          box block 0 {n} 0 {n} 0 {n}
create_box      1 box
create_atoms    1 box
mass            1 1.0
velocity        all create 1.44 87287 loop geom
pair_style      lj/cut 2.5
pair_coeff      1 1 1.0 1.0 2.5
neighbor        0.3 bin
neigh_modify    delay 0 every 20 check no
fix             1 all nve
thermo          50
run             {steps}
"""

_LOOP = re.compile(r"Loop time of\s+(\S+)\s+on\s+(\d+)\s+procs\s+for\s+(\d+)\s+steps\s+with\s+(\d+)\s+atoms")


# ---------------------------------------------------------------------------- arguments


def _int_list(p: argparse.ArgumentParser, name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        p.error(f"--{name} must be comma-separated positive integers, got {text!r}")
    if not values or min(values) < 1:
        p.error(f"--{name} must be comma-separated positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Molecular dynamics of the LAMMPS LJ melt: jaxdd against LAMMPS.")
    p.add_argument("--n-cells", type=int, default=20, help="fcc cells per axis (default 20: 32,000 atoms)")
    p.add_argument("--steps", type=int, default=100, help="NVE steps per run (default 100)")
    p.add_argument("--devices", default="1,2", help="comma-separated device counts (default 1,2)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes (default float32,float64)")
    p.add_argument("--paths", default="jnp,fused", help="comma-separated force paths: jnp, fused (default both; "
                                                         "fused is skipped when the kernels are not built)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs of each row, jaxdd's and LAMMPS's; the fastest is reported (default 3)")
    p.add_argument("--halo-skin", type=float, default=HALO_SKIN,
                   help=f"extra ghost-shell width beyond the cutoff (default {HALO_SKIN}; at least the neighbour "
                        f"skin {SKIN})")
    p.add_argument("--lammps", default="lmp", metavar="BIN", help="LAMMPS executable (default lmp, looked up on PATH)")
    p.add_argument("--lammps-suffix", default="", metavar="SUFFIX",
                   help="run LAMMPS with -sf SUFFIX (e.g. opt: its optimised lj/cut/opt pair style, when the build "
                        "has the OPT package); default: plain lj/cut")
    p.add_argument("--no-lammps", action="store_true", help="do not run LAMMPS; use the recorded reference figures")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH as JSON")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="after each row's timed runs, trace one more run of --steps steps (its list builds "
                        "and rebuilds as in a timed run) into DIR/<row>/ and print where a step's time goes "
                        "(bench/profile_table.py), with LAMMPS's own breakdown of its loop (Pair, Neigh, Comm, "
                        "Modify, ...) beside it")
    p.add_argument("--xla-defaults", action="store_true",
                   help=f"keep XLA's CPU defaults (else {CPU_XLA_FLAGS} is added to XLA_FLAGS)")
    args = p.parse_args(argv)
    check_args(p, args, positive=("n_cells", "steps", "repeats"), choices={"dtypes": DTYPES, "paths": PATHS})
    if not (args.halo_skin >= SKIN and np.isfinite(args.halo_skin)):
        p.error(f"--halo-skin must be a number >= the neighbour skin {SKIN}, got {args.halo_skin}")
    args.devices = _int_list(p, "devices", args.devices)
    return args


def set_device_count(n: int) -> None:
    """Ask for ``n`` virtual CPU devices; only possible before JAX's backends start."""
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
        pass  # backends already running (main called in a live process): use what is there


# ---------------------------------------------------------------------------- jaxdd


def bench_jaxdd(n_devices: int, dtype: str, n_cells: int, steps: int, path: str = "jnp",
                halo_skin: float = HALO_SKIN, repeats: int = 1, profile=None) -> dict:
    """One warm-up run and ``repeats`` timed runs of ``steps`` NVE steps on ``n_devices``
    devices, each from the same start; the figures of the fastest. ``profile``: None, or
    (trace folder, the process's HLO dump folder, steps): those steps are then traced after
    the timed runs and broken down (bench/profile_table.py) into the result's ``profile``."""
    data = lj_melt_data(n_cells, temperature=TEMPERATURE, dtype=np.dtype(dtype))
    n_atoms = int(data.positions.shape[0])
    # The model's parameters follow the positions' dtype; its skin keeps the neighbour list
    # between steps (a Verlet list rebuilt on device when an atom has moved skin / 2). Each
    # pair is listed once (a half list, LAMMPS's "newton on"), on one of the ranks holding it.
    if path == "fused":
        from jaxdd.models.lj_kernel import LennardJonesKernel

        model = LennardJonesKernel(1.0, 1.0, CUTOFF, skin=SKIN, half_list=True)
    else:
        model = LennardJones(1.0, 1.0, CUTOFF, skin=SKIN, half_list=True)
    dm = DistributedModel(model, DomainConfig(CUTOFF, skin=halo_skin, mesh=default_mesh(jax.devices()[:n_devices])))
    md = DomainParallel(dm, VelocityVerlet(DT), kB=1.0)

    t0 = time.perf_counter()
    md.run(md.init(data), steps)  # compiles the loop; capacities grow here if they must
    warmup_s = time.perf_counter() - t0
    warmup = md.last_run

    timed = []
    for _ in range(repeats):
        state = md.init(data)
        first = md.thermo(state)
        state = md.run(state, steps)
        timed.append((md.last_run, first, state))
    stats, first, state = min(timed, key=lambda t: t[0].seconds)
    last = md.thermo(state)
    if state.arrays["positions"].dtype != np.dtype(dtype):
        raise RuntimeError(f"positions came out {state.arrays['positions'].dtype}, not {dtype}: the timing would be "
                           f"of the wrong precision")
    pe0 = float(first["potential_energy"][0]) / n_atoms
    extra = {}
    if profile is not None:
        import profile_table

        extra["profile"] = profile_table.record_md(md, state, profile)
    return dict(extra,
        path=path, devices=n_devices, dtype=dtype, n_atoms=n_atoms, steps=stats.steps,
        seconds=stats.seconds, atom_steps_per_second=stats.atom_steps_per_second,
        seconds_of_each_run=[t[0].seconds for t in timed],
        rebuilds=stats.rebuilds, migrations=stats.migrations, recompiles=stats.recompiles,
        warmup_seconds=warmup_s, warmup_rebuilds=warmup.rebuilds, warmup_recompiles=warmup.recompiles,
        pe_per_atom_first=pe0, pe_per_atom_last=float(last["potential_energy"][0]) / n_atoms,
        pe_per_atom_first_minus_lammps=pe0 - LAMMPS_MELT_ENERGY_PER_ATOM,
        total_energy_drift_per_atom=float(last["total_energy"][0] - first["total_energy"][0]) / n_atoms,
        temperature_first=float(first["temperature"][0]), temperature_last=float(last["temperature"][0]),
    )


def fused_status() -> dict:
    """Whether this build has the fused-kernel (FFI) path to run."""
    if importlib.util.find_spec("jaxdd.ffi") is None:
        return dict(available=False, reason="not available in this build (no jaxdd.ffi module)")
    from jaxdd import ffi

    if not ffi.available():
        return dict(available=False, reason="not available in this build (the compiled kernel library is missing: "
                                            "pip install -e . builds it)")
    return dict(available=True, reason="")


# ---------------------------------------------------------------------------- LAMMPS


def parse_lammps_log(text: str) -> dict:
    """Loop time, procs, steps, atoms and the E_pair (per atom) of the first and last thermo rows."""
    m = _LOOP.search(text)
    if m is None:
        raise ValueError("no 'Loop time of ... on ... procs for ... steps with ... atoms' line in LAMMPS's output")
    seconds, procs, steps, atoms = float(m.group(1)), int(m.group(2)), int(m.group(3)), int(m.group(4))
    out = dict(seconds=seconds, procs=procs, steps=steps, n_atoms=atoms,
               atom_steps_per_second=steps * atoms / seconds if seconds > 0 else float("nan"))
    # LAMMPS's own account of the loop: seconds (average over ranks) and share of each section.
    # Rows of its "MPI task timing breakdown": section | min | avg | max | %varavg | %total.
    breakdown = {}
    for line in text[m.end():].splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) == 6 and cells[0].isalpha() and cells[0] != "Section":
            try:
                breakdown[cells[0]] = dict(avg_seconds=float(cells[2]), percent=float(cells[5]))
            except ValueError:
                continue
    if breakdown:
        out["breakdown"] = breakdown
    lines = text[:m.start()].splitlines()
    header = max((i for i, line in enumerate(lines) if line.split()[:1] == ["Step"]), default=None)
    if header is not None:
        cols = lines[header].split()
        key = next((c for c in ("E_pair", "PotEng") if c in cols), None)
        rows = []
        for line in lines[header + 1:]:
            fields = line.split()
            if len(fields) != len(cols):
                break
            try:
                rows.append([float(f) for f in fields])
            except ValueError:
                break
        if key is not None and rows:
            j = cols.index(key)
            out.update(pe_per_atom_first=rows[0][j], pe_per_atom_last=rows[-1][j],
                       thermo_first_step=int(rows[0][0]), thermo_last_step=int(rows[-1][0]))
    return out


def run_lammps(lmp: str, cores: int, n_cells: int, steps: int, repeats: int = 1, suffix: str = "") -> dict:
    """LAMMPS on the melt with ``cores`` MPI ranks (1: no mpirun), ``repeats`` times; the
    parsed figures of the fastest run. ``suffix``: LAMMPS's ``-sf`` (its accelerated variant
    of each style, e.g. ``opt``), or "" for the plain styles."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # Open MPI refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = [lmp, "-in", "in.lj"] + (["-sf", suffix] if suffix else [])
    if cores > 1:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise FileNotFoundError("mpirun is not on the PATH")
        cmd = [mpirun, "-np", str(cores), *cmd]
    runs = []
    with tempfile.TemporaryDirectory(prefix="md_lj_") as tmp:
        Path(tmp, "in.lj").write_text(IN_LJ.format(n=n_cells, steps=steps))
        for _ in range(repeats):
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}")
            figures = parse_lammps_log(proc.stdout)
            if figures["procs"] != cores:
                raise RuntimeError(f"LAMMPS ran on {figures['procs']} procs, not {cores}")
            runs.append(figures)
    best = min(runs, key=lambda f: f["seconds"])
    return dict(best, seconds_of_each_run=[f["seconds"] for f in runs], source="measured in this run",
                command=" ".join(cmd), style="lj/cut" + (f"/{suffix}" if suffix else ""))


def find_lammps(args) -> tuple[str | None, list[str]]:
    """The LAMMPS executable to run beside the rows (None: use the reference) and notes."""
    lmp = None if args.no_lammps else shutil.which(args.lammps)
    if args.no_lammps:
        return None, ["LAMMPS not run (--no-lammps)"]
    if lmp is None:
        return None, [f"LAMMPS is not installed ({args.lammps!r} is not on the PATH)"]
    return lmp, []


def lammps_beside(lmp: str | None, cores: int, args, notes: list[str]) -> dict | None:
    """LAMMPS on ``cores`` ranks, measured now (right before a jaxdd row), or None when it
    is not run or fails (the failure goes to ``notes``)."""
    if lmp is None:
        return None
    try:
        return run_lammps(lmp, cores, args.n_cells, args.steps, args.repeats, args.lammps_suffix)
    except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
        notes.append(f"LAMMPS on {cores} core(s) failed: {err}")
        return None


def lammps_figures(rows: list[dict], args, notes: list[str]) -> dict:
    """{cores: figures} for the core counts of ``--devices``: the fastest LAMMPS run beside
    any row of that core count, else the recorded reference."""
    out = {}
    for cores in args.devices:
        measured = [r["lammps_beside"] for r in rows if r["devices"] == cores and r.get("lammps_beside")]
        if measured:
            best = min(measured, key=lambda f: f["seconds"])
            out[cores] = dict(best, seconds_of_each_run=[t for f in measured for t in f["seconds_of_each_run"]])
        elif cores in LAMMPS_REFERENCE:
            out[cores] = dict(source=REFERENCE_LABEL, procs=cores, n_atoms=32000, steps=100,
                              atom_steps_per_second=LAMMPS_REFERENCE[cores])
    recorded = any(f["source"] == REFERENCE_LABEL for f in out.values())
    if recorded and args.lammps_suffix:
        notes.append(f"the reference figures are of plain lj/cut, not of -sf {args.lammps_suffix}")
    if recorded and (args.n_cells != 20 or args.steps != 100):
        notes.append("the reference figures are for 32,000 atoms and 100 steps, not this run's size")
    return out


# ---------------------------------------------------------------------------- report


def target_verdict(rows: list[dict], lammps: dict) -> dict:
    """The best jaxdd ratio, and the best jnp row's, over LAMMPS for each core count that has
    both (each row's ratio is to the LAMMPS runs beside it); whether all reach TARGET (best)
    and JNP_TARGET (jnp)."""
    per_cores = {}
    for cores in lammps:
        mine = [r for r in rows if r["devices"] == cores and r["ratio_to_lammps"] is not None]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["ratio_to_lammps"])
        jnp_rows = [r for r in mine if r["path"] == "jnp"]
        per_cores[cores] = dict(best_dtype=best["dtype"], best_path=best["path"], ratio=best["ratio_to_lammps"])
        if jnp_rows:
            top = max(jnp_rows, key=lambda r: r["ratio_to_lammps"])
            per_cores[cores].update(jnp_dtype=top["dtype"], jnp_ratio=top["ratio_to_lammps"])
    met = bool(per_cores) and all(v["ratio"] >= TARGET for v in per_cores.values())
    jnp_ratios = [v["jnp_ratio"] for v in per_cores.values() if "jnp_ratio" in v]
    jnp_met = all(r >= JNP_TARGET for r in jnp_ratios) if jnp_ratios else None
    return dict(threshold=TARGET, per_cores=per_cores, met=met if per_cores else None, jnp_threshold=JNP_TARGET,
                jnp_met=jnp_met)


def format_table(rows, fused, lammps, notes, verdict, header, steps) -> str:
    cols = ["path", "devices", "dtype", "atom-steps/s", "seconds", "warm-up s", "rebuilds", "PE/N step 0",
            f"PE/N step {steps}", "dE_tot/N", "LAMMPS beside", "vs LAMMPS"]
    body = []  # (cells, trailing text outside the columns)
    for r in rows:
        ratio = f"{r['ratio_to_lammps']:.3f}x" if r["ratio_to_lammps"] is not None else "n/a"
        beside = r.get("lammps_beside")
        body.append(([f"jaxdd ({r['path']})", str(r["devices"]), r["dtype"], f"{r['atom_steps_per_second']:,.0f}",
                      f"{r['seconds']:.3f}", f"{r['warmup_seconds']:.1f}", str(r["rebuilds"]),
                      f"{r['pe_per_atom_first']:.10f}", f"{r['pe_per_atom_last']:.10f}",
                      f"{r['total_energy_drift_per_atom']:.1e}",
                      f"{beside['atom_steps_per_second']:,.0f}" if beside else "-", ratio], ""))
    if not fused["available"]:
        body.append((["fused kernels", "-", "-"], fused["reason"]))
    for cores, f in sorted(lammps.items()):
        measured = f["source"] != REFERENCE_LABEL
        pe = [f"{f[k]:.10f}" if k in f else "-" for k in ("pe_per_atom_first", "pe_per_atom_last")]
        body.append(([f"LAMMPS {f.get('style', 'lj/cut')}", str(cores), "float64", f"{f['atom_steps_per_second']:,.0f}",
                      f"{f['seconds']:.3f}" if measured else "-", "-", "-", *pe, "-", "-", "1x"],
                     f"({cores} MPI rank{'s' if cores > 1 else ''}; {f['source']}"
                     f"{'; the fastest of the runs beside the rows' if measured else ''})"))
    widths = [max([len(c)] + [len(cells[i]) for cells, _ in body if i < len(cells)]) for i, c in enumerate(cols)]
    left = {0, 2}

    def line(cells, tail=""):
        text = "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return f"{text}  {tail}".rstrip()

    out = [header, line(cols)] + [line(cells, tail) for cells, tail in body]
    out += [f"note: {n}" for n in notes]
    out.append(f"PE/N at step 0 is the perfect lattice's: LAMMPS gives {LAMMPS_MELT_ENERGY_PER_ATOM:.12f}. Later "
               "energies differ from LAMMPS's: its initial velocities come from its own random stream")
    if verdict["per_cores"]:
        parts = [f"{c} core{'s' if c > 1 else ''} {v['ratio']:.3f}x ({v['best_path']}, {v['best_dtype']})"
                 for c, v in sorted(verdict["per_cores"].items())]
        state = "met" if verdict["met"] else "NOT met"
        out.append(f"target (best jaxdd path >= {TARGET}x LAMMPS on equal cores): {state}: " + ", ".join(parts))
        if verdict["jnp_met"] is not None:
            parts = [f"{c} core{'s' if c > 1 else ''} {v['jnp_ratio']:.3f}x ({v['jnp_dtype']})"
                     for c, v in sorted(verdict["per_cores"].items()) if "jnp_ratio" in v]
            state = "met" if verdict["jnp_met"] else "NOT met"
            out.append(f"target (jnp path >= {JNP_TARGET}x LAMMPS on equal cores): {state}: " + ", ".join(parts))
    else:
        out.append(f"target (best jaxdd path >= {TARGET}x LAMMPS on equal cores): no LAMMPS figure for these "
                   "device counts")
    return "\n".join(out)


def format_profiles(rows: list[dict], lammps: dict, steps: int) -> str:
    """Each profiled row's breakdown (ms per step by part) and, per core count, LAMMPS's own."""
    import profile_table

    out = [f"\nWhere a step's time goes (a traced run of {steps} steps after the timed runs; bench/profile_table.py)"]
    for r in rows:
        if "profile" in r:
            title = f"jaxdd ({r['path']}) {r['devices']} device(s) {r['dtype']}, {r['n_atoms']:,} atoms"
            out.append(profile_table.format_table(r["profile"], title))
    for cores, f in sorted(lammps.items()):
        if "breakdown" in f:
            ms = 1e3 / f["steps"]
            out.append(f"LAMMPS {f.get('style', 'lj/cut')} {cores} rank(s): {f['seconds'] * ms:.3f} ms per step "
                       "(its MPI task timing breakdown, average over ranks)")
            out += [f"  {k:32s} {v['avg_seconds'] * ms:10.4f} {v['percent'] / 100:7.1%}"
                    for k, v in f["breakdown"].items()]
    return "\n".join(out)


def pinned_run(n_devices: int, dtype: str, n_cells: int, steps: int, path: str, halo_skin: float,
               repeats: int = 1, profile_dir: Path | None = None) -> dict:
    """:func:`bench_jaxdd` in a child process bound to ``n_devices`` cores (all of them when the
    machine has fewer): one XLA CPU device would otherwise use every core of the machine, and
    the comparison with LAMMPS's N ranks would not be on equal cores."""
    row, cores = run_pinned(__file__, dict(n_devices=n_devices, dtype=dtype, n_cells=n_cells, steps=steps, path=path,
                                           halo_skin=halo_skin, repeats=repeats,
                                           profile_dir=None if profile_dir is None else str(profile_dir)), n_devices)
    return dict(row, cores=cores)


def worker(spec: str) -> int:
    """One pinned run (see :func:`pinned_run`): its figures as one JSON line on stdout."""
    kw = json.loads(spec)
    set_device_count(kw["n_devices"])
    profile = None
    if kw.get("profile_dir"):
        import profile_table

        folder = Path(kw["profile_dir"])
        profile = (str(folder / "trace"), str(folder / "hlo"), kw["steps"])
        # The HLO names the trace's operations by: dumped by this child's XLA, set before it starts.
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {profile_table.dump_flags(profile[1])}".strip()
    print(json.dumps(bench_jaxdd(kw["n_devices"], kw["dtype"], kw["n_cells"], kw["steps"], kw["path"],
                                 kw["halo_skin"], kw.get("repeats", 1), profile)), flush=True)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if not args.xla_defaults and "ynn_fusion_type" not in flags:  # before JAX starts; the children inherit it
        os.environ["XLA_FLAGS"] = f"{flags} {CPU_XLA_FLAGS}".strip()
    set_device_count(max(args.devices))
    devices = jax.devices()
    if max(args.devices) > len(devices):
        sys.exit(f"--devices asks for {max(args.devices)} devices but JAX sees {len(devices)}")
    device = f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind}), {os.cpu_count()} CPU cores"
    c = args.n_cells

    fused = fused_status()
    paths = [x for x in args.paths if x != "fused" or fused["available"]]
    rows = []
    pinned = devices[0].platform == "cpu" and hasattr(os, "sched_setaffinity")  # Linux binds cores
    if args.profile is not None and not pinned:
        sys.exit("--profile runs each row in a child process of its own (its HLO is dumped before its JAX starts), "
                 "which needs a CPU platform with sched_setaffinity (Linux)")
    lmp, notes = find_lammps(args)
    for path in paths:
        for n in args.devices:
            for dtype in args.dtypes:
                beside = lammps_beside(lmp, n, args, notes)  # the same phase of the machine as the row
                if pinned:  # N virtual devices on N cores, as LAMMPS's N ranks
                    folder = None if args.profile is None else args.profile / f"{path}-{n}dev-{dtype}"
                    rows.append(pinned_run(n, dtype, c, args.steps, path, args.halo_skin, args.repeats, folder))
                else:
                    rows.append(bench_jaxdd(n, dtype, c, args.steps, path, args.halo_skin, args.repeats))
                r = rows[-1]
                r["lammps_beside"] = beside
                print(f"jaxdd ({path}) {n} device(s) {dtype}: {r['atom_steps_per_second']:,.0f} atom-steps/s "
                      f"({r['steps']} steps in {r['seconds']:.3f} s, warm-up {r['warmup_seconds']:.1f} s, "
                      f"{r['rebuilds']} rebuilds, {r['recompiles']} recompiles)"
                      + (f"; LAMMPS beside it {beside['atom_steps_per_second']:,.0f}" if beside else ""), flush=True)
    lammps = lammps_figures(rows, args, notes)
    for r in rows:
        ref = r["lammps_beside"] or lammps.get(r["devices"])
        r["ratio_to_lammps"] = r["atom_steps_per_second"] / ref["atom_steps_per_second"] if ref else None
        if r["recompiles"]:
            notes.append(f"the timed {r['path']} run on {r['devices']} device(s), {r['dtype']}, recompiled {r['recompiles']} "
                         "time(s); its figure includes compilation")
    verdict = target_verdict(rows, lammps)
    n_atoms = rows[0]["n_atoms"]
    header = (f"\nLJ melt NVE: {n_atoms:,} atoms ({c}^3 fcc cells), lj/cut {CUTOFF}, skin {SKIN} "
              f"(ghost shell {CUTOFF} + {args.halo_skin}), dt {DT}, "
              f"{args.steps} steps, T0 {TEMPERATURE}; fastest of {args.repeats} timed run(s) per row; {device}; "
              f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(format_table(rows, fused, lammps, notes, verdict, header, args.steps), flush=True)
    if args.profile is not None:
        print(format_profiles(rows, lammps, args.steps), flush=True)
    if args.json is not None:
        record = dict(
            benchmark="md_lj", n_cells=c, n_atoms=n_atoms, steps=args.steps, repeats=args.repeats, cutoff=CUTOFF,
            skin=SKIN, halo_skin=args.halo_skin, dt=DT,
            temperature=TEMPERATURE, device=device, xla_flags=os.environ.get("XLA_FLAGS", ""),
            lammps_energy_per_atom=LAMMPS_MELT_ENERGY_PER_ATOM,
            results=rows, fused=fused, lammps={str(k): v for k, v in lammps.items()}, notes=notes,
            target=dict(verdict, per_cores={str(k): v for k, v in verdict["per_cores"].items()}),
        )
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
