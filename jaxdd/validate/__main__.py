"""``python -m jaxdd.validate``: validate a model distributed against one device.

    python -m jaxdd.validate MODULE:FACTORY [--sample FILE | --builtin NAME] [--world-size N]
                             [--atol A] [--rtol R] [--dtype float32|float64] [--save-spec PATH] [--json]

With no arguments it validates the built-in Lennard-Jones example on the ``lj-fcc``
sample. Exit status: 0 when the distributed model matches, 1 when it does not, 2 for a
usage error — bad options, a factory that cannot be imported, raises or returns no model,
a sample or spec that cannot be read — with one line on stderr saying what and why. The
sharded runs use this process's accelerators when there are at least ``--world-size`` of
them, otherwise virtual CPU devices.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

DEFAULT_FACTORY = "jaxdd.validate.examples:lennard_jones"
DEFAULT_SAMPLE = "lj-fcc"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxdd.validate", description=__doc__.splitlines()[0])
    p.add_argument("factory", nargs="?", help="MODULE:FACTORY, a function returning the model wrapper")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--sample", help="structure file ASE can read (all frames are used as one batch)")
    src.add_argument("--builtin", help="built-in sample: lj-fcc, cu-fcc or molecules")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to distribute over (default 2; with several processes, every device of the run)")
    p.add_argument("--atol", type=float, default=1e-5)
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument("--spec", metavar="NAME|PATH",
                   help="spec to start from: a preset name (e.g. mpnn_gp for the graph-parallel strategy) or a spec "
                        "JSON file (default: the model's own)")
    p.add_argument("--save-spec", metavar="PATH", help="write the working spec as JSON")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a summary")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        _parser().error("--world-size must be >= 1")
    for name in ("atol", "rtol"):
        if not (math.isfinite(getattr(args, name)) and getattr(args, name) >= 0):
            _parser().error(f"--{name} must be a finite number >= 0, got {getattr(args, name)}")
    import jax

    from ..launch import initialize

    # Under a multi-process launcher (python -m jaxdd.launch, srun, a pod) every process runs
    # this command; the mesh spans all their devices and one process prints.
    several = initialize()
    if args.world_size is None:
        args.world_size = jax.device_count() if several else 2

    # Virtual CPU devices must be requested before JAX starts a backend; accelerators, when
    # present, are used instead and this setting is then moot.
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        try:
            jax.config.update("jax_num_cpu_devices", max(args.world_size, 1))
        except RuntimeError:  # a backend is already running (e.g. called from Python): keep it
            pass

    jax.config.update("jax_enable_x64", args.dtype == "float64")
    import numpy as np

    from ..data import Batch
    from ..ops import SpecError
    from .examples import sample
    from .factory import ModelFactoryError
    from .runner import trace_and_validate

    factory = args.factory or DEFAULT_FACTORY
    dtype = np.float64 if args.dtype == "float64" else np.float32
    primary = jax.process_index() == 0  # every process validates; the first one reports
    log = open(os.devnull, "w") if not primary else sys.stderr if args.json else sys.stdout
    if args.factory is None:
        print(f"no model given: validating the built-in example {DEFAULT_FACTORY} on sample "
              f"'{args.builtin or DEFAULT_SAMPLE}'", file=log)
    try:
        if args.sample:
            import ase.io

            data = Batch.from_ase(ase.io.read(args.sample, index=":"), dtype=dtype)
        else:
            data = sample(args.builtin or DEFAULT_SAMPLE, dtype)
    except Exception as exc:  # whatever the reader raises (an unknown format, an empty file): a usage error
        where = f"file {args.sample}" if args.sample else f"'{args.builtin or DEFAULT_SAMPLE}'"
        print(f"error: cannot read the sample {where}: {_one_line(exc)}", file=sys.stderr)
        return 2
    try:
        start = _spec(args.spec)
        report = trace_and_validate(factory, data, world_size=args.world_size, atol=args.atol, rtol=args.rtol,
                                    progress=lambda line: print(line, file=log, flush=True), spec=start)
    except (SpecError, ModelFactoryError) as exc:  # no spec, or no model, to validate
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.save_spec and primary:
        report.spec.save(args.save_spec)
        print(f"spec written to {args.save_spec}", file=log)
    if primary:
        print(json.dumps(report.to_dict(), indent=2) if args.json else report.summary())
    return 0 if report.ok else 1


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its message (its type when it has none), newlines folded."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return text if isinstance(exc, (ValueError, OSError)) and text else f"{name}: {text}" if text else name


def _spec(name_or_path):
    """A preset by name, or a spec JSON file; None stays None."""
    if name_or_path is None:
        return None
    from ..ops import SpecError
    from ..spec import PRESETS, MLIPSpec

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if not os.path.exists(name_or_path):
        raise SpecError(f"--spec {name_or_path!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a file")
    return MLIPSpec.load(name_or_path)


if __name__ == "__main__":
    sys.exit(main())
