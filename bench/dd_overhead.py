"""Overhead of domain decomposition on the 32,000-atom LJ melt.

    python bench/dd_overhead.py [--n-cells 20] [--devices 1,2,4,8] [--repeat 3] [--json PATH]

Prints two tables:

1. Wall time of energy + forces through ``DistributedModel`` on a 1-device mesh over
   ``jaxdd.compute`` on the same device (target <= 1.15), both medians of ``--repeat``
   calls after a warm-up, both including their host-side work (the distributed call
   partitions and plans the halo on every call).
2. For each device count: XLA's cost analysis of the compiled per-rank program (flops and
   bytes accessed), its memory (arguments + temporaries), and the total work ratio
   sum over ranks of flops / flops of the single-device ``compute`` (target <= 1.3 at 8
   devices). On CPU the devices are virtual (``JAX_NUM_CPU_DEVICES``), so only the work,
   not the wall time, of several devices is meaningful here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.distributed import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.driver import _run as compute_program  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.systems import lj_melt_data  # noqa: E402
from timing import cost, median_time  # noqa: E402

OUTPUTS = ("energy", "forces")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-cells", type=int, default=20)
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.devices.split(",")]
    if max(counts) > len(jax.devices()):
        sys.exit(f"--devices asks for {max(counts)} devices but JAX sees {len(jax.devices())}")

    data = lj_melt_data(args.n_cells)
    batch = jaxdd.as_batch(data)
    model = LennardJones(1.0, 1.0, 2.5)
    cap = jaxdd.neighbor_capacity(batch.positions, batch.cell, batch.pbc, cutoff=2.5)
    n_atoms = batch.n_atoms

    t_compute = median_time(lambda: jaxdd.compute(model, data, OUTPUTS, capacity=cap), args.repeat)
    one = DistributedModel(model, DomainConfig(cutoff=2.5, mesh=default_mesh(jax.devices()[:1])))
    t_dd = median_time(lambda: one(data, OUTPUTS), args.repeat)
    ref = jaxdd.compute(model, data, OUTPUTS, capacity=cap)
    got = one(data, OUTPUTS)
    d_energy = abs(float(got["energy"][0] - ref["energy"][0])) / abs(float(ref["energy"][0]))
    d_forces = float(np.abs(np.asarray(got["forces"] - ref["forces"])).max())

    print(f"LJ melt, {n_atoms:,} atoms, rc 2.5, float64; {jax.devices()[0].platform} devices")
    print(f"{'compute (1 device)':28s} {t_compute:8.3f} s")
    print(f"{'DistributedModel (1 device)':28s} {t_dd:8.3f} s")
    print(f"{'ratio (target <= 1.15)':28s} {t_dd / t_compute:8.3f}")
    print(f"{'agreement':28s} energy rel {d_energy:.1e}, forces abs {d_forces:.1e}")

    base = cost(compute_program.lower(model, batch, OUTPUTS, cap).compile())
    rows = []
    for n in counts:
        dm = DistributedModel(model, DomainConfig(cutoff=2.5, mesh=default_mesh(jax.devices()[:n])))
        c = cost(dm.lower(data, OUTPUTS).compile())
        health = dm.plan(batch)[1]
        rows.append({
            "devices": n,
            "grid": health.layout.grid,
            "flops_per_rank": c["flops"],
            "bytes_per_rank": c["bytes"],
            "memory_per_rank": c["memory"],
            "work_ratio": n * c["flops"] / base["flops"],
            "max_ghosts": int(health.ghost_counts().max()),
            "max_owned": int(health.owned_counts().max()),
        })
    print()
    print(f"single-device compute: {base['flops']:.3e} flops, {base['bytes']:.3e} bytes, memory {base['memory'] or 0:,} B")
    print(f"{'devices':>7} {'grid':>10} {'owned':>7} {'ghosts':>7} {'flops/rank':>11} {'bytes/rank':>11} "
          f"{'memory/rank':>13} {'work ratio':>10}")
    for r in rows:
        mem = f"{r['memory_per_rank']:,}" if r["memory_per_rank"] is not None else "n/a"
        print(f"{r['devices']:>7} {str(r['grid']):>10} {r['max_owned']:>7} {r['max_ghosts']:>7} "
              f"{r['flops_per_rank']:>11.3e} {r['bytes_per_rank']:>11.3e} {mem:>13} {r['work_ratio']:>10.3f}")
    print("work ratio = devices x flops per rank / flops of compute (target <= 1.3 at 8 devices)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"n_atoms": n_atoms, "compute_s": t_compute, "dd_1_device_s": t_dd,
                       "ratio": t_dd / t_compute, "base": base, "rows": rows}, fh, indent=2, default=str)


if __name__ == "__main__":
    main()
