"""Lennard-Jones energy and forces of the LAMMPS LJ melt, with timings.

    python -m jaxdd.demo [--n-cells 20] [--dtype float64|float32] [--repeat 5] [--devices N]

Builds the perfect fcc lattice of the melt benchmark (32,000 atoms by default, LJ reduced
units, ``pair_style lj/cut 2.5`` without shift), evaluates energy and forces on the first
JAX device, and compares the energy per atom with LAMMPS's step-0 value. By symmetry every
force of the perfect lattice is zero, so max |F| measures rounding alone. Then it runs the
same model under domain decomposition on N devices (8 virtual CPU devices on a CPU) and
checks that the result equals the single-device one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

# Agreement expected with LAMMPS (ε per atom) and of the forces with zero (ε/σ). float64:
# rounding of ~55 pair terms per atom leaves ~1e-13, so 1e-9 has ample room. float32: a
# pairwise-summed float32 total is good to ~1e-6 of |E/N| = 6.77; 7e-5 is 1e-5 of it.
_TOLERANCE = {
    "float64": {"energy": 1e-9, "forces": 1e-9, "dd_energy_rel": 1e-10, "dd_forces": 1e-9},
    "float32": {"energy": 7e-5, "forces": 5e-4, "dd_energy_rel": 1e-5, "dd_forces": 1e-3},
}
_CUTOFF = 2.5


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxdd.demo",
        description="Lennard-Jones energy and forces of the LAMMPS LJ melt (perfect fcc lattice), with timings.",
    )
    p.add_argument("--n-cells", type=int, default=20, help="fcc cells per axis; 4 atoms each (default 20: 32,000 atoms)")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64", help="floating dtype (default float64)")
    p.add_argument("--repeat", type=int, default=5, help="steady-state calls to time; the median is shown (default 5)")
    p.add_argument("--devices", type=int, default=None,
                   help="devices of the distributed run (default: all JAX sees; 0 skips it)")
    args = p.parse_args(argv)
    if args.n_cells < 1:
        p.error(f"--n-cells must be a positive integer, got {args.n_cells}")
    if args.repeat < 1:
        p.error(f"--repeat must be a positive integer, got {args.repeat}")
    if args.devices is not None and not 0 <= args.devices <= len(jax.devices()):
        p.error(f"--devices must be between 0 and {len(jax.devices())} (the devices JAX sees), got {args.devices}")
    return args


def _timed(fn):
    """(result, seconds) of ``fn()``, waiting for every array in the result."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def _timed_host(fn):
    # neighbor_capacity returns host integers, so it has already waited for the device.
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def describe_devices() -> str:
    """One line naming the devices JAX sees, e.g. ``cpu x8 (cpu); computing on cpu:0``."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return f"{devices[0].platform} x{len(devices)} ({', '.join(kinds)}); computing on {devices[0]}"


def run(n_cells: int, dtype: str, repeat: int, devices: int | None = None) -> dict:
    """Build the melt, size the neighbour list, evaluate energy and forces; return the figures.

    Times in s; energy per atom in ε; max |F| in ε/σ. Call after choosing x64 (see ``main``).
    """
    # Imported here so that nothing of jaxdd loads before main() has set x64.
    import jaxdd
    from jaxdd.models.lj import LennardJones
    from jaxdd.systems import LAMMPS_MELT_ENERGY_PER_ATOM, lj_melt_data

    batch = jaxdd.as_batch(lj_melt_data(n_cells, dtype=np.dtype(dtype)))
    model = LennardJones(sigma=1.0, epsilon=1.0, cutoff=_CUTOFF, shift=False)
    nc = model.model_config.neighbor_config
    n_atoms = batch.n_atoms

    capacity, t_sizing = _timed_host(
        lambda: jaxdd.neighbor_capacity(
            batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
            cutoff=nc.search_cutoff, half=nc.half_list,
        )
    )
    # The same capacity on every call keeps the jit cache key fixed: one compilation.
    call = lambda: jaxdd.compute(model, batch, ("energy", "forces"), capacity=capacity)  # noqa: E731
    out, t_first = _timed(call)
    steady = [_timed(call)[1] for _ in range(repeat)]
    t_steady = statistics.median(steady)

    e_atom = float(np.asarray(out["energy"], np.float64)[0]) / n_atoms
    f_max = float(np.max(np.abs(np.asarray(out["forces"], np.float64))))
    dist = None
    n_dev = len(jax.devices()) if devices is None else devices
    if n_dev:
        from jaxdd.distributed import default_mesh

        dm = jaxdd.DistributedModel(model, jaxdd.DomainConfig(cutoff=_CUTOFF, mesh=default_mesh(jax.devices()[:n_dev])))
        dcall = lambda: dm(batch, ("energy", "forces"))  # noqa: E731
        dout, d_first = _timed(dcall)
        d_steady = statistics.median(_timed(dcall)[1] for _ in range(repeat))
        e_ref = float(np.asarray(out["energy"], np.float64)[0])
        dist = dict(
            n=n_dev, grid=dm.health.grid, t_first=d_first, t_steady=d_steady,
            energy_rel=abs(float(np.asarray(dout["energy"], np.float64)[0]) - e_ref) / abs(e_ref),
            forces_abs=float(np.max(np.abs(np.asarray(dout["forces"], np.float64) - np.asarray(out["forces"], np.float64)))),
        )
    return dict(
        distributed=dist,
        n_cells=n_cells, n_atoms=n_atoms, dtype=dtype, repeat=repeat,
        devices=describe_devices(),
        t_sizing=t_sizing, t_first=t_first, t_steady=t_steady,
        atoms_per_s=n_atoms / t_steady,
        energy_per_atom=e_atom, reference=LAMMPS_MELT_ENERGY_PER_ATOM,
        delta=e_atom - LAMMPS_MELT_ENERGY_PER_ATOM, max_force=f_max,
    )


def verdict(fig: dict) -> str:
    tol = _TOLERANCE[fig["dtype"]]
    e_ok = abs(fig["delta"]) <= tol["energy"]
    f_ok = fig["max_force"] <= tol["forces"]
    dist = fig.get("distributed")
    d_ok = dist is None or (dist["energy_rel"] <= tol["dd_energy_rel"] and dist["forces_abs"] <= tol["dd_forces"])
    if e_ok and f_ok and d_ok:
        same = "" if dist is None else f"; {dist['n']} devices equal 1 device"
        return f"OK: E/N within {tol['energy']:.0e} of LAMMPS, max |F| below {tol['forces']:.0e}{same} ({fig['dtype']})"
    parts = []
    if not d_ok:
        parts.append(f"distributed run differs from 1 device (energy rel {dist['energy_rel']:.1e}, "
                     f"forces {dist['forces_abs']:.1e})")
    if not e_ok:
        parts.append(f"E/N off LAMMPS by {fig['delta']:.2e} (tolerance {tol['energy']:.0e})")
    if not f_ok:
        parts.append(f"max |F| {fig['max_force']:.2e} (tolerance {tol['forces']:.0e})")
    return "MISMATCH: " + "; ".join(parts)


def format_table(fig: dict) -> str:
    c = fig["n_cells"]
    rows = [
        ("system", f"{fig['n_atoms']:,} atoms, LJ melt ({c}x{c}x{c} fcc cells, density 0.8442, rc {_CUTOFF} sigma)"),
        ("dtype", fig["dtype"]),
        ("devices", fig["devices"]),
        ("neighbour sizing", f"{fig['t_sizing']:.3f} s"),
        ("first call", f"{fig['t_first']:.3f} s (includes compilation)"),
        ("energy+forces", f"{fig['t_steady']:.3f} s (median of {fig['repeat']})"),
        ("atoms per second", f"{fig['atoms_per_s']:,.0f}"),
        ("energy per atom", f"{fig['energy_per_atom']:.12f} epsilon"),
        ("LAMMPS lj/cut", f"{fig['reference']:.12f} epsilon"),
        ("difference", f"{fig['delta']:.3e} epsilon"),
        ("max |F|", f"{fig['max_force']:.3e} epsilon/sigma"),
    ]
    dist = fig.get("distributed")
    if dist is not None:
        rows += [
            ("distributed", f"{dist['n']} devices, rank grid {dist['grid']}"),
            ("  first call", f"{dist['t_first']:.3f} s (includes partition, halo plan, compilation)"),
            ("  energy+forces", f"{dist['t_steady']:.3f} s (median of {fig['repeat']})"),
            ("  vs 1 device", f"energy rel {dist['energy_rel']:.1e}, max |dF| {dist['forces_abs']:.1e}"),
        ]
    rows.append(("verdict", verdict(fig)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def use_virtual_cpu_devices(n: int = 8) -> None:
    """Give a CPU-only JAX ``n`` virtual devices, so the distributed run has a mesh.

    Only possible before JAX creates its backends (importing jaxdd does not); an explicit
    ``JAX_NUM_CPU_DEVICES`` wins. Changes nothing on accelerators.
    """
    if "JAX_NUM_CPU_DEVICES" in os.environ:
        return
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # backends already initialised: keep what there is
        pass


def main(argv=None) -> int:
    use_virtual_cpu_devices()
    args = parse_args(argv)
    # Must precede every array: arrays made before it stay float32.
    jax.config.update("jax_enable_x64", args.dtype == "float64")
    fig = run(args.n_cells, args.dtype, args.repeat, args.devices)
    print(format_table(fig), flush=True)
    return 0 if verdict(fig).startswith("OK") else 1


if __name__ == "__main__":
    sys.exit(main())
