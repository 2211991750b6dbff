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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .checks import integral, integral_array
from .periodic import wrap_fractional

__all__ = ["AtomicData", "Batch", "as_batch", "wrap_positions"]

# Normalised Gram determinant below which the periodic lattice vectors count as parallel.
_GRAM_TOL = 1e-10
# A periodic lattice vector shorter than this (Å) counts as zero.
_MIN_LATTICE_LENGTH = 1e-8
# How many offending indices an error message lists before summarising.
_SHOW = 5


# ----------------------------------------------------------------------------- helpers


try:
    _Tracer = jax.core.Tracer
except AttributeError:  # moved in some JAX releases
    from jax._src.core import Tracer as _Tracer


def is_concrete(*xs: Any) -> bool:
    """Whether every one of ``xs`` holds values now (no tracer: checks on values can run)."""
    return not any(isinstance(x, _Tracer) for x in xs)


def _few(indices: Any) -> str:
    idx = [int(i) for i in np.asarray(indices).reshape(-1)]
    if len(idx) <= _SHOW:
        return str(idx)
    return "[" + ", ".join(map(str, idx[:_SHOW])) + f", ... ({len(idx)} in total)]"


def _default_float() -> Any:
    return jax.dtypes.canonicalize_dtype(jnp.float64)


def _float_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    dtype = np.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype (e.g. jnp.float32), got {dtype}")
    return dtype


def _coerce_positions(positions: Any, dtype: Any) -> jax.Array:
    x = jnp.asarray(positions, dtype=dtype)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(_default_float())
    return x


def _coerce_float(x: Any, dtype: Any) -> jax.Array | None:
    return None if x is None else jnp.asarray(x).astype(dtype)


def _coerce_int(x: Any, name: str, what: str = "entries") -> jax.Array | None:
    # A fraction (18.7, or 17.9999999 from a conversion) is refused, never truncated.
    return None if x is None else jnp.asarray(integral_array(name, x, what=what)).astype(jnp.int32)


def _coerce_cell(cell: Any, n_systems: int | None, dtype: Any, owner: str) -> jax.Array:
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


def _coerce_pbc(pbc: Any, n_systems: int, owner: str) -> jax.Array:
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


def _coerce_atoms(owner, positions, atomic_numbers, charges, masses, velocities, dtype):
    """Per-atom fields as arrays (floats in one dtype), with their shapes checked."""
    positions = _coerce_positions(positions, _float_dtype(dtype))
    fdt = positions.dtype
    fields = (positions, _coerce_int(atomic_numbers, f"{owner}: atomic_numbers", "atoms"), _coerce_float(charges, fdt),
              _coerce_float(masses, fdt), _coerce_float(velocities, fdt))
    _check_shapes(owner, *fields)
    return fields


def _check_shapes(owner: str, positions, atomic_numbers, charges, masses, velocities) -> int:
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


def _check_finite(owner: str, name: str, arr: Any, rows: np.ndarray | None = None) -> None:
    if arr is None or not is_concrete(arr):
        return
    a = np.asarray(arr)
    bad = ~np.isfinite(a.reshape(a.shape[0], -1)).all(axis=1)
    if rows is not None:
        bad &= rows
    if bad.any():
        raise ValueError(
            f"{owner}: {name} of atoms {_few(np.flatnonzero(bad))} contain NaN or inf; "
            f"fix or remove those atoms"
        )


def _check_atom_values(owner: str, positions, atomic_numbers, charges, masses, velocities,
                       real: np.ndarray | None) -> None:
    """Value checks on per-atom fields; `real` selects real atoms (None: all)."""
    # Padding rows are checked for finiteness too: a NaN there poisons gradients even
    # when it is masked out of the forward value.
    _check_finite(owner, "positions", positions)
    if is_concrete(atomic_numbers):
        z = np.asarray(atomic_numbers)
        bad = z < 1 if real is None else (z < 1) & real
        if bad.any():
            i = np.flatnonzero(bad)
            raise ValueError(
                f"{owner}: atomic_numbers must be >= 1 for real atoms; atoms {_few(i)} have "
                f"{_few(z[i])}; use the element's atomic number (0 is reserved for padding)"
            )
    _check_finite(owner, "charges", charges, real)
    _check_finite(owner, "velocities", velocities, real)
    _check_finite(owner, "masses", masses, real)
    if masses is not None and is_concrete(masses):
        m = np.asarray(masses)
        bad = m <= 0 if real is None else (m <= 0) & real
        if bad.any():
            raise ValueError(
                f"{owner}: masses must be positive; atoms {_few(np.flatnonzero(bad))} have "
                f"non-positive masses"
            )


def _check_cells(owner: str, cell, pbc, systems: np.ndarray | None) -> None:
    """Refuse non-finite cells and singular lattices on periodic axes.

    The periodic rows must be non-zero and linearly independent; independence is judged by
    the Gram determinant det(P Pᵀ) / Π|aᵢ|², which is scale-free and lies in [0, 1].
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
                f"{where} has a zero lattice vector on periodic axis {_few(zero)} "
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


def wrap_positions(positions: jax.Array, cell: jax.Array, pbc: jax.Array,
                   batch_idx: jax.Array | None = None) -> jax.Array:
    """Wrap positions into the cell along periodic axes only. Pure, jit-friendly.

    positions: [V, 3] Å; cell: [S, 3, 3] (or [3, 3]) Å, rows are lattice vectors;
    pbc: [S, 3] (or [3]) bool; batch_idx: [V] system of each atom (None: all in system 0;
    an index >= S, i.e. a padding atom, is left untouched). Returns [V, 3] Å.

    Fractional coordinates along the periodic axes are the least-squares solution on the
    periodic rows, ``f = r Pᵀ (P Pᵀ)⁻¹``; non-periodic rows are ignored. This equals the
    usual ``r @ inv(cell)`` when the cell is fully periodic, and equals ASE's ``wrap`` when
    the non-periodic rows are zero or orthogonal to the periodic ones (vacuum slabs, wires,
    molecules). Each atom moves by an integer combination of periodic lattice vectors, so
    its component along non-periodic directions is untouched; atoms already inside the cell
    (0 <= f < 1) are returned bit for bit, and no atom is moved onto the upper face: one a
    rounding error below the lower face (``f > -ulp``) stays where it is, as ASE's ``wrap``
    leaves it (see :mod:`jaxdd.periodic`).
    """
    positions = jnp.asarray(positions)
    cell = jnp.asarray(cell).astype(positions.dtype)
    pbc = jnp.asarray(pbc).astype(bool)
    if cell.ndim == 2:
        cell = cell[None]
    pbc = jnp.broadcast_to(pbc, (cell.shape[0], 3))
    n_sys = cell.shape[0]
    if batch_idx is None:
        batch_idx = jnp.zeros(positions.shape[0], jnp.int32)
    real = batch_idx < n_sys
    sys = jnp.where(real, batch_idx, 0)

    periodic_rows = cell * pbc[..., None]
    # Ones on the non-periodic diagonal keep the Gram matrix invertible without coupling
    # to the periodic block (those rows of `periodic_rows` are zero).
    gram = periodic_rows @ jnp.swapaxes(periodic_rows, -1, -2)
    gram = gram + jax.vmap(jnp.diag)((~pbc).astype(cell.dtype))
    to_frac = jnp.swapaxes(periodic_rows, -1, -2) @ jnp.linalg.inv(gram)  # [S, 3, 3]

    frac = jnp.einsum("vi,vij->vj", positions, to_frac[sys])
    _, shift = wrap_fractional(frac, pbc[sys] & real[:, None])
    return positions - jnp.einsum("vi,vij->vj", shift, periodic_rows[sys])


def _frozen_setattr(self, name, value):
    raise dataclasses.FrozenInstanceError(
        f"{type(self).__name__} is immutable; use .replace({name}=...) for a modified copy"
    )


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def _register(cls, fields: tuple[str, ...]):
    def flatten(obj):
        return tuple(getattr(obj, f) for f in fields), None

    def flatten_with_keys(obj):
        return tuple((jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in fields), None

    def unflatten(_, children):
        # No validation: JAX unflattens with tracers, None, sentinels or ints.
        obj = object.__new__(cls)
        for f, c in zip(fields, children):
            object.__setattr__(obj, f, c)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    cls._fields = fields
    cls.__setattr__ = _frozen_setattr
    cls.__delattr__ = _frozen_setattr

    def __repr__(self):
        parts = [f"{f}={_describe(getattr(self, f, None))}" for f in fields
                 if getattr(self, f, None) is not None]
        return f"{cls.__name__}({', '.join(parts)})"

    cls.__repr__ = __repr__
    return cls


def _set_fields(obj: Any, **values: Any) -> None:
    for k, v in values.items():
        object.__setattr__(obj, k, v)


# -------------------------------------------------------------------------- AtomicData


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
        positions, atomic_numbers, charges, masses, velocities = _coerce_atoms(
            owner, positions, atomic_numbers, charges, masses, velocities, dtype
        )
        fdt = positions.dtype
        cell = _coerce_cell(cell, 1, fdt, owner)
        if cell.shape[0] != 1:
            raise ValueError(
                f"{owner}: cell must describe one system ([3, 3] or [1, 3, 3]), got shape "
                f"{tuple(cell.shape)}; use Batch for several systems"
            )
        pbc = _coerce_pbc(pbc, 1, owner)

        _check_atom_values(owner, positions, atomic_numbers, charges, masses, velocities, None)
        _check_cells(owner, cell, pbc, None)
        _set_fields(self, positions=positions, atomic_numbers=atomic_numbers, cell=cell,
                    pbc=pbc, charges=charges, masses=masses, velocities=velocities)

    @property
    def n_atoms(self) -> int:
        """Number of atoms V (static)."""
        return self.positions.shape[0]

    def replace(self, **changes: Any) -> "AtomicData":
        """A validated copy with the given fields changed."""
        kw = {f: getattr(self, f) for f in self._fields}
        kw.update(changes)
        return AtomicData(**kw)

    def wrap(self) -> "AtomicData":
        """A copy with positions wrapped into the cell on periodic axes (see `wrap_positions`)."""
        return self.replace(positions=wrap_positions(self.positions, self.cell, self.pbc))

    def volume(self) -> jax.Array:
        """[1] cell volume |det cell| in Å³ (0 when a row is zero or the rows are dependent)."""
        return jnp.abs(jnp.linalg.det(self.cell))

    @classmethod
    def from_ase(cls, atoms: Any, dtype: Any = None) -> "AtomicData":
        """From an ``ase.Atoms``.

        Masses are always taken (ASE's defaults when unset); charges only when some initial
        charge is non-zero; velocities only when the atoms carry momenta.
        """
        fdt = _float_dtype(dtype) or _default_float()
        charges = atoms.get_initial_charges()
        return cls(
            positions=np.asarray(atoms.get_positions()),
            atomic_numbers=np.asarray(atoms.get_atomic_numbers()),
            cell=np.asarray(atoms.cell.array)[None],
            pbc=np.asarray(atoms.pbc)[None],
            masses=np.asarray(atoms.get_masses()),
            charges=np.asarray(charges) if np.any(charges != 0) else None,
            velocities=np.asarray(atoms.get_velocities()) if atoms.has("momenta") else None,
            dtype=fdt,
        )

    def to_ase(self) -> Any:
        """An ``ase.Atoms`` with the same positions, numbers, cell, pbc and optional fields."""
        import ase

        atoms = ase.Atoms(
            numbers=np.asarray(self.atomic_numbers),
            positions=np.asarray(self.positions, dtype=np.float64),
            cell=np.asarray(self.cell[0], dtype=np.float64),
            pbc=np.asarray(self.pbc[0]),
        )
        if self.masses is not None:
            atoms.set_masses(np.asarray(self.masses, dtype=np.float64))
        if self.charges is not None:
            atoms.set_initial_charges(np.asarray(self.charges, dtype=np.float64))
        if self.velocities is not None:
            # ASE stores momenta, so set velocities after masses.
            atoms.set_velocities(np.asarray(self.velocities, dtype=np.float64))
        return atoms


_register(AtomicData, ("positions", "atomic_numbers", "cell", "pbc", "charges", "masses",
                       "velocities"))


# ------------------------------------------------------------------------------- Batch


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
        positions, atomic_numbers, charges, masses, velocities = _coerce_atoms(
            owner, positions, atomic_numbers, charges, masses, velocities, dtype
        )
        fdt = positions.dtype
        n_atoms = positions.shape[0]
        cell = _coerce_cell(cell, None, fdt, owner)
        n_sys = cell.shape[0]
        if n_sys == 0:
            raise ValueError(f"{owner} has no systems: cell has shape {tuple(cell.shape)}")
        pbc = _coerce_pbc(pbc, n_sys, owner)
        batch_idx = _coerce_int(batch_idx, f"{owner}: batch_idx", "atoms")
        ptr = _coerce_int(ptr, f"{owner}: ptr")

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
            _check_layout(owner, batch_idx, ptr, atom_mask, system_mask)
        # Traced masks: the per-atom / per-system value checks below cover all rows.
        real_atoms = np.asarray(atom_mask) if is_concrete(atom_mask) else None
        real_systems = np.asarray(system_mask) if is_concrete(system_mask) else None
        _check_atom_values(owner, positions, atomic_numbers, charges, masses, velocities,
                           real_atoms)
        _check_cells(owner, cell, pbc, real_systems)

        _set_fields(self, positions=positions, atomic_numbers=atomic_numbers, cell=cell,
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
        """
        obj = object.__new__(cls)
        for f in cls._fields:
            object.__setattr__(obj, f, fields.pop(f, None))
        if fields:
            raise TypeError(f"Batch.unchecked got unknown fields {sorted(fields)}")
        return obj

    def replace(self, **changes: Any) -> "Batch":
        """A validated copy with the given fields changed."""
        kw = {f: getattr(self, f) for f in self._fields}
        kw.update(changes)
        return Batch(**kw)

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
        """
        n_atoms = integral("Batch.pad: n_atoms", n_atoms, minimum=0)
        n_systems = self.n_systems if n_systems is None else integral("Batch.pad: n_systems", n_systems, minimum=0)
        v, s = self.n_atoms, self.n_systems
        if is_concrete(self.ptr, self.system_mask):
            real_v, real_s = self.num_real_atoms(), self.num_real_systems()
            if n_atoms < real_v:
                raise ValueError(
                    f"Batch.pad: n_atoms={n_atoms} is smaller than the {real_v} real atoms of "
                    f"the batch; give n_atoms >= {real_v}"
                )
            if n_systems < real_s:
                raise ValueError(
                    f"Batch.pad: n_systems={n_systems} is smaller than the {real_s} real "
                    f"systems of the batch; give n_systems >= {real_s}"
                )
        elif n_atoms < v or n_systems < s:
            raise ValueError(
                f"Batch.pad: cannot shrink a traced batch (capacities {v} atoms, {s} systems) "
                f"to n_atoms={n_atoms}, n_systems={n_systems}; pad outside jit or only grow"
            )

        def fit(x, n, fill):
            if x is None:
                return None
            if x.shape[0] >= n:
                return x[:n]
            tail = jnp.full((n - x.shape[0], *x.shape[1:]), fill, x.dtype)
            return jnp.concatenate([x, tail])

        atom_mask = fit(self.atom_mask, n_atoms, False)
        ptr = self.ptr[: n_systems + 1]
        if n_systems + 1 > ptr.shape[0]:
            ptr = jnp.concatenate([ptr, jnp.full(n_systems + 1 - ptr.shape[0], ptr[-1], ptr.dtype)])
        return Batch(
            positions=fit(self.positions, n_atoms, 0),
            atomic_numbers=fit(self.atomic_numbers, n_atoms, 0),
            cell=fit(self.cell, n_systems, 0),
            pbc=fit(self.pbc, n_systems, False),
            batch_idx=jnp.where(atom_mask, fit(self.batch_idx, n_atoms, 0), n_systems),
            ptr=ptr,
            atom_mask=atom_mask,
            system_mask=fit(self.system_mask, n_systems, False),
            charges=fit(self.charges, n_atoms, 0),
            masses=fit(self.masses, n_atoms, 1),
            velocities=fit(self.velocities, n_atoms, 0),
            neighbors=None,
        )

    # -- conversions

    @classmethod
    def from_data(cls, data: AtomicData) -> "Batch":
        """A batch of one system (S = 1), no padding."""
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
        """
        data_list = list(data_list)
        if not data_list:
            raise ValueError("Batch.from_data_list: data_list is empty; give at least one system")
        for i, d in enumerate(data_list):
            if not isinstance(d, AtomicData):
                raise TypeError(
                    f"Batch.from_data_list: entry {i} is a {type(d).__name__}, not AtomicData"
                )
        fdt = jnp.result_type(*[d.positions.dtype for d in data_list])
        counts = [d.n_atoms for d in data_list]

        def cat(name, fill):
            present = [getattr(d, name) is not None for d in data_list]
            if not any(present):
                return None
            if fill is None and not all(present):
                missing = [i for i, p in enumerate(present) if not p]
                raise ValueError(
                    f"Batch.from_data_list: {name} is given for some systems but not for "
                    f"systems {_few(missing)}; give it for all systems or none"
                )
            parts = []
            for d in data_list:
                x = getattr(d, name)
                if x is None:
                    shape = d.positions.shape if name == "velocities" else (d.n_atoms,)
                    x = jnp.full(shape, fill, fdt)
                parts.append(x.astype(fdt))
            return jnp.concatenate(parts)

        return cls(
            positions=jnp.concatenate([d.positions.astype(fdt) for d in data_list]),
            atomic_numbers=jnp.concatenate([d.atomic_numbers for d in data_list]),
            cell=jnp.concatenate([d.cell.astype(fdt) for d in data_list]),
            pbc=jnp.concatenate([d.pbc for d in data_list]),
            batch_idx=np.repeat(np.arange(len(counts), dtype=np.int32), counts),
            ptr=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32),
            charges=cat("charges", 0.0),
            masses=cat("masses", None),
            velocities=cat("velocities", 0.0),
        )

    @classmethod
    def from_ase(cls, atoms_list: Any, dtype: Any = None) -> "Batch":
        """From a list of ``ase.Atoms`` (a single Atoms gives S = 1); see AtomicData.from_ase."""
        if hasattr(atoms_list, "get_positions"):
            atoms_list = [atoms_list]
        return cls.from_data_list([AtomicData.from_ase(a, dtype=dtype) for a in atoms_list])

    def to_data_list(self) -> list[AtomicData]:
        """The real systems as AtomicData, padding dropped (host-side)."""
        ptr = np.asarray(self.ptr)
        out = []
        for s in range(self.num_real_systems()):
            sl = slice(int(ptr[s]), int(ptr[s + 1]))
            out.append(AtomicData(
                positions=self.positions[sl], atomic_numbers=self.atomic_numbers[sl],
                cell=self.cell[s : s + 1], pbc=self.pbc[s : s + 1],
                charges=None if self.charges is None else self.charges[sl],
                masses=None if self.masses is None else self.masses[sl],
                velocities=None if self.velocities is None else self.velocities[sl],
            ))
        return out

    def to_ase(self) -> list[Any]:
        """The real systems as a list of ``ase.Atoms``, padding dropped."""
        return [d.to_ase() for d in self.to_data_list()]


_register(Batch, ("positions", "atomic_numbers", "cell", "pbc", "batch_idx", "ptr",
                  "atom_mask", "system_mask", "charges", "masses", "velocities", "neighbors"))


def _check_layout(owner, batch_idx, ptr, atom_mask, system_mask):
    """Check that ptr, batch_idx and the masks describe the same layout."""
    batch_idx, ptr = np.asarray(batch_idx), np.asarray(ptr)
    atom_mask, system_mask = np.asarray(atom_mask), np.asarray(system_mask)
    n_atoms, n_sys = batch_idx.shape[0], system_mask.shape[0]
    if ptr[0] != 0:
        raise ValueError(f"{owner}: ptr must start at 0, got ptr[0] = {int(ptr[0])}")
    steps = np.flatnonzero(np.diff(ptr) < 0)
    if steps.size:
        raise ValueError(
            f"{owner}: ptr must be non-decreasing; it decreases after systems {_few(steps)}"
        )
    if ptr[-1] > n_atoms:
        raise ValueError(
            f"{owner}: ptr[-1] = {int(ptr[-1])} exceeds the {n_atoms} rows of positions"
        )
    sizes = np.diff(ptr)
    empty = np.flatnonzero(system_mask & (sizes == 0))
    if empty.size:
        raise ValueError(
            f"{owner}: systems {_few(empty)} have no atoms (ptr[s] == ptr[s+1]) but are "
            f"marked real in system_mask; remove them or mark them as padding"
        )
    unmarked = np.flatnonzero(~system_mask & (sizes > 0))
    if unmarked.size:
        raise ValueError(
            f"{owner}: systems {_few(unmarked)} have atoms but system_mask is False for them; "
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
            f"{owner}: batch_idx disagrees with ptr at atoms {_few(wrong)} (expected "
            f"{_few(expected[wrong])}, got {_few(batch_idx[wrong])}); atoms must be sorted by "
            f"system, and padding atoms (rows >= ptr[-1] = {int(ptr[-1])}) must have "
            f"batch_idx = n_systems = {n_sys}"
        )
    real = np.arange(n_atoms) < ptr[-1]
    wrong = np.flatnonzero(atom_mask != real)
    if wrong.size:
        raise ValueError(
            f"{owner}: atom_mask disagrees with ptr at atoms {_few(wrong)}; atom_mask must be "
            f"True exactly on rows < ptr[-1] = {int(ptr[-1])}"
        )


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
