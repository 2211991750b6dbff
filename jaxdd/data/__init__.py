"""Atomic systems as JAX pytrees: one system (`AtomicData`) and a padded batch (`Batch`).

Conventions shared by everything in jaxdd:

- lengths in Å, charges in e, masses in amu, velocities in Å per ASE time unit
  (the units of ``ase.Atoms.get_velocities()``; one ASE time unit is Å·sqrt(amu/eV),
  about 10.18 fs);
- lattice vectors are the ROWS of ``cell``: ``cart = frac @ cell``. A row may be zero on a
  non-periodic axis;
- every array has a static *capacity*. A `Batch` stores its real atoms first, sorted by
  system, followed by padding atoms; its real systems first, followed by padding systems.

Both classes are frozen. Array fields are pytree leaves; optional fields that are absent
are ``None`` (an empty pytree node). Unflattening never validates, because JAX unflattens
with tracers, ``None``, sentinels or axis numbers (``in_axes``); the constructors (and
``replace``) do validate, running shape checks always and value checks (NaN, singular
cells, index consistency) only on concrete values.

Modules: :mod:`.fields` (coercion and shape checks), :mod:`.validation` (value checks),
:mod:`.wrap` (wrapping into the cell), :mod:`.pytree` (frozen pytree classes),
:mod:`.atomic_data`, :mod:`.batch` (with :func:`as_batch`), :mod:`.padding`,
:mod:`.concat` (lists of systems) and :mod:`.ase_atoms` (``ase.Atoms``); beside them the geometry
and numbers every layer above shares: :mod:`.periodic` (the one wrap rule), :mod:`.cell_widths`
(distances between a cell's faces), :mod:`.segments`
(per-system sums), :mod:`.constants` (CODATA, in Å, eV, e), :mod:`.checks` (user-given integers)
and :mod:`.systems` (the built-in example systems).
"""

from __future__ import annotations

from .atomic_data import AtomicData
from .batch import Batch, as_batch
from .validation import is_concrete  # imported from here by the neighbour lists, protocol and engine
from .wrap import wrap_positions

__all__ = ["AtomicData", "Batch", "as_batch", "wrap_positions"]
