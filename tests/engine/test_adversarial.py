"""Adversarial geometries: distributed equals one device (and ASE), or a clear error.

Each case is a geometry a careful user can hand the library and expect exact numbers for:
atoms on the faces, edges and corners of the cell and of the rank blocks, one ulp, 1e-17 or
1e-300 away from them, exactly at the cell length, many cells outside, very skewed cells,
cells thinner than the cutoff, one-atom systems, two atoms almost on top of each other,
clusters in large boxes (most ranks empty), mixed periodic/open batches with an empty system,
huge coordinates in open space. Each is compared

* with ``jaxdd.compute`` on one device and with ASE's Lennard-Jones calculator (energy
  1e-10 relative; forces 1e-9 × max(1, |F|max); stress 1e-9 × max(1, |σ|max));
* through ``DistributedModel`` on several rank grids;
* through 24 steps of ``DomainParallel`` with a plan rebuild on the devices at almost every
  other step (a migration hysteresis of 0.05 Å), against velocity Verlet on one device (1e-9 Å);
* through a checkpoint written halfway and restored.

The default suite runs every case through ``DistributedModel`` on the uneven grid (3, 2, 1)
and the dynamics of the cases the wrap rule was written for; the slow set runs the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from pathlib import Path
from typing import Callable

import ase
import jax
import numpy as np
import pytest
from ase.build import bulk
from ase.calculators.lj import LennardJones as AseLJ
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.dynamics import DomainParallel, VelocityVerlet
from jaxdd.models.lj import LennardJones
from jaxdd.models.lj_kernel import LennardJonesKernel

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

# 24 steps of dynamics: the runs plan again on the devices at most steps (at least 10 times in
# each case's run, which the dynamics test asserts), so every case crosses the device rebuild
# many times; 50 steps crossed the same kinds of events about twice as often, at twice the cost.
CUTOFF, SKIN, DT, STEPS = 2.5, 0.3, 0.01, 24
MODEL = LennardJones(1.0, 1.0, CUTOFF, shift=True)
LATTICE = 1.6796  # fcc, the LJ melt's density
N = 3  # fcc cells per axis of the base cube (108 atoms, L = 5.04 = 2 cutoffs)
L = N * LATTICE


# ------------------------------------------------------------------ geometries


def cube(n=N, rattle=0.05, seed=0) -> ase.Atoms:
    atoms = bulk("Ar", "fcc", a=LATTICE, cubic=True).repeat(n)
    if rattle:
        atoms.positions += np.random.default_rng(seed).normal(0.0, rattle, atoms.positions.shape)
        atoms.wrap()
    atoms.set_masses(np.ones(len(atoms)))
    return atoms


def with_atom(position, base=None) -> Callable[[], ase.Atoms]:
    """The base cube with the atom nearest ``position`` (Å, cartesian; a lattice site or one of
    its periodic images) placed exactly there."""

    def make():
        atoms = cube() if base is None else base()
        target = np.asarray(position, np.float64)
        delta = atoms.positions - target
        frac = delta @ np.linalg.inv(atoms.cell.array)
        frac -= np.round(frac) * atoms.pbc  # nearest periodic image
        atoms.positions[int(np.argmin(np.linalg.norm(frac @ atoms.cell.array, axis=1)))] = target
        return atoms

    return make


def shifted(offset, base=cube) -> Callable[[], ase.Atoms]:
    """Every atom of ``base`` moved by ``offset`` (Å)."""

    def make():
        atoms = base()
        atoms.positions += np.asarray(offset, np.float64)
        return atoms

    return make


def nudged(direction, base=None) -> Callable[[], ase.Atoms]:
    """The unrattled lattice (atoms exactly on block faces) with each coordinate moved one ulp."""

    def make():
        atoms = cube(rattle=0.0) if base is None else base()
        atoms.positions = np.nextafter(atoms.positions, direction * np.inf)
        return atoms

    return make


def skewed(angle_deg, n=3) -> Callable[[], ase.Atoms]:
    """A triclinic cell whose angle between a and b is ``angle_deg``, atoms on a rattled n³
    grid spaced at least 1.1 σ apart; one atom a rounding error below the tilted face."""

    def make():
        length = n * 1.1 / (2 * math.sin(math.radians(angle_deg) / 2))
        cell = ase.geometry.cellpar_to_cell([length, length, length, 90.0, 90.0, angle_deg])
        frac = (np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3) + 0.5) / n
        frac += np.random.default_rng(3).normal(0.0, 0.01, frac.shape)
        frac[0] = [0.0, 0.5 / n, 0.5 / n]
        atoms = ase.Atoms("Ar" * len(frac), scaled_positions=frac, cell=cell, pbc=True)
        atoms.set_masses(np.ones(len(atoms)))
        atoms.positions[0] -= 1e-17 * cell[0] / length
        return atoms

    return make


def thin(thickness=1.5) -> ase.Atoms:
    """A cell thinner than the cutoff along z: atoms see their own images."""
    rng = np.random.default_rng(5)
    cell = np.diag([L, L, thickness])
    frac = rng.random((24, 3))
    atoms = ase.Atoms("Ar24", scaled_positions=frac, cell=cell, pbc=True)
    atoms.positions[0] = [0.0, 0.0, -1e-17]
    return _spread(atoms, 0.95)


def small_cell(length=2.0, n_atoms=2) -> ase.Atoms:
    """A cell smaller than the cutoff on every axis."""
    atoms = ase.Atoms("Ar" * n_atoms, scaled_positions=[[0, 0, 0], [0.5, 0.5, 0.5]][:n_atoms],
                      cell=np.diag([length] * 3), pbc=True)
    atoms.positions[0] = [-1e-17, 0.0, length]
    atoms.set_masses(np.ones(n_atoms))
    return atoms


def one_atom(pbc) -> Callable[[], ase.Atoms]:
    def make():
        atoms = ase.Atoms("Ar", positions=[[-1e-17, 0.0, 0.0]], cell=np.diag([1.4, 1.6, 3.0]), pbc=pbc)
        atoms.set_masses([1.0])
        return atoms

    return make


def close_pair() -> ase.Atoms:
    atoms = cube()
    atoms.positions[1] = atoms.positions[0] + [0.05, 0.0, 0.0]
    return atoms


def cluster(box=20.0, pbc=True, offset=(0.0, 0.0, 0.0), n=13) -> Callable[[], ase.Atoms]:
    """A small cluster in a large box: most ranks own nothing."""

    def make():
        rng = np.random.default_rng(7)
        pos = rng.normal(0.0, 1.0, (n, 3))
        atoms = ase.Atoms("Ar" * n, positions=pos, cell=np.diag([box] * 3), pbc=pbc)
        atoms = _spread(atoms, 0.95)
        atoms.positions += np.asarray(offset)
        return atoms

    return make


def slab(pbc=(True, True, False), vacuum=6.0) -> Callable[[], ase.Atoms]:
    def make():
        atoms = cube()
        atoms.cell[2, 2] += vacuum
        atoms.pbc = pbc
        atoms.positions[0] = [-1e-17, 0.0, 0.0]
        return atoms

    return make


def _spread(atoms: ase.Atoms, min_dist: float) -> ase.Atoms:
    """Drop atoms closer than ``min_dist`` to an earlier one (images included)."""
    d = atoms.get_all_distances(mic=bool(atoms.pbc.any()))
    keep = [i for i in range(len(atoms)) if all(d[i, j] >= min_dist for j in range(i))]
    atoms = atoms[keep]
    atoms.set_masses(np.ones(len(atoms)))
    return atoms


def mixed_batch() -> list:
    """A periodic cube with an atom at -1e-17, an open cluster, and an empty (padding) system."""
    return [with_atom([-1e-17, -1e-17, 0.0])(), cluster(pbc=False, box=0.0)()]


@dataclasses.dataclass(frozen=True)
class Case:
    make: Callable  # -> ase.Atoms, or a list of them (a batch)
    dynamics: bool = True  # False: forces too large for a meaningful time step
    pad_system: bool = False  # add an empty padding system to the batch


A = LATTICE
H = L / 2  # a block face of grids with 2 ranks on an axis (= 1.5 A)
T = L / 3  # and with 3 (= A)
ULP_DOWN = np.nextafter(0.0, -1.0)
# fcc sites are (i, j, k) A/2 with i + j + k even; each case puts the nearest atom exactly on
# a face, edge or corner (or just off it), at a site so that the crystal stays intact.
F = 0.5 * A  # a coordinate off every face

CASES = {
    # Faces, edges and corners of the cell.
    "cell-face-at-0": Case(with_atom([0.0, F, F])),
    "cell-face-minus-1e-17": Case(with_atom([-1e-17, F, F])),
    "cell-face-minus-1e-300": Case(with_atom([-1e-300, F, F])),
    "cell-face-plus-1e-300": Case(with_atom([1e-300, F, F])),
    "cell-face-minus-1-ulp": Case(with_atom([ULP_DOWN, F, F])),
    "cell-face-at-L": Case(with_atom([L, F, F])),
    "cell-face-L-minus-1-ulp": Case(with_atom([np.nextafter(L, 0.0), F, F])),
    "cell-face-L-plus-1-ulp": Case(with_atom([np.nextafter(L, 2 * L), F, F])),
    "cell-face-L-minus-1e-17": Case(with_atom([L - 1e-17, F, F])),
    "cell-face-minus-5e-16": Case(with_atom([-5e-16, F, F])),  # f + 1 just below 1
    "cell-edge-minus-1e-17": Case(with_atom([-1e-17, -1e-17, A])),
    "cell-edge-at-L": Case(with_atom([L, L, A])),
    "cell-corner-minus-1e-17": Case(with_atom([-1e-17, -1e-17, -1e-17])),
    "cell-corner-minus-1e-300": Case(with_atom([-1e-300, -1e-300, -1e-300])),
    "cell-corner-at-L": Case(with_atom([L, L, L])),
    "cell-corner-minus-1-ulp": Case(with_atom([ULP_DOWN] * 3)),
    # Faces, edges and corners of the blocks of (2, ., .) and (3, ., .) grids.
    "block-face-half": Case(with_atom([H, F, A])),
    "block-face-half-minus-1-ulp": Case(with_atom([np.nextafter(H, 0.0), F, A])),
    "block-face-half-plus-1-ulp": Case(with_atom([np.nextafter(H, L), F, A])),
    "block-face-half-minus-1e-17": Case(with_atom([H - 1e-17, F, A])),
    "block-face-third": Case(with_atom([T, F, F])),
    "block-face-third-minus-1-ulp": Case(with_atom([np.nextafter(T, 0.0), F, F])),
    "block-edge-third-half": Case(with_atom([T, H, F])),
    "block-corner-half": Case(with_atom([H, H, 2 * A])),
    "block-corner-half-plus-1-ulp": Case(with_atom(np.nextafter([H, H, 2 * A], L))),
    # Whole lattices on the faces (the unrattled crystal has planes on every block face).
    "lattice-on-block-faces": Case(lambda: cube(rattle=0.0)),
    "lattice-1-ulp-below-faces": Case(nudged(-1)),
    "lattice-1-ulp-above-faces": Case(nudged(+1)),
    "lattice-minus-1e-17": Case(shifted([-1e-17] * 3, base=lambda: cube(rattle=0.0))),
    # Far outside the cell.
    "atom-7-cells-outside": Case(with_atom([F + 7 * L, F, A])),
    "atom-5-cells-below": Case(with_atom([F - 5 * L, F - 5 * L, A - 5 * L])),
    "all-atoms-3-cells-out": Case(shifted([3 * L, -3 * L, 2 * L])),
    "all-atoms-1000-cells-out": Case(shifted([1000 * L, 0.0, 0.0])),
    # Cell shapes.
    "triclinic-30-degrees": Case(skewed(30.0)),
    "triclinic-20-degrees": Case(skewed(20.0)),
    "cell-thinner-than-the-cutoff": Case(thin),
    "cutoff-larger-than-the-cell": Case(small_cell),
    # Few atoms, close atoms.
    "one-atom-periodic": Case(one_atom(True)),
    "one-atom-open": Case(one_atom(False)),
    "two-atoms-0.05-apart": Case(close_pair, dynamics=False),
    # Empty ranks, open and partial boundaries.
    "cluster-in-a-large-periodic-box": Case(cluster()),
    "cluster-in-open-space": Case(cluster(pbc=False, box=0.0)),
    "cluster-at-1e6-angstrom": Case(cluster(pbc=False, box=0.0, offset=(1e6, -2e6, 3e6))),
    "slab-periodic-in-x-and-y": Case(slab()),
    "wire-periodic-in-x": Case(slab(pbc=(True, False, False))),
    "batch-periodic-open-and-empty": Case(mixed_batch, pad_system=True),
}


def atoms_of(name) -> list[ase.Atoms]:
    made = CASES[name].make()
    return made if isinstance(made, list) else [made]


def data_of(name) -> jaxdd.Batch:
    systems = atoms_of(name)
    batch = jaxdd.Batch.from_ase(systems)
    if CASES[name].pad_system:
        batch = batch.pad(batch.n_atoms + 3, batch.n_systems + 1)
    return batch


# ------------------------------------------------------------------ references


def ase_outputs(atoms: ase.Atoms) -> dict:
    atoms = atoms.copy()
    atoms.calc = AseLJ(sigma=1.0, epsilon=1.0, rc=CUTOFF, smooth=False)
    out = dict(energy=atoms.get_potential_energy(), forces=atoms.get_forces())
    if atoms.pbc.all():
        out["stress"] = atoms.get_stress(voigt=False)
    return out


def outputs_of(name) -> tuple[str, ...]:
    """Stress only where every system has a full periodic cell."""
    return ("energy", "forces", "stress") if all(a.pbc.all() for a in atoms_of(name)) else ("energy", "forces")


@functools.lru_cache(maxsize=None)
def single_device(name) -> dict:
    out = jaxdd.compute(MODEL, data_of(name), outputs_of(name))
    return {k: np.asarray(v) for k, v in out.items()}


# The worst error of each case and path, written to $JAXDD_ADVERSARIAL_REPORT (JSON) when set.
WORST: dict = {}


def record(case, path, key, error) -> None:
    if case is not None:
        entry = WORST.setdefault(case, {}).setdefault(path, {})
        entry[key] = max(entry.get(key, 0.0), float(error))


@pytest.fixture(scope="module", autouse=True)
def _report_worst_errors():
    yield
    target = os.environ.get("JAXDD_ADVERSARIAL_REPORT")
    if target and WORST:
        old = json.loads(Path(target).read_text()) if Path(target).exists() else {}
        for case, paths in WORST.items():
            for path, errors in paths.items():
                entry = old.setdefault(case, {}).setdefault(path, {})
                for key, error in errors.items():
                    entry[key] = max(entry.get(key, 0.0), error)
        Path(target).write_text(json.dumps(old, indent=1, sort_keys=True))


def assert_close(got: dict, want: dict, keys, label="", case=None, path="distributed"):
    """Energy 1e-10 relative, forces and stress 1e-9 × max(1, largest magnitude) absolute."""
    for k in keys:
        g, w = np.asarray(got[k], np.float64), np.asarray(want[k], np.float64)
        assert g.shape == w.shape, f"{label}{k}: shape {g.shape} != {w.shape}"
        scale = np.abs(w) if k == "energy" else max(1.0, float(np.abs(w).max(initial=0.0)))
        record(case, path, k, np.max(np.abs(g - w) / np.maximum(scale, 1e-300), initial=0.0))
        if k == "energy":
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-300, err_msg=f"{label}{k}")
        else:
            tol = 1e-9 * max(1.0, float(np.abs(w).max(initial=0.0)))
            np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=f"{label}{k}")


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


VARIANTS = {
    "lj": MODEL,
    "lj-half-list": LennardJones(1.0, 1.0, CUTOFF, shift=True, half_list=True),
    "lj-fused-kernel": LennardJonesKernel(1.0, 1.0, CUTOFF, shift=True, half_list=True),
}


# One DistributedModel per grid and model, shared by the cases: systems of one shape reuse
# its compiled programs.
@functools.lru_cache(maxsize=None)
def dist_model(grid, variant="lj") -> DistributedModel:
    return DistributedModel(VARIANTS[variant], DomainConfig(CUTOFF, mesh=mesh_of(math.prod(grid)), grid=grid))


DEFAULT_GRID = (3, 2, 1)
SLOW_GRIDS = [(1, 1, 1), (2, 1, 1), (2, 2, 2)]
# The default suite: the cases the wrap rule was written for, all of one shape (one program).
DEFAULT_CASES = ["cell-face-minus-1e-17", "cell-face-minus-1e-300", "cell-corner-minus-1e-17", "cell-face-at-L",
                 "block-face-half-minus-1-ulp", "lattice-minus-1e-17", "atom-7-cells-outside"]


def grid_id(grid) -> str:
    return "x".join(map(str, grid))


def cases_on(grid, variant="lj", names=None):
    """Parameters (name, grid, variant); the default cases on the default grid and plain LJ
    run by default, the others in the slow set."""
    params = []
    for name in (CASES if names is None else names):
        default = grid == DEFAULT_GRID and variant == "lj" and name in DEFAULT_CASES
        params.append(pytest.param(name, grid, variant, marks=() if default else pytest.mark.slow,
                                   id=f"{name}-{grid_id(grid)}-{variant}"))
    return params


# ------------------------------------------------------------------ one device against ASE


@pytest.mark.parametrize("name", [n if n in DEFAULT_CASES else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_single_device_equals_ase(name):
    data = data_of(name)
    got = single_device(name)
    ptr = np.asarray(data.ptr)
    for s, atoms in enumerate(atoms_of(name)):
        want = ase_outputs(atoms)
        mine = dict(energy=got["energy"][s], forces=got["forces"][ptr[s]:ptr[s + 1]])
        keys = ["energy", "forces"]
        if "stress" in want and "stress" in got:
            # ASE's stress is -virial/V with its own sign convention: jaxdd's is the same.
            mine["stress"] = got["stress"][s]
            keys.append("stress")
        assert_close(mine, want, keys, label=f"{name} system {s}: ", case=name, path="compute vs ASE")


def test_the_suite_has_at_least_forty_cases():
    assert len(CASES) >= 40


# ------------------------------------------------------------------ DistributedModel


@pytest.mark.parametrize("name, grid, variant", [
    *cases_on(DEFAULT_GRID), *(p for g in SLOW_GRIDS for p in cases_on(g)),
    *cases_on(DEFAULT_GRID, "lj-half-list"), *cases_on(DEFAULT_GRID, "lj-fused-kernel")])
def test_distributed_model_equals_one_device(name, grid, variant):
    got = dist_model(grid, variant)(data_of(name), outputs_of(name))
    assert_close(got, single_device(name), outputs_of(name), label=f"{name} on {grid} ({variant}): ", case=name,
                 path=f"DistributedModel {grid_id(grid)} {variant}")


# ------------------------------------------------------------------ dynamics


@functools.lru_cache(maxsize=None)
def reference_trajectory(name, n_steps=STEPS) -> tuple[np.ndarray, ...]:
    """Velocity Verlet on one device: positions after every step (unwrapped). Computed once
    per case: every grid's run is checked against the same trajectory."""
    data = with_velocities(data_of(name))
    pos = np.asarray(data.positions, np.float64)
    vel = np.asarray(data.velocities, np.float64)
    inv_m = 1.0 / np.asarray(data.masses, np.float64)[:, None]
    mask = np.asarray(data.atom_mask)[:, None]

    # One capacity with room for the whole run: one compiled program for every step.
    cap = jaxdd.neighbor_capacity(pos, data.cell, data.pbc, data.batch_idx, data.atom_mask, cutoff=CUTOFF,
                                  headroom=1.5)

    def forces(x):
        out = jaxdd.compute(MODEL, data.replace(positions=x), ("forces",), capacity=cap)
        return np.asarray(out["forces"])

    f = forces(pos)
    frames = []
    for _ in range(n_steps):
        vel = vel + 0.5 * DT * f * inv_m * mask
        pos = pos + DT * vel * mask
        f = forces(pos)
        vel = vel + 0.5 * DT * f * inv_m * mask
        frames.append(pos)
    return tuple(frames)


def with_velocities(batch: jaxdd.Batch) -> jaxdd.Batch:
    """Velocities of about 1 Å per time unit (0.01 Å a step): a plan rebuild almost every step."""
    rng = np.random.default_rng(11)
    vel = rng.normal(0.0, 1.0, np.asarray(batch.positions).shape) * np.asarray(batch.atom_mask)[:, None]
    return batch.replace(velocities=jax.numpy.asarray(vel), masses=jax.numpy.ones(vel.shape[0]))


@functools.lru_cache(maxsize=None)
def dynamics(grid) -> DomainParallel:
    # A hysteresis of 0.05 Å (atoms move up to 0.04 Å a step): the halo is planned on the devices at
    # almost every step, so each boundary case crosses the device rebuild many times. Capacities
    # with twice the room a fresh plan needs: with the default 1.2 many cases outgrew
    # them in their first migrations and compiled the device loop a second time, which is not
    # what these tests are about (capacity growth has its own tests); the arithmetic of the
    # atoms is the same in either, padding rows are masked.
    dm = DistributedModel(MODEL, DomainConfig(CUTOFF, skin=SKIN, migration_hysteresis=0.05, capacity_factor=2.0,
                                              mesh=mesh_of(math.prod(grid)), grid=grid))
    return DomainParallel(dm, VelocityVerlet(DT), kB=1.0)


DYNAMICS = [n for n, c in CASES.items() if c.dynamics]
# On a second grid: the cases whose geometry differs most (the others share their arithmetic).
DYNAMICS_2x2x2 = ["cell-corner-minus-1e-17", "lattice-minus-1e-17", "triclinic-30-degrees", "slab-periodic-in-x-and-y",
                  "cluster-in-a-large-periodic-box", "cell-thinner-than-the-cutoff"]


@dataclasses.dataclass(frozen=True)
class Runs:
    """A case's dynamics on one grid: the state halfway (None where no run stops there) and
    the state after STEPS steps, with the plan rebuilds of the steps taken."""
    half: object
    end: object
    rebuilds: int
    host_rebuilds: int


@functools.lru_cache(maxsize=None)
def runs(name, grid) -> Runs:
    """The STEPS steps of case ``name`` on ``grid``, run once and shared by the tests that read
    them. On the default grid they run as two halves, STEPS // 2 steps and the rest: the
    halfway state is the one the checkpoint test writes, and the second half is the
    uninterrupted run it must end on. A run boundary is no rebuild: the device loop only
    stops at the step count, and the next run goes on from the same plan. One case's runs
    follow each other on one DomainParallel, so they share its compiled programs (run
    apart, after other cases grew its capacities, they compiled programs of their own)."""
    md = dynamics(grid)
    start = md.init(with_velocities(data_of(name)))
    if grid != DEFAULT_GRID:
        end = md.run(start, STEPS)
        return Runs(None, end, md.last_run.rebuilds, md.last_run.host_rebuilds)
    half = md.run(start, STEPS // 2)
    first = md.last_run
    end = md.run(half, STEPS - STEPS // 2)
    return Runs(half, end, first.rebuilds + md.last_run.rebuilds,
                first.host_rebuilds + md.last_run.host_rebuilds)


@pytest.mark.slow
@pytest.mark.parametrize("name, grid", [pytest.param(n, g, id=f"{n}-{grid_id(g)}") for g, names in
                                        [(DEFAULT_GRID, DYNAMICS), ((2, 2, 2), DYNAMICS_2x2x2)] for n in names])
def test_steps_with_device_rebuilds_follow_the_single_device_trajectory(name, grid):
    md, run = dynamics(grid), runs(name, grid)
    assert run.rebuilds >= 10 and run.host_rebuilds <= 1, f"{run.rebuilds} rebuilds, {run.host_rebuilds} on the host"
    got = np.asarray(md.gather(run.end).positions, np.float64)
    want = reference_trajectory(name)[-1]
    mask = np.asarray(data_of(name).atom_mask)
    record(name, f"{STEPS} MD steps {grid_id(grid)}", "positions", np.abs(got[mask] - want[mask]).max())
    np.testing.assert_allclose(got[mask], want[mask], rtol=0, atol=1e-9, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("name", DYNAMICS)
def test_a_run_restored_halfway_ends_where_the_uninterrupted_run_ends(name, tmp_path):
    md, run = dynamics(DEFAULT_GRID), runs(name, DEFAULT_GRID)
    md.save(tmp_path / "ck", run.half)
    resumed = md.run(md.restore(tmp_path / "ck"), STEPS - STEPS // 2)
    straight = run.end  # run on from the same halfway state, without the checkpoint
    record(name, "restored halfway", "positions", np.abs(np.asarray(md.gather(resumed).positions)
                                                         - np.asarray(md.gather(straight).positions)).max())
    np.testing.assert_array_equal(np.asarray(md.gather(resumed).positions), np.asarray(md.gather(straight).positions))


# ------------------------------------------------------------------ a device rebuild at the face


def three_atoms() -> jaxdd.Batch:
    """A heavy atom a rounding error below x = 0 (it stays there), its partner across the
    periodic face, and a fast atom that forces plan rebuilds on the devices."""
    atoms = ase.Atoms("Ar3", positions=[[-4e-17, 6.0, 6.0], [10.8, 6.0, 6.0], [3.0, 3.0, 3.0]],
                      cell=np.diag([12.0] * 3), pbc=True)
    data = jaxdd.Batch.from_ase([atoms])
    return data.replace(masses=jax.numpy.asarray([1e30, 1.0, 1.0]),
                        velocities=jax.numpy.asarray([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 8.0, 0.0]]))


def test_a_device_rebuild_keeps_an_atom_a_rounding_error_below_the_face_where_it_is():
    data = three_atoms()
    dm = DistributedModel(MODEL, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(2), grid=(2, 1, 1)))
    md = DomainParallel(dm, VelocityVerlet(DT), kB=1.0)
    state = md.run(md.init(data), 20)
    assert md.last_run.rebuilds >= 2 and md.last_run.host_rebuilds == 0
    frame = md.gather(state)
    # Its pair across the face is still there (about -0.9 eV), and nothing sits at x = L.
    want = jaxdd.compute(MODEL, frame, ("energy", "forces"))
    assert_close(dict(energy=state.energy, forces=md.forces(state)), want, ("energy", "forces"))
    assert float(want["energy"][0]) < -0.5
    assert abs(np.asarray(frame.positions)[0, 0] + 4e-17) < 1e-30  # not at L = 12 Å


# ------------------------------------------------------------------ plans reused with another model


def melt_md(cutoff, skin=SKIN) -> DomainParallel:
    model = LennardJones(1.0, 1.0, cutoff, shift=True)
    dm = DistributedModel(model, DomainConfig(cutoff, skin=skin, mesh=mesh_of(2), grid=(2, 1, 1)))
    return DomainParallel(dm, VelocityVerlet(DT), kB=1.0)


@functools.lru_cache(maxsize=None)
def narrow_checkpoint(tmp_dir) -> str:
    """A checkpoint written by a run whose model reaches 1.6 + 0.3 Å."""
    md = melt_md(1.6)
    state = md.run(md.init(with_velocities(data_of("cell-face-minus-1e-17"))), 3)
    md.save(f"{tmp_dir}/narrow", state)
    return f"{tmp_dir}/narrow"


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):
    return narrow_checkpoint(str(tmp_path_factory.mktemp("plans")))


def test_a_checkpoint_restored_with_a_longer_ranged_model_is_planned_again_and_equals_one_device(narrow):
    md = melt_md(CUTOFF)
    state = md.restore(narrow)
    assert state.ghost_width == pytest.approx(CUTOFF + SKIN)
    want = jaxdd.compute(MODEL, md.gather(state), ("energy", "forces"))
    assert_close(dict(energy=state.energy, forces=md.forces(state)), want, ("energy", "forces"))


def test_a_state_of_a_shorter_ranged_run_is_planned_again_before_it_is_used(narrow):
    short = melt_md(1.6)
    state = short.restore(narrow)
    md = melt_md(CUTOFF)
    after = md.run(state, 2)
    assert md.last_run.host_rebuilds >= 1
    want = jaxdd.compute(MODEL, md.gather(after), ("energy", "forces"))
    assert_close(dict(energy=after.energy, forces=md.forces(after)), want, ("energy", "forces"))


def test_a_model_reaching_past_the_ghost_shell_cannot_be_swapped_in():
    dm = dist_model(DEFAULT_GRID)
    with pytest.raises(ValueError, match=r"ghost width is 2\.5 Å but LennardJones reaches 3\.2 Å"):
        dm.model = LennardJones(1.0, 1.0, 3.2)
    assert dm.model is MODEL
    dm.model = LennardJones(1.1, 1.0, CUTOFF, shift=True)  # new parameters, same reach: fine
    dm.model = MODEL


# ------------------------------------------------------------------ a sweep of boundary placements

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# The unrattled lattice has planes of atoms on the cell faces and on the block faces of 2
# and 3 ranks per axis (multiples of A/2). Each drawn atom is moved off its site, axis by
# axis, by 0, ±1 ulp, ±1e-17, ±1e-300 or whole cells, so it sits on or just beside a face.
OFFSETS = ["0", "+ulp", "-ulp", "+1e-17", "-1e-17", "+1e-300", "-1e-300", "+2L", "-3L"]


def placed(x, offset) -> float:
    if offset.endswith("ulp"):
        return float(np.nextafter(x, np.inf if offset[0] == "+" else -np.inf))
    if offset.endswith("L"):
        return x + float(offset[:-1]) * L
    return x + float(offset)


@st.composite
def placements(draw):
    """Up to three atoms, each with an offset per axis."""
    atoms = draw(st.lists(st.integers(0, 4 * N ** 3 - 1), min_size=1, max_size=3, unique=True))
    return [(i, [draw(st.sampled_from(OFFSETS)) for _ in range(3)]) for i in atoms]


@functools.lru_cache(maxsize=None)
def lattice_plan(grid):
    from test_replan import host

    batch = jaxdd.Batch.from_ase([cube(rattle=0.0)])
    part, plan = host(batch, np.asarray(batch.positions), grid, CUTOFF + SKIN)
    return batch, part, plan


@pytest.mark.slow
@settings(max_examples=25)
@given(placements())
def test_boundary_placements_agree_between_host_plan_device_rebuild_and_one_device(moves):
    from test_replan import assert_rebuild_equals_host_plan

    batch, part, plan = lattice_plan(DEFAULT_GRID)
    positions = np.asarray(batch.positions).copy()
    for i, offsets in moves:
        positions[i] = [placed(x, o) for x, o in zip(positions[i], offsets)]
    owned, after = assert_rebuild_equals_host_plan(batch, part, plan, positions, DEFAULT_GRID, CUTOFF + SKIN)
    assert np.all(np.abs(owned["positions"][owned["ids"] >= 0]) < L)  # never wrapped onto the upper face
    assert np.all((after.frac >= 0) & (after.frac < 1))
    data = batch.replace(positions=jax.numpy.asarray(positions))
    want = jaxdd.compute(MODEL, data, ("energy", "forces", "stress"))
    got = dist_model(DEFAULT_GRID)(data, ("energy", "forces", "stress"))
    assert_close(got, want, ("energy", "forces", "stress"), label=f"{moves}: ")
