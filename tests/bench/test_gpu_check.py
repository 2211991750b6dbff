"""bench/gpu_check.sh --smoke: the GPU check's stages (build, test collection, the dynamics
table) run here at tiny sizes, so the script is known to work before a GPU is at hand. A run
builds the kernels and compiles a table (about 100 s even for one section), so the two checks of
it share one run, in the slow set; the default suite checks the script's arguments and the
table's sections."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bench/gpu_check.sh needs bash")


def smoke(out_dir, *table_args):
    """bench/gpu_check.sh --smoke (table arguments after --): (its stdout, the table printed)."""
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("OUT", None)
    argv = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--smoke", "--out", str(out_dir)]
    if table_args:
        argv += ["--", *table_args]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-2000:]
    assert "gpu_check: all stages passed" in out
    assert "error" not in (out_dir / "gpu_table.json").read_text().lower()
    return out, (out_dir / "gpu_table.txt").read_text()


#: Every section of bench/gpu_table.py, in the order the shared run below asks for.
SECTIONS = ("mlip", "lj", "lj-jax-md", "nequip-pair", "largest")


def assert_rows(table, rows):
    for row in rows:
        assert row in table, f"row {row!r} missing from the table:\n{table}"


@pytest.fixture(scope="module")
def full_smoke(tmp_path_factory):
    """One --smoke run of every section, shared by the two checks below: each run builds the
    kernels (the CUDA ones too where nvcc is found) and compiles its rows, so a run of the
    MLIP section alone would repeat most of this one's cost for rows this one prints too."""
    out_dir = tmp_path_factory.mktemp("gpu_check")
    # Every section, named after -- (which the script hands to bench/gpu_table.py) in an order
    # of its own: the zoo models first.
    out, table = smoke(out_dir, "--sections", ",".join(SECTIONS))
    return out, table, json.loads((out_dir / "gpu_table.json").read_text())


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_stage_and_prints_the_table(full_smoke):
    """Every stage (``smoke`` checks that all passed); of the table, the zoo models' rows and
    where their steps go."""
    out, table, record = full_smoke
    for stage in ("machine", "packages", "build", "kernel and neighbour tests", "dynamics table"):
        assert f"s] {stage}" in out, f"stage {stage!r} missing:\n{out[-4000:]}"
    assert_rows(table, ("schnet float32", "nequip float32", "mace float32"))
    # Where each zoo model's step goes, from a trace of it: the model is its largest part.
    assert_rows(table, ("Where a step's time goes", "MLIP MD, jaxdd: nequip float32, 27 atoms"))
    profiles = {r["what"]: r["profile"] for r in record["rows"] if r["section"] == "MLIP MD, jaxdd"}
    assert sorted(profiles) == ["mace float32", "nequip float32", "schnet float32"]
    for what, profile in profiles.items():
        rows = profile["rows"]
        assert max(rows, key=rows.get) == "model or pair kernel", (what, rows)
        assert rows["neighbour search and sort"] > 0, (what, rows)


@pytest.mark.slow
def test_gpu_check_smoke_prints_every_row_of_the_table(full_smoke):
    """Every section's rows: the LJ melt (jaxdd and jax-md), the zoo models, jax-md's NequIP
    against jaxdd's and the largest-fit search."""
    _, table, record = full_smoke
    # In the order asked for after --.
    assert record["rows"][0]["section"] == "MLIP MD, jaxdd" and record["rows"][-1]["section"] == "largest fit"
    assert_rows(table, ("fused float32", "jnp float64", "jax-md float32", "schnet float32", "nequip float32",
                        "mace float32", "jax-md NequIP (own loop)", "jaxdd NequIP (jax-md's network)", "largest fit"))


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


def _gpu_table():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu_table
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu_table


def test_gpu_table_runs_the_sections_asked_for_in_the_order_given():
    rows = _gpu_table().plan(False, 0.0, sections=("mlip", "lj"), lj_cells=(126,))
    assert [(section, what) for section, what, _ in rows] == [
        ("MLIP MD, jaxdd", "schnet float32"), ("MLIP MD, jaxdd", "nequip float32"), ("MLIP MD, jaxdd", "mace float32"),
        ("LJ melt, jaxdd", "fused float32"), ("LJ melt, jaxdd", "jnp float32"),
        ("LJ melt, jaxdd", "fused float64"), ("LJ melt, jaxdd", "jnp float64")]


def test_gpu_table_refuses_an_unknown_section_naming_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        _gpu_table().main(["--sections", "mlip,lj-lammps"])
    err = capsys.readouterr().err
    assert "lj-lammps" in err and "nequip-pair" in err


def test_gpu_table_shows_the_table_of_a_saved_run(tmp_path, capsys):
    """A run stopped in a long row leaves its JSON; --show prints the rows before that row."""
    saved = tmp_path / "gpu_table.json"
    row = dict(section="LJ melt, jaxdd", what="fused float32", atoms=32000, steps=100, seconds=0.5,
               atom_steps_per_second=6.4e6, ms_per_step=5.0, note="1 rebuilds")
    saved.write_text(json.dumps(dict(device="gpu (NVIDIA H200), jax 0.11.2", smoke=False, rows=[row])))
    assert _gpu_table().main(["--show", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H200" in out and "6,400,000" in out and "1 rebuilds" in out


@pytest.mark.parametrize("argv, named", [(["--lj-cells", "12x"], "--lj-cells"), (["--show", "/no/such.json"], "--show")])
def test_gpu_table_refuses_bad_arguments_naming_them(capsys, argv, named):
    with pytest.raises(SystemExit):
        _gpu_table().main(argv)
    assert named in capsys.readouterr().err
