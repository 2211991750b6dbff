"""Reading a mace-torch model: its configuration, every weight, and the constants it was built
with, checked against the structure :class:`~jaxdd.models.mace.MACE` builds from that
configuration. Variants MACE here does not implement are refused by name.

torch is imported only to read a torch object or file; :func:`export_torch` writes what was
read to a ``.npz`` that later loads without torch (e.g. on a machine that runs JAX only).
"""

from __future__ import annotations

import json
import os

import numpy as np

from .model import INTERACTIONS

__all__ = ["read", "export_torch", "UnsupportedModel"]


class UnsupportedModel(ValueError):
    """A mace-torch model uses a variant this MACE does not implement."""


_SUPPORTED = {"MACE", "ScaleShiftMACE"}


def _refuse(what, name, hint=""):
    raise UnsupportedModel(f"mace-torch model uses {what} {name!r}, which jaxdd's MACE does not implement"
                           + (f"; {hint}" if hint else ""))


def _load(source, config):
    """A mace-torch model object from an object, a ``torch.save``'d model or a state dict."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    import torch

    obj = torch.load(os.fspath(source), map_location="cpu", weights_only=False)
    if isinstance(obj, dict):
        if config is None:
            raise ValueError(f"{os.fspath(source)!r} holds a state dict, which does not record the model's "
                             "configuration (avg_num_neighbors, interaction classes, ...); pass "
                             "config=dict(...) with the keyword arguments mace-torch's ScaleShiftMACE (or MACE, "
                             "with config['model'] = 'MACE') was built with, or save the model object instead")
        from mace import modules

        config = dict(config)
        model = getattr(modules, config.pop("model", "ScaleShiftMACE"))(**config)
        model.load_state_dict(obj)
        return model
    return obj


def _check_variant(m):
    name = type(m).__name__
    if name not in _SUPPORTED:
        _refuse("the model class", name, f"supported: {sorted(_SUPPORTED)}")
    if len(getattr(m, "heads", ["Default"])) != 1:
        _refuse("several heads", ", ".join(m.heads), "select one head first (mace's fine-tuning tools)")
    for block in m.interactions:
        if type(block).__name__ not in INTERACTIONS:
            _refuse("the interaction block", type(block).__name__, f"supported: {list(INTERACTIONS)}")
        if getattr(block, "conv_fusion", None):
            _refuse("a fused convolution", "conv_fusion", "convert the model back to e3nn layers first")
    radial = m.radial_embedding
    if type(radial.bessel_fn).__name__ != "BesselBasis":
        _refuse("the radial basis", type(radial.bessel_fn).__name__, "supported: BesselBasis")
    if hasattr(radial, "distance_transform"):
        _refuse("the distance transform", type(radial.distance_transform).__name__)
    if getattr(radial, "apply_cutoff", True) is False:
        _refuse("the option", "apply_cutoff=False")
    if hasattr(m, "pair_repulsion"):
        _refuse("the pair repulsion", "ZBLBasis")
    if hasattr(m, "joint_embedding"):
        _refuse("extra embeddings", "embedding_specs")
    for flag in ("use_agnostic_product", "use_so3", "use_last_readout_only"):
        if getattr(m, flag, False):
            _refuse("the option", f"{flag}=True")
    if getattr(m, "edge_irreps", None) is not None:
        _refuse("the option", f"edge_irreps={m.edge_irreps}")
    for product in m.products:
        if type(product.symmetric_contractions).__name__ != "SymmetricContraction":
            _refuse("the product basis", type(product.symmetric_contractions).__name__,
                    "convert cuequivariance models back to e3nn layers first (mace's cueq_to_e3nn)")
    n = len(m.readouts)
    for i, readout in enumerate(m.readouts):
        want = "NonLinearReadoutBlock" if (i == n - 1 and n > 1) else "LinearReadoutBlock"
        if type(readout).__name__ != want:
            _refuse("the readout", type(readout).__name__, f"layer {i} needs a {want}")
    if n > 1:
        act = m.readouts[-1].non_linearity.acts[0]
        f = getattr(act, "f", act)
        if getattr(f, "__name__", type(f).__name__) != "silu":
            _refuse("the gate", getattr(f, "__name__", type(f).__name__), "supported: silu")


def _act_constant(m):
    """The constant e3nn multiplied silu by in this model (Monte-Carlo second moment)."""
    values = set()
    for block in m.interactions:
        for layer in list(block.conv_tp_weights)[:-1]:
            values.add(1.0 if layer.act._is_id else float(layer.act.cst))
    if len(m.readouts) > 1:
        act = m.readouts[-1].non_linearity.acts[0]
        values.add(1.0 if act._is_id else float(act.cst))
    if len(values) > 1:
        _refuse("different activation normalisations", sorted(values))
    return values.pop() if values else None


def _read_object(m):
    _check_variant(m)
    sd = {k: v.detach().cpu().double().numpy() for k, v in m.state_dict().items()}
    n_int = int(m.num_interactions)
    first, later = type(m.interactions[0]).__name__, type(m.interactions[-1]).__name__
    if any(type(b).__name__ != later for b in m.interactions[1:]):
        _refuse("mixed interaction blocks", [type(b).__name__ for b in m.interactions])
    hidden = m.interactions[1].node_feats_irreps if n_int > 1 else m.products[0].linear.irreps_out
    e0 = np.asarray(sd["atomic_energies_fn.atomic_energies"]).reshape(-1)
    config = dict(
        species=[int(z) for z in sd["atomic_numbers"]], r_max=float(sd["r_max"]),
        num_bessel=int(sd["radial_embedding.bessel_fn.bessel_weights"].size),
        num_polynomial_cutoff=int(sd["radial_embedding.cutoff_fn.p"]),
        max_ell=int(m.spherical_harmonics.irreps_out.lmax), hidden_irreps=str(hidden),
        mlp_irreps=str(m.readouts[-1].hidden_irreps) if n_int > 1 else "16x0e",
        num_interactions=n_int,
        correlation=[int(p.symmetric_contractions.contractions[0].correlation) for p in m.products],
        interaction=later, interaction_first=first,
        radial_mlp=[int(h) for h in m.interactions[0].conv_tp_weights.hs[1:-1]],
        avg_num_neighbors=float(m.interactions[0].avg_num_neighbors), atomic_energies=e0.tolist(),
        scale=float(sd["scale_shift.scale"]) if "scale_shift.scale" in sd else 1.0,
        shift=float(sd["scale_shift.shift"]) if "scale_shift.shift" in sd else 0.0,
    )
    return config, sd, _act_constant(m)


def _weights(config, sd):
    """(params, bases) in MACE's layout from a mace-torch state dict, shapes checked."""
    from .model import MACE

    skeleton = MACE(**config, dtype=np.float32, _weights=({}, []))  # structure only

    def take(key, shape):
        if key not in sd:
            raise UnsupportedModel(f"mace-torch state dict has no {key!r}; is this a MACE model?")
        value = np.asarray(sd[key], np.float64)
        if value.shape != tuple(shape):
            raise UnsupportedModel(f"mace-torch weight {key!r} has shape {value.shape}, but the configuration "
                                   f"read from the model needs {tuple(shape)}")
        return value

    n_el = len(config["species"])
    n_s = sum(m for m, l, p in skeleton.hidden_irreps if (l, p) == (0, 1))
    params = {"embedding": take("node_embedding.linear.weight", (n_el * n_s,)), "layers": [],
              "bessel_weights": take("radial_embedding.bessel_fn.bessel_weights", (config["num_bessel"],))}
    bases = []
    for t, layer in enumerate(skeleton.layers()):
        pre = f"interactions.{t}."
        sizes = layer.radial_sizes
        contractions, layer_bases = [], []
        for c in range(len(layer.out)):
            cpre = f"products.{t}.symmetric_contractions.contractions.{c}."
            corr = skeleton.correlation[t]
            us = [np.asarray(sd[f"{cpre}U_matrix_{nu}"], np.float64) for nu in range(1, corr + 1)]
            layer_bases.append(us)
            ws = [take(f"{cpre}weights_max", (n_el, us[-1].shape[-1], n_s))]
            ws += [take(f"{cpre}weights.{k}", (n_el, us[corr - 2 - k].shape[-1], n_s)) for k in range(corr - 1)]
            contractions.append(ws)
        bases.append(layer_bases)
        readout = ([take(f"readouts.{t}.linear.weight", (layer.readout[0].numel,))] if len(layer.readout) == 1 else
                   [take(f"readouts.{t}.linear_1.weight", (layer.readout[0].numel,)),
                    take(f"readouts.{t}.linear_2.weight", (layer.readout[1].numel,))])
        params["layers"].append({
            "linear_up": take(pre + "linear_up.weight", (layer.linear_up.numel,)),
            "radial": [take(f"{pre}conv_tp_weights.layer{k}.weight", (a, b))
                       for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))],
            "linear": take(pre + "linear.weight", (layer.linear.numel,)),
            "skip_tp": take(pre + "skip_tp.weight", (layer.skip_tp.numel,)),
            "contractions": contractions,
            "product_linear": take(f"products.{t}.linear.weight", (layer.product_linear.numel,)),
            "readout": readout,
        })
    return params, bases


def read(source, config=None):
    """``(config, (params, bases), act_constant)`` of a mace-torch model, a file saved from one,
    or a ``.npz`` from :func:`export_torch`."""
    if isinstance(source, (str, os.PathLike)) and os.fspath(source).endswith(".npz"):
        with np.load(os.fspath(source)) as f:
            cfg = json.loads(str(f["__config__"]))
            sd = {k: f[k] for k in f.files if not k.startswith("__")}
        act = cfg.pop("__act_constant__")
        return cfg, _weights(cfg, sd), act
    cfg, sd, act = _read_object(_load(source, config))
    return cfg, _weights(cfg, sd), act


def export_torch(source, path, config=None) -> str:
    """Write a mace-torch model's configuration and weights to ``path`` (``.npz``), which
    :meth:`MACE.from_torch` reads without torch. Returns the path."""
    cfg, sd, act = _read_object(_load(source, config))
    _weights(cfg, sd)  # refuse now, not on the machine that loads it
    path = os.fspath(path)
    if not path.endswith(".npz"):
        raise ValueError(f"export_torch writes a .npz file; got {path!r}")
    np.savez_compressed(path, __config__=json.dumps(dict(cfg, __act_constant__=act)), **sd)
    return path
