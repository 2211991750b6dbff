"""The types of a neighbour list: its layout, its static capacity, the sizes a build needed,
and the list itself.

:class:`NeighborCapacity` is hashable and part of every jit cache key; capacities come in
buckets (:func:`capacity_bucket`) so that systems of nearby sizes share one compiled program.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..data.checks import integral, integral_triple
from .capacity import DEFAULT_GROWTH_FACTOR, grow

__all__ = ["NeighborListFormat", "NeighborCapacity", "NeighborStats", "NeighborList", "capacity_bucket", "BUCKET_MIN",
           "NEIGHBOR_BACKENDS"]

#: Backends of a rank's neighbour list: ``"kernel"`` (the compiled cell list of
#: :mod:`jaxdd.ffi.neighbors`), ``"jnp"`` (the bin search of
#: :func:`~jaxdd.neighbors.build_neighbor_list`), or ``"auto"`` (the kernel where it runs).
NEIGHBOR_BACKENDS = ("auto", "kernel", "jnp")


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
    max_bonds: bond slots per atom (the width B of :class:`~jaxdd.neighbors.BondList`; read
        only by a build with a bond cutoff).
    """

    max_edges: int
    max_neighbors: int
    max_candidates: int
    search_range: tuple[int, int, int]
    bin_divisions: int = 2
    max_bins: int | None = None
    max_bonds: int = 1

    def __post_init__(self):
        # Stored as ints (hashable, part of the jit cache key); a fraction is refused, never truncated.
        for name in ("max_edges", "max_neighbors", "max_candidates", "bin_divisions", "max_bins", "max_bonds"):
            if name != "max_bins" or self.max_bins is not None:
                object.__setattr__(self, name, integral(f"NeighborCapacity.{name}", getattr(self, name), minimum=1))
        object.__setattr__(self, "search_range",
                           integral_triple("NeighborCapacity.search_range", self.search_range, minimum=1))

    def grown(self, needed: "NeighborStats", factor: float = DEFAULT_GROWTH_FACTOR) -> "NeighborCapacity":
        """A capacity that fits ``needed``: each slot count that is too small grown by
        :func:`jaxdd.neighbors.capacity.grow` (never smaller than self).

        Args:
          needed: the sizes a build needed (:meth:`NeighborList.stats`).
          factor: growth factor (>= 1) of a slot count that was too small.

        Returns:
          The grown capacity (bin divisions unchanged).
        """
        return NeighborCapacity(
            max_edges=grow(self.max_edges, needed.edges, factor),
            max_neighbors=grow(self.max_neighbors, needed.neighbors, factor),
            max_candidates=grow(self.max_candidates, needed.candidates, factor),
            search_range=tuple(max(a, int(b)) for a, b in zip(self.search_range, needed.search_range)),
            bin_divisions=self.bin_divisions,
            max_bins=None if self.max_bins is None else grow(self.max_bins, needed.bins, factor),
            max_bonds=grow(self.max_bonds, needed.bonds, factor),
        )

    @staticmethod
    def covering(caps, min_neighbors: int = 1) -> "NeighborCapacity":
        """The smallest capacity that fits each of ``caps`` (e.g. every rank's).

        Args:
          caps: capacities (an iterable of :class:`NeighborCapacity`, at least one).
          min_neighbors: neighbour slots it has at least.

        Returns:
          The elementwise largest slots and search range (default bin divisions and table).
        """
        caps = list(caps)
        return NeighborCapacity(
            max_edges=max(c.max_edges for c in caps),
            max_neighbors=max([c.max_neighbors for c in caps] + [min_neighbors]),
            max_candidates=max(c.max_candidates for c in caps),
            search_range=tuple(max(c.search_range[a] for c in caps) for a in range(3)),
            max_bonds=max(c.max_bonds for c in caps),
        )

    def bucketed(self) -> "NeighborCapacity":
        """This capacity with its edge, neighbour, candidate and bond slots rounded up to
        :func:`capacity_bucket` (search range, bin divisions and bin table unchanged)."""
        # Bond slots from 1: a list without bonds keeps its single slot, and a few bonds per
        # atom are not padded to 8 (the triplet arrays grow as their square).
        return dataclasses.replace(self, max_edges=capacity_bucket(self.max_edges),
                                   max_neighbors=capacity_bucket(self.max_neighbors),
                                   max_candidates=capacity_bucket(self.max_candidates),
                                   max_bonds=capacity_bucket(self.max_bonds, minimum=1))

    def table_size(self, n_atoms: int) -> int:
        """Bins in the table for ``n_atoms`` atom rows."""
        return int(self.max_bins) if self.max_bins is not None else max(4096, 2 * int(n_atoms))

    def fits(self, needed: "NeighborStats") -> bool:
        """Whether a build that needed ``needed`` (:class:`NeighborStats`) fits in this
        capacity: edges, neighbours, candidates, bonds and search range (the bin table is not checked)."""
        return (
            needed.edges <= self.max_edges
            and needed.bonds <= self.max_bonds
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

    Args:
      n: the capacity asked for.
      minimum: the smallest bucket.
    """
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # smallest power of two >= n
    return 3 * p // 4 if p >= 4 and 3 * p // 4 >= n else p


@dataclasses.dataclass(frozen=True)
class NeighborStats:
    """Sizes a build needed, read back on the host (plain ints).

    edges: COO edges. neighbors: most neighbours of one atom. candidates: most candidates
    one atom examined. search_range: bins scanned on each side, per cell axis. bins: bins of
    the table in use. bonds: most bonds of one atom (0 for a list without bonds).
    """

    edges: int
    neighbors: int
    candidates: int
    search_range: tuple[int, int, int]
    bins: int
    bonds: int = 0


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
    displacement: [max_edges, 3] Å added to every edge vector by
        :func:`~jaxdd.neighbors.edge_vectors`, or None (the default). Zeros set there are what
        per-atom virials are differentiated by (:mod:`jaxdd.engine.virials`): the gradient of the
        energy with respect to them is dE/dr_e.
    zero_shifts: static; True when every shift is zero by construction (a rank's list under
        decomposition, :func:`~jaxdd.neighbors.local_neighbor_list`): kernels may then skip
        reading them.
    bonds: the :class:`~jaxdd.neighbors.BondList` of a build with a bond cutoff (MATRIX
        format), or None.
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
    bonds: Any = None

    def stats(self) -> NeighborStats:
        """Sizes this build needed, as host integers (blocks until the build is done)."""
        return NeighborStats(
            edges=int(self.n_edges),
            neighbors=int(jnp.max(self.num_neighbors, initial=0)),
            candidates=int(self.needed_candidates),
            search_range=tuple(int(r) for r in np.asarray(self.needed_range)),
            bins=int(self.needed_bins),
            bonds=0 if self.bonds is None else int(jnp.max(self.bonds.count, initial=0)),
        )

