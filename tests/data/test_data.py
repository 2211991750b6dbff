"""Specification of jaxdd.data: AtomicData and Batch."""

import jax

jax.config.update("jax_enable_x64", True)

import dataclasses  # noqa: E402

import ase  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from ase.build import bulk, molecule  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from jaxdd.data import AtomicData, Batch, as_batch, wrap_positions  # noqa: E402


# ------------------------------------------------------------------------------ fixtures


def copper(rattle_seed=0, charges=True, velocities=True):
    atoms = bulk("Cu", "fcc", a=3.6) * (2, 2, 1)
    atoms.rattle(0.05, seed=rattle_seed)
    if charges:
        atoms.set_initial_charges(np.linspace(-0.3, 0.3, len(atoms)))
    if velocities:
        atoms.set_velocities(np.random.default_rng(1).normal(size=(len(atoms), 3)))
    return atoms


def water():
    atoms = molecule("H2O")
    atoms.center(vacuum=3.0)
    return atoms


def triclinic_cell():
    return np.array([[4.0, 0.0, 0.0], [1.3, 3.7, 0.0], [-0.8, 0.9, 4.4]])


def two_systems():
    return Batch.from_ase([copper(), water()])


# --------------------------------------------------------------------------- AtomicData


def test_from_ase_round_trip_keeps_every_field():
    atoms = copper()
    back = AtomicData.from_ase(atoms).to_ase()
    np.testing.assert_allclose(back.positions, atoms.positions, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(back.numbers, atoms.numbers)
    np.testing.assert_allclose(back.cell.array, atoms.cell.array, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(back.pbc, atoms.pbc)
    np.testing.assert_allclose(back.get_masses(), atoms.get_masses(), rtol=1e-12)
    np.testing.assert_allclose(back.get_initial_charges(), atoms.get_initial_charges(), atol=1e-12)
    np.testing.assert_allclose(back.get_velocities(), atoms.get_velocities(), atol=1e-12)


def test_from_ase_stores_cell_and_pbc_with_a_system_axis():
    data = AtomicData.from_ase(copper())
    assert data.cell.shape == (1, 3, 3)
    assert data.pbc.shape == (1, 3) and data.pbc.dtype == jnp.bool_
    assert data.atomic_numbers.dtype == jnp.int32


def test_from_ase_leaves_absent_charges_and_velocities_none():
    data = AtomicData.from_ase(copper(charges=False, velocities=False))
    assert data.charges is None
    assert data.velocities is None
    assert data.masses is not None


def test_from_ase_dtype_sets_every_float_field():
    data = AtomicData.from_ase(copper(), dtype=jnp.float32)
    for x in (data.positions, data.cell, data.masses, data.charges, data.velocities):
        assert x.dtype == jnp.float32


def test_constructor_defaults_to_zero_cell_and_no_pbc():
    data = AtomicData([[0.0, 0.0, 0.0], [0.0, 0.0, 0.74]], [1, 1])
    np.testing.assert_array_equal(data.cell, np.zeros((1, 3, 3)))
    np.testing.assert_array_equal(data.pbc, np.zeros((1, 3), bool))


def test_constructor_accepts_3x3_cell_and_single_bool_pbc():
    data = AtomicData([[0.0, 0.0, 0.0]], [29], cell=np.eye(3) * 3.0, pbc=True)
    assert data.cell.shape == (1, 3, 3)
    np.testing.assert_array_equal(data.pbc, [[True, True, True]])


def test_constructor_accepts_length_3_pbc():
    data = AtomicData([[0.0, 0.0, 0.0]], [29], cell=np.eye(3) * 3.0, pbc=[True, False, True])
    np.testing.assert_array_equal(data.pbc, [[True, False, True]])


def test_integer_positions_become_default_float():
    data = AtomicData([[0, 0, 0]], [1])
    assert data.positions.dtype == jnp.float64


def test_instances_are_frozen():
    data = AtomicData.from_ase(water())
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.positions = data.positions + 1.0


def test_replace_returns_a_new_validated_instance():
    data = AtomicData.from_ase(water())
    moved = data.replace(positions=data.positions + 1.0)
    np.testing.assert_allclose(moved.positions, data.positions + 1.0)
    with pytest.raises(ValueError, match="positions"):
        data.replace(positions=data.positions.at[0, 0].set(jnp.nan))


# ---------------------------------------------------------------------- bad AtomicData


def test_nan_positions_name_the_atom_index():
    pos = np.zeros((6, 3))
    pos[4, 1] = np.nan
    with pytest.raises(ValueError, match=r"positions of atoms \[4\]"):
        AtomicData(pos, [1] * 6)


def test_inf_positions_are_refused():
    pos = np.zeros((3, 3))
    pos[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"positions of atoms \[0\]"):
        AtomicData(pos, [1] * 3)


def test_mismatched_lengths_name_both_arrays():
    with pytest.raises(ValueError, match="atomic_numbers has 5 entries but positions has 6 rows"):
        AtomicData(np.zeros((6, 3)), [1] * 5)


def test_mismatched_masses_length_is_refused():
    with pytest.raises(ValueError, match="masses has 2 entries but positions has 3 rows"):
        AtomicData(np.zeros((3, 3)), [1] * 3, masses=[1.0, 1.0])


def test_wrong_positions_shape_is_refused():
    with pytest.raises(ValueError, match=r"positions must have shape \[n_atoms, 3\]"):
        AtomicData(np.zeros((4, 2)), [1] * 4)


def test_flat_positions_are_refused():
    with pytest.raises(ValueError, match=r"positions must have shape \[n_atoms, 3\]"):
        AtomicData(np.zeros(12), [1] * 4)


def test_empty_system_is_refused():
    with pytest.raises(ValueError, match="has no atoms"):
        AtomicData(np.zeros((0, 3)), np.zeros(0, int))


def test_atomic_number_zero_is_refused_for_real_atoms():
    with pytest.raises(ValueError, match=r"atomic_numbers must be >= 1.*atoms \[1\]"):
        AtomicData(np.zeros((2, 3)), [1, 0])


@pytest.mark.parametrize("make", [AtomicData, lambda x, z: Batch(x, z, cell=np.zeros((3, 3)))])
@pytest.mark.parametrize("z", [18.7, 17.9999999])
def test_fractional_atomic_numbers_are_refused_naming_the_atom_and_value_not_truncated(make, z):
    with pytest.raises(ValueError, match=rf"atomic_numbers must be whole numbers; atoms \[1\] have \[{z}\]"):
        make(np.zeros((2, 3)), np.array([18.0, z]))


def test_whole_float_and_numpy_integer_atomic_numbers_are_accepted():
    for z in (np.array([18.0, 1.0]), np.array([18, 1], np.int64), [np.int16(18), 1]):
        data = AtomicData(np.zeros((2, 3)), z)
        assert data.atomic_numbers.dtype == jnp.int32 and data.atomic_numbers.tolist() == [18, 1]


def test_fractional_batch_index_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"batch_idx must be whole numbers; atoms \[1\] have \[0.5\]"):
        Batch(np.zeros((2, 3)), [1, 1], cell=np.zeros((2, 3, 3)), batch_idx=[0.0, 0.5])


def test_pad_refuses_a_fractional_capacity():
    with pytest.raises(ValueError, match="n_atoms must be an integer >= 0, got 4.5"):
        Batch.from_data(AtomicData(np.zeros((2, 3)), [1, 1])).pad(4.5)


def test_singular_periodic_cell_names_system_and_axes():
    cell = np.array([[3.0, 0.0, 0.0], [6.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    with pytest.raises(ValueError, match=r"system 0 is singular on its periodic axes \[0, 1, 2\]"):
        AtomicData(np.zeros((1, 3)), [1], cell=cell, pbc=True)


def test_parallel_periodic_rows_of_a_slab_are_refused():
    cell = np.array([[3.0, 0.0, 0.0], [-1.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match=r"singular on its periodic axes \[0, 1\]"):
        AtomicData(np.zeros((1, 3)), [1], cell=cell, pbc=[True, True, False])


def test_zero_periodic_lattice_vector_is_refused():
    cell = np.diag([3.0, 3.0, 0.0])
    with pytest.raises(ValueError, match=r"zero lattice vector on periodic axis \[2\]"):
        AtomicData(np.zeros((1, 3)), [1], cell=cell, pbc=True)


def test_zero_lattice_vector_on_non_periodic_axis_is_accepted():
    data = AtomicData(np.zeros((1, 3)), [1], cell=np.diag([3.0, 3.0, 0.0]),
                      pbc=[True, True, False])
    assert data.n_atoms == 1


def test_bad_float_dtype_is_refused():
    with pytest.raises(ValueError, match="dtype must be a floating dtype"):
        AtomicData(np.zeros((1, 3)), [1], dtype=jnp.int32)


# -------------------------------------------------------------------------------- Batch


def test_batch_from_ase_builds_batch_idx_and_ptr():
    batch = two_systems()
    n_cu = len(copper())
    np.testing.assert_array_equal(batch.ptr, [0, n_cu, n_cu + 3])
    np.testing.assert_array_equal(batch.batch_idx, [0] * n_cu + [1] * 3)
    assert batch.batch_idx.dtype == jnp.int32 and batch.ptr.dtype == jnp.int32
    assert batch.atom_mask.all() and batch.system_mask.all()
    assert (batch.n_atoms, batch.n_systems) == (n_cu + 3, 2)


def test_batch_from_ase_concatenates_cells_and_pbc():
    batch = two_systems()
    np.testing.assert_allclose(batch.cell[0], copper().cell.array)
    np.testing.assert_allclose(batch.cell[1], water().cell.array)
    np.testing.assert_array_equal(batch.pbc, [[True] * 3, [False] * 3])


def test_batch_from_data_list_fills_missing_charges_and_velocities_with_zeros():
    batch = two_systems()
    n_cu = len(copper())
    np.testing.assert_array_equal(batch.charges[n_cu:], 0.0)
    np.testing.assert_array_equal(batch.velocities[n_cu:], 0.0)


def test_batch_from_data_list_refuses_masses_given_for_some_systems_only():
    with_m = AtomicData.from_ase(water())
    without_m = with_m.replace(masses=None)
    with pytest.raises(ValueError, match=r"masses is given for some systems but not for systems \[1\]"):
        Batch.from_data_list([with_m, without_m])


def test_batch_from_data_has_one_system():
    batch = Batch.from_data(AtomicData.from_ase(water()))
    np.testing.assert_array_equal(batch.ptr, [0, 3])
    np.testing.assert_array_equal(batch.batch_idx, [0, 0, 0])
    assert batch.n_systems == 1


def test_batch_derives_batch_idx_from_ptr():
    batch = Batch(np.zeros((5, 3)), [1] * 5, np.zeros((2, 3, 3)), ptr=[0, 2, 5])
    np.testing.assert_array_equal(batch.batch_idx, [0, 0, 1, 1, 1])


def test_batch_derives_ptr_from_batch_idx():
    batch = Batch(np.zeros((5, 3)), [1] * 5, np.zeros((2, 3, 3)), batch_idx=[0, 0, 1, 1, 1])
    np.testing.assert_array_equal(batch.ptr, [0, 2, 5])


def test_as_batch_wraps_atomic_data_and_passes_batches_through():
    batch = two_systems()
    assert as_batch(batch) is batch
    single = as_batch(AtomicData.from_ase(water()))
    assert isinstance(single, Batch) and single.n_systems == 1


def test_to_data_list_round_trips_every_system():
    atoms_list = [copper(), water()]
    back = two_systems().to_data_list()
    assert len(back) == 2
    for d, atoms in zip(back, atoms_list):
        np.testing.assert_allclose(d.positions, atoms.positions)
        np.testing.assert_array_equal(d.atomic_numbers, atoms.numbers)


def test_to_ase_drops_padding():
    atoms_list = [copper(), water()]
    back = two_systems().pad(20, 5).to_ase()
    assert len(back) == 2
    for got, want in zip(back, atoms_list):
        np.testing.assert_allclose(got.positions, want.positions)
        np.testing.assert_array_equal(got.numbers, want.numbers)
        np.testing.assert_allclose(got.cell.array, want.cell.array)
        np.testing.assert_array_equal(got.pbc, want.pbc)
        np.testing.assert_allclose(got.get_masses(), want.get_masses())


def test_volume_is_abs_det_and_zero_for_padding_and_open_systems():
    batch = Batch.from_ase([copper(), molecule("H2O")]).pad(20, 3)
    np.testing.assert_allclose(batch.volume(), [copper().get_volume(), 0.0, 0.0])


# ---------------------------------------------------------------------------------- pad


def test_pad_keeps_real_data():
    batch = two_systems()
    padded = batch.pad(20, 4)
    n = batch.n_atoms
    np.testing.assert_array_equal(padded.positions[:n], batch.positions)
    np.testing.assert_array_equal(padded.atomic_numbers[:n], batch.atomic_numbers)
    np.testing.assert_array_equal(padded.batch_idx[:n], batch.batch_idx)
    np.testing.assert_array_equal(padded.cell[:2], batch.cell)
    np.testing.assert_array_equal(padded.masses[:n], batch.masses)
    assert (padded.num_real_atoms(), padded.num_real_systems()) == (n, 2)


def test_pad_masks_padding_atoms_and_systems():
    batch = two_systems()
    padded = batch.pad(20, 4)
    n = batch.n_atoms
    assert (padded.n_atoms, padded.n_systems) == (20, 4)
    np.testing.assert_array_equal(padded.atom_mask, np.arange(20) < n)
    np.testing.assert_array_equal(padded.system_mask, [True, True, False, False])
    np.testing.assert_array_equal(padded.positions[n:], 0.0)
    np.testing.assert_array_equal(padded.atomic_numbers[n:], 0)
    np.testing.assert_array_equal(padded.cell[2:], 0.0)
    np.testing.assert_array_equal(padded.pbc[2:], False)
    np.testing.assert_array_equal(padded.ptr, [0, batch.ptr[1], n, n, n])


def test_pad_sets_batch_idx_of_padding_atoms_to_n_systems():
    batch = two_systems()
    padded = batch.pad(20, 4)
    np.testing.assert_array_equal(padded.batch_idx[batch.n_atoms:], 4)


def test_pad_fills_masses_with_one_and_other_optional_fields_with_zero():
    batch = two_systems()
    padded = batch.pad(20)
    n = batch.n_atoms
    np.testing.assert_array_equal(padded.masses[n:], 1.0)
    np.testing.assert_array_equal(padded.charges[n:], 0.0)
    np.testing.assert_array_equal(padded.velocities[n:], 0.0)


def test_pad_keeps_system_capacity_by_default():
    assert two_systems().pad(20).n_systems == 2


def test_repad_to_smaller_capacity_keeps_real_atoms():
    batch = two_systems()
    again = batch.pad(30, 6).pad(batch.n_atoms + 1, 3)
    assert (again.n_atoms, again.n_systems) == (batch.n_atoms + 1, 3)
    np.testing.assert_array_equal(again.positions[: batch.n_atoms], batch.positions)
    np.testing.assert_array_equal(again.batch_idx[batch.n_atoms:], 3)


def test_pad_drops_attached_neighbors():
    batch = two_systems().replace(neighbors={"senders": jnp.zeros(4, jnp.int32)})
    assert batch.pad(20).neighbors is None


def test_pad_refuses_too_few_atoms():
    batch = two_systems()
    with pytest.raises(ValueError, match=rf"n_atoms=3 is smaller than the {batch.n_atoms} real atoms"):
        batch.pad(3)


def test_pad_refuses_too_few_systems():
    with pytest.raises(ValueError, match="n_systems=1 is smaller than the 2 real systems"):
        two_systems().pad(20, 1)


def test_segment_sum_over_batch_idx_drops_padding():
    padded = two_systems().pad(20, 4)
    padded = padded.replace(positions=padded.positions.at[padded.num_real_atoms():].set(100.0))
    ones = jnp.ones(padded.n_atoms)
    counts = jax.ops.segment_sum(ones, padded.batch_idx, padded.n_systems)
    np.testing.assert_array_equal(counts, [len(copper()), 3, 0, 0])
    x_sum = jax.ops.segment_sum(padded.positions[:, 0], padded.batch_idx, padded.n_systems)
    np.testing.assert_allclose(x_sum[:2], [copper().positions[:, 0].sum(),
                                           water().positions[:, 0].sum()])


# -------------------------------------------------------------------------- bad batches


def test_batch_with_an_empty_system_is_refused():
    with pytest.raises(ValueError, match=r"systems \[1\] have no atoms"):
        Batch(np.zeros((3, 3)), [1] * 3, np.zeros((2, 3, 3)), ptr=[0, 3, 3])


def test_batch_idx_disagreeing_with_ptr_is_refused():
    with pytest.raises(ValueError, match=r"batch_idx disagrees with ptr at atoms \[2\]"):
        Batch(np.zeros((3, 3)), [1] * 3, np.zeros((2, 3, 3)), batch_idx=[0, 0, 0], ptr=[0, 2, 3])


def test_batch_without_atoms_is_refused():
    with pytest.raises(ValueError, match="Batch has no atoms"):
        Batch(np.zeros((0, 3)), np.zeros(0, int), np.zeros((1, 3, 3)))


def test_batch_nan_position_names_the_atom():
    batch = two_systems()
    with pytest.raises(ValueError, match=r"positions of atoms \[5\]"):
        batch.replace(positions=batch.positions.at[5, 2].set(jnp.nan))


def test_batch_singular_cell_names_the_system():
    batch = two_systems()
    bad = batch.cell.at[0, 1].set(batch.cell[0, 0] * 2.0)
    with pytest.raises(ValueError, match="cell of system 0 is singular"):
        batch.replace(cell=bad)


def test_batch_zero_periodic_vector_names_system_and_axis():
    batch = two_systems()
    with pytest.raises(ValueError, match=r"system 1 has a zero lattice vector on periodic axis \[0\]"):
        batch.replace(cell=batch.cell.at[1, 0].set(0.0), pbc=batch.pbc.at[1].set(True))


def test_batch_wrong_ptr_length_is_refused():
    with pytest.raises(ValueError, match=r"ptr must have shape \[n_systems \+ 1\] = \[3\]"):
        Batch(np.zeros((3, 3)), [1] * 3, np.zeros((2, 3, 3)), ptr=[0, 3])


# ---------------------------------------------------------------------------- pytrees


def test_flatten_unflatten_round_trip():
    batch = two_systems().pad(20, 4)
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(back, Batch)
    for a, b in zip(jax.tree_util.tree_leaves(back), leaves):
        assert a is b


def test_array_fields_are_leaves_and_absent_fields_are_not():
    data = AtomicData.from_ase(copper(charges=False, velocities=False))
    assert len(jax.tree_util.tree_leaves(data)) == 5  # positions, numbers, cell, pbc, masses


def test_leaves_carry_field_names_in_their_key_paths():
    data = AtomicData.from_ase(water())
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(data)[0]]
    assert ".positions" in paths and ".masses" in paths


def test_neighbors_are_carried_as_a_pytree():
    nbrs = {"senders": jnp.arange(4), "receivers": jnp.arange(4)}
    batch = two_systems().replace(neighbors=nbrs)
    out = jax.jit(lambda b: b)(batch)
    np.testing.assert_array_equal(out.neighbors["receivers"], nbrs["receivers"])


def test_tree_map_to_none_unflattens_without_validation():
    out = jax.tree_util.tree_map(lambda x: None, two_systems())
    assert isinstance(out, Batch) and out.positions is None


def test_unflatten_with_sentinels_and_ints_does_not_validate():
    batch = two_systems()
    sentinel = object()
    marked = jax.tree_util.tree_map(lambda x: sentinel, batch)
    assert marked.cell is sentinel
    axes = jax.tree_util.tree_map(lambda x: 0, batch)
    assert axes.positions == 0


def test_jit_over_a_batch():
    batch = two_systems().pad(20, 4)

    @jax.jit
    def per_system_x(b):
        return jax.ops.segment_sum(b.positions[:, 0], b.batch_idx, b.n_systems)

    expected = jax.ops.segment_sum(batch.positions[:, 0], batch.batch_idx, 4)
    np.testing.assert_allclose(per_system_x(batch), expected)


def test_jit_can_return_a_new_batch():
    batch = two_systems()
    moved = jax.jit(lambda b: b.replace(positions=b.positions + 1.0))(batch)
    assert isinstance(moved, Batch)
    np.testing.assert_allclose(moved.positions, batch.positions + 1.0)


def test_vmap_with_pytree_in_axes_over_stacked_data():
    data = AtomicData.from_ase(water())
    stacked = jax.tree_util.tree_map(lambda x: jnp.stack([x, x]), data)
    in_axes = jax.tree_util.tree_map(lambda x: 0, data)
    com = jax.vmap(lambda d: d.positions.mean(0), in_axes=(in_axes,))(stacked)
    np.testing.assert_allclose(com[1], data.positions.mean(0))


def test_tracers_inside_jit_skip_value_checks():
    pos = np.zeros((2, 3))
    pos[1, 0] = np.nan

    @jax.jit
    def build(p, cell):
        # NaN positions and a singular periodic cell would be refused on concrete values.
        return AtomicData(p, [1, 1], cell=cell, pbc=True).positions

    out = build(pos, jnp.zeros((3, 3)))
    assert np.isnan(out[1, 0])


def test_tracers_inside_jit_still_check_shapes():
    with pytest.raises(ValueError, match="atomic_numbers has 3 entries but positions has 2 rows"):
        jax.jit(lambda p: AtomicData(p, [1, 1, 1]).positions)(np.zeros((2, 3)))


def test_grow_padding_inside_jit():
    batch = two_systems()
    padded = jax.jit(lambda b: b.pad(20, 4))(batch)
    np.testing.assert_array_equal(padded.batch_idx, batch.pad(20, 4).batch_idx)


# ---------------------------------------------------------------------------------- wrap


def _scatter(cell, pbc, n=40, seed=0):
    """Points well inside/outside cell images; none near a cell face."""
    rng = np.random.default_rng(seed)
    frac = rng.uniform(0.05, 0.95, size=(n, 3)) + rng.integers(-3, 4, size=(n, 3))
    frac = np.where(pbc, frac, rng.uniform(-2.0, 2.0, size=(n, 3)))
    return frac @ cell


def test_wrap_fully_periodic_matches_ase():
    cell = triclinic_cell()
    atoms = ase.Atoms("C40", positions=_scatter(cell, [True] * 3), cell=cell, pbc=True)
    got = AtomicData.from_ase(atoms).wrap().positions
    atoms.wrap()
    np.testing.assert_allclose(got, atoms.positions, rtol=0, atol=1e-10)


def test_wrap_slab_matches_ase():
    cell = triclinic_cell()
    cell[2] = [0.0, 0.0, 10.0]  # vacuum axis orthogonal to the periodic plane
    pbc = [True, True, False]
    atoms = ase.Atoms("C40", positions=_scatter(cell, pbc), cell=cell, pbc=pbc)
    got = AtomicData.from_ase(atoms).wrap().positions
    atoms.wrap()
    np.testing.assert_allclose(got, atoms.positions, rtol=0, atol=1e-10)


def test_wrap_slab_with_zero_vacuum_row_matches_ase():
    cell = triclinic_cell()
    cell[2] = 0.0
    pbc = [True, True, False]
    pos = _scatter(cell, pbc) + np.array([0.0, 0.0, 1.0]) * np.arange(40)[:, None]
    atoms = ase.Atoms("C40", positions=pos, cell=cell, pbc=pbc)
    got = AtomicData.from_ase(atoms).wrap().positions
    atoms.wrap()
    np.testing.assert_allclose(got, atoms.positions, rtol=0, atol=1e-10)


def test_wrap_keeps_non_periodic_coordinates():
    cell = np.diag([5.0, 6.0, 7.0])
    pbc = [True, False, True]
    pos = _scatter(cell, pbc)
    got = np.asarray(AtomicData(pos, [6] * 40, cell=cell, pbc=pbc).wrap().positions)
    np.testing.assert_array_equal(got[:, 1], pos[:, 1])
    assert (got[:, [0, 2]] >= 0).all() and (got[:, [0, 2]] < [5.0, 7.0]).all()


def test_wrap_without_pbc_is_identity():
    atoms = water()
    atoms.positions += 50.0
    data = AtomicData.from_ase(atoms)
    np.testing.assert_array_equal(data.wrap().positions, data.positions)


def test_wrap_leaves_atoms_inside_the_cell_bit_for_bit():
    cell = triclinic_cell()
    pos = np.random.default_rng(2).uniform(0.05, 0.95, size=(10, 3)) @ cell
    data = AtomicData(pos, [6] * 10, cell=cell, pbc=True)
    np.testing.assert_array_equal(data.wrap().positions, data.positions)


def test_batch_wrap_wraps_each_system_in_its_own_cell_and_skips_padding():
    cell = triclinic_cell()
    slab_cell = np.diag([4.0, 5.0, 0.0])
    a = ase.Atoms("C20", positions=_scatter(cell, [True] * 3, n=20), cell=cell, pbc=True)
    b = ase.Atoms("O20", positions=_scatter(slab_cell, [True, True, False], n=20, seed=3),
                  cell=slab_cell, pbc=[True, True, False])
    batch = Batch.from_ase([a, b]).pad(48, 3)
    batch = batch.replace(positions=batch.positions.at[40:].set(-7.5))
    got = batch.wrap()
    a.wrap()
    b.wrap()
    np.testing.assert_allclose(got.positions[:20], a.positions, atol=1e-10)
    np.testing.assert_allclose(got.positions[20:40], b.positions, atol=1e-10)
    np.testing.assert_array_equal(got.positions[40:], -7.5)


def test_wrap_positions_is_differentiable_with_identity_jacobian():
    cell = jnp.asarray(triclinic_cell())
    pos = jnp.asarray(_scatter(triclinic_cell(), [True] * 3, n=4))
    jac = jax.jacobian(lambda p: wrap_positions(p, cell, jnp.ones(3, bool)).sum(0))(pos)
    # d(sum_v wrapped[v, i]) / d pos[u, j] = delta_ij: floor contributes nothing.
    np.testing.assert_array_equal(jac, np.broadcast_to(np.eye(3)[:, None, :], (3, 4, 3)))


@settings(max_examples=50, deadline=None)
@given(
    pbc=st.tuples(st.booleans(), st.booleans(), st.booleans()),
    seed=st.integers(0, 2**31 - 1),
)
def test_wrap_moves_atoms_by_periodic_lattice_vectors_into_the_cell(pbc, seed):
    cell = triclinic_cell()
    pbc = np.array(pbc)
    # Non-periodic rows are zeroed, as for vacuum axes; the check is then cell-independent.
    cell = np.where(pbc[:, None], cell, 0.0)
    pos = _scatter(np.where(pbc[:, None], cell, np.eye(3)), pbc, n=16, seed=seed)
    got = np.asarray(wrap_positions(pos, cell, pbc))
    periodic = cell[pbc]
    if periodic.shape[0]:
        # displacement = integer combination of periodic rows
        coeff, *_ = np.linalg.lstsq(periodic.T, (pos - got).T, rcond=None)
        np.testing.assert_allclose(coeff, np.round(coeff), atol=1e-8)
        np.testing.assert_allclose((pos - got) - np.round(coeff).T @ periodic, 0, atol=1e-8)
        # fractional coordinates along periodic rows lie in [0, 1)
        frac, *_ = np.linalg.lstsq(periodic.T, got.T, rcond=None)
        assert (frac > -1e-9).all() and (frac < 1 + 1e-9).all()
    else:
        np.testing.assert_array_equal(got, pos)
