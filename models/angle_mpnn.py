"""A small angle-aware message-passing potential: bond features updated from angles.

The idioms of M3GNet, CHGNet and DimeNet on jaxdd's bond list (``NeighborConfig(bond_cutoff=
...)``, :class:`~jaxdd.neighbors.BondList`), at a size a test compiles in seconds. Atoms carry
features ``h [V, F]``; every bond ``(i, b)`` — a neighbour ``j`` of ``i`` closer than the bond
cutoff ``r_b`` — carries features ``e [V, B, F]``; the angles are the pairs of bonds of one atom.

* bond embedding: Gaussians of the bond length times a smooth envelope
  ``u(r) = (1 - (r / r_b)²)²`` (zero, with zero slope, at ``r_b``);
* each of ``layers`` layers:

  - three-body update (M3GNet): ``e[i,b] += u_b · tanh(Σ_{c≠b} A(cos θ_bc) u_c σ(h[j_c] W))``,
    the sum over the angles at ``i`` (``A``: a polynomial of the cosine, per feature);
  - directional message (DimeNet): ``D[j,c'] = Σ_{c≠c'} A'(cos θ_c'c) e[j,c]`` at every atom,
    and bond ``(i, b)`` to ``j`` reads ``D`` at its reverse, ``e[i,b] += u_b · tanh(D[j, rev])``:
    the messages ``k → j`` arriving at ``j`` feed ``j → i``;
  - symmetrisation: ``e ← (e + e[j, rev]) / 2``, so both directions of a bond agree;
  - atom update: ``h[i] += tanh(Σ_b u_b (e[i,b] W_e + σ(h[j_b]) W_h)) / avg_num_bonds``.

* readout: ``ε_i = Σ_f tanh(h_i) w`` (eV), ``E = Σ_i ε_i`` per system.

``σ`` is the shifted softplus. Pairs beyond the bond cutoff do not enter; ``cutoff`` only sets
the neighbour list the bonds are taken from (``r_b <= cutoff``). Under decomposition the
per-bond and per-angle arrays are rows of atoms with extra axes; the dispatch refreshes their
ghost rows before they are read through a partner index, and the reverse indices count in
each partner's owner order (docs/angle_models.md). Shapes: positions [V, 3] Å; bonds
[V, B]; angles [V, B, B]. Outputs: ``energy`` [S] eV, ``atomic_energies`` [V] eV, ``forces``
[V, 3] eV/Å and ``stress`` [S, 3, 3] eV/Å³ (autodiff).
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.neighbors import (NeighborListFormat, bond_partners, bond_vectors, reverse_bonds, triplet_cosines,
                             triplet_mask)

from .species import SpeciesNetwork, cast_params, check_positive

__all__ = ["AngleMPNN"]

_N_RBF = 6  # Gaussians of the bond length
_ANGULAR = 3  # powers of the cosine: 1, cos, cos²


def _ssp(x):
    """Shifted softplus ln(1 + eˣ) - ln 2."""
    return jax.nn.softplus(x) - math.log(2.0)


class AngleMPNN(SpeciesNetwork):
    """An angle-aware message-passing potential (see the module docstring).

    species: atomic numbers. cutoff: the neighbour list's range (Å). bond_cutoff: r_b (Å),
    0 < r_b <= cutoff. features: F. layers: message-passing layers. avg_num_bonds: scale of
    the atom update. seed: parameters from ``jax.random.PRNGKey(seed)``. dtype: parameter
    dtype (the computation follows the positions').
    """

    bond_cutoff: float = eqx.field(static=True)
    avg_num_bonds: float = eqx.field(static=True)

    def __init__(self, species=(1, 8), cutoff: float = 4.0, bond_cutoff: float = 3.0, *, features: int = 8,
                 layers: int = 2, avg_num_bonds: float = 6.0, seed: int = 0, dtype=jnp.float64):
        owner = "AngleMPNN"
        super().__init__(species, cutoff, format=NeighborListFormat.MATRIX, bond_cutoff=bond_cutoff)
        self.bond_cutoff = self.model_config.neighbor_config.bond_cutoff
        self.avg_num_bonds = check_positive(avg_num_bonds, "avg_num_bonds", owner)
        f = integral(f"{owner} features", features, minimum=1)
        n_layers = integral(f"{owner} layers", layers, minimum=1)
        k = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 5 * n_layers))

        def normal(shape, fan_in):
            return (jax.random.normal(next(k), shape) / np.sqrt(fan_in)).astype(dtype)

        self.params = {
            "embed": normal((len(self.species), f), 1.0),
            "rbf": normal((_N_RBF, f), _N_RBF),
            "readout": normal((f,), f),
            "layers": [{"three_body": normal((_ANGULAR, f), _ANGULAR), "w_three": normal((f, f), f),
                        "directional": normal((_ANGULAR, f), _ANGULAR), "w_bond": normal((f, f), f),
                        "w_atom": normal((f, f), f)} for _ in range(n_layers)],
        }

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        p = cast_params(self.params, dt)
        bonds = neighbors.bonds
        rb = self.bond_cutoff
        partner = bond_partners(neighbors)  # [V, B]
        vec = bond_vectors(positions, cell, batch_idx, neighbors)  # [V, B, 3]
        r2 = jnp.sum(vec * vec, axis=-1)
        # Masked by the model's own bond cutoff: with a skin the list holds bonds up to r_b + skin.
        inside = bonds.mask & (r2 < rb * rb)
        r = jnp.sqrt(jnp.where(inside, r2, 1.0))
        u = jnp.where(inside, (1.0 - r2 / rb**2) ** 2, 0.0)  # [V, B]
        cos = triplet_cosines(vec, bonds)  # [V, B, B]
        angles = triplet_mask(bonds) & inside[:, :, None] & inside[:, None, :]
        powers = jnp.stack([jnp.ones_like(cos), cos, cos * cos], axis=-1)  # [V, B, B, 3]

        centres = jnp.linspace(0.0, rb, _N_RBF, dtype=dt)
        rbf = jnp.exp(-((r[..., None] - centres) ** 2) / (2 * (rb / _N_RBF) ** 2))
        h = p["embed"][kind]  # [V, F]
        e = (rbf @ p["rbf"]) * u[..., None]  # [V, B, F]

        for layer in p["layers"]:
            # Three-body sum over the angles at i (M3GNet).
            weight = jnp.where(angles[..., None], powers @ layer["three_body"], 0.0)  # [V, B, B, F]
            neighbour = _ssp(h.at[partner].get(mode="fill", fill_value=0.0) @ layer["w_three"]) * u[..., None]
            e = e + u[..., None] * jnp.tanh(jnp.einsum("vbcf,vcf->vbf", weight, neighbour))
            # Messages k → j at j, read by j → i at its reverse (DimeNet).
            turn = jnp.where(angles[..., None], powers @ layer["directional"], 0.0)
            arriving = jnp.einsum("vbcf,vcf->vbf", turn, e)  # [V, B, F] at each bond's own atom
            e = e + u[..., None] * jnp.tanh(reverse_bonds(arriving, neighbors))
            # Both directions of a bond agree.
            e = 0.5 * (e + reverse_bonds(e, neighbors))
            # Atom update from its bonds.
            messages = e @ layer["w_bond"] + _ssp(h.at[partner].get(mode="fill", fill_value=0.0)) @ layer["w_atom"]
            h = h + jnp.tanh(jnp.sum(u[..., None] * messages, axis=1) / self.avg_num_bonds)
        return jnp.tanh(h) @ p["readout"]
