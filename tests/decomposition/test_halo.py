"""Specification of jaxdd.decomposition.halo: ghost-shell plans and the two halo exchanges.

Plans are checked on the host against a brute-force enumeration of every periodic image;
the exchanges run inside ``jax.shard_map`` over a mesh of virtual CPU devices, one rank
per device, and are compared with the plan's host-side bookkeeping
(``HaloPlan.local_ids`` / ``local_shifts``).
"""

import contextlib
import functools
import signal

import ase
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from scipy.optimize import lsq_linear

from jaxdd import Batch
from jaxdd.engine import default_mesh
from jaxdd.decomposition.halo import HaloLayout, halo_forward, halo_reverse
from jaxdd.decomposition.halo_plan import build_halo_plan, build_rank_plans
from jaxdd.decomposition.partition import partition
from jaxdd.data.systems import fcc_lattice

LATTICE = 1.6796
GHOST_WIDTH = 2.5
SHEAR = np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [-0.1, 0.1, 1.0]])
AXIS = "dd"


# ----------------------------------------------------------------------------- systems


def rattled(atoms, seed, amplitude=0.05):
    atoms.rattle(amplitude, seed=seed)
    return atoms


def cube(n_cells=4, seed=1):
    return rattled(fcc_lattice(n_cells, LATTICE), seed)


def triclinic(n_cells=4, seed=2):
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.set_cell(atoms.cell.array @ SHEAR, scale_atoms=True)
    return rattled(atoms, seed, 0.03)


def slab():
    atoms = fcc_lattice((4, 4, 3), LATTICE)
    cell = atoms.cell.array.copy()
    cell[2, 2] += 10.0
    atoms.set_cell(cell)
    atoms.pbc = (True, True, False)
    return rattled(atoms, 3)


def cluster():
    atoms = rattled(fcc_lattice(4, LATTICE), 4)
    atoms.rotate(30, "z")  # lattice planes oblique to the cuts
    atoms.rotate(20, "x")
    return ase.Atoms(atoms.symbols, positions=atoms.positions + 3.0, cell=np.zeros((3, 3)), pbc=False)


def corner_of_a_box():
    """A 32-atom crystallite in one corner of a periodic 16 Å box: most blocks are empty."""
    atoms = cube(2, seed=7)
    return ase.Atoms(atoms.symbols, positions=atoms.positions + 0.5, cell=np.eye(3) * 16.0, pbc=True)


# name: (systems, grid, ghost width)
CASES = {
    "cube-2x2x2": (lambda: [cube()], (2, 2, 2), GHOST_WIDTH),
    "triclinic-3x2x1-multihop": (lambda: [triclinic()], (3, 2, 1), GHOST_WIDTH),
    "small-cell-2x1x1-self-images": (lambda: [cube(2)], (2, 1, 1), GHOST_WIDTH),
    "thin-cell-1x1x1-several-images": (lambda: [cube((2, 1, 1))], (1, 1, 1), GHOST_WIDTH),
    "cube-8x1x1-wide-shell": (lambda: [cube()], (8, 1, 1), 3.5),
    "slab-4x2x1": (lambda: [slab()], (4, 2, 1), GHOST_WIDTH),
    "cluster-2x2x2": (lambda: [cluster()], (2, 2, 2), GHOST_WIDTH),
    "batch-3x2x1": (lambda: [cube(3), triclinic(2)], (3, 2, 1), GHOST_WIDTH),
    "empty-ranks-2x2x2": (lambda: [corner_of_a_box()], (2, 2, 2), GHOST_WIDTH),
}


@functools.lru_cache(maxsize=None)
def case(name):
    """(batch, partition, plan) of a named case (built once)."""
    make, grid, width = CASES[name]
    batch = Batch.from_ase(make())
    part = partition(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                     int(np.prod(grid)), grid=grid)
    return batch, part, build_halo_plan(part, width)


def wrapped_positions(batch, part):
    cell = np.asarray(batch.cell)
    return np.asarray(batch.positions) - np.einsum("vi,vij->vj", part.wraps, cell[part.system])


def host_local_positions(batch, part, plan):
    """Positions every local row should hold: the owner's wrapped position plus the row's shift."""
    cell = np.asarray(batch.cell)
    ids = plan.local_ids
    safe = np.where(ids >= 0, ids, 0)
    pos = wrapped_positions(batch, part)[safe] + np.einsum("pli,plij->plj", plan.local_shifts, cell[part.system[safe]])
    return np.where((ids >= 0)[..., None], pos, 0.0)


# ----------------------------------------------------------------------------- brute force


def frame_cell(cell, pbc):
    """Rows of the partition frame: lattice vectors on periodic axes, unit normals on open ones."""
    if pbc.all():
        return cell
    if not pbc.any():
        return np.eye(3)
    assert pbc.tolist() == [True, True, False], "only slabs open along z are used here"
    normal = np.cross(cell[0], cell[1])
    return np.stack([cell[0], cell[1], normal / np.linalg.norm(normal)])


def candidate_images(batch, part, rank, width):
    """Every periodic image (atom, shift) whose perpendicular distance to ``rank``'s block is
    at most ``width`` on each axis, with that distance; computed from all images by brute force."""
    cell = np.asarray(batch.cell)
    pbc = np.asarray(batch.pbc)
    wrapped = wrapped_positions(batch, part)
    lo, hi = part.bounds(rank)
    found = {}
    for s in range(batch.n_systems):
        frame = frame_cell(cell[s], pbc[s])
        inv = np.linalg.inv(frame)
        spacing = 1.0 / np.linalg.norm(inv, axis=0)  # distance between planes g_a = const, per unit of g_a
        atoms = np.flatnonzero(np.asarray(batch.atom_mask) & (part.system == s))
        reach = [int(np.ceil(width / spacing[a])) + 1 if pbc[s, a] else 0 for a in range(3)]
        shifts = np.stack(np.meshgrid(*(np.arange(-k, k + 1) for k in reach), indexing="ij"), -1).reshape(-1, 3)
        images = wrapped[atoms][:, None, :] + (shifts @ cell[s])[None]  # [n, k, 3]
        g = images @ inv
        outside = np.maximum(np.maximum(lo[s] - g, g - hi[s]), 0.0) * spacing
        for i, k in zip(*np.nonzero(np.all(outside <= width + 1e-9, axis=-1))):
            found[(int(atoms[i]), tuple(int(x) for x in shifts[k]))] = (images[i, k], frame, lo[s], hi[s])
    return found


def euclidean_distance_to_block(point, frame, lo, hi):
    """Exact distance from a point to the parallelepiped {g @ frame : lo <= g <= hi}."""
    result = lsq_linear(frame.T, point, bounds=(lo, hi), method="bvls")
    return float(np.linalg.norm(frame.T @ result.x - point))


def held_images(plan, rank):
    ids, shifts = plan.local_ids[rank], plan.local_shifts[rank]
    return [(int(i), tuple(int(x) for x in s)) for i, s in zip(ids, shifts) if i >= 0]


# ----------------------------------------------------------------------------- plans (host)


@pytest.mark.parametrize("name", list(CASES))
def test_a_rank_planned_alone_holds_and_sends_what_the_whole_plan_gives_it(name):
    _, part, whole = case(name)
    width = CASES[name][2]
    capacity = (whole.layout.n_owned, tuple(e.capacity for e in whole.layout.exchanges))
    for rank in range(part.n_ranks):
        alone = build_rank_plans(part, width, [rank], capacity=capacity)
        assert alone.ranks == (rank,) and alone.layout == whole.layout
        np.testing.assert_array_equal(alone.local_ids[0], whole.local_ids[rank])
        np.testing.assert_array_equal(alone.local_shifts[0], whole.local_shifts[rank])
        for field in ("send_idx", "send_valid", "send_system", "wrap", "row_ids", "row_shifts"):
            np.testing.assert_array_equal(getattr(alone.routing, field)[0], getattr(whole.routing, field)[rank])


@pytest.mark.parametrize("name", list(CASES))
def test_ranks_planned_apart_agree_on_the_whole_plan_sizes_by_their_maxima(name):
    _, part, whole = case(name)
    apart = [build_rank_plans(part, CASES[name][2], [rank]) for rank in range(part.n_ranks)]
    assert all(p.needed_owned == whole.needed_owned for p in apart)
    assert tuple(max(n) for n in zip(*(p.needed_exchange for p in apart))) == whole.needed_exchange


@pytest.mark.parametrize("name", list(CASES))
def test_every_image_within_the_ghost_width_of_a_block_is_held_by_that_rank(name):
    batch, part, plan = case(name)
    width = CASES[name][2]
    for rank in range(part.n_ranks):
        held = set(held_images(plan, rank))
        for key, (point, frame, lo, hi) in candidate_images(batch, part, rank, width).items():
            if key in held:
                continue
            distance = euclidean_distance_to_block(point, frame, lo, hi)
            assert distance > width - 1e-9, f"rank {rank} misses image {key} at {distance:.6f} Å"


@pytest.mark.parametrize("name", list(CASES))
def test_every_ghost_row_lies_within_the_ghost_width_of_its_rank_block(name):
    batch, part, plan = case(name)
    width = CASES[name][2]
    for rank in range(part.n_ranks):
        near = candidate_images(batch, part, rank, width)
        ghosts = held_images(plan, rank)[plan.owned_counts()[rank]:]
        far = [key for key in ghosts if key not in near]
        assert not far, f"rank {rank} holds ghosts beyond {width} Å of its block: {far[:5]}"


@pytest.mark.parametrize("name", list(CASES))
def test_no_rank_holds_the_same_image_twice(name):
    _, part, plan = case(name)
    for rank in range(part.n_ranks):
        held = held_images(plan, rank)
        assert len(held) == len(set(held))


@pytest.mark.parametrize("name", list(CASES))
def test_owned_rows_come_first_and_hold_exactly_the_rank_atoms(name):
    _, part, plan = case(name)
    n_owned = plan.layout.n_owned
    for rank in range(part.n_ranks):
        owned = plan.local_ids[rank, :n_owned]
        np.testing.assert_array_equal(owned[owned >= 0], np.flatnonzero(part.owner == rank))
        assert np.all(owned[len(np.flatnonzero(part.owner == rank)):] == -1)
        assert np.all(plan.local_shifts[rank, :n_owned] == 0)


def test_a_shell_wider_than_a_block_takes_several_hops():
    _, part, plan = case("cube-8x1x1-wide-shell")
    block = LATTICE * 4 / 8  # 0.84 Å along x; a 3.5 Å shell spans 5 blocks (4.2)
    hops = int(np.ceil(CASES["cube-8x1x1-wide-shell"][2] / block))
    assert hops == 5
    x_hops = sorted((e.direction, e.hop) for e in plan.layout.exchanges if e.axis == 0)
    assert x_hops == sorted((d, h) for d in (1, -1) for h in range(1, hops + 1))


def test_a_cell_thinner_than_the_shell_yields_images_of_the_rank_own_atoms():
    batch, part, plan = case("thin-cell-1x1x1-several-images")
    ghosts = plan.local_ids[0, plan.layout.n_owned:]
    ghosts = ghosts[ghosts >= 0]
    assert ghosts.size > 0
    assert set(ghosts.tolist()) == set(range(batch.n_atoms))
    # Along x (3.4 Å) a 2.5 Å shell needs one image on each side; along y and z (1.7 Å), two.
    shifts = plan.local_shifts[0][plan.local_ids[0] >= 0]
    assert np.abs(shifts).max(axis=0).tolist() == [1, 2, 2]


def test_open_axes_exchange_nothing_across_the_boundary():
    _, part, plan = case("cluster-2x2x2")
    for ex in plan.layout.exchanges:
        assert len(ex.pairs) == 4  # of the 8 ranks, only those with a neighbour on that side send
    assert np.all(np.asarray(plan.routing.wrap) == 0)
    assert np.all(plan.local_shifts == 0)


# Grids that leave a periodic axis whole: the ranks search its images themselves.
SEARCHED = ["triclinic-3x2x1-multihop", "small-cell-2x1x1-self-images", "cube-8x1x1-wide-shell", "batch-3x2x1"]


@functools.lru_cache(maxsize=None)
def searched_plan(name):
    _, part, _ = case(name)
    return build_halo_plan(part, CASES[name][2], periodic_search=True)


@pytest.mark.parametrize("name", SEARCHED)
def test_a_periodic_search_plan_exchanges_nothing_along_the_axes_the_grid_leaves_whole(name):
    _, part, plan = case(name)
    whole = np.asarray(part.grid) == 1
    searched = searched_plan(name)
    assert {e.axis for e in searched.layout.exchanges} == {e.axis for e in plan.layout.exchanges} - set(np.flatnonzero(whole))
    assert np.all(searched.local_shifts[..., whole] == 0)
    assert np.all(searched.ghost_counts() < plan.ghost_counts())


@pytest.mark.parametrize("name", SEARCHED)
def test_a_periodic_search_plan_holds_every_image_its_search_cannot_reach(name):
    """The search adds lattice shifts along the whole axes to the rows held; every image
    within the ghost width of a block must be a held row plus such a shift."""
    batch, part, _ = case(name)
    width = CASES[name][2]
    plan = searched_plan(name)
    whole = np.asarray(part.grid) == 1
    for rank in range(part.n_ranks):
        held = set(held_images(plan, rank))
        for (atom, shift), (point, frame, lo, hi) in candidate_images(batch, part, rank, width).items():
            if (atom, tuple(0 if w else k for w, k in zip(whole, shift))) in held:
                continue
            distance = euclidean_distance_to_block(point, frame, lo, hi)
            assert distance > width - 1e-9, f"rank {rank} misses image {(atom, shift)} at {distance:.6f} Å"


@pytest.mark.parametrize("name", SEARCHED)
def test_a_rank_planned_alone_with_periodic_search_holds_what_the_whole_plan_gives_it(name):
    _, part, _ = case(name)
    whole = searched_plan(name)
    capacity = (whole.layout.n_owned, tuple(e.capacity for e in whole.layout.exchanges))
    for rank in range(part.n_ranks):
        alone = build_rank_plans(part, CASES[name][2], [rank], capacity=capacity, periodic_search=True)
        assert alone.layout == whole.layout
        np.testing.assert_array_equal(alone.local_ids[0], whole.local_ids[rank])
        np.testing.assert_array_equal(alone.routing.send_idx[0], whole.routing.send_idx[rank])


def test_too_small_capacities_are_flagged_with_the_sizes_that_fit():
    _, part, fresh = case("triclinic-3x2x1-multihop")
    n_exchanges = len(fresh.layout.exchanges)
    tight = build_halo_plan(part, GHOST_WIDTH, capacity=(1, (1,) * n_exchanges))
    assert tight.overflow
    assert tight.needed_owned == part.counts().max()
    assert tight.needed_exchange == fresh.needed_exchange
    exact = build_halo_plan(part, GHOST_WIDTH, capacity=(tight.needed_owned, tight.needed_exchange))
    assert not exact.overflow
    for rank in range(part.n_ranks):
        assert sorted(held_images(exact, rank)) == sorted(held_images(fresh, rank))


@contextlib.contextmanager
def time_limit(seconds):
    """Fail (rather than hang) when the body runs longer than ``seconds``."""

    def expire(*_):
        raise TimeoutError

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except TimeoutError:
        pytest.fail(f"did not finish within {seconds} s")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_cut_across_a_planar_cluster_is_planned_in_finite_time():
    xy = np.stack(np.meshgrid(np.arange(8), np.arange(8), indexing="ij"), -1).reshape(-1, 2) * 1.1
    positions = np.concatenate([xy, np.zeros((64, 1))], axis=1)
    part = partition(positions, np.zeros((1, 3, 3)), np.zeros((1, 3), bool), np.zeros(64, int),
                     np.ones(64, bool), 8, grid=(2, 2, 2))
    with time_limit(2):
        plan = build_halo_plan(part, GHOST_WIDTH)
    for rank in range(8):  # open axes, zero cell: the frame is Cartesian
        lo, hi = part.bounds(rank)
        gap = np.maximum(np.maximum(lo[0] - positions, positions - hi[0]), 0.0)
        near = set(np.flatnonzero(np.linalg.norm(gap, axis=1) <= GHOST_WIDTH).tolist())
        held = {i for i, _ in held_images(plan, rank)}
        assert near <= held


# ----------------------------------------------------------------------------- exchanges (device)


def mesh_of(n_ranks):
    return default_mesh(jax.devices()[:n_ranks])


def on_ranks(plan, fn, *, with_cell=False):
    """``fn(x, layout, routing[, cell])`` run on every rank; x has a leading [P] axis."""
    layout = plan.layout

    def body(x, routing, cell):
        routing = jax.tree_util.tree_map(lambda a: a[0], routing)
        args = (cell,) if with_cell else ()
        return fn(x[0], layout, routing, *args)[None]

    sharded = jax.jit(
        jax.shard_map(body, mesh=mesh_of(plan.n_ranks), in_specs=(P(AXIS), P(AXIS), P()), out_specs=P(AXIS))
    )
    routing = jax.tree_util.tree_map(jnp.asarray, plan.routing)
    return lambda x, cell=jnp.zeros((1, 3, 3)): sharded(x, routing, cell)


def forward(x, layout, routing, cell=None):
    return halo_forward(x, layout, routing, AXIS, cell=cell)


def reverse(y, layout, routing):
    return halo_reverse(y, layout, routing, AXIS)


ADJOINT_CASES = ["triclinic-3x2x1-multihop", "small-cell-2x1x1-self-images", "empty-ranks-2x2x2"]


def test_adjoint_cases_exercise_multiple_hops_and_self_images():
    hops = {e.hop for e in case("triclinic-3x2x1-multihop")[2].layout.exchanges}
    assert max(hops) > 1
    pairs = [p for e in case("small-cell-2x1x1-self-images")[2].layout.exchanges for p in e.pairs]
    assert any(src == dst for src, dst in pairs)


@pytest.mark.parametrize("name", ADJOINT_CASES)
def test_halo_forward_and_halo_reverse_are_adjoint(name):
    _, part, plan = case(name)
    layout = plan.layout
    rng = np.random.default_rng(0)
    x = rng.standard_normal((part.n_ranks, layout.n_owned, 3))
    y = rng.standard_normal((part.n_ranks, layout.n_local, 3))
    fx = np.asarray(on_ranks(plan, forward)(jnp.asarray(x)))
    ry = np.asarray(on_ranks(plan, reverse)(jnp.asarray(y)))
    lhs, rhs = np.vdot(fx, y), np.vdot(x, ry)
    assert lhs == pytest.approx(rhs, rel=1e-12, abs=1e-12)


def collectives(plan, fn) -> int:
    """ppermutes in the program of ``fn`` on every rank."""
    layout = plan.layout

    def body(x, routing):
        return fn(x[0], layout, jax.tree_util.tree_map(lambda a: a[0], routing))[None]

    sharded = jax.shard_map(body, mesh=mesh_of(plan.n_ranks), in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))
    routing = jax.tree_util.tree_map(jnp.asarray, plan.routing)
    rows = layout.n_owned if fn is forward else layout.n_local
    return str(jax.make_jaxpr(sharded)(jnp.zeros((plan.n_ranks, rows, 3)), routing)).count("ppermute[")


@pytest.mark.parametrize("fn", [forward, reverse], ids=["forward", "reverse"])
def test_both_directions_of_an_axis_split_in_two_share_one_collective(fn):
    _, _, plan = case("cube-2x2x2")
    assert len(plan.layout.exchanges) == 6
    assert collectives(plan, fn) == 3


@pytest.mark.parametrize("fn", [forward, reverse], ids=["forward", "reverse"])
def test_an_axis_split_in_three_and_a_later_hop_keep_their_own_collectives(fn):
    _, _, plan = case("triclinic-3x2x1-multihop")
    layout = plan.layout
    x_axis = [e for e in layout.exchanges if e.axis == 0]
    assert len(x_axis) > 2  # several hops each way along x, whose pairs differ by direction
    assert collectives(plan, fn) == len(x_axis) + 1  # y: one collective for both directions


def test_halo_forward_without_a_cell_is_linear():
    _, part, plan = case("triclinic-3x2x1-multihop")
    rng = np.random.default_rng(1)
    x1, x2 = (rng.standard_normal((part.n_ranks, plan.layout.n_owned, 2)) for _ in range(2))
    run = on_ranks(plan, forward)
    combined = np.asarray(run(jnp.asarray(2.0 * x1 - 3.0 * x2)))
    separate = 2.0 * np.asarray(run(jnp.asarray(x1))) - 3.0 * np.asarray(run(jnp.asarray(x2)))
    np.testing.assert_allclose(combined, separate, rtol=0, atol=1e-12)


def per_rank_owned(values, plan):
    """Global per-atom ``values`` laid out as owned rows [P, n_owned, ...] (zero padding)."""
    ids = plan.local_ids[:, : plan.layout.n_owned]
    rows = values[np.where(ids >= 0, ids, 0)]
    return np.where((ids >= 0).reshape(ids.shape + (1,) * (values.ndim - 1)), rows, 0.0)


@pytest.mark.parametrize("name", ADJOINT_CASES)
def test_halo_forward_copies_each_owner_row_into_its_ghost_rows(name):
    batch, part, plan = case(name)
    values = np.random.default_rng(2).standard_normal((batch.n_atoms, 4))
    got = np.asarray(on_ranks(plan, forward)(jnp.asarray(per_rank_owned(values, plan))))
    ids = plan.local_ids
    expected = np.where((ids >= 0)[..., None], values[np.where(ids >= 0, ids, 0)], 0.0)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", ADJOINT_CASES)
def test_halo_reverse_sums_every_row_of_an_atom_into_its_owner_row(name):
    batch, part, plan = case(name)
    ids = plan.local_ids
    y = np.random.default_rng(3).standard_normal(ids.shape + (3,))
    y = np.where((ids >= 0)[..., None], y, 0.0)  # padding rows hold nothing
    got = np.asarray(on_ranks(plan, reverse)(jnp.asarray(y)))
    totals = np.zeros((batch.n_atoms, 3))
    np.add.at(totals, ids[ids >= 0], y[ids >= 0])
    np.testing.assert_allclose(got, per_rank_owned(totals, plan), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["triclinic-3x2x1-multihop", "small-cell-2x1x1-self-images", "slab-4x2x1",
                                  "batch-3x2x1"])
def test_halo_forward_with_the_cell_places_every_ghost_at_its_image_position(name):
    batch, part, plan = case(name)
    own = per_rank_owned(wrapped_positions(batch, part), plan)
    got = np.asarray(on_ranks(plan, forward, with_cell=True)(jnp.asarray(own), jnp.asarray(batch.cell)))
    np.testing.assert_allclose(got, host_local_positions(batch, part, plan), rtol=0, atol=1e-12)


def test_a_new_plan_with_the_same_capacities_reuses_the_compiled_exchange():
    atoms_a, atoms_b = triclinic(seed=11), triclinic(seed=12)
    atoms_b.positions[:] += np.random.default_rng(4).normal(0, 0.2, atoms_b.positions.shape)
    grid = (3, 2, 1)
    traces = []

    @functools.partial(jax.jit, static_argnums=0)
    def exchange(layout: HaloLayout, routing, own_positions, cell):
        traces.append(layout)

        def body(x, routing):
            routing = jax.tree_util.tree_map(lambda a: a[0], routing)
            return halo_forward(x[0], layout, routing, AXIS, cell=cell)[None]

        return jax.shard_map(body, mesh=mesh_of(6), in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS))(
            own_positions, routing)

    plans = []
    for atoms in (atoms_a, atoms_b):
        batch = Batch.from_ase(atoms)
        part = partition(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, 6, grid=grid)
        capacity = None
        if plans:  # the second plan reuses the first one's capacities
            first = plans[0].layout
            capacity = (first.n_owned, tuple(e.capacity for e in first.exchanges))
        plan = build_halo_plan(part, GHOST_WIDTH, capacity=capacity)
        assert not plan.overflow
        own = per_rank_owned(wrapped_positions(batch, part), plan)
        routing = jax.tree_util.tree_map(jnp.asarray, plan.routing)
        got = np.asarray(exchange(plan.layout, routing, jnp.asarray(own), jnp.asarray(batch.cell)))
        np.testing.assert_allclose(got, host_local_positions(batch, part, plan), rtol=0, atol=1e-12)
        plans.append(plan)
    assert plans[0].layout == plans[1].layout
    assert not np.array_equal(plans[0].routing.send_idx, plans[1].routing.send_idx)  # a different routing
    assert len(traces) == 1


@pytest.mark.parametrize("ranks", [(), (8,), (1, 1), (-1,)])
def test_planning_ranks_outside_the_grid_is_refused_naming_them(ranks):
    _, part, _ = case("cube-2x2x2")
    with pytest.raises(ValueError, match="ranks must be distinct ranks of the grid"):
        build_rank_plans(part, GHOST_WIDTH, ranks)
