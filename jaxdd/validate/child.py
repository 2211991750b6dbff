"""Sharded runs in a child process on virtual CPU devices, and the files the two processes
exchange: the request and the batch it reads (``request.json``, ``batch.npz``), the result
it writes (``result.json``, ``outputs.npz``, ``owner.npy``). The child is
``python -m jaxdd.validate._worker DIR``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

from ..data import Batch
from ..spec import MLIPSpec
from .report import HaloCompleteness
from .sharded import ShardedResult

__all__ = ["run_in_child", "save_batch", "load_batch", "write_result", "read_result"]


def run_in_child(factory_ref: str, batch: Batch, spec: MLIPSpec, outputs, world_size: int) -> ShardedResult:
    """One sharded run in a child process with ``world_size`` virtual CPU devices.

    Args:
        factory_ref: the model factory's ``"module:qualname"``, imported by the child.
        batch: the sample. spec: the distribution spec to run under. outputs: the output keys.
        world_size: ranks (virtual CPU devices of the child).

    Returns:
        The child's :class:`~jaxdd.validate.sharded.ShardedResult`, or one whose ``error`` says
        that the child failed.
    """
    with tempfile.TemporaryDirectory(prefix="jaxdd-validate-") as tmp:
        tmp = Path(tmp)
        save_batch(batch, tmp / "batch.npz")
        (tmp / "request.json").write_text(json.dumps({
            "factory": factory_ref, "spec": spec.to_dict(), "outputs": list(outputs), "world_size": world_size,
        }))
        env = dict(os.environ)
        env["JAX_NUM_CPU_DEVICES"] = str(world_size)
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_ENABLE_X64"] = "1" if np.asarray(batch.positions).dtype == np.float64 else "0"
        env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])
        proc = subprocess.run([sys.executable, "-m", "jaxdd.validate._worker", str(tmp)], env=env,
                              capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / "result.json").exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            return ShardedResult(error=f"child process failed (exit {proc.returncode}): {tail[0]}",
                                 diagnosis="the factory must be importable in a fresh process with the same sys.path")
        return read_result(tmp)


def save_batch(batch: Batch, path: Path) -> None:
    """Write the batch's arrays to ``path`` (an ``.npz``), as :func:`load_batch` reads them.

    Args:
        batch: the sample. path: the file to write.
    """
    fields = {k: np.asarray(getattr(batch, k)) for k in ("positions", "atomic_numbers", "cell", "pbc", "batch_idx",
                                                           "ptr", "atom_mask", "system_mask", "charges", "masses",
                                                           "velocities") if getattr(batch, k) is not None}
    np.savez(path, **fields)


def load_batch(path: Path) -> Batch:
    """The batch :func:`save_batch` wrote to ``path``.

    Args:
        path: the ``.npz`` file.

    Returns:
        The batch, its arrays as written (not checked again).
    """
    with np.load(path) as z:
        fields = {k: z[k] for k in z.files}
    return Batch.unchecked(**{k: jax.numpy.asarray(v) for k, v in fields.items()})


def write_result(res: ShardedResult, tmp: Path) -> None:
    """Write a run's result into the folder ``tmp``, as :func:`read_result` reads it.

    Args:
        res: the run's result. tmp: the folder the parent process gave the child.
    """
    if res.outputs is not None:
        np.savez(tmp / "outputs.npz", **res.outputs)
    if res.owner is not None:
        np.save(tmp / "owner.npy", res.owner)
    (tmp / "result.json").write_text(json.dumps({
        "error": res.error, "diagnosis": res.diagnosis, "counts": res.counts, "fallbacks": list(res.fallbacks),
        "health": res.health, "halo": None if res.halo is None else dataclasses.asdict(res.halo),
    }))


def read_result(tmp: Path) -> ShardedResult:
    """The result :func:`write_result` wrote into the folder ``tmp``.

    Args:
        tmp: the folder the child wrote into.

    Returns:
        The child's run result.
    """
    data = json.loads((tmp / "result.json").read_text())
    outputs = None
    if (tmp / "outputs.npz").exists():
        with np.load(tmp / "outputs.npz") as z:
            outputs = {k: z[k] for k in z.files}
    halo = None
    if data["halo"] is not None:
        h = data["halo"]
        halo = HaloCompleteness(h["matches"], h["checked"], tuple(h["atoms"]), tuple(map(tuple, h["missing"])),
                                tuple(map(tuple, h["extra"])))
    owner = np.load(tmp / "owner.npy") if (tmp / "owner.npy").exists() else None
    return ShardedResult(outputs, data["error"], data["diagnosis"], data["counts"], tuple(data["fallbacks"]),
                         data["health"], halo, owner)
