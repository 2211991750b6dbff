"""Several processes: two processes of two virtual CPU devices each (gloo collectives) give
what one process of four devices gives, a process that dies ends the other within a bounded
time, and a run restarted from its checkpoint ends where an uninterrupted one does.

Each case starts ``python -m jaxdd.launch -n 2 --cpu-devices 2 tests/multiprocess_worker.py``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdd
from jaxdd import DistributedModel, DomainConfig
from jaxdd.distributed import default_mesh
from jaxdd.launch import initialize
from jaxdd.models.lj import LennardJones

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "multiprocess_worker.py"
# The single-process references are small systems on four ranks; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


def launcher(*target, grace: float = 120, timeout: float = 600):
    """``python -m jaxdd.launch -n 2 --cpu-devices 2 <target>``, finished."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "jaxdd.launch", "-n", "2", "--cpu-devices", "2", "--grace", str(grace), *target],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=TESTS.parent)


def launch(out_dir: Path, task: str, *extra, grace: float = 120):
    t0 = time.time()
    proc = launcher(str(WORKER), str(out_dir), task, *extra, grace=grace)
    return proc, time.time() - t0


@functools.lru_cache(maxsize=None)
def uninterrupted(tmp: str):
    """(launch result of the 50-step run, its final state) — shared by the MD cases."""
    out = Path(tmp)
    proc, _ = launch(out, "md")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, dict(np.load(out / "md.npz"))


@pytest.fixture(scope="module")
def md_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("md"))


def test_initialize_without_any_setting_leaves_a_single_process_alone(monkeypatch):
    for name in ("JAXDD_COORDINATOR", "JAXDD_NUM_PROCESSES", "JAXDD_PROCESS_ID", "JAX_COORDINATOR_ADDRESS",
                 "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert initialize() is False


def test_initialize_with_a_partial_setting_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("JAXDD_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.delenv("JAXDD_NUM_PROCESSES", raising=False)
    monkeypatch.delenv("JAXDD_PROCESS_ID", raising=False)
    with pytest.raises(ValueError, match="num_processes, process_id"):
        initialize()


def run_launcher_main(*argv, timeout=60):
    return subprocess.run([sys.executable, "-m", "jaxdd.launch", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS.parent)


def test_launcher_gives_every_process_its_index_and_one_coordinator(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os, sys\nprint(os.environ['JAXDD_PROCESS_ID'], os.environ['JAXDD_NUM_PROCESSES'], "
                      "os.environ['JAXDD_COORDINATOR'], os.environ['JAX_NUM_CPU_DEVICES'], sys.argv[1:])\n")
    proc = run_launcher_main("-n", "3", "--cpu-devices", "2", str(script), "-m", "x")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert [line.split()[:2] for line in lines] == [["[0]", "0"], ["[1]", "1"], ["[2]", "2"]]
    assert len({line.split()[3] for line in lines}) == 1  # one coordinator address
    assert all(line.endswith("2 ['-m', 'x']") for line in lines)  # the script's own -m is its argument


def test_launcher_stops_the_others_when_one_fails_and_returns_its_status(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['JAXDD_PROCESS_ID'] == '1':\n    sys.exit(3)\n"
                      "time.sleep(600)\n")
    t0 = time.time()
    proc = run_launcher_main("-n", "2", "--grace", "1", str(script))
    assert proc.returncode == 3
    assert time.time() - t0 < 30
    assert "process 1 exited with status 3" in proc.stderr and "stopped the remaining processes" in proc.stderr


def test_launcher_without_a_target_is_a_usage_error():
    proc = run_launcher_main("-n", "2")
    assert proc.returncode == 2 and "give a script" in proc.stderr


@pytest.mark.slow
def test_two_processes_give_the_single_process_models(tmp_path):
    from multiprocess_worker import OUTPUTS, lj_crystal
    from test_dispatch import SYSTEM, Plain

    proc, _ = launch(tmp_path, "models")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "process 1 of 2: devices" in proc.stdout
    got = np.load(tmp_path / "models.npz")
    mesh = default_mesh(jax.devices()[:4])
    lj = DistributedModel(LennardJones(1.0, 1.0, 2.5), DomainConfig(2.5, mesh=mesh))(lj_crystal(),
                                                                                                   OUTPUTS)
    mp = DistributedModel(Plain("mpnn_segment_sum"), DomainConfig(5.0, mesh=mesh))(SYSTEM, ("energy", "forces"))
    # Each process planned only the two ranks on its own devices, and they agreed on the rest.
    planned = [json.loads((tmp_path / f"planned-{p}.json").read_text()) for p in (0, 1)]
    assert [p["ranks"] for p in planned] == [[0, 1], [2, 3]]
    assert all(p["rows"][0] == 2 for p in planned)
    assert planned[0]["health_owned"] == planned[1]["health_owned"] == planned[0]["owned"] + planned[1]["owned"]
    for prefix, want in (("lj", lj), ("mpnn", mp)):
        for key, value in want.items():
            value = np.asarray(value)
            tol = dict(rtol=1e-10, atol=0) if key == "energy" else dict(rtol=0, atol=1e-10)
            np.testing.assert_allclose(got[f"{prefix}_{key}"], value, err_msg=f"{prefix} {key}", **tol)


@pytest.mark.slow
def test_fifty_md_steps_on_two_processes_give_the_single_process_trajectory(md_dir):
    from jaxdd.systems import lj_melt_data

    _, got = uninterrupted(md_dir)
    model = LennardJones(1.0, 1.0, 2.5, skin=0.3)
    dm = DistributedModel(model, DomainConfig(2.5, skin=0.3, mesh=default_mesh(jax.devices()[:4])))
    engine = jaxdd.DomainParallel(dm, jaxdd.VelocityVerlet(0.005), kB=1.0)
    state = engine.run(engine.init(lj_melt_data(5, temperature=1.44)), 50)
    want = engine.gather(state)
    assert int(got["step"]) == 50
    assert int(got["rebuilds"]) >= 1 and int(got["host_rebuilds"]) == 0  # every rebuild ran on the devices
    np.testing.assert_allclose(got["positions"], np.asarray(want.positions), rtol=0, atol=1e-10)
    np.testing.assert_allclose(got["total_energy"], engine.thermo(state)["total_energy"], rtol=1e-10, atol=0)


@pytest.mark.slow
def test_a_process_that_dies_ends_the_other_within_60_s_and_the_restart_finishes_the_run(md_dir, tmp_path):
    _, whole = uninterrupted(md_dir)
    proc, _ = launch(tmp_path, "md", "--die-after-checkpoint")
    ended = time.time()
    assert proc.returncode != 0
    died = float((tmp_path / "died").read_text())
    assert ended - died < 60, f"the surviving process took {ended - died:.0f} s to stop"
    out = proc.stdout + proc.stderr
    assert "process 1 exited with signal 9" in out
    assert "another task died" in out or "heartbeat" in out, out[-3000:]
    assert not (tmp_path / "md.npz").exists()

    proc, _ = launch(tmp_path, "restart")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    again = np.load(tmp_path / "restart.npz")
    assert int(again["step"]) == 50
    np.testing.assert_array_equal(again["total_energy"], whole["total_energy"])
    np.testing.assert_array_equal(again["positions"], whole["positions"])


@pytest.mark.slow
def test_validate_command_runs_across_two_processes_and_one_reports():
    proc = launcher("-m", "jaxdd.validate", "--builtin", "lj-fcc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[0] OK — distributed outputs equal single device on 4 ranks" in proc.stdout
    assert "4 cpu device(s) across 2 processes" in proc.stdout
    assert "[1] OK" not in proc.stdout
