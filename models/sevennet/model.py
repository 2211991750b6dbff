"""SevenNet (Park et al., J. Chem. Theory Comput. 20, 4857 (2024)): a NequIP-style potential, run
with the weights of its published checkpoints.

With atoms as nodes and the neighbour list (cutoff r_c = 5 Å) as edges ``j -> i`` along
``r_ij = r_j - r_i``:

* node attributes: the one-hot of the atom's type (the checkpoint's own type map, 89 elements
  in alphabetical order of their symbols); initial features ``x_i = Linear(onehot_i)``, scalars;
* edges: spherical harmonics ``Y(r̂_ij)`` up to ``lmax`` ("component" normalisation, every
  irrep even: the model is SO(3)-equivariant only) and 8 Bessel functions
  ``(2/r_c) sin(c_n r)/r`` with trained frequencies ``c_n``, times the XPLOR switch
  (r_on 4.5 Å) or the polynomial cutoff (p = 6);
* each of the 5 layers::

      sc_i = Linear_sc(x_i)
      h_i  = Linear_1(x_i)
      m_i  = Σ_j W(basis_ij) ⊙ (h_j ⊗ Y(r̂_ij)) / denominator     uvu tensor product
      x_i  ← Gate(Linear_2(m_i) + sc_i)                           silu on scalars and gates

  where W is a bias-free MLP ``[8, 64, 64, paths]`` with normalised silu and ``denominator``
  the checkpoint's constant (about 36 for the published models);
* readout: ``e_i = Linear(Linear(x_i))`` (128 -> 64 -> 1 scalars) and
  ``E_i = scale[type_i] · e_i + shift[type_i]``; ``E = Σ_i E_i``.

A multi-fidelity checkpoint (SevenNet-MF-0) appends the one-hot of the chosen modality to the
inputs of ``Linear_1``, ``Linear_2`` and the first readout linear, and shifts per modality.

The layers follow e3nn for PyTorch's normalisations (:mod:`jaxdd.models.mace.layers`), so the
checkpoint's weights apply unchanged.
"""

from __future__ import annotations


import e3nn_jax as e3nn
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.model.base import ModelConfig
from jaxdd.model.species import SpeciesModel

from ..mace.edges import edge_sum
from ..mace.radial import polynomial_cutoff
from ..species import cast_params, edge_lengths, weights_dtype
from ..mace.layers import Linear, TensorProduct, conv_tp_irreps, radial_mlp, split, uvu_messages
from ..mace.nonlinear import gate, gate_irreps
from . import checkpoint as ckpt

__all__ = ["SevenNet", "E3NN_TORCH_SILU_CONSTANT"]

#: The constant e3nn for PyTorch normalises silu with (``normalize2mom``: the inverse root of
#: the mean of silu(z)² over one million normal samples of its seeded generator). It differs
#: from the exact value (1.6765...) by about 1e-4, so the published weights need this one.
E3NN_TORCH_SILU_CONSTANT = 1.6791767923989418


class _Layer:
    """Static structure of layer ``t`` (irreps, paths, linears), built from the architecture."""

    def __init__(self, model, t):
        x_in, x_out = model.arch.irreps[t], model.arch.irreps[t + 1]
        sh = tuple((1, l, 1) for l in range(model.arch.lmax_sh + 1))
        modal = ((model.arch.n_modalities, 0, 1),)
        self.gate_in = gate_irreps(x_out)[0]
        self.x_out = x_out
        self.modal_1 = "self_inter_intro" in model.arch.modal_inputs
        self.modal_2 = "self_inter_outro" in model.arch.modal_inputs
        self.self_connection = Linear(x_in, self.gate_in)
        self.linear_1 = Linear(x_in + (modal if self.modal_1 else ()), x_in)
        mid, ins = conv_tp_irreps(x_in, sh, tuple((1, l, p) for l, p in model.arch.targets[t]))
        self.conv = TensorProduct(x_in, sh, mid, ins)
        self.linear_2 = Linear(mid + (modal if self.modal_2 else ()), self.gate_in)


def _with_modal(x, onehot, use):
    """``x [n, d]`` with the modality's one-hot appended to every row when ``use``."""
    if not use:
        return x
    return jnp.concatenate([x, jnp.broadcast_to(onehot.astype(x.dtype), (x.shape[0], onehot.shape[0]))], axis=-1)


class SevenNet(eqx.Module, SpeciesModel):
    """SevenNet with a checkpoint's weights: energy, atomic energies, forces and stress.

    Build it with :meth:`from_checkpoint`. Outputs: ``energy [S]`` (eV), ``atomic_energies
    [V]`` (eV, zero on padding atoms), and, by autodiff, ``forces [V, 3]`` (eV/Å) and ``stress
    [S, 3, 3]`` (eV/Å³). ``arch`` is the checkpoint's static
    :class:`~jaxdd.models.sevennet.checkpoint.Architecture` (layers, harmonics, cutoff function,
    fidelity, source file).
    """

    params: dict
    species: tuple = eqx.field(static=True)
    arch: ckpt.Architecture = eqx.field(static=True)
    edge_block: int | None = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, arch: ckpt.Architecture, weights: dict, *, skin: float = 0.0, edge_block=None,
                 dtype=jnp.float64):
        """Use :meth:`from_checkpoint`; this takes what :func:`~.checkpoint.read` returns."""
        self.species = arch.species
        self.arch = arch
        self.edge_block = edge_block
        self.model_config = self.energy_config(arch.cutoff, skin=skin)
        self._check_sizes(weights)
        self.params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), weights)

    @classmethod
    def from_checkpoint(cls, name_or_path, *, modal=None, skin: float = 0.0, edge_block=None,
                        dtype=jnp.float64) -> "SevenNet":
        """SevenNet with the configuration and weights of a checkpoint, read without torch.

        Args:
          name_or_path: ``"7net-0"``, ``"7net-l3i5"`` or ``"7net-mf-0"`` (the files of the
            installed ``sevenn`` distribution; ``pip install --no-deps sevenn`` is enough), or
            the path of a SevenNet ``.pth`` checkpoint.
          modal: the fidelity of a multi-fidelity checkpoint (``"PBE"`` or ``"R2SCAN"`` for
            7net-mf-0); required there and refused elsewhere.
          skin: extra neighbour-search range (Å) so dynamics can keep a list for several steps
            (pairs beyond the cutoff are masked; the numbers do not depend on it).
          edge_block: edges per block of the convolutions' sums (None: the backend's default,
            :func:`~jaxdd.models.mace.edges.default_edge_block`); bounds their memory.
          dtype: of the weights (float64 or float32); the computation follows the positions'.

        Returns:
          the :class:`SevenNet`.

        Raises:
          FileNotFoundError: an unknown name, a missing file, or a name whose ``sevenn`` is not
            installed.
          UnsupportedCheckpoint: an option of the architecture that is not implemented.
          ValueError: ``modal`` missing or unknown (the message lists the modalities).
        """
        dt = weights_dtype(dtype, "SevenNet.from_checkpoint")
        arch, weights = ckpt.read(name_or_path, modal)
        return cls(arch, weights, skin=skin, edge_block=edge_block, dtype=dt)

    # ------------------------------------------------------------------ structure

    def layers(self):
        """Static structure of each layer (irreps, paths, linears).

        Returns:
          list of one structure per layer.
        """
        return [_Layer(self, t) for t in range(len(self.arch.irreps) - 1)]

    @property
    def modalities_in_embedding(self) -> bool:
        """True when the modality's one-hot is appended to the type one-hot (no published model)."""
        return "node_embedding" in self.arch.modal_inputs

    def _linears(self):
        n_types = len(self.species)
        modal = ((self.arch.n_modalities, 0, 1),)
        x = self.arch.irreps[-1]
        hidden = ((_dim(x) // 2, 0, 1),)
        embedding = Linear(((n_types, 0, 1),) + (modal if self.modalities_in_embedding else ()), self.arch.irreps[0])
        readout = (Linear(x + (modal if "output_block" in self.arch.modal_inputs else ()), hidden),
                   Linear(hidden, ((1, 0, 1),)))
        return embedding, readout

    def _check_sizes(self, weights):
        """ValueError naming the first weight whose size disagrees with the architecture."""
        embedding, readout = self._linears()
        expected = [("embedding", embedding.numel, weights["embedding"].size)]
        for t, (layer, w) in enumerate(zip(self.layers(), weights["layers"])):
            expected += [(f"layer {t} self_connection", layer.self_connection.numel, w["self_connection"].size),
                         (f"layer {t} linear_1", layer.linear_1.numel, w["linear_1"].size),
                         (f"layer {t} weight network", layer.conv.numel, w["radial"][-1].shape[-1]),
                         (f"layer {t} linear_2", layer.linear_2.numel, w["linear_2"].size)]
        expected += [("readout 1", readout[0].numel, weights["readout"][0].size),
                     ("readout 2", readout[1].numel, weights["readout"][1].size)]
        for name, want, got in expected:
            if want != got:
                raise ckpt.UnsupportedCheckpoint(f"SevenNet checkpoint {self.arch.source!r}: {name} has {got} weights, "
                                                 f"the architecture read from its configuration needs {want}")

    # ------------------------------------------------------------------ jaxdd model interface

    def validate_input(self, data) -> None:
        z = np.asarray(data.atomic_numbers)[np.asarray(data.atom_mask)]
        bad = np.flatnonzero(~np.isin(z, self.species))
        if bad.size:
            rows = np.flatnonzero(np.asarray(data.atom_mask))[bad]
            symbols = sorted({_symbol(v) for v in z[bad].tolist()})
            raise ValueError(f"atoms {rows[:8].tolist()} are {symbols}, elements SevenNet checkpoint "
                             f"{self.arch.source!r} was not trained on (it knows {len(self.species)} elements); use a "
                             "checkpoint that covers them")

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        n = positions.shape[0]
        p = cast_params(self.params, dt)
        onehot = jax.nn.one_hot(kind, len(self.species), dtype=dt)
        embedding, readout = self._linears()
        x = embedding(p["embedding"], _with_modal(onehot, p["modal"], self.modalities_in_embedding))
        edges = self._edges(p, positions, cell, batch_idx, neighbors)

        for layer, w in zip(self.layers(), p["layers"]):
            sc = layer.self_connection(w["self_connection"], x)
            h = layer.linear_1(w["linear_1"], _with_modal(x, p["modal"], layer.modal_1))

            def messages(rows, _, w=w, layer=layer):  # of a block of b edges: [b, dim(mid)]
                weights = radial_mlp(w["radial"], rows["basis"], E3NN_TORCH_SILU_CONSTANT)
                return uvu_messages(layer.conv, weights, rows["source"], rows["sh"])

            # The senders' features, one array per irrep, gathered for every edge before the
            # blocks: the gradient of a slice of one wide array is a padded copy of it, and the
            # sum of those padded copies (one per path) cost more than the rest of the layer.
            source = [b[neighbors.senders] for b in split(layer.conv.irreps_in1, h)]
            rows = {"basis": edges["basis"], "sh": edges["sh"], "source": source}
            m = edge_sum(messages, rows, neighbors.receivers, n, (), self.edge_block) / w["denominator"]
            y = layer.linear_2(w["linear_2"], _with_modal(m, p["modal"], layer.modal_2)) + sc
            x = gate(layer.x_out, y, E3NN_TORCH_SILU_CONSTANT, E3NN_TORCH_SILU_CONSTANT, jax.nn.silu)

        e = readout[0](p["readout"][0], _with_modal(x, p["modal"], "output_block" in self.arch.modal_inputs))
        e = readout[1](p["readout"][1], e)[:, 0]
        return e * p["scale"][kind] + p["shift"][kind]

    def _edges(self, p, positions, cell, batch_idx, neighbors):
        """Per edge: harmonics ``sh [E, (lmax+1)²]`` and the enveloped radial basis ``basis [E, 8]``
        (zero on padding edges and pairs beyond the cutoff)."""
        dt = positions.dtype
        rc = self.cutoff
        vec, r, inside = edge_lengths(positions, cell, batch_idx, neighbors, rc)  # vec: sender minus receiver
        unit = jnp.where(inside[:, None], vec, jnp.asarray([0.0, 0.0, 1.0], dt))
        sh = e3nn.spherical_harmonics(e3nn.Irreps.spherical_harmonics(self.arch.lmax_sh), unit, normalize=True,
                                      normalization="component").array
        bessel = (2.0 / rc) * jnp.sin(p["bessel"] * r[:, None]) / r[:, None]
        envelope = _envelope(dict(self.arch.cutoff_function), r, rc)
        return {"sh": sh, "basis": jnp.where(inside[:, None], bessel * envelope[:, None], 0.0)}


def _envelope(options, r, rc):
    """The cutoff function: XPLOR's switch from ``cutoff_on`` to ``rc``, or the polynomial of
    degree ``poly_cut_p_value``."""
    if options["cutoff_function_name"] == "XPLOR":
        r_on = float(options["cutoff_on"])
        r2, on2, c2 = r * r, r_on * r_on, rc * rc
        switch = (c2 - r2) ** 2 * (c2 + 2 * r2 - 3 * on2) / (c2 - on2) ** 3
        return jnp.where(r < r_on, 1.0, switch)
    return polynomial_cutoff(r, rc, int(options.get("poly_cut_p_value", 6)))


def _dim(irreps) -> int:
    """The dimension Σ mul·(2l+1) of ``irreps``."""
    return sum(m * (2 * l + 1) for m, l, _ in irreps)


def _symbol(z: int) -> str:
    import ase.data

    return ase.data.chemical_symbols[z] if 0 < z < len(ase.data.chemical_symbols) else f"Z={z}"
