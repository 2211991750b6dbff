"""Wrapping positions into their cell along the periodic axes only."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .periodic import wrap_fractional

__all__ = ["wrap_positions"]


def wrap_positions(positions: jax.Array, cell: jax.Array, pbc: jax.Array,
                   batch_idx: jax.Array | None = None) -> jax.Array:
    """Wrap positions into the cell along periodic axes only. Pure, jit-friendly.

    Fractional coordinates along the periodic axes are the least-squares solution on the
    periodic rows, ``f = r Pᵀ (P Pᵀ)⁻¹``; non-periodic rows are ignored. This equals the
    usual ``r @ inv(cell)`` when the cell is fully periodic, and equals ASE's ``wrap`` when
    the non-periodic rows are zero or orthogonal to the periodic ones (vacuum slabs, wires,
    molecules). Each atom moves by an integer combination of periodic lattice vectors, so
    its component along non-periodic directions is untouched; atoms already inside the cell
    (0 <= f < 1) are returned bit for bit, and no atom is moved onto the upper face: one a
    rounding error below the lower face (``f > -ulp``) stays where it is, as ASE's ``wrap``
    leaves it (see :mod:`jaxdd.data.periodic`).

    Args:
      positions: [V, 3] Å.
      cell: [S, 3, 3] (or [3, 3]) Å, rows are lattice vectors.
      pbc: [S, 3] (or [3]) bool.
      batch_idx: [V] system of each atom (None: all in system 0; an index >= S, i.e. a
        padding atom, is left untouched).

    Returns:
      [V, 3] Å, the wrapped positions.
    """
    positions = jnp.asarray(positions)
    cell = jnp.asarray(cell).astype(positions.dtype)
    pbc = jnp.asarray(pbc).astype(bool)
    if cell.ndim == 2:
        cell = cell[None]
    pbc = jnp.broadcast_to(pbc, (cell.shape[0], 3))
    n_sys = cell.shape[0]
    if batch_idx is None:
        batch_idx = jnp.zeros(positions.shape[0], jnp.int32)
    real = batch_idx < n_sys
    sys = jnp.where(real, batch_idx, 0)

    periodic_rows = cell * pbc[..., None]
    # Ones on the non-periodic diagonal keep the Gram matrix invertible without coupling
    # to the periodic block (those rows of `periodic_rows` are zero).
    gram = periodic_rows @ jnp.swapaxes(periodic_rows, -1, -2)
    gram = gram + jax.vmap(jnp.diag)((~pbc).astype(cell.dtype))
    to_frac = jnp.swapaxes(periodic_rows, -1, -2) @ jnp.linalg.inv(gram)  # [S, 3, 3]

    frac = jnp.einsum("vi,vij->vj", positions, to_frac[sys])
    _, shift = wrap_fractional(frac, pbc[sys] & real[:, None])
    return positions - jnp.einsum("vi,vij->vj", shift, periodic_rows[sys])
