"""``PartitionHealth``: what the last partition gave each rank, and the per-rank counts it is made of."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..decomposition.halo import HaloPlan
from ..decomposition.partition import Partition, imbalance
from ..decomposition.ranks import agree_max

__all__ = ["PartitionHealth", "partition_health", "owned_and_ghosts", "covers_every_atom"]


@dataclasses.dataclass(frozen=True)
class PartitionHealth:
    """Per-rank summary of the last partition (host numbers).

    grid: rank grid. owned, ghost: [P] owned rows and ghost rows (periodic images counted
    each) per rank. remote: [P] atoms of which a rank holds no row at all. capacities: owned rows, ghost rows, neighbour-list edges.
    recompiles: compilations caused by capacity growth (halo or neighbour list) in the last call.
    devices: devices the ranks run on, of ``devices_present`` that JAX sees (fewer when the
    grid names fewer ranks than there are devices).
    """

    grid: tuple[int, int, int]
    owned: np.ndarray
    ghost: np.ndarray
    remote: np.ndarray
    owned_capacity: int
    ghost_capacity: int
    edge_capacity: int
    recompiles: int
    devices: int | None = None
    devices_present: int | None = None

    @property
    def imbalance(self) -> float:
        """Owned atoms of the busiest rank over the mean over ranks (1.0: balanced)."""
        return imbalance(self.owned)

    def __str__(self) -> str:
        rows = [f"grid {self.grid}: owned/ghost/remote atoms per rank (capacities {self.owned_capacity}/"
                f"{self.ghost_capacity} rows, {self.edge_capacity} edges); recompiles {self.recompiles}; "
                f"imbalance {self.imbalance:.3f} (busiest rank's owned atoms / mean)"]
        if self.devices is not None and self.devices_present is not None and self.devices < self.devices_present:
            rows.append(f"  runs on {self.devices} of the {self.devices_present} devices (the first {self.devices})")
        for r, (o, g, m) in enumerate(zip(self.owned, self.ghost, self.remote)):
            rows.append(f"  rank {r}: {o} / {g} / {m}")
        return "\n".join(rows)


def per_rank(plan: HaloPlan, values) -> np.ndarray:
    """Values of the plan's ranks as a [P] vector of every rank's (agreed over processes)."""
    if plan.ranks is None:
        return np.asarray(values)
    full = np.full(int(np.prod(plan.layout.grid)), np.iinfo(np.int64).min, np.int64)
    full[plan.rank_ids] = values
    return agree_max(full)


def owned_and_ghosts(plan: HaloPlan) -> tuple[np.ndarray, np.ndarray]:
    """Atoms every rank of ``plan`` owns and ghost rows it holds, [P] each (agreed over processes)."""
    return per_rank(plan, plan.owned_counts()), per_rank(plan, plan.ghost_counts())


def covers_every_atom(part: Partition, plan: HaloPlan) -> bool:
    """Whether some rank of several holds a row of every real atom (agreed over processes, so
    every process decides alike): decomposition gains nothing.

    Args:
      part: the partition (each atom's owner).
      plan: its halo plan (each rank's rows).
    """
    n_real = int((part.owner >= 0).sum())
    return part.n_ranks > 1 and n_real > 0 and bool(np.any(per_rank(plan, distinct_held(plan)) >= n_real))


def distinct_held(plan: HaloPlan) -> np.ndarray:
    """Atoms of which each rank holds a row, [P] (ghost rows count images, so may repeat)."""
    return np.array([np.unique(ids[ids >= 0]).size for ids in plan.local_ids])


def partition_health(part: Partition, plan: HaloPlan, *, edge_capacity: int, recompiles: int, devices: int,
                     devices_present: int) -> PartitionHealth:
    """The :class:`PartitionHealth` of ``part`` planned as ``plan``.

    Args:
      part, plan: the partition and its halo plan.
      edge_capacity: neighbour-list edge slots per rank. recompiles: compilations for
        capacity growth in the call. devices, devices_present: ranks run on, of those JAX sees.
    """
    n_real = int((part.owner >= 0).sum())
    owned, ghosts = owned_and_ghosts(plan)
    return PartitionHealth(grid=part.grid, owned=owned, ghost=ghosts, remote=n_real - per_rank(plan, distinct_held(plan)),
                           owned_capacity=plan.layout.n_owned, ghost_capacity=plan.layout.n_ghost,
                           edge_capacity=edge_capacity, recompiles=recompiles, devices=devices,
                           devices_present=devices_present)
