"""MACE: higher-order equivariant message passing (Batatia et al., NeurIPS 2022), in JAX.

With atoms as nodes and the neighbour list (cutoff r_max, Å) as edges ``j -> i`` along
``r_ij = r_i - r_j``:

* node attributes: one-hot element ``z_i``; initial features ``h_i = Linear(z_i)`` (scalars);
* edges: spherical harmonics ``Y(r̂_ij)`` up to ``max_ell`` ("component" normalisation) and
  ``num_bessel`` radial functions (Bessel ``sqrt(2/r_max) sin(nπr/r_max)/r``, Gaussian or
  Chebyshev; of the length or of a distance transform of it, :mod:`.radial`) times the
  polynomial cutoff of degree ``num_polynomial_cutoff``;
* each interaction (:mod:`.blocks`)::

      A_i = Linear(Σ_j R(r_ij) ⊙ (Linear_up(h_j) ⊗ Y(r̂_ij))) / avg_num_neighbors  (or / density_i)
      sc_i = h_i ⊗ z_i                                   (residual: element-wise self-connection)

  then the equivariant product basis: ``h_i = Linear(SymmetricContraction_{z_i}(A_i)) + sc_i``,
  products of A_i with itself up to ``correlation`` (3 = four-body messages per layer);
* readouts: a linear one of each layer's features, a gated MLP of the last layer's scalars;
  ``E_i = E0[z_i] + scale · (ZBL_i + Σ_layers readout) + shift`` (``ScaleShiftMACE``; plain
  ``MACE`` has scale 1 and shift 0; ``ZBL_i`` the optional pair repulsion) and ``E = Σ_i E_i``.

The layers follow e3nn for PyTorch's normalisations (:mod:`.layers`), so the weights of a model
trained with mace-torch apply unchanged (:func:`MACE.from_torch`).
"""

from __future__ import annotations

import os

import ase.data

import e3nn_jax as e3nn
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.model.base import ModelConfig
from jaxdd.model.species import SpeciesModel
from jaxdd.neighbors import edge_vectors

from .. import species as species_lib
from ..species import weights_dtype
from . import irreps as ir
from . import radial as rad
from .blocks import INTERACTIONS, READOUTS, Layer
from .layers import Linear, normalized_silu_constant, symmetric_basis, symmetrize_basis
from .convert import select_head, weights_from_state_dict
from .torch_import import is_export, load_export, read, save_export

__all__ = ["MACE", "INTERACTIONS", "export_torch"]


class MACE(eqx.Module, SpeciesModel):
    """MACE potential: energy, atomic energies, forces and stress.

    species: atomic numbers, in the order of the one-hot element encoding. r_max: cutoff (Å).
    num_bessel, num_polynomial_cutoff: radial basis and envelope degree. max_ell: degree of the
    edge harmonics. hidden_irreps: node features between layers (e.g. ``"16x0e + 16x1o"``; equal
    multiplicities). mlp_irreps: hidden scalars of the last readout. num_interactions: layers.
    correlation: body order of each product (int or one per layer). interaction /
    interaction_first: block of the later / first layer (:data:`INTERACTIONS`). radial_mlp: hidden
    widths of the radial network. avg_num_neighbors: message normalisation. radial_type: basis
    (:data:`~.radial.RADIAL_TYPES`). distance_transform: None, ``"Agnesi"`` or ``"Soft"``.
    apply_cutoff: envelope the basis (True) or the radial network's output. pair_repulsion: add
    ZBL. edge_irreps, use_edge_irreps_first: irreps of the convolution (None: the node
    features'). readout: of the last layer (:data:`~.blocks.READOUTS`). atomic_energies: E0
    per element (eV). scale, shift: of the atomic interaction energies (eV). skin: extra
    neighbour-search range (Å) that lets dynamics keep a list for several steps (pairs beyond
    r_max are masked; the numbers do not depend on it). edge_block: edges per block of the
    convolution's sum (:func:`~.edges.edge_sum`; None:
    :func:`~.edges.default_edge_block`), which bounds its memory; the numbers do not depend on
    it beyond rounding. seed: random weights
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
    radial_type: str = eqx.field(static=True)
    distance_transform: str | None = eqx.field(static=True)
    apply_cutoff: bool = eqx.field(static=True)
    pair_repulsion: bool = eqx.field(static=True)
    edge_irreps: tuple | None = eqx.field(static=True)
    use_edge_irreps_first: bool = eqx.field(static=True)
    readout: str = eqx.field(static=True)
    edge_block: int | None = eqx.field(static=True)
    act_constant: float = eqx.field(static=True)
    gate_constants: tuple = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, species=(1, 6, 8), r_max: float = 5.0, *, num_bessel: int = 8,
                 num_polynomial_cutoff: int = 5, max_ell: int = 3, hidden_irreps="16x0e + 16x1o",
                 mlp_irreps="16x0e", num_interactions: int = 2, correlation=3,
                 interaction: str = INTERACTIONS[0], interaction_first: str | None = None,
                 radial_mlp=(64, 64, 64), avg_num_neighbors: float = 8.0, radial_type: str = "bessel",
                 distance_transform: str | None = None, apply_cutoff: bool = True, pair_repulsion: bool = False,
                 edge_irreps=None, use_edge_irreps_first: bool = False, readout: str = READOUTS[0],
                 atomic_energies=None, scale: float = 1.0, shift: float = 0.0, skin: float = 0.0, edge_block=None,
                 seed: int = 0, dtype=jnp.float64, _weights=None, _act_constant=None, _gate_constants=None):
        owner = "MACE"
        dtype = weights_dtype(dtype, owner)
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
        self.edge_block = None if edge_block is None else integral(f"{owner} edge_block", edge_block, minimum=1)
        self.avg_num_neighbors = species_lib.check_positive(avg_num_neighbors, "avg_num_neighbors", owner)
        self.act_constant = float(normalized_silu_constant() if _act_constant is None else _act_constant)
        self.gate_constants = tuple(map(float, _gate_constants or (normalized_silu_constant(),
                                                                   normalized_silu_constant(jax.nn.sigmoid))))
        _check_options(self, owner, radial_type, distance_transform, apply_cutoff, pair_repulsion, edge_irreps,
                       use_edge_irreps_first, readout)
        self.model_config = self.energy_config(r_max, skin=skin)
        n_el = len(self.species)
        e0 = np.zeros(n_el) if atomic_energies is None else np.asarray(atomic_energies, np.float64).reshape(-1)
        if e0.shape != (n_el,) or not np.all(np.isfinite(e0)):
            raise ValueError(f"{owner} atomic_energies needs {n_el} finite values (eV), one per species, got {atomic_energies!r}")
        if _weights is None:
            params, bases = self._random_weights(seed)
        else:
            params, bases = _weights
        params = dict(_default_edge_params(self, r_max), **params)
        params.update(atomic_energies=e0, scale=np.float64(scale), shift=np.float64(shift))
        self.params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
        # Stored as monomial coefficients (layers.symmetrize_basis) of each U_ν.
        self.bases = [[[jnp.asarray(symmetrize_basis(u, l), dtype) for u in us]
                       for us, (_, l, _) in zip(layer_bases, layer.out)]
                      for layer_bases, layer in zip(bases, self.layers())]

    # ------------------------------------------------------------------ structure and weights

    def layers(self):
        """Static structure of each layer (irreps, paths, weight sizes).

        Returns:
          list of :class:`~.blocks.Layer`, one per interaction.
        """
        return [Layer(self, t) for t in range(self.num_interactions)]

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
            if layer.nonlinear:
                conv = layer.block.random_weights(layer, normal)
            else:
                conv = {"linear_up": normal((layer.linear_up.numel,)),
                        "radial": [normal((a, b)) for a, b in zip(layer.radial_sizes[:-1], layer.radial_sizes[1:])],
                        "linear": normal((layer.linear.numel,)), "skip_tp": normal((layer.skip_tp.numel,))}
            params["layers"].append({
                **conv,
                **({"density": normal((self.num_bessel, 1))} if layer.density else {}),
                **({"readout_bias": [normal((k,)) for k in layer.readout_biases]} if layer.readout_biases else {}),
                "contractions": [[normal((n_el, u.shape[-1], n_s), 1 / u.shape[-1]) for u in reversed(us)]
                                 for us in layer_bases],
                "product_linear": normal((layer.product_linear.numel,)),
                "readout": [normal((lin.numel,)) for lin in layer.readout],
            })
        return params, bases

    @classmethod
    def from_torch(cls, source, *, head=None, config=None, skin: float = 0.0, edge_block=None,
                   dtype=jnp.float64) -> "MACE":
        """A MACE with the configuration and weights of a mace-torch model.

        Variants that are not MACE as described above (other interaction blocks, gates,
        embeddings, ...) are refused by name (:class:`~jaxdd.models.mace.UnsupportedModel`). A
        file that cannot be a model (missing, empty, truncated, of another kind) raises
        FileNotFoundError or ValueError naming it.

        Args:
          source: a mace-torch ``MACE`` / ``ScaleShiftMACE`` object, a file saved from one
            (``torch.save(model)``, mace's ``.model``), or a ``.npz`` written by
            :func:`export_torch` (needs no torch).
          head: for a model with several heads, the one to keep (its readouts, E0s, scale and
            shift); a multi-head model without it is refused with the list of its heads.
          config: for a state-dict file only, the keyword arguments mace-torch's model was built
            with (refused otherwise).
          skin, edge_block: as in the constructor.
          dtype: of the weights, floating.

        Returns:
          the :class:`MACE`.
        """
        dtype = weights_dtype(dtype, "MACE.from_torch")
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
        settings, state = select_head(settings, state, head, source)
        weights = weights_from_state_dict(cls, settings, state)
        return cls(**settings, skin=skin, edge_block=edge_block, dtype=dtype, _weights=weights,
                   _act_constant=act_constant)

    # ------------------------------------------------------------------ jaxdd model interface

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        n = positions.shape[0]
        params = species_lib.cast_params(self.params, dt)
        bases = species_lib.cast_params(self.bases, dt)
        attrs = jax.nn.one_hot(kind, len(self.species), dtype=dt)
        edges = _edge_features(self, params, positions, cell, batch_idx, neighbors, kind)

        n_s = ir.count(self.hidden_irreps, 0, 1)
        feats = Linear(((len(self.species), 0, 1),), ((n_s, 0, 1),))(params["embedding"], attrs)
        node_inter = jnp.zeros((n,), dt)
        if self.pair_repulsion:
            node_inter = jax.ops.segment_sum(edges["zbl"], edges["receivers"], num_segments=n)
        for layer, p_layer, layer_bases in zip(self.layers(), params["layers"], bases):
            feats, energy = layer(p_layer, layer_bases, feats, attrs, kind, len(self.species), edges, self)
            node_inter = node_inter + energy

        return params["atomic_energies"][kind] + params["scale"] * node_inter + params["shift"]


def _check_options(model, owner, radial_type, distance_transform, apply_cutoff, pair_repulsion, edge_irreps,
                   use_edge_irreps_first, readout):
    """Set the radial, pair and readout options of ``model``; ValueError naming a bad one."""
    if radial_type not in rad.RADIAL_TYPES:
        raise ValueError(f"{owner} radial_type must be one of {rad.RADIAL_TYPES}, got {radial_type!r}")
    if radial_type == "gaussian" and model.num_bessel < 2:
        raise ValueError(f"{owner} radial_type 'gaussian' needs num_bessel >= 2 (its width is r_max / (n - 1))")
    if distance_transform in ("None", None):
        distance_transform = None
    elif distance_transform not in rad.DISTANCE_TRANSFORMS:
        raise ValueError(f"{owner} distance_transform must be None or one of {rad.DISTANCE_TRANSFORMS}, "
                         f"got {distance_transform!r}")
    if readout not in READOUTS:
        raise ValueError(f"{owner} readout must be one of {READOUTS}, got {readout!r}")
    for name, flag in (("apply_cutoff", apply_cutoff), ("pair_repulsion", pair_repulsion),
                       ("use_edge_irreps_first", use_edge_irreps_first)):
        if not isinstance(flag, (bool, np.bool_)):
            raise ValueError(f"{owner} {name} must be True or False, got {flag!r}")
    edge = None if edge_irreps is None else ir.parse(edge_irreps)
    if edge is not None and (not edge or edge[0][1:] != (0, 1)):
        raise ValueError(f"{owner} edge_irreps must start with scalars 0e, got {edge_irreps!r}")
    model.radial_type, model.distance_transform, model.readout = radial_type, distance_transform, readout
    model.apply_cutoff, model.pair_repulsion = bool(apply_cutoff), bool(pair_repulsion)
    model.edge_irreps, model.use_edge_irreps_first = edge, bool(use_edge_irreps_first)


def _default_edge_params(model, r_max):
    """The untrained constants of the radial basis, the distance transform and ZBL (mace-torch's)."""
    out = {}
    if model.radial_type == "bessel":
        out["bessel_weights"] = np.pi / r_max * np.arange(1, model.num_bessel + 1)
    elif model.radial_type == "gaussian":
        out["gaussian_weights"] = np.linspace(0.0, r_max, model.num_bessel)
    if model.distance_transform is not None:
        out["transform"] = rad.default_transform_params(model.distance_transform)
    if model.distance_transform is not None or model.pair_repulsion:
        out["covalent_radii"] = np.asarray(ase.data.covalent_radii)[list(model.species)]
    if model.pair_repulsion:
        out["zbl"] = rad.default_zbl_params()
    return out


def _edge_features(model, params, positions, cell, batch_idx, neighbors, kind):
    """Per edge: ``senders``, ``receivers``, ``inside`` (a real edge within the cutoff), harmonics
    ``sh``, radial basis ``feats`` (enveloped unless ``apply_cutoff`` is off, when ``cutoff``
    carries the envelope) and ``zbl`` energies."""
    dt = positions.dtype
    rc = model.model_config.neighbor_config.cutoff
    senders, receivers = neighbors.senders, neighbors.receivers
    # MACE's edge vector points from the sender to the receiver: r_i - r_j.
    vec = -edge_vectors(positions, cell, batch_idx, neighbors)
    r2 = jnp.sum(vec * vec, axis=-1)
    inside = neighbors.mask & (r2 < rc * rc)
    r = jnp.sqrt(jnp.where(inside, r2, 1.0))  # safe norm on padding edges
    unit = jnp.where(inside[:, None], vec, jnp.asarray([0.0, 0.0, 1.0], dt))
    sh = e3nn.spherical_harmonics(e3nn.Irreps.spherical_harmonics(model.max_ell), unit, normalize=True,
                                  normalization="component").array
    cutoff = jnp.where(inside, rad.polynomial_cutoff(r, rc, model.num_polynomial_cutoff), 0.0)
    ks, kr = kind[senders], kind[receivers]
    x = r
    if model.distance_transform == "Agnesi":
        t = params["transform"]
        rcov = params["covalent_radii"]
        x = rad.agnesi(r, 0.5 * (rcov[ks] + rcov[kr]), t["a"], t["q"], t["p"])
    elif model.distance_transform == "Soft":
        rcov = params["covalent_radii"]
        x = rad.soft(r, rcov[ks] + rcov[kr], params["transform"]["alpha"])
    if model.radial_type == "bessel":
        basis = rad.bessel(x, params["bessel_weights"], rc)
    elif model.radial_type == "gaussian":
        basis = rad.gaussian(x, params["gaussian_weights"], rc)
    else:
        basis = rad.chebyshev(x, model.num_bessel)
    out = {"senders": senders, "receivers": receivers, "sh": sh, "inside": inside}
    if model.apply_cutoff:
        out.update(feats=basis * cutoff[:, None], cutoff=None)
    else:
        out.update(feats=jnp.where(inside[:, None], basis, 0.0), cutoff=cutoff)
    if model.pair_repulsion:
        z = jnp.asarray(model.species, dt)
        rcov = params["covalent_radii"]
        e = rad.zbl_edge_energy(r, z[ks], z[kr], rcov[ks], rcov[kr], params["zbl"], model.num_polynomial_cutoff)
        out["zbl"] = jnp.where(inside, e, 0.0)
    return out


def export_torch(source, path, config=None) -> str:
    """Write a mace-torch model's configuration and weights to ``path`` (``.npz``), which
    :meth:`MACE.from_torch` reads without torch (every head of a multi-head model is kept; pick
    one when loading). The model is checked (variants refused) before anything is written.

    Args:
      source: a mace-torch model object or a file saved from one.
      path: the ``.npz`` to write.
      config: for a state-dict file only, the keyword arguments the model was built with.

    Returns:
      the path written.
    """
    if not os.fspath(path).endswith(".npz"):  # before the (slow) read, not after it
        raise ValueError(f"export_torch: path must name a .npz file; got {os.fspath(path)!r}")
    settings, state, act_constant = read(source, config)
    for head in settings.get("heads") or [None]:  # refuse here, not on the machine that loads it
        weights_from_state_dict(MACE, *select_head(settings, state, head, source))
    return save_export(path, settings, state, act_constant)
