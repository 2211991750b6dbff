"""Examples and notebooks run as shipped."""

import json
import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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


# The bring-your-own-model notebook walks the whole arc in the default suite; the others
# run with the slow set.
NOTEBOOKS = [pytest.param(p, marks=() if p.name == "bring_your_own_model.ipynb" else pytest.mark.slow)
             for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_code_cells_run_in_order(path):
    namespace = {}
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), f"{path.name}", "exec"), namespace)
