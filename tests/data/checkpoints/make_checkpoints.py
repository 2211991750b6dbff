"""Write the dynamics checkpoints kept under tests/data/checkpoints (run once, from the repository root).

    python tests/data/checkpoints/make_checkpoints.py              # write
    python tests/data/checkpoints/make_checkpoints.py --verify halo one_device  # restore, continue, compare

Each run kind (one device, a halo grid, node blocks) runs 5 steps of a 108-atom LJ melt in
float64, saves its state to ``<kind>/``, then runs 5 more steps and stores what it reached in
``<kind>.npz``: the gathered positions and velocities, the energy and the conserved quantity
after the save (``saved_*``) and after the 5 further steps (``continued_*``). The checkpoints
were written before the engine was reorganised into its present modules; the tests restore
them with today's code and ask for the same numbers, bit for bit. They run as the test suite
ran then (8 CPU devices, XLA's CPU backend without LLVM's optimisation passes, :data:`XLA_FLAGS`);
code compiled with other flags may round differently, so the tests restore them under these.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

#: The XLA flags the checkpoints and their numbers were written with.
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = XLA_FLAGS

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402

from jaxdd import DistributedModel, DomainConfig  # noqa: E402
from jaxdd.dynamics import DomainParallel, NoseHooverChain  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.data.systems import lj_melt_data  # noqa: E402

HERE = Path(__file__).resolve().parent
CUTOFF, SKIN, DT = 2.5, 0.3, 0.005
#: Run kind → (rank grid, DomainConfig.strategy).
KINDS = {"one_device": ((1, 1, 1), None), "halo": ((2, 1, 1), None), "graph_parallel": ((2, 1, 1), "graph_partition")}
INTEGRATOR = dict(dt=DT, temperature=1.0, period=100 * DT, kB=1.0)
STEPS = 5


def md_of(kind: str) -> DomainParallel:
    """The DomainParallel of a run kind: LJ (σ = ε = 1, cutoff 2.5) under Nosé–Hoover at T* = 1."""
    grid, strategy = KINDS[kind]
    mesh = Mesh(np.asarray(jax.devices()[:math.prod(grid)]), ("dd",), axis_types=(AxisType.Auto,))
    dm = DistributedModel(LennardJones(1.0, 1.0, CUTOFF),
                          DomainConfig(CUTOFF, skin=SKIN, mesh=mesh, grid=grid, strategy=strategy))
    return DomainParallel(dm, NoseHooverChain(**INTEGRATOR))


def melt():
    """108 LJ atoms at T* = 1.44 (float64)."""
    return lj_melt_data(3, temperature=1.44, dtype=np.float64)


def numbers(md: DomainParallel, state, prefix: str) -> dict:
    batch = md.gather(state)
    thermo = md.thermo(state)
    return {f"{prefix}_positions": np.asarray(batch.positions), f"{prefix}_velocities": np.asarray(batch.velocities),
            f"{prefix}_energy": np.asarray(state.energy), f"{prefix}_conserved": np.asarray(thermo["conserved"])}


def verify(kind: str) -> None:
    """Restore ``<kind>/`` and continue it: AssertionError unless every number equals the stored one."""
    md = md_of(kind)
    want = np.load(HERE / f"{kind}.npz")
    state = md.restore(HERE / kind)
    assert state.step == STEPS, f"restored at step {state.step}, saved at {STEPS}"
    got = numbers(md, state, "saved")
    got.update(numbers(md, md.run(state, STEPS), "continued"))
    assert set(got) == set(want.files), f"stored {sorted(want.files)}, got {sorted(got)}"
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key], err_msg=f"{kind}: {key}")


def main() -> None:
    for kind in KINDS:
        md = md_of(kind)
        state = md.run(md.init(melt()), STEPS)
        folder = HERE / kind
        shutil.rmtree(folder, ignore_errors=True)
        md.save(folder, state)
        out = numbers(md, state, "saved")
        out.update(numbers(md, md.run(state, STEPS), "continued"))
        np.savez(HERE / f"{kind}.npz", **out)
        print(f"{kind}: saved at step {state.step} to {folder}", file=sys.stderr)


def verify_each(kinds) -> dict:
    """``verify`` each kind in this one process: kind → "ok" or what differed."""
    outcome = {}
    for kind in kinds:
        try:
            verify(kind)
            outcome[kind] = "ok"
        except Exception as e:  # noqa: BLE001 - reported per kind, the caller decides
            outcome[kind] = f"{type(e).__name__}: {e}"
    return outcome


if __name__ == "__main__":
    if sys.argv[1:2] == ["--verify"]:  # the test's child process: make_checkpoints.py --verify KIND...
        import json

        outcome = verify_each(sys.argv[2:])
        print(json.dumps(outcome))
        sys.exit(0 if all(v == "ok" for v in outcome.values()) else 1)
    else:
        main()
