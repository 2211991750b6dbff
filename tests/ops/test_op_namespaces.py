"""Op namespaces are declared explicitly, and jaxdd's declarations name every module that registers ops."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from jaxdd.ops import SpecError, get_op, op_providers, register_op_namespace
from jaxdd.ops.registry import OP_NAMESPACES

ROOT = Path(__file__).resolve().parents[2]
# A module-level call of register_op (or a *_op helper around it) with a written-out op name.
_REGISTRATION = re.compile(r"""^(?:@|[A-Za-z_][\w.]*\s*(?::[^=\n]*)?=\s*)?(?:\w+\.)*(\w*_op)\(\s*["'](\w+)::""",
                           re.MULTILINE | re.ASCII)


def _registering_modules():
    for package, folder in (("jaxdd", ROOT / "jaxdd"), ("jaxdd.models", ROOT / "models")):
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            module = ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts)))
            for match in _REGISTRATION.finditer(path.read_text()):
                if match.group(1) != "get_op":
                    yield match.group(2), module


@pytest.mark.parametrize("namespace, module", sorted(set(_registering_modules())))
def test_every_module_registering_ops_is_declared_for_its_namespace(namespace, module):
    assert module in op_providers().get(namespace, ()), (
        f"{module} registers {namespace}:: ops; declare it in jaxdd.ops.registry with "
        f"register_op_namespace({namespace!r}, {module!r})")


def test_a_namespace_is_declared_once_unless_replaced():
    register_op_namespace("nstest", "tests.nowhere")
    try:
        assert register_op_namespace("nstest", "tests.nowhere") == ("tests.nowhere",)
        with pytest.raises(SpecError, match="'nstest' is already registered.*replace=True"):
            register_op_namespace("nstest", "tests.elsewhere")
        register_op_namespace("nstest", "tests.elsewhere", replace=True)
        assert op_providers()["nstest"] == ("tests.elsewhere",)
    finally:
        OP_NAMESPACES.unregister("nstest")


def test_a_declared_namespace_whose_module_registers_nothing_keeps_the_error_message():
    with pytest.raises(SpecError, match=r"'jaxdd_ffi::nothing' is not registered; import the module"):
        get_op("jaxdd_ffi::nothing")


def test_get_op_imports_a_declared_provider_on_first_use(tmp_path, monkeypatch):
    (tmp_path / "nstest_provider.py").write_text(
        "from jaxdd.ops import register_op\nDOUBLE = register_op('nstest2::double', lambda x: 2 * x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    register_op_namespace("nstest2", "nstest_provider")
    try:
        assert "nstest_provider" not in sys.modules
        assert get_op("nstest2::double").name == "nstest2::double"
        assert "nstest_provider" in sys.modules
    finally:
        OP_NAMESPACES.unregister("nstest2")
        sys.modules.pop("nstest_provider", None)
