"""What an angle model's per-bond features cost under decomposition, for three designs.

    python bench/bond_halo.py [--n-cells 10] [--grid 2,2,2] [--cutoff 5.0] [--bond-cutoff 3.0]
                              [--layers 3] [--features 64] [--bond-reads 2]

A model whose bond features ``[V, B, F]`` are updated layer by layer and read at each bond's
reverse (CHGNet, M3GNet with symmetrised bonds, DimeNet) needs, on a rank, the bond rows of
ghosts bonded to its atoms. The system is a rattled fcc crystal (a = 4.1 Å) of mixed H, C, N,
O, ``--n-cells``³ cells; the script plans the halo on the host (nothing compiles) and prints, for
the fullest rank, its owned and ghost rows and what each design exchanges or recomputes:

- **refresh** (jaxdd's): ghost shell = the cutoff. Bond rows are refreshed from their owners
  before they are read through a partner index: per layer ``--bond-reads`` forward exchanges of
  ``[ghosts, B, F]`` beside the node features' ``[ghosts, F]``; once per list build the partner
  names ``[ghosts, B, 2]`` int32 that put the reverse indices in the owners' order.
- **local bond rows**: no bond exchange; the rank computes the bond rows of its ghosts itself.
  A ghost's bond row at layer L reads its partners' rows at layer L - 1, so the ghost shell
  needing bond rows deepens by the bond cutoff per layer: shell ``max(cutoff, (L + 1) r_b)``,
  and the triplets ``B²`` of every ghost within ``L r_b`` computed each layer.
- **deep halo**: no exchange inside the model (``scatter_mode="local"``): shell ``L × cutoff``,
  every ghost row computed.

Bytes are float64 forward-pass exchanges (the backward pass sends as much again); B is the
most bonds of one atom (the list's width).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # virtual ranks for the plan; nothing runs on them

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from ase.neighborlist import neighbor_list  # noqa: E402

from jaxdd.data import Batch  # noqa: E402
from jaxdd.data.systems import fcc_lattice  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig  # noqa: E402
from jaxdd.models.angle_mpnn import AngleMPNN  # noqa: E402

SPECIES = (1, 6, 7, 8)
LATTICE = 4.1


def crystal(n_cells: int):
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.numbers = np.random.default_rng(0).choice(SPECIES, len(atoms))
    atoms.rattle(0.15, seed=1)
    return atoms


def fullest(batch, grid, width, cutoff, bond_cutoff) -> tuple[int, int]:
    """(owned, ghost rows) of the rank with the most ghost rows for a ghost shell ``width`` Å deep."""
    model = AngleMPNN(SPECIES, cutoff=cutoff, bond_cutoff=bond_cutoff, features=4)
    dm = DistributedModel(model, DomainConfig(cutoff=cutoff, ghost_width=width, grid=grid))
    part, plan = dm.plan(batch)
    real = plan.local_ids >= 0
    owned = np.asarray([np.sum(part.owner == r) for r in range(real.shape[0])])
    ghosts = real.sum(axis=1) - owned
    r = int(np.argmax(ghosts))
    return int(owned[r]), int(ghosts[r])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-cells", type=int, default=10)
    ap.add_argument("--grid", default="2,2,2")
    ap.add_argument("--cutoff", type=float, default=5.0)
    ap.add_argument("--bond-cutoff", type=float, default=3.0)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--bond-reads", type=int, default=2, help="reads of a bond array through a partner per layer")
    args = ap.parse_args(argv)
    grid = tuple(int(x) for x in args.grid.split(","))
    atoms = crystal(args.n_cells)
    batch = Batch.from_ase(atoms)
    rc, rb, L, F = args.cutoff, args.bond_cutoff, args.layers, args.features
    bonds = np.bincount(neighbor_list("i", atoms, rb), minlength=len(atoms))
    B = int(bonds.max())
    print(f"{len(atoms)} atoms, grid {grid}, cutoff {rc} Å, bond cutoff {rb} Å, {L} layers, F = {F}; "
          f"bonds per atom {bonds.mean():.1f} (most {B}), angles per atom {np.mean(bonds * (bonds - 1)):.0f}")
    rows = []
    owned, g = fullest(batch, grid, rc, rc, rb)
    per_layer = g * F * 8 + args.bond_reads * g * B * F * 8
    rows.append(("refresh", rc, owned, g, f"{per_layer / 2**20:.2f} MiB/layer + {g * B * 8 / 2**20:.2f} MiB/build",
                 0))
    width = max(rc, (L + 1) * rb)
    _, g_local = fullest(batch, grid, width, rc, rb)
    _, g_bonded = fullest(batch, grid, L * rb, rc, rb)
    rows.append(("local bond rows", width, owned, g_local, f"{g_local * F * 8 / 2**20:.2f} MiB/layer (nodes)",
                 g_bonded * B * B * L))
    _, g_deep = fullest(batch, grid, L * rc, rc, rb)
    rows.append(("deep halo", L * rc, owned, g_deep, "0", g_deep * B * B * L))
    head = ("design", "shell Å", "owned", "ghosts", "exchanged (forward)", "ghost triplets computed")
    table = [head] + [(d, f"{w:g}", str(o), str(gh), x, f"{t:,}") for d, w, o, gh, x, t in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    for r in table:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"owned triplets per layer: {owned * B * B:,} (slots; the real angles are fewer)")


if __name__ == "__main__":
    main()
