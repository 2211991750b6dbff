"""LAMMPS atom types as species: the ``type → atomic number`` map the bridge is given.

LAMMPS numbers its atom types 1..ntypes and knows nothing of elements; a jaxdd model reads
atomic numbers. ``--types 1=Si,2=O`` (or ``{1: "Si", 2: 8}`` from Python) says which is which.
"""

from __future__ import annotations

import numpy as np
from ase.data import atomic_numbers as element_numbers
from ase.data import chemical_symbols

__all__ = ["TypeMapError", "parse_types", "species_map", "species_table"]


class TypeMapError(ValueError):
    """A type map that cannot be read, or that leaves a LAMMPS atom type without a species."""


def _atomic_number(type_id, species) -> int:
    """The atomic number of ``species`` (a symbol such as ``"Si"``, or a number 1..118)."""
    if isinstance(species, str) and species.strip().isdigit():
        species = int(species.strip())
    if isinstance(species, (int, np.integer)) and not isinstance(species, bool):
        if 1 <= int(species) < len(chemical_symbols):
            return int(species)
    elif isinstance(species, str) and species.strip() in element_numbers and species.strip() != "X":
        return int(element_numbers[species.strip()])
    raise TypeMapError(f"atom type {type_id}: {species!r} is not an element (a symbol such as Si, or an atomic "
                       "number 1-118)")


def species_map(mapping) -> dict[int, int]:
    """``{type: atomic number}`` from ``{type: symbol or atomic number}``; types are ints >= 1.

    Args:
      mapping: a dict such as ``{1: "Si", 2: "O"}`` or ``{1: 14, 2: 8}``.

    Returns:
      ``{1: 14, 2: 8}``.
    """
    out, spelled = {}, {}
    for type_id, species in dict(mapping).items():
        t = int(type_id) if isinstance(type_id, (int, np.integer, str)) and str(type_id).strip().isdigit() else None
        if t is None or t < 1:
            raise TypeMapError(f"atom type {type_id!r} is not a LAMMPS type (an integer >= 1)")
        if t in out:  # 1 and "1", or "1" and "01": one type, and the last one named would win unseen
            raise TypeMapError(f"atom type {t} is named twice, as {spelled[t]!r} and {type_id!r}; name each type once")
        out[t], spelled[t] = _atomic_number(t, species), type_id
    return out


def parse_types(text: str) -> dict[int, int]:
    """``{type: atomic number}`` from the command line's ``--types 1=Si,2=O`` (numbers work too: ``1=14``).

    Args:
      text: comma-separated ``TYPE=SPECIES`` pairs.

    Returns:
      ``{1: 14, 2: 8}``; a type given twice, or a pair that is not ``TYPE=SPECIES``, is a
      :class:`TypeMapError`.
    """
    pairs = {}
    for item in (p.strip() for p in str(text).split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip() or not value.strip():
            raise TypeMapError(f"--types entry {item!r} is not TYPE=SPECIES (e.g. 1=Si)")
        if key.strip() in pairs:
            raise TypeMapError(f"--types names atom type {key.strip()} twice")
        pairs[key.strip()] = value.strip()
    if not pairs:
        raise TypeMapError(f"--types {text!r} names no atom type (e.g. --types 1=Si,2=O)")
    return species_map(pairs)


def species_table(mapping: dict[int, int], n_types: int) -> np.ndarray:
    """A lookup table [n_types + 1] int32, atomic number by LAMMPS type (entry 0 unused).

    Args:
      mapping: ``{type: atomic number}`` (:func:`species_map`).
      n_types: LAMMPS's number of atom types; each of 1..n_types needs a species.

    Returns:
      The table; a type without a species is a :class:`TypeMapError` naming it.
    """
    missing = [t for t in range(1, int(n_types) + 1) if t not in mapping]
    if missing:
        example = ",".join(f"{t}=<element>" for t in missing[:3])
        raise TypeMapError(f"atom type{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of the "
                           f"{n_types} in the LAMMPS system {'have' if len(missing) > 1 else 'has'} no species: add "
                           f"{example} to --types (types={{type: element}} from Python)")
    table = np.zeros(int(n_types) + 1, np.int32)
    for t, z in mapping.items():
        if t <= n_types:
            table[t] = z
    return table
