"""Benchmark: molecular dynamics of a MACE model, jaxdd against mace-torch, on equal pinned cores.

    python bench/mace_md.py [--model reference|mp0-medium] [--channels C] [--sizes 10,16] [--steps 10]
                            [--cores 1,2] [--dtypes float32,float64] [--no-torch] [--sides jaxdd,torch-bare]
                            [--json PATH]

``--model reference`` (the default) is the reference architecture of the tests
(``tests/data/mace``): ``ScaleShiftMACE``, elements H, C, O, two
``RealAgnosticResidualInteractionBlock`` layers, hidden irreps ``16x0e + 16x1o``, ``max_ell`` 3,
correlation 3, cutoff 5 Å. ``--model mp0-medium`` is MACE-MP-0 medium's size: hidden irreps
``128x0e + 128x1o`` (``--channels`` changes the 128, e.g. for a quick check), ``max_ell`` 3,
correlation 3, 2 interactions, cutoff 6 Å, 8 Bessel functions, radial MLP [64, 64, 64], readout
MLP ``16x0e``, elements H, C, O (those of the system; MP-0 knows 89, which changes only the
per-element weight tables). With torch and mace-torch installed the benchmark builds the model
in mace-torch (seeded random weights) and converts it with ``MACE.from_torch``, so both sides run
the same weights; without them jaxdd runs alone (the reference architecture on
``tests/data/mace/trained.npz``, the MP-0 size natively built) and says so.

The full MP-0-medium comparison (4,096 atoms on one core takes a while; run on a quiet
machine)::

    python bench/mace_md.py --model mp0-medium --sizes 10,16 --cores 1 --steps 10 --json mace_mp0.json

The system: ``n³`` atoms of random H/C/O on a jittered simple-cubic lattice of spacing 2.15 Å
(0.1 atoms/Å³, about 50 neighbours within 5 Å), periodic: ``--sizes 10,16`` gives 1,000 and
4,096 atoms. Each side runs ``--steps`` NVE velocity-Verlet steps (dt 0.5 fs, T0 300 K):

* jaxdd: ``DomainParallel`` on N virtual CPU devices (N = cores), neighbour skin 1 Å (lists
  rebuilt on the devices when an atom has moved 0.5 Å); one warm-up run (compilation) and a
  timed run from a fresh start;
* mace-torch, its ASE calculator (``MACECalculator`` driving ``ase.md.VelocityVerlet``);
* mace-torch, a bare loop: mace's own graph construction (``AtomicData.from_config``, matscipy
  neighbour list) and ``model(batch)`` every step, velocity Verlet in torch; one warm-up step.

Every configuration runs in a child process bound to its cores (torch with as many threads).
It prints atom-steps per second, the ratio of jaxdd to the faster mace-torch path of the same
dtype on the same cores, and the working memory per atom of the timed run: the peak resident
memory of the process during it minus its resident memory just before (set-up, compilation and
warm-up left out), in kB/atom. Target: jaxdd on one core >= 1.0x mace-torch.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "mace"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py

SPACING = 2.15  # Å, simple-cubic lattice: 0.1 atoms per Å³
DT_FS = 0.5
T0 = 300.0
SKIN = 1.0
TARGET = 1.0  # jaxdd / mace-torch on one core
SIDES = ("jaxdd", "torch-ase", "torch-bare")
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("mace") is not None


def system(n: int, seed: int = 0):
    """ase.Atoms: n³ random H/C/O atoms, jittered simple cubic, periodic; Maxwell velocities at T0."""
    import numpy as np
    from ase import Atoms
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution

    rng = np.random.default_rng(seed)
    grid = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3) * SPACING
    atoms = Atoms(numbers=rng.choice([1, 6, 8], n**3), positions=grid + rng.normal(0, 0.15, grid.shape),
                  cell=np.eye(3) * n * SPACING, pbc=True)
    MaxwellBoltzmannDistribution(atoms, temperature_K=T0, rng=rng)
    return atoms


MODELS = ("reference", "mp0-medium")


def mp0_settings(channels: int) -> dict:
    """MACE-MP-0 medium's architecture (``channels`` per irrep; 128 in the release), in jaxdd's terms."""
    return dict(species=(1, 6, 8), r_max=6.0, num_bessel=8, num_polynomial_cutoff=5, max_ell=3,
                hidden_irreps=f"{channels}x0e + {channels}x1o", mlp_irreps="16x0e", num_interactions=2,
                correlation=3, radial_mlp=(64, 64, 64), avg_num_neighbors=60.0,
                atomic_energies=(-1.1, -8.2, -4.9), scale=1.0, shift=0.0)


def torch_model(dtype: str, model: str = "reference", channels: int = 128):
    """The mace-torch model (seeded), in ``dtype``."""
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import numpy as np
    import torch

    sys.path.insert(0, str(DATA))
    import make_reference

    torch.set_default_dtype(torch.float64)
    if model == "reference":
        built = make_reference.build_model("RealAgnosticResidualInteractionBlock", 1)
    else:
        from e3nn import o3
        from mace import modules

        torch.manual_seed(1)
        c = mp0_settings(channels)
        residual = modules.RealAgnosticResidualInteractionBlock
        built = modules.ScaleShiftMACE(
            r_max=c["r_max"], num_bessel=c["num_bessel"], num_polynomial_cutoff=c["num_polynomial_cutoff"],
            max_ell=c["max_ell"], interaction_cls=residual, interaction_cls_first=residual,
            num_interactions=c["num_interactions"], num_elements=len(c["species"]),
            hidden_irreps=o3.Irreps(c["hidden_irreps"]), MLP_irreps=o3.Irreps(c["mlp_irreps"]),
            atomic_energies=np.asarray(c["atomic_energies"]), avg_num_neighbors=c["avg_num_neighbors"],
            atomic_numbers=list(c["species"]), correlation=c["correlation"], gate=torch.nn.functional.silu,
            atomic_inter_scale=c["scale"], atomic_inter_shift=c["shift"], radial_MLP=list(c["radial_mlp"]))
    return built.to(getattr(torch, dtype))


def jaxdd_model(dtype: str, with_torch: bool, model: str = "reference", channels: int = 128):
    from jaxdd.models.mace import MACE

    if with_torch:
        return MACE.from_torch(torch_model("float64", model, channels), skin=SKIN, dtype=dtype)
    if model == "reference":
        return MACE.from_torch(DATA / "trained.npz", skin=SKIN, dtype=dtype)
    return MACE(**mp0_settings(channels), skin=SKIN, dtype=dtype, seed=1)


def _memory_kb(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of this process, kB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


def _start_peak() -> float:
    """Reset the peak-RSS mark (Linux ``clear_refs``) and return the RSS now, kB: the working
    memory of what follows is then ``VmHWM - start``, set-up and compilation left out."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _memory_kb("VmRSS")


def run_jaxdd(n: int, cores: int, dtype: str, steps: int, with_torch: bool, model: str = "reference",
              channels: int = 128) -> dict:
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_num_cpu_devices", cores)
    import numpy as np
    from ase.units import fs

    import jaxdd
    from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
    from jaxdd.dynamics import DomainParallel, VelocityVerlet

    atoms = system(n)
    model = jaxdd_model(dtype, with_torch, model, channels)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.dtype(dtype))
    data = data.replace(velocities=jax.numpy.asarray(atoms.get_velocities(), dtype))
    dm = DistributedModel(model, DomainConfig(model.model_config.neighbor_config.cutoff, skin=SKIN,
                                              mesh=default_mesh(jax.devices()[:cores])))
    md = DomainParallel(dm, VelocityVerlet(DT_FS * fs))
    t0 = time.perf_counter()
    md.run(md.init(data), steps)
    warmup = time.perf_counter() - t0
    base = _start_peak()
    state = md.init(data)
    first = md.thermo(state)
    state = md.run(state, steps)
    stats = md.last_run
    last = md.thermo(state)
    return dict(side="jaxdd", seconds=stats.seconds, atom_steps_per_second=stats.atom_steps_per_second,
                warmup_seconds=warmup, rebuilds=stats.rebuilds, recompiles=stats.recompiles,
                pe_first=float(first["potential_energy"][0]), pe_last=float(last["potential_energy"][0]),
                memory_kb_per_atom=(_memory_kb("VmHWM") - base) / len(atoms))


def _mace_batch(atoms, z_table, r_max, dtype):
    import torch
    from mace import data as mace_data
    from mace.tools import torch_geometric

    config = mace_data.config_from_atoms(atoms)
    graph = mace_data.AtomicData.from_config(config, z_table=z_table, cutoff=r_max)
    batch = torch_geometric.batch.Batch.from_data_list([graph]).to_dict()
    return {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in batch.items()}


def run_torch(n: int, cores: int, dtype: str, steps: int, side: str, model: str = "reference",
              channels: int = 128) -> dict:
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch
    from ase.units import fs

    torch.set_num_threads(cores)
    atoms = system(n)
    name = model
    model = torch_model(dtype, name, channels)
    if side == "torch-ase":
        from ase.md.verlet import VelocityVerlet
        from mace.calculators import MACECalculator

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "bench.model"
            torch.save(torch_model("float64", name, channels), path)
            atoms.calc = MACECalculator(model_paths=str(path), device="cpu", default_dtype=dtype)
        dyn = VelocityVerlet(atoms, DT_FS * fs)
        pe_first = atoms.get_potential_energy()
        dyn.run(1)  # warm-up
        base = _start_peak()
        t0 = time.perf_counter()
        dyn.run(steps)
        seconds = time.perf_counter() - t0
        pe_last = atoms.get_potential_energy()
    else:
        from mace.tools import utils

        tdt = getattr(torch, dtype)
        z_table = utils.AtomicNumberTable([1, 6, 8])
        r_max = float(model.r_max)
        masses = torch.tensor(atoms.get_masses(), dtype=tdt)[:, None]
        x = torch.tensor(atoms.positions, dtype=tdt)
        v = torch.tensor(atoms.get_velocities(), dtype=tdt)
        dt = DT_FS * fs

        def forces(pos):
            atoms.positions = pos.detach().numpy()
            out = model(_mace_batch(atoms, z_table, r_max, tdt), compute_force=True)
            return out["forces"].detach(), float(out["energy"][0])

        f, pe_first = forces(x)
        forces(x)  # warm-up
        base = _start_peak()
        t0 = time.perf_counter()
        for _ in range(steps):
            v = v + 0.5 * dt * f / masses
            x = x + dt * v
            f, pe_last = forces(x)
            v = v + 0.5 * dt * f / masses
        seconds = time.perf_counter() - t0
    return dict(side=side, seconds=seconds, atom_steps_per_second=steps * len(atoms) / seconds,
                warmup_seconds=None, rebuilds=None, recompiles=None, pe_first=pe_first, pe_last=pe_last,
                memory_kb_per_atom=(_memory_kb("VmHWM") - base) / len(atoms))


def worker(spec: str) -> int:
    kw = json.loads(spec)
    side = kw.pop("side")
    row = run_jaxdd(**kw) if side == "jaxdd" else run_torch(side=side, **{k: v for k, v in kw.items()
                                                                          if k != "with_torch"})
    print(json.dumps(row), flush=True)
    return 0


def pinned(side: str, n: int, cores: int, dtype: str, steps: int, with_torch: bool, model: str = "reference",
           channels: int = 128) -> dict:
    """One configuration in a child process bound to ``cores`` cores."""
    use = set(sorted(os.sched_getaffinity(0))[:cores])
    spec = json.dumps(dict(side=side, n=n, cores=cores, dtype=dtype, steps=steps, with_torch=with_torch,
                           model=model, channels=channels))
    env = dict(os.environ, OMP_NUM_THREADS=str(cores))
    proc = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True, env=env,
                          preexec_fn=lambda: os.sched_setaffinity(0, use))
    if proc.returncode != 0:
        # A side that cannot run a size (mace-torch runs out of memory at MP-0 medium size and
        # 4,096 atoms in 24 GB) is a result of the comparison, not the end of the benchmark.
        why = (f"killed by signal {-proc.returncode} (SIGKILL: most often the kernel's out-of-memory killer)"
               if proc.returncode < 0 else f"exit status {proc.returncode}")
        print(f"{side} on {cores} core(s), {n**3} atoms, {dtype} failed ({why}); its stderr ends:\n"
              f"{proc.stderr[-1500:]}", file=sys.stderr, flush=True)
        return dict(side=side, n_atoms=n**3, cores=len(use), dtype=dtype, steps=steps, failed=why,
                    atom_steps_per_second=None, seconds=None, warmup_seconds=None, memory_kb_per_atom=None)
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(row, n_atoms=n**3, cores=len(use), dtype=dtype, steps=steps)


def parse_args(argv=None):
    from timing import check_args

    p = argparse.ArgumentParser(description="MACE molecular dynamics: jaxdd against mace-torch.")
    p.add_argument("--sizes", default="10,16", help="lattice points per axis, comma-separated (default 10,16: "
                                                    "1,000 and 4,096 atoms)")
    p.add_argument("--steps", type=int, default=10, help="timed NVE steps per run (default 10)")
    p.add_argument("--cores", default="1,2", help="comma-separated core counts (default 1,2)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes (default both)")
    p.add_argument("--model", default="reference", choices=MODELS,
                   help="reference (the tests' 16-channel architecture, default) or mp0-medium (MACE-MP-0 medium's size)")
    p.add_argument("--channels", type=int, default=128, help="channels per irrep of mp0-medium (default 128)")
    p.add_argument("--no-torch", action="store_true", help="run jaxdd only")
    p.add_argument("--sides", default=",".join(SIDES),
                   help=f"comma-separated sides to run, of {', '.join(SIDES)} (default all; the ratio is over the "
                        "faster mace-torch side run)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    check_args(p, args, positive=("steps", "channels"), choices={"dtypes": ("float32", "float64")})
    for name in ("sizes", "cores"):
        try:
            values = tuple(int(v) for v in getattr(args, name).split(",") if v.strip())
        except ValueError:
            values = ()
        if not values or min(values) < 1:
            p.error(f"--{name} must be comma-separated positive integers, got {getattr(args, name)!r}")
        setattr(args, name, values)
    args.sides = tuple(s.strip() for s in args.sides.split(",") if s.strip())
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown or not args.sides:
        p.error(f"--sides takes a comma-separated choice of {', '.join(SIDES)}, got {','.join(unknown) or 'none'}")
    if max(args.cores) > len(os.sched_getaffinity(0)):
        p.error(f"--cores asks for {max(args.cores)} cores but this process may use {len(os.sched_getaffinity(0))}")
    return args


def format_table(rows, notes) -> str:
    cols = ["side", "atoms", "cores", "dtype", "atom-steps/s", "seconds", "warm-up s", "work kB/atom", "jaxdd / torch"]
    lines = []
    for r in rows:
        if r.get("failed"):
            lines.append([r["side"], f"{r['n_atoms']:,}", str(r["cores"]), r["dtype"], "failed", "-", "-", "-", "-"])
            continue
        ratio = f"{r['ratio']:.2f}x" if r.get("ratio") is not None else "-"
        warm = f"{r['warmup_seconds']:.1f}" if r["warmup_seconds"] is not None else "-"
        lines.append([r["side"], f"{r['n_atoms']:,}", str(r["cores"]), r["dtype"], f"{r['atom_steps_per_second']:,.0f}",
                      f"{r['seconds']:.2f}", warm, f"{r['memory_kb_per_atom']:.1f}", ratio])
    from timing import text_table

    return text_table(cols, lines, notes)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    args = parse_args(argv)
    with_torch = HAVE_TORCH and not args.no_torch
    notes = []
    if not with_torch:
        what = "tests/data/mace/trained.npz" if args.model == "reference" else "a natively built model"
        notes.append("mace-torch not run (" + ("--no-torch" if args.no_torch else "torch and mace-torch are not "
                     "installed: pip install torch==2.13.0 mace-torch") + f"); jaxdd runs {what}")
    sides = [s for s in args.sides if with_torch or s == "jaxdd"]
    if with_torch and len(sides) < len(SIDES):
        notes.append(f"sides run: {', '.join(sides)} (--sides)")
    rows = []
    for n in args.sizes:
        for cores in args.cores:
            for dtype in args.dtypes:
                group = []
                for side in sides:
                    row = pinned(side, n, cores, dtype, args.steps, with_torch, args.model, args.channels)
                    speed = (f"failed: {row['failed']}" if row.get("failed")
                             else f"{row['atom_steps_per_second']:,.0f} atom-steps/s")
                    print(f"{side:10s} {row['n_atoms']:6d} atoms {cores} core(s) {dtype}: {speed}", flush=True)
                    group.append(row)
                    if row.get("failed"):
                        notes.append(f"{side} failed at {row['n_atoms']:,} atoms, {cores} core(s), {dtype}: "
                                     f"{row['failed']}")
                torch_best = max((r["atom_steps_per_second"] for r in group
                                  if r["side"] != "jaxdd" and not r.get("failed")), default=None)
                for r in group:
                    ran = torch_best and r["side"] == "jaxdd" and not r.get("failed")
                    r["ratio"] = r["atom_steps_per_second"] / torch_best if ran else None
                rows += group
    size = "the tests' architecture, cutoff 5 Å" if args.model == "reference" else \
        f"MP-0 medium size ({args.channels}x0e + {args.channels}x1o, cutoff 6 Å)"
    print(f"\nMACE NVE ({args.steps} steps, dt {DT_FS} fs, T0 {T0:.0f} K), H/C/O at 0.1 atoms/Å³, {size}; "
          f"ratio: jaxdd over the faster mace-torch path, same cores and dtype")
    print(format_table(rows, notes))
    one = [r["ratio"] for r in rows if r["side"] == "jaxdd" and r["cores"] == 1 and r["ratio"] is not None]
    if one:
        state = "met" if min(one) >= TARGET else "NOT met"
        print(f"target (jaxdd on one core >= {TARGET}x mace-torch): {state}: lowest {min(one):.2f}x")
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(benchmark="mace_md", model=args.model, channels=args.channels, steps=args.steps,
                                     results=rows, notes=notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
