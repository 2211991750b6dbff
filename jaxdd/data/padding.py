"""Padding a batch to static capacities: which value each field takes on padding rows."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .checks import integral
from .validation import is_concrete

__all__ = ["padded_fields"]


def padded_fields(batch: Any, n_atoms: int, n_systems: int | None = None) -> dict[str, Any]:
    """The keyword arguments of ``batch`` padded (or re-padded) to new capacities.

    Padding atoms get position 0, atomic number 0, atom_mask False and batch_idx =
    n_systems; padding systems get a zero cell, pbc False and system_mask False; ptr repeats
    its last value. Optional fields are padded with zeros, except masses with 1.0 so that
    quantities like v = p / m stay finite on padding rows (a NaN there would leak into
    gradients through masking). An attached neighbour list indexes the old capacity, so it
    is dropped (``neighbors=None``).

    Growing works on traced batches; shrinking needs concrete values, to know how many
    atoms and systems are real.

    Args:
      batch: a ``Batch``.
      n_atoms: the atom capacity V' (at least the real atoms).
      n_systems: the system capacity S' (at least the real systems; None: the current S).

    Returns:
      Every Batch field at capacities [V'] and [S'].
    """
    n_atoms = integral("Batch.pad: n_atoms", n_atoms, minimum=0)
    n_systems = batch.n_systems if n_systems is None else integral("Batch.pad: n_systems", n_systems, minimum=0)
    v, s = batch.n_atoms, batch.n_systems
    if is_concrete(batch.ptr, batch.system_mask):
        real_v, real_s = batch.num_real_atoms(), batch.num_real_systems()
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

    atom_mask = fit(batch.atom_mask, n_atoms, False)
    ptr = batch.ptr[: n_systems + 1]
    if n_systems + 1 > ptr.shape[0]:
        ptr = jnp.concatenate([ptr, jnp.full(n_systems + 1 - ptr.shape[0], ptr[-1], ptr.dtype)])
    return dict(
        positions=fit(batch.positions, n_atoms, 0),
        atomic_numbers=fit(batch.atomic_numbers, n_atoms, 0),
        cell=fit(batch.cell, n_systems, 0),
        pbc=fit(batch.pbc, n_systems, False),
        batch_idx=jnp.where(atom_mask, fit(batch.batch_idx, n_atoms, 0), n_systems),
        ptr=ptr,
        atom_mask=atom_mask,
        system_mask=fit(batch.system_mask, n_systems, False),
        charges=fit(batch.charges, n_atoms, 0),
        masses=fit(batch.masses, n_atoms, 1),
        velocities=fit(batch.velocities, n_atoms, 0),
        neighbors=None,
    )
