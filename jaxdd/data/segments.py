"""Per-system reductions over atoms that stay accurate in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["per_system_sum"]

# Up to this many systems a masked dense reduction is used: XLA reduces it as a tree, so
# a float32 sum over 10^5 atoms keeps ~1e-7 relative accuracy, where a scatter-add
# (segment_sum) accumulates atom by atom and drifts by ~1e-3.
_DENSE_MAX_SYSTEMS = 64


def per_system_sum(values: jax.Array, batch_idx: jax.Array, n_systems: int) -> jax.Array:
    """Sum per-atom ``values [V, ...]`` into ``[n_systems, ...]`` by ``batch_idx [V]``.

    Rows whose ``batch_idx`` is outside ``[0, n_systems)`` (padding) are dropped.

    Args:
      values: [V, ...] per-atom values.
      batch_idx: [V] int system of each atom.
      n_systems: S.

    Returns:
      [S, ...] sums.
    """
    if n_systems <= _DENSE_MAX_SYSTEMS:
        onehot = batch_idx[None, :] == jnp.arange(n_systems, dtype=batch_idx.dtype)[:, None]  # [S, V]
        onehot = onehot.reshape(onehot.shape + (1,) * (values.ndim - 1))
        return jnp.sum(jnp.where(onehot, values[None], 0), axis=1)
    return jax.ops.segment_sum(values, batch_idx, n_systems, indices_are_sorted=True)
