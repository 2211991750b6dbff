"""Specification of ``bench/mace_md.py``: its arguments, and a small jaxdd-only run as a user starts
it (slow set)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import mace_md  # noqa: E402


def test_sides_choose_which_of_jaxdd_and_the_mace_torch_paths_run():
    assert mace_md.parse_args(["--cores", "1", "--sides", "jaxdd,torch-bare"]).sides == ("jaxdd", "torch-bare")
    assert mace_md.parse_args(["--cores", "1"]).sides == mace_md.SIDES


def test_a_side_the_benchmark_does_not_have_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        mace_md.parse_args(["--cores", "1", "--sides", "jaxdd,lammps"])
    assert exit_info.value.code == 2
    assert "--sides" in capsys.readouterr().err


@pytest.mark.slow
def test_a_jaxdd_run_reports_its_speed_and_working_memory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "mace_md.py"), "--sizes", "4", "--steps", "2",
                           "--cores", "1", "--dtypes", "float64", "--no-torch", "--json", str(tmp_path / "m.json")],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "m.json").read_text())["results"]
    assert (row["side"], row["n_atoms"], row["cores"], row["dtype"]) == ("jaxdd", 64, 1, "float64")
    assert row["atom_steps_per_second"] > 0 and row["memory_kb_per_atom"] >= 0


def test_a_side_killed_for_memory_is_reported_as_failed_not_the_end_of_the_benchmark(monkeypatch):
    killed = subprocess.CompletedProcess(args=[], returncode=-9, stdout="", stderr="")
    monkeypatch.setattr(mace_md.subprocess, "run", lambda *a, **k: killed)
    row = mace_md.pinned("torch-bare", 16, 1, "float32", 1, True, "mp0-medium")
    assert row["failed"].startswith("killed by signal 9") and row["atom_steps_per_second"] is None
    table = mace_md.format_table([row], [f"torch-bare failed: {row['failed']}"])
    assert "failed" in table.splitlines()[1]
