"""Where the validator's sharded runs happen: the devices a ``device`` string names (as the
PyTorch guide writes it), and this process's devices or a child process's virtual CPU ones."""

from __future__ import annotations

import jax

from ..data import Batch
from .child import run_in_child
from .sharded import run_sharded

__all__ = ["devices_for", "sharded_runner"]


_PLATFORMS = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}


def devices_for(device: str, world_size: int):
    """The ``devices`` of :func:`~jaxdd.validate.trace_and_validate` for a ``device`` string.

    Args:
        device: as the PyTorch guide writes it (``"cuda:0"``, ``"gpu"``, ``"cpu:0"``).
        world_size: ranks, one device each.

    Returns:
        ``world_size`` devices of that platform, from that index; ``"subprocess"`` for CPU when
        this process has too few CPU devices. ValueError for any other platform without enough.
    """
    name, _, index = str(device).partition(":")
    platform = _PLATFORMS.get(name.strip().lower())
    if platform is None or (index and not index.strip().isdigit()):
        raise ValueError(f"device must be like 'cuda:0', 'gpu', 'cpu' or 'tpu:0', got {device!r}; the jaxdd form is "
                         "devices='auto', devices='subprocess' or devices=[jax devices]")
    start = int(index) if index else 0
    try:
        present = jax.devices(platform)
    except RuntimeError:
        present = []
    chosen = present[start:start + world_size]
    if len(chosen) == world_size:
        return chosen
    if platform == "cpu":
        return "subprocess"  # virtual CPU ranks in a child process, as devices="auto" does
    raise ValueError(
        f"device={device!r} asks for world_size={world_size} ranks from {platform} device {start}, but this process has "
        f"{len(present)} {platform} device(s): JAX runs one rank per device (it has no virtual ranks on one GPU). "
        f"On a machine with {world_size} of them pass devices=jax.devices('{platform}')[:{world_size}]; to validate "
        "without them, devices='subprocess' runs the ranks on virtual CPU devices")


def sharded_runner(model, factory_ref: str | None, batch: Batch, outputs, world_size: int, devices):
    """How the sharded runs happen, checked before any of them runs.

    Args:
        model: the model wrapper. factory_ref: its factory's ``"module:qualname"`` (None when it
            has none; a child process then cannot build the model). batch: the sample.
        outputs: the output keys. world_size: ranks. devices: ``"auto"``, ``"subprocess"`` or
            a list of devices.

    Returns:
        ``(run, where)``: ``run(spec)`` makes one sharded run and returns its
        :class:`~jaxdd.validate.sharded.ShardedResult`; ``where`` describes the devices.
    """
    if jax.process_count() > 1 and (devices != "auto" or world_size != jax.device_count()):
        raise ValueError(
            f"with {jax.process_count()} processes the sharded runs use every device of the run: world_size must be "
            f"{jax.device_count()} (got {world_size}) and devices 'auto' (got {devices!r})")
    if devices == "auto":
        devices = jax.devices() if len(jax.devices()) >= world_size else "subprocess"
    if devices == "subprocess":
        if factory_ref is None:
            raise ValueError(
                f"this process has {len(jax.devices())} device(s), fewer than world_size={world_size}, so the sharded "
                "runs need a child process, which needs the factory as an importable 'module:qualname' (a module-level "
                "function, not a lambda or a local function)"
            )
        return (lambda spec: run_in_child(factory_ref, batch, spec, outputs, world_size),
                f"{world_size} virtual CPU devices in a child process (this process has {len(jax.devices())})")
    devices = list(devices)[:world_size]
    if len(devices) < world_size:
        raise ValueError(f"devices has {len(devices)} entries, fewer than world_size={world_size}")
    kind = devices[0].platform
    where = f"across {jax.process_count()} processes" if jax.process_count() > 1 else "in this process"
    return (lambda spec: run_sharded(model, batch, spec, outputs, devices), f"{world_size} {kind} device(s) {where}")
