"""Specification of ``bench/balance.py`` and ``bench/ensembles.py``: they run as a user starts
them, on small systems (the slow set; each takes a minute or two)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(script, *args, timeout=1200):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # the scripts set it
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_balance_reports_imbalance_flops_times_and_equality(tmp_path):
    out = run("balance.py", "--quick", "--steps", "20", "--json", str(tmp_path / "b.json"))
    record = json.loads((tmp_path / "b.json").read_text())
    balanced = [r for r in record["partition"] if r["balance"] == "static"]
    assert len(balanced) == 3 and max(r["imbalance"] for r in balanced) <= 1.10
    assert all(r["flops_per_rank"] > 0 for r in record["partition"])
    assert len(record["md"]) == 4 and all(r["atom_steps_per_second"] > 0 for r in record["md"])
    assert record["equality"] <= 1e-9
    assert "target (imbalance <= 1.10 after static balancing): met" in out


@pytest.mark.slow
def test_ensembles_prints_drift_and_averages(tmp_path):
    out = run("ensembles.py", "--quick", "--steps", "400", "--json", str(tmp_path / "e.json"))
    assert "drift" in out and "within 3" in out
    assert json.loads((tmp_path / "e.json").read_text())
