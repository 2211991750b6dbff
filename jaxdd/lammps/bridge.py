"""``LammpsBridge``: a jaxdd model as the force field of a running LAMMPS, through
``fix ID group external pf/callback 1 1``.

At every force evaluation LAMMPS calls the fix's callback with its local atoms (ids,
positions, and the force array to fill). The bridge reads the atom types and the box,
evaluates the model (:class:`~jaxdd.lammps.evaluator.ForceEvaluator`), writes the forces,
and hands LAMMPS the energy (the fix's share of ``pe`` with ``fix_modify ID energy yes``),
the global virial (its share of the pressure with ``virial yes``, so barostats see it) and,
when asked, per-atom energies and virials (``compute pe/atom``, ``compute stress/atom``).
Units are LAMMPS's ``metal``: eV, Å, eV/Å; the virial in eV (LAMMPS's Σ r ⊗ f, W = -dE/dε).

LAMMPS runs on one MPI rank; the model runs on every device of the process.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import warnings

import numpy as np

from .evaluator import ForceEvaluator, Result
from .species import species_map, species_table
from .units import check_units

__all__ = ["LammpsBridge", "BridgeError", "LostAtomsError", "SeveralRanksError", "lammps_cell"]


class BridgeError(ValueError):
    """The bridge cannot attach to this LAMMPS: no such fix, or a fix of another style."""


class SeveralRanksError(BridgeError):
    """LAMMPS runs on several MPI ranks; the bridge runs it on one."""


class LostAtomsError(RuntimeError):
    """LAMMPS lost every atom during the run (``thermo_modify lost ignore`` kept it going)."""


SEVERAL_RANKS = (
    "LAMMPS runs on {n} MPI ranks; the jaxdd bridge runs LAMMPS on one rank and evaluates the model on every "
    "device of that process (split over them by its domain decomposition, --grid). Run without mpirun: "
    "python -m jaxdd.lammps -in SCRIPT --model MODULE:FACTORY (LAMMPS's own work is then integration and "
    "output, which one rank does quickly); with several GPUs, make them all visible to that one process")


def lammps_cell(lmp) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """LAMMPS's box as (cell [3, 3] Å, rows a, b, c; origin [3] Å, ``boxlo``; periodic axes [3] bool).

    Args:
      lmp: a ``lammps.lammps`` instance with a box.
    """
    lo, hi, xy, yz, xz, periodicity, _ = lmp.extract_box()
    lx, ly, lz = (float(h) - float(l) for h, l in zip(hi, lo))
    cell = np.array([[lx, 0.0, 0.0], [xy, ly, 0.0], [xz, yz, lz]], np.float64)
    return cell, np.asarray(lo, np.float64), np.asarray(periodicity, bool)


class LammpsBridge:
    """Attach ``model`` to the ``fix external pf/callback`` named ``fix_id`` of a LAMMPS instance.

    Args:
      lmp: a ``lammps.lammps`` instance, with its box and the fix already defined.
      fix_id: the ID of a ``fix ID group external pf/callback Ncall Napply``.
      model: a :class:`~jaxdd.BaseModel` or a :class:`~jaxdd.DistributedModel`.
      types: ``{LAMMPS type: element symbol or atomic number}``; every type of the system needs one.
      skin: the ghost shell beyond the model's neighbour range (Å), for a bare model.
      mesh, grid: the device mesh and rank grid, for a bare model (default: every device,
        the least-surface grid).
      virial: hand LAMMPS the global virial (``fix_modify ID virial yes``); False sets
        ``virial no`` and skips computing it.
      atom_terms: hand LAMMPS per-atom energies and virials at every call (for ``compute
        pe/atom``, ``stress/atom``, ``heat/flux``).

    The bridge sets ``fix_modify ID energy yes virial yes|no``. An error while LAMMPS runs
    (the model fails, an atom type changes to one without a species) stops the run at that
    step (LAMMPS's timeout, which also skips later ``run`` commands); :attr:`error` holds it and
    :meth:`raise_error` raises it.
    """

    def __init__(self, lmp, fix_id: str, model, types, *, skin: float = 2.0, mesh=None, grid=None,
                 virial: bool = True, atom_terms: bool = False):
        ranks = int(lmp.extract_setting("world_size"))
        if ranks > 1:
            raise SeveralRanksError(SEVERAL_RANKS.format(n=ranks))
        check_units(lmp.extract_global("units"))
        if not lmp.has_id("fix", fix_id):
            raise BridgeError(f"LAMMPS has no fix {fix_id!r} (its fixes: {', '.join(lmp.available_ids('fix')) or 'none'})"
                              f"; define it before attaching: fix {fix_id} all external pf/callback 1 1")
        self.lmp = lmp
        self.fix_id = str(fix_id)
        self.types = species_map(types)
        self.table = species_table(self.types, int(lmp.extract_global("ntypes")))
        self.evaluator = ForceEvaluator(model, skin=skin, mesh=mesh, grid=grid, virial=virial, atom_terms=atom_terms)
        self.atom_terms = bool(atom_terms)
        self.virial = bool(virial)
        #: The exception that stopped the run, or None.
        self.error: BaseException | None = None
        #: The last evaluation (a :class:`~jaxdd.lammps.evaluator.Result`), None before the first.
        self.last: Result | None = None
        if _fix_mode(lmp, self.fix_id) == "pf/array":
            raise BridgeError(f"fix {fix_id} is 'external pf/array', which takes forces from an array and never calls "
                              "back: the model would not run and pe would stay 0. Define it as 'fix "
                              f"{fix_id} all external pf/callback 1 1' before attaching")
        lmp.set_fix_external_callback(self.fix_id, self.callback)
        lmp.command(f"fix_modify {self.fix_id} energy yes virial {'yes' if virial else 'no'}")

    def callback(self, caller, step, nlocal, tag, x, f) -> None:
        """What LAMMPS calls at each force evaluation (``fix external``'s Python callback).

        Args:
          caller: unused (LAMMPS passes the object given at registration).
          step: the time step. nlocal: LAMMPS's local atoms N.
          tag: [N] atom ids. x: [N, 3] Å positions. f: [N, 3] eV/Å, filled here.
        """
        if self.error is not None:  # the run is ending; nothing more is evaluated
            f[:] = 0.0
            return
        try:
            result = self.evaluate(tag, x)
            f[:] = result.forces
            self.hand_over(result)
        except BaseException as exc:  # noqa: BLE001  (LAMMPS would ignore it: stop the run, keep it)
            self.error = exc
            f[:] = 0.0
            self.lmp.force_timeout()

    def evaluate(self, tag, x) -> Result:
        """The model at LAMMPS's atoms now: reads their types and the box.

        Args:
          tag: [N] atom ids. x: [N, 3] Å positions, in LAMMPS's local order.
        """
        n = len(tag)
        natoms = int(self.lmp.get_natoms())
        if n < natoms:  # LAMMPS counts its atoms again only at thermo output (lost atoms)
            self._lost(natoms - n, natoms, n)
        types = np.asarray(self.lmp.numpy.extract_atom("type"))[:n]
        if types.size and int(types.max()) >= len(self.table):
            self.table = species_table(self.types, int(self.lmp.extract_global("ntypes")))
        numbers = self.table[types]
        if n and not np.all(numbers > 0):
            species_table(self.types, int(types.max()))  # raises, naming the type without a species
        cell, origin, pbc = lammps_cell(self.lmp)
        self.last = self.evaluator(tag, x, numbers, cell, origin, pbc)
        return self.last

    def _lost(self, lost: int, natoms: int, n: int) -> None:
        """Atoms LAMMPS dropped since it last counted them: all of them is a
        :class:`LostAtomsError`, some a warning (LAMMPS's ``thermo_modify lost`` decides)."""
        step = int(self.lmp.extract_global("ntimestep"))
        dt = float(self.lmp.extract_global("dt"))
        cause = (f"atoms that flew out of the box in one step, most often a time step too large (timestep {dt:g} ps; "
                 "metal units take about 0.001 ps) or forces too large (atoms overlapping at the start)")
        if n == 0:
            raise LostAtomsError(f"Lost atoms: all {natoms} atoms were lost by step {step}, none is left for the "
                                 f"model ({cause}). Use a smaller timestep, minimize first, and leave "
                                 "'thermo_modify lost error' (LAMMPS's default) on to stop at the first atom lost")
        warnings.warn(f"Lost atoms: {lost} of {natoms} atoms were lost by step {step} ({cause}); the model "
                      "continues with the rest as 'thermo_modify lost' allows", RuntimeWarning, stacklevel=2)

    def hand_over(self, result: Result) -> None:
        """Give LAMMPS the energy, the virial and the per-atom terms of ``result`` (forces aside)."""
        lmp, fid = self.lmp, self.fix_id
        lmp.fix_external_set_energy_global(fid, float(result.energy))
        if self.virial:
            w = result.virial
            lmp.fix_external_set_virial_global(fid, [w[0, 0], w[1, 1], w[2, 2], w[0, 1], w[0, 2], w[1, 2]])
        if self.atom_terms:
            _set_peratom(lmp, fid, result.atomic_energies, result.atomic_virials)

    def raise_error(self) -> None:
        """Raise the error that stopped the run, if one did."""
        if self.error is not None:
            raise self.error


def _set_peratom(lmp, fix_id: str, energies: np.ndarray, virials: np.ndarray) -> None:
    """Per-atom energies [N] eV and virials [N, 3, 3] eV into the fix, through the C
    library (the Python wrappers copy element by element). LAMMPS's per-atom virial has six
    components (xx, yy, zz, xy, xz, yz): the symmetric part of W_i."""
    c_double_p = ctypes.POINTER(ctypes.c_double)
    e = np.ascontiguousarray(energies, np.float64)
    w = 0.5 * (virials + np.swapaxes(virials, 1, 2))
    v = np.ascontiguousarray(np.stack([w[:, 0, 0], w[:, 1, 1], w[:, 2, 2], w[:, 0, 1], w[:, 0, 2], w[:, 1, 2]], 1))
    rows = (v.ctypes.data + v.strides[0] * np.arange(len(v), dtype=np.uintp)).astype(np.uintp)
    key = fix_id.encode()
    lmp.lib.lammps_fix_external_set_energy_peratom(lmp.lmp, key, e.ctypes.data_as(c_double_p))
    lmp.lib.lammps_fix_external_set_virial_peratom(lmp.lmp, key, rows.ctypes.data_as(ctypes.POINTER(c_double_p)))


def _fix_mode(lmp, fix_id: str) -> str | None:
    """``"pf/callback"`` or ``"pf/array"``: the mode of ``fix ID group external MODE``, or None
    where it cannot be told (LAMMPS before 2Apr2025, or another setting stops LAMMPS's init).

    LAMMPS does not report a fix's arguments; its init tells the modes apart: a ``pf/callback``
    fix without a callback refuses to start, a ``pf/array`` one does not. The callback is unset
    and ``write_coeff`` (which inits LAMMPS, moving no atom) is run with LAMMPS's error printing off.
    A fix of another style is a :class:`BridgeError`.
    """
    from lammps.core import ExceptionCheck

    key = fix_id.encode()
    try:  # a NULL callback: LAMMPS checks the fix's style
        with ExceptionCheck(lmp):
            lmp.lib.lammps_set_fix_external_callback(lmp.lmp, key, lmp.FIX_EXTERNAL_CALLBACK_FUNC(), None)
    except Exception as exc:  # LAMMPS's own message: the fix is not of style external
        raise BridgeError(f"fix {fix_id!r} cannot take the jaxdd callback ({' '.join(str(exc).split())}); it must "
                          f"be 'fix {fix_id} all external pf/callback 1 1'") from None
    if not hasattr(lmp.lib, "lammps_set_show_error"):
        return None
    with tempfile.TemporaryDirectory(prefix="jaxdd_lammps_") as tmp:
        before = lmp.lib.lammps_set_show_error(lmp.lmp, 0)
        try:
            lmp.command(f"write_coeff {os.path.join(tmp, 'coeff')}")
        except Exception as exc:
            return "pf/callback" if "callback function not set" in str(exc) else None
        finally:
            lmp.lib.lammps_set_show_error(lmp.lmp, before)
    return "pf/array"

