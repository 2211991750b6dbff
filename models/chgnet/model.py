"""CHGNet (Deng et al., Nature Machine Intelligence 5, 1031 (2023)): a crystal graph network with
bonds and angles, run with the weights of its published models.

Atoms are nodes; the atom graph's edges are the neighbours within r_a (6 Å for 0.3.0 and
r2scan, 5 Å for 0.2.0), the bond graph's nodes the bonds shorter than r_b (3 Å), its edges
the angles between two bonds of one atom. With ``r_ij = |x_j - x_i + S·cell|``:

* inputs: ``h_i = Embedding[Z_i - 1]`` (94 elements); per edge the enveloped Bessel basis
  ``g(r) = sqrt(2/r_c) sin(f_n r/r_c)/r · u(r/r_c)`` at ``r_c = r_a`` and at ``r_c = r_b``,
  with trained frequencies ``f_n`` and GemNet's polynomial envelope ``u`` of degree p = 8 (5
  for 0.2.0); edge features ``e_ij = W_e g_a(r_ij)``, atom-graph weights ``w_ij = W_a g_a(r_ij)``,
  bond-graph weights ``v_ij = W_b g_b(r_ij)``; per angle θ between bonds ``ij`` and ``ik``
  (``θ = acos(0.999999 cos θ)``) ``a_jik = W_t [1/√2, sin(f_k θ), cos(f_k θ)]/√π``;
* ``n_conv = 4`` atom convolutions; after each of the first three, a bond convolution and an
  angle update::

      h_i  ← h_i + L(Σ_j G([h_i, e_ij, h_j]) ⊙ w_ij)
      e_ij ← e_ij + L'(Σ_{k≠j} G([e_ij, e_ik, a_jik, h_i]) ⊙ v_ij ⊙ v_ik + (the same at j))
      a_jik ← a_jik + G([e_ij, e_ik, a_jik, h_i])

  where ``G(x) = silu(LN(MLP(x))) · sigmoid(LN(MLP'(x)))`` is a gated MLP (no LayerNorms in
  0.2.0) and L, L' linear maps (with biases in 0.2.0, which chgnet adds to every edge's
  features, bond or not, in a structure that has at least one angle);
* magnetic moments after the third atom convolution: ``m_i = |w·h_i + b|`` (μB);
* energy: ``E_i = MLP(LN(h_i)) + E_ref[Z_i]`` (readout MLP [64, 64, 64] with SiLU; ``E_ref``
  the composition model, AtomRef's per-element energies), ``E = Σ_i E_i`` (chgnet reports
  E/N).

Bond features are kept once per direction (the bond ``i→j`` in row i, ``j→i`` in row j, equal
through the bond list's ``reverse``): each bond convolution sums the messages at both ends
into both copies, reading the other end's through the reverse bond. Under domain
decomposition (``SPEC_MPNN_HALO``) the dispatch refreshes, before each such read, the ghost
rows of the atom features and of the bond messages from their owners (docs/angle_models.md):
two forward exchanges per block, no other change.

An isolated atom (no neighbour within r_a) keeps its embedding through the convolutions, as
chgnet computes it when its converter is told to ignore isolated atoms (by default chgnet's
converter refuses such a structure).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.model.base import ModelConfig, NeighborConfig
from jaxdd.model.species import SpeciesModel
from jaxdd.neighbors import NeighborListFormat, gather_bonds, reverse_bonds

from ..species import cast_params, check_positive, weights_dtype
from . import checkpoint as ckpt
from .basis import ACOS_SHRINK, fourier, radial_bessel
from .layers import angle_update, atom_conv, bond_conv, layer_norm, linear, mlp, others

__all__ = ["CHGNet"]

_OUTPUTS = frozenset({"energy", "atomic_energies", "forces", "stress", "magmoms"})


class CHGNet(eqx.Module, SpeciesModel):
    """CHGNet with a checkpoint's weights: energy, atomic energies, forces, stress and magnetic moments.

    Build it with :meth:`load`. Outputs: ``energy [S]`` (eV, the total), ``atomic_energies
    [V]`` (eV, chgnet's site energies: readout plus the element's reference energy; zero on
    padding atoms), ``magmoms [V]`` (μB, per atom, zero on padding atoms) and, by autodiff,
    ``forces [V, 3]`` (eV/Å) and ``stress [S, 3, 3]`` (eV/Å³, ASE's sign). ``arch`` is the
    checkpoint's static :class:`~jaxdd.models.chgnet.checkpoint.Architecture`.

    Neighbour list: a MATRIX list at the atom cutoff carrying the bonds within the bond cutoff
    (``NeighborConfig(bond_cutoff=...)``); both widths are sized from the data and grown when an
    atom has more neighbours or bonds.
    """

    params: dict
    species: tuple = eqx.field(static=True)
    arch: ckpt.Architecture = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, arch: ckpt.Architecture, weights: dict, *, skin: float = 0.0, dtype=jnp.float64):
        """Use :meth:`load`; this takes what :func:`~.checkpoint.read` returns."""
        skin = 0.0 if skin == 0 else check_positive(skin, "skin", "CHGNet")
        self.species = tuple(range(1, ckpt.N_ELEMENTS + 1))
        self.arch = arch
        # With a skin, pairs and bonds are listed to their cutoffs plus the skin and masked here by
        # the cutoffs themselves.
        nc = NeighborConfig(cutoff=arch.atom_cutoff, skin=skin, format=NeighborListFormat.MATRIX,
                            bond_cutoff=arch.bond_cutoff)
        self.model_config = ModelConfig(outputs=_OUTPUTS, active_outputs=_OUTPUTS - {"atomic_energies"},
                                        autograd_outputs=frozenset({"forces", "stress"}),
                                        autograd_inputs=frozenset({"positions", "cell"}), neighbor_config=nc)
        self.params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), weights)

    @classmethod
    def load(cls, name_or_path="0.3.0", *, skin: float = 0.0, dtype=jnp.float64) -> "CHGNet":
        """CHGNet with the configuration and weights of a checkpoint, read without torch.

        Args:
          name_or_path: ``"0.3.0"``, ``"0.2.0"`` or ``"r2scan"`` (the files of the installed
            ``chgnet`` distribution; ``pip install --no-deps chgnet`` is enough), or the path of
            a CHGNet checkpoint (``.pth.tar``).
          skin: extra neighbour-search range (Å) so dynamics can keep a list for several steps
            (pairs and bonds beyond their cutoffs are masked; the numbers do not depend on it).
          dtype: of the weights (float64 or float32); the computation follows the positions'.

        Returns:
          the :class:`CHGNet`.

        Raises:
          FileNotFoundError: an unknown name, a missing file, or a name whose ``chgnet`` is not
            installed.
          UnsupportedCheckpoint: an option of ``model_args`` that is not implemented.
          ValueError: a file that is not a CHGNet checkpoint, or a dtype other than float32/64.
        """
        dt = weights_dtype(dtype, "CHGNet.load")
        arch, weights = ckpt.read(name_or_path)
        return cls(arch, weights, skin=skin, dtype=dt)

    # ------------------------------------------------------------------ jaxdd model interface

    @property
    def distribution_spec(self):
        """``SPEC_MPNN_HALO`` with ``magmoms`` declared per atom."""
        from jaxdd.spec import SPEC_MPNN_HALO, OutputKind

        return SPEC_MPNN_HALO.with_output_kinds(magmoms=OutputKind.PER_NODE)

    def validate_input(self, data) -> None:
        """Host check that every real atom of the Batch ``data`` is one of chgnet's 94 elements
        (ValueError naming them)."""
        z = np.asarray(data.atomic_numbers)[np.asarray(data.atom_mask)]
        bad = np.flatnonzero((z < 1) | (z > ckpt.N_ELEMENTS))
        if bad.size:
            rows = np.flatnonzero(np.asarray(data.atom_mask))[bad]
            raise ValueError(f"atoms {rows[:8].tolist()} have atomic numbers {sorted(set(z[bad].tolist()))}; CHGNet "
                             f"knows the elements 1 to {ckpt.N_ELEMENTS} (H to Pu)")

    def forward(self, positions, cell, batch_idx, atomic_numbers, atom_mask, neighbors, n_systems):
        """Energies, atomic energies and magnetic moments.

        Args:
          the inputs of :meth:`~jaxdd.model.species.SpeciesModel.adapt_input`.

        Returns:
          dict of ``energy [S]`` eV, ``atomic_energies [V]`` eV and ``magmoms [V]`` μB (zero on
          padding atoms).
        """
        kind = self.species_index(atomic_numbers)
        atomic, magmoms = self.site_outputs(positions, cell, batch_idx, kind, neighbors, n_systems)
        atomic = jnp.where(atom_mask, atomic, 0.0)
        energy = jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems)
        return {"energy": energy, "atomic_energies": atomic, "magmoms": jnp.where(atom_mask, magmoms, 0.0)}

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        n_systems = cell.shape[0]
        return self.site_outputs(positions, cell, batch_idx, kind, neighbors, n_systems)[0]

    # ------------------------------------------------------------------ the network

    def site_outputs(self, positions, cell, batch_idx, kind, neighbors, n_systems):
        """Site energies and magnetic moments of every atom row.

        Args:
          positions: [V, 3] Å. cell: [S, 3, 3] Å (rows lattice vectors). batch_idx: [V] system
          of each atom. kind: [V] element index ``Z - 1``. neighbors: the MATRIX list with
          ``bonds``. n_systems: S (static).

        Returns:
          ``(energies [V] eV, magmoms [V] μB)``, before padding rows are masked.
        """
        if getattr(neighbors, "bonds", None) is None or getattr(neighbors, "matrix", None) is None:
            raise ValueError("CHGNet needs a MATRIX neighbour list with bonds (NeighborConfig(format=MATRIX, "
                             "bond_cutoff=...), as its model_config asks); call it through jaxdd.compute")
        dt = positions.dtype
        p = cast_params(self.params, dt)
        arch = self.arch
        n = positions.shape[0]

        vec = _slot_vectors(positions, cell, batch_idx, neighbors.matrix, neighbors.matrix_shifts)  # [V, K, 3]
        filled = neighbors.matrix < n
        r2 = jnp.sum(vec * vec, axis=-1)
        inside = filled & (r2 < arch.atom_cutoff**2)
        r = jnp.sqrt(jnp.where(inside, r2, 1.0))  # a safe norm: no NaN gradient on padding slots
        basis = jnp.where(inside[..., None], radial_bessel(r, p["rbf_atom"], arch.atom_cutoff, arch.envelope_p), 0.0)
        edge_weights = linear((p["bond_weights_atom"], None), basis)  # [V, K, F]

        bl = neighbors.bonds
        rb = gather_bonds(r, bl, fill=1.0)
        is_bond = bl.mask & gather_bonds(inside, bl, fill=False) & (rb < arch.bond_cutoff)  # [V, B]
        width = is_bond.shape[1]
        triplets = is_bond[:, :, None] & is_bond[:, others(width)]  # [V, B, B-1]
        bond_basis = radial_bessel(jnp.where(is_bond, rb, 1.0), p["rbf_bond"], arch.bond_cutoff, arch.envelope_p)
        bond_weights = linear((p["bond_weights_bond"], None), jnp.where(is_bond[..., None], bond_basis, 0.0))
        unit = gather_bonds(vec, bl) / rb[..., None]
        cos = jnp.where(triplets, jnp.einsum("vbx,vbcx->vbc", unit, unit[:, others(width)]), 0.0)
        angles = linear((p["angle_embedding"], None), fourier(jnp.arccos(cos * ACOS_SHRINK), p["fourier"]))
        angles = jnp.where(triplets[..., None], angles, 0.0)
        # chgnet skips the bond convolutions of a structure without angles, and with them the
        # biases of their output layers (0.2.0) that reach every edge.
        convolved = True
        if arch.mlp_out_bias:
            has_angles = jax.ops.segment_max(jnp.sum(is_bond, axis=1) >= 2, batch_idx, num_segments=n_systems)
            convolved = has_angles[jnp.clip(batch_idx, 0, n_systems - 1)][:, None, None]
        # [V, K]: the bond of each slot of a row, B where the slot holds no bond (each bond one slot).
        on_slot = (bl.slot[:, None, :] == jnp.arange(basis.shape[1])[None, :, None]) & is_bond[:, None, :]
        slot_bond = jnp.where(jnp.any(on_slot, axis=-1), jnp.argmax(on_slot, axis=-1), width)

        # The edge features are e = W_e g(r) plus, on the bonds, the bond convolutions' updates
        # (and on every edge their output biases, 0.2.0). They are kept as those parts: the
        # features of the bonds [V, B, F], the updates summed, and the biases summed; an atom
        # convolution multiplies each part by its first layers' columns where it lives (g(r) by
        # W·W_e, the updates per bond, placed on their slots), never the features of every slot.
        bond_edges = linear((p["bond_embedding"], None), gather_bonds(basis, bl))  # [V, B, F]
        updates = jnp.zeros_like(bond_edges)
        bias = None  # the output biases summed [F], or None

        def edge_pre(t):
            """The edges' part (core, gate) of atom convolution t's first layers, [V, K, H] each."""
            parts = []
            for w1 in _edge_columns(p["atom_conv"][t]["gated"], h.shape[-1]):  # [H, F] each
                pre = basis @ (w1 @ p["bond_embedding"]).T
                if t:  # the bonds' updates, read on their slots (none on the other slots)
                    per_bond = jnp.pad(updates @ w1.T, ((0, 0), (0, 1), (0, 0)))  # row B: no bond
                    pre = pre + jnp.take_along_axis(per_bond, slot_bond[..., None], axis=1)
                if bias is not None:
                    pre = pre + jnp.where(convolved & inside[..., None], bias @ w1.T, 0.0)
                parts.append(pre)
            return tuple(parts)

        def bonds_now():
            """The bonds' current features [V, B, F]."""
            e = bond_edges + updates
            return e if bias is None else e + jnp.where(convolved & bl.mask[..., None], bias, 0.0)

        h = p["embedding"][kind]
        for t in range(arch.n_conv - 1):
            h = atom_conv(p["atom_conv"][t], h, edge_pre(t), edge_weights, neighbors.matrix, inside)
            at_atom = bond_conv(p["bond_conv"][t], h, bonds_now(), angles, bond_weights, triplets)
            summed = at_atom + jnp.where(is_bond[..., None], reverse_bonds(at_atom, neighbors), 0.0)  # both ends
            # The output layer: its product on the bonds' sums, its bias (if any) on all edges,
            # bonds or not, as chgnet's applies to every undirected edge.
            (w_out, b_out), = p["bond_conv"][t]["out"]
            updates = updates + summed @ w_out.T
            if b_out is not None:
                bias = b_out if bias is None else bias + b_out
            angles = angle_update(p["angle_update"][t], h, bonds_now(), angles, triplets)
        magmoms = jnp.abs(linear(p["site_wise"], h))[:, 0]  # after the last but one atom convolution
        h = atom_conv(p["atom_conv"][-1], h, edge_pre(arch.n_conv - 1), edge_weights, neighbors.matrix, inside)

        x = layer_norm(p["readout_norm"], h) if arch.readout_norm else h
        energies = mlp(p["readout"], x)[:, 0] + p["atomref"][kind]
        return energies, magmoms


def _edge_columns(gated, atom_width):
    """The columns of a gated MLP's first layers (core, gate) that multiply the edge features in
    ``[h_i, e_ij, h_j]``: ``([H, F_e], [H, F_e])``."""
    return tuple(gated[k][0][0][:, atom_width:-atom_width] for k in ("core", "gate"))


def _slot_vectors(positions, cell, batch_idx, matrix, matrix_shifts):
    """Atom → neighbour vectors of every MATRIX slot, ``x_j - x_i + S·cell`` [V, K, 3] Å (zero
    on padding slots)."""
    n = positions.shape[0]
    shift = matrix_shifts.astype(positions.dtype)
    if cell.shape[0] == 1:
        shift = shift @ cell[0]
    else:
        shift = jnp.einsum("vki,vij->vkj", shift, cell[jnp.clip(batch_idx, 0, cell.shape[0] - 1)])
    vec = positions.at[matrix].get(mode="fill", fill_value=0) - positions[:, None, :] + shift
    return jnp.where((matrix < n)[..., None], vec, 0.0)
