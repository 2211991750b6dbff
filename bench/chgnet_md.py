"""Benchmark: molecular dynamics of CHGNet 0.3.0, jaxdd against chgnet (torch), on equal pinned cores.

    python bench/chgnet_md.py [--sizes 5,8] [--steps 20] [--cores 1,2] [--devices 1,2]
                              [--sides jaxdd,torch-ase,torch-bare] [--torch-python PATH]
                              [--budget-gb 24] [--largest] [--xla-defaults] [--json PATH]

The published CHGNet 0.3.0, float32, on diamond Si (a = 5.43 Å, the cubic 8-atom cell repeated
n×n×n: ``--sizes 5,8`` gives 1,000 and 4,096 atoms, rattled by 0.01 Å, Maxwell–Boltzmann
velocities at 300 K), ``--steps`` steps (default 20) of NVE velocity Verlet at dt = 1 fs. The
sides:

* jaxdd: ``CHGNet.load("0.3.0", dtype=float32)`` (weights read without torch) under
  ``DomainParallel`` with ``VelocityVerlet``: neighbours, bonds and angles built on device, its
  on-device MD loop, neighbour skin 0.5 Å (see ``SKIN``), on N virtual CPU devices pinned to N cores
  (``--devices 1,2``; grid (N, 1, 1)); one warm-up run (compilation) and a timed run from a
  fresh start;
* torch-ase: chgnet's ``CHGNetCalculator`` as its users run it (its graph built on the host every
  step: pymatgen's neighbour search and chgnet's graph and line-graph construction), driving
  ``ase.md.VelocityVerlet``; one warm-up step;
* torch-bare: chgnet's model on a graph built once (``model.graph_converter``), ``--steps``
  calls of ``model([graph], task="efs")`` (energy, forces and stress); one warm-up call. No
  graph building and no integration: the floor of what chgnet's model costs.

The torch sides run with as many torch threads as cores (``--cores 1,2``), in an interpreter
that has torch and chgnet (``--torch-python`` or ``$JAXDD_TORCH_PYTHON``; default this one if
it has both, else ``/work/venv-torch/bin/python``); jaxdd needs only the ``chgnet`` wheel's
files (``pip install --no-deps chgnet``).

Printed: atom-steps per second, the warm-up time, the working memory per atom of the timed run
(peak resident memory during it minus resident memory just before, kB/atom), the peak resident
memory of the child, jaxdd over each chgnet side on as many cores, and jaxdd on N devices over
one. Target: jaxdd >= 3.0x ``CHGNetCalculator`` (torch-ase) at 1,000 atoms on one core.
``--largest`` grows n on one core until a side fails or passes ``--budget-gb`` (default 24 GB,
at most 90 % of this machine's memory) and prints the largest cell each side ran. The frame
(child processes, memory budget, table) is ``bench/torch_md.py``'s.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared frame and the scripts beside

import torch_md  # noqa: E402
from mlip_md import DT_FS, diamond  # noqa: E402

MODELS = ("0.3.0",)
SIDES = torch_md.SIDES
# Å. Pairs are listed to 6 Å + skin and bonds to 3 Å + skin, and the model works on every listed
# slot. At 1 Å the bonds would reach Si's second shell (3.84 Å): 16 listed bonds per atom for 4
# real ones, and 256 pairs of them for 12 angles. At 0.5 Å no shell of diamond Si lies between
# a cutoff and cutoff + skin (6.0-6.5 Å and 3.0-3.5 Å), so the lists hold the real pairs and
# bonds plus the capacity's headroom; an atom at 300 K moves ~0.005 Å/fs, so the list is still
# kept for tens of steps.
SKIN = 0.5
BENCH = torch_md.Bench(
    name="chgnet_md", script=__file__, package="chgnet", torch_modules=("torch", "chgnet", "pymatgen"),
    models=MODELS, atoms=lambda n: 8 * n**3, sizes=(5, 8),
    title=f"CHGNet NVE (dt {DT_FS} fs, 300 K), diamond Si a = 5.43 Å, float32",
    target=(3.0, 1000, ("torch-ase",), None), install="pip install torch==2.13.0 chgnet==0.4.2")


def run_jaxdd(model: str, n: int, cores: int, steps: int) -> dict:
    """``steps`` of jaxdd's MD of CHGNet ``model`` (weights read without torch) on ``cores`` devices."""
    import numpy as np

    from jaxdd.models.chgnet import CHGNet

    potential = CHGNet.load(model, skin=SKIN, dtype=np.float32)
    return torch_md.jaxdd_md(potential, diamond(8 * n**3), cores, steps, SKIN)


def run_torch(model: str, n: int, cores: int, steps: int, side: str) -> dict:
    """``steps`` of chgnet: its ASE calculator under ASE's velocity Verlet (torch-ase) or its
    model on a graph built once (torch-bare)."""
    from chgnet.model import CHGNet
    from chgnet.model.dynamics import CHGNetCalculator

    atoms = diamond(8 * n**3)
    net = CHGNet.load(model_name=model, use_device="cpu", verbose=False)
    if side == "torch-ase":
        return torch_md.torch_md(side, atoms, steps, calculator=CHGNetCalculator(model=net, use_device="cpu"))
    from pymatgen.io.ase import AseAtomsAdaptor

    graph = net.graph_converter(AseAtomsAdaptor.get_structure(atoms))

    def call():
        out = net([graph], task="efs")
        return float(out["e"][0]) * len(atoms)  # chgnet predicts eV per atom

    return torch_md.torch_md(side, atoms, steps, call=call)


torch_python = functools.partial(torch_md.torch_python, BENCH)
pinned = functools.partial(torch_md.pinned, BENCH)
target_line = functools.partial(torch_md.target_line, BENCH)
parse_args = functools.partial(torch_md.parse_args, BENCH)

if __name__ == "__main__":
    sys.exit(torch_md.main(BENCH, run_jaxdd, run_torch))
