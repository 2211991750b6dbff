"""The one registry behind every extension point of jaxdd.

Dispatch rules (:func:`jaxdd.dispatch.register_rule`), named ops (:func:`jaxdd.ops.register_op`)
and their namespaces, helper-adapter kinds (:func:`jaxdd.spec.adapters.register_helper_adapter`),
validator fix rules (:func:`jaxdd.validate.register_fix_rule`) and integrators
(:func:`jaxdd.dynamics.register_integrator`) are each a :class:`Registry` of named entries, and
share its one rule for a name that is taken: registering a *different* value under it is refused
unless ``replace=True``; registering the same value, or the same definition again (a module or a
notebook cell run twice), is allowed and replaces the entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry", "same_definition", "describe"]

V = TypeVar("V")


def same_definition(a, b) -> bool:
    """True for the same object, an equal piece of data, or the same definition run again.

    Two functions are the same definition when their ``__module__``, ``__qualname__`` and
    ``__code__`` are equal; two classes when their module and qualname are and each function
    defined in the class body is the same definition as its namesake.

    Args:
      a, b: the objects compared (functions, classes; data compares by equality).

    Returns:
      Whether ``b`` is ``a`` defined again.
    """
    if a is b:
        return True
    if not callable(a) and not callable(b):
        return type(a) is type(b) and a == b
    keys = ("__module__", "__qualname__")
    if any(getattr(a, k, None) is None or getattr(a, k, None) != getattr(b, k, None) for k in keys):
        return False
    if isinstance(a, type) and isinstance(b, type):
        own = {n: m for n, m in vars(a).items() if callable(m) and hasattr(m, "__code__")}
        return own.keys() == {n for n, m in vars(b).items() if callable(m) and hasattr(m, "__code__")} and all(
            same_definition(m, vars(b)[n]) for n, m in own.items())
    return getattr(a, "__code__", None) is not None and a.__code__ == getattr(b, "__code__", None)


def describe(value) -> str:
    """``module.qualname`` of a function or class, else its ``repr`` (for error messages).

    Args:
      value: what to name.
    """
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(value)


class Registry(Generic[V]):
    """Named entries of one extension point, in registration order.

    Args:
      what: what an entry is, for messages (``"dispatch rule"``).
      error: the exception class of a refused registration or a missing name.
      definition: ``definition(value)`` is what two values are compared and described by
        (default: the value itself; e.g. an op handle's function).

    A registry reads like a read-only mapping: ``name in reg``, ``reg[name]``, ``reg.get(name)``,
    ``len(reg)``, iteration over the names; it changes through :meth:`register` and
    :meth:`unregister` only.
    """

    def __init__(self, what: str, error: type[Exception] = ValueError, *,
                 definition: Callable[[V], object] = lambda value: value):
        self.what, self.error, self._definition = what, error, definition
        self._entries: dict[str, V] = {}

    def register(self, name: str, value: V, *, replace: bool = False, before: str | None = None) -> V:
        """Register ``value`` under ``name``; returns ``value``.

        Args:
          name: the entry's name.
          value: the entry.
          replace: allow replacing a different value registered under ``name`` (the same
            value, or its definition run again, is always allowed).
          before: the name of an entry to place this one ahead of (default: where ``name``
            already is, else last).

        Returns:
          ``value``.

        Raises:
          error: ``name`` is taken by a different value and ``replace`` is False, or ``before``
            names no entry.
        """
        old = self._entries.get(name)
        if name in self._entries and not replace and not same_definition(self._definition(old), self._definition(value)):
            raise self.error(f"{self.what} {name!r} is already registered ({describe(self._definition(old))}); "
                             "pass replace=True to replace it")
        if before is None:
            self._entries[name] = value
            return value
        if before not in self._entries or before == name:
            raise self.error(f"before={before!r}: no such {self.what} (registered: {list(self._entries)})")
        entries = [(n, v) for n, v in self._entries.items() if n != name]
        at = next(i for i, (n, _) in enumerate(entries) if n == before)
        self._entries = dict(entries[:at] + [(name, value)] + entries[at:])
        return value

    def unregister(self, name: str) -> V:
        """Remove the entry ``name`` and return it.

        Args:
          name: the entry's name.
        """
        if name not in self._entries:
            raise self.error(f"no {self.what} {name!r} (registered: {list(self._entries)})")
        return self._entries.pop(name)

    def get(self, name: str, default: V | None = None) -> V | None:
        """The entry ``name``, or ``default``.

        Args:
          name: the entry's name.
          default: what to return when there is none.
        """
        return self._entries.get(name, default)

    def names(self) -> tuple[str, ...]:
        """The registered names, in order."""
        return tuple(self._entries)

    def values(self) -> tuple[V, ...]:
        """The registered entries, in order."""
        return tuple(self._entries.values())

    def items(self) -> tuple[tuple[str, V], ...]:
        """``(name, entry)`` pairs, in order."""
        return tuple(self._entries.items())

    def copy(self) -> dict[str, V]:
        """The entries as a new dict (changing it leaves the registry as it is)."""
        return dict(self._entries)

    def __getitem__(self, name: str) -> V:
        return self._entries[name]

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.what!r}: {list(self._entries)})"
