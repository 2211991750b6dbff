"""Specification of ``bench/mlip_md.py``: jax-md's NequIP loop and jaxdd's DomainParallel on
the same network, each in a pinned child, as a user starts it (64 atoms, slow set)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax_md", reason="jax-md is a test dependency (pip install -e '.[test]')")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_mlip_md_times_jax_md_and_jaxdd_on_one_and_two_devices(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "mlip_md.py"), "--atoms", "64", "--steps", "5",
                           "--repeats", "2", "--cost", "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "m.json").read_text())
    rows = record["rows"]
    # Every side ran with XLA's CPU operations on the threads that run them and its own
    # fusion emitter (the bench's flags).
    assert "--xla_cpu_multi_thread_eigen=false" in record["xla_flags"]
    assert "--xla_cpu_experimental_ynn_fusion_type=" in record["xla_flags"]
    assert [(r["side"], r["devices"]) for r in rows] == [("jax-md", 1), ("jaxdd", 1), ("jaxdd", 2)]
    assert all(r["atom_steps_per_second"] > 0 and r["max_rss_mb"] > 0 for r in rows)
    # Each jaxdd side ran on the devices it is named for (its child set the count before JAX started).
    assert [r["mesh_devices"] for r in rows[1:]] == [1, 2]
    # The fastest of the timed runs is the figure, each side alike.
    assert all(len(r["seconds_of_each_run"]) == 2 and r["seconds"] == min(r["seconds_of_each_run"]) for r in rows)
    assert "target (jaxdd 1 device >= 1.0x jax-md)" in proc.stdout
    # --cost: XLA's count of one step of each side (one rank's), printed and recorded.
    assert all(r["step_gflops"] > 0 and r["step_gbytes"] > 0 for r in rows)
    assert proc.stdout.count("one step, one rank (XLA cost analysis)") == 3
