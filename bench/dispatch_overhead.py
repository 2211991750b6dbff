"""Cost of re-interpreting a model's jaxpr (the dispatch) on a 1-device mesh.

    python bench/dispatch_overhead.py [--atoms 2000] [--models mpnn_segment_sum,e3nn_equivariant] [--json PATH]

For each plain single-device model of ``tests/plain_models.py`` (no jaxdd inside), on a
random periodic system of ``--atoms`` atoms (density 0.05 Å⁻³, cutoff 5 Å), energy + forces
are compiled twice on the same inputs (the same neighbour list, the same capacities):

- plain: ``jax.value_and_grad`` of the model, jitted on one device;
- dispatched: the same, with the model traced and re-interpreted by ``jaxdd.dispatch``
  inside ``shard_map`` over a 1-device mesh under ``halo_correction`` (every rule runs:
  masks, reductions, collectives; the halo itself is empty on one device).

It prints XLA's compiled flops of both and their ratio (target <= 1.05), the rules that
fired, the median wall time of both, and the largest difference of their results.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.dispatch import DispatchReport, Runtime, call_model  # noqa: E402
from jaxdd.ops import HaloStoragePolicy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import plain_models  # noqa: E402
from test_dispatch import Plain  # noqa: E402
from timing import cost, median_time  # noqa: E402


def system(n_atoms, seed=0, density=0.05):
    box = (n_atoms / density) ** (1 / 3)
    rng = np.random.default_rng(seed)
    # A jittered simple-cubic lattice keeps atoms apart without a rejection loop.
    k = int(np.ceil(n_atoms ** (1 / 3)))
    grid = np.stack(np.meshgrid(*[np.arange(k)] * 3, indexing="ij"), -1).reshape(-1, 3)[:n_atoms]
    pos = (grid + 0.5 + rng.uniform(-0.2, 0.2, grid.shape)) * (box / k)
    return jaxdd.AtomicData(positions=pos, atomic_numbers=rng.integers(1, 5, n_atoms), cell=np.eye(3) * box,
                            pbc=np.array([True] * 3))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--atoms", type=int, default=2000)
    p.add_argument("--models", default="mpnn_segment_sum,mpnn_jraph,e3nn_equivariant,flax_scan,sum_readout")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    data = system(args.atoms)
    batch = jaxdd.as_batch(data)
    nl, _ = jaxdd.neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                                cutoff=plain_models.CUTOFF)
    batch = batch.replace(neighbors=nl)
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("dd",), axis_types=(AxisType.Auto,))
    rows = []
    print(f"{args.atoms:,} atoms, {int(nl.n_edges):,} edges (capacity {nl.senders.shape[0]:,}), float64, "
          f"{jax.devices()[0].platform}")
    print(f"{'model':18s} {'plain flops':>12s} {'dispatched':>12s} {'ratio':>7s} {'plain s':>8s} {'disp s':>8s} "
          f"{'max |dF|':>9s}  rules")
    for name in args.models.split(","):
        model = Plain(name)

        def energy(model, positions):
            return jnp.sum(model(batch.replace(positions=positions))["energy"])

        plain = jax.jit(jax.value_and_grad(energy, argnums=1))
        report = DispatchReport(policy=HaloStoragePolicy())

        def rank(model, local):
            local = jax.tree_util.tree_map(lambda x: x[0], local)  # this rank's block, as in the engine

            def e(positions):
                rt = Runtime(None, None, ("dd",), HaloStoragePolicy(), local.atom_mask, edge_owned=local.neighbors.mask)
                out, _ = call_model(model, local.replace(positions=positions), rt, report)
                return jnp.sum(out["energy"])

            value, grad = jax.value_and_grad(e)(local.positions)
            return value, grad[None]

        stacked = jax.tree_util.tree_map(lambda x: x[None], batch)
        dispatched = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=(P(), P("dd")), out_specs=(P(), P("dd")),
                                           check_vma=False))  # as DistributedModel runs it
        f_plain = cost(plain.lower(model, batch.positions).compile())["flops"]
        f_disp = cost(dispatched.lower(model, stacked).compile())["flops"]
        t_plain = median_time(lambda: plain(model, batch.positions), args.repeat)
        t_disp = median_time(lambda: dispatched(model, stacked), args.repeat)
        (e0, g0), (e1, g1) = plain(model, batch.positions), dispatched(model, stacked)
        g1 = g1[0]
        d_f = float(jnp.max(jnp.abs(g0 - g1)))
        rules = ", ".join(f"{k} {v}" for k, v in sorted(report.counts.items()))
        rows.append(dict(model=name, plain_flops=f_plain, dispatched_flops=f_disp, ratio=f_disp / f_plain,
                         plain_s=t_plain, dispatched_s=t_disp, max_force_diff=d_f, energy_diff=float(abs(e0 - e1)),
                         rules=dict(report.counts)))
        print(f"{name:18s} {f_plain:12.4e} {f_disp:12.4e} {f_disp / f_plain:7.4f} {t_plain:8.3f} {t_disp:8.3f} "
              f"{d_f:9.1e}  {rules}")
    print("target: dispatched / plain flops <= 1.05")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
