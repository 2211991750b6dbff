"""The engine above the dispatch: one rank's program and the model that runs it on every rank.

- :mod:`~jaxdd.engine.driver` — ``compute``: the single-device reference every distributed run is checked against.
- :mod:`~jaxdd.engine.virials` — per-atom virials from the edge vectors.
- :mod:`~jaxdd.engine.rank_program` — one rank's program, its inputs, and the evaluation on a rank.
- :mod:`~jaxdd.engine.distributed` — ``DomainConfig`` and ``DistributedModel``.

How a system is cut and what each rank holds (partition, halo plans, migration, node blocks,
the ``shard_map`` wrapper) is the layer below, :mod:`jaxdd.decomposition`.
"""

from .distributed import DistributedModel, DomainConfig, PartitionHealth, default_mesh

__all__ = ["DistributedModel", "DomainConfig", "PartitionHealth", "default_mesh"]


def __getattr__(name: str):
    """Earlier submodule paths (``jaxdd.decomposition.halo``, ...): see :mod:`jaxdd._moved`."""
    from .._moved import moved_attribute

    return moved_attribute(__name__, name)
