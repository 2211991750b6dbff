"""bench/gpu_check.sh --smoke: the GPU check's stages (build, test collection, the dynamics
table) run here at tiny sizes, so the script is known to work before a GPU is at hand."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bench/gpu_check.sh needs bash")


def test_gpu_check_smoke_runs_every_stage_and_prints_the_table(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--smoke", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "gpu_check: all stages passed" in out
    table = (tmp_path / "gpu_table.txt").read_text()
    for row in ("fused float32", "jnp float64", "jax-md float32", "schnet float32", "nequip float32", "mace float32",
                "jax-md NequIP (own loop)", "jaxdd NequIP (jax-md's network)", "largest fit"):
        assert row in table, f"row {row!r} missing from the table:\n{table}"
    assert "error" not in (tmp_path / "gpu_table.json").read_text().lower()


def test_gpu_check_refuses_to_run_without_its_wheels(tmp_path):
    """Outside --smoke it installs from bench/wheels only; with none there it says how to get them."""
    wheels = ROOT / "bench" / "wheels"
    if wheels.is_dir() and any(wheels.glob("*.whl")):
        pytest.skip("bench/wheels holds wheels here; the refusal needs an empty folder")
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--out", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "bench/gpu_wheels.sh" in proc.stdout
