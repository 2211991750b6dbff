"""mace-torch's ``RealAgnosticResidualNonLinearInteractionBlock`` (the multi-head MH releases)::

    e_ij = [R(r_ij), Linear_s(z_j), Linear_t(z_i)]                 (radial basis + element embeddings)
    W_ij = MLP(e_ij),  ρ_i = Σ_j tanh(MLP_ρ(e_ij)²)                (Linear → LayerNorm → SiLU stacks)
    u_i = Linear_up(h_i)
    A_i = Linear_2(Gate(Linear_1(Σ_j W_ij ⊙ (u_j ⊗ Y(r̂_ij))) / (β ρ_i + α) + Linear_res(u_i)))
    sc_i = Linear_skip(h_i)

The gate applies silu to the scalars and multiplies each higher irrep by the sigmoid of its
own gate scalar (both normalised to unit second moment by constants read from the model).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import irreps as ir
from .edges import edge_sum
from .layers import Linear, split, uvu_messages

__all__ = ["NONLINEAR", "NonLinearInteraction", "mlp_with_layer_norm", "gate"]

#: The class name of the block.
NONLINEAR = "RealAgnosticResidualNonLinearInteractionBlock"


def mlp_with_layer_norm(layers, x):
    """mace's ``RadialMLP``: ``Linear → LayerNorm → SiLU`` between layers, a plain linear last.

    Args:
      layers: per layer ``{"w": [out, in], "b": [out]}`` and, but for the last, ``"g"``,
        ``"beta"`` ``[out]`` (the LayerNorm's affine weights; eps 1e-5).
      x: ``[..., in]``.

    Returns:
      ``[..., out]``.
    """
    for k, layer in enumerate(layers):
        x = x @ layer["w"].T + layer["b"]
        if k < len(layers) - 1:
            mean = jnp.mean(x, axis=-1, keepdims=True)
            var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
            x = (x - mean) / jnp.sqrt(var + 1e-5) * layer["g"] + layer["beta"]
            x = jax.nn.silu(x)
    return x


def gate_irreps(target):
    """The input layout of the gate whose output is ``target``: the sorted sum of the scalars,
    one gate scalar per gated channel, and the gated irreps (e3nn's ``Gate`` convention).

    Args:
      target: the gate's output irreps (sorted).

    Returns:
      ``(irreps_in, scalars, gated, sources, sorted_entries)``: ``irreps_in`` simplified;
      ``sources[k]`` says where sorted entry ``k`` came from (``"s"``, ``"g"`` or ``"x"``, and
      its index within that group).
    """
    scalars = tuple(e for e in target if e[1] == 0)
    gated = tuple(e for e in target if e[1] > 0)
    gates = tuple((m, 0, 1) for m, _, _ in gated)
    unsorted = scalars + gates + gated
    tags = [("s", i) for i in range(len(scalars))] + [("g", i) for i in range(len(gates))] + \
        [("x", i) for i in range(len(gated))]
    srt, perm = ir.sort(unsorted)
    sources = [None] * len(srt)
    for old, new in enumerate(perm):
        sources[new] = tags[old]
    return ir.simplify(srt), scalars, gated, tuple(sources), srt


def gate(target, x, scalar_cst, gate_cst, gate_fn=jax.nn.sigmoid):
    """The gate of :func:`gate_irreps` on ``x [n, dim]`` (its sorted input layout).

    Args:
      target: the output irreps (scalars first, then the gated irreps in order).
      x: ``[n, dim]`` features.
      scalar_cst, gate_cst: the constants normalising silu and the gates' activation.
      gate_fn: the gates' activation (MACE's sigmoid; SevenNet gates with silu).

    Returns:
      ``[n, dim(target)]``.
    """
    _, scalars, gated, sources, srt = gate_irreps(target)
    blocks = {}
    start = 0
    for (mul, l, _), src in zip(srt, sources):
        blocks[src] = x[:, start:start + mul * (2 * l + 1)].reshape(x.shape[0], mul, 2 * l + 1)
        start += mul * (2 * l + 1)
    out = [(jax.nn.silu(blocks[("s", i)]) * scalar_cst).reshape(x.shape[0], -1) for i in range(len(scalars))]
    for i in range(len(gated)):
        g = gate_fn(blocks[("g", i)][..., 0]) * gate_cst  # [n, mul]
        out.append((blocks[("x", i)] * g[..., None]).reshape(x.shape[0], -1))
    return jnp.concatenate(out, axis=-1)


class NonLinearInteraction:
    """Static structure of the block in layer ``layer`` (a :class:`~.blocks.Layer`).

    Args:
      layer: the layer (its ``feats_in``, ``edge``, ``target``, ``out`` and convolution).
      n_species: the number of elements.
      num_bessel: the radial basis's size.
      radial_mlp: hidden widths of the weights' network.
    """

    def __init__(self, layer, n_species, num_bessel, radial_mlp):
        n_s = ir.count(layer.feats_in, 0, 1)
        self.embedding = Linear(((n_species, 0, 1),), ((n_s, 0, 1),))
        self.nonlin = gate_irreps(layer.target)[0]
        self.linear_res = Linear(layer.edge, self.nonlin)
        self.linear_1 = Linear(layer.linear.irreps_in, self.nonlin)
        self.linear_2 = Linear(layer.target, layer.target)
        self.skip = Linear(layer.feats_in, layer.out)
        n_in = num_bessel + 2 * n_s
        self.radial_sizes = (n_in,) + tuple(radial_mlp) + (layer.conv_tp.numel,)
        self.density_sizes = (n_in, 64, 1)

    def __call__(self, layer, p, feats, attrs, edges, constants, edge_block=None):
        """``(A [n, dim(target)], sc [n, dim(out)])`` of the block.

        Args:
          layer: the :class:`~.blocks.Layer`.
          p: the layer's weights.
          feats: ``[n, dim]`` node features in.
          attrs: ``[n, n_species]`` one-hot elements.
          edges: as for :meth:`~.blocks.Layer.__call__`.
          constants: ``(scalar_cst, gate_cst)`` of the gate.
          edge_block: edges per block of the convolution's sum (:func:`~.edges.edge_sum`).

        Returns:
          ``(A, sc)``.
        """
        n = feats.shape[0]
        senders, receivers, cutoff = edges["senders"], edges["receivers"], edges["cutoff"]
        sc = self.skip(p["skip"], feats)
        up = layer.linear_up(p["linear_up"], feats)
        res = self.linear_res(p["linear_res"], up)
        source = self.embedding(p["source_embedding"], attrs)
        target = self.embedding(p["target_embedding"], attrs)
        # The networks have biases and read the element embeddings: an edge beyond the cutoff
        # (padding, or within the neighbour list's skin) would weigh in unless masked.
        def network(rows, nodes, params):
            source, target = nodes
            e = jnp.concatenate([rows["feats"], source[rows["senders"]], target[rows["receivers"]]], axis=-1)
            out = jnp.where(rows["inside"][:, None], mlp_with_layer_norm(params, e), 0.0)
            return out if cutoff is None else out * rows["cutoff"][:, None]

        def messages(rows, nodes):
            return uvu_messages(layer.conv_tp, network(rows, nodes, p["radial_net"]), rows["source"], rows["sh"])

        rows = {"feats": edges["feats"], "sh": edges["sh"], "senders": senders, "receivers": receivers,
                "inside": edges["inside"], **({"cutoff": cutoff} if cutoff is not None else {})}
        edge_density = jnp.tanh(network(rows, (source, target), p["density_net"])[:, 0] ** 2)
        density = jax.ops.segment_sum(edge_density, receivers, num_segments=n)
        # The senders' features gathered per irrep before the blocks (see layers.uvu_messages).
        rows["source"] = [b[senders] for b in split(layer.edge, up)]
        aggregated = edge_sum(messages, rows, receivers, n, (source, target), edge_block)
        a = self.linear_1(p["linear_1"], aggregated) / (density * p["beta"] + p["alpha"])[:, None] + res
        a = gate(layer.target, a, *constants)
        return self.linear_2(p["linear_2"], a), sc

    def random_weights(self, layer, normal):
        """Random weights of the block (``normal(shape, scale)`` draws them).

        Args:
          layer: the :class:`~.blocks.Layer`.
          normal: a function ``(shape, scale=1.0) -> array`` of standard normal draws.

        Returns:
          dict of the block's weights.
        """
        def mlp(sizes):
            return [dict({"w": normal((b, a), 1 / a ** 0.5), "b": normal((b,), 0.1)},
                         **({"g": 1 + normal((b,), 0.1), "beta": normal((b,), 0.1)} if k < len(sizes) - 2 else {}))
                    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]

        return {"skip": normal((self.skip.numel,)), "linear_up": normal((layer.linear_up.numel,)),
                "linear_res": normal((self.linear_res.numel,)), "linear_1": normal((self.linear_1.numel,)),
                "linear_2": normal((self.linear_2.numel,)), "source_embedding": normal((self.embedding.numel,)),
                "target_embedding": normal((self.embedding.numel,)), "radial_net": mlp(self.radial_sizes),
                "density_net": mlp(self.density_sizes), "alpha": 20.0, "beta": 0.0}

    def from_state_dict(self, layer, take, pre):
        """The block's weights from a mace-torch state dict.

        Args:
          layer: the :class:`~.blocks.Layer`.
          take: ``(key, shape) -> array``, checking the shape.
          pre: the block's prefix, ``"interactions.<t>."``.

        Returns:
          dict of the block's weights.
        """
        def mlp(name, sizes):
            out = []
            for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
                layer_w = {"w": take(f"{pre}{name}.net.{3 * k}.weight", (b, a)),
                           "b": take(f"{pre}{name}.net.{3 * k}.bias", (b,))}
                if k < len(sizes) - 2:
                    layer_w.update(g=take(f"{pre}{name}.net.{3 * k + 1}.weight", (b,)),
                                   beta=take(f"{pre}{name}.net.{3 * k + 1}.bias", (b,)))
                out.append(layer_w)
            return out

        linears = {"skip": ("skip_tp", self.skip), "linear_up": ("linear_up", layer.linear_up),
                   "linear_res": ("linear_res", self.linear_res), "linear_1": ("linear_1", self.linear_1),
                   "linear_2": ("linear_2", self.linear_2), "source_embedding": ("source_embedding", self.embedding),
                   "target_embedding": ("target_embedding", self.embedding)}
        out = {k: take(f"{pre}{name}.weight", (lin.numel,)) for k, (name, lin) in linears.items()}
        out.update(radial_net=mlp("conv_tp_weights", self.radial_sizes), density_net=mlp("density_fn", self.density_sizes),
                   alpha=take(pre + "alpha", ()), beta=take(pre + "beta", ()))
        return out
