"""One process of a multi-process run, started by ``python -m jaxdd.launch`` from the tests.

    python -m jaxdd.launch -n 2 --cpu-devices 2 tests/multiprocess_worker.py OUT TASK [--die-after-checkpoint]

TASK is ``models`` (the LJ and a message-passing model through ``DistributedModel``),
``md`` (50 NVE steps of an LJ crystal under ``DomainParallel``, checkpointed after 25),
``restart`` (the last 25 steps again, from that checkpoint), or ``fail-CAUSE`` (two
``DistributedModel`` calls, process 1 failing between them by CAUSE: ``exception``,
``exit`` (``sys.exit(3)``), ``sigkill`` or ``sigint``; it writes the time to ``OUT/failed``).
Process 0 writes what it computed to ``OUT/<task>.npz``; every process sees the whole mesh
and feeds its own devices.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import jaxdd.launch

jaxdd.launch.initialize(heartbeat_timeout_s=10)

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jaxdd  # noqa: E402
from jaxdd import DistributedModel, DomainConfig, DomainParallel, VelocityVerlet  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.data.systems import fcc_lattice, lj_melt_data  # noqa: E402

OUTPUTS = ("energy", "forces", "stress")


def lj_crystal():
    atoms = fcc_lattice(5, 1.6796)
    atoms.rattle(0.05, seed=1)
    return jaxdd.AtomicData.from_ase(atoms)


def md_engine():
    model = LennardJones(1.0, 1.0, 2.5, skin=0.3)
    return DomainParallel(DistributedModel(model, DomainConfig(2.5, skin=0.3)), VelocityVerlet(0.005), kB=1.0)


def models(out_dir: Path) -> dict:
    from test_dispatch import SYSTEM, Plain

    out = {}
    dm = DistributedModel(LennardJones(1.0, 1.0, 2.5), DomainConfig(2.5))
    lj = dm(lj_crystal(), OUTPUTS)
    _, plan = dm.plan(jaxdd.as_batch(lj_crystal()))  # what this process planned: its own ranks only
    (out_dir / f"planned-{jax.process_index()}.json").write_text(json.dumps(
        dict(ranks=list(plan.ranks), rows=list(plan.local_ids.shape), owned=plan.owned_counts().tolist(),
             health_owned=dm.health.owned.tolist())))
    out.update({f"lj_{k}": np.asarray(v) for k, v in lj.items()})
    mp = DistributedModel(Plain("mpnn_segment_sum"), DomainConfig(5.0))(SYSTEM, ("energy", "forces"))
    out.update({f"mpnn_{k}": np.asarray(v) for k, v in mp.items()})
    return out


def md(out_dir: Path, die: bool) -> dict:
    engine = md_engine()
    state = engine.run(engine.init(lj_melt_data(5, temperature=1.44)), 25)
    engine.save(out_dir / "checkpoint", state)
    if die and jax.process_index() == 1:
        (out_dir / "died").write_text(f"{time.time()}\n")
        os.kill(os.getpid(), 9)
    state = engine.run(state, 25)
    return final(engine, state)


def fail(out_dir: Path, cause: str) -> dict:
    dm = DistributedModel(LennardJones(1.0, 1.0, 2.5), DomainConfig(2.5))
    first = dm(lj_crystal(), ("energy",))
    if jax.process_index() == 1:
        (out_dir / "failed").write_text(f"{time.time()}\n")
        if cause == "exception":
            raise RuntimeError("process 1 fails between two calls")
        if cause == "exit":
            sys.exit(3)
        os.kill(os.getpid(), {"sigkill": signal.SIGKILL, "sigint": signal.SIGINT}[cause])
        time.sleep(60)  # ended by the signal before this
    second = dm(lj_crystal(), ("energy",))  # process 0 waits here for process 1
    return dict(first=np.asarray(first["energy"]), second=np.asarray(second["energy"]))


def restart(out_dir: Path) -> dict:
    engine = md_engine()
    state = engine.run(engine.restore(out_dir / "checkpoint"), 25)
    return final(engine, state)


def final(engine, state) -> dict:
    thermo = engine.thermo(state)
    batch = engine.gather(state)
    return dict(step=np.asarray(state.step), rebuilds=engine.placement.counters.rebuilds,
                host_rebuilds=engine.placement.counters.host_rebuilds,
                positions=np.asarray(batch.positions),
                velocities=np.asarray(batch.velocities), **{k: np.asarray(v) for k, v in thermo.items()})


def main() -> int:
    out_dir, task = Path(sys.argv[1]), sys.argv[2]
    die = "--die-after-checkpoint" in sys.argv[3:]
    print(f"process {jax.process_index()} of {jax.process_count()}: devices {jax.local_devices()} "
          f"of {len(jax.devices())}", flush=True)
    tasks = {"models": lambda: models(out_dir), "md": lambda: md(out_dir, die), "restart": lambda: restart(out_dir),
             "fail": lambda: fail(out_dir, task.partition("-")[2])}
    result = tasks[task.partition("-")[0]]()
    if jax.process_index() == 0:
        np.savez(out_dir / f"{task}.npz", **result)
    print(f"process {jax.process_index()}: {task} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
