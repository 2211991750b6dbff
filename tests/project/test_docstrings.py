"""Every public function, class, method and property of jaxdd has a docstring that says what it takes.

The public API is every name in the ``__all__`` of ``jaxdd`` and of each of its modules and
subpackages (``jaxdd.models`` and ``jaxdd.specs``, whose sources are ``models/`` and ``specs/``,
included; modules and names with a leading underscore are private), plus the public methods
and properties that a public class defines itself (its own ``__dict__``; members inherited
from a base outside jaxdd and the methods a dataclass generates are not its own). Data (constants, registries, specs) cannot
carry a docstring of its own and is left out.

Each must have a non-empty docstring. A function or method that takes parameters (beyond
``self`` or ``cls``) must also say what they are: an ``Args:`` section, or a one-paragraph
docstring that names each parameter. A method that overrides a documented method of a jaxdd
base class shares its docstring (as :func:`inspect.getdoc` and the docs do). A function
registered as a dispatch rule takes what the rule protocol says, documented once
(:data:`jaxdd.dispatch.registry.Rule`): its docstring says what it decides, not its Args.

The test reports every missing docstring at once. A module that cannot be imported because an
optional package (warp, torch, mlip ...) is missing is skipped, by name and reason, in
:func:`test_module_imports`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
import re

import pytest

import jaxdd

#: Packages to walk: ``jaxdd.models`` (``models/``) and ``jaxdd.specs`` (``specs/``) live outside
#: ``jaxdd/``'s folder, so walking ``jaxdd`` does not find them.
PACKAGES = ("jaxdd", "jaxdd.models", "jaxdd.specs")


def _is_private(module_name: str) -> bool:
    return any(part.startswith("_") for part in module_name.split("."))


@functools.cache
def module_names() -> tuple[str, ...]:
    """The public modules of jaxdd, packages and their submodules, in walk order."""
    names = []
    for package_name in PACKAGES:
        package = importlib.import_module(package_name)
        names.append(package_name)
        for info in pkgutil.walk_packages(package.__path__, package_name + ".", onerror=lambda name: None):
            names.append(info.name)
    return tuple(dict.fromkeys(name for name in names if not _is_private(name)))


def _optional_import_error(error: ImportError) -> bool:
    """Whether ``error`` is a missing third-party package (not a broken jaxdd module)."""
    missing = (error.name or "").split(".")[0]
    return bool(missing) and missing != "jaxdd"


@functools.cache
def import_modules() -> tuple[dict, dict, dict]:
    """``(modules, skipped, broken)``: name → module for those that import; name → reason for
    those that need a missing optional package; name → error for those that fail otherwise."""
    modules, skipped, broken = {}, {}, {}
    for name in module_names():
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as error:
            if _optional_import_error(error):
                skipped[name] = f"needs {error.name}: {error}"
            else:
                broken[name] = f"{type(error).__name__}: {error}"
        except Exception as error:  # a module that raises on import is broken, not undocumented
            broken[name] = f"{type(error).__name__}: {error}"
    return modules, skipped, broken


def _in_jaxdd(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] == "jaxdd"


def _is_function(obj) -> bool:
    """Plain functions and the wrappers that keep one (``jax.jit``, ``functools.cache``)."""
    return not inspect.isclass(obj) and (inspect.isroutine(obj) or (callable(obj) and hasattr(obj, "__wrapped__")))


def _generated_class_doc(cls) -> bool:
    """The docstring ``dataclass`` and ``NamedTuple`` write for a class without one: ``Name(a, b)``."""
    doc = cls.__dict__.get("__doc__") or ""
    return "\n" not in doc.strip() and doc.startswith(cls.__name__ + "(") and doc.rstrip().endswith(")")


def _class_doc(cls) -> str:
    doc = cls.__dict__.get("__doc__")
    if not isinstance(doc, str) or _generated_class_doc(cls):
        return ""
    return doc.strip()


def _member_doc(cls, name: str, member) -> str:
    """A member's docstring, or that of the member it overrides in a jaxdd base class."""
    doc = (getattr(member, "__doc__", None) or "").strip()
    if doc:
        return doc
    for base in cls.__mro__[1:]:
        if _in_jaxdd(base) and name in base.__dict__:
            doc = (getattr(_unwrap(base.__dict__[name]), "__doc__", None) or "").strip()
            if doc:
                return doc
    return ""


def _unwrap(member):
    """The function behind a ``staticmethod``, ``classmethod`` or property (its getter)."""
    if isinstance(member, (staticmethod, classmethod)):
        return member.__func__
    if isinstance(member, property):
        return member.fget
    if isinstance(member, functools.cached_property):
        return member.func
    return member


def _parameters(function, *, bound: bool) -> list[str]:
    """The parameters ``function`` takes from a caller (``self``/``cls`` left out when ``bound``)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    if bound and parameters and parameters[0].kind in (parameters[0].POSITIONAL_ONLY,
                                                       parameters[0].POSITIONAL_OR_KEYWORD):
        parameters = parameters[1:]
    return [p.name for p in parameters if not p.name.startswith("_")]


def _says_what_it_takes(doc: str, parameters: list[str]) -> bool:
    """An ``Args:`` section, or one paragraph that names every parameter."""
    if not parameters or re.search(r"^\s*Args:", doc, re.MULTILINE):
        return True
    if re.search(r"\n\s*\n", doc):
        return False
    return all(re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", doc) for name in parameters)


@functools.cache
def _dispatch_rules() -> frozenset[int]:
    from jaxdd.dispatch import registered_rules

    return frozenset(id(rule) for rule in registered_rules().values())


def _follows_the_rule_protocol(function, parameters: list[str]) -> bool:
    """A registered dispatch rule taking ``(ctx, eqn, in_layouts)``, as the protocol documents."""
    return id(function) in _dispatch_rules() and len(parameters) == 3


def _check_function(qualname: str, function, doc: str, *, bound: bool, problems: list[str]) -> None:
    if not doc:
        problems.append(f"{qualname}: no docstring")
        return
    parameters = _parameters(function, bound=bound)
    if not _follows_the_rule_protocol(function, parameters) and not _says_what_it_takes(doc, parameters):
        problems.append(f"{qualname}: no Args section for ({', '.join(parameters)})")


def _dataclass_generated(cls, name: str) -> bool:
    return dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}


def _check_class(cls, problems: list[str]) -> None:
    qualname = f"{cls.__module__}.{cls.__qualname__}"
    if not _class_doc(cls):
        problems.append(f"{qualname}: no docstring")
    for name, member in vars(cls).items():
        if name.startswith("_") or _dataclass_generated(cls, name):
            continue
        target = _unwrap(member)
        if isinstance(member, (property, functools.cached_property)):
            if not _member_doc(cls, name, target):
                problems.append(f"{qualname}.{name}: no docstring (property)")
        elif _is_function(target):
            if not _in_jaxdd(target):
                continue  # a function from elsewhere assigned as an attribute
            bound = not isinstance(member, staticmethod)
            _check_function(f"{qualname}.{name}", target, _member_doc(cls, name, target),
                            bound=bound, problems=problems)


def public_objects(modules: dict) -> list[tuple[str, object]]:
    """``(where, object)`` for each public name, each object once, under the first module exporting it."""
    seen, found = set(), []
    for module_name, module in modules.items():
        for name in getattr(module, "__all__", ()):
            if name.startswith("_"):
                continue
            try:
                obj = getattr(module, name)
            except AttributeError:  # a submodule listed in __all__ and imported lazily
                obj = importlib.import_module(f"{module_name}.{name}")
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            found.append((f"{module_name}.{name}", obj))
    return found


def missing_docstrings() -> list[str]:
    """Every public definition of jaxdd without the docstring it needs, one line each."""
    modules, _, broken = import_modules()
    problems: list[str] = [f"{name}: cannot be imported ({error})" for name, error in broken.items()]
    for name, module in modules.items():
        if not (module.__doc__ or "").strip():
            problems.append(f"{name}: no module docstring")
    for where, obj in public_objects(modules):
        if inspect.ismodule(obj):
            continue  # checked above when public, and a module's own __all__ is walked
        if inspect.isclass(obj):
            if _in_jaxdd(obj):
                _check_class(obj, problems)
        elif _is_function(obj):
            if _in_jaxdd(obj) or _in_jaxdd(inspect.unwrap(obj)):
                qualname = f"{obj.__module__}.{getattr(obj, '__qualname__', where)}"
                _check_function(qualname, obj, (obj.__doc__ or "").strip(), bound=False, problems=problems)
    return sorted(dict.fromkeys(problems))


@pytest.mark.parametrize("name", module_names())
def test_module_imports(name):
    """Every public module imports, or needs an optional package that is not installed."""
    _, skipped, broken = import_modules()
    if name in skipped:
        pytest.skip(f"{name} not checked for docstrings: {skipped[name]}")
    assert name not in broken, f"{name} cannot be imported: {broken[name]}"


def test_public_api_has_docstrings():
    """Every public function, class, method and property has a docstring saying what it takes."""
    problems = missing_docstrings()
    if problems:
        pytest.fail(f"{len(problems)} public definitions lack a docstring or its Args:\n" + "\n".join(problems),
                    pytrace=False)
