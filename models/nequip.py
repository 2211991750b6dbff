"""NequIP: an E(3)-equivariant message-passing potential written with e3nn-jax.

Architecture (after Batzner et al., Nat. Commun. 13, 2453 (2022)), with atoms as nodes and
the COO neighbour list (cutoff r_c, Å) as directed edges ``sender -> receiver``:

* embedding: ``h_i = E[species_i]``, scalars ``n_0e x 0e`` (n_0e: the scalars of the
  hidden irreps);
* edges: spherical harmonics ``Y(r̂_ij)`` of l = 0, 1, 2 ("component" normalisation), and
  ``n_basis`` Bessel functions of the distance times the polynomial envelope
  ``u(r / r_c)`` of degree ``envelope_p`` (zero, with zero first and second derivatives,
  at r_c; zero on padding edges);
* ``n_layers`` interaction layers::

      m_ij = R(r_ij) ⊙ (h_j ⊗ Y(r̂_ij))                 one radial weight per path and channel
      a_i  = Σ_j m_ij / sqrt(avg_num_neighbors)       e3nn.scatter_sum over receivers
      h_i ← Gate(Linear(a_i) + Linear_self(h_i))      (+ h_i when the irreps agree)

  where ``⊗`` is the full tensor product filtered to the irreps of the hidden features,
  ``R`` a radial MLP (``[n_basis, radial_hidden, n_paths]``, silu), the linears mix channels
  of equal irreps (e3nn ``FunctionalLinear``), and the gate acts on scalars with silu and
  multiplies each non-scalar irrep by a sigmoid gate scalar;
* readout: an MLP of the scalars of the last layer gives the atomic energy (eV); the energy
  of a system is the sum of its atomic energies.

The energy is invariant under rotations, reflections and translations; forces are
equivariant. Parameters are plain arrays drawn from ``jax.random.PRNGKey(seed)``.
"""

from __future__ import annotations

import math

import e3nn_jax as e3nn
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral

from .species import SpeciesNetwork, cast_params, check_positive, edge_lengths

__all__ = ["NequIP", "polynomial_envelope"]

_SH_IRREPS = e3nn.Irreps.spherical_harmonics(2)


class _Normals:
    """Standard normal draws of any shapes, cut in order from one vector drawn from ``key``."""

    def __init__(self, key, total, dtype):
        self._values = np.asarray(jax.random.normal(key, (total,), dtype))
        self._cursor = 0

    def __call__(self, shape):
        size = math.prod(shape)
        out = self._values[self._cursor:self._cursor + size].reshape(shape)
        self._cursor += size
        return out


def _mlp_sizes(sizes):
    return [(a, b) for a, b in zip(sizes[:-1], sizes[1:])]


def _mlp_init(normal, sizes):
    return [{"w": normal((a, b)) / math.sqrt(a), "b": np.zeros((b,))} for a, b in _mlp_sizes(sizes)]


def _mlp(layers, x):
    """Dense layers with silu between them (none after the last)."""
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"]
        if i < len(layers) - 1:
            x = jax.nn.silu(x)
    return x


def polynomial_envelope(x, p: int):
    """u_p(x) = 1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2): 1 at x = 0; value, first and
    second derivatives zero at x = 1 (DimeNet's envelope)."""
    return 1.0 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)


def _linear_init(normal, linear):
    return [ins.weight_std * normal(ins.path_shape) for ins in linear.instructions]


class NequIP(SpeciesNetwork):
    """NequIP-style equivariant potential: energy, atomic energies, forces and stress.

    species: atomic numbers the model knows (rows of the embedding). cutoff: r_c (Å).
    hidden_irreps: irreps of the atom features after each layer (must hold scalars ``0e``).
    n_layers: interaction layers (>= 1). n_basis: Bessel functions. envelope_p: degree
    parameter of the polynomial envelope. radial_hidden: width of the radial MLP.
    readout_hidden: width of the readout MLP. avg_num_neighbors: normalises the
    aggregated messages. seed: parameters from ``jax.random.PRNGKey(seed)``. dtype:
    parameter dtype; the computation follows the positions' dtype.

    Outputs: ``energy [S]`` (eV), ``atomic_energies [V]`` (eV, zero on padding atoms), and,
    from the framework's autodiff, ``forces [V, 3]`` (eV/Å) and ``stress [S, 3, 3]`` (eV/Å³).
    """

    hidden_irreps: str = eqx.field(static=True)
    n_layers: int = eqx.field(static=True)
    n_basis: int = eqx.field(static=True)
    envelope_p: int = eqx.field(static=True)
    avg_num_neighbors: float = eqx.field(static=True)

    def __init__(self, species=(1, 6, 7, 8), cutoff: float = 5.0, *, hidden_irreps="16x0e + 8x1o + 4x2e",
                 n_layers: int = 3, n_basis: int = 8, envelope_p: int = 6, radial_hidden: int = 32,
                 readout_hidden: int = 16, avg_num_neighbors: float = 30.0, seed: int = 0, dtype=jnp.float64):
        super().__init__(species, cutoff)
        owner = "NequIP"
        hidden = e3nn.Irreps(hidden_irreps).simplify()
        if hidden.count("0e") < 1:
            raise ValueError(f"{owner} hidden_irreps must contain scalars 0e, got {hidden}")
        self.hidden_irreps = str(hidden)
        self.n_layers = integral(f"{owner} n_layers", n_layers, minimum=1)
        self.n_basis = integral(f"{owner} n_basis", n_basis, minimum=1)
        self.envelope_p = integral(f"{owner} envelope_p", envelope_p, minimum=2)
        radial_hidden = integral(f"{owner} radial_hidden", radial_hidden, minimum=1)
        readout_hidden = integral(f"{owner} readout_hidden", readout_hidden, minimum=1)
        self.avg_num_neighbors = check_positive(avg_num_neighbors, "avg_num_neighbors", owner)

        n_scalars = hidden.count("0e")
        layers = [
            ([self.n_basis, int(radial_hidden), irreps_tp.num_irreps],
             e3nn.FunctionalLinear(irreps_tp, gate_in), e3nn.FunctionalLinear(irreps_in, gate_in))
            for irreps_in, irreps_tp, gate_in in self._layer_irreps()
        ]

        def build(normal):
            return {
                "embed": normal((len(self.species), n_scalars)),
                "layers": [
                    {"radial": _mlp_init(normal, radial), "linear": _linear_init(normal, linear),
                     "self": _linear_init(normal, self_linear)}
                    for radial, linear, self_linear in layers
                ],
                "readout": _mlp_init(normal, [n_scalars, int(readout_hidden), 1]),
            }

        shapes = []
        build(lambda shape: shapes.append(shape) or np.zeros(shape))
        # All draws are cut from one normal vector: one small program instead of one per shape.
        normal = _Normals(jax.random.PRNGKey(seed), sum(math.prod(s) for s in shapes), dtype)
        self.params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), build(normal))

    def _layer_irreps(self):
        """(input irreps, tensor-product irreps, gate input irreps) of each layer."""
        hidden = e3nn.Irreps(self.hidden_irreps)
        scalars = e3nn.Irreps(f"{hidden.count('0e')}x0e")
        gated = hidden.filter(drop=["0e", "0o"])
        # Gate input: the scalars, one gate scalar per non-scalar irrep, then those irreps.
        gate_in = (scalars + e3nn.Irreps(f"{gated.num_irreps}x0e") + gated) if gated.num_irreps else scalars
        out, irreps_in = [], scalars
        for _ in range(self.n_layers):
            irreps_tp = e3nn.tensor_product(irreps_in, _SH_IRREPS, filter_ir_out=hidden)
            out.append((irreps_in, irreps_tp, gate_in))
            irreps_in = hidden
        return out

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        n = positions.shape[0]
        rc = self.cutoff
        params = cast_params(self.params, dt)
        senders, receivers = neighbors.senders, neighbors.receivers

        vec, r, inside = edge_lengths(positions, cell, batch_idx, neighbors, rc)
        # Padding edges get a unit vector: finite harmonics and gradients, zeroed by the envelope.
        unit = jnp.where(inside[:, None], vec, jnp.asarray([0.0, 0.0, 1.0], dt))
        sh = e3nn.spherical_harmonics(_SH_IRREPS, unit, normalize=True, normalization="component")
        envelope = jnp.where(inside, polynomial_envelope(r / rc, self.envelope_p), 0.0)
        basis = e3nn.bessel(r, self.n_basis, rc) * envelope[:, None]  # [E, n_basis]

        h = e3nn.IrrepsArray(f"{params['embed'].shape[1]}x0e", params["embed"][kind])
        norm = 1.0 / math.sqrt(self.avg_num_neighbors)
        for p_layer, (irreps_in, irreps_tp, gate_in) in zip(params["layers"], self._layer_irreps()):
            messages = e3nn.tensor_product(h[senders], sh, filter_ir_out=e3nn.Irreps(self.hidden_irreps))
            weights = _mlp(p_layer["radial"], basis) * envelope[:, None]  # [E, n_paths], zero on padding
            messages = messages * weights
            aggregated = e3nn.scatter_sum(messages, dst=receivers, output_size=n) * norm
            linear = e3nn.FunctionalLinear(irreps_tp, gate_in)
            self_linear = e3nn.FunctionalLinear(irreps_in, gate_in)
            pre = e3nn.vmap(lambda a: linear(p_layer["linear"], a))(aggregated)
            pre = pre + e3nn.vmap(lambda a: self_linear(p_layer["self"], a))(h)
            update = e3nn.gate(pre, even_act=jax.nn.silu, even_gate_act=jax.nn.sigmoid, odd_act=jnp.tanh,
                               odd_gate_act=jnp.tanh)
            h = h + update if update.irreps == h.irreps else update

        scalars = h.filter(keep="0e").array
        return _mlp(params["readout"], scalars)[:, 0]
