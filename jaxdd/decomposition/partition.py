"""Spatial partition: a 3-D block grid of ranks in each system's fractional coordinates.

Every system of a batch is cut by the same rank grid ``(Px, Py, Pz)``: rank ``(i, j, k)``
owns the atoms whose fractional coordinates fall in block ``(i, j, k)`` of their own cell.
Periodic axes span ``[0, 1)`` (atoms are wrapped there); open axes span the atoms' own
extent, measured along unit vectors orthogonal to the periodic lattice vectors (the same
"effective cell" the neighbour search uses), so slabs, wires and clusters need no cell.
The assignment is deterministic: the same positions always give the same owners.

Blocks are equal slices of that extent, or, balanced (:func:`balanced_cuts`), slices cut
where each holds an equal share of the atoms along each axis: cutting planes across the
whole system, as LAMMPS's ``balance shift``, so the blocks still form a grid and the halo
exchanges stay between grid neighbours. Cuts are relative positions in ``[0, 1]`` of each
axis's extent (``cuts [S, 3, max(grid) + 1]``), so they follow a cell that moves.

Host-side (numpy): a partition is computed once per plan, not traced.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ..neighbors import effective_cell
from ..data.periodic import wrap_fractional

__all__ = ["Partition", "balanced_cuts", "block_of", "choose_grid", "imbalance", "partition", "rank_coords",
           "rank_of", "uniform_cuts"]


def rank_coords(rank: int | np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """Grid coordinates ``[..., 3]`` of flat ``rank`` (an int or array of them) in ``grid``
    (row-major, like the device mesh)."""
    return np.stack(np.unravel_index(np.asarray(rank), grid), axis=-1)


def rank_of(coords: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """Flat rank of grid coordinates ``coords`` ``[..., 3]`` in ``grid`` (row-major)."""
    coords = np.asarray(coords)
    return np.ravel_multi_index((coords[..., 0], coords[..., 1], coords[..., 2]), grid)


def choose_grid(n_ranks: int, lengths: np.ndarray) -> tuple[int, int, int]:
    """The factorisation ``Px * Py * Pz == n_ranks`` with the smallest halo surface.

    Surface of a block: dx*dy + dy*dz + dz*dx with d = length / P. Ties go to the first
    grid in lexicographic order, so the choice is deterministic.

    Args:
      n_ranks: number of ranks.
      lengths: [3] extent of the system along each axis (Å, perpendicular to the other two).
    """
    lengths = np.maximum(np.asarray(lengths, float), 1e-12)
    best, best_cost = None, np.inf
    for grid in grids_of(n_ranks):  # lexicographic order
        d = lengths / np.asarray(grid)
        cost = d[0] * d[1] + d[1] * d[2] + d[2] * d[0]
        if cost < best_cost * (1 - 1e-12):
            best, best_cost = grid, cost
    return best


@dataclasses.dataclass(frozen=True)
class Partition:
    """Where every atom lives (host arrays).

    grid: rank grid (Px, Py, Pz). owner: [V] flat rank of each real atom (-1 for padding).
    frac: [V, 3] coordinates in the partition frame (periodic axes wrapped to [0, 1); open
    axes in Å along the effective cell's unit vectors). wraps: [V, 3] int lattice vectors
    removed by wrapping (position_wrapped = position - wraps @ cell).
    lo, hi: [S, 3] extent of each system's partitioned box in that frame.
    spacing: [S, 3] distance between lattice planes of the effective cell (Å per frame unit).
    pbc: [S, 3] bool. system: [V] system of each atom. cuts: [S, 3, max(grid) + 1] relative
    block boundaries along each axis (0 … 1 of ``hi - lo``; entries past ``grid[a]`` are 1),
    or None for equal slices.
    """

    grid: tuple[int, int, int]
    owner: np.ndarray
    frac: np.ndarray
    wraps: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    spacing: np.ndarray
    pbc: np.ndarray
    system: np.ndarray
    cuts: np.ndarray | None = None

    @property
    def n_ranks(self) -> int:
        """Number of ranks, ``Px * Py * Pz``."""
        return int(np.prod(self.grid))

    def bounds(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Block of ``rank`` in every system: (lo, hi) each [S, 3], in the partition frame."""
        c = rank_coords(rank, self.grid)
        if self.cuts is None:
            width = (self.hi - self.lo) / np.asarray(self.grid)
            return self.lo + c * width, self.lo + (c + 1) * width
        edges = block_edges(self.lo, self.hi, self.cuts)
        axes = np.arange(3)
        return edges[:, axes, c], edges[:, axes, c + 1]

    def thinnest(self) -> np.ndarray:
        """[S, 3] width of the thinnest block along each axis (frame units)."""
        if self.cuts is None:
            return (self.hi - self.lo) / np.asarray(self.grid)
        edges = block_edges(self.lo, self.hi, self.cuts)
        widths = np.diff(edges, axis=2)
        real = np.arange(widths.shape[2])[None, None, :] < np.asarray(self.grid)[None, :, None]
        return np.min(np.where(real, widths, np.inf), axis=2)

    def imbalance(self) -> float:
        """Owned atoms of the busiest rank over the mean (1.0: perfectly balanced)."""
        return imbalance(self.counts())

    def counts(self) -> np.ndarray:
        """Owned atoms per rank, [P]."""
        return np.bincount(self.owner[self.owner >= 0], minlength=self.n_ranks)


def partition(positions, cell, pbc, batch_idx, atom_mask, n_ranks: int, grid=None, cuts=None,
              balance: bool = False, weights=None) -> Partition:
    """Assign each real atom to a rank of a ``grid`` (chosen by :func:`choose_grid` if None).

    Args:
      positions: [V, 3] Å.
      cell: [S, 3, 3] Å.
      pbc: [S, 3] bool.
      batch_idx: [V] system of each atom.
      atom_mask: [V] real atoms.
      n_ranks: number of ranks.
      grid: rank grid (Px, Py, Pz); None: :func:`choose_grid` of the system with the most atoms.
      cuts: [S, 3, max(grid) + 1] (or [3, max(grid) + 1] for every system) relative block
        boundaries; None: equal slices.
      balance: cut each axis where the blocks hold equal shares of the atoms
        (:func:`balanced_cuts`; ``cuts`` must then be None), or of ``weights``.
      weights: [V] a cost per atom (e.g. its neighbour count), for ``balance``.
    """
    positions = np.asarray(positions, np.float64)
    cell = np.asarray(cell, np.float64).reshape(-1, 3, 3)
    pbc = np.asarray(pbc, bool).reshape(-1, 3)
    batch_idx = np.asarray(batch_idx)
    atom_mask = np.asarray(atom_mask, bool)
    n_sys = cell.shape[0]
    system = np.clip(batch_idx, 0, n_sys - 1)

    ceff = np.asarray(effective_cell(cell, pbc), np.float64)
    # Periodic rows exactly as given (JAX may have computed in float32 without x64).
    ceff = np.where(pbc[:, :, None], cell, ceff)
    inv = np.linalg.inv(ceff)
    spacing = 1.0 / np.linalg.norm(inv, axis=1)  # [S, 3]
    frac = np.einsum("vi,vij->vj", positions, inv[system])
    periodic = pbc[system]
    frac, wraps = wrap_fractional(frac, periodic)

    lo = np.zeros((n_sys, 3))
    hi = np.ones((n_sys, 3))
    for s in range(n_sys):
        sel = atom_mask & (system == s)
        if sel.any():
            fmin, fmax = frac[sel].min(axis=0), frac[sel].max(axis=0)
            # A sliver of room above the topmost atom keeps it inside the last block.
            pad = np.maximum(1e-9 * np.maximum(np.abs(fmax), 1.0), 1e-9)
            lo[s] = np.where(pbc[s], 0.0, fmin)
            hi[s] = np.where(pbc[s], 1.0, fmax + pad)

    if grid is None:
        sizes = np.bincount(system[atom_mask], minlength=n_sys)
        main = int(np.argmax(sizes)) if sizes.size else 0
        grid = choose_grid(n_ranks, (hi[main] - lo[main]) * spacing[main])
    grid = tuple(int(g) for g in grid)

    if balance:
        if cuts is not None:
            raise ValueError("partition: pass cuts or balance=True, not both")
        cuts = balanced_cuts(frac, lo, hi, system, atom_mask, grid, weights)
    elif cuts is not None:
        cuts = _checked_cuts(cuts, n_sys, grid)
    block = block_of(frac, lo, hi, system, grid, cuts)
    owner = np.where(atom_mask, rank_of(block, grid), -1)
    return Partition(grid=grid, owner=owner, frac=frac, wraps=wraps.astype(np.int64), lo=lo, hi=hi, spacing=spacing,
                     pbc=pbc, system=system, cuts=cuts)


def imbalance(owned) -> float:
    """The busiest rank's owned atoms over the mean over ranks, of counts ``owned`` [P]
    (1.0: balanced, or no atoms)."""
    owned = np.asarray(owned, np.float64)
    return float(owned.max() / owned.mean()) if owned.sum() > 0 else 1.0


def block_edges(lo, hi, cuts):
    """Absolute block boundaries [S, 3, G + 1] in the partition frame from relative ``cuts``
    (the same arithmetic on the host and in the device rebuild, so both place an atom on a
    boundary in the same block)."""
    return lo[..., None] + cuts * (hi - lo)[..., None]


def block_of(frac, lo, hi, system, grid, cuts=None) -> np.ndarray:
    """Block coordinates [V, 3] of frame coordinates ``frac`` [V, 3].

    Equal slices: block b owns [lo + b·w, lo + (b+1)·w); a boundary belongs to the block
    above it, as floor() says; the clip keeps f == 1 - ulp (rounding of the division) and
    the open axes' topmost atom in the last block. With ``cuts``, block b owns
    [edge_b, edge_{b+1}), the same rule. The device rebuild (replan.py) computes the same.

    Args:
      frac: [V, 3] coordinates in the partition frame.
      lo, hi: [S, 3] extent of each system's partitioned box in that frame.
      system: [V] system of each atom.
      grid: rank grid (Px, Py, Pz).
      cuts: [S, 3, max(grid) + 1] relative block boundaries; None: equal slices.
    """
    grid_a = np.asarray(grid)
    if cuts is None:
        width = (hi - lo) / grid_a
        block = np.floor((frac - lo[system]) / width[system]).astype(np.int64)
    else:
        edges = block_edges(lo, hi, cuts)[system]  # [V, 3, G + 1]
        interior = np.arange(edges.shape[2])[None, None, :]
        interior = (interior >= 1) & (interior < grid_a[None, :, None])
        block = np.sum(interior & (frac[:, :, None] >= edges), axis=2).astype(np.int64)
    return np.clip(block, 0, grid_a - 1)


def uniform_cuts(n_systems: int, grid) -> np.ndarray:
    """Equal slices as relative cuts [S, 3, max(grid) + 1], for ``n_systems`` systems and rank ``grid``."""
    g = max(grid)
    cuts = np.ones((n_systems, 3, g + 1))
    for a, n in enumerate(grid):
        cuts[:, a, :n + 1] = np.arange(n + 1) / n
    return cuts


def balanced_cuts(frac, lo, hi, system, atom_mask, grid, weights=None) -> np.ndarray:
    """Relative cuts [S, 3, max(grid) + 1] that give the blocks along each axis equal shares
    of each system's atoms (or of ``weights`` [V], a cost per atom).

    Each cut lies halfway between two neighbouring distinct coordinates, where the share
    below it is nearest to k / G_a, so no atom sits on it and a lattice plane stays in one
    block; an axis whose atoms share one coordinate (or a system without atoms) keeps equal
    slices.

    Args:
      frac: [V, 3] coordinates in the partition frame.
      lo, hi: [S, 3] extent of each system's partitioned box in that frame.
      system: [V] system of each atom.
      atom_mask: [V] real atoms.
      grid: rank grid (Px, Py, Pz).
      weights: [V] a cost per atom; None: every atom counts one.
    """
    frac = np.asarray(frac, np.float64)
    n_sys = lo.shape[0]
    cuts = uniform_cuts(n_sys, grid)
    w_all = np.ones(len(frac)) if weights is None else np.asarray(weights, np.float64)
    for s in range(n_sys):
        sel = np.asarray(atom_mask, bool) & (system == s)
        if not sel.any():
            continue
        for a, n in enumerate(grid):
            if n == 1:
                continue
            span = max(hi[s, a] - lo[s, a], 1e-300)
            rel = (frac[sel, a] - lo[s, a]) / span
            # Candidate cuts lie halfway between neighbouring distinct coordinates (a plane of
            # atoms stays whole in one block); each takes the one whose share below is nearest
            # to k / G.
            values, inverse = np.unique(rel, return_inverse=True)
            if len(values) < 2:
                continue
            mass = np.bincount(inverse, weights=w_all[sel], minlength=len(values))
            below = np.cumsum(mass)[:-1] / max(mass.sum(), 1e-300)  # share under each candidate
            candidates = 0.5 * (values[:-1] + values[1:])
            # ``below`` rises, so the nearest candidate to a rising k / G never moves back: the
            # cuts rise, strictly inside (0, 1).
            for k in range(1, n):
                cuts[s, a, k] = candidates[int(np.argmin(np.abs(below - k / n)))]
    return cuts


def _checked_cuts(cuts, n_sys: int, grid) -> np.ndarray:
    cuts = np.asarray(cuts, np.float64)
    g = max(grid)
    if cuts.ndim == 2:
        cuts = np.broadcast_to(cuts, (n_sys,) + cuts.shape).copy()
    if cuts.shape != (n_sys, 3, g + 1):
        raise ValueError(f"cuts must have shape [{n_sys}, 3, {g + 1}] (systems, axes, max(grid) + 1) for grid {grid}, "
                         f"got {list(cuts.shape)}")
    for a, n in enumerate(grid):
        c = cuts[:, a, :n + 1]
        if not (np.all(np.isfinite(c)) and np.all(c[:, 0] == 0) and np.all(c[:, -1] == 1) and np.all(np.diff(c) >= 0)):
            raise ValueError(f"cuts along axis {a} must rise from 0 to 1 over grid[{a}] + 1 = {n + 1} entries, got "
                             f"{c.tolist()}")
    return cuts


def grids_of(n_ranks: int):
    """All rank grids with ``n_ranks`` ranks."""
    for px, py in itertools.product(range(1, n_ranks + 1), repeat=2):
        if n_ranks % (px * py) == 0:
            yield (px, py, n_ranks // (px * py))
