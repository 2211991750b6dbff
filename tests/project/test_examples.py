"""Examples and notebooks run as shipped."""

import json
import runpy
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_lj_example_agrees_with_ase():
    main = runpy.run_path(str(ROOT / "examples" / "01_lj_energy_forces.py"))["main"]
    d_energy, d_forces, d_stress = main()
    assert d_energy < 1e-10 and d_forces < 1e-9 and d_stress < 1e-9


@pytest.mark.slow
def test_byo_jax_mpnn_example_validates_saves_loads_and_distributes():
    main = runpy.run_path(str(ROOT / "examples" / "distributed" / "04_byo_jax_mpnn.py"))["main"]
    d_energy, d_forces, d_stress = main()
    assert d_energy < 1e-10 and d_forces < 1e-9 and d_stress < 1e-9


@pytest.mark.slow
def test_byo_graph_transformer_example_validates_energy_and_forces_through_the_kernel_vjp():
    from jaxdd import ffi

    if not ffi.available():
        pytest.skip("compiled kernels not built (pip install -e .)")
    main = runpy.run_path(str(ROOT / "examples" / "distributed" / "05_byo_graph_transformer.py"))["main"]
    d_energy, d_forces = main()
    assert d_energy < 1e-10 and d_forces < 1e-9


@pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")
# In the slow set: docs/training.md fits a model with DistributedModel.apply against one device
# in the default suite, and tests/engine/test_training.py checks the gradients.
@pytest.mark.slow
def test_fit_example_losses_agree_with_one_device_and_go_down():
    main = runpy.run_path(str(ROOT / "examples" / "distributed" / "06_fit_on_a_large_cell.py"))["main"]
    distributed, one_device = main()
    assert len(distributed) == len(one_device) == 5
    np.testing.assert_allclose(distributed, one_device, rtol=1e-9, atol=0)  # step by step
    assert np.all(np.diff(one_device) < 0)  # a real fit: every Adam step lowers the loss


# The notebooks run with the slow set; docs/adding_a_model.md walks the same arc, a plain JAX
# function to a model validated and run on several devices, in the default suite.
NOTEBOOKS = [pytest.param(p, marks=pytest.mark.slow) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_cells_run_in_order(path):
    namespace = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
