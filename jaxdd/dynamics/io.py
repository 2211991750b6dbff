"""Output of a run: an extxyz trajectory writer, a progress line, and the reading of a
dynamics checkpoint's files (refusing a damaged one with an error naming the file)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np

from ..checkpoint import array_tree, damaged, read_json, restore_arrays

__all__ = ["ExtXYZWriter", "Progress", "read_md_json", "read_md_arrays", "host_array"]


def host_array(x) -> np.ndarray:
    """``x`` whole on the host; with several processes each contributes its devices' rows
    (a collective: every process must call it)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


class ExtXYZWriter:
    """Appends frames to an extended-XYZ file (readable by ``ase.io.read(path, ":")``).

    Each frame is one system of the gathered batch at one step, with positions (Å, unwrapped),
    velocities, forces (eV/Å), and ``step``, ``system`` and ``energy`` (eV) in its info line.
    """

    def __init__(self, path):
        self.path = Path(path)
        self.frames = 0
        if self.path.exists():
            raise FileExistsError(f"trajectory {self.path} exists; choose a new file")

    def write(self, md, state) -> None:
        from ase.calculators.singlepoint import SinglePointCalculator
        from ase.io import write

        batch = md.gather(state)
        forces = md.forces(state)
        energy = np.asarray(state.energy, np.float64)
        real = np.asarray(batch.atom_mask)
        system = np.asarray(batch.batch_idx)
        frames = []
        for s, atoms in enumerate(batch.to_ase()):
            rows = real & (system == s)
            atoms.calc = SinglePointCalculator(atoms, energy=float(energy[s]), forces=forces[rows])
            atoms.info.update(step=int(state.step), system=s)
            frames.append(atoms)
        if jax.process_index() == 0:  # every process gathered the frame; one writes it
            with open(self.path, "a") as handle:
                write(handle, frames, format="extxyz")
        self.frames += len(frames)


class Progress:
    """A one-line progress report on stderr: steps done, atom-steps per second."""

    def __init__(self, total: int, n_atoms: int, stream=None):
        self.total, self.n_atoms = total, n_atoms
        self.stream = stream if stream is not None else sys.stderr
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        width = 30
        filled = int(width * done / max(self.total, 1))
        rate = done * self.n_atoms / elapsed
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} steps  "
                          f"{rate:,.0f} atom-steps/s")
        self.stream.flush()

    def close(self, stats) -> None:
        self.stream.write(f"\n{stats.steps} steps in {stats.seconds:.2f} s: {stats.atom_steps_per_second:,.0f} "
                          f"atom-steps/s, {stats.rebuilds} plan rebuilds, {stats.recompiles} recompilations\n")
        self.stream.flush()


# ----------------------------------------------------------------------------- checkpoints


def _int(low):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def _ints(low, n=None):
    return lambda v: isinstance(v, list) and (n is None or len(v) == n) and all(map(_int(low), v))


def _float_dtype(v) -> bool:
    try:
        return isinstance(v, str) and np.issubdtype(np.dtype(v), np.floating)
    except TypeError:
        return False


_EXCHANGE_KEYS = ("axis", "direction", "hop", "pairs", "offset", "capacity")


def _layout(v) -> bool:
    return (isinstance(v, dict) and _ints(1, 3)(v.get("grid")) and _int(0)(v.get("n_owned"))
            and isinstance(v.get("exchanges"), list)
            and all(isinstance(e, dict) and all(k in e for k in _EXCHANGE_KEYS) for e in v["exchanges"]))


# What DomainParallel.save writes into md.json: key -> (what it must be, test).
_MD_FIELDS = {
    "step": ("a step count (an integer >= 0)", _int(0)),
    "converged": ("true or false", lambda v: isinstance(v, bool)),
    "dtype": ("a floating dtype name", _float_dtype),
    "integrator": ("an object naming the integrator's kind", lambda v: isinstance(v, dict) and isinstance(v.get("kind"), str)),
    "n_ranks": ("a rank count (an integer >= 1)", _int(1)),
    "grid": ("3 integers >= 1", _ints(1, 3)),
    "layout": ("the halo layout (grid, n_owned, exchanges)", _layout),
    "halo_capacity": ("[owned rows, [rows per exchange]]", lambda v: isinstance(v, list) and len(v) == 2
                      and _int(0)(v[0]) and _ints(0)(v[1])),
    "n_migrate": ("an integer >= 0", _int(0)),
    "nl_capacity": ("the neighbour-list capacity (an object)", lambda v: isinstance(v, dict)),
    "extra": ("a list of names", lambda v: isinstance(v, list) and all(isinstance(k, str) for k in v)),
}


def read_md_json(path: Path, integrators: dict):
    """(md.json of the dynamics checkpoint ``path`` as a dict, the integrator it names).

    FileNotFoundError when ``path`` holds no md.json; CheckpointError naming md.json when it is
    empty, cut short, lacks a field or holds a value ``DomainParallel.save`` never writes.
    integrators: the known integrator classes by name.
    """
    file = Path(path) / "md.json"
    if not file.exists():
        raise FileNotFoundError(f"{path} holds no dynamics checkpoint (no md.json)")
    meta = read_json(file)
    for key, (want, ok) in _MD_FIELDS.items():
        if key not in meta:
            raise damaged(file, f"has no field {key!r}")
        if not ok(meta[key]):
            raise damaged(file, f"field {key!r} must be {want}, got {str(meta[key])[:200]}")
    settings = dict(meta["integrator"])
    kind = settings.pop("kind")
    if kind not in integrators:
        raise damaged(file, f"names the integrator {kind!r}, which is not one of {sorted(integrators)}")
    try:
        integrator = integrators[kind](**settings)
    except (TypeError, ValueError) as exc:
        raise damaged(file, f"holds {kind} settings that cannot be used ({exc})") from None
    return meta, integrator


_MD_GROUPS = ("ranked", "energy", "extra", "template")


def read_md_arrays(folder: Path, sharding_of) -> dict:
    """The arrays of a dynamics checkpoint (its ``arrays/`` folder), each group placed with
    ``sharding_of(group)``. CheckpointError naming the folder or file when it is missing,
    damaged, or lacks a group ``DomainParallel.save`` writes."""
    tree = array_tree(folder)
    missing = [g for g in _MD_GROUPS if g not in tree]
    if missing:
        raise damaged(folder, f"holds no {', '.join(missing)} arrays")
    target = {group: jax.tree_util.tree_map(
        lambda m, group=group: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sharding_of(group)), tree[group])
        for group in tree}
    return restore_arrays(folder, target)
