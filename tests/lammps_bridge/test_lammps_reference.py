"""Specification: the bridge's evaluations equal LAMMPS's own ``lj/cut``, from stored runs.

``tests/data/lammps/make_bridge_reference.py`` stored LAMMPS's 200-step runs of 108 argon atoms
in a triclinic box (metal units, float64). Here, without LAMMPS:

* NVE: LAMMPS's ``fix nve`` written out operation by operation (``fix_nve.cpp``) takes its
  forces from the evaluator, handed positions wrapped as LAMMPS holds them; thermo every 10
  steps equals LAMMPS's to 1e-9 relative, and the final positions to 1e-9 Å;
* NPT (``fix npt ... tri``, the box growing by a third): LAMMPS's own states every 10 steps,
  its box origin moving, give LAMMPS's energy, virial and forces to 1e-9 relative.

Both on one device and on a (2, 2, 1) grid of virtual devices, where atoms migrate and the
plan is rebuilt on the devices between LAMMPS's steps.
"""

from __future__ import annotations

import numpy as np
import pytest

from bridge_systems import ARGON, REFERENCE, evaluator, wrapped
from jaxdd.engine.placed import Placed

# 108 atoms on four ranks: every rank holds every atom as a ghost, which jaxdd warns about.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")
R = REFERENCE
N = R["nve__x"].shape[0]
TAGS = np.arange(1, N + 1)
NUMBERS = np.full(N, ARGON)


def lammps_nve(ev, steps=200, every=10):
    """LAMMPS's velocity Verlet (fix nve) with the evaluator as the force field.

    Returns (thermo rows [step, pe, ke, press, pxy] every ``every`` steps, final positions)."""
    x, v, mass, cell = R["nve__x"].copy(), R["nve__v"].copy(), R["nve__mass"], R["nve__cell"]
    dt, ftm2v, mvv2e, nktv2p = 0.002, float(R["ftm2v"]), float(R["mvv2e"]), float(R["nktv2p"])
    volume = abs(np.linalg.det(cell))
    dtfm = (0.5 * dt * ftm2v / mass)[:, None]

    def thermo(step, res):
        mv2 = mvv2e * np.einsum("n,na,nb->ab", mass, v, v)
        press = (np.trace(mv2) + np.trace(res.virial)) / (3 * volume) * nktv2p
        pxy = (mv2[0, 1] + res.virial[0, 1]) / volume * nktv2p
        return [step, res.energy, 0.5 * np.trace(mv2), press, pxy]

    res = ev(TAGS, wrapped(x, cell), NUMBERS, cell)
    rows = [thermo(0, res)]
    for step in range(1, steps + 1):
        v = v + dtfm * res.forces
        x = x + dt * v
        res = ev(TAGS, wrapped(x, cell), NUMBERS, cell)
        v = v + dtfm * res.forces
        if step % every == 0:
            rows.append(thermo(step, res))
    return np.array(rows), x


def check_nve(grid, steps):
    ev = evaluator(grid)
    rows, x = lammps_nve(ev, steps)
    ref = R["nve__thermo"][:len(rows)]
    scale = np.max(np.abs(ref), axis=0)
    assert np.all(np.abs(rows - ref) <= 1e-9 * scale), np.abs(rows - ref) / scale
    if steps == 200:
        np.testing.assert_allclose(x, R["nve__final_x"], rtol=0, atol=1e-9)
    return ev


def check_npt_frames(grid):
    ev = evaluator(grid)
    for k in range(len(R["npt__frames_pe"])):
        res = ev(TAGS, R["npt__frames_x"][k], NUMBERS, R["npt__frames_cell"][k], R["npt__frames_origin"][k])
        assert abs(res.energy - R["npt__frames_pe"][k]) <= 1e-9 * abs(R["npt__frames_pe"]).max(), k
        np.testing.assert_allclose(res.virial, R["npt__frames_virial"][k], rtol=0,
                                   atol=1e-9 * np.abs(R["npt__frames_virial"][k]).max())
        np.testing.assert_allclose(res.forces, R["npt__frames_f"][k], rtol=0,
                                   atol=1e-9 * np.abs(R["npt__frames_f"][k]).max())
    return ev


def test_atoms_handed_over_in_another_order_get_their_forces_in_that_order_on_the_same_plan():
    # LAMMPS sorts its atoms now and then (atom_modify sort): the same atoms in a new order.
    ev = evaluator()
    x, cell, origin = R["npt__frames_x"][0], R["npt__frames_cell"][0], R["npt__frames_origin"][0]
    first = ev(TAGS, x, NUMBERS, cell, origin)
    for seed in (1, 2, 2):
        order = np.random.default_rng(seed).permutation(N)
        again = ev(TAGS[order], x[order], NUMBERS[order], cell, origin)
        np.testing.assert_allclose(again.forces, first.forces[order], rtol=0, atol=1e-12)
    assert ev.counts.placements == 1


def test_an_evaluation_an_atom_outran_is_repeated_on_a_new_plan_the_evaluator_holds():
    # Two ranks, so the plan can go stale: one atom jumps 0.8 Å, beyond half the 1 Å skin.
    ev = evaluator((2, 1, 1))
    x, cell, origin = R["npt__frames_x"][0], R["npt__frames_cell"][0], R["npt__frames_origin"][0]
    ev(TAGS, x, NUMBERS, cell, origin)
    moved = x.copy()
    moved[0] += [0.8, 0.0, 0.0]
    got = ev(TAGS, moved, NUMBERS, cell, origin)
    assert ev.counts.placements == 1 and ev.counts.repeated == 1 and ev.counts.rebuilds >= 1
    assert isinstance(ev.placed, Placed)  # the engine's placed atoms: the bridge keeps no dynamics state
    want = evaluator((2, 1, 1))(TAGS, moved, NUMBERS, cell, origin)
    np.testing.assert_allclose(got.forces, want.forces, rtol=0, atol=1e-12 * np.abs(want.forces).max())
    assert abs(got.energy - want.energy) <= 1e-12 * abs(want.energy)


def test_nve_through_the_evaluator_follows_lammps_lj_cut_on_one_device():
    ev = check_nve((1, 1, 1), 200)
    assert ev.counts.placements == 1  # the plan of the first call served all 200 steps


@pytest.mark.slow
def test_nve_through_the_evaluator_follows_lammps_lj_cut_on_a_2x2x1_grid():
    ev = check_nve((2, 2, 1), 200)
    assert ev.counts.placements == 1 and ev.counts.rebuilds > 0  # atoms migrated on the devices


def test_npt_tri_states_of_lammps_give_its_energy_virial_and_forces_on_one_device():
    check_npt_frames((1, 1, 1))


@pytest.mark.slow
def test_npt_tri_states_of_lammps_give_its_energy_virial_and_forces_on_a_2x2x1_grid():
    ev = check_npt_frames((2, 2, 1))
    assert ev.counts.placements == 1 and ev.counts.rebuilds > 0
