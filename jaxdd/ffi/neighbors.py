"""The compiled open-boundary cell list (CPU and CUDA): each rank's neighbour search over its rows.

Under domain decomposition a rank whose rows are its owned atoms and explicit ghost images
on every axis (a half list, or this search asked for) searches with no periodic axis.
:func:`cell_list` is that search as one C++ pass (csrc/neighbors/neighbors_cpu.cc; on CUDA GPUs
neighbors_cuda.cu, which gives the same list edge for edge): per-system bins of half
the cutoff, a counting sort, a stencil scan per receiver. It computes what :func:`jaxdd.neighbors.build_neighbor_list`
computes with an identity cell and no periodic axis (the same pairs, grouped by receiver
in receiver order; the order within a receiver may differ), in a small fraction of the
time on a CPU, and needs no candidate or bin capacity: only the edge slots can run out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import _call

__all__ = ["cell_list"]

_NAME = "jaxdd cell_list"
# The handlers of csrc/neighbors/neighbors_cpu.cc and neighbors_cuda.cu.
_CELL_LIST = _call.target("cell_list")


def cell_list(positions, system, atom_mask, *, cutoff: float, max_edges: int, n_receivers: int | None = None,
              n_systems: int = 1, half: bool = False, order=None):
    """Pairs closer than ``cutoff`` among atoms of the same system, no periodic images.

    Args:
      positions: [n, 3] Å (float32 or float64).
      system: [n] int32 system of each atom.
      atom_mask: [n] bool (False rows, and rows whose system is outside [0, n_systems),
        take no part).
      cutoff: Å.
      max_edges: edge slots of the result (>= 1).
      n_receivers: only rows [0, n_receivers) receive edges (default all).
      n_systems: systems of the batch.
      half: list each pair once, from the row ``order`` picks.
      order: for a half list, two [n] int32 keys, e.g. global atom id and image: the row of
        lower (key a, key b) when the keys a have the same parity, else the row of higher,
        as :func:`jaxdd.neighbors.build_neighbor_list` (default the row index: a receiver's
        sender index is then above its own).

    Returns:
      (senders [max_edges] int32, receivers [max_edges] int32 (padding: n), shifts
      [max_edges, 3] int32 (all zero), num_neighbors [n] int32, n_edges [] int32). n_edges
      counts every pair found, also those past ``max_edges`` that were not written: a result
      with n_edges > max_edges is incomplete, and the caller must build again with more
      slots.
    """
    positions = jnp.asarray(positions)
    suffix = _call.float_suffix(_NAME, "positions", positions)
    _call.check_array(_NAME, "positions", positions, (None, 3), positions.dtype)
    n = positions.shape[0]
    system, atom_mask = jnp.asarray(system), jnp.asarray(atom_mask)
    _call.check_array(_NAME, "system", system, (n,), np.int32)
    _call.check_array(_NAME, "atom_mask", atom_mask, (n,), np.bool_)
    if int(max_edges) < 1:
        raise ValueError(f"{_NAME}: max_edges must be >= 1, got {max_edges}")
    if not (np.isfinite(cutoff) and cutoff > 0):
        raise ValueError(f"{_NAME}: cutoff must be a positive finite number, got {cutoff!r}")
    n_recv = n if n_receivers is None else int(n_receivers)
    e = int(max_edges)
    if order is None:  # keys a all equal (so no parity flips), keys b the row index
        order = (jnp.zeros(n, jnp.int32), jnp.arange(n, dtype=jnp.int32))
    order = tuple(jnp.asarray(k) for k in order)
    for name, key in zip(("order[0]", "order[1]"), order):
        _call.check_array(_NAME, name, key, (n,), np.int32)
    results = [((e,), np.int32), ((e,), np.int32), ((n,), np.int32), ((), np.int32)]
    senders, receivers, per_atom, n_edges = _CELL_LIST(
        suffix, results, positions, system, atom_mask, *order, n_receivers=np.int64(n_recv),
        n_systems=np.int64(n_systems), cutoff=np.float64(cutoff), half=bool(half))
    # The kernel writes no shifts (there are none); zeros built here cost nothing where unused.
    return senders, receivers, jnp.zeros((e, 3), jnp.int32), per_atom, n_edges
