"""Benchmark: graph-parallel against halo decomposition, side by side.

    python bench/gp_vs_halo.py [--n-cells 20] [--molecule-atoms 2000] [--devices 8]
                               [--features 32] [--repeat 3] [--json PATH]

Two systems, one message-passing model (the zoo's SchNet, 3 interactions, cutoff 5 Å,
float64), energy + forces:

- **bulk**: a rattled fcc crystal (a = 4.1 Å, ~28 neighbours per atom) of mixed H, C, N, O,
  20×20×20 cells = 32,000 atoms by default; large and homogeneous, where spatial domains
  are mostly interior.
- **molecules**: a batch of small molecules (each its own non-periodic system), about 2,000
  atoms in all; every molecule fits inside one cutoff sphere, so spatial domains are all
  halo and every rank holds nearly every atom.

For each system and strategy the script runs the distributed model once (compilation and
capacity sizing), then reports, per rank of ``--devices`` ranks:

- rows: owned / ghost rows of the fullest rank;
- comm/call: bytes of the results of the compiled program's collectives (all-gather,
  collective-permute, reduce-scatter, all-reduce, all-to-all), read from the optimised HLO;
  ``per layer`` divides that by the model's interaction layers;
- memory: XLA's memory analysis of the per-rank program (arguments + temporaries + outputs);
- wall: the median time of ``--repeat`` calls, host planning included.

On a CPU the devices are virtual (set by the script) and share the machine's cores, so wall
times add up all ranks' work; communication bytes and per-rank memory are what carry over to
real devices.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax

jax.config.update("jax_enable_x64", True)

import ase.build  # noqa: E402
import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.data import Batch  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh  # noqa: E402
from jaxdd.models.mpnn import SchNet  # noqa: E402
from jaxdd.data.systems import fcc_lattice  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py
from timing import collectives, cost, median_time, write_record  # noqa: E402

CUTOFF = 5.0
SPECIES = (1, 6, 7, 8)
LATTICE = 4.1
LAYERS = 3
OUTPUTS = ("energy", "forces")
MOLECULES = ("H2O", "CH4", "NH3", "C2H6", "CH3OH", "HCOOH", "C6H6", "CO2", "CH3CN", "CH3CH2OH", "CH3COOH",
             "C4H4NH", "CH3NO2")


def bulk(n_cells: int) -> Batch:
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.numbers = np.random.default_rng(0).choice(SPECIES, len(atoms))
    atoms.rattle(0.15, seed=1)
    return Batch.from_ase(atoms)


def molecules(n_atoms: int) -> Batch:
    """Randomly turned small molecules in vacuum boxes until ``n_atoms`` atoms are reached."""
    rng = np.random.default_rng(0)
    out, total = [], 0
    while total < n_atoms:
        mol = ase.build.molecule(MOLECULES[len(out) % len(MOLECULES)])
        mol.rotate(rng.uniform(0, 360), rng.normal(size=3), center="COM")
        mol.center(vacuum=4.0)
        mol.pbc = False
        out.append(mol)
        total += len(mol)
    return Batch.from_ase(out)


def measure(model, batch: Batch, strategy: str, mesh, repeat: int) -> dict:
    dm = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh, strategy=strategy))
    t0 = time.perf_counter()
    jax.block_until_ready(dm(batch, OUTPUTS))
    first = time.perf_counter() - t0
    health = dm.health
    compiled = dm.lower(batch, OUTPUTS).compile()
    comm = collectives(compiled)
    total = sum(b for _, b in comm.values())
    wall = median_time(lambda: dm(batch, OUTPUTS), repeat)
    return dict(
        strategy=strategy, owned=int(health.owned.max()), ghost=int(health.ghost.max()),
        comm_bytes=total, comm_per_layer=total / LAYERS, collectives={k: list(v) for k, v in comm.items()},
        memory=cost(compiled)["memory"], wall=wall, first_call=first,
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-cells", type=int, default=20, help="fcc cells per axis of the bulk system (default 20: 32,000 atoms)")
    p.add_argument("--molecule-atoms", type=int, default=2000, help="atoms of the molecule set (default 2000)")
    p.add_argument("--devices", type=int, default=8, help="ranks (virtual CPU devices on a CPU; default 8)")
    p.add_argument("--features", type=int, default=32, help="SchNet feature width (default 32)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = p.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)  # virtual devices when running on the CPU
    if len(jax.devices()) < args.devices:
        p.error(f"--devices {args.devices}: only {len(jax.devices())} devices")
    mesh = default_mesh(jax.devices()[: args.devices])
    model = SchNet(SPECIES, CUTOFF, features=args.features, n_interactions=LAYERS)
    systems = {"bulk": bulk(args.n_cells), "molecules": molecules(args.molecule_atoms)}
    print(f"jaxdd {jaxdd.__version__}, jax {jax.__version__}, {args.devices} {jax.default_backend()} devices; "
          f"SchNet ({LAYERS} interactions, {args.features} features, cutoff {CUTOFF} Å), float64, energy + forces")
    rows = []
    header = (f"{'system':<22} {'strategy':<16} {'owned':>7} {'ghost':>7} {'comm/call MB':>13} {'per layer MB':>13} "
              f"{'memory MB':>10} {'wall s':>8}")
    print(header)
    print("-" * len(header))
    import warnings

    for name, batch in systems.items():
        label = f"{name} ({batch.n_atoms} atoms)"
        pair = []
        for strategy in ("halo", "graph_partition"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # degenerate halos are part of the comparison
                r = measure(model, batch, strategy, mesh, args.repeat)
            r["system"], r["n_atoms"] = name, batch.n_atoms
            pair.append(r)
            rows.append(r)
            print(f"{label:<22} {strategy:<16} {r['owned']:>7} {r['ghost']:>7} {r['comm_bytes'] / 1e6:>13.2f} "
                  f"{r['comm_per_layer'] / 1e6:>13.2f} {r['memory'] / 1e6:>10.1f} {r['wall']:>8.3f}")
        halo, gp = pair
        print(f"{'':<22} {'gp / halo':<16} {'':>7} {'':>7} {gp['comm_bytes'] / halo['comm_bytes']:>13.2f} "
              f"{'':>13} {gp['memory'] / halo['memory']:>10.2f} {gp['wall'] / halo['wall']:>8.2f}")
    if args.json:
        write_record(args.json, dict(benchmark="gp_vs_halo", devices=args.devices, features=args.features,
                                     layers=LAYERS, rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
