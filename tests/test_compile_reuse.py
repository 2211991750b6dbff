"""Differently sized structures share compiled programs, and a long-lived process keeps the
programs jaxdd holds (and the memory mappings XLA's CPU backend makes for them) bounded.

The end-to-end checks run tests/compile_reuse_worker.py in a fresh interpreter: this process
clears its caches between modules (conftest.py), and a process of its own counts only its own
mappings and compilations.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from ase.build import bulk

import jaxdd
from jaxdd import driver, programs
from jaxdd.models.lj import LennardJones
from jaxdd.neighbors import capacity_bucket

WORKER = Path(__file__).with_name("compile_reuse_worker.py")
LJ = LennardJones(sigma=3.4, epsilon=0.0104, cutoff=8.5, shift=True)


def run_worker(*args: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def unexpected_compiles(record: dict) -> list[int]:
    """Calls that compiled although their key already had a program (since the last drop)."""
    seen, last_release, bad = set(), 0, []
    for i, (key, new, releases, regrowths) in enumerate(
            zip(record["keys"], record["new_programs"], record["releases"], record["regrowths"])):
        if releases != last_release:  # the programs were dropped at the start of this call
            seen, last_release = set(), releases
        if key in seen and new > regrowths:
            bad.append(i)
        seen.add(key)
    return bad


def test_capacity_buckets_are_powers_of_two_and_three_halves_of_them():
    assert [capacity_bucket(n) for n in (0, 1, 8, 9, 12, 13, 17, 25, 33, 49, 97, 1000)] == \
        [8, 8, 8, 12, 12, 16, 24, 32, 48, 64, 128, 1024]
    assert capacity_bucket(3, minimum=1) == 3 and capacity_bucket(5, minimum=1) == 6
    n = np.arange(1, 5000)
    b = np.array([capacity_bucket(k) for k in n])
    assert np.all(b >= n) and np.all(np.diff(b) >= 0) and np.all(b[n >= 8] <= 1.5 * n[n >= 8])
    assert len(set(b[:200])) == 11  # 8, 12, 16, ..., 192, 256: eleven atom buckets cover 1..200 atoms


def test_compute_pads_atoms_to_the_bucket_and_cuts_every_per_atom_output_back():
    atoms = bulk("Ar", "fcc", a=5.26, cubic=True).repeat((3, 2, 2))[:-7]  # 41 atoms: rows padded to 48
    atoms.rattle(0.1, seed=3)
    data = jaxdd.AtomicData.from_ase(atoms)
    keys = ("energy", "forces", "stress", "atomic_energies")
    got = jaxdd.compute(LJ, data, keys)
    # The same program on exactly 41 rows with exactly the needed capacity: what compute ran before.
    batch = jaxdd.as_batch(data)
    cap = jaxdd.neighbor_capacity(batch.positions, batch.cell, batch.pbc, cutoff=8.5, headroom=1.0)
    exact, overflow, _ = driver._run(LJ, batch, keys, cap)
    assert not bool(overflow)
    assert got["forces"].shape == (41, 3) and got["atomic_energies"].shape == (41,)
    for k in keys:  # float64: equal to rounding (a sum over 48 rows instead of 41)
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(exact[k]), rtol=1e-14, atol=1e-15)


def test_dropping_programs_frees_them_and_waits_for_a_new_compilation():
    f = programs.track(jax.jit(lambda x: jax.numpy.cumsum(x * 2.0)))
    fraction = programs.MAP_FRACTION
    try:
        programs.MAP_FRACTION = None  # no limit: a check looks and drops nothing
        for n in (3, 4, 5):
            f(np.ones(n))
        assert not programs.check() and f._cache_size() == 3
        f(np.ones(6))  # compiled since the last check
        programs.MAP_FRACTION = 1e-6  # any process is over this
        released = programs.releases
        assert programs.check() and f._cache_size() == 0 and programs.releases == released + 1
        assert not programs.check()  # nothing compiled since the last check: nothing counted or dropped
        f(np.ones(3))
        assert programs.check() and f._cache_size() == 0  # a new program, still over the limit
    finally:
        programs.MAP_FRACTION = fraction
        programs._TRACKED.remove(f)


def test_structures_of_different_sizes_share_programs_in_one_process():
    # Six strained 2x2x2 argon cells with up to 4 vacancies (28 to 32 atoms), each through
    # jaxdd.compute, the ASE calculator and a DistributedModel on 4 virtual devices.
    r = run_worker("--structures", "6", "--reps", "2,2,2", "--vacancies", "0.125", timeout=600)
    assert len(set(r["sizes"])) >= 3
    for path in ("compute", "ase", "dist"):
        rec = r[path]
        assert rec["worst"] < 1e-10, path  # against ASE's Lennard-Jones
        assert not unexpected_compiles(rec), path
        programs_compiled = sum(rec["new_programs"]) - sum(rec["regrowths"])
        assert programs_compiled == len(set(rec["keys"])) < len(set(r["sizes"])), path
        # A call that compiled nothing maps (almost) nothing new: a few entries for the
        # small conversions of a new atom count, against hundreds per compiled program.
        grown = np.diff(rec["maps"])[np.asarray(rec["new_programs"][1:]) == 0]
        assert grown.size and grown.max() < 40, (path, rec["maps"])


@pytest.mark.slow
def test_three_hundred_structures_in_one_process_keep_the_mappings_bounded():
    # Argon supercells of 1 to 4 cells per axis with vacancies (1 to 200 atoms, many cell
    # shapes), each through compute, the ASE calculator and DistributedModel, no cache cleared.
    r = run_worker("--structures", "300", timeout=3600)
    limit = r["map_limit"]
    assert limit is not None and limit <= r["max_map_count"] // 2
    for path in ("compute", "ase", "dist"):
        rec = r[path]
        assert rec["worst"] < 1e-9, path
        assert not unexpected_compiles(rec), path
        # Over the limit only by what one call compiles before the next call drops programs.
        assert max(rec["maps"]) < limit + 8000, path
    for path in ("compute", "ase"):
        assert len(set(r[path]["keys"])) < 0.5 * len(set(r["sizes"])), path
