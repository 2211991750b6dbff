"""The engine above the dispatch: one rank's program and the model that runs it on every rank.

- :mod:`~jaxdd.engine.driver` — ``compute``: the single-device reference every distributed run is checked against.
- :mod:`~jaxdd.engine.virials` — per-atom virials from the edge vectors.
- :mod:`~jaxdd.engine.rank_program` — one rank's program, its inputs, and the evaluation on a rank.
- :mod:`~jaxdd.engine.distributed` — ``DomainConfig`` and ``DistributedModel``.

What every driver (``DomainParallel``, the LAMMPS bridge, the ASE calculator) shares:

- :mod:`~jaxdd.engine.placed` — ``AtomRows``, ``RankPlan``, ``Placed``: atoms placed on the ranks (pytrees).
- :mod:`~jaxdd.engine.run_placement` — ``Placement``: atoms placed, their plan rebuilt, the ranks rebalanced.
- :mod:`~jaxdd.engine.replan_program` — a plan rebuilt on the devices, atoms migrating.
- :mod:`~jaxdd.engine.rank_forces` — the forces on one rank's owned atoms.
- :mod:`~jaxdd.engine.atom_order` — per-rank rows back in the batch's atom order.
- :mod:`~jaxdd.engine.cells` — positions carried with a moving cell (``cell_map``).
- :mod:`~jaxdd.engine.host` — ``host_array``: device arrays whole on the host.

How a system is cut and what each rank holds (partition, halo plans, migration, node blocks,
the ``shard_map`` wrapper) is the layer below, :mod:`jaxdd.decomposition`.
"""

from .distributed import DistributedModel, DomainConfig, PartitionHealth, default_mesh

__all__ = ["DistributedModel", "DomainConfig", "PartitionHealth", "default_mesh"]


def __getattr__(name: str):
    """Earlier submodule paths (``jaxdd.engine.halo``, ...), imported through the finder :mod:`jaxdd`
    installs (:mod:`jaxdd._moved`: it warns and gives the module at its present path)."""
    import importlib

    full = f"{__name__}.{name}"
    if not name.startswith("__"):
        try:
            return importlib.import_module(full)
        except ModuleNotFoundError as exc:
            if exc.name != full:
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
