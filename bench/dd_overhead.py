"""Overhead of domain decomposition on the 32,000-atom LJ melt.

    python bench/dd_overhead.py [--n-cells 20] [--devices 1,2,4,8] [--repeat 3]
                                [--mlip schnet,nequip] [--mlip-cells 4] [--json PATH]

Prints three tables:

1. Wall time of energy + forces through ``DistributedModel`` on a 1-device mesh over
   ``jaxdd.compute`` on the same device (target <= 1.15), both medians of ``--repeat``
   calls after a warm-up, both including their host-side work (the distributed call
   partitions and plans the halo on every call).
2. For each device count: XLA's cost analysis of the compiled per-rank program (flops and
   bytes accessed), its memory (arguments + temporaries), and the total work ratio
   sum over ranks of flops / flops of the single-device ``compute`` (target <= 1.3 at 8
   devices). On CPU the devices are virtual (``JAX_NUM_CPU_DEVICES``), so only the work,
   not the wall time, of several devices is meaningful here.
3. For each MLIP of ``--mlip`` (SchNet, NequIP; float64) on a rattled fcc cell of H, C, N,
   O (``--mlip-cells`` per axis, 4 n³ atoms, 5 Å cutoff), on a 1-device mesh: median wall
   time of energy + forces through ``jaxdd.compute`` (the reference, measured in this run),
   ``DistributedModel.__call__`` (host work on every call) and ``DistributedModel.apply`` on
   inputs prepared once (as a training loop calls it), plain and under ``eqx.filter_jit``,
   each with its ratio to the reference (target for prepared apply <= 1.05); the paths'
   calls are taken in turn, so a drift of the machine's speed weighs on all alike. XLA's
   flops of both compiled programs are printed above each table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.engine.driver import _run as compute_program  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.models.mpnn import SchNet  # noqa: E402
from jaxdd.models.nequip import NequIP  # noqa: E402
from jaxdd.data.systems import fcc_lattice, lj_melt_data  # noqa: E402
from timing import cost, median_time  # noqa: E402

OUTPUTS = ("energy", "forces")
SPECIES = (1, 6, 7, 8)
MLIP_CUTOFF = 5.0  # Å
MLIPS = {
    "schnet": lambda: SchNet(SPECIES, MLIP_CUTOFF, seed=0),
    "nequip": lambda: NequIP(SPECIES, MLIP_CUTOFF, seed=0),
}


def mixed_fcc(n_cells: int) -> jaxdd.AtomicData:
    """Rattled fcc (a = 4.1 Å, 0.1 Å rattle) of random H, C, N, O: 4 n_cells³ atoms, periodic."""
    atoms = fcc_lattice(n_cells, 4.1)
    rng = np.random.default_rng(0)
    positions = atoms.positions + rng.normal(0.0, 0.1, atoms.positions.shape)
    return jaxdd.AtomicData(positions, rng.choice(SPECIES, len(atoms)), np.asarray(atoms.cell), True)


def interleaved_medians(fns: dict, repeat: int) -> dict:
    """Median seconds per call of each of ``fns`` (label → callable), after one warm-up call
    each, the calls taken in turn (round robin) so that a drift of the machine's speed
    during the run weighs on every path alike."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times = {label: [] for label in fns}
    for _ in range(repeat):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[label].append(time.perf_counter() - t0)
    return {label: statistics.median(t) for label, t in times.items()}


def mlip_row(model, data, cap, mesh, repeat: int) -> dict:
    """Per-call seconds of compute, DistributedModel.__call__ and prepared apply (plain and
    under eqx.filter_jit) of ``model`` on one device, their ratios to compute and their
    largest differences from it."""
    dm = DistributedModel(model, DomainConfig(cutoff=MLIP_CUTOFF, mesh=mesh, grid=(1, 1, 1)))
    prepared = dm.prepare(data, OUTPUTS)
    jitted = eqx.filter_jit(dm.apply)
    paths = {
        "compute": lambda: jaxdd.compute(model, data, OUTPUTS, capacity=cap),
        "DistributedModel.__call__": lambda: dm(data, OUTPUTS),
        "prepared apply": lambda: dm.apply(model, prepared),
        "prepared apply, filter_jit": lambda: jitted(model, prepared),
    }
    ref = paths["compute"]()
    row = {"seconds": interleaved_medians(paths, repeat), "ratio": {}, "agreement": {}}
    for label, fn in paths.items():
        row["ratio"][label] = row["seconds"][label] / row["seconds"]["compute"]
        got = fn()
        row["agreement"][label] = {
            "energy_rel": abs(float(got["energy"][0] - ref["energy"][0])) / abs(float(ref["energy"][0])),
            "forces_abs": float(np.abs(np.asarray(got["forces"] - ref["forces"])).max()),
        }
    # The work behind the times: the 1-rank program also carries the cell's periodic images
    # within the ghost width as ghost rows, on which node-wise layers run too.
    single = compute_program.lower(model, jaxdd.as_batch(data), OUTPUTS, cap).compile()
    row["flops"] = {"compute": cost(single)["flops"], "distributed": cost(dm.lower(data, OUTPUTS).compile())["flops"]}
    row["ghost_rows"] = int(prepared.program.layout.n_ghost)
    return row


def mlip_rows(names, n_cells: int, repeat: int) -> list[dict]:
    """:func:`mlip_row` of each MLIP in ``names`` on the mixed fcc cell of ``n_cells``."""
    data = mixed_fcc(n_cells)
    batch = jaxdd.as_batch(data)
    # The reference gets its neighbour capacity up front, as the LJ row: no host sizing per call.
    cap = jaxdd.neighbor_capacity(batch.positions, batch.cell, batch.pbc, cutoff=MLIP_CUTOFF)
    mesh = default_mesh(jax.devices()[:1])
    return [dict(model=name, n_atoms=int(batch.n_atoms), **mlip_row(MLIPS[name](), data, cap, mesh, repeat))
            for name in names]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-cells", type=int, default=20)
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--mlip", default="schnet,nequip",
                   help="MLIPs of the third table, comma-separated (schnet, nequip; '' leaves it out)")
    p.add_argument("--mlip-cells", type=int, default=4, help="fcc cells per axis of the MLIP system (4 n³ atoms)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    counts = [int(c) for c in args.devices.split(",")]
    if max(counts) > len(jax.devices()):
        sys.exit(f"--devices asks for {max(counts)} devices but JAX sees {len(jax.devices())}")
    mlips = [m.strip() for m in args.mlip.split(",") if m.strip()]
    if any(m not in MLIPS for m in mlips):
        p.error(f"--mlip must list some of {','.join(MLIPS)}, got {args.mlip!r}")
    if args.repeat < 1 or args.mlip_cells < 1:
        p.error("--repeat and --mlip-cells must be positive integers")

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

    mlip = mlip_rows(mlips, args.mlip_cells, args.repeat) if mlips else []
    for row in mlip:
        print()
        print(f"{row['model']}, {row['n_atoms']:,} atoms (mixed H/C/N/O fcc), rc {MLIP_CUTOFF} Å, float64, "
              f"1 device; median of {args.repeat}")
        flops = row["flops"]
        print(f"XLA flops: compute {flops['compute']:.3e}, distributed {flops['distributed']:.3e} "
              f"(ratio {flops['distributed'] / flops['compute']:.3f}; {row['ghost_rows']} ghost row slots)")
        print(f"{'':28s} {'ms/call':>9} {'compute':>9} {'ratio':>7}   agreement with compute")
        for label, t in row["seconds"].items():
            agree = row["agreement"][label]
            print(f"{label:28s} {1e3 * t:9.2f} {1e3 * row['seconds']['compute']:9.2f} {row['ratio'][label]:7.3f}   "
                  f"energy rel {agree['energy_rel']:.1e}, forces abs {agree['forces_abs']:.1e}")
    if mlip:
        print("ratio = time / time of compute; target for prepared apply <= 1.05")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"n_atoms": n_atoms, "compute_s": t_compute, "dd_1_device_s": t_dd,
                       "ratio": t_dd / t_compute, "base": base, "rows": rows, "mlip": mlip}, fh, indent=2,
                      default=str)


if __name__ == "__main__":
    main()
