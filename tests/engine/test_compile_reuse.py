"""Differently sized structures share compiled programs, and a long-lived process keeps the
programs jaxdd holds (and the memory mappings XLA's CPU backend makes for them) bounded.

The end-to-end checks run tests/compile_reuse_worker.py in a fresh interpreter: this process
clears its caches between modules (conftest.py), and a process of its own counts only its own
mappings and compilations.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdd
from jaxdd import programs
from jaxdd.neighbors import capacity_bucket

WORKER = Path(__file__).resolve().parents[1] / "compile_reuse_worker.py"


def run_worker(*args: str, timeout: float) -> dict:
    # The worker imports the jaxdd this process imported, whatever the environment installs.
    path = [str(Path(jaxdd.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def unexpected_compiles(record: dict) -> list[int]:
    """Calls that compiled although their key already had a program (since the last drop)."""
    seen, last_release, bad = set(), record["releases_before"], []
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
        assert not programs.check()  # nothing compiled since: the mappings are not even counted
        f(np.ones(3))
        programs.MAP_FRACTION = None
        assert not programs.check() and f._cache_size() == 1  # no limit: kept
    finally:
        programs.MAP_FRACTION = fraction
        programs._TRACKED.remove(f)


# A child process compiling its own programs: in the slow set, beside the 300-structure run below,
# which checks the same sharing (and the bound on mappings) over many more sizes.
@pytest.mark.slow
def test_structures_of_different_sizes_share_programs_in_one_process():
    # Eight strained 2x2x2 argon cells with up to 3 vacancies (29 to 32 atoms), each through
    # jaxdd.compute, the ASE calculator and a DistributedModel on 4 virtual devices (the eighth
    # is the first whose compute program already served another size).
    r = run_worker("--structures", "8", "--reps", "2,2,2", "--vacancies", "0.1", timeout=600)
    assert len(set(r["sizes"])) >= 3
    for path in ("compute", "ase", "dist"):
        rec = r[path]
        assert rec["worst"] < 1e-10, path  # against ASE's Lennard-Jones
        assert not unexpected_compiles(rec), path
        assert sum(rec["new_programs"]) <= len(set(rec["keys"])) + sum(rec["regrowths"]), path
        sizes_of = {}
        for key, size in zip(rec["keys"], r["sizes"]):
            sizes_of.setdefault(key, set()).add(size)
        assert max(len(s) for s in sizes_of.values()) > 1, path  # one program served several sizes
        # A call that compiled nothing maps (almost) nothing new: a few entries for the
        # small conversions of a new atom count, against hundreds per compiled program.
        grown = np.diff(rec["maps"])[np.asarray(rec["new_programs"][1:]) == 0]
        assert grown.size and grown.max() < 40, (path, rec["maps"])


@pytest.mark.slow
def test_three_hundred_structures_in_one_process_keep_the_mappings_bounded():
    # Argon supercells of 1 to 3 cells per axis with vacancies (4 to 108 atoms, 27 cell shapes),
    # each through compute, the ASE calculator and DistributedModel, no cache cleared. Before
    # capacity buckets and the bound on held programs, such a process died: each structure
    # compiled anew, hundreds to thousands of mappings per program, against vm.max_map_count.
    r = run_worker("--structures", "300", "--max-reps", "3", timeout=3600)
    limit = r["map_limit"]
    assert limit is not None and limit <= r["max_map_count"] // 2
    for path in ("compute", "ase", "dist"):
        rec = r[path]
        assert rec["worst"] < 1e-9, path
        assert not unexpected_compiles(rec), path
        drops = rec["releases"][-1] - rec["releases_before"]
        assert sum(rec["new_programs"]) <= len(set(rec["keys"])) * (1 + drops) + sum(rec["regrowths"]), path
        # Over the limit only by what one call compiles before the next call drops programs.
        assert max(rec["maps"]) < limit + 8000, path
    for path in ("compute", "ase"):  # after the first half nearly every structure reuses a program
        new = r[path]["new_programs"]
        assert sum(new[150:]) <= sum(new[:150]) // 4, path
