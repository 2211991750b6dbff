"""Ewald summation of point-charge electrostatics in periodic cells.

For charges q_i (e) at positions r_i (Å) in a periodic cell of volume V (Å³)

    E = E_real + E_recip + E_self + E_background

    E_real  = ½ Σ_i Σ_{j, n; r < r_c} k q_i q_j erfc(α r) / r          (r = |r_j + n - r_i|)
    E_recip = (2π k / V) Σ_{k ≠ 0, |k| < k_max} exp(-k² / 4α²) / k² |S(k)|²,
              S(k) = Σ_j q_j exp(i k·r_j)
    E_self  = -k α / √π Σ_i q_i²
    E_background = -π k Q² / (2 V α²),   Q = Σ_i q_i

with k = 14.3996454784 eV Å / e² (:data:`COULOMB`, CODATA 2018, from :mod:`jaxdd.data.constants`).
Energies are in eV, forces in eV/Å, stress in eV/Å³ (forces and stress are the framework's
derivatives of the energy).

Accuracy: one parameter ``accuracy`` (ε) sets both truncations. The splitting parameter is
α = √(-ln ε) / r_c (Å⁻¹), so erfc(α r_c) ≈ ε, and the reciprocal cutoff is
k_max = 2 α √(-ln ε) (Å⁻¹), so exp(-k_max² / 4α²) = ε.

Net charge: a cell whose charges do not sum to zero is neutralised by a uniform background
(E_background above, the usual correction of Ewald codes and pymatgen's
``EwaldSummation``); for a neutral cell the term is zero.

Under decomposition the real-space sum runs on the halo (the framework's neighbour list at
r_c) and the structure factors are per-system sums over atoms, said with
:func:`jaxdd.system_sum`: each rank sums its owned atoms and the ranks' sums are
all-reduced, so every rank evaluates the reciprocal term from the global S(k).

The reciprocal vectors k = 2π n·B (n integer, B the reciprocal basis) that can satisfy
|k| < k_max have |n_a| ≤ k_max |a_a| / 2π; the number of them sets array shapes, so it is
chosen on the host from each batch's cells (:meth:`Ewald.validate_input`, called by
``jaxdd.compute`` and ``DistributedModel`` before tracing) unless given as ``kmax_index``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.data.constants import COULOMB
from jaxdd.model.base import BaseModel, ModelConfig, NeighborConfig
from jaxdd.neighbors import edge_vectors
from jaxdd.data.segments import per_system_sum
from jaxdd.dispatch.intent import system_sum

__all__ = ["Ewald", "EwaldBase", "COULOMB", "ewald_parameters", "long_range_config", "HostSizes"]


def ewald_parameters(cutoff: float, accuracy: float) -> tuple[float, float]:
    """(α Å⁻¹, k_max Å⁻¹) for a real-space cutoff r_c (Å) and a relative accuracy ε in (0, 1)."""
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)) or not 0.0 < cutoff < math.inf:
        raise ValueError(f"cutoff must be a positive finite number (Å), got {cutoff!r}")
    if isinstance(accuracy, bool) or not isinstance(accuracy, (int, float)) or not 0.0 < accuracy < 1.0:
        raise ValueError(f"accuracy must be a number in (0, 1), e.g. 1e-8; got {accuracy!r}")
    s = math.sqrt(-math.log(accuracy))
    alpha = s / float(cutoff)
    return alpha, 2.0 * alpha * s


@jax.tree_util.register_pytree_node_class
class HostSizes:
    """Array sizes a model chooses on the host from a concrete batch and reads while tracing.

    A pytree node with no leaves whose auxiliary data is the current choice (a tuple of
    ints, or None before the first batch): a new choice is a new tree structure, so jit
    compiles a program for it instead of reusing one of other shapes.
    """

    def __init__(self, value=None, fixed: bool = False):
        self._box = [value]
        self.fixed = fixed

    @property
    def value(self):
        """The current choice (a tuple of ints), or None before the first batch."""
        return self._box[0]

    def set(self, value) -> None:
        """Choose ``value`` for the next trace (ignored when the sizes are fixed)."""
        if not self.fixed:
            self._box[0] = value

    def tree_flatten(self):
        """No children; the choice and ``fixed`` as aux data."""
        return (), (self._box[0], self.fixed)

    @classmethod
    def tree_unflatten(cls, aux, children):
        """Rebuild from the ``aux`` data of :meth:`tree_flatten` (``children`` is empty)."""
        return cls(*aux)


def check_periodic_charges(data, name: str) -> None:
    """Host checks shared by Ewald and PME: charges present, real systems periodic in 3-D."""
    if data.charges is None:
        raise ValueError(f"{name} needs per-atom charges (e): the batch has no 'charges' field; build it with "
                         "AtomicData(..., charges=q) or Batch.from_ase(atoms) with atoms.set_initial_charges(q)")
    pbc = np.asarray(data.pbc, bool).reshape(-1, 3)
    real = np.asarray(data.system_mask, bool)
    bad = np.flatnonzero(real & ~pbc.all(axis=1))
    if bad.size:
        raise ValueError(f"{name} sums over periodic images in three dimensions, but system(s) {bad[:8].tolist()} "
                         f"have pbc {pbc[bad[0]].tolist()}; use a cell periodic along all three axes")


def charged_inputs(data, name: str, sizes: HostSizes, what: str, fix: str) -> dict:
    """The forward arguments of Ewald and PME from a traced Batch, once the host has sized
    ``what`` (or the user fixed it with ``fix``)."""
    if sizes.value is None:
        raise ValueError(f"{name} has not chosen {what}: call it through jaxdd.compute or DistributedModel (which "
                         f"size it from the batch), or pass {fix}")
    if data.neighbors is None:
        raise ValueError(f"{name} needs data.neighbors; call it through jaxdd.compute or DistributedModel")
    if data.charges is None:
        raise ValueError(f"{name} needs per-atom charges (e) in the batch's 'charges' field")
    return dict(positions=data.positions, charges=data.charges, cell=data.cell, batch_idx=data.batch_idx,
                atom_mask=data.atom_mask, neighbors=data.neighbors, n_systems=data.n_systems)


def real_cells(data) -> np.ndarray:
    """[S_real, 3, 3] cells (Å) of the batch's real systems, as float64 host arrays."""
    cell = np.asarray(data.cell, np.float64).reshape(-1, 3, 3)
    return cell[np.asarray(data.system_mask, bool)]


def reciprocal(cell):
    """(B [S, 3, 3] with rows b_a, a_a·b_b = δ_ab (Å⁻¹, no 2π), V [S] Å³) of cells [S, 3, 3]."""
    a0, a1, a2 = cell[:, 0], cell[:, 1], cell[:, 2]
    c = jnp.stack([jnp.cross(a1, a2), jnp.cross(a2, a0), jnp.cross(a0, a1)], axis=1)
    det = jnp.sum(a0 * c[:, 0], axis=-1)
    safe = jnp.where(det != 0, det, 1.0)
    return c / safe[:, None, None], jnp.abs(det)


def real_space(q, positions, cell, batch_idx, neighbors, alpha, cutoff):
    """Per-atom real-space energies [V] eV: ½ Σ_j k q_i q_j erfc(α r)/r over neighbours r < r_c."""
    vec = edge_vectors(positions, cell, batch_idx, neighbors)
    r2 = jnp.sum(vec * vec, axis=-1)
    inside = neighbors.mask & (r2 < cutoff * cutoff)
    r = jnp.sqrt(jnp.where(inside, r2, 1.0))  # safe value keeps gradients finite on padding
    n = q.shape[0]
    qq = q[jnp.minimum(neighbors.receivers, n - 1)] * q[jnp.minimum(neighbors.senders, n - 1)]
    pair = jnp.where(inside, COULOMB * qq * jax.scipy.special.erfc(alpha * r) / r, 0.0)
    return jax.ops.segment_sum(0.5 * pair, neighbors.receivers, n)


def self_and_background(q, system, total, volume, alpha):
    """Per-atom self and uniform-background energies [V] eV; total: [S] net charge e, volume: [S] Å³."""
    self_energy = -COULOMB * alpha / math.sqrt(math.pi) * q * q
    background = -math.pi * COULOMB / (2.0 * alpha * alpha) * q * (total / volume)[system]
    return self_energy + background


def _half_space(nmax) -> np.ndarray:
    """Integer vectors n with |n_a| ≤ nmax_a, one of each pair ±n, n ≠ 0: [n_k, 3]."""
    axes = [np.arange(-m, m + 1) for m in nmax]
    n = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, 3)
    first = np.where(n[:, 0] != 0, n[:, 0], np.where(n[:, 1] != 0, n[:, 1], n[:, 2]))
    return n[first > 0]


def long_range_config(cutoff: float, outputs) -> ModelConfig:
    """The config of Ewald and PME: energy and forces active, forces and stress by autodiff.

    Args:
      cutoff: real-space cutoff r_c (Å) of the neighbour list.
      outputs: the output names the model offers.

    Returns:
      the :class:`~jaxdd.model.base.ModelConfig`.
    """
    return ModelConfig(
        outputs=frozenset(outputs),
        active_outputs=frozenset({"energy", "forces"}),
        autograd_outputs=frozenset({"forces", "stress"}),
        autograd_inputs=frozenset({"positions", "cell"}),
        neighbor_config=NeighborConfig(cutoff=cutoff),
    )


class EwaldBase(eqx.Module, BaseModel):
    """What Ewald and PME share: α and k_max from the accuracy, sizes chosen on the host from
    each batch's cells, and the charged, periodic inputs.

    A subclass sets ``sized`` (what the host sizes, for messages) and ``fix`` (the argument
    that fixes it), and writes :meth:`sizes_for` and ``forward``.
    """

    alpha: float = eqx.field(static=True)
    kmax: float = eqx.field(static=True)
    accuracy: float = eqx.field(static=True)
    sizes: HostSizes
    model_config: ModelConfig = eqx.field(static=True)
    sized: ClassVar[str] = "its sizes"
    fix: ClassVar[str] = "fixed sizes"

    def sizes_for(self, cells) -> tuple[int, int, int]:
        """The sizes covering |k| < k_max in every one of ``cells``.

        Args:
          cells: [S, 3, 3] (Å), rows lattice vectors.

        Returns:
          three ints.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement sizes_for(cells)")

    def validate_input(self, data) -> None:
        """Host checks of ``data`` (charges, systems periodic in 3-D), then sizes chosen from its cells.

        Args:
          data: a concrete Batch.
        """
        check_periodic_charges(data, type(self).__name__)
        self.sizes.set(self.sizes_for(real_cells(data)))

    def adapt_input(self, data, **kwargs) -> dict:
        """The inputs of ``forward`` (:func:`charged_inputs`).

        Args:
          data: the Batch, its neighbour list attached. kwargs: of the wrapper's call (unused).

        Returns:
          dict of positions, charges, cell, batch_idx, atom_mask, neighbors and n_systems.
        """
        return charged_inputs(data, type(self).__name__, self.sizes, self.sized, self.fix)


class Ewald(EwaldBase):
    """Ewald electrostatics (see the module docstring for the terms and units).

    cutoff: real-space cutoff r_c (Å). accuracy: ε, sets α and k_max. kmax_index: the
    largest |n_a| of the reciprocal vectors k = 2π n·B summed over, or None to choose it
    from each batch's cells on the host.

    Reads ``charges`` [V] (e) from the batch; every real system must be periodic along all
    three axes. Outputs: ``energy`` [S] eV, ``atomic_energies`` [V] eV, and from the
    framework's autodiff ``forces`` [V, 3] eV/Å and ``stress`` [S, 3, 3] eV/Å³.
    """

    sized: ClassVar[str] = "its reciprocal vectors"
    fix: ClassVar[str] = "kmax_index=(n1, n2, n3)"

    def __init__(self, cutoff: float, accuracy: float = 1e-8, kmax_index=None):
        self.alpha, self.kmax = ewald_parameters(cutoff, accuracy)
        self.accuracy = float(accuracy)
        if kmax_index is not None:
            kmax_index = tuple(integral("Ewald kmax_index", m, minimum=0) for m in kmax_index)
            if len(kmax_index) != 3:
                raise ValueError(f"Ewald kmax_index must be three integers >= 0, got {kmax_index!r}")
        self.sizes = HostSizes(kmax_index, fixed=kmax_index is not None)
        self.model_config = long_range_config(cutoff, {"energy", "atomic_energies", "forces", "stress"})

    @property
    def distribution_spec(self):
        from jaxdd.spec import SPEC_EWALD_HALO

        return SPEC_EWALD_HALO


    def kmax_index_for(self, cells) -> tuple[int, int, int]:
        """The smallest ``kmax_index`` covering |k| < k_max in every one of ``cells`` [S, 3, 3] (Å)."""
        lengths = np.linalg.norm(np.asarray(cells, np.float64).reshape(-1, 3, 3), axis=-1)
        need = np.floor(self.kmax * lengths.max(axis=0, initial=0.0) / (2 * math.pi)).astype(int)
        return tuple(max(1, int(m)) for m in need)

    def sizes_for(self, cells) -> tuple[int, int, int]:
        """The host's choice of sizes for ``cells`` [S, 3, 3] (Å): :meth:`kmax_index_for`."""
        return self.kmax_index_for(cells)

    def forward(self, positions, charges, cell, batch_idx, atom_mask, neighbors, n_systems):
        dtype = positions.dtype
        rc = self.model_config.neighbor_config.cutoff
        q = jnp.where(atom_mask, charges.astype(dtype), 0.0)
        system = jnp.clip(batch_idx, 0, n_systems - 1)

        recip, volume = reciprocal(cell.astype(dtype))  # [S, 3, 3], [S]
        n = jnp.asarray(_half_space(self.sizes.value), dtype)  # [n_k, 3]
        kvec = 2 * math.pi * jnp.einsum("ka,sab->skb", n, recip)  # [S, n_k, 3]
        k2 = jnp.sum(kvec * kvec, axis=-1)
        inside = k2 < self.kmax * self.kmax
        # Each ±k pair counted once, hence 4π instead of 2π.
        green = jnp.where(inside, 4 * math.pi * COULOMB * jnp.exp(-k2 / (4 * self.alpha ** 2))
                          / jnp.where(inside, k2, 1.0), 0.0) / volume[:, None]  # [S, n_k]

        frac = jnp.einsum("vi,vai->va", positions, recip[system])  # k·r = 2π n·frac
        phase = 2 * math.pi * frac @ n.T  # [V, n_k]
        cos, sin = jnp.cos(phase), jnp.sin(phase)
        s_cos = system_sum(q[:, None] * cos, batch_idx, n_systems)  # [S, n_k], every atom once
        s_sin = system_sum(q[:, None] * sin, batch_idx, n_systems)
        recip_atomic = q * jnp.sum(green[system] * (cos * s_cos[system] + sin * s_sin[system]), axis=-1)

        total = system_sum(q, batch_idx, n_systems)
        atomic = (real_space(q, positions, cell, batch_idx, neighbors, self.alpha, rc) + recip_atomic
                  + self_and_background(q, system, total, volume, self.alpha))
        atomic = jnp.where(atom_mask & (batch_idx < n_systems), atomic, 0.0)
        return {"energy": per_system_sum(atomic, batch_idx, n_systems), "atomic_energies": atomic}
