"""Physical constants, each defined once, at full precision, in jaxdd's units (Å, eV, e).

Source: the CODATA 2018 recommended values (E. Tiesinga et al., Rev. Mod. Phys. 93, 025010
(2021)), the set simple-dftd3 and ASE's ``create_units("2018")`` use. Every model that needs a
constant imports it from here.
"""

from __future__ import annotations

import math

__all__ = ["ELEMENTARY_CHARGE", "VACUUM_PERMITTIVITY", "COULOMB", "BOHR", "HARTREE"]

#: Elementary charge e (C; exact since the 2019 SI).
ELEMENTARY_CHARGE = 1.602176634e-19

#: Vacuum electric permittivity ε0 (F/m).
VACUUM_PERMITTIVITY = 8.8541878128e-12

#: Coulomb constant k = e / (4π ε0 Å) in eV Å / e² (14.3996454784...): k q_i q_j / r is an
#: energy in eV for charges in e and r in Å.
COULOMB: float = ELEMENTARY_CHARGE / (4.0 * math.pi * VACUUM_PERMITTIVITY * 1e-10)

#: Bohr radius a0 in Å.
BOHR = 0.529177210903

#: Hartree energy E_h in eV.
HARTREE = 27.211386245988
