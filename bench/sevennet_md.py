"""Benchmark: molecular dynamics of SevenNet, jaxdd against sevenn (torch), on equal pinned cores.

    python bench/sevennet_md.py [--models 7net-0,7net-l3i5] [--sizes 5,8] [--steps 20] [--cores 1,2]
                                [--devices 1,2] [--sides jaxdd,torch-ase,torch-bare] [--torch-python PATH]
                                [--budget-gb 24] [--largest] [--xla-defaults] [--json PATH]

The published checkpoints 7net-0 (SevenNet_0__11Jul2024) and 7net-l3i5, float32, on diamond Si
(a = 5.43 Å, the cubic 8-atom cell repeated n×n×n: ``--sizes 5,8`` gives 1,000 and 4,096 atoms,
rattled by 0.01 Å, Maxwell–Boltzmann velocities at 300 K), ``--steps`` steps (default 20) of
NVE velocity Verlet at dt = 1 fs. The sides:

* jaxdd: ``SevenNet.from_checkpoint`` (weights read without torch) under ``DomainParallel`` with
  ``VelocityVerlet``, its on-device MD loop, neighbour skin 1 Å, on N virtual CPU devices pinned
  to N cores (``--devices 1,2``; grid (N, 1, 1)); one warm-up run (compilation) and a timed run
  from a fresh start;
* torch-ase: sevenn's ``SevenNetCalculator`` (float32, its own neighbour list every step)
  driving ``ase.md.VelocityVerlet``; one warm-up step;
* torch-bare: sevenn's model on a graph built once (``unlabeled_atoms_to_graph``), ``--steps``
  calls of its forward and backward (energy, forces and stress); one warm-up call. No
  neighbour list and no integration: the floor of what sevenn's model costs.

The torch sides run with as many torch threads as cores (``--cores 1,2``). Every configuration
is a child process bound to its cores; the torch ones run in a separate interpreter that has
torch and sevenn (``--torch-python``, or ``$JAXDD_TORCH_PYTHON``; default: this interpreter if
it has both, else ``/work/venv-torch/bin/python``), the jaxdd ones in this one (which needs
only the ``sevenn`` wheel's files: ``pip install --no-deps sevenn``). A side that fails, is
killed (out of memory) or grows past ``--budget-gb`` (default 24 GB, at most 90 % of the
machine's memory; the child is killed there) is reported as failed and the benchmark goes on.

Printed: atom-steps per second (atoms × steps / wall seconds of the timed run), the warm-up
time, the working memory per atom of the timed run as ``bench/mace_md.py`` measures it (peak
resident memory during it minus resident memory just before, kB/atom), the peak resident
memory of the child, jaxdd over each sevenn side on the same number of cores, and jaxdd on N
devices over jaxdd on one. Target: jaxdd >= 2.0x the faster sevenn side for 7net-0 and l3i5 at
1,000 atoms on one core; 2 devices >= 1.7x 1 device. The frame (child processes, memory budget,
table, ``--largest``) is ``bench/torch_md.py``'s, shared with ``bench/chgnet_md.py``.

``--largest`` then grows n (by about a quarter per try, from the largest of ``--sizes``) for
each model and side on one core until the side fails or its peak memory passes the budget,
with 2 steps a run, and prints the largest cell each side ran. It can take long (a run of
the largest cells on one core is minutes).

Every jaxdd child runs with ``bench/mlip_md.py``'s XLA flags (XLA's CPU operations on the
thread that runs them, XLA's own fusion emitter; about twice as fast on pinned cores there);
``--xla-defaults`` keeps XLA's.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "sevennet"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the shared frame and the scripts beside

import torch_md  # noqa: E402
from mlip_md import DT_FS, diamond  # noqa: E402

MODELS = ("7net-0", "7net-l3i5")
SIDES = torch_md.SIDES
SKIN = 1.0  # Å
BENCH = torch_md.Bench(
    name="sevennet_md", script=__file__, package="sevenn", torch_modules=("torch", "sevenn", "e3nn"), models=MODELS,
    atoms=lambda n: 8 * n**3, sizes=(5, 8),
    title=f"SevenNet NVE (dt {DT_FS} fs, 300 K), diamond Si a = 5.43 Å, float32",
    target=(2.0, 1000, ("torch-ase", "torch-bare"), 1.7), install="pip install torch==2.13.0 sevenn==0.13.0")


def run_jaxdd(model: str, n: int, cores: int, steps: int) -> dict:
    """``steps`` of jaxdd's MD of SevenNet ``model`` (weights read without torch) on ``cores`` devices."""
    import numpy as np

    from jaxdd.models.sevennet import SevenNet

    potential = SevenNet.from_checkpoint(model, skin=SKIN, dtype=np.float32)
    return torch_md.jaxdd_md(potential, diamond(8 * n**3), cores, steps, SKIN)


def run_torch(model: str, n: int, cores: int, steps: int, side: str) -> dict:
    """``steps`` of sevenn: its ASE calculator under ASE's velocity Verlet (torch-ase) or its
    model on a graph built once (torch-bare)."""
    sys.path.insert(0, str(DATA))
    import make_reference  # the sevenn checkpoints of the reference data, sevenn's float32 calculator

    atoms = diamond(8 * n**3)
    calc = make_reference.calculator(model, None, "float32")
    if side == "torch-ase":
        return torch_md.torch_md(side, atoms, steps, calculator=calc)
    from sevenn import _keys as KEY
    from sevenn.atom_graph_data import AtomGraphData
    from sevenn.train.dataload import unlabeled_atoms_to_graph

    graph = AtomGraphData.from_numpy_dict(unlabeled_atoms_to_graph(atoms, calc.cutoff, with_shift=False))

    def call():
        # A copy per call: the model writes its outputs and the gradient flag into the graph.
        out = calc.model(graph.clone())
        out[KEY.PRED_FORCE].detach()
        return float(out[KEY.PRED_TOTAL_ENERGY])

    return torch_md.torch_md(side, atoms, steps, call=call)


torch_python = functools.partial(torch_md.torch_python, BENCH)
has_sevenn = functools.partial(torch_md.has_modules, modules=("torch", "sevenn"))
pinned = functools.partial(torch_md.pinned, BENCH)
add_ratios = torch_md.add_ratios
target_line = functools.partial(torch_md.target_line, BENCH)
parse_args = functools.partial(torch_md.parse_args, BENCH)
format_table = functools.partial(torch_md.format_table, BENCH)
watched = torch_md.watched

if __name__ == "__main__":
    sys.exit(torch_md.main(BENCH, run_jaxdd, run_torch))
