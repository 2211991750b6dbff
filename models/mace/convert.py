"""From a mace-torch state dict (numpy arrays) to MACE's weights: one head picked out of a
multi-head model, every weight mapped and its shape checked.
"""

from __future__ import annotations

import os

import numpy as np

from . import irreps as ir
from .torch_import import UnsupportedModel

__all__ = ["weights_from_state_dict", "select_head"]


def weights_from_state_dict(cls, config, sd):
    """(params, bases) in MACE's layout from a mace-torch state dict, every shape checked
    against the structure the configuration gives.

    Args:
      cls: the MACE class (its structure is built from ``config``).
      config: single-head configuration (:func:`select_head`).
      sd: the state dict, numpy arrays by mace-torch's names.

    Returns:
      ``(params, bases)`` for ``MACE(**config, _weights=...)``.
    """
    skeleton = cls(**config, dtype=np.float32, _weights=({}, []))  # structure only

    def take(key, shape):
        if key not in sd:
            raise UnsupportedModel(f"mace-torch state dict has no {key!r}; is this a MACE model?")
        value = np.asarray(sd[key], np.float64)
        if len(value.shape) != len(shape) or any(w is not None and v != w for v, w in zip(value.shape, shape)):
            raise UnsupportedModel(f"mace-torch weight {key!r} has shape {value.shape}, but the configuration "
                                   f"read from the model needs {tuple(shape)}")
        return value

    n_el = len(config["species"])
    n_s = ir.count(skeleton.hidden_irreps, 0, 1)
    params = {"embedding": take("node_embedding.linear.weight", (n_el * n_s,)), "layers": []}
    params.update(_edge_params(skeleton, config, take))
    bases = []
    for t, layer in enumerate(skeleton.layers()):
        pre, corr = f"interactions.{t}.", skeleton.correlation[t]
        contractions, layer_bases = [], []
        for c in range(len(layer.out)):
            cpre = f"products.{t}.symmetric_contractions.contractions.{c}."
            n_ell = sum(2 * l + 1 for _, l, _ in layer.target)
            lead = () if layer.out[c][1] == 0 else (2 * layer.out[c][1] + 1,)
            us = [take(f"{cpre}U_matrix_{nu}", lead + (n_ell,) * nu + (sd.get(f"{cpre}U_matrix_{nu}", np.zeros(1)).shape[-1],))
                  for nu in range(1, corr + 1)]
            layer_bases.append(us)
            ws = [take(f"{cpre}weights_max", (n_el, us[-1].shape[-1], n_s))]
            ws += [take(f"{cpre}weights.{k}", (n_el, us[corr - 2 - k].shape[-1], n_s)) for k in range(corr - 1)]
            contractions.append(ws)
        bases.append(layer_bases)
        names = ["linear"] if len(layer.readout) == 1 else ["linear_1", "linear_2"]
        sizes = layer.radial_sizes
        extra = {}
        if layer.density:
            extra["density"] = take(pre + "density_fn.layer0.weight", (config["num_bessel"], 1))
        if layer.readout_biases:
            extra["readout_bias"] = [take(f"readouts.{t}.linear_mid.bias", (layer.readout_biases[0],)),
                                     take(f"readouts.{t}.linear_2.bias", (1,))]
            names = ["linear_1", "linear_mid", "linear_2"]
        if layer.nonlinear:
            extra.update(layer.block.from_state_dict(layer, take, pre))
        else:
            extra.update({
                "linear_up": take(pre + "linear_up.weight", (layer.linear_up.numel,)),
                "radial": [take(f"{pre}conv_tp_weights.layer{k}.weight", (a, b))
                           for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))],
                "linear": take(pre + "linear.weight", (layer.linear.numel,)),
                "skip_tp": take(pre + "skip_tp.weight", (layer.skip_tp.numel,))})
        params["layers"].append({
            **extra,
            "contractions": contractions,
            "product_linear": take(f"products.{t}.linear.weight", (layer.product_linear.numel,)),
            "readout": [take(f"readouts.{t}.{name}.weight", (lin.numel,)) for name, lin in zip(names, layer.readout)],
        })
    return params, bases


def _edge_params(skeleton, config, take):
    """The radial basis, distance transform and ZBL constants from the state dict."""
    out, n_b = {}, config["num_bessel"]
    if skeleton.radial_type == "bessel":
        out["bessel_weights"] = take("radial_embedding.bessel_fn.bessel_weights", (n_b,))
    elif skeleton.radial_type == "gaussian":
        out["gaussian_weights"] = take("radial_embedding.bessel_fn.gaussian_weights", (n_b,))
    elif not np.array_equal(take("radial_embedding.bessel_fn.n", (1, n_b)), np.arange(1, n_b + 1)[None]):
        raise UnsupportedModel("the Chebyshev basis's degrees (radial_embedding.bessel_fn.n) are not 1..num_bessel")
    species = list(config["species"])
    if skeleton.distance_transform is not None:
        pre = "radial_embedding.distance_transform."
        names = ("a", "q", "p") if skeleton.distance_transform == "Agnesi" else ("alpha",)
        out["transform"] = {k: take(pre + k, ()) for k in names}
        out["covalent_radii"] = take(pre + "covalent_radii", (None,))[species]
    if skeleton.pair_repulsion:
        pre = "pair_repulsion_fn."
        out["zbl"] = {"c": take(pre + "c", (4,)), "a_exp": take(pre + "a_exp", ()),
                      "a_prefactor": take(pre + "a_prefactor", ())}
        rc = take(pre + "covalent_radii", (None,))[species]
        if "covalent_radii" in out and not np.array_equal(rc, out["covalent_radii"]):
            raise UnsupportedModel("the ZBL repulsion and the distance transform use different covalent radii")
        out["covalent_radii"] = rc
    return out


def select_head(config, sd, head, source=None):
    """The configuration and state dict of one head of a model: its E0s, scale and shift, and
    the readout weights of that head alone (a multi-head readout is the heads' readouts side by
    side, their hidden units masked to the node's head).

    Args:
      config: as :func:`~.torch_import.read` returned it (``heads`` lists the model's heads).
      sd: its state dict.
      head: the head's name, or None for a model with one head.
      source: what the model was read from, for messages.

    Returns:
      ``(config, sd)`` of a single-head model (``config`` without ``heads``).
    """
    config, sd = dict(config), dict(sd)
    heads = list(config.pop("heads", None) or ["Default"])
    where = f"{os.fspath(source)!r}: " if isinstance(source, (str, os.PathLike)) else ""
    if head is None:
        if len(heads) > 1:
            raise UnsupportedModel(f"{where}the mace-torch model has {len(heads)} heads {heads}: pick one with "
                                   f"MACE.from_torch(..., head=name), e.g. head={heads[0]!r}")
        return config, sd
    if head not in heads:
        raise ValueError(f"{where}head {head!r} is not a head of this model; its heads are {heads}")
    h, n_h = heads.index(head), len(heads)
    e0 = np.asarray(config["atomic_energies"], np.float64)
    config["atomic_energies"] = (e0.reshape(n_h, -1)[h] if e0.ndim == 2 or n_h > 1 else e0).tolist()
    for key in ("scale", "shift"):
        values = np.asarray(config[key], np.float64).reshape(-1)
        config[key] = float(values[h if values.size > 1 else 0])
    if n_h == 1:
        return config, sd
    m = ir.count(ir.parse(config["mlp_irreps"]), 0, 1)
    if m % n_h:
        raise UnsupportedModel(f"the readout's {m} hidden scalars do not split into {n_h} heads")
    m //= n_h
    config["mlp_irreps"] = f"{m}x0e"
    n = config["num_interactions"]
    rows = slice(h * m, (h + 1) * m)
    for t in range(n):
        pre = f"readouts.{t}."
        if pre + "linear.weight" in sd:  # [features, heads] per path: the scalars' block only
            sd[pre + "linear.weight"] = sd[pre + "linear.weight"].reshape(-1, n_h)[:, h].copy()
            continue
        w1 = sd[pre + "linear_1.weight"]
        sd[pre + "linear_1.weight"] = w1.reshape(-1, n_h * m)[:, rows].reshape(-1)
        # The hidden layer's fan-in shrinks from n_h·m to m: e3nn divides by its square root.
        fix = 1.0 / np.sqrt(n_h)
        sd[pre + "linear_2.weight"] = sd[pre + "linear_2.weight"].reshape(n_h * m, n_h)[rows, h] * fix
        if pre + "linear_mid.weight" in sd:
            sd[pre + "linear_mid.weight"] = (sd[pre + "linear_mid.weight"].reshape(n_h * m, n_h * m)[rows, rows]
                                             * fix).reshape(-1)
            sd[pre + "linear_mid.bias"] = sd[pre + "linear_mid.bias"][rows]
            sd[pre + "linear_2.bias"] = sd[pre + "linear_2.bias"][h:h + 1]
    return config, sd
