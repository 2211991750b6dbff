"""The built-in example end to end: validate the Lennard-Jones model distributed, then run the LJ melt.

    python -m jaxdd.demo [--n-cells 20] [--steps 100] [--devices 4] [--dtype float64|float32]
                         [--thermo-every 50] [--warmup N]

1. Validation. ``trace_and_validate`` evaluates the built-in Lennard-Jones model
   (``jaxdd.validate.examples:lennard_jones``) on one device and on N ranks, on the built-in
   ``lj-fcc`` sample (864 rattled atoms), compares the outputs (energy, forces, stress) and
   prints its verdict, as ``python -m jaxdd.validate`` does. A model that fails is not run.
2. Dynamics. The LAMMPS LJ melt benchmark: an fcc lattice at density 0.8442 (32,000 atoms by
   default), velocities at T 1.44, ``pair_style lj/cut 2.5`` without shift, neighbour skin 0.3,
   velocity Verlet with dt 0.005, LJ reduced units, masses 1, run under ``DomainParallel`` on
   N devices. It prints the thermo the way LAMMPS does (energies per atom) every
   ``--thermo-every`` steps, checks the step-0 potential energy per atom against LAMMPS's and
   every force of the perfect lattice against zero (its value by symmetry), and prints the
   steady-state atom-steps per second and the plan rebuilds and atom migrations of the run.
   The timed run is preceded by an untimed warm-up over the same steps (``--warmup``) that
   compiles the programs and grows the capacities; any compilation left in the timed run
   is reported with its seconds. The velocities come from numpy's random stream, not
   LAMMPS's, so only step 0 is compared.

Devices: the accelerators when there are at least N of them, else N virtual CPU devices.
Exit status: 0 when the validation passes and step 0 agrees with LAMMPS, 1 when either
fails, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import jax
import numpy as np

# Agreement expected with LAMMPS (ε per atom) and of the forces with zero (ε/σ). float64:
# rounding of ~55 pair terms per atom leaves ~1e-13, so 1e-9 has ample room. float32: a
# pairwise-summed float32 total is good to ~1e-6 of |E/N| = 6.77; 7e-5 is 1e-5 of it.
_TOLERANCE = {
    "float64": {"energy": 1e-9, "forces": 1e-9},
    "float32": {"energy": 7e-5, "forces": 5e-4},
}
# The melt benchmark's settings, LJ reduced units (σ = ε = m = k_B = 1).
_CUTOFF, _SKIN, _DT, _TEMPERATURE = 2.5, 0.3, 0.005, 1.44
# The ghost shell is wider than the neighbour skin: atoms then migrate (a host-side plan
# rebuild) every ~30 steps, while the Verlet list is rebuilt on device every ~6.
_HALO_SKIN = 1.0
_VALIDATE_FACTORY = "jaxdd.validate.examples:lennard_jones"
_VALIDATE_SAMPLE = "lj-fcc"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxdd.demo",
        description="Validate the built-in Lennard-Jones model distributed, then run the LAMMPS LJ melt "
                    "under domain decomposition.",
    )
    p.add_argument("--n-cells", type=int, metavar="N", default=20,
                   help="fcc cells per axis; 4 atoms each (default 20: 32,000 atoms)")
    p.add_argument("--steps", type=int, metavar="N", default=100, help="measured MD steps (default 100)")
    p.add_argument("--devices", type=int, metavar="N", default=4,
                   help="devices to run on: accelerators when there are that many, else virtual CPU devices "
                        "(default 4)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64",
                   help="floating dtype (default float64)")
    p.add_argument("--thermo-every", type=int, metavar="N", default=50,
                   help="steps between thermo lines (default 50; 0: the first and last step only)")
    p.add_argument("--warmup", type=int, metavar="N", default=None,
                   help="steps of the untimed warm-up that grows capacities and compiles the programs "
                        "(default: as many as --steps)")
    args = p.parse_args(argv)
    if args.warmup is None:
        args.warmup = args.steps
    for name, low in (("n_cells", 1), ("steps", 1), ("devices", 1), ("thermo_every", 0), ("warmup", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name.replace('_', '-')} must be an integer >= {low}, got {getattr(args, name)}")
    # Virtual CPU devices can only be requested before JAX starts a backend, so the device
    # count is checked here, after the request and before anything else touches JAX.
    use_virtual_cpu_devices(args.devices)
    if choose_devices(args.devices) is None:
        seen = ", ".join(f"{len(jax.devices(b))} {b}" for b in _backends())
        fixed = os.environ.get("JAX_NUM_CPU_DEVICES")
        p.error(f"--devices {args.devices}: JAX sees only {seen} device(s)"
                + (f" (JAX_NUM_CPU_DEVICES={fixed})" if fixed is not None else ""))
    return args


def use_virtual_cpu_devices(n: int) -> None:
    """Ask a CPU-only JAX for ``n`` virtual devices, so the distributed runs have a mesh.

    Only possible before JAX creates its backends (importing jaxdd does not); an explicit
    ``JAX_NUM_CPU_DEVICES`` wins. Changes nothing on accelerators.
    """
    if "JAX_NUM_CPU_DEVICES" in os.environ:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialised: keep what there is
        pass


def _backends() -> list[str]:
    default = jax.default_backend()
    return [default] + (["cpu"] if default != "cpu" else [])


def choose_devices(n: int) -> list | None:
    """The first ``n`` devices of the default backend, else of the CPU; None if neither has ``n``."""
    for backend in _backends():
        devices = jax.devices(backend)
        if len(devices) >= n:
            return devices[:n]
    return None


def describe_devices(devices) -> str:
    """One line naming the devices in use, e.g. ``4 x cpu (cpu; 4 of 8 devices)``."""
    kinds = ", ".join(sorted({d.device_kind for d in devices}))
    platform = devices[0].platform
    return f"{len(devices)} x {platform} ({kinds}; {len(devices)} of {len(jax.devices(platform))} devices)"


def rows(*pairs) -> str:
    """``label  value`` lines with the values aligned, one per pair."""
    return "\n".join(f"{k:<14} {v}" for k, v in pairs)


# ---------------------------------------------------------------------- 1. validation


def validate(devices, dtype: str):
    """``trace_and_validate`` of the built-in LJ model on ``devices``; prints and returns the report."""
    from jaxdd.validate import trace_and_validate
    from jaxdd.validate.examples import sample

    data = sample(_VALIDATE_SAMPLE, np.dtype(dtype))
    print(f"1. validation: {_VALIDATE_FACTORY} on sample '{_VALIDATE_SAMPLE}' ({data.n_atoms} atoms), "
          f"1 device against {len(devices)} ranks", flush=True)
    report = trace_and_validate(_VALIDATE_FACTORY, data, world_size=len(devices), devices=devices)
    # The summary opens with the verdict; it is printed last, as the section's result.
    verdict, *details = report.summary().splitlines()
    print("\n".join("   " + line for line in details))
    print(rows(("validation", verdict)), flush=True)
    return report


# ---------------------------------------------------------------------- 2. dynamics


def melt_dynamics(devices):
    """A ``DomainParallel`` of the melt's model: velocity Verlet, LJ units, on ``devices``."""
    from jaxdd.engine import DistributedModel, DomainConfig, default_mesh
    from jaxdd.dynamics import DomainParallel, VelocityVerlet
    from jaxdd.models.lj import LennardJones

    # A model skin lets the loop keep its neighbour list between steps (a Verlet list, as
    # LAMMPS's `neighbor 0.3 bin`); the domain skin lets the halo plan last several steps.
    # Each pair is listed once (LAMMPS's `newton on`), on one of the two ranks holding it.
    model = LennardJones(1.0, 1.0, _CUTOFF, shift=False, skin=_SKIN, half_list=True)
    dm = DistributedModel(model, DomainConfig(_CUTOFF, skin=_HALO_SKIN, mesh=default_mesh(devices)))
    return DomainParallel(dm, VelocityVerlet(_DT), kB=1.0)


_THERMO_HEADER = f"{'Step':>8} {'Temp':>14} {'E_pair':>14} {'TotEng':>14} {'Press':>14}"


def thermo_line(step: int, thermo: dict, n_atoms: int) -> str:
    # LAMMPS in LJ units normalises extensive thermo quantities by the atom count.
    return (f"{step:>8} {thermo['temperature'][0]:>14.8g} {thermo['potential_energy'][0] / n_atoms:>14.8g} "
            f"{thermo['total_energy'][0] / n_atoms:>14.8g} {thermo['pressure'][0]:>14.8g}")


def lammps_check(energy_per_atom: float, max_force: float, dtype: str) -> tuple[bool, str]:
    """(agrees, one line) for the step-0 potential energy per atom and the largest force."""
    from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM

    tol = _TOLERANCE[dtype]
    delta = energy_per_atom - LAMMPS_MELT_ENERGY_PER_ATOM
    ok = abs(delta) <= tol["energy"] and max_force <= tol["forces"]
    return ok, (f"{'OK' if ok else 'MISMATCH'}: step-0 E_pair {energy_per_atom:.12f} vs LAMMPS lj/cut "
                f"{LAMMPS_MELT_ENERGY_PER_ATOM:.12f} (difference {delta:.1e}, tolerance {tol['energy']:.0e}); "
                f"max |F| {max_force:.1e} (perfect lattice: 0; tolerance {tol['forces']:.0e})")


def warm_up(md, data, steps: int) -> int:
    """Run the first ``steps`` steps and throw them away, so that the timed run finds its
    capacities grown and its programs compiled.

    The timed run starts from the same state, so within these steps it follows the same
    trajectory and needs no capacity that was not grown here. (The melting lattice needs
    larger halo capacities than the perfect one: at 32,000 atoms they grow at step 50.)
    JAX compiles a program per input layout: the loop for a state fresh from ``init``
    (forces already sharded over the mesh, the rest not), for atoms laid out again at a
    rebuild and for its own sharded output; the thermo likewise. Hence two halves with a
    thermo between. Programs compiled before a capacity grew do not serve after it, so a
    warm-up that grew one is followed by a short one at the final capacities. Returns the
    steps taken.
    """
    taken = 0
    for length in (steps, min(steps, 10)):
        state = md.run(md.init(data), length // 2)
        grown = md.last_run.recompiles
        md.thermo(state)
        md.run(state, length - length // 2)
        taken += length
        if not grown + md.last_run.recompiles:
            break
    return taken


@contextlib.contextmanager
def compilations():
    """A list that receives the seconds of every XLA compilation inside the block."""
    seconds = []

    def listen(event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":  # jax's name for the XLA compile step
            seconds.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seconds
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def run_melt(args, devices) -> bool:
    """Warm up, run the measured steps with thermo, print the figures; True when step 0 agrees with LAMMPS."""
    from jaxdd.data.systems import LJ_MELT_DENSITY, lj_melt_data

    c = args.n_cells
    data = lj_melt_data(c, temperature=_TEMPERATURE, dtype=np.dtype(args.dtype))
    n_atoms = data.n_atoms
    print(f"\n2. LJ melt: {n_atoms:,} atoms ({c}x{c}x{c} fcc cells, density {LJ_MELT_DENSITY}, T {_TEMPERATURE}), "
          f"lj/cut {_CUTOFF}, skin {_SKIN}, dt {_DT}, velocity Verlet, {args.dtype}", flush=True)
    md = melt_dynamics(devices)

    t0 = time.perf_counter()
    warm = warm_up(md, data, args.warmup)
    state = md.init(data)
    t_warmup = time.perf_counter() - t0
    print(rows(("rank grid", f"{md.grid} on {describe_devices(devices)}"),
               ("warm-up", f"{warm} steps and set-up in {t_warmup:.1f} s, compilation included (not timed below)")))

    thermo0 = md.thermo(state)
    ok, check = lammps_check(float(thermo0["potential_energy"][0]) / n_atoms,
                             float(np.max(np.abs(md.forces(state)))), args.dtype)
    print(_THERMO_HEADER)
    print(thermo_line(0, thermo0, n_atoms), flush=True)
    last = {}

    def log(step, thermo):
        last.update(step=step, thermo=thermo)
        print(thermo_line(step, thermo, n_atoms), flush=True)

    with compilations() as compiled:
        state = md.run(state, args.steps, thermo_every=args.thermo_every, log=log)
    stats = md.last_run
    if last.get("step") != state.step:  # LAMMPS also prints the last step of a run
        log(state.step, md.thermo(state))
    drift = (last["thermo"]["total_energy"][0] - thermo0["total_energy"][0]) / n_atoms
    print(rows(
        ("LAMMPS check", check),
        ("atom-steps/s", f"{stats.atom_steps_per_second:,.0f} ({stats.steps} steps of {n_atoms:,} atoms in "
                         f"{stats.seconds:.2f} s after the warm-up; thermo output included, "
                         + (f"and {len(compiled)} compilations taking {sum(compiled):.1f} s; "
                            f"{stats.steps * n_atoms / (stats.seconds - sum(compiled)):,.0f} without them)"
                            if compiled else "no compilation)")),
        ("rebuilds", f"{stats.rebuilds} plan rebuilds, {stats.migrations:,} atom migrations, "
                     f"{stats.recompiles} capacity recompilations"),
        ("energy drift", f"{drift:+.2e} epsilon per atom over {stats.steps} steps (TotEng; lj/cut is not shifted, "
                         "so a pair crossing the cutoff makes it jump)"),
    ), flush=True)
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    # Must precede every array: arrays made before it stay float32.
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    devices = choose_devices(args.devices)
    print(rows(("devices", describe_devices(devices))), flush=True)
    # Arrays made without a device go to the first device in use (matters only when the
    # default backend has too few devices and the run falls back to the CPU).
    with jax.default_device(devices[0]):
        report = validate(devices, args.dtype)
        if not report.ok:
            print(rows(("verdict", "FAIL: the model does not validate distributed; the melt is not run")))
            return 1
        ok = run_melt(args, devices)
    print(rows(("verdict", "OK" if ok else "FAIL: step 0 disagrees with LAMMPS")))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
