"""A species-aware pair potential with one radial message per atom: the model of
``docs/adding_a_model.md``, written on :class:`~jaxdd.model.species.SpeciesModel`.

For atom i of species a_i, with neighbours j within the cutoff r_c (Å) and the cosine cutoff
``f_c(r) = 0.5 (cos(π r / r_c) + 1)``::

    g_n(r)  = exp(-((r - μ_n) / w)²) f_c(r)                   n_rbf Gaussians, μ_n on [0, r_c]
    φ_ab(r) = Σ_n c[a, b, n] g_n(r)                            pair energy (eV), c symmetric in a, b
    h_i     = Σ_j (Σ_n g_n(r_ij)) e[a_j]                       one message, [features]
    ε_i     = E0[a_i] + ½ Σ_j φ_{a_i a_j}(r_ij) + tanh(h_i) · v  atomic energy (eV)

and ``E = Σ_i ε_i`` per system; forces and stress by the framework's autodiff. It reads the
framework's COO neighbour list and distributes under ``SPEC_MPNN_HALO`` (the base's spec).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp

from jaxdd.data.checks import integral
from jaxdd.model.base import ModelConfig
from jaxdd.model.species import SpeciesModel

from .species import cast_params, check_cutoff, check_species, edge_lengths

__all__ = ["SpeciesPair"]


class SpeciesPair(eqx.Module, SpeciesModel):
    """Species-aware pair energies and one radial message (see the module docstring).

    Args:
      species: atomic numbers the model knows (rows of its tables).
      cutoff: r_c (Å).
      n_rbf: Gaussians of the distance (>= 2).
      features: width of the message.
      seed: parameters from ``jax.random.PRNGKey(seed)``, drawn in float32.
      dtype: parameter dtype; the computation follows the positions' dtype.

    Outputs: those of :class:`~jaxdd.model.species.SpeciesModel` (``energy [S]`` eV,
    ``atomic_energies [V]`` eV, ``forces [V, 3]`` eV/Å, ``stress [S, 3, 3]`` eV/Å³).
    """

    params: dict
    species: tuple[int, ...] = eqx.field(static=True)
    n_rbf: int = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, species=(1, 8), cutoff: float = 4.0, *, n_rbf: int = 6, features: int = 8, seed: int = 0,
                 dtype=jnp.float64):
        owner = "SpeciesPair"
        self.species = check_species(species, owner)
        self.n_rbf = integral(f"{owner} n_rbf", n_rbf, minimum=2)
        features = integral(f"{owner} features", features, minimum=1)
        self.model_config = self.energy_config(check_cutoff(cutoff, owner))
        k = len(self.species)
        keys = jax.random.split(jax.random.PRNGKey(seed), 3)

        def draw(key, shape, scale):
            return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)

        self.params = {
            "pair": draw(keys[0], (k, k, self.n_rbf), 0.1),  # eV
            "embed": draw(keys[1], (k, features), 1.0),
            "readout": draw(keys[2], (features,), 1.0 / math.sqrt(features)),  # eV
            "e0": jnp.zeros((k,), dtype),  # eV
        }

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        """Atomic energies from the edges of the COO list (see the module docstring).

        Args:
          positions: [V, 3] Å. cell: [S, 3, 3] Å. batch_idx: [V] system of each atom.
          kind: [V] species index. neighbors: the COO neighbour list.

        Returns:
          [V] atomic energies (eV), before padding rows are masked.
        """
        dt = positions.dtype
        n = positions.shape[0]
        rc = self.cutoff
        p = cast_params(self.params, dt)
        _, r, inside = edge_lengths(positions, cell, batch_idx, neighbors, rc)
        fc = jnp.where(inside, 0.5 * (jnp.cos(jnp.pi * r / rc) + 1.0), 0.0)
        centres = jnp.linspace(0.0, rc, self.n_rbf, dtype=dt)
        g = jnp.exp(-(((r[:, None] - centres) * (self.n_rbf - 1) / rc) ** 2)) * fc[:, None]  # [E, n_rbf]

        a, b = kind[neighbors.receivers], kind[neighbors.senders]  # padding rows are zeroed by g
        coef = 0.5 * (p["pair"] + jnp.swapaxes(p["pair"], 0, 1))
        phi = jnp.sum(g * coef[a, b], axis=-1)  # [E] eV
        h = jax.ops.segment_sum(jnp.sum(g, axis=-1)[:, None] * p["embed"][b], neighbors.receivers, num_segments=n)
        pair = jax.ops.segment_sum(0.5 * phi, neighbors.receivers, num_segments=n)
        return p["e0"][kind] + pair + jnp.tanh(h) @ p["readout"]
