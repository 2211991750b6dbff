"""Names keep working across the package reorganisations: moved modules (``jaxdd.mesh``, now
``jaxdd.models.pme_grid``, a deprecated alias), ``jaxdd.ops`` (now a package) and
``jaxdd.dispatch`` (now a package)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import warnings

import pytest


def test_jaxdd_mesh_is_a_deprecated_alias_of_the_pme_grid():
    import jaxdd.models.pme_grid

    sys.modules.pop("jaxdd.mesh", None)
    with pytest.warns(DeprecationWarning, match="jaxdd.models.pme_grid"):
        mesh = importlib.import_module("jaxdd.mesh")
    for name in jaxdd.models.pme_grid.__all__:
        assert getattr(mesh, name) is getattr(jaxdd.models.pme_grid, name)


def test_a_spec_naming_the_pme_spread_op_imports_the_pme_grid_not_the_alias():
    code = ("import sys, jaxdd.ops\n"
            "assert jaxdd.ops.get_op('jaxdd_mesh::spread').name == 'jaxdd_mesh::spread'\n"
            "assert 'jaxdd.models.pme_grid' in sys.modules and 'jaxdd.mesh' not in sys.modules\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


def test_every_name_of_the_former_ops_module_is_importable():
    ops = importlib.import_module("jaxdd.ops")
    for name in ["SpecError", "StoragePolicy", "HaloStoragePolicy", "HaloRefreshPolicy", "GraphParallelPolicy",
                 "POLICIES", "Transform", "GatherInputs", "GatherInputsFull", "SliceOwned", "ScatterOutputs",
                 "AllReduceSum", "SliceOutputsOwned", "TRANSFORMS", "OpHandle", "register_op", "get_op",
                 "registered_ops", "varying_axes", "match_varying"]:
        assert hasattr(ops, name), name


def test_every_name_of_the_former_dispatch_module_is_importable():
    dispatch = importlib.import_module("jaxdd.dispatch")
    for name in ["Kind", "Layout", "REPLICATED", "DispatchError", "DispatchWarning", "DispatchReport", "Runtime",
                 "Dispatcher", "batch_layouts", "call_model", "warn_fallbacks", "register_rule", "Decision"]:
        assert hasattr(dispatch, name), name
    import jaxdd

    assert jaxdd.register_rule is dispatch.register_rule


def test_no_module_of_the_dispatch_package_names_pme():
    from pathlib import Path

    folder = Path(importlib.import_module("jaxdd.dispatch").__file__).parent
    for path in folder.rglob("*.py"):
        text = path.read_text().lower()
        assert "pme" not in text and "jaxdd.mesh" not in text, path


@pytest.mark.parametrize("earlier", sorted(__import__("jaxdd._moved", fromlist=["MOVED"]).MOVED))
def test_an_earlier_module_path_imports_the_present_module_and_warns_once(earlier):
    from jaxdd import _moved

    present = importlib.import_module(_moved.MOVED[earlier])
    sys.modules.pop(earlier, None)
    _moved._warned.discard(earlier)
    with pytest.warns(DeprecationWarning, match=_moved.MOVED[earlier].replace(".", r"\.")):
        module = importlib.import_module(earlier)
    assert module is present and module.__name__ == present.__spec__.name == _moved.MOVED[earlier]
    sys.modules.pop(earlier, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module(earlier) is present  # once: the second import is quiet
