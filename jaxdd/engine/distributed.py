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
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from .. import programs
from . import virials
from ..data import AtomicData, Batch, as_batch, is_concrete
from ..decomposition.guardrail import check_halo, device_memory, halo_size
from ..decomposition.halo import HaloLayout, HaloPlan
from ..decomposition.partition import Partition
from ..dispatch import warn_fallbacks
from ..model.protocol import check_stress_cells, model_config, requested_outputs, unpad_atoms
from ..model.base import ModelOutputs
from ..neighbors import NeighborCapacity, NeighborListFormat
from ..neighbors.capacity import Capacities, factors
from ..ops import GraphParallelPolicy, HaloRefreshPolicy, HaloStoragePolicy
from ..spec import SPEC_MPNN_HALO, MLIPSpec, OutputKind
from . import placement
from .call import per_node_keys, run_program
from .config import DomainConfig, default_mesh
from .health import PartitionHealth, covers_every_atom, owned_and_ghosts, partition_health
from .rank_program import Needs, RankInputs, RankProgram, ReportSink, Sizing

__all__ = ["DomainConfig", "DistributedModel", "PartitionHealth", "default_mesh"]


class DistributedModel:
    """A wrapper run under spatial domain decomposition; call it like ``jaxdd.compute``.

    model: a :class:`~jaxdd.BaseModel` with a full neighbour list that provides per-atom
    energies (``spec.node_energy_key``, else ``atomic_energies``).
    domain_config: a :class:`DomainConfig`. spec: an :class:`~jaxdd.spec.MLIPSpec`
    (default: the model's ``distribution_spec``, else ``SPEC_MPNN_HALO``).
    """

    def __init__(self, model, domain_config: DomainConfig, spec: MLIPSpec | None = None):
        spec, policy, layout, ghost_width, deep, energy_key, use_node = _settings(model, domain_config, spec)
        nc = model_config(model).neighbor_config
        self.config = domain_config
        self.spec = spec
        self.strategy = layout  # "halo" or "graph_partition"
        self.policy = policy
        self.energy_key = energy_key
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
        #: The capacities of this model's programs and the one rule that grows them.
        self.sizing = Sizing(self.capacity_factor, self.growth_factor,
                             spec.compile.max_regrowths if spec.compile is not None else 8)
        self._model = model
        self._reports = ReportSink()
        self._last_program = None
        self._warned = None
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
        neighbours of ``model``, naming both numbers.

        Every path that reuses a plan (a restored checkpoint, a state of another run, a
        changed model) goes through this check before the plan is used.

        Args:
          width: the ghost width (Å) the plan was built for.
          model: the model the plan is for; None: the wrapped one.
          what: what ``width`` is, named in the error.
        """
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

    @property
    def capacities(self) -> Capacities | None:
        """The static sizes the next program compiles with (None until the first plan); see :attr:`sizing`."""
        return self.sizing.capacities

    # ------------------------------------------------------------------ host side

    def plan(self, batch: Batch, grid=None, *, bucketed: bool = False, cuts=None,
             weights=None) -> tuple[Partition, HaloPlan]:
        """Partition ``batch`` and plan its halo: :func:`jaxdd.engine.placement.plan`.

        Args:
          batch: the atoms.
          grid: the rank grid (default ``DomainConfig.grid``, else the least-surface one).
          bucketed: round the owned rows and exchange slots up to capacity buckets.
          cuts: [S, 3, max(grid) + 1] relative block boundaries to keep; None: equal slices,
            or balanced ones when ``DomainConfig.balance`` is set.
          weights: [V] a cost per atom for a balanced partition; None: atoms.

        Returns:
          (partition, halo plan).
        """
        return placement.plan(self, batch, grid, bucketed=bucketed, cuts=cuts, weights=weights)

    def search_pbc(self, pbc, grid) -> np.ndarray:
        """The periodic axes of the ranks' neighbour search, [S, 3] bool, for a batch's ``pbc``
        [S, 3] split by ``grid``: :func:`jaxdd.engine.placement.search_pbc`."""
        return placement.search_pbc(self, pbc, grid)

    def rank_inputs(self, batch: Batch, part: Partition, plan: HaloPlan) -> tuple[RankInputs, np.ndarray]:
        """Every rank's rows of ``batch`` under ``part`` and ``plan`` (its partition and halo
        plan): :func:`jaxdd.engine.placement.rank_inputs`."""
        return placement.rank_inputs(self, batch, part, plan)

    def size_neighbors(self, inputs: RankInputs, local_positions: np.ndarray,
                       headroom: float | None = None) -> NeighborCapacity:
        """The neighbour capacity these rows need: :func:`jaxdd.engine.placement.size_neighbors`.

        Args:
          inputs, local_positions: as :meth:`rank_inputs` returns them (host arrays).
          headroom: factor over the exact needs (default: the capacity factor).
        """
        return placement.size_neighbors(self, inputs, local_positions, headroom)

    # ------------------------------------------------------------------ call

    def _prepare(self, data, outputs, *, size: bool) -> tuple[Partition, HaloPlan, RankInputs]:
        """Plan ``data`` and lay it out; ``size``: size the neighbour lists for these positions
        (else only when no capacity is known yet: a call regrows on overflow instead)."""
        batch, outputs = _checked_call(self, data, outputs)
        part, plan = self.plan(batch, bucketed=True)
        inputs, local_positions = self.rank_inputs(batch, part, plan)
        neighbors = None
        if self.capacities.neighbors is None:
            self.sizing.adopt_neighbors(self.size_neighbors(inputs, local_positions).bucketed())
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
        size = halo_size(*owned_and_ghosts(plan), edges, np.dtype(dtype).itemsize)
        limit = self.config.memory_limit
        if limit is None:
            limit = device_memory(self.config.mesh.devices.flat[0])
        check_halo(size, limit, grid=part.grid, ghost_width=self.ghost_width, stacklevel=5,
                   warn=not covers_every_atom(part, plan))

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
            bond_cutoff=nc.bond_search_cutoff,
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
        out, overflow, _ = run_program(model, dataclasses.replace(inputs, n_atoms=0))
        if is_concrete(overflow):
            if bool(overflow):
                raise RuntimeError(
                    "a neighbour list overflowed its capacity in DistributedModel.apply: the inputs were altered "
                    "after DistributedModel.prepare; prepare them again (a DistributedModel call regrows by itself)")
        else:
            out = {k: jnp.where(overflow, jnp.nan, v) if jnp.issubdtype(v.dtype, jnp.inexact) else v
                   for k, v in out.items()}
        n = inputs.n_atoms
        per_node = per_node_keys(program)
        return ModelOutputs({k: (v[:n] if k in per_node else v) for k, v in out.items()})

    def lower(self, data: AtomicData | Batch, outputs: Iterable[str] | str | None = None):
        """The lowered XLA program of one call (a ``jax.stages.Lowered``): for analysis
        (``.compile().cost_analysis()``, ``.memory_analysis()``, ``.as_text()``), not to call.

        Args:
          data: the atoms (an :class:`~jaxdd.AtomicData` or :class:`~jaxdd.Batch`).
          outputs: output keys (default: the model's active outputs).
        """
        _, _, inputs = self._prepare(data, outputs, size=False)
        return run_program.lower(self.model, dataclasses.replace(inputs, n_atoms=0)).lowered

    def __call__(self, data: AtomicData | Batch, outputs: Iterable[str] | str | None = None) -> ModelOutputs:
        """Evaluate the model distributed; same keys, shapes and atom order as ``jaxdd.compute``.

        :meth:`prepare` and :meth:`apply`, except that neighbour capacities are sized once
        and grown (a new program) when a list overflows."""
        programs.check()  # a long-lived process: drop jaxdd's programs when its code mappings crowd
        regrowths = self.sizing.regrowths
        part, plan, inputs = self._prepare(data, outputs, size=False)
        n_atoms, program = inputs.n_atoms, inputs.program
        inputs = dataclasses.replace(inputs, n_atoms=0)  # the program does not depend on the atom count

        def attempt(capacities):
            run = dataclasses.replace(inputs, program=self.program(program.n_systems, program.outputs, plan.layout))
            out, overflow, needed = run_program(self.model, run)
            return out, Needs.of_neighbors(overflow, needed)

        out = self.sizing.run_until_fits(attempt)
        if program.virial_key is not None:
            virials.refuse_broken(out[program.virial_key], type(self.model).__name__, program.virial_key)
        self.health = partition_health(part, plan, edge_capacity=self.capacities.neighbors.max_edges,
                                       recompiles=self.sizing.regrowths - regrowths, devices=self.config.n_ranks,
                                       devices_present=jax.device_count())
        report = self.dispatch_report
        if report is not None and report is not self._warned:  # the dispatch's guesses, once per program
            self._warned = report
            warn_fallbacks(report, type(self.model).__name__)
        return unpad_atoms(out, n_atoms, int(inputs.gather.shape[0]), self.spec)


def _checked_call(dm: DistributedModel, data, outputs) -> tuple[Batch, tuple[str, ...]]:
    """The batch and output keys of a call, checked against the model and the spec."""
    cfg = model_config(dm.model)
    key = dm.spec.node_virial_key
    outputs, wants_virials = requested_outputs(cfg, outputs, key)
    if wants_virials:
        if dm.strategy != "halo":
            raise ValueError(f"{key!r} (the spec's node_virial_key): per-atom virials are derived under the halo "
                             "strategy; node blocks (graph_partition) do not give them yet: use strategy='halo'")
        virials.check_supported(cfg.neighbor_config, type(dm.model).__name__, key, deep=dm.deep_halo)
    batch = as_batch(data)
    dm.model.validate_input(batch)
    if "stress" in outputs:
        check_stress_cells(batch)
    # The output layout of the sharded program is fixed before tracing, so a key the
    # framework does not derive itself needs a declared kind (no shape heuristic here).
    undeclared = [k for k in outputs if k not in ("energy", "forces", "stress", dm.energy_key, key)
                  and dm.spec.kind_of(k) is OutputKind.UNKNOWN]
    if undeclared:
        raise ValueError(
            f"outputs {undeclared} have no OutputKind in the spec; DistributedModel needs one to lay them "
            "out across ranks: spec.with_output_kinds(key=OutputKind.PER_NODE or PER_GRAPH or GLOBAL)"
        )
    return batch, outputs


def _settings(model, domain_config, spec):
    """Check a model, its domain config and spec against each other; (spec, policy, strategy,
    ghost width, deep halo, energy key, node energy) of the run, or a ValueError naming the conflict."""
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
    if nc.bond_cutoff is not None and layout != "halo":
        raise ValueError(f"{name} lists bonds (NeighborConfig.bond_cutoff), which run under the halo strategy: "
                         "a bond's reverse lies in its partner's row, which node blocks do not hold")
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
    return spec, policy, layout, ghost_width, deep, (node_key if use_node else "energy"), use_node


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
