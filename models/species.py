"""Atomic numbers to species rows, the checks every element-resolved zoo model makes, and the
inputs the neighbour-list models among them read."""

from __future__ import annotations

import math
import numbers

import numpy as np

from jaxdd.data.checks import integral

__all__ = ["species_table", "check_species", "check_cutoff", "validate_species", "neighbor_inputs", "weights_dtype"]


def species_table(species):
    """Static table atomic number -> species index (unlisted numbers map to 0)."""
    table = np.zeros(max(species) + 1, np.int32)
    table[list(species)] = np.arange(len(species))
    return table


def check_species(species, owner):
    """``species`` as a tuple of distinct atomic numbers >= 1; ValueError naming ``owner`` otherwise."""
    species = tuple(integral(f"{owner} species", z, minimum=1) for z in species)
    if not species or len(set(species)) != len(species) or min(species) < 1:
        raise ValueError(f"{owner} species must be distinct atomic numbers >= 1, got {species}")
    return species


def check_cutoff(cutoff, owner):
    """``cutoff`` (Å) as a positive finite float; ValueError naming ``owner`` otherwise."""
    if not isinstance(cutoff, numbers.Real) or isinstance(cutoff, bool) or not math.isfinite(cutoff) or cutoff <= 0:
        raise ValueError(f"{owner} cutoff must be a positive finite number (Å), got {cutoff!r}")
    return float(cutoff)


def validate_species(data, species, owner):
    """Host check of a batch ``data``: every real atom's atomic number is one of ``species``
    (ValueError naming the atoms and the model ``owner`` otherwise)."""
    z = np.asarray(data.atomic_numbers)[np.asarray(data.atom_mask)]
    bad = np.flatnonzero(~np.isin(z, species))
    if bad.size:
        rows = np.flatnonzero(np.asarray(data.atom_mask))[bad]
        raise ValueError(
            f"atoms {rows[:8].tolist()} have atomic numbers {sorted(set(z[bad].tolist()))} that are not in "
            f"{owner} species {species}; build the model with those species"
        )


def neighbor_inputs(data, owner) -> dict:
    """The forward arguments of a model that reads the framework's neighbour list: positions,
    cell, batch_idx, atomic_numbers, atom_mask, neighbors and n_systems of ``data`` (ValueError
    naming the model ``owner`` when it has no neighbour list)."""
    if data.neighbors is None:
        raise ValueError(f"{owner} needs data.neighbors; call it through jaxdd.compute")
    return dict(positions=data.positions, cell=data.cell, batch_idx=data.batch_idx,
                atomic_numbers=data.atomic_numbers, atom_mask=data.atom_mask, neighbors=data.neighbors,
                n_systems=data.n_systems)


def weights_dtype(dtype, owner):
    """``dtype`` as a numpy dtype; ValueError naming ``owner``'s dtype unless it is float32 or float64.

    Args:
      dtype: the dtype asked for (a numpy or jax dtype, a type or its name).
      owner: the model or loader, for the message.

    Returns:
      the numpy dtype.
    """
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    # The weights are cast to it: an integer or bool dtype would truncate them without a word, and
    # a half precision rounds them to 3 significant digits (meV off on a few atoms).
    if dt is None or dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        got = dt.name if dt is not None else repr(dtype)
        raise ValueError(f"{owner} dtype must be float32 or float64, got {got}; the weights are cast to it: an "
                         "integer or bool dtype would truncate them and a half precision would round them")
    return dt
