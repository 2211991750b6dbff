"""Specification of ``bench/chgnet_md.py``: its arguments, its target, and small runs as a user
starts them (slow set). The frame it shares with ``bench/sevennet_md.py`` (child processes, the
memory budget, failed sides) is specified in ``test_bench_sevennet_md.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import chgnet_md  # noqa: E402


def test_the_defaults_are_the_specified_comparison():
    args = chgnet_md.parse_args(["--cores", "1", "--devices", "1"])
    assert args.models == ("0.3.0",)
    assert args.sizes == (5, 8)  # 1,000 and 4,096 atoms
    assert args.steps == 20
    assert args.sides == ("jaxdd", "torch-ase", "torch-bare")
    assert args.budget_gb == 24 and not args.largest


def _row(side, cores, speed, atoms=1000):
    return dict(model="0.3.0", side=side, cores=cores, n_atoms=atoms, atom_steps_per_second=speed)


@pytest.mark.parametrize("jaxdd, verdict", [(310.0, "met"), (290.0, "NOT met")])
def test_the_target_is_three_times_the_ase_calculator_on_one_core(jaxdd, verdict):
    # The bare model is faster than the calculator; the target is over the calculator as users run it.
    rows = [_row("torch-ase", 1, 100.0), _row("torch-bare", 1, 200.0), _row("jaxdd", 1, jaxdd)]
    chgnet_md.torch_md.add_ratios(rows)
    assert f": {verdict}: chgnet: 0.3.0 {jaxdd / 100:.2f}x" in chgnet_md.target_line(rows)


def test_without_a_calculator_run_the_target_is_not_measured():
    rows = [_row("torch-bare", 1, 200.0), _row("jaxdd", 1, 900.0)]
    chgnet_md.torch_md.add_ratios(rows)
    assert ": not measured: " in chgnet_md.target_line(rows)


@pytest.mark.slow
def test_the_chgnet_sides_run_in_the_torch_interpreter(tmp_path):
    python = chgnet_md.torch_python()
    if python is None or not chgnet_md.torch_md.has_modules(python, chgnet_md.BENCH.torch_modules):
        pytest.skip("no interpreter with torch and chgnet ($JAXDD_TORCH_PYTHON)")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "chgnet_md.py"), "--sizes", "2", "--steps", "2",
                           "--cores", "1", "--sides", "torch-ase,torch-bare", "--torch-python", python,
                           "--json", str(tmp_path / "c.json")], capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [(r["side"], r["n_atoms"], r["torch_threads"]) for r in rows] == [("torch-ase", 64, 1),
                                                                             ("torch-bare", 64, 1)]
    assert rows[0]["pe_first"] == pytest.approx(rows[1]["pe_first"], rel=1e-5)  # the same crystal, the same model
