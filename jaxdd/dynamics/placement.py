"""Where a run's atoms are: a state placed on the ranks from host positions, its plan rebuilt
on the devices (atoms migrating to the ranks whose blocks hold them) or on the host, and the
blocks cut again to balance the ranks."""

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
from ..engine.rank_program import Needs
from ..neighbors.capacity import Capacities
from .device_programs import carried_fields, replanned
from .io import host_array
from .state import Counters, MDState

__all__ = ["Placement", "REPLICATED", "partition_frame", "atom_order", "unwrapped_positions", "rank_of_atom",
           "with_capacities", "padded"]

REPLICATED = ("cell", "system_mask", "plan_cell")  # the plan's entries every rank holds whole


class Placement:
    """The layout of one run's atoms on the ranks, and the host work that changes it.

    Args:
      dist_model: the :class:`~jaxdd.DistributedModel` whose plans and capacities are used.
      moves_cell: the integrator moves the cell (blocks then follow it at every rebuild).
      node_blocks: the graph-parallel strategy (no atom leaves its rank; rebuilds plan on the host).

    Attributes:
      grid: the rank grid, fixed after the first partition. cuts: a balanced partition's block
      boundaries, kept between rebalancing (None: placed afresh). weights: [V] cost per atom the
      next balanced partition shares out (None: atoms). frame: the partition frame on device.
      counters: the rebuilds, migrations and rebalancings so far.
    """

    def __init__(self, dist_model, *, moves_cell: bool, node_blocks: bool):
        self.dist_model = dist_model
        self.moves_cell = moves_cell
        self.node_blocks = node_blocks
        self.grid = dist_model.config.grid
        self.cuts = None
        self.weights = None
        self.frame = None
        self.counters = Counters()

    def place(self, template: Batch, positions, velocities, forces, *, step, extra, energy) -> MDState:
        """Partition ``positions``, plan the halo and lay the atoms out on the ranks.

        Args:
          template: the batch (atoms, cell, masses ...; its positions are replaced).
          positions: [N, 3] Å, unwrapped, in the batch's order.
          velocities: [N, 3] Å per time unit, in the batch's order.
          forces: [N, 3] eV/Å in the batch's order; None: zeros.
          step: the state's step count.
          extra: the integrator's own state.
          energy: [S] eV potential energy of ``positions``; None: zeros.

        Returns:
          The placed :class:`MDState`.
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
        arrays = dict(
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
        fixed = {k: getattr(inputs, k) for k in ("local", "owned_rows", "routing", "cell", "system_mask")}
        fixed["plan_cell"] = fixed["cell"]
        energy = jnp.zeros(template.n_systems, dtype) if energy is None else energy
        # Placed as the loop returns them (per-rank rows on their device, the rest
        # replicated), so fresh, rebuilt and running states share one compiled program.
        mesh = dm.config.mesh
        replicated = NamedSharding(mesh, P())
        arrays = place_ranked(arrays, mesh, plan.ranks)
        fixed = {k: jax.device_put(v, replicated) if k in REPLICATED else place_ranked(v, mesh, plan.ranks)
                 for k, v in fixed.items()}
        energy = jax.device_put(energy, replicated)
        extra = jax.device_put(extra, replicated)
        self.frame = jax.device_put(partition_frame(template, dm.ghost_width, self.cuts), replicated)
        dm.sizing.adopt_migrate(n_owned)  # sized once; it grows when a rebuild needs more (a new program)
        return MDState(step=step, energy=energy, extra=extra, arrays=arrays, fixed=fixed, template=template,
                       layout=plan.layout, ghost_width=dm.ghost_width,
                       virial=jax.device_put(jnp.zeros((template.n_systems, 3, 3), dtype), replicated))

    def reset_frame(self, template: Batch) -> None:
        """The partition frame of ``template`` (its cell) with the kept cuts, on the devices."""
        dm = self.dist_model
        self.frame = jax.device_put(partition_frame(template, dm.ghost_width, self.cuts),
                                    NamedSharding(dm.config.mesh, P()))

    def rebuild(self, state: MDState) -> MDState:
        """Migrate the atoms of ``state`` to the ranks whose blocks hold them now and rebuild
        the halo plan, on the devices. Capacities that no longer fit grow (a new program); the
        host plans only when the blocks have changed shape beyond what the plan's exchanges
        cover. Node blocks are planned again on the host (their blocks never change)."""
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
            arrays = padded(state.arrays, layout.n_owned, mesh)
            cfg = ReplanConfig(layout=layout, n_migrate=capacities.migrate, n_systems=state.template.n_systems,
                               axes=tuple(mesh.axis_names))
            arrays, plan, report = replanned(arrays, state.fixed["cell"], state.fixed["system_mask"], self.frame,
                                             cfg, mesh, carried_fields(state.fixed["local"]), state.fixed["local"].pbc)
            report = jax.tree_util.tree_map(np.asarray, report)
            if bool(report["far"]) or bool(report["hops"]):
                return None, None  # blocks changed shape: planned on the host
            owned, exchange = int(report["owned"]), tuple(int(n) for n in report["exchange"])
            fits = owned <= layout.n_owned and all(n <= e.capacity for n, e in zip(exchange, layout.exchanges))
            if fits and int(report["migrate"]) <= capacities.migrate:
                self.counters.migrations += int(report["migrated"])
                plan["plan_cell"] = state.fixed["cell"]
                return dataclasses.replace(state, arrays=arrays, fixed={**state.fixed, **plan}, layout=layout,
                                           ghost_width=dm.ghost_width), None  # the width self.frame plans
            dm.sizing.adopt_layout(layout)  # the sizes tried grow to what the rebuild needs
            return None, Needs(owned=owned, exchange=exchange, migrate=int(report["migrate"]))

        rebuilt = dm.sizing.run_until_fits(attempt, what="the halo plan")
        return self.rebuild_on_host(state) if rebuilt is None else rebuilt

    def rebalance(self, state: MDState, weights=None) -> MDState:
        """Cut the blocks again where the atoms of ``state`` are now (each an equal share along
        each axis, of atoms or of ``weights`` [V]) and plan on the host; the step and the
        dynamics are unchanged."""
        self.counters.rebalances += 1
        self.counters.rebuilds += 1
        self.cuts = None  # the next partition places them afresh
        self.weights = weights
        return self.rebuild_on_host(state)

    def rebuild_on_host(self, state: MDState) -> MDState:
        """``state`` with a plan computed on the host from its gathered atoms (a partition afresh)."""
        self.counters.host_rebuilds += 1
        positions, velocities, forces = self.global_rows(state, "positions", "velocities", "forces")
        before = rank_of_atom(state)
        new = self.place(state.template, positions, velocities, forces, step=state.step, extra=state.extra,
                          energy=state.energy)
        new.converged = state.converged
        new.virial = state.virial
        self.counters.migrations += int(np.sum(rank_of_atom(new) != before))
        return new

    def global_rows(self, state: MDState, *keys, unwrap: bool = True):
        """Per-rank arrays of ``state`` in the batch's atom order, float64 numpy (a collective
        with several processes).

        Args:
          state: the placed state.
          keys: names of ``state.arrays`` (``"positions"``, ``"velocities"``, ``"forces"`` ...).
          unwrap: unwrap the positions by each atom's lattice image; False: exactly the plan's frame.

        Returns:
          A list of ``[V, ...]`` arrays, one per key.
        """
        t = state.template
        ids = host_array(state.arrays["ids"])
        out = []
        for key in keys:
            value = atom_order(ids, host_array(state.arrays[key]), t.n_atoms)
            if key == "positions":
                image = atom_order(ids, host_array(state.arrays["image"]), t.n_atoms) if unwrap else None
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


def padded(arrays: dict, n_owned: int, mesh) -> dict:
    """Per-rank rows ``arrays`` (``[P, n, ...]`` each) padded to ``n_owned`` rows (free rows:
    id -1), split over the ranks of ``mesh``."""
    n = arrays["ids"].shape[1]
    if n == n_owned:
        return arrays
    ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    pad = jax.jit(lambda a: {k: jnp.pad(v, [(0, 0), (0, n_owned - n)] + [(0, 0)] * (v.ndim - 2),
                                        constant_values=-1 if k == "ids" else 0) for k, v in a.items()},
                  out_shardings=ranked)
    return pad(arrays)


def atom_order(ids, rows, n_atoms: int) -> np.ndarray:
    """Per-rank rows ``[P, n, ...]`` (atom ``ids`` [P, n], -1 on free rows) in the batch's atom
    order, float64 ``[n_atoms, ...]`` (zeros for atoms no row holds)."""
    ids = np.asarray(ids).reshape(-1)
    rows = np.asarray(rows, np.float64).reshape((ids.size,) + np.shape(rows)[2:])
    out = np.zeros((n_atoms,) + rows.shape[1:])
    out[ids[ids >= 0]] = rows[ids >= 0]
    return out


def unwrapped_positions(template: Batch, frame, image=None) -> np.ndarray:
    """Positions [V, 3] Å from the plan's frame, unwrapped by the lattice ``image`` of each
    atom when given; padding rows keep the batch's own positions.

    Args:
      template: the batch (its cell, batch_idx, atom_mask and positions).
      frame: [V, 3] Å positions in the plan's wrapped frame, in the batch's order.
      image: [V, 3] int lattice vectors wrapping removed; None: not unwrapped.
    """
    if image is not None:
        cell = np.asarray(template.cell, np.float64)
        system = np.clip(np.asarray(template.batch_idx), 0, cell.shape[0] - 1)
        frame = frame + np.einsum("vi,vij->vj", image, cell[system])
    return np.where(np.asarray(template.atom_mask)[:, None], frame, np.asarray(template.positions, np.float64))


def rank_of_atom(state: MDState) -> np.ndarray:
    """The rank owning each atom of the batch of ``state``, [V] (-1: padding)."""
    ids = host_array(state.arrays["ids"])
    out = np.full(state.template.n_atoms, -1)
    rank, row = np.nonzero(ids >= 0)
    out[ids[rank, row]] = rank
    return out
