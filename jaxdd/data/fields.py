"""Coercion of user-given fields to arrays, with their shapes checked.

Float fields share one dtype (see :func:`coerce_atoms`); integer fields (atomic numbers,
``batch_idx``, ``ptr``) become int32 and a fraction is refused, never truncated. Shape
checks run always, traced or not; value checks are in :mod:`jaxdd.data.validation`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .checks import integral_array

__all__ = ["default_float", "float_dtype", "coerce_positions", "coerce_float", "coerce_int",
           "coerce_cell", "coerce_pbc", "coerce_atoms", "check_shapes"]


def default_float() -> Any:
    """JAX's default float dtype: float64 with ``jax_enable_x64``, else float32."""
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def float_dtype(dtype: Any) -> Any:
    """``dtype`` as a numpy floating dtype, or None when None.

    Args:
      dtype: a floating dtype (``jnp.float32``, ``"float64"`` ...) or None.

    Raises:
      ValueError: when ``dtype`` is not a floating dtype.
    """
    if dtype is None:
        return None
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype (e.g. jnp.float32), got {dtype}")
    return dtype


def coerce_positions(positions: Any, dtype: Any) -> jax.Array:
    """``positions`` as an array of ``dtype`` (None: its own dtype when floating, else JAX's
    default float)."""
    x = jnp.asarray(positions, dtype=dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(default_float())
    return x


def coerce_float(x: Any, dtype: Any) -> jax.Array | None:
    """``x`` as an array of ``dtype``, or None when None."""
    return None if x is None else jnp.asarray(x).astype(dtype)


def coerce_int(x: Any, name: str, what: str = "entries") -> jax.Array | None:
    """``x`` as an int32 array, or None when None.

    Args:
      x: integers, or whole floats (``18.0``).
      name: the field named in an error message.
      what: what the entries are, in an error message (``"atoms"``, ``"entries"``).

    Raises:
      ValueError: when an entry is not a whole number.
    """
    # A fraction (18.7, or 17.9999999 from a conversion) is refused, never truncated.
    return None if x is None else jnp.asarray(integral_array(name, x, what=what)).astype(jnp.int32)


def coerce_cell(cell: Any, n_systems: int | None, dtype: Any, owner: str) -> jax.Array:
    """The cell as an [S, 3, 3] array of ``dtype`` (Å, lattice vectors as rows).

    Args:
      cell: [S, 3, 3] or [3, 3] (one system), or None: zeros for ``n_systems`` systems.
      n_systems: how many zero cells a None cell gives (None: 1).
      dtype: the float dtype.
      owner: the class named in an error message.

    Returns:
      [S, 3, 3] array.
    """
    if cell is None:
        return jnp.zeros((n_systems or 1, 3, 3), dtype)
    cell = jnp.asarray(cell).astype(dtype)
    if cell.shape == (3, 3):
        cell = cell[None]
    if cell.ndim != 3 or cell.shape[1:] != (3, 3):
        raise ValueError(
            f"{owner}: cell must have shape [n_systems, 3, 3] (or [3, 3] for one system) "
            f"with lattice vectors as rows, got shape {tuple(cell.shape)}"
        )
    return cell


def coerce_pbc(pbc: Any, n_systems: int, owner: str) -> jax.Array:
    """Periodicity as an [S, 3] bool array.

    Args:
      pbc: a bool, a [3] array (the same for every system), an [S, 3] array, or None (all
        False).
      n_systems: S.
      owner: the class named in an error message.

    Returns:
      [S, 3] bool array.
    """
    if pbc is None:
        return jnp.zeros((n_systems, 3), bool)
    pbc = jnp.asarray(pbc).astype(bool)
    if pbc.ndim == 0 or pbc.shape == (3,):
        pbc = jnp.broadcast_to(pbc, (n_systems, 3))
    if pbc.shape != (n_systems, 3):
        raise ValueError(
            f"{owner}: pbc must be a bool, a [3] array or a [n_systems, 3] = "
            f"[{n_systems}, 3] array, got shape {tuple(pbc.shape)}"
        )
    return pbc


def coerce_atoms(owner, positions, atomic_numbers, charges, masses, velocities, dtype):
    """Per-atom fields as arrays (floats in one dtype), with their shapes checked.

    Args:
      owner: the class named in an error message.
      positions: [V, 3] Å.
      atomic_numbers: [V] integers.
      charges: [V] e, or None.
      masses: [V] amu, or None.
      velocities: [V, 3] Å / ASE time unit, or None.
      dtype: the float dtype; None: that of a floating ``positions``, else JAX's default.

    Returns:
      ``(positions, atomic_numbers, charges, masses, velocities)``, atomic numbers int32.
    """
    positions = coerce_positions(positions, float_dtype(dtype))
    fdt = positions.dtype
    fields = (positions, coerce_int(atomic_numbers, f"{owner}: atomic_numbers", "atoms"), coerce_float(charges, fdt),
              coerce_float(masses, fdt), coerce_float(velocities, fdt))
    check_shapes(owner, *fields)
    return fields


def check_shapes(owner: str, positions, atomic_numbers, charges, masses, velocities) -> int:
    """Check that the per-atom fields have one row per atom.

    Args:
      owner: the class named in an error message.
      positions: [V, 3] array.
      atomic_numbers: [V] array (required).
      charges: [V] array or None.
      masses: [V] array or None.
      velocities: [V, 3] array or None.

    Returns:
      V, the number of atoms (at least 1).

    Raises:
      ValueError: saying which field has which wrong shape.
    """
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(
            f"{owner}: positions must have shape [n_atoms, 3], got shape "
            f"{tuple(positions.shape)}; reshape to one row (x, y, z) per atom"
        )
    n = positions.shape[0]
    if atomic_numbers is None:
        raise ValueError(f"{owner}: atomic_numbers is required, one per atom")
    if n == 0:
        raise ValueError(f"{owner} has no atoms: positions has 0 rows; give at least one atom")
    for name, arr, tail in (
        ("atomic_numbers", atomic_numbers, ()),
        ("charges", charges, ()),
        ("masses", masses, ()),
        ("velocities", velocities, (3,)),
    ):
        if arr is None:
            continue
        if arr.shape != (n, *tail):
            if arr.ndim >= 1 and arr.shape[1:] == tail:
                raise ValueError(
                    f"{owner}: {name} has {arr.shape[0]} entries but positions has {n} rows; "
                    f"give one entry per atom"
                )
            want = "[n_atoms]" if not tail else "[n_atoms, 3]"
            raise ValueError(
                f"{owner}: {name} must have shape {want} = {(n, *tail)}, "
                f"got shape {tuple(arr.shape)}"
            )
    return n
