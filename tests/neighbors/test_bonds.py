"""Specification of jaxdd.neighbors' bonds: the neighbours within a bond cutoff as slots of
the MATRIX rows, their reverses and their triplets, checked against ASE and brute force."""

import dataclasses

import ase
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase.neighborlist import neighbor_list as ase_neighbor_list

import jaxdd
from jaxdd import Batch, NeighborCapacity, NeighborListFormat, build_neighbor_list, neighbor_capacity, neighbor_list
from jaxdd.model.base import BaseModel, ModelConfig, NeighborConfig
from jaxdd.neighbors import (bond_partners, bond_vectors, gather_bonds, local_neighbor_list, triplet_cosines,
                             triplet_mask)

MATRIX = NeighborListFormat.MATRIX
CUTOFF, BOND_CUTOFF = 3.2, 2.3


def triclinic(n, seed, pbc, lengths=(4.2, 4.6, 5.0)):
    """A random triclinic system of ``n`` atoms, some outside the cell."""
    rng = np.random.default_rng(seed)
    cell = np.diag(lengths)
    cell[1, 0], cell[2, 0], cell[2, 1] = 0.9, -0.6, 0.7
    frac = rng.uniform(-0.2, 1.2, (n, 3))
    return ase.Atoms(numbers=[1] * n, positions=frac @ cell, cell=cell, pbc=pbc)


SYSTEMS = [triclinic(18, 0, (True, True, True)), triclinic(14, 1, (True, False, True)),
           triclinic(9, 2, (False, False, False), lengths=(2.5, 2.5, 2.5)),
           triclinic(6, 3, (True, True, True), lengths=(2.0, 2.2, 2.4))]  # cells thinner than the bond cutoff


def batch_bonds(atoms_list, **kw):
    batch = Batch.from_ase(atoms_list)
    nl, cap = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                            cutoff=CUTOFF, format=MATRIX, bond_cutoff=BOND_CUTOFF, **kw)
    return batch, nl, cap


def bond_table(batch, nl):
    """Per row: the list of (j, shift) of its bonds, in bond order (host numpy)."""
    bonds = nl.bonds
    matrix, shifts = np.asarray(nl.matrix), np.asarray(nl.matrix_shifts)
    slot, mask = np.asarray(bonds.slot), np.asarray(bonds.mask)
    return [[(int(matrix[i, s]), tuple(int(x) for x in shifts[i, s])) for s, m in zip(slot[i], mask[i]) if m]
            for i in range(matrix.shape[0])]


def ase_bonds(atoms, cutoff):
    i, j, S = ase_neighbor_list("ijS", atoms, cutoff)
    return {(int(a), int(b), tuple(int(x) for x in s)) for a, b, s in zip(i, j, S)}


def test_bonds_equal_ase_neighbor_list_at_the_bond_cutoff():
    batch, nl, _ = batch_bonds(SYSTEMS)
    table = bond_table(batch, nl)
    ptr = np.asarray(batch.ptr)
    for k, atoms in enumerate(SYSTEMS):
        ours = {(i - ptr[k], j - ptr[k], s) for i in range(ptr[k], ptr[k + 1]) for j, s in table[i]}
        assert ours == ase_bonds(atoms, BOND_CUTOFF), f"system {k}"


def test_bonds_are_the_row_slots_within_the_bond_cutoff_in_slot_order_padded_with_k():
    batch, nl, _ = batch_bonds(SYSTEMS)
    bonds, k = nl.bonds, nl.matrix.shape[1]
    slot, mask, count = np.asarray(bonds.slot), np.asarray(bonds.mask), np.asarray(bonds.count)
    assert bonds.slot.dtype == jnp.int32 and bonds.reverse.dtype == jnp.int32 and bonds.count.dtype == jnp.int32
    np.testing.assert_array_equal(mask.sum(axis=1), count)
    for i in range(slot.shape[0]):
        real = slot[i, : count[i]]
        assert np.all(np.diff(real) > 0), "bonds keep the slot order"
        assert np.all(slot[i, count[i]:] == k), "padding bonds point one past the last slot"
        assert np.all(mask[i, : count[i]]) and not np.any(mask[i, count[i]:]), "bonds are compacted to the front"


def test_reverse_is_the_same_bond_seen_from_its_partner():
    batch, nl, _ = batch_bonds(SYSTEMS)
    table = bond_table(batch, nl)
    reverse, width = np.asarray(nl.bonds.reverse), nl.bonds.width
    for i, row in enumerate(table):
        for b, (j, s) in enumerate(row):
            rb = reverse[i, b]
            assert table[j][rb] == (i, tuple(-x for x in s))
            assert reverse[j, rb] == b, "the reverse of the reverse is the bond itself"
        assert np.all(reverse[i, len(row):] == width), "padding bonds reverse to B"


def test_triplets_equal_a_brute_force_count_of_angles_with_their_cosines():
    batch, nl, _ = batch_bonds(SYSTEMS)
    ptr = np.asarray(batch.ptr)
    vectors = bond_vectors(batch.positions, batch.cell, batch.batch_idx, nl)
    cos, triplets = np.asarray(triplet_cosines(vectors, nl.bonds)), np.asarray(triplet_mask(nl.bonds))
    for k, atoms in enumerate(SYSTEMS):
        # Brute force: every ordered pair of distinct ASE bonds of one atom, and its cosine.
        i_, j_, d_ = ase_neighbor_list("ijD", atoms, BOND_CUTOFF)
        expected = {}
        for i in range(len(atoms)):
            vecs = d_[i_ == i]
            for a in range(len(vecs)):
                for c in range(len(vecs)):
                    if a != c:
                        u, v = vecs[a], vecs[c]
                        expected.setdefault(i, []).append(u @ v / np.linalg.norm(u) / np.linalg.norm(v))
        for i in range(len(atoms)):
            row = ptr[k] + i
            ours = cos[row][triplets[row]]
            assert len(ours) == len(expected.get(i, [])), f"system {k} atom {i}"
            np.testing.assert_allclose(np.sort(ours), np.sort(expected.get(i, [])), atol=1e-12)


def test_bond_vectors_point_from_the_atom_to_its_partners_image():
    batch, nl, _ = batch_bonds(SYSTEMS)
    pos, cell, bidx = (np.asarray(x) for x in (batch.positions, batch.cell, batch.batch_idx))
    vectors = np.asarray(bond_vectors(batch.positions, batch.cell, batch.batch_idx, nl))
    j = np.asarray(bond_partners(nl))
    shifts = np.asarray(gather_bonds(nl.matrix_shifts, nl.bonds))
    m = np.asarray(nl.bonds.mask)
    want = pos[np.minimum(j, len(pos) - 1)] - pos[:, None, :] + np.einsum("vbi,vij->vbj", shifts, cell[bidx])
    np.testing.assert_allclose(vectors[m], want[m], atol=1e-12)
    assert np.all(vectors[~m] == 0) and np.all(j[~m] == len(pos))


def test_a_bond_width_too_small_raises_the_overflow_flag_with_the_bonds_needed():
    batch, nl, cap = batch_bonds(SYSTEMS)
    needed = nl.stats().bonds
    assert needed == int(np.max(np.asarray(nl.bonds.count)))
    small = dataclasses.replace(cap, max_bonds=needed - 1)
    cut = build_neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask, cutoff=CUTOFF,
                              capacity=small, format=MATRIX, bond_cutoff=BOND_CUTOFF)
    assert bool(cut.overflow) and cut.stats().bonds == needed
    assert not small.fits(cut.stats()) and small.grown(cut.stats()).fits(cut.stats())


def test_neighbor_list_grows_the_bond_width_and_finds_every_bond():
    start = neighbor_capacity(*_inputs(SYSTEMS), cutoff=CUTOFF, bond_cutoff=BOND_CUTOFF)
    batch, nl, cap = batch_bonds(SYSTEMS, capacity=dataclasses.replace(start, max_bonds=1))
    assert cap.max_bonds > 1 and not bool(nl.overflow)
    _, full, _ = batch_bonds(SYSTEMS)
    assert bond_table(batch, nl) == bond_table(batch, full)


def _inputs(atoms_list):
    b = Batch.from_ase(atoms_list)
    return b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask


def test_sizing_counts_the_most_bonds_of_one_atom():
    batch, nl, _ = batch_bonds(SYSTEMS)
    cap = neighbor_capacity(*_inputs(SYSTEMS), cutoff=CUTOFF, headroom=1.0, bond_cutoff=BOND_CUTOFF)
    assert cap.max_bonds == int(np.max(np.asarray(nl.bonds.count)))


def test_a_list_without_bond_cutoff_carries_no_bonds():
    b = Batch.from_ase(SYSTEMS)
    nl, _ = neighbor_list(b.positions, b.cell, b.pbc, b.batch_idx, b.atom_mask, cutoff=CUTOFF, format=MATRIX)
    assert nl.bonds is None and nl.stats().bonds == 0


def test_a_rank_list_reverses_bonds_only_into_receiver_rows():
    # Rows past n_receivers (a rank's ghosts) hold no neighbours, so a bond to one has no reverse.
    atoms = triclinic(24, 5, (False, False, False), lengths=(5.0, 5.0, 5.0))
    pos = jnp.asarray(atoms.positions)
    n_recv = 12
    cap = NeighborCapacity(max_edges=600, max_neighbors=24, max_candidates=24, search_range=(2, 2, 2), max_bonds=24)
    nl = local_neighbor_list(pos, jnp.zeros(24, jnp.int32), jnp.ones(24, bool), n_systems=1, cutoff=CUTOFF,
                             capacity=cap, format=MATRIX, n_receivers=n_recv, bond_cutoff=BOND_CUTOFF)
    j = np.asarray(bond_partners(nl))
    m, rev = np.asarray(nl.bonds.mask), np.asarray(nl.bonds.reverse)
    assert not np.any(m[n_recv:]), "non-receiver rows have no bonds"
    to_ghost = m & (j >= n_recv)
    assert np.any(to_ghost) and np.all(rev[to_ghost] == nl.bonds.width)
    assert np.all(rev[m & ~to_ghost] < nl.bonds.width)


@pytest.mark.parametrize("kw, match", [
    (dict(bond_cutoff=2.0), "MATRIX"),
    (dict(bond_cutoff=2.0, format=MATRIX, half_list=True), "half_list=False"),
    (dict(bond_cutoff=3.5, format=MATRIX), r"\(0, cutoff = 3.0\]"),
    (dict(bond_cutoff=0.0, format=MATRIX), r"\(0, cutoff = 3.0\]"),
    (dict(max_bonds=8, format=MATRIX), "needs a bond_cutoff"),
    (dict(bond_cutoff=2.0, max_bonds=0, format=MATRIX), "max_bonds must be an integer >= 1"),
])
def test_a_bond_cutoff_the_list_cannot_carry_is_refused_naming_why(kw, match):
    with pytest.raises(ValueError, match=match):
        NeighborConfig(cutoff=3.0, **kw)


def test_the_builder_refuses_bonds_on_a_coo_list():
    with pytest.raises(ValueError, match="MATRIX"):
        neighbor_list(*_inputs(SYSTEMS[:1]), cutoff=CUTOFF, bond_cutoff=BOND_CUTOFF)


class _TripletModel(eqx.Module, BaseModel):
    """Energy = Σ over triplets of cos² θ · (r_b r_b')⁻¹ (eV): reads only the bond list."""

    model_config: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(
        outputs=frozenset({"energy", "forces"}), autograd_outputs=frozenset({"forces"}),
        autograd_inputs=frozenset({"positions"}),
        neighbor_config=NeighborConfig(cutoff=CUTOFF, format=MATRIX, bond_cutoff=BOND_CUTOFF, max_bonds=1)))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        vec = bond_vectors(data.positions, data.cell, data.batch_idx, data.neighbors)
        bonds = data.neighbors.bonds
        r = jnp.sqrt(jnp.where(bonds.mask, jnp.sum(vec * vec, -1), 1.0))
        cos = triplet_cosines(vec, bonds)
        per_atom = jnp.sum(jnp.where(triplet_mask(bonds), cos**2 / (r[:, :, None] * r[:, None, :]), 0.0), (1, 2))
        per_atom = jnp.where(data.atom_mask, per_atom, 0.0)
        return {"energy": jax.ops.segment_sum(per_atom, data.batch_idx, data.n_systems)}


def test_compute_builds_bonds_for_a_batch_growing_a_too_small_bond_width():
    one_bond = dataclasses.replace(neighbor_capacity(*_inputs(SYSTEMS), cutoff=CUTOFF), max_bonds=1)
    out = jaxdd.compute(_TripletModel(), Batch.from_ase(SYSTEMS), ("energy",), capacity=one_bond, max_rebuilds=1)
    for k, atoms in enumerate(SYSTEMS):
        i_, d_ = ase_neighbor_list("iD", atoms, BOND_CUTOFF)
        e = 0.0
        for i in range(len(atoms)):
            v = d_[i_ == i]
            r = np.linalg.norm(v, axis=1)
            c = (v @ v.T) / np.outer(r, r)
            e += np.sum(np.where(~np.eye(len(v), dtype=bool), c**2 / np.outer(r, r), 0.0))
        np.testing.assert_allclose(float(out["energy"][k]), e, rtol=1e-12)
