"""Host copies of device arrays, whole, with one process or several."""

from __future__ import annotations

import numpy as np

__all__ = ["host_array"]


def host_array(x) -> np.ndarray:
    """``x`` whole on the host; with several processes each contributes its devices' rows
    (a collective: every process must call it).

    Args:
      x: a device array (or anything ``np.asarray`` reads), any shape.

    Returns:
      A numpy array of ``x``'s global shape and dtype.
    """
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
