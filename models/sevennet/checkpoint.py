"""SevenNet checkpoints: finding the published ones, reading any of them without torch, and
turning the configuration and state dict into :class:`~jaxdd.models.sevennet.SevenNet`'s settings
and weights.

The published checkpoints ship in the ``sevenn`` wheel (``sevenn/pretrained_potentials/``). Its
package is found without importing it (importing ``sevenn`` imports torch), so a ``sevenn``
installed with ``pip install --no-deps sevenn`` is enough: a carrier of the files.

Options of the architecture that none of the published checkpoints uses are refused by name
(:class:`UnsupportedCheckpoint`), never approximated.
"""

from __future__ import annotations

import dataclasses

import math

import numpy as np

from jaxdd.interop import carrier, pth

from ..mace import irreps as ir
from ..mace.layers import conv_tp_irreps

__all__ = ["PRETRAINED", "UnsupportedCheckpoint", "resolve", "read"]

#: Published checkpoints of the ``sevenn`` wheel: name -> path under its package folder.
PRETRAINED = {
    "7net-0": "pretrained_potentials/SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth",
    "7net-l3i5": "pretrained_potentials/SevenNet_l3i5/checkpoint_l3i5.pth",
    "7net-mf-0": "pretrained_potentials/SevenNet_MF_0/checkpoint_sevennet_mf_0.pth",
}
# sevenn's own spellings of the same files.
_ALIASES = {"sevennet-0": "7net-0", "7net-0_11july2024": "7net-0", "sevennet-0_11july2024": "7net-0",
            "sevennet-l3i5": "7net-l3i5", "sevennet-mf-0": "7net-mf-0"}


class UnsupportedCheckpoint(ValueError):
    """A SevenNet checkpoint uses an option that jaxdd's SevenNet does not implement."""


def resolve(name_or_path) -> str:
    """The checkpoint file of a published model's name, or ``name_or_path`` as a path.

    Args:
      name_or_path: ``"7net-0"``, ``"7net-l3i5"``, ``"7net-mf-0"`` (case-insensitive; sevenn's
        ``"SevenNet-0"`` spellings too), or the path of a SevenNet ``.pth``.

    Returns:
      the file's path.

    Raises:
      FileNotFoundError: a name whose ``sevenn`` distribution is not installed, or a path that
        does not exist.
    """
    return carrier.carried_file(name_or_path, PRETRAINED, "sevenn", "SevenNet", aliases=_ALIASES)


def _version(config) -> tuple:
    parts = str(config.get("version", "0.0.0")).split(".")
    head = tuple(int(p) for p in parts[:3] if p.isdigit())
    return head + (parts[3] if len(parts) > 3 else "",)


def _refuse(source, what, hint):
    raise UnsupportedCheckpoint(f"SevenNet checkpoint {source!r} uses {what}, which jaxdd's SevenNet does not "
                                f"implement; {hint}")


def _check_options(config, source):
    """UnsupportedCheckpoint naming the first option none of the published models uses."""
    convert = "convert it to the published layout with sevenn, or load it with sevenn itself"
    if config.get("_model_type", "E3_equivariant_model") != "E3_equivariant_model":
        _refuse(source, f"model type {config['_model_type']!r}", convert)
    if config.get("interaction_type", "nequip") != "nequip":
        _refuse(source, f"interaction_type {config['interaction_type']!r}", convert)
    sc = config.get("self_connection_type", "linear")
    if any(t != "linear" for t in ([sc] if isinstance(sc, str) else sc)):
        _refuse(source, f"self_connection_type {sc!r} (only 'linear' is implemented)", convert)
    if config.get("readout_as_fcn", False):
        _refuse(source, "readout_as_fcn: True (an MLP readout)", convert)
    if config.get("use_bias_in_linear", False):
        _refuse(source, "use_bias_in_linear: True", convert)
    if config.get("is_parity", False):
        _refuse(source, "is_parity: True (O(3) features with odd irreps)", convert)
    if not config.get("_normalize_sph", False):
        _refuse(source, "_normalize_sph: False (harmonics of unnormalised edge vectors)", convert)
    if (config.get("cuequivariance_config") or {}).get("use", False):
        _refuse(source, "a cuEquivariance layout (cuequivariance_config.use: True)",
                "save it again without cuEquivariance (sevenn's e3nn layout)")
    for flag, what in (("use_flash_tp", "FlashTP"), ("use_oeq", "OpenEquivariance")):
        if config.get(flag, False):
            _refuse(source, f"a {what} layout ({flag}: True)", f"save it again without {what}")
    basis = dict(config.get("radial_basis", {}))
    if basis.get("radial_basis_name", "bessel") != "bessel":
        _refuse(source, f"radial basis {basis['radial_basis_name']!r} (only 'bessel')", convert)
    cutoff = dict(config.get("cutoff_function", {}))
    if cutoff.get("cutoff_function_name") not in ("XPLOR", "poly_cut"):
        _refuse(source, f"cutoff function {cutoff.get('cutoff_function_name')!r} (only 'XPLOR' and 'poly_cut')",
                convert)
    for key in ("act_radial",):
        if config.get(key, "silu") != "silu":
            _refuse(source, f"{key} {config[key]!r} (only silu)", convert)
    for key in ("act_scalar", "act_gate"):
        if dict(config.get(key, {"e": "silu"})).get("e", "silu") != "silu":
            _refuse(source, f"{key} {config[key]!r} (only silu on even scalars)", convert)
    if int(config.get("lmax_edge", -1)) > 0 and int(config["lmax_edge"]) != int(config["lmax"]):
        _refuse(source, f"lmax_edge {config['lmax_edge']} different from lmax {config['lmax']}", convert)


def _layer_irreps(config):
    """Node irreps before each layer and after the last, as ``(mul, l, 1)`` tuples."""
    n_layers = int(config["num_convolution_layer"])
    manual = config.get("irreps_manual", False)
    if manual:
        irreps = [ir.parse(text) for text in manual]
    else:  # sevenn's default: `channel` copies of every l <= lmax, scalars only after the last layer
        ch, lmax = int(config["channel"]), int(config.get("lmax_node", -1))
        lmax = lmax if lmax > 0 else int(config["lmax"])
        hidden = tuple((ch, l, 1) for l in range(lmax + 1))
        irreps = [((ch, 0, 1),)] + [hidden] * (n_layers - 1) + [((ch, 0, 1),)]
    if len(irreps) != n_layers + 1 or any(p != 1 for x in irreps for _, _, p in x):
        raise UnsupportedCheckpoint(f"irreps_manual {manual!r} needs {n_layers + 1} entries of even irreps")
    return irreps


def _shift_scale(value, n_types, n_modal, what, source):
    """``value`` (a number, one per type, or one per modality and type) as ``[n_modal or 1, n_types]``."""
    arr = np.asarray(value, np.float64)
    if arr.ndim == 0:
        arr = np.full((1, n_types), float(arr))
    elif arr.ndim == 1 and arr.shape[0] == n_types:
        arr = arr[None]
    elif arr.ndim == 1 and arr.shape[0] == 1:
        arr = np.full((1, n_types), float(arr[0]))
    elif not (arr.ndim == 2 and arr.shape == (n_modal, n_types)):
        raise UnsupportedCheckpoint(f"SevenNet checkpoint {source!r}: {what} of shape {arr.shape} fits neither "
                                    f"{n_types} types nor {n_modal} modalities x {n_types} types")
    return arr


def _conv_columns(irreps_x, sh, target, state, prefix, version, source):
    """The last weight-network layer ``[hidden, numel]`` with its columns in the order of
    :func:`~jaxdd.models.mace.layers.conv_tp_irreps`'s (sorted) instructions.

    Checkpoints written before sevenn 0.11 keep the columns in the order the paths are found
    (input irrep, harmonic, output degree), and some of them store Wigner 3j blocks of the
    opposite sign: those paths' columns are negated, as sevenn's own loader does.
    """
    mids, by_output = conv_tp_irreps(irreps_x, sh, tuple((1, l, p) for l, p in target))
    # sevenn < 0.11 found each path once, by input irrep, then harmonic, then output degree.
    by_loop = sorted(by_output, key=lambda ins: (ins[0], ins[1], mids[ins[2]][1]))
    layers = sorted(k for k in state if k.startswith(f"{prefix}.weight_nn.layer") and k.endswith(".weight"))
    w = np.asarray(state[layers[-1]], np.float64)
    numel = sum(irreps_x[i][0] for i, _, _, _ in by_loop)
    if w.shape[1] != numel:
        raise UnsupportedCheckpoint(f"SevenNet checkpoint {source!r}: {layers[-1]} has {w.shape[1]} columns, the "
                                    f"convolution's paths need {numel}")
    old = version[:3] < (0, 11, 0) or (version[:3] == (0, 11, 0) and version[3] == "dev0")
    if not old:
        return w
    blocks, start = {}, 0
    for ins in by_loop:
        i, j, k, _ = ins
        mul = irreps_x[i][0]
        block = w[:, start:start + mul]
        start += mul
        l1, l2, l3 = irreps_x[i][1], sh[j][1], mids[k][1]
        key = f"{prefix}.convolution._compiled_main_left_right._w3j_{l1}_{l2}_{l3}"
        if l1 > 0 and l2 > 0 and l3 > 0 and key in state:
            stored, ours = np.asarray(state[key], np.float64), ir.wigner_3j(l1, l2, l3)
            if np.allclose(stored, -ours, atol=1e-6):
                block = -block
            elif not np.allclose(stored, ours, atol=1e-6):
                raise UnsupportedCheckpoint(f"SevenNet checkpoint {source!r}: {key} is not e3nn's Wigner 3j symbol")
        blocks[ins] = block
    return np.concatenate([blocks[t] for t in by_output], axis=1)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The static structure a SevenNet checkpoint describes (hashable: the model's static field).

    species: atomic numbers, in the order of the type one-hot. cutoff: r_c (Å). irreps: each
    layer's node irreps, ``((mul, l, parity), ...)``, the last the readout's input. lmax_sh:
    the edges' highest harmonic. targets: per layer, the ``(l, parity)`` its convolution makes.
    cutoff_function: sevenn's cutoff function as sorted ``(key, value)`` pairs. n_modalities:
    fidelities of a multi-fidelity checkpoint (0 for one). modal_inputs: the linears the
    modality's one-hot is appended to. modal: the fidelity run (None for one). source: the file.
    """

    species: tuple
    cutoff: float
    irreps: tuple
    lmax_sh: int
    targets: tuple
    cutoff_function: tuple
    n_modalities: int
    modal_inputs: tuple
    modal: str | None
    source: str


def read(name_or_path, modal=None):
    """Architecture and weights of a SevenNet checkpoint, for the :class:`SevenNet` constructor.

    Args:
      name_or_path: a published model's name or a ``.pth`` path (:func:`resolve`).
      modal: for a multi-fidelity checkpoint, the modality (fidelity) to run; required there,
        refused elsewhere.

    Returns:
      ``(arch, weights)``: the :class:`Architecture` and the weights as numpy arrays.
    """
    source = resolve(name_or_path)
    checkpoint = pth.load_dict(source, ("config", "model_state_dict"), "a SevenNet checkpoint")
    config, state = dict(checkpoint["config"]), dict(checkpoint["model_state_dict"])
    _check_options(config, source)
    version = _version(config)
    if version[:3] < (0, 10, 0):  # sevenn's names before 0.10
        state = {k.replace("denumerator", "denominator"): v for k, v in state.items()}

    type_map = {int(z): int(t) for z, t in dict(config["_type_map"]).items()}
    species = tuple(z for z, _ in sorted(type_map.items(), key=lambda zt: zt[1]))
    n_types = len(species)
    modal_map = dict(config.get("_modal_map") or {}) if config.get("use_modality", False) else {}
    modalities = tuple(sorted(modal_map, key=modal_map.get))
    if modalities:
        if modal is None or modal not in modal_map:
            said = "no modal" if modal is None else f"modal {modal!r}"
            raise ValueError(f"SevenNet checkpoint {source!r} is multi-fidelity and was given {said}; choose "
                             f"modal= one of {list(modalities)}")
        modal_index = modal_map[modal]
    elif modal is not None:
        raise ValueError(f"SevenNet checkpoint {source!r} has one fidelity; drop modal={modal!r}")
    else:
        modal_index = None
    modal_inputs = {key: bool(modalities) and bool(config.get(f"use_modal_{key}", False))
                    for key in ("node_embedding", "self_inter_intro", "self_inter_outro", "output_block")}

    irreps = _layer_irreps(config)
    lmax_sh = int(config["lmax"]) if int(config.get("lmax_edge", -1)) <= 0 else int(config["lmax_edge"])
    sh = tuple((1, l, 1) for l in range(lmax_sh + 1))
    n_modal = len(modalities)
    shift = _shift_scale(state["rescale_atomic_energy.shift"], n_types, n_modal, "shift", source)
    scale = _shift_scale(state["rescale_atomic_energy.scale"], n_types, n_modal, "scale", source)
    row = lambda arr: arr[modal_index if arr.shape[0] > 1 else 0]  # noqa: E731

    def f64(key):
        return np.asarray(state[key], np.float64)

    layers = []
    for t in range(len(irreps) - 1):
        p = f"{t}_"
        last = t == len(irreps) - 2
        lmax_out = max(l for _, l, _ in irreps[t + 1])
        target = {(l1 + l2 - d, 1) for _, l1, _ in irreps[t] for _, l2, _ in sh
                  for d in range(2 * min(l1, l2) + 1) if l1 + l2 - d <= lmax_out}
        target = {(0, 1)} if last else target
        hidden = sorted(k for k in state if k.startswith(f"{p}convolution.weight_nn.layer"))
        radial = [f64(k) for k in hidden[:-1]]
        radial.append(_conv_columns(irreps[t], sh, target, state, f"{p}convolution", version, source))
        layers.append({
            "self_connection": f64(f"{p}self_connection_intro.linear.weight"),
            "linear_1": f64(f"{p}self_interaction_1.linear.weight"),
            "radial": radial,
            "denominator": float(np.asarray(state[f"{p}convolution.denominator"]).reshape(-1)[0]),
            "linear_2": f64(f"{p}self_interaction_2.linear.weight"),
            "target": tuple(sorted(target)),
        })
    arch = Architecture(species=species, cutoff=float(config["cutoff"]), irreps=tuple(irreps), lmax_sh=lmax_sh,
                        targets=tuple(layer.pop("target") for layer in layers),
                        cutoff_function=tuple(sorted(dict(config["cutoff_function"]).items())),
                        n_modalities=n_modal, modal_inputs=tuple(sorted(k for k, v in modal_inputs.items() if v)),
                        modal=modal, source=source)
    weights = {
        "bessel": f64("edge_embedding.basis_function.coeffs"),
        "embedding": f64("onehot_to_feature_x.linear.weight"),
        "layers": layers,
        "readout": [f64("reduce_input_to_hidden.linear.weight"), f64("reduce_hidden_to_energy.linear.weight")],
        "shift": row(shift),
        "scale": row(scale),
        "modal": (np.eye(n_modal)[modal_index] if n_modal else np.zeros(0)),
    }
    if not all(math.isfinite(d) and d > 0 for d in (layer["denominator"] for layer in layers)):
        raise ValueError(f"SevenNet checkpoint {source!r} has a non-positive convolution denominator")
    return arch, weights
