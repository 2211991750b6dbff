"""Masks and identity elements for reductions over rank rows.

A reduction over atoms (or edges) must count each row on exactly one rank: ghost and pad
rows are replaced by the reduction's identity before the local reduction and the collective.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["along", "identity_of"]


def along(mask, ndim: int, axis: int):
    """A 1-D ``mask`` reshaped to broadcast along ``axis`` of an ``ndim``-D array."""
    return mask.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def identity_of(op: str, dtype):
    """The identity of reduction ``op`` (``sum``/``add``, ``max``, ``min``, ``prod``/``mul``,
    ``and``, ``or``, ``xor``) as a 0-d array of ``dtype``."""
    dtype = jnp.dtype(dtype)
    if op in ("sum", "add", "or", "xor"):
        return jnp.zeros((), dtype)
    if op in ("prod", "mul"):
        return jnp.ones((), dtype)
    if op == "and":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf if op == "max" else jnp.inf, dtype)
    if dtype == jnp.bool_:
        return jnp.array(op == "min", dtype)
    info = jnp.iinfo(dtype)
    return jnp.array(info.min if op == "max" else info.max, dtype)
