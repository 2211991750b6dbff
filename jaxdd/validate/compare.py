"""The partition-invariant difference between a reference output and a distributed one."""

from __future__ import annotations

import dataclasses

import numpy as np

__all__ = ["KeyDiff", "diff", "compare_outputs"]


@dataclasses.dataclass(frozen=True)
class KeyDiff:
    """How one output differs. abs: the smaller of the elementwise and the sorted-rows
    maximum absolute difference. rel: abs / max|reference|. passed: abs <= atol or rel <= rtol."""

    abs: float
    rel: float
    passed: bool

    def to_dict(self) -> dict:
        """The JSON form: ``abs``, ``rel`` and ``passed``."""
        return {"abs": self.abs, "rel": self.rel, "passed": self.passed}


def _rows(x: np.ndarray) -> np.ndarray:
    x = x.reshape(x.shape[0], -1) if x.ndim else x.reshape(1, 1)
    order = np.lexsort(x.T[::-1]) if x.shape[1] else np.arange(x.shape[0])
    return x[order]


def diff(ref, got) -> tuple[float, float]:
    """(abs, rel) difference of ``got`` from ``ref``; infinite when shapes differ or values are not finite.

    Elementwise, and also with the rows of each sorted lexicographically, so outputs that
    match up to a reordering of equivalent rows still compare equal; the smaller counts.

    Args:
      ref: the reference array.
      got: the array compared with it.

    Returns:
      ``(abs, rel)``: the largest absolute and relative differences.
    """
    ref = np.asarray(ref, np.float64)
    got = np.asarray(got, np.float64)
    if ref.shape != got.shape or not np.all(np.isfinite(got)):
        return float("inf"), float("inf")
    if ref.size == 0:
        return 0.0, 0.0
    elem = float(np.max(np.abs(ref - got)))
    agg = float(np.max(np.abs(_rows(ref) - _rows(got)))) if ref.ndim else elem
    absolute = min(elem, agg)
    scale = float(np.max(np.abs(ref)))
    return absolute, (absolute / scale if scale > 0 else (0.0 if absolute == 0 else float("inf")))


def compare_outputs(ref: dict, got: dict, atol: float, rtol: float) -> dict[str, KeyDiff]:
    """One :class:`KeyDiff` per key of ``ref`` (a key missing from ``got`` fails).

    Args:
      ref: key → reference array.
      got: key → the array compared with it.
      atol: the absolute tolerance.
      rtol: the relative tolerance; a key passes when either difference is within its tolerance.
    """
    out = {}
    for key in ref:
        if key not in got:
            out[key] = KeyDiff(float("inf"), float("inf"), False)
            continue
        a, r = diff(ref[key], got[key])
        out[key] = KeyDiff(a, r, bool(a <= atol or r <= rtol))
    return out
