"""The base of element-resolved models that read the framework's neighbour list.

Most machine-learning potentials share one frame: a table of the elements they know, a COO or
MATRIX neighbour list within a cutoff, an energy per atom, and the system's energy as the sum
of its atoms' energies, forces and stress derived by the framework. :class:`SpeciesModel`
writes that frame once; a model states only what differs — its species, its cutoff (in its
:class:`~jaxdd.model.base.ModelConfig`) and :meth:`SpeciesModel.atom_energies`::

    class PairModel(eqx.Module, SpeciesModel):
        params: jax.Array
        species: tuple = eqx.field(static=True)
        model_config: ModelConfig = eqx.field(static=True)

        def __init__(self, species=(1, 8), cutoff=4.0):
            self.species = tuple(species)
            self.model_config = SpeciesModel.energy_config(cutoff)
            self.params = jnp.ones((len(species), len(species)))

        def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
            ...  # [V] eV, from the edges of neighbors
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..spec import SPEC_MPNN_HALO
from .base import BaseModel, ModelConfig, NeighborConfig

__all__ = ["SpeciesModel", "species_table", "validate_species", "neighbor_inputs"]

_ENERGY_OUTPUTS = frozenset({"energy", "atomic_energies", "forces", "stress"})
_DERIVED = frozenset({"forces", "stress"})


def species_table(species) -> np.ndarray:
    """Static table atomic number → species index.

    Args:
      species: the atomic numbers a model knows, in the order of its tables.

    Returns:
      int32 array ``[max(species) + 1]``; unlisted numbers map to 0.
    """
    table = np.zeros(max(species) + 1, np.int32)
    table[list(species)] = np.arange(len(species))
    return table


def validate_species(data, species, owner: str) -> None:
    """Host check that every real atom of a batch is one of ``species``.

    Args:
      data: a concrete Batch.
      species: the atomic numbers the model knows.
      owner: the model, for the message.

    Raises:
      ValueError: naming the atoms and their atomic numbers.
    """
    z = np.asarray(data.atomic_numbers)[np.asarray(data.atom_mask)]
    bad = np.flatnonzero(~np.isin(z, species))
    if bad.size:
        rows = np.flatnonzero(np.asarray(data.atom_mask))[bad]
        raise ValueError(
            f"atoms {rows[:8].tolist()} have atomic numbers {sorted(set(z[bad].tolist()))} that are not in "
            f"{owner} species {species}; build the model with those species"
        )


def neighbor_inputs(data, owner: str) -> dict:
    """The forward arguments of a model that reads the framework's neighbour list.

    Args:
      data: the Batch, its neighbour list attached.
      owner: the model, for the message.

    Returns:
      dict of ``positions [V, 3]`` Å, ``cell [S, 3, 3]`` Å, ``batch_idx [V]``, ``atomic_numbers
      [V]``, ``atom_mask [V]``, ``neighbors`` and ``n_systems`` (static int).

    Raises:
      ValueError: ``data`` has no neighbour list.
    """
    if data.neighbors is None:
        raise ValueError(f"{owner} needs data.neighbors; call it through jaxdd.compute")
    return dict(positions=data.positions, cell=data.cell, batch_idx=data.batch_idx,
                atomic_numbers=data.atomic_numbers, atom_mask=data.atom_mask, neighbors=data.neighbors,
                n_systems=data.n_systems)


class SpeciesModel(BaseModel):
    """Base of a model that knows a table of elements and sums an energy per atom.

    A subclass declares ``species`` (tuple of atomic numbers) and ``model_config`` (usually
    :meth:`energy_config`) and writes :meth:`atom_energies`. The base checks a batch's elements
    (``validate_input``), hands the neighbour-list inputs to ``forward`` (``adapt_input``), masks
    padding atoms, sums per system and declares ``SPEC_MPNN_HALO``; each stays overridable.

    Outputs: ``energy [S]`` (eV), ``atomic_energies [V]`` (eV, zero on padding atoms), and, by
    the framework's autodiff, ``forces [V, 3]`` (eV/Å) and ``stress [S, 3, 3]`` (eV/Å³).
    """

    species: tuple[int, ...]

    @staticmethod
    def energy_config(cutoff: float, **neighbor_options) -> ModelConfig:
        """The config of an energy model: energy and atomic energies, forces and stress derived.

        Args:
          cutoff: interaction range (Å).
          neighbor_options: further :class:`~jaxdd.model.base.NeighborConfig` fields (``format``,
            ``skin``, ``max_neighbors``, ``half_list``).

        Returns:
          the :class:`~jaxdd.model.base.ModelConfig`.
        """
        return ModelConfig(outputs=_ENERGY_OUTPUTS, autograd_outputs=_DERIVED,
                           autograd_inputs=frozenset({"positions", "cell"}),
                           neighbor_config=NeighborConfig(cutoff=cutoff, **neighbor_options))

    @property
    def distribution_spec(self):
        """``SPEC_MPNN_HALO``: halo-corrected scatters, forces and stress by autodiff."""
        return SPEC_MPNN_HALO

    def validate_input(self, data) -> None:
        """Host check that every real atom of ``data`` is one of ``species`` (ValueError otherwise)."""
        validate_species(data, self.species, type(self).__name__)

    def adapt_input(self, data, **kwargs) -> dict:
        """The neighbour-list inputs of ``forward``.

        Args:
          data: the Batch, its neighbour list attached.
          kwargs: keyword arguments of the wrapper's call (unused).

        Returns:
          the dict of :func:`neighbor_inputs`.
        """
        return neighbor_inputs(data, type(self).__name__)

    def species_index(self, atomic_numbers):
        """The row of each atom's element in the model's tables.

        Args:
          atomic_numbers: ``[V]`` int (padding atoms any value).

        Returns:
          ``[V]`` int32 species indices (0 for unknown numbers).
        """
        table = jnp.asarray(species_table(self.species))
        return table[jnp.clip(atomic_numbers, 0, table.size - 1)]

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        """The energy of every atom row, before padding rows are masked.

        Args:
          positions: ``[V, 3]`` Å. cell: ``[S, 3, 3]`` Å (rows lattice vectors).
          batch_idx: ``[V]`` system of each atom. kind: ``[V]`` species index
          (:meth:`species_index`). neighbors: the neighbour list ``model_config`` asked for.

        Returns:
          ``[V]`` atomic energies (eV), in the positions' dtype.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement atom_energies(positions, cell, "
                                  "batch_idx, kind, neighbors) -> [V] eV")

    def forward(self, positions, cell, batch_idx, atomic_numbers, atom_mask, neighbors, n_systems):
        """Energies of the systems and their atoms.

        Args:
          the inputs :meth:`adapt_input` returns.

        Returns:
          dict of ``energy [S]`` and ``atomic_energies [V]`` (eV, zero on padding atoms).
        """
        kind = self.species_index(atomic_numbers)
        atomic = self.atom_energies(positions, cell, batch_idx, kind, neighbors)
        atomic = jnp.where(atom_mask, atomic, 0.0)
        energy = jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)
        return {"energy": energy, "atomic_energies": atomic}
