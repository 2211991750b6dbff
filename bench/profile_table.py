"""Where a step's time goes, from a JAX profiler trace of a few steps.

    python bench/profile_table.py TRACE_DIR --hlo HLO_DIR [--steps N]

jaxdd names the parts of its programs with ``jax.named_scope``: ``jaxdd.neighbors`` (the
neighbour search and its sort), ``jaxdd.replan`` (a rebuild: migration and the new plan),
``jaxdd.model`` (the model or the pair kernel), ``jaxdd.halo`` (the halo exchanges, forward and
back) and ``jaxdd.integrate`` (the integrator's own arithmetic). XLA keeps those names in each
operation's ``op_name`` metadata. The profiler times every operation by its HLO name; the HLO
that XLA dumps (``XLA_FLAGS="--xla_dump_to=HLO_DIR --xla_dump_hlo_as_text"``, set before JAX
starts: :func:`dump_flags`) maps each name to its ``op_name``. An operation belongs to its
innermost jaxdd scope; one outside all of them is "other XLA ops". What the device (or, on a
CPU, every thread) was not busy with between the first and the last operation is "host and
gaps": the host's own work between device programs, and waits.

On a GPU the device's timeline is read (the ``/device:GPU:N`` planes); on the CPU, XLA's
operations on the host's threads, by the virtual device they ran for. The rows are averaged over
the devices. On a CPU one device's operations may overlap on several threads, so its rows may
add up to more than the wall time; "host and gaps" is then zero.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

#: jaxdd scope → the row of the table it is counted in. A user's own ``jax.named_scope`` may
#: be added here to get a row of its own.
SCOPES = {
    "jaxdd.neighbors": "neighbour search and sort",
    "jaxdd.replan": "rebuild (migration, new plan)",
    "jaxdd.model": "model or pair kernel",
    "jaxdd.halo": "halo exchange",
    "jaxdd.integrate": "integrator",
}
OTHER = "other XLA ops"
GAPS = "host and gaps"
#: HLO opcodes whose events hold other operations' events (counted through those).
CONTAINERS = ("while", "conditional", "call", "async-start", "async-done")

_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _instruction(line: str):
    """(name, opcode, op_name) of one line of HLO text, or None."""
    m = _NAME.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):  # a tuple type: skip to its closing parenthesis
        depth = 0
        for i, c in enumerate(rest):
            depth += (c == "(") - (c == ")")
            if depth == 0:
                rest = rest[i + 1:]
                break
    else:
        rest = rest.split(" ", 1)[1] if " " in rest else ""
    op = _OPCODE.match(rest)
    if not op:
        return None
    meta = _OP_NAME.search(rest)
    return m.group(1), op.group(1), meta.group(1) if meta else ""


def dump_flags(hlo_dir: str | Path, modules: str = "jit_advance|jit_replanned|jit_evaluate") -> str:
    """XLA flags that dump the optimised HLO of ``modules`` (a regex) as text into ``hlo_dir``.

    Args:
      hlo_dir: where XLA writes ``module_<id>.<name>.*after_optimizations.txt``.
      modules: which programs (jaxdd's device loop, its rebuilds and evaluations by default).

    Returns:
      The flags, to append to ``XLA_FLAGS`` before JAX initialises its backend.
    """
    return f"--xla_dump_to={hlo_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re={modules}"


def newest_trace(trace_dir: str | Path) -> Path:
    """The newest ``*.xplane.pb`` under ``trace_dir`` (the directory given to ``jax.profiler.trace``).

    Raises:
      FileNotFoundError: naming the directory, when it holds none.
    """
    found = sorted(Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {str(trace_dir)!r}: record one with "
                                "jax.profiler.trace(DIR) around a few steps")
    return found[-1]


def hlo_names(hlo_dir: str | Path) -> dict:
    """(program id, HLO name) → (opcode, op_name) of every instruction XLA dumped.

    Args:
      hlo_dir: the ``--xla_dump_to`` directory (:func:`dump_flags`).

    Returns:
      The map; program ids are the ``module_<id>`` of the file names (the profiler's
      ``program_id``). FileNotFoundError when the directory holds no optimised HLO.
    """
    files = sorted(Path(hlo_dir).glob("module_*after_optimizations.txt"))
    if not files:
        raise FileNotFoundError(f"no optimised HLO (module_*after_optimizations.txt) in {str(hlo_dir)!r}: start the "
                                f"process with XLA_FLAGS containing {dump_flags(hlo_dir)!r}")
    names = {}
    for path in files:
        program = int(path.name.split(".")[0].split("_")[1])
        for line in path.read_text().splitlines():
            found = _instruction(line)
            # A fused computation's parameters may reuse a name: the instruction that runs wins.
            if found and (found[1] != "parameter" or (program, found[0]) not in names):
                names[(program, found[0])] = found[1:]
    return names


_SCOPE = re.compile(r"jaxdd\.\w+")


def category(op_name: str) -> str:
    """The table row of an operation: its innermost jaxdd scope's, else :data:`OTHER`.

    Args:
      op_name: its ``op_name`` metadata, e.g. ``jit(advance)/.../jaxdd.integrate/jvp(jaxdd.model)/mul``
        (a gradient's operations keep their scope inside ``jvp(...)`` and ``transpose(...)``).
    """
    found = [m.group(0) for m in _SCOPE.finditer(op_name) if m.group(0) in SCOPES]
    return SCOPES[found[-1]] if found else OTHER


def _lanes(data) -> tuple[str, dict]:
    """(where, {device: [events]}) of the XLA operations a trace timed: each GPU's planes where
    there are any, else the host's threads grouped by the virtual CPU device they ran for."""
    lanes: dict = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if line.name != "XLA Modules":
                    lanes.setdefault(plane.name, []).extend(e for e in line.events if "hlo_op" in dict(e.stats))
    if any(lanes.values()):
        return "GPU", lanes
    for plane in data.planes:
        if plane.name == "/host:CPU":
            for line in plane.lines:
                for e in line.events:
                    stats = dict(e.stats)
                    if "hlo_op" in stats:
                        lanes.setdefault(stats.get("device_ordinal", 0), []).append(e)
    return "CPU device", lanes


def breakdown(trace: str | Path, hlo_dir: str | Path, steps: int) -> dict:
    """Milliseconds per step of each row of the table, from one trace.

    Args:
      trace: a ``*.xplane.pb`` file (:func:`newest_trace`).
      hlo_dir: the HLO the traced programs were compiled to (:func:`dump_flags`).
      steps: the steps the trace covers.

    Returns:
      dict: ``rows`` {row: ms per step} (averaged over devices; with "host and gaps" they add
      up to ``wall_ms``), ``wall_ms`` per step (first operation to last), ``lanes`` (devices), ``where``,
      ``unnamed`` (operations not found in the HLO: counted as other XLA ops).
    """
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(trace))
    names = hlo_names(hlo_dir)
    where, lanes = _lanes(data)
    rows = {row: 0.0 for row in (*dict.fromkeys(SCOPES.values()), OTHER)}
    first, last, unnamed, n = None, None, 0, 0
    for events in lanes.values():
        spans = []
        for e in events:
            stats = dict(e.stats)
            opcode, op_name = names.get((stats.get("program_id"), stats["hlo_op"]), ("", ""))
            if opcode in CONTAINERS:
                continue
            unnamed += not opcode
            rows[category(op_name)] += e.duration_ns
            spans.append((e.start_ns, e.end_ns))
        if spans:
            n += 1
            first = min([s for s, _ in spans] + ([first] if first is not None else []))
            last = max([t for _, t in spans] + ([last] if last is not None else []))
    if not n:
        raise ValueError(f"{trace} holds no XLA operation: was the trace recorded around the steps?")
    wall = (last - first) / 1e6 / steps
    out = {row: ns / n / 1e6 / steps for row, ns in rows.items()}
    out[GAPS] = max(wall - sum(out.values()), 0.0)
    return dict(rows=out, wall_ms=wall, lanes=n, where=where, unnamed=unnamed)


def record(run, trace_dir: str | Path, hlo_dir: str | Path, steps: int) -> dict:
    """Trace ``run()`` (``steps`` steps, blocking until they are done) and break it down.

    Args:
      run: a callable that runs the steps and returns when they are done.
      trace_dir: where ``jax.profiler.trace`` writes (a new folder per call).
      hlo_dir: the process's ``--xla_dump_to`` folder (:func:`dump_flags`).
      steps: the steps ``run`` makes.

    Returns:
      :func:`breakdown`'s dict, with ``trace`` (the trace file's path).
    """
    import jax

    with jax.profiler.trace(str(trace_dir)):
        jax.block_until_ready(run())
    trace = newest_trace(trace_dir)
    return dict(breakdown(trace, hlo_dir, steps), trace=str(trace))


def record_md(md, state, profile) -> dict:
    """:func:`record` of ``DomainParallel`` steps from ``state``, as the benchmarks' rows take it.

    Args:
      md: the ``DomainParallel`` (already compiled: its timed runs came first).
      state: the state the traced steps start from.
      profile: (trace folder, HLO dump folder, steps).

    Returns:
      :func:`record`'s dict.
    """
    trace_dir, hlo_dir, steps = profile
    return record(lambda: md.run(state, steps).arrays["positions"], trace_dir, hlo_dir, steps)


def format_table(result: dict, title: str = "") -> str:
    """The breakdown as text: ms per step and share of the wall time, a row per part."""
    wall = result["wall_ms"]
    head = f"{wall:.3f} ms per step averaged over {result['lanes']} {result['where']}(s)"
    lines = [f"{title}: {head}" if title else head, f"  {'part':32s} {'ms/step':>10s} {'share':>7s}"]
    for row, ms in result["rows"].items():
        lines.append(f"  {row:32s} {ms:10.4f} {ms / wall if wall else 0.0:7.1%}")
    if result.get("unnamed"):
        lines.append(f"  ({result['unnamed']} operation(s) not in the dumped HLO, counted as {OTHER})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("trace_dir", type=Path, help="the directory given to jax.profiler.trace")
    p.add_argument("--hlo", type=Path, required=True, help="the --xla_dump_to directory of the traced process")
    p.add_argument("--steps", type=int, default=1, help="steps the trace covers (figures are per step)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    try:
        trace = newest_trace(args.trace_dir)
        print(format_table(breakdown(trace, args.hlo, args.steps), str(args.trace_dir)))
    except (FileNotFoundError, ValueError) as e:
        print(f"profile_table: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
