"""Built-in models and samples of ``python -m jaxdd.validate``.

Models: ``lennard_jones`` (σ = ε = 1, r_c = 2.5, LJ reduced units). Samples:
``lj-fcc`` (a rattled fcc crystal of 864 atoms at the LJ melt density, reduced units),
``cu-fcc`` (rattled fcc copper, 4×4×4 cubic cells, 256 atoms, Å) and ``molecules`` (eight
small molecules, each in its own open box, Å).
"""

from __future__ import annotations

import numpy as np

__all__ = ["lennard_jones", "SAMPLES", "sample"]


def lennard_jones():
    """Lennard-Jones (σ = ε = 1, r_c = 2.5) with its halo spec."""
    from ..models.lj import LennardJones

    return LennardJones(1.0, 1.0, 2.5)


def _lj_fcc(dtype):
    from ..data import AtomicData
    from ..data.systems import fcc_lattice, melt_lattice_constant

    atoms = fcc_lattice(6, melt_lattice_constant())
    atoms.rattle(0.03, seed=1)
    return AtomicData.from_ase(atoms, dtype=dtype)


def _cu_fcc(dtype):
    from ase.build import bulk

    from ..data import AtomicData

    atoms = bulk("Cu", "fcc", a=3.61, cubic=True).repeat(4)
    atoms.rattle(0.05, seed=2)
    return AtomicData.from_ase(atoms, dtype=dtype)


def _molecules(dtype):
    from ase.build import molecule

    from ..data import Batch

    names = ["H2O", "CH4", "NH3", "C2H6", "CO2", "C6H6", "CH3OH", "HCOOH"]
    mols = []
    for k, name in enumerate(names):
        m = molecule(name)
        m.rattle(0.02, seed=k)
        mols.append(m)
    return Batch.from_ase(mols, dtype=dtype)


SAMPLES = {"lj-fcc": _lj_fcc, "cu-fcc": _cu_fcc, "molecules": _molecules}


def sample(name: str, dtype=np.float64):
    """The built-in sample ``name`` (one of :data:`SAMPLES`), with float arrays of ``dtype``."""
    try:
        return SAMPLES[name](dtype)
    except KeyError:
        raise ValueError(f"unknown built-in sample {name!r}; choose one of {sorted(SAMPLES)}") from None
