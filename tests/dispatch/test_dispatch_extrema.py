"""Max and min over atoms or edges under decomposition: ``pmax``/``pmin`` across ranks with a
derivative, so forces through them equal one device.

A model that normalises its edge features by their largest value over the whole system (as
e3x's norms do, inside a custom derivative) or subtracts the smallest atomic energy has a
max or min over rows of every rank. The dispatch masks ghost and pad rows, reduces, and takes
the extremum across ranks; its derivative goes to the entries equal to the answer (ties
shared as ``jnp.max`` shares them), wherever they are. Float64, (2, 2, 2) and (3, 2, 1).
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors
from jaxdd.dispatch import DispatchWarning
from jaxdd.engine import DistributedModel, DomainConfig

CUTOFF = 3.0


@jax.custom_jvp
def normalised(x):
    """x / max(x) over every entry, with a hand-written derivative (as e3x writes its norms)."""
    return x / jnp.max(x)


@normalised.defjvp
def _normalised_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    m = jnp.max(x)
    dm = jax.jvp(jnp.max, (x,), (t,))[1]
    return x / m, t / m - x * dm / m**2


class EnergyModel(BaseModel):
    """Energy and forces (by autograd) from the whole batch."""

    def __init__(self):
        self.model_config = ModelConfig(
            outputs={"energy", "forces"}, autograd_outputs={"forces"}, autograd_inputs={"positions"},
            neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def adapt_input(self, data):
        return dict(data=data)


class ExtremumModel(EnergyModel):
    """Pair terms scaled by the system's longest edge, less the smallest atomic energy."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, data):
        nl = data.neighbors
        v = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.where(nl.mask, jnp.sum(v * v, axis=1), 0.0)
        smooth = jnp.where(nl.mask, (1.0 - r2 / CUTOFF**2) ** 2, 0.0)
        if self.how == "custom":
            scaled = normalised(r2)
        else:
            scaled = r2 / jnp.max(r2)
        pair = jnp.exp(-scaled) * smooth
        atomic = jax.ops.segment_sum(0.5 * pair, nl.receivers, num_segments=data.n_atoms)
        lowest = jnp.min(jnp.where(data.atom_mask, atomic, jnp.inf))
        energy = jnp.sum(jnp.where(data.atom_mask, atomic - 0.1 * lowest, 0.0))
        return {"energy": energy[None]}


def lattice(n=8, spacing=2.0, seed=0):
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return jaxdd.AtomicData(positions=(k + rng.uniform(-0.3, 0.3, k.shape)) * spacing,
                            atomic_numbers=np.ones(len(k), int), cell=np.eye(3) * n * spacing,
                            pbc=np.array([True] * 3))


@pytest.mark.parametrize("grid", [pytest.param((2, 2, 2), marks=pytest.mark.slow), (3, 2, 1)], ids=["2x2x2", "3x2x1"])
@pytest.mark.parametrize("how", ["plain", "custom"])
def test_forces_through_a_max_and_a_min_over_rows_equal_one_device(how, grid):
    data, model = lattice(), ExtremumModel(how)
    ref = jaxdd.compute(model, data)
    dm = DistributedModel(model, DomainConfig(cutoff=CUTOFF, grid=grid))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DispatchWarning)  # nothing guessed, nothing left rank-local
        got = dm(data)
    if how == "custom":  # the dispatch enters the custom derivative, and counts it
        assert dm.dispatch_report.counts["enter.custom_jvp_call"] >= 1
    assert abs(float(got["energy"][0] - ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(ref["forces"]), rtol=0, atol=1e-9)
    assert np.abs(np.asarray(ref["forces"])).max() > 1e-3  # the forces are not trivially zero


class UnfollowedSum(EnergyModel):
    """A per-atom energy summed as the last entry of a running sum over the atom rows (right on
    one device for one system, but a running sum along rows stays rank-local)."""

    def forward(self, data):
        atomic = jnp.where(data.atom_mask, jnp.sum(data.positions**2, axis=1), 0.0)
        return {"energy": jnp.cumsum(atomic)[-1:]}  # the unfollowed line


def test_an_unfollowed_sum_is_refused_naming_the_users_line_in_words():
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# the unfollowed line"))
    dm = DistributedModel(UnfollowedSum(), DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1)))
    with pytest.raises(jaxdd.dispatch.DispatchError) as err:
        dm(lattice())
    message = str(err.value)
    assert "could not follow" in message and f"test_dispatch_extrema.py:{line}" in message
    assert "jaxdd.system_sum" in message and "Layout(" not in message


def test_a_rank_local_energy_allowed_to_run_is_still_refused_in_words():
    # Even with allow_unfollowed=True an energy that differs between ranks cannot be returned.
    line = next(i for i, text in enumerate(open(__file__), 1) if text.rstrip().endswith("# the unfollowed line"))
    dm = DistributedModel(UnfollowedSum(), DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1), allow_unfollowed=True))
    with pytest.raises(jaxdd.dispatch.DispatchError) as err:
        dm(lattice())
    message = str(err.value)
    assert "not the same on every rank" in message and f"test_dispatch_extrema.py:{line}" in message
    assert "Layout(" not in message
