"""Per-rank ("varying") types of arrays inside ``shard_map``: read and matched, so that a
kernel's custom derivative sees all its arguments varying over the same mesh axes."""

from __future__ import annotations

import jax

__all__ = ["varying_axes", "match_varying"]


def varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` varies inside ``shard_map`` (empty outside, or for non-arrays)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)  # jax 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # later releases


def match_varying(args: tuple) -> tuple:
    """``args`` with every array made varying over the union of their mesh axes (identity
    outside ``shard_map``, or with ``check_vma=False``)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    if not axes:
        return tuple(args)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing or not hasattr(x, "dtype"):
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return tuple(cast(a) for a in args)
