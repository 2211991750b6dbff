"""The named-op registry: kernels the dispatch treats as opaque, called by name.

A *named op* (``"namespace::op"``) is a kernel the dispatch cannot see into, declared on a
spec by an :class:`~jaxdd.spec.OpAdapter`; :func:`register_op` names it, :func:`get_op`
finds it again. All errors are :class:`~jaxdd.ops.SpecError`.

A module provides a namespace by registering its ops when it is imported: a module-level
call of :func:`register_op` (or of a helper named ``*_op`` around it, such as
``jaxdd.ffi.warp.warp_op``) with the op's name written out. jaxdd's own providers
(``jaxdd_ffi``, ``jaxdd_warp``, ``jaxdd_mesh``, and any a new module adds) are found by
reading the sources of jaxdd and its model zoo (``jaxdd.models``, whose ``pme_grid`` provides
``jaxdd_mesh``) for such calls (:func:`op_providers`), and :func:`get_op` imports
them on first use, so a spec file naming their ops loads without importing them first.
Ops of other packages resolve once the module that registers them is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path

import jax

from .errors import SpecError
from .sharding import match_varying

__all__ = ["OpHandle", "register_op", "get_op", "registered_ops", "op_providers"]

_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_.]*", re.ASCII)
_REGISTRY: dict[str, "OpHandle"] = {}
# The package whose modules op_providers reads: the one holding jaxdd.ops, and its model zoo,
# installed as a subpackage from a folder of its own.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]
_PACKAGE = __name__.split(".", 1)[0]
_ZOO = f"{_PACKAGE}.models"
# A registration at module level (a line that is not indented): a call of register_op or a
# *_op helper, bare, assigned or as a decorator, whose first argument is a written-out op name.
# Groups: the function called, the op's namespace.
_REGISTRATION = re.compile(
    r"""^(?:@|[A-Za-z_][\w.]*\s*(?::[^=\n]*)?=\s*)?(?:[A-Za-z_][\w]*\.)*(\w*_op)\(\s*["']([A-Za-z_]\w*)::""",
    re.MULTILINE | re.ASCII)


@dataclasses.dataclass(frozen=True, eq=False)
class OpHandle:
    """A named op: a kernel the dispatch treats as opaque, called as ``handle(*args)``.

    Calls go through a ``jax.jit`` named after the handle, so the op appears in a traced
    program as one call the dispatch can recognise by name (and re-binds whole, its
    derivative rule included). Handles compare by name.

    fwd, bwd: the op's reverse-mode rule, when it has one (see :func:`register_op`).
    """

    name: str
    fn: Callable = dataclasses.field(repr=False)
    module: str = ""
    fwd: Callable | None = dataclasses.field(default=None, repr=False)
    bwd: Callable | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        inner = self.fn if self.bwd is None else _with_vjp(self.fn, self.fwd, self.bwd)

        def call(*args, **kwargs):
            return inner(*args, **kwargs)

        call.__name__ = call.__qualname__ = self.name
        object.__setattr__(self, "_jitted", jax.jit(call))

    @property
    def namespace(self) -> str:
        """The part of the name before ``::`` (the provider's namespace)."""
        return self.name.split("::", 1)[0]

    @property
    def differentiable(self) -> bool:
        """True when the op carries its own reverse-mode rule (a ``custom_vjp``)."""
        return self.bwd is not None

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)

    def __eq__(self, other):
        return isinstance(other, OpHandle) and other.name == self.name

    def __hash__(self):
        return hash(("OpHandle", self.name))

    def __str__(self):
        return self.name


def _with_vjp(fn: Callable, fwd: Callable | None, bwd: Callable) -> Callable:
    """``fn`` as a ``jax.custom_vjp`` whose rule is ``fwd``/``bwd`` (see :func:`register_op`).

    Symbolic zeros are asked for so that ``bwd`` learns which outputs nothing depends on
    (``None`` there) and can skip their work, e.g. a second-derivative formula for kernel
    forces when only the energy is differentiated.
    """
    from jax.custom_derivatives import SymbolicZero

    core = jax.custom_vjp(fn)

    def fwd_rule(*primals):
        args = tuple(p.value for p in primals)
        return fwd(*args) if fwd is not None else (fn(*args), args)

    def bwd_rule(residuals, cts):
        cts = jax.tree_util.tree_map(lambda c: None if isinstance(c, SymbolicZero) else c, cts,
                                     is_leaf=lambda c: isinstance(c, SymbolicZero))
        return tuple(bwd(residuals, cts))

    core.defvjp(fwd_rule, bwd_rule, symbolic_zeros=True)

    def op(*args):
        # Inside shard_map, the rule sees its arguments varying over the same mesh axes
        # (what an FFI call needs); the casts happen out here, where JAX differentiates
        # them, so an argument that did not vary gets its cotangent summed over ranks.
        return core(*match_varying(args))

    return op


def register_op(name: str, fn: Callable | None = None, *, fwd: Callable | None = None,
                bwd: Callable | None = None, replace: bool = False):
    """Register ``fn`` as the named op ``"namespace::op"`` and return its :class:`OpHandle`.

    Usable as a decorator: ``@register_op("mymodel::fused_message")``. Registering a name
    twice with different functions is refused unless ``replace=True`` (re-running a module,
    e.g. in a notebook, re-registers the same function and is allowed).

    Args:
      name: ``"namespace::op"`` (identifiers).
      fn: fn(*arrays) -> array or tuple of arrays. All arguments are arrays (scalars as
        0-d arrays): the dispatch may call the op again on transformed arguments, so
        nothing may hide in keyword arguments. None: return a decorator.
      fwd: fwd(*arrays) -> (outputs, residuals), the forward half of the rule (default:
        ``fn`` and the arguments themselves); only with ``bwd``.
      bwd: the op's reverse-mode rule (a backward kernel or a jnp formula), making the op a
        ``jax.custom_vjp``: ``bwd(residuals, cotangents)`` returns one cotangent per
        argument (``None`` for integer, boolean or non-differentiated ones); an entry of
        ``cotangents`` is ``None`` when nothing depends on that output. Without ``bwd``,
        JAX differentiates ``fn`` itself (it must then be made of jax ops).
      replace: allow replacing an op registered under ``name`` by another function.

    Returns:
      The op's :class:`OpHandle` (a decorator when ``fn`` is None).

    Raises:
      SpecError: a malformed name, a non-callable ``fn``/``fwd``/``bwd``, ``fwd`` without
        ``bwd``, or a name already registered by another function.
    """
    if not isinstance(name, str) or not _OP_NAME.fullmatch(name):
        raise SpecError(f"op name must look like 'namespace::op' (identifiers), got {name!r}")
    if fn is None:
        return lambda f: register_op(name, f, fwd=fwd, bwd=bwd, replace=replace)
    if not callable(fn):
        raise SpecError(f"register_op({name!r}, ...): the implementation must be callable, got {fn!r}")
    for field, rule in (("fwd", fwd), ("bwd", bwd)):
        if rule is not None and not callable(rule):
            raise SpecError(f"register_op({name!r}, ...): {field} must be callable, got {rule!r}")
    if fwd is not None and bwd is None:
        raise SpecError(f"register_op({name!r}, ...): fwd without bwd; pass the backward rule too")
    old = _REGISTRY.get(name)
    if old is not None and not (replace or old.fn is fn or _same_source(old.fn, fn)):
        raise SpecError(f"op {name!r} is already registered by {old.module or 'another module'}; pass replace=True")
    handle = OpHandle(name, fn, getattr(fn, "__module__", "") or "", fwd=fwd, bwd=bwd)
    _REGISTRY[name] = handle
    return handle


def _same_source(a: Callable, b: Callable) -> bool:
    """True for the same function defined again (a module or notebook cell run twice)."""
    keys = ("__module__", "__qualname__", "__code__")
    return all(getattr(a, k, None) is not None and getattr(a, k, None) == getattr(b, k, None) for k in keys)


def get_op(name: str) -> OpHandle:
    """The registered op ``name``; a :class:`SpecError` naming the handle if nobody registered it."""
    if isinstance(name, OpHandle):
        return name
    if not isinstance(name, str) or "::" not in name:
        raise SpecError(f"an op handle is a 'namespace::op' string, got {name!r}")
    namespace = name.split("::", 1)[0]
    if name not in _REGISTRY:
        for module in _discovered_providers().get(namespace, ()):
            importlib.import_module(module)
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SpecError(
            f"op {name!r} is not registered; import the module that registers the {namespace!r} ops "
            f"(it calls jaxdd.ops.register_op({name!r}, ...)) before loading this spec"
        ) from None


def registered_ops() -> tuple[str, ...]:
    """Names of all registered ops, sorted."""
    return tuple(sorted(_REGISTRY))


def op_providers() -> dict[str, tuple[str, ...]]:
    """jaxdd's own providers of named ops: namespace → the modules that register its ops.

    Found by reading (not importing) every module of the jaxdd package for registrations at
    module level (see the module docstring), once per process; :func:`get_op` imports a
    namespace's modules when asked for one of its ops that is not registered yet.

    Returns: {namespace: (module name, ...)}, modules in path order.
    """
    return dict(_discovered_providers())


@functools.cache
def _discovered_providers() -> dict[str, tuple[str, ...]]:
    found: dict[str, list[str]] = {}
    roots = [(_PACKAGE, _PACKAGE_DIR)]
    zoo = importlib.util.find_spec(_ZOO)  # located, not imported
    if zoo is not None and zoo.submodule_search_locations:
        roots += [(_ZOO, Path(folder)) for folder in zoo.submodule_search_locations
                  if Path(folder).resolve() != _PACKAGE_DIR / "models"]  # else read with the package
    for package, folder in roots:
        for module, source in _sources(package, folder):
            namespaces = {m.group(2) for m in _REGISTRATION.finditer(source) if m.group(1) != "get_op"}
            for namespace in sorted(namespaces):
                found.setdefault(namespace, []).append(module)
    return {namespace: tuple(modules) for namespace, modules in found.items()}


def _sources(package: str, folder: Path):
    """Yield (module name, source text) for each readable ``.py`` file under ``folder``."""
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        if "__pycache__" in parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield ".".join((package, *(parts[:-1] if parts[-1] == "__init__" else parts))), source
