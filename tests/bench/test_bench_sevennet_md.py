"""Specification of ``bench/sevennet_md.py``: its arguments, its report of failed sides and of
the target, and small runs as a user starts them (slow set)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import sevennet_md  # noqa: E402


def test_the_defaults_are_the_specified_comparison():
    args = sevennet_md.parse_args(["--cores", "1", "--devices", "1"])
    assert args.models == ("7net-0", "7net-l3i5")
    assert args.sizes == (5, 8)  # 1,000 and 4,096 atoms
    assert args.steps == 20
    assert args.sides == ("jaxdd", "torch-ase", "torch-bare")
    assert args.budget_gb == 24 and not args.largest


def test_lists_are_parsed_without_repeats():
    args = sevennet_md.parse_args(["--models", "7net-l3i5", "--sizes", "2,3,3", "--cores", "1,1", "--devices", "1",
                                   "--sides", "jaxdd,torch-bare"])
    assert (args.models, args.sizes, args.cores, args.devices, args.sides) == (
        ("7net-l3i5",), (2, 3), (1,), (1,), ("jaxdd", "torch-bare"))


@pytest.mark.parametrize("argv, option", [
    (["--sides", "jaxdd,lammps"], "--sides"),
    (["--models", "7net-omni"], "--models"),
    (["--sizes", "0"], "--sizes"),
    (["--sizes", "five"], "--sizes"),
    (["--steps", "0"], "--steps"),
    (["--devices", "100000"], "--devices"),
    (["--cores", "100000"], "--cores"),
    (["--budget-gb", "0"], "--budget-gb"),
])
def test_a_bad_option_is_a_usage_error(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        sevennet_md.parse_args(["--cores", "1", "--devices", "1", *argv])
    assert exit_info.value.code == 2
    assert option in capsys.readouterr().err


def test_a_side_killed_for_memory_is_reported_as_failed_not_the_end_of_the_benchmark(monkeypatch):
    monkeypatch.setattr(sevennet_md.torch_md, "watched", lambda *a, **k: (-9, "", "", None))
    row = sevennet_md.pinned("torch-ase", "7net-0", 8, 1, 1, sys.executable)
    assert row["failed"].startswith("killed by signal 9") and row["atom_steps_per_second"] is None
    assert (row["n_atoms"], row["model"]) == (4096, "7net-0")
    sevennet_md.add_ratios([row])
    table = sevennet_md.format_table([row], [f"torch-ase failed: {row['failed']}"])
    assert "failed" in table.splitlines()[1]


def test_a_child_past_the_memory_budget_is_killed():
    grow = "import time; x = bytearray(400 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(60)"
    rc, _, _, why = sevennet_md.watched([sys.executable, "-c", grow], dict(os.environ), set(), limit_mb=150)
    assert rc != 0 and why.startswith("exceeded the memory budget")


def _row(model, side, cores, speed, atoms=1000):
    return dict(model=model, side=side, cores=cores, n_atoms=atoms, atom_steps_per_second=speed)


def test_ratios_are_over_each_sevenn_side_on_as_many_cores_and_over_one_device():
    group = [_row("7net-0", "torch-ase", 1, 100.0), _row("7net-0", "torch-bare", 1, 125.0),
             _row("7net-0", "torch-bare", 2, 200.0), _row("7net-0", "jaxdd", 1, 250.0),
             _row("7net-0", "jaxdd", 2, 450.0)]
    sevennet_md.add_ratios(group)
    assert [r["ratios"] for r in group] == [{}, {}, {}, {"torch-ase": 2.5, "torch-bare": 2.0}, {"torch-bare": 2.25}]
    assert group[4]["speedup"] == pytest.approx(1.8) and group[3]["speedup"] is None


def test_the_target_is_over_the_faster_sevenn_side():
    rows = _measured({"7net-0": 2.5, "7net-l3i5": 2.1}, {"7net-0": 1.8, "7net-l3i5": 1.8})
    rows.insert(0, _row("7net-0", "torch-bare", 1, 130.0))  # faster than torch-ase: 250 / 130 < 2
    sevennet_md.add_ratios([r for r in rows if r["model"] == "7net-0"])
    assert ": NOT met: " in sevennet_md.target_line(rows)


def _measured(one_core, two_devices):
    """Rows of both models at 1,000 atoms: sevenn at 100 atom-steps/s, jaxdd ``one_core`` times
    it on one core and ``two_devices`` times that on two (model -> factor)."""
    rows = []
    for model in one_core:
        speed = 100.0 * one_core[model]
        group = [_row(model, "torch-ase", 1, 100.0), _row(model, "jaxdd", 1, speed),
                 _row(model, "jaxdd", 2, two_devices[model] * speed)]
        sevennet_md.add_ratios(group)
        rows += group
    return rows


def test_the_target_line_says_met_only_when_every_part_is_measured_and_met():
    met = _measured({"7net-0": 2.5, "7net-l3i5": 2.1}, {"7net-0": 1.8, "7net-l3i5": 1.75})
    assert ": met: " in sevennet_md.target_line(met)
    slow_sevenn = _measured({"7net-0": 2.5, "7net-l3i5": 1.9}, {"7net-0": 1.8, "7net-l3i5": 1.75})
    assert ": NOT met: " in sevennet_md.target_line(slow_sevenn)
    slow_devices = _measured({"7net-0": 2.5, "7net-l3i5": 2.1}, {"7net-0": 1.8, "7net-l3i5": 1.2})
    assert ": NOT met: " in sevennet_md.target_line(slow_devices)
    line = sevennet_md.target_line(_measured({"7net-0": 2.5}, {"7net-0": 1.8}))
    assert ": not measured: " in line and "7net-l3i5 not measured" in line


@pytest.mark.slow
def test_a_jaxdd_run_reports_its_speed_and_working_memory(tmp_path):
    # 216 atoms: at 64 the rows of the radial networks' [64, 64] weights equal the atom count.
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sevennet_md.py"), "--models", "7net-0", "--sizes",
                           "3", "--steps", "2", "--devices", "1", "--sides", "jaxdd",
                           "--json", str(tmp_path / "s.json")], capture_output=True, text=True, env=env, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = json.loads((tmp_path / "s.json").read_text())["results"]
    assert (row["side"], row["model"], row["n_atoms"], row["cores"]) == ("jaxdd", "7net-0", 216, 1)
    assert row["mesh_devices"] == 1
    assert row["atom_steps_per_second"] > 0 and row["memory_kb_per_atom"] >= 0 and row["peak_mb"] > 0
    assert "target (jaxdd >= 2.0x sevenn" in proc.stdout


@pytest.mark.slow
def test_the_sevenn_sides_run_in_the_torch_interpreter(tmp_path):
    python = sevennet_md.torch_python()
    if python is None or not sevennet_md.has_sevenn(python):
        pytest.skip("no interpreter with torch and sevenn ($JAXDD_TORCH_PYTHON)")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "sevennet_md.py"), "--models", "7net-0", "--sizes",
                           "2", "--steps", "2", "--cores", "1", "--sides", "torch-ase,torch-bare", "--torch-python",
                           python, "--json", str(tmp_path / "s.json")], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "s.json").read_text())["results"]
    assert [(r["side"], r["n_atoms"], r["torch_threads"]) for r in rows] == [("torch-ase", 64, 1),
                                                                             ("torch-bare", 64, 1)]
    assert all(r["atom_steps_per_second"] > 0 for r in rows)
    assert rows[0]["pe_first"] == pytest.approx(rows[1]["pe_first"], rel=1e-6)  # the same crystal, the same model
