"""A batch's fields from a list of systems, and the systems back from a batch (host-side)."""

from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np

from .atomic_data import AtomicData
from .validation import few

__all__ = ["concatenated_fields", "split_systems"]


def concatenated_fields(data_list: Sequence[AtomicData]) -> dict[str, Any]:
    """The keyword arguments of a ``Batch`` that concatenates systems, in order, unpadded.

    A system without charges or velocities counts as uncharged or at rest (zeros) when
    another system has them; masses must be given for all systems or none. Floats take the
    common dtype of the systems' positions.

    Args:
      data_list: the systems, at least one AtomicData.

    Returns:
      positions [V, 3] Å, atomic_numbers [V], cell [S, 3, 3] Å, pbc [S, 3], batch_idx [V],
      ptr [S + 1], and charges [V] e, masses [V] amu, velocities [V, 3] (each None when no
      system has it).
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
                f"systems {few(missing)}; give it for all systems or none"
            )
        parts = []
        for d in data_list:
            x = getattr(d, name)
            if x is None:
                shape = d.positions.shape if name == "velocities" else (d.n_atoms,)
                x = jnp.full(shape, fill, fdt)
            parts.append(x.astype(fdt))
        return jnp.concatenate(parts)

    return dict(
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


def split_systems(batch: Any) -> list[AtomicData]:
    """The real systems of a batch as AtomicData, padding dropped.

    Args:
      batch: a ``Batch`` with concrete values.

    Returns:
      One AtomicData per real system, in order.
    """
    ptr = np.asarray(batch.ptr)
    out = []
    for s in range(batch.num_real_systems()):
        sl = slice(int(ptr[s]), int(ptr[s + 1]))
        out.append(AtomicData(
            positions=batch.positions[sl], atomic_numbers=batch.atomic_numbers[sl],
            cell=batch.cell[s : s + 1], pbc=batch.pbc[s : s + 1],
            charges=None if batch.charges is None else batch.charges[sl],
            masses=None if batch.masses is None else batch.masses[sl],
            velocities=None if batch.velocities is None else batch.velocities[sl],
        ))
    return out
