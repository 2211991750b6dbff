"""The perpendicular widths of a cell: how far apart its opposite faces are.

A model that takes minimum-image displacements is right only while every periodic width
exceeds twice its range; a neighbour search in cells needs the width to count its bins. The
same formula serves host checks (numpy) and checks inside ``jit`` (JAX arrays).
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["cell_widths"]


def cell_widths(cell):
    """Distances between opposite faces of each cell.

    Works on numpy arrays (host checks) and JAX arrays (inside ``jit``) alike.

    Args:
      cell: [..., 3, 3] Å, rows the lattice vectors.

    Returns:
      [..., 3] Å: entry k is the cell's extent along the normal of the face spanned by the
      other two vectors, ``|det(cell)| / |a_(k+1) × a_(k+2)|`` (0 for a cell without volume).
    """
    xp = jax.numpy if isinstance(cell, jax.Array) else np
    a, b, c = cell[..., 0, :], cell[..., 1, :], cell[..., 2, :]
    faces = xp.stack([xp.cross(b, c), xp.cross(c, a), xp.cross(a, b)], axis=-2)  # normal of the face opposite a_k
    volume = xp.abs(xp.sum(a * faces[..., 0, :], axis=-1))[..., None]
    area = xp.sqrt(xp.sum(faces * faces, axis=-1))
    return volume / xp.where(area > 0, area, 1.0)
