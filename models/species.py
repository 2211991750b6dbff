"""Atomic numbers to species rows, the checks every element-resolved zoo model makes, and the
inputs the neighbour-list models among them read."""

from __future__ import annotations

import math
import numbers

import numpy as np

from jaxdd.data.checks import integral

__all__ = ["species_table", "check_species", "check_cutoff", "validate_species", "neighbor_inputs"]


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
