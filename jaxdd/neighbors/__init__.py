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

from .. import programs
from ..checks import integral
from .capacity import DEFAULT_GROWTH_FACTOR, grow
from .capacity import headroom as with_headroom
from ..data import is_concrete
from ..periodic import wrap_fractional

__all__ = [
    "NeighborListFormat",
    "NeighborCapacity",
    "NeighborList",
    "build_neighbor_list",
    "neighbor_capacity",
    "neighbor_list",
    "edge_vectors",
    "effective_cell",
    "local_neighbor_list",
    "NEIGHBOR_BACKENDS",
    "PAIR_COUNT_SLOTS",
]


class NeighborListFormat(enum.Enum):
    """How a neighbour list is laid out: COO edge arrays or a per-atom MATRIX."""

    COO = "coo"
    MATRIX = "matrix"


@dataclasses.dataclass(frozen=True)
class NeighborCapacity:
    """Static sizes of a neighbour list build (hashable: part of the jit cache key).

    max_edges: COO edge slots.
    max_neighbors: neighbour slots per atom (MATRIX format).
    max_candidates: atoms examined per atom (the atoms of its block of neighbouring bins).
    search_range: bins scanned on each side of an atom's bin, per cell axis.
    bin_divisions: bins per cutoff length; finer bins examine fewer atoms that are too
        far away but scan more bins (2 is a good balance for dense systems).
    max_bins: size of the bin table shared by all systems (None: max(4096, 2 n_atoms));
        systems that would need more bins get coarser ones.
    """

    max_edges: int
    max_neighbors: int
    max_candidates: int
    search_range: tuple[int, int, int]
    bin_divisions: int = 2
    max_bins: int | None = None

    def __post_init__(self):
        # Stored as ints (hashable, part of the jit cache key); a fraction is refused, never truncated.
        for name in ("max_edges", "max_neighbors", "max_candidates", "bin_divisions", "max_bins"):
            if name != "max_bins" or self.max_bins is not None:
                object.__setattr__(self, name, integral(f"NeighborCapacity.{name}", getattr(self, name), minimum=1))
        try:
            rng = tuple(self.search_range)
        except TypeError:
            rng = ()
        if len(rng) != 3:
            raise ValueError(f"NeighborCapacity.search_range must be 3 integers >= 1, got {self.search_range}")
        rng = tuple(integral(f"NeighborCapacity.search_range[{a}] (of {self.search_range!r})", r, minimum=1)
                    for a, r in enumerate(rng))
        object.__setattr__(self, "search_range", rng)

    def grown(self, needed: "NeighborStats", factor: float = DEFAULT_GROWTH_FACTOR) -> "NeighborCapacity":
        """A capacity that fits ``needed``: each slot count that is too small grown by
        :func:`jaxdd.neighbors.capacity.grow` (never smaller than self)."""
        return NeighborCapacity(
            max_edges=grow(self.max_edges, needed.edges, factor),
            max_neighbors=grow(self.max_neighbors, needed.neighbors, factor),
            max_candidates=grow(self.max_candidates, needed.candidates, factor),
            search_range=tuple(max(a, int(b)) for a, b in zip(self.search_range, needed.search_range)),
            bin_divisions=self.bin_divisions,
            max_bins=None if self.max_bins is None else grow(self.max_bins, needed.bins, factor),
        )

    @staticmethod
    def covering(caps, min_neighbors: int = 1) -> "NeighborCapacity":
        """The smallest capacity that fits each of ``caps`` (e.g. every rank's), with at
        least ``min_neighbors`` neighbour slots."""
        caps = list(caps)
        return NeighborCapacity(
            max_edges=max(c.max_edges for c in caps),
            max_neighbors=max([c.max_neighbors for c in caps] + [min_neighbors]),
            max_candidates=max(c.max_candidates for c in caps),
            search_range=tuple(max(c.search_range[a] for c in caps) for a in range(3)),
        )

    def bucketed(self) -> "NeighborCapacity":
        """This capacity with its edge, neighbour and candidate slots rounded up to
        :func:`capacity_bucket` (search range, bin divisions and bin table unchanged)."""
        return dataclasses.replace(self, max_edges=capacity_bucket(self.max_edges),
                                   max_neighbors=capacity_bucket(self.max_neighbors),
                                   max_candidates=capacity_bucket(self.max_candidates))

    def table_size(self, n_atoms: int) -> int:
        """Bins in the table for ``n_atoms`` atom rows."""
        return int(self.max_bins) if self.max_bins is not None else max(4096, 2 * int(n_atoms))

    def fits(self, needed: "NeighborStats") -> bool:
        return (
            needed.edges <= self.max_edges
            and needed.neighbors <= self.max_neighbors
            and needed.candidates <= self.max_candidates
            and all(int(b) <= a for a, b in zip(self.search_range, needed.search_range))
        )


#: The smallest bucket: capacities below it are raised to it.
BUCKET_MIN = 8


def capacity_bucket(n: int, minimum: int = BUCKET_MIN) -> int:
    """``n`` rounded up to the next capacity bucket: the smallest number >= max(n, minimum)
    of the form 2^k or 3 * 2^k (8, 12, 16, 24, 32, 48, 64, 96, ...).

    Consecutive buckets differ by a factor 1.5 or 4/3, so a bucketed capacity is at most 1.5
    times the one asked for, and sizes from 1 to N fall into about 2 log2(N) buckets: systems
    of different sizes that land in one bucket share one compiled program.
    """
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # smallest power of two >= n
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


@dataclasses.dataclass(frozen=True)
class NeighborStats:
    """Sizes a build needed, read back on the host (plain ints)."""

    edges: int
    neighbors: int
    candidates: int
    search_range: tuple[int, int, int]
    bins: int


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
    needed_candidates, needed_range, needed_bins: sizes the search needed ([], [3], [] int32).
    overflow: [] bool, True when any capacity was too small; the list is then incomplete.
    displacement: [max_edges, 3] Å added to every edge vector by :func:`edge_vectors`, or None
        (the default). Zeros set there are what per-atom virials are differentiated by
        (:mod:`jaxdd.virials`): the gradient of the energy with respect to them is dE/dr_e.
    zero_shifts: static; True when every shift is zero by construction (a rank's list under
        decomposition, :func:`local_neighbor_list`): kernels may then skip reading them.
    """

    senders: jax.Array
    receivers: jax.Array
    shifts: jax.Array
    mask: jax.Array
    matrix: Any
    matrix_shifts: Any
    num_neighbors: jax.Array
    n_edges: jax.Array
    needed_candidates: jax.Array
    needed_range: jax.Array
    needed_bins: jax.Array
    overflow: jax.Array
    displacement: Any = None
    zero_shifts: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def stats(self) -> NeighborStats:
        """Sizes this build needed, as host integers (blocks until the build is done)."""
        return NeighborStats(
            edges=int(self.n_edges),
            neighbors=int(jnp.max(self.num_neighbors, initial=0)),
            candidates=int(self.needed_candidates),
            search_range=tuple(int(r) for r in np.asarray(self.needed_range)),
            bins=int(self.needed_bins),
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


@jax.jit
def effective_cell(cell, pbc):
    """Cell used for binning: periodic rows as given, open rows orthonormal completions.

    cell: [S, 3, 3] (rows are lattice vectors); pbc: [S, 3] bool. Returns [S, 3, 3].
    """
    index = (pbc[:, 0].astype(jnp.int32) * 4 + pbc[:, 1].astype(jnp.int32) * 2 + pbc[:, 2].astype(jnp.int32))
    branches = [lambda c, p=p: _complete_cell(c, p) for p in _PATTERNS]
    return jax.vmap(lambda i, c: jax.lax.switch(i, branches, c))(index, cell)


def _rows(x, idx):
    # Padding edges index one past the last atom: "fill" reads zeros there, so their
    # vectors are exactly zero without a mask (a select here would cost a full pass).
    return x.at[idx].get(mode="fill", fill_value=0)


@jax.custom_jvp
def _differences(positions, senders, receivers):
    """positions[senders] - positions[receivers], [E, 3] (zero where an index is past the end)."""
    return _rows(positions, senders) - _rows(positions, receivers)


@_differences.defjvp
def _differences_jvp(primals, tangents):
    # The same difference of the tangent, read as rows of four (a zero column added, then
    # dropped): its transpose, the gradient, then scatters rows of four into the forces.
    # XLA's CPU scatter adds rows of three an element at a time, about three times slower
    # on receiver-sorted edges; the forward pass keeps rows of three, which XLA fuses better.
    # The receivers' rows are negated before they are read (a sum, not a difference), so the
    # gradient negates the receivers' [n_atoms, 4] sums instead of a second edge-long array.
    # A zero row past the last atom stands for the padding edges (index n_atoms), and XLA's
    # gather clamps larger indices onto it, so the reads need neither a mask nor jnp's
    # wrapping of negative indices (indices are never negative): either would make the
    # gradient's scatters rewrite both index arrays first, a pass over the edges each.
    positions, senders, receivers = primals
    padded = jnp.pad(tangents[0], ((0, 1), (0, 1)))
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))

    def rows(x, idx):
        return jax.lax.gather(x, idx[:, None], dims, (1, x.shape[1]),
                              mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)

    return _differences(*primals), (rows(padded, senders) + rows(-padded, receivers))[:, :3]


def edge_vectors(positions, cell, batch_idx, nl: NeighborList):
    """Receiver → sender vectors of the COO edges, [max_edges, 3] (padding rows are zero).

    positions: [n_atoms, 3]; cell: [S, 3, 3]; batch_idx: [n_atoms] system of each atom.
    Differentiable in positions and cell (the strain used for stress acts through both), and
    in ``nl.displacement`` when the list has one (added to every vector), to any order; the
    edge indices are those jaxdd's lists hold, in [0, n_atoms] (n_atoms: padding).
    """
    if nl.zero_shifts:  # a rank's list: no images, so neither the shifts nor the cell enter
        vectors = _differences(positions, nl.senders, nl.receivers)
        return vectors if nl.displacement is None else vectors + nl.displacement
    shifts = nl.shifts.astype(positions.dtype)
    if cell.shape[0] == 1:
        # One system: a [E, 3] x [3, 3] product; no per-edge copy of the cell (whose
        # gradient would otherwise be a scatter over all edges).
        shift = shifts @ cell[0]
    else:
        shift = jnp.einsum("ei,eij->ej", shifts, cell[_rows(batch_idx, nl.receivers)])
    vectors = _differences(positions, nl.senders, nl.receivers) + shift
    return vectors if nl.displacement is None else vectors + nl.displacement


# --------------------------------------------------------------------------- binning


def _margin(dtype) -> float:
    # Bins are made slightly wider than the cutoff so that rounding in the fractional
    # coordinates can never push a true neighbour outside the scanned block.
    return float(np.sqrt(np.finfo(dtype).eps))


def _fit_budget(nb, budget):
    """Coarsen bin counts [S, 3] so each system has at most ``budget`` bins.

    Wider bins are always correct (the reach shrinks); only efficiency is traded.
    """
    for _ in range(3):  # each pass fixes at least one axis that reached a single bin
        total = jnp.prod(nb, axis=1, keepdims=True)
        free = jnp.maximum(jnp.sum(nb > 1, axis=1, keepdims=True), 1)
        factor = jnp.where(total > budget, (budget / total) ** (1.0 / free), 1.0)
        nb = jnp.where(nb > 1, jnp.maximum(jnp.floor(nb * factor), 1.0), nb)
    return nb


def _lengths(cutoff: float, divisions: int, dtype) -> tuple[float, float]:
    """(reach, target bin width) in Å of a search to ``cutoff`` with ``divisions`` bins per cutoff."""
    reach = cutoff * (1.0 + _margin(dtype))
    return reach, reach / divisions


def _bins(positions, cell, pbc, batch_idx, atom_mask, lengths, max_bins):
    """Bin every atom into a dense table of ``max_bins`` bins; all shapes static.

    lengths: :func:`_lengths` (Python floats, or arrays of the positions' dtype holding the
    same values: the arithmetic is the same, so the bins are too)."""
    n_atoms = positions.shape[0]
    n_sys = cell.shape[0]
    dtype = positions.dtype
    reach, target = lengths

    ceff = jax.lax.stop_gradient(effective_cell(cell, pbc))
    inv = jnp.linalg.inv(ceff)  # [S, 3, 3]
    spacing = 1.0 / jnp.linalg.norm(inv, axis=1)  # [S, 3] distance between lattice planes
    sys_idx = jnp.clip(batch_idx, 0, n_sys - 1)
    pos = jax.lax.stop_gradient(positions)
    frac = jnp.einsum("vi,vij->vj", pos, inv[sys_idx])
    per_atom_pbc = pbc[sys_idx]
    fw, wraps = wrap_fractional(frac, per_atom_pbc)
    # Wrapped positions from integers times the cell: exact on the original coordinates.
    pos_w = pos - jnp.einsum("vi,vij->vj", wraps, cell[sys_idx])

    big = jnp.asarray(jnp.finfo(dtype).max, dtype)
    fmin = jax.ops.segment_min(jnp.where(atom_mask[:, None], frac, big), sys_idx, n_sys)
    fmax = jax.ops.segment_max(jnp.where(atom_mask[:, None], frac, -big), sys_idx, n_sys)
    extent = jnp.where(fmax >= fmin, fmax - fmin, 0.0)  # fractional units

    # Periodic axes: bins of width >= cutoff/divisions; a cell thinner than that gets one
    # bin and a wider reach. Open axes: bins over the atoms' own extent.
    wanted = jnp.where(pbc, jnp.floor(spacing / target), jnp.floor(extent * spacing / target) + 1)
    nb = _fit_budget(jnp.maximum(wanted, 1.0), max(1, max_bins // n_sys))
    width_open = jnp.maximum(target / spacing, extent / nb * (1.0 + _margin(dtype)))
    need = jnp.where(pbc, jnp.ceil(reach * nb / spacing), jnp.ceil(reach / (width_open * spacing)))
    need = jnp.max(jnp.maximum(need, 1), axis=0).astype(jnp.int32)  # [3], over systems
    nbins = nb.astype(jnp.int32)  # [S, 3]

    atom_nb = nbins[sys_idx]
    b_per = jnp.floor(fw * atom_nb).astype(jnp.int32)
    b_open = jnp.floor((frac - fmin[sys_idx]) / width_open[sys_idx]).astype(jnp.int32)
    b = jnp.clip(jnp.where(per_atom_pbc, b_per, b_open), 0, atom_nb - 1)
    # Systems own consecutive ranges of the table, so no two systems share a bin.
    n_per_sys = jnp.prod(nbins, axis=1)
    sys_base = (jnp.cumsum(n_per_sys) - n_per_sys).astype(jnp.int32)
    keys = jnp.where(atom_mask, _linear_key(sys_base[sys_idx], b, atom_nb), max_bins)
    counts = jax.ops.segment_sum(jnp.ones(n_atoms, jnp.int32), keys, max_bins)
    order = jnp.argsort(keys).astype(jnp.int32)
    return dict(
        bins=b,
        nbins=nbins,
        need=need,
        bins_used=jnp.sum(n_per_sys),
        sys_idx=sys_idx,
        sys_base=sys_base,
        wraps=wraps.astype(jnp.int32),
        pos_w=pos_w,
        order=order,
        # Atoms in bin order: a bin's atoms are contiguous, so reading a run of
        # candidates touches consecutive memory.
        pos_sorted=pos_w[order],
        rank=jnp.zeros(n_atoms, jnp.int32).at[order].set(jnp.arange(n_atoms, dtype=jnp.int32)),
        bin_count=counts,
        bin_start=jnp.cumsum(counts) - counts,
        n_atoms=n_atoms,
    )


def _linear_key(base, b, nb):
    """Bin key: ``base`` (first key of the atom's system) + the bin's row-major index."""
    return base + (b[..., 0] * nb[..., 1] + b[..., 1]) * nb[..., 2] + b[..., 2]


def _offsets(search_range):
    rx, ry, rz = search_range
    grid = itertools.product(range(-rx, rx + 1), range(-ry, ry + 1), range(-rz, rz + 1))
    return np.asarray(list(grid), dtype=np.int32)  # [n_off, 3]


def _lex_positive(s):
    sx, sy, sz = s[..., 0], s[..., 1], s[..., 2]
    return (sx > 0) | ((sx == 0) & ((sy > 0) | ((sy == 0) & (sz > 0))))


def _window(a, start, rows: int):
    """Rows ``start .. start + rows`` of ``a`` (the first ``rows`` when ``start`` is None; a
    traced ``start`` must leave ``rows`` rows after it)."""
    return a[:rows] if start is None else jax.lax.dynamic_slice_in_dim(a, start, rows)


def _block_counts(g, pbc, receiving, search_range, max_bins, rows, start=None):
    """For each of ``rows`` atoms (the first, or those from row ``start``) and each
    neighbouring bin: the bin's run in the sorted order and its image. receiving: [rows] bool,
    the rows that search (others count no candidates). Returns start, count [rows, n_off]
    and image [rows, n_off, 3].
    """
    offsets = jnp.asarray(_offsets(search_range))  # [n_off, 3]
    sys_idx = _window(g["sys_idx"], start, rows)
    nb = g["nbins"][sys_idx][:, None, :]  # [R, 1, 3]
    raw = _window(g["bins"], start, rows)[:, None, :] + offsets[None, :, :]  # [R, n_off, 3]
    per = pbc[sys_idx][:, None, :]
    image = jnp.where(per, jnp.floor_divide(raw, nb), 0)
    wrapped = jnp.where(per, jnp.mod(raw, nb), raw)
    inside = jnp.all(per | ((raw >= 0) & (raw < nb)), axis=-1)
    key = jnp.clip(_linear_key(g["sys_base"][sys_idx][:, None], wrapped, nb), 0, max_bins - 1)
    count = jnp.where(inside & receiving[:, None], g["bin_count"][key], 0)
    return g["bin_start"][key], count, image


def _candidates(positions, cell, pbc, batch_idx, atom_mask, *, cutoff, half, capacity, n_receivers=None, order=None,
                lengths=None, receiving=None, bins=None, row_start=None):
    """Examine, for every receiver, the atoms of its block of neighbouring bins.

    Receivers are the first ``n_receivers`` rows (default all), or ``n_receivers`` rows from
    row ``row_start`` (traced; a window of the rows, for counting a large system in blocks).
    The block of atom i is the concatenation of the runs (in bin-sorted order) of its n_off
    neighbouring bins; slot t of row i is one candidate. Returns (mask [R, C], aux) with
    mask[i, t] True when candidate t is a neighbour of i. lengths: (reach, bin width,
    cutoff²) as arrays (default from ``cutoff``); receiving: [R] bool, receivers that search
    (default the atoms'); bins: :func:`_bins` of these inputs, when already made.
    """
    table = capacity.table_size(positions.shape[0])
    if lengths is None:
        lengths = (*_lengths(cutoff, capacity.bin_divisions, positions.dtype), cutoff * cutoff)
    g = _bins(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], table) if bins is None else bins
    n_all = g["n_atoms"]
    n = n_all if n_receivers is None else int(n_receivers)
    c = capacity.max_candidates
    receiving = _window(atom_mask, row_start, n) if receiving is None else receiving
    start, count, image = _block_counts(g, pbc, receiving, capacity.search_range, table, n, row_start)
    n_off = count.shape[1]
    end = jnp.cumsum(count, axis=1)
    first = end - count  # first slot of each bin's run in the atom's row
    total = end[:, -1]

    # Ragged runs -> per-slot (bin, sorted index) without a search: scatter the change of
    # the per-slot values at the first slot of each run, then a running sum along the row.
    # An empty run adds its change at the same slot as the next run, which overrides it.
    values = jnp.stack([jnp.broadcast_to(jnp.arange(n_off, dtype=jnp.int32), count.shape), start - first], -1)
    prev = jnp.concatenate([jnp.zeros_like(values[:, :1]), values[:, :-1]], axis=1)
    rows = jnp.broadcast_to(jnp.arange(n)[:, None], first.shape)
    delta = jnp.zeros((n, c, 2), jnp.int32).at[rows, first].add(values - prev, mode="drop")
    spread = jnp.cumsum(delta, axis=1)
    t = jnp.arange(c, dtype=jnp.int32)
    which = spread[..., 0]  # [V, C] neighbouring bin of each slot
    sorted_pos = jnp.clip(t + spread[..., 1], 0, n_all - 1)  # [R, C] candidate, in bin order

    # Origin of each (atom, bin): the atom moved by minus the bin's image shift, so a
    # candidate's vector is one gather and one subtraction.
    cell_i = jax.lax.stop_gradient(cell)[_window(g["sys_idx"], row_start, n)]  # [R, 3, 3]
    shifts = jnp.einsum("voi,vij->voj", image.astype(positions.dtype), cell_i)
    origin = _window(g["pos_w"], row_start, n)[:, None, :] - shifts
    flat_which = jnp.arange(n)[:, None] * n_off + which
    vec = g["pos_sorted"][sorted_pos] - origin.reshape(-1, 3)[flat_which]
    d2 = jnp.sum(vec * vec, axis=-1)
    # The atom itself in its own image is the only candidate at exactly zero distance
    # that is the atom itself (a lattice translation of a non-singular cell is never zero).
    itself = sorted_pos == _window(g["rank"], row_start, n)[:, None]
    mask = (t < total[:, None]) & (d2 < lengths[2]) & ~(itself & (d2 == 0))
    if half and order is not None:  # rows ranked by (key a, key b); no periodic images here
        j = g["order"][sorted_pos]
        ka, kb = (jnp.asarray(k, jnp.int32) for k in order)
        ai, bi = _window(ka, row_start, n)[:, None], _window(kb, row_start, n)[:, None]
        higher = (ka[j] > ai) | ((ka[j] == ai) & (kb[j] > bi))
        mask = mask & (higher != (((ka[j] ^ ai) & 1) == 1))  # the rule of :func:`build_neighbor_list`
    elif half:
        i = jnp.arange(n, dtype=jnp.int32)[:, None] + (0 if row_start is None else row_start)
        j = g["order"][sorted_pos]
        shift = image.reshape(-1, 3)[flat_which] - g["wraps"][j] + _window(g["wraps"], row_start, n)[:, None, :]
        mask = mask & ((i < j) | ((i == j) & _lex_positive(shift)))
    aux = dict(g, sorted_pos=sorted_pos, which=which, image=image, total=total)
    return mask, aux


# --------------------------------------------------------------------------- builders


def _check_order(order, n: int, half: bool, pbc):
    """The two [n] int32 half-list keys, checked: only for a half list without periodic axes
    (the keys do not tell a pair's periodic images apart)."""
    if not half:
        raise ValueError("order decides which row of a pair lists it; it needs half=True")
    keys = tuple(order) if isinstance(order, (tuple, list)) else ()
    if len(keys) != 2:
        raise ValueError(f"order must be two [n_atoms] int32 arrays (key a, key b), got {type(order).__name__}")
    keys = tuple(jnp.asarray(k) for k in keys)
    for name, k in zip(("order[0]", "order[1]"), keys):
        if k.shape != (n,) or not jnp.issubdtype(k.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array of shape ({n},) (one key per atom), got {k.dtype}{k.shape}")
    if is_concrete(pbc) and np.any(np.asarray(pbc)):
        raise ValueError("order is for lists without periodic axes (a rank's owned and ghost rows); with a periodic "
                         "axis use the default half-list rule (order=None)")
    return tuple(k.astype(jnp.int32) for k in keys)


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
    n_receivers: int | None = None,
    order=None,
) -> NeighborList:
    """Build a neighbour list on device; traceable under ``jit`` (keyword args static but ``order``).

    positions: [n_atoms, 3] Å; cell: [S, 3, 3] Å (rows); pbc: [S, 3] bool;
    batch_idx: [n_atoms] system of each atom (default all 0); atom_mask: [n_atoms] bool,
    False for padding rows (default all True); n_receivers: only rows [0, n_receivers) are
    receivers (default all; under decomposition, the owned rows), and the work scales with
    them. Pairs with distance < cutoff are listed. order: for a half list without periodic
    axes, two [n_atoms] int32 keys that decide which row of a pair lists it, e.g. global
    atom id and image under decomposition: the row of lower (key a, key b), compared
    lexicographically, when the two keys a have the same parity, else the row of higher.
    The parity spreads the pairs between two sets of rows (two ranks) about evenly; the
    lower key alone would give them all to the set holding the lower ids. Default: the
    lower row index, and the positive image shift.
    Check ``overflow`` (or use :func:`neighbor_list`, which grows and rebuilds). Called
    outside a trace it runs as one compiled program per shape and configuration.
    """
    _check_cutoff(cutoff)
    format = NeighborListFormat(format)
    if n_receivers is not None:
        n_receivers = integral("build_neighbor_list: n_receivers", n_receivers, minimum=0)
    inputs = tuple(x if x is None or isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
                   for x in (positions, cell, pbc, batch_idx, atom_mask))
    if order is not None:  # checked here, where a host pbc is still concrete
        order = _check_order(order, inputs[0].shape[0], half, inputs[2])
    kw = dict(cutoff=float(cutoff), capacity=capacity, half=bool(half), format=format, n_receivers=n_receivers)
    if not is_concrete(*jax.tree_util.tree_leaves((inputs, order))):
        return _build(*inputs, **kw, order=order)  # inside the caller's program
    return _build_jit(*inputs, **kw, order=order)


def _build(positions, cell, pbc, batch_idx, atom_mask, *, cutoff, capacity, half, format, n_receivers, order):
    positions, cell, pbc, batch_idx, atom_mask = _normalise_inputs(positions, cell, pbc, batch_idx, atom_mask)
    n = positions.shape[0]

    mask, aux = _candidates(
        positions, cell, pbc, batch_idx, atom_mask,
        cutoff=cutoff, half=half, capacity=capacity, n_receivers=n_receivers, order=order,
    )
    c = mask.shape[1]
    per_atom = jnp.sum(mask, axis=1, dtype=jnp.int32)  # [R]
    n_edges = jnp.sum(per_atom, dtype=jnp.int32)

    # Row-major compaction keeps the edges sorted by receiver.
    (idx,) = jnp.nonzero(mask.reshape(-1), size=capacity.max_edges, fill_value=0)
    valid = jnp.arange(capacity.max_edges) < n_edges
    recv = (idx // c).astype(jnp.int32)
    slot = idx % c
    send = aux["order"][aux["sorted_pos"][recv, slot]]
    shift = aux["image"][recv, aux["which"][recv, slot]] - aux["wraps"][send] + aux["wraps"][recv]
    senders = jnp.where(valid, send, n).astype(jnp.int32)
    receivers = jnp.where(valid, recv, n).astype(jnp.int32)
    shifts = jnp.where(valid[:, None], shift, 0).astype(jnp.int32)

    needed_candidates = jnp.max(aux["total"], initial=0)
    overflow = (
        (aux["bins_used"] > capacity.table_size(n))
        | (needed_candidates > c)
        | jnp.any(aux["need"] > jnp.asarray(capacity.search_range))
    )
    return _assemble(senders, receivers, shifts, valid, per_atom, n_edges, n, capacity, format, overflow,
                     needed_candidates=needed_candidates, needed_range=aux["need"], needed_bins=aux["bins_used"])


def _assemble(senders, receivers, shifts, valid, per_atom, n_edges, n, capacity, format, overflow, *,
              needed_candidates, needed_range, needed_bins) -> NeighborList:
    """A NeighborList from COO edges grouped by receiver (the MATRIX table built from them);
    ``overflow`` is the search's own, the edge and neighbour slots are checked here."""
    matrix = matrix_shifts = None
    per_atom = jnp.pad(per_atom, (0, n - per_atom.shape[0]))
    if format is NeighborListFormat.MATRIX:
        kk = capacity.max_neighbors
        row_start = jnp.cumsum(per_atom) - per_atom
        safe = jnp.minimum(receivers, n - 1) if n else receivers
        col = jnp.arange(capacity.max_edges) - row_start[safe]
        col = jnp.where(valid & (col < kk), col, kk)  # out of range: dropped
        matrix = jnp.full((n, kk), n, jnp.int32).at[receivers, col].set(senders, mode="drop")
        matrix_shifts = jnp.zeros((n, kk, 3), jnp.int32).at[receivers, col].set(shifts, mode="drop")
    overflow = (
        overflow
        | (n_edges > capacity.max_edges)
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
        needed_candidates=jnp.asarray(needed_candidates).astype(jnp.int32),
        needed_range=jnp.asarray(needed_range).astype(jnp.int32),
        needed_bins=jnp.asarray(needed_bins).astype(jnp.int32),
        overflow=overflow,
    )


NEIGHBOR_BACKENDS = ("auto", "kernel", "jnp")


def local_neighbor_list(positions, batch_idx, atom_mask, *, n_systems: int, cutoff: float,
                        capacity: NeighborCapacity, half: bool = False,
                        format: NeighborListFormat = NeighborListFormat.COO, n_receivers: int | None = None,
                        backend: str = "jnp", order=None) -> NeighborList:
    """The neighbour list of atoms with open boundaries (no periodic axis, no cell), as a
    rank builds it over its owned rows and ghost images; traceable under ``jit``.

    positions: [n, 3] Å; batch_idx: [n] int32; atom_mask: [n] bool. backend: ``"jnp"`` (the
    bin search of :func:`build_neighbor_list`, any device) or ``"kernel"`` (the compiled
    cell list of :mod:`jaxdd.ffi.neighbors`: CPU, or CUDA GPUs with the CUDA kernels built;
    much faster, same pairs; only its
    edge and neighbour slots can overflow). Shifts are all zero. order: for a half list, the
    two [n] int32 keys that decide which row of a pair lists it (see :func:`build_neighbor_list`).
    """
    if backend not in ("kernel", "jnp"):
        raise ValueError(f"backend must be 'kernel' or 'jnp' here, got {backend!r}")
    if backend == "jnp":
        dtype = positions.dtype
        nl = build_neighbor_list(
            positions, jnp.broadcast_to(jnp.eye(3, dtype=dtype), (n_systems, 3, 3)), jnp.zeros((n_systems, 3), bool),
            batch_idx, atom_mask, cutoff=cutoff, capacity=capacity, half=half, format=format, n_receivers=n_receivers,
            order=order)
        return dataclasses.replace(nl, zero_shifts=True)
    from ..ffi.neighbors import cell_list

    _check_cutoff(cutoff)
    format = NeighborListFormat(format)
    n = positions.shape[0]
    senders, receivers, shifts, per_atom, n_edges = cell_list(
        positions, jnp.asarray(batch_idx, jnp.int32), jnp.asarray(atom_mask, bool), cutoff=float(cutoff),
        max_edges=capacity.max_edges, n_receivers=n_receivers, n_systems=n_systems, half=half, order=order)
    valid = jnp.arange(capacity.max_edges) < n_edges
    zero = jnp.zeros((), jnp.int32)
    nl = _assemble(senders, receivers, shifts, valid, per_atom, n_edges, n, capacity, format, jnp.zeros((), bool),
                   needed_candidates=zero, needed_range=jnp.zeros(3, jnp.int32), needed_bins=zero)
    return dataclasses.replace(nl, zero_shifts=True)


# The sizing passes below compile once per bucket of rows (capacity_bucket) and take the cutoff
# and the receiver count as data: systems of nearby sizes and any cutoff share their programs.
# Padding rows are masked atoms, which no pass bins or counts.


def _receiving(atom_mask, rows, n_receivers):
    return atom_mask[:rows] & (jnp.arange(rows) < n_receivers)


@programs.track
@jax.jit(static_argnames=("table",))
def _range_stats(positions, cell, pbc, batch_idx, atom_mask, lengths, table):
    return _bins(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], table)["need"]


@programs.track
@jax.jit(static_argnames=("table", "search_range", "rows"))
def _candidate_stats(positions, cell, pbc, batch_idx, atom_mask, lengths, n_receivers, table, search_range, rows):
    g = _bins(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], table)
    _, count, _ = _block_counts(g, pbc, _receiving(atom_mask, rows, n_receivers), search_range, table, rows)
    return jnp.max(jnp.sum(count, axis=1), initial=0)


#: Candidate slots the pair count examines at once (rows x candidates per row): the count of
#: a larger system runs in blocks of rows, so sizing needs memory for one block (a few GB),
#: not for every candidate of every atom.
PAIR_COUNT_SLOTS = 1 << 25


def _count_block_rows(rows: int, candidates: int, slots: int) -> int:
    """Rows the pair count takes at once: all of them, or a power of two under ``slots`` /
    ``candidates`` (at least 64)."""
    fit = max(slots // max(candidates, 1), 64)
    return rows if rows <= fit else 1 << (fit.bit_length() - 1)


@programs.track
@jax.jit(static_argnames=("half", "capacity", "rows", "slots"))
def _pair_stats(positions, cell, pbc, batch_idx, atom_mask, lengths, n_receivers, half, capacity, rows, slots,
                order=None):
    """(pairs, most pairs of one receiver) of the first ``rows`` rows, in blocks of about
    ``slots`` candidate slots."""
    receiving = _receiving(atom_mask, rows, n_receivers)
    block = _count_block_rows(rows, capacity.max_candidates, slots)

    def pairs(recv, start=None, bins=None):  # (pairs, most of one receiver) of ``block`` rows
        mask, _ = _candidates(positions, cell, pbc, batch_idx, atom_mask, cutoff=None, half=half, capacity=capacity,
                              n_receivers=block, lengths=lengths, receiving=recv, order=order, bins=bins,
                              row_start=start)
        per_atom = jnp.sum(mask, axis=1, dtype=jnp.int32)
        return jnp.sum(per_atom), jnp.max(per_atom, initial=0)

    if block == rows:
        return pairs(receiving)
    g = _bins(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], capacity.table_size(positions.shape[0]))

    def count(nominal):
        # The last block is moved back to end at the last row; rows an earlier block counted
        # are left out of it.
        start = jnp.minimum(nominal, rows - block)
        again = start + jnp.arange(block) < nominal
        return pairs(jax.lax.dynamic_slice_in_dim(receiving, start, block) & ~again, start, g)

    sums, peaks = jax.lax.map(count, jnp.arange(0, rows, block, dtype=jnp.int32))
    return jnp.sum(sums), jnp.max(peaks)


def _padded_rows(positions, cell, pbc, batch_idx, atom_mask, rows: int):
    """Host copies of the inputs with ``rows`` atom rows: the extra ones are masked atoms of
    system 0 (numpy, so sizing compiles no small programs of its own)."""
    positions, cell, pbc, batch_idx, atom_mask = _normalise_inputs(positions, cell, pbc, batch_idx, atom_mask, xp=np)
    extra = rows - positions.shape[0]
    return (np.pad(positions, ((0, extra), (0, 0))), cell, pbc, np.pad(batch_idx, (0, extra)),
            np.pad(atom_mask, (0, extra)))


def _normalise_inputs(positions, cell, pbc, batch_idx, atom_mask, xp=jnp):
    """The inputs as ``xp`` arrays (``jnp``, or ``np`` on the host), defaults filled in; an
    atom of no system (``batch_idx`` out of range) is masked."""
    positions = xp.asarray(positions)
    n = positions.shape[0]
    cell = xp.asarray(cell, positions.dtype).reshape(-1, 3, 3)
    pbc = xp.asarray(pbc, bool).reshape(-1, 3)
    batch_idx = xp.zeros(n, xp.int32) if batch_idx is None else xp.asarray(batch_idx, xp.int32)
    atom_mask = xp.ones(n, bool) if atom_mask is None else xp.asarray(atom_mask, bool)
    atom_mask = atom_mask & (batch_idx >= 0) & (batch_idx < cell.shape[0])
    return positions, cell, pbc, batch_idx, atom_mask


def neighbor_capacity(
    positions,
    cell,
    pbc,
    batch_idx=None,
    atom_mask=None,
    *,
    cutoff: float,
    half: bool = False,
    headroom: float = 1.2,
    bin_divisions: int = 2,
    n_receivers: int | None = None,
    order=None,
) -> NeighborCapacity:
    """Host-side sizing: the capacities this configuration needs, times ``headroom``.

    Runs small device passes (binning, candidate count, then a pair count that stores no
    pairs; compiled once per size bucket of rows, for any cutoff), so the result is exact
    for these positions; ``headroom`` leaves room for atoms
    to move before the capacity overflows. ``n_receivers`` and ``order`` (the half-list
    keys of a rank's rows) as in :func:`build_neighbor_list`.
    """
    _check_cutoff(cutoff)
    if not headroom >= 1.0:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    cutoff, divisions = float(cutoff), integral("neighbor_capacity: bin_divisions", bin_divisions, minimum=1)
    positions = np.asarray(positions)
    positions = positions.astype(jax.dtypes.canonicalize_dtype(positions.dtype))  # the dtype JAX computes in
    dtype = positions.dtype
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(f"neighbor_capacity: positions must be [n_atoms, 3], got shape {positions.shape}")
    n = positions.shape[0]
    n_receivers = n if n_receivers is None else integral("neighbor_capacity: n_receivers", n_receivers, minimum=0)
    # The table of the list being sized (its real rows), whatever the padding.
    table = NeighborCapacity(1, 1, 1, (1, 1, 1)).table_size(n)
    lengths = np.asarray((*_lengths(cutoff, divisions, dtype), cutoff * cutoff), dtype)
    padded = capacity_bucket(n, minimum=64)
    args = _padded_rows(positions, cell, pbc, batch_idx, atom_mask, padded)
    rows = min(capacity_bucket(n_receivers, minimum=64), padded)
    rng = tuple(int(r) for r in np.asarray(_range_stats(*args, lengths, table=table)))
    candidates = int(_candidate_stats(*args, lengths, n_receivers, table=table, search_range=rng, rows=rows))
    probe = NeighborCapacity(1, 1, with_headroom(candidates, headroom), rng, divisions)
    # The pair count runs with bucketed candidate slots (the counts do not depend on spare
    # slots), so configurations of similar size share its compiled program.
    if order is not None:  # the keys of the padded rows too (those rows are masked)
        order = tuple(np.pad(np.asarray(k, np.int32), (0, padded - n)) for k in _check_order(order, n, half, pbc))
    edges, neighbors = _pair_stats(*args, lengths, n_receivers, half=bool(half),
                                   capacity=dataclasses.replace(probe.bucketed(), max_bins=table), rows=rows,
                                   slots=PAIR_COUNT_SLOTS, order=order)
    return dataclasses.replace(
        probe, max_edges=with_headroom(int(edges), headroom), max_neighbors=with_headroom(int(neighbors), headroom)
    )


_build_jit = programs.track(jax.jit(_build, static_argnames=("cutoff", "capacity", "half", "format", "n_receivers")))


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
    args = (positions, cell, pbc, batch_idx, atom_mask)
    if capacity is None:
        capacity = neighbor_capacity(*args, cutoff=cutoff, half=half)
    for _ in range(max_rebuilds):
        nl = build_neighbor_list(*args, cutoff=cutoff, capacity=capacity, half=half, format=format)
        if not bool(nl.overflow):
            return nl, capacity
        capacity = capacity.grown(nl.stats())
    raise RuntimeError(f"neighbour list still overflowed after {max_rebuilds} rebuilds (last capacity {capacity})")
