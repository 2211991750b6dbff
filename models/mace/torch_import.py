"""Reading a mace-torch model: its configuration, every weight, and the constants it was built
with. Variants MACE here does not implement are refused by name.

torch is imported only to read a torch object or file; :func:`save_export` writes what was
read to a ``.npz`` that :func:`load_export` reads without torch (e.g. on a machine that runs
JAX only). Mapping the state dict onto MACE's weights is :meth:`MACE.from_torch`'s.
"""

from __future__ import annotations

import json
import os

import numpy as np

__all__ = ["INTERACTIONS", "UnsupportedModel", "read", "load_export", "save_export"]

#: Interaction blocks MACE can be built with (mace-torch class names).
INTERACTIONS = ("RealAgnosticResidualInteractionBlock", "RealAgnosticInteractionBlock")


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
    """The constant e3nn multiplied silu by in this model (a Monte-Carlo second moment; e3nn
    leaves the activation unscaled when the constant is within 1e-4 of one)."""
    acts = [layer.act for block in m.interactions for layer in list(block.conv_tp_weights)[:-1]]
    if len(m.readouts) > 1:
        acts.append(m.readouts[-1].non_linearity.acts[0])
    values = {1.0 if abs(float(a.cst) - 1) < 1e-4 else float(a.cst) for a in acts}
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


def read(source, config=None):
    """``(config, state_dict, act_constant)`` of a mace-torch model object or a file saved from
    one (config: for a state-dict file, the keyword arguments the model was built with)."""
    return _read_object(_load(source, config))


def load_export(path):
    """``(config, state_dict, act_constant)`` from a ``.npz`` written by :func:`save_export`."""
    with np.load(os.fspath(path)) as f:
        if "__config__" not in f.files:
            raise ValueError(f"{os.fspath(path)!r} is not a MACE export (it has no configuration); write one with "
                             "jaxdd.models.mace.export_torch(model, path) where torch and mace-torch are installed")
        config = json.loads(str(f["__config__"]))
        state = {k: f[k] for k in f.files if not k.startswith("__")}
    return config, state, config.pop("__act_constant__")


def save_export(path, config, state, act_constant) -> str:
    """Write what :func:`read` returned to ``path`` (``.npz``, compressed). Returns the path."""
    path = os.fspath(path)
    if not path.endswith(".npz"):
        raise ValueError(f"a MACE export is a .npz file; got {path!r}")
    np.savez_compressed(path, __config__=json.dumps(dict(config, __act_constant__=act_constant)), **state)
    return path
