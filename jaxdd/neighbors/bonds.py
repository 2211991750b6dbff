"""Bonds and angles: the neighbours of each atom within a bond cutoff, as slots of its
MATRIX row, with the reverse of every bond; triplets are the pairs of bonds of one row.

Models that pass messages along bonds and update them from angles (M3GNet, CHGNet,
DimeNet) read three things from a :class:`BondList` built beside the MATRIX list
(``NeighborConfig(bond_cutoff=...)``):

* bond ``(i, b)``, for ``b < count[i]``, is the neighbour ``j = matrix[i, slot[i, b]]`` with
  shift ``S = matrix_shifts[i, slot[i, b]]`` and distance below the bond cutoff; the bonds of
  a row are its neighbour slots within the bond cutoff, kept in slot order and compacted to
  the front of the row;
* ``reverse[i, b]`` is the bond ``b'`` of row ``j`` that holds ``(j → i, -S)``: the same
  bond seen from its other end (a per-bond feature symmetrised through it reads
  ``x[j, reverse[i, b]]``);
* the triplets (angles) of atom ``i`` are the pairs ``(b, b')`` of its bonds with
  ``b != b'`` (:func:`triplet_mask`), the angle between the two bond vectors at ``i``.

Padding: ``slot`` = K (the matrix width), ``reverse`` = B (the bond width), ``mask`` False.
The width B is a capacity (``NeighborCapacity.max_bonds``): an atom with more bonds sets the
list's ``overflow`` and the host grows B, like every other capacity; no bond is dropped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BondList", "build_bonds", "triplet_mask", "bond_partners", "bond_vectors", "triplet_cosines",
           "gather_bonds", "reverse_bonds"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BondList:
    """The bonds of every atom row, as slots of the MATRIX list (see the module docstring).

    slot: [V, B] int32 column of ``matrix`` of each bond (padding K).
    mask: [V, B] bool, True for real bonds.
    count: [V] int32 bonds of each atom (may exceed B on overflow).
    reverse: [V, B] int32 bond index in the partner's row of the same bond seen from the
        partner (padding B; also B where the partner's row holds no bonds, e.g. a ghost row
        that is not a receiver).
    """

    slot: jax.Array
    mask: jax.Array
    count: jax.Array
    reverse: jax.Array

    @property
    def width(self) -> int:
        """B, the bond slots of a row."""
        return self.slot.shape[1]


def _matrix_vectors(positions, cell, batch_idx, matrix, matrix_shifts):
    """Receiver → neighbour vectors of every MATRIX slot, [V, K, 3] Å (zero on padding slots)."""
    n = positions.shape[0]
    filled = matrix < n
    sys_idx = jnp.clip(batch_idx, 0, cell.shape[0] - 1)
    shift = jnp.einsum("vki,vij->vkj", matrix_shifts.astype(positions.dtype), cell[sys_idx])
    vec = positions.at[matrix].get(mode="fill", fill_value=0) - positions[:, None, :] + shift
    return jnp.where(filled[..., None], vec, 0.0)


def build_bonds(positions, cell, batch_idx, matrix, matrix_shifts, *, bond_cutoff: float, max_bonds: int) -> BondList:
    """The bonds of a MATRIX neighbour list: the slots within ``bond_cutoff``, compacted, and
    the reverse of each; traceable under ``jit``. Positions are not differentiated through.

    Args:
      positions: [V, 3] Å, as the list was built from (its shifts are relative to them).
      cell: [S, 3, 3] Å, rows lattice vectors.
      batch_idx: [V] int32 system of each atom.
      matrix: [V, K] int32 neighbour of each slot (padding V).
      matrix_shifts: [V, K, 3] int32 image shift of each slot, in cell vectors.
      bond_cutoff: Å; a neighbour at distance < bond_cutoff is a bond.
      max_bonds: B, bond slots per row (static).

    Returns:
      The :class:`BondList`; ``count`` > B in a row means it overflowed (the caller flags it).
    """
    n, k = matrix.shape
    b = int(max_bonds)
    vec = _matrix_vectors(jax.lax.stop_gradient(positions), jax.lax.stop_gradient(cell), batch_idx, matrix,
                          matrix_shifts)
    is_bond = (matrix < n) & (jnp.sum(vec * vec, axis=-1) < float(bond_cutoff) ** 2)  # [V, K]
    count = jnp.sum(is_bond, axis=1, dtype=jnp.int32)
    # Compaction in slot order: the bond's rank among the row's bonds is its column.
    rank = jnp.cumsum(is_bond, axis=1, dtype=jnp.int32) - 1
    col = jnp.where(is_bond & (rank < b), rank, b)  # out of range: dropped (the row overflowed)
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], (n, k))
    slot = jnp.full((n, b), k, jnp.int32).at[rows, col].set(
        jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (n, k)), mode="drop")
    mask = jnp.arange(b)[None, :] < jnp.minimum(count, b)[:, None]
    partner = jnp.where(mask, jnp.take_along_axis(matrix, jnp.minimum(slot, k - 1), axis=1), n)  # [V, B]
    shift = jnp.take_along_axis(matrix_shifts, jnp.minimum(slot, k - 1)[..., None], axis=1)  # [V, B, 3]

    # Reverse: among the bonds of the partner's row, the one back to this atom with the
    # opposite shift. A full list holds each (j, i, -S) once, so at most one matches.
    j = jnp.minimum(partner, n - 1)
    back = (mask[:, :, None] & mask[j] & (partner[j] == jnp.arange(n, dtype=jnp.int32)[:, None, None])
            & (shift[j][..., 0] == -shift[:, :, None, 0]) & (shift[j][..., 1] == -shift[:, :, None, 1])
            & (shift[j][..., 2] == -shift[:, :, None, 2]))  # [V, B, B']
    reverse = jnp.where(jnp.any(back, axis=-1), jnp.argmax(back, axis=-1), b).astype(jnp.int32)
    return BondList(slot=slot, mask=mask, count=count, reverse=reverse)


def triplet_mask(bonds: BondList) -> jax.Array:
    """The triplets (angles) of every row: pairs of distinct bonds of one atom.

    Args:
      bonds: the :class:`BondList`.

    Returns:
      [V, B, B] bool, True at ``(i, b, b')`` when both are bonds of ``i`` and ``b != b'``
      (ordered pairs: each angle appears twice, as ``(b, b')`` and ``(b', b)``).
    """
    width = bonds.width
    return bonds.mask[:, :, None] & bonds.mask[:, None, :] & ~np.eye(width, dtype=bool)


def gather_bonds(x, bonds: BondList, fill=0):
    """The entries of a per-slot array at the bonds of each row.

    Args:
      x: [V, K, ...] an array over the MATRIX slots (e.g. ``matrix``, ``matrix_shifts``, or
        per-edge features).
      bonds: the :class:`BondList`.
      fill: the value of padding bonds.

    Returns:
      [V, B, ...] ``x[i, slot[i, b]]``, ``fill`` on padding bonds.
    """
    idx = jnp.minimum(bonds.slot, x.shape[1] - 1).reshape(bonds.slot.shape + (1,) * (x.ndim - 2))
    picked = jnp.take_along_axis(x, idx, axis=1)
    return jnp.where(bonds.mask.reshape(bonds.mask.shape + (1,) * (x.ndim - 2)), picked, fill)


def bond_partners(neighbors) -> jax.Array:
    """The atom row at the other end of each bond, [V, B] int32 (padding V).

    Args:
      neighbors: a :class:`~jaxdd.neighbors.NeighborList` with ``bonds``.
    """
    return gather_bonds(neighbors.matrix, neighbors.bonds, fill=neighbors.matrix.shape[0])


def reverse_bonds(x, neighbors, fill=0):
    """A per-bond value read at the reverse of every bond: ``x[j, reverse[i, b]]`` for bond
    ``(i, b)`` to ``j`` — the same bond seen from its other end (DimeNet's message ``k → j``
    feeding ``j → i``, or a symmetrisation ``(x + reverse_bonds(x)) / 2``).

    Args:
      x: [V, B, ...] per-bond values.
      neighbors: a :class:`~jaxdd.neighbors.NeighborList` with ``bonds``.
      fill: the value of padding bonds.

    Returns:
      [V, B, ...], ``fill`` on padding bonds. Under decomposition a partner may be a ghost
      row; the dispatch refreshes ``x``'s ghost rows from their owners before this read, and
      the reverse indices count in the owners' bond order (docs/angle_models.md).
    """
    partner = bond_partners(neighbors)
    return x.at[partner, neighbors.bonds.reverse].get(mode="fill", fill_value=fill)


def bond_vectors(positions, cell, batch_idx, neighbors) -> jax.Array:
    """Atom → bond partner vectors, differentiable in positions and cell.

    Args:
      positions: [V, 3] Å. cell: [S, 3, 3] Å. batch_idx: [V] system of each atom.
      neighbors: a :class:`~jaxdd.neighbors.NeighborList` with ``bonds``.

    Returns:
      [V, B, 3] Å, ``positions[j] - positions[i] + S @ cell``; zero on padding bonds.
    """
    bonds = neighbors.bonds
    matrix = gather_bonds(neighbors.matrix, bonds, fill=positions.shape[0])
    shifts = gather_bonds(neighbors.matrix_shifts, bonds)
    return _matrix_vectors(positions, cell, batch_idx, matrix, shifts)


def triplet_cosines(vectors, bonds: BondList) -> jax.Array:
    """Cosine of the angle at atom ``i`` between its bonds ``b`` and ``b'``, with gradients that
    stay finite on padding (safe norms).

    Args:
      vectors: [V, B, 3] Å bond vectors (:func:`bond_vectors`).
      bonds: the :class:`BondList`.

    Returns:
      [V, B, B] cosines; zero off the triplets of :func:`triplet_mask`.
    """
    r2 = jnp.sum(vectors * vectors, axis=-1)
    r = jnp.sqrt(jnp.where(bonds.mask, r2, 1.0))
    unit = vectors / r[..., None]
    cos = jnp.einsum("vbx,vcx->vbc", unit, unit)
    return jnp.where(triplet_mask(bonds), cos, 0.0)
