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


def _pinned(cores: int) -> tuple[set, dict, object]:
    """(the first ``cores`` cores, the environment without this process's device count,
    the ``preexec_fn`` that binds a child to those cores) for a worker child."""
    import os

    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    use = set(available[:cores])
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    return use, env, (lambda: os.sched_setaffinity(0, use)) if use else None


def run_pinned(script: str, spec: dict, cores: int) -> tuple[dict, int]:
    """Run ``python script --worker <spec as JSON>`` in a child process bound to the first
    ``cores`` cores (one XLA CPU device would otherwise use them all), without this
    process's device count (the worker sets its own). Returns (the JSON of the child's last
    stdout line, the cores it had); RuntimeError with the child's stderr if it fails."""
    import json
    import os
    import subprocess
    import sys

    use, env, pin = _pinned(cores)
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env, preexec_fn=pin)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(script).name} worker {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1]), len(use) or os.cpu_count()


class PinnedWorker:
    """A child process bound to ``cores`` cores that prepares once and then times one run
    per :meth:`run` call: ``python script --worker <spec as JSON>`` talking one JSON line
    per request (see :func:`serve`). Several workers kept alive side by side, each timed in
    turn, measure every side in the same phases of a machine whose speed drifts."""

    def __init__(self, script: str, spec: dict, cores: int):
        import json
        import os
        import subprocess
        import sys
        import tempfile

        use, env, pin = _pinned(cores)
        self.cores = len(use) or os.cpu_count()
        self.spec, self.name, self._json = spec, Path(script).name, json
        # stderr to a file: a pipe nobody reads while the child runs would fill with its
        # warnings and stop it.
        self._stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, script, "--worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env, preexec_fn=pin)
        self._reply()  # the child answers once prepared (compiled, warmed)

    def _reply(self) -> dict:
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("{"):
                return self._json.loads(line)
        self.proc.wait()
        self._stderr.seek(0)
        raise RuntimeError(f"{self.name} worker {self.spec} failed:\n{self._stderr.read()[-3000:]}")

    def request(self, what: str) -> dict:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def run(self) -> dict:
        """One timed run in the child: its JSON answer (``seconds`` and what else it reports)."""
        return self.request("run")

    def close(self) -> dict:
        """End the child; its last JSON answer (e.g. its peak memory)."""
        out = self.request("stop")
        self.proc.wait()
        self._stderr.close()
        return out

    def kill(self) -> None:
        """End the child now, whatever it is doing (a failed or interrupted run)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


def serve(prepare) -> int:
    """The child's side of :class:`PinnedWorker`: ``prepare()`` returns a function timing one
    run (returning a dict with ``seconds``); answers "ready", then each "run" with that dict
    and "stop" with the peak resident memory, one JSON line each."""
    import json
    import resource
    import sys

    run = prepare()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() == "run":
            print(json.dumps(run()), flush=True)
        elif line.strip() == "stop":
            break
    print(json.dumps({"max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}), flush=True)
    return 0


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
    compiled = getattr(compiled, "compiled", compiled)  # equinox wraps jax's Compiled (driver's program)
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


def text_table(cols, lines, notes=()) -> str:
    """Rows of strings right-aligned under their column names, then one ``note:`` line each.

    Args:
      cols: the column names.
      lines: the rows, one string per column.
      notes: lines printed after the table.

    Returns:
      the table as text.
    """
    widths = [max(len(c), *(len(line[i]) for line in lines)) for i, c in enumerate(cols)]
    out = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    out += ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join(out + [f"note: {n}" for n in notes])
