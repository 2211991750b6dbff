"""One atomic system as a frozen JAX pytree: :class:`AtomicData`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from .ase_atoms import fields_from_ase, to_ase_atoms
from .fields import coerce_atoms, coerce_cell, coerce_pbc
from .pytree import register, replaced, set_fields
from .validation import check_atom_values, check_cells
from .wrap import wrap_positions

__all__ = ["AtomicData"]


class AtomicData:
    """One atomic system.

    positions: [V, 3] Å. atomic_numbers: [V] int32 (>= 1).
    cell: [1, 3, 3] Å, lattice vectors as rows (cart = frac @ cell); rows may be zero on
    non-periodic axes; default zeros. pbc: [1, 3] bool; default all False.
    charges: [V] e, masses: [V] amu, velocities: [V, 3] Å / ASE time unit; each optional.

    ``cell`` may be given as [3, 3] and ``pbc`` as [3] or a single bool. Float fields share
    one dtype: ``dtype`` if given, else that of a floating ``positions``, else JAX's default
    float (float64 only with ``jax_enable_x64``).
    """

    positions: jax.Array
    atomic_numbers: jax.Array
    cell: jax.Array
    pbc: jax.Array
    charges: jax.Array | None
    masses: jax.Array | None
    velocities: jax.Array | None

    def __init__(self, positions, atomic_numbers, cell=None, pbc=None, *, charges=None,
                 masses=None, velocities=None, dtype=None):
        owner = "AtomicData"
        positions, atomic_numbers, charges, masses, velocities = coerce_atoms(
            owner, positions, atomic_numbers, charges, masses, velocities, dtype
        )
        fdt = positions.dtype
        cell = coerce_cell(cell, 1, fdt, owner)
        if cell.shape[0] != 1:
            raise ValueError(
                f"{owner}: cell must describe one system ([3, 3] or [1, 3, 3]), got shape "
                f"{tuple(cell.shape)}; use Batch for several systems"
            )
        pbc = coerce_pbc(pbc, 1, owner)

        check_atom_values(owner, positions, atomic_numbers, charges, masses, velocities, None)
        check_cells(owner, cell, pbc, None)
        set_fields(self, positions=positions, atomic_numbers=atomic_numbers, cell=cell,
                   pbc=pbc, charges=charges, masses=masses, velocities=velocities)

    @property
    def n_atoms(self) -> int:
        """Number of atoms V (static)."""
        return self.positions.shape[0]

    def replace(self, **changes: Any) -> "AtomicData":
        """A validated copy with ``changes`` (field name → new value) applied (:func:`~jaxdd.data.pytree.replaced`)."""
        return replaced(self, **changes)

    def wrap(self) -> "AtomicData":
        """A copy with positions wrapped into the cell on periodic axes (see `wrap_positions`)."""
        return self.replace(positions=wrap_positions(self.positions, self.cell, self.pbc))

    def volume(self) -> jax.Array:
        """[1] cell volume |det cell| in Å³ (0 when a row is zero or the rows are dependent)."""
        return jnp.abs(jnp.linalg.det(self.cell))

    @classmethod
    def from_ase(cls, atoms: Any, dtype: Any = None) -> "AtomicData":
        """From the ``ase.Atoms`` ``atoms``, floats of ``dtype`` (None: JAX's default); what is
        taken from it: :func:`~jaxdd.data.ase_atoms.fields_from_ase`."""
        return cls(**fields_from_ase(atoms, dtype))

    def to_ase(self) -> Any:
        """An ``ase.Atoms`` with the same positions, numbers, cell, pbc and optional fields."""
        return to_ase_atoms(self)


register(AtomicData, ("positions", "atomic_numbers", "cell", "pbc", "charges", "masses",
                      "velocities"))
