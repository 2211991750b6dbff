"""The library stays in pieces a reader can hold: no module of ``jaxdd/`` over 500 lines and
no class over 300 (a class that grows past that has found a second concept; give it its own
module)."""

from __future__ import annotations

import ast
from pathlib import Path

JAXDD = Path(__file__).resolve().parents[2] / "jaxdd"
MODULE_LINES, CLASS_LINES = 500, 300


def _modules():
    return sorted(p for p in JAXDD.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(JAXDD.parent)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"


def test_no_class_is_over_300_lines():
    long = {}
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                long[f"{path.relative_to(JAXDD.parent)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"classes over {CLASS_LINES} lines: {long}"
