"""Per-molecule helpers of the charge-equilibration model, written as third-party code often is.

``mol_sum`` assumes the atoms of each molecule are contiguous and in order, as they are in an
ordinary single-device batch; under domain decomposition a rank holds only some atoms of a
molecule (and ghost copies), so this helper is wrong there. The model's spec replaces it
with a distribution-aware version (see :mod:`jaxdd.models.qeq`).
"""

import jax.numpy as jnp


def mol_sum(values, mol_idx, n_molecules):
    """Per-molecule sums of per-atom ``values`` [N] by a running sum over the atoms.

    mol_idx: [N] molecule of each atom (padding atoms hold ``n_molecules``). Returns [n_molecules].
    """
    counts = jnp.bincount(mol_idx, length=n_molecules)
    ends = jnp.cumsum(counts)
    running = jnp.concatenate([jnp.zeros(1, values.dtype), jnp.cumsum(jnp.where(mol_idx < n_molecules, values, 0))])
    return running[ends] - running[ends - counts]
