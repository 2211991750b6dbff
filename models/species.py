"""The checks every element-resolved zoo model makes of its arguments, and :class:`SpeciesNetwork`,
the fields the zoo's networks share. The species table, the check of a batch's elements and the
neighbour-list inputs are those of the models' base, :mod:`jaxdd.model.species` (imported here by
their earlier names)."""

from __future__ import annotations

import math
import numbers

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.model.base import ModelConfig
from jaxdd.model.species import SpeciesModel, neighbor_inputs, species_table, validate_species
from jaxdd.neighbors import edge_vectors

__all__ = ["SpeciesNetwork", "species_table", "check_species", "check_cutoff", "check_positive", "validate_species",
           "neighbor_inputs", "weights_dtype", "edge_lengths", "cast_params"]


class SpeciesNetwork(eqx.Module, SpeciesModel):
    """A :class:`~jaxdd.model.species.SpeciesModel` as an equinox module, its weights one pytree.

    Declares the fields the zoo's networks share: ``params`` (the weights), ``species`` (the
    atomic numbers known, static) and ``model_config`` (static), and checks and sets the last
    two. A subclass adds its hyperparameters as static fields and writes ``__init__`` and
    ``atom_energies``.
    """

    params: dict
    species: tuple[int, ...] = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, species, cutoff: float, **neighbor_options):
        """Check and set ``species`` and ``model_config``; a subclass's ``__init__`` calls it,
        then sets ``params`` and its own fields.

        Args:
          species: the atomic numbers the model knows (distinct, >= 1).
          cutoff: r_c (Å), positive and finite.
          neighbor_options: further :class:`~jaxdd.model.base.NeighborConfig` fields.
        """
        owner = type(self).__name__
        self.species = check_species(species, owner)
        self.model_config = self.energy_config(check_cutoff(cutoff, owner), **neighbor_options)


def check_species(species, owner):
    """``species`` as a tuple of distinct atomic numbers >= 1; ValueError naming ``owner`` otherwise."""
    species = tuple(integral(f"{owner} species", z, minimum=1) for z in species)
    if not species or len(set(species)) != len(species) or min(species) < 1:
        raise ValueError(f"{owner} species must be distinct atomic numbers >= 1, got {species}")
    return species


def check_cutoff(cutoff, owner):
    """``cutoff`` (Å) as a positive finite float; ValueError naming ``owner`` otherwise."""
    if not isinstance(cutoff, numbers.Real) or isinstance(cutoff, bool) or not math.isfinite(cutoff) or cutoff <= 0:
        raise ValueError(f"{owner} cutoff must be a positive finite number (Å), got {cutoff!r}")
    return float(cutoff)


def check_positive(value, name, owner) -> float:
    """``value`` as a positive finite float; ValueError naming ``owner``'s ``name`` otherwise."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"{owner} {name} must be positive, got {value!r}")
    return x


def edge_lengths(positions, cell, batch_idx, neighbors, cutoff):
    """The edges of a COO neighbour list within ``cutoff``.

    Args:
      positions: [V, 3] Å. cell: [S, 3, 3] Å. batch_idx: [V] system of each atom.
      neighbors: the COO neighbour list. cutoff: r_c (Å).

    Returns:
      ``(vec, r, inside)``: ``vec [E, 3]`` Å (sender minus receiver), ``r [E]`` Å (1 on edges
      that are padding or beyond the cutoff: a safe norm, whose gradient is never NaN) and
      ``inside [E]`` bool.
    """
    vec = edge_vectors(positions, cell, batch_idx, neighbors)
    r2 = jnp.sum(vec * vec, axis=-1)
    inside = neighbors.mask & (r2 < cutoff * cutoff)
    return vec, jnp.sqrt(jnp.where(inside, r2, 1.0)), inside


def cast_params(params, dtype):
    """Every array leaf of ``params`` in ``dtype`` (the positions' dtype: the computation follows it)."""
    return jax.tree_util.tree_map(lambda p: p.astype(dtype), params)


def weights_dtype(dtype, owner):
    """``dtype`` as a numpy dtype; ValueError naming ``owner``'s dtype unless it is float32 or float64.

    Args:
      dtype: the dtype asked for (a numpy or jax dtype, a type or its name).
      owner: the model or loader, for the message.

    Returns:
      the numpy dtype.
    """
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    # The weights are cast to it: an integer or bool dtype would truncate them without a word, and
    # a half precision rounds them to 3 significant digits (meV off on a few atoms).
    if dt is None or dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        got = dt.name if dt is not None else repr(dtype)
        raise ValueError(f"{owner} dtype must be float32 or float64, got {got}; the weights are cast to it: an "
                         "integer or bool dtype would truncate them and a half precision would round them")
    return dt
