"""Specification of DistributedModel: the same outputs as ``jaxdd.compute`` on any rank grid.

Every comparison runs Lennard-Jones (cutoff 2.5) in float64 on a real ``shard_map`` over
virtual CPU devices, against ``jaxdd.compute`` of the same model on the same data:
energy to 1e-10 relative, forces, stress and atomic energies to 1e-9 absolute.

Compiling one distributed call takes seconds, so the default suite runs each kind of
system on one grid chosen for the path it exercises, on small systems; the full matrix of
systems (at full size) times grids is marked ``slow``. Distributed models and reference
results are built once per (system, grid) and shared between the tests that read them.
"""

import dataclasses
import functools
import math

import ase
import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import ffi
from jaxdd import AtomicData, Batch, NeighborCapacity
from jaxdd.neighbors.capacity import Capacities
from jaxdd.data import as_batch
from jaxdd.engine import DistributedModel, DomainConfig, PartitionHealth, default_mesh
from jaxdd.decomposition.halo_plan import build_halo_plan
from jaxdd.models.lj import LennardJones
from jaxdd.decomposition.partition import partition
from jaxdd.data.systems import fcc_lattice

LATTICE = 1.6796
CUTOFF = 2.5
KEYS = ("energy", "forces", "stress", "atomic_energies")
LJ = LennardJones(1.0, 1.0, CUTOFF)
SHEAR = np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [-0.1, 0.1, 1.0]])  # det 1: density kept
GRIDS = [(1, 1, 1), (2, 1, 1), (2, 2, 2), (4, 2, 1), (3, 2, 1), (8, 1, 1)]

# Small systems replicate every rank's whole neighbourhood; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


# ----------------------------------------------------------------------------- systems


def rattled(atoms, seed, amplitude=0.05):
    atoms.rattle(amplitude, seed=seed)
    return atoms


def cube_atoms(n_cells, seed=1):
    """fcc at reduced density 0.844 (a = 1.6796), rattled."""
    return rattled(fcc_lattice(n_cells, LATTICE), seed)


def triclinic_atoms(n_cells, seed=2):
    """The fcc supercell under a volume-preserving shear; nearest pairs stay above 0.9."""
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.set_cell(atoms.cell.array @ SHEAR, scale_atoms=True)
    return rattled(atoms, seed, 0.03)


def slab_atoms(n_cells, seed=3):
    """Periodic in x and y (an oblique in-plane cell); 10 Å of vacuum above the top layer along
    the open axis, whose cell row is tilted (only the normal to the periodic rows counts)."""
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.set_cell(atoms.cell.array @ np.array([[1.0, 0.0, 0.0], [0.15, 1.0, 0.0], [0.0, 0.0, 1.0]]),
                   scale_atoms=True)
    cell = atoms.cell.array.copy()
    cell[2] += [1.0, -0.5, 10.0]
    atoms.set_cell(cell)
    atoms.pbc = (True, True, False)
    return rattled(atoms, seed, 0.03)


def cluster_atoms(n_cells, seed=4, cell=None):
    """A roughly spherical fcc cluster, its lattice oblique to the axes, no periodicity; in a
    vacuum box (for stress) unless ``cell`` is given."""
    atoms = fcc_lattice(n_cells, LATTICE)
    atoms.rotate(30, "z")
    atoms.rotate(20, "x")
    centred = atoms.positions - atoms.positions.mean(axis=0)
    keep = np.linalg.norm(centred, axis=1) < 0.5 * n_cells * LATTICE
    box = np.eye(3) * (n_cells * LATTICE + 10.0) if cell is None else cell
    return rattled(ase.Atoms(atoms.symbols[keep], positions=centred[keep] + 5.0 + 0.5 * n_cells * LATTICE,
                             cell=box, pbc=False), seed)


def corner_atoms(n_cells, seed=7):
    """A crystallite filling less than half of a periodic box along each axis (the rest vacuum),
    so that on any grid with 2 or more ranks along an axis some ranks own no atom."""
    crystal = cube_atoms(n_cells, seed)
    return ase.Atoms(crystal.symbols, positions=crystal.positions + 0.5,
                     cell=np.eye(3) * (2.2 * n_cells * LATTICE), pbc=True)


def batch_of_two(n_cube, n_triclinic):
    """A cube and a triclinic cell of different sizes, padded by 5 atoms and one empty system."""
    batch = Batch.from_ase([cube_atoms(n_cube, seed=5), triclinic_atoms(n_triclinic, seed=6)])
    return batch.pad(batch.n_atoms + 5, 3)


@dataclasses.dataclass(frozen=True)
class System:
    """A test system at two sizes (default suite / slow matrix) and its DomainConfig extras."""

    small: object
    full: object
    ghost_width: float | None = None

    def data(self, size):
        return (self.small if size == "small" else self.full)()


def data_of(make, *args, **kwargs):
    return lambda: AtomicData.from_ase(make(*args, **kwargs))


SYSTEMS = {
    # (1) 4,000 atoms at full size.
    "fcc-cube": System(data_of(cube_atoms, 5), data_of(cube_atoms, 10)),
    # (2) 2,916 atoms in a sheared cell at full size.
    "triclinic": System(data_of(triclinic_atoms, 4), data_of(triclinic_atoms, 9)),
    # (3) pbc (T, T, F).
    "slab": System(data_of(slab_atoms, (5, 5, 3)), data_of(slab_atoms, (10, 10, 6))),
    # (4) pbc all False, in a vacuum box.
    "cluster": System(data_of(cluster_atoms, 6), data_of(cluster_atoms, 12)),
    # (5) a ghost shell wider than a block: several hops on every split axis.
    "wide-shell": System(data_of(cube_atoms, 4), data_of(cube_atoms, 5), ghost_width=4.5),
    # (6) two systems of different sizes and cells, plus padding atoms and a padding system.
    "batch": System(lambda: batch_of_two(4, 3), lambda: batch_of_two(8, 6)),
    # (7) ranks whose blocks hold no atom.
    "empty-rank": System(data_of(corner_atoms, 4), data_of(corner_atoms, 8)),
}

# The default suite: each system once, on a grid chosen for the path it exercises.
DEFAULT_CASES = [
    # every axis split, one hop; the slow set: test_a_three_dimensional_mesh_equals_compute runs
    # the same grid in the default suite (through a 3-D mesh of the devices)
    pytest.param("fcc-cube", (2, 2, 2), marks=pytest.mark.slow),
    ("triclinic", (3, 2, 1)),  # uneven grid, thin blocks along x (two hops), z self-images
    ("slab", (4, 2, 1)),  # periodic axes split, the open axis whole
    ("cluster", (2, 2, 2)),  # open axes split: no exchange across the boundary
    ("wide-shell", (8, 1, 1)),  # ghost shell spanning six blocks
    ("batch", (3, 2, 1)),  # both systems cut by one grid
    ("empty-rank", (2, 2, 2)),  # seven of eight ranks own nothing
]


def mesh_of(n_ranks):
    return default_mesh(jax.devices()[:n_ranks])


def as_numpy(outputs):
    return {k: np.asarray(v) for k, v in outputs.items()}


@functools.lru_cache(maxsize=None)
def data(name, size):
    return SYSTEMS[name].data(size)


@functools.lru_cache(maxsize=None)
def reference(name, size):
    return as_numpy(jaxdd.compute(LJ, data(name, size), KEYS))


def run_distributed(name, size, grid):
    """(DistributedModel after one call, its outputs) for a system on a grid."""
    config = DomainConfig(cutoff=CUTOFF, mesh=mesh_of(math.prod(grid)), grid=grid,
                          ghost_width=SYSTEMS[name].ghost_width)
    model = DistributedModel(LJ, config)
    return model, as_numpy(model(data(name, size), KEYS))


# Shared by the default tests that read the same model; the slow matrix keeps nothing.
distributed = functools.lru_cache(maxsize=None)(run_distributed)


def assert_matches(got, want):
    assert list(got) == list(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert got[key].dtype == want[key].dtype, key
    for key in want:
        if key == "energy":
            np.testing.assert_allclose(got[key], want[key], rtol=1e-10, atol=0, err_msg=key)
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=0, atol=1e-9, err_msg=key)


# Every compiled XLA:CPU program keeps its code mapped until JAX's caches drop it; a few
# dozen distributed programs in one process exceed the kernel's vm.max_map_count and the
# next compilation aborts. The slow cases reuse nothing, so each releases its programs.


@pytest.fixture
def release_compiled_programs():
    yield
    jax.clear_caches()


# ----------------------------------------------------------------------------- agreement


def _case_id(case):
    name, grid = case.values if hasattr(case, "values") else case
    return f"{name}-{'x'.join(map(str, grid))}"


@pytest.mark.parametrize("name, grid", DEFAULT_CASES, ids=[_case_id(c) for c in DEFAULT_CASES])
def test_distributed_outputs_equal_single_device_compute(name, grid):
    _, got = distributed(name, "small", grid)
    assert_matches(got, reference(name, "small"))


@pytest.mark.slow
@pytest.mark.usefixtures("release_compiled_programs")
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("name", list(SYSTEMS))
def test_full_size_systems_on_every_grid_equal_single_device_compute(name, grid):
    _, got = run_distributed(name, "full", grid)
    assert_matches(got, reference(name, "full"))


def test_atoms_moved_by_lattice_vectors_give_the_same_outputs_in_their_own_order():
    original = data("triclinic", "small")
    cell = np.asarray(original.cell[0])
    k = np.random.default_rng(8).integers(-2, 3, (original.n_atoms, 3))
    moved = original.replace(positions=np.asarray(original.positions) + k @ cell)
    # Same partition and capacities as the cached model for this grid: no new compilation.
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh_of(6), grid=(3, 2, 1)))
    assert_matches(as_numpy(model(moved, KEYS)), reference("triclinic", "small"))


def test_one_device_equals_compute():
    # A single rank: every ghost is a periodic image of the rank's own atoms.
    _, got = distributed("triclinic", "small", (1, 1, 1))
    assert_matches(got, reference("triclinic", "small"))


def test_a_two_dimensional_mesh_equals_compute():
    devices = np.array(jax.devices()[:4]).reshape(2, 2)
    mesh = Mesh(devices, ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh, grid=(2, 2, 1)))
    got = as_numpy(model(data("fcc-cube", "small"), KEYS))
    assert_matches(got, reference("fcc-cube", "small"))


def test_a_three_dimensional_mesh_equals_compute():
    devices = np.array(jax.devices()[:8]).reshape(2, 2, 2)
    mesh = Mesh(devices, ("x", "y", "z"), axis_types=(AxisType.Auto,) * 3)
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh, grid=(2, 2, 2)))
    got = as_numpy(model(data("fcc-cube", "small"), KEYS))
    assert_matches(got, reference("fcc-cube", "small"))


@pytest.mark.slow
@pytest.mark.usefixtures("release_compiled_programs")
def test_a_two_dimensional_mesh_of_eight_devices_equals_compute():
    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    mesh = Mesh(devices, ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh, grid=(4, 2, 1)))
    got = as_numpy(model(data("triclinic", "full"), KEYS))
    assert_matches(got, reference("triclinic", "full"))


@pytest.mark.slow
@pytest.mark.usefixtures("release_compiled_programs")
def test_a_cluster_without_a_cell_equals_compute():
    atoms = cluster_atoms(8, cell=np.zeros((3, 3)))
    outputs = ("energy", "forces", "atomic_energies")
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh_of(8), grid=(2, 2, 2)))
    got = as_numpy(model(AtomicData.from_ase(atoms), outputs))
    want = as_numpy(jaxdd.compute(LJ, AtomicData.from_ase(atoms), outputs))
    assert_matches(got, want)


def test_tiny_initial_capacities_grow_to_the_same_result():
    name, grid = "triclinic", (2, 1, 1)
    batch = Batch.from_ase(triclinic_atoms(4))
    plan = build_halo_plan(
        partition(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, 2, grid=grid), CUTOFF)
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh_of(2), grid=grid))
    model.sizing.use(Capacities(1, (1,) * len(plan.layout.exchanges), NeighborCapacity(8, 2, 4, (1, 1, 1))))
    got = as_numpy(model(data(name, "small"), KEYS))
    assert_matches(got, reference(name, "small"))
    health = model.health
    assert health.recompiles >= 1
    assert health.owned_capacity >= health.owned.max()
    assert health.ghost_capacity >= health.ghost.max()


# ----------------------------------------------------------------------------- health


def distinct_atoms_held(model, name, size):
    """Per rank, how many different atoms have a row there (owned or as any ghost image)."""
    _, plan = model.plan(as_batch(data(name, size)))
    return np.array([len(set(ids[ids >= 0].tolist())) for ids in plan.local_ids])


def test_edge_capacity_of_a_batch_of_overlapping_molecules_counts_each_alone():
    # Twenty copies of one molecule at the same coordinates, each its own system: a rank's
    # list never joins two systems, so its capacity is sized per system, not for the pile.
    mol = cluster_atoms(3, cell=np.eye(3) * 20.0)
    batch = Batch.from_ase([mol] * 20)
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh_of(2)))
    model(batch, ("energy",))
    per_atom = np.bincount(np.asarray(jaxdd.neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx,
                                                          batch.atom_mask, cutoff=CUTOFF)[0].receivers))
    assert model.health.edge_capacity <= 2 * per_atom[: batch.n_atoms].sum()


def test_health_reports_the_partition_of_the_last_call():
    model, _ = distributed("triclinic", "small", (3, 2, 1))
    health = model.health
    n_atoms = data("triclinic", "small").n_atoms
    _, plan = model.plan(as_batch(data("triclinic", "small")))
    assert isinstance(health, PartitionHealth)
    assert health.grid == (3, 2, 1)
    assert health.owned.sum() == n_atoms
    np.testing.assert_array_equal(health.owned, plan.owned_counts())
    np.testing.assert_array_equal(health.ghost, plan.ghost_counts())
    assert health.owned_capacity >= health.owned.max()
    assert health.ghost_capacity >= health.ghost.max()
    assert health.recompiles == 0


def test_health_remote_counts_the_atoms_a_rank_holds_no_row_of():
    # Slab on (4, 2, 1): y blocks plus the shell are wider than the cell (atoms held as two
    # images) while x blocks plus the shell are narrower (some atoms not held at all).
    model, _ = distributed("slab", "small", (4, 2, 1))
    n_atoms = data("slab", "small").n_atoms
    np.testing.assert_array_equal(model.health.remote, n_atoms - distinct_atoms_held(model, "slab", "small"))


def test_health_shows_ranks_that_own_nothing():
    model, _ = distributed("empty-rank", "small", (2, 2, 2))
    assert model.health.owned.tolist() == [data("empty-rank", "small").n_atoms] + [0] * 7


def test_default_grid_of_a_cube_on_eight_devices_is_2x2x2():
    model = DistributedModel(LJ, DomainConfig(cutoff=CUTOFF, mesh=mesh_of(8)))
    part, _ = model.plan(as_batch(data("fcc-cube", "small")))
    assert part.grid == (2, 2, 2)


# ----------------------------------------------------------------------------- bad input


def test_ghost_width_below_the_cutoff_is_refused_naming_ghost_width():
    with pytest.raises(ValueError, match="ghost_width"):
        DomainConfig(cutoff=CUTOFF, ghost_width=2.0, mesh=mesh_of(1))


def test_grid_with_a_rank_count_other_than_the_device_count_of_a_given_mesh_is_refused():
    with pytest.raises(ValueError, match=r"grid \(2, 1, 1\) has 2 ranks but the mesh has 4 devices.*mesh=None"):
        DomainConfig(cutoff=CUTOFF, mesh=mesh_of(4), grid=(2, 1, 1))


def test_a_grid_smaller_than_the_machine_runs_on_the_first_devices_and_equals_compute():
    config = DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1))  # no mesh, 8 devices present
    assert list(config.mesh.devices.flat) == jax.devices()[:2]
    model = DistributedModel(LJ, config)
    assert_matches(as_numpy(model(data("fcc-cube", "small"), KEYS)), reference("fcc-cube", "small"))
    assert (model.health.devices, model.health.devices_present) == (2, len(jax.devices()))
    assert f"runs on 2 of the {len(jax.devices())} devices" in str(model.health)


def test_a_grid_larger_than_the_machine_is_refused_naming_the_device_count():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"grid \\(4, 2, 2\\) has 16 ranks but there are only {n} devices"):
        DomainConfig(cutoff=CUTOFF, grid=(4, 2, 2))


@pytest.mark.parametrize("grid, bad", [((2.5, 2, 1), r"grid\[0\].* got 2.5"), ((2, 1, True), r"grid\[2\].* got True")])
def test_a_grid_entry_that_is_not_a_whole_number_is_refused_naming_it_not_truncated(grid, bad):
    with pytest.raises(ValueError, match=f"DomainConfig.{bad}"):
        DomainConfig(cutoff=CUTOFF, mesh=mesh_of(4), grid=grid)


def test_a_grid_of_whole_floats_and_numpy_integers_is_stored_as_ints():
    config = DomainConfig(cutoff=CUTOFF, mesh=mesh_of(4), grid=(2.0, np.int64(2), 1))
    assert config.grid == (2, 2, 1) and all(type(g) is int for g in config.grid)


@pytest.mark.parametrize("cutoff", [0.0, -1.0, float("nan"), float("inf")])
def test_a_cutoff_that_is_not_positive_and_finite_is_refused(cutoff):
    with pytest.raises(ValueError, match="cutoff"):
        DomainConfig(cutoff=cutoff, mesh=mesh_of(1))


@pytest.mark.parametrize("half, backend, axes", [(False, "auto", {0, 1}), (False, "kernel", {0, 1, 2}),
                                                 (True, "auto", {0, 1, 2})], ids=["full", "full-kernel", "half"])
def test_ranks_search_the_images_along_an_axis_the_grid_leaves_whole_unless_the_list_needs_them(half, backend, axes):
    """A full list finds the periodic images along z itself on a grid (3, 2, 1): no exchange
    along z; a half list (whose order keys tell images apart by their rows) and the kernel
    search (open boundaries only) hold them as ghost rows. test_distributed_outputs_equal_
    single_device_compute checks the outputs of the first."""
    if backend == "kernel" and not ffi.available():
        pytest.skip("compiled kernels not built (pip install -e .)")
    config = DomainConfig(cutoff=CUTOFF, mesh=mesh_of(6), grid=(3, 2, 1), neighbor_backend=backend)
    model = DistributedModel(LennardJones(1.0, 1.0, CUTOFF, half_list=half), config)
    batch = as_batch(data("triclinic", "small"))
    part, plan = model.plan(batch)
    assert {e.axis for e in plan.layout.exchanges} == axes
    inputs, _ = model.rank_inputs(batch, part, plan)
    assert np.all(inputs.local.pbc[..., 2] == (axes == {0, 1})) and not np.any(inputs.local.pbc[..., :2])


# A half list keeps each pair on one rank (picked by global id order and parity; images by their shift).
HALF_CASES = [("triclinic", (3, 2, 1), "auto"),
              pytest.param("batch", (2, 2, 1), "jnp", marks=pytest.mark.slow, id="batch-jnp"),
              pytest.param("wide-shell", (8, 1, 1), "auto", marks=pytest.mark.slow, id="wide-shell-auto")]


@pytest.mark.parametrize("name, grid, backend", HALF_CASES)
def test_a_half_neighbour_list_gives_the_single_device_outputs(name, grid, backend):
    config = DomainConfig(cutoff=CUTOFF, mesh=mesh_of(math.prod(grid)), grid=grid,
                          ghost_width=SYSTEMS[name].ghost_width, neighbor_backend=backend)
    half = DistributedModel(LennardJones(1.0, 1.0, CUTOFF, half_list=True), config)
    assert_matches(as_numpy(half(data(name, "small"), KEYS)), reference(name, "small"))


def test_a_half_neighbour_list_on_node_blocks_is_refused():
    with pytest.raises(ValueError, match="half neighbour list.*node blocks"):
        DistributedModel(LennardJones(1.0, 1.0, CUTOFF, half_list=True),
                         DomainConfig(cutoff=CUTOFF, mesh=mesh_of(2), strategy="graph_partition"))


def test_a_model_reaching_beyond_the_ghost_width_is_refused():
    with pytest.raises(ValueError, match="ghost width"):
        DistributedModel(LennardJones(1.0, 1.0, 3.0), DomainConfig(cutoff=CUTOFF, mesh=mesh_of(2)))


def test_nan_positions_are_refused_before_anything_runs():
    atoms = cube_atoms(2)
    positions = atoms.positions.copy()
    positions[3, 1] = np.nan
    with pytest.raises(ValueError, match="positions"):
        AtomicData(positions, atoms.numbers, atoms.cell.array, atoms.pbc)
