"""The one wrap rule: fractional coordinates folded into ``[0, 1)`` on periodic axes.

Every place that folds atoms into the cell -- the host partition, the device rebuild,
migration, the half-list order keys, the neighbour search and :func:`jaxdd.wrap_positions`
-- uses :func:`wrap_fractional`, so they agree on every atom's image and block.

Why a rule at all: ``f - floor(f)`` is not always below 1 in floating point. For
``f = -1e-19`` it is ``-1e-19 + 1``, which rounds to ``1.0``. Resetting that to 0 without
counting the image leaves the atom planned at the lower face while its wrapped position,
``r - floor(f)·cell``, sits at the upper face (``-1e-17 + L == L``) -- a silent error of one
cell length. Here such an atom keeps image 0 (it *is* at the lower face, a rounding error
away) and its wrapped fraction is exactly 0. ASE's ``wrap`` (with its ``eps``) leaves such
an atom where it is too.
"""

from __future__ import annotations

import jax
import numpy as np

__all__ = ["wrap_fractional"]


def wrap_fractional(frac, periodic):
    """Fold fractional coordinates into ``[0, 1)`` on periodic axes.

    Works on numpy arrays (host plans) and JAX arrays (inside ``jit``) alike.

    Args:
      frac: [..., 3] fractional coordinates.
      periodic: bool, broadcastable to ``frac``: which entries fold.

    Returns:
      ``(wrapped, image)``: ``wrapped`` in ``[0, 1)`` on periodic entries (``frac``
      unchanged elsewhere), and ``image`` the whole lattice steps taken off, in ``frac``'s
      dtype (0 on open entries), so the wrapped position is ``r - image @ cell``. Always
      ``wrapped < 1``: a fraction that rounds up to 1 counts one image more and wraps to 0.
    """
    xp = np if isinstance(frac, np.ndarray) and not isinstance(periodic, jax.Array) else jax.numpy
    image = xp.where(periodic, xp.floor(frac), 0.0)
    wrapped = frac - image
    # f in (-ulp, 0) gives floor -1 and f + 1 rounds to 1.0: the atom is at the lower face,
    # so it belongs to image floor + 1 = 0 there, at fraction 0 (block 0 owns that face).
    up = periodic & (wrapped >= 1.0)
    image = xp.where(up, image + 1.0, image)
    wrapped = xp.where(up, xp.zeros_like(wrapped), wrapped)
    return wrapped, image
