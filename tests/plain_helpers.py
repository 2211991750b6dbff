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


def density_energies(positions, senders, receivers, shift_vectors, edge_mask, cutoff):
    """Per-atom energies of two passes over the edges: a smooth neighbour density, then
    messages weighted by the senders' densities. Both sums need every neighbour's term.

    Args:
      positions: [N, 3] Å. senders, receivers: [E] int (padding: N). shift_vectors: [E, 3] Å,
        the image of each sender. edge_mask: [E] bool. cutoff: Å.

    Returns:
      [N] per-atom energies.
    """
    n = positions.shape[0]
    vec = (positions.at[senders].get(mode="fill", fill_value=0.0)
           - positions.at[receivers].get(mode="fill", fill_value=0.0) + shift_vectors)
    r2 = jnp.sum(vec * vec, axis=-1)
    smooth = jnp.where(edge_mask & (r2 < cutoff**2), (1.0 - r2 / cutoff**2) ** 2, 0.0)
    density = jax.ops.segment_sum(smooth, receivers, n)
    messages = smooth * jnp.tanh(density.at[senders].get(mode="fill", fill_value=0.0))
    return jax.ops.segment_sum(messages, receivers, n) + 0.1 * density**2


def _doubled(x):
    return 2.0 * x


doubled = jax.jit(_doubled)
