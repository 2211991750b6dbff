"""MACE: higher-order equivariant message passing (Batatia et al., NeurIPS 2022), in JAX.

With atoms as nodes and the neighbour list (cutoff r_max, Å) as edges ``j -> i`` along
``r_ij = r_i - r_j``:

* node attributes: one-hot element ``z_i``; initial features ``h_i = Linear(z_i)`` (scalars);
* edges: spherical harmonics ``Y(r̂_ij)`` up to ``max_ell`` ("component" normalisation) and
  ``num_bessel`` Bessel functions ``sqrt(2/r_max) sin(nπr/r_max)/r`` times the polynomial
  cutoff of degree ``num_polynomial_cutoff``;
* each interaction (``RealAgnosticResidualInteractionBlock`` or ``RealAgnosticInteractionBlock``)::

      A_i = Linear(Σ_j R(r_ij) ⊙ (Linear_up(h_j) ⊗ Y(r̂_ij))) / avg_num_neighbors
      sc_i = h_i ⊗ z_i                                   (residual: element-wise self-connection)

  then the equivariant product basis: ``h_i = Linear(SymmetricContraction_{z_i}(A_i)) + sc_i``,
  products of A_i with itself up to ``correlation`` (3 = four-body messages per layer);
* readouts: a linear one of each layer's features, a gated MLP of the last layer's scalars;
  ``E_i = E0[z_i] + scale · Σ_layers readout + shift`` (``ScaleShiftMACE``; plain ``MACE`` has
  scale 1 and shift 0) and ``E = Σ_i E_i``.

The layers follow e3nn for PyTorch's normalisations (:mod:`.layers`), so the weights of a model
trained with mace-torch apply unchanged (:func:`MACE.from_torch`).
"""

from __future__ import annotations

import math
import os

import e3nn_jax as e3nn
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.spec.model import BaseModel, ModelConfig, ModelOutputs, NeighborConfig
from jaxdd.neighbors import edge_vectors

from .. import species as species_lib
from ..nequip import polynomial_envelope
from . import irreps as ir
from .layers import Linear, TensorProduct, conv_tp_irreps, normalized_silu_constant, radial_mlp, split, \
    symmetric_basis, symmetric_contraction, symmetrize_basis
from .torch_import import INTERACTIONS, UnsupportedModel, is_export, load_export, read, save_export

__all__ = ["MACE", "INTERACTIONS", "export_torch"]


def _float_dtype(dtype, owner):
    """``dtype`` as a numpy dtype; ValueError naming ``dtype`` unless it is a floating one."""
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    # The weights are cast to it: an integer or bool dtype would truncate them without a word.
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        got = dt.name if dt is not None else repr(dtype)
        raise ValueError(f"{owner} dtype must be a floating dtype (float32 or float64), got {got}; "
                         "the weights are cast to it, and an integer or bool dtype would truncate them")
    return dt


class _Layer:
    """Static structure of one interaction + product + readout (built at trace time)."""

    def __init__(self, model, t):
        n_el = len(model.species)
        attrs = ((n_el, 0, 1),)
        sh = ir.spherical_harmonics_irreps(model.max_ell)
        hidden = model.hidden_irreps
        n_s = ir.count(hidden, 0, 1)
        last = t == model.num_interactions - 1
        self.residual = model.interactions[t] == INTERACTIONS[0]
        self.feats_in = ((n_s, 0, 1),) if t == 0 else hidden
        sh_inter = sh
        if t > 0 and ir.count(hidden, 0, -1) > 0:
            sh_inter = tuple((1, l, p) for l in range(model.max_ell + 1) for p in (1, -1))
        source = sh if t == 0 else sh_inter
        self.target = ir.simplify(ir.sort(tuple((n_s, l, p) for _, l, p in source))[0])
        # The last layer keeps its scalars only (mace-torch's hidden_irreps[0]).
        self.out = (hidden[0],) if last else hidden
        self.linear_up = Linear(self.feats_in, self.feats_in)
        mid, ins = conv_tp_irreps(self.feats_in, sh, self.target)
        self.conv_tp = TensorProduct(self.feats_in, sh, mid, ins)
        self.linear = Linear(mid, self.target)
        if self.residual:
            self.skip_tp = TensorProduct.fully_connected(self.feats_in, attrs, self.out)
        else:
            self.skip_tp = TensorProduct.fully_connected(self.target, attrs, self.target)
        self.radial_sizes = (model.num_bessel,) + model.radial_mlp + (self.conv_tp.numel,)
        self.product_linear = Linear(self.out, self.out)
        # A gated MLP reads the last layer when there are several, a linear map every other.
        self.readout = (Linear(self.out, ((1, 0, 1),)),) if not (last and t > 0) else (
            Linear(self.out, model.mlp_irreps), Linear(model.mlp_irreps, ((1, 0, 1),)))


class MACE(eqx.Module, BaseModel):
    """MACE potential: energy, atomic energies, forces and stress.

    species: atomic numbers, in the order of the one-hot element encoding. r_max: cutoff (Å).
    num_bessel, num_polynomial_cutoff: radial basis and envelope degree. max_ell: degree of the
    edge harmonics. hidden_irreps: node features between layers (e.g. ``"16x0e + 16x1o"``; equal
    multiplicities). mlp_irreps: hidden scalars of the last readout. num_interactions: layers.
    correlation: body order of each product (int or one per layer). interaction /
    interaction_first: block of the later / first layer (:data:`INTERACTIONS`). radial_mlp: hidden
    widths of the radial network. avg_num_neighbors: message normalisation. atomic_energies: E0
    per element (eV). scale, shift: of the atomic interaction energies (eV). skin: extra
    neighbour-search range (Å) that lets dynamics keep a list for several steps (pairs beyond
    r_max are masked; the numbers do not depend on it). seed: random weights
    from ``jax.random.PRNGKey(seed)``. dtype: parameter dtype; the computation follows the
    positions' dtype.

    Outputs: ``energy [S]`` (eV), ``atomic_energies [V]`` (eV, zero on padding atoms), and, by
    autodiff, ``forces [V, 3]`` (eV/Å) and ``stress [S, 3, 3]`` (eV/Å³).
    """

    params: dict
    bases: list  # symmetric-contraction bases per layer and output irrep, as monomial coefficients (constants)
    species: tuple = eqx.field(static=True)
    max_ell: int = eqx.field(static=True)
    num_bessel: int = eqx.field(static=True)
    num_polynomial_cutoff: int = eqx.field(static=True)
    hidden_irreps: tuple = eqx.field(static=True)
    mlp_irreps: tuple = eqx.field(static=True)
    num_interactions: int = eqx.field(static=True)
    correlation: tuple = eqx.field(static=True)
    interactions: tuple = eqx.field(static=True)
    radial_mlp: tuple = eqx.field(static=True)
    avg_num_neighbors: float = eqx.field(static=True)
    act_constant: float = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, species=(1, 6, 8), r_max: float = 5.0, *, num_bessel: int = 8,
                 num_polynomial_cutoff: int = 5, max_ell: int = 3, hidden_irreps="16x0e + 16x1o",
                 mlp_irreps="16x0e", num_interactions: int = 2, correlation=3,
                 interaction: str = INTERACTIONS[0], interaction_first: str | None = None,
                 radial_mlp=(64, 64, 64), avg_num_neighbors: float = 8.0, atomic_energies=None,
                 scale: float = 1.0, shift: float = 0.0, skin: float = 0.0, seed: int = 0,
                 dtype=jnp.float64, _weights=None, _act_constant=None):
        owner = "MACE"
        dtype = _float_dtype(dtype, owner)
        self.species = species_lib.check_species(species, owner)
        r_max = species_lib.check_cutoff(r_max, owner)
        self.num_bessel = integral(f"{owner} num_bessel", num_bessel, minimum=1)
        self.num_polynomial_cutoff = integral(f"{owner} num_polynomial_cutoff", num_polynomial_cutoff, minimum=1)
        self.max_ell = integral(f"{owner} max_ell", max_ell, minimum=0)
        self.num_interactions = integral(f"{owner} num_interactions", num_interactions, minimum=1)
        self.hidden_irreps = ir.parse(hidden_irreps)
        self.mlp_irreps = ir.parse(mlp_irreps)
        muls = {m for m, _, _ in self.hidden_irreps}
        if not self.hidden_irreps or self.hidden_irreps[0][1:] != (0, 1) or len(muls) != 1:
            raise ValueError(f"{owner} hidden_irreps must start with scalars 0e and have one multiplicity for every irrep "
                             f"(the product basis contracts channels irrep by irrep), got {hidden_irreps!r}")
        if any((l, p) != (0, 1) for _, l, p in self.mlp_irreps):
            raise ValueError(f"{owner} mlp_irreps must be scalars 0e, got {mlp_irreps!r}")
        corr = (correlation,) * self.num_interactions if np.ndim(correlation) == 0 else tuple(correlation)
        if len(corr) != self.num_interactions:
            raise ValueError(f"{owner} correlation needs one order per interaction ({self.num_interactions}), got {correlation!r}")
        self.correlation = tuple(integral(f"{owner} correlation", c, minimum=1) for c in corr)
        first = interaction if interaction_first is None else interaction_first
        for name in (interaction, first):
            if name not in INTERACTIONS:
                raise ValueError(f"{owner} interaction {name!r} is not supported; choose one of {INTERACTIONS}")
        self.interactions = (first,) + (interaction,) * (self.num_interactions - 1)
        self.radial_mlp = tuple(integral(f"{owner} radial_mlp", h, minimum=1) for h in radial_mlp)
        self.avg_num_neighbors = float(avg_num_neighbors)
        if not (math.isfinite(self.avg_num_neighbors) and self.avg_num_neighbors > 0):
            raise ValueError(f"{owner} avg_num_neighbors must be positive, got {avg_num_neighbors!r}")
        self.act_constant = float(normalized_silu_constant() if _act_constant is None else _act_constant)
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "atomic_energies", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}),
            neighbor_config=NeighborConfig(cutoff=r_max, skin=skin),
        )
        n_el = len(self.species)
        e0 = np.zeros(n_el) if atomic_energies is None else np.asarray(atomic_energies, np.float64).reshape(-1)
        if e0.shape != (n_el,) or not np.all(np.isfinite(e0)):
            raise ValueError(f"{owner} atomic_energies needs {n_el} finite values (eV), one per species, got {atomic_energies!r}")
        if _weights is None:
            params, bases = self._random_weights(seed)
        else:
            params, bases = _weights
        params = dict(params, atomic_energies=e0, scale=np.float64(scale), shift=np.float64(shift),
                      bessel_weights=params.get("bessel_weights", np.pi / r_max * np.arange(1, self.num_bessel + 1)))
        self.params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
        # Stored as monomial coefficients (layers.symmetrize_basis) of each U_ν.
        self.bases = [[[jnp.asarray(symmetrize_basis(u, l), dtype) for u in us]
                       for us, (_, l, _) in zip(layer_bases, layer.out)]
                      for layer_bases, layer in zip(bases, self.layers())]

    # ------------------------------------------------------------------ structure and weights

    def layers(self):
        """Static structure of each layer (irreps, paths, weight sizes)."""
        return [_Layer(self, t) for t in range(self.num_interactions)]

    def _random_weights(self, seed):
        key = [jax.random.PRNGKey(seed)]

        def normal(shape, scale=1.0):
            # Drawn in float32 (the zoo's convention): one seed is the same model in either precision.
            key[0], sub = jax.random.split(key[0])
            return np.asarray(jax.random.normal(sub, shape, jnp.float32), np.float64) * scale

        n_el, n_s = len(self.species), ir.count(self.hidden_irreps, 0, 1)
        params = {"embedding": normal((n_el * n_s,)), "layers": []}
        bases = []
        for t, layer in enumerate(self.layers()):
            coupling = tuple((1, l, p) for _, l, p in layer.target)
            layer_bases = [[symmetric_basis(coupling, l, p, nu) for nu in range(1, self.correlation[t] + 1)]
                           for _, l, p in layer.out]
            bases.append(layer_bases)
            params["layers"].append({
                "linear_up": normal((layer.linear_up.numel,)),
                "radial": [normal((a, b)) for a, b in zip(layer.radial_sizes[:-1], layer.radial_sizes[1:])],
                "linear": normal((layer.linear.numel,)),
                "skip_tp": normal((layer.skip_tp.numel,)),
                "contractions": [[normal((n_el, u.shape[-1], n_s), 1 / u.shape[-1]) for u in reversed(us)]
                                 for us in layer_bases],
                "product_linear": normal((layer.product_linear.numel,)),
                "readout": [normal((lin.numel,)) for lin in layer.readout],
            })
        return params, bases

    @classmethod
    def from_torch(cls, source, *, config=None, skin: float = 0.0, dtype=jnp.float64) -> "MACE":
        """A MACE with the configuration and weights of a mace-torch model.

        Variants that are not MACE as described above (other interaction blocks, gates, radial
        bases, heads, ...) are refused by name (:class:`~jaxdd.models.mace.UnsupportedModel`). A
        file that cannot be a model (missing, empty, truncated, of another kind) raises
        FileNotFoundError or ValueError naming it.

        Args:
          source: a mace-torch ``MACE`` / ``ScaleShiftMACE`` object, a file saved from one
            (``torch.save(model)``, mace's ``.model``), or a ``.npz`` written by
            :func:`export_torch` (needs no torch).
          config: for a state-dict file only, the keyword arguments mace-torch's model was built
            with (refused otherwise).
          skin: as in the constructor.
          dtype: of the weights, floating.
        """
        dtype = _float_dtype(dtype, "MACE.from_torch")
        if isinstance(source, (str, os.PathLike)) and is_export(source):
            if config is not None:
                # config holds mace-torch constructor arguments, for a state dict only; the
                # export's own configuration is complete and in jaxdd's terms.
                raise ValueError(f"MACE.from_torch: config is for a mace-torch state-dict file only; "
                                 f"{os.fspath(source)!r} is a .npz export, which carries its own "
                                 "configuration: drop config=")
            settings, state, act_constant = load_export(source)
        else:
            settings, state, act_constant = read(source, config)
        weights = _weights_from_state_dict(cls, settings, state)
        return cls(**settings, skin=skin, dtype=dtype, _weights=weights, _act_constant=act_constant)

    # ------------------------------------------------------------------ jaxdd model interface

    @property
    def distribution_spec(self):
        from jaxdd.spec import SPEC_MPNN_HALO

        return SPEC_MPNN_HALO

    def validate_input(self, data) -> None:
        species_lib.validate_species(data, self.species, "MACE")

    def adapt_input(self, data, **kwargs) -> dict:
        return species_lib.neighbor_inputs(data, "MACE")

    def forward(self, positions, cell, batch_idx, atomic_numbers, atom_mask, neighbors, n_systems):
        dt = positions.dtype
        n = positions.shape[0]
        rc = self.model_config.neighbor_config.cutoff
        params = jax.tree_util.tree_map(lambda p: p.astype(dt), self.params)
        bases = jax.tree_util.tree_map(lambda p: p.astype(dt), self.bases)
        table = jnp.asarray(species_lib.species_table(self.species))
        kind = table[jnp.clip(atomic_numbers, 0, table.size - 1)]
        attrs = jax.nn.one_hot(kind, len(self.species), dtype=dt)
        senders, receivers = neighbors.senders, neighbors.receivers

        # MACE's edge vector points from the sender to the receiver: r_i - r_j.
        vec = -edge_vectors(positions, cell, batch_idx, neighbors)
        r2 = jnp.sum(vec * vec, axis=-1)
        inside = neighbors.mask & (r2 < rc * rc)
        r = jnp.sqrt(jnp.where(inside, r2, 1.0))  # safe norm on padding edges
        unit = jnp.where(inside[:, None], vec, jnp.asarray([0.0, 0.0, 1.0], dt))
        sh = e3nn.spherical_harmonics(e3nn.Irreps.spherical_harmonics(self.max_ell), unit, normalize=True,
                                      normalization="component").array
        envelope = jnp.where(inside, polynomial_envelope(r / rc, self.num_polynomial_cutoff), 0.0)
        bessel = math.sqrt(2.0 / rc) * jnp.sin(params["bessel_weights"] * r[:, None]) / r[:, None]
        radial = bessel * envelope[:, None]  # [E, num_bessel], zero on padding edges

        n_s = ir.count(self.hidden_irreps, 0, 1)
        feats = Linear(((len(self.species), 0, 1),), ((n_s, 0, 1),))(params["embedding"], attrs)
        node_inter = jnp.zeros((n,), dt)
        for layer, p_layer, layer_bases in zip(self.layers(), params["layers"], bases):
            sc = layer.skip_tp(p_layer["skip_tp"], feats, attrs) if layer.residual else None
            up = layer.linear_up(p_layer["linear_up"], feats)
            weights = radial_mlp(p_layer["radial"], radial, self.act_constant)  # [E, numel]
            messages = layer.conv_tp(weights, up[senders], sh)
            aggregated = jax.ops.segment_sum(messages, receivers, num_segments=n)
            a = layer.linear(p_layer["linear"], aggregated) / self.avg_num_neighbors
            if not layer.residual:
                a = layer.skip_tp(p_layer["skip_tp"], a, attrs)
            # [n, channels, Σ(2l+1)]: the irreps of A side by side, channel-major.
            a = jnp.concatenate(split(layer.target, a), axis=-1)
            products = [symmetric_contraction(us, ws, a, kind, len(self.species))
                        for us, ws in zip(layer_bases, p_layer["contractions"])]
            feats = layer.product_linear(p_layer["product_linear"], jnp.concatenate(products, axis=-1))
            if sc is not None:
                feats = feats + sc
            if len(layer.readout) == 1:
                node_inter = node_inter + layer.readout[0](p_layer["readout"][0], feats)[:, 0]
            else:
                hidden = jax.nn.silu(layer.readout[0](p_layer["readout"][0], feats)) * self.act_constant
                node_inter = node_inter + layer.readout[1](p_layer["readout"][1], hidden)[:, 0]

        atomic = params["atomic_energies"][kind] + params["scale"] * node_inter + params["shift"]
        atomic = jnp.where(atom_mask, atomic, 0.0)
        energy = jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)
        return {"energy": energy, "atomic_energies": atomic}

    def adapt_output(self, raw, data) -> ModelOutputs:
        return ModelOutputs(raw)


def _weights_from_state_dict(cls, config, sd):
    """(params, bases) in MACE's layout from a mace-torch state dict, every shape checked
    against the structure the configuration gives."""
    skeleton = cls(**config, dtype=np.float32, _weights=({}, []))  # structure only

    def take(key, shape):
        if key not in sd:
            raise UnsupportedModel(f"mace-torch state dict has no {key!r}; is this a MACE model?")
        value = np.asarray(sd[key], np.float64)
        if value.shape != tuple(shape):
            raise UnsupportedModel(f"mace-torch weight {key!r} has shape {value.shape}, but the configuration "
                                   f"read from the model needs {tuple(shape)}")
        return value

    n_el = len(config["species"])
    n_s = ir.count(skeleton.hidden_irreps, 0, 1)
    params = {"embedding": take("node_embedding.linear.weight", (n_el * n_s,)), "layers": [],
              "bessel_weights": take("radial_embedding.bessel_fn.bessel_weights", (config["num_bessel"],))}
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
        params["layers"].append({
            "linear_up": take(pre + "linear_up.weight", (layer.linear_up.numel,)),
            "radial": [take(f"{pre}conv_tp_weights.layer{k}.weight", (a, b))
                       for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))],
            "linear": take(pre + "linear.weight", (layer.linear.numel,)),
            "skip_tp": take(pre + "skip_tp.weight", (layer.skip_tp.numel,)),
            "contractions": contractions,
            "product_linear": take(f"products.{t}.linear.weight", (layer.product_linear.numel,)),
            "readout": [take(f"readouts.{t}.{name}.weight", (lin.numel,)) for name, lin in zip(names, layer.readout)],
        })
    return params, bases


def export_torch(source, path, config=None) -> str:
    """Write a mace-torch model's configuration and weights to ``path`` (``.npz``), which
    :meth:`MACE.from_torch` reads without torch. source, config: as for ``from_torch``. The
    model is checked (variants refused) before anything is written. Returns the path."""
    if not os.fspath(path).endswith(".npz"):  # before the (slow) read, not after it
        raise ValueError(f"export_torch: path must name a .npz file; got {os.fspath(path)!r}")
    settings, state, act_constant = read(source, config)
    _weights_from_state_dict(MACE, settings, state)  # refuse here, not on the machine that loads it
    return save_export(path, settings, state, act_constant)
