"""An immutable, hashable mapping: what a spec stores its maps in, so that a spec can be a
static argument of ``jax.jit``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

__all__ = ["FrozenMap"]


class FrozenMap(Mapping):
    """An immutable, hashable mapping (iteration in key order).

    Args:
      items: a mapping, or an iterable of ``(key, value)`` pairs; keys must be hashable and
        comparable with each other (they are sorted).
    """

    __slots__ = ("_items", "_dict")

    def __init__(self, items: Mapping | Iterable = ()):
        d = dict(items.items() if isinstance(items, Mapping) else items)
        object.__setattr__(self, "_dict", d)
        object.__setattr__(self, "_items", tuple(sorted(d.items(), key=lambda kv: kv[0])))

    def __getitem__(self, key):
        return self._dict[key]

    def __iter__(self) -> Iterator:
        return (k for k, _ in self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return hash(self._items)

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is immutable")

    def __repr__(self):
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self._items) + "}"
