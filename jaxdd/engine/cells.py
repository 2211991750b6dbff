"""Positions carried with a moving cell: the map of one cell onto another that keeps
fractional coordinates (barostats, and LAMMPS boxes that change between callbacks)."""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["cell_map", "carry_with_cell"]


def cell_map(old, new, real=None):
    """The [S, 3, 3] M that carries positions of cells ``old`` to ``new`` keeping fractional
    coordinates: x_new = x_old @ M = x_old @ old⁻¹ @ new.

    Args:
      old, new: [S, 3, 3] cells (Å, rows lattice vectors).
      real: [S] the systems to map (default: those whose ``old`` cell has a volume); the
        others get the identity (padding systems' empty cells).

    Returns:
      [S, 3, 3] M, dimensionless.
    """
    if real is None:
        real = jnp.abs(jnp.linalg.det(old)) > 0
    real = real[:, None, None]
    eye = jnp.eye(3, dtype=old.dtype)
    return jnp.einsum("sij,sjk->sik", jnp.linalg.inv(jnp.where(real, old, eye)), jnp.where(real, new, eye))


def carry_with_cell(x, old, new, system, real=None):
    """Positions ``x`` [n, 3] of cells ``old`` carried to ``new`` (:func:`cell_map`).

    Args:
      x: [n, 3] positions (Å) in the cells ``old``.
      old, new: [S, 3, 3] cells (Å, rows lattice vectors).
      system: [n] system of each row.
      real: [S] the systems to map, as for :func:`cell_map`.

    Returns:
      [n, 3] positions in the cells ``new``, at the same fractional coordinates.
    """
    return jnp.einsum("ni,nij->nj", x, cell_map(old, new, real)[system])
