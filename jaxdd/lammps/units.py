"""LAMMPS unit systems the bridge accepts: ``metal`` (eV, Å, ps, amu, bar), jaxdd's own.

jaxdd models take Å and return eV, eV/Å and eV virials, which is LAMMPS's ``metal`` style
as it is: the bridge converts nothing. Other styles are refused before anything runs, each
with what to do instead (a ``real`` script is a ``metal`` script with its energies,
forces, times and pressures converted; ``lj`` has no length or energy scale at all).
"""

from __future__ import annotations

__all__ = ["UnitError", "SUPPORTED", "check_units"]

#: The unit style the bridge runs: LAMMPS's ``metal`` (energy eV, distance Å, time ps,
#: mass amu (g/mol), force eV/Å, pressure bar; the virial in eV).
SUPPORTED = "metal"

_WHY = {
    "real": "energies in kcal/mol and times in fs; jaxdd's models give eV: write the script in units metal "
            "(energies eV, times ps: timestep 0.001 for 1 fs, pressures in bar rather than atm)",
    "lj": "reduced units have no length or energy scale, and jaxdd's models are in Å and eV: write the script in "
          "units metal with sigma in Å and epsilon in eV (LAMMPS's default unit style is lj: a script without a "
          "units command is lj)",
}


class UnitError(ValueError):
    """A LAMMPS unit style the bridge does not run."""


def check_units(style: str) -> None:
    """Refuse any LAMMPS unit style but ``metal``, saying what to do (:class:`UnitError`).

    Args:
      style: LAMMPS's unit style (``lmp.extract_global("units")``, or a script's ``units`` command).
    """
    style = str(style).strip()
    if style == SUPPORTED:
        return
    why = _WHY.get(style, "jaxdd's models give eV, eV/Å and eV virials for positions in Å: write the script in "
                          "units metal")
    raise UnitError(f"units {style}: the jaxdd bridge runs LAMMPS's units metal only; {why}")
