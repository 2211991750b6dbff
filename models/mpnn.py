"""SchNet: continuous-filter convolutions on a ``jraph`` graph.

Architecture (Schütt et al., J. Chem. Phys. 148, 241722 (2018)), with atoms as nodes and
the COO neighbour list (cutoff r_c, Å) as directed edges ``sender -> receiver``:

* embedding: ``h_i = E[species_i]`` (``[V, features]``), the nodes of the graph;
* edges: ``n_rbf`` Gaussians of the distance on ``[0, r_c]``, times the cosine cutoff
  ``f_c(r) = 0.5 (cos(π r / r_c) + 1)`` (zero, with zero slope, at r_c; zero on padding
  edges);
* ``n_interactions`` interaction blocks, each a continuous-filter convolution::

      W_ij = Dense(ssp(Dense(rbf_ij))) * f_c(r_ij)            filter network
      m_i  = Σ_j W_ij ⊙ Dense(h_j) / avg_num_neighbors     jraph.segment_sum over receivers
      h_i ← h_i + Dense(ssp(Dense(m_i)))

  with the shifted softplus ``ssp(x) = ln(1 + eˣ) - ln 2``;
* readout: ``ε_i = Dense(ssp(Dense(h_i)))`` (eV), and ``E = Σ_i ε_i`` per system.

The layers are ``flax.linen`` modules (the embedding a plain array); the graph is a ``jraph.GraphsTuple`` built inside
the forward pass.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import jraph
import numpy as np

from jaxdd.data.checks import integral

from .species import SpeciesNetwork, cast_params, check_positive, edge_lengths

__all__ = ["SchNet"]


def shifted_softplus(x):
    """ln(1 + eˣ) - ln 2: softplus through the origin."""
    return jax.nn.softplus(x) - math.log(2.0)


class _Interaction(nn.Module):
    """One continuous-filter convolution and atom-wise update on a GraphsTuple."""

    features: int
    avg_num_neighbors: float
    dtype: object

    @nn.compact
    def __call__(self, graph: jraph.GraphsTuple) -> jraph.GraphsTuple:
        def dense(width, name):
            return nn.Dense(width, dtype=self.dtype, param_dtype=self.dtype, name=name)

        h = graph.nodes
        rbf, envelope = graph.edges["rbf"], graph.edges["envelope"]
        w = dense(self.features, "filter_out")(shifted_softplus(dense(self.features, "filter_in")(rbf)))
        w = w * envelope[:, None]  # zero at the cutoff and on padding edges
        x = dense(self.features, "in2f")(h)
        messages = x[graph.senders] * w  # padding senders (index V) are clamped, then zeroed by w
        m = jraph.segment_sum(messages, graph.receivers, num_segments=h.shape[0]) / self.avg_num_neighbors
        v = dense(self.features, "f2out_2")(shifted_softplus(dense(self.features, "f2out_1")(m)))
        return graph._replace(nodes=h + v)


class _SchNetNet(nn.Module):
    """GraphsTuple (nodes: embedded atoms [V, features]) -> atomic energies [V]."""

    features: int
    n_interactions: int
    avg_num_neighbors: float
    dtype: object

    @nn.compact
    def __call__(self, graph: jraph.GraphsTuple):
        for i in range(self.n_interactions):
            graph = _Interaction(self.features, self.avg_num_neighbors, self.dtype, name=f"interaction_{i}")(graph)
        x = shifted_softplus(nn.Dense(self.features // 2, dtype=self.dtype, param_dtype=self.dtype,
                                      name="readout_1")(graph.nodes))
        return nn.Dense(1, dtype=self.dtype, param_dtype=self.dtype, name="readout_2")(x)[:, 0]


@functools.partial(jax.jit, static_argnums=0)
def _init(net, key, graph):
    return net.init(key, graph)


def _gaussians(r, n, cutoff):
    """[E] -> [E, n] Gaussians centred on an even grid over [0, cutoff], width = spacing."""
    centers = jnp.linspace(0.0, cutoff, n, dtype=r.dtype)
    width = cutoff / (n - 1)
    return jnp.exp(-0.5 * ((r[:, None] - centers) / width) ** 2)


class SchNet(SpeciesNetwork):
    """SchNet message passing: energy, atomic energies, forces and stress.

    species: atomic numbers the model knows (rows of the embedding). cutoff: r_c (Å).
    features: width of the atom features and filters. n_rbf: Gaussians of the distance.
    n_interactions: interaction blocks. avg_num_neighbors: divides the aggregated
    messages. seed: parameters from ``jax.random.PRNGKey(seed)``. dtype: parameter dtype;
    the computation follows the positions' dtype.

    Outputs: ``energy [S]`` (eV), ``atomic_energies [V]`` (eV, zero on padding atoms), and,
    from the framework's autodiff, ``forces [V, 3]`` (eV/Å) and ``stress [S, 3, 3]`` (eV/Å³).
    """

    features: int = eqx.field(static=True)
    n_rbf: int = eqx.field(static=True)
    n_interactions: int = eqx.field(static=True)
    avg_num_neighbors: float = eqx.field(static=True)

    def __init__(self, species=(1, 6, 7, 8), cutoff: float = 5.0, *, features: int = 32, n_rbf: int = 16,
                 n_interactions: int = 3, avg_num_neighbors: float = 30.0, seed: int = 0, dtype=jnp.float64):
        super().__init__(species, cutoff)
        owner = "SchNet"
        self.features = integral(f"{owner} features", features, minimum=2)
        self.n_rbf = integral(f"{owner} n_rbf", n_rbf, minimum=2)
        self.n_interactions = integral(f"{owner} n_interactions", n_interactions, minimum=1)
        self.avg_num_neighbors = check_positive(avg_num_neighbors, "avg_num_neighbors", owner)
        # Parameter shapes do not depend on the graph: a one-edge graph initialises them.
        k_embed, k_net = jax.random.split(jax.random.PRNGKey(seed))
        index = jnp.zeros((1,), jnp.int32)
        graph = jraph.GraphsTuple(
            nodes=jnp.zeros((1, self.features), dtype),
            edges={"rbf": jnp.zeros((1, self.n_rbf), dtype), "envelope": jnp.zeros((1,), dtype)},
            senders=index, receivers=index, globals=None, n_node=jnp.array([1]), n_edge=jnp.array([1]))
        self.params = {
            "embedding": jax.random.normal(k_embed, (len(self.species), self.features), dtype),
            "net": _init(self._net(dtype), k_net, graph),
        }

    def _net(self, dtype):
        return _SchNetNet(self.features, self.n_interactions, self.avg_num_neighbors, dtype)

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        n = positions.shape[0]
        rc = self.cutoff

        vec, r, inside = edge_lengths(positions, cell, batch_idx, neighbors, rc)
        envelope = jnp.where(inside, 0.5 * (jnp.cos(jnp.pi * r / rc) + 1.0), 0.0)
        params = cast_params(self.params, dt)
        graph = jraph.GraphsTuple(
            nodes=params["embedding"][kind],  # [V, features]
            edges={"rbf": _gaussians(r, self.n_rbf, rc), "envelope": envelope},
            senders=neighbors.senders,
            receivers=neighbors.receivers,
            globals=None,
            n_node=np.asarray([n]),
            n_edge=np.asarray([neighbors.senders.shape[0]]),
        )
        return self._net(dt).apply(params["net"], graph)
