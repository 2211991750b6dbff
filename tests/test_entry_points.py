"""Specification of the command-line entry points: ``python -m jaxdd.demo`` and the benchmark.

Each runs in a subprocess on the CPU, as a user would start it.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxdd.systems import LAMMPS_MELT_ENERGY_PER_ATOM

REPO = Path(__file__).resolve().parents[1]


def run(*args, timeout=180):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def figure(text, label):
    """The number after ``label`` on its line of a table."""
    m = re.search(rf"^{re.escape(label)}\s+(\S+)", text, flags=re.MULTILINE)
    assert m, f"no line {label!r} in:\n{text}"
    return float(m.group(1).rstrip("x").replace(",", ""))


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "lj_forces.json"
    out = run("bench/lj_forces.py", "--n-cells", "4", "--repeat", "1", "--ref-cells", "3", "--json", str(path))
    return out, path


def test_demo_energy_per_atom_matches_lammps():
    out = run("-m", "jaxdd.demo", "--n-cells", "4", "--repeat", "1")
    assert abs(figure(out, "energy per atom") - LAMMPS_MELT_ENERGY_PER_ATOM) < 1e-9
    assert re.search(r"^verdict\s+OK", out, flags=re.MULTILINE), out


def test_bench_prints_ratio_to_ase(bench):
    out, _ = bench
    m = re.search(r"^ratio to ASE.*?\s([\d.]+)x\s+([\d.]+)x\s*$", out, flags=re.MULTILINE)
    assert m, out
    assert all(float(r) > 0 for r in m.groups())


def test_bench_writes_its_figures_as_json(bench):
    _, path = bench
    record = json.loads(path.read_text())
    assert set(record["results"]) == {"float32", "float64"}
    f64 = record["results"]["float64"]
    assert f64["n_atoms"] == 256
    assert abs(f64["energy_per_atom_minus_lammps"]) < 1e-9
    assert record["reference"]["n_atoms"] == 108
