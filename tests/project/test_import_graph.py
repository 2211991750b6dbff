"""jaxdd's modules import each other without cycles.

The graph is built from the source with ``ast`` (nothing is imported): one node per module
of ``jaxdd`` (``jaxdd/``) and ``jaxdd.models`` (``models/``), one edge per import of another
such module, relative imports resolved. ``from pkg import name`` is an edge to the submodule
``pkg.name`` when there is one, else to ``pkg`` itself. Imports at module level (class bodies
and ``try``/``if`` blocks included, ``if TYPE_CHECKING:`` blocks left out) run when the module
is imported, so a cycle among them is what breaks an import; imports inside functions run
later and are counted apart (and must not close a cycle either).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"jaxdd": ROOT / "jaxdd", "jaxdd.models": ROOT / "models"}


@functools.cache
def module_files() -> dict[str, Path]:
    """Module name → source file, for every ``.py`` file of the packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package,) + parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Yield (import node, at module level) for every import statement of a module's tree."""

    def walk(node, top: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), top)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, top
            yield from walk(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                                  ast.Lambda)))

    yield from walk(tree, True)


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` statement reads from."""
    if not node.level:
        return node.module or ""
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


@functools.cache  # read once per run: the sources do not change while the suite runs
def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(module-level edges, function-level edges): module → the jaxdd modules it imports."""
    files = module_files()
    top: dict[str, set[str]] = {m: set() for m in files}
    inner: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, at_top in _imports(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _base(module, path.name == "__init__.py", node)
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in files else base)
            for target in targets:
                # `import a.b.c` names a.b.c; keep the longest prefix that is one of ours.
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    (top if at_top else inner)[module].add(target)
    return top, inner


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_graph_sees_the_package_structure():
    top, _ = import_graph()
    assert "jaxdd.dispatch.interpreter" in top["jaxdd.dispatch"]
    assert "jaxdd.dispatch.registry" in top["jaxdd.models.pme_grid"] or "jaxdd.dispatch" in top["jaxdd.models.pme_grid"]
    assert "jaxdd.models.pme_grid" in top["jaxdd.models.pme"]


def test_find_cycle_names_the_modules_of_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_level_import_cycle():
    top, _ = import_graph()
    cycle = find_cycle(top)
    assert cycle is None, "module-level import cycle: " + " -> ".join(cycle)


def test_no_import_cycle_counting_imports_inside_functions_too():
    top, inner = import_graph()
    both = {m: top[m] | inner[m] for m in top}
    cycle = find_cycle(both)
    assert cycle is None, "import cycle (through an import inside a function): " + " -> ".join(cycle)


@pytest.mark.parametrize("package", ["jaxdd.dispatch", "jaxdd.ops"])
def test_the_dispatch_and_ops_packages_know_no_model_or_pme_grid(package):
    top, inner = import_graph()
    for module in top:
        if module == package or module.startswith(package + "."):
            for target in top[module] | inner[module]:
                assert not target.startswith("jaxdd.models"), f"{module} imports {target}"


def package_of(module: str) -> str:
    """The package a module belongs to: ``jaxdd.<name>`` (a subpackage, or a top-level module
    on its own); the model zoo is one package, ``jaxdd.models``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package → the packages its modules import (the root ``jaxdd``, which re-exports, left out)."""
    graph: dict[str, set[str]] = {}
    for module, targets in edges.items():
        a = package_of(module)
        for target in targets:
            b = package_of(target)
            if a != b and "jaxdd" not in (a, b):
                graph.setdefault(a, set()).add(b)
    return graph


def test_no_import_cycle_between_packages():
    top, inner = import_graph()
    cycle = find_cycle(package_graph({m: top[m] | inner[m] for m in top}))
    assert cycle is None, "packages import each other: " + " -> ".join(cycle)


# Each layer imports only the layers below it: the registry every extension point uses, atoms and
# geometry, the kernels, neighbour lists (and their capacities), how a model distributes (its spec),
# what a model declares (the model protocol), how a system is cut into ranks, the dispatch, the engine
# that runs rank programs, and what drives the engine (dynamics, ASE, the validator, LAMMPS).
LAYERS = ("jaxdd.registry", "jaxdd.data", "jaxdd.ops", "jaxdd.ffi", "jaxdd.neighbors", "jaxdd.spec", "jaxdd.model",
          "jaxdd.decomposition", "jaxdd.dispatch", "jaxdd.engine", "jaxdd.dynamics", "jaxdd.interop", "jaxdd.validate",
          "jaxdd.lammps")


def test_the_top_level_holds_packages_and_entry_points_only():
    # Every module sits in the package of its layer; at the top: the command-line entry points
    # (demo, launch), the bound on compiled programs every layer from the neighbour lists up
    # shares, and the finder of earlier import paths.
    flat = sorted(p.stem for p in PACKAGES["jaxdd"].glob("*.py") if p.stem != "__init__")
    assert flat == ["_moved", "demo", "launch", "programs"]


#: The packages that drive the engine; what they share lives in the engine, below all of them.
DRIVERS = ("jaxdd.dynamics", "jaxdd.lammps", "jaxdd.interop")


@pytest.mark.parametrize("driver", DRIVERS)
def test_no_driver_package_imports_another_driver_package(driver):
    top, inner = import_graph()
    others = [d for d in DRIVERS if d != driver]
    wrong = sorted(f"{module} imports {target}" for module in top if package_of(module) == driver
                   for target in top[module] | inner[module] if package_of(target) in others)
    assert not wrong, "a driver package imports another (share through jaxdd.engine):\n" + "\n".join(wrong)


@pytest.mark.parametrize("lower, upper", [(a, b) for i, a in enumerate(LAYERS) for b in LAYERS[i + 1:]])
def test_a_layer_never_imports_one_above_it(lower, upper):
    top, inner = import_graph()
    graph = package_graph({m: top[m] | inner[m] for m in top})
    assert upper not in graph.get(lower, set()), f"{lower} imports {upper}, a layer above it"


def test_only_the_package_face_imports_the_finder_of_earlier_paths():
    # jaxdd/__init__.py installs the finder; every other module imports the present paths.
    top, inner = import_graph()
    wrong = sorted(m for m in top if "jaxdd._moved" in top[m] | inner[m] and m != "jaxdd")
    assert not wrong, f"modules import jaxdd._moved (import the present path instead): {wrong}"


def test_no_zoo_module_imports_the_face_jaxdd():
    # A zoo model imports each name from the module that defines it, never from the top-level
    # package (which imports everything, the zoo's own layer included).
    wrong = []
    for module, path in module_files().items():
        if not module.startswith("jaxdd.models"):
            continue
        for node, _ in _imports(ast.parse(path.read_text(), filename=str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            if "jaxdd" in names and not getattr(node, "level", 0):
                wrong.append(f"{module}:{node.lineno}")
    assert not wrong, f"zoo modules import the face jaxdd: {wrong}"
