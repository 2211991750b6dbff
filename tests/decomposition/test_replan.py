"""Specification of jaxdd.decomposition.replan: plan rebuilds on the devices.

A rebuild on the devices (atoms migrate over ``ppermute``, each rank plans its own halo)
must give exactly the plan the host computes from the moved atoms: the same owned rows in
the same order, the same ghosts and the same routing. What does not fit is reported, never
dropped. The systems are the halo specification's (``test_halo.CASES``).
"""

import dataclasses

import jax
import numpy as np
import pytest

from jaxdd.engine import default_mesh
from jaxdd.decomposition.halo_plan import build_halo_plan
from jaxdd.decomposition.partition import partition
from jaxdd.decomposition.replan import ReplanConfig, frame_of, replan
from jaxdd import Batch
from test_halo import CASES, case, cluster

# The default suite moves atoms of three systems (multi-hop and self images, an open axis,
# two systems in one grid); the others are in the slow set.
MOVED = ["triclinic-3x2x1-multihop", "slab-4x2x1", "batch-3x2x1",
         *(pytest.param(name, marks=pytest.mark.slow) for name in ("cube-2x2x2", "cluster-2x2x2", "empty-ranks-2x2x2"))]


def moved(batch, amplitude=0.3, seed=0):
    """Positions moved at random by about ``amplitude`` Å (real atoms only)."""
    step = np.random.default_rng(seed).normal(0.0, amplitude / np.sqrt(3), np.asarray(batch.positions).shape)
    return np.asarray(batch.positions) + np.where(np.asarray(batch.atom_mask)[:, None], step, 0.0)


def rows_of(plan, part, positions):
    """Each rank's owned rows of ``plan`` carrying ``positions`` (unwrapped), as the devices hold them."""
    n_owned = plan.layout.n_owned
    ids = plan.local_ids[:, :n_owned]
    valid = ids >= 0
    safe = np.where(valid, ids, 0)
    return dict(positions=np.where(valid[..., None], positions[safe], 0.0), ids=np.where(valid, ids, -1).astype(np.int32),
                system=np.where(valid, part.system[safe], 0).astype(np.int32),
                image=np.zeros(ids.shape + (3,), np.int32), tag=np.where(valid, 10 * ids + 7, 0))


def host(batch, positions, grid, width, capacity=None, periodic_search=False):
    part = partition(positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, int(np.prod(grid)), grid=grid)
    return part, build_halo_plan(part, width, capacity=capacity, periodic_search=periodic_search)


def rebuild(batch, rows, layout, width, n_migrate=64):
    cfg = ReplanConfig(layout=layout, n_migrate=n_migrate, n_systems=batch.n_systems, axes=("dd",))
    mesh = default_mesh(jax.devices()[: int(np.prod(layout.grid))])
    (owned, routing, held), report = replan(rows, frame_of(batch.cell, batch.pbc, width, np.float64), cfg, mesh)
    return jax.tree_util.tree_map(np.asarray, (owned, routing, held, report))


def roomy(plan, factor=2):
    """``plan``'s capacities, ``factor`` times larger."""
    return (factor * plan.layout.n_owned, tuple(factor * e.capacity for e in plan.layout.exchanges))


def assert_rebuild_equals_host_plan(batch, part, before, positions, grid, width, periodic_search=False):
    """Rebuild ``before`` on the devices with the atoms at ``positions`` and check it against
    the host plan of those positions: rows, routing, needs, each atom's data and wrap."""
    after_part, after = host(batch, positions, grid, width, capacity=roomy(before), periodic_search=periodic_search)
    rows = {k: np.concatenate([v, np.zeros((v.shape[0], after.layout.n_owned - v.shape[1]) + v.shape[2:], v.dtype)
                               - (k == "ids")], axis=1)
            for k, v in rows_of(before, part, positions).items()}
    owned, routing, held, report = rebuild(batch, rows, after.layout, width)
    assert not report["far"] and not report["hops"]
    assert report["owned"] <= after.layout.n_owned and np.all(report["exchange"] <= [e.capacity for e in after.layout.exchanges])
    np.testing.assert_array_equal(held["ids"], after.local_ids)
    for field in ("send_valid", "send_system", "wrap", "row_ids", "row_shifts"):
        np.testing.assert_array_equal(getattr(routing, field), getattr(after.routing, field))
    np.testing.assert_array_equal(np.where(routing.send_valid, routing.send_idx, 0),
                                  np.where(after.routing.send_valid, after.routing.send_idx, 0))
    assert tuple(report["exchange"]) == after.needed_exchange
    # Every atom arrives with its own data, wrapped as the host wraps it.
    ids = owned["ids"]
    valid = ids >= 0
    np.testing.assert_array_equal(owned["tag"][valid], 10 * ids[valid] + 7)
    np.testing.assert_array_equal(owned["image"][valid], after_part.wraps[ids[valid]])
    cell = np.asarray(batch.cell)
    wrapped = positions - np.einsum("vi,vij->vj", after_part.wraps, cell[after_part.system])
    np.testing.assert_allclose(owned["positions"][valid], wrapped[ids[valid]], rtol=0, atol=1e-12)
    assert report["migrated"] == int(np.sum(after_part.owner != part.owner))
    return owned, after_part


@pytest.mark.parametrize("name", MOVED)
def test_a_device_rebuild_equals_the_host_plan_of_the_moved_atoms(name):
    batch, part, before = case(name)
    _, grid, width = CASES[name]
    assert_rebuild_equals_host_plan(batch, part, before, moved(batch), grid, width)


# Two systems in one grid: the slow set (test_a_device_rebuild_equals_the_host_plan_of_the_moved_atoms
# rebuilds them in the default suite).
@pytest.mark.parametrize("name", ["triclinic-3x2x1-multihop", pytest.param("batch-3x2x1", marks=pytest.mark.slow)])
def test_a_device_rebuild_of_a_periodic_search_plan_equals_the_host_plan(name):
    """A plan with no exchange along the axes the grid leaves whole (the ranks search their
    images) is rebuilt on the devices from its own layout, as the host plans it."""
    batch, _, _ = case(name)
    _, grid, width = CASES[name]
    part, before = host(batch, np.asarray(batch.positions), grid, width, periodic_search=True)
    assert all(grid[e.axis] > 1 for e in before.layout.exchanges)
    assert_rebuild_equals_host_plan(batch, part, before, moved(batch), grid, width, periodic_search=True)


def test_exchanges_that_no_longer_fit_are_reported_with_the_sizes_that_do():
    batch, part, plan = case("cube-2x2x2")
    width = CASES["cube-2x2x2"][2]
    halved = [max(1, e.capacity // 2) for e in plan.layout.exchanges]
    tight = dataclasses.replace(plan.layout, exchanges=tuple(
        dataclasses.replace(e, offset=sum(halved[:i]), capacity=c) for i, (e, c) in enumerate(zip(plan.layout.exchanges, halved))))
    *_, report = rebuild(batch, rows_of(plan, part, np.asarray(batch.positions)), tight, width)
    # The first exchange is exact; later ones forward what the cut ones delivered, so they
    # may ask for less than they will once the first fits (the caller grows until all fit).
    assert report["exchange"][0] == plan.needed_exchange[0] > halved[0]
    assert report["owned"] == plan.needed_owned


def test_atoms_beyond_the_migration_slots_are_reported():
    batch, part, plan = case("cube-2x2x2")
    width = CASES["cube-2x2x2"][2]
    positions = moved(batch, amplitude=0.6)
    *_, report = rebuild(batch, rows_of(plan, part, positions), roomy_layout(plan), width, n_migrate=1)
    assert report["migrate"] > 1


def roomy_layout(plan):
    n_owned, caps = roomy(plan)
    return dataclasses.replace(plan.layout, n_owned=n_owned, exchanges=tuple(
        dataclasses.replace(e, offset=sum(caps[:i]), capacity=c) for i, (e, c) in enumerate(zip(plan.layout.exchanges, caps))))


def test_an_atom_more_than_one_block_away_is_reported_not_dropped():
    batch, part, plan = case("cube-8x1x1-wide-shell")
    width = CASES["cube-8x1x1-wide-shell"][2]
    positions = np.asarray(batch.positions).copy()
    cell = np.asarray(batch.cell)[0]
    positions[0] += 0.3 * cell[0]  # 2.4 blocks along x
    *_, report = rebuild(batch, rows_of(plan, part, positions), plan.layout, width)
    assert report["far"]


def test_blocks_grown_thinner_than_the_plan_hops_are_reported():
    batch = Batch.from_ase(cluster())
    part, plan = host(batch, np.asarray(batch.positions), (4, 1, 1), 2.5)
    assert max(e.hop for e in plan.layout.exchanges) == 2
    positions = np.asarray(batch.positions)
    centre = positions.mean(axis=0)
    squeezed = centre + (positions - centre) * 0.3  # the blocks of an open axis shrink with the cluster
    *_, report = rebuild(batch, rows_of(plan, part, squeezed), plan.layout, 2.5)
    assert report["hops"] and not report["far"]
