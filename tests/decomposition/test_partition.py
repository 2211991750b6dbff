"""Specification of jaxdd.decomposition.partition: the block grid of ranks and the owner of every atom.

Host-side only (numpy); nothing here compiles. Expectations are computed independently of
the library: fractional coordinates by solving against the cell, block surfaces from the
perpendicular widths of the cell, factorisations by plain enumeration.
"""

import itertools

import ase
import numpy as np
import pytest

from jaxdd import Batch
from jaxdd.decomposition.partition import choose_grid, grids_of, partition, rank_coords, rank_of
from jaxdd.data.systems import fcc_lattice

LATTICE = 1.6796
SHEAR = np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [-0.1, 0.1, 1.0]])


# ----------------------------------------------------------------------------- helpers


def triclinic_atoms(n_cells=4, seed=2):
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.set_cell(atoms.cell.array @ SHEAR, scale_atoms=True)
    atoms.rattle(0.03, seed=seed)
    return atoms


def cube_atoms(n_cells=4, seed=1):
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.rattle(0.05, seed=seed)
    return atoms


def slab_atoms(seed=3):
    atoms = fcc_lattice((4, 4, 3), LATTICE)
    cell = atoms.cell.array.copy()
    cell[2, 2] += 10.0  # vacuum above the slab
    atoms.set_cell(cell)
    atoms.pbc = (True, True, False)
    atoms.rattle(0.05, seed=seed)
    return atoms


def cluster_atoms(seed=4):
    atoms = fcc_lattice(3, LATTICE)
    atoms.rattle(0.05, seed=seed)
    return ase.Atoms(atoms.symbols, positions=atoms.positions + 5.0, cell=np.zeros((3, 3)), pbc=False)


def partition_of(batch, n_ranks, grid=None):
    return partition(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, n_ranks, grid=grid)


def partition_atoms(atoms, n_ranks, grid=None, positions=None):
    positions = atoms.positions if positions is None else positions
    n = len(atoms)
    return partition(positions, atoms.cell.array[None], np.asarray(atoms.pbc)[None], np.zeros(n, int),
                     np.ones(n, bool), n_ranks, grid=grid)


def fractional(positions, cell):
    """Fractional coordinates: positions = frac @ cell."""
    return np.linalg.solve(np.asarray(cell).T, np.asarray(positions).T).T


def perpendicular_widths(cell):
    """Distance between opposite faces of the cell along each axis: V / |b x c| etc."""
    volume = abs(np.linalg.det(cell))
    return np.array([volume / np.linalg.norm(np.cross(cell[(i + 1) % 3], cell[(i + 2) % 3])) for i in range(3)])


def all_grids(n_ranks):
    return [g for g in itertools.product(range(1, n_ranks + 1), repeat=3) if np.prod(g) == n_ranks]


def block_surface(lengths, grid):
    d = np.asarray(lengths, float) / np.asarray(grid)
    return 2.0 * (d[0] * d[1] + d[1] * d[2] + d[2] * d[0])


def least_surface_grid(n_ranks, lengths):
    """The least-surface factorisation; ties go to the lexicographically first grid."""
    grids = sorted(all_grids(n_ranks))
    surfaces = np.array([block_surface(lengths, g) for g in grids])
    best = surfaces.min()
    return next(g for g, s in zip(grids, surfaces) if s <= best * (1 + 1e-12))


def containing_blocks(part, atom):
    """Ranks whose half-open block [lo, hi) contains the atom's frame coordinates."""
    s = part.system[atom]
    found = []
    for r in range(part.n_ranks):
        lo, hi = part.bounds(r)
        if np.all(part.frac[atom] >= lo[s]) and np.all(part.frac[atom] < hi[s]):
            found.append(r)
    return found


# ----------------------------------------------------------------------------- rank numbering


def test_rank_coords_are_row_major_and_inverse_of_rank_of():
    grid = (3, 2, 4)
    coords = rank_coords(np.arange(24), grid)
    assert coords.tolist() == [list(c) for c in itertools.product(range(3), range(2), range(4))]
    assert rank_of(coords, grid).tolist() == list(range(24))


def test_grids_of_lists_every_factorisation_once():
    for n in (1, 6, 8, 12):
        assert sorted(grids_of(n)) == all_grids(n)


# ----------------------------------------------------------------------------- choose_grid


def test_choose_grid_splits_a_cube_for_8_ranks_into_2x2x2():
    assert choose_grid(8, np.array([10.0, 10.0, 10.0])) == (2, 2, 2)


def test_choose_grid_on_a_4_1_1_box_has_the_least_block_surface():
    lengths = np.array([40.0, 10.0, 10.0])
    chosen = choose_grid(8, lengths)
    assert np.prod(chosen) == 8
    assert block_surface(lengths, chosen) == pytest.approx(min(block_surface(lengths, g) for g in all_grids(8)))
    # (8,1,1), (4,2,1) and (4,1,2) tie here; ties go to the first grid in lexicographic order.
    assert chosen == least_surface_grid(8, lengths) == (4, 1, 2)


def test_choose_grid_cuts_a_long_box_only_along_its_length():
    assert choose_grid(8, np.array([60.0, 10.0, 10.0])) == (8, 1, 1)
    assert choose_grid(8, np.array([10.0, 10.0, 60.0])) == (1, 1, 8)


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4, 6, 7, 8, 12])
def test_choose_grid_is_the_least_surface_factorisation(n_ranks):
    rng = np.random.default_rng(n_ranks)
    for _ in range(20):
        lengths = rng.uniform(1.0, 30.0, 3)
        assert choose_grid(n_ranks, lengths) == least_surface_grid(n_ranks, lengths)


def test_partition_without_a_grid_measures_the_cell_by_its_perpendicular_widths():
    # Edge lengths (4.1, 2, 2) would cut axis 0; the widths between faces are (1, 0.49, 2).
    cell = np.array([[1.0, 4.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]])
    rng = np.random.default_rng(0)
    positions = rng.uniform(0, 1, (50, 3)) @ cell
    part = partition(positions, cell[None], np.ones((1, 3), bool), np.zeros(50, int), np.ones(50, bool), 2)
    assert part.grid == least_surface_grid(2, perpendicular_widths(cell)) == (1, 1, 2)


def test_partition_without_a_grid_sizes_the_grid_for_the_largest_system():
    small = fcc_lattice((1, 1, 6), LATTICE)  # long along z, but only 24 atoms
    large = fcc_lattice((6, 2, 2), LATTICE)  # long along x, 96 atoms
    assert partition_of(Batch.from_ase([small, large]), 4).grid == (4, 1, 1)


# ----------------------------------------------------------------------------- owners


@pytest.mark.parametrize("grid", [(2, 2, 2), (3, 2, 1), (8, 1, 1)])
def test_owner_of_a_periodic_atom_is_the_block_of_its_wrapped_fractional_coordinates(grid):
    atoms = triclinic_atoms()
    part = partition_atoms(atoms, int(np.prod(grid)), grid)
    frac = fractional(atoms.positions, atoms.cell.array) % 1.0
    block = np.floor(frac * np.asarray(grid)).astype(int)
    expected = np.ravel_multi_index(tuple(block.T), grid)
    np.testing.assert_array_equal(part.owner, expected)


@pytest.mark.parametrize(
    "atoms, grid",
    [(triclinic_atoms(), (3, 2, 1)), (slab_atoms(), (2, 2, 2)), (cluster_atoms(), (2, 2, 2)),
     (cluster_atoms(), (4, 2, 1))],
    ids=["triclinic", "slab", "cluster", "cluster-4x2"],
)
def test_every_real_atom_lies_in_exactly_one_block_that_of_its_owner(atoms, grid):
    part = partition_atoms(atoms, int(np.prod(grid)), grid)
    for atom in range(len(atoms)):
        assert containing_blocks(part, atom) == [part.owner[atom]]
    assert part.counts().sum() == len(atoms)


def test_padding_atoms_have_no_owner_and_real_atoms_one_rank():
    batch = Batch.from_ase([cube_atoms(3), triclinic_atoms(2)]).pad(150, 3)
    part = partition_of(batch, 6, (3, 2, 1))
    real = np.asarray(batch.atom_mask)
    assert np.all(part.owner[~real] == -1)
    assert np.all((part.owner[real] >= 0) & (part.owner[real] < 6))
    assert part.counts().sum() == real.sum()


def test_each_system_of_a_batch_is_cut_in_its_own_cell():
    a, b = cube_atoms(3), triclinic_atoms(2)
    batch = Batch.from_ase([a, b])
    part = partition_of(batch, 6, (3, 2, 1))
    alone_a = partition_atoms(a, 6, (3, 2, 1))
    alone_b = partition_atoms(b, 6, (3, 2, 1))
    np.testing.assert_array_equal(part.owner, np.concatenate([alone_a.owner, alone_b.owner]))


def test_owner_assignment_is_deterministic():
    atoms = slab_atoms()
    first = partition_atoms(atoms, 8, (2, 2, 2))
    second = partition_atoms(atoms, 8, (2, 2, 2))
    np.testing.assert_array_equal(first.owner, second.owner)
    np.testing.assert_array_equal(first.frac, second.frac)


@pytest.mark.parametrize("grid", [(2, 2, 2), (3, 2, 1)])
def test_owners_are_invariant_to_lattice_translations_of_atoms(grid):
    atoms = triclinic_atoms()
    rng = np.random.default_rng(5)
    k = rng.integers(-3, 4, (len(atoms), 3))
    moved = atoms.positions + k @ atoms.cell.array
    before = partition_atoms(atoms, int(np.prod(grid)), grid)
    after = partition_atoms(atoms, int(np.prod(grid)), grid, positions=moved)
    np.testing.assert_array_equal(after.owner, before.owner)
    np.testing.assert_allclose(after.frac, before.frac, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(after.wraps - before.wraps, k)


def test_atoms_outside_the_cell_are_wrapped_on_periodic_axes():
    atoms = triclinic_atoms()
    cell = atoms.cell.array
    rng = np.random.default_rng(6)
    moved = atoms.positions + rng.integers(-3, 4, (len(atoms), 3)) @ cell
    part = partition_atoms(atoms, 6, (3, 2, 1), positions=moved)
    assert np.all((part.frac >= 0.0) & (part.frac < 1.0))
    wrapped = moved - part.wraps @ cell
    frac = fractional(wrapped, cell)
    assert np.all((frac > -1e-12) & (frac < 1.0 + 1e-12))
    np.testing.assert_allclose(frac, part.frac, rtol=0, atol=1e-12)


def test_open_axes_are_not_wrapped_and_span_the_atoms_extent():
    atoms = slab_atoms()
    positions = atoms.positions.copy()
    positions[:5, 2] += 30.0  # beyond the top of the cell, along the open axis
    part = partition_atoms(atoms, 8, (2, 2, 2), positions=positions)
    assert np.all(part.wraps[:, 2] == 0)
    # The open axis has a unit lattice vector orthogonal to the periodic ones (here z).
    np.testing.assert_allclose(part.frac[:, 2], positions[:, 2], rtol=0, atol=1e-12)
    assert part.lo[0, 2] == pytest.approx(positions[:, 2].min(), abs=1e-12)
    assert positions[:, 2].max() < part.hi[0, 2] < positions[:, 2].max() + 1e-6
    # The upper z-layer of blocks starts half way up that extent, so it holds the raised atoms.
    assert np.all(rank_coords(part.owner[:5], part.grid)[:, 2] == 1)


def test_a_cluster_without_a_cell_is_cut_within_its_own_extent():
    atoms = cluster_atoms()
    part = partition_atoms(atoms, 8, (2, 2, 2))
    np.testing.assert_allclose(part.lo[0], atoms.positions.min(axis=0), rtol=0, atol=1e-12)
    assert np.all(part.counts() > 0)


def test_a_rank_whose_block_holds_no_atoms_owns_nothing():
    # A small cluster in one corner of a large periodic box: only rank 0's block holds atoms.
    atoms = cube_atoms(2)
    box = ase.Atoms(atoms.symbols, positions=atoms.positions + 0.5, cell=np.eye(3) * 20.0, pbc=True)
    part = partition_atoms(box, 8, (2, 2, 2))
    assert part.counts().tolist() == [len(box)] + [0] * 7
