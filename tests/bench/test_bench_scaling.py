"""Specification of ``bench/scaling_model.py``: it measures per-rank work, predicts GPU step
times and validates against pinned CPU runs, as a user starts it (small systems, slow set)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scaling_model_measures_predicts_and_validates(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}  # the script sets it
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "scaling_model.py"), "--quick", "--models", "lj",
                           "--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "s.png")],
                          capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "s.json").read_text())
    assert {(m["model"], m["strategy"]) for m in record["measured"]} == {("lj", "halo"), ("lj", "graph_partition")}
    for p in record["predictions"]:
        assert list(p["gpus"]) == [1, 8, 64, 1024] and all(w["total"] > 0 for w in p["weak"] + p["strong"])
    assert [(r["model"], r["ranks"]) for r in record["validation"]] == [("lj", 1), ("lj", 2)]
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in record["validation"])
    assert "prediction error" in proc.stdout
