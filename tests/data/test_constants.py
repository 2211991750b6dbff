"""Physical constants: defined once (``jaxdd.data.constants``), CODATA 2018 at full precision.

ASE's CODATA 2018 units (``ase.units.create_units("2018")``) are the outside reference; ASE
derives a0 and E_h from other constants, so they agree with the recommended values to ~1e-11.
"""

import math

import pytest
from ase.units import create_units

from jaxdd.data import constants
from jaxdd.models import dftd3, ewald, qeq

ASE_2018 = create_units("2018")


def test_coulomb_constant_is_e_over_four_pi_epsilon_zero_angstrom_of_codata_2018():
    k = ASE_2018["_e"] / (4 * math.pi * ASE_2018["_eps0"] * 1e-10)
    assert constants.COULOMB == pytest.approx(k, rel=1e-13)
    assert constants.COULOMB == pytest.approx(14.3996454784, rel=1e-11)


def test_bohr_and_hartree_are_codata_2018():
    assert constants.BOHR == pytest.approx(ASE_2018["Bohr"], rel=1e-10)
    assert constants.HARTREE == pytest.approx(ASE_2018["Hartree"], rel=1e-10)


@pytest.mark.parametrize("module, name", [(ewald, "COULOMB"), (qeq, "COULOMB"), (dftd3, "BOHR"), (dftd3, "HARTREE")])
def test_models_take_their_constants_from_jaxdd_constants(module, name):
    assert getattr(module, name) is getattr(constants, name)
