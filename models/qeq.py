"""Charge equilibration in the AIMNet2 manner: predicted electronegativities and hardnesses,
charges equilibrated per molecule to its total charge, a damped Coulomb energy.

For atom i with learned features h_i (two rounds of radial message passing), the network
predicts an electronegativity χ_i (eV/e) and a hardness J_i > 0 (eV/e²). Minimising
Σ_i (χ_i q_i + ½ J_i q_i²) subject to Σ_{i∈m} q_i = Q_m for each molecule m gives

    q_i = (λ_m − χ_i) / J_i,   λ_m = (Q_m + Σ_{i∈m} χ_i/J_i) / Σ_{i∈m} 1/J_i,

with Q_m the sum of the input ``charges`` (formal charges, e) of the molecule's atoms (0 when
the batch has none). The energy is

    E = Σ_i [ε(h_i) + χ_i q_i + ½ J_i q_i²] + ½ Σ_{i≠j, r<r_c} k q_i q_j erf(r/σ) / r · f_c(r)

with k = 14.3996454784 eV Å / e² (CODATA 2018, :data:`jaxdd.data.constants.COULOMB`) and a cosine
envelope f_c. The per-molecule sums go through :func:`jaxdd.models.qeq_helpers.mol_sum`, a
helper that assumes contiguous molecules; the spec declares a :class:`~jaxdd.PythonAdapter`
that swaps it for :func:`distributed_mol_sum` under decomposition. Outputs: ``energy`` [S] eV,
``atomic_energies`` [V] eV, ``charges`` [V] e (per node), ``forces`` [V, 3] eV/Å and ``stress``
[S, 3, 3] eV/Å³ from autodiff.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.constants import COULOMB
from jaxdd.neighbors import edge_vectors
from jaxdd.dispatch.intent import system_sum
from jaxdd.spec.adapters import PythonAdapter

from . import qeq_helpers
from .radial_messages import init_messages, normal, pass_messages, radial_filter
from .species import SpeciesNetwork



__all__ = ["ChargeEquilibration", "distributed_mol_sum", "COULOMB"]


def distributed_mol_sum(values, mol_idx, n_molecules):
    """The per-molecule sum under decomposition: each atom counted once, summed over ranks.

    Args:
      values: [V, ...] per-atom values.
      mol_idx: [V] int molecule of each atom.
      n_molecules: the number of molecules.

    Returns:
      [n_molecules, ...] sums.
    """
    return system_sum(values, mol_idx, n_molecules)


class ChargeEquilibration(SpeciesNetwork):
    """Charge-equilibration network (see the module docstring).

    species: atomic numbers the model knows. cutoff: r_c (Å) of message passing and Coulomb.
    features: width of the atom features. sigma: Coulomb damping length σ (Å). seed, dtype:
    deterministic initialisation and parameter precision.
    """

    sigma: float = eqx.field(static=True)

    def __init__(self, species=(1, 6, 7, 8), cutoff: float = 5.0, features: int = 16, sigma: float = 1.0,
                 seed: int = 0, dtype=jnp.float64):
        super().__init__(species, cutoff)
        self.sigma = float(sigma)
        k = jax.random.split(jax.random.PRNGKey(seed), 5)
        embed, radial, layers = init_messages(k, len(self.species), features, 8, 2, dtype)
        self.params = dict(embed=embed, radial=radial, layers=layers,
                           heads=normal(k[3], (features, 3), dtype) / np.sqrt(features))  # ε, χ, J
        # Charges are a further per-atom output, computed by default beside energy and forces.
        self.model_config = dataclasses.replace(
            self.model_config, outputs=self.model_config.outputs | {"charges"},
            active_outputs=frozenset({"energy", "forces", "charges"}))

    @property
    def distribution_spec(self):
        from jaxdd.spec import SPEC_MPNN_HALO, OutputKind

        return SPEC_MPNN_HALO.with_helpers(
            PythonAdapter("jaxdd.models.qeq_helpers", "mol_sum", replacement=distributed_mol_sum)
        ).with_output_kinds(charges=OutputKind.PER_NODE)

    def adapt_input(self, data, **kwargs) -> dict:
        nl = data.neighbors
        if nl is None:
            raise ValueError("ChargeEquilibration needs data.neighbors; call it through jaxdd.compute")
        formal = data.charges if data.charges is not None else jnp.zeros(data.positions.shape[0],
                                                                          data.positions.dtype)
        return dict(vectors=edge_vectors(data.positions, data.cell, data.batch_idx, nl), senders=nl.senders,
                    receivers=nl.receivers, edge_mask=nl.mask, atomic_numbers=data.atomic_numbers,
                    atom_mask=data.atom_mask, batch_idx=data.batch_idx, n_systems=data.n_systems, formal=formal)

    def forward(self, vectors, senders, receivers, edge_mask, atomic_numbers, atom_mask, batch_idx, n_systems,
                formal):
        dtype = vectors.dtype
        n = atomic_numbers.shape[0]
        rc = self.model_config.neighbor_config.cutoff
        kind = self.species_index(atomic_numbers)

        r2 = jnp.where(edge_mask, jnp.sum(vectors * vectors, axis=1), 1.0)
        r = jnp.where(edge_mask, jnp.sqrt(r2), 1.0)
        inside = edge_mask & (r < rc)
        filt, env = radial_filter(r, inside, rc, self.params["radial"])
        h = pass_messages(self.params["embed"].astype(dtype)[kind], self.params["layers"], filt, lambda x: x[senders], receivers)
        out = jnp.tanh(h) @ self.params["heads"].astype(dtype)
        eps, chi = out[:, 0], out[:, 1]
        hard = jax.nn.softplus(out[:, 2]) + 0.5

        real = atom_mask & (batch_idx < n_systems)
        inv_j = jnp.where(real, 1.0 / hard, 0.0)
        chi_j = jnp.where(real, chi / hard, 0.0)
        total = qeq_helpers.mol_sum(jnp.where(real, formal, 0.0), batch_idx, n_systems)
        softness = qeq_helpers.mol_sum(inv_j, batch_idx, n_systems)
        # An empty (padding) system has no softness; a safe divisor keeps NaN out of the gradient.
        lam = (total + qeq_helpers.mol_sum(chi_j, batch_idx, n_systems)) / jnp.where(softness > 0, softness, 1.0)
        q = jnp.where(real, (lam[jnp.minimum(batch_idx, n_systems - 1)] - chi) / hard, 0.0)

        erf = jax.scipy.special.erf(r / self.sigma)
        pair = jnp.where(inside, COULOMB * q[jnp.minimum(receivers, n - 1)] * q[jnp.minimum(senders, n - 1)]
                         * erf / r * env, 0.0)
        coulomb = jax.ops.segment_sum(0.5 * pair, receivers, num_segments=n)
        atomic = jnp.where(real, eps + chi * q + 0.5 * hard * q * q + coulomb, 0.0)
        return {"energy": jax.ops.segment_sum(atomic, batch_idx, num_segments=n_systems),
                "atomic_energies": atomic, "charges": q}
