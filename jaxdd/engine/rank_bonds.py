"""The reverse of a rank's bonds in its owners' bond order, so per-bond values exchanged
through the halo can be read back through it.

Only owned rows are receivers of a rank's list, so a bond from an owned atom ``i`` to a ghost
``j`` has no reverse in this rank's rows: the ghost's row holds no bonds here. Its reverse
lives in the row of ``j`` on ``j``'s owner, in the order that rank listed ``j``'s bonds. Per-bond
values ``[V, B, ...]`` refreshed through the halo hold, on a ghost row, the owner's row of
``j``; so the reverse index must count in the owner's order too.

Each rank names the partners of its owned rows' bonds by what every rank agrees on — the
partner's global atom id and its image shift relative to the row — and refreshes these names
to its ghost rows (one halo exchange of ``[V, B, 2]`` int32 per neighbour-list build). The
reverse of bond ``(i, b)`` to row ``j`` is then the bond of ``j`` (its owner's order) whose
partner is ``i``'s atom at the opposite shift; for an owned ``j`` this is the reverse the build
found itself.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ..decomposition.halo import halo_forward
from ..neighbors import NeighborList, gather_bonds

__all__ = ["owner_reverse"]


def _pack(shift):
    """Image shifts [..., 3] (within ±511 cells) as one int32 key."""
    s = shift + 512
    return (s[..., 0] << 20) | (s[..., 1] << 10) | s[..., 2]


def owner_reverse(nl: NeighborList, routing, layout, axes) -> NeighborList:
    """``nl`` with ``bonds.reverse`` counted in each partner row's owner order; inside ``shard_map``.

    Args:
      nl: this rank's list with bonds, its receivers the owned rows.
      routing: the rank's :class:`~jaxdd.decomposition.halo.HaloRouting` (``row_ids``,
        ``row_shifts`` of every local row).
      layout: the halo layout. axes: the mesh axes of the ranks.

    Returns:
      The list with the reverse of every bond into a ghost row filled in (padding B as before).
    """
    bonds = nl.bonds
    n, width = nl.matrix.shape[0], bonds.width
    partner = gather_bonds(nl.matrix, bonds, fill=n)  # [V, B]
    j = jnp.minimum(partner, n - 1)
    image = gather_bonds(nl.matrix_shifts, bonds)  # non-zero only on axes a periodic search keeps whole
    rel = routing.row_shifts[j] + image - routing.row_shifts[:, None, :]  # partner's image, relative to the row
    names = jnp.stack([routing.row_ids[j], _pack(rel)], axis=-1)
    names = jnp.where(bonds.mask[..., None], names, -1)  # [V, B, 2]
    # Ghost rows get their owner's names, in the owner's bond order.
    names = halo_forward(names[:layout.n_owned], layout, routing, axes)
    want = jnp.stack([jnp.broadcast_to(routing.row_ids[:, None], partner.shape), _pack(-rel)], axis=-1)
    back = bonds.mask[:, :, None] & jnp.all(names[j] == want[:, :, None, :], axis=-1)  # [V, B, B']
    reverse = jnp.where(jnp.any(back, axis=-1), jnp.argmax(back, axis=-1), width).astype(jnp.int32)
    return dataclasses.replace(nl, bonds=dataclasses.replace(bonds, reverse=reverse))
