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

from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM

REPO = Path(__file__).resolve().parents[2]


def run(*args, timeout=180, env=None):
    """stdout of ``python *args``; env: variables to set, or to remove where the value is None."""
    env = {k: v for k, v in {**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})}.items() if v is not None}
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


@pytest.mark.slow  # the README's first command end to end (about 20 s from an empty compilation cache)
def test_demo_validates_then_runs_the_melt():
    # Without JAX_NUM_CPU_DEVICES the demo asks for its 4 virtual devices itself.
    out = run("-m", "jaxdd.demo", "--n-cells", "4", "--steps", "10", "--thermo-every", "5", "--warmup", "5",
              env={"JAX_NUM_CPU_DEVICES": None})
    assert re.search(r"^devices\s+4 x cpu", out, flags=re.MULTILINE), out
    assert re.search(r"^validation\s+OK .* on 4 ranks", out, flags=re.MULTILINE), out
    # LAMMPS-style thermo (energies per atom): the first step, every 5th, the last.
    thermo = re.findall(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$", out, flags=re.MULTILINE)
    assert [int(t[0]) for t in thermo] == [0, 5, 10], out
    assert float(thermo[0][1]) == pytest.approx(1.44)
    assert abs(float(thermo[0][2]) - LAMMPS_MELT_ENERGY_PER_ATOM) < 1e-7  # printed to 8 digits
    m = re.search(r"^LAMMPS check\s+OK: step-0 E_pair (\S+)", out, flags=re.MULTILINE)
    assert m, out
    assert abs(float(m.group(1)) - LAMMPS_MELT_ENERGY_PER_ATOM) < 1e-9
    assert figure(out, "atom-steps/s") > 0
    assert re.search(r"^atom-steps/s\s+\S+ \(10 steps of 256 atoms in ", out, flags=re.MULTILINE), out
    assert re.search(r"^rebuilds\s+\d+ plan rebuilds, \d+ atom migrations", out, flags=re.MULTILINE), out
    assert re.search(r"^verdict\s+OK", out, flags=re.MULTILINE), out


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--devices", "9"], "--devices 9: JAX sees only 8 cpu device(s)"),
    (["--dtype", "float16"], "invalid choice"),
])
def test_demo_refuses_bad_arguments(args, message):
    proc = subprocess.run([sys.executable, "-m", "jaxdd.demo", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "8"}, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr
    assert proc.stdout == ""


def test_demo_lammps_check_fails_off_the_reference():
    from jaxdd.demo import lammps_check

    assert lammps_check(LAMMPS_MELT_ENERGY_PER_ATOM, 0.0, "float64")[0]
    ok, line = lammps_check(LAMMPS_MELT_ENERGY_PER_ATOM + 1e-6, 0.0, "float64")
    assert not ok and line.startswith("MISMATCH")
    assert not lammps_check(LAMMPS_MELT_ENERGY_PER_ATOM, 1e-3, "float64")[0]


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
