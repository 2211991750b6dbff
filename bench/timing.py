"""Shared measuring helpers of the benchmarks (imported by the scripts beside it)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import jax
import numpy as np


def call_times(fn, repeat: int = 3) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn`` (results waited for), after one warm-up
    call (compilation)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return times


def median_time(fn, repeat: int = 3) -> float:
    """Median seconds of ``repeat`` calls of ``fn`` after one warm-up call (compilation)."""
    return statistics.median(call_times(fn, repeat))


def run_pinned(script: str, spec: dict, cores: int) -> tuple[dict, int]:
    """Run ``python script --worker <spec as JSON>`` in a child process bound to the first
    ``cores`` cores (one XLA CPU device would otherwise use them all), without this
    process's device count (the worker sets its own). Returns (the JSON of the child's last
    stdout line, the cores it had); RuntimeError with the child's stderr if it fails."""
    import json
    import os
    import subprocess
    import sys

    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    use = set(available[:cores])
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, preexec_fn=(lambda: os.sched_setaffinity(0, use)) if use else None)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(script).name} worker {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), len(use) or os.cpu_count()


def jax_md_loop(apply, steps: int):
    """jax-md's NVE stepping as its users write it: ``steps`` calls of ``apply`` inside one
    ``lax.fori_loop``, the neighbour list updated after each. Returns the jitted
    ``(state, nbrs) -> (state, nbrs)``; check ``nbrs.did_buffer_overflow`` after a call."""

    @jax.jit
    def loop(state, nbrs):
        def body(i, carry):
            state, nbrs = carry
            state = apply(state, neighbor=nbrs)
            return state, nbrs.update(state.position)

        return jax.lax.fori_loop(0, steps, body, (state, nbrs))

    return loop


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


_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


def collectives(compiled) -> dict:
    """Collectives of a compiled per-device program: kind → (count, bytes of their results).

    Read from the optimised HLO, so it counts what runs (fused, combined and async forms
    included); the result of an all-gather is what a rank ends up holding, of a
    collective-permute what it receives.
    """
    import re

    compiled = getattr(compiled, "compiled", compiled)
    found = {k: [0, 0] for k in _COLLECTIVES}
    shape = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
    for line in compiled.as_text().splitlines():
        m = re.search(r"=\s*(.+?)\s+(all-gather|all-reduce|reduce-scatter|collective-permute|all-to-all)(-start)?\(",
                      line)
        if m is None:
            continue
        size = 0
        for dtype, dims in shape.findall(m.group(1)):
            if dtype in _BYTES:
                size += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        if m.group(3):  # an async start's result also holds its operand: count the larger half
            size = size // 2 if m.group(2) != "all-gather" else size
        found[m.group(2)][0] += 1
        found[m.group(2)][1] += size
    return {k: tuple(v) for k, v in found.items() if v[0]}


def check_args(p, args, positive=(), choices=None) -> None:
    """Shared command-line checks: the ``positive`` integer options are >= 1, and each
    option in ``choices`` (name → allowed values) is a comma-separated list of them,
    replaced by a tuple without repeats."""
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    for name, allowed in (choices or {}).items():
        text = getattr(args, name)
        values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
        if not values or any(v not in allowed for v in values):
            p.error(f"--{name} must list some of {','.join(allowed)}, got {text!r}")
        setattr(args, name, values)
