"""Specification of ``jaxdd.dynamics``: DomainParallel molecular dynamics and minimisation.

The reference trajectory is a plain velocity-Verlet loop on one device around
``jaxdd.compute``; distributed runs must follow it to 1e-9 (float64) through plan rebuilds
and migrations. System: the LAMMPS LJ melt in reduced units, 4³ fcc cells (256 atoms,
box 6.7 σ) at T = 1.44, cutoff 2.5 σ, skin 0.3 σ.
"""

from __future__ import annotations

import functools
import math
import re
import shutil

import ase.io
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.dynamics import FIRE, DomainParallel, Langevin, VelocityVerlet
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import lj_melt, lj_melt_data

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF, SKIN, DT = 2.5, 0.3, 0.005
MODEL = LennardJones(1.0, 1.0, CUTOFF)


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def melt(n_cells=4, temperature=1.44):
    return lj_melt_data(n_cells, temperature=temperature, dtype=np.float64)


def fresh_md(grid, integrator=VelocityVerlet(DT), shift=False, skin=0.0):
    """A new DomainParallel (its own compiled programs and capacities). skin: the model's
    neighbour skin (> 0: the loop keeps its neighbour list between steps)."""
    model = LennardJones(1.0, 1.0, CUTOFF, shift=shift, skin=skin)
    dm = DistributedModel(model, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(math.prod(grid)), grid=grid))
    return DomainParallel(dm, integrator, kB=None if isinstance(integrator, Langevin) else 1.0)


# Compiling a loop takes seconds: tests that only read results share one per configuration.
md_on = functools.lru_cache(maxsize=None)(fresh_md)


@functools.lru_cache(maxsize=None)
def reference(n_steps):
    """Velocity Verlet on one device: [(positions, velocities)] after every step."""
    data = melt()
    pos = np.asarray(data.positions)
    vel = np.asarray(data.velocities)
    cap = jaxdd.neighbor_capacity(pos, data.cell, data.pbc, cutoff=CUTOFF, headroom=1.5)

    def forces(x):
        return np.asarray(jaxdd.compute(MODEL, data.replace(positions=x), ("forces",), capacity=cap)["forces"])

    f = forces(pos)
    frames = []
    for _ in range(n_steps):
        vel = vel + 0.5 * DT * f
        pos = pos + DT * vel
        f = forces(pos)
        vel = vel + 0.5 * DT * f
        frames.append((pos, vel))
    return frames


@functools.lru_cache(maxsize=None)
def nve_run(grid, n_steps):
    md = md_on(grid)
    state = md.run(md.init(melt()), n_steps)
    return md, state


# ----------------------------------------------------------------------------- trajectories


# 50 steps: the melt at T = 1.44 rebuilds its plans every eight steps or so (six times here).
N_STEPS = 50


@pytest.mark.parametrize("grid", [(2, 2, 1), pytest.param((3, 2, 1), marks=pytest.mark.slow)], ids=["2x2x1", "3x2x1"])
def test_nve_trajectory_equals_single_device_through_migrations(grid):
    md, state = nve_run(grid, N_STEPS)
    assert state.step == N_STEPS
    assert md.last_run.rebuilds >= 3 and md.last_run.migrations >= 1
    got = md.gather(state)
    pos, vel = reference(N_STEPS)[-1]
    np.testing.assert_allclose(np.asarray(got.positions), pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got.velocities), vel, rtol=0, atol=1e-9)


def test_a_rebuild_foreseen_from_the_last_step_discards_no_step():
    # Each step is checked against where the next one will take the atoms (this step's move
    # extrapolated): the plan is rebuilt before a step outruns it, not after evaluating one.
    md, _ = nve_run((2, 2, 1), N_STEPS)
    assert md.last_run.rebuilds >= 1
    assert md.last_run.discarded == 0


def _flops(lowered) -> float:
    analysis = lowered.compile().cost_analysis()
    return float((analysis[0] if isinstance(analysis, (list, tuple)) else analysis)["flops"])


def test_lower_gives_the_device_loop_whose_body_is_one_step():
    # XLA counts a loop body once: the step's flops are about one force evaluation's.
    md, state = nve_run((2, 2, 1), N_STEPS)
    step = _flops(md.lower(state))
    force = _flops(md.dist_model.lower(melt(), ("energy", "forces")))
    assert 0.5 * force < step < 2 * force


def test_one_rank_trajectory_equals_single_device_without_plan_rebuilds():
    # One rank searches its periodic cell itself and holds no ghost rows: no atom can outrun
    # its plan, so the device loop runs through (the search wraps the positions it bins).
    md, state = nve_run((1, 1, 1), 40)
    assert md.last_run.rebuilds == 0 and md.last_run.discarded == 0
    got = md.gather(state)
    pos, vel = reference(N_STEPS)[39]
    np.testing.assert_allclose(np.asarray(got.positions), pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got.velocities), vel, rtol=0, atol=1e-9)


def test_kept_neighbour_list_gives_the_single_device_trajectory():
    md = md_on((2, 2, 1), skin=SKIN)
    assert md.nl_skin == SKIN
    state = md.run(md.init(melt()), N_STEPS)
    assert md.last_run.rebuilds >= 3  # the list is kept between rebuilds, and built afresh at each
    got = md.gather(state)
    pos, vel = reference(N_STEPS)[-1]
    np.testing.assert_allclose(np.asarray(got.positions), pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got.velocities), vel, rtol=0, atol=1e-9)


@pytest.mark.skipif(not jaxdd.ffi.available(), reason="compiled kernels not built (pip install -e .)")
def test_the_fused_kernel_on_a_half_list_gives_the_single_device_trajectory():
    from jaxdd.models.lj_kernel import LennardJonesKernel

    model = LennardJonesKernel(1.0, 1.0, CUTOFF, skin=SKIN, half_list=True)
    md = DomainParallel(DistributedModel(model, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(6), grid=(3, 2, 1))),
                        VelocityVerlet(DT), kB=1.0)
    state = md.run(md.init(melt()), N_STEPS)
    assert md.last_run.rebuilds >= 1 and md.last_run.host_rebuilds == 0
    got = md.gather(state)
    pos, vel = reference(N_STEPS)[-1]
    np.testing.assert_allclose(np.asarray(got.positions), pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got.velocities), vel, rtol=0, atol=1e-9)


def test_every_atom_has_exactly_one_owner_after_the_run():
    _, state = nve_run((2, 2, 1), N_STEPS)
    ids = np.asarray(state.arrays["ids"]).ravel()
    assert sorted(ids[ids >= 0].tolist()) == list(range(melt().n_atoms))


@pytest.mark.slow
def test_langevin_on_one_and_two_devices_gives_the_same_trajectory():
    integrator = Langevin(DT, temperature=1.44, friction=1.0, seed=7, kB=1.0)
    one, two = md_on((1, 1, 1), integrator), md_on((2, 1, 1), integrator)
    a = one.gather(one.run(one.init(melt()), 20))
    b = two.gather(two.run(two.init(melt()), 20))
    np.testing.assert_allclose(np.asarray(b.positions), np.asarray(a.positions), rtol=0, atol=1e-9)


@pytest.mark.slow
def test_langevin_trajectory_does_not_depend_on_the_device_count():
    integrator = Langevin(DT, temperature=1.44, friction=1.0, seed=7, kB=1.0)
    runs = []
    for grid in [(1, 1, 1), (2, 1, 1), (2, 2, 2)]:
        md = md_on(grid, integrator)
        runs.append(md.gather(md.run(md.init(melt()), 60)))
    for other in runs[1:]:
        np.testing.assert_allclose(np.asarray(other.positions), np.asarray(runs[0].positions), rtol=0, atol=1e-9)
        np.testing.assert_allclose(np.asarray(other.velocities), np.asarray(runs[0].velocities), rtol=0, atol=1e-9)


@pytest.mark.slow
def test_langevin_thermostat_drives_a_cold_system_towards_its_temperature():
    md = md_on((2, 1, 1), Langevin(DT, temperature=1.0, friction=5.0, seed=1, kB=1.0))
    state = md.run(md.init(melt(temperature=0.05)), 200)
    assert 0.6 < md.thermo(state)["temperature"][0] < 1.4


# ----------------------------------------------------------------------------- restart


def test_restart_continues_bit_for_bit_on_the_same_device_count(tmp_path):
    integrator = Langevin(DT, temperature=1.44, friction=0.5, seed=3, kB=1.0)
    md = md_on((2, 2, 1), integrator)
    straight = md.run(md.init(melt()), 20)
    half = md.run(md.init(melt()), 10)
    md.save(tmp_path / "ck", half)
    again = fresh_md((2, 2, 1), integrator)
    resumed = again.run(again.restore(tmp_path / "ck"), 10)
    assert resumed.step == 20
    a, b = md.gather(straight), again.gather(resumed)
    np.testing.assert_array_equal(np.asarray(a.positions), np.asarray(b.positions))
    np.testing.assert_array_equal(np.asarray(a.velocities), np.asarray(b.velocities))


@pytest.mark.slow
def test_restart_on_another_device_count_agrees_to_round_off(tmp_path):
    md = md_on((2, 2, 1))
    straight = md.run(md.init(melt()), 40)
    md.save(tmp_path / "ck", md.run(md.init(melt()), 20))
    other = fresh_md((2, 1, 1))
    resumed = other.run(other.restore(tmp_path / "ck"), 20)
    np.testing.assert_allclose(np.asarray(other.gather(resumed).positions), np.asarray(md.gather(straight).positions),
                               rtol=0, atol=1e-10)


def test_checkpoint_stores_the_spec_and_never_overwrites(tmp_path):
    md = md_on((2, 1, 1))
    state = md.init(melt())
    path = md.save(tmp_path / "ck", state)
    assert jaxdd.MLIPSpec.load(path / "spec.json") == md.dist_model.spec
    with pytest.raises(FileExistsError):
        md.save(path, state)


def test_restore_refuses_a_different_integrator(tmp_path):
    md = md_on((2, 1, 1))
    md.save(tmp_path / "ck", md.init(melt()))
    with pytest.raises(ValueError, match="same integrator"):
        md_on((2, 1, 1), VelocityVerlet(0.001)).restore(tmp_path / "ck")


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """One small checkpoint (2 ranks), copied by each test that damages it."""
    md = md_on((2, 1, 1))
    return md.save(tmp_path_factory.mktemp("saved") / "ck", md.init(melt()))


def _cut_short(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


# (damage done to a copy of the checkpoint, the file or folder the error must name, what it must say)
DAMAGES = {
    "empty md.json": (lambda ck: (ck / "md.json").write_text(""), "md.json", "is empty"),
    "truncated md.json": (lambda ck: _cut_short(ck / "md.json"), "md.json", "is not valid JSON"),
    "md.json without a field": (lambda ck: (ck / "md.json").write_text('{"step": 3}'), "md.json", "has no field"),
    "deleted arrays folder": (lambda ck: shutil.rmtree(ck / "arrays"), "arrays", "is missing"),
    "truncated array metadata": (lambda ck: _cut_short(ck / "arrays" / "_METADATA"), "arrays/_METADATA",
                                 "is not valid JSON"),
    "removed array manifest": (lambda ck: (ck / "arrays" / "manifest.ocdbt").unlink(), "arrays/manifest.ocdbt",
                               "is missing"),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_restoring_a_damaged_checkpoint_names_the_file_and_what_is_wrong(saved_checkpoint, tmp_path, damage):
    make, name, problem = DAMAGES[damage]
    if not (saved_checkpoint / name).exists():
        pytest.skip(f"this orbax writes no {name}")
    ck = shutil.copytree(saved_checkpoint, tmp_path / "ck")
    make(ck)
    with pytest.raises(jaxdd.CheckpointError, match=f"damaged checkpoint: {re.escape(str(ck / name))} {problem}.*"
                                                     "restore an intact copy"):
        md_on((2, 1, 1)).restore(ck)


# ----------------------------------------------------------------------------- thermo and output


def test_thermo_at_step_zero_matches_the_generated_temperature_and_ase_pressure():
    from ase.calculators.lj import LennardJones as AseLJ

    md = md_on((2, 1, 1))
    thermo = md.thermo(md.init(melt()))
    np.testing.assert_allclose(thermo["temperature"], [1.44], rtol=1e-12)  # 3N - 3 degrees of freedom
    # LAMMPS's step-0 potential energy per atom of the melt (pair_style lj/cut 2.5, unshifted).
    np.testing.assert_allclose(thermo["potential_energy"] / 256, [-6.773368053234], rtol=1e-10)
    # ASE's LJ is shifted to zero at the cutoff: a constant per pair, so the same stress.
    atoms = lj_melt(4, temperature=1.44)
    atoms.calc = AseLJ(sigma=1.0, epsilon=1.0, rc=CUTOFF, smooth=False)
    ke = 0.5 * np.sum(atoms.get_masses()[:, None] * atoms.get_velocities() ** 2)
    pressure = 2 * ke / (3 * atoms.get_volume()) - np.sum(atoms.get_stress()[:3]) / 3
    np.testing.assert_allclose(thermo["pressure"], [pressure], rtol=1e-9)
    np.testing.assert_allclose(thermo["total_energy"], thermo["potential_energy"] + thermo["kinetic_energy"])


def test_thermo_is_logged_every_n_steps():
    rows = []
    md = md_on((2, 1, 1))
    md.run(md.init(melt()), 30, thermo_every=10, log=lambda step, thermo: rows.append(step))
    assert rows == [10, 20, 30]


def test_trajectory_frames_are_the_gathered_system(tmp_path):
    md = md_on((2, 1, 1))
    state = md.run(md.init(melt()), 20, trajectory=tmp_path / "traj.extxyz", trajectory_every=10)
    frames = ase.io.read(tmp_path / "traj.extxyz", ":")
    assert [f.info["step"] for f in frames] == [0, 10, 20]
    np.testing.assert_allclose(frames[-1].positions, np.asarray(md.gather(state).positions), atol=1e-8)
    np.testing.assert_allclose(frames[-1].get_forces(), md.forces(state), atol=1e-8)


def test_progress_reports_atom_steps_per_second(capsys):
    md = md_on((2, 1, 1))
    md.run(md.init(melt()), 10, progress=True)
    err = capsys.readouterr().err
    assert "atom-steps/s" in err and "10/10 steps" in err
    assert md.last_run.atom_steps_per_second > 0


# ----------------------------------------------------------------------------- minimisation


@pytest.mark.slow
def test_fire_relaxes_a_rattled_crystal_to_the_lattice_energy():
    from ase.calculators.lj import LennardJones as AseLJ

    perfect = lj_melt(3, density=1.0)
    atoms = perfect.copy()
    atoms.rattle(0.05, seed=2)
    md = md_on((2, 1, 1), FIRE(fmax=1e-4), shift=True)  # shifted to zero at the cutoff, as ASE's LJ
    state = md.run(md.init(jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)), 2000)
    assert state.converged and state.step < 2000
    assert np.abs(md.forces(state)).max() < 1e-4
    perfect.calc = AseLJ(sigma=1.0, epsilon=1.0, rc=CUTOFF, smooth=False)
    np.testing.assert_allclose(md.thermo(state)["potential_energy"], [perfect.get_potential_energy()], rtol=1e-8)


# ----------------------------------------------------------------------------- capacities and errors


@pytest.mark.slow
def test_neighbour_list_overflow_grows_and_the_trajectory_is_unchanged():
    import dataclasses

    md = fresh_md((2, 2, 1))
    state = md.init(melt())
    dm = md.dist_model
    dm.sizing.use(dataclasses.replace(
        dm.capacities, neighbors=dataclasses.replace(dm.capacities.neighbors, max_edges=dm.capacities.neighbors.max_edges // 2)))
    state = md.run(state, 20)
    assert md.last_run.recompiles >= 1
    np.testing.assert_allclose(np.asarray(md.gather(state).positions), reference(N_STEPS)[19][0], rtol=0, atol=1e-9)


# One rank: the slow set (the kept list of one rank follows one device in the default suite
# through test_one_rank_trajectory_equals_single_device_without_plan_rebuilds).
@pytest.mark.parametrize("grid", [(2, 2, 1), pytest.param((1, 1, 1), marks=pytest.mark.slow)], ids=["2x2x1", "1x1x1"])
def test_a_kept_neighbour_list_that_overflowed_when_built_grows_and_the_trajectory_is_unchanged(grid):
    """With a skin the loop keeps its list between steps; the list built before the first
    step is checked at that step (a list too small there is never used)."""
    import dataclasses

    md = fresh_md(grid, skin=0.2)
    state = md.init(melt())
    dm = md.dist_model
    dm.sizing.use(dataclasses.replace(
        dm.capacities, neighbors=dataclasses.replace(dm.capacities.neighbors, max_edges=dm.capacities.neighbors.max_edges // 2)))
    state = md.run(state, 20)
    assert md.last_run.recompiles >= 1
    np.testing.assert_allclose(np.asarray(md.gather(state).positions), reference(N_STEPS)[19][0], rtol=0, atol=1e-9)


def test_two_different_boltzmann_constants_are_refused():
    dm = DistributedModel(MODEL, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(2)))
    with pytest.raises(ValueError, match="kB"):
        DomainParallel(dm, Langevin(DT, temperature=1.0, friction=1.0), kB=1.0)


def test_zero_skin_is_refused():
    dm = DistributedModel(MODEL, DomainConfig(CUTOFF, mesh=mesh_of(2)))
    with pytest.raises(ValueError, match="skin"):
        DomainParallel(dm, VelocityVerlet(DT))


def test_a_time_step_too_large_for_the_skin_is_named():
    md = fresh_md((2, 1, 1), VelocityVerlet(0.5))
    with pytest.raises(RuntimeError, match="time step is too large"):
        md.run(md.init(melt(temperature=3.0)), 5)


@pytest.mark.parametrize("kwargs, match", [(dict(n_steps=-1), "n_steps"), (dict(n_steps=5, trajectory="x.xyz"),
                                                                             "trajectory_every"),
                                           (dict(n_steps=2.5), "n_steps must be an integer >= 0, got 2.5"),
                                           (dict(n_steps=5, thermo_every=True), "thermo_every .* got True")])
def test_bad_run_arguments_are_named(kwargs, match):
    md = md_on((2, 1, 1))
    state = md.init(melt())
    with pytest.raises(ValueError, match=match):
        md.run(state, **kwargs)


@pytest.mark.parametrize("make, match", [(lambda: VelocityVerlet(0.0), "dt"),
                                         (lambda: Langevin(0.005, temperature=-1.0, friction=1.0), "temperature"),
                                         (lambda: FIRE(fmax=0.0), "fmax")])
def test_bad_integrator_settings_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ----------------------------------------------------------------------------- slow


@pytest.mark.slow
def test_nve_energy_drift_of_4000_atoms_over_1000_steps_is_below_1e_4():
    # Shifted to zero at the cutoff: an unshifted cut potential jumps by V(rc) whenever a pair
    # crosses it, and melting the lattice changes the pair count; that is not integrator drift.
    # The fused kernel keeping its neighbour list between steps (skin): the drift measured is the
    # integrator's, and this path runs the 4M atom-steps in seconds instead of minutes.
    from jaxdd.models.lj_kernel import LennardJonesKernel

    model = LennardJonesKernel(1.0, 1.0, CUTOFF, shift=True, skin=SKIN)
    md = DomainParallel(DistributedModel(model, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(2), grid=(2, 1, 1))),
                        VelocityVerlet(DT), kB=1.0)
    state = md.init(melt(10))
    e0 = md.thermo(state)["total_energy"][0]
    state = md.run(state, 1000)
    e1 = md.thermo(state)["total_energy"][0]
    assert abs(e1 - e0) / abs(e0) < 1e-4


def test_a_step_that_stays_non_finite_on_a_fresh_plan_is_refused_naming_it():
    import equinox as eqx

    broken = eqx.tree_at(lambda m: m.epsilon, MODEL, jnp.full_like(MODEL.epsilon, jnp.nan))  # weights gone bad
    dm = DistributedModel(broken, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(2), grid=(2, 1, 1)))
    md = DomainParallel(dm, VelocityVerlet(DT), kB=1.0)
    with pytest.raises(RuntimeError, match="not finite at step 1"):
        md.run(md.init(melt()), 3)
