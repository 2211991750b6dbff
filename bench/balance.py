"""Benchmark: load balancing of uneven systems (``DomainConfig(balance=...)``).

    python bench/balance.py [--quick] [--steps 200] [--json PATH]

Three uneven LJ systems (reduced units, cutoff 2.5, skin 0.3): a (T, T, F) slab whose cell
is 60 % vacuum above the film, the same film with z periodic (the vacuum is then inside
the partitioned cell), and a drop off the centre of a periodic box. Printed:

1. On 8 virtual CPU devices, grid (2, 2, 2), equal slices against static balancing: the
   imbalance (owned atoms of the busiest rank / mean; target <= 1.10 balanced), owned and
   ghost rows per rank, and XLA's cost analysis of one force evaluation (flops per rank:
   every rank runs the program sized for the busiest, so the total is 8 times it).
2. 200 MD steps (velocity Verlet) on 2 devices pinned to 2 cores, equal slices against
   balanced blocks, in child processes, after as many untimed steps: atom-steps per second
   and the ratio, for a thicker film cut across its thickness and a larger drop.
3. The balanced film on 8 devices with dynamic balancing (every 50 steps) against one
   device after 200 steps: the largest position difference (target <= 1e-9 σ, float64).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def set_device_count(n: int) -> None:
    os.environ["JAX_NUM_CPU_DEVICES"] = str(n)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


CUTOFF, SKIN, DT = 2.5, 0.3, 0.005


def systems(quick: bool, thick: bool = False) -> dict:
    """The three systems; ``thick``: the film and drop of the 2-device runs, whose halves are
    several ghost widths across (thinner blocks are mostly ghost shell, whoever owns them)."""
    from jaxdd.data.systems import lj_droplet, lj_slab

    if thick:
        film = (4, 4, 6) if quick else (8, 8, 12)
        radius, box = (6.0, 16.0) if quick else (9.0, 24.0)
    else:
        film = (6, 6, 4) if quick else (10, 10, 6)
        radius, box = (5.0, 14.0) if quick else (8.0, 22.0)
    return {
        "slab (T,T,F)": lambda: lj_slab(film, vacuum=0.6, temperature=0.5, seed=1),
        "film (T,T,T)": lambda: lj_slab(film, vacuum=0.6, pbc=(True, True, True), temperature=0.5, seed=1),
        "drop": lambda: lj_droplet(radius, box, temperature=0.8, seed=2, centre=(0.3, 0.35, 0.4)),
    }


def model():
    from jaxdd.models.lj import LennardJones

    return LennardJones(1.0, 1.0, CUTOFF, shift=True, skin=SKIN)


def mesh_of(n):
    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


def partition_rows(quick: bool) -> list[dict]:
    """Part 1: imbalance, rows and flops per rank on 8 devices."""
    import jax
    import numpy as np

    import jaxdd
    from timing import cost

    jax.config.update("jax_enable_x64", True)
    rows = []
    for name, build in systems(quick).items():
        data = jaxdd.AtomicData.from_ase(build(), dtype=np.float64)
        for balance in (None, "static"):
            dm = jaxdd.DistributedModel(model(), jaxdd.DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(8),
                                                                    grid=(2, 2, 2), balance=balance))
            dm(data, ("energy", "forces"))
            health = dm.health
            c = cost(dm.lower(data, ("energy", "forces")).compile())
            rows.append(dict(system=name, balance=balance or "none", atoms=int(data.positions.shape[0]),
                             imbalance=health.imbalance, owned=[int(x) for x in health.owned],
                             ghost=[int(x) for x in health.ghost], flops_per_rank=c["flops"],
                             flops_total=8 * c["flops"]))
    return rows


def md_worker(spec: str) -> int:
    """Part 2 in a pinned child: one MD run, its figures as a JSON line."""
    kw = json.loads(spec)
    set_device_count(kw["devices"])
    import jax
    import numpy as np

    import jaxdd

    jax.config.update("jax_enable_x64", True)
    data = jaxdd.AtomicData.from_ase(systems(kw["quick"], thick=True)[kw["system"]](), dtype=np.float64)
    dm = jaxdd.DistributedModel(model(), jaxdd.DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(kw["devices"]),
                                                            grid=tuple(kw["grid"]), balance=kw["balance"]))
    md = jaxdd.DomainParallel(dm, jaxdd.VelocityVerlet(DT), kB=1.0)
    # As many steps untimed first: programs compiled and capacities grown before timing.
    state = md.run(md.init(data), kw["steps"])
    t0 = time.perf_counter()
    state = md.run(state, kw["steps"])
    seconds = time.perf_counter() - t0
    stats = md.last_run
    owned = np.sum(np.asarray(state.arrays["ids"]) >= 0, axis=1)  # [P] atoms each rank owns now
    print(json.dumps(dict(seconds=seconds, atom_steps_per_second=stats.atom_steps_per_second, atoms=int(owned.sum()),
                          rebuilds=stats.rebuilds, recompiles=stats.recompiles,
                          imbalance=float(owned.max() / owned.mean()))), flush=True)
    return 0


def pinned_md(system: str, grid, balance, steps: int, quick: bool) -> dict:
    from timing import run_pinned

    row, cores = run_pinned(__file__, dict(system=system, grid=list(grid), balance=balance, steps=steps, quick=quick,
                                           devices=2), 2)
    return dict(row, system=system, grid=tuple(grid), balance=balance or "none", cores=cores)


def equality(steps: int, quick: bool) -> float:
    """Part 3: the balanced film on 8 devices (dynamic) against one device."""
    import jax
    import numpy as np

    import jaxdd

    jax.config.update("jax_enable_x64", True)
    data = jaxdd.AtomicData.from_ase(systems(quick)["film (T,T,T)"](), dtype=np.float64)
    out = []
    for n, grid, balance in ((8, (2, 2, 2), "dynamic"), (1, (1, 1, 1), None)):
        dm = jaxdd.DistributedModel(model(), jaxdd.DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(n), grid=grid,
                                                                balance=balance,
                                                                balance_every=50 if balance == "dynamic" else None))
        md = jaxdd.DomainParallel(dm, jaxdd.VelocityVerlet(DT), kB=1.0)
        state = md.run(md.init(data), steps)
        out.append((np.asarray(md.gather(state).positions), md.last_run))
    print(f"  8 devices, dynamic balancing: {out[0][1]}")
    return float(np.abs(out[0][0] - out[1][0]).max())


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return md_worker(argv[1])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small systems (a smoke run)")
    p.add_argument("--steps", type=int, default=200, help="MD steps of parts 2 and 3 (default 200)")
    p.add_argument("--json", type=Path, default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    set_device_count(8)

    print("1. Equal slices against static balancing, 8 devices, grid (2, 2, 2)")
    rows = partition_rows(args.quick)
    print(f"{'system':>14} {'atoms':>6} {'blocks':>7} {'imbalance':>9} {'owned per rank':>36} "
          f"{'max ghosts':>10} {'Mflop/rank':>10} {'Mflop total':>11}")
    for r in rows:
        print(f"{r['system']:>14} {r['atoms']:>6} {r['balance']:>7} {r['imbalance']:>9.3f} "
              f"{' '.join(str(o) for o in r['owned']):>36} {max(r['ghost']):>10} "
              f"{r['flops_per_rank'] / 1e6:>10.2f} {r['flops_total'] / 1e6:>11.2f}")
    balanced = [r for r in rows if r["balance"] == "static"]
    worst = max(r["imbalance"] for r in balanced)
    print(f"target (imbalance <= 1.10 after static balancing): {'met' if worst <= 1.10 else 'NOT met'}: "
          f"highest {worst:.3f}")

    print(f"\n2. {args.steps} MD steps on 2 devices pinned to 2 cores (child processes), equal slices against balanced")
    md_rows = []
    for system, grid in (("film (T,T,T)", (1, 1, 2)), ("drop", (2, 1, 1))):
        for balance in (None, "static"):
            md_rows.append(pinned_md(system, grid, balance, args.steps, args.quick))
            r = md_rows[-1]
            print(f"{system:>14} ({r['atoms']} atoms) grid {grid} {r['balance']:>7}: "
                  f"{r['atom_steps_per_second']:>10,.0f} atom-steps/s "
                  f"({r['seconds']:.2f} s, imbalance {r['imbalance']:.3f}, {r['rebuilds']} rebuilds, "
                  f"{r['recompiles']} recompiles)", flush=True)
        print(f"{'':>14} balanced / equal slices: "
              f"{md_rows[-1]['atom_steps_per_second'] / md_rows[-2]['atom_steps_per_second']:.2f}x")

    print(f"\n3. Balanced film, dynamic balancing, 8 devices against one device after {args.steps} steps")
    diff = equality(args.steps, args.quick)
    print(f"  largest position difference {diff:.2e} σ: {'met' if diff <= 1e-9 else 'NOT met'} (target <= 1e-9)")

    if args.json is not None:
        from timing import write_record

        write_record(args.json, dict(benchmark="balance", partition=rows, md=md_rows, equality=diff,
                                     quick=args.quick, steps=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
