"""How a system is cut into ranks and what each rank holds (below the dispatch and the engine).

- :mod:`~jaxdd.decomposition.partition` — spatial blocks of a rank grid (host).
- :mod:`~jaxdd.decomposition.halo` — the ghost shell of every rank and the exchanges that fill it.
- :mod:`~jaxdd.decomposition.replan` — migration and the halo plan again, on the devices (dynamics).
- :mod:`~jaxdd.decomposition.graph_partition` — contiguous node blocks, no ghost shell.
- :mod:`~jaxdd.decomposition.guardrail` — each rank's share before compiling: warn or refuse an oversized halo.
- :mod:`~jaxdd.decomposition.ranks` — the one ``shard_map`` wrapper, per-rank placement, agreement over processes.
"""
