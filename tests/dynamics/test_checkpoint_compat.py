"""Checkpoints written by an earlier jaxdd restore and continue bit for bit.

``tests/data/checkpoints/`` holds one checkpoint of each run kind (one device, a halo grid,
node blocks), written before the engine and dynamics were reorganised into their present
modules, with the numbers that run reached (``make_checkpoints.py`` there wrote both).
Bit for bit holds for code compiled the same way, so they are restored and continued in one
process compiling with the XLA flags the checkpoints were written with (the suite's own flags
may differ: tests/conftest.py), which reports on each kind. The halo grid, whose checkpoint
holds the most (a plan, ghosts, per-rank capacities), is checked by default; one device and
node blocks, each a child compiling its own programs, are in the slow set.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "make_checkpoints.py"
KINDS = ("graph_parallel", "halo", "one_device")
SLOW_KINDS = ("graph_parallel", "one_device")


@functools.lru_cache(maxsize=None)
def verified(kinds: tuple[str, ...]) -> dict:
    """Run kind → "ok" or what differed, for ``kinds`` verified in one child process."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", PYTHONWARNINGS=(
        "ignore:the ghost shell of some ranks covers every atom:RuntimeWarning"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--verify", *kinds], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the child printed nothing (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k in SLOW_KINDS else k
                                  for k in KINDS])
def test_an_earlier_checkpoint_restores_and_continues_bit_for_bit(kind):
    outcome = verified(SLOW_KINDS if kind in SLOW_KINDS else (kind,))
    assert outcome[kind] == "ok", outcome[kind]


def test_every_run_kind_written_is_checked():
    written = sorted(p.stem for p in SCRIPT.parent.glob("*.npz"))
    assert written == sorted(KINDS)
