"""A LAMMPS input script read before it runs: the ``fix external`` the bridge attaches to,
the unit style, the number of atom types and whether per-atom terms are computed, and the
script cut in two around the fix (LAMMPS runs the first part, the bridge attaches, LAMMPS
runs the rest).

Commands are read as LAMMPS reads them: ``&`` continues a line, ``#`` starts a comment
(outside quotes), words are split on whitespace. Commands whose words hold variables
(``$x``, ``${x}``) are read as they stand; what cannot be known before the run (a unit style
or a type count behind a variable) is checked again once LAMMPS holds the system.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

__all__ = ["ScriptError", "Command", "Script", "read_script"]

#: Computes and fixes that read per-atom energies or virials from the force field.
PER_ATOM_STYLES = ("pe/atom", "stress/atom", "centroid/stress/atom", "heat/flux", "stress/cartesian",
                   "stress/cylinder", "stress/spherical", "stress/mop", "stress/mop/profile")


class ScriptError(ValueError):
    """A script the bridge cannot run: unreadable, no ``fix external``, or not in units metal."""


@dataclasses.dataclass(frozen=True)
class Command:
    """One command of a script: its words and the physical lines it spans (1-based, last inclusive)."""

    words: tuple[str, ...]
    first: int
    last: int


@dataclasses.dataclass(frozen=True)
class Script:
    """A script read before it runs.

    path: the file. lines: its physical lines. commands: its :class:`Command` s. fix: the
    command of the ``fix ID group external pf/callback`` the bridge attaches to.
    units: the style of the first ``units`` command (None: none; LAMMPS's default is lj).
    reads_restart: a ``read_restart`` comes first (the restart file holds the unit style).
    n_types: atom types declared by ``create_box`` or a data file's header (None: unknown).
    atom_terms: a compute or fix reads per-atom energies or virials (``pe/atom``, ``stress/atom``, ...).
    virial: the script leaves the fix's virial on (no ``fix_modify ID virial no``).
    """

    path: Path
    lines: tuple[str, ...]
    commands: tuple[Command, ...]
    fix: Command
    units: str | None
    reads_restart: bool
    n_types: int | None
    atom_terms: bool
    virial: bool

    @property
    def fix_id(self) -> str:
        """The ID of the fix the bridge attaches to."""
        return self.fix.words[1]

    def split(self) -> tuple[str, str]:
        """(the script up to and including the fix's command, the rest), as text."""
        return "".join(self.lines[:self.fix.last]), "".join(self.lines[self.fix.last:])


def _commands(lines) -> list[Command]:
    out, words, first = [], [], None
    for number, raw in enumerate(lines, 1):
        text = raw.rstrip("\n")
        text = _without_comment(text)
        more = text.rstrip().endswith("&")
        if more:
            text = text.rstrip()[:-1]
        if first is None:
            first = number
        try:
            words += shlex.split(text, posix=True)
        except ValueError:  # an unbalanced quote: LAMMPS will say so; read the words plainly
            words += text.split()
        if not more:
            if words:
                out.append(Command(tuple(words), first, number))
            words, first = [], None
    if words:
        out.append(Command(tuple(words), first, len(lines)))
    return out


def _without_comment(text: str) -> str:
    """``text`` up to a ``#`` outside quotes."""
    quote = None
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return text[:i]
    return text


def _is_external(cmd: Command) -> bool:
    w = cmd.words
    return len(w) >= 4 and w[0] == "fix" and w[3] == "external"


def _data_file_types(path: Path) -> int | None:
    """The ``N atom types`` of a LAMMPS data file's header, or None."""
    try:
        with open(path) as f:
            for i, line in enumerate(f):
                match = re.match(r"^\s*(\d+)\s+atom\s+types\b", line)
                if match:
                    return int(match.group(1))
                if i > 200 or re.match(r"^\s*(Atoms|Masses|Velocities)\b", line):
                    return None
    except OSError:
        return None
    return None


def read_script(path, fix_id: str | None = None) -> Script:
    """Read ``path`` and find the ``fix external`` the bridge attaches to.

    Args:
      path: the LAMMPS input script.
      fix_id: the fix's ID; required when the script defines several fixes of style external
        (default: its one ``fix ... external``).

    Returns:
      A :class:`Script`; a :class:`ScriptError` when the file cannot be read, names no
      ``fix ID group external pf/callback Ncall Napply`` (or no such ``fix_id``), names
      several without ``fix_id``, or names one with ``pf/array`` (which has no callback).
    """
    path = Path(path)
    try:
        lines = tuple(path.read_text().splitlines(keepends=True))
    except (OSError, UnicodeDecodeError) as exc:
        raise ScriptError(f"cannot read the input script {path}: {exc.strerror or exc}") from None
    commands = _commands(lines)
    externals = [c for c in commands if _is_external(c)]
    chosen = [c for c in externals if fix_id is None or c.words[1] == fix_id]
    ids = list(dict.fromkeys(c.words[1] for c in externals if len(c.words) > 1))
    if fix_id is None and len(ids) > 1:  # the bridge would serve one; LAMMPS stops at the other's first call
        raise ScriptError(f"{path} defines {len(ids)} fixes of style external ({', '.join(ids)}); say which one is "
                          f"the jaxdd model's with --fix (e.g. --fix {ids[0]})")
    if not chosen:
        if fix_id is not None and externals:
            raise ScriptError(f"{path} has no fix {fix_id!r} of style external (its fix external: "
                              f"{', '.join(c.words[1] for c in externals)}); pass --fix with one of them")
        what = f"fix {fix_id!r}" if fix_id else "fix of style external"
        raise ScriptError(f"{path} names no {what} for the jaxdd model: add 'fix {fix_id or 'jaxdd'} all external "
                          "pf/callback 1 1' where the pair style would be (and no pair_style)")
    fix = chosen[0]
    if len(fix.words) < 5 or fix.words[4] != "pf/callback":
        raise ScriptError(f"{path}, line {fix.first}: fix {fix.words[1]} must be 'external pf/callback Ncall Napply' "
                          f"for the jaxdd callback, got '{' '.join(fix.words)}'")
    if fix.words[2] != "all":  # LAMMPS applies the forces to the group only; the energy is every atom's
        raise ScriptError(f"{path}, line {fix.first}: fix {fix.words[1]} acts on group {fix.words[2]!r}; the jaxdd "
                          "model is the potential of every atom (its energy counts them all, LAMMPS would apply "
                          f"forces to the group only): use 'fix {fix.words[1]} all external pf/callback ...'")
    before = [c for c in commands if c.first < fix.first]
    units = next((c.words[1] for c in before if c.words[0] == "units" and len(c.words) > 1), None)
    reads_restart = units is None and any(c.words[0] == "read_restart" for c in before)
    n_types = None
    for c in before:
        w = c.words
        if w[0] == "create_box" and len(w) > 1 and w[1].isdigit():
            n_types = int(w[1])
        elif w[0] == "read_data" and len(w) > 1 and "$" not in w[1]:
            # LAMMPS opens it relative to the working directory; the script's folder is the usual place too.
            n_types = _data_file_types(Path(w[1]))
            if n_types is None and not Path(w[1]).is_absolute():
                n_types = _data_file_types(path.parent / w[1])
        elif w[0] in ("read_restart", "read_dump"):
            n_types = None
    atom_terms = any(any(style in c.words[2:4] for style in PER_ATOM_STYLES)
                     for c in commands if c.words[0] in ("compute", "fix"))
    virial = True
    for c in commands:
        w = c.words
        if w[0] == "fix_modify" and len(w) > 1 and w[1] == fix.words[1] and "virial" in w:
            i = w.index("virial")
            virial = i + 1 >= len(w) or w[i + 1] != "no"
    return Script(path=path, lines=lines, commands=tuple(commands), fix=fix, units=units,
                  reads_restart=reads_restart, n_types=n_types, atom_terms=atom_terms, virial=virial)
