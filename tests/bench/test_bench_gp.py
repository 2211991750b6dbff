"""Specification of ``bench/gp_vs_halo.py``: graph-parallel and halo side by side.

The script runs in a subprocess, as a user would start it, on tiny systems over two virtual
CPU devices (it sets the device count itself before JAX starts).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gp_vs_halo.py"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "gp.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # the script sets it
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--n-cells", "3", "--molecule-atoms", "60", "--devices", "2", "--repeat", "1",
         "--json", str(path)],
        capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(path.read_text())


@pytest.mark.slow
def test_both_strategies_are_measured_on_both_systems(tiny_run):
    _, record = tiny_run
    assert [(r["system"], r["strategy"]) for r in record["rows"]] == [
        ("bulk", "halo"), ("bulk", "graph_partition"), ("molecules", "halo"), ("molecules", "graph_partition")]
    for r in record["rows"]:
        assert r["comm_bytes"] > 0 and r["memory"] > 0 and r["wall"] > 0


@pytest.mark.slow
def test_graph_parallel_ranks_hold_no_ghost_rows(tiny_run):
    _, record = tiny_run
    assert all(r["ghost"] == 0 for r in record["rows"] if r["strategy"] == "graph_partition")
    assert all(r["ghost"] > 0 for r in record["rows"] if r["strategy"] == "halo")


@pytest.mark.slow
def test_graph_parallel_communicates_by_all_gather_without_halo_permutes(tiny_run):
    _, record = tiny_run
    gp = [r for r in record["rows"] if r["strategy"] == "graph_partition"]
    assert all("all-gather" in r["collectives"] and "collective-permute" not in r["collectives"] for r in gp)


@pytest.mark.slow
def test_table_prints_the_ratios(tiny_run):
    out, _ = tiny_run
    assert out.count("gp / halo") == 2
