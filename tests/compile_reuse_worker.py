"""Many differently sized structures through one process, without clearing any cache.

Run by tests/test_compile_reuse.py in a fresh interpreter (``python tests/compile_reuse_worker.py
--structures N --paths compute,ase,dist``): Lennard-Jones argon (fcc supercells and jittered
random cells, strained and sheared, 1 to ``--max-atoms`` atoms) is evaluated by
``jaxdd.compute``, by ``jaxdd.ase.Calculator`` and by a ``DistributedModel`` on virtual CPU
devices; every result is compared with ASE's own Lennard-Jones calculator. Prints one JSON
object: per path the ``/proc/self/maps`` line count and the compilation count after each
structure, the programs each jaxdd entry point holds, and the largest deviation from ASE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

DEVICES = 4
os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(DEVICES))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.monitoring  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from ase import Atoms  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.calculators.lj import LennardJones as AseLJ  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402

SIGMA, EPSILON, CUTOFF = 3.4, 0.0104, 8.5
COMPILES = [0]


def _count(event, duration, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count)


def maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def structures(n: int, max_atoms: int, min_atoms: int = 1, seed: int = 0) -> list[Atoms]:
    """``n`` argon structures of ``min_atoms``..``max_atoms`` atoms in varying cells: strained
    fcc supercells and jittered grids in random triclinic cells, at argon's density."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        if len(out) % 2 == 0:
            reps = tuple(int(r) for r in rng.integers(1, 5, size=3))
            if not min_atoms <= 4 * np.prod(reps) <= max_atoms:
                continue
            atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(reps)
        else:
            k = int(rng.integers(min_atoms, max_atoms + 1))
            shape = np.maximum(1, np.round(np.cbrt(k) * rng.uniform(0.6, 1.5, 3))).astype(int)
            while np.prod(shape) < k:
                shape[np.argmin(shape)] += 1
            grid = np.stack(np.meshgrid(*[np.arange(s) for s in shape], indexing="ij"), -1).reshape(-1, 3)
            sites = grid[rng.permutation(len(grid))[:k]] + rng.uniform(-0.1, 0.1, (k, 3))
            spacing = 3.76  # Å: argon's density, one atom per cube of this side
            cell = np.diag(shape * spacing)
            atoms = Atoms(f"Ar{k}", scaled_positions=(sites + 0.5) / shape, cell=cell, pbc=True)
        shear = np.eye(3) + np.triu(rng.uniform(-0.15, 0.15, (3, 3)), 1) + np.diag(rng.uniform(-0.04, 0.04, 3))
        atoms.set_cell(atoms.cell.array @ shear, scale_atoms=True)
        atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
        out.append(atoms)
    return out


def reference(atoms: Atoms):
    calc = AseLJ(sigma=SIGMA, epsilon=EPSILON, rc=CUTOFF, smooth=False)
    return calc.get_potential_energy(atoms), calc.get_forces(atoms), calc.get_stress(atoms)


def deviation(got, ref) -> float:
    e, f, s = got
    e0, f0, s0 = ref
    return max(abs(e - e0) / max(1.0, abs(e0)), float(np.max(np.abs(f - f0), initial=0.0)),
               float(np.max(np.abs(s - s0))))


def run(path: str, atoms_list, model) -> dict:
    from ase.stress import full_3x3_to_voigt_6_stress

    if path == "dist":
        mesh = jaxdd.distributed.default_mesh(jax.devices()[:DEVICES])
        dist = jaxdd.DistributedModel(model, jaxdd.DomainConfig(CUTOFF, mesh=mesh))
    calc = jaxdd.ase.Calculator(model) if path == "ase" else None
    record = dict(maps=[], compiles=[], worst=0.0)
    for atoms in atoms_list:
        if path == "ase":
            a = atoms.copy()
            a.calc = calc
            got = a.get_potential_energy(), a.get_forces(), a.get_stress()
        else:
            data = jaxdd.AtomicData.from_ase(atoms)
            if path == "compute":
                out = jaxdd.compute(model, data, ("energy", "forces", "stress"))
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # small cells: every rank holds every atom
                    out = dist(data, ("energy", "forces", "stress"))
            got = (float(out["energy"][0]), np.asarray(out["forces"]),
                   full_3x3_to_voigt_6_stress(np.asarray(out["stress"][0])))
            assert got[1].shape == (len(atoms), 3)
        record["worst"] = max(record["worst"], deviation(got, reference(atoms)))
        record["maps"].append(maps())
        record["compiles"].append(COMPILES[0])
    return record


def programs() -> dict:
    from jaxdd import distributed, driver, neighbors

    return dict(compute=driver._run._cached._cache_size(), dist=distributed._run._cached._cache_size(),
                sizing=sum(f._cache_size() for f in (neighbors._range_stats, neighbors._candidate_stats,
                                                     neighbors._pair_stats)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--structures", type=int, default=300)
    ap.add_argument("--max-atoms", type=int, default=200)
    ap.add_argument("--min-atoms", type=int, default=1)
    ap.add_argument("--paths", default="compute,ase,dist")
    args = ap.parse_args(argv)
    atoms_list = structures(args.structures, args.max_atoms, args.min_atoms)
    model = LennardJones(sigma=SIGMA, epsilon=EPSILON, cutoff=CUTOFF, shift=True)
    result = dict(start_maps=maps(), max_map_count=int(open("/proc/sys/vm/max_map_count").read()),
                  sizes=[len(a) for a in atoms_list])
    for path in args.paths.split(","):
        result[path] = run(path, atoms_list, model)
    result["programs"] = programs()
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
