"""The named-op registry: kernels the dispatch treats as opaque, called by name.

A *named op* (``"namespace::op"``) is a kernel the dispatch cannot see into, declared on a
spec by an :class:`~jaxdd.spec.OpAdapter`; :func:`register_op` names it, :func:`get_op`
finds it again. All errors are :class:`~jaxdd.ops.SpecError`.

A module provides a namespace by registering its ops when it is imported. So that a spec file
naming its ops loads without importing the module first, the namespace is registered too, with
the modules that provide it (:func:`register_op_namespace`): :func:`get_op` imports them on
first use. jaxdd's own namespaces (``jaxdd_ffi``, ``jaxdd_warp``, ``jaxdd_mesh``) are
registered here, in :data:`OP_NAMESPACES`; ops of other packages resolve once the module that
registers them is imported, or on first use once their namespace is registered.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable

import jax

from ..registry import Registry
from .errors import SpecError
from .sharding import match_varying

__all__ = ["OpHandle", "register_op", "get_op", "registered_ops", "register_op_namespace", "op_providers", "OPS",
           "OP_NAMESPACES"]

_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_.]*", re.ASCII)
#: Every named op's :class:`OpHandle`, by name; two handles are the same op when their functions are.
OPS: Registry["OpHandle"] = Registry("named op", SpecError, definition=lambda handle: handle.fn)
#: namespace → the modules that register its ops, imported by :func:`get_op` on first use.
OP_NAMESPACES: Registry[tuple[str, ...]] = Registry("op namespace", SpecError)

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
    handle = OpHandle(name, fn, getattr(fn, "__module__", "") or "", fwd=fwd, bwd=bwd)
    return OPS.register(name, handle, replace=replace)


def get_op(name: str) -> OpHandle:
    """The registered op ``name``; a :class:`SpecError` naming the handle if nobody registered it."""
    if isinstance(name, OpHandle):
        return name
    if not isinstance(name, str) or "::" not in name:
        raise SpecError(f"an op handle is a 'namespace::op' string, got {name!r}")
    namespace = name.split("::", 1)[0]
    if name not in OPS:
        for module in OP_NAMESPACES.get(namespace, ()):
            importlib.import_module(module)
    try:
        return OPS[name]
    except KeyError:
        raise SpecError(
            f"op {name!r} is not registered; import the module that registers the {namespace!r} ops "
            f"(it calls jaxdd.ops.register_op({name!r}, ...)) before loading this spec"
        ) from None


def registered_ops() -> tuple[str, ...]:
    """Names of all registered ops, sorted."""
    return tuple(sorted(OPS))


def register_op_namespace(namespace: str, *modules: str, replace: bool = False) -> tuple[str, ...]:
    """Declare the modules that register the ops of ``namespace``, so :func:`get_op` imports them.

    Args:
      namespace: the part of the op names before ``::`` (an identifier).
      modules: absolute names of the modules whose import registers the namespace's ops.
      replace: allow a different list of modules for a namespace already declared.

    Returns:
      ``modules``.
    """
    if not isinstance(namespace, str) or not namespace.isidentifier():
        raise SpecError(f"an op namespace is an identifier, got {namespace!r}")
    if not modules or not all(isinstance(m, str) and all(p.isidentifier() for p in m.split(".")) for m in modules):
        raise SpecError(f"register_op_namespace({namespace!r}, ...): give the providing modules' dotted names, "
                        f"got {modules!r}")
    return OP_NAMESPACES.register(namespace, tuple(modules), replace=replace)


def op_providers() -> dict[str, tuple[str, ...]]:
    """The declared providers of named ops: namespace → the modules that register its ops.

    Returns: {namespace: (module name, ...)} (see :func:`register_op_namespace`).
    """
    return OP_NAMESPACES.copy()


# jaxdd's own providers: the compiled kernels, the Warp kernels, the model zoo's particle-mesh grid.
register_op_namespace("jaxdd_ffi", "jaxdd.ffi.attention", "jaxdd.ffi.lj")
register_op_namespace("jaxdd_warp", "jaxdd.ffi.warp")
register_op_namespace("jaxdd_mesh", "jaxdd.models.pme_grid")
