"""The Python examples of the README and docs/ run as written."""

import re
from pathlib import Path

import numpy as np
import pytest

import jaxdd

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def run_python_blocks(page: Path) -> dict:
    namespace = {}
    for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
        exec(compile(block, str(page), "exec"), namespace)
    return namespace


# The porting page compiles five models on one and two devices: a slow sweep. The training page
# differentiates a distributed SchNet (the gradients it shows are tests/engine/test_training.py's,
# in the default suite).
SLOW_PAGES = {"porting.md", "training.md"}


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW_PAGES else p
                                  for p in PAGES], ids=lambda p: p.name)
def test_python_examples_run(page):
    run_python_blocks(page)


def test_readme_custom_model_gives_forces_that_sum_to_zero():
    ns = run_python_blocks(ROOT / "README.md")
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=1)
    out = jaxdd.compute(ns["Morse"](depth=0.3, cutoff=5.0), jaxdd.AtomicData.from_ase(atoms))
    forces = np.asarray(out["forces"])
    assert forces.shape == (32, 3) and np.isfinite(forces).all()
    np.testing.assert_allclose(forces.sum(axis=0), 0.0, atol=1e-10)  # Newton's third law


def test_spec_page_json_example_loads():
    from jaxdd.ops import register_op
    from jaxdd.spec import MLIPSpec

    register_op("ns::op", lambda x: x)
    text = (ROOT / "docs" / "spec.md").read_text()
    (example,) = re.findall(r"```json\n(.*?)```", text, re.S)
    spec = MLIPSpec.from_json(example)
    assert spec.distribution.custom_ops[0].op.name == "ns::op"
