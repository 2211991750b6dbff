"""One MACE layer: interaction block, product basis and readout, as static structure (irreps,
paths, weight sizes) plus the function that applies it to a layer's weights.

Interaction blocks (mace-torch class names, :data:`INTERACTIONS`)::

    A_i = Linear(Σ_j R(r_ij) ⊙ (Linear_up(h_j) ⊗ Y(r̂_ij))) / norm_i
    norm_i = avg_num_neighbors                                  (RealAgnostic[Residual]InteractionBlock)
    norm_i = 1 + Σ_j tanh((W_d · edge_feats_ij)²) [· cutoff]     (RealAgnosticDensity[Residual]InteractionBlock)

"Residual" blocks carry the self-connection ``h_i ⊗ z_i`` past the product basis; the others
apply it to ``A_i``. The non-linear block is :mod:`.nonlinear`'s. Readouts: linear on every layer but the last, which has a gated MLP
(``NonLinearReadoutBlock``) or a gated MLP with biases and a middle layer
(``NonLinearBiasReadoutBlock``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import irreps as ir
from .edges import edge_sum
from .layers import (Linear, TensorProduct, conv_tp_irreps, radial_mlp, split, symmetric_contraction,
                     uvu_messages)
from .nonlinear import NONLINEAR, NonLinearInteraction

__all__ = ["INTERACTIONS", "READOUTS", "Layer"]

#: Interaction blocks MACE can be built with (mace-torch class names).
INTERACTIONS = ("RealAgnosticResidualInteractionBlock", "RealAgnosticInteractionBlock",
                "RealAgnosticDensityInteractionBlock", "RealAgnosticDensityResidualInteractionBlock", NONLINEAR)
#: Readouts of the last layer (mace-torch class names).
READOUTS = ("NonLinearReadoutBlock", "NonLinearBiasReadoutBlock")


class Layer:
    """Static structure of interaction ``t`` of ``model`` (built at trace time).

    Args:
      model: the :class:`~jaxdd.models.mace.MACE` (its static fields).
      t: the layer's index.
    """

    def __init__(self, model, t):
        n_el = len(model.species)
        attrs = ((n_el, 0, 1),)
        sh = ir.spherical_harmonics_irreps(model.max_ell)
        hidden = model.hidden_irreps
        n_s = ir.count(hidden, 0, 1)
        last = t == model.num_interactions - 1
        name = model.interactions[t]
        self.residual = "Residual" in name
        self.nonlinear = name == NONLINEAR
        self.density = "Density" in name
        self.feats_in = ((n_s, 0, 1),) if t == 0 else hidden
        sh_inter = sh
        if t > 0 and ir.count(hidden, 0, -1) > 0:
            sh_inter = tuple((1, l, p) for l in range(model.max_ell + 1) for p in (1, -1))
        source = sh if t == 0 else sh_inter
        self.target = ir.simplify(ir.sort(tuple((n_s, l, p) for _, l, p in source))[0])
        # The irreps the convolution runs on (mace-torch's edge_irreps; the node features' own by default).
        edge = model.edge_irreps
        if t == 0:
            edge = ((ir.count(edge, 0, 1), 0, 1),) if (edge and model.use_edge_irreps_first) else None
        self.edge = edge if edge else self.feats_in
        # The last layer keeps its scalars only (mace-torch's hidden_irreps[0]).
        self.out = (hidden[0],) if last else hidden
        self.linear_up = Linear(self.feats_in, self.edge)
        mid, ins = conv_tp_irreps(self.edge, sh, self.target)
        self.conv_tp = TensorProduct(self.edge, sh, mid, ins)
        self.linear = Linear(mid, self.target)
        if self.residual:
            self.skip_tp = TensorProduct.fully_connected(self.feats_in, attrs, self.out)
        else:
            self.skip_tp = TensorProduct.fully_connected(self.target, attrs, self.target)
        self.radial_sizes = (model.num_bessel,) + model.radial_mlp + (self.conv_tp.numel,)
        self.product_linear = Linear(self.out, self.out)
        self.block = NonLinearInteraction(self, n_el, model.num_bessel, model.radial_mlp) if self.nonlinear else None
        # A gated MLP reads the last layer when there are several, a linear map every other.
        one = ((1, 0, 1),)
        if not (last and t > 0):
            self.readout = (Linear(self.out, one),)
        elif model.readout == READOUTS[0]:
            self.readout = (Linear(self.out, model.mlp_irreps), Linear(model.mlp_irreps, one))
        else:
            self.readout = (Linear(self.out, model.mlp_irreps), Linear(model.mlp_irreps, model.mlp_irreps),
                            Linear(model.mlp_irreps, one))
        # Biases of the middle and last readout layers (NonLinearBiasReadoutBlock).
        self.readout_biases = (ir.count(model.mlp_irreps, 0, 1), 1) if len(self.readout) == 3 else ()

    def __call__(self, p, bases, feats, attrs, kind, n_species, edges, model):
        """The layer's new node features and its readout's energy per node.

        Args:
          p: the layer's weights (``MACE.params["layers"][t]``).
          bases: the product basis's monomial coefficients, per output irrep.
          feats: ``[n, dim]`` node features in.
          attrs: ``[n, n_species]`` one-hot elements.
          kind: ``[n]`` element row of each node.
          n_species: the number of elements.
          edges: ``senders``, ``receivers``, ``inside`` ``[E]``, ``sh`` ``[E, (l+1)²]``, ``feats`` ``[E,
            num_bessel]`` (radial basis), ``cutoff`` ``[E]`` or None (applied to the weights
            here when the basis is not enveloped).
          model: the MACE (its activation constants, ``avg_num_neighbors`` and ``edge_block``).

        Returns:
          ``(features [n, dim_out], energy [n])``.
        """
        act_constant = model.act_constant
        if self.nonlinear:
            a, sc = self.block(self, p, feats, attrs, edges, model.gate_constants, model.edge_block)
        else:
            a, sc = self._interaction(p, feats, attrs, edges, act_constant, model.avg_num_neighbors, model.edge_block)
        # [n, channels, Σ(2l+1)]: the irreps of A side by side, channel-major.
        a = jnp.concatenate(split(self.target, a), axis=-1)
        products = [symmetric_contraction(us, ws, a, kind, n_species) for us, ws in zip(bases, p["contractions"])]
        feats = self.product_linear(p["product_linear"], jnp.concatenate(products, axis=-1))
        if sc is not None:
            feats = feats + sc
        readout = p["readout"]
        if len(self.readout) == 1:
            return feats, self.readout[0](readout[0], feats)[:, 0]
        hidden = jax.nn.silu(self.readout[0](readout[0], feats)) * act_constant
        if len(self.readout) == 3:
            hidden = jax.nn.silu(self.readout[1](readout[1], hidden) + p["readout_bias"][0]) * act_constant
            return feats, self.readout[2](readout[2], hidden)[:, 0] + p["readout_bias"][1][0]
        return feats, self.readout[1](readout[1], hidden)[:, 0]

    def _interaction(self, p, feats, attrs, edges, act_constant, avg_num_neighbors, edge_block):
        """``(A [n, dim(target)], sc [n, dim(out)] or None)`` of the linear blocks."""
        n = feats.shape[0]
        senders, receivers, cutoff = edges["senders"], edges["receivers"], edges["cutoff"]
        sc = self.skip_tp(p["skip_tp"], feats, attrs) if self.residual else None
        up = self.linear_up(p["linear_up"], feats)

        def messages(rows, _):  # of a block of b edges: [b, dim(mid)]
            weights = radial_mlp(p["radial"], rows["feats"], act_constant)  # [b, numel]
            if cutoff is not None:
                weights = weights * rows["cutoff"][:, None]
            return uvu_messages(self.conv_tp, weights, rows["source"], rows["sh"])

        # The senders' features gathered per irrep for every edge, before the blocks (see
        # uvu_messages: slices of one wide array cost more than the rest in the backward pass).
        rows = {"feats": edges["feats"], "sh": edges["sh"], "source": [b[senders] for b in split(self.edge, up)],
                **({"cutoff": cutoff} if cutoff is not None else {})}
        aggregated = edge_sum(messages, rows, receivers, n, (), edge_block)
        a = self.linear(p["linear"], aggregated)
        if self.density:
            w = p["density"]  # [num_bessel, 1]: e3nn's one-layer FullyConnectedNet, no activation
            edge_density = jnp.tanh((edges["feats"] @ (w / math.sqrt(w.shape[0])))[:, 0] ** 2)
            if cutoff is not None:
                edge_density = edge_density * cutoff
            density = jax.ops.segment_sum(edge_density, receivers, num_segments=n)
            a = a / (density + 1.0)[:, None]
        else:
            a = a / avg_num_neighbors
        if not self.residual:
            a = self.skip_tp(p["skip_tp"], a, attrs)
        return a, sc
