"""Checks of user-given integers, shared by every constructor that takes one (models included).

A count, an index, a capacity or an atomic number given as a float is accepted only when it
is a whole number (``18.0``); ``18.7`` or ``17.9999999`` is refused rather than truncated,
with an error naming the field and the value. numpy integers are integers; ``True`` and
``False`` are not counts and are refused.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

__all__ = ["integral", "integral_triple", "integral_array"]

# How many offending entries an error message lists before summarising.
_SHOW = 5


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is an integer or a whole finite float, else None."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return int(value) if math.isfinite(value) and float(value).is_integer() else None
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape == () and dtype is not None and np.dtype(dtype) != bool:  # a 0-d numpy or JAX array
        try:
            return _whole(np.asarray(value).item())
        except Exception:  # a traced value: its number is unknown here
            return None
    return None


def _show(value: Any) -> str:
    if isinstance(value, np.generic) or getattr(value, "shape", None) == ():
        try:
            return repr(np.asarray(value).item())
        except Exception:
            pass
    return repr(value)


def integral(name: str, value: Any, *, minimum: int | None = None, error: type[Exception] = ValueError) -> int:
    """``value`` as an ``int``; ``error`` (ValueError) naming ``name`` and the value otherwise.

    Integers (numpy's too), whole finite floats and 0-d arrays of either are accepted; fractional
    or non-finite floats, bools, strings and the rest are refused, as is a value below ``minimum``.

    Args:
      name: what ``value`` is, for the error message.
      value: the number to check.
      minimum: the smallest value accepted (None: no bound).
      error: the exception class raised on a refusal.

    Returns:
      ``value`` as a Python ``int``.
    """
    whole = _whole(value)
    if whole is None or (minimum is not None and whole < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise error(f"{name} must be an integer{bound}, got {_show(value)}")
    return whole


def integral_triple(name: str, value: Any, *, minimum: int | None = None) -> tuple[int, int, int]:
    """``value`` (one integer per axis) as three ``int``; ValueError naming ``name`` otherwise.

    Args:
      name: what ``value`` is, for the error message.
      value: the three numbers to check (any iterable).
      minimum: the smallest value accepted (None: no bound).

    Returns:
      A tuple of three Python ints.
    """
    try:
        items = tuple(value)
    except TypeError:
        items = ()
    if len(items) != 3:
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be 3 integers{bound}, got {value!r}")
    return tuple(integral(f"{name}[{a}] (of {value!r})", v, minimum=minimum) for a, v in enumerate(items))


def _few(values) -> str:
    values = list(values)
    shown = ", ".join(map(repr, values[:_SHOW]))
    return f"[{shown}]" if len(values) <= _SHOW else f"[{shown}, ... ({len(values)} in total)]"


def integral_array(name: str, values: Any, *, what: str = "entries", error: type[Exception] = ValueError):
    """``values`` (array-like) when it holds integers, ready for an integer ``astype``.

    An integer array (numpy or JAX, traced or not) is returned as it is; floats that are all
    whole numbers come back as a numpy int64 array. Otherwise ``error`` names ``name``, the
    offending ``what`` (e.g. ``"atoms"``) and their values. A traced float array cannot be
    checked and is refused by its dtype; bool and non-numeric arrays are refused too.

    Args:
      name: what ``values`` is, for the error message.
      values: the array-like to check.
      what: what one entry is (``"atoms"``, ``"entries"``), for the error message.
      error: the exception class raised on a refusal.

    Returns:
      ``values`` itself when of an integer dtype, else an int64 numpy array.
    """
    dtype = getattr(values, "dtype", None)
    if dtype is None:
        values = np.asarray(values)
        dtype = values.dtype
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return values
    if dtype == bool or not np.issubdtype(dtype, np.floating):
        raise error(f"{name} must be integers, got an array of {dtype}")
    try:
        host = np.asarray(values)
    except Exception:  # a traced array: no values to look at
        raise error(f"{name} must have an integer dtype, got {dtype} under a JAX transformation, where its "
                    "values cannot be checked for fractions; convert it to integers first") from None
    bad = ~(np.isfinite(host) & (host == np.round(host)))
    if bad.any():
        idx = np.flatnonzero(bad.reshape(-1))
        raise error(f"{name} must be whole numbers; {what} {_few(idx.tolist())} have "
                    f"{_few(host.reshape(-1)[idx].tolist())} (a fraction is never truncated silently)")
    return host.astype(np.int64)
