"""An internal-graph backbone: the model builds its own full graph from positions.

Like UMA-style backbones, the network ignores the framework's neighbour list and forms its
own edges: every ordered pair (i, j) of atoms of the same system closer than the cutoff, by
the minimum-image convention on periodic axes (so periodic cells must be at least twice the
cutoff across). Two rounds of radial message passing (aggregated with ``segment_sum`` over
the pair index) and an atom-wise readout give atomic energies.

Under decomposition a rank's local block carries its ghosts as explicit images, so the same
code finds every owned atom's neighbours among the local rows; but its scatters also write
ghost rows, which must not be exchanged. Its spec is therefore ``SPEC_UMA_HALO`` with
``scatter_mode="local"`` and a ghost shell ``layers`` × cutoff deep.

Shapes: positions [V, 3] Å; the internal pair list is [V², ...] (fine for blocks of a few
thousand atoms). Outputs: ``energy`` [S] eV, ``atomic_energies`` [V] eV, ``forces`` [V, 3]
eV/Å and ``stress`` [S, 3, 3] eV/Å³ (autodiff).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.model import BaseModel, ModelConfig, NeighborConfig

from .species import check_cutoff, check_species, species_table, validate_species

def _normal(key, shape, dtype):
    """Parameters drawn in float32 and cast: one seed gives the same model in any precision."""
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


__all__ = ["InternalGraphBackbone"]


class InternalGraphBackbone(eqx.Module, BaseModel):
    """species: atomic numbers. cutoff: r_c (Å). features: width. layers: message-passing rounds."""

    embed: jax.Array
    radial: jax.Array
    weights: tuple
    readout: jax.Array
    species: tuple[int, ...] = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, species=(1, 6, 7, 8), cutoff: float = 5.0, features: int = 8, layers: int = 2,
                 seed: int = 0, dtype=jnp.float64):
        species = check_species(species, "InternalGraphBackbone")
        cutoff = check_cutoff(cutoff, "InternalGraphBackbone")
        k = jax.random.split(jax.random.PRNGKey(seed), 4)
        n_rbf = 6
        self.embed = _normal(k[0], (len(species), features), dtype)
        self.radial = _normal(k[1], (n_rbf, features), dtype) / np.sqrt(n_rbf)
        self.weights = tuple(_normal(kk, (features, features), dtype) / np.sqrt(features)
                             for kk in jax.random.split(k[2], layers))
        self.readout = _normal(k[3], (features,), dtype) / np.sqrt(features)
        self.species = species
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "atomic_energies", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}),
            neighbor_config=NeighborConfig(cutoff=cutoff),
        )

    @property
    def distribution_spec(self):
        from jaxdd.ops import HaloStoragePolicy
        from jaxdd.spec import SPEC_UMA_HALO

        return SPEC_UMA_HALO.with_policy(
            HaloStoragePolicy(scatter_mode="local", gather_mode="local", halo_layers=len(self.weights)))

    def validate_input(self, data) -> None:
        validate_species(data, self.species, "InternalGraphBackbone")
        rc = self.model_config.neighbor_config.cutoff
        cell = np.asarray(data.cell, np.float64)
        for s, (c, p) in enumerate(zip(cell, np.asarray(data.pbc))):
            if p.any():
                spacing = np.abs(np.linalg.det(c)) / np.linalg.norm(np.cross(c[[1, 2, 0]], c[[2, 0, 1]]), axis=1)
                if np.any(spacing[p] < 2 * rc):
                    raise ValueError(f"system {s}: a periodic cell thinner than twice the cutoff ({2 * rc} Å) "
                                     "across; the minimum-image graph would miss images; use a larger cell")

    def adapt_input(self, data, **kwargs) -> dict:
        return dict(positions=data.positions, cell=data.cell, pbc=data.pbc, atomic_numbers=data.atomic_numbers,
                    atom_mask=data.atom_mask, batch_idx=data.batch_idx, n_systems=data.n_systems)

    def forward(self, positions, cell, pbc, atomic_numbers, atom_mask, batch_idx, n_systems):
        dtype = positions.dtype
        n = positions.shape[0]
        rc = self.model_config.neighbor_config.cutoff
        table = jnp.asarray(species_table(self.species))
        kind = table[jnp.clip(atomic_numbers, 0, table.size - 1)]

        # Every ordered pair, receivers i and senders j.
        i = jnp.repeat(jnp.arange(n), n)
        j = jnp.tile(jnp.arange(n), n)
        sys_i = jnp.minimum(batch_idx, n_systems - 1)[i]
        d = positions[j] - positions[i]
        # Minimum image on periodic axes (systems without any are left alone: their cell may be zero).
        periodic = jnp.any(pbc, axis=1)
        frame = jnp.where(periodic[:, None, None], cell, jnp.eye(3, dtype=dtype))
        frac = jnp.einsum("pk,pkl->pl", d, jnp.linalg.inv(frame)[sys_i])
        frac = frac - jnp.where(pbc[sys_i], jnp.round(frac), 0.0)
        d = jnp.einsum("pk,pkl->pl", frac, frame[sys_i])
        real = atom_mask & (batch_idx < n_systems)
        r2 = jnp.sum(d * d, axis=1)
        pair = real[i] & real[j] & (batch_idx[i] == batch_idx[j]) & (i != j) & (r2 < rc * rc)
        r = jnp.sqrt(jnp.where(pair, r2, 1.0))
        env = jnp.where(pair, 0.5 * (jnp.cos(jnp.pi * r / rc) + 1.0), 0.0)
        centres = jnp.linspace(0.0, rc, self.radial.shape[0], dtype=dtype)
        rbf = jnp.exp(-((r[:, None] - centres) ** 2) / (rc / self.radial.shape[0]) ** 2) * env[:, None]
        filt = rbf @ self.radial.astype(dtype)

        h = self.embed.astype(dtype)[kind]
        for w in self.weights:
            h = h + jax.ops.segment_sum(jnp.tanh(h[j] @ w.astype(dtype)) * filt, i, num_segments=n) / 4.0
        atomic = jnp.where(real, jnp.tanh(h) @ self.readout.astype(dtype), 0.0)
        return {"energy": jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems), "atomic_energies": atomic}
