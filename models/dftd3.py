"""DFT-D3 dispersion with Becke-Johnson (rational) damping, optionally with the
Axilrod-Teller-Muto three-body term: DFT-D3(BJ) and DFT-D3(BJ)-ATM.

Grimme, Antony, Ehrlich, Krieg, J. Chem. Phys. 132, 154104 (2010) (the model and its
reference C6 table); Grimme, Ehrlich, Goerigk, J. Comput. Chem. 32, 1456 (2011) (BJ
damping). The expressions and the conventions below are those of simple-dftd3 (the
``dftd3`` Python package), which this module reproduces to round-off.

Everything is evaluated in atomic units (bohr, hartree) and converted at the boundary:
positions and cells in Å, energies in eV, forces in eV/Å, stress in eV/Å³, with the CODATA
2018 constants simple-dftd3 uses (:data:`BOHR` Å per bohr, :data:`HARTREE` eV per hartree, from
:mod:`jaxdd.data.constants`).

For atoms A, B at distance r (bohr):

* coordination numbers, every neighbour within ``cn_cutoff``::

      CN_A = Σ_B 1 / (1 + exp(-k1 ((R_A + R_B) / r - 1))),   k1 = 16,

  with R = (4/3) × the covalent radius of Pyykkö and Atsumi (2009);
* C6 by Gaussian weighting over the reference coordination numbers of each element::

      w_A,a = exp(k3 (CN_A - CN_A,a)²) / Σ_a' exp(k3 (CN_A - CN_A,a')²),   k3 = -4,
      C6_AB = Σ_ab w_A,a w_B,b C6_ref(A, a, B, b);

* C8_AB = 3 C6_AB Q_A Q_B with Q = sqrt(0.5 <r⁴>/<r²> sqrt(Z));
* the pair energy, every pair within ``cutoff``, half to each atom::

      E_AB = -s6 C6 / (r⁶ + R0⁶) - s8 C8 / (r⁸ + R0⁸),   R0 = a1 sqrt(C8/C6) + a2;

* with ``three_body=True``, the ATM term for every triangle whose three sides are within
  ``three_body_cutoff``, a third to each atom, zero-damped as simple-dftd3 does for its
  rational damping (``s9 = 1``, ``alp = 16``, radii (4/3) R0_vdW of the D3 zero damping)::

      E_ABC = s9 sqrt(C6_AB C6_AC C6_BC) (3 cos a cos b cos c + 1) / (r_AB r_AC r_BC)³
              / (1 + 6 (R̄ / r̄)^(alp/3)),

  R̄ and r̄ the products of the three radii and of the three distances.

Nothing is smoothed at the cutoffs (simple-dftd3's default). The reference table, radii and
<r⁴>/<r²> ratios ship in ``data/dftd3_bj.npz`` (see ``data/README.md`` for their source).
Forces and stress come from the framework's autodiff of the energy.

Under domain decomposition a pair energy needs the coordination numbers of both atoms; the
CN is a scatter-add over the neighbour list, so under the default spec (``SPEC_DFTD3_HALO``)
ghost rows get their owners' CN and one ghost shell of ``max(cutoff, cn_cutoff,
three_body_cutoff)`` suffices. Under a deep spec (``scatter_mode="local"``) ghosts count
their own neighbours, and the shell must reach ``max(cutoff, three_body_cutoff) + cn_cutoff``
(:meth:`DFTD3.required_ghost_width`); a shallower one is refused.
"""

from __future__ import annotations

import functools
import importlib.resources
import math
import numbers

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from jaxdd.data.checks import integral
from jaxdd.data.constants import BOHR, HARTREE
from jaxdd.model.base import BaseModel, ModelConfig, ModelOutputs, NeighborConfig
from jaxdd.neighbors import NeighborListFormat, edge_vectors
from jaxdd.data.segments import per_system_sum

from .species import neighbor_inputs

__all__ = ["DFTD3", "FUNCTIONALS", "BOHR", "HARTREE", "MAX_ELEMENT", "reference_tables"]


#: The tables cover H (1) to Pu (94).
MAX_ELEMENT = 94

K1 = 16.0  # steepness of the counting function
K3 = -4.0  # Gaussian weighting of the reference coordination numbers
ATM_ALPHA = 16.0  # exponent of the ATM zero damping (simple-dftd3: alp + 2 with alp = 14)
ATM_RADIUS_SCALE = 4.0 / 3.0  # rs9 of simple-dftd3's rational damping

#: Becke-Johnson parameters (s6, s8, a1, a2; a2 in bohr) by functional. pbe, pbe0, b3lyp,
#: tpss, blyp, bp86, revpbe: Grimme, Ehrlich, Goerigk, J. Comput. Chem. 32, 1456 (2011),
#: Table 2; r2scan: Ehlert, Huniar, Ning, Furness, Sun, Kaplan, Perdew, Brandenburg,
#: J. Chem. Phys. 154, 061101 (2021). The same values as simple-dftd3's parameter file.
FUNCTIONALS = {
    "pbe": (1.0, 0.7875, 0.4289, 4.4407),
    "pbe0": (1.0, 1.2177, 0.4145, 4.8593),
    "b3lyp": (1.0, 1.9889, 0.3981, 4.4211),
    "tpss": (1.0, 1.9435, 0.4535, 4.4752),
    "blyp": (1.0, 2.6996, 0.4298, 4.2359),
    "bp86": (1.0, 3.2822, 0.3946, 4.8516),
    "revpbe": (1.0, 2.3550, 0.5238, 3.5016),
    "r2scan": (1.0, 0.78981345, 0.49484001, 5.73083694),
}
_ALIASES = {"b3-lyp": "b3lyp", "b-lyp": "blyp", "b-p": "bp86", "bp": "bp86", "pbeh": "pbe0"}

# simple-dftd3's defaults (bohr): pairs 60, coordination numbers 40, three-body 40.
DEFAULT_CUTOFF = 60.0 * BOHR
DEFAULT_CN_CUTOFF = 40.0 * BOHR
DEFAULT_THREE_BODY_CUTOFF = 40.0 * BOHR


@functools.cache
def reference_tables() -> dict:
    """The D3 reference data in atomic units, as float64 numpy arrays indexed by atomic number.

    c6 [95, 95, 5, 5] hartree bohr⁶ (zero for missing references); cn [95, 5] reference
    coordination numbers; n_ref [95]; rcov [95] bohr, (4/3) covalent radii; q [95] bohr,
    sqrt(0.5 <r⁴>/<r²> sqrt(Z)); r0 [95, 95] bohr, pair van der Waals radii (ATM damping).
    Row 0 is empty.
    """
    path = importlib.resources.files("jaxdd.models").joinpath("data", "dftd3_bj.npz")
    with path.open("rb") as f, np.load(f) as raw:
        data = {k: np.array(raw[k]) for k in raw.files}
    z = np.arange(data["n_ref"].size, dtype=np.float64)
    # The conversions simple-dftd3 applies to the published values (Å and <r⁴>/<r²> in a.u.).
    return {
        "c6": data["c6"],
        "cn": data["cn"],
        "n_ref": data["n_ref"].astype(np.int32),
        "rcov": 4.0 / 3.0 * data["covalent_radius"] / BOHR,
        "q": np.sqrt(0.5 * data["r4_over_r2"] * np.sqrt(z)),
        "r0": data["vdw_radius"] / BOHR,
    }


def _functional(functional) -> tuple[str, tuple[float, float, float, float]]:
    if not isinstance(functional, str):
        raise ValueError(f"DFTD3 functional must be a functional name, one of {sorted(FUNCTIONALS)}; got {functional!r}")
    key = functional.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in FUNCTIONALS:
        raise ValueError(f"DFTD3 functional {functional!r} has no D3(BJ) parameters here; known: {sorted(FUNCTIONALS)}")
    return key, FUNCTIONALS[key]


def _length(name, value) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if not ok:
        raise ValueError(f"DFTD3 {name} must be a positive finite distance (Å), got {value!r}")
    return float(value)


def _safe_sqrt(x, mask):
    """sqrt(x) where ``mask``, 1 elsewhere, with finite gradients on the masked entries."""
    return jnp.sqrt(jnp.where(mask, x, 1.0))


class DFTD3(eqx.Module, BaseModel):
    """DFT-D3(BJ) dispersion (see the module docstring): energy, atomic energies, forces, stress.

    functional: name of the functional whose BJ parameters are used (:data:`FUNCTIONALS`).
    damping: ``"bj"`` (the only damping here). cutoff: pair range (Å; simple-dftd3's
    default 60 bohr). cn_cutoff: coordination-number range (Å; default 40 bohr).
    three_body: add the ATM term (s9 = 1). three_body_cutoff: ATM range (Å; default 40 bohr).
    species: atomic numbers the model is restricted to (None: all of 1 to 94); a short list
    keeps the reference tables, and the three-body work, small. max_neighbors: starting width
    of the neighbour table of the three-body term (grown on overflow).
    The neighbour list is built once at the largest range; each term masks its own.
    """

    s6: jax.Array
    s8: jax.Array
    a1: jax.Array
    a2: jax.Array  # bohr
    s9: jax.Array  # 1 with the three-body term, else 0 (unused)
    # Reference tables restricted to the table rows (row 0 empty, then the species).
    c6_ref: jax.Array  # [S, S, 5, 5] hartree bohr⁶
    cn_ref: jax.Array  # [S, 5]
    n_ref: jax.Array  # [S]
    rcov: jax.Array  # [S] bohr
    q: jax.Array  # [S] bohr
    r0_vdw: jax.Array  # [S, S] bohr
    kind: jax.Array  # [95] row of each atomic number in the tables (0: none)
    species: tuple[int, ...] | None = eqx.field(static=True)
    functional: str = eqx.field(static=True)
    pair_cutoff: float = eqx.field(static=True)
    cn_cutoff: float = eqx.field(static=True)
    three_body: bool = eqx.field(static=True)
    three_body_cutoff: float = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, functional: str = "pbe", damping: str = "bj", cutoff: float = DEFAULT_CUTOFF,
                 cn_cutoff: float = DEFAULT_CN_CUTOFF, three_body: bool = False,
                 three_body_cutoff: float = DEFAULT_THREE_BODY_CUTOFF, species=None, *,
                 max_neighbors: int | None = None):
        if not isinstance(damping, str) or damping.strip().lower() not in ("bj", "rational"):
            raise ValueError(f"DFTD3 damping must be 'bj' (Becke-Johnson, rational damping), got {damping!r}")
        name, (s6, s8, a1, a2) = _functional(functional)
        self.functional = name
        self.pair_cutoff = _length("cutoff", cutoff)
        self.cn_cutoff = _length("cn_cutoff", cn_cutoff)
        self.three_body = bool(three_body)
        self.three_body_cutoff = _length("three_body_cutoff", three_body_cutoff)
        # float64 where JAX has it; the computation casts to the dtype of the positions.
        self.s6, self.s8, self.a1, self.a2 = (jnp.asarray(np.float64(v)) for v in (s6, s8, a1, a2))
        self.s9 = jnp.asarray(np.float64(1.0 if self.three_body else 0.0))
        if species is not None:
            species = tuple(integral("DFTD3 species", z, minimum=1) for z in species)
            if not species or len(set(species)) != len(species) or not all(1 <= z <= MAX_ELEMENT for z in species):
                raise ValueError(f"DFTD3 species must be distinct atomic numbers from 1 to {MAX_ELEMENT}, got {species}")
        self.species = species
        # Row 0 of every table is empty: padding atoms (and elements outside ``species``) use it.
        rows = np.arange(MAX_ELEMENT + 1) if species is None else np.array((0,) + species)
        kind = np.zeros(MAX_ELEMENT + 1, np.int32)
        kind[rows] = np.arange(rows.size)
        t = reference_tables()
        self.c6_ref = jnp.asarray(t["c6"][np.ix_(rows, rows)])
        self.cn_ref = jnp.asarray(t["cn"][rows])
        self.n_ref = jnp.asarray(t["n_ref"][rows])
        self.rcov = jnp.asarray(t["rcov"][rows])
        self.q = jnp.asarray(t["q"][rows])
        self.r0_vdw = jnp.asarray(t["r0"][np.ix_(rows, rows)])
        self.kind = jnp.asarray(kind)
        ranges = [self.pair_cutoff, self.cn_cutoff] + ([self.three_body_cutoff] if self.three_body else [])
        # Triplets are the slot pairs of the per-atom neighbour table (MATRIX); pairs and
        # coordination numbers use the COO edges, present in either format.
        fmt = NeighborListFormat.MATRIX if self.three_body else NeighborListFormat.COO
        self.model_config = ModelConfig(
            outputs=frozenset({"energy", "atomic_energies", "forces", "stress"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}),
            neighbor_config=NeighborConfig(cutoff=max(ranges), format=fmt, max_neighbors=max_neighbors),
        )

    # ----------------------------------------------------------------- protocol

    @property
    def distribution_spec(self):
        from jaxdd.spec import SPEC_DFTD3_HALO

        return SPEC_DFTD3_HALO

    def required_ghost_width(self, policy=None) -> float:
        """Ghost-shell width (Å) the model needs under ``policy``: the neighbour range when
        ghosts receive their owners' coordination numbers (halo exchange of scatters, the
        default), the interaction range plus ``cn_cutoff`` when ghosts count their own
        neighbours (``HaloStoragePolicy(scatter_mode="local")``)."""
        from jaxdd.ops import HaloStoragePolicy

        reach = self.model_config.neighbor_config.search_cutoff
        if isinstance(policy, HaloStoragePolicy) and policy.deep:
            interact = max(self.pair_cutoff, self.three_body_cutoff if self.three_body else 0.0)
            return max(reach, interact + self.cn_cutoff)
        return reach

    def distributed_setup(self, ctx) -> None:
        """Refuse a deep-halo decomposition whose ghost shell misses neighbours of ghosts
        (read from the :class:`~jaxdd.DDContext` ``ctx``)."""
        from jaxdd.ops import HaloStoragePolicy

        policy = ctx.policy
        if not (isinstance(policy, HaloStoragePolicy) and policy.deep):
            return
        # Under scatter_mode="local" the shell is at least halo_layers neighbour ranges deep.
        width = getattr(ctx, "ghost_width", None)
        if width is None:
            width = ctx.halo_layers * self.model_config.neighbor_config.search_cutoff
        need = self.required_ghost_width(policy)
        if width < need - 1e-9:
            raise ValueError(
                f"DFTD3 under a deep halo (scatter_mode='local'): ghosts compute their own coordination numbers, so "
                f"the ghost shell must reach the interaction range + cn_cutoff = {need:.6g} Å, but it is {width:.6g} Å "
                f"(halo_layers={ctx.halo_layers} × neighbour range "
                f"{self.model_config.neighbor_config.search_cutoff:.6g} Å); use halo_layers="
                f"{math.ceil(need / self.model_config.neighbor_config.search_cutoff - 1e-9)}, or the model's own "
                "spec (SPEC_DFTD3_HALO), whose ghosts read their owners' coordination numbers"
            )

    def validate_input(self, data) -> None:
        z = np.asarray(data.atomic_numbers)
        real = np.asarray(data.atom_mask)
        known = np.arange(1, MAX_ELEMENT + 1) if self.species is None else np.asarray(self.species)
        bad = np.flatnonzero(real & ~np.isin(z, known))
        if bad.size:
            what = (f"DFTD3 has reference data for elements 1 to {MAX_ELEMENT} only" if self.species is None
                    else f"the model was built for species {self.species}")
            raise ValueError(f"atomic_numbers of atoms {bad[:8].tolist()} are {sorted(set(z[bad].tolist()))}; {what}")

    def adapt_input(self, data, **kwargs) -> dict:
        return neighbor_inputs(data, "DFTD3")

    def adapt_output(self, raw, data) -> ModelOutputs:
        return ModelOutputs(raw)

    # ----------------------------------------------------------------- physics

    def forward(self, positions, cell, batch_idx, atomic_numbers, atom_mask, neighbors, n_systems):
        dt = positions.dtype
        n = positions.shape[0]
        nl = neighbors
        z = jnp.where(atom_mask, self.kind[jnp.clip(atomic_numbers, 0, MAX_ELEMENT)], 0)  # table rows
        recv = jnp.minimum(nl.receivers, n - 1)
        send = jnp.minimum(nl.senders, n - 1)
        zi, zj = z[recv], z[send]

        vec = edge_vectors(positions, cell, batch_idx, nl) / BOHR  # [E, 3] bohr
        r2 = jnp.sum(vec * vec, axis=-1)
        real = nl.mask & (r2 > 0)
        r = _safe_sqrt(r2, real)

        # Coordination numbers: a scatter-add onto receivers (so ghost rows are their owners').
        in_cn = real & (r2 <= (self.cn_cutoff / BOHR) ** 2)
        rcov = self.rcov.astype(dt)
        count = 1.0 / (1.0 + jnp.exp(-K1 * ((rcov[zi] + rcov[zj]) / r - 1.0)))
        cn = jax.ops.segment_sum(jnp.where(in_cn, count, 0.0), nl.receivers, num_segments=n)

        w = self._weights(cn, z)  # [V, 5]
        c6_ref = self.c6_ref.astype(dt)
        c6 = jnp.einsum("ea,eab,eb->e", w[recv], c6_ref[zi, zj], w[send])

        # Becke-Johnson pair energy, half to each atom of the pair (the list is full).
        in_pair = real & (r2 <= (self.pair_cutoff / BOHR) ** 2)
        q = self.q.astype(dt)
        qq = 3.0 * q[zi] * q[zj]
        r0 = self.a1.astype(dt) * jnp.sqrt(qq) + self.a2.astype(dt)
        r0_2 = r0 * r0
        r0_6 = r0_2 * r0_2 * r0_2
        s2 = jnp.where(in_pair, r2, 1.0)
        s6 = s2 * s2 * s2
        pair = -c6 * (self.s6.astype(dt) / (s6 + r0_6) + self.s8.astype(dt) * qq / (s6 * s2 + r0_6 * r0_2))
        atomic = jax.ops.segment_sum(jnp.where(in_pair, 0.5 * pair, 0.0), nl.receivers, num_segments=n)

        if self.three_body:
            atomic = atomic + self._three_body(positions, cell, batch_idx, z, w, nl)
        atomic = jnp.where(atom_mask, atomic * HARTREE, 0.0)
        return {"energy": per_system_sum(atomic, batch_idx, n_systems), "atomic_energies": atomic}

    def _weights(self, cn, z):
        """Gaussian weights [V, 5] of each atom's reference coordination numbers."""
        dt = cn.dtype
        valid = jnp.arange(self.cn_ref.shape[1]) < self.n_ref[z][:, None]
        d2 = jnp.where(valid, (cn[:, None] - self.cn_ref.astype(dt)[z]) ** 2, 0.0)
        # Shifting by the nearest reference keeps the largest weight at exp(0): the weights
        # stay normalised where every exponential would underflow (simple-dftd3 then picks the
        # reference of highest CN, which is the nearest one there). The shift cancels exactly.
        nearest = jax.lax.stop_gradient(jnp.min(jnp.where(valid, d2, jnp.inf), axis=1, initial=jnp.inf))
        nearest = jnp.where(jnp.isfinite(nearest), nearest, 0.0)
        g = jnp.where(valid, jnp.exp(K3 * (d2 - nearest[:, None])), 0.0)
        norm = jnp.sum(g, axis=1, keepdims=True)
        return g / jnp.where(norm > 0, norm, 1.0)

    def _three_body(self, positions, cell, batch_idx, z, w, nl):
        """ATM energy of each atom [V] (hartree): a third of each triangle it is a corner of,
        from the [V, K, K] slot pairs of its neighbour table."""
        dt = positions.dtype
        n = positions.shape[0]
        senders = nl.matrix  # [V, K]; padding slots point one past the last atom
        k = senders.shape[1]
        filled = senders < n
        slot = jnp.minimum(senders, n - 1)
        shift = nl.matrix_shifts.astype(dt)
        if cell.shape[0] == 1:
            shift = shift @ cell[0]
        else:
            shift = jnp.einsum("vki,vij->vkj", shift, cell[jnp.clip(batch_idx, 0, cell.shape[0] - 1)])
        vec = (positions[slot] - positions[:, None, :] + shift) / BOHR  # [V, K, 3] bohr
        r2 = jnp.sum(vec * vec, axis=-1)
        cut2 = (self.three_body_cutoff / BOHR) ** 2
        near = filled & (r2 > 0) & (r2 <= cut2)
        d = vec[:, None, :, :] - vec[:, :, None, :]  # [V, K(j), K(k), 3]: from j to k
        r2jk = jnp.sum(d * d, axis=-1)
        tri = (near[:, :, None] & near[:, None, :] & ~np.eye(k, dtype=bool)
               & (r2jk > 0) & (r2jk <= cut2))

        # C6 of every pair, from per-atom sums over the first atom's references:
        # t[v, s, b] = Σ_a w[v, a] C6_ref(z_v, a, s, b) for every table row s.
        c6_ref = self.c6_ref.astype(dt)
        t = jnp.einsum("va,vsab->vsb", w, c6_ref[z])  # [V, S, 5]
        zk = jax.nn.one_hot(z[slot], c6_ref.shape[0], dtype=dt)  # [V, K, S]
        wk = w[slot]  # [V, K, 5]
        c6_ij = jnp.einsum("vsb,vks,vkb->vk", t, zk, wk)
        c6_jk = jnp.einsum("vjsb,vks,vkb->vjk", t[slot], zk, wk)

        r0_vdw = ATM_RADIUS_SCALE * self.r0_vdw.astype(dt)
        r0_ij = r0_vdw[z[:, None], z[slot]]  # [V, K]
        r0_jk = r0_vdw[z[slot][:, :, None], z[slot][:, None, :]]  # [V, K, K]
        r0 = r0_ij[:, :, None] * r0_ij[:, None, :] * r0_jk

        a = jnp.where(tri, r2[:, :, None], 1.0)  # r_ij²
        b = jnp.where(tri, r2[:, None, :], 1.0)  # r_ik²
        c = jnp.where(tri, r2jk, 1.0)  # r_jk²
        p2 = a * b * c
        p1 = jnp.sqrt(p2)
        p3 = p2 * p1
        damp = 1.0 / (1.0 + 6.0 * (r0 / p1) ** (ATM_ALPHA / 3.0))
        angle = 0.375 * (a + c - b) * (a - c + b) * (-a + c + b) / (p3 * p2) + 1.0 / p3
        c9 = jnp.sqrt(jnp.where(tri, c6_ij[:, :, None] * c6_ij[:, None, :] * c6_jk, 1.0))
        energy = jnp.where(tri, self.s9.astype(dt) * c9 * angle * damp, 0.0)
        # Each triangle appears at each of its corners, once per order of the other two.
        return jnp.sum(energy, axis=(1, 2)) / 6.0
