"""The inputs of a neighbour-list build and of its sizing, checked and normalised.

The builder and the sizing passes read the same inputs the same way: an atom of no system
is masked, and the half-list keys are refused where they cannot decide a pair.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..data import is_concrete

__all__ = ["check_cutoff", "check_bond_cutoff", "check_order", "normalise_inputs"]


def check_order(order, n: int, half: bool, pbc):
    """The two half-list keys, checked: only for a half list without periodic axes (the keys
    do not tell a pair's periodic images apart).

    Args:
      order: two [n] integer arrays (key a, key b).
      n: atom rows.
      half: whether the list is a half list (the keys need one).
      pbc: [S, 3] bool; refused when concrete and any axis is periodic.

    Returns:
      The two keys as [n] int32 arrays.

    Raises:
      ValueError: naming what is wrong with ``order``.
    """
    if not half:
        raise ValueError("order decides which row of a pair lists it; it needs half=True")
    keys = tuple(order) if isinstance(order, (tuple, list)) else ()
    if len(keys) != 2:
        raise ValueError(f"order must be two [n_atoms] int32 arrays (key a, key b), got {type(order).__name__}")
    keys = tuple(jnp.asarray(k) for k in keys)
    for name, k in zip(("order[0]", "order[1]"), keys):
        if k.shape != (n,) or not jnp.issubdtype(k.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array of shape ({n},) (one key per atom), got {k.dtype}{k.shape}")
    if is_concrete(pbc) and np.any(np.asarray(pbc)):
        raise ValueError("order is for lists without periodic axes (a rank's owned and ghost rows); with a periodic "
                         "axis use the default half-list rule (order=None)")
    return tuple(k.astype(jnp.int32) for k in keys)


def check_cutoff(cutoff):
    """Refuse a cutoff (Å) that is not a positive finite number (ValueError)."""
    if not (isinstance(cutoff, (int, float, np.floating, np.integer)) and math.isfinite(cutoff) and cutoff > 0):
        raise ValueError(f"cutoff must be a positive finite number, got {cutoff!r}")


def check_bond_cutoff(bond_cutoff, cutoff, format, half: bool):
    """The bond cutoff of a build, checked: None, or 0 < bond_cutoff <= cutoff (Å) on a full
    MATRIX list (bonds are slots of its rows, and a bond's reverse lies in its partner's row).

    Args:
      bond_cutoff: Å, or None (no bonds).
      cutoff: the list's cutoff (Å).
      format: the list's :class:`~jaxdd.neighbors.NeighborListFormat` (its value).
      half: whether the list is a half list.

    Returns:
      The bond cutoff as a float, or None.

    Raises:
      ValueError: naming what is wrong.
    """
    if bond_cutoff is None:
        return None
    if not (isinstance(bond_cutoff, (int, float, np.floating, np.integer)) and not isinstance(bond_cutoff, bool)
            and math.isfinite(bond_cutoff) and 0 < bond_cutoff <= cutoff):
        raise ValueError(f"bond_cutoff must be a number in (0, cutoff = {cutoff}] Å, got {bond_cutoff!r}")
    if getattr(format, "value", format) != "matrix":
        raise ValueError(f"bond_cutoff needs the MATRIX format (bonds are slots of its rows), got {format}")
    if half:
        raise ValueError("bond_cutoff needs a full list (half_list=False): a bond's reverse lies in its partner's row")
    return float(bond_cutoff)


def normalise_inputs(positions, cell, pbc, batch_idx, atom_mask, xp=jnp):
    """The inputs as ``xp`` arrays (``jnp``, or ``np`` on the host), defaults filled in; an
    atom of no system (``batch_idx`` out of range) is masked.

    Args:
      positions: [n_atoms, 3] Å.
      cell: [S, 3, 3] or [3, 3] Å.
      pbc: [S, 3] or [3] bool.
      batch_idx: [n_atoms] system of each atom, or None (all 0).
      atom_mask: [n_atoms] bool, or None (all True).
      xp: ``jnp`` or ``np``.

    Returns:
      (positions [n_atoms, 3], cell [S, 3, 3] in the positions' dtype, pbc [S, 3] bool,
      batch_idx [n_atoms] int32, atom_mask [n_atoms] bool).
    """
    positions = xp.asarray(positions)
    n = positions.shape[0]
    cell = xp.asarray(cell, positions.dtype).reshape(-1, 3, 3)
    pbc = xp.asarray(pbc, bool).reshape(-1, 3)
    batch_idx = xp.zeros(n, xp.int32) if batch_idx is None else xp.asarray(batch_idx, xp.int32)
    atom_mask = xp.ones(n, bool) if atom_mask is None else xp.asarray(atom_mask, bool)
    atom_mask = atom_mask & (batch_idx >= 0) & (batch_idx < cell.shape[0])
    return positions, cell, pbc, batch_idx, atom_mask

