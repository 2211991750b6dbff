"""An internal-graph backbone: the model builds its own graph from positions.

Like UMA-style backbones, the network ignores the framework's edges and forms its own: for
every atom, the ordered pairs (i, j) of atoms of the same system closer than the cutoff, by
the minimum-image convention on periodic axes (so periodic cells must be at least twice the
cutoff across). The search runs over blocks of rows (all pairs of a block at a time, so its
memory is ``block × V``) and keeps each atom's nearest ``K`` candidates in a ``[V, K]``
sender table; ``K`` is the width of the framework's per-atom neighbour matrix for the same
cutoff, which the framework sizes with headroom and grows (and recompiles) when an atom
gains neighbours, so no pair is ever dropped. Two rounds of radial message passing,
aggregated with ``segment_sum`` over the flattened edge index, and an atom-wise readout
give atomic energies.

Under decomposition a rank's local block carries its ghosts as explicit images, so the same
code finds every owned atom's neighbours among the local rows; but its scatters also write
ghost rows, which must not be exchanged. Its spec is therefore ``SPEC_UMA_HALO`` with
``scatter_mode="local"`` and a ghost shell ``layers`` × cutoff deep. The dispatch cannot
follow provenance through the graph search (row numbers from ``arange``, the ``[V, K]``
table flattened to an edge index) and reports those places as shape guesses; they are
harmless here, since with local scatters and a deep halo nothing inside the model is
exchanged, and ``jaxdd.validate`` confirms the result.

Shapes: positions [V, 3] Å; internal graph [V, K] senders and image shifts. Outputs:
``energy`` [S] eV, ``atomic_energies`` [V] eV, ``forces`` [V, 3] eV/Å and ``stress``
[S, 3, 3] eV/Å³ (autodiff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.model.protocol import check_cell_width
from jaxdd.neighbors import NeighborListFormat

from .radial_messages import init_messages, normal, pass_messages, radial_filter
from .species import SpeciesNetwork



__all__ = ["InternalGraphBackbone"]


class InternalGraphBackbone(SpeciesNetwork):
    """species: atomic numbers. cutoff: r_c (Å). features: width. layers: message-passing rounds."""

    def __init__(self, species=(1, 6, 7, 8), cutoff: float = 5.0, features: int = 8, layers: int = 2,
                 seed: int = 0, dtype=jnp.float64):
        # Only the width of the framework's MATRIX list is used: it sizes the internal graph.
        super().__init__(species, cutoff, format=NeighborListFormat.MATRIX)
        k = jax.random.split(jax.random.PRNGKey(seed), 4)
        embed, radial, weights = init_messages(k, len(self.species), features, 6, layers, dtype)
        self.params = dict(embed=embed, radial=radial, weights=weights,
                           readout=normal(k[3], (features,), dtype) / np.sqrt(features))

    @property
    def distribution_spec(self):
        from jaxdd.ops import HaloStoragePolicy
        from jaxdd.spec import SPEC_UMA_HALO

        return SPEC_UMA_HALO.with_policy(
            HaloStoragePolicy(scatter_mode="local", gather_mode="local", halo_layers=len(self.params["weights"])))

    def validate_input(self, data) -> None:
        super().validate_input(data)
        check_cell_width(self, data.cell, data.pbc)

    def minimum_image_cutoff(self) -> float:
        """The graph's cutoff (Å): its pairs are minimum-image on periodic axes."""
        return self.model_config.neighbor_config.cutoff

    def adapt_input(self, data, **kwargs) -> dict:
        if data.neighbors is None or data.neighbors.matrix is None:
            raise ValueError("InternalGraphBackbone sizes its graph from data.neighbors; call it through jaxdd.compute")
        return dict(positions=data.positions, cell=data.cell, pbc=data.pbc, atomic_numbers=data.atomic_numbers,
                    atom_mask=data.atom_mask, batch_idx=data.batch_idx, n_systems=data.n_systems,
                    width=data.neighbors.matrix.shape[1])

    def graph(self, positions, cell, pbc, batch_idx, real, width: int):
        """The model's own graph: ``senders [V, K]`` (nearest first, padding ``V``) and the
        integer image ``shifts [V, K, 3]`` of each sender (minimum image on periodic axes).

        Args:
          positions: [V, 3] Å.
          cell: [S, 3, 3] Å (rows lattice vectors).
          pbc: [S, 3] bool periodic axes.
          batch_idx: [V] system of each atom.
          real: [V] bool real atoms (padding rows are no one's neighbours).
          width: K, the neighbours kept per atom (at most V - 1).
        """
        n = positions.shape[0]
        rc = self.model_config.neighbor_config.cutoff
        width = min(int(width), max(n - 1, 1))
        n_sys = cell.shape[0]
        pos = jax.lax.stop_gradient(positions)
        sys = jnp.clip(batch_idx, 0, n_sys - 1)
        # Open systems measure in Cartesian coordinates (their cell may be zero).
        periodic = jnp.any(pbc, axis=1)
        frame = jnp.where(periodic[:, None, None], jax.lax.stop_gradient(cell), jnp.eye(3, dtype=pos.dtype))
        frac = jnp.einsum("vk,vkl->vl", pos, jnp.linalg.inv(frame)[sys])  # [V, 3]
        block = int(min(n, max(8, 2**21 // max(n, 1))))
        n_blocks = -(-n // block)
        rows = jnp.arange(n_blocks * block, dtype=jnp.int32).reshape(n_blocks, block)

        def search(rows):
            r = jnp.minimum(rows, n - 1)
            df = frac[None, :, :] - frac[r][:, None, :]  # [B, V, 3]
            wrap = jnp.where(pbc[sys[r]][:, None, :], jnp.round(df), 0.0)
            d = jnp.einsum("bvk,bkl->bvl", df - wrap, frame[sys[r]])
            r2 = jnp.sum(d * d, axis=-1)
            ok = ((rows < n)[:, None] & real[r][:, None] & real[None, :] & (batch_idx[r][:, None] == batch_idx[None, :])
                  & (r[:, None] != jnp.arange(n)[None, :]) & (r2 < rc * rc))
            score, idx = jax.lax.top_k(jnp.where(ok, -r2, -jnp.inf), width)  # nearest first
            shift = -jnp.take_along_axis(wrap, idx[..., None], axis=1)
            return jnp.where(score > -jnp.inf, idx, n), shift

        senders, shifts = jax.lax.map(search, rows)
        return senders.reshape(-1, width)[:n], shifts.reshape(-1, width, 3)[:n].astype(jnp.int32)

    def forward(self, positions, cell, pbc, atomic_numbers, atom_mask, batch_idx, n_systems, width):
        dtype = positions.dtype
        n = positions.shape[0]
        rc = self.model_config.neighbor_config.cutoff
        kind = self.species_index(atomic_numbers)
        real = atom_mask & (batch_idx < n_systems)

        senders, shifts = self.graph(positions, cell, pbc, batch_idx, real, width)
        k = senders.shape[1]
        # The edge index, flattened: receivers i and senders j.
        i = jnp.repeat(jnp.arange(n), k)
        j = senders.reshape(-1)
        pair = j < n
        sys_i = jnp.clip(batch_idx, 0, cell.shape[0] - 1)[i]
        d = (positions.at[j].get(mode="fill", fill_value=0) - positions[i]
             + jnp.einsum("pk,pkl->pl", shifts.reshape(-1, 3).astype(dtype), cell[sys_i]))
        r2 = jnp.sum(d * d, axis=1)
        r = jnp.sqrt(jnp.where(pair, r2, 1.0))
        filt, _ = radial_filter(r, pair, rc, self.params["radial"])
        h = pass_messages(self.params["embed"].astype(dtype)[kind], self.params["weights"], filt,
                          lambda x: x.at[j].get(mode="fill", fill_value=0), i)
        atomic = jnp.where(real, jnp.tanh(h) @ self.params["readout"].astype(dtype), 0.0)
        return {"energy": jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems), "atomic_energies": atomic}
