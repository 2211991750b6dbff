"""Specification of ``python -m jaxdd.validate``: exit codes, built-in example, spec round trip."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.spec import MLIPSpec
from jaxdd.validate.__main__ import main
from jaxdd.validate.examples import SAMPLES
from test_dispatch import CUTOFF, SYSTEM, mesh_for
from test_validate import make_mpnn

TESTS = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def cli(*args, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "jaxdd.validate", *args], cwd=TESTS.parent, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_no_arguments_validates_the_builtin_example():
    proc = cli()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "built-in example" in proc.stdout and "OK —" in proc.stdout
    assert "[pass]" in proc.stdout  # a progress line per attempt


# lj-fcc, the default sample, is run by test_no_arguments_validates_the_builtin_example; cu-fcc,
# a second periodic fcc sample, is in the slow set.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "cu-fcc" else n
                                  for n in sorted(set(SAMPLES) - {"lj-fcc"})])
def test_every_other_builtin_sample_passes_with_the_default_model(name, capsys):
    assert main(["--builtin", name, "--world-size", "2"]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "OK —" in out
    # Molecules have no cell: their stress is left out of the comparison, and the report says so.
    assert ("not compared: stress (system(s) [0, 1, 2, 3, 4, 5, 6, 7] have no cell" in out) == (name == "molecules")


@pytest.mark.slow
def test_validate_save_load_distribute_round_trip(tmp_path):
    sample = tmp_path / "sample.extxyz"
    SYSTEM.to_ase().write(sample)
    spec_path = tmp_path / "spec.json"
    proc = cli("test_validate:make_mpnn", "--sample", str(sample), "--world-size", "2", "--atol", "1e-9",
               "--rtol", "1e-10", "--save-spec", str(spec_path), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["ok"] is True
    spec = MLIPSpec.load(spec_path)
    model = make_mpnn()
    got = DistributedModel(model, DomainConfig(CUTOFF, mesh=mesh_for((2, 1, 1))), spec=spec)(SYSTEM)
    ref = jaxdd.compute(model, SYSTEM)
    assert abs(float(got["energy"][0] - ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    assert float(np.max(np.abs(np.asarray(got["forces"] - ref["forces"])))) <= 1e-9


@pytest.mark.slow
def test_failing_model_exits_1():
    proc = cli("test_validate:make_mol_sum", "--builtin", "cu-fcc", "--atol", "1e-9", "--rtol", "1e-10")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL —" in proc.stdout


@pytest.mark.slow
def test_spec_option_validates_the_graph_parallel_preset():
    proc = cli("test_validate:make_mpnn", "--builtin", "cu-fcc", "--world-size", "2", "--spec", "mpnn_gp", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    assert report["spec"]["core"]["policy"]["kind"] == "graph_parallel"


@pytest.mark.parametrize("args", [("--world-size", "0"), ("--builtin", "nonesuch"), ("no_such_module:factory",),
                                  ("--dtype", "float16"), ("--spec", "no_such_preset")])
def test_usage_errors_exit_2(args, capsys):
    # In this process: main's status, or the status argparse exits with.
    try:
        status = main(list(args))
    except SystemExit as exit:
        status = exit.code
    assert status == 2, capsys.readouterr()


def test_the_module_exits_with_the_status_of_main():
    proc = cli("--spec", "no_such_preset")
    assert proc.returncode == 2, proc.stdout + proc.stderr


def raising_factory():
    raise RuntimeError("the weights file is gone")


def number_factory():
    return 42


@pytest.mark.parametrize("factory, cause", [
    ("test_validate_cli:raising_factory", "raised RuntimeError: the weights file is gone"),
    ("test_validate_cli:number_factory", "returned 42 (int), not a model wrapper"),
])
def test_a_factory_that_builds_no_model_is_a_usage_error_on_one_line(factory, cause, capsys):
    assert main([factory, "--builtin", "molecules"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model factory") and factory in err and cause in err and err.count("\n") == 1


def test_an_unreadable_sample_file_is_a_usage_error_naming_it(tmp_path, capsys):
    empty = tmp_path / "empty.xyz"
    empty.write_text("")
    assert main(["--sample", str(empty)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot read the sample file {empty}: ") and "Empty file" in err
    assert err.count("\n") == 1
