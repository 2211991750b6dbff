"""Specification of ``jaxdd.models.composite.SumModel``: a short-range MLIP, DFT-D3 and
Ewald/PME electrostatics in one call, one neighbour list and one decomposition.

The sum must equal its members evaluated one by one, each with its own neighbour list
(energy 1e-10 relative, forces and stress 1e-9 absolute), and under decomposition it must
equal its single-device result to the same tolerances.
"""

from __future__ import annotations

import functools
import math

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.models.composite import SumModel
from jaxdd.models.dftd3 import DFTD3
from jaxdd.models.ewald import Ewald
from jaxdd.models.lj_kernel import LennardJonesKernel
from jaxdd.models.mpnn import SchNet
from jaxdd.models.pme import PME
from jaxdd.spec import SPEC_MPNN_GP

from test_ewald import ion_box

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

KEYS = ("energy", "forces", "stress")


def members(long_range="ewald"):
    """SchNet at 4 Å, D3(BJ) pairs at 7 Å (CN at 5 Å), and Ewald or PME with a 6 Å real space."""
    coulomb = Ewald(6.0) if long_range == "ewald" else PME(6.0)
    return (SchNet(species=(11, 17), cutoff=4.0, features=8, n_rbf=8, n_interactions=2),
            DFTD3(cutoff=7.0, cn_cutoff=5.0, species=(11, 17)), coulomb)


def assert_close(got, want):
    np.testing.assert_allclose(np.asarray(got["energy"]), np.asarray(want["energy"]), rtol=1e-10, atol=0)
    for key in ("forces", "stress"):
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=0, atol=1e-9)


@functools.cache
def ions(n=4):
    return ion_box(n, seed=2)


def test_sum_equals_its_members_each_with_its_own_neighbour_list():
    parts = members()
    data = ions()
    separate = [jaxdd.compute(m, data, KEYS) for m in parts]
    want = {k: sum(np.asarray(out[k]) for out in separate) for k in KEYS}
    assert_close(jaxdd.compute(SumModel(*parts), data, KEYS), want)


def test_one_neighbour_list_at_the_largest_range_serves_every_member():
    model = SumModel(*members())
    assert model.model_config.neighbor_config.cutoff == 7.0
    assert model.cutoff == 7.0


@pytest.mark.slow
def test_distributed_sum_equals_single_device():
    model = SumModel(*members())
    data = ions(6)  # 216 ions, a ~17 Å triclinic cell
    want = jaxdd.compute(model, data, KEYS)
    mesh = Mesh(np.asarray(jax.devices()[:4]), ("dd",), axis_types=(AxisType.Auto,))
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, mesh=mesh, grid=(2, 2, 1)))
    assert_close(dm(data, KEYS), want)


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 2), (2, 2, 1)])
def test_distributed_sum_with_pme_equals_single_device(grid):
    model = SumModel(*members("pme"))
    data = ions(6)
    want = jaxdd.compute(model, data, KEYS)
    mesh = Mesh(np.asarray(jax.devices()[:math.prod(grid)]), ("dd",), axis_types=(AxisType.Auto,))
    dm = DistributedModel(model, DomainConfig(cutoff=model.cutoff, mesh=mesh, grid=grid))
    assert_close(dm(data, KEYS), want)


def test_a_single_member_is_refused():
    with pytest.raises(ValueError, match="at least two members"):
        SumModel(Ewald(6.0))


def test_a_member_with_its_own_forces_is_refused():
    with pytest.raises(ValueError, match=r"members\[1\] \(LennardJonesKernel\) computes \['forces', 'stress'\]"):
        SumModel(Ewald(6.0), LennardJonesKernel(1.0, 1.0, 2.5))


def test_members_whose_specs_store_atoms_differently_are_refused():
    class NodeBlocks(SchNet):
        @property
        def distribution_spec(self):
            return SPEC_MPNN_GP

    with pytest.raises(ValueError, match="share a storage policy"):
        SumModel(Ewald(6.0), NodeBlocks(species=(11, 17), cutoff=4.0)).distribution_spec
