"""Spatial partition: a 3-D block grid of ranks in each system's fractional coordinates.

Every system of a batch is cut by the same rank grid ``(Px, Py, Pz)``: rank ``(i, j, k)``
owns the atoms whose fractional coordinates fall in block ``(i, j, k)`` of their own cell.
Periodic axes span ``[0, 1)`` (atoms are wrapped there); open axes span the atoms' own
extent, measured along unit vectors orthogonal to the periodic lattice vectors (the same
"effective cell" the neighbour search uses), so slabs, wires and clusters need no cell.
The assignment is deterministic: the same positions always give the same owners.

Host-side (numpy): a partition is computed once per plan, not traced.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ..neighbors import effective_cell
from ..periodic import wrap_fractional

__all__ = ["Partition", "choose_grid", "partition", "rank_coords", "rank_of"]


def rank_coords(rank: int | np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """Grid coordinates ``[..., 3]`` of flat rank(s) (row-major, like the device mesh)."""
    return np.stack(np.unravel_index(np.asarray(rank), grid), axis=-1)


def rank_of(coords: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
    """Flat rank of grid coordinates ``[..., 3]``."""
    coords = np.asarray(coords)
    return np.ravel_multi_index((coords[..., 0], coords[..., 1], coords[..., 2]), grid)


def choose_grid(n_ranks: int, lengths: np.ndarray) -> tuple[int, int, int]:
    """The factorisation ``Px * Py * Pz == n_ranks`` with the smallest halo surface.

    lengths: [3] extent of the system along each axis (Å, perpendicular to the other two).
    Surface of a block: dx*dy + dy*dz + dz*dx with d = length / P. Ties go to the first
    grid in lexicographic order, so the choice is deterministic.
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
    pbc: [S, 3] bool. system: [V] system of each atom.
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

    @property
    def n_ranks(self) -> int:
        return int(np.prod(self.grid))

    def bounds(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """Block of ``rank`` in every system: (lo, hi) each [S, 3], in the partition frame."""
        c = rank_coords(rank, self.grid)
        width = (self.hi - self.lo) / np.asarray(self.grid)
        return self.lo + c * width, self.lo + (c + 1) * width

    def counts(self) -> np.ndarray:
        """Owned atoms per rank, [P]."""
        return np.bincount(self.owner[self.owner >= 0], minlength=self.n_ranks)


def partition(positions, cell, pbc, batch_idx, atom_mask, n_ranks: int, grid=None) -> Partition:
    """Assign each real atom to a rank of a ``grid`` (chosen by :func:`choose_grid` if None).

    positions: [V, 3] Å; cell: [S, 3, 3]; pbc: [S, 3]; batch_idx: [V]; atom_mask: [V].
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

    width = (hi - lo) / np.asarray(grid)
    # Block b owns [lo + b·w, lo + (b+1)·w): a boundary belongs to the block above it, as
    # floor() says; the clip keeps f == 1 - ulp (rounding of the division) and the open
    # axes' topmost atom in the last block. The device rebuild (replan.py) computes the same.
    block = np.floor((frac - lo[system]) / width[system]).astype(np.int64)
    block = np.clip(block, 0, np.asarray(grid) - 1)
    owner = np.where(atom_mask, rank_of(block, grid), -1)
    return Partition(
        grid=grid,
        owner=owner,
        frac=frac,
        wraps=wraps.astype(np.int64),
        lo=lo,
        hi=hi,
        spacing=spacing,
        pbc=pbc,
        system=system,
    )


def grids_of(n_ranks: int):
    """All rank grids with ``n_ranks`` ranks."""
    for px, py in itertools.product(range(1, n_ranks + 1), repeat=2):
        if n_ranks % (px * py) == 0:
            yield (px, py, n_ranks // (px * py))
