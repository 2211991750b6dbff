"""Specification of jaxdd.neighbors: static-shape cell lists checked against ASE."""

import dataclasses

import ase
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.neighborlist import neighbor_list as ase_neighbor_list
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxdd import Batch, NeighborCapacity, NeighborListFormat, build_neighbor_list, neighbor_capacity, neighbor_list

# One static shape for every generated system, so the builder compiles once.
MAX_ATOMS = 40
MAX_SYSTEMS = 3
GENEROUS = NeighborCapacity(max_edges=40_000, max_neighbors=2_000, max_candidates=MAX_ATOMS * 40, search_range=(6, 6, 6))


def pair_set(receivers, senders, shifts, dist=None, cutoff=None, tol=1e-9):
    """Set of (i, j, shift); pairs within tol of the cutoff are left out (rounding ties)."""
    keep = np.ones(len(receivers), bool) if dist is None else np.abs(dist - cutoff) > tol * cutoff
    return {(int(i), int(j), tuple(int(x) for x in s)) for i, j, s, k in zip(receivers, senders, shifts, keep) if k}


def ours_by_system(batch, nl, cutoff):
    """Our COO edges, split per system, in each system's own atom numbering."""
    m = np.asarray(nl.mask)
    r, s, sh = np.asarray(nl.receivers)[m], np.asarray(nl.senders)[m], np.asarray(nl.shifts)[m]
    pos, cell, bidx = np.asarray(batch.positions), np.asarray(batch.cell), np.asarray(batch.batch_idx)
    ptr = np.asarray(batch.ptr)
    dist = np.linalg.norm(pos[s] - pos[r] + np.einsum("ei,eij->ej", sh, cell[bidx[r]]), axis=1)
    out = []
    for k in range(len(ptr) - 1):
        sel = bidx[r] == k
        assert np.all(bidx[s][sel] == k), "an edge joins two systems"
        out.append(pair_set(r[sel] - ptr[k], s[sel] - ptr[k], sh[sel], dist[sel], cutoff))
    return out


def ase_pairs(atoms, cutoff):
    i, j, S, d = ase_neighbor_list("ijSd", atoms, cutoff)
    return pair_set(i, j, S, d, cutoff)


def half_of(pairs):
    def positive(s):
        return s > (0, 0, 0)

    return {(i, j, s) for i, j, s in pairs if i < j or (i == j and positive(s))}


@st.composite
def systems(draw):
    """A batch of 1-3 systems: triclinic cells, any pbc, atoms outside the cell, small cells."""
    n_sys = draw(st.integers(1, MAX_SYSTEMS))
    cutoff = draw(st.floats(0.8, 3.5))
    atoms_list = []
    for _ in range(n_sys):
        lengths = np.array(draw(st.lists(st.floats(1.2, 7.0), min_size=3, max_size=3)))
        skew = np.array(draw(st.lists(st.floats(-0.4, 0.4), min_size=3, max_size=3)))
        cell = np.diag(lengths)
        cell[1, 0], cell[2, 0], cell[2, 1] = skew * lengths[[1, 2, 2]]
        pbc = draw(st.tuples(st.booleans(), st.booleans(), st.booleans()))
        n = draw(st.integers(1, MAX_ATOMS // MAX_SYSTEMS))
        frac = np.array(draw(st.lists(st.floats(-0.3, 1.3), min_size=3 * n, max_size=3 * n))).reshape(n, 3)
        atoms_list.append(ase.Atoms(numbers=[1] * n, positions=frac @ cell, cell=cell, pbc=pbc))
    return atoms_list, cutoff


def _pairs_equal_ase(case):
    atoms_list, cutoff = case
    batch = Batch.from_ase(atoms_list).pad(MAX_ATOMS, MAX_SYSTEMS)
    nl, _ = neighbor_list(
        batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, cutoff=cutoff, capacity=GENEROUS
    )
    ours = ours_by_system(batch, nl, cutoff)
    for k, atoms in enumerate(atoms_list):
        assert ours[k] == ase_pairs(atoms, cutoff), f"system {k} (pbc {atoms.pbc.tolist()})"


def _half_list_once(case):
    atoms_list, cutoff = case
    batch = Batch.from_ase(atoms_list).pad(MAX_ATOMS, MAX_SYSTEMS)
    nl, _ = neighbor_list(
        batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
        cutoff=cutoff, capacity=GENEROUS, half=True,
    )
    ours = ours_by_system(batch, nl, cutoff)
    for k, atoms in enumerate(atoms_list):
        assert ours[k] == half_of(ase_pairs(atoms, cutoff))


# Each example compiles its own search (the cutoff is static): a few in the default suite,
# a longer sweep in the slow set.
@settings(max_examples=5)
@given(systems())
def test_pairs_equal_ase_neighbor_list(case):
    _pairs_equal_ase(case)


@pytest.mark.slow
@settings(max_examples=40)
@given(systems())
def test_pairs_equal_ase_neighbor_list_sweep(case):
    _pairs_equal_ase(case)


@settings(max_examples=3)
@given(systems())
def test_half_list_keeps_each_pair_once(case):
    _half_list_once(case)


@pytest.mark.slow
@settings(max_examples=20)
@given(systems())
def test_half_list_keeps_each_pair_once_sweep(case):
    _half_list_once(case)


def fcc(n=3, a=1.6796, pbc=True):
    from ase.build import bulk

    return bulk("Ar", "fcc", a=a, cubic=True).repeat(n) if pbc else None


def test_cell_smaller_than_twice_the_cutoff_lists_every_image():
    # One atom in a 1.5 Å cubic cell, cutoff 4 Å: all images within 4 Å, including self-images.
    atoms = ase.Atoms("H", positions=[[0.1, 0.2, 0.3]], cell=np.eye(3) * 1.5, pbc=True)
    nl, cap = neighbor_list(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=4.0)
    m = np.asarray(nl.mask)
    assert cap.search_range == (3, 3, 3)
    assert int(m.sum()) == len(ase_neighbor_list("i", atoms, 4.0)) > 0
    assert np.all(np.asarray(nl.senders)[m] == 0)


def test_matrix_rows_hold_the_coo_neighbours():
    atoms = fcc(3)
    atoms.rattle(0.05, seed=1)
    coo, cap = neighbor_list(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5)
    mat, _ = neighbor_list(
        atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5, format=NeighborListFormat.MATRIX, capacity=cap
    )
    n = len(atoms)
    matrix, mshift, count = np.asarray(mat.matrix), np.asarray(mat.matrix_shifts), np.asarray(mat.num_neighbors)
    from_matrix = {
        (i, int(matrix[i, k]), tuple(mshift[i, k])) for i in range(n) for k in range(count[i])
    }
    m = np.asarray(coo.mask)
    from_coo = set(zip(np.asarray(coo.receivers)[m].tolist(), np.asarray(coo.senders)[m].tolist(),
                       map(tuple, np.asarray(coo.shifts)[m])))
    assert from_matrix == from_coo
    assert np.all(matrix[np.arange(matrix.shape[1])[None, :] >= count[:, None]] == n)


def test_padding_edges_point_one_past_the_last_atom():
    atoms = fcc(3)
    cap = neighbor_capacity(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5)
    big = NeighborCapacity(cap.max_edges + 100, cap.max_neighbors, cap.max_candidates, cap.search_range)
    nl = build_neighbor_list(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5, capacity=big)
    pad = ~np.asarray(nl.mask)
    assert pad.sum() >= 100
    assert np.all(np.asarray(nl.senders)[pad] == len(atoms))
    assert np.all(np.asarray(nl.receivers)[pad] == len(atoms))
    assert np.all(np.asarray(nl.shifts)[pad] == 0)


def test_edges_are_sorted_by_receiver():
    atoms = fcc(3)
    atoms.rattle(0.1, seed=3)
    nl, _ = neighbor_list(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5)
    r = np.asarray(nl.receivers)
    assert np.all(np.diff(r) >= 0)


@pytest.mark.parametrize(
    "field, shrink",
    [("max_edges", 0.5), ("max_candidates", 0.5), ("search_range", None), ("max_neighbors", 0.5)],
)
def test_too_small_capacity_raises_the_overflow_flag_on_device(field, shrink):
    atoms = fcc(3)
    cap = neighbor_capacity(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5)
    if field == "search_range":
        # A cell thinner than the cutoff needs more than one bin of reach.
        atoms = ase.Atoms("H2", positions=[[0, 0, 0], [0.5, 0.5, 0.5]], cell=np.eye(3) * 1.2, pbc=True)
        cap = neighbor_capacity(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5)
        small = dataclasses.replace(cap, search_range=(1, 1, 1))
    else:
        small = NeighborCapacity(**{**cap.__dict__, field: max(1, int(getattr(cap, field) * shrink))})
    fmt = NeighborListFormat.MATRIX if field == "max_neighbors" else NeighborListFormat.COO
    nl = jax.jit(build_neighbor_list, static_argnames=("cutoff", "capacity", "half", "format"))(
        atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5, capacity=small, format=fmt
    )
    assert bool(nl.overflow)
    assert cap.fits(nl.stats()) and not small.fits(nl.stats())


def test_neighbor_list_grows_an_overflowing_capacity_and_finds_every_pair():
    atoms = fcc(3)
    tiny = NeighborCapacity(max_edges=10, max_neighbors=2, max_candidates=2, search_range=(1, 1, 1))
    nl, grown = neighbor_list(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5, capacity=tiny)
    assert not bool(nl.overflow)
    assert grown.max_edges > tiny.max_edges
    assert int(nl.n_edges) == len(ase_neighbor_list("i", atoms, 2.5))


@pytest.mark.parametrize("field, value", [("max_edges", 100.5), ("max_candidates", True), ("bin_divisions", 1.9),
                                          ("max_bins", 4096.2)])
def test_a_capacity_that_is_not_a_whole_number_is_refused_naming_it_not_truncated(field, value):
    fields = dict(max_edges=100, max_neighbors=10, max_candidates=50, search_range=(1, 1, 1)) | {field: value}
    with pytest.raises(ValueError, match=f"NeighborCapacity.{field} must be an integer >= 1, got {value}"):
        NeighborCapacity(**fields)


def test_a_fractional_search_range_is_refused_naming_the_axis():
    with pytest.raises(ValueError, match=r"NeighborCapacity.search_range\[1\].* got 2.5"):
        NeighborCapacity(100, 10, 50, (1, 2.5, 1))


def test_new_positions_with_the_same_capacity_do_not_recompile():
    atoms = fcc(3)
    cap = neighbor_capacity(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5, headroom=1.5)
    traces = []

    @jax.jit
    def build(positions):
        traces.append(1)
        return build_neighbor_list(positions, atoms.cell.array, atoms.pbc, cutoff=2.5, capacity=cap)

    for seed in range(3):
        moved = atoms.copy()
        moved.rattle(0.05, seed=seed)
        nl = build(jnp.asarray(moved.positions))
        assert int(nl.n_edges) == len(ase_neighbor_list("i", moved, 2.5))
    assert len(traces) == 1


def test_systems_of_a_batch_are_never_joined():
    a = fcc(2)
    b = a.copy()
    b.positions += 0.01  # same place: would be neighbours if systems were mixed
    batch = Batch.from_ase([a, b])
    nl, _ = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, cutoff=2.5)
    m = np.asarray(nl.mask)
    bidx = np.asarray(batch.batch_idx)
    assert np.all(bidx[np.asarray(nl.senders)[m]] == bidx[np.asarray(nl.receivers)[m]])
    assert int(nl.n_edges) == 2 * len(ase_neighbor_list("i", a, 2.5))


def test_positions_outside_the_cell_give_the_same_edge_vectors_as_wrapped_ones():
    atoms = fcc(2)
    atoms.rattle(0.05, seed=4)
    outside = atoms.positions + np.array([2.0, -1.0, 3.0]) @ atoms.cell.array
    nl_in, _ = neighbor_list(atoms.positions, atoms.cell.array, atoms.pbc, cutoff=2.5)
    nl_out, _ = neighbor_list(outside, atoms.cell.array, atoms.pbc, cutoff=2.5)

    def vectors(pos, nl):
        m = np.asarray(nl.mask)
        r, s, sh = np.asarray(nl.receivers)[m], np.asarray(nl.senders)[m], np.asarray(nl.shifts)[m]
        v = pos[s] - pos[r] + sh @ atoms.cell.array
        return np.array(sorted(map(tuple, np.round(np.c_[r, s, v], 9))))

    np.testing.assert_allclose(vectors(outside, nl_out), vectors(atoms.positions, nl_in), atol=1e-9)


def test_open_axes_need_no_cell():
    # A molecule with a zero cell and no pbc: binning uses the atoms' own extent.
    pos = np.random.default_rng(0).uniform(-8, 8, (30, 3))
    atoms = ase.Atoms(numbers=[1] * 30, positions=pos, pbc=False)
    nl, _ = neighbor_list(pos, np.zeros((3, 3)), [False] * 3, cutoff=4.0)
    m = np.asarray(nl.mask)
    got = pair_set(np.asarray(nl.receivers)[m], np.asarray(nl.senders)[m], np.asarray(nl.shifts)[m])
    i, j, S = ase_neighbor_list("ijS", atoms, 4.0)
    assert got == pair_set(i, j, S)


@pytest.mark.parametrize("n_receivers", [None, 600], ids=["all-rows", "first-rows"])
@pytest.mark.parametrize("half", [False, True], ids=["full", "half"])
def test_sizing_a_large_system_in_blocks_of_rows_counts_what_one_pass_counts(monkeypatch, half, n_receivers):
    """The pair count of neighbor_capacity runs in blocks of rows past PAIR_COUNT_SLOTS
    candidate slots (its memory bound); the capacities must not change. 700 atoms are 768
    padded rows: blocks of 64 divide them, a block of 512 rows leaves a last block that
    overlaps the first."""
    import jaxdd.neighbors as nb

    atoms = ase.Atoms("Ar700", positions=np.random.default_rng(3).random((700, 3)) * [14.0, 13.0, 12.0],
                      cell=[[14.0, 0, 0], [2.0, 13.0, 0], [1.0, -1.5, 12.0]], pbc=[True, True, False])
    size = dict(cutoff=2.5, half=half, n_receivers=n_receivers)
    one_pass = neighbor_capacity(atoms.positions, atoms.cell.array, atoms.pbc, **size)
    candidates = nb.capacity_bucket(one_pass.max_candidates)
    for slots in (1, 600 * candidates):  # blocks of 64 rows; of 512
        monkeypatch.setattr("jaxdd.neighbors.sizing.PAIR_COUNT_SLOTS", slots)
        assert neighbor_capacity(atoms.positions, atoms.cell.array, atoms.pbc, **size) == one_pass


@pytest.mark.parametrize("cutoff", [0.0, -1.0, float("nan"), float("inf")])
def test_non_positive_or_non_finite_cutoff_is_refused(cutoff):
    with pytest.raises(ValueError, match="cutoff"):
        neighbor_capacity(np.zeros((2, 3)), np.eye(3) * 5, [True] * 3, cutoff=cutoff)


def _edge_energy(vectors):
    """A smooth function of the edge vectors with every derivative order non-trivial."""
    r2 = jnp.sum(vectors * vectors, axis=-1)
    return jnp.sum(jnp.exp(-r2) * vectors[:, 0] + 0.1 * r2 * r2)


@pytest.mark.parametrize("rank_list", [False, True], ids=["with-shifts", "zero-shifts"])
def test_edge_vector_derivatives_equal_those_of_the_plain_difference(rank_list):
    # edge_vectors carries its own derivative rule (rows of four in the gradient): every
    # order, forward and reverse, in positions and cell, must equal plain autodiff of
    # positions[s] - positions[r] + shifts @ cell.
    from jaxdd import edge_vectors

    atoms = fcc(2)
    atoms.rattle(0.07, seed=8)
    pos = jnp.asarray(atoms.positions)
    cell = jnp.asarray(atoms.cell.array)[None]
    batch = jnp.zeros(len(atoms), jnp.int32)
    nl, _ = neighbor_list(pos, cell, atoms.pbc[None], cutoff=2.5, half=True)
    if rank_list:
        nl = dataclasses.replace(nl, shifts=jnp.zeros_like(nl.shifts), zero_shifts=True)

    def plain(p, c):
        s, r = nl.senders, nl.receivers
        v = p.at[s].get(mode="fill", fill_value=0) - p.at[r].get(mode="fill", fill_value=0)
        return v if rank_list else v + nl.shifts.astype(p.dtype) @ c[0]

    def ours(p, c):
        return edge_vectors(p, c, batch, nl)

    rng = np.random.default_rng(1)
    dp, dc = rng.normal(size=pos.shape), rng.normal(size=cell.shape)
    for name, f in (("value", lambda g: g(pos, cell)),
                    ("grad", lambda g: jax.grad(lambda p, c: _edge_energy(g(p, c)), (0, 1))(pos, cell)),
                    ("jvp", lambda g: jax.jvp(g, (pos, cell), (dp, dc))[1]),
                    ("hvp", lambda g: jax.jvp(jax.grad(lambda p, c: _edge_energy(g(p, c)), (0, 1)),
                                              (pos, cell), (dp, dc))[1])):
        for got, want in zip(jax.tree_util.tree_leaves(f(ours)), jax.tree_util.tree_leaves(f(plain))):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12, atol=1e-12, err_msg=name)
