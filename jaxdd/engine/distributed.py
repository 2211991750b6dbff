"""Domain decomposition: ``DomainConfig`` and ``DistributedModel``.

``DistributedModel(model, DomainConfig(cutoff))`` runs a single-device wrapper over a device
mesh: the host partitions the batch into spatial blocks (:mod:`jaxdd.decomposition.partition`) and plans
the ghost shell (:mod:`jaxdd.decomposition.halo`), or, with ``strategy="graph_partition"``, into contiguous
node blocks with no ghost shell (:mod:`jaxdd.decomposition.graph_partition`); inside ``shard_map`` every rank refreshes its ghost
positions with ``halo_forward``, builds its neighbour list with its owned atoms as the only
receivers, calls the model, and sums its owned per-atom energies. The energy is the
``psum`` of those sums; forces and stress are ``jax.grad`` of it, taken with the ghost
positions produced inside the differentiated function, so ghost forces travel home through
the transpose of ``halo_forward``. Outputs come back in the batch's own atom order.

Capacities are static and sized on the host with headroom; an overflow (a plan or a
neighbour list that no longer fits) grows them and compiles again, never drops anything.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import programs, virials
from ..checks import integral
from ..neighbors.capacity import Capacities, factors, headroom
from ..data import AtomicData, Batch, as_batch, is_concrete
from ..dispatch import DispatchError, DispatchReport, Kind, unfollowed_error, warn_fallbacks
from ..driver import bucketed_atoms, check_stress_cells, model_config, requested_outputs, unpad_atoms
from ..decomposition.graph_partition import STRATEGIES, block_capacity, node_blocks
from ..decomposition.guardrail import check_halo, device_memory, halo_size
from ..decomposition.halo import HaloLayout, HaloPlan, build_halo_plan, build_rank_plans
from ..model import ModelOutputs
from ..neighbors import (NEIGHBOR_BACKENDS, NeighborCapacity, NeighborListFormat, NeighborStats, capacity_bucket,
                        neighbor_capacity)
from ..ops import GraphParallelPolicy, HaloRefreshPolicy, HaloStoragePolicy
from ..decomposition.partition import Partition, imbalance, partition
from ..decomposition.ranks import agree_max, on_ranks, own_ranks
from .rank_program import (RankInputs, RankProgram, ReportSink, half_list_order, neighbor_needs, neighbor_stats,
                           rank_evaluate)
from ..spec import SPEC_MPNN_HALO, MLIPSpec, OutputKind

__all__ = ["DomainConfig", "DistributedModel", "PartitionHealth", "default_mesh"]


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
        return int(self.mesh.size)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)


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


class DistributedModel:
    """A wrapper run under spatial domain decomposition; call it like ``jaxdd.compute``.

    model: a :class:`~jaxdd.BaseModel` with a full neighbour list that provides per-atom
    energies (``spec.node_energy_key``, else ``atomic_energies``).
    domain_config: a :class:`DomainConfig`. spec: an :class:`~jaxdd.spec.MLIPSpec`
    (default: the model's ``distribution_spec``, else ``SPEC_MPNN_HALO``).
    """

    def __init__(self, model, domain_config: DomainConfig, spec: MLIPSpec | None = None):
        cfg = model_config(model)
        if not isinstance(domain_config, DomainConfig):
            raise ValueError(f"domain_config must be a DomainConfig, got {domain_config!r}")
        spec = spec if spec is not None else (model.distribution_spec or SPEC_MPNN_HALO)
        if not isinstance(spec, MLIPSpec):
            raise ValueError(f"spec must be an MLIPSpec, got {spec!r}")
        name = type(model).__name__
        policy, layout = _strategy(spec.policy, domain_config.strategy, name)
        nc = cfg.neighbor_config
        if nc is None:
            raise ValueError(f"{name} declares no neighbor_config; DistributedModel needs one")
        deep = isinstance(policy, HaloStoragePolicy) and policy.deep
        # A half list lists each pair on one rank only (picked by the global ids' order and
        # parity, images by their shift), its other end possibly a ghost whose share goes
        # home with the ghost partial sums. Deep halos and node blocks compute on ghost rows
        # or on every rank's rows, where that rule does not hold.
        if nc.half_list and (deep or layout != "halo"):
            raise ValueError(
                f"{name} asks for a half neighbour list, which runs under the halo strategy with ghost partial "
                f"sums sent home; this spec uses {'a deep halo' if deep else 'node blocks'}: use half_list=False"
            )
        ghost_width = domain_config.ghost_width
        # Node blocks have no ghost shell (every rank's list searches all atoms): no width to check.
        if deep:  # every layer reads one more neighbour shell of ghosts computed on this rank
            ghost_width = max(ghost_width, policy.halo_layers * nc.search_cutoff)
        elif layout == "halo" and nc.search_cutoff > ghost_width + 1e-12:
            raise ValueError(
                f"the model's neighbour range {nc.search_cutoff} (cutoff + skin) exceeds the ghost width "
                f"{ghost_width}; raise DomainConfig.cutoff/skin/ghost_width"
            )
        strategy = spec.compile.force_strategy if spec.compile is not None else "framework_from_node_energy"
        if strategy == "model_internal":
            raise ValueError(
                f"spec.compile.force_strategy='model_internal' ({name} computes its own forces): DistributedModel "
                "takes forces from the energy; declare the model's forces as a PER_NODE output of a custom op instead"
            )
        node_key = spec.node_energy_key or ("atomic_energies" if "atomic_energies" in cfg.outputs else None)
        if node_key is not None and node_key not in cfg.outputs:
            raise ValueError(f"spec.node_energy_key {node_key!r} is not an output of {name} (outputs {sorted(cfg.outputs)})")
        use_node = strategy == "framework_from_node_energy" and node_key is not None
        if not use_node and "energy" not in cfg.outputs:
            raise ValueError(
                f"{name} provides neither per-atom energies nor 'energy' (outputs {sorted(cfg.outputs)}); "
                "DistributedModel differentiates one of them"
            )
        if layout == "graph_partition" and domain_config.balance is not None:
            # The strategy may come from the spec (GraphParallelPolicy), after DomainConfig checked.
            raise ValueError("DomainConfig.balance places spatial blocks, but this spec runs the graph-parallel "
                             "strategy (node blocks of equal size already): leave balance=None")
        self.config = domain_config
        self.spec = spec
        self.strategy = layout  # "halo" or "graph_partition"
        self.policy = policy
        self.energy_key = node_key if use_node else "energy"
        self.use_node_energy = use_node
        self.ghost_width = ghost_width
        self.deep_halo = deep
        # Along an axis the grid leaves whole (one rank along it) the ranks need no ghost images:
        # they search its periodic images themselves, as one device searches its cell; one rank
        # then holds no ghost rows, a grid (1, 1, 2) only the shells along z. A half list keeps
        # the images (its order keys tell a pair's images apart by their rows), and so does the
        # kernel search, which has open boundaries only.
        self.periodic_search = (layout == "halo" and not deep and not nc.half_list
                                and domain_config.neighbor_backend != "kernel")
        self.capacity_factor, self.growth_factor = factors(domain_config.capacity_factor, spec.compile)
        self._model = model
        #: The static sizes the next program compiles with (None until the first plan).
        self.capacities: Capacities | None = None
        self._halo_regrowths = 0  # halo capacity growths since the last recorded call
        self._bucketed_capacity = {}  # bucketed halo capacity by exchange pattern, see _bucket_plan
        self._reports = ReportSink()
        self._last_program = None
        self.health: PartitionHealth | None = None

    @property
    def model(self):
        """The wrapped model. Assigning another (new weights, a changed cutoff) checks that the
        plans this DistributedModel builds still hold every neighbour it can reach."""
        return self._model

    @model.setter
    def model(self, model) -> None:
        self.check_ghost_width(self.ghost_width, model, what="this DistributedModel's ghost width")
        self._model = model

    def needed_ghost_width(self, model=None) -> float:
        """The ghost shell (Å) ``model`` (default: the wrapped one) needs: its neighbour range
        (cutoff + skin), times the halo layers of a deep halo; 0 for node blocks (no shell)."""
        nc = model_config(self._model if model is None else model).neighbor_config
        if nc is None or self.strategy != "halo":
            return 0.0
        return self.policy.halo_layers * nc.search_cutoff if self.deep_halo else nc.search_cutoff

    def ghost_width_covers(self, width: float | None, model=None) -> bool:
        """Whether a plan built for a ghost shell of ``width`` Å (None: unknown) holds every
        neighbour of ``model`` (default: the wrapped one)."""
        return width is not None and self.needed_ghost_width(model) <= width + 1e-12

    def check_ghost_width(self, width: float, model=None, *, what: str = "the plan's ghost width") -> None:
        """Raise ValueError when a plan built for a ghost shell of ``width`` Å misses
        neighbours of ``model`` (default: the wrapped one), naming both numbers.

        Every path that reuses a plan (a restored checkpoint, a state of another run, a
        changed model) goes through this check before the plan is used."""
        if not self.ghost_width_covers(width, model):
            need = self.needed_ghost_width(model)
            name = type(self._model if model is None else model).__name__
            raise ValueError(
                f"{what} is {width:.6g} Å but {name} reaches {need:.6g} Å (neighbour range cutoff + skin"
                f"{', times the halo layers' if self.deep_halo else ''}): the plan would miss neighbours; build "
                f"the DistributedModel with DomainConfig(cutoff=..., skin=...) covering {need:.6g} Å")

    @property
    def last_program(self) -> RankProgram | None:
        """The :class:`~jaxdd.engine.rank_program.RankProgram` the last call or :meth:`prepare` built (None before)."""
        return self._last_program

    @property
    def dispatch_report(self):
        """The :class:`~jaxdd.dispatch.DispatchReport` of the program the last call ran (None before a call)."""
        return self._reports.get(self._last_program)

    # ------------------------------------------------------------------ host side

    def plan(self, batch: Batch, grid=None, *, bucketed: bool = False, cuts=None,
             weights=None) -> tuple[Partition, HaloPlan]:
        """Partition ``batch`` and plan its halo (growing :attr:`capacities` if needed).

        grid: the rank grid (default ``DomainConfig.grid``, else the least-surface one).
        bucketed: round the owned rows and exchange slots up to capacity buckets
        (:func:`~jaxdd.neighbors.capacity_bucket`), as calls of the model do (halo strategy
        only: node blocks keep their exact size). cuts: relative block boundaries to keep
        ([S, 3, max(grid) + 1], :mod:`jaxdd.decomposition.partition`); None: equal slices, or
        balanced ones when ``DomainConfig.balance`` is set, by atoms or by ``weights`` [V]
        (a cost per atom)."""
        cfg = self.config
        if self.strategy == "graph_partition":
            # Node blocks keep their exact size: padded block rows gave wrong NequIP energies on
            # molecules over 8 ranks (tests/test_graph_parallel.py, slow set).
            part, plan = node_blocks(batch.batch_idx, batch.atom_mask, batch.pbc, cfg.n_ranks)
            self.capacities = dataclasses.replace(self.capacities or Capacities(0), owned=plan.layout.n_owned)
            return part, plan
        part = partition(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                         cfg.n_ranks, grid=grid if grid is not None else cfg.grid, cuts=cuts,
                         balance=cuts is None and cfg.balance is not None, weights=weights)
        # With several processes each plans only the ranks on its own devices; they agree on
        # the capacities (maxima of a few integers) so that every rank runs one program shape.
        ranks = own_ranks(cfg.mesh)
        capacity = None if self.capacities is None else self.capacities.halo
        if ranks is not None and capacity is None:
            needs = build_rank_plans(part, self.ghost_width, ranks, capacity_factor=self.capacity_factor,
                                     periodic_search=self.periodic_search)
            needs = agree_max([needs.needed_owned, *needs.needed_exchange])
            capacity = (headroom(needs[0], self.capacity_factor),
                        tuple(headroom(n, self.capacity_factor) for n in needs[1:]))
        plan = self._plan_ranks(part, ranks, capacity)
        if plan.overflow:
            have = Capacities(plan.layout.n_owned, tuple(e.capacity for e in plan.layout.exchanges))
            grown = have.grown(self.growth_factor, owned=plan.needed_owned, exchange=plan.needed_exchange)
            plan = self._plan_ranks(part, ranks, grown.halo)
            self._halo_regrowths += 1
        if bucketed:
            plan = self._bucket_plan(part, ranks, plan)
        layout = plan.layout
        self.capacities = dataclasses.replace(
            self.capacities or Capacities(0), owned=layout.n_owned, exchange=tuple(e.capacity for e in layout.exchanges))
        self._check_degenerate(part, plan)
        return part, plan

    def _bucket_plan(self, part: Partition, ranks, plan: HaloPlan) -> HaloPlan:
        """``plan`` again with its owned rows and exchange slots rounded up to capacity buckets,
        and never below those of the last plan with the same exchanges (``plan`` itself when it
        has them already), so that differently sized systems share programs."""
        layout = plan.layout
        have = (layout.n_owned, tuple(e.capacity for e in layout.exchanges))
        shape = (layout.grid, tuple((e.axis, e.direction, e.hop, e.pairs) for e in layout.exchanges))
        last = self._bucketed_capacity.get(shape, (0, (0,) * len(have[1])))
        want = (max(last[0], capacity_bucket(have[0])),
                tuple(max(a, capacity_bucket(c)) for a, c in zip(last[1], have[1])))
        self._bucketed_capacity[shape] = want
        return plan if want == have else self._plan_ranks(part, ranks, want)

    def search_pbc(self, pbc, grid) -> np.ndarray:
        """The periodic axes of the ranks' neighbour search, [S, 3] bool, for a batch's ``pbc``
        ([S, 3]) split by ``grid``: none where ghost rows are the periodic images; the batch's
        own along the axes the grid leaves whole when the ranks search those images themselves
        (:attr:`periodic_search`); all of them for node blocks, which search the whole cell."""
        pbc = np.asarray(pbc, bool)
        if self.strategy == "graph_partition":
            return pbc
        if not self.periodic_search:
            return np.zeros_like(pbc)
        return pbc & (np.asarray(grid) == 1)

    def _plan_ranks(self, part: Partition, ranks, capacity) -> HaloPlan:
        """The plan of ``ranks`` (None: all) with ``capacity``; with several processes its
        needs are agreed over all of them."""
        if ranks is None:
            # A single rank owns every atom whatever they do: no headroom for imbalance.
            factor = 1.0 if self.periodic_search and part.n_ranks == 1 else self.capacity_factor
            return build_halo_plan(part, self.ghost_width, capacity_factor=factor, capacity=capacity,
                                   periodic_search=self.periodic_search)
        plan = build_rank_plans(part, self.ghost_width, ranks, capacity_factor=self.capacity_factor, capacity=capacity,
                                periodic_search=self.periodic_search)
        needs = agree_max([plan.needed_owned, *plan.needed_exchange])
        layout = plan.layout
        overflow = needs[0] > layout.n_owned or any(n > e.capacity for n, e in zip(needs[1:], layout.exchanges))
        return dataclasses.replace(plan, needed_owned=int(needs[0]), needed_exchange=tuple(int(n) for n in needs[1:]),
                                   overflow=bool(overflow))

    def _check_degenerate(self, part: Partition, plan: HaloPlan) -> None:
        if self.strategy == "graph_partition":
            return  # no ghost shell to degenerate
        if _covers_every_atom(part, plan):
            owned, ghosts = _owned_and_ghosts(plan)
            r = int(np.argmax(owned + ghosts))
            msg = (
                f"the ghost shell of some ranks covers every atom (grid {part.grid}, ghost width "
                f"{self.ghost_width} Å; the busiest rank holds {int(ghosts[r])} ghost rows for {int(owned[r])} owned "
                "atoms): decomposition gains nothing here; use fewer ranks or a larger system"
            )
            if self.config.require_nondegenerate:
                raise ValueError(msg)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def rank_inputs(self, batch: Batch, part: Partition, plan: HaloPlan) -> tuple[RankInputs, np.ndarray]:
        """The rows every rank reads for ``batch`` under ``plan``, on the host.

        Returns:
          (inputs, local_positions): a :class:`~jaxdd.engine.rank_program.RankInputs` of host arrays
          (``program`` unset; place it with :meth:`RankInputs.place`) and every rank's local
          rows' positions ``[P, n_local, 3]`` Å, ghost images included (to size neighbour lists).
        """
        n_owned = plan.layout.n_owned
        ids = plan.local_ids  # [P, n_local]
        valid = ids >= 0
        safe = np.where(valid, ids, 0)
        n_sys = batch.n_systems
        cell = np.asarray(batch.cell)
        positions = np.asarray(batch.positions, np.float64)
        wrapped = positions - np.einsum("vi,vij->vj", part.wraps, cell[part.system])
        own_ids = ids[:, :n_owned]
        own_valid = own_ids >= 0
        dtype = batch.positions.dtype
        own_pos = np.where(own_valid[..., None], wrapped[np.where(own_valid, own_ids, 0)], 0.0)
        own_sys = np.where(own_valid, part.system[np.where(own_valid, own_ids, 0)], 0)
        bidx = np.where(valid, np.asarray(batch.batch_idx)[safe], n_sys)
        owned_rows = valid & (np.arange(ids.shape[1]) < n_owned)[None, :]
        # ptr holds what it holds on one device, every system's atom count (a total, as the
        # dispatch treats it): a per-system normaliser read from it is right on every rank.
        real = np.asarray(batch.batch_idx)[np.asarray(batch.atom_mask, bool)]
        counts = np.broadcast_to(np.bincount(real, minlength=n_sys)[:n_sys], (len(ids), n_sys))
        ptr = np.concatenate([np.zeros((len(ids), 1), np.int64), np.cumsum(counts, axis=1)], axis=1)

        carried = set(self.spec.distribution.shard_fields)  # the per-atom fields the spec sends to ranks

        def rows(field, fill):
            x = getattr(batch, field)
            if x is None or field not in carried:
                return None
            x = np.asarray(x)
            return np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[safe], fill)

        local = Batch.unchecked(
            positions=np.zeros(ids.shape + (3,), dtype),  # filled by halo_forward on device
            atomic_numbers=rows("atomic_numbers", 0).astype(np.int32),
            cell=np.broadcast_to(cell, (len(ids),) + cell.shape),
            pbc=np.broadcast_to(self.search_pbc(batch.pbc, part.grid), (len(ids), n_sys, 3)),
            batch_idx=bidx.astype(np.int32),
            ptr=ptr.astype(np.int32),
            atom_mask=valid,
            system_mask=np.broadcast_to(np.asarray(batch.system_mask), (len(ids), n_sys)),
            charges=rows("charges", 0.0),
            masses=rows("masses", 1.0),
            velocities=rows("velocities", 0.0),
        )
        # Where each global atom's owned row lands in the flattened [P * n_owned] outputs: its
        # owner's block, at its place among that owner's atoms in id order (the plan's order).
        # Rows up to the atom count's capacity bucket (cut off again on the host), so that the
        # program does not depend on the exact atom count.
        gather = np.full(bucketed_atoms(batch), part.n_ranks * n_owned)  # padding atoms → a zero row
        real = np.flatnonzero(part.owner >= 0)
        by_owner = real[np.argsort(part.owner[real], kind="stable")]
        first = np.searchsorted(part.owner[by_owner], part.owner[by_owner])
        gather[by_owner] = part.owner[by_owner] * n_owned + (np.arange(len(by_owner)) - first)
        inputs = RankInputs(
            local=jax.tree_util.tree_map(np.asarray, local),
            own_pos=np.asarray(own_pos, dtype),
            own_sys=np.asarray(own_sys, np.int32),
            owned_rows=np.asarray(owned_rows),
            routing=jax.tree_util.tree_map(np.asarray, plan.routing),
            cell=np.asarray(cell, dtype),
            system_mask=np.asarray(batch.system_mask),
            gather=np.asarray(gather, np.int32),
            n_atoms=batch.n_atoms,
        )
        local_positions = wrapped[safe] + np.einsum("pli,plij->plj", plan.local_shifts, cell[part.system[safe]])
        return inputs, local_positions

    def size_neighbors(self, inputs: RankInputs, local_positions: np.ndarray,
                       headroom: float | None = None) -> NeighborCapacity:
        """The neighbour-list capacity every rank's list needs for these rows, with headroom.

        Args:
          inputs, local_positions: as :meth:`rank_inputs` returns them (host arrays).
          headroom: factor over the exact needs (default: the capacity factor).
        """
        headroom = self.capacity_factor if headroom is None else headroom
        pos = np.asarray(local_positions)
        local = inputs.local
        n_owned = inputs.own_pos.shape[1]
        nc = model_config(self.model).neighbor_config
        if self.strategy == "graph_partition":
            n_ranks = pos.shape[0]
            return block_capacity(
                pos.reshape(-1, 3), np.asarray(inputs.cell), np.asarray(local.pbc[0]),
                np.asarray(local.batch_idx).reshape(-1), np.asarray(local.atom_mask).reshape(-1), n_ranks, n_owned,
                cutoff=nc.search_cutoff, headroom=headroom, max_neighbors=nc.max_neighbors or 1)
        if self.periodic_search:  # sized as the ranks search: periodic along their local pbc, in the cell
            caps = [neighbor_capacity(pos[r], np.asarray(inputs.cell), np.asarray(local.pbc[r]),
                                      np.asarray(local.batch_idx[r]), np.asarray(local.atom_mask[r]),
                                      cutoff=nc.search_cutoff, headroom=headroom, n_receivers=n_owned)
                    for r in range(pos.shape[0])]
            if len(caps) == 1:
                return caps[0]  # one rank: sized exactly as on one device
        else:
            # Systems sized apart, as the ranks search them: a batch of molecules that overlap in
            # space (each in its own box) would otherwise count each other as neighbours.
            n_sys = int(local.cell.shape[1])
            # A half list is counted with the ranks' keys: the pairs a rank shares with its
            # ghosts split between the two ranks (by rows, it would count all of them).
            routing = inputs.routing
            caps = [
                neighbor_capacity(pos[r], np.broadcast_to(np.eye(3), (n_sys, 3, 3)), np.zeros((n_sys, 3), bool),
                                  np.asarray(local.batch_idx[r]), np.asarray(local.atom_mask[r]),
                                  cutoff=nc.search_cutoff, headroom=headroom, half=nc.half_list,
                                  n_receivers=pos.shape[1] if self.deep_halo else n_owned,
                                  order=half_list_order(np.asarray(routing.row_ids[r]),
                                                        np.asarray(routing.row_shifts[r])) if nc.half_list else None)
                for r in range(pos.shape[0])
            ]
        cover = NeighborCapacity.covering(caps, nc.max_neighbors or 1)
        if jax.process_count() == 1:
            return cover
        # Each process sized its own ranks; every rank needs the largest.
        sizes = agree_max([cover.max_edges, cover.max_neighbors, cover.max_candidates, *cover.search_range,
                           -1 if cover.max_bins is None else cover.max_bins])
        return dataclasses.replace(cover, max_edges=int(sizes[0]), max_neighbors=int(sizes[1]),
                                   max_candidates=int(sizes[2]), search_range=tuple(int(x) for x in sizes[3:6]),
                                   max_bins=None if cover.max_bins is None else int(sizes[6]))

    def grow_neighbors(self, needed: NeighborStats) -> None:
        """Grow the neighbour capacity of :attr:`capacities` to hold ``needed`` (an overflow's
        sizes), by the growth factor; the next program compiles with it."""
        grown = self.capacities.grown(self.growth_factor, neighbors=needed)
        self.capacities = dataclasses.replace(grown, neighbors=grown.neighbors.bucketed())

    # ------------------------------------------------------------------ call

    def _check_call(self, data, outputs) -> tuple[Batch, tuple[str, ...]]:
        cfg = model_config(self.model)
        key = self.spec.node_virial_key
        outputs, wants_virials = requested_outputs(cfg, outputs, key)
        if wants_virials:
            if self.strategy != "halo":
                raise ValueError(f"{key!r} (the spec's node_virial_key): per-atom virials are derived under the halo "
                                 "strategy; node blocks (graph_partition) do not give them yet: use strategy='halo'")
            virials.check_supported(cfg.neighbor_config, type(self.model).__name__, key, deep=self.deep_halo)
        batch = as_batch(data)
        self.model.validate_input(batch)
        if "stress" in outputs:
            check_stress_cells(batch)
        # The output layout of the sharded program is fixed before tracing, so a key the
        # framework does not derive itself needs a declared kind (no shape heuristic here).
        undeclared = [k for k in outputs if k not in ("energy", "forces", "stress", self.energy_key, key)
                      and self.spec.kind_of(k) is OutputKind.UNKNOWN]
        if undeclared:
            raise ValueError(
                f"outputs {undeclared} have no OutputKind in the spec; DistributedModel needs one to lay them "
                "out across ranks: spec.with_output_kinds(key=OutputKind.PER_NODE or PER_GRAPH or GLOBAL)"
            )
        return batch, outputs

    def _prepare(self, data, outputs, *, size: bool) -> tuple[Partition, HaloPlan, RankInputs]:
        """Plan ``data`` and lay it out; ``size``: size the neighbour lists for these positions
        (else only when no capacity is known yet: a call regrows on overflow instead)."""
        batch, outputs = self._check_call(data, outputs)
        part, plan = self.plan(batch, bucketed=True)
        inputs, local_positions = self.rank_inputs(batch, part, plan)
        neighbors = None
        if self.capacities.neighbors is None:
            self.capacities = dataclasses.replace(
                self.capacities, neighbors=self.size_neighbors(inputs, local_positions).bucketed())
        if size:  # exactly what these positions need (bucketed): the positions of prepared inputs do not move
            neighbors = self.size_neighbors(inputs, local_positions, headroom=1.0).bucketed()
        self._check_halo_size(part, plan, (neighbors or self.capacities.neighbors).max_edges, batch.positions.dtype)
        program = self.program(batch.n_systems, outputs, plan.layout, neighbors=neighbors)
        return part, plan, dataclasses.replace(inputs.place(self.config.mesh, plan.ranks), program=program)

    def _check_halo_size(self, part: Partition, plan: HaloPlan, edges: int, dtype) -> None:
        """The guardrail (:mod:`jaxdd.decomposition.guardrail`), before anything compiles; a ghost
        shell that covers every atom has its own warning (:meth:`plan`)."""
        if self.strategy == "graph_partition" or part.n_ranks == 1:
            return
        size = halo_size(*_owned_and_ghosts(plan), edges, np.dtype(dtype).itemsize)
        limit = self.config.memory_limit
        if limit is None:
            limit = device_memory(self.config.mesh.devices.flat[0])
        check_halo(size, limit, grid=part.grid, ghost_width=self.ghost_width, stacklevel=5,
                   warn=not _covers_every_atom(part, plan))

    def prepare(self, data: AtomicData | Batch, outputs: Iterable[str] | str | None = None) -> RankInputs:
        """The host work of a call: partition, halo plan, capacities sized for these positions,
        and the rows of every rank placed on the mesh.

        Args:
          data: the atoms (an :class:`~jaxdd.AtomicData` or :class:`~jaxdd.Batch`).
          outputs: output keys (default: the model's active outputs).

        Returns:
          A :class:`~jaxdd.engine.rank_program.RankInputs` (a pytree) for :meth:`apply`; its
          ``program`` holds the static program (layout, capacities, outputs).
        """
        return self._prepare(data, outputs, size=True)[2]

    def program(self, n_systems: int, outputs: tuple[str, ...], layout: HaloLayout,
                neighbors: NeighborCapacity | None = None) -> RankProgram:
        """The :class:`~jaxdd.engine.rank_program.RankProgram` of this model for ``n_systems`` systems,
        ``outputs`` and a halo ``layout``, with the neighbour capacity ``neighbors`` (default:
        that of :attr:`capacities`)."""
        nc = model_config(self.model).neighbor_config
        program = RankProgram(
            layout=layout,
            nl_capacity=self.capacities.neighbors if neighbors is None else neighbors,
            search_cutoff=nc.search_cutoff,
            nl_format=nc.format,
            nl_backend=self.config.neighbor_search,
            nl_half=bool(nc.half_list),
            periodic_search=self.periodic_search,
            strategy=self.strategy,
            policy=self.policy,
            autograd=frozenset(model_config(self.model).autograd_outputs),
            outputs=tuple(outputs),
            energy_key=self.energy_key,
            use_node_energy=self.use_node_energy,
            deep=self.deep_halo,
            n_systems=int(n_systems),
            virial_key=self.spec.node_virial_key if self.spec.node_virial_key in outputs else None,
            mesh=self.config.mesh,
            spec=self.spec,
            # A deep halo declares that ranks compute their ghost rows themselves, nothing exchanged
            # inside the model: what the dispatch could not follow is local by that declaration
            # (listed, and warned about), as it is the validator's fix for such values.
            strict=not (self.config.allow_unfollowed or self.deep_halo),
            sink=self._reports,
        )
        self._last_program = program
        return program

    def apply(self, model, inputs: RankInputs) -> ModelOutputs:
        """Evaluate ``model`` on prepared inputs: a pure function of both.

        ``model``'s arrays are pytree leaves, so ``jax.jit(dm.apply)`` and ``jax.grad`` of a
        loss over its outputs with respect to the model's parameters work; the result equals
        :meth:`__call__` and ``jaxdd.compute``. The capacities are those :meth:`prepare`
        sized for these positions, so every neighbour fits. Should a list overflow all the
        same (inputs altered after :meth:`prepare`), no pair is dropped silently: a call
        outside a trace raises, and under ``jit`` or ``grad`` every output is NaN.

        Args:
          model: a model like the wrapped one (e.g. with other parameters), with the same
            neighbour configuration (cutoff, skin, format).
          inputs: from :meth:`prepare`.

        Returns:
          :class:`~jaxdd.ModelOutputs`, in the batch's atom order.
        """
        if not isinstance(inputs, RankInputs) or inputs.program is None:
            raise TypeError(f"DistributedModel.apply takes the inputs DistributedModel.prepare returns, got "
                            f"{type(inputs).__name__}")
        nc, program = model_config(model).neighbor_config, inputs.program
        if nc is None or (nc.search_cutoff, NeighborListFormat(nc.format), bool(nc.half_list)) != (
                program.search_cutoff, NeighborListFormat(program.nl_format), program.nl_half):
            raise ValueError(
                f"DistributedModel.apply: {type(model).__name__}'s neighbour configuration ({nc}) is not the one the "
                f"inputs were prepared for (search cutoff {program.search_cutoff} Å, {program.nl_format}); "
                "prepare them with a DistributedModel of this model")
        out, overflow, _ = _run(model, dataclasses.replace(inputs, n_atoms=0))
        if is_concrete(overflow):
            if bool(overflow):
                raise RuntimeError(
                    "a neighbour list overflowed its capacity in DistributedModel.apply: the inputs were altered "
                    "after DistributedModel.prepare; prepare them again (a DistributedModel call regrows by itself)")
        else:
            out = {k: jnp.where(overflow, jnp.nan, v) if jnp.issubdtype(v.dtype, jnp.inexact) else v
                   for k, v in out.items()}
        n = inputs.n_atoms
        per_node = _per_node_keys(program)
        return ModelOutputs({k: (v[:n] if k in per_node else v) for k, v in out.items()})

    def lower(self, data: AtomicData | Batch, outputs: Iterable[str] | str | None = None):
        """The lowered XLA program of one call (a ``jax.stages.Lowered``): for analysis
        (``.compile().cost_analysis()``, ``.memory_analysis()``, ``.as_text()``), not to call."""
        _, _, inputs = self._prepare(data, outputs, size=False)
        return _run.lower(self.model, dataclasses.replace(inputs, n_atoms=0)).lowered

    def __call__(self, data: AtomicData | Batch, outputs: Iterable[str] | str | None = None) -> ModelOutputs:
        """Evaluate the model distributed; same keys, shapes and atom order as ``jaxdd.compute``.

        :meth:`prepare` and :meth:`apply`, except that neighbour capacities are sized once
        and grown (a new program) when a list overflows."""
        programs.check()  # a long-lived process: drop jaxdd's programs when its code mappings crowd
        part, plan, inputs = self._prepare(data, outputs, size=False)
        n_atoms = inputs.n_atoms
        inputs = dataclasses.replace(inputs, n_atoms=0)  # the program does not depend on the atom count
        recompiles = 0
        for _ in range(self.spec.compile.max_regrowths if self.spec.compile else 8):
            out, overflow, needed = _run(self.model, inputs)
            if not bool(overflow):
                if inputs.program.virial_key is not None:
                    virials.refuse_broken(out[inputs.program.virial_key], type(self.model).__name__,
                                          inputs.program.virial_key)
                self._record_health(part, plan, recompiles)
                self._warn_once()
                return unpad_atoms(out, n_atoms, int(inputs.gather.shape[0]), self.spec)
            recompiles += 1
            self.grow_neighbors(neighbor_stats(needed))
            inputs = dataclasses.replace(
                inputs, program=self.program(inputs.program.n_systems, inputs.program.outputs, plan.layout))
        raise RuntimeError(f"neighbour lists still overflowed after {recompiles} capacity increases")

    def _warn_once(self) -> None:
        """Warn about the dispatch's guesses once per traced program."""
        report = self.dispatch_report
        if report is not None and report is not getattr(self, "_warned", None):
            self._warned = report
            warn_fallbacks(report, type(self.model).__name__)

    def _record_health(self, part: Partition, plan: HaloPlan, recompiles: int) -> None:
        n_real = int((part.owner >= 0).sum())
        held = _per_rank(plan, _distinct_held(plan))
        owned, ghosts = _owned_and_ghosts(plan)
        self.health = PartitionHealth(
            grid=part.grid,
            owned=owned,
            ghost=ghosts,
            remote=n_real - held,
            owned_capacity=plan.layout.n_owned,
            ghost_capacity=plan.layout.n_ghost,
            edge_capacity=self.capacities.neighbors.max_edges,
            recompiles=recompiles + self._halo_regrowths,
            devices=self.config.n_ranks,
            devices_present=jax.device_count(),
        )
        self._halo_regrowths = 0


def _per_rank(plan: HaloPlan, values) -> np.ndarray:
    """Values of the plan's ranks as a [P] vector of every rank's (agreed over processes)."""
    if plan.ranks is None:
        return np.asarray(values)
    full = np.full(int(np.prod(plan.layout.grid)), np.iinfo(np.int64).min, np.int64)
    full[plan.rank_ids] = values
    return agree_max(full)


def _owned_and_ghosts(plan: HaloPlan) -> tuple[np.ndarray, np.ndarray]:
    """Atoms every rank owns and ghost rows it holds, [P] each (agreed over processes)."""
    return _per_rank(plan, plan.owned_counts()), _per_rank(plan, plan.ghost_counts())


def _covers_every_atom(part: Partition, plan: HaloPlan) -> bool:
    """Whether some rank of several holds a row of every real atom (agreed over processes, so
    every process decides alike): decomposition gains nothing."""
    n_real = int((part.owner >= 0).sum())
    return part.n_ranks > 1 and n_real > 0 and bool(np.any(_per_rank(plan, _distinct_held(plan)) >= n_real))


def _distinct_held(plan: HaloPlan) -> np.ndarray:
    """Atoms of which each rank holds a row, [P] (ghost rows count images, so may repeat)."""
    return np.array([np.unique(ids[ids >= 0]).size for ids in plan.local_ids])


def _per_node_keys(program: RankProgram) -> set[str]:
    """Outputs with one row per atom: forces, the per-atom energies, declared PER_NODE keys."""
    spec = program.spec
    return {k for k in program.outputs
            if k in ("forces", program.virial_key) or (program.use_node_energy and k == program.energy_key)
            or spec.kind_of(k) is OutputKind.PER_NODE}


@programs.track
@eqx.filter_jit
def _run(model, inputs: RankInputs):
    """(outputs over the gather rows [N'], overflow [] bool, the neighbour sizes needed) of one
    evaluation of ``model`` on ``inputs`` (its program static)."""
    program = inputs.program
    axes = program.axes
    params, rest = eqx.partition(model, eqx.is_array)
    # Forces and stress the model computes itself (a kernel's direct forces) are its outputs,
    # laid out like any other; only autograd outputs are derived here.
    want_forces = "forces" in program.outputs and "forces" in program.autograd
    want_stress = "stress" in program.outputs and "stress" in program.autograd
    want_virials = program.virial_key is not None
    spec = program.spec
    n_owned = program.layout.n_owned
    report = DispatchReport(policy=program.policy)
    per_node = _per_node_keys(program)

    def rank_fn(local, own_pos, own_sys, owned_rows, routing, params, cell, system_mask):
        model = eqx.combine(params, rest)
        per_system, out, lays, nl, g_pos, g_strain, w_atoms = rank_evaluate(
            model, local, own_pos, own_sys, owned_rows, routing, cell, system_mask, program, report,
            forces=want_forces, stress=want_stress, virials=want_virials)
        results = {}
        for key in program.outputs:  # one fixed order on every rank
            if key == "energy":
                results[key] = per_system
            elif key == "forces" and want_forces:
                results[key] = -g_pos
            elif key == "stress" and want_stress:
                volume = jnp.abs(jnp.linalg.det(cell))
                safe = jnp.where(volume > 0, volume, 1.0)[:, None, None]
                results[key] = jax.lax.psum(g_strain, axes) / safe
            elif key == program.virial_key:
                results[key] = w_atoms
            elif key in per_node:
                results[key] = out[key][:n_owned]
            elif key in spec.all_reduce_outputs:
                results[key] = jax.lax.psum(out[key], axes)
            else:
                if lays[key].kind in (Kind.NODE, Kind.EDGE):
                    raise DispatchError(
                        f"output {key!r} is declared {spec.kind_of(key).value} but is laid out per "
                        f"{lays[key].kind.value} after dispatch; declare it PER_NODE or reduce it over atoms in the model"
                    )
                if lays[key].local:
                    report.note(f"output {key!r} differs between ranks (a per-rank partial?); rank 0's value is "
                                "returned: list it in all_reduce_outputs if the ranks' values should be summed")
                results[key] = out[key]  # complete on every rank: the dispatch reduced it
        overflow, needed = neighbor_needs(nl, axes)
        return results, overflow, needed

    replicated_out = ({k: k not in per_node for k in program.outputs}, True, True)
    try:
        results, overflow, needed = on_ranks(
            rank_fn, program.mesh,
            ranked=(inputs.local, inputs.own_pos, inputs.own_sys, inputs.owned_rows, inputs.routing),
            replicated=(params, inputs.cell, inputs.system_mask), replicated_out=replicated_out)
    finally:  # a refused program's report still says what the dispatch saw (the validator reads it)
        program.sink.put(program, report)
    if program.strict and report.fallbacks:  # notes on the outputs, made after the energy
        raise unfollowed_error(report, type(model).__name__)
    outputs = {}
    for key in program.outputs:
        value = results[key]
        if key in per_node:
            flat = value.reshape((-1,) + value.shape[2:])
            flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], flat.dtype)])
            # Replicated: every process holds whole outputs (in the batch's order) it can read.
            value = jax.lax.with_sharding_constraint(flat[inputs.gather], NamedSharding(program.mesh, P()))
        outputs[key] = value
    return ModelOutputs(outputs), overflow, needed


def _strategy(policy, strategy: str | None, name: str):
    """(the storage policy the dispatch runs under, the layout strategy) for a spec's policy
    and ``DomainConfig.strategy``."""
    if isinstance(policy, GraphParallelPolicy):
        if strategy == "halo":
            raise ValueError(
                f"the spec of {name} asks for graph parallelism (GraphParallelPolicy) but DomainConfig.strategy is "
                "'halo'; use strategy='graph_partition' (or None), or a spec with a halo policy")
        return policy, "graph_partition"
    if not isinstance(policy, (HaloStoragePolicy, HaloRefreshPolicy)):
        raise ValueError(f"spec policy {type(policy).__name__} is not one DistributedModel runs")
    if strategy == "graph_partition":
        if isinstance(policy, HaloRefreshPolicy) or policy.deep:
            raise ValueError(
                f"the spec of {name} uses {type(policy).__name__}"
                f"{'(scatter_mode=local)' if isinstance(policy, HaloStoragePolicy) else ''}: a model that builds its own "
                "graph from positions needs spatial domains with a ghost shell; use strategy='halo'")
        # A halo spec's scatter and gather modes concern ghost rows, which node blocks do not have.
        return GraphParallelPolicy(), "graph_partition"
    return policy, "halo"
