"""Per-atom virials, derived from the energy through the edge vectors.

The energy of a model that sees positions and cell only through the edge vectors
``r_e = x_sender - x_receiver + shift @ cell`` (:func:`jaxdd.edge_vectors`) has the virial
``W = -sum_e r_e ⊗ dE/dr_e``: the derivative with respect to a strain ``ε`` of positions and
cell is ``dE/dε = sum_e r_e ⊗ dE/dr_e = V σ``. Each edge's term goes to its receiver (the
atom whose neighbour it is), so with a full neighbour list

    atomic_virials[i] = -sum_{e: receiver(e) = i} r_e ⊗ dE/dr_e      [V, 3, 3] eV

and the per-atom virials of a system sum to ``-V σ`` (its virial), as heat-flux
calculations need. ``dE/dr_e`` is the gradient with respect to a zero offset added to every
edge vector (``NeighborList.displacement``). A model whose energy also depends on positions
another way (a reciprocal-space sum, its own distance computation) breaks the sum rule;
:func:`enforce_sum_rule` turns such results into NaN, which :func:`refuse_broken` refuses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..neighbors import NeighborListFormat

__all__ = ["atomic_virials", "enforce_sum_rule", "tolerance", "check_supported", "refuse_broken"]


def tolerance(dtype) -> float:
    """Largest relative difference between the summed per-atom virials and the strain
    derivative that is still round-off, for ``dtype``: 1e-8 in float64, 1e-3 in float32."""
    return 1e-8 if jnp.dtype(dtype) == jnp.float64 else 1e-3


def refuse_broken(values, model_name: str, key: str) -> None:
    """Raise ValueError when per-atom virials (host values) came back NaN: they broke the sum rule.

    Args:
      values: [V, 3, 3] per-atom virials (eV), on the host.
      model_name: the model, for the message.
      key: the output key of the virials, for the message.
    """
    import numpy as np

    if np.isnan(np.asarray(values)).any():
        raise ValueError(
            f"the per-atom virials {key!r} of {model_name} do not sum to its virial (the strain derivative of the "
            "energy): its energy depends on positions or the cell other than through jaxdd.edge_vectors (a "
            "reciprocal-space sum, distances it computes itself), or is not finite; per-atom virials need an "
            "energy of the edge vectors")


def check_supported(nc, model_name: str, key: str, *, deep: bool = False) -> None:
    """Raise ValueError when per-atom virials cannot be derived for a model's neighbour list.

    Args:
      nc: the model's :class:`~jaxdd.NeighborConfig`. model_name: its class name, for the
      message. key: the spec's ``node_virial_key``. deep: a deep halo (edges on ghost rows).
    """
    why = None
    if nc is None:
        why = "it declares no neighbour list"
    elif NeighborListFormat(nc.format) is not NeighborListFormat.COO:
        why = "it reads a MATRIX neighbour list, whose vectors it computes itself (COO lists only)"
    elif nc.half_list:
        why = "it reads a half neighbour list (each pair once: no receiver of its own per atom); use half_list=False"
    elif deep:
        why = "the spec's deep halo computes edges on ghost rows too; use a halo_correction spec"
    if why is not None:
        raise ValueError(f"{key!r} (the spec's node_virial_key) needs the energy's gradient by edge vector, but "
                         f"{model_name} cannot give it: {why}")


def atomic_virials(vectors, grad_vectors, mask, receivers, n_rows: int):
    """Per-atom virials [n_rows, 3, 3] eV from edge vectors and the energy's gradient by them.

    Args:
      vectors: [E, 3] Å edge vectors (padding rows zero). grad_vectors: [E, 3] eV/Å dE/dr_e.
      mask: [E] real edges. receivers: [E] receiving row of each edge (padding: n_rows or
      beyond, dropped). n_rows: rows of the result.
    """
    per_edge = -vectors[:, :, None] * jnp.where(mask[:, None], grad_vectors, 0.0)[:, None, :]
    return jax.ops.segment_sum(per_edge, receivers, num_segments=n_rows)


def enforce_sum_rule(per_atom, summed, strain_derivative, system_mask):
    """``per_atom`` ([V, 3, 3] eV), or NaN everywhere when the per-system sums of the per-atom
    virials (``summed`` [S, 3, 3]) differ from ``-dE/dε`` (``strain_derivative`` [S, 3, 3]) of
    the real systems (``system_mask`` [S]) by more than :func:`tolerance`, relative to the
    largest of the latter."""
    real = system_mask[:, None, None]
    summed, strain_derivative = jnp.where(real, summed, 0.0), jnp.where(real, strain_derivative, 0.0)
    scale = jnp.maximum(jnp.max(jnp.abs(strain_derivative)), jnp.finfo(strain_derivative.dtype).tiny)
    residual = jnp.max(jnp.abs(summed + strain_derivative)) / scale
    return jnp.where(residual <= tolerance(per_atom.dtype), per_atom, jnp.nan)
