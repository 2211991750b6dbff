"""Reading a mace-torch model: its configuration, every weight, and the constants it was built
with. Variants MACE here does not implement are refused by name.

torch is imported only to read a torch object or file; :func:`save_export` writes what was
read to a ``.npz`` that :func:`load_export` reads without torch (e.g. on a machine that runs
JAX only). Mapping the state dict onto MACE's weights is :meth:`MACE.from_torch`'s.

A file that cannot be a model (missing, a directory, empty, cut short, of another kind) is
refused with an error naming it and what is wrong: from its bytes where they tell, before torch
or numpy read it; otherwise their own error is chained to ours, not shown raw.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping

import numpy as np

__all__ = ["INTERACTIONS", "UnsupportedModel", "read", "is_export", "load_export", "save_export"]

from .blocks import INTERACTIONS, READOUTS
from .nonlinear import NONLINEAR


class UnsupportedModel(ValueError):
    """A mace-torch model uses a variant this MACE does not implement."""


_SUPPORTED = {"MACE", "ScaleShiftMACE"}


def _refuse(what, name, hint=""):
    raise UnsupportedModel(f"mace-torch model uses {what} {name!r}, which jaxdd's MACE does not implement"
                           + (f"; {hint}" if hint else ""))


def _cause(exc: BaseException) -> str:
    """``Type: message`` of an error from torch, numpy or zipfile, for a message that chains it."""
    # On one line: torch puts what went wrong under a heading line ("Error(s) in loading ...").
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    text = text if len(text) <= 300 else text[:300] + " ..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _check_file(source) -> str:
    """``source`` as a path str when it names a non-empty file; FileNotFoundError or ValueError
    naming it and what is wrong otherwise."""
    path = os.fspath(source)
    if not os.path.exists(path):
        raise FileNotFoundError(f"MACE model file {path!r} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory, not a MACE model file (a mace-torch model saved with "
                         "torch.save, or a .npz written by export_torch)")
    try:
        with open(path, "rb") as f:
            empty = not f.read(1)
    except OSError as e:
        raise ValueError(f"MACE model file {path!r} cannot be read ({_cause(e)})") from e
    if empty:
        raise ValueError(f"MACE model file {path!r} is empty (0 bytes); its write was probably interrupted")
    return path


def _zip_names(path: str):
    """Member names of the zip archive ``path`` (.npz and torch files are both zips); None when
    it is not one."""
    try:
        with zipfile.ZipFile(path) as z:
            return z.namelist()
    except Exception as e:  # zipfile raises several kinds on a damaged archive
        with open(path, "rb") as f:
            head = f.read(4)
        # A zip archive keeps its table of contents at the end: one that starts like a zip but
        # cannot be opened was cut short (or overwritten), whatever reads it next.
        if head == b"PK\x03\x04":
            raise ValueError(f"MACE model file {path!r} is truncated or damaged: it starts as a zip archive "
                             f"(as .npz and torch files do) but is not a complete one ({_cause(e)})") from e
        return None


def is_export(source) -> bool:
    """Whether the path ``source`` is (meant as) an export: a ``.npz`` name, or a zip archive
    holding an export's configuration whatever its name."""
    path = os.fspath(source)
    if path.lower().endswith(".npz"):
        return True
    try:
        with zipfile.ZipFile(path) as z:
            return "__config__.npy" in z.namelist()
    except Exception:  # not a readable zip: the torch reader's checks say what it is
        return False


def _state_dict_model(path, obj, config):
    """The mace-torch model ``config`` describes, with the state dict ``obj`` (read from ``path``)."""
    import torch

    if not all(isinstance(v, torch.Tensor) for v in obj.values()):
        keys = ", ".join(map(repr, list(obj)[:5])) + (", ..." if len(obj) > 5 else "")
        raise ValueError(f"{path!r} holds a dict with keys {keys}, not a mace-torch model or its state dict "
                         "(a training checkpoint keeps the state dict under one of its keys)")
    if config is None:
        raise ValueError(f"{path!r} holds a state dict, which does not record the model's "
                         "configuration (avg_num_neighbors, interaction classes, ...); pass "
                         "config=dict(...) with the keyword arguments mace-torch's ScaleShiftMACE (or MACE, "
                         "with config['model'] = 'MACE') was built with, or save the model object instead")
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict of the keyword arguments the mace-torch model of {path!r} "
                         f"was built with, got {type(config).__name__}")
    from mace import modules

    config = dict(config)
    name = config.pop("model", "ScaleShiftMACE")
    if not isinstance(name, str) or not hasattr(modules, name):
        raise ValueError(f"config['model'] must name a mace-torch model class (e.g. 'ScaleShiftMACE'), got {name!r}")
    try:
        model = getattr(modules, name)(**config)
    except Exception as e:
        raise ValueError(f"config does not build a mace-torch {name} for the state dict of {path!r} "
                         f"({_cause(e)})") from e
    try:
        model.load_state_dict(obj)
    except Exception as e:
        raise ValueError(f"the state dict in {path!r} does not fit the {name} that config builds "
                         f"({_cause(e)})") from e
    return model


def _load(source, config):
    """A mace-torch model object from an object, a ``torch.save``'d model or a state dict."""
    if not isinstance(source, (str, os.PathLike)):
        if config is not None:
            raise ValueError("config is for a state-dict file only; a mace-torch model object records its own "
                             "configuration: drop config=")
        return source
    path = _check_file(source)
    names = _zip_names(path)
    if path.lower().endswith(".npz") or (names is not None and "__config__.npy" in names):
        raise ValueError(f"{path!r} is a .npz file (a jaxdd MACE export, or meant as one), not a mace-torch "
                         "model; load an export with MACE.from_torch(path); export_torch reads mace-torch "
                         "models (torch.save'd .model files or model objects)")
    # Every torch zip holds its pickle as <folder>/data.pkl; other zips are not torch files.
    if names is not None and not any(n.rsplit("/", 1)[-1] == "data.pkl" for n in names):
        raise ValueError(f"{path!r} is a zip archive but not a torch file (it has no data.pkl); a mace-torch "
                         "model file is written by torch.save(model, path) (mace's .model files)")
    try:
        import torch
    except ImportError as e:
        raise ModuleNotFoundError(f"reading {path!r} as a mace-torch model needs torch and mace-torch "
                                  "(pip install torch mace-torch); where they are installed, export_torch(model, "
                                  "'model.npz') writes an export that loads without them", name="torch") from e
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(f"reading {path!r} needs the module {e.name!r}, which its pickle refers to "
                                  "(a mace-torch model needs mace-torch: pip install mace-torch)",
                                  name=e.name) from e
    except Exception as e:  # torch.load fails in many ways on a file it cannot read
        raise ValueError(f"MACE model file {path!r} cannot be read by torch.load: it is not a torch file, is "
                         f"damaged, or was saved by an incompatible torch or mace version ({_cause(e)})") from e
    if isinstance(obj, dict):
        return _state_dict_model(path, obj, config)
    if config is not None:
        raise ValueError(f"config is for a state-dict file only; {path!r} holds a whole "
                         f"{type(obj).__name__}, which records its own configuration: drop config=")
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(f"{path!r} holds a {type(obj).__name__}, not a mace-torch model "
                         "(torch.save(model, path)) or its state dict")
    return obj


_BASES = {"BesselBasis": "bessel", "GaussianBasis": "gaussian", "ChebychevBasis": "chebyshev"}
_TRANSFORMS = {"AgnesiTransform": "Agnesi", "SoftTransform": "Soft"}


def _check_variant(m):
    """UnsupportedModel naming the first part of ``m`` that MACE here does not implement."""
    name = type(m).__name__
    if name not in _SUPPORTED:
        _refuse("the model class", name, f"supported: {sorted(_SUPPORTED)}")
    for block in m.interactions:
        if type(block).__name__ not in INTERACTIONS:
            _refuse("the interaction block", type(block).__name__, f"supported: {list(INTERACTIONS)}")
        if getattr(block, "conv_fusion", None):
            _refuse("a fused convolution", "conv_fusion", "convert the model back to e3nn layers first "
                    "(mace's mace.cli.convert_cueq_e3nn or convert_oeq_e3nn)")
    radial = m.radial_embedding
    if type(radial.bessel_fn).__name__ not in _BASES:
        _refuse("the radial basis", type(radial.bessel_fn).__name__, f"supported: {sorted(_BASES)}")
    if hasattr(radial, "distance_transform") and type(radial.distance_transform).__name__ not in _TRANSFORMS:
        _refuse("the distance transform", type(radial.distance_transform).__name__, f"supported: {sorted(_TRANSFORMS)}")
    if hasattr(m, "joint_embedding"):
        _refuse("extra embeddings", "embedding_specs")
    for flag in ("use_agnostic_product", "use_so3", "use_last_readout_only"):
        if getattr(m, flag, False):
            _refuse("the option", f"{flag}=True")
    for product in m.products:
        sc = type(product.symmetric_contractions)
        if sc.__name__ != "SymmetricContraction" or not sc.__module__.startswith("mace."):
            _refuse("the product basis", type(product.symmetric_contractions).__name__,
                    "convert cuequivariance models back to e3nn layers first (mace's mace.cli.convert_cueq_e3nn)")
    n = len(m.readouts)
    if n > 1 and len(m.products[-1].linear.irreps_out) != 1:
        _refuse("the option", "keep_last_layer_irreps=True")
    for i, readout in enumerate(m.readouts):
        want = READOUTS if (i == n - 1 and n > 1) else ("LinearReadoutBlock",)
        if type(readout).__name__ not in want:
            _refuse("the readout", type(readout).__name__, f"layer {i} needs one of {list(want)}")
    if n > 1:
        act = m.readouts[-1].non_linearity.acts[0]
        f = getattr(act, "f", act)
        if getattr(f, "__name__", type(f).__name__) != "silu":
            _refuse("the gate", getattr(f, "__name__", type(f).__name__), "supported: silu")


def _act_constant(m):
    """The constant e3nn multiplied silu by in this model (a Monte-Carlo second moment; e3nn
    leaves the activation unscaled when the constant is within 1e-4 of one)."""
    acts = [layer.act for block in m.interactions if type(block).__name__ != NONLINEAR
            for layer in list(block.conv_tp_weights)[:-1]]
    if len(m.readouts) > 1:
        acts.append(m.readouts[-1].non_linearity.acts[0])
    values = {1.0 if abs(float(a.cst) - 1) < 1e-4 else float(a.cst) for a in acts}
    if len(values) > 1:
        _refuse("different activation normalisations", sorted(values))
    return values.pop() if values else None


def _gate_constants(m):
    """``(silu, sigmoid)`` normalisation constants of the non-linear blocks' gates, or None: as
    mace computes them, ``E[f(z)²]^(-1/2)`` over 10⁶ draws of torch's generator seeded 0."""
    gates = [b.equivariant_nonlin for b in m.interactions if type(b).__name__ == NONLINEAR]
    if not gates:
        return None
    if any(type(g).__name__ != "GatedEquivariantBlock" for g in gates):
        _refuse("the gate", type(gates[0]).__name__, "supported: mace's GatedEquivariantBlock (mace-torch >= 0.3.15)")
    import torch

    z = torch.randn(1_000_000, generator=torch.Generator(device="cpu").manual_seed(0), dtype=torch.float64)
    return [float(f(z).pow(2).mean().pow(-0.5)) for f in (torch.nn.functional.silu, torch.sigmoid)]


def _enabled(config) -> bool:
    return bool(config is not None and getattr(config, "enabled", True))


def _to_e3nn_layout(m):
    """``m`` itself, or a copy in e3nn layout when it was built for cuEquivariance or
    OpenEquivariance (mace's own ``convert_cueq_e3nn`` / ``convert_oeq_e3nn``)."""
    blocks = list(m.interactions) + list(m.products)
    cueq = any(_enabled(getattr(b, "cueq_config", None)) for b in blocks)
    oeq = any(_enabled(getattr(b, "oeq_config", None)) for b in blocks)
    if not (cueq or oeq):
        return m
    import torch

    kind = "cuEquivariance" if cueq else "OpenEquivariance"
    default = torch.get_default_dtype()  # mace's converters set it to the model's
    try:
        if cueq:
            from mace.cli.convert_cueq_e3nn import run
        else:
            from mace.cli.convert_oeq_e3nn import run
        return run(m, return_model=True, device="cpu")
    except ImportError as e:
        raise ModuleNotFoundError(f"the mace-torch model is in {kind} layout; converting it back to e3nn layout "
                                  f"needs {e.name!r} (pip install {'cuequivariance-torch' if cueq else 'openequivariance'}"
                                  ")", name=e.name) from e
    except Exception as e:
        raise UnsupportedModel(f"the mace-torch model is in {kind} layout and mace's converter back to e3nn layout "
                               f"failed ({_cause(e)}); convert it where it was trained (mace.cli.convert_"
                               f"{'cueq' if cueq else 'oeq'}_e3nn) and read that file") from e
    finally:
        torch.set_default_dtype(default)


def _read_object(m):
    if type(m).__name__ not in _SUPPORTED:
        _refuse("the model class", type(m).__name__, f"supported: {sorted(_SUPPORTED)}")
    m = _to_e3nn_layout(m)
    _check_variant(m)
    sd = {k: v.detach().cpu().double().numpy() for k, v in m.state_dict().items()}
    n_int = int(m.num_interactions)
    first, later = type(m.interactions[0]).__name__, type(m.interactions[-1]).__name__
    if any(type(b).__name__ != later for b in m.interactions[1:]):
        _refuse("mixed interaction blocks", [type(b).__name__ for b in m.interactions])
    hidden = m.interactions[1].node_feats_irreps if n_int > 1 else m.products[0].linear.irreps_out
    radial = m.radial_embedding
    edge_irreps = getattr(m, "edge_irreps", None)
    heads = [str(h) for h in getattr(m, "heads", None) or ["Default"]]
    config = dict(
        species=[int(z) for z in sd["atomic_numbers"]], r_max=float(sd["r_max"]),
        num_bessel=int(radial.out_dim), num_polynomial_cutoff=int(sd["radial_embedding.cutoff_fn.p"]),
        max_ell=int(m.spherical_harmonics.irreps_out.lmax), hidden_irreps=str(hidden),
        mlp_irreps=str(m.readouts[-1].hidden_irreps) if n_int > 1 else "16x0e",
        num_interactions=n_int,
        correlation=[int(p.symmetric_contractions.contractions[0].correlation) for p in m.products],
        interaction=later, interaction_first=first,
        radial_mlp=[int(h) for h in m.interactions[0].conv_tp_weights.hs[1:-1]],
        avg_num_neighbors=float(m.interactions[0].avg_num_neighbors),
        radial_type=_BASES[type(radial.bessel_fn).__name__],
        distance_transform=_TRANSFORMS[type(radial.distance_transform).__name__]
        if hasattr(radial, "distance_transform") else None,
        apply_cutoff=bool(getattr(radial, "apply_cutoff", True)), pair_repulsion=hasattr(m, "pair_repulsion"),
        edge_irreps=None if edge_irreps is None else str(edge_irreps),
        use_edge_irreps_first=bool(getattr(m, "use_edge_irreps_first", False)),
        readout=type(m.readouts[-1]).__name__ if n_int > 1 else READOUTS[0],
        atomic_energies=np.asarray(sd["atomic_energies_fn.atomic_energies"]).tolist(),
        scale=np.asarray(sd.get("scale_shift.scale", 1.0)).tolist(),
        shift=np.asarray(sd.get("scale_shift.shift", 0.0)).tolist(),
    )
    if len(heads) > 1:
        config["heads"] = heads
    gates = _gate_constants(m)
    if gates is not None:
        config["_gate_constants"] = gates
    return config, sd, _act_constant(m)


def read(source, config=None):
    """``(config, state_dict, act_constant)`` of a mace-torch model object or a file saved from one.

    Args:
      source: the model object, or the path of a file saved from one.
      config: for a state-dict file, the keyword arguments the model was built with.
    """
    model = _load(source, config)
    if not isinstance(source, (str, os.PathLike)):
        return _read_object(model)
    try:
        return _read_object(model)
    except UnsupportedModel as e:  # say which file holds the model
        raise UnsupportedModel(f"{os.fspath(source)!r}: {e}") from e


def load_export(path):
    """``(config, state_dict, act_constant)`` from a ``.npz`` at ``path`` written by :func:`save_export`."""
    path = _check_file(path)
    names = _zip_names(path)
    if names is None:
        raise ValueError(f"{path!r} is not a .npz archive (not a zip archive at all), so not a MACE export; "
                         "write one with jaxdd.models.mace.export_torch(model, path) where torch and mace-torch "
                         "are installed")
    if "__config__.npy" not in names:
        raise ValueError(f"{path!r} is not a MACE export (it has no configuration); write one with "
                         "jaxdd.models.mace.export_torch(model, path) where torch and mace-torch are installed")
    try:
        with np.load(path) as f:
            config = json.loads(str(f["__config__"]))
            state = {k: f[k] for k in f.files if not k.startswith("__")}
        act_constant = config.pop("__act_constant__")
    except Exception as e:  # a damaged member: zlib, zipfile, numpy or JSON errors
        raise ValueError(f"MACE export {path!r} is damaged: its arrays or configuration cannot be read "
                         f"({_cause(e)}); write it again with export_torch") from e
    return config, state, act_constant


def save_export(path, config, state, act_constant) -> str:
    """Write what :func:`read` returned to ``path`` (``.npz``, compressed). Returns the path.

    Args:
      path: the file to write, ending in ``.npz``.
      config, state, act_constant: the configuration, state dict and activation constant
        :func:`read` returned.
    """
    path = os.fspath(path)
    if not path.endswith(".npz"):
        raise ValueError(f"a MACE export is a .npz file; got {path!r}")
    np.savez_compressed(path, __config__=json.dumps(dict(config, __act_constant__=act_constant)), **state)
    return path
