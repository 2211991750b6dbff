"""Checkpoints written by an earlier jaxdd restore and continue bit for bit.

``tests/data/checkpoints/`` holds one checkpoint of each run kind (one device, a halo grid,
node blocks), written before the engine and dynamics were reorganised into their present
modules, with the numbers that run reached (``make_checkpoints.py`` there wrote both).
Bit for bit holds for code compiled the same way, so they are restored and continued in one
process compiling with the XLA flags the checkpoints were written with (the suite's own flags
may differ: tests/conftest.py), which reports on each kind. The child compiles every program
afresh (its flags are not the suite's), so the three kinds are checked in the slow set; the
default suite saves, restores and continues a run bit for bit with today's code
(tests/dynamics/test_dynamics.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "checkpoints" / "make_checkpoints.py"
KINDS = ("graph_parallel", "halo", "one_device")


@pytest.fixture(scope="module")
def verified() -> dict:
    """Run kind → "ok" or what differed, from one child process."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the script sets its own
    env.update(JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8", PYTHONWARNINGS=(
        "ignore:the ghost shell of some ranks covers every atom:RuntimeWarning"))
    proc = subprocess.run([sys.executable, str(SCRIPT), "--verify", *KINDS], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"the child printed nothing (status {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_an_earlier_checkpoint_restores_and_continues_bit_for_bit(kind, verified):
    assert verified[kind] == "ok", verified[kind]


def test_every_run_kind_written_is_checked():
    written = sorted(p.stem for p in SCRIPT.parent.glob("*.npz"))
    assert written == sorted(KINDS)
