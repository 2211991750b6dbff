"""Geometry of a neighbour list: the cell its atoms are binned in, and its edge vectors.

An edge's vector points from the receiver to the sender's image,
``positions[senders] - positions[receivers] + shifts @ cell``; :func:`edge_vectors` computes
it differentiably (a custom JVP makes the gradient's scatter cheap).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp

from .formats import NeighborList

__all__ = ["effective_cell", "edge_vectors"]


def _normalize(v):
    n = jnp.linalg.norm(v)
    return v / jnp.where(n > 0, n, 1.0)


def _complete_cell(cell, pattern):
    """Replace the lattice vectors of non-periodic axes by unit vectors orthogonal to the
    periodic ones, so fractional coordinates exist for slabs, wires and molecules whose
    cell is zero or arbitrary on open axes."""
    per = [a for a in range(3) if pattern[a]]
    rows = [cell[a] for a in range(3)]
    eye = jnp.eye(3, dtype=cell.dtype)
    if len(per) == 3:
        return cell
    if len(per) == 2:
        (k,) = [a for a in range(3) if not pattern[a]]
        rows[k] = _normalize(jnp.cross(rows[per[0]], rows[per[1]]))
    elif len(per) == 1:
        u = _normalize(rows[per[0]])
        e = eye[jnp.argmin(jnp.abs(u))]
        v1 = _normalize(jnp.cross(u, e))
        v2 = jnp.cross(u, v1)
        k1, k2 = [a for a in range(3) if not pattern[a]]
        rows[k1], rows[k2] = v1, v2
    else:
        rows = [eye[0], eye[1], eye[2]]
    return jnp.stack(rows)


_PATTERNS = list(itertools.product((False, True), repeat=3))


@jax.jit
def effective_cell(cell, pbc):
    """Cell used for binning: periodic rows as given, open rows orthonormal completions.

    Args:
      cell: [S, 3, 3] Å, rows are lattice vectors (open rows may be zero or arbitrary).
      pbc: [S, 3] bool, periodic axes of each system.

    Returns:
      [S, 3, 3] Å: the periodic rows of ``cell``, and on open axes unit vectors orthogonal to
      the periodic rows, so that fractional coordinates exist for slabs, wires and molecules.
    """
    index = (pbc[:, 0].astype(jnp.int32) * 4 + pbc[:, 1].astype(jnp.int32) * 2 + pbc[:, 2].astype(jnp.int32))
    branches = [lambda c, p=p: _complete_cell(c, p) for p in _PATTERNS]
    return jax.vmap(lambda i, c: jax.lax.switch(i, branches, c))(index, cell)


def _rows(x, idx):
    # Padding edges index one past the last atom: "fill" reads zeros there, so their
    # vectors are exactly zero without a mask (a select here would cost a full pass).
    return x.at[idx].get(mode="fill", fill_value=0)


@jax.custom_jvp
def _differences(positions, senders, receivers):
    """positions[senders] - positions[receivers], [E, 3] (zero where an index is past the end)."""
    return _rows(positions, senders) - _rows(positions, receivers)


@_differences.defjvp
def _differences_jvp(primals, tangents):
    # The same difference of the tangent, read as rows of four (a zero column added, then
    # dropped): its transpose, the gradient, then scatters rows of four into the forces.
    # XLA's CPU scatter adds rows of three an element at a time, about three times slower
    # on receiver-sorted edges; the forward pass keeps rows of three, which XLA fuses better.
    # The receivers' rows are negated before they are read (a sum, not a difference), so the
    # gradient negates the receivers' [n_atoms, 4] sums instead of a second edge-long array.
    # A zero row past the last atom stands for the padding edges (index n_atoms), and XLA's
    # gather clamps larger indices onto it, so the reads need neither a mask nor jnp's
    # wrapping of negative indices (indices are never negative): either would make the
    # gradient's scatters rewrite both index arrays first, a pass over the edges each.
    positions, senders, receivers = primals
    padded = jnp.pad(tangents[0], ((0, 1), (0, 1)))
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,), start_index_map=(0,))

    def rows(x, idx):
        return jax.lax.gather(x, idx[:, None], dims, (1, x.shape[1]),
                              mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS)

    return _differences(*primals), (rows(padded, senders) + rows(-padded, receivers))[:, :3]


def edge_vectors(positions, cell, batch_idx, nl: NeighborList):
    """Receiver → sender vectors of the COO edges.

    Differentiable in positions and cell (the strain used for stress acts through both), and
    in ``nl.displacement`` when the list has one (added to every vector), to any order; the
    edge indices are those jaxdd's lists hold, in [0, n_atoms] (n_atoms: padding).

    Args:
      positions: [n_atoms, 3] Å.
      cell: [S, 3, 3] Å, rows are lattice vectors.
      batch_idx: [n_atoms] int, system of each atom.
      nl: the neighbour list (COO edges).

    Returns:
      [max_edges, 3] Å, ``positions[senders] - positions[receivers] + shifts @ cell``
      (plus ``nl.displacement``); padding rows are zero.
    """
    if nl.zero_shifts:  # a rank's list: no images, so neither the shifts nor the cell enter
        vectors = _differences(positions, nl.senders, nl.receivers)
        return vectors if nl.displacement is None else vectors + nl.displacement
    shifts = nl.shifts.astype(positions.dtype)
    if cell.shape[0] == 1:
        # One system: a [E, 3] x [3, 3] product; no per-edge copy of the cell (whose
        # gradient would otherwise be a scatter over all edges).
        shift = shifts @ cell[0]
    else:
        shift = jnp.einsum("ei,eij->ej", shifts, cell[_rows(batch_idx, nl.receivers)])
    vectors = _differences(positions, nl.senders, nl.receivers) + shift
    return vectors if nl.displacement is None else vectors + nl.displacement
