"""The bin search: atoms binned in the fractional coordinates of their system's cell, and
every receiver's candidates read from its static block of neighbouring bins.

Every shape is static: the bin table has ``capacity.table_size`` bins, each receiver
examines ``capacity.max_candidates`` candidate slots over ``capacity.search_range`` bins per
side; what a build needed beyond them is returned (``need``, ``total``, ``bins_used``) for the
caller to flag an overflow.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ..data.periodic import wrap_fractional
from .geometry import effective_cell

__all__ = ["search_lengths", "bin_atoms", "block_counts", "candidate_mask"]


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


def search_lengths(cutoff: float, divisions: int, dtype) -> tuple[float, float]:
    """The lengths of a search to ``cutoff``.

    Args:
      cutoff: Å.
      divisions: bins per cutoff length (``NeighborCapacity.bin_divisions``).
      dtype: dtype of the positions (sets the rounding margin).

    Returns:
      (reach, target bin width) in Å: the cutoff widened by a rounding margin, and the
      reach over ``divisions``.
    """
    reach = cutoff * (1.0 + _margin(dtype))
    return reach, reach / divisions


def bin_atoms(positions, cell, pbc, batch_idx, atom_mask, lengths, max_bins):
    """Bin every atom into a dense table of ``max_bins`` bins; all shapes static.

    Args:
      positions: [n_atoms, 3] Å.
      cell: [S, 3, 3] Å, rows are lattice vectors.
      pbc: [S, 3] bool.
      batch_idx: [n_atoms] int32, system of each atom.
      atom_mask: [n_atoms] bool, False for rows that are not binned.
      lengths: (reach, bin width) of :func:`search_lengths` (Python floats, or arrays of the
        positions' dtype holding the same values: the arithmetic is the same, so the bins
        are too).
      max_bins: bins in the table shared by all systems (static).

    Returns:
      A dict of the binning: ``bins`` [n_atoms, 3] and ``nbins`` [S, 3] int32 bin indices and
      counts, ``need`` [3] int32 search range needed, ``bins_used`` [] int32, ``sys_idx``,
      ``sys_base``, ``wraps`` [n_atoms, 3] int32 (cells each atom was wrapped by),
      ``pos_w`` [n_atoms, 3] Å wrapped positions, ``order`` (atoms sorted by bin),
      ``pos_sorted``, ``rank``, ``bin_count`` and ``bin_start`` [max_bins] (each bin's run in
      the sorted order), and ``n_atoms``.
    """
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


def block_counts(g, pbc, receiving, search_range, max_bins, rows, start=None):
    """For each of ``rows`` atoms (the first, or those from row ``start``) and each
    neighbouring bin: the bin's run in the sorted order and its image.

    Args:
      g: the binning of :func:`bin_atoms`.
      pbc: [S, 3] bool.
      receiving: [rows] bool, the rows that search (others count no candidates).
      search_range: bins scanned on each side, per cell axis (static).
      max_bins: bins in the table (static).
      rows: rows examined (static).
      start: first row examined ([] int32, may be traced), or None for row 0.

    Returns:
      (start [rows, n_off] int32 first sorted index of each bin's run, count [rows, n_off]
      int32 atoms of the run, image [rows, n_off, 3] int32 cell shift of the bin).
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


def candidate_mask(positions, cell, pbc, batch_idx, atom_mask, *, cutoff, half, capacity, n_receivers=None,
                   order=None, lengths=None, receiving=None, bins=None, row_start=None):
    """Examine, for every receiver, the atoms of its block of neighbouring bins.

    Receivers are the first ``n_receivers`` rows (default all), or ``n_receivers`` rows from
    row ``row_start`` (traced; a window of the rows, for counting a large system in blocks).
    The block of atom i is the concatenation of the runs (in bin-sorted order) of its n_off
    neighbouring bins; slot t of row i is one candidate.

    Args:
      positions, cell, pbc, batch_idx, atom_mask: as :func:`bin_atoms` (Å).
      cutoff: Å (unused when ``lengths`` is given).
      half: keep one edge of each pair.
      capacity: the :class:`~jaxdd.neighbors.NeighborCapacity` (static).
      n_receivers: receiver rows (static; default all).
      order: for a half list, the two [n_atoms] int32 keys of
        :func:`~jaxdd.neighbors.build_neighbor_list`, or None.
      lengths: (reach, bin width, cutoff²) as arrays (default from ``cutoff``).
      receiving: [R] bool, receivers that search (default the atoms').
      bins: :func:`bin_atoms` of these inputs, when already made.
      row_start: first receiver row ([] int32, may be traced), or None.

    Returns:
      (mask [R, C] bool, aux): mask[i, t] True when candidate t is a neighbour of receiver i;
      aux the binning of :func:`bin_atoms` with ``sorted_pos`` and ``which`` [R, C] (each
      slot's atom in bin order and its neighbouring bin), ``image`` [R, n_off, 3] and
      ``total`` [R] (candidates each receiver needed).
    """
    table = capacity.table_size(positions.shape[0])
    if lengths is None:
        lengths = (*search_lengths(cutoff, capacity.bin_divisions, positions.dtype), cutoff * cutoff)
    g = bin_atoms(positions, cell, pbc, batch_idx, atom_mask, lengths[:2], table) if bins is None else bins
    n_all = g["n_atoms"]
    n = n_all if n_receivers is None else int(n_receivers)
    c = capacity.max_candidates
    receiving = _window(atom_mask, row_start, n) if receiving is None else receiving
    start, count, image = block_counts(g, pbc, receiving, capacity.search_range, table, n, row_start)
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
        mask = mask & (higher != (((ka[j] ^ ai) & 1) == 1))  # build_neighbor_list's rule
    elif half:
        i = jnp.arange(n, dtype=jnp.int32)[:, None] + (0 if row_start is None else row_start)
        j = g["order"][sorted_pos]
        shift = image.reshape(-1, 3)[flat_which] - g["wraps"][j] + _window(g["wraps"], row_start, n)[:, None, :]
        mask = mask & ((i < j) | ((i == j) & _lex_positive(shift)))
    aux = dict(g, sorted_pos=sorted_pos, which=which, image=image, total=total)
    return mask, aux
