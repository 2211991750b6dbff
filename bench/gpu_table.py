"""The figures of bench/gpu_check.sh: LJ and MLIP dynamics on one device, jax-md beside them.

    python bench/gpu_table.py [--smoke] [--budget SECONDS] [--json PATH] [--sections lj,mlip,...]
                              [--lj-cells 20,63,126] [--profile DIR]
    python bench/gpu_table.py --show PATH.json     # the table of a run, one stopped in a row too

On the device JAX picks (a GPU where there is one), one table:

- the LAMMPS LJ melt (bench/md_lj.py's problem) under ``DomainParallel`` on one device at
  32,000, 1,000,000 and 8,000,000 atoms, float32 and float64, the fused kernel and the jnp
  path: atom-steps per second, ms per step, the compile (warm-up) time, the peak device
  memory, and the step's time over its HBM-bandwidth floor (the bytes a step must move,
  see :func:`lj_floor_bytes`, at 4.8 TB/s, the H200's);
- jax-md's own LJ NVE loop (``energy.lennard_jones_neighbor_list``, ``simulate.nve``,
  ``lax.fori_loop`` with the list updated each step) at 32,000 and 1,000,000 atoms;
- SchNet, NequIP and MACE (jaxdd's zoo; MACE from tests/data/mace/trained.npz) under
  ``DomainParallel`` on 32,768 atoms, float32, and the largest system of a doubling
  series that fits in the device's memory;
- jax-md's NequIP in its own loop against the same network under jaxdd (bench/mlip_md.py's
  runs) on 8,000 atoms of diamond Si;
- with ``--profile DIR``, where each jaxdd LJ and MLIP row's step spends its time: neighbour
  search and sort, rebuilds, the model or pair kernel, the halo, the integrator, other XLA ops,
  host and gaps (a trace of a few more steps, bench/profile_table.py).

Every row is timed after a warm-up run of the same length (compilation, capacity growth).
A row that fails prints its error in the table instead of stopping it, and rows past
``--budget`` seconds are listed as skipped. ``--smoke`` runs the same code at tiny sizes
(a CPU suffices; the test suite runs it so the script cannot rot).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import md_lj  # noqa: E402
import profile_table  # noqa: E402
import timing  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200
LJ_DENSITY = 0.8442


def lj_floor_bytes(n_atoms: int, dtype: str) -> float:
    """Bytes one LJ velocity-Verlet step must move at the least: positions, velocities and
    forces each read and written once ([n, 3] each), and the half neighbour list (pairs
    within cutoff + skin, two int32 indices each) read once."""
    b = np.dtype(dtype).itemsize
    pairs = n_atoms * LJ_DENSITY * 4 / 3 * math.pi * (md_lj.CUTOFF + md_lj.SKIN) ** 3 / 2
    return n_atoms * 3 * b * 2 * 3 + pairs * 8


def _peak_memory_gb() -> float | None:
    """The device's peak memory in use since the process started (JAX has no reset): a row's
    figure is the largest of it and every row before."""
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 1e9


def _oom(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return any(k in text for k in ("resource_exhausted", "out of memory", "memory_limit", "needs more memory"))


# ---------------------------------------------------------------------------- rows


def lj_jaxdd(n_cells: int, dtype: str, path: str, steps: int, profile=None) -> dict:
    r = md_lj.bench_jaxdd(1, dtype, n_cells, steps, path, profile=profile)
    floor = lj_floor_bytes(r["n_atoms"], dtype) / HBM_BYTES_PER_S
    return dict(atoms=r["n_atoms"], steps=r["steps"], seconds=r["seconds"],
                compile_s=r["warmup_seconds"] - r["seconds"],
                note=f"{r['rebuilds']} rebuilds, PE/N step 0 {r['pe_per_atom_first']:.6f}",
                floor_ratio=(r["seconds"] / r["steps"]) / floor, **({"profile": r["profile"]} if profile else {}))


def lj_jax_md(n_cells: int, dtype: str, steps: int) -> dict:
    import jax.numpy as jnp
    from jax_md import energy, simulate, space

    data = md_lj.lj_melt_data(n_cells, temperature=md_lj.TEMPERATURE, dtype=np.dtype(dtype))
    box = float(np.asarray(data.cell)[0, 0, 0])
    displacement, shift = space.periodic(box)
    neighbor_fn, energy_fn = energy.lennard_jones_neighbor_list(
        displacement, box, sigma=1.0, epsilon=1.0, r_onset=2.0, r_cutoff=md_lj.CUTOFF, dr_threshold=md_lj.SKIN)
    R = jnp.asarray(data.positions, dtype)
    nbrs = neighbor_fn.allocate(R)
    init, apply = simulate.nve(energy_fn, shift, md_lj.DT)
    state = init(jax.random.PRNGKey(0), R, mass=1.0, neighbor=nbrs, kT=md_lj.TEMPERATURE)

    loop = timing.jax_md_loop(apply, steps)
    t0 = time.perf_counter()
    s, n = jax.block_until_ready(loop(state, nbrs))
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    s, n = jax.block_until_ready(loop(s, n))
    seconds = time.perf_counter() - t0
    if bool(n.did_buffer_overflow):
        raise RuntimeError("jax-md's neighbour list overflowed; the figure would be wrong")
    floor = lj_floor_bytes(len(R), dtype) / HBM_BYTES_PER_S
    return dict(atoms=len(R), steps=steps, seconds=seconds, compile_s=first - seconds,
                note="smooth cutoff from r 2.0 (jax-md's LJ)", floor_ratio=(seconds / steps) / floor)


def _mlip(name: str, dtype: str):
    import mace_md

    if name == "mace":
        return mace_md.jaxdd_model(dtype, with_torch=False)
    from jaxdd.models.mpnn import SchNet
    from jaxdd.models.nequip import NequIP

    kind = SchNet if name == "schnet" else NequIP
    return kind(species=(1, 6, 8), cutoff=5.0, dtype=np.dtype(dtype))


def mlip_jaxdd(name: str, n: int, steps: int, dtype: str = "float32", profile=None) -> dict:
    """A zoo model under DomainParallel on n³ atoms of bench/mace_md.py's H/C/O system;
    ``profile``: None, or (trace folder, HLO dump folder, steps) to trace after the timed run."""
    import mace_md
    from ase.units import fs

    import jaxdd
    from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
    from jaxdd.dynamics import DomainParallel, VelocityVerlet

    atoms = mace_md.system(n)
    model = _mlip(name, dtype)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.dtype(dtype))
    data = data.replace(velocities=jax.numpy.asarray(atoms.get_velocities(), dtype))
    dm = DistributedModel(model, DomainConfig(5.0, skin=mace_md.SKIN, mesh=default_mesh(jax.devices()[:1])))
    md = DomainParallel(dm, VelocityVerlet(mace_md.DT_FS * fs))
    t0 = time.perf_counter()
    md.run(md.init(data), steps)
    warmup = time.perf_counter() - t0
    state = md.run(md.init(data), steps)
    stats = md.last_run
    extra = {} if profile is None else {"profile": profile_table.record_md(md, state, profile)}
    return dict(atoms=len(atoms), steps=steps, seconds=stats.seconds, compile_s=warmup - stats.seconds,
                note=f"{stats.rebuilds} rebuilds", **extra)


def largest_fit(name: str, sides: list[int], steps: int, deadline: float) -> dict:
    """The largest n³ of ``sides`` (ascending) whose run fits in device memory."""
    best, tried, reason = None, [], "every size ran"
    for n in sides:
        if time.perf_counter() > deadline:
            reason = f"budget spent before {n ** 3:,} atoms"
            break
        try:
            mlip_jaxdd(name, n, steps)
            best = n ** 3
            tried.append(n ** 3)
        except Exception as err:  # noqa: BLE001 - the reason goes into the table
            reason = f"{n ** 3:,} atoms: {'out of memory' if _oom(err) else type(err).__name__ + ': ' + str(err)[:80]}"
            break
    return dict(atoms=best, note=f"largest that ran of {[f'{t:,}' for t in tried]}; stopped: {reason}")


def nequip_pair(n_atoms: int, steps: int, kind: str) -> list[tuple[str, dict]]:
    import mlip_md

    ref = mlip_md.prepare_jax_md(n_atoms, steps, kind)()  # compiled and warmed, then one timed run
    mine = mlip_md.prepare_jaxdd(n_atoms, steps, kind, 1)()
    ratio = ref["seconds"] / mine["seconds"]
    return [("jax-md NequIP (own loop)", dict(atoms=n_atoms, steps=steps, seconds=ref["seconds"], note="")),
            ("jaxdd NequIP (jax-md's network)", dict(atoms=n_atoms, steps=steps, seconds=mine["seconds"],
                                                      note=f"{ratio:.2f}x jax-md, {mine['rebuilds']} rebuilds"))]


# ---------------------------------------------------------------------------- plan and report


#: The table's sections, by the name ``--sections`` takes, in their default order.
SECTIONS = {"lj": "LJ melt, jaxdd", "lj-jax-md": "LJ melt, jax-md", "mlip": "MLIP MD, jaxdd",
            "nequip-pair": "NequIP, jax-md vs jaxdd", "largest": "largest fit"}
#: jaxdd's LJ melt sizes (fcc cells a side: 4 n³ atoms) and steps a run.
LJ_STEPS = {20: 100, 63: 50, 126: 20}
#: Steps each profiled row traces after its timed run.
PROFILE_STEPS = 10


def plan(smoke: bool, deadline: float, sections=tuple(SECTIONS), lj_cells=tuple(LJ_STEPS), profile=None) -> list:
    """(section, label, thunk) in the order they run: ``sections`` in the order given, the
    most wanted first; a thunk returns its figures, or a list of (label, figures) rows. The
    largest-fit searches stop at ``deadline`` (time.perf_counter). ``profile``: None, or
    (folder, HLO dump folder): each LJ and MLIP row of jaxdd then traces a few more steps
    into a folder of its own there and breaks them down (bench/profile_table.py)."""

    def traced(label):
        if profile is None:
            return None
        folder = Path(profile[0]) / label.replace(" ", "-")
        return (folder, profile[1], 2 if smoke else PROFILE_STEPS)

    if smoke:  # each code path once, at tiny sizes
        lj = [(4, 4, "float32", "fused"), (4, 4, "float64", "jnp")]
        jm = [(4, 4, "float32")]
        mlip_n, mlip_steps, sides, nq = 3, 2, [3], (64, 2, "small")
    else:
        lj = [(c, LJ_STEPS[c], d, p) for c in lj_cells for d in ("float32", "float64") for p in ("fused", "jnp")]
        jm = [(c, LJ_STEPS[c], d) for c in (20, 63) for d in ("float32", "float64")]
        mlip_n, mlip_steps, sides, nq = 32, 20, [64, 100, 128, 160], (8000, 100, "default")
    rows = {key: [] for key in SECTIONS}
    for cells, steps, dtype, path in lj:
        rows["lj"].append((SECTIONS["lj"], f"{path} {dtype}", lambda c=cells, d=dtype, p=path, s=steps:
                           lj_jaxdd(c, d, p, s, traced(f"lj-{4 * c ** 3}-{p}-{d}"))))
    for cells, steps, dtype in jm:
        rows["lj-jax-md"].append((SECTIONS["lj-jax-md"], f"jax-md {dtype}",
                                  lambda c=cells, d=dtype, s=steps: lj_jax_md(c, d, s)))
    for name in ("schnet", "nequip", "mace"):
        rows["mlip"].append((SECTIONS["mlip"], f"{name} float32", lambda m=name: mlip_jaxdd(
            m, mlip_n, mlip_steps, profile=traced(f"mlip-{m}-{mlip_n ** 3}"))))
    rows["nequip-pair"].append((SECTIONS["nequip-pair"], "", lambda: nequip_pair(*nq)))
    for name in ("schnet", "nequip", "mace"):
        rows["largest"].append((SECTIONS["largest"], f"{name} float32",
                                lambda m=name: largest_fit(m, sides, 1 if smoke else 3, deadline)))
    return [row for key in sections for row in rows[key]]


def run(smoke: bool, budget: float, sections=tuple(SECTIONS), lj_cells=tuple(LJ_STEPS), saved=None,
        profile=None) -> list[dict]:
    """The rows' figures; ``saved(rows)`` is called after each row (a run killed in a long
    row keeps the rows before it). ``profile``: as :func:`plan` takes it."""
    start = time.perf_counter()
    deadline = start + budget
    out = []
    for section, label, job in plan(smoke, deadline, sections, lj_cells, profile):
        row = dict(section=section, what=label)
        if time.perf_counter() > deadline:
            out.append(dict(row, error=f"skipped: the {budget:.0f} s budget is spent"))
            print(f"{section}: {label}: skipped (budget)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            got = job()
            results = got if isinstance(got, list) else [(label, got)]
        except Exception as err:  # noqa: BLE001 - one failed row must not hide the others
            traceback.print_exc()
            kind = "out of memory" if _oom(err) else f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
            results = [(label, dict(error=kind))]
        for what, fig in results:
            fig = dict(row, what=what, **fig, wall_s=time.perf_counter() - t0, peak_gb=_peak_memory_gb())
            if fig.get("seconds"):
                fig["atom_steps_per_second"] = fig["atoms"] * fig["steps"] / fig["seconds"]
                fig["ms_per_step"] = 1e3 * fig["seconds"] / fig["steps"]
            out.append(fig)
            shown = ", ".join(f"{k}={v}" for k, v in fig.items() if k not in ("section", "what", "profile"))
            print(f"{section}: {what}: {shown}", flush=True)
        if saved is not None:
            saved(out)
    return out


def format_table(rows: list[dict], device: str) -> str:
    cols = ("section", "what", "atoms", "atom-steps/s", "ms/step", "x HBM floor", "compile s", "peak GB so far",
            "note")

    def cell(r, c):
        if c == "atoms":
            return "-" if r.get("atoms") is None else f"{r['atoms']:,}"
        if c == "atom-steps/s":
            return f"{r['atom_steps_per_second']:,.0f}" if "atom_steps_per_second" in r else "-"
        if c == "ms/step":
            return f"{r['ms_per_step']:.3f}" if "ms_per_step" in r else "-"
        if c == "x HBM floor":
            return f"{r['floor_ratio']:.1f}" if r.get("floor_ratio") else "-"
        if c == "compile s":
            return f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "-"
        if c == "peak GB so far":
            return f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
        if c == "note":
            return r.get("error") or r.get("note", "")
        return str(r.get(c, ""))

    body = [[cell(r, c) for c in cols] for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols[:-1])]
    lines = [f"jaxdd GPU check on {device}", "  ".join(c.ljust(w) for c, w in zip(cols, widths)) + "  note"]
    for b in body:
        lines.append("  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(b, widths)))
                     + "  " + b[-1])
    lines.append("x HBM floor: a step's time over (positions, velocities, forces read and written once, the half "
                 f"list read once) / {HBM_BYTES_PER_S / 1e12:.1f} TB/s; compile s: warm-up run minus timed run; "
                 "peak GB so far: the device's peak since the start, up to that row")
    profiled = [r for r in rows if r.get("profile")]
    if profiled:
        lines.append("\nWhere a step's time goes (bench/profile_table.py: a traced run of a few more steps, device "
                     "time by jaxdd's named scopes)")
        lines.extend(profile_table.format_table(r["profile"], f"{r['section']}: {r['what']}, {r['atoms']:,} atoms")
                     for r in profiled)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, any device (the test suite's check)")
    p.add_argument("--budget", type=float, default=None, help="seconds for all rows (default 330; smoke 600)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here (after every row)")
    p.add_argument("--show", type=Path, default=None, metavar="JSON",
                   help="print the table of a run's JSON (one stopped in a row too) and exit")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"the sections to run, in this order (default: all, {','.join(SECTIONS)})")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="trace a few more steps of each jaxdd LJ and MLIP row into DIR and print where the time goes "
                        "(XLA dumps the programs' HLO into DIR/hlo to name the operations)")
    p.add_argument("--lj-cells", default=",".join(map(str, LJ_STEPS)),
                   help=f"jaxdd's LJ melt sizes, fcc cells a side, of {sorted(LJ_STEPS)} (default: all; jax-md's "
                        "loop runs the two smaller)")
    args = p.parse_args(argv)
    if args.show is not None:
        if not args.show.is_file():
            p.error(f"--show {args.show}: no such file (gpu_check.sh writes gpu_table.json in its --out folder)")
        got = json.loads(args.show.read_text())
        print(format_table(got["rows"], got["device"]))
        return 0
    sections = tuple(k.strip() for k in args.sections.split(",") if k.strip())
    try:
        lj_cells = tuple(int(c) for c in args.lj_cells.split(",") if c.strip())
    except ValueError:
        p.error(f"--lj-cells {args.lj_cells!r}: whole numbers of fcc cells a side, of {sorted(LJ_STEPS)}")
    unknown = [k for k in sections if k not in SECTIONS] + [c for c in lj_cells if c not in LJ_STEPS]
    if unknown:
        p.error(f"unknown --sections or --lj-cells entries {unknown}: sections are {list(SECTIONS)}, "
                f"sizes {sorted(LJ_STEPS)}")
    budget = args.budget if args.budget is not None else (600.0 if args.smoke else 330.0)
    profile = None
    if args.profile is not None:
        # Before JAX starts its backend, which reads XLA_FLAGS once.
        hlo = args.profile / "hlo"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + profile_table.dump_flags(hlo)).strip()
        profile = (args.profile, hlo)
        # A program taken from the persistent compilation cache is not compiled, so XLA would dump
        # no HLO for it to name its operations by.
        jax.config.update("jax_enable_compilation_cache", False)
    d = jax.devices()[0]
    device = f"{d.platform} ({d.device_kind}), jax {jax.__version__}"

    def saved(rows):
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(dict(device=device, smoke=args.smoke, rows=rows), indent=1, default=str))

    rows = run(args.smoke, budget, sections, lj_cells, saved, profile)
    if profile is not None:  # the HLO is read; XLA's LLVM IR and object files beside it are not needed
        import shutil

        for path in profile[1].glob("*"):
            if path.is_dir():
                shutil.rmtree(path)
            elif not path.name.endswith("after_optimizations.txt"):
                path.unlink()
    print("\n" + format_table(rows, device), flush=True)
    errors = [r for r in rows if r.get("error") and not r["error"].startswith("skipped")]
    return 1 if (args.smoke and errors) else 0


if __name__ == "__main__":
    sys.exit(main())
