"""Lennard-Jones energy, forces and stress of a rattled argon crystal, checked against ASE.

    python examples/01_lj_energy_forces.py
"""

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from ase.calculators.lj import LennardJones as AseLJ  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.data.systems import fcc_lattice  # noqa: E402


def main():
    atoms = fcc_lattice(4, 5.26, symbol="Ar")  # 256 atoms, Å
    atoms.rattle(0.05, seed=0)
    model = LennardJones(sigma=3.4, epsilon=0.0104, cutoff=8.5, shift=True)  # Å, eV
    out = jaxdd.compute(model, jaxdd.AtomicData.from_ase(atoms), ("energy", "forces", "stress"))

    atoms.calc = AseLJ(sigma=3.4, epsilon=0.0104, rc=8.5, smooth=False)
    d_energy = abs(float(out["energy"][0]) - atoms.get_potential_energy())
    d_forces = np.abs(np.asarray(out["forces"]) - atoms.get_forces()).max()
    d_stress = np.abs(np.asarray(out["stress"][0]) - atoms.get_stress(voigt=False)).max()
    print(f"atoms            {len(atoms)}")
    print(f"energy           {float(out['energy'][0]):.10f} eV")
    print(f"|dE| vs ASE      {d_energy:.2e} eV")
    print(f"max |dF| vs ASE  {d_forces:.2e} eV/Å")
    print(f"max |dσ| vs ASE  {d_stress:.2e} eV/Å³")
    return d_energy, d_forces, d_stress


if __name__ == "__main__":
    main()
