"""Specification of jaxdd.model.species: SpeciesModel, the base of element-resolved models,
and the helpers it is built on. No program is compiled here (the zoo's models, each on the
base, are run in tests/models)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd.model.species import SpeciesModel, neighbor_inputs, species_table, validate_species
from jaxdd.neighbors import NeighborListFormat
from jaxdd.spec import SPEC_MPNN_HALO


class Constant(SpeciesModel):
    """One energy per element: the smallest model on the base."""

    def __init__(self, species=(1, 8), cutoff=3.0):
        self.species = tuple(species)
        self.model_config = SpeciesModel.energy_config(cutoff)
        self.e0 = jnp.asarray([-1.0, -2.0][: len(species)])

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        return self.e0[kind].astype(positions.dtype)


def water():
    import ase.build

    return jaxdd.as_batch(jaxdd.AtomicData.from_ase(ase.build.molecule("H2O")))


def test_the_energy_config_derives_forces_and_stress_and_passes_the_neighbour_options():
    cfg = SpeciesModel.energy_config(4.0, format=NeighborListFormat.MATRIX, max_neighbors=12, skin=0.5)
    assert cfg.outputs == {"energy", "atomic_energies", "forces", "stress"}
    assert cfg.autograd_outputs == {"forces", "stress"} and cfg.autograd_inputs == {"positions", "cell"}
    nc = cfg.neighbor_config
    assert (nc.cutoff, nc.format, nc.max_neighbors, nc.skin) == (4.0, NeighborListFormat.MATRIX, 12, 0.5)


def test_the_species_table_maps_atomic_numbers_to_rows():
    assert species_table((8, 1)).tolist() == [0, 1, 0, 0, 0, 0, 0, 0, 0]
    model = Constant((8, 1))
    assert model.species_index(jnp.asarray([1, 8, 8, 0, 99])).tolist() == [1, 0, 0, 0, 0]


def test_the_base_declares_the_message_passing_spec():
    assert Constant().distribution_spec is SPEC_MPNN_HALO


def test_an_unknown_element_is_refused_naming_the_atom_and_the_model():
    with pytest.raises(ValueError, match=r"atoms \[0\] have atomic numbers \[8\] that are not in Constant species"):
        Constant(species=(1,)).validate_input(water())
    validate_species(water(), (1, 8), "Constant")


def test_a_batch_without_neighbours_is_refused():
    with pytest.raises(ValueError, match="Constant needs data.neighbors"):
        neighbor_inputs(water(), "Constant")


def test_forward_masks_padding_atoms_and_sums_per_system():
    model = Constant()
    batch = water()
    out = model.forward(positions=batch.positions, cell=batch.cell, batch_idx=jnp.asarray([0, 0, 1]),
                        atomic_numbers=batch.atomic_numbers, atom_mask=jnp.asarray([True, True, False]),
                        neighbors=None, n_systems=2)
    np.testing.assert_allclose(out["atomic_energies"], [-2.0, -1.0, 0.0])
    np.testing.assert_allclose(out["energy"], [-3.0, 0.0])


def test_a_subclass_without_atom_energies_says_what_to_write():
    class Nothing(SpeciesModel):
        species = (1,)

    with pytest.raises(NotImplementedError, match="Nothing must implement atom_energies"):
        Nothing().atom_energies(None, None, None, None, None)
