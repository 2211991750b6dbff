"""Lennard-Jones with its pair energies from an NVIDIA Warp kernel (optional: warp-lang).

The same potential as :class:`jaxdd.models.lj.LennardJones` (one species), but the pair
energy of each edge comes from :func:`jaxdd.ffi.warp.lj_edge_energy`, a Warp kernel called
through ``warp.jax_kernel`` and differentiated by Warp's adjoint. Edge vectors, scatters
onto atoms and per-system sums stay in jax.numpy, so the dispatch distributes the model with
the plain ``SPEC_LJ_HALO`` and no adapter. Forces and stress come from the framework's
autodiff through the Warp kernel.
"""

import jax
import jax.numpy as jnp

from jaxdd.ffi import warp
from jaxdd.neighbors import edge_vectors
from jaxdd.data.segments import per_system_sum

from .lj import LennardJones

__all__ = ["LennardJonesWarp"]


class LennardJonesWarp(LennardJones):
    """Lennard-Jones by a Warp kernel: ``energy [S]``, ``atomic_energies [V]``, and
    (autograd) ``forces [V, 3]``, ``stress [S, 3, 3]``.

    sigma (Å), epsilon (eV): scalars (one species); cutoff (Å), shift, half_list, skin as
    for :class:`~jaxdd.models.lj.LennardJones`. Needs warp-lang >= 1.16 when called.
    """

    def __init__(self, sigma: float = 1.0, epsilon: float = 1.0, cutoff: float = 2.5, shift: bool = False, *,
                 half_list: bool = False, skin: float = 0.0):
        if jnp.ndim(sigma) or jnp.ndim(epsilon):
            raise ValueError("LennardJonesWarp takes one species: sigma and epsilon must be scalars")
        super().__init__(sigma, epsilon, cutoff, shift, None, half_list=half_list, skin=skin)

    def forward(self, positions, cell, batch_idx, atomic_numbers, neighbors, n_systems):
        dtype = positions.dtype
        n = positions.shape[0]
        nc = self.model_config.neighbor_config
        vec = edge_vectors(positions, cell, batch_idx, neighbors)
        half = warp.lj_edge_energy(vec, neighbors.mask, self.sigma.astype(dtype), self.epsilon.astype(dtype),
                                   nc.cutoff, self.shift)  # [E]: each atom's half of the pair
        atomic = jax.ops.segment_sum(half, neighbors.receivers, n)
        if nc.half_list:
            atomic = atomic + jax.ops.segment_sum(half, neighbors.senders, n)
        return {"energy": per_system_sum(atomic, batch_idx, n_systems), "atomic_energies": atomic}
