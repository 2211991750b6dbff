"""Declarations that swap a third-party helper for a distribution-aware replacement.

Some models call helpers that are wrong under decomposition, e.g. a per-molecule sum that
sizes its output from ``mol_idx[-1] + 1``. A spec lists one adapter per such helper; the
dispatch installs the replacement while the model is traced and restores the original
afterwards. These classes only *declare* the swap.

A replacement is a callable or a ``"module:qualname"`` reference; only importable
module-level callables can be saved in a spec file. The kinds of adapter are registered by
their JSON tag (:data:`HELPER_ADAPTERS`, :func:`register_helper_adapter`); an
:class:`AdapterInstaller` (formerly ``AdapterRegistry``) installs them while a model is traced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable
from typing import Any, ClassVar

from ..ops import SpecError
from ..registry import Registry

__all__ = ["AdapterInstaller", "AdapterRegistry", "HelperAdapter", "PythonAdapter", "JitAdapter", "MethodAdapter",
           "ModuleForwardAdapter", "HELPER_ADAPTERS", "register_helper_adapter", "resolve_reference"]


def resolve_reference(ref: str, what: str = "replacement") -> Any:
    """Import ``"package.module:qualified.name"``; SpecError naming what failed.

    Args:
      ref: ``"module:qualname"``, an absolute module path and a dotted name in it.
      what: what the reference is, for the error message.

    Returns:
      The object ``ref`` names.
    """
    if not isinstance(ref, str) or ref.count(":") != 1 or not all(ref.split(":")) or ref.startswith("."):
        raise SpecError(f"{what} must be an absolute 'module:qualname' reference, got {ref!r}")
    module_name, qualname = ref.split(":")
    try:
        obj = importlib.import_module(module_name)
    except (ImportError, TypeError, ValueError) as exc:
        raise SpecError(f"{what} {ref!r}: cannot import module {module_name!r} ({exc}); install or import it first") from None
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise SpecError(f"{what} {ref!r}: module {module_name!r} has no attribute {qualname!r}") from None
    return obj


def reference_of(fn: Any) -> str | None:
    """``"module:qualname"`` of an importable module-level callable, else None."""
    if isinstance(fn, str):
        return fn
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname:  # lambdas and local functions
        return None
    try:
        found = resolve_reference(f"{module}:{qualname}")
    except SpecError:
        return None
    return f"{module}:{qualname}" if found is fn else None


def _check_name(owner: str, field: str, value: Any) -> None:
    if not isinstance(value, str) or not value or not all(p.isidentifier() for p in value.split(".")):
        raise SpecError(f"{owner}.{field} must be a dotted Python name, got {value!r}")


@dataclasses.dataclass(frozen=True)
class HelperAdapter:
    """Base of the helper adapters; ``kind`` is the JSON tag."""

    kind: ClassVar[str] = ""
    _names: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self):
        owner = type(self).__name__
        for name in self._names:
            _check_name(owner, name, getattr(self, name))
        r = self.replacement
        if isinstance(r, str):
            fn = resolve_reference(r, f"{owner}.replacement")
            if not callable(fn):
                raise SpecError(f"{owner}.replacement {r!r} is not callable (got {type(fn).__name__})")
            object.__setattr__(self, "replacement", fn)
            # Keep the name it was given by: an object's own __module__/__qualname__ do not
            # always lead back to it (re-exports, builtins), and saving must round-trip.
            object.__setattr__(self, "_reference", r)
        elif not callable(r):
            raise SpecError(f"{owner}.replacement must be callable or a 'module:qualname' string, got {r!r}")

    @property
    def replacement_ref(self) -> str | None:
        """The replacement as ``"module:qualname"``, or None if it cannot be imported by name."""
        return getattr(self, "_reference", None) or reference_of(self.replacement)

    def to_dict(self) -> dict:
        """The JSON form: ``kind``, the target's names and the replacement's reference.

        Raises SpecError when the replacement cannot be imported by name (a lambda or local function).
        """
        ref = self.replacement_ref
        if ref is None:
            raise SpecError(
                f"{type(self).__name__} for {self.target}: replacement {self.replacement!r} is not an importable "
                "module-level callable, so the spec cannot be saved; define it at module scope"
            )
        return {"kind": self.kind, **{n: getattr(self, n) for n in self._names}, "replacement": ref}

    @property
    def target(self) -> str:
        """The dotted name of what is replaced (``module.attr``, ``Class.method`` ...)."""
        return ".".join(getattr(self, n) for n in self._names)


#: The kinds of helper adapter by JSON tag (``kind``): what a spec file's helpers may name.
HELPER_ADAPTERS: Registry[type[HelperAdapter]] = Registry("helper adapter kind", SpecError)


def register_helper_adapter(cls: type[HelperAdapter]) -> type[HelperAdapter]:
    """Make the :class:`HelperAdapter` subclass ``cls`` a kind spec files may name (its ``kind``).

    Args:
      cls: a frozen-dataclass subclass of HelperAdapter with a ``kind`` of its own.

    Returns:
      ``cls`` (so the call works as a class decorator).
    """
    if not (isinstance(cls, type) and issubclass(cls, HelperAdapter) and cls.kind):
        raise SpecError(f"register_helper_adapter takes a HelperAdapter subclass with a kind, got {cls!r}")
    return HELPER_ADAPTERS.register(cls.kind, cls)


@register_helper_adapter
@dataclasses.dataclass(frozen=True)
class PythonAdapter(HelperAdapter):
    """Replace the function ``module_path.attr_name`` while the model is traced."""

    module_path: str
    attr_name: str
    replacement: Callable | str
    kind: ClassVar[str] = "python"
    _names: ClassVar[tuple[str, ...]] = ("module_path", "attr_name")


@register_helper_adapter
@dataclasses.dataclass(frozen=True)
class JitAdapter(PythonAdapter):
    """Replace the jitted function ``module_path.attr_name``; the replacement is jitted too."""

    kind: ClassVar[str] = "jit"


@register_helper_adapter
@dataclasses.dataclass(frozen=True)
class MethodAdapter(HelperAdapter):
    """Replace the method ``module_path.class_name.method_name``."""

    module_path: str
    class_name: str
    method_name: str
    replacement: Callable | str
    kind: ClassVar[str] = "method"
    _names: ClassVar[tuple[str, ...]] = ("module_path", "class_name", "method_name")


@register_helper_adapter
@dataclasses.dataclass(frozen=True)
class ModuleForwardAdapter(HelperAdapter):
    """Replace the ``__call__`` of the module class ``module_path.class_name``."""

    module_path: str
    class_name: str
    replacement: Callable | str
    kind: ClassVar[str] = "module_forward"
    _names: ClassVar[tuple[str, ...]] = ("module_path", "class_name")


# --------------------------------------------------------------------------- installing


def _owner(adapter: HelperAdapter):
    """(object holding the attribute, attribute name) an adapter replaces."""
    try:
        obj = importlib.import_module(adapter.module_path)
    except ImportError as exc:
        raise SpecError(f"{type(adapter).__name__} for {adapter.target}: cannot import {adapter.module_path!r} ({exc})") from None
    if isinstance(adapter, (MethodAdapter, ModuleForwardAdapter)):
        try:
            obj = getattr(obj, adapter.class_name)
        except AttributeError:
            raise SpecError(f"{type(adapter).__name__}: module {adapter.module_path!r} has no class "
                            f"{adapter.class_name!r}") from None
        attr = adapter.method_name if isinstance(adapter, MethodAdapter) else "__call__"
    else:
        attr = adapter.attr_name
    if not hasattr(obj, attr):
        raise SpecError(f"{type(adapter).__name__}: {adapter.module_path}.{'.'.join(adapter.target.split('.')[1:])} "
                        f"has no attribute {attr!r} to replace")
    return obj, attr


@dataclasses.dataclass
class _Installed:
    adapter: HelperAdapter
    owner: Any
    attr: str
    original: Any
    own: bool  # the attribute lived on the owner itself (not inherited)


class AdapterInstaller:
    """Installs helper adapters while a model is traced and restores the originals.

    ``install(*adapters)`` is all-or-nothing: if one adapter fails, those already installed
    by the call are rolled back and the error re-raised. ``restore()`` undoes everything in
    reverse order of installation. ``installed(adapters)`` does both around a ``with`` block.
    """

    def __init__(self):
        self._active: list[_Installed] = []

    def install(self, *adapters: HelperAdapter) -> None:
        """Install ``adapters``, all or none: on a failure those installed by this call are put back.

        Args:
          adapters: the helper adapters to install, in order.
        """
        done: list[_Installed] = []
        try:
            for adapter in adapters:
                if not isinstance(adapter, HelperAdapter):
                    raise SpecError(f"AdapterInstaller.install takes helper adapters, got {adapter!r}")
                owner, attr = _owner(adapter)
                own = attr in getattr(owner, "__dict__", {})
                original = owner.__dict__[attr] if own else getattr(owner, attr)
                replacement = adapter.replacement
                if isinstance(adapter, JitAdapter):
                    import jax

                    replacement = jax.jit(replacement)
                setattr(owner, attr, replacement)
                done.append(_Installed(adapter, owner, attr, original, own))
        except BaseException:
            for item in reversed(done):
                _put_back(item)
            raise
        self._active.extend(done)

    def restore(self) -> None:
        """Put back every original, in reverse order of installation."""
        while self._active:
            _put_back(self._active.pop())

    def list_active(self) -> tuple[HelperAdapter, ...]:
        """The adapters installed now, in installation order."""
        return tuple(item.adapter for item in self._active)

    @contextlib.contextmanager
    def installed(self, adapters=()):
        """Install ``adapters`` for the ``with`` block; restore everything installed during it."""
        mark = len(self._active)
        self.install(*adapters)
        try:
            yield self
        finally:
            while len(self._active) > mark:
                _put_back(self._active.pop())


#: The former name of :class:`AdapterInstaller` (it installs adapters; the kinds are registered in
#: :data:`HELPER_ADAPTERS`).
AdapterRegistry = AdapterInstaller


def _put_back(item: _Installed) -> None:
    if item.own:
        setattr(item.owner, item.attr, item.original)
    else:
        try:
            delattr(item.owner, item.attr)
        except AttributeError:
            setattr(item.owner, item.attr, item.original)
