"""The zoo's species-aware pair model (``jaxdd.models.species_pair``), the model of
``docs/adding_a_model.md``: it refuses elements it does not know, and it distributes on four
ranks with its own spec, no fix applied (float64, 64 atoms)."""

from __future__ import annotations

import numpy as np
import pytest

import jaxdd
from jaxdd.models.species_pair import SpeciesPair
from jaxdd.validate import trace_and_validate

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


def sample():
    """64 H and O atoms on a rattled simple-cubic lattice of spacing 2 Å, periodic, 8 Å cell."""
    import ase

    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(*[np.arange(4)] * 3, indexing="ij"), -1).reshape(-1, 3) * 2.0
    atoms = ase.Atoms(numbers=rng.choice([1, 8], len(grid)), positions=grid + rng.normal(0, 0.1, grid.shape),
                      cell=np.eye(3) * 8.0, pbc=True)
    return jaxdd.AtomicData.from_ase(atoms)


def make_model():
    return SpeciesPair((1, 8), cutoff=3.0)


def test_an_element_the_model_does_not_know_is_refused_naming_the_model():
    batch = jaxdd.as_batch(sample())
    numbers = np.asarray(batch.atomic_numbers).copy()
    numbers[3] = 6
    carbon = batch.replace(atomic_numbers=numbers)
    with pytest.raises(ValueError, match=r"atoms \[3\].*SpeciesPair species"):
        make_model().validate_input(carbon)


def test_it_passes_the_validator_at_world_size_4_with_no_fix():
    report = trace_and_validate(make_model, sample(), world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None
