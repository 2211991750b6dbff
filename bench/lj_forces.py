"""Benchmark: Lennard-Jones energy and forces of the LAMMPS LJ melt.

    python bench/lj_forces.py [--n-cells 20] [--repeat 5] [--dtypes float32,float64]
                              [--half-list] [--ref-cells 8] [--json PATH]

The system is the perfect fcc lattice of the melt benchmark (32,000 atoms by default,
rc 2.5 σ, no shift). For each dtype it times, as the median of ``--repeat`` jitted calls
after one warm-up call:

* the neighbour-list build alone (fixed capacity);
* energy + forces including the neighbour-list build;
* energy + forces on a prebuilt neighbour list.

The reference, measured in the same run, is ASE's ``LennardJones(rc=2.5, smooth=False)``
on a smaller melt (``--ref-cells``), timed once; "ratio to ASE" divides jaxdd's atoms per
second (including its neighbour list, as ASE's call does) by ASE's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax

# float64 runs need x64; float32 arrays are made float32 explicitly.
jax.config.update("jax_enable_x64", True)

import equinox as eqx  # noqa: E402
import numpy as np  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.engine.driver import energy_and_derivatives, neighbor_list_for  # noqa: E402
from jaxdd.models.lj import LennardJones  # noqa: E402
from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM, lj_melt, lj_melt_data  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared bench/timing.py
from timing import check_args, write_record  # noqa: E402

CUTOFF = 2.5
OUTPUTS = ("energy", "forces")
DTYPES = ("float32", "float64")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Lennard-Jones energy+forces benchmark on the LAMMPS LJ melt.")
    p.add_argument("--n-cells", type=int, default=20, help="fcc cells per axis (default 20: 32,000 atoms)")
    p.add_argument("--repeat", type=int, default=5, help="timed calls per figure; the median is shown (default 5)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated dtypes (default float32,float64)")
    p.add_argument("--half-list", action="store_true", help="use a half neighbour list (each pair once)")
    p.add_argument("--ref-cells", type=int, default=8, help="fcc cells per axis of the ASE reference run (default 8)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the figures to PATH as JSON")
    args = p.parse_args(argv)
    check_args(p, args, positive=("n_cells", "repeat", "ref_cells"), choices={"dtypes": DTYPES})
    return args


def median_time(fn, repeat: int) -> tuple[float, object]:
    """(median seconds of ``repeat`` calls after one warm-up call, the warm-up's result)."""
    first = jax.block_until_ready(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), first


@eqx.filter_jit
def _forces_with_list(model, batch, capacity):
    nl = neighbor_list_for(model, batch, capacity)
    return energy_and_derivatives(model, batch.replace(neighbors=nl), OUTPUTS), nl.overflow


@eqx.filter_jit
def _forces_prebuilt(model, batch):
    return energy_and_derivatives(model, batch, OUTPUTS)


def bench_dtype(dtype: str, n_cells: int, repeat: int, half_list: bool) -> dict:
    """Figures of one dtype: times (s), atoms/s and the energy check."""
    batch = jaxdd.as_batch(lj_melt_data(n_cells, dtype=np.dtype(dtype)))
    model = LennardJones(sigma=1.0, epsilon=1.0, cutoff=CUTOFF, shift=False, half_list=half_list)
    nc = model.model_config.neighbor_config
    n = batch.n_atoms
    capacity = jaxdd.neighbor_capacity(
        batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
        cutoff=nc.search_cutoff, half=nc.half_list,
    )
    build = jax.jit(partial(
        jaxdd.build_neighbor_list, cutoff=nc.search_cutoff, capacity=capacity, half=nc.half_list, format=nc.format,
    ))
    args = (batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask)
    t_list, nl = median_time(lambda: build(*args), repeat)
    if bool(nl.overflow):
        raise RuntimeError(f"neighbour list overflowed at capacity {capacity}; the timings would be of a partial list")

    t_full, (out, overflow) = median_time(lambda: _forces_with_list(model, batch, capacity), repeat)
    if bool(overflow):
        raise RuntimeError(f"neighbour list overflowed at capacity {capacity}")
    prebuilt = batch.replace(neighbors=nl)
    t_pre, _ = median_time(lambda: _forces_prebuilt(model, prebuilt), repeat)

    if out["forces"].dtype != np.dtype(dtype):
        raise RuntimeError(f"forces came out {out['forces'].dtype}, not {dtype}: the {dtype} timing would be wrong")
    e_atom = float(np.asarray(out["energy"], np.float64)[0]) / n
    return dict(
        n_atoms=n,
        neighbor_list_s=t_list, neighbor_list_atoms_per_s=n / t_list,
        energy_forces_s=t_full, energy_forces_atoms_per_s=n / t_full,
        prebuilt_s=t_pre, prebuilt_atoms_per_s=n / t_pre,
        energy_per_atom=e_atom, energy_per_atom_minus_lammps=e_atom - LAMMPS_MELT_ENERGY_PER_ATOM,
        max_abs_force=float(np.max(np.abs(np.asarray(out["forces"], np.float64)))),
    )


def bench_ase(ref_cells: int) -> dict:
    """One timed energy+forces call of ASE's Lennard-Jones (its neighbour list included)."""
    from ase.calculators.lj import LennardJones as AseLennardJones

    atoms = lj_melt(ref_cells)
    atoms.calc = AseLennardJones(sigma=1.0, epsilon=1.0, rc=CUTOFF, smooth=False)
    t0 = time.perf_counter()
    atoms.get_forces()
    seconds = time.perf_counter() - t0
    return dict(
        code="ase.calculators.lj.LennardJones(sigma=1, epsilon=1, rc=2.5, smooth=False)",
        n_cells=ref_cells, n_atoms=len(atoms), seconds=seconds, atoms_per_s=len(atoms) / seconds,
    )


def format_table(results: dict, ref: dict, header: str) -> str:
    dtypes = list(results)
    rows = [
        ("neighbour list [s]", "neighbor_list_s", "{:.4f}"),
        ("  atoms/s", "neighbor_list_atoms_per_s", "{:,.0f}"),
        ("E+F incl. list [s]", "energy_forces_s", "{:.4f}"),
        ("  atoms/s", "energy_forces_atoms_per_s", "{:,.0f}"),
        ("E+F prebuilt list [s]", "prebuilt_s", "{:.4f}"),
        ("  atoms/s", "prebuilt_atoms_per_s", "{:,.0f}"),
        ("E/N [epsilon]", "energy_per_atom", "{:.12f}"),
        ("E/N - LAMMPS", "energy_per_atom_minus_lammps", "{:.2e}"),
        ("max |F| [epsilon/sigma]", "max_abs_force", "{:.2e}"),
        ("ratio to ASE (incl. list)", "ratio_to_ase", "{:.1f}x"),
    ]
    w0 = max(len(r[0]) for r in rows)
    cells = [[fmt.format(results[d][key]) for d in dtypes] for _, key, fmt in rows]
    w = max(max(len(c) for row in cells for c in row), *(len(d) for d in dtypes))
    lines = [header, f"{'':<{w0}}  " + "  ".join(f"{d:>{w}}" for d in dtypes)]
    lines += [f"{label:<{w0}}  " + "  ".join(f"{c:>{w}}" for c in row) for (label, _, _), row in zip(rows, cells)]
    lines.append(
        f"reference: ASE LennardJones(rc=2.5, smooth=False), {ref['n_atoms']:,} atoms "
        f"({ref['n_cells']}^3 cells), one call {ref['seconds']:.3f} s = {ref['atoms_per_s']:,.0f} atoms/s; "
        f"LAMMPS E/N {LAMMPS_MELT_ENERGY_PER_ATOM:.12f}"
    )
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    devices = jax.devices()
    device = f"{devices[0].platform} x{len(devices)} ({devices[0].device_kind}); computing on {devices[0]}"
    results = {d: bench_dtype(d, args.n_cells, args.repeat, args.half_list) for d in args.dtypes}
    ref = bench_ase(args.ref_cells)
    for fig in results.values():
        fig["ratio_to_ase"] = fig["energy_forces_atoms_per_s"] / ref["atoms_per_s"]
    n = next(iter(results.values()))["n_atoms"]
    c = args.n_cells
    header = (
        f"LJ melt energy+forces: {n:,} atoms ({c}^3 fcc cells), rc {CUTOFF} sigma, "
        f"{'half' if args.half_list else 'full'} list, median of {args.repeat}; {device}"
    )
    print(format_table(results, ref, header), flush=True)
    if args.json is not None:
        record = dict(
            benchmark="lj_forces", n_cells=c, n_atoms=n, cutoff=CUTOFF, half_list=args.half_list,
            repeat=args.repeat, device=device, lammps_energy_per_atom=LAMMPS_MELT_ENERGY_PER_ATOM,
            results=results, reference=ref,
        )
        write_record(args.json, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
