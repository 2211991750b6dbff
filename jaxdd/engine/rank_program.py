"""One rank's program: what it is compiled for, what it is fed, and how it runs on the ranks.

- :class:`RankProgram` (static, hashable): the halo layout, the capacities, the neighbour
  search, the storage policy and the outputs; equal programs share one compiled program.
- :class:`RankInputs` (a pytree): every rank's rows stacked on a leading ``[P]`` axis, the
  arrays the program reads, with its :class:`RankProgram` as static metadata.
- :func:`rank_evaluate`: one rank's share of an evaluation (energy, its gradients).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ..adapters import AdapterRegistry
from ..neighbors.capacity import Capacities
from ..context import DDContext, dd_scope
from ..data import Batch
from ..dispatch import DispatchError, DispatchReport, Kind, Runtime, call_model, unfollowed_error
from ..decomposition.graph_partition import block_neighbor_list, gathered_inputs
from ..decomposition.halo import HaloLayout, halo_forward
from ..decomposition.ranks import place_ranked
from ..neighbors import (NeighborCapacity, NeighborListFormat, NeighborStats, build_neighbor_list, edge_vectors,
                         local_neighbor_list)
from ..segments import per_system_sum
from ..spec import MLIPSpec
from ..virials import atomic_virials, enforce_sum_rule

__all__ = ["RankProgram", "RankInputs", "ReportSink", "rank_evaluate", "rank_neighbors", "neighbor_needs",
           "neighbor_stats"]


class ReportSink:
    """Dispatch reports of the programs one ``DistributedModel`` traced, by program."""

    def __init__(self):
        self._reports = {}

    def put(self, program: RankProgram, report: DispatchReport) -> None:
        self._reports[program.key] = report

    def get(self, program: RankProgram | None) -> DispatchReport | None:
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

    @property
    def key(self) -> RankProgram:
        """This program without its report sink: equal for programs that compile alike."""
        return dataclasses.replace(self, sink=None)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    @property
    def n_ranks(self) -> int:
        return int(self.mesh.size)

    @property
    def capacities(self) -> Capacities:
        """The program's capacities as one value."""
        return Capacities(owned=self.layout.n_owned, exchange=tuple(e.capacity for e in self.layout.exchanges),
                          neighbors=self.nl_capacity)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankInputs:
    """The arrays a :class:`RankProgram` reads; ``[P, ...]`` fields hold every rank's rows.

    local: [P, n_local] rows as a :class:`~jaxdd.Batch` (positions filled on device by the
    halo exchange). own_pos: [P, n_owned, 3] Å owned positions in the partition's wrapped
    frame. own_sys: [P, n_owned] their systems. owned_rows: [P, n_local] real owned rows.
    routing: the halo plan's per-rank routing. cell: [S, 3, 3] Å. system_mask: [S].
    gather: [N'] where each atom's owned row lands in the flattened ``[P * n_owned]`` outputs
    (N' = the atom count's bucket; padding atoms read a zero row).
    program (static): the program these inputs are laid out for. n_atoms (static): atoms
    of the batch, the rows outputs are cut back to.
    """

    local: Batch
    own_pos: jax.Array
    own_sys: jax.Array
    owned_rows: jax.Array
    routing: object
    cell: jax.Array
    system_mask: jax.Array
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


def neighbor_stats(needed: dict) -> NeighborStats:
    """The :class:`~jaxdd.neighbors.NeighborStats` of the sizes :func:`neighbor_needs` returned."""
    return NeighborStats(
        edges=int(needed["edges"]),
        neighbors=int(needed["neighbors"]),
        candidates=int(needed["candidates"]),
        search_range=tuple(int(x) for x in np.asarray(needed["range"])),
        bins=int(needed["bins"]),
    )


def neighbor_needs(nl, axes) -> tuple[jax.Array, dict]:
    """(overflow on any rank [] bool, the sizes the ranks' lists needed), both the same on every rank."""
    needed = dict(
        edges=jax.lax.pmax(nl.n_edges, axes),
        neighbors=jax.lax.pmax(jnp.max(nl.num_neighbors), axes),
        candidates=jax.lax.pmax(nl.needed_candidates, axes),
        range=jax.lax.pmax(nl.needed_range, axes),
        bins=jax.lax.pmax(nl.needed_bins, axes),
    )
    return jax.lax.pmax(nl.overflow.astype(jnp.int32), axes) > 0, needed


def half_list_order(row_ids, row_shifts):
    """The half-list keys of a rank's rows (``order`` of :func:`jaxdd.neighbors.build_neighbor_list`):
    the global atom id, and the image shift packed in one int32 (images within ±512 cells,
    10 bits per axis), so that the rows of one atom's images differ.

    Args:
      row_ids: [n_local] int32 global id of each row. row_shifts: [n_local, 3] int32 image
        shift of each row, in cell vectors (numpy or jax arrays).

    Returns:
      (key a [n_local], key b [n_local]) int32.
    """
    s = row_shifts + 512
    return row_ids, (s[:, 0] << 20) | (s[:, 1] << 10) | s[:, 2]


def rank_neighbors(positions, local, program: RankProgram, cell=None, routing=None):
    """This rank's neighbour list over its local rows ([n_local, 3] Å, ghosts included) for the
    model's search cutoff; only owned rows are receivers unless the halo is deep. Under the
    graph-parallel strategy the search runs over every rank's rows (gathered here) in the
    real ``cell`` ([S, 3, 3]) with the batch's pbc, and senders index the stacked rows.
    A half list keeps each pair on one rank: the edge from the row that the parity rule of
    :func:`jaxdd.neighbors.build_neighbor_list` picks by (global id, image shift), which needs
    this rank's ``routing`` (its rows' ids and shifts)."""
    layout, n_sys = program.layout, program.n_systems
    if program.strategy == "graph_partition":
        all_pos, all_sys, all_mask = gathered_inputs(local, positions, program.axes)
        return block_neighbor_list(
            all_pos, jax.lax.stop_gradient(cell), local.pbc, all_sys, all_mask, jax.lax.axis_index(program.axes),
            layout.n_owned, cutoff=program.search_cutoff, capacity=program.nl_capacity, format=program.nl_format)
    if program.periodic_search:  # periodic along the axes the grid leaves whole, open along the others
        return build_neighbor_list(
            jax.lax.stop_gradient(positions), jax.lax.stop_gradient(cell), local.pbc, local.batch_idx, local.atom_mask,
            cutoff=program.search_cutoff, capacity=program.nl_capacity, format=program.nl_format,
            n_receivers=layout.n_owned)
    order = half_list_order(routing.row_ids, routing.row_shifts) if program.nl_half else None
    return local_neighbor_list(
        jax.lax.stop_gradient(positions), local.batch_idx, local.atom_mask, n_systems=n_sys,
        cutoff=program.search_cutoff, capacity=program.nl_capacity, format=program.nl_format,
        n_receivers=layout.n_local if program.deep else layout.n_owned, backend=program.nl_backend,
        half=program.nl_half, order=order)


def rank_evaluate(model, local, own_pos, own_sys, owned_rows, routing, cell, system_mask, program: RankProgram,
                  report: DispatchReport, *, forces: bool = True, stress: bool = False, virials: bool = False,
                  neighbors=None):
    """One rank's share of a distributed evaluation; call inside :func:`~jaxdd.decomposition.ranks.on_ranks` on one rank's rows.

    Args:
      own_pos: [n_owned, 3] Å owned positions (in the partition's wrapped frame).
      own_sys: [n_owned] system of each owned row. owned_rows: [n_local] real owned rows.
      local, routing: this rank's slice of :class:`RankInputs`. cell: [S, 3, 3] Å.
      system_mask: [S]. forces, stress: which gradients to take. virials: also the per-atom
        virials of the owned atoms (:mod:`jaxdd.virials`; a full COO list, halo strategy).
      neighbors: a list from :func:`rank_neighbors` to reuse (built for a model that
        declares a neighbour skin, while no atom has moved half of it); None builds one.

    Returns:
      ``(per_system [S] eV, out, lays, nl, g_pos [n_owned, 3] or None, g_strain [S, 3, 3] or
      None, atomic_virials [n_owned, 3, 3] or None)``: the model's outputs and their dispatch
      layouts, the neighbour list, this rank's share of the gradients (forces are ``-g_pos``;
      the virial is the psum of ``g_strain``) and its owned atoms' virials (NaN when they
      break the sum rule on any rank: see :func:`jaxdd.virials.refuse_broken`).
    """
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
    return per_system, out, lays, nl, g_pos, g_strain, w_atoms


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
        return call_model(model, batch, runtime, report)
