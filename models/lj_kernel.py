"""Lennard-Jones through the fused FFI kernel, with kernel-direct forces and stress.

The same potential, parameters and outputs as :class:`jaxdd.models.lj.LennardJones`, but
one compiled pass over the neighbour list (:func:`jaxdd.ffi.lennard_jones`) gives the
per-atom energies, the forces and the virial. Forces and stress are outputs of the model
(PER_NODE and PER_GRAPH in the spec), not derived by autograd, and the spec declares the
kernel's op with ``ScatterOutputs`` on its per-atom outputs: under decomposition the
partial sums the kernel leaves on ghost rows go home to their owners.

``DistributedModel`` takes forces and stress from the energy; here that derivative runs
through the op's ``custom_vjp``, i.e. the backward kernel. Needs the compiled kernels
(``jaxdd.ffi.available()``); the pure-jnp model is :class:`~jaxdd.models.lj.LennardJones`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxdd.ffi import lennard_jones
from jaxdd.model.base import ModelConfig
from jaxdd.neighbors import NeighborListFormat
from jaxdd.ops import ScatterOutputs
from jaxdd.data.segments import per_system_sum
from jaxdd.spec import SPEC_LJ_HALO, OpAdapter

from .lj import LennardJones

__all__ = ["LennardJonesKernel", "SPEC_LJ_KERNEL_HALO"]

#: SPEC_LJ_HALO with the kernel declared: its three per-atom outputs (energies, forces,
#: virial) carry ghost partial sums, sent home by halo_reverse + halo_forward.
SPEC_LJ_KERNEL_HALO = SPEC_LJ_HALO.with_custom_ops(
    OpAdapter("jaxdd_ffi::lj_pair", output_transforms={0: ScatterOutputs(), 1: ScatterOutputs(), 2: ScatterOutputs()})
)


class LennardJonesKernel(LennardJones):
    """Lennard-Jones by the fused kernel: ``energy [S]``, ``atomic_energies [V]``, ``forces
    [V, 3]`` and ``stress [S, 3, 3]``, all from the kernel (none by autograd).

    Arguments as for :class:`~jaxdd.models.lj.LennardJones` (σ, ε in Å and eV; COO lists only).
    """

    def __init__(self, sigma=1.0, epsilon=1.0, cutoff: float = 2.5, shift: bool = False, species=None, *,
                 half_list: bool = False, skin: float = 0.0):
        super().__init__(sigma, epsilon, cutoff, shift, species, half_list=half_list, skin=skin,
                         format=NeighborListFormat.COO)
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "atomic_energies", "forces", "stress"}),
            neighbor_config=self.model_config.neighbor_config,
        )

    @property
    def distribution_spec(self):
        return SPEC_LJ_KERNEL_HALO

    def _types(self, atomic_numbers):
        """Row of each atom in the [K, K] parameter tables ([V] int32)."""
        if self.species is None:
            return jnp.zeros(atomic_numbers.shape, jnp.int32)
        table = np.zeros(max(self.species) + 1, np.int32)
        table[list(self.species)] = np.arange(len(self.species))
        return jnp.asarray(table)[jnp.clip(atomic_numbers, 0, table.size - 1)]

    def forward(self, positions, cell, batch_idx, atomic_numbers, neighbors, n_systems):
        dtype = positions.dtype
        nc = self.model_config.neighbor_config
        # A rank's list has no image shifts: a [0, 3] array spares the kernel reading them.
        shifts = jnp.zeros((0, 3), jnp.int32) if neighbors.zero_shifts else neighbors.shifts
        atomic, forces, virial = lennard_jones(
            positions, shifts, cell, neighbors.senders, neighbors.receivers, neighbors.mask,
            self.sigma.astype(dtype), self.epsilon.astype(dtype), cutoff=nc.cutoff, system=batch_idx,
            types=self._types(atomic_numbers), shift=self.shift, half_list=nc.half_list,
        )
        volume = jnp.abs(jnp.linalg.det(cell))
        safe = jnp.where(volume > 0, volume, 1.0)[:, None, None]
        stress = jnp.where((volume > 0)[:, None, None], -per_system_sum(virial, batch_idx, n_systems) / safe, 0.0)
        return {
            "energy": per_system_sum(atomic, batch_idx, n_systems),
            "atomic_energies": atomic,
            "forces": forces,
            "stress": stress,
        }
