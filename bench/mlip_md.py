"""Benchmark: MLIP molecular dynamics, jax-md's own NVE loop against jaxdd's DomainParallel.

    python bench/mlip_md.py [--atoms 1000,8000] [--steps 100] [--repeats 3] [--config small|default] [--json PATH]

jax-md's NequIP (``jax_md.energy.nequip_neighbor_list`` built from ``nequip.default_config()``,
one element, random weights from its own ``init_fn``) on diamond silicon (a = 5.43 Å, r_max
5 Å), float32, NVE at dt = 1 fs from 300 K:

- jax-md: ``simulate.nve`` with its cell-list neighbour list (``neighbor_fn.update`` every
  step), 100 steps inside one ``lax.fori_loop``, the list checked for overflow after;
- jaxdd: the same network and weights wrapped by ``jaxdd.interop.jax_md.JaxMDModel`` under
  ``DomainParallel(VelocityVerlet)`` on 1 device and on 2 devices.

Each side is a child process pinned to its cores (1 for jax-md and jaxdd's 1 device, 2 for
jaxdd's 2 devices), compiled and warmed (jaxdd past its first plan rebuild, where it has
one); then ``--repeats`` rounds, in each of which the three sides time one run in turn (each
continuing its trajectory), so that every side is measured in every phase of a machine whose
speed drifts; the fastest run of each side is reported. Printed: atom-steps per second, the
ratios (targets: jaxdd 1 device ≥ 1.0× jax-md; 2 devices ≥ 1.7× 1 device) and the peak
resident memory of each child. ``--config small`` (default here: this 2-core machine)
shrinks jax-md's default network (32x0e + 8x1e + 4x2e, 3 interaction steps);
``--config default`` keeps it (128x0e + 64x1e + 4x2e, 5 steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

A_SI, R_MAX, DT_FS, MASS_SI = 5.43, 5.0, 1.0, 28.0855
#: XLA's CPU backend splits an operation over an Eigen thread pool sized for the whole machine,
#: whatever cores the process is bound to: on a pinned core (or two, one per device) those
#: threads take turns on it, and every side ran about half as fast as with the operations
#: kept on the thread that runs them (jax-md 533 against 1,136 atom-steps/s, jaxdd on one
#: device 547 against 1,299). XLA (jax 0.10) also hands elementwise fusions to YNNPACK by
#: default, whose code for the network's edge-long expressions is slower than XLA's own
#: emitter: without it, five steps on 1,000 atoms took 2.79 s instead of 3.43 (jax-md) and
#: 2.63 s instead of 3.29 (jaxdd). Every side runs with both options, each unless XLA_FLAGS
#: already names it (--xla-defaults keeps XLA's defaults).
CPU_XLA_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "--xla_cpu_experimental_ynn_fusion_type=")
SCALE = 0.01  # eV per unit of the network's output


def config(kind: str):
    from jax_md._nn import nequip

    cfg = nequip.default_config()
    # Random weights give forces of any size; a small scale keeps the crystal together for
    # the timed steps (it costs nothing: one product at the end).
    cfg.n_elements, cfg.r_max, cfg.shift, cfg.scale = 1, R_MAX, 0.0, SCALE
    if kind == "small":
        cfg.hidden_irreps, cfg.graph_net_steps, cfg.radial_net_n_hidden = "32x0e + 8x1e + 4x2e", 3, 32
    return cfg


def diamond(n_atoms: int, seed: int = 0):
    """Diamond Si, (n_atoms / 8)^(1/3) conventional cells per axis, Maxwell–Boltzmann 300 K."""
    import ase.build
    from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary

    k = round((n_atoms / 8) ** (1 / 3))
    if 8 * k**3 != n_atoms:
        raise SystemExit(f"--atoms must be 8·k³ (diamond cells), got {n_atoms}")
    atoms = ase.build.bulk("Si", "diamond", a=A_SI, cubic=True).repeat((k, k, k))
    atoms.rattle(0.01, seed=seed)
    import numpy as np

    MaxwellBoltzmannDistribution(atoms, temperature_K=300, rng=np.random.default_rng(seed))
    Stationary(atoms)
    return atoms


def network(cfg, atoms):
    """jax-md's factory, its weights (its own init) and the one-hot species."""
    import jax
    import jax.numpy as jnp
    from jax_md import energy, space

    box = jnp.asarray(atoms.cell.array.T, jnp.float32)
    displacement, shift = space.periodic(box[0, 0])
    neighbor_fn, init_fn, energy_fn = energy.nequip_neighbor_list(displacement, box[0, 0], cfg)
    R = jnp.asarray(atoms.positions, jnp.float32)
    nbrs = neighbor_fn.allocate(R)
    species = jax.nn.one_hot(jnp.zeros(len(atoms), jnp.int32), 1)
    params = init_fn(jax.random.PRNGKey(0), R, nbrs, atoms=species)
    return dict(box=box, displacement=displacement, shift=shift, neighbor_fn=neighbor_fn, energy_fn=energy_fn,
                params=params, species=species, R=R, nbrs=nbrs)


def prepare_jax_md(n_atoms: int, steps: int, kind: str, cost: bool = False):
    """jax-md's loop, compiled and warmed; returns a function timing one run of ``steps``.
    cost: each run's figures also give XLA's cost analysis of one step (``step_cost``)."""
    import jax
    import jax.numpy as jnp
    from ase import units
    from jax_md import simulate

    atoms = diamond(n_atoms)
    net = network(config(kind), atoms)

    def energy(R, neighbor, **kwargs):
        return net["energy_fn"](net["params"], R, neighbor, atoms=net["species"])

    init, apply = simulate.nve(energy, net["shift"], DT_FS * units.fs)
    state = init(jax.random.PRNGKey(1), net["R"], mass=MASS_SI, neighbor=net["nbrs"], kT=0.0)
    state = state.set(momentum=jnp.asarray(atoms.get_momenta(), jnp.float32))

    from timing import jax_md_loop

    loop = jax_md_loop(apply, steps)
    carry = loop(state, net["nbrs"])  # compile and warm
    jax.block_until_ready(carry[0].position)
    step_cost = step_costs(jax_md_loop(apply, 1).lower(*carry).compile()) if cost else {}

    def run() -> dict:
        nonlocal carry
        t0 = time.perf_counter()
        carry = loop(*carry)  # each run continues the trajectory
        jax.block_until_ready(carry[0].position)
        seconds = time.perf_counter() - t0
        if bool(carry[1].did_buffer_overflow):
            raise RuntimeError("jax-md's neighbour list overflowed; the figure would be wrong")
        return dict(seconds=seconds, **step_cost)

    return run


def prepare_jaxdd(n_atoms: int, steps: int, kind: str, devices: int, cost: bool = False):
    """jaxdd's DomainParallel on ``devices`` devices, compiled and warmed; returns a function
    timing one run of ``steps``. cost: as :func:`prepare_jax_md` (one rank's step)."""
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh
    from jax_md import energy

    import jaxdd
    from jaxdd.interop.jax_md import JaxMDModel

    atoms = diamond(n_atoms)
    cfg = config(kind)
    net = network(cfg, atoms)
    model = JaxMDModel(lambda d, b: energy.nequip_neighbor_list(d, b, cfg), cutoff=R_MAX, format="Sparse",
                       periodic=True, fractional_coordinates=False, species=(14,), species_as="atoms",
                       params=net["params"])
    if len(jax.devices()) < devices:  # a mesh of fewer devices would be timed under this one's name
        raise RuntimeError(f"{devices} devices asked for, JAX has {len(jax.devices())}: set JAX_NUM_CPU_DEVICES "
                           "before JAX is imported")
    mesh = Mesh(np.asarray(jax.devices()[:devices]), ("dd",), axis_types=(AxisType.Auto,))
    dm = jaxdd.DistributedModel(model, jaxdd.DomainConfig(R_MAX, skin=0.5, mesh=mesh))
    from ase import units

    md = jaxdd.DomainParallel(dm, jaxdd.VelocityVerlet(DT_FS * units.fs))
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float32)
    state = md.run(md.init(data), steps)  # compile, grow capacities, warm
    for _ in range(10):  # and past one plan rebuild, whose program compiles at its first use (0.8 s)
        if md.last_run.rebuilds or md.keeps_plan:
            break
        state = md.run(state, steps)
    step_cost = step_costs(md.lower(state).compile()) if cost else {}

    def run() -> dict:
        nonlocal state
        t0 = time.perf_counter()
        state = md.run(state, steps)  # each run continues the trajectory
        seconds = time.perf_counter() - t0
        return dict(seconds=seconds, rebuilds=md.last_run.rebuilds, discarded=md.last_run.discarded,
                    recompiles=md.last_run.recompiles, mesh_devices=int(mesh.size), **step_cost)

    return run


def step_costs(compiled) -> dict:
    """XLA's cost analysis of a compiled loop whose body is one step (counted once): one
    rank's flops and bytes accessed per step. Deterministic, unlike the timings."""
    from timing import cost

    c = cost(compiled)
    return dict(step_gflops=c["flops"] / 1e9, step_gbytes=c["bytes"] / 1e9)


def worker(spec: str) -> int:
    kw = json.loads(spec)
    # Before JAX is imported (timing imports it): JAX reads the device count once, at import.
    os.environ["JAX_NUM_CPU_DEVICES"] = str(kw["devices"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from timing import serve

    if kw["side"] == "jax-md":
        return serve(lambda: prepare_jax_md(kw["atoms"], kw["steps"], kw["config"], kw["cost"]))
    return serve(lambda: prepare_jaxdd(kw["atoms"], kw["steps"], kw["config"], kw["devices"], kw["cost"]))


def interleaved(atoms: int, steps: int, kind: str, repeats: int, cost: bool = False) -> list[dict]:
    """jax-md (1 core), jaxdd on 1 device (1 core) and on 2 (2 cores), each a pinned child
    prepared once; then ``repeats`` rounds in which each times one run in turn, so every side
    is measured in every phase of the machine. Rows with the fastest run of each side."""
    from timing import PinnedWorker

    sides = (("jax-md", 1), ("jaxdd", 1), ("jaxdd", 2))
    workers = []
    try:
        for side, devices in sides:  # prepared one at a time: compilation is not timed
            workers.append(PinnedWorker(__file__, dict(side=side, atoms=atoms, steps=steps, config=kind,
                                                       devices=devices, cost=cost), devices))
        runs = [[] for _ in sides]
        for _ in range(repeats):
            for w, timed in zip(workers, runs):
                timed.append(w.run())
        rows = []
        for (side, devices), w, timed in zip(sides, workers, runs):
            best = min(timed, key=lambda r: r["seconds"])
            rows.append(dict(best, seconds_of_each_run=[r["seconds"] for r in timed], **w.close(), side=side,
                             atoms=atoms, cores=w.cores, devices=devices,
                             atom_steps_per_second=atoms * steps / best["seconds"]))
        return rows
    finally:
        for w in workers:
            if w.proc.poll() is None:  # not closed: a side failed or the run was interrupted
                w.kill()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--atoms", default="1000,8000", help="comma-separated atom counts, each 8·k³ (default 1000,8000)")
    p.add_argument("--steps", type=int, default=100, help="NVE steps per timed run (default 100)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds of timed runs, each side once per round; the fastest is reported (default 3)")
    p.add_argument("--config", choices=("small", "default"), default="small", help="jax-md NequIP size")
    p.add_argument("--cost", action="store_true",
                   help="also print XLA's cost analysis of one step per side (one rank's GFLOP and GB accessed)")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON here")
    p.add_argument("--xla-defaults", action="store_true",
                   help=f"keep XLA's CPU defaults (else {' '.join(CPU_XLA_FLAGS)} are added to XLA_FLAGS, "
                        "for every side)")
    args = p.parse_args(argv)
    from timing import check_args

    check_args(p, args, positive=("steps", "repeats"))
    sizes = [int(a) for a in args.atoms.split(",") if a.strip()]
    if not args.xla_defaults:  # the children inherit it
        flags = os.environ.get("XLA_FLAGS", "")
        missing = [f for f in CPU_XLA_FLAGS if f.split("=")[0] not in flags]
        os.environ["XLA_FLAGS"] = " ".join([flags, *missing]).strip()
    rows = []
    print(f"NequIP (jax-md, {args.config} config) NVE on diamond Si, {args.steps} steps, dt {DT_FS} fs, float32; "
          f"each side a child pinned to its cores, timed in turn, fastest of {args.repeats} round(s); "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"{'side':>14} {'atoms':>6} {'cores':>5} {'atom-steps/s':>13} {'seconds':>8} {'max RSS MB':>10} {'ratio':>22}")
    for n in sizes:
        ref, one, two = interleaved(n, args.steps, args.config, args.repeats, args.cost)
        one["ratio"] = one["atom_steps_per_second"] / ref["atom_steps_per_second"]
        two["ratio"] = two["atom_steps_per_second"] / one["atom_steps_per_second"]
        for r, label, what in ((ref, "jax-md", ""), (one, "jaxdd 1 dev", f"{one['ratio']:.2f}x jax-md"),
                               (two, "jaxdd 2 dev", f"{two['ratio']:.2f}x 1 device")):
            print(f"{label:>14} {n:>6} {r['cores']:>5} {r['atom_steps_per_second']:>13,.0f} {r['seconds']:>8.2f} "
                  f"{r['max_rss_mb']:>10.0f} {what:>22}", flush=True)
        if args.cost:
            for r, label in ((ref, "jax-md"), (one, "jaxdd 1 dev"), (two, "jaxdd 2 dev")):
                print(f"{label:>14} {n:>6}  one step, one rank (XLA cost analysis): {r['step_gflops']:.2f} GFLOP, "
                      f"{r['step_gbytes']:.2f} GB accessed", flush=True)
        rows += [ref, one, two]
    ones = [r["ratio"] for r in rows if r["side"] == "jaxdd" and r["devices"] == 1]
    twos = [r["ratio"] for r in rows if r["side"] == "jaxdd" and r["devices"] == 2]
    print(f"target (jaxdd 1 device >= 1.0x jax-md): {'met' if min(ones) >= 1.0 else 'NOT met'}: lowest {min(ones):.3f}x")
    print(f"target (2 pinned devices >= 1.7x 1 device): {'met' if min(twos) >= 1.7 else 'NOT met'}: "
          f"lowest {min(twos):.3f}x")
    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(benchmark="mlip_md", config=args.config, steps=args.steps, repeats=args.repeats,
                                     xla_flags=os.environ.get("XLA_FLAGS", ""), rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
