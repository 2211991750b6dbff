"""The compiled cell list (each rank's open-boundary neighbour search) and the threaded LJ pass.

The cell list must find exactly the pairs of the jnp bin search
(:func:`jaxdd.neighbors.build_neighbor_list` with no periodic axis), grouped by receiver in
receiver order, report every pair it could not store, and never fail on sparse or
non-finite input. Under decomposition it is the default search on CPU devices, so the
distributed suites run through it; here one distributed case runs both backends.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdd import ffi
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.models.lj import LennardJones
from jaxdd.neighbors import (NeighborCapacity, NeighborListFormat, build_neighbor_list, local_neighbor_list,
                             neighbor_capacity)
from jaxdd.data.systems import lj_melt_data

pytestmark = pytest.mark.skipif(not ffi.available(), reason="compiled kernels not built (pip install -e .)")

from jaxdd.ffi.neighbors import cell_list  # noqa: E402


def _cloud(n, box, n_systems, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, box, (n, 3)).astype(dtype)
    system = np.sort(rng.integers(0, n_systems, n)).astype(np.int32)
    mask = rng.uniform(size=n) > 0.1
    return x, system, mask


def _pairs(receivers, senders, n_edges):
    n_edges = int(n_edges)
    return set(zip(np.asarray(receivers)[:n_edges].tolist(), np.asarray(senders)[:n_edges].tolist()))


def _reference(x, system, mask, n_systems, cutoff, half, n_receivers):
    eye = np.broadcast_to(np.eye(3, dtype=x.dtype), (n_systems, 3, 3))
    pbc = np.zeros((n_systems, 3), bool)
    cap = neighbor_capacity(x, eye, pbc, system, mask, cutoff=cutoff, half=half)
    return build_neighbor_list(x, eye, pbc, system, mask, cutoff=cutoff, capacity=cap, half=half,
                               n_receivers=n_receivers), cap


@pytest.mark.parametrize("dtype, half, n_systems", [
    (np.float64, False, 1), (np.float32, True, 3),
    pytest.param(np.float64, True, 3, marks=pytest.mark.slow), pytest.param(np.float32, False, 1, marks=pytest.mark.slow)])
def test_cell_list_finds_the_pairs_of_the_bin_search(dtype, half, n_systems):
    x, system, mask = _cloud(1500, 12.0, n_systems, dtype)
    ref, cap = _reference(x, system, mask, n_systems, 3.0, half, n_receivers=1200)
    senders, receivers, shifts, count, n_edges = cell_list(x, system, mask, cutoff=3.0, max_edges=cap.max_edges,
                                                           n_receivers=1200, n_systems=n_systems, half=half)
    assert int(n_edges) == int(ref.n_edges)
    assert _pairs(receivers, senders, n_edges) == _pairs(ref.receivers, ref.senders, ref.n_edges)
    np.testing.assert_array_equal(np.asarray(count), np.asarray(ref.num_neighbors))
    assert not np.any(np.asarray(shifts))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_pairs_on_the_cutoff_sphere_in_every_direction_are_decided_by_the_distance_alone(dtype):
    # The kernel scans only the bins whose box lies within the cutoff; a pair the distance
    # test keeps must never sit in a skipped bin, whichever way it points (the diagonals are
    # where the stencil is trimmed most). Senders sit just inside and just outside the sphere.
    rng = np.random.default_rng(5)
    cutoff = 2.5
    centres = rng.uniform(4.0, 8.0, (6, 3))
    directions = rng.normal(size=(400, 3))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    radii = cutoff * (1 + np.array([-1e-6, 1e-6]))
    shells = centres[:, None, None] + radii[None, :, None, None] * directions[None, None]
    x = np.concatenate([centres, shells.reshape(-1, 3)]).astype(dtype)
    n = len(x)
    system, mask = np.zeros(n, np.int32), np.ones(n, bool)
    d = x[None, :, :] - x[:6, None, :]  # as the kernel computes it, in the positions' precision
    r2 = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
    want = {(i, j) for i, j in zip(*np.nonzero(r2 < dtype(cutoff) * dtype(cutoff))) if i != j}
    senders, receivers, _, _, n_edges = cell_list(x, system, mask, cutoff=cutoff, max_edges=len(want) + 64,
                                                  n_receivers=6)
    assert _pairs(receivers, senders, n_edges) == want
    for i in range(6):  # the test really sits on the sphere: each centre's inner shell in, its outer one out
        inner = {(i, 6 + 800 * i + k) for k in range(400)}
        outer = {(i, 6 + 800 * i + 400 + k) for k in range(400)}
        assert inner <= want and not outer & want


def test_a_pair_whose_bin_only_touches_the_cutoff_sphere_at_a_corner_is_found():
    # Bins are cubes of half the cutoff from the atoms' lowest corner (an atom at the origin
    # puts it there): each receiver sits diagonally off the bin corner (5, 5, 5) at just under
    # the cutoff, so the bin beyond that corner is within reach by 1e-7 of the cutoff only.
    cutoff = 2.5
    corner = np.full(3, 5.0)
    signs = np.array(np.meshgrid([-1, 1], [-1, 1], [-1, 1])).T.reshape(-1, 3).astype(float)
    receivers = corner - cutoff * (1 - 1e-7) * signs / np.sqrt(3)
    senders = corner + 1e-9 * signs  # each just past the corner, in the bin diagonally beyond it
    x = np.concatenate([receivers, senders, np.zeros((1, 3)), rng_fill(400)])
    n = len(x)
    got = cell_list(x, np.zeros(n, np.int32), np.ones(n, bool), cutoff=cutoff, max_edges=4096, n_receivers=8)
    pairs = _pairs(got[1], got[0], got[4])
    assert {(i, 8 + i) for i in range(8)} <= pairs
    d = x[None, :, :] - x[:8, None, :]
    r2 = (d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1]) + d[..., 2] * d[..., 2]
    assert pairs == {(i, j) for i, j in zip(*np.nonzero(r2 < cutoff * cutoff)) if i != j}


def rng_fill(n):
    """Atoms far from the corner (so that the grid keeps bins of half the cutoff)."""
    return np.random.default_rng(6).uniform(9.5, 10.0, (n, 3))


def test_a_half_list_ordered_by_keys_lists_each_pair_from_the_row_the_parity_rule_picks_in_both_searches():
    x, system, mask = _cloud(1200, 10.0, 1, np.float64)
    rng = np.random.default_rng(1)
    order = (rng.integers(0, 50, 1200).astype(np.int32), rng.permutation(1200).astype(np.int32))  # ties in key a
    eye, pbc = np.eye(3)[None], np.zeros((1, 3), bool)
    cap = neighbor_capacity(x, eye, pbc, system, mask, cutoff=2.5)
    ref = build_neighbor_list(x, eye, pbc, system, mask, cutoff=2.5, capacity=cap, half=True, order=order)
    senders, receivers, _, _, n_edges = cell_list(x, system, mask, cutoff=2.5, max_edges=cap.max_edges, half=True,
                                                  order=order)
    got = _pairs(receivers, senders, n_edges)
    assert got == _pairs(ref.receivers, ref.senders, ref.n_edges)
    f_senders, f_receivers, _, _, f_edges = cell_list(x, system, mask, cutoff=2.5, max_edges=cap.max_edges)
    full = _pairs(f_receivers, f_senders, f_edges)
    key = list(zip(*order))
    # The lower (key a, key b) lists the pair when the keys a have the same parity, else the higher.
    assert got == {(i, j) for i, j in full if (key[j] > key[i]) != bool((order[0][i] ^ order[0][j]) & 1)}
    assert full == got | {(j, i) for i, j in got} and not got & {(j, i) for i, j in got}


def test_the_half_list_rule_splits_the_pairs_between_two_ranks_about_evenly():
    # Ids that grow along x (as a lattice's do) and a cut at mid-x: with the lower id alone
    # every pair across a cut would be listed on the low-x side.
    x, system, mask = _cloud(3000, 12.0, 1, np.float64)
    mask[:] = True
    ids = np.argsort(np.argsort(x[:, 0])).astype(np.int32)
    order = (ids, np.zeros(3000, np.int32))
    senders, receivers, _, _, n_edges = cell_list(x, system, mask, cutoff=2.0, max_edges=200_000, half=True,
                                                  order=order)
    left = x[:, 0] < 6.0
    s, r = np.asarray(senders)[:int(n_edges)], np.asarray(receivers)[:int(n_edges)]
    across = left[s] != left[r]
    from_left = np.sum(across & left[r])
    assert abs(from_left / np.sum(across) - 0.5) < 0.05


def test_cell_list_edges_are_grouped_by_receiver_and_padded_past_the_last_atom():
    x, system, mask = _cloud(800, 10.0, 1, np.float64)
    senders, receivers, _, _, n_edges = cell_list(x, system, mask, cutoff=2.5, max_edges=60_000)
    r = np.asarray(receivers)
    assert np.all(np.diff(r) >= 0)
    assert np.all(r[int(n_edges):] == 800) and np.all(np.asarray(senders)[int(n_edges):] == 800)


def test_cell_list_counts_the_pairs_it_had_no_room_for():
    x, system, mask = _cloud(800, 10.0, 1, np.float64)
    senders, receivers, _, _, full = cell_list(x, system, mask, cutoff=2.5, max_edges=60_000)
    every_pair = _pairs(receivers, senders, full)
    senders, receivers, _, _, n_edges = cell_list(x, system, mask, cutoff=2.5, max_edges=1000)
    assert int(n_edges) == int(full) > 1000
    assert _pairs(receivers, senders, 1000) <= every_pair


def test_overflowing_local_list_raises_the_flag():
    x, system, mask = _cloud(800, 10.0, 1, np.float64)
    cap = NeighborCapacity(max_edges=1000, max_neighbors=4, max_candidates=1, search_range=(1, 1, 1))
    nl = local_neighbor_list(jnp.asarray(x), system, mask, n_systems=1, cutoff=2.5, capacity=cap, backend="kernel")
    assert bool(nl.overflow) and int(nl.n_edges) > 1000
    nl = local_neighbor_list(jnp.asarray(x), system, mask, n_systems=1, cutoff=2.5, capacity=cap, backend="kernel",
                             format=NeighborListFormat.MATRIX)
    assert bool(nl.overflow)


def test_matrix_rows_of_the_kernel_list_equal_those_of_the_bin_search():
    x, system, mask = _cloud(300, 7.0, 2, np.float64)
    _, cap = _reference(x, system, mask, 2, 2.5, False, None)
    args = dict(n_systems=2, cutoff=2.5, capacity=cap, format=NeighborListFormat.MATRIX)
    got = local_neighbor_list(jnp.asarray(x), system, mask, backend="kernel", **args)
    want = local_neighbor_list(jnp.asarray(x), system, mask, backend="jnp", **args)
    assert not bool(got.overflow)
    rows = lambda m: [sorted(r[r < 300].tolist()) for r in np.asarray(m)]  # noqa: E731
    assert rows(got.matrix) == rows(want.matrix)


def test_sparse_systems_and_non_finite_positions_are_searched_without_failing():
    x = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [1e5, 1e5, 1e5], [np.nan, 0.0, 0.0], [1e5, 1e5, 1e5 + 1.5]])
    system = np.zeros(5, np.int32)
    senders, receivers, _, count, n_edges = cell_list(x, system, np.ones(5, bool), cutoff=2.0, max_edges=16)
    assert _pairs(receivers, senders, n_edges) == {(0, 1), (1, 0), (2, 4), (4, 2)}
    assert int(np.asarray(count)[3]) == 0


def test_unknown_backend_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="neighbor_backend"):
        DomainConfig(2.5, neighbor_backend="cuda")


def test_distributed_energies_and_forces_are_the_same_with_either_backend():
    data = lj_melt_data(7, temperature=1.0, dtype=np.float64)
    mesh = default_mesh(jax.devices()[:2])
    out = {}
    for backend in ("kernel", "jnp"):
        dm = DistributedModel(LennardJones(1.0, 1.0, 2.5), DomainConfig(2.5, mesh=mesh, neighbor_backend=backend))
        out[backend] = dm(data)
    np.testing.assert_allclose(out["kernel"]["energy"], out["jnp"]["energy"], rtol=1e-12)
    np.testing.assert_allclose(out["kernel"]["forces"], out["jnp"]["forces"], rtol=0, atol=1e-11)


def test_threaded_lj_pass_equals_the_single_pass_over_an_unsorted_list():
    """A full list sorted by receiver is split over threads; the same edges shuffled take one
    pass. Both must give the same energies, forces and virial."""
    x, system, mask = _cloud(1500, 11.0, 1, np.float64)  # ~100k edges: several chunks
    senders, receivers, shifts, _, n_edges = cell_list(x, system, np.ones(1500, bool), cutoff=2.5, max_edges=200_000)
    assert int(n_edges) > 65_536
    edge_mask = jnp.arange(200_000) < n_edges
    cell = jnp.eye(3)[None]
    perm = np.random.default_rng(1).permutation(200_000)
    ordered = ffi.lennard_jones(x, shifts, cell, senders, receivers, edge_mask, 1.0, 1.0, cutoff=2.5)
    shuffled = ffi.lennard_jones(x, shifts[perm], cell, senders[perm], receivers[perm], edge_mask[perm], 1.0, 1.0,
                                 cutoff=2.5)
    for a, b in zip(ordered, shuffled):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-12, atol=1e-9)


def test_half_list_order_keys_are_checked_naming_what_is_wrong():
    x, system, mask = _cloud(50, 5.0, 1, np.float64)
    eye, pbc = np.eye(3)[None], np.zeros((1, 3), bool)
    cap = neighbor_capacity(x, eye, pbc, system, mask, cutoff=2.0)
    keys = (np.arange(50, dtype=np.int32), np.zeros(50, np.int32))
    with pytest.raises(ValueError, match="half=True"):
        build_neighbor_list(x, eye, pbc, system, mask, cutoff=2.0, capacity=cap, order=keys)
    with pytest.raises(ValueError, match=r"order\[1\].*\(50,\)"):
        build_neighbor_list(x, eye, pbc, system, mask, cutoff=2.0, capacity=cap, half=True, order=(keys[0], keys[1][:9]))
    with pytest.raises(ValueError, match="periodic"):
        build_neighbor_list(x, eye * 5.0, np.ones((1, 3), bool), system, mask, cutoff=2.0, capacity=cap, half=True,
                            order=keys)


@pytest.mark.skipif(not ffi.cuda_available(), reason="no CUDA device with jaxdd's CUDA kernels (see docs/gpu.md)")
@pytest.mark.parametrize("dtype, half, n_systems", [(np.float64, False, 1), (np.float32, True, 3)])
def test_cuda_cell_list_is_the_cpu_one_edge_for_edge(dtype, half, n_systems):
    """Both kernels sort each bin by atom index and scan the same bins in the same order."""
    x, system, mask = _cloud(3000, 14.0, n_systems, dtype, seed=3)
    rng = np.random.default_rng(4)
    order = (rng.integers(0, 40, 3000).astype(np.int32), rng.permutation(3000).astype(np.int32))
    args = dict(cutoff=3.0, max_edges=150_000, n_receivers=2500, n_systems=n_systems, half=half, order=order)

    def on(platform, **kw):
        put = lambda a: jax.device_put(a, jax.devices(platform)[0])  # noqa: E731
        return jax.device_get(cell_list(put(x), put(system), put(mask), **dict(args, **kw)))

    for kw in ({}, dict(max_edges=5000)):  # and with too few slots: the same count, the same first edges
        for got, want in zip(on("cuda", **kw), on("cpu", **kw)):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("backend", ["kernel", "jnp"])
def test_a_rank_list_declares_its_shifts_zero_and_they_are(backend):
    x, system, mask = _cloud(300, 7.0, 1, np.float64)
    _, cap = _reference(x, system, mask, 1, 2.5, False, None)
    nl = local_neighbor_list(jnp.asarray(x), system, mask, n_systems=1, cutoff=2.5, capacity=cap, backend=backend)
    assert nl.zero_shifts
    assert not np.any(np.asarray(nl.shifts))


def test_a_half_list_with_keys_is_sized_to_the_pairs_it_lists():
    """Rows past the receivers (a rank's ghosts) list each pair they share with a receiver on
    one side only, by the keys; sized with the same keys, the capacity is exactly what the
    list holds (headroom 1), not every receiver-ghost pair."""
    x, system, mask = _cloud(400, 9.0, 1, np.float64)
    eye, pbc = np.eye(3)[None], np.zeros((1, 3), bool)
    rng = np.random.default_rng(2)
    keys = (rng.permutation(400).astype(np.int32), rng.integers(0, 4, 400).astype(np.int32))
    cap = neighbor_capacity(x, eye, pbc, system, mask, cutoff=2.0, half=True, n_receivers=250, order=keys,
                            headroom=1.0)
    nl = build_neighbor_list(x, eye, pbc, system, mask, cutoff=2.0, capacity=cap, half=True, n_receivers=250,
                             order=keys)
    assert not bool(nl.overflow)
    assert cap.max_edges == int(nl.n_edges)
    by_rows = neighbor_capacity(x, eye, pbc, system, mask, cutoff=2.0, half=True, n_receivers=250, headroom=1.0)
    assert by_rows.max_edges > cap.max_edges  # the row rule keeps every receiver-ghost pair
