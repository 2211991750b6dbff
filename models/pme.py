"""Smooth particle-mesh Ewald (Essmann et al., J. Chem. Phys. 103, 8577 (1995)).

The energy has the terms of :mod:`jaxdd.models.ewald` (same units: e, Å, eV; Coulomb
constant k = 14.3996454784 eV Å / e², :data:`jaxdd.data.constants.COULOMB`); only the reciprocal sum
is approximated. Charges are spread onto a periodic K1 × K2 × K3 mesh with cardinal B-splines
of order p (default 6, even, >= 4), Fourier transformed, and

    E_recip = k / (2π V) Σ_{m ≠ 0} exp(-π² |m|² / α²) / |m|² · B(m) |F(Q)(m)|²

with m = m1 b1 + m2 b2 + m3 b3 (b_a reciprocal vectors) and B(m) = Π_a |b_a(m_a)|² the
B-spline moduli correction. Forces and stress are the framework's derivatives of the energy.

Accuracy: α = √(-ln ε) / r_c as in Ewald; with ``mesh=None`` the mesh is chosen on the host
from each batch's cells (:meth:`PME.validate_input`): K_a covers the reciprocal vectors
|k| < k_max with :data:`MESH_MARGIN` times the Nyquist minimum, rounded up to a size the
distributed FFT can cut: a multiple of 24, which fits every rank grid whose Px and Py·Pz divide
24 (all grids of up to 8 ranks, and e.g. (3, 2, 1) or (2, 3, 2); see
:func:`jaxdd.models.pme_grid.mesh_problems`). Other grids need a ``mesh`` that fits them.

Two ways to run under decomposition (the model's ``distribution_spec`` follows the choice):

- ``distributed_fft=True`` (default): the mesh is distributed, each rank holding one block
  (:mod:`jaxdd.models.pme_grid`): O(mesh / P) memory per rank. Spec: ``SPEC_PME_HALO``.
- ``distributed_fft=False``: the PyTorch system's way: each rank spreads its owned atoms
  onto the whole mesh, the meshes are all-reduced and every rank transforms the whole mesh.
  Spec: ``SPEC_PME_HALO`` with an :class:`~jaxdd.spec.OpAdapter` for
  ``jaxdd_mesh::spread`` (``SliceOwned`` inputs, ``AllReduceSum(replicated_consumer=True)``).

On one device both are plain ``jnp.fft``. A net charge is neutralised by a uniform
background, as in Ewald.
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from jaxdd.models import pme_grid
from jaxdd.data.checks import integral
from jaxdd.data.segments import per_system_sum
from jaxdd.dispatch.intent import system_sum

from .ewald import (COULOMB, EwaldBase, HostSizes, ewald_parameters, long_range_config, real_space, reciprocal,
                    self_and_background)

__all__ = ["PME", "MESH_MARGIN", "MESH_MULTIPLE"]

#: Mesh points per axis over the Nyquist minimum 2 |m_a|max (interpolation error of order-p splines).
MESH_MARGIN = 2.0
#: Auto mesh sizes are multiples of this, so that the distributed FFT can cut them.
MESH_MULTIPLE = 24


class PME(EwaldBase):
    """Smooth particle-mesh Ewald (see the module docstring for terms and units).

    cutoff: real-space cutoff r_c (Å). accuracy: ε, sets α (as in :class:`Ewald`) and the
    auto mesh. mesh: (K1, K2, K3) mesh points along the three lattice vectors, or None to
    choose them from each batch. distributed_fft: distribute the mesh and its FFT under
    decomposition (else replicate it). order: B-spline order p (even, >= 4).

    Reads ``charges`` [V] (e); real systems must be periodic along all three axes.
    Outputs: ``energy`` [S] eV, and from the framework's autodiff ``forces`` [V, 3] eV/Å and
    ``stress`` [S, 3, 3] eV/Å³.
    """

    order: int = eqx.field(static=True)
    distributed_fft: bool = eqx.field(static=True)
    sized: ClassVar[str] = "its mesh"
    fix: ClassVar[str] = "mesh=(K1, K2, K3)"

    def __init__(self, cutoff: float, accuracy: float = 1e-6, mesh=None, distributed_fft: bool = True,
                 order: int = 6):
        self.alpha, self.kmax = ewald_parameters(cutoff, accuracy)
        self.accuracy = float(accuracy)
        self.order = pme_grid.check_order(order)
        self.distributed_fft = bool(distributed_fft)
        if mesh is not None:
            try:
                mesh = tuple(integral("PME mesh", k, minimum=1) for k in mesh)
            except TypeError:
                raise ValueError(f"PME mesh must be three integers (K1, K2, K3) or None, got {mesh!r}") from None
            if len(mesh) != 3 or min(mesh) < self.order:
                raise ValueError(f"PME mesh must be three integers >= the B-spline order {self.order}, got {mesh!r}")
        self.sizes = HostSizes(mesh, fixed=mesh is not None)
        self.model_config = long_range_config(cutoff, {"energy", "forces", "stress"})

    @property
    def mesh(self) -> tuple[int, int, int] | None:
        """The mesh (K1, K2, K3) in use: given, or chosen from the last batch (None before one)."""
        return self.sizes.value

    @property
    def distribution_spec(self):
        from jaxdd.ops import AllReduceSum, SliceOwned
        from jaxdd.spec import SPEC_PME_HALO, OpAdapter

        if self.distributed_fft:
            return SPEC_PME_HALO
        return SPEC_PME_HALO.with_custom_ops(OpAdapter(
            pme_grid.spread_op, arg_transforms={i: SliceOwned() for i in range(4)},
            output_transforms={0: AllReduceSum(replicated_consumer=True)}))

    def mesh_for(self, cells) -> tuple[int, int, int]:
        """The auto mesh for cells [S, 3, 3] (Å): see the module docstring."""
        lengths = np.linalg.norm(np.asarray(cells, np.float64).reshape(-1, 3, 3), axis=-1).max(axis=0, initial=0.0)
        nyquist = 2.0 * self.kmax * lengths / (2 * math.pi)
        need = np.maximum(np.ceil(MESH_MARGIN * nyquist), 2 * self.order)
        return tuple(int(-(-k // MESH_MULTIPLE) * MESH_MULTIPLE) for k in need)

    def sizes_for(self, cells) -> tuple[int, int, int]:
        """The host's choice of sizes for ``cells`` [S, 3, 3] (Å): :meth:`mesh_for`."""
        return self.mesh_for(cells)

    def forward(self, positions, charges, cell, batch_idx, atom_mask, neighbors, n_systems):
        shape = self.sizes.value
        dtype = positions.dtype
        rc = self.model_config.neighbor_config.cutoff
        q = jnp.where(atom_mask, charges.astype(dtype), 0.0)
        system = jnp.clip(batch_idx, 0, n_systems - 1)
        recip, volume = reciprocal(cell.astype(dtype))
        frac = jnp.einsum("vi,vai->va", positions, recip[system])
        base, weights = pme_grid.bspline_weights(frac * jnp.asarray(shape, dtype), self.order)
        moduli = tuple(jnp.asarray(pme_grid.bspline_moduli(k, self.order), dtype) for k in shape)
        if self.distributed_fft:
            mesh_sum = pme_grid.pme_energy(q, weights, base, system, recip, volume, self.alpha, moduli)
        else:
            charge_mesh = pme_grid.spread_op(q, weights, base, system, jnp.zeros((n_systems,) + tuple(shape), dtype))
            mesh_sum = pme_grid.pme_sum(charge_mesh, recip, volume, jnp.asarray(self.alpha, dtype), moduli)

        total = system_sum(q, batch_idx, n_systems)
        atomic = (real_space(q, positions, cell, batch_idx, neighbors, self.alpha, rc)
                  + self_and_background(q, system, total, volume, self.alpha))
        atomic = jnp.where(atom_mask & (batch_idx < n_systems), atomic, 0.0)
        return {"energy": per_system_sum(atomic, batch_idx, n_systems) + COULOMB * mesh_sum}
