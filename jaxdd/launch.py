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

On CPUs the collectives run over gloo (selected here); on GPUs over NCCL. A process that
dies stops sending heartbeats; after ``heartbeat_timeout_s`` the coordination service ends
every other process with an error naming the dead task, so nothing hangs.

``python -m jaxdd.launch -n 2 [--cpu-devices 2] script.py [args]`` (or ``-m module [args]``,
e.g. ``-m jaxdd.validate``) starts ``n`` processes on this machine with a local coordinator,
prefixes their output with their process id, and when one fails stops the others and exits
with its status.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time

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

    coordinator_address: ``host:port`` of process 0's coordination service. num_processes,
    process_id: the run's size and this process's index (0-based). local_device_ids: the
    devices this process drives (default: all it sees; one GPU per process on a pod). Unset
    values come from ``JAXDD_*`` variables, then JAX's cluster detection (module docstring).
    heartbeat_timeout_s: how long a silent peer is waited for before every process is ended.
    Returns False (doing nothing) when no multi-process setting is found, so a script runs
    unchanged on one process; True once joined. Calling it again is harmless.
    """
    import jax

    if is_initialized():
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
    return True


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
    """Run ``python argv...`` as ``n_processes`` processes on this machine; returns the exit
    status (0, or the first failing process's). A failure stops the others after ``grace_s``
    seconds (they normally end by themselves once the coordination service notices)."""
    port = port or _free_port()
    base = dict(os.environ if env is None else env)
    procs = []
    for pid in range(n_processes):
        child = dict(base, JAXDD_COORDINATOR=f"127.0.0.1:{port}", JAXDD_NUM_PROCESSES=str(n_processes),
                     JAXDD_PROCESS_ID=str(pid), PYTHONUNBUFFERED="1")
        if cpu_devices is not None:
            child["JAX_NUM_CPU_DEVICES"] = str(cpu_devices)
        p = subprocess.Popen([sys.executable, *argv], env=child, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
        threading.Thread(target=_pump, args=(p.stdout, f"[{pid}] ", sys.stdout), daemon=True).start()
        procs.append(p)
    status, failed_at = 0, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed_at is None:
                i, c = bad[0]
                status, failed_at = c, time.monotonic()
                why = f"signal {-c}" if c < 0 else f"status {c}"
                print(f"jaxdd.launch: process {i} exited with {why}; the others are given {grace_s:.0f} s to stop",
                      file=sys.stderr, flush=True)
            if all(c is not None for c in codes):
                break
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                print("jaxdd.launch: stopped the remaining processes", file=sys.stderr, flush=True)
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        status = 130
    for p in procs:
        p.wait()
    if status == 0:
        status = next((p.returncode for p in procs if p.returncode), 0)
    return 128 - status if status < 0 else status


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
