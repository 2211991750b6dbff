"""Lennard-Jones pair potential.

    V(r) = 4 ε [(σ/r)^12 - (σ/r)^6] - V_shift,   r < r_c

with ``V_shift = V(r_c)`` when ``shift=True`` (ASE's ``LennardJones(smooth=False)``) and 0
otherwise (LAMMPS ``pair_style lj/cut``). Units are the caller's: σ and r_c in the length
unit of the positions (Å), ε in the energy unit (eV); LJ reduced units work the same way.

Per-species-pair parameters: pass ``species`` (atomic numbers) and ``[K, K]`` symmetric
``sigma``/``epsilon`` matrices, row/column ``k`` belonging to ``species[k]``.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.model.base import BaseModel, ModelConfig, ModelOutputs, NeighborConfig
from jaxdd.neighbors import NeighborListFormat, edge_vectors
from jaxdd.data.segments import per_system_sum

__all__ = ["LennardJones"]


def _param(name, value, species):
    arr = np.asarray(value, dtype=np.float64)
    if species is None:
        if arr.ndim != 0:
            raise ValueError(f"LennardJones {name} must be a scalar when species is None, got shape {arr.shape}")
    else:
        k = len(species)
        if arr.ndim == 0:
            arr = np.full((k, k), float(arr))
        if arr.shape != (k, k):
            raise ValueError(f"LennardJones {name} must be [{k}, {k}] for species {species}, got shape {arr.shape}")
        if not np.allclose(arr, arr.T, rtol=0, atol=0):
            raise ValueError(f"LennardJones {name} must be symmetric: {name}[a, b] == {name}[b, a]")
    if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError(f"LennardJones {name} must be positive and finite, got {value!r}")
    return arr


@jax.custom_jvp
def _lj_pair(r2, s2, epsilon):
    """4 ε [(s2/r2)^6 - (s2/r2)^3] per pair: r2 = r² (Å²), s2 = σ² (Å²), ε (eV).

    Its derivative is written out (custom_jvp) because autodiff of the power expression
    leaves XLA a longer chain to evaluate per pair in the backward pass, and XLA recomputes
    that chain once for each of the two force scatters (receiver and sender).
    """
    s6 = (s2 / r2) ** 3
    return 4.0 * epsilon * (s6 * s6 - s6)


@_lj_pair.defjvp
def _lj_pair_jvp(primals, tangents):
    r2, s2, epsilon = primals
    dr2, ds2, deps = tangents
    s6 = (s2 / r2) ** 3
    s12 = s6 * s6
    pair = 4.0 * epsilon * (s12 - s6)
    # d pair / d r2 = -4 ε (6 s12 - 3 s6) / r2; d pair / d s2 = 4 ε (6 s12 - 3 s6) / s2.
    slope = 4.0 * epsilon * (6.0 * s12 - 3.0 * s6)
    return pair, slope * (ds2 / s2 - dr2 / r2) + 4.0 * (s12 - s6) * deps


class LennardJones(eqx.Module, BaseModel):
    """Lennard-Jones energy, atomic energies, forces and stress.

    sigma: σ (Å), scalar or [K, K]; epsilon: ε (eV), scalar or [K, K]; cutoff: r_c (Å);
    shift: subtract V(r_c) from every pair; species: atomic numbers of the K rows, or None
    (one species for all atoms). half_list/skin/format choose the neighbour list.

    Outputs: ``energy [S]``, ``atomic_energies [V]`` (half of each pair to each atom),
    and, from the framework's autodiff, ``forces [V, 3]`` and ``stress [S, 3, 3]``.
    """

    sigma: jax.Array
    epsilon: jax.Array
    shift: bool = eqx.field(static=True)
    species: tuple[int, ...] | None = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(
        self,
        sigma=1.0,
        epsilon=1.0,
        cutoff: float = 2.5,
        shift: bool = False,
        species=None,
        *,
        half_list: bool = False,
        skin: float = 0.0,
        format: NeighborListFormat = NeighborListFormat.COO,
    ):
        if species is not None:
            species = tuple(integral("LennardJones species", z, minimum=1) for z in species)
            if len(set(species)) != len(species) or min(species, default=1) < 1:
                raise ValueError(f"LennardJones species must be distinct atomic numbers >= 1, got {species}")
        self.sigma = jnp.asarray(_param("sigma", sigma, species))
        self.epsilon = jnp.asarray(_param("epsilon", epsilon, species))
        self.shift = bool(shift)
        self.species = species
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "atomic_energies", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}),
            neighbor_config=NeighborConfig(cutoff=cutoff, format=format, half_list=half_list, skin=skin),
        )

    @property
    def distribution_spec(self):
        from jaxdd.spec import SPEC_LJ_HALO

        return SPEC_LJ_HALO

    def validate_input(self, data) -> None:
        if self.species is None:
            return
        z = np.asarray(data.atomic_numbers)[np.asarray(data.atom_mask)]
        bad = np.flatnonzero(~np.isin(z, self.species))
        if bad.size:
            rows = np.flatnonzero(np.asarray(data.atom_mask))[bad]
            raise ValueError(
                f"atoms {rows[:8].tolist()} have atomic numbers {sorted(set(z[bad].tolist()))} that are not in "
                f"LennardJones species {self.species}; add parameters for them"
            )

    def adapt_input(self, data, **kwargs) -> dict:
        nl = data.neighbors
        if nl is None:
            raise ValueError("LennardJones needs data.neighbors; call it through jaxdd.compute")
        return dict(
            positions=data.positions,
            cell=data.cell,
            batch_idx=data.batch_idx,
            atomic_numbers=data.atomic_numbers,
            neighbors=nl,
            n_systems=data.n_systems,
        )

    def _pair_params(self, atomic_numbers, receivers, senders, dtype):
        sigma = self.sigma.astype(dtype)
        epsilon = self.epsilon.astype(dtype)
        if self.species is None:
            return sigma, epsilon
        table = np.zeros(max(self.species) + 1, np.int32)
        table[list(self.species)] = np.arange(len(self.species))
        kind = jnp.asarray(table)[jnp.clip(atomic_numbers, 0, table.size - 1)]
        n = atomic_numbers.shape[0]
        a = kind[jnp.minimum(receivers, n - 1)]
        b = kind[jnp.minimum(senders, n - 1)]
        return sigma[a, b], epsilon[a, b]

    def forward(self, positions, cell, batch_idx, atomic_numbers, neighbors, n_systems):
        dtype = positions.dtype
        n = positions.shape[0]
        rc = self.model_config.neighbor_config.cutoff
        vec = edge_vectors(positions, cell, batch_idx, neighbors)
        r2 = jnp.sum(vec * vec, axis=-1)
        inside = neighbors.mask & (r2 < rc * rc)
        r2 = jnp.where(inside, r2, 1.0)  # safe value keeps gradients finite on padding
        sigma, epsilon = self._pair_params(atomic_numbers, neighbors.receivers, neighbors.senders, dtype)
        pair = _lj_pair(r2, sigma * sigma, epsilon)
        if self.shift:
            c6 = (sigma * sigma / (rc * rc)) ** 3
            pair = pair - 4.0 * epsilon * (c6 * c6 - c6)
        pair = jnp.where(inside, pair, 0.0)
        # Each pair's energy is split evenly between its two atoms.
        atomic = jax.ops.segment_sum(0.5 * pair, neighbors.receivers, n)
        if self.model_config.neighbor_config.half_list:
            atomic = atomic + jax.ops.segment_sum(0.5 * pair, neighbors.senders, n)
        energy = per_system_sum(atomic, batch_idx, n_systems)
        return {"energy": energy, "atomic_energies": atomic}

    def adapt_output(self, raw, data) -> ModelOutputs:
        return ModelOutputs(raw)
