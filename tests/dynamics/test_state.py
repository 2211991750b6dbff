"""The state of a dynamics run is an immutable, typed pytree: its leaves are its arrays, a
field is never assigned, and a run returns new states rather than changing the one it was
given. (Checkpoints written before the state took this form restore and continue bit for
bit: ``test_checkpoint_compat.py``.)"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

from jaxdd.dynamics import DomainParallel, MDState, VelocityVerlet
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.engine.placed import AtomRows, Placed, RankPlan
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import lj_melt_data

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 2.5


@pytest.fixture(scope="module")
def run():
    """(the DomainParallel of a 2-rank LJ melt of 108 atoms, its state at step 0)."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("dd",), axis_types=(AxisType.Auto,))
    dm = DistributedModel(LennardJones(1.0, 1.0, CUTOFF), DomainConfig(CUTOFF, skin=0.3, mesh=mesh, grid=(2, 1, 1)))
    md = DomainParallel(dm, VelocityVerlet(0.005), kB=1.0)
    return md, md.init(lj_melt_data(3, temperature=1.44, dtype=np.float64))


def test_the_state_flattens_to_its_arrays(run):
    _, state = run
    leaves, treedef = jax.tree_util.tree_flatten(state)
    assert leaves and all(isinstance(leaf, jax.Array) for leaf in leaves)
    ids = {id(leaf) for leaf in leaves}
    for name in AtomRows.names():
        if state.rows[name] is not None:
            assert id(state.rows[name]) in ids, name
    assert id(state.energy) in ids and id(state.virial) in ids and id(state.plan.plan_cell) in ids
    again = jax.tree_util.tree_unflatten(treedef, leaves)
    assert isinstance(again, MDState) and again.step == state.step and again.layout == state.layout
    # Arrays in, arrays out: a jitted function maps over the state as a whole.
    doubled = jax.jit(lambda s: jax.tree_util.tree_map(lambda x: x, s))(state)
    np.testing.assert_array_equal(doubled.rows.positions, state.rows.positions)


def test_the_state_has_typed_fields(run):
    _, state = run
    assert isinstance(state.placed, Placed)
    assert isinstance(state.rows, AtomRows) and isinstance(state.plan, RankPlan)
    assert state.rows.positions.shape[-1] == 3 and state.plan.cell.shape[-2:] == (3, 3)
    assert state.arrays is state.rows and state.fixed is state.plan  # the earlier names read the same
    assert state.arrays["ids"] is state.rows.ids


@pytest.mark.parametrize("field", ["step", "energy", "placed", "converged"])
def test_assigning_a_field_of_the_state_raises(run, field):
    _, state = run
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(state, field, getattr(state, field))


def test_assigning_a_field_of_the_placed_atoms_raises(run):
    _, state = run
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.placed.rows = state.rows
    with pytest.raises(dataclasses.FrozenInstanceError):
        state.rows.positions = state.rows.positions


def test_replace_makes_a_changed_copy(run):
    _, state = run
    later = state.replace(step=7, template=state.template)
    assert later.step == 7 and state.step == 0 and later.rows is state.rows


def test_a_run_leaves_the_state_it_was_given_unchanged(run):
    md, state = run
    positions = np.asarray(state.rows.positions).copy()
    later = md.run(state, 3)
    assert later.step == 3 and state.step == 0
    np.testing.assert_array_equal(np.asarray(state.rows.positions), positions)
