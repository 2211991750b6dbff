"""Specification: community models written for one device run distributed unchanged.

Two models as their libraries' users write them, each wrapped as a jaxdd ``BaseModel`` that
only hands it jaxdd's neighbour list:

- ``E3xEnergy``: an equivariant message-passing network from e3x's own layers (``Embed``,
  ``MessagePass``, ``Tensor``, ``Dense``; ``e3x.nn.basis`` with a smooth cutoff), taking atomic
  numbers, displacements and separate ``dst_idx``/``src_idx`` arrays the way e3x's examples do.
  Its normalisation (``e3x.ops.norm`` scales by the largest |x| over every edge, inside a custom
  derivative) is left in.
- ``StackedIndexMPNN``: a plain flax model that stacks its pair indices into one ``[2, n_edges]``
  array (``jnp.stack([idx_i, idx_j])``) and gathers and scatters through its rows.

Under the default spec on grids (2, 2, 2) and (3, 2, 1) of 8 devices, each equals
``jaxdd.compute`` (float64: energy to 1e-10 relative, forces and stress to 1e-9 eV/Å and
eV/Å³), and the dispatch neither guesses nor leaves anything rank-local. e3x's norm is a
``custom_jvp`` holding a max of |x| over every edge: the dispatch enters it for the max across
ranks and keeps its rule (which keeps zero-length padding pairs finite).
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import e3x
import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdd
from jaxdd import BaseModel, ModelConfig, NeighborConfig, edge_vectors
from jaxdd.dispatch import DispatchWarning
from jaxdd.engine import DistributedModel, DomainConfig

# A 10 Å cell on 8 ranks: every rank's ghost shell reaches round the cell (said by a RuntimeWarning).
pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF = 3.0  # Å
SPECIES = (1, 6, 8)
N_EMBEDDINGS = max(SPECIES) + 1  # rows indexed by atomic number, as e3x's examples do
GRIDS = [(2, 2, 2), (3, 2, 1)]


# ----------------------------------------------------------------------------- the models


class E3xEnergy(nn.Module):
    """Atomic energies (eV) of an e3x message-passing network; float64 parameters."""

    features: int = 8
    max_degree: int = 1
    num_basis: int = 6
    num_layers: int = 2

    @nn.compact
    def __call__(self, atomic_numbers, displacements, dst_idx, src_idx):
        """atomic_numbers [N]; displacements [P, 3] (Å), r_src - r_dst; dst_idx, src_idx [P]
        (a pair with dst_idx >= N is padding, dropped by e3x's segment sums). Returns [N] (eV)."""
        f64 = dict(param_dtype=jnp.float64)
        n = atomic_numbers.shape[0]
        pairs = dict(dst_idx=dst_idx, src_idx=src_idx, num_segments=n)
        basis = e3x.nn.basis(displacements, num=self.num_basis, max_degree=self.max_degree,
                             radial_fn=e3x.nn.reciprocal_bernstein,
                             cutoff_fn=functools.partial(e3x.nn.smooth_cutoff, cutoff=CUTOFF))
        x = e3x.nn.Embed(num_embeddings=N_EMBEDDINGS, features=self.features, **f64)(atomic_numbers)
        for _ in range(self.num_layers):
            x = e3x.nn.add(x, e3x.nn.MessagePass(include_pseudotensors=False, **f64)(x, basis, **pairs))
            x = e3x.nn.add(x, e3x.nn.Dense(self.features, **f64)(e3x.nn.silu(e3x.nn.Dense(self.features, **f64)(x))))
        x = e3x.nn.add(x, e3x.nn.Dense(self.features, **f64)(e3x.nn.Tensor(include_pseudotensors=False, **f64)(x, x)))
        scalars = e3x.nn.change_max_degree_or_type(x, max_degree=0, include_pseudotensors=False)
        hidden = e3x.nn.silu(e3x.nn.Dense(self.features, **f64)(scalars))
        atomic = jnp.squeeze(nn.Dense(1, use_bias=False, **f64)(hidden), axis=(-1, -2, -3))
        element_bias = self.param("element_bias", nn.initializers.normal(0.1), (N_EMBEDDINGS,), jnp.float64)
        return atomic + element_bias[atomic_numbers]


class StackedIndexMPNN(nn.Module):
    """Atomic energies (eV) of a flax message-passing network over one ``[2, n_edges]`` index array."""

    features: int = 16
    n_layers: int = 2
    n_rbf: int = 8

    @nn.compact
    def __call__(self, atomic_numbers, vectors, idx_i, idx_j, edge_mask):
        """atomic_numbers [N]; vectors [E, 3] (Å), r_j - r_i; idx_i [E] the atoms messages go
        to, idx_j [E] the atoms they come from; edge_mask [E]. Returns [N] (eV)."""
        dense = functools.partial(nn.Dense, param_dtype=jnp.float64)
        edge_index = jnp.stack([idx_i, idx_j])  # [2, E]: row 0 receives, row 1 sends
        r = jnp.sqrt(jnp.where(edge_mask, jnp.sum(vectors * vectors, axis=-1), 1.0))
        envelope = jnp.where(edge_mask & (r < CUTOFF), 0.5 * (jnp.cos(jnp.pi * r / CUTOFF) + 1.0), 0.0)
        centers = jnp.linspace(0.0, CUTOFF, self.n_rbf)
        rbf = jnp.exp(-((r[:, None] - centers) ** 2) / (CUTOFF / self.n_rbf) ** 2)
        h = nn.Embed(N_EMBEDDINGS, self.features, param_dtype=jnp.float64)(atomic_numbers)
        for _ in range(self.n_layers):
            messages = nn.silu(dense(self.features)(h))[edge_index[1]] * dense(self.features)(rbf) * envelope[:, None]
            aggregated = jnp.zeros_like(h).at[edge_index[0]].add(messages)
            h = h + dense(self.features)(nn.silu(aggregated))
        return dense(1)(nn.silu(dense(self.features)(h)))[:, 0]


class CommunityModel(eqx.Module, BaseModel):
    """A flax module's atomic energies summed per system; forces and stress by autograd.

    ``pairs`` hands the module jaxdd's neighbour list the way it wants it: ``"e3x"`` as
    displacements, ``dst_idx`` (receivers) and ``src_idx`` (senders); ``"stacked"`` as vectors,
    ``idx_i`` (receivers), ``idx_j`` (senders) and the edge mask.
    """

    params: Any
    net: nn.Module = eqx.field(static=True)
    pairs: str = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, net: nn.Module, pairs: str, seed: int = 0):
        self.net, self.pairs = net, pairs
        # One compiled init: flax's init op by op compiles a small program per operation.
        self.params = jax.jit(net.init)(jax.random.PRNGKey(seed), *self._dummy_inputs())
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "forces", "stress"}), autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}), neighbor_config=NeighborConfig(cutoff=CUTOFF))

    def _dummy_inputs(self):
        """Inputs of the module's call on a two-atom, two-pair graph (parameter shapes only)."""
        z, v, idx = jnp.array([1, 6]), jnp.array([[1.0, 0.0, 0.0], [-1.0, 0.0, 0.0]]), jnp.array([0, 1])
        return (z, v, idx, idx[::-1]) if self.pairs == "e3x" else (z, v, idx, idx[::-1], jnp.ones(2, bool))

    def adapt_input(self, data):
        return dict(data=data)

    def forward(self, data):
        nl = data.neighbors
        vectors = edge_vectors(data.positions, data.cell, data.batch_idx, nl)  # sender - receiver, Å
        if self.pairs == "e3x":
            # e3x has no pair mask for sparse lists: padding pairs point past the last atom.
            dst_idx = jnp.where(nl.mask, nl.receivers, data.n_atoms)
            atomic = self.net.apply(self.params, data.atomic_numbers, vectors, dst_idx, nl.senders)
        else:
            atomic = self.net.apply(self.params, data.atomic_numbers, vectors, nl.receivers, nl.senders, nl.mask)
        atomic = jnp.where(data.atom_mask, atomic, 0.0)
        return {"energy": jax.ops.segment_sum(atomic, data.batch_idx, num_segments=data.n_systems)}


MODELS = {"e3x": lambda: CommunityModel(E3xEnergy(), "e3x"),
          "stacked_index_flax": lambda: CommunityModel(StackedIndexMPNN(), "stacked")}


def periodic_system(n: int = 5, spacing: float = 2.0, seed: int = 0) -> jaxdd.AtomicData:
    """n³ atoms (H, C, O at random) on a jittered simple-cubic lattice in a periodic cube of side n·spacing Å."""
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    return jaxdd.AtomicData(positions=(k + rng.uniform(-0.2, 0.2, k.shape)) * spacing,
                            atomic_numbers=np.asarray(SPECIES)[rng.integers(0, len(SPECIES), len(k))],
                            cell=np.eye(3) * n * spacing, pbc=np.array([True] * 3))


SYSTEM = periodic_system()


# ----------------------------------------------------------------------------- runs (one per model and grid)


@functools.lru_cache(maxsize=None)
def one_device(name: str):
    return jaxdd.compute(MODELS[name](), SYSTEM)


@functools.lru_cache(maxsize=None)
def distributed(name: str, grid: tuple[int, int, int]):
    """(outputs, dispatch report, DispatchWarnings issued) of the default-spec run on ``grid``."""
    dist = DistributedModel(MODELS[name](), DomainConfig(cutoff=CUTOFF, grid=grid))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DispatchWarning)
        out = dist(SYSTEM)
    return out, dist.dispatch_report, [w for w in caught if issubclass(w.category, DispatchWarning)]


def grid_id(grid):
    return "x".join(map(str, grid))


# ----------------------------------------------------------------------------- specification


WITH_DERIVATIVES = ["e3x", "stacked_index_flax"]
# Each model on one grid in the default suite, on the other in the slow sweep.
DEFAULT_GRID = {"e3x": (2, 2, 2), "stacked_index_flax": (3, 2, 1)}


def cases(names):
    return [pytest.param(name, grid, id=f"{name}-{grid_id(grid)}",
                         marks=() if DEFAULT_GRID.get(name) == grid else pytest.mark.slow)
            for name in names for grid in GRIDS]


@pytest.mark.parametrize("name, grid", cases(MODELS))
def test_energy_equals_one_device(name, grid):
    ref, (got, _, _) = one_device(name), distributed(name, grid)
    e = float(ref["energy"][0])
    assert abs(float(got["energy"][0]) - e) <= 1e-10 * abs(e)


@pytest.mark.parametrize("name, grid", cases(WITH_DERIVATIVES))
def test_forces_equal_one_device(name, grid):
    ref, (got, _, _) = one_device(name), distributed(name, grid)
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(ref["forces"]), rtol=0, atol=1e-9)
    assert np.abs(np.asarray(ref["forces"])).max() > 1e-3  # the forces are not trivially zero


@pytest.mark.parametrize("name, grid", cases(WITH_DERIVATIVES))
def test_stress_equals_one_device(name, grid):
    ref, (got, _, _) = one_device(name), distributed(name, grid)
    assert np.isfinite(np.asarray(ref["stress"])).all()
    np.testing.assert_allclose(np.asarray(got["stress"]), np.asarray(ref["stress"]), rtol=0, atol=1e-9)


@pytest.mark.parametrize("name, grid", cases(MODELS))
def test_nothing_is_guessed_or_left_rank_local(name, grid):
    _, report, dispatch_warnings = distributed(name, grid)
    assert report.fallbacks == []
    assert dispatch_warnings == []


@pytest.mark.parametrize("name, grid", cases(["e3x"]))
def test_e3x_normalisation_over_every_edge_is_a_max_across_ranks(name, grid):
    _, report, _ = distributed("e3x", grid)
    assert report.counts["reduce.max"] >= 1  # e3x.ops.norm's largest |x| over all edges: a pmax
    assert report.counts["scatter_add.owned_rows"] == E3xEnergy.num_layers  # one per message pass


@pytest.mark.parametrize("name, grid", cases(["stacked_index_flax"]))
def test_stacked_index_rows_scatter_onto_atoms_with_a_halo_exchange(name, grid):
    _, report, _ = distributed("stacked_index_flax", grid)
    assert report.counts["scatter_add.owned_rows"] == StackedIndexMPNN.n_layers
