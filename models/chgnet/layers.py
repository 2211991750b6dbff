"""CHGNet's layers (chgnet/model/functions.py, layers.py) on jaxdd's per-atom tables: atoms
``[V, F]``, edges of the atom graph as the slots of the MATRIX list ``[V, K, F]``, bonds as
the slots of the bond list ``[V, B, F]`` and angles as pairs of distinct bonds of one atom
``[V, B, B-1, F]``: bond ``b`` with the bonds ``others(B)[b]`` (every bond but ``b``, in order).
The pair of a bond with itself is never an angle, so it is left out of the tables rather than
masked in them.

Weights are as torch stores them: a linear layer is ``(W [out, in], b [out] or None)`` and
computes ``x W^T + b``; an ``MLP`` is a list of them with SiLU between consecutive layers.

The first linear layer of a gated MLP acts on the concatenation of the features of a message's
parts (centre atom, bond, neighbour, angle). It is applied to each part where the part lives
(per atom, per bond) and the results are summed where the message lives: the same numbers as
the concatenated product, without building the concatenation on the largest table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["others", "linear", "mlp", "layer_norm", "GatedFirst", "add_pairs", "gated_mlp", "atom_conv", "bond_conv", "angle_update",
           "LAYER_NORM_EPS"]

#: torch's ``nn.LayerNorm`` default epsilon.
LAYER_NORM_EPS = 1e-5


@functools.lru_cache(maxsize=None)
def others(width: int) -> np.ndarray:
    """The partner bonds of each bond in the angle tables: row ``b`` lists ``0..width-1`` without
    ``b``, [width, width-1] (static)."""
    return np.array([[c for c in range(width) if c != b] for b in range(width)], np.int32).reshape(width, width - 1)


def linear(layer, x):
    """``x W^T + b`` of a torch linear layer ``(W [out, in], b [out] or None)`` on ``x [..., in]``."""
    w, b = layer
    y = x @ w.T
    return y if b is None else y + b


def _rest(layers, x):
    """An MLP after its first layer's output ``x``: SiLU, then each further layer, SiLU between them."""
    for layer in layers:
        x = linear(layer, jax.nn.silu(x))
    return x


def mlp(layers, x):
    """chgnet's ``MLP`` of ``layers`` (linear layers, SiLU between consecutive ones, none after the
    last) on ``x [..., in]``."""
    return _rest(layers[1:], linear(layers[0], x))


def layer_norm(norm, x):
    """torch's ``LayerNorm`` of ``x [..., F]`` over its last axis (biased variance, eps 1e-5), with
    ``norm = (weight [F], bias [F])``."""
    mean = jnp.mean(x, axis=-1, keepdims=True)
    centred = x - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred / jnp.sqrt(var + LAYER_NORM_EPS) * norm[0] + norm[1]


class GatedFirst:
    """The first layers of a gated MLP's core and gate, split by input part.

    Args:
      gated: the gated MLP's weights (``core``, ``gate``, optional ``norm_core``, ``norm_gate``).
      widths: the widths of the concatenated input's parts, in chgnet's order.
    """

    def __init__(self, gated, widths):
        (wc, bc), (wg, bg) = gated["core"][0], gated["gate"][0]
        self.bias = (bc, bg) if bc is not None else None
        starts = [sum(widths[:k]) for k in range(len(widths) + 1)]
        if starts[-1] != wc.shape[1]:
            raise ValueError(f"a gated MLP with {wc.shape[1]} inputs cannot take parts of widths {widths}")
        self.blocks = [(wc[:, a:b], wg[:, a:b]) for a, b in zip(starts[:-1], starts[1:])]

    def part(self, k, x, bias=False):
        """The products of part ``k``'s features ``x [..., width_k]`` with its columns of the core's
        and the gate's first layers: ``(core [..., H], gate [..., H])`` (plus their biases when
        ``bias``). Core and gate stay two arrays: slicing one stacked product would cost, under
        autodiff, a padded copy of the largest table per layer."""
        wc, wg = self.blocks[k]
        yc, yg = x @ wc.T, x @ wg.T
        if bias and self.bias is not None:
            yc, yg = yc + self.bias[0], yg + self.bias[1]
        return yc, yg


def add_pairs(*pairs):
    """The sum of (core, gate) pairs, each summed with broadcasting."""
    return sum(p[0] for p in pairs[1:]) + pairs[0][0], sum(p[1] for p in pairs[1:]) + pairs[0][1]


def gated_mlp(gated, pre):
    """chgnet's ``GatedMLP`` with weights ``gated`` from its first layers' outputs ``pre = (core,
    gate)``, each ``[..., H]``: ``silu(norm(core(x))) · sigmoid(norm(gate(x)))``, the norms
    LayerNorms or none."""
    core, gate = _rest(gated["core"][1:], pre[0]), _rest(gated["gate"][1:], pre[1])
    if "norm_core" in gated:
        core, gate = layer_norm(gated["norm_core"], core), layer_norm(gated["norm_gate"], gate)
    return jax.nn.silu(core) * jax.nn.sigmoid(gate)


def atom_conv(w, h, edge_pre, edge_weights, senders, inside):
    """chgnet's ``AtomConv``: ``h_i + out(Σ_j gated([h_i, e_ij, h_j]) ⊙ w_ij)``.

    Args:
      w: the layer's weights (``gated``, ``out``).
      h: atom features [V, F].
      edge_pre: the edges' part of the gated MLP's first layers, ``e_ij`` times its columns
        (:meth:`GatedFirst.part` 1), core and gate [V, K, H] each; the caller forms it from the edges' radial basis
        and the bond updates, which is cheaper than from the edge features on every slot.
      edge_weights: ``w_ij`` [V, K, F], the edges' enveloped radial basis times a linear map.
      senders: [V, K] the neighbour ``j`` of each slot (padding V).
      inside: [V, K] bool, the slots that are edges within the atom cutoff.

    Returns:
      the new atom features [V, F].
    """
    fa = h.shape[-1]
    first = GatedFirst(w["gated"], (fa, w["gated"]["core"][0][0].shape[1] - 2 * fa, fa))
    neighbour = [x.at[senders].get(mode="fill", fill_value=0) for x in first.part(2, h)]  # [V, K, H] each
    centre = [x[:, None, :] for x in first.part(0, h, bias=True)]
    pre = add_pairs(centre, edge_pre, neighbour)
    messages = jnp.where(inside[..., None], gated_mlp(w["gated"], pre) * edge_weights, 0.0)
    return h + mlp(w["out"], jnp.sum(messages, axis=1))


def _triplet_pre(first, h, bonds, angles):
    """First-layer outputs (core, gate) [V, B, B-1, H] of the messages ``[e_b, e_b', a_bb', h_i]`` of
    every pair of distinct bonds."""
    own = [x[:, :, None, :] for x in first.part(0, bonds, bias=True)]
    other = [x[:, others(bonds.shape[1]), :] for x in first.part(1, bonds)]
    atom = [x[:, None, None, :] for x in first.part(3, h)]
    return add_pairs(own, other, first.part(2, angles), atom)


def bond_conv(w, h, bonds, angles, bond_weights, triplets):
    """The messages of chgnet's ``BondConv`` summed at each bond's own atom, before its output
    layer: ``m_b = Σ_b' gated([e_b, e_b', a_bb', h_i]) ⊙ w_b ⊙ w_b'``. chgnet's bond update
    sums them at both ends of the bond: ``m`` of bond ``(i, b)`` plus ``m`` of its reverse.

    Args:
      w: the layer's weights (``gated``).
      h: atom features [V, F_a].
      bonds: bond features [V, B, F_e] (both copies of a bond equal).
      angles: angle features [V, B, B-1, F_t].
      bond_weights: ``w_b`` [V, B, F_e], the bonds' enveloped radial basis (bond cutoff) times a linear map.
      triplets: [V, B, B-1] bool, the angles (pairs of distinct bonds of one atom).

    Returns:
      [V, B, F_e] the summed messages of each bond at its own atom (zero on padding bonds).
    """
    first = GatedFirst(w["gated"], (bonds.shape[-1], bonds.shape[-1], angles.shape[-1], h.shape[-1]))
    update = gated_mlp(w["gated"], _triplet_pre(first, h, bonds, angles))
    update = update * bond_weights[:, :, None, :] * bond_weights[:, others(bonds.shape[1]), :]
    return jnp.sum(jnp.where(triplets[..., None], update, 0.0), axis=2)


def angle_update(w, h, bonds, angles, triplets):
    """chgnet's ``AngleUpdate``: ``a_bb' + gated([e_b, e_b', a_bb', h_i])``, zero off the angles.

    Args:
      w: the layer's weights (``gated``).
      h: atom features [V, F_a]. bonds: bond features [V, B, F_e].
      angles: angle features [V, B, B-1, F_t]. triplets: [V, B, B-1] bool.

    Returns:
      the new angle features [V, B, B-1, F_t].
    """
    first = GatedFirst(w["gated"], (bonds.shape[-1], bonds.shape[-1], angles.shape[-1], h.shape[-1]))
    new = angles + gated_mlp(w["gated"], _triplet_pre(first, h, bonds, angles))
    return jnp.where(triplets[..., None], new, 0.0)
