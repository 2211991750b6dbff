"""Benchmark: per-rank memory and work of PME's distributed mesh against the replicated one.

    python bench/pme_scaling.py [--n-ions 512] [--mesh 96] [--devices 1,2,4,8] [--json PATH]

One system, a rattled grid of ``--n-ions`` ions (half +1 e, half -1 e) in a triclinic cell of
about 2.8 Å per ion along each axis, smooth PME (cutoff 5 Å, order 6) on a ``--mesh``³ mesh,
energy + forces in float64. For each rank count and each mesh mode the distributed program
is compiled (not run) and XLA's analyses of the per-rank program are read:

- memory: arguments + temporaries + outputs of the per-rank program (XLA memory analysis);
- mesh: the part of it that the mesh accounts for, the memory of the program on ``--mesh``
  minus that on a mesh of ``--base-mesh`` points per axis (same ranks, same mode);
- flops: XLA's cost analysis of the per-rank program.

``distributed``: each rank holds one block of the mesh (mesh halo + all_to_all FFT, see
models/pme_grid.py); its mesh memory and FFT work should fall near 1/P. ``replicated``: every rank
spreads onto the whole mesh, all-reduces it and transforms it whole (the PyTorch system's
PME); its mesh memory and FFT work stay those of one device. Ratios are against 1 rank.
On a CPU the devices are virtual (set by the script); memory and flops are per device and
carry over to real accelerators.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.data import AtomicData, as_batch  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.models.pme_grid import mesh_problems  # noqa: E402
from jaxdd.models.pme import PME  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py
from timing import check_args, cost, write_record  # noqa: E402

CUTOFF = 5.0
OUTPUTS = ("energy", "forces")
MODES = ("distributed", "replicated")


def ions(n_ions: int, seed: int = 0) -> AtomicData:
    """A rattled n×n×n grid of ions (n = cube root of n_ions), neutral, triclinic cell."""
    n = round(n_ions ** (1 / 3))
    rng = np.random.default_rng(seed)
    cell = n * np.array([[2.8, 0.0, 0.0], [0.3, 2.7, 0.0], [-0.25, 0.4, 2.75]])
    grid = (np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3) + 0.5) / n
    q = np.array([1.0, -1.0] * (n ** 3 // 2) + [0.0] * (n ** 3 % 2))
    rng.shuffle(q)
    return AtomicData(grid @ cell + rng.normal(0, 0.25, (n ** 3, 3)), np.where(q > 0, 11, 17), cell, [True] * 3,
                      charges=q)


def measure(data, n_ranks: int, mode: str, mesh: int) -> dict:
    """Cost of the compiled per-rank program, and the rank grid it was cut by."""
    model = PME(CUTOFF, mesh=(mesh,) * 3, distributed_fft=mode == "distributed")
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=default_mesh(jax.devices()[:n_ranks])))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # small rank blocks replicate their neighbourhood
        grid = dm.plan(as_batch(data))[0].grid
        bad = mesh_problems((mesh,) * 3, grid)
        if bad:
            raise SystemExit(f"mesh {mesh} does not fit the {n_ranks}-rank grid {grid}: {'; '.join(bad)}")
        compiled = dm.lower(data, OUTPUTS).compile()
    return dict(cost(compiled), grid=list(grid))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-ions", type=int, default=512, help="ions (a cube number; default 512)")
    p.add_argument("--mesh", type=int, default=96, help="mesh points per axis (default 96)")
    p.add_argument("--base-mesh", type=int, default=24, help="small mesh whose memory is subtracted (default 24)")
    p.add_argument("--devices", default="1,2,4,8", help="rank counts, comma-separated (default 1,2,4,8)")
    p.add_argument("--modes", default=",".join(MODES), help="mesh modes (default distributed,replicated)")
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = p.parse_args(argv)
    check_args(p, args, positive=("n_ions", "mesh", "base_mesh"), choices={"modes": MODES})
    try:
        ranks = tuple(int(v) for v in args.devices.split(","))
    except ValueError:
        p.error(f"--devices must list positive integers, got {args.devices!r}")
    if not ranks or min(ranks) < 1:
        p.error(f"--devices must list positive integers, got {args.devices!r}")
    jax.config.update("jax_num_cpu_devices", max(ranks))  # virtual devices when running on the CPU
    if len(jax.devices()) < max(ranks):
        p.error(f"--devices {max(ranks)}: only {len(jax.devices())} devices")
    data = ions(args.n_ions)
    print(f"jaxdd {jaxdd.__version__}, jax {jax.__version__}, {jax.default_backend()} devices; PME order 6, "
          f"cutoff {CUTOFF} Å, {data.n_atoms} ions, mesh {args.mesh}³ (base {args.base_mesh}³), float64, "
          "energy + forces; per-rank figures of the compiled program")
    header = (f"{'ranks':>5} {'grid':<9} {'mode':<12} {'memory MB':>10} {'mesh MB':>9} {'mesh x1':>8} "
              f"{'GFLOP':>9} {'flops x1':>9}")
    print(header)
    print("-" * len(header))
    rows, first = [], {}
    for mode in args.modes:
        for n in ranks:
            full = measure(data, n, mode, args.mesh)
            base = measure(data, n, mode, args.base_mesh)
            mesh_bytes = full["memory"] - base["memory"]
            row = dict(ranks=n, grid=full["grid"], mode=mode, memory=full["memory"],
                       mesh_memory=mesh_bytes, flops=full["flops"])
            ref = first.setdefault(mode, row)
            rows.append(row)
            print(f"{n:>5} {'x'.join(map(str, row['grid'])):<9} {mode:<12} {full['memory'] / 1e6:>10.1f} "
                  f"{mesh_bytes / 1e6:>9.1f} {mesh_bytes / ref['mesh_memory']:>8.3f} {full['flops'] / 1e9:>9.3f} "
                  f"{full['flops'] / ref['flops']:>9.3f}")
    if len(args.modes) == 2:
        for n in ranks:
            d, r = (next(x for x in rows if x["ranks"] == n and x["mode"] == m) for m in MODES)
            print(f"{n} ranks: distributed / replicated mesh memory {d['mesh_memory'] / r['mesh_memory']:.3f}, "
                  f"flops {d['flops'] / r['flops']:.3f}, ideal {1 / n:.3f}")
    if args.json:
        write_record(args.json, dict(benchmark="pme_scaling", n_ions=data.n_atoms, mesh=args.mesh,
                                     base_mesh=args.base_mesh, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
