"""Storage policies: how per-atom arrays live on each rank.

Immutable and hashable, so specs holding them can be static arguments of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..data.checks import integral
from .errors import SpecError, check_choice
from .tagged import Tagged

__all__ = ["StoragePolicy", "HaloStoragePolicy", "HaloRefreshPolicy", "GraphParallelPolicy", "POLICIES"]


@dataclasses.dataclass(frozen=True)
class StoragePolicy(Tagged):
    """How per-atom arrays are stored across ranks; written to JSON as its ``kind`` and its fields."""

    tag_key: ClassVar[str] = "kind"
    kind: ClassVar[str] = ""


@dataclasses.dataclass(frozen=True)
class HaloStoragePolicy(StoragePolicy):
    """``[owned | halo]`` rows on every rank (spatial domains with a ghost shell).

    scatter_mode: what a scatter-add into a per-atom array does.
        ``"halo_correction"`` (default): ghost partial sums are sent home and owners'
        totals copied back out (reverse then forward exchange); right for models whose
        scatters follow the framework's edge list (MPNNs).
        ``"local"``: nothing; the ghost shell is deep enough that each rank's own rows are
        already right (backbones that build their own full graph inside the block).
    gather_mode: how per-atom values are read for neighbours.
        ``"halo_read"`` (default): ghost rows are kept equal to their owners' rows.
        ``"local"``: ghost rows are whatever the rank computed itself.
    halo_layers: message-passing layers the ghost shell must cover. With
        ``scatter_mode="local"`` the shell is ``halo_layers`` × (cutoff + skin) deep and every
        local atom, ghosts included, receives edges, so owned rows come out exact after that
        many layers. Ignored by ``halo_correction`` (one cutoff always suffices there).
    """

    scatter_mode: str = "halo_correction"
    gather_mode: str = "halo_read"
    halo_layers: int = 1
    kind: ClassVar[str] = "halo"

    def __post_init__(self):
        check_choice("HaloStoragePolicy", "scatter_mode", self.scatter_mode, ("halo_correction", "local"))
        check_choice("HaloStoragePolicy", "gather_mode", self.gather_mode, ("halo_read", "local"))
        object.__setattr__(self, "halo_layers",
                           integral("HaloStoragePolicy.halo_layers", self.halo_layers, minimum=1, error=SpecError))

    @property
    def deep(self) -> bool:
        """True when ranks compute ghost rows themselves (no scatter exchange)."""
        return self.scatter_mode == "local"

    def to_dict(self) -> dict:
        d = super().to_dict()
        if self.halo_layers == 1:  # files of single-layer specs stay in the common schema
            del d["halo_layers"]
        return d


@dataclasses.dataclass(frozen=True)
class HaloRefreshPolicy(StoragePolicy):
    """Halo storage whose only exchange is the forward refresh of ghost rows.

    Scatters fold nothing back (a no-op); ghosts are re-read from their owners before use.
    For backbones that build their own graph and never scatter onto ghost rows.
    """

    kind: ClassVar[str] = "halo_refresh"


@dataclasses.dataclass(frozen=True)
class GraphParallelPolicy(StoragePolicy):
    """Contiguous node blocks per rank, no spatial halo; node features all-gathered per layer."""

    kind: ClassVar[str] = "graph_parallel"


#: JSON ``kind`` → policy class.
POLICIES: dict[str, type[StoragePolicy]] = {
    cls.kind: cls for cls in (HaloStoragePolicy, HaloRefreshPolicy, GraphParallelPolicy)
}
