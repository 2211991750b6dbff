"""Where a run's atoms are: atoms placed on the ranks from host positions, their plan rebuilt
on the devices (atoms migrating to the ranks whose blocks hold them) or on the host, and the
blocks cut again to balance the ranks. Every driver (``DomainParallel``, the LAMMPS bridge)
places its atoms through a :class:`Placement`."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..data import Batch
from ..decomposition.halo import HaloLayout
from ..decomposition.ranks import place_ranked
from ..decomposition.replan import ReplanConfig, frame_of
from ..neighbors.capacity import Capacities
from .atom_order import atom_order, rank_of_atom, unwrapped_positions
from .host import host_array
from .placed import AtomRows, Placed, RankPlan
from .rank_program import Needs
from .replan_program import carried_fields, replanned

__all__ = ["Placement", "Counters", "partition_frame", "with_capacities", "padded"]


@dataclasses.dataclass
class Counters:
    """Events of a :class:`Placement` since it was made (host counts): plan rebuilds, those
    planned on the host, atoms that migrated to another rank, rebalancings, and steps
    evaluated and discarded (counted by the driver)."""

    rebuilds: int = 0
    host_rebuilds: int = 0
    migrations: int = 0
    rebalances: int = 0
    discarded: int = 0


class Placement:
    """The layout of one run's atoms on the ranks, and the host work that changes it.

    Args:
      dist_model: the :class:`~jaxdd.DistributedModel` whose plans and capacities are used.
      moves_cell: the integrator moves the cell (blocks then follow it at every rebuild).
      node_blocks: the graph-parallel strategy (no atom leaves its rank; rebuilds plan on the host).
      counters: the :class:`Counters` to count in (a driver's own, which may count more); None: new ones.

    Attributes:
      grid: the rank grid, fixed after the first partition. cuts: a balanced partition's block
      boundaries, kept between rebalancing (None: placed afresh). weights: [V] cost per atom the
      next balanced partition shares out (None: atoms). frame: the partition frame on device.
      counters: the rebuilds, migrations and rebalancings so far.
    """

    def __init__(self, dist_model, *, moves_cell: bool, node_blocks: bool, counters: Counters | None = None):
        self.dist_model = dist_model
        self.moves_cell = moves_cell
        self.node_blocks = node_blocks
        self.grid = dist_model.config.grid
        self.cuts = None
        self.weights = None
        self.frame = None
        self.counters = Counters() if counters is None else counters

    def place(self, template: Batch, positions, velocities, forces=None) -> Placed:
        """Partition ``positions``, plan the halo and lay the atoms out on the ranks.

        Args:
          template: the batch (atoms, cell, masses ...; its positions are replaced).
          positions: [N, 3] Å, unwrapped, in the batch's order.
          velocities: [N, 3] Å per time unit, in the batch's order.
          forces: [N, 3] eV/Å in the batch's order; None: zeros.

        Returns:
          The :class:`~jaxdd.engine.placed.Placed` atoms.
        """
        dm = self.dist_model
        batch = template.replace(positions=jnp.asarray(positions, template.positions.dtype))
        part, plan = dm.plan(batch, grid=self.grid, cuts=self.cuts, weights=self.weights)
        self.grid = part.grid  # fixed after the first partition, so plans keep their shapes
        self.cuts = part.cuts
        inputs, local_positions = dm.rank_inputs(batch, part, plan)
        if dm.capacities.neighbors is None:
            dm.sizing.adopt_neighbors(dm.size_neighbors(inputs, local_positions))
        n_owned = plan.layout.n_owned
        ids = plan.local_ids[:, :n_owned]
        valid = ids >= 0
        # Every real atom is owned by exactly one rank (of this process's ranks: by one of
        # them exactly when the partition says so).
        owned_count = np.bincount(ids[valid], minlength=batch.n_atoms)
        mine = np.isin(part.owner, plan.rank_ids) & np.asarray(batch.atom_mask)
        if np.any(owned_count[mine] != 1) or np.any(owned_count[~mine] != 0):
            bad = np.flatnonzero(np.where(mine, owned_count != 1, owned_count != 0))
            raise RuntimeError(f"atoms {bad[:8].tolist()} are owned by {owned_count[bad[:8]].tolist()} ranks after "
                               "partitioning; every atom must have exactly one owner")
        safe = np.where(valid, ids, 0)
        dtype = template.positions.dtype

        def owned(x, fill=0.0):  # host rows; placed below, each process sending only its own
            x = np.asarray(x)
            return np.asarray(np.where(valid.reshape(valid.shape + (1,) * (x.ndim - 1)), x[safe], fill), dtype)

        masses = np.asarray(template.masses, np.float64)
        rows = AtomRows(
            positions=inputs.own_pos,
            image=np.asarray(np.where(valid[..., None], part.wraps[safe], 0), np.int32),
            velocities=owned(velocities),
            forces=owned(np.zeros_like(positions) if forces is None else forces),
            ids=np.asarray(np.where(valid, ids, -1), np.int32),
            system=inputs.own_sys,
            inv_mass=owned(1.0 / masses),
            reference=inputs.own_pos,
            atomic_numbers=np.asarray(np.where(valid, np.asarray(template.atomic_numbers)[safe], 0), np.int32),
            masses=owned(masses, 1.0),
            **({"charges": owned(template.charges)} if template.charges is not None else {}),
        )
        # Placed as the device programs return them (per-rank rows on their device, the rest
        # replicated), so fresh, rebuilt and running states share one compiled program.
        mesh = dm.config.mesh
        replicated = NamedSharding(mesh, P())
        cell = jax.device_put(inputs.cell, replicated)
        ranked = place_ranked({k: getattr(inputs, k) for k in ("local", "owned_rows", "routing")}, mesh, plan.ranks)
        fixed = RankPlan(**ranked, cell=cell, system_mask=jax.device_put(inputs.system_mask, replicated),
                         plan_cell=cell)
        self.frame = jax.device_put(partition_frame(template, dm.ghost_width, self.cuts), replicated)
        dm.sizing.adopt_migrate(n_owned)  # sized once; it grows when a rebuild needs more (a new program)
        return Placed(rows=place_ranked(rows, mesh, plan.ranks), plan=fixed, template=template, layout=plan.layout,
                      ghost_width=dm.ghost_width)

    def reset_frame(self, template: Batch) -> None:
        """The partition frame of ``template`` (its cell) with the kept cuts, on the devices."""
        dm = self.dist_model
        self.frame = jax.device_put(partition_frame(template, dm.ghost_width, self.cuts),
                                    NamedSharding(dm.config.mesh, P()))

    def rebuild(self, state: Placed) -> Placed:
        """Migrate the atoms of ``state`` (a :class:`~jaxdd.engine.placed.Placed`) to the ranks
        whose blocks hold them now and rebuild the halo plan, on the devices. Capacities that no
        longer fit grow (a new program); the host plans only when the blocks have changed shape
        beyond what the plan's exchanges cover. Node blocks are planned again on the host (their
        blocks never change). Returns the rebuilt :class:`~jaxdd.engine.placed.Placed`."""
        self.counters.rebuilds += 1
        if self.node_blocks:
            return self.rebuild_on_host(state)
        dm = self.dist_model
        mesh = dm.config.mesh
        if self.moves_cell:  # blocks follow the cell: the frame of the cell now
            self.reset_frame(state.template)
        tried = []

        def attempt(capacities):
            # The state's own layout first; after a growth, the layout of the grown capacities.
            layout = with_capacities(state.layout, capacities) if tried else state.layout
            tried.append(layout)
            # Rows padded to the layout's, so a grown layout compiles one program, not two.
            rows = padded(state.rows, layout.n_owned, mesh)
            cfg = ReplanConfig(layout=layout, n_migrate=capacities.migrate, n_systems=state.template.n_systems,
                               axes=tuple(mesh.axis_names))
            plan = state.plan
            rows, new_plan, report = replanned(rows, plan.cell, plan.system_mask, self.frame, cfg, mesh,
                                               carried_fields(plan.local), plan.local.pbc)
            report = jax.tree_util.tree_map(np.asarray, report)
            if bool(report["far"]) or bool(report["hops"]):
                return None, None  # blocks changed shape: planned on the host
            owned, exchange = int(report["owned"]), tuple(int(n) for n in report["exchange"])
            fits = owned <= layout.n_owned and all(n <= e.capacity for n, e in zip(exchange, layout.exchanges))
            if fits and int(report["migrate"]) <= capacities.migrate:
                self.counters.migrations += int(report["migrated"])
                return state.replace(rows=rows, plan=plan.replace(**new_plan, plan_cell=plan.cell), layout=layout,
                                     ghost_width=dm.ghost_width), None  # the width self.frame plans
            dm.sizing.adopt_layout(layout)  # the sizes tried grow to what the rebuild needs
            return None, Needs(owned=owned, exchange=exchange, migrate=int(report["migrate"]))

        rebuilt = dm.sizing.run_until_fits(attempt, what="the halo plan")
        return self.rebuild_on_host(state) if rebuilt is None else rebuilt

    def rebalance(self, state: Placed, weights=None) -> Placed:
        """Cut the blocks again where the atoms of ``state`` (a :class:`~jaxdd.engine.placed.Placed`)
        are now (each an equal share along each axis, of atoms or of ``weights`` [V]) and plan
        on the host. Returns the replanned :class:`~jaxdd.engine.placed.Placed`."""
        self.counters.rebalances += 1
        self.counters.rebuilds += 1
        self.cuts = None  # the next partition places them afresh
        self.weights = weights
        return self.rebuild_on_host(state)

    def rebuild_on_host(self, state: Placed) -> Placed:
        """The atoms of ``state`` (a :class:`~jaxdd.engine.placed.Placed`) placed again with a plan
        computed on the host from their gathered rows (a partition afresh)."""
        self.counters.host_rebuilds += 1
        positions, velocities, forces = self.global_rows(state, "positions", "velocities", "forces")
        before = rank_of_atom(state)
        new = self.place(state.template, positions, velocities, forces)
        self.counters.migrations += int(np.sum(rank_of_atom(new) != before))
        return new

    def global_rows(self, state: Placed, *keys, unwrap: bool = True):
        """Per-rank rows of ``state`` in the batch's atom order, float64 numpy (a collective
        with several processes).

        Args:
          state: the :class:`~jaxdd.engine.placed.Placed` atoms.
          keys: names of :class:`~jaxdd.engine.placed.AtomRows` fields (``"positions"``,
            ``"velocities"``, ``"forces"`` ...).
          unwrap: unwrap the positions by each atom's lattice image; False: exactly the plan's frame.

        Returns:
          A list of ``[V, ...]`` arrays, one per key.
        """
        t = state.template
        ids = host_array(state.rows.ids)
        out = []
        for key in keys:
            value = atom_order(ids, host_array(state.rows[key]), t.n_atoms)
            if key == "positions":
                image = atom_order(ids, host_array(state.rows.image), t.n_atoms) if unwrap else None
                value = unwrapped_positions(t, value, image)
            out.append(value)
        return out


def with_capacities(layout: HaloLayout, capacities: Capacities) -> HaloLayout:
    """``layout`` with the owned rows and exchange slots of ``capacities``."""
    exchanges, offset = [], 0
    for ex, cap in zip(layout.exchanges, capacities.exchange):
        exchanges.append(dataclasses.replace(ex, offset=offset, capacity=cap))
        offset += cap
    return dataclasses.replace(layout, n_owned=capacities.owned, exchanges=tuple(exchanges))


def partition_frame(template: Batch, ghost_width: float, cuts=None):
    """The partition frame of ``template``'s cell, in float64 where JAX has it (the host
    partition's precision).

    Args:
      template: the batch (its cell and pbc).
      ghost_width: the halo's width (Å).
      cuts: a balanced partition's relative block boundaries; None: equal slices.
    """
    return frame_of(template.cell, template.pbc, ghost_width, np.float64 if jax.config.jax_enable_x64 else np.float32,
                    cuts)


def padded(rows: AtomRows, n_owned: int, mesh) -> AtomRows:
    """``rows`` padded to ``n_owned`` rows per rank (free rows: id -1).

    Args:
      rows: the :class:`~jaxdd.engine.placed.AtomRows`, ``[P, n, ...]`` each.
      n_owned: the rows each rank holds after (>= n).
      mesh: the device mesh of P ranks, which the rows are split over.

    Returns:
      The :class:`~jaxdd.engine.placed.AtomRows`, ``[P, n_owned, ...]`` each.
    """
    n = rows.ids.shape[1]
    if n == n_owned:
        return rows
    ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    pad = jax.jit(lambda a: AtomRows(**{k: jnp.pad(v, [(0, 0), (0, n_owned - n)] + [(0, 0)] * (v.ndim - 2),
                                                   constant_values=-1 if k == "ids" else 0)
                                        for k, v in a.as_dict().items()}),
                  out_shardings=ranked)
    return pad(rows)
