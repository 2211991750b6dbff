"""CHGNet checkpoints: finding the published ones, reading any of them without torch, and
turning ``model_args`` and the state dict into :class:`~jaxdd.models.chgnet.CHGNet`'s settings
and weights.

The pretrained models ship in the ``chgnet`` wheel (``chgnet/pretrained/``). Its package is
found without importing it (importing ``chgnet`` imports torch and pymatgen), so a ``chgnet``
installed with ``pip install --no-deps chgnet`` is enough: a carrier of the files.

Options of ``model_args`` that none of the published models uses are refused by name
(:class:`UnsupportedCheckpoint`), never approximated; the few that chgnet itself accepts and
never reads (``skip_connection`` and the misspelt ``cutofff_coeff`` of 0.2.0) are ignored, as
chgnet ignores them.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jaxdd.interop import carrier, pth

__all__ = ["PRETRAINED", "UnsupportedCheckpoint", "Architecture", "resolve", "read"]

#: Published models of the ``chgnet`` wheel: name -> path under its package folder.
PRETRAINED = {
    "0.3.0": "pretrained/0.3.0/chgnet_0.3.0_e29f68s314m37.pth.tar",
    "0.2.0": "pretrained/0.2.0/chgnet_0.2.0_e30f77s348m32.pth.tar",
    "r2scan": "pretrained/r2scan/chgnet_r2scan_transfer_learning_e15f36s161m23.pth.tar",
}

#: Elements of chgnet's embedding and composition model: atomic numbers 1 to 94.
N_ELEMENTS = 94

# model_args chgnet reads, with the values jaxdd's CHGNet implements (None: any value; the
# weights' shapes decide). Keys not listed here and not in _IGNORED are refused.
_IMPLEMENTED = {
    "atom_fea_dim": None, "bond_fea_dim": None, "angle_fea_dim": None, "num_radial": None, "num_angular": None,
    "n_conv": None, "atom_conv_hidden_dim": None, "bond_conv_hidden_dim": None, "angle_layer_hidden_dim": None,
    "mlp_hidden_dims": None, "atom_graph_cutoff": None, "bond_graph_cutoff": None, "cutoff_coeff": None,
    "composition_model": None, "learnable_rbf": None,
    "update_bond": (True,), "update_angle": (True,), "mlp_first": (True,), "is_intensive": (True,),
    "non_linearity": ("silu",), "gMLP_norm": ("layer", None), "readout_norm": ("layer", None),
    "conv_norm": (None,), "final_mlp": ("MLP", "normal"),
    # Only in training (dropout) or on the host (graph conversion): no effect on the numbers.
    "conv_dropout": None, "mlp_dropout": None, "graph_converter_algorithm": None, "converter_verbose": None,
    "version": None,
    # Read by chgnet only when mlp_first is False (refused above).
    "read_out": None, "num_heads": None,
}
# Keys chgnet accepts in **kwargs and never reads.
_IGNORED = frozenset({"skip_connection", "cutofff_coeff"})


class UnsupportedCheckpoint(ValueError):
    """A CHGNet checkpoint uses an option that jaxdd's CHGNet does not implement."""


def resolve(name_or_path) -> str:
    """The checkpoint file of a published model's name, or ``name_or_path`` as a path.

    Args:
      name_or_path: ``"0.3.0"``, ``"0.2.0"`` or ``"r2scan"`` (case-insensitive), or the path
        of a CHGNet ``.pth.tar`` written by chgnet's trainer or ``torch.save``.

    Returns:
      the file's path.

    Raises:
      FileNotFoundError: a name whose ``chgnet`` distribution is not installed, or a path that
        does not exist.
    """
    return carrier.carried_file(name_or_path, PRETRAINED, "chgnet", "CHGNet")


def _refuse(source, what):
    raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r} uses {what}, which jaxdd's CHGNet does not implement; "
                                "load it with chgnet itself")


def _check_options(args, source):
    """UnsupportedCheckpoint naming the first option of ``model_args`` that is not implemented."""
    for key, value in args.items():
        if key in _IGNORED:
            continue
        if key not in _IMPLEMENTED:
            _refuse(source, f"the option {key}={value!r}")
        allowed = _IMPLEMENTED[key]
        if allowed is not None and value not in allowed:
            _refuse(source, f"{key}={value!r} (implemented: {', '.join(repr(v) for v in allowed)})")
    if not isinstance(args.get("composition_model", "MPtrj"), str | None):
        _refuse(source, f"a composition model of type {type(args['composition_model']).__name__} (only AtomRef)")


def _mlp(state, prefix, source):
    """The linear layers ``[(W [out, in], b [out] or None), ...]`` of chgnet's ``MLP`` at
    ``prefix`` (``<prefix>.layers.<i>``), in order; an activation sits between consecutive ones."""
    found = {}
    for key in state:
        m = re.fullmatch(re.escape(prefix) + r"\.layers\.(\d+)\.weight", key)
        if m:
            found[int(m.group(1))] = key
    if not found:
        raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r} has no weights {prefix}.layers.*")
    layers = []
    for i in sorted(found):
        bias = state.get(f"{prefix}.layers.{i}.bias")
        layers.append((np.asarray(state[found[i]], np.float64), None if bias is None else np.asarray(bias, np.float64)))
    return layers


def _norm(state, prefix):
    """``(weight, bias)`` of a LayerNorm at ``prefix``, or None where there is none."""
    if f"{prefix}.weight" not in state:
        return None
    return (np.asarray(state[f"{prefix}.weight"], np.float64), np.asarray(state[f"{prefix}.bias"], np.float64))


def _gated(state, prefix, source, norm):
    """A ``GatedMLP``: its core and gate MLPs and, with ``norm``, their two LayerNorms."""
    out = {"core": _mlp(state, f"{prefix}.mlp_core", source), "gate": _mlp(state, f"{prefix}.mlp_gate", source)}
    if norm:
        out["norm_core"], out["norm_gate"] = _norm(state, f"{prefix}.bn1"), _norm(state, f"{prefix}.bn2")
        if out["norm_core"] is None or out["norm_gate"] is None:
            raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r} says gMLP_norm='layer' but has no "
                                        f"{prefix}.bn1/bn2")
    return out


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The static structure a CHGNet checkpoint describes (hashable: the model's static field).

    atom_cutoff: the atom graph's cutoff r_a (Å). bond_cutoff: the bond graph's r_b (Å).
    envelope_p: the exponent p of the polynomial envelope (``cutoff_coeff``). n_conv: atom
    convolutions (bond convolutions and angle updates: ``n_conv - 1``). gated_norm: whether
    the gated MLPs normalise (LayerNorm) before their activations. readout_norm: whether a
    LayerNorm precedes the readout. mlp_out_bias: whether the convolutions' output linears
    have biases (0.2.0). composition: whether an AtomRef reference energy is added. version:
    the checkpoint's version (``model_args['version']``, the published name, or None).
    source: the file.
    """

    atom_cutoff: float
    bond_cutoff: float
    envelope_p: float
    n_conv: int
    gated_norm: bool
    readout_norm: bool
    mlp_out_bias: bool
    composition: bool
    version: str | None
    source: str


def read(name_or_path):
    """Architecture and weights of a CHGNet checkpoint, for the :class:`CHGNet` constructor.

    Args:
      name_or_path: a published model's name or a checkpoint path (:func:`resolve`).

    Returns:
      ``(arch, weights)``: the :class:`Architecture` and the weights as float64 numpy arrays
      (linear weights ``[out, in]`` as torch stores them).

    Raises:
      FileNotFoundError: see :func:`resolve`.
      UnsupportedCheckpoint: an option that is not implemented, or weights that do not match
        the options.
      ValueError: a file that is not a CHGNet checkpoint.
    """
    source = resolve(name_or_path)
    # chgnet's trainer saves {"model": {"state_dict", "model_args"}, ...}; CHGNet.as_dict() is the inner dict.
    inner = pth.load_dict(source, ("state_dict", "model_args"), "a CHGNet checkpoint", inside="model")
    args, state = dict(inner["model_args"]), dict(inner["state_dict"])
    _check_options(args, source)

    n_conv = int(args.get("n_conv", 4))
    if n_conv < 2:
        _refuse(source, f"n_conv={n_conv} (the magnetic moments are read after the last but one of at least 2)")
    gated_norm = args.get("gMLP_norm", "layer") is not None

    def f64(key):
        if key not in state:
            raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r} has no {key} in its state dict")
        return np.asarray(state[key], np.float64)

    extra = sorted(k for k in state if k.startswith("composition_model.") and k != "composition_model.fc.weight")
    if extra:
        _refuse(source, f"a composition model with weights {extra[:3]} (only AtomRef, composition_model.fc.weight)")
    composition = "composition_model.fc.weight" in state
    atomref = f64("composition_model.fc.weight").reshape(-1) if composition else np.zeros(N_ELEMENTS)
    embedding = f64("atom_embedding.embedding.weight")
    if embedding.shape[0] != N_ELEMENTS or atomref.shape != (N_ELEMENTS,):
        raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r} embeds {embedding.shape[0]} elements and references "
                                    f"{atomref.shape[0]}; chgnet's models have {N_ELEMENTS}")
    bias_key = "atom_conv_layers.0.mlp_out.layers.1.bias"

    weights = {
        "embedding": embedding,
        "atomref": atomref,
        "rbf_atom": f64("bond_basis_expansion.rbf_expansion_ag.frequencies"),
        "rbf_bond": f64("bond_basis_expansion.rbf_expansion_bg.frequencies"),
        "fourier": f64("angle_basis_expansion.fourier_expansion.frequencies"),
        "bond_embedding": f64("bond_embedding.weight"),
        "bond_weights_atom": f64("bond_weights_ag.weight"),
        "bond_weights_bond": f64("bond_weights_bg.weight"),
        "angle_embedding": f64("angle_embedding.weight"),
        "atom_conv": [{"gated": _gated(state, f"atom_conv_layers.{t}.twoBody_atom", source, gated_norm),
                       "out": _mlp(state, f"atom_conv_layers.{t}.mlp_out", source)} for t in range(n_conv)],
        "bond_conv": [{"gated": _gated(state, f"bond_conv_layers.{t}.twoBody_bond", source, gated_norm),
                       "out": _mlp(state, f"bond_conv_layers.{t}.mlp_out", source)} for t in range(n_conv - 1)],
        "angle_update": [{"gated": _gated(state, f"angle_layers.{t}.twoBody_bond", source, gated_norm)}
                         for t in range(n_conv - 1)],
        "site_wise": (f64("site_wise.weight"), f64("site_wise.bias")),
        "readout_norm": _norm(state, "readout_norm"),
        "readout": _mlp(state, "mlp", source),
    }
    readout_norm = args.get("readout_norm", "layer") is not None
    if readout_norm != (weights["readout_norm"] is not None):
        raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r}: readout_norm={args.get('readout_norm')!r} but the "
                                    f"state dict {'lacks' if readout_norm else 'has'} readout_norm weights")
    if weights["readout_norm"] is None:
        del weights["readout_norm"]
    if 2 * weights["fourier"].size + 1 != weights["angle_embedding"].shape[1]:
        raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r}: {weights['fourier'].size} Fourier frequencies do "
                                    f"not make the angle embedding's {weights['angle_embedding'].shape[1]} inputs")
    arch = Architecture(atom_cutoff=float(args.get("atom_graph_cutoff", 6.0)),
                        bond_cutoff=float(args.get("bond_graph_cutoff", 3.0)),
                        envelope_p=float(args.get("cutoff_coeff", 8)), n_conv=n_conv, gated_norm=gated_norm,
                        readout_norm=readout_norm, mlp_out_bias=bias_key in state, composition=composition,
                        version=args.get("version", _published_name(source)), source=source)
    if not 0 < arch.bond_cutoff <= arch.atom_cutoff:
        raise UnsupportedCheckpoint(f"CHGNet checkpoint {source!r}: bond_graph_cutoff {arch.bond_cutoff} must be "
                                    f"positive and at most atom_graph_cutoff {arch.atom_cutoff}")
    return arch, weights


def _published_name(source) -> str | None:
    """The published model's name when ``source`` is one of the wheel's files, else None."""
    for name, rel in PRETRAINED.items():
        if str(source).endswith(rel):
            return name
    return None
