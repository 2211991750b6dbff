"""The README's Python examples run as written."""

import re
from pathlib import Path

import numpy as np

import jaxdd

README = Path(__file__).resolve().parents[1] / "README.md"


def run_readme_blocks():
    namespace = {}
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S):
        exec(compile(block, str(README), "exec"), namespace)
    return namespace


def test_readme_examples_run_and_the_custom_model_gives_finite_forces():
    ns = run_readme_blocks()
    assert np.isfinite(np.asarray(ns["out"]["energy"])).all()
    from ase.build import bulk

    atoms = bulk("Cu", "fcc", a=3.6, cubic=True).repeat(2)
    atoms.rattle(0.05, seed=1)
    out = jaxdd.compute(ns["Morse"](depth=0.3, cutoff=5.0), jaxdd.AtomicData.from_ase(atoms))
    forces = np.asarray(out["forces"])
    assert forces.shape == (32, 3) and np.isfinite(forces).all()
    np.testing.assert_allclose(forces.sum(axis=0), 0.0, atol=1e-10)  # Newton's third law
