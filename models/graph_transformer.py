"""A small graph transformer whose message passing is one fused kernel.

Atoms are nodes, the COO neighbour list (cutoff r_c, Å) the directed edges
``sender -> receiver``:

* embedding: ``h_i = E[species_i]`` (``[V, F]``);
* edge weights: ``w_ij = exp(-r²/(2 s²)) (1 - r²/r_c²)²`` with ``s = r_c / 2`` (zero, with
  zero slope, at r_c; zero on padding edges);
* ``n_layers`` attention layers (one head), each::

      q, k, v = tanh(h W_q), tanh(h W_k), h W_v
      m_i = Σ_j u_ij v_j / (1 + Σ_j u_ij),   u_ij = w_ij exp(q_i · k_j / √F)
      h_i ← h_i + tanh(m_i W_o)

  where ``m`` is the fused kernel :func:`jaxdd.ffi.attention_message` (op
  ``"jaxdd_ffi::attention_message"``, backward by its VJP kernel), or its jnp reference;
* readout: ``ε_i = h_i · a + b[species_i]`` (eV), ``E = Σ_i ε_i`` per system.

Forces and stress come from the framework's autodiff, through the kernel's custom VJP.
The kernel is opaque to the dispatch, so the spec declares it: ``OpAdapter(op,
output_transforms={0: ScatterOutputs()})`` (the kernel leaves ghost rows of ``m`` without
their messages; the transform sends partials home and refreshes ghosts before the next
layer reads them). The ``"jnp"`` backend needs no adapter: its scatters are visible.
"""

from __future__ import annotations

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.ffi import attention
from jaxdd.neighbors import edge_vectors
from jaxdd.ops import ScatterOutputs
from jaxdd.spec import SPEC_MPNN_HALO, OpAdapter

from .species import SpeciesNetwork, cast_params

__all__ = ["GraphTransformer", "SPEC_GRAPH_TRANSFORMER_HALO", "BACKENDS"]

BACKENDS = ("ffi", "jnp")

#: The message-passing preset with the fused kernel declared.
SPEC_GRAPH_TRANSFORMER_HALO = SPEC_MPNN_HALO.with_custom_ops(
    OpAdapter("jaxdd_ffi::attention_message", output_transforms={0: ScatterOutputs()})
)


class GraphTransformer(SpeciesNetwork):
    """Graph transformer: energy, atomic energies, and (autograd) forces and stress.

    species: atomic numbers the model knows. cutoff: r_c (Å). features: F. n_layers:
    attention layers. backend: ``"ffi"`` (the compiled kernel) or ``"jnp"`` (its
    reference; no compiled library needed). seed: parameters drawn in float32 from
    ``numpy.random.default_rng(seed)`` (the same model in any precision).
    """

    features: int = eqx.field(static=True)
    n_layers: int = eqx.field(static=True)
    backend: str = eqx.field(static=True)

    def __init__(self, species=(1, 6, 8), cutoff: float = 4.0, *, features: int = 8, n_layers: int = 2,
                 backend: str = "ffi", seed: int = 0):
        super().__init__(species, cutoff)
        owner = "GraphTransformer"
        if backend not in BACKENDS:
            raise ValueError(f"{owner} backend must be one of {list(BACKENDS)}, got {backend!r}")
        self.features = integral(f"{owner} features", features, minimum=1)
        self.n_layers = integral(f"{owner} n_layers", n_layers, minimum=1)
        self.backend = backend
        rng = np.random.default_rng(seed)
        f, k = self.features, len(self.species)

        def draw(*shape, scale=1.0):
            return jnp.asarray((scale * rng.standard_normal(shape)).astype(np.float32).astype(np.float64))

        self.params = {
            "embedding": draw(k, f),
            "layers": [{name: draw(f, f, scale=f ** -0.5) for name in ("wq", "wk", "wv", "wo")}
                       for _ in range(self.n_layers)],
            "readout": draw(f, scale=f ** -0.5),
            "bias": draw(k, scale=0.1),
        }

    @property
    def distribution_spec(self):
        return SPEC_GRAPH_TRANSFORMER_HALO if self.backend == "ffi" else SPEC_MPNN_HALO

    def _message(self, q, k, v, w, senders, receivers):
        if self.backend == "ffi":
            return attention.attention_message(q, k, v, w, senders, receivers)
        return attention.attention_message_reference(q, k, v, w, senders, receivers)

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        rc = self.cutoff
        p = cast_params(self.params, dt)

        vec = edge_vectors(positions, cell, batch_idx, neighbors)
        r2 = jnp.sum(vec * vec, axis=-1)
        inside = neighbors.mask & (r2 < rc * rc)
        r2 = jnp.where(inside, r2, 0.0)
        w = jnp.where(inside, jnp.exp(-2.0 * r2 / (rc * rc)) * (1.0 - r2 / (rc * rc)) ** 2, 0.0)

        h = p["embedding"][kind]
        for layer in p["layers"]:
            q, k, v = jnp.tanh(h @ layer["wq"]), jnp.tanh(h @ layer["wk"]), h @ layer["wv"]
            m = self._message(q, k, v, w, neighbors.senders, neighbors.receivers)
            h = h + jnp.tanh(m @ layer["wo"])
        return h @ p["readout"] + p["bias"][kind]
