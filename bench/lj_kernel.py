"""Benchmark: force evaluations of the LJ melt by the fused FFI kernel, the jnp path and LAMMPS.

    python bench/lj_kernel.py [--n-cells 20] [--repeat 5] [--dtypes float32,float64] [--half-list]
                              [--all-cores] [--lammps lmp | --no-lammps] [--json PATH]

The system is the perfect fcc lattice of the LAMMPS melt benchmark (32,000 atoms by
default, ``pair_style lj/cut 2.5``, no shift), its neighbour list built once (full list, as
under decomposition, unless ``--half-list``). For each dtype it times the median of
``--repeat`` jitted energy + forces calls after a warm-up call, on that prebuilt list:

* ``jnp``: :class:`jaxdd.models.lj.LennardJones`, forces by autodiff of the energy;
* ``fused``: :class:`jaxdd.models.lj_kernel.LennardJonesKernel`, energies, forces and
  virial from one pass of the compiled kernel (kernel-direct forces);
* ``fused, autodiff``: the same kernel's energies differentiated through the op's custom
  VJP (the backward kernel), which is how ``DistributedModel`` gets its forces.

Throughput is force evaluations × atoms per second. By default the process is pinned to
one core (the kernels are single-threaded; XLA would otherwise spread the jnp path over
all cores), so every figure is "on one core"; ``--all-cores`` lifts that.

LAMMPS runs in the same benchmark run when ``lmp`` is on the PATH: ``lmp -in in.lj`` on one
core, 100 MD steps of the melt; its force-evaluation throughput is steps × atoms divided by
the ``Pair`` time of its timing breakdown. Otherwise the figure recorded on this machine
(the oracle notes: 2.3 M atom-steps/s for whole MD steps on one core, bench/md_lj.py) is
used, labelled as not measured in this run; a whole step costs more than its force
evaluation, so that ratio flatters jaxdd by the non-pair share of LAMMPS's step (~15-20%).
Targets: fused >= 3x the jnp path; fused >= 0.5x LAMMPS on one core.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def _pin_to_one_core(argv) -> str:
    """Pin this process to one core before JAX starts its thread pools (unless --all-cores)."""
    if "--all-cores" in (sys.argv[1:] if argv is None else argv) or not hasattr(os, "sched_setaffinity"):
        return f"all {os.cpu_count()} cores"
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"one core (cpu {core})"


CORES = _pin_to_one_core(None)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd import ffi  # noqa: E402
from jaxdd.engine.driver import energy_and_derivatives  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.models.lj_kernel import LennardJonesKernel  # noqa: E402
from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM, lj_melt_data  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py and md_lj.py
from md_lj import IN_LJ, LAMMPS_REFERENCE, REFERENCE_LABEL, parse_lammps_log  # noqa: E402
from timing import check_args, median_time, write_record  # noqa: E402

CUTOFF = 2.5
OUTPUTS = ("energy", "forces")
DTYPES = ("float32", "float64")
PATHS = ("jnp", "fused", "fused, autodiff")
TARGET_JNP = 3.0  # fused / jnp
TARGET_LAMMPS = 0.5  # fused / LAMMPS on one core
LAMMPS_STEPS = 100
_PAIR = re.compile(r"^Pair\s*\|\s*(\S+)\s*\|\s*(\S+)\s*\|", re.MULTILINE)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="LJ force evaluations: fused FFI kernel, jnp path, LAMMPS.")
    p.add_argument("--n-cells", type=int, default=20, help="fcc cells per axis (default 20: 32,000 atoms)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per figure; the median is shown (default 5)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes (default float32,float64)")
    p.add_argument("--half-list", action="store_true", help="use a half neighbour list (each pair once)")
    p.add_argument("--all-cores", action="store_true", help="do not pin the process to one core")
    p.add_argument("--lammps", default="lmp", metavar="BIN", help="LAMMPS executable (default lmp, looked up on PATH)")
    p.add_argument("--no-lammps", action="store_true", help="do not run LAMMPS; use the recorded reference figure")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH as JSON")
    args = p.parse_args(argv)
    check_args(p, args, positive=("n_cells", "repeat"), choices={"dtypes": DTYPES})
    return args


@eqx.filter_jit
def _model_forces(model, batch):
    return energy_and_derivatives(model, batch, OUTPUTS)


@eqx.filter_jit
def _kernel_autodiff_forces(model, batch):
    def energy(positions):
        return jnp.sum(model(batch.replace(positions=positions))["energy"])

    e, g = jax.value_and_grad(energy)(batch.positions)
    return {"energy": e[None], "forces": -g}


def bench_dtype(dtype: str, n_cells: int, repeat: int, half_list: bool) -> dict:
    """Figures of one dtype: {path: seconds, atoms/s, E/N, max |F - F_jnp|}."""
    batch = jaxdd.as_batch(lj_melt_data(n_cells, dtype=np.dtype(dtype)))
    params = dict(sigma=1.0, epsilon=1.0, cutoff=CUTOFF, shift=False, half_list=half_list)
    jnp_model, kernel_model = LennardJones(**params), LennardJonesKernel(**params)
    nc = jnp_model.model_config.neighbor_config
    nl, _ = jaxdd.neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                                cutoff=nc.search_cutoff, half=nc.half_list)
    batch = batch.replace(neighbors=nl)
    n = batch.n_atoms
    calls = {
        "jnp": lambda: _model_forces(jnp_model, batch),
        "fused": lambda: _model_forces(kernel_model, batch),
        "fused, autodiff": lambda: _kernel_autodiff_forces(kernel_model, batch),
    }
    out, ref_forces = {}, None
    for path in PATHS:
        result = jax.block_until_ready(calls[path]())
        if result["forces"].dtype != np.dtype(dtype):
            raise RuntimeError(f"{path}: forces came out {result['forces'].dtype}, not {dtype}")
        seconds = median_time(calls[path], repeat)
        forces = np.asarray(result["forces"], np.float64)
        ref_forces = forces if ref_forces is None else ref_forces
        out[path] = dict(
            seconds=seconds, atoms_per_s=n / seconds,
            energy_per_atom=float(np.asarray(result["energy"], np.float64)[0]) / n,
            max_abs_force_minus_jnp=float(np.max(np.abs(forces - ref_forces))),
        )
    return dict(n_atoms=n, n_edges=int(nl.n_edges), paths=out)


# ---------------------------------------------------------------------------- LAMMPS


def run_lammps(lmp: str, n_cells: int) -> dict:
    """``lmp -in in.lj`` on one core: whole-step and pair-only atom-steps per second."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="lj_kernel_") as tmp:
        Path(tmp, "in.lj").write_text(IN_LJ.format(n=n_cells, steps=LAMMPS_STEPS))
        proc = subprocess.run([lmp, "-in", "in.lj"], cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{lmp} -in in.lj exited {proc.returncode}: {(proc.stderr or proc.stdout)[-500:]}")
    figures = parse_lammps_log(proc.stdout)
    m = _PAIR.search(proc.stdout)
    if m is None:
        raise ValueError("no 'Pair | ...' row in LAMMPS's timing breakdown")
    pair_seconds = float(m.group(2))  # the average over ranks (one rank here)
    atom_steps = figures["steps"] * figures["n_atoms"]
    return dict(source="measured in this run", command=f"{lmp} -in in.lj", pair_seconds=pair_seconds,
                atoms_per_s=atom_steps / pair_seconds, step_atoms_per_s=figures["atom_steps_per_second"],
                n_atoms=figures["n_atoms"], steps=figures["steps"])


def lammps_figure(args) -> tuple[dict, list[str]]:
    notes = []
    lmp = None if args.no_lammps else shutil.which(args.lammps)
    if lmp is not None:
        try:
            return run_lammps(lmp, args.n_cells), notes
        except (OSError, RuntimeError, ValueError, subprocess.TimeoutExpired) as err:
            notes.append(f"LAMMPS failed: {err}")
    else:
        notes.append("LAMMPS not run (--no-lammps)" if args.no_lammps
                     else f"LAMMPS is not installed ({args.lammps!r} is not on the PATH)")
    if args.n_cells != 20:
        notes.append("the recorded LAMMPS figure is for 32,000 atoms, not this run's size")
    return dict(source=REFERENCE_LABEL, atoms_per_s=LAMMPS_REFERENCE[1], step_atoms_per_s=LAMMPS_REFERENCE[1],
                note="whole MD steps (pair + neighbour + integration), not force evaluations alone"), notes


# ---------------------------------------------------------------------------- report


def format_table(results: dict, lammps: dict, notes: list[str], header: str) -> str:
    lines = [header]
    cols = ["path", "dtype", "s per call", "atoms/s", "vs jnp", "vs LAMMPS", "E/N - LAMMPS", "max|F-F_jnp|"]
    rows = []
    for dtype, fig in results.items():
        base = fig["paths"]["jnp"]["atoms_per_s"]
        for path in PATHS:
            p = fig["paths"][path]
            rows.append([path, dtype, f"{p['seconds']:.4f}", f"{p['atoms_per_s']:,.0f}", f"{p['atoms_per_s'] / base:.1f}x",
                         f"{p['atoms_per_s'] / lammps['atoms_per_s']:.2f}x",
                         f"{p['energy_per_atom'] - LAMMPS_MELT_ENERGY_PER_ATOM:.1e}", f"{p['max_abs_force_minus_jnp']:.1e}"])
    rows.append(["LAMMPS lj/cut", "float64", "-", f"{lammps['atoms_per_s']:,.0f}", "-", "1.00x", "-", "-"])
    widths = [max(len(str(r[i])) for r in [cols] + rows) for i in range(len(cols))]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    lines += [fmt.format(*cols)] + [fmt.format(*r) for r in rows]
    if lammps["source"] == "measured in this run":
        lines.append(f"LAMMPS: {lammps['command']}, {lammps['steps']} MD steps of {lammps['n_atoms']:,} atoms, one core: "
                     f"force evaluations (Pair time {lammps['pair_seconds']:.2f} s) {lammps['atoms_per_s']:,.0f} atoms/s; "
                     f"whole steps {lammps['step_atoms_per_s']:,.0f} atom-steps/s")
    else:
        lines.append(f"LAMMPS: {lammps['atoms_per_s']:,.0f} atom-steps/s, {lammps['source']} ({lammps['note']})")
    for dtype, fig in results.items():
        fused = fig["paths"]["fused"]["atoms_per_s"]
        vs_jnp = fused / fig["paths"]["jnp"]["atoms_per_s"]
        vs_lmp = fused / lammps["atoms_per_s"]
        lines.append(f"targets {dtype}: fused {vs_jnp:.1f}x jnp (>= {TARGET_JNP:g}x: "
                     f"{'met' if vs_jnp >= TARGET_JNP else 'NOT met'}), {vs_lmp:.2f}x LAMMPS "
                     f"(>= {TARGET_LAMMPS:g}x: {'met' if vs_lmp >= TARGET_LAMMPS else 'NOT met'})")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not ffi.available():
        print("bench/lj_kernel.py: the compiled kernels are not built; `pip install -e .` builds them", file=sys.stderr)
        return 1
    devices = jax.devices()
    device = f"{devices[0].platform} ({devices[0].device_kind}), {CORES}"
    results = {d: bench_dtype(d, args.n_cells, args.repeat, args.half_list) for d in args.dtypes}
    lammps, notes = lammps_figure(args)
    fig = next(iter(results.values()))
    header = (f"LJ melt force evaluations (energy + forces, prebuilt {'half' if args.half_list else 'full'} list of "
              f"{fig['n_edges']:,} edges): {fig['n_atoms']:,} atoms ({args.n_cells}^3 fcc cells), rc {CUTOFF} sigma, "
              f"median of {args.repeat}; {device}")
    print(format_table(results, lammps, notes, header), flush=True)
    if args.json is not None:
        write_record(args.json, dict(benchmark="lj_kernel", n_cells=args.n_cells, cutoff=CUTOFF,
                                     half_list=args.half_list, repeat=args.repeat, device=device, results=results,
                                     lammps=lammps, notes=notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
