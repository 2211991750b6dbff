"""Specification of load balancing: ``DomainConfig(balance="static" | "dynamic")``.

A balanced partition cuts each axis where the blocks hold equal shares of the atoms
(planes across the whole system, so blocks still form a grid); the halo plans, the device
rebuilds and migration work on the uneven blocks, and the results equal one device.

Systems (LJ reduced units, cutoff 2.5, skin 0.3): a film with its upper 60 % vacuum along
a periodic z (where equal slices leave half the ranks empty), the same film as a
(T, T, F) slab, and a drop in a periodic box.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.data import as_batch
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.dynamics import DomainParallel, VelocityVerlet
from jaxdd.decomposition.halo_plan import build_halo_plan
from jaxdd.decomposition.partition import balanced_cuts, partition
from jaxdd.decomposition.replan import ReplanConfig, frame_of, replan
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import lj_droplet, lj_slab

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

MODEL = LennardJones(1.0, 1.0, 2.5, shift=True, skin=0.3)


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def system(name):
    atoms = {"film": lambda: lj_slab((4, 4, 3), pbc=(True, True, True), temperature=0.8, seed=5),
             "slab": lambda: lj_slab((4, 4, 3), temperature=0.8, seed=5),
             "drop": lambda: lj_droplet(6.0, 16.0, temperature=0.8, seed=6, centre=(0.3, 0.35, 0.4))}[name]()
    return jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)


def parts(name, grid, balance):
    b = as_batch(system(name))
    return b, partition(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, math.prod(grid), grid=grid,
                        balance=balance)


# ----------------------------------------------------------------------------- the partition


@pytest.mark.parametrize("name", ["film", "drop"])
def test_balanced_blocks_hold_equal_shares(name):
    _, even = parts(name, (2, 2, 2), False)
    _, balanced = parts(name, (2, 2, 2), True)
    assert balanced.imbalance() <= 1.10 < even.imbalance()


def test_cuts_lie_between_atoms_and_rise_from_zero_to_one():
    _, part = parts("film", (3, 2, 1), True)
    assert part.cuts.shape == (1, 3, 4)
    np.testing.assert_array_equal(part.cuts[0, :, 0], 0.0)
    np.testing.assert_array_equal(part.cuts[0, 0, 3], 1.0)
    assert np.all(np.diff(part.cuts[0, 0]) > 0)
    rel = (part.frac[:, 0] - part.lo[0, 0]) / (part.hi[0, 0] - part.lo[0, 0])
    assert not np.any(np.isin(rel, part.cuts[0, 0, 1:3]))


def test_weights_move_the_cuts_toward_the_costly_atoms():
    b, part = parts("film", (1, 1, 2), True)
    heavy = np.where(part.frac[:, 2] > np.median(part.frac[:, 2]), 3.0, 1.0)
    weighted = balanced_cuts(part.frac, part.lo, part.hi, part.system, np.asarray(b.atom_mask), (1, 1, 2), heavy)
    assert weighted[0, 2, 1] > part.cuts[0, 2, 1]


def test_cuts_that_do_not_rise_are_refused():
    b = as_batch(system("film"))
    bad = np.array([[0.0, 0.6, 0.4, 1.0]] * 3)
    with pytest.raises(ValueError, match="cuts along axis 0 must rise from 0 to 1"):
        partition(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, 3, grid=(3, 1, 1), cuts=bad)


def test_balancing_node_blocks_is_refused_even_when_the_spec_chooses_them():
    from jaxdd.spec import SPEC_MPNN_GP
    from jaxdd.models.mpnn import SchNet

    with pytest.raises(ValueError, match="graph-parallel strategy.*leave balance=None"):
        DistributedModel(SchNet((18,), 5.0), DomainConfig(5.0, mesh=mesh_of(2), balance="static"), spec=SPEC_MPNN_GP)


def test_a_bad_balance_setting_is_refused():
    with pytest.raises(ValueError, match="DomainConfig.balance must be None, 'static' or 'dynamic'"):
        DomainConfig(2.5, balance="shift")


# ----------------------------------------------------------------------------- device rebuilds


@pytest.mark.parametrize("name, grid", [("film", (2, 2, 2)), ("slab", (3, 2, 1)), ("drop", (2, 2, 2))])
def test_a_device_rebuild_on_balanced_blocks_equals_the_host_plan(name, grid):
    b, before = parts(name, grid, True)
    width = 2.8
    plan = build_halo_plan(before, width)
    rng = np.random.default_rng(1)
    positions = np.asarray(b.positions) + rng.normal(0, 0.1, np.asarray(b.positions).shape)
    after_part = partition(positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, math.prod(grid), grid=grid,
                           cuts=before.cuts)
    capacity = (2 * plan.layout.n_owned, tuple(2 * e.capacity for e in plan.layout.exchanges))
    after = build_halo_plan(after_part, width, capacity=capacity)
    n_owned = plan.layout.n_owned
    ids = plan.local_ids[:, :n_owned]
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    pad = after.layout.n_owned - n_owned
    rows = dict(positions=np.where(valid[..., None], positions[safe], 0.0), ids=np.where(valid, ids, -1),
                system=np.zeros_like(ids), image=np.zeros(ids.shape + (3,), np.int32))
    rows = {k: np.concatenate([v, np.full((v.shape[0], pad) + v.shape[2:], -1 if k == "ids" else 0, v.dtype)], 1)
            .astype(np.int32 if k != "positions" else np.float64) for k, v in rows.items()}
    cfg = ReplanConfig(layout=after.layout, n_migrate=64, n_systems=1, axes=("dd",))
    frame = frame_of(b.cell, b.pbc, width, np.float64, cuts=before.cuts)
    (owned, routing, held), report = jax.tree_util.tree_map(
        np.asarray, replan(rows, frame, cfg, mesh_of(math.prod(grid))))
    assert not report["far"] and not report["hops"]
    np.testing.assert_array_equal(held["ids"], after.local_ids)
    np.testing.assert_array_equal(routing.row_shifts, after.routing.row_shifts)
    assert report["migrated"] == int(np.sum(after_part.owner != before.owner)) > 0


# ----------------------------------------------------------------------------- results


# The film on (2, 2, 2) is in the slow set: balanced film blocks follow one device through
# the dynamics below (test_dynamic_balancing_follows_one_device, the restart).
@pytest.mark.parametrize("name, grid", [pytest.param("film", (2, 2, 2), marks=pytest.mark.slow), ("drop", (3, 2, 1)),
                                        pytest.param("slab", (2, 2, 2), marks=pytest.mark.slow)])
def test_a_balanced_distributed_model_equals_one_device(name, grid):
    dm = DistributedModel(MODEL, DomainConfig(2.5, skin=0.3, mesh=mesh_of(math.prod(grid)), grid=grid,
                                              balance="static"))
    out = dm(system(name), ("energy", "forces", "stress"))
    ref = jaxdd.compute(MODEL, system(name), ("energy", "forces", "stress"))
    np.testing.assert_allclose(out["energy"], ref["energy"], rtol=1e-10)
    np.testing.assert_allclose(out["forces"], ref["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(out["stress"], ref["stress"], rtol=0, atol=1e-9)
    assert dm.health.imbalance <= 1.10


# Capacities with room to spare (the default headroom is 1.2): the runs below keep one layout
# through their rebalancing and rebuilds instead of growing it (each growth compiles the device
# loop and the device rebuild again); growth itself is specified in test_dynamics and test_replan.
ROOMY = 2.0


@functools.lru_cache(maxsize=None)
def md_run(grid, balance, n_steps=200):
    dm = DistributedModel(MODEL, DomainConfig(2.5, skin=0.3, mesh=mesh_of(math.prod(grid)), grid=grid,
                                              balance=balance, capacity_factor=ROOMY,
                                              balance_every=25 if balance == "dynamic" else None))
    md = DomainParallel(dm, VelocityVerlet(0.005), kB=1.0)
    state = md.run(md.init(system("film")), n_steps)
    return np.asarray(md.gather(state).positions), md.last_run


@pytest.mark.slow  # by default balanced blocks are checked by a restart and by a device rebuild below
def test_dynamic_balancing_follows_one_device():
    positions, stats = md_run((2, 2, 2), "dynamic", 50)
    reference, _ = md_run((1, 1, 1), None, 50)
    np.testing.assert_allclose(positions, reference, rtol=0, atol=1e-9)
    assert stats.rebalances == 2 and stats.rebuilds > stats.rebalances  # device rebuilds in between


@pytest.mark.slow
def test_static_balancing_follows_one_device_on_an_uneven_grid():
    positions, stats = md_run((3, 2, 1), "static")
    reference, _ = md_run((1, 1, 1), None)
    np.testing.assert_allclose(positions, reference, rtol=0, atol=1e-9)
    assert stats.rebalances == 0


@pytest.mark.slow
def test_a_balanced_run_restarts_where_it_left_off(tmp_path):
    # To rounding here: the restarted run and the straight one execute different programs (the
    # restore places the atoms afresh), and the elemental emitters the suite compiles with to save
    # time (tests/conftest.py) may fuse them an ulp apart. Bit for bit: the test below. Both are in
    # the slow set (the default suite restarts unbalanced runs: tests/dynamics/test_dynamics.py).
    resumed, straight = restarted_and_straight(tmp_path)
    np.testing.assert_allclose(resumed, straight, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_a_balanced_run_restarts_bit_for_bit(tmp_path):
    # In a process that compiles as a user's does (XLA's default CPU code generation), where the
    # two programs round alike.
    from conftest import SPEED_FLAGS

    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if f not in SPEED_FLAGS)
    code = ("import jax, numpy as np; jax.config.update('jax_enable_x64', True)\n"
            f"import test_balance; np.testing.assert_array_equal(*test_balance.restarted_and_straight({str(tmp_path)!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def restarted_and_straight(folder) -> tuple[np.ndarray, np.ndarray]:
    """Positions after 10 steps + save + restore + 10 steps, and after 20 steps straight (static
    balance on (2, 2, 2), the film)."""
    from pathlib import Path

    def fresh():
        dm = DistributedModel(MODEL, DomainConfig(2.5, skin=0.3, mesh=mesh_of(8), grid=(2, 2, 2), balance="static",
                                                  capacity_factor=ROOMY))
        return DomainParallel(dm, VelocityVerlet(0.005), kB=1.0)

    md = fresh()
    straight = md.run(md.init(system("film")), 20)
    md.save(Path(folder) / "ck", md.run(md.init(system("film")), 10))
    again = fresh()
    resumed = again.run(again.restore(Path(folder) / "ck"), 10)
    return np.asarray(again.gather(resumed).positions), np.asarray(md.gather(straight).positions)


def test_pair_weights_are_each_atoms_neighbour_count_plus_one():
    from ase.neighborlist import neighbor_list

    dm = DistributedModel(MODEL, DomainConfig(2.5, skin=0.3, mesh=mesh_of(8), grid=(2, 2, 2), balance="static",
                                              balance_by="pairs"))
    md = DomainParallel(dm, VelocityVerlet(0.005), kB=1.0)
    state = md.init(system("drop"))
    atoms = lj_droplet(6.0, 16.0, temperature=0.8, seed=6, centre=(0.3, 0.35, 0.4))
    expected = 1 + np.bincount(neighbor_list("i", atoms, 2.5 + 0.3), minlength=len(atoms))  # the model's list range
    np.testing.assert_array_equal(md.pair_weights(state), expected)


# In the slow set: the default suite specifies the pair weights (test_pair_weights_...), the cuts
# weights move (test_weights_move_the_cuts_...) and dynamic balancing under dynamics (by atoms).
@pytest.mark.slow
def test_balancing_by_pairs_follows_one_device():
    dm = DistributedModel(MODEL, DomainConfig(2.5, skin=0.3, mesh=mesh_of(8), grid=(2, 2, 2), balance="dynamic",
                                              balance_by="pairs", balance_every=50))
    md = DomainParallel(dm, VelocityVerlet(0.005), kB=1.0)
    state = md.run(md.init(system("film")), 200)
    reference, _ = md_run((1, 1, 1), None)
    np.testing.assert_allclose(np.asarray(md.gather(state).positions), reference, rtol=0, atol=1e-9)
    assert md.last_run.rebalances == 4


def test_balancing_by_something_else_is_refused():
    with pytest.raises(ValueError, match="DomainConfig.balance_by must be 'atoms' or 'pairs'"):
        DomainConfig(2.5, balance="static", balance_by="time")
