"""Several processes: two processes of two virtual CPU devices each (gloo collectives) give
what one process of four devices gives, a process that fails (exception, ``sys.exit``, SIGKILL,
SIGINT) ends the other within a bounded time and the launcher names it and exits with its
status, and a run restarted from its checkpoint ends where an uninterrupted one does.

Each case starts ``python -m jaxdd.launch -n 2 --cpu-devices 2 tests/multiprocess_worker.py``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import jaxdd
from jaxdd import DistributedModel, DomainConfig
from jaxdd.engine import default_mesh
from jaxdd.launch import initialize
from jaxdd.models.lj import LennardJones

TESTS = Path(__file__).resolve().parents[1]
WORKER = TESTS / "multiprocess_worker.py"
# The single-process references are small systems on four ranks; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


def launcher(*target, grace: float = 120, timeout: float = 600, xla_flags: str | None = None):
    """``python -m jaxdd.launch -n 2 --cpu-devices 2 <target>``, finished; past ``timeout`` its
    processes are killed too (they are in its session) and TimeoutExpired is raised."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxdd.launch", "-n", "2", "--cpu-devices", "2", "--grace", str(grace), *target],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=TESTS.parent, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


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


def fail_between_calls(tmp_path: Path, cause: str):
    """Process 1 fails by ``cause`` between two DistributedModel calls (the worker's
    ``fail-<cause>``); returns the launcher's result, the seconds from that failure to the
    launcher's end, and the seconds in all. A hang fails the test after 120 s."""
    t0 = time.time()
    # Compiling dominates these runs and their results are not checked: compile without optimisation.
    proc = launcher(str(WORKER), str(tmp_path), f"fail-{cause}", grace=120, timeout=120,
                    xla_flags="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
    ended = time.time()
    assert (tmp_path / "failed").exists(), proc.stdout + proc.stderr
    assert not (tmp_path / f"fail-{cause}.npz").exists()  # process 0 never finished the second call
    return proc, ended - float((tmp_path / "failed").read_text()), ended - t0


def assert_the_run_ended_by_itself(proc, after_failure: float, in_all: float) -> None:
    # The other process ends on its own (no kill at the end of the 120 s grace), promptly.
    assert "stopped the remaining processes" not in proc.stderr, proc.stderr
    assert after_failure < 30, f"the run took {after_failure:.0f} s to end after process 1 failed"
    assert in_all < 90, f"the run took {in_all:.0f} s"


def test_an_exception_in_one_process_ends_the_run_with_status_1_naming_the_process(tmp_path):
    proc, after_failure, in_all = fail_between_calls(tmp_path, "exception")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == ("jaxdd.launch: failed: process 1 exited with status 1: "
                                            "RuntimeError: process 1 fails between two calls"), proc.stderr
    assert "[1] RuntimeError: process 1 fails between two calls" in proc.stdout  # its traceback
    assert_the_run_ended_by_itself(proc, after_failure, in_all)


@pytest.mark.slow
def test_sys_exit_3_in_one_process_ends_the_run_with_status_3_naming_the_process(tmp_path):
    proc, after_failure, in_all = fail_between_calls(tmp_path, "exit")
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == "jaxdd.launch: failed: process 1 exited with status 3: sys.exit(3)"
    assert_the_run_ended_by_itself(proc, after_failure, in_all)


@pytest.mark.slow
def test_sigkill_of_one_process_ends_the_run_with_status_137_naming_the_process(tmp_path):
    proc, after_failure, in_all = fail_between_calls(tmp_path, "sigkill")
    assert proc.returncode == 128 + 9, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == "jaxdd.launch: failed: process 1 exited with signal 9 (SIGKILL)"
    assert_the_run_ended_by_itself(proc, after_failure, in_all)


@pytest.mark.slow
def test_sigint_to_one_process_ends_the_run_with_status_130_naming_the_process(tmp_path):
    proc, after_failure, in_all = fail_between_calls(tmp_path, "sigint")
    assert proc.returncode == 128 + 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[-1] == ("jaxdd.launch: failed: process 1 exited with signal 2 (SIGINT): "
                                            "KeyboardInterrupt")
    assert_the_run_ended_by_itself(proc, after_failure, in_all)


@pytest.mark.slow
def test_launcher_passes_sigterm_on_to_the_processes_and_exits_with_143(tmp_path):
    script = tmp_path / "wait.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-m", "jaxdd.launch", "-n", "2", "--grace", "5", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=TESTS.parent,
                            start_new_session=True)
    try:
        assert sorted(proc.stdout.readline() for _ in range(2)) == ["[0] up\n", "[1] up\n"]
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + 15 and time.time() - t0 < 10
    assert err.splitlines()[-1] == "jaxdd.launch: stopped by SIGTERM"


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
    from jaxdd.data.systems import lj_melt_data

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
    assert proc.stderr.splitlines()[-1] == "jaxdd.launch: failed: process 1 exited with signal 9 (SIGKILL)"
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
