"""Earlier import paths of modules that moved: each still imports, warns once, and is the
module at its present path (the same object, so ``isinstance`` and patches agree).

``import jaxdd.halo`` or ``from jaxdd.distributed import DomainConfig`` keeps working for
code written before the package took its present layers; new code imports the present path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "install", "moved_attribute"]

#: Earlier module path → present module path.
MOVED = {
    "jaxdd.mesh": "jaxdd.models.pme_grid",
    "jaxdd.capacity": "jaxdd.neighbors.capacity",
    "jaxdd.engine.capacity": "jaxdd.neighbors.capacity",
    "jaxdd.rank_program": "jaxdd.engine.rank_program",
    "jaxdd.distributed": "jaxdd.engine.distributed",
    **{f"{prefix}.{name}": f"jaxdd.decomposition.{name}"
       for prefix in ("jaxdd", "jaxdd.engine") for name in ("partition", "halo", "replan", "graph_partition")},
    "jaxdd.engine.guardrail": "jaxdd.decomposition.guardrail",
    # The flat top-level modules, grouped into the packages of their layer.
    **{f"jaxdd.{name}": f"jaxdd.data.{name}" for name in ("checks", "periodic", "constants", "systems", "segments")},
    "jaxdd.adapters": "jaxdd.spec.adapters",
    # The model protocol, once filed under jaxdd.spec (``jaxdd.model`` is its package now).
    **{f"{prefix}.{name}": f"jaxdd.model.{name}"
       for prefix in ("jaxdd", "jaxdd.spec") for name in ("protocol", "checkpoint", "context")},
    "jaxdd.spec.model": "jaxdd.model.base",
    "jaxdd.intent": "jaxdd.dispatch.intent",
    "jaxdd.driver": "jaxdd.engine.driver",
    "jaxdd.virials": "jaxdd.engine.virials",
    "jaxdd.ase": "jaxdd.interop.ase",
    "jaxdd.pme_grid": "jaxdd.models.pme_grid",
    # What the drivers share, moved down from the dynamics into the engine.
    "jaxdd.dynamics.placement": "jaxdd.engine.run_placement",
}

_warned: set[str] = set()


def _present(name: str):
    """The module at ``name``'s present path, warning the first time ``name`` is used."""
    target = MOVED[name]
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"{name} is deprecated: the module moved to {target}; import that instead",
                      DeprecationWarning, stacklevel=4)
    return importlib.import_module(target)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the earlier paths of :data:`MOVED`; loading one gives the present module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = _present(spec.name)
        spec.loader_state = module.__spec__  # the import system overwrites __spec__; put back in exec_module
        return module

    def exec_module(self, module) -> None:
        # The present module has run already; it keeps its own spec (name, origin).
        module.__spec__ = module.__spec__.loader_state if module.__spec__.loader_state is not None else module.__spec__


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def moved_attribute(package: str, name: str):
    """``package.name`` for an earlier submodule path (a package's ``__getattr__``)."""
    full = f"{package}.{name}"
    if full not in MOVED:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return importlib.import_module(full)
