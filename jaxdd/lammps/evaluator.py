"""``ForceEvaluator``: a jaxdd model evaluated at the positions LAMMPS hands over, one call per
time step, with the plan of the decomposition and the neighbour lists kept on the devices.

The first call partitions the atoms and plans the halo on the host
(:class:`~jaxdd.engine.run_placement.Placement`, as ``DomainParallel`` does). Later calls run
one device program (:func:`~jaxdd.lammps.device.callback_step`): LAMMPS's positions go into
the plan's rows, forces come back in LAMMPS's order. The plan is rebuilt, on the devices
(atoms migrating between ranks), when an atom has moved half the domain skin since it was
built; a neighbour list with a skin is rebuilt inside the program when an atom has moved half
the model's skin. The host plans again only when the atoms themselves change (created,
deleted, retyped).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ..data import AtomicData, as_batch
from ..decomposition.ranks import place_ranked
from ..engine import DistributedModel, DomainConfig, default_mesh
from ..engine.host import host_array
from ..engine.placed import Placed
from ..engine.rank_program import STALE, Needs
from ..engine.run_placement import Counters, Placement
from ..model.protocol import check_cell_width
from .device import StepSettings, built_lists, callback_step

__all__ = ["ForceEvaluator", "Result"]


@dataclasses.dataclass(frozen=True)
class Result:
    """One evaluation, in LAMMPS's order of its local atoms (numpy float64).

    energy: eV. forces: [N, 3] eV/Å. virial: [3, 3] eV, W = -dE/dε (LAMMPS's virial
    Σ r ⊗ f; zeros when not computed). atomic_energies: [N] eV, atomic_virials: [N, 3, 3]
    eV (summing to ``virial``), or None when not asked for.
    """

    energy: float
    forces: np.ndarray
    virial: np.ndarray
    atomic_energies: np.ndarray | None = None
    atomic_virials: np.ndarray | None = None


@dataclasses.dataclass
class Counts(Counters):
    """What the evaluator did so far: calls, host placements, and its
    :class:`~jaxdd.engine.run_placement.Placement`'s events (plan rebuilds, those planned on
    the host, migrations; ``discarded``: evaluations repeated on a new plan because an atom
    outran the old one)."""

    calls: int = 0
    placements: int = 0

    @property
    def repeated(self) -> int:
        """Evaluations repeated on a new plan (``discarded``)."""
        return self.discarded


class ForceEvaluator:
    """A model evaluated under domain decomposition at positions given from outside.

    Args:
      model: a :class:`~jaxdd.BaseModel`, or a :class:`~jaxdd.DistributedModel` (its
        ``DomainConfig.skin`` must be > 0).
      skin: the ghost shell beyond the model's neighbour range (Å) when ``model`` is a bare
        model: atoms may move half of it before the plan is rebuilt.
      mesh: the device mesh (default: every device of the process, or a DistributedModel's own).
      grid: the rank grid ``(nx, ny, nz)`` (default: the least-surface one, or a
        DistributedModel's own). Given with a DistributedModel, they fill in what its
        ``DomainConfig`` leaves open; one that differs from what it sets is a ValueError.
      virial: compute the global virial at every call (barostats and pressures need it).
      atom_terms: compute per-atom energies and virials too (the model must output
        ``atomic_energies`` and use a full neighbour list).

    Attributes:
      dist_model: the :class:`~jaxdd.DistributedModel` evaluated. settings: the
      :class:`~jaxdd.lammps.device.StepSettings` of its program. placement: where the atoms
      are on the ranks. counts: a :class:`Counts` of what was done so far. placed: the atoms
      on the ranks, a :class:`~jaxdd.engine.placed.Placed` (None before the first call).
    """

    def __init__(self, model, *, skin: float = 2.0, mesh=None, grid=None, virial: bool = True,
                 atom_terms: bool = False):
        if isinstance(model, DistributedModel):
            dm = distributed_on(model, mesh, grid)
        else:
            nc = model.model_config.neighbor_config
            if nc is None:
                raise ValueError(f"{type(model).__name__} declares no neighbor_config; the bridge needs a cutoff")
            if not (isinstance(skin, (int, float)) and math.isfinite(skin) and skin > 0):
                raise ValueError(f"skin must be a number > 0 (Å of ghost shell beyond the cutoff), got {skin!r}")
            mesh = default_mesh(jax.devices()) if mesh is None else mesh
            dm = DistributedModel(model, DomainConfig(nc.cutoff, skin=max(float(skin), nc.skin), mesh=mesh, grid=grid))
        cfg = dm.config
        if not cfg.skin > 0:
            raise ValueError(f"DomainConfig.skin must be > 0 for the plan to outlast a step, got {cfg.skin}: build the "
                             "DistributedModel with DomainConfig(..., skin=2.0) (Å), or hand over the bare model")
        node_blocks = dm.strategy == "graph_partition"
        if atom_terms:
            _check_atom_terms(dm, node_blocks)
        nc = dm.model.model_config.neighbor_config
        # As DomainParallel: a plan with nothing to outrun (node blocks, or one rank searching
        # its periodic images itself) is kept; otherwise atoms may move half the domain skin.
        keeps_plan = node_blocks or (dm.periodic_search and int(cfg.mesh.size) == 1)
        threshold = math.inf if keeps_plan else min(cfg.migration_hysteresis, cfg.skin / 2)
        self.dist_model = dm
        self.settings = StepSettings(threshold=float(threshold), ghost_width=float(dm.ghost_width),
                                     nl_skin=float(nc.skin), search_cutoff=float(nc.search_cutoff),
                                     virial=bool(virial), atom_terms=bool(atom_terms))
        self.counts = Counts()
        self.placement = Placement(dm, moves_cell=True, node_blocks=node_blocks, counters=self.counts)
        self.placed: Placed | None = None
        self._kept = None
        self._kept_for = None
        self._tags = None
        self._sorted_tags = None
        self._numbers = None
        self._maps = None
        self._pending = False
        self._static = self._program_for = self._pbc = None
        self._dtype = np.float64 if jax.config.jax_enable_x64 else np.float32

    @property
    def mesh(self):
        """The device mesh the model runs on."""
        return self.dist_model.config.mesh

    def __call__(self, tags, positions, atomic_numbers, cell, origin=(0.0, 0.0, 0.0), pbc=(True, True, True)) -> Result:
        """Energy, forces and virial of the atoms now.

        Args:
          tags: [N] int atom ids (LAMMPS's ``tag``), each once.
          positions: [N, 3] Å, in the order of ``tags`` (wrapped or not).
          atomic_numbers: [N] int species of each atom.
          cell: [3, 3] Å the box, rows the lattice vectors (LAMMPS's a, b, c).
          origin: [3] Å the box's lower corner (LAMMPS's ``boxlo``).
          pbc: 3 bools, the periodic axes.

        Returns:
          A :class:`Result` in the order of ``tags``.
        """
        self.counts.calls += 1
        tags = np.asarray(tags)
        numbers = np.asarray(atomic_numbers)
        x = np.asarray(positions, self._dtype)  # LAMMPS's own array, not a copy, in float64
        cell = np.asarray(cell, np.float64).reshape(1, 3, 3)
        origin = np.asarray(origin, np.float64).reshape(3)
        pbc = np.asarray(pbc, bool).reshape(1, 3)
        # The box moves under fix deform, npt or box/relax: a minimum-image model is checked at
        # every call, not only when the atoms were placed.
        check_cell_width(self.dist_model.model, cell, pbc, at=f" LAMMPS passed at call {self.counts.calls}")
        if self.placed is None or not self._same_atoms(tags, numbers, pbc):
            self._place(tags, x, numbers, cell, origin, pbc)
        elif not np.array_equal(tags, self._tags):  # LAMMPS sorted its atoms: same atoms, new order
            self._tags, self._numbers = tags.copy(), numbers.copy()
            self._maps = None
        if self._pending:
            self._rebuild(self.placed.plan.cell)
        # Host arrays, handed to the program as they are (a transfer per call; the positions are
        # LAMMPS's own buffer).
        out, flags = self._step(x, cell.astype(self._dtype), origin.astype(self._dtype), pbc)
        self._pending = bool(flags[1])
        n_sys = 0
        get = lambda k: np.asarray(out[k], np.float64) if k in out else None  # noqa: E731
        return Result(energy=float(get("energy")[n_sys]), forces=get("forces"), virial=get("virial")[n_sys],
                      atomic_energies=get("atomic_energies"), atomic_virials=get("atomic_virials"))

    # ------------------------------------------------------------------ host side

    def _same_atoms(self, tags, numbers, pbc) -> bool:
        """Whether the atoms (their ids, species and the periodic axes) are those placed."""
        if tags.shape != self._tags.shape or not np.array_equal(pbc, self._pbc):
            return False
        if np.array_equal(tags, self._tags):
            return np.array_equal(numbers, self._numbers)
        order = np.argsort(tags, kind="stable")
        return np.array_equal(tags[order], self._sorted_tags) and np.array_equal(numbers[order],
                                                                                 self._numbers[np.argsort(self._tags)])

    def _place(self, tags, x, numbers, cell, origin, pbc) -> None:
        """Partition the atoms and plan on the host; ids are the ranks of the tags in order."""
        if len(np.unique(tags)) != len(tags):
            raise ValueError("atom ids (LAMMPS tags) must be unique; the bridge maps atoms by their ids")
        order = np.argsort(tags, kind="stable")
        positions = x[order] - origin
        data = AtomicData(positions=positions.astype(self._dtype), atomic_numbers=numbers[order],
                          cell=cell[0].astype(self._dtype), pbc=pbc[0], masses=np.ones(len(tags), self._dtype))
        batch = as_batch(data)
        self.dist_model.model.validate_input(batch)
        self.placement.cuts = self.placement.weights = None
        self.placed = self.placement.place(batch, positions, np.zeros_like(positions))
        self.counts.placements += 1
        self._tags, self._sorted_tags, self._numbers, self._pbc = tags.copy(), tags[order], numbers.copy(), pbc.copy()
        self._maps = self._kept = None
        self._pending = False

    def _rebuild(self, cell) -> None:
        """Rebuild the plan on the devices from the rows' current positions, in ``cell``."""
        self.placed = self.placement.rebuild(self.placed.with_cell(cell))  # counted in self.counts
        self._maps = self._kept = None
        self._pending = False

    def _advance(self, out, cell) -> None:
        """Keep the rows' new positions, the cell they are in and the kept lists."""
        placed = self.placed
        self.placed = placed.replace(rows=placed.rows.replace(positions=out["positions"])).with_cell(cell)
        self._kept = out["kept"]

    def _index_maps(self):
        """(rows_of [P, n_owned] on the ranks, slot_of [N] replicated): where each row's atom is
        in LAMMPS's arrays, and where each LAMMPS atom's row is in the flattened rows."""
        if self._maps is None:
            ids = host_array(self.placed.rows.ids)
            lammps_of_id = np.argsort(self._tags, kind="stable")  # id k = the k-th smallest tag
            rows_of = np.where(ids >= 0, lammps_of_id[np.maximum(ids, 0)], -1).astype(np.int32)
            flat = ids.reshape(-1)
            row_of_id = np.empty(len(self._tags), np.int64)
            row_of_id[flat[flat >= 0]] = np.flatnonzero(flat >= 0)
            slot_of = np.empty(len(self._tags), np.int32)
            slot_of[lammps_of_id] = row_of_id
            self._maps = (place_ranked(rows_of, self.mesh), jax.device_put(slot_of, NamedSharding(self.mesh, P())))
        return self._maps

    def _program(self):
        """The rank program of the current layout and capacities (made again only when they change)."""
        key = (self.placed.layout, self.dist_model.capacities)
        if self._program_for != key:
            outputs = ("energy", "atomic_energies", "forces") if self.settings.atom_terms else ("energy", "forces")
            self._static = self.dist_model.program(self.placed.template.n_systems, outputs, self.placed.layout)
            self._program_for = key
        return self._static

    def _step(self, x, cell, origin, pbc):
        """One evaluation (:func:`~jaxdd.lammps.device.callback_step`) at LAMMPS's positions ``x``
        [N, 3] Å in the box ``cell`` [1, 3, 3] Å (``origin`` [3] Å, ``pbc`` [1, 3]), done again
        until it fits: capacities grown after an overflow, the plan rebuilt from where the atoms
        are when one outran it (that evaluation may have missed neighbours). The rows keep the
        new positions. Returns (its outputs, its flags far, ahead, overflow as host bools)."""

        def attempt(_):
            placed, static = self.placed, self._program()
            rows_of, slot_of = self._index_maps()
            if self.settings.keeps_list and (self._kept is None or self._kept_for != static.key):
                self._kept, self._kept_for = built_lists(placed.rows, placed.plan, static), static.key
            out = callback_step(self.dist_model.model, placed.rows, placed.plan.replace(cell=cell), self._kept, x,
                                rows_of, slot_of, origin, cell, placed.plan.cell, pbc, static, self.settings)
            self._kept = None  # spent (donated); the caller keeps the returned lists
            flags = np.asarray(out["flags"])
            if flags[0]:
                self._advance(out, cell)  # plan again from the rows' new positions
                return (out, flags), STALE
            needs = Needs.of_neighbors(flags[2], out["needed"])
            if needs is None:
                self._advance(out, cell)
            return (out, flags), needs

        def replan():
            self.counts.discarded += 1
            self._rebuild(cell)

        return self.dist_model.sizing.run_until_fits(attempt, replan=replan)


def distributed_on(dm: DistributedModel, mesh, grid) -> DistributedModel:
    """``dm`` on ``mesh`` and ``grid`` where given: those its ``DomainConfig`` leaves None are
    filled in (a new DistributedModel); one it sets otherwise is a ValueError naming both."""
    cfg, changes = dm.config, {}
    if grid is not None:
        grid = tuple(int(g) for g in grid)
        if cfg.grid is not None and tuple(cfg.grid) != grid:
            raise ValueError(f"grid {grid} differs from the DistributedModel's DomainConfig.grid {tuple(cfg.grid)}: "
                             "give one of them (drop --grid, or build the DomainConfig with the grid wanted)")
        if cfg.grid is None:
            changes["grid"] = grid
    if mesh is not None:
        ids = [d.id for d in mesh.devices.flat]
        if cfg.mesh is not None and [d.id for d in cfg.mesh.devices.flat] != ids:
            raise ValueError(f"the mesh of devices {ids} differs from the DistributedModel's DomainConfig.mesh "
                             f"(devices {[d.id for d in cfg.mesh.devices.flat]}): give one of them")
        if cfg.mesh is None:
            changes["mesh"] = mesh
    if not changes:
        return dm
    return DistributedModel(dm.model, dataclasses.replace(cfg, **changes), dm.spec)


def _check_atom_terms(dm: DistributedModel, node_blocks: bool) -> None:
    """Refuse per-atom terms a model or strategy cannot give, naming why."""
    model = dm.model
    name = type(model).__name__
    if node_blocks:
        raise ValueError("per-atom virials are assigned through each rank's full neighbour list (the halo "
                         "strategy); this DistributedModel runs node blocks: use DomainConfig(strategy='halo')")
    if "atomic_energies" not in model.model_config.outputs:
        raise ValueError(f"{name} has no 'atomic_energies' output; per-atom energies and virials need it")
    if model.model_config.neighbor_config.half_list:
        raise ValueError(f"{name} uses a half neighbour list; per-atom virials need a full one (half_list=False)")

