"""Several atomic systems, concatenated and padded to static capacities: :class:`Batch`,
and :func:`as_batch`, the batch view every driver takes."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .atomic_data import AtomicData
from .concat import concatenated_fields, split_systems
from .fields import coerce_atoms, coerce_cell, coerce_int, coerce_pbc
from .padding import padded_fields
from .pytree import register, replaced, set_fields
from .validation import check_atom_values, check_cells, check_layout, is_concrete
from .wrap import wrap_positions

__all__ = ["Batch", "as_batch"]


class Batch:
    """Several atomic systems, concatenated and possibly padded to static capacities.

    positions: [V, 3] Å. atomic_numbers: [V] int32 (0 on padding atoms).
    cell: [S, 3, 3] Å (rows are lattice vectors). pbc: [S, 3] bool.
    batch_idx: [V] int32 system of each atom; padding atoms get S (one past the last
    system), so ``jax.ops.segment_sum(x, batch_idx, S)`` drops them.
    ptr: [S + 1] int32; the atoms of system s are rows ptr[s]:ptr[s+1]. ptr counts real
    atoms only: padding atoms are rows >= ptr[S], and padding systems repeat ptr[S].
    atom_mask: [V] bool, system_mask: [S] bool; True on real rows.
    charges: [V] e, masses: [V] amu, velocities: [V, 3] Å / ASE time unit; optional.
    neighbors: any pytree or None; a neighbour list attached by the compute driver, carried
    along untouched.

    Real atoms come first, sorted by system; real systems come first; every real system has
    at least one atom. Give ``batch_idx`` or ``ptr`` (the other is derived; with neither, S
    must be 1 and every atom is real). ``atom_mask`` defaults to ``batch_idx < S`` and
    ``system_mask`` to all True (pass it when the batch has padding systems; `pad` does).
    """

    positions: jax.Array
    atomic_numbers: jax.Array
    cell: jax.Array
    pbc: jax.Array
    batch_idx: jax.Array
    ptr: jax.Array
    atom_mask: jax.Array
    system_mask: jax.Array
    charges: jax.Array | None
    masses: jax.Array | None
    velocities: jax.Array | None
    neighbors: Any

    def __init__(self, positions, atomic_numbers, cell, pbc=None, batch_idx=None, ptr=None,
                 atom_mask=None, system_mask=None, *, charges=None, masses=None,
                 velocities=None, neighbors=None, dtype=None):
        owner = "Batch"
        positions, atomic_numbers, charges, masses, velocities = coerce_atoms(
            owner, positions, atomic_numbers, charges, masses, velocities, dtype
        )
        fdt = positions.dtype
        n_atoms = positions.shape[0]
        cell = coerce_cell(cell, None, fdt, owner)
        n_sys = cell.shape[0]
        if n_sys == 0:
            raise ValueError(f"{owner} has no systems: cell has shape {tuple(cell.shape)}")
        pbc = coerce_pbc(pbc, n_sys, owner)
        batch_idx = coerce_int(batch_idx, f"{owner}: batch_idx", "atoms")
        ptr = coerce_int(ptr, f"{owner}: ptr")

        if batch_idx is None and ptr is None:
            if n_sys != 1:
                raise ValueError(
                    f"{owner}: give batch_idx or ptr to say which of the {n_sys} systems "
                    f"each atom belongs to"
                )
            batch_idx = jnp.zeros(n_atoms, jnp.int32)
        if ptr is not None and ptr.shape != (n_sys + 1,):
            raise ValueError(
                f"{owner}: ptr must have shape [n_systems + 1] = [{n_sys + 1}], "
                f"got shape {tuple(ptr.shape)}"
            )
        if batch_idx is not None and batch_idx.shape != (n_atoms,):
            raise ValueError(
                f"{owner}: batch_idx has shape {tuple(batch_idx.shape)} but positions has "
                f"{n_atoms} rows; give one system index per atom"
            )
        if ptr is None:
            # Padding atoms (index S) fall outside the S segments and are not counted.
            counts = jax.ops.segment_sum(jnp.ones(n_atoms, jnp.int32), batch_idx, n_sys)
            ptr = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
        if batch_idx is None:
            rows = jnp.arange(n_atoms, dtype=jnp.int32)
            batch_idx = (jnp.searchsorted(ptr, rows, side="right") - 1).astype(jnp.int32)
            batch_idx = jnp.where(rows >= ptr[-1], n_sys, batch_idx)
        atom_mask = batch_idx < n_sys if atom_mask is None else jnp.asarray(atom_mask).astype(bool)
        # Every system is real unless said otherwise, so that an empty system is refused
        # rather than silently taken for padding.
        system_mask = (jnp.ones(n_sys, bool) if system_mask is None
                       else jnp.asarray(system_mask).astype(bool))
        if atom_mask.shape != (n_atoms,):
            raise ValueError(
                f"{owner}: atom_mask must have shape [n_atoms] = [{n_atoms}], "
                f"got shape {tuple(atom_mask.shape)}"
            )
        if system_mask.shape != (n_sys,):
            raise ValueError(
                f"{owner}: system_mask must have shape [n_systems] = [{n_sys}], "
                f"got shape {tuple(system_mask.shape)}"
            )

        if is_concrete(batch_idx, ptr, atom_mask, system_mask):
            check_layout(owner, batch_idx, ptr, atom_mask, system_mask)
        # Traced masks: the per-atom / per-system value checks below cover all rows.
        real_atoms = np.asarray(atom_mask) if is_concrete(atom_mask) else None
        real_systems = np.asarray(system_mask) if is_concrete(system_mask) else None
        check_atom_values(owner, positions, atomic_numbers, charges, masses, velocities,
                           real_atoms)
        check_cells(owner, cell, pbc, real_systems)

        set_fields(self, positions=positions, atomic_numbers=atomic_numbers, cell=cell,
                   pbc=pbc, batch_idx=batch_idx, ptr=ptr, atom_mask=atom_mask,
                   system_mask=system_mask, charges=charges, masses=masses,
                   velocities=velocities, neighbors=neighbors)

    # -- sizes

    @property
    def n_atoms(self) -> int:
        """Atom capacity V (static; real and padding atoms)."""
        return self.positions.shape[0]

    @property
    def n_systems(self) -> int:
        """System capacity S (static; real and padding systems)."""
        return self.cell.shape[0]

    def num_real_atoms(self) -> int:
        """Number of real atoms (host-side; needs concrete values)."""
        return int(self.ptr[-1])

    def num_real_systems(self) -> int:
        """Number of real systems (host-side; needs concrete values)."""
        return int(jnp.sum(self.system_mask))

    # -- functional updates

    @classmethod
    def unchecked(cls, **fields: Any) -> "Batch":
        """A Batch from arrays as given, without coercion or validation.

        For layouts the checks do not describe, e.g. a domain-decomposed rank's block whose
        rows are not grouped by system (there ``ptr`` only counts rows per system; use
        ``batch_idx``). Missing optional fields are None.

        Args:
          fields: field name → array (or None), as it is to be stored.

        Returns:
          A Batch holding exactly ``fields``.
        """
        obj = object.__new__(cls)
        for f in cls._fields:
            object.__setattr__(obj, f, fields.pop(f, None))
        if fields:
            raise TypeError(f"Batch.unchecked got unknown fields {sorted(fields)}")
        return obj

    def replace(self, **changes: Any) -> "Batch":
        """A validated copy with ``changes`` (field name → new value) applied (:func:`~jaxdd.data.pytree.replaced`)."""
        return replaced(self, **changes)

    def wrap(self) -> "Batch":
        """A copy with positions wrapped into each system's cell on periodic axes only.

        Padding atoms are untouched. See `wrap_positions` for how partially periodic cells
        are handled.
        """
        return self.replace(positions=wrap_positions(self.positions, self.cell, self.pbc,
                                                     self.batch_idx))

    def volume(self) -> jax.Array:
        """[S] cell volumes |det cell| in Å³.

        Computed from the rows as given, whatever pbc says: 0 when a row is zero (the usual
        cell of a non-periodic axis), when the rows are dependent, and for padding systems.
        """
        return jnp.abs(jnp.linalg.det(self.cell))

    def pad(self, n_atoms: int, n_systems: int | None = None) -> "Batch":
        """A copy padded (or re-padded) to capacities ``n_atoms`` and ``n_systems``.

        n_systems defaults to the current capacity S. Padding atoms get position 0, atomic
        number 0, atom_mask False and batch_idx = n_systems; padding systems get a zero cell,
        pbc False and system_mask False; ptr repeats its last value. Optional fields are
        padded with zeros, except masses with 1.0 so that quantities like v = p / m stay
        finite on padding rows (a NaN there would leak into gradients through masking).
        An attached neighbour list indexes the old capacity, so it is dropped.

        Growing works on traced batches; shrinking needs concrete values, to know how many
        atoms and systems are real.

        Args:
          n_atoms: the atom capacity V' (at least the real atoms).
          n_systems: the system capacity S' (at least the real systems).

        Returns:
          A Batch with [V'] atom rows and [S'] system rows.
        """
        return Batch(**padded_fields(self, n_atoms, n_systems))

    # -- conversions

    @classmethod
    def from_data(cls, data: AtomicData) -> "Batch":
        """A batch of one system (S = 1), no padding: every row of ``data`` is real."""
        n = data.n_atoms
        return cls(
            positions=data.positions, atomic_numbers=data.atomic_numbers, cell=data.cell,
            pbc=data.pbc, batch_idx=jnp.zeros(n, jnp.int32),
            ptr=jnp.asarray([0, n], jnp.int32), atom_mask=jnp.ones(n, bool),
            system_mask=jnp.ones(1, bool), charges=data.charges, masses=data.masses,
            velocities=data.velocities,
        )

    @classmethod
    def from_data_list(cls, data_list: Sequence[AtomicData]) -> "Batch":
        """Concatenate systems, in order, into one batch without padding.

        A system without charges or velocities counts as uncharged or at rest (zeros) when
        another system has them; masses must be given for all systems or none.

        Args:
          data_list: the systems, at least one AtomicData.

        Returns:
          A Batch with S = len(data_list) and V = their total atom count.
        """
        return cls(**concatenated_fields(data_list))

    @classmethod
    def from_ase(cls, atoms_list: Any, dtype: Any = None) -> "Batch":
        """From ``atoms_list``, a list of ``ase.Atoms`` (a single Atoms gives S = 1), floats in
        ``dtype`` (None: JAX's default float); see AtomicData.from_ase."""
        if hasattr(atoms_list, "get_positions"):
            atoms_list = [atoms_list]
        return cls.from_data_list([AtomicData.from_ase(a, dtype=dtype) for a in atoms_list])

    def to_data_list(self) -> list[AtomicData]:
        """The real systems as AtomicData, padding dropped (host-side)."""
        return split_systems(self)

    def to_ase(self) -> list[Any]:
        """The real systems as a list of ``ase.Atoms``, padding dropped."""
        return [d.to_ase() for d in self.to_data_list()]


register(Batch, ("positions", "atomic_numbers", "cell", "pbc", "batch_idx", "ptr",
                 "atom_mask", "system_mask", "charges", "masses", "velocities", "neighbors"))


def as_batch(data: AtomicData | Batch) -> Batch:
    """A Batch view of ``data``: a Batch is returned as is, an AtomicData becomes S = 1."""
    if isinstance(data, Batch):
        return data
    if isinstance(data, AtomicData):
        return Batch.from_data(data)
    raise TypeError(
        f"as_batch expects AtomicData or Batch, got {type(data).__name__}; "
        f"for ase.Atoms use Batch.from_ase"
    )
