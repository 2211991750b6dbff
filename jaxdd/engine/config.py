"""``DomainConfig``: how a system is cut into spatial domains, and the default device mesh."""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ..data.checks import integral
from ..decomposition.graph_partition import STRATEGIES
from ..neighbors import NEIGHBOR_BACKENDS

__all__ = ["DomainConfig", "default_mesh"]


def default_mesh(devices=None) -> Mesh:
    """A 1-D mesh named ``"dd"`` over ``devices`` (default: all devices)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), ("dd",), axis_types=(AxisType.Auto,))


def _mesh_for(grid) -> Mesh:
    """The default mesh: every device, or the first prod(grid) of them for a grid that names
    fewer ranks (one process only: with several, each must hold devices of the mesh)."""
    devices = jax.devices()
    if grid is None or math.prod(grid) == len(devices):
        return default_mesh(devices)
    n = math.prod(grid)
    if n > len(devices):
        raise ValueError(f"DomainConfig.grid {grid} has {n} ranks but there are only {len(devices)} devices; "
                         "choose a grid whose product is at most the device count (or grid=None)")
    if jax.process_count() > 1:
        raise ValueError(f"DomainConfig.grid {grid} has {n} ranks but the {jax.process_count()} processes hold "
                         f"{len(devices)} devices; with several processes the grid must use every device "
                         "(or pass mesh=default_mesh(devices) naming them)")
    return default_mesh(devices[:n])


def _positive(name, value, *, allow_zero=False):
    ok = isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool)
    ok = ok and math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ValueError(f"DomainConfig.{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(value)


def _kernel_neighbors_possible(mesh: Mesh) -> bool:
    """True when the compiled cell list can run on every device of ``mesh``: all CPUs with
    the CPU kernels built, or all CUDA GPUs with the CUDA kernels built too."""
    from .. import ffi

    platforms = {d.platform for d in mesh.devices.flat}
    if platforms == {"cpu"}:
        return ffi.available()
    return platforms <= {"gpu", "cuda"} and ffi.cuda_available()


@dataclasses.dataclass(frozen=True)
class DomainConfig:
    """How a system is cut into spatial domains.

    cutoff: interaction range of the model (Å). mesh: the device mesh (default: all
    devices, 1-D, or the first Px·Py·Pz of them when ``grid`` names fewer ranks); any mesh
    shape works, ranks are its devices in row-major order. skin: extra neighbour range (Å).
    ghost_width: ghost shell width (Å, default cutoff + skin; never below the cutoff).
    grid: rank grid (Px, Py, Pz) whose product is the mesh's device count (default: the one
    with the least halo surface). strategy: ``"halo"`` (spatial
    domains with a ghost shell) or ``"graph_partition"`` (contiguous node blocks, node
    features all-gathered per layer; see :mod:`jaxdd.decomposition.graph_partition`); None (default):
    graph_partition when the spec's policy is :class:`~jaxdd.ops.GraphParallelPolicy`, else halo.
    capacity_factor: headroom of the static capacities (>= 1; None, the default: the spec's
    ``CompilePolicy.capacity_factor``, else 1.2; see :mod:`jaxdd.neighbors.capacity`). migration_hysteresis: how far
    an atom may leave its block before it migrates (default skin / 2; used by dynamics).
    require_nondegenerate: raise instead of warning when the ghost shell covers every atom.
    neighbor_backend: how each rank searches its rows for neighbours: ``"kernel"`` (the
    compiled cell list of :mod:`jaxdd.ffi.neighbors`; CPU devices, or CUDA GPUs when the
    CUDA kernels were built), ``"jnp"`` (the jit-compiled bin search, any device) or
    ``"auto"`` (default: the kernel where it can run, else jnp). Both give the same pairs.
    A full list (not deep) under ``"auto"`` or ``"jnp"`` has the ranks search the periodic
    images along the axes the grid leaves whole with the jnp search and no ghost images there
    (:meth:`DistributedModel.search_pbc`); ``"kernel"`` keeps explicit images on every axis.
    memory_limit: bytes one rank may use (None, the default: what its device reports, none
    on CPU); a halo whose rows and neighbour list alone need more is refused before
    compiling (:mod:`jaxdd.decomposition.guardrail`).
    allow_unfollowed: run a model whose values the dispatch could not follow (it had to guess a
    layout by shape, or leave an operation over atoms rank-local). By default that is a
    :class:`~jaxdd.DispatchError` naming each place, since the result may be wrong; True is for
    experts who checked the result with ``jaxdd.validate``: the places are then listed in
    ``dispatch_report.fallbacks`` and a :class:`~jaxdd.DispatchWarning`. A deep-halo spec
    (``scatter_mode="local"``) declares every rank computes its ghost rows itself, which allows
    them too.
    balance: where the blocks are cut: None (default: equal slices of the cell, or of the
    atoms' extent on open axes), ``"static"`` (planes placed so the blocks along each axis
    hold equal shares of the atoms, as LAMMPS's ``balance shift``; at every partition, and
    kept through a run of dynamics), ``"dynamic"`` (dynamics places them again every
    ``balance_every`` steps as the atoms move). The halo strategy only. balance_every: steps
    between rebalancing under ``"dynamic"`` (default 500; refused with another ``balance``,
    where it would do nothing). balance_by: what the blocks share
    equally: ``"atoms"`` (default) or ``"pairs"`` (each atom weighted by 1 + its neighbour
    count, measured on the devices from the neighbour lists; dynamics only, where those
    lists exist: a DistributedModel call balances atoms; ``"pairs"`` without ``balance`` is
    refused).
    """

    cutoff: float
    mesh: Mesh | None = None
    skin: float = 0.0
    ghost_width: float | None = None
    grid: tuple[int, int, int] | None = None
    strategy: str | None = None
    capacity_factor: float | None = None
    migration_hysteresis: float | None = None
    require_nondegenerate: bool = False
    neighbor_backend: str = "auto"
    memory_limit: int | None = None
    allow_unfollowed: bool = False
    balance: str | None = None
    balance_every: int | None = None
    balance_by: str = "atoms"

    def __post_init__(self):
        cutoff = _positive("cutoff", self.cutoff)
        skin = _positive("skin", self.skin, allow_zero=True)
        ghost = cutoff + skin if self.ghost_width is None else _positive("ghost_width", self.ghost_width)
        if ghost < cutoff:
            raise ValueError(
                f"DomainConfig.ghost_width = {ghost} is below the cutoff {cutoff}: ghosts would miss neighbours; "
                "use a ghost width >= cutoff + skin"
            )
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"DomainConfig.strategy must be one of {list(STRATEGIES)} or None, got {self.strategy!r}")
        if self.neighbor_backend not in NEIGHBOR_BACKENDS:
            raise ValueError(f"DomainConfig.neighbor_backend must be one of {list(NEIGHBOR_BACKENDS)}, "
                             f"got {self.neighbor_backend!r}")
        if self.memory_limit is not None:
            object.__setattr__(self, "memory_limit", integral("DomainConfig.memory_limit", self.memory_limit, minimum=1))
        factor = None if self.capacity_factor is None else _positive("capacity_factor", self.capacity_factor)
        if factor is not None and factor < 1:
            raise ValueError(f"DomainConfig.capacity_factor must be >= 1, got {factor}")
        hyst = skin / 2 if self.migration_hysteresis is None else _positive(
            "migration_hysteresis", self.migration_hysteresis, allow_zero=True)
        if skin > 0 and hyst >= skin:
            raise ValueError(f"DomainConfig.migration_hysteresis = {hyst} must be below the skin {skin}")
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ValueError(f"DomainConfig.mesh must be a jax.sharding.Mesh or None, got {self.mesh!r}")
        grid = None
        if self.grid is not None:
            try:
                grid = tuple(self.grid)
            except TypeError:
                grid = ()
            if len(grid) != 3:
                raise ValueError(f"DomainConfig.grid must be 3 positive integers, got {self.grid!r}")
            grid = tuple(integral(f"DomainConfig.grid[{a}] (of grid={self.grid!r})", g, minimum=1)
                         for a, g in enumerate(grid))
        mesh = self.mesh if self.mesh is not None else _mesh_for(grid)
        if grid is not None:
            if math.prod(grid) != mesh.size:
                raise ValueError(
                    f"DomainConfig.grid {grid} has {math.prod(grid)} ranks but the mesh has {mesh.size} devices; "
                    "choose a grid whose product is the mesh's device count, or leave mesh=None: the first "
                    "Px*Py*Pz devices are then used"
                )
            object.__setattr__(self, "grid", grid)
        object.__setattr__(self, "cutoff", cutoff)
        object.__setattr__(self, "skin", skin)
        object.__setattr__(self, "ghost_width", ghost)
        object.__setattr__(self, "capacity_factor", factor)
        object.__setattr__(self, "migration_hysteresis", hyst)
        object.__setattr__(self, "mesh", mesh)
        if self.balance not in (None, "static", "dynamic"):
            raise ValueError(f"DomainConfig.balance must be None, 'static' or 'dynamic', got {self.balance!r}")
        if self.balance is not None and self.strategy == "graph_partition":
            raise ValueError("DomainConfig.balance places spatial blocks; strategy='graph_partition' has node blocks "
                             "of equal size already: leave balance=None")
        if self.balance_every is not None and self.balance != "dynamic":
            raise ValueError(f"DomainConfig.balance_every={self.balance_every!r} sets how often balance='dynamic' "
                             f"places the blocks again, but balance={self.balance!r}: pass balance='dynamic' too, "
                             "or leave balance_every out")
        every = 500 if self.balance_every is None and self.balance == "dynamic" else self.balance_every
        if every is not None:
            every = integral("DomainConfig.balance_every", every, minimum=1)
        object.__setattr__(self, "balance_every", every)
        if self.balance_by not in ("atoms", "pairs"):
            raise ValueError(f"DomainConfig.balance_by must be 'atoms' or 'pairs', got {self.balance_by!r}")
        if self.balance_by != "atoms" and self.balance is None:
            raise ValueError(f"DomainConfig.balance_by={self.balance_by!r} says what balanced blocks share, but "
                             "balance=None places none: pass balance='static' or 'dynamic' too")
        if self.neighbor_backend == "kernel" and not _kernel_neighbors_possible(mesh):
            raise ValueError(
                "DomainConfig.neighbor_backend='kernel' needs jaxdd's compiled kernels for the mesh's devices: "
                "CPU devices with the CPU kernels (pip install -e . builds them) or CUDA GPUs with the CUDA "
                "kernels too (built at install time when nvcc is found; see docs/gpu.md); use 'auto' or 'jnp'")

    @property
    def neighbor_search(self) -> str:
        """The resolved neighbour backend: ``"kernel"`` or ``"jnp"``."""
        if self.neighbor_backend != "auto":
            return self.neighbor_backend
        return "kernel" if _kernel_neighbors_possible(self.mesh) else "jnp"

    @property
    def n_ranks(self) -> int:
        """Number of ranks P: the devices of the mesh."""
        return int(self.mesh.size)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The mesh's axis names, the ranks' axes in ``shard_map`` and the collectives."""
        return tuple(self.mesh.axis_names)
