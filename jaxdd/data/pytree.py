"""Frozen classes of array fields registered as JAX pytrees (AtomicData, Batch).

Array fields are pytree leaves; absent optional fields are ``None`` (an empty pytree node).
Unflattening never validates, because JAX unflattens with tracers, ``None``, sentinels or
axis numbers (``in_axes``); the classes' constructors do.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["register", "set_fields", "replaced"]


_FIELDS: dict[type, tuple[str, ...]] = {}  # each registered class's fields, in order


def _frozen_setattr(self, name, value):
    raise dataclasses.FrozenInstanceError(
        f"{type(self).__name__} is immutable; use .replace({name}=...) for a modified copy"
    )


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
    return type(x).__name__


def register(cls, fields: tuple[str, ...]):
    """Register ``cls`` as a frozen pytree whose children are ``fields``, in order.

    Sets ``cls._fields``, refuses attribute assignment and deletion, and gives a ``repr``
    that shows each present field's dtype and shape.

    Args:
      cls: the class; its instances hold one attribute per field.
      fields: the attribute names, in flattening order.

    Returns:
      ``cls``.
    """
    def flatten(obj):
        return tuple(getattr(obj, f) for f in fields), None

    def flatten_with_keys(obj):
        return tuple((jax.tree_util.GetAttrKey(f), getattr(obj, f)) for f in fields), None

    def unflatten(_, children):
        # No validation: JAX unflattens with tracers, None, sentinels or ints.
        obj = object.__new__(cls)
        for f, c in zip(fields, children):
            object.__setattr__(obj, f, c)
        return obj

    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
    cls._fields = _FIELDS[cls] = fields
    cls.__setattr__ = _frozen_setattr
    cls.__delattr__ = _frozen_setattr

    def __repr__(self):
        parts = [f"{f}={_describe(getattr(self, f, None))}" for f in fields
                 if getattr(self, f, None) is not None]
        return f"{cls.__name__}({', '.join(parts)})"

    cls.__repr__ = __repr__
    return cls


def set_fields(obj: Any, **values: Any) -> None:
    """Set the fields of a frozen ``obj`` (in its constructor): field name → ``values``."""
    for k, v in values.items():
        object.__setattr__(obj, k, v)


def replaced(obj: Any, **changes: Any) -> Any:
    """A copy of the registered ``obj`` made by its constructor (so validated), with ``changes``
    (field name → new value, as the constructor takes it) applied."""
    return type(obj)(**{**{f: getattr(obj, f) for f in _FIELDS[type(obj)]}, **changes})
