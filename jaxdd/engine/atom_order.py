"""Per-rank rows back in the batch's atom order, on the host."""

from __future__ import annotations

import numpy as np

from ..data import Batch
from .host import host_array
from .placed import Placed

__all__ = ["atom_order", "unwrapped_positions", "rank_of_atom"]


def atom_order(ids, rows, n_atoms: int) -> np.ndarray:
    """Per-rank rows in the batch's atom order.

    Args:
      ids: [P, n] int global atom index of each row (-1 on free rows).
      rows: [P, n, ...] values of the rows.
      n_atoms: V, the batch's atom count.

    Returns:
      float64 ``[V, ...]`` (zeros for atoms no row holds).
    """
    ids = np.asarray(ids).reshape(-1)
    rows = np.asarray(rows, np.float64).reshape((ids.size,) + np.shape(rows)[2:])
    out = np.zeros((n_atoms,) + rows.shape[1:])
    out[ids[ids >= 0]] = rows[ids >= 0]
    return out


def unwrapped_positions(template: Batch, frame, image=None) -> np.ndarray:
    """Positions [V, 3] Å from the plan's frame, unwrapped by the lattice ``image`` of each
    atom when given; padding rows keep the batch's own positions.

    Args:
      template: the batch (its cell, batch_idx, atom_mask and positions).
      frame: [V, 3] Å positions in the plan's wrapped frame, in the batch's order.
      image: [V, 3] int lattice vectors wrapping removed; None: not unwrapped.
    """
    if image is not None:
        cell = np.asarray(template.cell, np.float64)
        system = np.clip(np.asarray(template.batch_idx), 0, cell.shape[0] - 1)
        frame = frame + np.einsum("vi,vij->vj", image, cell[system])
    return np.where(np.asarray(template.atom_mask)[:, None], frame, np.asarray(template.positions, np.float64))


def rank_of_atom(placed: Placed) -> np.ndarray:
    """The rank owning each atom of the batch of ``placed`` (a :class:`~jaxdd.engine.placed.Placed`),
    [V] (-1: padding); a collective with several processes."""
    ids = host_array(placed.rows.ids)
    out = np.full(placed.template.n_atoms, -1)
    rank, row = np.nonzero(ids >= 0)
    out[ids[rank, row]] = rank
    return out
