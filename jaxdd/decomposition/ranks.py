"""The rank helpers every distributed program goes through: the one ``shard_map`` wrapper
(:func:`on_ranks`), per-rank blocks placed on their devices (:func:`place_ranked`), which
ranks this process drives (:func:`own_ranks`), and agreement over processes (:func:`agree_max`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["on_ranks", "place_ranked", "own_ranks", "agree_max"]


def on_ranks(fn, mesh: Mesh, ranked: tuple = (), replicated: tuple = (), replicated_out=None):
    """Call ``fn(*ranked_blocks, *replicated)`` on every rank of ``mesh`` inside ``shard_map``.

    Args:
      fn: one rank's function; returns a pytree of arrays.
      ranked: pytrees whose leaves have a leading ``[P]`` axis; each rank sees its block
        without that axis.
      replicated: pytrees the same on every rank (a model's parameters, the cell).
      replicated_out: a pytree prefix of ``fn``'s outputs, True where the output is the
        same on every rank (default: none is).

    Returns:
      ``fn``'s outputs: ranked ones ``[P, ...]`` (each rank's value stacked), replicated
      ones as rank 0 computed them, replicated over the mesh.

    Every input and output crosses the ``shard_map`` boundary split over the ranks (a
    replicated input is broadcast to ``[P, ...]`` first, a replicated output is rank 0's
    block), so differentiating the wrapped program from outside (parameter gradients) only
    transposes splits and broadcasts: the cotangents of the ranks' copies of a parameter
    are summed by the broadcast's transpose. ``check_vma=False``: a single-device model
    traced on per-rank types would have to mark its own loop carries as varying; jaxdd
    instead differentiates sums of per-rank terms, for which exact transposes of the
    collectives are right (see docs/dispatch.md).
    """
    axes = tuple(mesh.axis_names)
    n = int(mesh.size)

    def spread(x):
        x = jnp.asarray(x)
        return jnp.broadcast_to(x[None], (n,) + x.shape)

    def body(ranked, replicated):
        drop = lambda x: x[0]  # noqa: E731
        out = fn(*jax.tree_util.tree_map(drop, ranked), *jax.tree_util.tree_map(drop, replicated))
        return jax.tree_util.tree_map(lambda x: jnp.asarray(x)[None], out)

    out = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)(
        tuple(ranked), jax.tree_util.tree_map(spread, tuple(replicated)))
    if replicated_out is None:
        return out
    whole = NamedSharding(mesh, P())

    def pick(flag, sub):
        take = lambda x: jax.lax.with_sharding_constraint(x[0], whole)  # noqa: E731
        return jax.tree_util.tree_map(take, sub) if flag else sub

    return jax.tree_util.tree_map(pick, replicated_out, out, is_leaf=lambda x: isinstance(x, bool))


def place_ranked(tree, mesh: Mesh, ranks=None):
    """Per-rank host blocks as global ``[P, ...]`` arrays split over the mesh. Only this
    process's devices are written, so a process never builds or sends another process's rows.

    Args:
      tree: a pytree of host arrays ``[len(ranks), ...]``, one block per rank in ``ranks``.
      mesh: the device mesh of P ranks.
      ranks: the ranks the blocks belong to (:func:`own_ranks`); None: the blocks of every rank.

    Returns:
      ``tree`` with each leaf a global ``[P, ...]`` array.
    """
    ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if ranks is None:
        return jax.device_put(tree, ranked)
    where = {int(r): i for i, r in enumerate(ranks)}
    n_ranks = int(mesh.size)

    def put(x):
        x = np.asarray(x)
        shape = (n_ranks,) + x.shape[1:]
        pieces = [jax.device_put(x[where[idx[0].start]:where[idx[0].start] + 1], device)
                  for device, idx in ranked.addressable_devices_indices_map(shape).items()]
        return jax.make_array_from_single_device_arrays(shape, ranked, pieces)

    return jax.tree_util.tree_map(put, tree)


def own_ranks(mesh: Mesh):
    """The ranks (blocks of the ``[P, ...]`` arrays) on this process's devices of ``mesh``, in
    order, or None when this process drives every device."""
    if jax.process_count() == 1:
        return None
    ranked = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    return tuple(sorted(idx[0].start for idx in ranked.addressable_devices_indices_map((int(mesh.size),)).values()))


def agree_max(values) -> np.ndarray:
    """The elementwise maximum of the integer vector ``values`` over every process (itself with one)."""
    values = np.asarray(values, np.int64)
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(values)).reshape(-1, values.size).max(axis=0)
