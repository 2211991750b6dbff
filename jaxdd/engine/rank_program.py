"""One rank's program: what it is compiled for, what it is fed, and how it runs on the ranks.

- :class:`RankProgram` (static, hashable): the halo layout, the capacities, the neighbour
  search, the storage policy and the outputs; equal programs share one compiled program.
- :class:`RankInputs` (a pytree): every rank's rows stacked on a leading ``[P]`` axis, the
  arrays the program reads, with its :class:`RankProgram` as static metadata.
- :func:`rank_evaluate`: one rank's share of an evaluation (energy, its gradients), from a
  rank's :class:`RankRows` to an :class:`Evaluation`.
- :func:`run_ranks`: the one way a program enters ``shard_map`` (its model, its report).
- :class:`Sizing`: the capacities programs compile with and the one overflow → grow → retry
  rule (:meth:`Sizing.run_until_fits`); nothing outside it changes them.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..spec.adapters import AdapterRegistry
from ..neighbors.capacity import Capacities, run_until_fits
from ..model.context import DDContext, dd_scope
from ..data import Batch
from ..dispatch import DispatchError, DispatchReport, Kind, Runtime, call_model, unfollowed_error
from ..decomposition.halo import HaloLayout, halo_forward
from ..decomposition.ranks import on_ranks, place_ranked
from ..neighbors import NeighborCapacity, NeighborListFormat, edge_vectors
from ..data.segments import per_system_sum
from ..spec import MLIPSpec
from .virials import atomic_virials, enforce_sum_rule
from .rank_neighbors import neighbor_stats, rank_neighbors

__all__ = ["RankProgram", "RankInputs", "RankRows", "Evaluation", "ReportSink", "Needs", "STALE", "Sizing",
           "rank_evaluate", "run_ranks"]


class ReportSink:
    """Dispatch reports of the programs one ``DistributedModel`` traced, by program."""

    def __init__(self):
        self._reports = {}

    def put(self, program: RankProgram, report: DispatchReport) -> None:
        """Keep ``report``, the dispatch report of tracing ``program`` (replacing an earlier one)."""
        self._reports[program.key] = report

    def get(self, program: RankProgram | None) -> DispatchReport | None:
        """The dispatch report kept for ``program``, or None (not traced yet, or ``program`` None)."""
        return None if program is None else self._reports.get(program.key)


@dataclasses.dataclass(frozen=True)
class RankProgram:
    """Everything that shapes one compiled rank program (hashable: the compile key).

    layout: the halo layout (owned rows, exchange slots). nl_capacity: the neighbour-list
    capacity. search_cutoff (Å), nl_format, nl_backend, nl_half: the neighbour search.
    periodic_search: the rank searches the periodic images along its local batch's pbc
    (the axes the grid leaves whole) itself, in the cell, with no ghost images along them.
    strategy: ``"halo"`` or ``"graph_partition"``. policy: the dispatch's storage policy.
    autograd: outputs the engine derives from the energy. outputs: keys computed, in order.
    energy_key, use_node_energy: what is differentiated. deep: a deep halo (ghost rows
    computed too). n_systems: systems of the batch. virial_key: the output key of per-atom
    virials when they are computed (the spec's ``node_virial_key``), else None. mesh: the
    device mesh. spec: the spec. strict: refuse a model whose values the dispatch could not
    follow (``DomainConfig.allow_unfollowed`` False).
    sink: where the traced program's dispatch report goes (compared by identity: each
    DistributedModel keeps its own reports).
    bond_cutoff: the range bonds are listed to (Å; the model's bond cutoff + skin), or None.
    """

    layout: HaloLayout
    nl_capacity: NeighborCapacity
    search_cutoff: float
    nl_format: NeighborListFormat
    nl_backend: str
    nl_half: bool
    periodic_search: bool
    strategy: str
    policy: object
    autograd: frozenset
    outputs: tuple[str, ...]
    energy_key: str
    use_node_energy: bool
    deep: bool
    n_systems: int
    virial_key: str | None
    mesh: Mesh
    spec: MLIPSpec
    strict: bool
    sink: ReportSink
    bond_cutoff: float | None = None

    @property
    def key(self) -> RankProgram:
        """This program without its report sink: equal for programs that compile alike."""
        return dataclasses.replace(self, sink=None)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh's axis names, the ranks' axes in ``shard_map`` and the collectives."""
        return tuple(self.mesh.axis_names)

    @property
    def n_ranks(self) -> int:
        """Number of ranks P: the devices of the mesh."""
        return int(self.mesh.size)

    @property
    def capacities(self) -> Capacities:
        """The program's capacities as one value."""
        return Capacities(owned=self.layout.n_owned, exchange=tuple(e.capacity for e in self.layout.exchanges),
                          neighbors=self.nl_capacity)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankRows:
    """One rank's rows of an evaluation (a pytree; inside :func:`run_ranks`).

    local: the rank's local rows as a :class:`~jaxdd.Batch` (positions made by the halo
    exchange). own_pos: [n_owned, 3] Å owned positions (in the partition's wrapped frame).
    own_sys: [n_owned] system of each owned row. owned_rows: [n_local] real owned rows.
    routing: the rank's halo routing. cell: [S, 3, 3] Å. system_mask: [S].
    """

    local: Batch
    own_pos: jax.Array
    own_sys: jax.Array
    owned_rows: jax.Array
    routing: object
    cell: jax.Array
    system_mask: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankInputs(RankRows):
    """The arrays a :class:`RankProgram` reads: the :class:`RankRows` fields with every rank's
    rows stacked on a leading ``[P]`` axis (``local``, ``own_pos``, ``own_sys``, ``owned_rows``,
    ``routing``; ``cell`` and ``system_mask`` the same on every rank), and

    gather: [N'] where each atom's owned row lands in the flattened ``[P * n_owned]`` outputs
    (N' = the atom count's bucket; padding atoms read a zero row).
    program (static): the program these inputs are laid out for. n_atoms (static): atoms
    of the batch, the rows outputs are cut back to.
    """

    gather: jax.Array
    program: RankProgram | None = dataclasses.field(default=None, metadata=dict(static=True))
    n_atoms: int = dataclasses.field(default=0, metadata=dict(static=True))

    #: Fields with one row block per rank (leading [P] axis); the rest are the same on every rank.
    RANKED = ("local", "own_pos", "own_sys", "owned_rows", "routing")

    def place(self, mesh: Mesh, ranks=None) -> RankInputs:
        """These host arrays on ``mesh``: rank blocks on their devices, the rest replicated.
        ranks: the ranks whose blocks the arrays hold (None: every rank); with several
        processes each holds only its own devices' ranks."""
        replicated = NamedSharding(mesh, P())
        placed = {f.name: (place_ranked(getattr(self, f.name), mesh, ranks) if f.name in self.RANKED
                           else jax.device_put(getattr(self, f.name), replicated))
                  for f in dataclasses.fields(self) if not f.metadata.get("static")}
        return dataclasses.replace(self, **placed)


class Evaluation(NamedTuple):
    """One rank's share of an evaluation (:func:`rank_evaluate`).

    per_system: [S] eV energies (the same on every rank). outputs: the model's outputs on
    this rank. layouts: their dispatch layouts. neighbors: the neighbour list used.
    g_pos: [n_owned, 3] eV/Å dE/d(owned positions) of this rank's term (forces are minus
    it; None when not taken). g_strain: [S, 3, 3] eV this rank's share of dE/dε (the virial
    is the psum; None when not taken). atomic_virials: [n_owned, 3, 3] eV of the owned atoms
    (NaN when they break the sum rule on any rank; None when not taken).
    """

    per_system: jax.Array
    outputs: dict
    layouts: dict
    neighbors: object
    g_pos: jax.Array | None = None
    g_strain: jax.Array | None = None
    atomic_virials: jax.Array | None = None


def rank_evaluate(model, rows: RankRows, program: RankProgram, report: DispatchReport, *, forces: bool = True,
                  stress: bool = False, virials: bool = False, neighbors=None) -> Evaluation:
    """One rank's share of a distributed evaluation; call inside :func:`run_ranks` on one rank's rows.

    Args:
      model: the model on this rank. rows: this rank's :class:`RankRows`.
      program: the rank program. report: the dispatch report the trace writes to.
      forces, stress: which gradients to take. virials: also the per-atom virials of the
        owned atoms (:mod:`jaxdd.engine.virials`; a full COO list, halo strategy).
      neighbors: a list from :func:`~jaxdd.engine.rank_neighbors.rank_neighbors` to reuse
        (built for a model that declares a neighbour skin, while no atom has moved half of
        it); None builds one.

    Returns:
      An :class:`Evaluation`: the energies, outputs and layouts, the neighbour list and this
      rank's share of the gradients asked for.
    """
    local, own_pos, own_sys, owned_rows, routing, cell, system_mask = (
        rows.local, rows.own_pos, rows.own_sys, rows.owned_rows, rows.routing, rows.cell, rows.system_mask)
    axes = program.axes
    layout = program.layout
    spec = program.spec
    n_sys = program.n_systems
    ops = {str(a.op): a for a in spec.distribution.custom_ops}

    def global_energy(own_pos, strain, displacement=None):
        if strain is None:
            pos, cell_s = own_pos, cell
        else:
            deform = jnp.eye(3, dtype=own_pos.dtype) + strain
            pos = jnp.einsum("vi,vij->vj", own_pos, deform[own_sys])
            cell_s = jnp.einsum("sij,sjk->sik", cell, deform)
        # Ghost positions are made here, inside the differentiated function, so ghost
        # forces travel home through the transpose of halo_forward.
        positions = halo_forward(pos, layout, routing, axes, cell=cell_s)
        nl = rank_neighbors(positions, local, program, cell_s, routing) if neighbors is None else neighbors
        probed = nl if displacement is None else dataclasses.replace(nl, displacement=displacement)
        runtime = Runtime(layout, routing, axes, program.policy, owned_rows,
                          edge_owned=nl.mask & (nl.receivers < layout.n_owned), ops=ops, n_ranks=program.n_ranks,
                          batch_idx=local.batch_idx, receivers_owned=not program.deep, atom_mask=local.atom_mask)
        batch = local.replace(positions=positions, cell=cell_s, neighbors=probed)
        out, lays = _call_model(model, batch, runtime, report, program)
        if program.strict and report.fallbacks:
            raise unfollowed_error(report, type(model).__name__)
        # What is differentiated is this rank's term of a sum over ranks: the program's
        # collectives transpose exactly (psum to psum, ppermute to its inverse), so the
        # gradient of the sum of the ranks' terms is the gradient of the energy.
        if program.use_node_energy:
            # Owned rows only (the first n_owned): an energy completed on its owners by a
            # ScatterOutputs op then needs no copy back onto the ghosts, and XLA drops it.
            n_own = layout.n_owned
            atomic = jnp.where(owned_rows[:n_own], out[program.energy_key][:n_own], 0.0)
            own_systems = per_system_sum(atomic, local.batch_idx[:n_own], n_sys)
            per_system = jax.lax.psum(own_systems, axes)
            term = jnp.sum(jnp.where(system_mask, own_systems, 0.0))
        else:
            if lays["energy"].kind in (Kind.NODE, Kind.EDGE) or lays["energy"].local:
                # What the dispatch could not follow names the user's file and line.
                unfollowed = "".join(f"\n  - {m}" for m in report.fallbacks[:4])
                raise DispatchError(
                    "the model's 'energy' is not the same on every rank after dispatch: it is "
                    f"{lays['energy'].describe()}. Sum per-atom energies over atoms (segment_sum by batch_idx, "
                    "jnp.sum, or jaxdd.system_sum) so the dispatch can reduce them across ranks"
                    + (f"; the dispatch could not follow:{unfollowed}" if unfollowed else "")
                )
            per_system = out["energy"]  # complete, and computed alike on every rank
            term = jnp.sum(jnp.where(system_mask, per_system, 0.0)) / program.n_ranks
        return term, (per_system, out, lays, nl, positions)

    # Each rank's strain copy collects that rank's share of the virial; summed by the caller.
    g_pos = g_strain = w_atoms = None
    if virials:
        dtype = own_pos.dtype
        strain = jnp.zeros((n_sys, 3, 3), dtype)
        probe = jnp.zeros((program.nl_capacity.max_edges, 3), dtype)
        (_, aux), (g_pos, g_strain, g_edges) = jax.value_and_grad(global_energy, argnums=(0, 1, 2), has_aux=True)(
            own_pos, strain, probe)
        nl, positions = aux[3], aux[4]
        vectors = edge_vectors(positions, cell, local.batch_idx, nl)
        w_atoms = atomic_virials(vectors, g_edges, nl.mask, nl.receivers, layout.n_local)[:layout.n_owned]
        w_atoms = jnp.where((own_sys < n_sys)[:, None, None] & owned_rows[:layout.n_owned, None, None], w_atoms, 0.0)
        summed = jax.lax.psum(per_system_sum(w_atoms, jnp.where(owned_rows[:layout.n_owned], own_sys, n_sys), n_sys),
                              axes)
        w_atoms = enforce_sum_rule(w_atoms, summed, jax.lax.psum(g_strain, axes), system_mask)
    elif stress:
        strain = jnp.zeros((n_sys, 3, 3), own_pos.dtype)
        (_, aux), (g_pos, g_strain) = jax.value_and_grad(global_energy, argnums=(0, 1), has_aux=True)(own_pos, strain)
    elif forces:  # no strain in the graph: nothing is spent on the virial
        (_, aux), g_pos = jax.value_and_grad(global_energy, has_aux=True)(own_pos, None)
    else:  # nothing to differentiate
        _, aux = global_energy(own_pos, None)
    per_system, out, lays, nl, _ = aux
    return Evaluation(per_system, out, lays, nl, g_pos, g_strain, w_atoms)


def _call_model(model, batch: Batch, runtime: Runtime, report: DispatchReport, program: RankProgram):
    """``model(batch)`` on this rank, through the dispatch, inside the DD scope; (outputs, layouts)."""
    policy = program.policy
    ctx = DDContext(
        active=True, mesh=program.mesh, axis_names=program.axes, policy=policy,
        world_size=program.n_ranks, n_owned=program.layout.n_owned, n_padded=program.layout.n_local,
        n_edges=int(batch.neighbors.senders.shape[0]), n_systems=program.n_systems,
        halo_layers=getattr(policy, "halo_layers", 1), adapters=AdapterRegistry(),
    )
    with dd_scope(ctx), ctx.adapters.installed(program.spec.distribution.third_party_helpers):
        model.distributed_setup(ctx)
        with jax.named_scope("jaxdd.model"):  # a profile tells the model's ops apart (bench/profile_table.py)
            return call_model(model, batch, runtime, report)


def run_ranks(fn, program: RankProgram, *, model=None, ranked: tuple = (), replicated: tuple = (),
              replicated_out=None, report: DispatchReport | None = None):
    """Run ``fn`` on every rank of ``program``'s mesh: the one way a program enters ``shard_map``.

    Args:
      fn: one rank's function, called as ``fn(model, report, *ranked_blocks, *replicated)``
        with the model rebuilt on the rank (None without ``model``) and the program's
        :class:`~jaxdd.dispatch.DispatchReport`; returns a pytree of arrays.
      program: the rank program (its mesh and storage policy).
      model: an equinox-style model whose array leaves enter as replicated inputs (so that
        parameter gradients flow through), or None.
      ranked, replicated, replicated_out: as :func:`~jaxdd.decomposition.ranks.on_ranks`.
      report: the report the trace writes to (default: a new one for the program's policy).

    Returns:
      (``fn``'s outputs as :func:`~jaxdd.decomposition.ranks.on_ranks` returns them, the report).
    """
    params, rest = eqx.partition(model, eqx.is_array)
    report = DispatchReport(policy=program.policy) if report is None else report

    def rank_fn(*args):
        blocks, params, others = args[:len(ranked)], args[len(ranked)], args[len(ranked) + 1:]
        return fn(eqx.combine(params, rest) if model is not None else None, report, *blocks, *others)

    out = on_ranks(rank_fn, program.mesh, ranked=ranked, replicated=(params, *replicated),
                   replicated_out=replicated_out)
    return out, report


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a run needed beyond its capacities (it overflowed): sizes to grow to.

    owned: owned rows per rank. exchange: slots of each halo exchange, in plan order.
    neighbors: a :class:`~jaxdd.neighbors.NeighborStats` the neighbour lists needed, or None.
    migrate: slots for atoms leaving a rank in one rebuild.
    """

    owned: int = 0
    exchange: tuple[int, ...] = ()
    neighbors: object = None
    migrate: int = 0

    @classmethod
    def of_neighbors(cls, overflow, needed) -> Needs | None:
        """The needs of a program's neighbour lists, None when none overflowed.

        Args:
          overflow: whether any rank's list overflowed (:func:`neighbor_needs`'s first output).
          needed: the sizes the ranks needed (its second output).
        """
        return cls(neighbors=neighbor_stats(needed)) if bool(overflow) else None


#: The needs of a run whose plan an atom outran (:meth:`Sizing.run_until_fits` plans again).
STALE = "stale plan"


class Sizing:
    """The capacities of one model's rank programs, and the one rule by which they grow.

    Every program a :class:`~jaxdd.DistributedModel` and its dynamics compile reads its
    static sizes (:class:`~jaxdd.neighbors.capacity.Capacities`) here, and nothing else
    changes them: a fresh plan is adopted (:meth:`adopt_layout`, :meth:`adopt_neighbors`,
    :meth:`adopt_migrate`), a checkpoint's are restored (:meth:`use`), and a run that
    overflowed grows them (:meth:`run_until_fits`). Nothing is ever dropped to fit.

    Args:
      capacity_factor: headroom of a capacity sized afresh (>= 1).
      growth_factor: growth of a capacity that overflowed (>= 1).
      max_regrowths: growths one run may ask for before it is refused.
    """

    def __init__(self, capacity_factor: float, growth_factor: float, max_regrowths: int = 8):
        self.capacity_factor = float(capacity_factor)
        self.growth_factor = float(growth_factor)
        self.max_regrowths = int(max_regrowths)
        #: Capacity growths so far (each compiles a new program).
        self.regrowths = 0
        self._capacities: Capacities | None = None
        self._bucketed = {}  # bucketed halo capacity by exchange pattern, see bucketed_halo

    @property
    def capacities(self) -> Capacities | None:
        """The static sizes the next program compiles with (None before the first plan)."""
        return self._capacities

    def use(self, capacities: Capacities) -> None:
        """Compile the next programs with ``capacities`` (a checkpoint's, or deliberately small
        ones: a run that overflows them grows them)."""
        if not isinstance(capacities, Capacities):
            raise TypeError(f"capacities must be a jaxdd.neighbors.capacity.Capacities, got {capacities!r}")
        self._capacities = capacities

    def adopt_layout(self, layout: HaloLayout) -> None:
        """Take the owned rows and exchange slots of ``layout``, a fresh plan's."""
        self._capacities = dataclasses.replace(self._capacities or Capacities(0), owned=layout.n_owned,
                                               exchange=tuple(e.capacity for e in layout.exchanges))

    def adopt_neighbors(self, capacity: NeighborCapacity) -> None:
        """Take a neighbour capacity sized on the host, when none is known yet."""
        if self._capacities.neighbors is None:
            self._capacities = dataclasses.replace(self._capacities, neighbors=capacity)

    def adopt_migrate(self, n_owned: int) -> None:
        """Size the migration slots of on-device rebuilds, once: 8 + an eighth of the ``n_owned`` owned rows."""
        if not self._capacities.migrate:
            self._capacities = dataclasses.replace(self._capacities, migrate=8 + int(n_owned) // 8)

    def bucketed_halo(self, layout: HaloLayout) -> tuple[int, tuple[int, ...]]:
        """(owned rows, exchange slots) of ``layout`` rounded up to capacity buckets, never below
        those of the last layout with the same exchanges, so differently sized systems share
        programs."""
        from ..neighbors import capacity_bucket

        have = (layout.n_owned, tuple(e.capacity for e in layout.exchanges))
        shape = (layout.grid, tuple((e.axis, e.direction, e.hop, e.pairs) for e in layout.exchanges))
        last = self._bucketed.get(shape, (0, (0,) * len(have[1])))
        want = (max(last[0], capacity_bucket(have[0])),
                tuple(max(a, capacity_bucket(c)) for a, c in zip(last[1], have[1])))
        self._bucketed[shape] = want
        return want

    def grow(self, needs: Needs) -> Capacities:
        """The capacities grown (:func:`~jaxdd.neighbors.capacity.grow`) to hold ``needs``; a grown
        neighbour capacity is rounded up to buckets. Returns the new capacities."""
        grown = (self._capacities or Capacities(0)).grown(
            self.growth_factor, owned=needs.owned, exchange=needs.exchange, neighbors=needs.neighbors,
            migrate=needs.migrate)
        if needs.neighbors is not None and grown.neighbors is not None:
            grown = dataclasses.replace(grown, neighbors=grown.neighbors.bucketed())
        self._capacities = grown
        self.regrowths += 1
        return grown

    def run_until_fits(self, attempt, *, what: str = "neighbour lists", replan=None):
        """Run ``attempt`` until it fits (:func:`jaxdd.neighbors.capacity.run_until_fits`), growing
        these capacities by :meth:`grow`.

        Args:
          attempt: ``attempt(capacities) -> (result, needs)``: one run with these capacities;
            ``needs`` a :class:`Needs` when it overflowed (the run is then done again with
            grown capacities), :data:`STALE` when an atom outran the run's plan (``replan``
            then plans again, and the run is done again), else None.
          what: what overflowed, for the error.
          replan: ``replan()`` plans again after a :data:`STALE` run (at most once per call:
            a fresh plan holds the atoms where they are); None: no run goes stale.

        Returns:
          The result of the first run that fitted.

        Raises:
          RuntimeError: still overflowing after ``max_regrowths`` growths.
        """
        def grow_to(needs):
            if needs is STALE:
                replan()
            else:
                self.grow(needs)

        return run_until_fits(lambda: attempt(self._capacities), grow_to,
                              max_regrowths=self.max_regrowths + (replan is not None), what=what)
