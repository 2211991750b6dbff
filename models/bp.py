"""Behler-Parrinello neural-network potential: atom-centred symmetry functions and
one small neural network per element.

Every atom ``i`` is described by element-resolved symmetry functions of its
neighbourhood within the cutoff ``r_c`` (Å), with the cosine cutoff
``f_c(r) = 0.5 (cos(π r / r_c) + 1)`` (zero, with zero slope, at ``r_c``):

* radial, for each neighbour element ``s`` and each ``(η, R_s)``::

      G2[i, s] = Σ_{j ∈ s} exp(-η (r_ij - R_s)²) f_c(r_ij)

* angular, for each unordered element pair ``{s, t}`` and each ``(η, ζ, λ = ±1)``::

      G4[i, st] = 2^(1-ζ) Σ_{j ∈ s, k ∈ t, j ≠ k} (1 + λ cos θ_ijk)^ζ
                  exp(-η (r_ij² + r_ik² + r_jk²)) f_c(r_ij) f_c(r_ik) f_c(r_jk)

  (ordered pairs ``(j, k)``; for ``s == t`` each pair is counted twice, as in
  Behler's sums over all ``j ≠ k``).

The descriptor vector, scaled by ``n_species / avg_num_neighbors`` (radial) and its square
(angular) so that its entries are O(1), goes through the network of the atom's element (a
``flax.linen`` ``Dense`` stack with tanh) to the atomic energy (eV). The energy of a system
is the sum of its atomic energies.

All terms come from the framework's per-atom neighbour MATRIX (``NeighborConfig(format=
MATRIX)``): row ``i`` lists the senders of atom ``i``'s edges in its first slots and pads
the rest. Edge vectors and the one-hot species of the senders form a dense table
``[V, K, ...]``, and triplets are the ``[V, K, K]`` slot pairs of that table. ``K`` is the
list's static width: the framework sizes it from the data and, when an atom gains more
neighbours than fit, grows it and compiles again, so no neighbour is ever dropped. The
triplet work grows as ``V * K²``.
"""

from __future__ import annotations

import functools
import math

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.neighbors import NeighborListFormat

from .species import SpeciesNetwork, cast_params, check_positive

__all__ = ["BehlerParrinello"]


class _ElementNet(nn.Module):
    """Descriptor [..., D] -> atomic energy [...]: Dense + tanh layers, then Dense(1)."""

    hidden: tuple[int, ...]
    dtype: object

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(self.hidden):
            x = jnp.tanh(nn.Dense(width, dtype=self.dtype, param_dtype=self.dtype, name=f"hidden_{i}")(x))
        return nn.Dense(1, dtype=self.dtype, param_dtype=self.dtype, name="energy")(x)[..., 0]


@functools.partial(jax.jit, static_argnums=0)
def _init_networks(net, keys, dummy):
    """Parameters of one network per key, stacked along a leading species axis."""
    return jax.vmap(net.init, in_axes=(0, None))(keys, dummy)


def _cosine_cutoff(r, rc):
    return jnp.where(r < rc, 0.5 * (jnp.cos(jnp.pi * r / rc) + 1.0), 0.0)


class BehlerParrinello(SpeciesNetwork):
    """Behler-Parrinello potential: energy, atomic energies, forces and stress.

    species: atomic numbers the model knows (one network each). cutoff: r_c (Å).
    radial_shifts: R_s of the radial functions (Å; default 8 evenly spaced from 0.8 Å to
    r_c - 0.5 Å). radial_eta: η (Å⁻²), one per shift or one for all (default 1 / (2 ΔR²),
    ΔR the spacing of the shifts). angular_eta: η of the angular functions (Å⁻²).
    zeta: integer exponents ζ >= 1 (each with λ = +1 and -1). hidden: widths of the hidden
    layers. avg_num_neighbors: typical neighbour count, scales the descriptors.
    max_neighbors: starting width K of the per-atom neighbour table (grown by the
    framework when an atom has more neighbours; see the module docstring). seed: parameters are drawn from ``jax.random.PRNGKey(seed)``. dtype:
    parameter dtype; the computation follows the positions' dtype.

    Descriptor length per atom: ``S * n_radial + S (S + 1) / 2 * n_angular`` with S species,
    ``n_angular = len(angular_eta) * len(zeta) * 2``.

    Outputs: ``energy [S]`` (eV), ``atomic_energies [V]`` (eV, zero on padding atoms), and,
    from the framework's autodiff, ``forces [V, 3]`` (eV/Å) and ``stress [S, 3, 3]`` (eV/Å³).
    """

    radial_shifts: tuple[float, ...] = eqx.field(static=True)
    radial_eta: tuple[float, ...] = eqx.field(static=True)
    angular_eta: tuple[float, ...] = eqx.field(static=True)
    zeta: tuple[int, ...] = eqx.field(static=True)
    hidden: tuple[int, ...] = eqx.field(static=True)
    avg_num_neighbors: float = eqx.field(static=True)
    max_neighbors: int = eqx.field(static=True)

    def __init__(self, species=(1, 6, 7, 8), cutoff: float = 5.0, *, radial_shifts=None, radial_eta=None,
                 angular_eta=(0.005, 0.05), zeta=(1, 4), hidden=(32, 32), avg_num_neighbors: float = 30.0,
                 max_neighbors: int = 64, seed: int = 0, dtype=jnp.float64):
        owner = "BehlerParrinello"
        self.max_neighbors = integral(f"{owner} max_neighbors", max_neighbors, minimum=2)
        super().__init__(species, cutoff, format=NeighborListFormat.MATRIX, max_neighbors=self.max_neighbors)
        cutoff = self.cutoff
        if radial_shifts is None:
            radial_shifts = np.linspace(0.8, max(cutoff - 0.5, 0.8), 8)
        shifts = tuple(float(x) for x in np.atleast_1d(radial_shifts))
        if radial_eta is None:
            spacing = (shifts[-1] - shifts[0]) / (len(shifts) - 1) if len(shifts) > 1 else cutoff / 4
            radial_eta = 1.0 / (2.0 * spacing**2)
        eta = np.broadcast_to(np.asarray(radial_eta, np.float64), (len(shifts),))
        self.radial_shifts = shifts
        self.radial_eta = tuple(float(x) for x in eta)
        self.angular_eta = tuple(float(x) for x in np.atleast_1d(angular_eta))
        zeta = tuple(np.atleast_1d(zeta).tolist())
        if not zeta:
            raise ValueError(f"{owner} zeta must be integers >= 1, got {zeta}")
        self.zeta = tuple(integral(f"{owner} zeta", z, minimum=1) for z in zeta)
        if any(not (math.isfinite(x) and x > 0) for x in self.radial_eta + self.angular_eta):
            raise ValueError(f"{owner} eta values must be positive and finite")
        self.hidden = tuple(integral(f"{owner} hidden", h, minimum=1) for h in hidden)
        self.avg_num_neighbors = check_positive(avg_num_neighbors, "avg_num_neighbors", owner)
        net = _ElementNet(self.hidden, dtype)
        keys = jax.random.split(jax.random.PRNGKey(seed), len(self.species))
        dummy = jnp.zeros((1, self.n_descriptors), dtype)
        # One network per species, stacked along a leading species axis.
        self.params = {"networks": _init_networks(net, keys, dummy)}

    @property
    def n_descriptors(self) -> int:
        """Symmetry functions per atom: radial ones per species, angular ones per species pair."""
        n = len(self.species)
        n_angular = len(self.angular_eta) * len(self.zeta) * 2
        return n * len(self.radial_shifts) + n * (n + 1) // 2 * n_angular

    def descriptors(self, positions, cell, batch_idx, atomic_numbers, neighbors):
        """Symmetry functions ``[V, n_descriptors]`` (scaled) and the ``[V]`` species index of
        every atom.

        Args:
          positions: [V, 3] Å.
          cell: [S, 3, 3] Å (rows lattice vectors).
          batch_idx: [V] system of each atom.
          atomic_numbers: [V] int.
          neighbors: a MATRIX-format neighbour list of width K.
        """
        kind = self.species_index(atomic_numbers)  # [V]
        return self.symmetry_functions(positions, cell, batch_idx, kind, neighbors), kind

    def symmetry_functions(self, positions, cell, batch_idx, kind, neighbors):
        """Symmetry functions ``[V, n_descriptors]`` (scaled).

        Args:
          positions: [V, 3] Å. cell: [S, 3, 3] Å. batch_idx: [V] system of each atom.
          kind: [V] species index. neighbors: a MATRIX-format neighbour list of width K.
        """
        dt = positions.dtype
        n = positions.shape[0]
        k = neighbors.matrix.shape[1]
        n_species = len(self.species)
        rc = self.cutoff

        # Padding slots point one past the last atom: "fill" reads zeros there.
        senders = neighbors.matrix  # [V, K]
        filled = senders < n
        shift = neighbors.matrix_shifts.astype(dt)
        if cell.shape[0] == 1:
            shift = shift @ cell[0]
        else:
            shift = jnp.einsum("vki,vij->vkj", shift, cell[jnp.clip(batch_idx, 0, cell.shape[0] - 1)])
        nbr_pos = positions.at[senders].get(mode="fill", fill_value=0)
        nbr_vec = jnp.where(filled[..., None], nbr_pos - positions[:, None, :] + shift, 0.0)  # [V, K, 3]
        sender_kind = kind.at[senders].get(mode="fill", fill_value=-1)
        nbr_kind = (sender_kind[..., None] == np.arange(n_species)).astype(dt)  # [V, K, S]

        # Pair distances with safe norms on empty slots.
        r2 = jnp.sum(nbr_vec * nbr_vec, axis=-1)
        r = jnp.sqrt(jnp.where(filled, r2, 1.0))
        fc = jnp.where(filled, _cosine_cutoff(r, rc), 0.0)  # [V, K]

        # Radial G2: [V, n_radial] per neighbour species.
        shifts = jnp.asarray(self.radial_shifts, dt)
        eta = jnp.asarray(self.radial_eta, dt)
        gauss = jnp.exp(-eta * (r[..., None] - shifts) ** 2) * fc[..., None]  # [V, K, n_radial]
        g2 = jnp.einsum("vkr,vks->vsr", gauss, nbr_kind).reshape(n, -1)

        # Angular G4 over the [V, K, K] neighbour pairs of every atom.
        pair = filled[:, :, None] & filled[:, None, :] & ~np.eye(k, dtype=bool)
        d_jk = nbr_vec[:, None, :, :] - nbr_vec[:, :, None, :]
        r2_jk = jnp.sum(d_jk * d_jk, axis=-1)
        r_jk = jnp.sqrt(jnp.where(pair, r2_jk, 1.0))
        fc_jk = jnp.where(pair, _cosine_cutoff(r_jk, rc), 0.0)
        cos = jnp.einsum("vjx,vkx->vjk", nbr_vec, nbr_vec) / (r[:, :, None] * r[:, None, :])
        weight = fc[:, :, None] * fc[:, None, :] * fc_jk  # zero off real pairs
        total_r2 = r2[:, :, None] + r2[:, None, :] + jnp.where(pair, r2_jk, 0.0)
        terms = []
        for eta_a in self.angular_eta:
            radial = jnp.exp(-eta_a * total_r2) * weight
            for zeta in self.zeta:
                for lam in (1.0, -1.0):
                    angular = (2.0 ** (1 - zeta)) * (1.0 + lam * cos) ** zeta
                    terms.append(angular * radial)
        t = jnp.stack(terms, axis=-1)  # [V, K, K, n_angular]
        by_second = jnp.einsum("vjka,vkt->vjta", t, nbr_kind)
        by_pair = jnp.einsum("vjs,vjta->vsta", nbr_kind, by_second)  # [V, S, S, n_angular]
        upper = np.triu_indices(n_species)
        g4 = by_pair[:, upper[0], upper[1], :].reshape(n, -1)

        scale = n_species / self.avg_num_neighbors
        return jnp.concatenate([g2 * scale, g4 * scale**2], axis=-1)

    def atom_energies(self, positions, cell, batch_idx, kind, neighbors):
        dt = positions.dtype
        g = self.symmetry_functions(positions, cell, batch_idx, kind, neighbors)
        params = cast_params(self.params["networks"], dt)
        net = _ElementNet(self.hidden, dt)
        per_species = jax.vmap(lambda p: net.apply(p, g))(params)  # [n_species, V]
        chosen = kind[None, :] == np.arange(len(self.species))[:, None]
        return jnp.sum(jnp.where(chosen, per_species, 0.0), axis=0)
