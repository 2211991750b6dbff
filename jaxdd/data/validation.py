"""Value checks of atomic fields: NaN and inf, atomic numbers, masses, singular cells, and the
layout of a batch (``ptr``, ``batch_idx`` and the masks agreeing).

Each check runs only on concrete values: under ``jax.jit`` the arrays are tracers and the
checks are skipped (:func:`is_concrete`). Every failure is a ``ValueError`` whose message
names the owner (``AtomicData`` or ``Batch``), the field and the offending rows.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

__all__ = ["is_concrete", "few", "check_finite", "check_atom_values", "check_cells", "check_layout"]

# Normalised Gram determinant below which the periodic lattice vectors count as parallel.
_GRAM_TOL = 1e-10
# A periodic lattice vector shorter than this (Å) counts as zero.
_MIN_LATTICE_LENGTH = 1e-8
# How many offending indices an error message lists before summarising.
_SHOW = 5


try:
    _Tracer = jax.core.Tracer
except AttributeError:  # moved in some JAX releases
    from jax._src.core import Tracer as _Tracer


def is_concrete(*xs: Any) -> bool:
    """Whether every one of ``xs`` holds values now (no tracer: checks on values can run)."""
    return not any(isinstance(x, _Tracer) for x in xs)


def few(indices: Any) -> str:
    """A short listing of ``indices`` (any array-like of ints) for an error message: all of
    them up to five, else the first five and the total count."""
    idx = [int(i) for i in np.asarray(indices).reshape(-1)]
    if len(idx) <= _SHOW:
        return str(idx)
    return "[" + ", ".join(map(str, idx[:_SHOW])) + f", ... ({len(idx)} in total)]"


def check_finite(owner: str, name: str, arr: Any, rows: np.ndarray | None = None) -> None:
    """Refuse NaN or inf in the rows of a per-atom field.

    Args:
      owner: the class named in the message (``"AtomicData"``, ``"Batch"``).
      name: the field named in the message.
      arr: [V, ...] the field, or None (nothing to check); a tracer is not checked.
      rows: [V] bool, the rows to check (None: all).

    Raises:
      ValueError: naming the atoms whose row holds NaN or inf.
    """
    if arr is None or not is_concrete(arr):
        return
    a = np.asarray(arr)
    bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    if rows is not None:
        bad &= rows
    if bad.any():
        raise ValueError(
            f"{owner}: {name} of atoms {few(np.flatnonzero(bad))} contain NaN or inf; "
            f"fix or remove those atoms"
        )


def check_atom_values(owner: str, positions, atomic_numbers, charges, masses, velocities,
                      real: np.ndarray | None) -> None:
    """Value checks on per-atom fields: finite values, atomic numbers >= 1, positive masses.

    Args:
      owner: the class named in the message.
      positions: [V, 3] Å; checked on every row, padding included.
      atomic_numbers: [V] int.
      charges: [V] e, or None.
      masses: [V] amu, or None.
      velocities: [V, 3] Å / ASE time unit, or None.
      real: [V] bool, the real atoms, whose other fields are checked (None: all).

    Raises:
      ValueError: naming the offending atoms.
    """
    # Padding rows are checked for finiteness too: a NaN there poisons gradients even
    # when it is masked out of the forward value.
    check_finite(owner, "positions", positions)
    if is_concrete(atomic_numbers):
        z = np.asarray(atomic_numbers)
        bad = z < 1 if real is None else (z < 1) & real
        if bad.any():
            i = np.flatnonzero(bad)
            raise ValueError(
                f"{owner}: atomic_numbers must be >= 1 for real atoms; atoms {few(i)} have "
                f"{few(z[i])}; use the element's atomic number (0 is reserved for padding)"
            )
    check_finite(owner, "charges", charges, real)
    check_finite(owner, "velocities", velocities, real)
    check_finite(owner, "masses", masses, real)
    if masses is not None and is_concrete(masses):
        m = np.asarray(masses)
        bad = m <= 0 if real is None else (m <= 0) & real
        if bad.any():
            raise ValueError(
                f"{owner}: masses must be positive; atoms {few(np.flatnonzero(bad))} have "
                f"non-positive masses"
            )


def check_cells(owner: str, cell, pbc, systems: np.ndarray | None) -> None:
    """Refuse non-finite cells and singular lattices on periodic axes.

    The periodic rows must be non-zero and linearly independent; independence is judged by
    the Gram determinant det(P Pᵀ) / Π|aᵢ|², which is scale-free and lies in [0, 1].

    Args:
      owner: the class named in the message.
      cell: [S, 3, 3] Å, lattice vectors as rows.
      pbc: [S, 3] bool.
      systems: [S] bool, the systems to check (None: all).

    Raises:
      ValueError: naming the system and what is wrong with its cell.
    """
    if not is_concrete(cell, pbc):
        return
    cell = np.asarray(cell, dtype=np.float64)
    pbc = np.asarray(pbc)
    for s in range(cell.shape[0]):
        if systems is not None and not systems[s]:
            continue
        where = f"{owner}: cell of system {s}"
        if not np.isfinite(cell[s]).all():
            raise ValueError(f"{where} contains NaN or inf: {cell[s].tolist()}")
        axes = np.flatnonzero(pbc[s])
        if axes.size == 0:
            continue
        lengths = np.linalg.norm(cell[s, axes], axis=1)
        zero = axes[lengths < _MIN_LATTICE_LENGTH]
        if zero.size:
            raise ValueError(
                f"{where} has a zero lattice vector on periodic axis {few(zero)} "
                f"(pbc={tuple(bool(p) for p in pbc[s])}); give a non-zero row "
                f"cell[{int(zero[0])}] or set that axis non-periodic"
            )
        unit = cell[s, axes] / lengths[:, None]
        gram = float(np.linalg.det(unit @ unit.T))
        if not gram >= _GRAM_TOL:
            raise ValueError(
                f"{where} is singular on its periodic axes {axes.tolist()}: lattice vectors "
                f"{', '.join(f'cell[{int(a)}]' for a in axes)} are linearly dependent "
                f"(normalised Gram determinant {gram:.3g} < {_GRAM_TOL:g}); give independent "
                f"lattice vectors or set the redundant axes non-periodic"
            )


def check_layout(owner, batch_idx, ptr, atom_mask, system_mask) -> None:
    """Check that ptr, batch_idx and the masks describe the same layout.

    Real atoms come first, sorted by system; padding systems come after the real ones and
    are empty; every real system has at least one atom.

    Args:
      owner: the class named in the message.
      batch_idx: [V] int, system of each atom (S on padding atoms); concrete.
      ptr: [S + 1] int, the atoms of system s are rows ptr[s]:ptr[s+1]; concrete.
      atom_mask: [V] bool, True on real atoms; concrete.
      system_mask: [S] bool, True on real systems; concrete.

    Raises:
      ValueError: saying which of them disagree, and where.
    """
    batch_idx, ptr = np.asarray(batch_idx), np.asarray(ptr)
    atom_mask, system_mask = np.asarray(atom_mask), np.asarray(system_mask)
    n_atoms, n_sys = batch_idx.shape[0], system_mask.shape[0]
    if ptr[0] != 0:
        raise ValueError(f"{owner}: ptr must start at 0, got ptr[0] = {int(ptr[0])}")
    steps = np.flatnonzero(np.diff(ptr) < 0)
    if steps.size:
        raise ValueError(
            f"{owner}: ptr must be non-decreasing; it decreases after systems {few(steps)}"
        )
    if ptr[-1] > n_atoms:
        raise ValueError(
            f"{owner}: ptr[-1] = {int(ptr[-1])} exceeds the {n_atoms} rows of positions"
        )
    sizes = np.diff(ptr)
    empty = np.flatnonzero(system_mask & (sizes == 0))
    if empty.size:
        raise ValueError(
            f"{owner}: systems {few(empty)} have no atoms (ptr[s] == ptr[s+1]) but are "
            f"marked real in system_mask; remove them or mark them as padding"
        )
    unmarked = np.flatnonzero(~system_mask & (sizes > 0))
    if unmarked.size:
        raise ValueError(
            f"{owner}: systems {few(unmarked)} have atoms but system_mask is False for them; "
            f"padding systems must be empty"
        )
    n_real_sys = int(system_mask.sum())
    if not system_mask[:n_real_sys].all():
        raise ValueError(
            f"{owner}: padding systems must come after all real systems; system_mask is "
            f"{system_mask.tolist()}"
        )
    expected = np.full(n_atoms, n_sys, np.int64)
    expected[: ptr[-1]] = np.repeat(np.arange(n_sys), sizes)
    wrong = np.flatnonzero(batch_idx != expected)
    if wrong.size:
        raise ValueError(
            f"{owner}: batch_idx disagrees with ptr at atoms {few(wrong)} (expected "
            f"{few(expected[wrong])}, got {few(batch_idx[wrong])}); atoms must be sorted by "
            f"system, and padding atoms (rows >= ptr[-1] = {int(ptr[-1])}) must have "
            f"batch_idx = n_systems = {n_sys}"
        )
    real = np.arange(n_atoms) < ptr[-1]
    wrong = np.flatnonzero(atom_mask != real)
    if wrong.size:
        raise ValueError(
            f"{owner}: atom_mask disagrees with ptr at atoms {few(wrong)}; atom_mask must be "
            f"True exactly on rows < ptr[-1] = {int(ptr[-1])}"
        )
