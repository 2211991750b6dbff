"""Neighbour lists with static shapes: a cell list that runs on device under ``jit``.

The builder bins atoms in the fractional coordinates of each system's cell, sorts the
bin keys, and for every atom scans a static block of neighbouring bins. Every array has a
fixed capacity (:class:`NeighborCapacity`); when a capacity is too small the builder sets
``overflow`` and reports the sizes it needed, and the host grows the capacity and builds
again (:func:`neighbor_list`). Nothing is ever dropped silently.

Conventions (shared by every model and by the domain decomposition):

* An edge ``e`` has a ``receiver`` (the atom whose neighbourhood it belongs to), a
  ``sender`` and an integer image ``shift``; its vector points from the receiver to the
  sender's image::

      vec[e] = positions[senders[e]] - positions[receivers[e]] + shifts[e] @ cell

  This is ASE's ``neighbor_list('ijS')`` with ``i = receiver``, ``j = sender``.
* Shifts are relative to the positions as given: atoms outside the cell on periodic axes
  are wrapped for the search only, so wrapping the input changes no edge vector.
* A full list holds both ``(i, j, S)`` and ``(j, i, -S)``; a half list keeps the one with
  ``i < j`` (or ``i == j`` and ``S`` lexicographically positive: periodic self-images).
* COO edges are sorted by receiver. Padding entries point one past the last atom
  (index ``n_atoms``) with a zero shift and ``mask`` False.
* Edges never join atoms of different systems of a batch.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "NeighborListFormat",
    "NeighborCapacity",
    "NeighborList",
    "build_neighbor_list",
    "neighbor_capacity",
    "neighbor_list",
    "edge_vectors",
    "effective_cell",
]


class NeighborListFormat(enum.Enum):
    """How a neighbour list is laid out: COO edge arrays or a per-atom MATRIX."""

    COO = "coo"
    MATRIX = "matrix"


@dataclasses.dataclass(frozen=True)
class NeighborCapacity:
    """Static sizes of a neighbour list build (hashable: part of the jit cache key).

    max_edges: COO edge slots.
    max_neighbors: neighbour slots per atom (MATRIX format; also bounds COO rows).
    max_per_bin: atoms scanned per (atom, neighbouring bin).
    search_range: bins scanned on each side of an atom's bin, per cell axis.
    """

    max_edges: int
    max_neighbors: int
    max_per_bin: int
    search_range: tuple[int, int, int]

    def __post_init__(self):
        for name in ("max_edges", "max_neighbors", "max_per_bin"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"NeighborCapacity.{name} must be >= 1, got {getattr(self, name)}")
        rng = tuple(int(r) for r in self.search_range)
        if len(rng) != 3 or min(rng) < 1:
            raise ValueError(f"NeighborCapacity.search_range must be 3 integers >= 1, got {self.search_range}")
        object.__setattr__(self, "search_range", rng)

    def grown(self, needed: "NeighborStats", factor: float = 1.25) -> "NeighborCapacity":
        """A capacity that fits ``needed`` with ``factor`` headroom (never smaller than self)."""
        return NeighborCapacity(
            max_edges=max(self.max_edges, _headroom(needed.edges, factor)),
            max_neighbors=max(self.max_neighbors, _headroom(needed.neighbors, factor)),
            max_per_bin=max(self.max_per_bin, _headroom(needed.per_bin, factor)),
            search_range=tuple(max(a, int(b)) for a, b in zip(self.search_range, needed.search_range)),
        )

    def fits(self, needed: "NeighborStats") -> bool:
        return (
            needed.edges <= self.max_edges
            and needed.neighbors <= self.max_neighbors
            and needed.per_bin <= self.max_per_bin
            and all(int(b) <= a for a, b in zip(self.search_range, needed.search_range))
        )


def _headroom(n, factor):
    n = int(n)
    return max(1, int(math.ceil(n * factor)) + (2 if n else 0))


@dataclasses.dataclass(frozen=True)
class NeighborStats:
    """Sizes a build needed, read back on the host (plain ints)."""

    edges: int
    neighbors: int
    per_bin: int
    search_range: tuple[int, int, int]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NeighborList:
    """A neighbour list of static shape.

    senders, receivers: [max_edges] int32 atom indices (padding: n_atoms).
    shifts: [max_edges, 3] int32 image shifts of the sender, in cell vectors.
    mask: [max_edges] bool, True for real edges.
    matrix: [n_atoms, max_neighbors] int32 sender of each slot (padding: n_atoms), or None.
    matrix_shifts: [n_atoms, max_neighbors, 3] int32, or None.
    num_neighbors: [n_atoms] int32 neighbours of each atom (may exceed max_neighbors on overflow).
    n_edges: [] int32 edges found (may exceed max_edges on overflow).
    needed_per_bin, needed_range: sizes the search needed ([] and [3] int32).
    overflow: [] bool, True when any capacity was too small; the list is then incomplete.
    """

    senders: jax.Array
    receivers: jax.Array
    shifts: jax.Array
    mask: jax.Array
    matrix: Any
    matrix_shifts: Any
    num_neighbors: jax.Array
    n_edges: jax.Array
    needed_per_bin: jax.Array
    needed_range: jax.Array
    overflow: jax.Array

    def stats(self) -> NeighborStats:
        """Sizes this build needed, as host integers (blocks until the build is done)."""
        return NeighborStats(
            edges=int(self.n_edges),
            neighbors=int(jnp.max(self.num_neighbors, initial=0)),
            per_bin=int(self.needed_per_bin),
            search_range=tuple(int(r) for r in np.asarray(self.needed_range)),
        )


# --------------------------------------------------------------------------- geometry


def _normalize(v):
    n = jnp.linalg.norm(v)
    return v / jnp.where(n > 0, n, 1.0)


def _complete_cell(cell, pattern):
    """Replace the lattice vectors of non-periodic axes by unit vectors orthogonal to the
    periodic ones, so fractional coordinates exist for slabs, wires and molecules whose
    cell is zero or arbitrary on open axes."""
    per = [a for a in range(3) if pattern[a]]
    rows = [cell[a] for a in range(3)]
    eye = jnp.eye(3, dtype=cell.dtype)
    if len(per) == 3:
        return cell
    if len(per) == 2:
        (k,) = [a for a in range(3) if not pattern[a]]
        rows[k] = _normalize(jnp.cross(rows[per[0]], rows[per[1]]))
    elif len(per) == 1:
        u = _normalize(rows[per[0]])
        e = eye[jnp.argmin(jnp.abs(u))]
        v1 = _normalize(jnp.cross(u, e))
        v2 = jnp.cross(u, v1)
        k1, k2 = [a for a in range(3) if not pattern[a]]
        rows[k1], rows[k2] = v1, v2
    else:
        rows = [eye[0], eye[1], eye[2]]
    return jnp.stack(rows)


_PATTERNS = list(itertools.product((False, True), repeat=3))


def effective_cell(cell, pbc):
    """Cell used for binning: periodic rows as given, open rows orthonormal completions.

    cell: [S, 3, 3] (rows are lattice vectors); pbc: [S, 3] bool. Returns [S, 3, 3].
    """
    index = (pbc[:, 0].astype(jnp.int32) * 4 + pbc[:, 1].astype(jnp.int32) * 2 + pbc[:, 2].astype(jnp.int32))
    branches = [lambda c, p=p: _complete_cell(c, p) for p in _PATTERNS]
    return jax.vmap(lambda i, c: jax.lax.switch(i, branches, c))(index, cell)


def edge_vectors(positions, cell, batch_idx, nl: NeighborList):
    """Receiver → sender vectors of the COO edges, [max_edges, 3] (padding rows are zero).

    positions: [n_atoms, 3]; cell: [S, 3, 3]; batch_idx: [n_atoms] system of each atom.
    Differentiable in positions and cell (the strain used for stress acts through both).
    """
    n = positions.shape[0]
    recv = jnp.minimum(nl.receivers, n - 1)
    send = jnp.minimum(nl.senders, n - 1)
    system = jnp.clip(batch_idx[recv], 0, cell.shape[0] - 1)
    shift = jnp.einsum("ei,eij->ej", nl.shifts.astype(positions.dtype), cell[system])
    vec = positions[send] - positions[recv] + shift
    return jnp.where(nl.mask[:, None], vec, 0.0)


# --------------------------------------------------------------------------- binning


def _max_bins_per_axis(n_systems: int) -> int:
    # Bin keys are int32: all systems' bins together must stay below 2**31 - 1.
    return max(1, int(math.floor(((2**31 - 2) / max(n_systems, 1)) ** (1.0 / 3.0))))


def _margin(dtype) -> float:
    # Bins are made slightly wider than the cutoff so that rounding in the fractional
    # coordinates can never push a true neighbour outside the scanned block.
    return float(np.sqrt(np.finfo(dtype).eps))


def _bins(positions, cell, pbc, batch_idx, atom_mask, cutoff):
    """Bin every atom; return what the search needs. All shapes static."""
    n_atoms = positions.shape[0]
    n_sys = cell.shape[0]
    dtype = positions.dtype
    nbmax = _max_bins_per_axis(n_sys)
    reach = cutoff * (1.0 + _margin(dtype))

    ceff = jax.lax.stop_gradient(effective_cell(cell, pbc))
    inv = jnp.linalg.inv(ceff)  # [S, 3, 3]
    spacing = 1.0 / jnp.linalg.norm(inv, axis=1)  # [S, 3] distance between lattice planes
    sys_idx = jnp.clip(batch_idx, 0, n_sys - 1)
    pos = jax.lax.stop_gradient(positions)
    frac = jnp.einsum("vi,vij->vj", pos, inv[sys_idx])
    per_atom_pbc = pbc[sys_idx]
    wraps = jnp.where(per_atom_pbc, jnp.floor(frac), 0.0)
    fw = frac - wraps
    # Wrapped positions from integers times the cell: exact on the original coordinates.
    pos_w = pos - jnp.einsum("vi,vij->vj", wraps, cell[sys_idx])

    big = jnp.asarray(jnp.finfo(dtype).max, dtype)
    fmin = jax.ops.segment_min(jnp.where(atom_mask[:, None], frac, big), sys_idx, n_sys)
    fmax = jax.ops.segment_max(jnp.where(atom_mask[:, None], frac, -big), sys_idx, n_sys)
    extent = jnp.where(fmax >= fmin, fmax - fmin, 0.0)

    # Periodic axes: floor(spacing / cutoff) bins, more than one bin's reach when the cell
    # is thinner than the cutoff. Open axes: bins of width >= cutoff over the atoms' extent.
    nb_per = jnp.clip(jnp.floor(spacing / reach), 1, nbmax)
    width_open = jnp.maximum(reach / spacing, extent / (nbmax - 1))
    nb_open = jnp.clip(jnp.floor(extent / width_open) + 1, 1, nbmax)
    nbins = jnp.where(pbc, nb_per, nb_open).astype(jnp.int32)  # [S, 3]
    need = jnp.where(pbc, jnp.ceil(reach * nb_per / spacing), 1.0).astype(jnp.int32)
    need = jnp.max(jnp.maximum(need, 1), axis=0)  # [3], over systems

    atom_nb = nbins[sys_idx]
    b_per = jnp.floor(fw * atom_nb).astype(jnp.int32)
    b_open = jnp.floor((frac - fmin[sys_idx]) / width_open[sys_idx]).astype(jnp.int32)
    b = jnp.clip(jnp.where(per_atom_pbc, b_per, b_open), 0, atom_nb - 1)
    # Systems own consecutive key ranges, so no two systems share a bin.
    n_per_sys = jnp.prod(nbins, axis=1)
    sys_base = (jnp.cumsum(n_per_sys) - n_per_sys).astype(jnp.int32)
    keys = _linear_key(sys_base[sys_idx], b, atom_nb)
    keys = jnp.where(atom_mask, keys, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(keys)
    return dict(
        bins=b,
        nbins=nbins,
        need=need,
        sys_idx=sys_idx,
        sys_base=sys_base,
        wraps=wraps.astype(jnp.int32),
        pos_w=pos_w,
        order=order.astype(jnp.int32),
        sorted_keys=keys[order],
        n_atoms=n_atoms,
    )


def _linear_key(base, b, nb):
    """Bin key: ``base`` (first key of the atom's system) + the bin's row-major index."""
    return base + (b[:, 0] * nb[:, 1] + b[:, 1]) * nb[:, 2] + b[:, 2]


def _offsets(search_range):
    rx, ry, rz = search_range
    grid = itertools.product(range(-rx, rx + 1), range(-ry, ry + 1), range(-rz, rz + 1))
    return np.asarray(list(grid), dtype=np.int32)  # [n_off, 3]


def _lex_positive(s):
    sx, sy, sz = s[..., 0], s[..., 1], s[..., 2]
    return (sx > 0) | ((sx == 0) & ((sy > 0) | ((sy == 0) & (sz > 0))))


def _candidates(positions, cell, pbc, batch_idx, atom_mask, *, cutoff, half, max_per_bin, search_range):
    """Scan the neighbouring bins of every atom.

    Returns (mask [V, n_off, M], aux): mask[i, o, k] is True when the k-th atom of the
    o-th neighbouring bin of atom i is a neighbour of i.
    """
    g = _bins(positions, cell, pbc, batch_idx, atom_mask, cutoff)
    n = g["n_atoms"]
    offsets = jnp.asarray(_offsets(search_range))  # [n_off, 3]
    nb = g["nbins"][g["sys_idx"]]  # [V, 3]
    raw = g["bins"][:, None, :] + offsets[None, :, :]  # [V, n_off, 3]
    per = pbc[g["sys_idx"]][:, None, :]
    image = jnp.where(per, jnp.floor_divide(raw, nb[:, None, :]), 0)
    wrapped = jnp.where(per, jnp.mod(raw, nb[:, None, :]), raw)
    inside = jnp.all(per | ((raw >= 0) & (raw < nb[:, None, :])), axis=-1)
    n_off = offsets.shape[0]
    base = jnp.broadcast_to(g["sys_base"][g["sys_idx"]][:, None], (n, n_off))
    qkeys = _linear_key(base.reshape(-1), wrapped.reshape(-1, 3), jnp.repeat(nb, n_off, axis=0))
    start = jnp.searchsorted(g["sorted_keys"], qkeys, side="left").reshape(n, n_off)
    stop = jnp.searchsorted(g["sorted_keys"], qkeys, side="right").reshape(n, n_off)
    count = jnp.where(inside & atom_mask[:, None], stop - start, 0)

    k = jnp.arange(max_per_bin, dtype=jnp.int32)
    slot = jnp.minimum(start[:, :, None] + k, n - 1)
    j = g["order"][slot]  # [V, n_off, M]
    cell_i = cell[g["sys_idx"]]  # [V, 3, 3]
    img_cart = jnp.einsum("voi,vij->voj", image.astype(positions.dtype), jax.lax.stop_gradient(cell_i))
    vec = g["pos_w"][j] + img_cart[:, :, None, :] - g["pos_w"][:, None, None, :]
    d2 = jnp.sum(vec * vec, axis=-1)
    i = jnp.arange(n, dtype=jnp.int32)[:, None, None]
    zero_image = jnp.all(image == 0, axis=-1)[:, :, None]
    mask = (k < count[:, :, None]) & (d2 < cutoff * cutoff) & ~((j == i) & zero_image)
    if half:
        shift = image[:, :, None, :] - g["wraps"][j] + g["wraps"][:, None, None, :]
        mask = mask & ((i < j) | ((i == j) & _lex_positive(shift)))
    aux = dict(g, image=image, start=start, count=count)
    return mask, aux


# --------------------------------------------------------------------------- builders


def _check_cutoff(cutoff):
    if not (isinstance(cutoff, (int, float, np.floating, np.integer)) and math.isfinite(cutoff) and cutoff > 0):
        raise ValueError(f"cutoff must be a positive finite number, got {cutoff!r}")


def build_neighbor_list(
    positions,
    cell,
    pbc,
    batch_idx=None,
    atom_mask=None,
    *,
    cutoff: float,
    capacity: NeighborCapacity,
    half: bool = False,
    format: NeighborListFormat = NeighborListFormat.COO,
) -> NeighborList:
    """Build a neighbour list on device; traceable under ``jit`` (all keyword args static).

    positions: [n_atoms, 3] Å; cell: [S, 3, 3] Å (rows); pbc: [S, 3] bool;
    batch_idx: [n_atoms] system of each atom (default all 0); atom_mask: [n_atoms] bool,
    False for padding rows (default all True). Pairs with distance < cutoff are listed.
    Check ``overflow`` (or use :func:`neighbor_list`, which grows and rebuilds).
    """
    _check_cutoff(cutoff)
    format = NeighborListFormat(format)
    positions = jnp.asarray(positions)
    n = positions.shape[0]
    cell = jnp.asarray(cell, positions.dtype).reshape(-1, 3, 3)
    pbc = jnp.asarray(pbc, bool).reshape(-1, 3)
    batch_idx = jnp.zeros(n, jnp.int32) if batch_idx is None else jnp.asarray(batch_idx, jnp.int32)
    atom_mask = jnp.ones(n, bool) if atom_mask is None else jnp.asarray(atom_mask, bool)
    atom_mask = atom_mask & (batch_idx >= 0) & (batch_idx < cell.shape[0])

    m = capacity.max_per_bin
    mask, aux = _candidates(
        positions, cell, pbc, batch_idx, atom_mask,
        cutoff=float(cutoff), half=half, max_per_bin=m, search_range=capacity.search_range,
    )
    n_off = mask.shape[1]
    flat = mask.reshape(n, n_off * m)
    per_atom = jnp.sum(flat, axis=1, dtype=jnp.int32)
    n_edges = jnp.sum(per_atom, dtype=jnp.int32)
    needed_per_bin = jnp.max(aux["count"], initial=0)
    needed_range = aux["need"]

    (idx,) = jnp.nonzero(flat.reshape(-1), size=capacity.max_edges, fill_value=n * n_off * m)
    valid = jnp.arange(capacity.max_edges) < n_edges
    recv = jnp.minimum(idx // (n_off * m), n - 1).astype(jnp.int32)
    o = (idx // m) % n_off
    k = idx % m
    start = aux["start"][recv, o]
    send = aux["order"][jnp.minimum(start + k, n - 1)]
    shift = aux["image"][recv, o] - aux["wraps"][send] + aux["wraps"][recv]
    senders = jnp.where(valid, send, n).astype(jnp.int32)
    receivers = jnp.where(valid, recv, n).astype(jnp.int32)
    shifts = jnp.where(valid[:, None], shift, 0).astype(jnp.int32)

    matrix = matrix_shifts = None
    if format is NeighborListFormat.MATRIX:
        kk = capacity.max_neighbors
        row_start = jnp.cumsum(per_atom) - per_atom
        col = jnp.arange(capacity.max_edges) - row_start[recv]
        col = jnp.where(valid & (col < kk), col, kk)  # out of range: dropped
        matrix = jnp.full((n, kk), n, jnp.int32).at[recv, col].set(senders, mode="drop")
        matrix_shifts = jnp.zeros((n, kk, 3), jnp.int32).at[recv, col].set(shifts, mode="drop")

    overflow = (
        (n_edges > capacity.max_edges)
        | (needed_per_bin > m)
        | jnp.any(needed_range > jnp.asarray(capacity.search_range))
        | ((format is NeighborListFormat.MATRIX) & (jnp.max(per_atom, initial=0) > capacity.max_neighbors))
    )
    return NeighborList(
        senders=senders,
        receivers=receivers,
        shifts=shifts,
        mask=valid,
        matrix=matrix,
        matrix_shifts=matrix_shifts,
        num_neighbors=per_atom,
        n_edges=n_edges,
        needed_per_bin=needed_per_bin.astype(jnp.int32),
        needed_range=needed_range.astype(jnp.int32),
        overflow=overflow,
    )


@jax.jit(static_argnames=("cutoff",))
def _bin_stats(positions, cell, pbc, batch_idx, atom_mask, cutoff):
    g = _bins(positions, cell, pbc, batch_idx, atom_mask, cutoff)
    sk = g["sorted_keys"]
    # Largest run of equal keys among real atoms = most atoms in one bin.
    first = jnp.searchsorted(sk, sk, side="left")
    last = jnp.searchsorted(sk, sk, side="right")
    real = sk != jnp.iinfo(jnp.int32).max
    return jnp.max(jnp.where(real, last - first, 0), initial=0), g["need"]


@jax.jit(static_argnames=("cutoff", "half", "max_per_bin", "search_range"))
def _pair_stats(positions, cell, pbc, batch_idx, atom_mask, cutoff, half, max_per_bin, search_range):
    mask, aux = _candidates(
        positions, cell, pbc, batch_idx, atom_mask,
        cutoff=cutoff, half=half, max_per_bin=max_per_bin, search_range=search_range,
    )
    per_atom = jnp.sum(mask, axis=(1, 2), dtype=jnp.int32)
    return jnp.sum(per_atom), jnp.max(per_atom, initial=0)


def _normalise_inputs(positions, cell, pbc, batch_idx, atom_mask):
    positions = jnp.asarray(positions)
    n = positions.shape[0]
    cell = jnp.asarray(cell, positions.dtype).reshape(-1, 3, 3)
    pbc = jnp.asarray(pbc, bool).reshape(-1, 3)
    batch_idx = jnp.zeros(n, jnp.int32) if batch_idx is None else jnp.asarray(batch_idx, jnp.int32)
    atom_mask = jnp.ones(n, bool) if atom_mask is None else jnp.asarray(atom_mask, bool)
    return positions, cell, pbc, batch_idx, atom_mask


def neighbor_capacity(
    positions, cell, pbc, batch_idx=None, atom_mask=None, *, cutoff: float, half: bool = False, headroom: float = 1.2
) -> NeighborCapacity:
    """Host-side sizing: the capacities this configuration needs, times ``headroom``.

    Runs two small device passes (binning, then a pair count without storing pairs), so
    the result is exact for these positions; ``headroom`` leaves room for atoms to move.
    """
    _check_cutoff(cutoff)
    if headroom < 1.0:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    args = _normalise_inputs(positions, cell, pbc, batch_idx, atom_mask)
    per_bin, need = _bin_stats(*args, cutoff=float(cutoff))
    per_bin = _headroom(int(per_bin), headroom)
    rng = tuple(int(r) for r in np.asarray(need))
    edges, neighbors = _pair_stats(
        *args, cutoff=float(cutoff), half=bool(half), max_per_bin=per_bin, search_range=rng
    )
    return NeighborCapacity(
        max_edges=_headroom(int(edges), headroom),
        max_neighbors=_headroom(int(neighbors), headroom),
        max_per_bin=per_bin,
        search_range=rng,
    )


_build_jit = jax.jit(build_neighbor_list, static_argnames=("cutoff", "capacity", "half", "format"))


def neighbor_list(
    positions,
    cell,
    pbc,
    batch_idx=None,
    atom_mask=None,
    *,
    cutoff: float,
    half: bool = False,
    format: NeighborListFormat = NeighborListFormat.COO,
    capacity: NeighborCapacity | None = None,
    max_rebuilds: int = 8,
) -> tuple[NeighborList, NeighborCapacity]:
    """Build a complete neighbour list from the host: size, build, grow on overflow.

    Returns the list and the capacity it was built with (reuse it to avoid re-jitting).
    """
    args = _normalise_inputs(positions, cell, pbc, batch_idx, atom_mask)
    if capacity is None:
        capacity = neighbor_capacity(*args, cutoff=cutoff, half=half)
    for _ in range(max_rebuilds):
        nl = _build_jit(*args, cutoff=float(cutoff), capacity=capacity, half=bool(half), format=NeighborListFormat(format))
        if not bool(nl.overflow):
            return nl, capacity
        capacity = capacity.grown(nl.stats())
    raise RuntimeError(f"neighbour list still overflowed after {max_rebuilds} rebuilds (last capacity {capacity})")
