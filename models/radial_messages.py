"""Radial message passing shared by the charge-equilibration network and the internal-graph
backbone: a species embedding, a radial filter of the edge lengths, and rounds of messages
``h_i ← h_i + Σ_j tanh(h_j W) ⊙ filter(r_ij) / 4``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["normal", "init_messages", "radial_filter", "pass_messages"]


def normal(key, shape, dtype):
    """Standard normal parameters drawn in float32 and cast: one seed gives the same model in any precision.

    Args:
      key: a ``jax.random`` key. shape: of the draw. dtype: of the parameters.

    Returns:
      the ``shape`` array in ``dtype``.
    """
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def init_messages(keys, n_species: int, features: int, n_rbf: int, n_layers: int, dtype):
    """The parameters of the messages.

    Args:
      keys: ``jax.random`` keys; the first three are used. n_species: rows of the embedding.
      features: width F. n_rbf: Gaussians of the radial filter. n_layers: rounds. dtype: of the parameters.

    Returns:
      ``(embed [n_species, F], radial [n_rbf, F], layers)``, ``layers`` a tuple of ``n_layers``
      ``[F, F]`` matrices.
    """
    embed = normal(keys[0], (n_species, features), dtype)
    radial = normal(keys[1], (n_rbf, features), dtype) / np.sqrt(n_rbf)
    layers = tuple(normal(k, (features, features), dtype) / np.sqrt(features)
                   for k in jax.random.split(keys[2], n_layers))
    return embed, radial, layers


def radial_filter(r, mask, rc, radial):
    """Gaussians of the edge lengths times a cosine envelope, mixed by ``radial``.

    Args:
      r: [E] edge lengths (Å; any finite value on masked edges). mask: [E] bool edges kept.
      rc: the cutoff (Å). radial: [n_rbf, F] weights.

    Returns:
      ``(filter [E, F], envelope [E])``, both zero on masked edges.
    """
    dtype = r.dtype
    env = jnp.where(mask, 0.5 * (jnp.cos(jnp.pi * r / rc) + 1.0), 0.0)
    centres = jnp.linspace(0.0, rc, radial.shape[0], dtype=dtype)
    rbf = jnp.exp(-((r[:, None] - centres) ** 2) / (rc / radial.shape[0]) ** 2) * env[:, None]
    return rbf @ radial.astype(dtype), env


def pass_messages(h, layers, filt, gather, receivers):
    """Rounds of radial messages.

    Args:
      h: [V, F] atom features. layers: one [F, F] matrix per round. filt: [E, F] radial filter.
      gather: the senders' rows of a [V, F] array, [E, F]. receivers: [E] receiving atom of each edge.

    Returns:
      the features after every round, [V, F].
    """
    for w in layers:
        messages = jnp.tanh(gather(h) @ w.astype(h.dtype)) * filt
        h = h + jax.ops.segment_sum(messages, receivers, num_segments=h.shape[0]) / 4.0
    return h
