"""Several processes and hosts: ``jax.distributed`` set up for jaxdd, and a local launcher.

jaxdd runs on JAX's multi-controller runtime unchanged: every process runs the same
script, sees the global device mesh (``jax.devices()``) and feeds only its own devices
(``jax.local_devices()``). Call :func:`initialize` first thing in the script, before any
JAX computation::

    import jaxdd.launch
    jaxdd.launch.initialize()        # reads the cluster's environment
    import jaxdd
    ...                              # the same code as on one process

Where the settings come from, first match wins:

1. the arguments of :func:`initialize`;
2. ``JAXDD_COORDINATOR`` (``host:port``), ``JAXDD_NUM_PROCESSES``, ``JAXDD_PROCESS_ID``
   (set by ``python -m jaxdd.launch`` on one machine, or by a pod spec);
3. JAX's own detection: SLURM (``srun``; one task per GPU or per host), Open MPI,
   Kubernetes indexed jobs, ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
   ``JAX_PROCESS_ID``.

On CPUs the collectives run over gloo (selected here); on GPUs over NCCL.

When one process fails the others are ended, whatever the cause:

- an uncaught exception, ``sys.exit(n)`` with ``n != 0``, Ctrl-C (SIGINT): the process
  prints its traceback and leaves at once with its status (1, ``n``, or by SIGINT).
  :func:`initialize` arranges this: JAX's own exit handler waits in a shutdown barrier for
  every process, so the failing one would stay alive, heartbeats and all, while the others
  wait for it in their next collective, and the run would hang until the barrier times out;
- SIGKILL, a crash, a lost host: the process is gone at once.

The others then fail in their next collective: at once on CPUs, where gloo sees the
connection closed (and they leave as above), else after ``heartbeat_timeout_s``, when the
coordination service misses the heartbeats of the one gone and ends every other process
with an error naming it.

``python -m jaxdd.launch -n 2 [--cpu-devices 2] script.py [args]`` (or ``-m module [args]``,
e.g. ``-m jaxdd.validate``) starts ``n`` processes on this machine with a local coordinator
and prefixes their output with their process id. When one fails it names it on stderr
(``process 1 exited with status 1``, ``... with signal 9 (SIGKILL)``), kills those still
running after ``--grace`` seconds, and exits with the first failure's status (128 + the
signal for a signal). SIGINT or SIGTERM sent to the launcher is passed on to the processes,
with the same grace.
"""

from __future__ import annotations

import argparse
import atexit
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

__all__ = ["initialize", "is_initialized", "main"]

_ENV = ("JAXDD_COORDINATOR", "JAXDD_NUM_PROCESSES", "JAXDD_PROCESS_ID")


def is_initialized() -> bool:
    """True once ``jax.distributed`` is up in this process."""
    from jax._src import distributed

    return distributed.global_state.client is not None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None, heartbeat_timeout_s: int = 30,
               initialization_timeout_s: int = 300) -> bool:
    """Join this process to a multi-process run; call before any JAX computation.

    Unset values come from ``JAXDD_*`` variables, then JAX's cluster detection (module
    docstring). Calling it again is harmless.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: the run's size.
      process_id: this process's index (0-based).
      local_device_ids: the devices this process drives (default: all it sees; one GPU per
        process on a pod).
      heartbeat_timeout_s: how long a silent peer is waited for before every process is ended, s.
      initialization_timeout_s: how long joining waits for every process to arrive, s.

    Returns:
      False (doing nothing) when no multi-process setting is found, so a script runs
      unchanged on one process; True once joined.

    Once joined, a process that fails (uncaught exception, ``sys.exit(n)`` with ``n != 0``,
    Ctrl-C) leaves at once with its status instead of waiting in JAX's shutdown barrier, so
    the others are ended too (module docstring); ``sys.excepthook`` and ``sys.exit`` are
    wrapped to see it.
    """
    import jax

    if is_initialized():
        _end_promptly_on_failure()
        return True
    env = {k: os.environ.get(k) for k in _ENV}
    coordinator_address = coordinator_address or env["JAXDD_COORDINATOR"]
    num_processes = num_processes if num_processes is not None else _int(env, "JAXDD_NUM_PROCESSES")
    process_id = process_id if process_id is not None else _int(env, "JAXDD_PROCESS_ID")
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        missing = [n for n, v in zip(("coordinator_address", "num_processes", "process_id"), explicit) if v is None]
        raise ValueError(f"jaxdd.launch.initialize: {', '.join(missing)} not given (arguments or JAXDD_* variables); "
                         "give all three, or none to let JAX detect the cluster")
    if coordinator_address is None and not _cluster_detected():
        return False
    # CPU collectives across processes need gloo; accelerators bring their own (NCCL).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address, num_processes, process_id, local_device_ids=local_device_ids,
                               heartbeat_timeout_seconds=int(heartbeat_timeout_s),
                               initialization_timeout=int(initialization_timeout_s))
    _end_promptly_on_failure()
    return True


# How this process fails, once known: (exit status or the signal to end by, what happened).
_failure: tuple[int | signal.Signals, str] | None = None
_hooked = False


def _end_promptly_on_failure() -> None:
    """Make a failing process leave at once, skipping JAX's exit handler.

    JAX's handler (``jax.distributed.shutdown``) waits in a barrier until every process has
    reached it. A process failing while the others wait for it in a collective would sit there,
    heartbeats and all, until the barrier times out: nothing would notice it had failed. So
    note the failure (the exception hook; ``sys.exit``, whose status no exit handler can see)
    and leave from an exit handler registered after JAX's, hence run before it.
    """
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous_hook, sys_exit = sys.excepthook, sys.exit

    def excepthook(kind, value, tb):
        what = "".join(traceback.format_exception_only(kind, value)).strip()
        _note_failure(signal.SIGINT if issubclass(kind, KeyboardInterrupt) else 1, what)
        previous_hook(kind, value, tb)  # the traceback, as usual

    def exit(status=None):
        if status is not None and status != 0:  # as Python does: an int is the status, anything else 1
            _note_failure(status if isinstance(status, int) else 1, f"sys.exit({status!r})")
        sys_exit(status)

    exit.__doc__ = sys_exit.__doc__
    sys.excepthook, sys.exit = excepthook, exit
    atexit.register(_leave_if_failed)


def _note_failure(status: int | signal.Signals, what: str) -> None:
    """Remember the first failure; under :func:`launch`, also tell it when and what.

    The launcher may see several processes gone at one poll: those failing because this one
    failed (a collective cut off) note a later time, so it names the right one first.
    """
    global _failure
    if _failure is not None:
        return
    _failure = (status, what)
    where = os.environ.get("JAXDD_FAILURE_DIR")
    if where:
        try:
            with open(os.path.join(where, os.environ.get("JAXDD_PROCESS_ID", "-")), "w") as f:
                f.write(f"{time.time()!r} {what.splitlines()[0] if what else ''}")
        except OSError:
            pass


def _leave_if_failed() -> None:
    """Exit handler: a failing process ends here, with its status or by its signal."""
    if _failure is None:
        return  # a clean exit: JAX's shutdown barrier waits for the others, as it should
    status = _failure[0]
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if "logging" in sys.modules:  # its own exit handler, registered earlier, would not run
        sys.modules["logging"].shutdown()
    if isinstance(status, signal.Signals):  # Ctrl-C ends a Python process by SIGINT; keep that
        signal.signal(status, signal.SIG_DFL)
        os.kill(os.getpid(), status)
        os._exit(128 + status)
    os._exit(status & 0xFF)


def _int(env, name):
    value = env[name]
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _cluster_detected() -> bool:
    """Whether JAX's own detection would find a multi-process setting."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    if "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    if "OMPI_COMM_WORLD_SIZE" in os.environ and int(os.environ["OMPI_COMM_WORLD_SIZE"]) > 1:
        return True
    return "KUBERNETES_SERVICE_HOST" in os.environ and "JOB_COMPLETION_INDEX" in os.environ


# --------------------------------------------------------------------------- local launcher


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(stream, prefix: str, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix}{line}")
        out.flush()


def launch(argv: list[str], n_processes: int, *, cpu_devices: int | None = None, grace_s: float = 60.0,
           port: int | None = None, env: dict | None = None) -> int:
    """Run ``python argv...`` as ``n_processes`` processes on this machine.

    When one fails (non-zero status or a signal) it is named on stderr, and those still
    running are killed ``grace_s`` seconds later (they normally end before, once the
    coordination service notices). SIGINT or SIGTERM sent to the launcher is passed on, with
    the same grace. Returns 0, or the first failure's status (128 + the signal for a signal).
    """
    port = port or _free_port()
    base = dict(os.environ if env is None else env)
    received = []  # signals sent to the launcher, handled below once every process runs
    restore = _catch(received, (signal.SIGINT, signal.SIGTERM))
    procs, pumps = [], []
    # (process, return code, what) failing first; a signal to the launcher; when to kill the rest
    failed = interrupted = stop_at = None
    with tempfile.TemporaryDirectory(prefix="jaxdd-launch-") as notes:
        try:
            for pid in range(n_processes):
                child = dict(base, JAXDD_COORDINATOR=f"127.0.0.1:{port}", JAXDD_NUM_PROCESSES=str(n_processes),
                             JAXDD_PROCESS_ID=str(pid), JAXDD_FAILURE_DIR=notes, PYTHONUNBUFFERED="1")
                if cpu_devices is not None:
                    child["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
                p = subprocess.Popen([sys.executable, *argv], env=child, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
                pumps.append(threading.Thread(target=_pump, args=(p.stdout, f"[{pid}] ", sys.stdout), daemon=True))
                pumps[-1].start()
                procs.append(p)
            alive_at = [time.time()] * n_processes  # when each was last seen running
            while True:
                codes = [p.poll() for p in procs]
                if failed is None and interrupted is None:  # after a signal they end because of it
                    failed = _first_failure(codes, alive_at, notes)
                    if failed is not None:
                        print(f"jaxdd.launch: process {failed[0]} {_exited(*failed[1:])}; the others are given "
                              f"{grace_s:.0f} s to stop", file=sys.stderr, flush=True)
                        stop_at = time.monotonic() + grace_s
                alive_at = [time.time() if c is None else t for c, t in zip(codes, alive_at)]
                if all(c is not None for c in codes):
                    break
                if received:
                    signum = received.pop()
                    if interrupted is not None:  # a second one: no more waiting
                        stop_at = time.monotonic()
                    else:
                        interrupted = signal.Signals(signum)
                        for p in procs:
                            if p.poll() is None:
                                p.send_signal(signum)
                        stop_at = min(stop_at or float("inf"), time.monotonic() + grace_s)
                if stop_at is not None and time.monotonic() >= stop_at:
                    left = [i for i, p in enumerate(procs) if p.poll() is None]
                    for i in left:
                        procs[i].kill()
                    print(f"jaxdd.launch: stopped the remaining processes ({', '.join(map(str, left))})",
                          file=sys.stderr, flush=True)
                    break
                time.sleep(0.1)
        finally:
            for p in procs:  # nothing outlives the launcher, whatever stopped it
                if p.poll() is None:
                    p.kill()
                p.wait()
            restore()
    for t in pumps:  # their last lines (a traceback) come before the verdict
        t.join(timeout=5)
    if failed is not None:
        print(f"jaxdd.launch: failed: process {failed[0]} {_exited(*failed[1:])}", file=sys.stderr, flush=True)
        return 128 - failed[1] if failed[1] < 0 else failed[1]
    if interrupted is not None:
        print(f"jaxdd.launch: stopped by {interrupted.name}", file=sys.stderr, flush=True)
        return 128 + interrupted
    return 0


def _first_failure(codes: list, alive_at: list, notes: str):
    """(process, return code, what) of the first to fail among those gone, or None.

    Several may be found gone at one poll, one failing because another did (a collective
    cut off). A process notes when it failed (:func:`_note_failure`); one that could not (a
    signal) is taken to have failed when last seen running, before any it brought down.
    """
    bad = {i: (c, *_failure_note(notes, i)) for i, c in enumerate(codes) if c not in (None, 0)}
    if not bad:
        return None
    first = min(bad, key=lambda i: (bad[i][1] if bad[i][1] is not None else alive_at[i], i))
    return first, bad[first][0], bad[first][2]


def _failure_note(notes: str, process: int):
    """(when, what) the process noted on failing, or (None, "")."""
    try:
        with open(os.path.join(notes, str(process))) as f:
            when, _, what = f.read().partition(" ")
        return float(when), what
    except (OSError, ValueError):
        return None, ""


def _exited(code: int, what: str = "") -> str:
    """``exited with status 1: RuntimeError: ...`` or ``exited with signal 9 (SIGKILL)``."""
    if code >= 0:
        how = f"exited with status {code}"
    else:
        try:
            how = f"exited with signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            how = f"exited with signal {-code}"
    return f"{how}: {what[:200]}" if what else how


def _catch(received: list, signums):
    """Record ``signums`` in ``received`` instead of acting on them; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # only the main thread may set handlers; launch() still works
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in signums}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


def _module_flag(argv: list[str]) -> int | None:
    """Index of a "-m" among the launcher's own options (None: a script is run)."""
    takes_value = {"-n", "--processes", "--cpu-devices", "--grace", "--port"}
    i = 0
    while i < len(argv):
        if argv[i] == "-m":
            return i
        if not argv[i].startswith("-"):
            return None  # the script: what follows is its own
        i += 2 if argv[i] in takes_value else 1
    return None


def main(argv=None) -> int:
    """``python -m jaxdd.launch``: start the processes of a script or module on this machine.

    Args:
      argv: the command line without the program name (None: ``sys.argv[1:]``).

    Returns:
      The exit status: 0 when every process succeeded, else the first failure's.
    """
    p = argparse.ArgumentParser(prog="python -m jaxdd.launch",
                                description="Run a jaxdd script (or -m module) as several processes on this machine.")
    p.add_argument("-n", "--processes", type=int, required=True, help="processes to start (>= 1)")
    p.add_argument("--cpu-devices", type=int, help="virtual CPU devices per process (JAX_NUM_CPU_DEVICES)")
    p.add_argument("--grace", type=float, default=60.0, help="seconds the others get after one fails (default 60)")
    p.add_argument("--port", type=int, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("target", nargs=argparse.REMAINDER,
                   help="script.py [args], or -m module [args]: what every process runs")
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = _module_flag(argv)  # everything from "-m" on belongs to the module, options included
    args = p.parse_args(argv if cut is None else argv[:cut])
    target = args.target if cut is None else argv[cut:]
    if args.processes < 1:
        p.error("--processes must be >= 1")
    if not target or target == ["-m"]:
        p.error("give a script (script.py [args]) or a module (-m module [args])")
    return launch(target, args.processes, cpu_devices=args.cpu_devices, grace_s=args.grace, port=args.port)


if __name__ == "__main__":
    sys.exit(main())
