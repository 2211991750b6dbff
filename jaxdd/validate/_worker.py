"""Child process of the validator: one sharded run on this process's (virtual) devices.

    python -m jaxdd.validate._worker DIR

DIR holds ``request.json`` (factory, spec, outputs, world_size) and ``batch.npz``; the run
writes ``result.json`` (and ``outputs.npz``, ``owner.npy``) there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    tmp = Path((argv or sys.argv[1:])[0])
    request = json.loads((tmp / "request.json").read_text())
    import jax

    from ..spec import MLIPSpec
    from .child import load_batch, write_result
    from .factory import resolve_factory
    from .sharded import run_sharded

    factory, _ = resolve_factory(request["factory"])
    model = factory()
    batch = load_batch(tmp / "batch.npz")
    spec = MLIPSpec.from_dict(request["spec"], source="validator request")
    devices = jax.devices()[: request["world_size"]]
    write_result(run_sharded(model, batch, spec, tuple(request["outputs"]), devices), tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
