"""Specification: jaxdd's modules use each other through public names only.

No module imports another module's private (underscore) name, and no module reads or writes
an underscore attribute of an object other than ``self``/``cls`` (a reach-in into another
object's private state): what one module needs from another has a public, documented home.
A private *module* may be imported by its own package (``jaxdd.ffi._call`` by ``jaxdd.ffi``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "jaxdd").rglob("*.py")) + sorted((ROOT / "models").rglob("*.py"))

# Underscore attributes of other libraries that have no public spelling.
OUTSIDE = {
    "os._exit": "leaving a launched child process without running the parent's cleanup",
    "._cache_size": "JAX's count of a jitted function's compiled programs (jaxdd.programs)",
    "._replace": "a namedtuple's public copy with changes (jraph.GraphsTuple)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations(source: str, name: str) -> list[str]:
    """Every private import and reach-in of ``source`` (the text of the module ``name``)."""
    tree = ast.parse(source, name)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                # `from . import _call`: a private module of the importing package itself.
                sibling_module = node.module is None and node.level == 1
                if _private(alias.name) and not sibling_module:
                    found.append(f"{name}:{node.lineno} imports {alias.name} from {node.module}")
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            text = ast.unparse(node)
            if text in OUTSIDE or f".{node.attr}" in OUTSIDE:
                continue
            found.append(f"{name}:{node.lineno} reaches into {text}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_module_uses_only_public_names_of_other_modules_and_objects(path):
    assert violations(path.read_text(), str(path.relative_to(ROOT))) == []


def test_the_check_catches_a_private_import_and_a_reach_in():
    source = "from jaxdd.engine.driver import _run\n\ndef f(dm):\n    return dm._inputs\n"
    assert violations(source, "probe.py") == ["probe.py:1 imports _run from jaxdd.engine.driver",
                                              "probe.py:4 reaches into dm._inputs"]
