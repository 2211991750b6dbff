"""The halo guardrail: how large each rank's share is before its program compiles.

A deep halo (several message-passing layers of ghosts) or blocks thinner than the ghost
width can give every rank many times more ghost rows than atoms it owns; the program then
needs far more memory than the system suggests, and fails late. :func:`halo_size` counts the
busiest rank's rows and edges and a lower bound of its memory (the rows and the neighbour
list alone, before any model feature); :func:`check_halo` warns when ghosts exceed
:data:`GHOST_RATIO` times the owned atoms and refuses when the lower bound exceeds the
memory limit.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

__all__ = ["GHOST_RATIO", "HaloSize", "HaloSizeWarning", "halo_size", "check_halo", "device_memory"]

#: Ghost rows per owned atom above which the engine warns.
GHOST_RATIO = 10.0


class HaloSizeWarning(RuntimeWarning):
    """A rank holds many more ghost rows than atoms it owns."""


@dataclasses.dataclass(frozen=True)
class HaloSize:
    """Each rank's share, summed up: ``owned`` atoms and ``ghosts`` rows of the rank with the
    most ghosts per owned atom; ``rows``, neighbour-list ``edges`` and at least ``min_bytes``
    of memory (its rows and neighbour list, no model features) of the rank with the most rows."""

    owned: int
    ghosts: int
    rows: int
    edges: int
    min_bytes: int

    def describe(self) -> str:
        """One line for messages: the ghosts per owned atom, and the busiest rank's rows, edges and memory."""
        return (f"{self.ghosts} ghost rows for {self.owned} owned atoms ({self.ghosts / max(self.owned, 1):.1f}x) on "
                f"one rank; {self.rows} rows, {self.edges} neighbour-list edges and at least "
                f"{self.min_bytes / 2**20:.1f} MiB on the busiest")


def halo_size(owned, ghosts, edges: int, itemsize: int) -> HaloSize:
    """The share of the rank with the most rows.

    Args:
      owned, ghosts: [P] atoms each rank owns and ghost rows it holds.
      edges: neighbour-list edge slots of every rank.
      itemsize: bytes of one float of the positions' dtype.
    """
    owned, ghosts = np.asarray(owned, np.int64), np.asarray(ghosts, np.int64)
    worst = int(np.argmax(ghosts / np.maximum(owned, 1)))
    rows = int(np.max(owned + ghosts))
    # A row: positions, their gradient, ids, system, mask; an edge: two indices, an image
    # shift, a mask, the edge vector and its gradient.
    row_bytes, edge_bytes = 6 * itemsize + 12, 6 * itemsize + 21
    return HaloSize(int(owned[worst]), int(ghosts[worst]), rows, int(edges), rows * row_bytes + int(edges) * edge_bytes)


def device_memory(device) -> int | None:
    """Bytes a device can hold (``memory_stats()['bytes_limit']``), or None where it does not say (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # not every backend implements it
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def check_halo(size: HaloSize, memory_limit: int | None, *, grid, ghost_width: float, warn: bool = True,
               stacklevel: int = 3) -> None:
    """Refuse a share whose lower bound of memory exceeds ``memory_limit`` (bytes; None: no
    limit); with ``warn``, warn when ghosts exceed :data:`GHOST_RATIO` times the owned atoms.

    Args:
      size: the busiest rank's share (:func:`halo_size`).
      memory_limit: bytes one device can hold, or None (no limit).
      grid: the rank grid (Px, Py, Pz), for the messages.
      ghost_width: the halo's width (Å), for the messages.
      warn: warn on a ghost-heavy share (a ValueError is raised either way).
      stacklevel: of the warning, to point at the caller's call.

    Raises:
      ValueError: the share needs more than ``memory_limit``.
    """
    advice = ("use fewer ranks or a larger system, a thinner halo (halo_layers, ghost_width), or "
              "HaloStoragePolicy(scatter_mode='halo_correction') instead of a deep halo")
    if memory_limit is not None and size.min_bytes > memory_limit:
        raise ValueError(f"the halo of grid {tuple(grid)} (ghost width {ghost_width:.3g} Å) needs {size.describe()}, "
                         f"more than the memory limit of {memory_limit / 2**20:.1f} MiB; {advice}")
    if warn and size.ghosts > GHOST_RATIO * max(size.owned, 1):
        warnings.warn(f"the halo of grid {tuple(grid)} (ghost width {ghost_width:.3g} Å) holds {size.describe()}: "
                      f"most of each rank's work is on copies; {advice}", HaloSizeWarning, stacklevel=stacklevel)
