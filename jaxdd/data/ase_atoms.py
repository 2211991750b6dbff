"""Conversions between one system's fields and an ``ase.Atoms`` (host-side).

ASE is imported only when an ``ase.Atoms`` is built, so jaxdd.data does not need it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .fields import default_float, float_dtype

__all__ = ["fields_from_ase", "to_ase_atoms"]


def fields_from_ase(atoms: Any, dtype: Any = None) -> dict[str, Any]:
    """The keyword arguments of ``AtomicData`` for an ``ase.Atoms``.

    Masses are always taken (ASE's defaults when unset); charges only when some initial
    charge is non-zero; velocities only when the atoms carry momenta.

    Args:
      atoms: an ``ase.Atoms``.
      dtype: the float dtype (None: JAX's default float).

    Returns:
      positions [V, 3] Å, atomic_numbers [V], cell [1, 3, 3] Å, pbc [1, 3], masses [V] amu,
      charges [V] e or None, velocities [V, 3] Å / ASE time unit or None, and dtype.
    """
    fdt = float_dtype(dtype) or default_float()
    charges = atoms.get_initial_charges()
    return dict(
        positions=np.asarray(atoms.get_positions()),
        atomic_numbers=np.asarray(atoms.get_atomic_numbers()),
        cell=np.asarray(atoms.cell.array)[None],
        pbc=np.asarray(atoms.pbc)[None],
        masses=np.asarray(atoms.get_masses()),
        charges=np.asarray(charges) if np.any(charges != 0) else None,
        velocities=np.asarray(atoms.get_velocities()) if atoms.has("momenta") else None,
        dtype=fdt,
    )


def to_ase_atoms(data: Any) -> Any:
    """An ``ase.Atoms`` with the same positions, numbers, cell, pbc and optional fields.

    Args:
      data: an ``AtomicData`` (one system).

    Returns:
      ``ase.Atoms``, float fields in float64.
    """
    import ase

    atoms = ase.Atoms(
        numbers=np.asarray(data.atomic_numbers),
        positions=np.asarray(data.positions, dtype=np.float64),
        cell=np.asarray(data.cell[0], dtype=np.float64),
        pbc=np.asarray(data.pbc[0]),
    )
    if data.masses is not None:
        atoms.set_masses(np.asarray(data.masses, dtype=np.float64))
    if data.charges is not None:
        atoms.set_initial_charges(np.asarray(data.charges, dtype=np.float64))
    if data.velocities is not None:
        # ASE stores momenta, so set velocities after masses.
        atoms.set_velocities(np.asarray(data.velocities, dtype=np.float64))
    return atoms
