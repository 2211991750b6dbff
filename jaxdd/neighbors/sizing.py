"""Sizing a neighbour list on the host: the capacities a configuration needs.

:func:`neighbor_capacity` runs small device passes (binning, candidate count, then a pair
count that stores no pairs), so the sizes are exact for the positions given, with headroom
for the atoms to move.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import programs
from ..data.checks import integral
from .capacity import headroom as with_headroom
from .cell_list import bin_atoms, block_counts, candidate_mask, search_lengths
from .formats import NeighborCapacity, capacity_bucket
from .inputs import check_bond_cutoff, check_cutoff, check_order, normalise_inputs

__all__ = ["neighbor_capacity", "PAIR_COUNT_SLOTS"]

# The sizing passes below compile once per bucket of rows (capacity_bucket) and take the cutoff
# and the receiver count as data: systems of nearby sizes and any cutoff share their programs.
# Padding rows are masked atoms, which no pass bins or counts.


def _receiving(atom_mask, rows, n_receivers):
    return atom_mask[:rows] & (jnp.arange(rows) < n_receivers)


@programs.track
@jax.jit(static_argnames=("table",))
def _range_stats(positions, cell, pbc, batch_idx, atom_mask, lengths, table):
    return bin_atoms(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], table)["need"]


@programs.track
@jax.jit(static_argnames=("table", "search_range", "rows"))
def _candidate_stats(positions, cell, pbc, batch_idx, atom_mask, lengths, n_receivers, table, search_range, rows):
    g = bin_atoms(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], table)
    _, count, _ = block_counts(g, pbc, _receiving(atom_mask, rows, n_receivers), search_range, table, rows)
    return jnp.max(jnp.sum(count, axis=1), initial=0)


#: Candidate slots the pair count examines at once (rows x candidates per row): the count of
#: a larger system runs in blocks of rows, so sizing needs memory for one block (a few GB),
#: not for every candidate of every atom.
PAIR_COUNT_SLOTS = 1 << 25


def _count_block_rows(rows: int, candidates: int, slots: int) -> int:
    """Rows the pair count takes at once: all of them, or a power of two under ``slots`` /
    ``candidates`` (at least 64)."""
    fit = max(slots // max(candidates, 1), 64)
    return rows if rows <= fit else 1 << (fit.bit_length() - 1)


@programs.track
@jax.jit(static_argnames=("half", "capacity", "rows", "slots"))
def _pair_stats(positions, cell, pbc, batch_idx, atom_mask, lengths, n_receivers, half, capacity, rows, slots,
                order=None):
    """(pairs, most pairs of one receiver) of the first ``rows`` rows, in blocks of about
    ``slots`` candidate slots."""
    receiving = _receiving(atom_mask, rows, n_receivers)
    block = _count_block_rows(rows, capacity.max_candidates, slots)

    def pairs(recv, start=None, bins=None):  # (pairs, most of one receiver) of ``block`` rows
        mask, _ = candidate_mask(positions, cell, pbc, batch_idx, atom_mask, cutoff=None, half=half, capacity=capacity,
                                 n_receivers=block, lengths=lengths, receiving=recv, order=order, bins=bins,
                                 row_start=start)
        per_atom = jnp.sum(mask, axis=1, dtype=jnp.int32)
        return jnp.sum(per_atom), jnp.max(per_atom, initial=0)

    if block == rows:
        return pairs(receiving)
    g = bin_atoms(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], capacity.table_size(positions.shape[0]))

    def count(nominal):
        # The last block is moved back to end at the last row; rows an earlier block counted
        # are left out of it.
        start = jnp.minimum(nominal, rows - block)
        again = start + jnp.arange(block) < nominal
        return pairs(jax.lax.dynamic_slice_in_dim(receiving, start, block) & ~again, start, g)

    sums, peaks = jax.lax.map(count, jnp.arange(0, rows, block, dtype=jnp.int32))
    return jnp.sum(sums), jnp.max(peaks)


def _padded_rows(positions, cell, pbc, batch_idx, atom_mask, rows: int):
    """Host copies of the inputs with ``rows`` atom rows: the extra ones are masked atoms of
    system 0 (numpy, so sizing compiles no small programs of its own)."""
    positions, cell, pbc, batch_idx, atom_mask = normalise_inputs(positions, cell, pbc, batch_idx, atom_mask, xp=np)
    extra = rows - positions.shape[0]
    return (np.pad(positions, ((0, extra), (0, 0))), cell, pbc, np.pad(batch_idx, (0, extra)),
            np.pad(atom_mask, (0, extra)))


def neighbor_capacity(
    positions, cell, pbc, batch_idx=None, atom_mask=None, *,
    cutoff: float,
    half: bool = False,
    headroom: float = 1.2,
    bin_divisions: int = 2,
    n_receivers: int | None = None,
    order=None,
    bond_cutoff: float | None = None,
) -> NeighborCapacity:
    """Host-side sizing: the capacities this configuration needs, times ``headroom``.

    Runs small device passes (binning, candidate count, then a pair count that stores no
    pairs; compiled once per size bucket of rows, for any cutoff), so the result is exact
    for these positions; ``headroom`` leaves room for atoms
    to move before the capacity overflows. Past :data:`PAIR_COUNT_SLOTS` candidate slots the
    pair count runs in blocks of rows.

    Args:
      positions, cell, pbc, batch_idx, atom_mask, cutoff, n_receivers, order: the system and
        the build, as in :func:`~jaxdd.neighbors.build_neighbor_list`.
      half: size a half list.
      headroom: factor (>= 1) on the edge, neighbour, candidate and bond slots needed.
      bin_divisions: bins per cutoff length.
      bond_cutoff: Å, or None: size the bond slots of a list with bonds too (a second pair
        count, to the bond cutoff; the list must be a full one, its format is not asked).

    Returns:
      The :class:`~jaxdd.neighbors.NeighborCapacity` to build this configuration with.
    """
    check_cutoff(cutoff)
    if bond_cutoff is not None:
        bond_cutoff = check_bond_cutoff(bond_cutoff, cutoff, "matrix", half)
    if not headroom >= 1.0:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    cutoff, divisions = float(cutoff), integral("neighbor_capacity: bin_divisions", bin_divisions, minimum=1)
    positions = np.asarray(positions)
    positions = positions.astype(jax.dtypes.canonicalize_dtype(positions.dtype))  # the dtype JAX computes in
    dtype = positions.dtype
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(f"neighbor_capacity: positions must be [n_atoms, 3], got shape {positions.shape}")
    n = positions.shape[0]
    n_receivers = n if n_receivers is None else integral("neighbor_capacity: n_receivers", n_receivers, minimum=0)
    # The table of the list being sized (its real rows), whatever the padding.
    table = NeighborCapacity(1, 1, 1, (1, 1, 1)).table_size(n)
    lengths = np.asarray((*search_lengths(cutoff, divisions, dtype), cutoff * cutoff), dtype)
    padded = capacity_bucket(n, minimum=64)
    args = _padded_rows(positions, cell, pbc, batch_idx, atom_mask, padded)
    rows = min(capacity_bucket(n_receivers, minimum=64), padded)
    rng = tuple(int(r) for r in np.asarray(_range_stats(*args, lengths, table=table)))
    candidates = int(_candidate_stats(*args, lengths, n_receivers, table=table, search_range=rng, rows=rows))
    probe = NeighborCapacity(1, 1, with_headroom(candidates, headroom), rng, divisions)
    # The pair count runs with bucketed candidate slots (the counts do not depend on spare
    # slots), so configurations of similar size share its compiled program.
    if order is not None:  # the keys of the padded rows too (those rows are masked)
        order = tuple(np.pad(np.asarray(k, np.int32), (0, padded - n)) for k in check_order(order, n, half, pbc))
    edges, neighbors = _pair_stats(*args, lengths, n_receivers, half=bool(half),
                                   capacity=dataclasses.replace(probe.bucketed(), max_bins=table), rows=rows,
                                   slots=PAIR_COUNT_SLOTS, order=order)
    bonds = 1
    if bond_cutoff is not None:  # the same search with the bond cutoff's square as the threshold
        bond_lengths = lengths.copy()
        bond_lengths[2] = bond_cutoff * bond_cutoff
        _, most = _pair_stats(*args, bond_lengths, n_receivers, half=False,
                              capacity=dataclasses.replace(probe.bucketed(), max_bins=table), rows=rows,
                              slots=PAIR_COUNT_SLOTS)
        bonds = with_headroom(int(most), headroom)
    return dataclasses.replace(
        probe, max_edges=with_headroom(int(edges), headroom), max_neighbors=with_headroom(int(neighbors), headroom),
        max_bonds=bonds)

