"""Helpers for the plain (single-device) reference models in ``plain_models.py``.

Plain JAX only: nothing here imports jaxdd.
"""

import jax
import jax.numpy as jnp


def mol_sum(values, batch_idx, n_systems):
    """Per-system sum of per-atom ``values`` by a cumulative sum over the atoms.

    Written the way some third-party codes do it: the atoms are assumed to be ordered
    by system and contiguous (true for an ordinary single-device batch), so the sum of
    system ``s`` is the difference of the running sum at the end and at the start of its
    block of atoms.

    Args:
      values: [N] per-atom values (padding atoms should already be zero).
      batch_idx: [N] int system of each atom; padding atoms hold ``n_systems`` and are
        not counted.
      n_systems: python int, number of systems.

    Returns:
      [n_systems] per-system sums.
    """
    counts = jnp.bincount(batch_idx, length=n_systems)
    ends = jnp.cumsum(counts)
    c = jnp.concatenate([jnp.zeros(1, dtype=values.dtype), jnp.cumsum(values)])
    return c[ends] - c[ends - counts]


class Readout:
    """A third-party readout with a method and a forward, for the method adapters."""

    def scale(self, x):
        return 2.0 * x

    def __call__(self, x):
        return x + 1.0


class DerivedReadout(Readout):
    """Inherits ``scale``: replacing it must not leave a copy on this class afterwards."""


def _doubled(x):
    return 2.0 * x


doubled = jax.jit(_doubled)
