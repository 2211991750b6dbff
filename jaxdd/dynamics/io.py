"""Output of a run: an extxyz trajectory writer and a progress line (checkpoints are
:mod:`jaxdd.dynamics.checkpoints`; host copies of device arrays :mod:`jaxdd.engine.host`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import numpy as np

__all__ = ["ExtXYZWriter", "Progress"]


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
        """Append one frame per real system of ``state`` (a collective: every process calls it).

        Args:
          md: the DomainParallel running the state (it gathers the rows and forces).
          state: the run's state at this step.
        """
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
        """Redraw the line for ``done`` steps of the total."""
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        width = 30
        filled = int(width * done / max(self.total, 1))
        rate = done * self.n_atoms / elapsed
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} steps  "
                          f"{rate:,.0f} atom-steps/s")
        self.stream.flush()

    def close(self, stats) -> None:
        """End the line with the run's totals, from its RunStats ``stats``."""
        self.stream.write(f"\n{stats.steps} steps in {stats.seconds:.2f} s: {stats.atom_steps_per_second:,.0f} "
                          f"atom-steps/s, {stats.rebuilds} plan rebuilds, {stats.recompiles} recompilations\n")
        self.stream.flush()
