"""Specification: edge indices built with ``jnp.stack`` (a primitive of its own in JAX) or with
``jnp.concatenate`` of expanded index arrays keep what they point at, so a model that stacks
its senders and receivers, as rows or as columns, runs distributed and equals one device.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import AtomicData, BaseModel, ModelConfig, NeighborConfig
from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
from jaxdd.data.segments import per_system_sum
from jaxdd.data.systems import fcc_lattice
from plain_helpers import density_energies

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 5.0


class StackedPairs(eqx.Module, BaseModel):
    """Two message-passing steps over edge indices stacked as rows (axis 0) or columns (axis -1),
    with ``jnp.stack`` or (``concatenate=True``) ``jnp.concatenate`` of ``i[None]`` / ``i[:, None]``."""

    axis: int = eqx.field(static=True)
    concatenate: bool = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, axis: int, concatenate: bool = False):
        self.axis = axis
        self.concatenate = concatenate
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "forces"}), autograd_outputs=frozenset({"forces"}),
            autograd_inputs=frozenset({"positions"}), neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data, **kwargs):
        return dict(positions=data.positions, cell=data.cell, batch_idx=data.batch_idx, neighbors=data.neighbors,
                    n_systems=data.n_systems)

    def forward(self, positions, cell, batch_idx, neighbors, n_systems):
        if self.concatenate:
            pairs = jnp.concatenate([jnp.expand_dims(neighbors.senders, self.axis),
                                     jnp.expand_dims(neighbors.receivers, self.axis)], axis=self.axis)
        else:
            pairs = jnp.stack([neighbors.senders, neighbors.receivers], axis=self.axis)
        senders, receivers = (pairs[0], pairs[1]) if self.axis == 0 else (pairs[:, 0], pairs[:, 1])
        atomic = density_energies(positions, senders, receivers, neighbors.shifts @ cell[0], neighbors.mask, CUTOFF)
        return {"energy": per_system_sum(atomic, batch_idx, n_systems)}


def bulk() -> AtomicData:
    atoms = fcc_lattice(3, 4.1)
    rng = np.random.default_rng(3)
    return AtomicData(atoms.positions + rng.normal(0, 0.1, atoms.positions.shape), np.full(len(atoms), 6),
                      np.asarray(atoms.cell), True)


# Each axis and each construction once in the default suite (rows-stack, columns-concatenate);
# the other two pairs in the slow set.
@pytest.mark.parametrize("axis, concatenate", [
    pytest.param(0, False, id="rows-stack"), pytest.param(-1, True, id="columns-concatenate"),
    pytest.param(-1, False, id="columns-stack", marks=pytest.mark.slow),
    pytest.param(0, True, id="rows-concatenate", marks=pytest.mark.slow)])
def test_stacked_edge_indices_distribute_exactly(axis, concatenate):
    model, data = StackedPairs(axis, concatenate), bulk()
    want = jaxdd.compute(model, data, ("energy", "forces"))
    dm = DistributedModel(model, DomainConfig(cutoff=CUTOFF, mesh=default_mesh(jax.devices()[:8]), grid=(2, 2, 2)))
    got = dm(data, ("energy", "forces"))
    assert abs(float(got["energy"][0]) - float(want["energy"][0])) <= 1e-10 * abs(float(want["energy"][0]))
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(want["forces"]), rtol=0, atol=1e-9)
    assert dm.dispatch_report.fallbacks == []  # every layout known from provenance, none guessed
    # Both sums are onto the receivers, found in the stack: owners' sums copied to their ghosts.
    assert dm.dispatch_report.counts["scatter_add.owned_rows"] == 2
