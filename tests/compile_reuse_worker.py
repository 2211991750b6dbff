"""Many differently sized structures through one process, without clearing any cache.

Run by tests/engine/test_compile_reuse.py in a fresh interpreter::

    python tests/compile_reuse_worker.py --structures N [--reps 2,2,2] [--paths compute,ase,dist]

Lennard-Jones argon (cubic fcc supercells of 1 to ``--max-reps`` cells per axis, up to ``--vacancies`` of
the atoms removed, strained and rattled; at most ``--max-atoms`` atoms) is evaluated by
``jaxdd.compute`` (energy, forces, stress, atomic energies), by ``jaxdd.interop.ase.Calculator``
(energy, forces) and by a ``DistributedModel`` on 4 virtual CPU devices (energy, forces,
stress); every result is compared with ASE's own Lennard-Jones calculator, and the distributed
forces with those of ``jaxdd.compute``. Prints one JSON object with, per path and
per structure: the ``/proc/self/maps`` line count, the programs the path's jaxdd entry point
compiled, and the bucket key of the call (what its compiled program depends on); plus the
times jaxdd dropped its programs and the largest deviation from ASE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

DEVICES = 4
os.environ["JAX_NUM_CPU_DEVICES"] = str(DEVICES)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from ase import Atoms  # noqa: E402
from ase.build import bulk  # noqa: E402
from ase.calculators.lj import LennardJones as AseLJ  # noqa: E402
from ase.stress import full_3x3_to_voigt_6_stress  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd import programs
from jaxdd.engine import driver
from jaxdd.model import protocol
from jaxdd.engine import call, distributed  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402

SIGMA, EPSILON, CUTOFF = 3.4, 0.0104, 8.5


def maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def structures(n: int, max_atoms: int, vacancies: float, reps=None, max_reps: int = 4, seed: int = 0) -> list[Atoms]:
    """``n`` argon structures: cubic fcc supercells (``reps`` cells per axis, default random
    1..``max_reps``), up to a fraction ``vacancies`` of the atoms removed, strained by up to 2 %
    and rattled."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        r = tuple(int(x) for x in rng.integers(1, max_reps + 1, size=3)) if reps is None else reps
        atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat(r)
        keep = len(atoms) - int(rng.integers(0, int(vacancies * len(atoms)) + 1))
        if not 1 <= keep <= max_atoms:
            continue
        atoms = atoms[np.sort(rng.permutation(len(atoms))[:keep])]
        atoms.set_cell(atoms.cell.array @ (np.eye(3) + rng.uniform(-0.02, 0.02, (3, 3))), scale_atoms=True)
        atoms.rattle(0.05, seed=int(rng.integers(1 << 30)))
        out.append(atoms)
    return out


def deviation(atoms: Atoms, energy, forces, stress=None) -> float:
    """Largest difference from ASE's Lennard-Jones (energy relative, forces in eV/Å, stress in eV/Å³)."""
    ref = AseLJ(sigma=SIGMA, epsilon=EPSILON, rc=CUTOFF, smooth=False)
    e0 = ref.get_potential_energy(atoms)
    dev = max(abs(energy - e0) / max(1.0, abs(e0)), float(np.max(np.abs(forces - ref.get_forces(atoms)))))
    return dev if stress is None else max(dev, float(np.max(np.abs(stress - ref.get_stress(atoms)))))


def compute_key(data, capacity=None):
    """What a ``jaxdd.compute`` program depends on here: the atom rows and the neighbour capacity."""
    batch = jaxdd.as_batch(data)
    batch = protocol.pad_atoms(batch, protocol.bucketed_atoms(batch))
    if capacity is None:
        capacity = driver.program_capacity(jaxdd.neighbor_capacity(
            batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, cutoff=CUTOFF, headroom=1.0),
            LennardJones(cutoff=CUTOFF).model_config.neighbor_config)
    return hash((batch.n_atoms, capacity))


def run(path: str, atoms_list, model, single: list) -> dict:
    """Evaluate every structure along ``path``; ``single`` collects jaxdd.compute's forces (the
    compute path) that the distributed path's forces are then compared with as arrays."""
    held = driver._run._cached._cache_size if path != "dist" else call.run_program._cached._cache_size
    if path == "dist":
        mesh = distributed.default_mesh(jax.devices()[:DEVICES])
        dist = jaxdd.DistributedModel(model, jaxdd.DomainConfig(CUTOFF, mesh=mesh))
    calc = jaxdd.interop.ase.Calculator(model) if path == "ase" else None
    record = dict(maps=[], new_programs=[], keys=[], releases=[], regrowths=[], worst=0.0,
                  releases_before=programs.releases)
    for i, atoms in enumerate(atoms_list):
        before, releases = held(), programs.releases
        data = jaxdd.AtomicData.from_ase(atoms)
        if path == "ase":
            a = atoms.copy()
            a.calc = calc
            forces = a.get_forces()  # energy and forces in one evaluation
            record["worst"] = max(record["worst"], deviation(atoms, a.get_potential_energy(), forces))
            key = compute_key(data, calc._capacity)
        else:
            if path == "compute":
                out = jaxdd.compute(model, data, ("energy", "forces", "stress", "atomic_energies"))
                key = compute_key(data)
                # Per-atom outputs are cut back from the padded rows.
                assert out["atomic_energies"].shape == (len(atoms),)
                assert abs(float(out["atomic_energies"].sum()) - float(out["energy"][0])) < 1e-12
                single.append(out["forces"])
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # small cells: every rank holds every atom
                    out = dist(data, ("energy", "forces", "stress"))
                key = hash((dist.last_program.key, jaxdd.neighbors.capacity_bucket(len(atoms))))
                if single:  # arrays of the two paths combine, as arrays of one call do
                    assert float(jax.numpy.max(jax.numpy.abs(out["forces"] - single[i]))) < 1e-10
            forces = np.asarray(out["forces"])
            assert forces.shape == (len(atoms), 3)
            stress = full_3x3_to_voigt_6_stress(np.asarray(out["stress"][0]))
            record["worst"] = max(record["worst"], deviation(atoms, float(out["energy"][0]), forces, stress))
        dropped = programs.releases != releases
        record["new_programs"].append(held() - (0 if dropped else before))
        record["releases"].append(programs.releases)
        record["regrowths"].append(dist.health.recompiles if path == "dist" else 0)
        record["keys"].append(key)
        record["maps"].append(maps())
    return record


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--structures", type=int, default=300)
    ap.add_argument("--max-atoms", type=int, default=200)
    ap.add_argument("--vacancies", type=float, default=0.1, help="largest fraction of atoms removed")
    ap.add_argument("--reps", default=None, help="cells per axis, e.g. 2,2,2 (default: random 1..max-reps)")
    ap.add_argument("--max-reps", type=int, default=4)
    ap.add_argument("--paths", default="compute,ase,dist")
    ap.add_argument("--map-fraction", type=float, default=None, help="jaxdd.programs.MAP_FRACTION to use")
    args = ap.parse_args(argv)
    if args.map_fraction is not None:
        programs.MAP_FRACTION = args.map_fraction
    reps = None if args.reps is None else tuple(int(r) for r in args.reps.split(","))
    atoms_list = structures(args.structures, args.max_atoms, args.vacancies, reps, args.max_reps)
    model = LennardJones(sigma=SIGMA, epsilon=EPSILON, cutoff=CUTOFF, shift=True)
    with open("/proc/sys/vm/max_map_count") as f:
        result = dict(start_maps=maps(), max_map_count=int(f.read()), map_limit=programs.map_limit(),
                      sizes=[len(a) for a in atoms_list])
    single = []
    for path in args.paths.split(","):
        result[path] = run(path, atoms_list, model, single)
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
