"""Checkpoints written by an earlier jaxdd restore and continue bit for bit.

``tests/data/checkpoints/`` holds one checkpoint of each run kind (one device, a halo grid,
node blocks), written before the engine and dynamics were reorganised into their present
modules, with the numbers that run reached (``make_checkpoints.py`` there wrote both).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).resolve().parents[1] / "data" / "checkpoints"
_spec = importlib.util.spec_from_file_location("make_checkpoints", DATA / "make_checkpoints.py")
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


def assert_numbers_equal(got: dict, want, prefix: str) -> None:
    for key, value in got.items():
        np.testing.assert_array_equal(value, want[key], err_msg=key)
    assert set(got) == {k for k in want.files if k.startswith(prefix)}


@pytest.mark.parametrize("kind", sorted(make.KINDS))
def test_an_earlier_checkpoint_restores_and_continues_bit_for_bit(kind):
    md = make.md_of(kind)
    want = np.load(DATA / f"{kind}.npz")
    state = md.restore(DATA / kind)
    assert state.step == make.STEPS
    assert_numbers_equal(make.numbers(md, state, "saved"), want, "saved")
    assert_numbers_equal(make.numbers(md, md.run(state, make.STEPS), "continued"), want, "continued")
