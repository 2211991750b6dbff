"""Atoms placed on the ranks: every rank's rows of atoms, the halo plan they run on, and the
two together with the batch they came from (pytrees, replaced rather than changed).

A driver (``DomainParallel``, the LAMMPS bridge) holds a :class:`Placed` that
:class:`~jaxdd.engine.run_placement.Placement` made and rebuilds; the device programs read
its rows and plan.
"""

from __future__ import annotations

import dataclasses

import jax

from ..data import Batch
from ..decomposition.halo import HaloLayout

__all__ = ["AtomRows", "RankPlan", "Placed"]


class _Fields:
    """Read access by name (``rows["ids"]``) and :meth:`replace`, for the frozen dataclasses here."""

    def __getitem__(self, name: str):
        """The field ``name`` (KeyError when there is none)."""
        if name not in self.names():
            raise KeyError(name)
        return getattr(self, name)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def replace(self, **changes):
        """A copy with ``changes`` (field name → new value) applied."""
        return dataclasses.replace(self, **changes)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AtomRows(_Fields):
    """The owned rows of every rank, ``[P, n_owned, ...]`` each (free rows: ``ids`` -1).

    positions: [..., 3] Å in the plan's wrapped frame. image: [..., 3] int32 lattice
    vectors the wrapping removed. velocities: [..., 3] Å per time unit. forces: [..., 3]
    eV/Å. ids: int32 global atom index. system: int32 system of each row. inv_mass: [..., 1]
    or [...] 1/amu. reference: [..., 3] Å the positions the plan was built from.
    atomic_numbers: int32. masses: amu. charges: e, or None when the batch has none.
    """

    positions: jax.Array
    image: jax.Array
    velocities: jax.Array
    forces: jax.Array
    ids: jax.Array
    system: jax.Array
    inv_mass: jax.Array
    reference: jax.Array
    atomic_numbers: jax.Array
    masses: jax.Array
    charges: jax.Array | None = None

    def as_dict(self) -> dict:
        """The rows by name (``charges`` left out when absent): the layout checkpoints store
        and :func:`~jaxdd.decomposition.replan.rank_replan` carries."""
        return {k: getattr(self, k) for k in self.names() if getattr(self, k) is not None}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RankPlan(_Fields):
    """The halo plan the rows run on.

    local: [P, n_local] every rank's local rows as a :class:`~jaxdd.Batch` (positions filled
    on device by the halo exchange). owned_rows: [P, n_local] real owned rows. routing: the
    per-rank :class:`~jaxdd.decomposition.halo.HaloRouting`. cell: [S, 3, 3] Å the cell now
    (replicated). system_mask: [S] real systems (replicated). plan_cell: [S, 3, 3] Å the cell
    the plan was built in (replicated).
    """

    local: Batch
    owned_rows: jax.Array
    routing: object
    cell: jax.Array
    system_mask: jax.Array
    plan_cell: jax.Array

    def split(self) -> tuple[dict, tuple]:
        """(the per-rank part ``{local, owned_rows, routing}``, (cell, system_mask) the same on
        every rank): how :func:`~jaxdd.engine.rank_program.run_ranks` takes a plan."""
        return ({k: getattr(self, k) for k in ("local", "owned_rows", "routing")}, (self.cell, self.system_mask))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Placed(_Fields):
    """Atoms placed on the ranks.

    rows: the :class:`AtomRows`. plan: the :class:`RankPlan` they run on. template: the batch
    (atoms, masses ...; its cell is the current one, which moves under a barostat or a
    changing box). layout (static): the plan's :class:`~jaxdd.decomposition.halo.HaloLayout`.
    ghost_width (static): the ghost shell (Å) the plan was built for, checked against the
    model before the plan is used.
    """

    rows: AtomRows
    plan: RankPlan
    template: Batch
    layout: HaloLayout = dataclasses.field(metadata=dict(static=True))
    ghost_width: float | None = dataclasses.field(default=None, metadata=dict(static=True))

    def with_cell(self, cell) -> Placed:
        """These rows in the cell ``cell`` [S, 3, 3] Å (the plan's and the template's), the
        plan unchanged."""
        return self.replace(plan=self.plan.replace(cell=cell), template=self.template.replace(cell=cell))
