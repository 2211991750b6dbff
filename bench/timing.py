"""Shared measuring helpers of the benchmarks (imported by the scripts beside it)."""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np


def median_time(fn, repeat: int = 3) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after one warm-up call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cost(compiled) -> dict:
    """XLA's cost analysis of a compiled program: flops, bytes accessed, memory (B) or None."""
    compiled = getattr(compiled, "compiled", compiled)  # equinox wraps jax's Compiled
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0]
    memory = compiled.memory_analysis()
    mem = None
    if memory is not None:
        mem = memory.argument_size_in_bytes + memory.temp_size_in_bytes + memory.output_size_in_bytes
    return {"flops": float(analysis.get("flops", np.nan)), "bytes": float(analysis.get("bytes accessed", np.nan)),
            "memory": mem}


def write_record(path, record: dict) -> None:
    """Write a benchmark's figures as JSON at ``path`` with the versions that produced them."""
    import json
    import platform

    import jaxdd

    record = dict(record, jax=jax.__version__, jaxdd=jaxdd.__version__, python=platform.python_version())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")
