"""The decomposition engine: how a system is cut, what each rank holds, and how it runs.

- :mod:`~jaxdd.engine.partition` — spatial blocks of a rank grid (host).
- :mod:`~jaxdd.engine.halo` — the ghost shell of every rank and the exchanges that fill it.
- :mod:`~jaxdd.engine.replan` — migration and the halo plan again, on the devices (dynamics).
- :mod:`~jaxdd.engine.graph_partition` — contiguous node blocks, no ghost shell.
- :mod:`~jaxdd.engine.rank_program` — one rank's program, its inputs, the ``shard_map`` wrapper.
- :mod:`~jaxdd.engine.guardrail` — each rank's share before compiling: warn or refuse an oversized halo.
- :mod:`~jaxdd.engine.distributed` — ``DomainConfig`` and ``DistributedModel``.

Each module is also importable by its earlier name (``jaxdd.halo``, ``jaxdd.distributed``, ...):
the same module object.
"""

#: The engine's modules, by name.
MODULES = ("partition", "halo", "replan", "graph_partition", "rank_program", "distributed")
