"""Kernel 1: fused Lennard-Jones energies, forces and virial on a COO neighbour list.

One pass over the edges gives per-atom energies, forces and per-atom virials; the named
op ``"jaxdd_ffi::lj_pair"`` wraps the compiled kernel with a ``custom_vjp``: the
energies' derivative is a second kernel (positions, cells) and a jnp formula
(parameters); derivatives of the forces and virials (second derivatives) come from the
jnp reference, and cost nothing when nothing depends on them.

Edges follow :mod:`jaxdd.neighbors`: edge e points from receiver r to sender s,
``d_e = x[s] - x[r] + shifts_e · cell`` (integer image shifts; the kernel applies the cell
itself, so no [E, 3] array of shift vectors is made); padding edges have ``mask`` False
(and may index one past the last atom).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import register_op
from . import _call

__all__ = ["lennard_jones", "lennard_jones_reference", "LJ_OP"]

_NAME = "lennard_jones"
# The handlers of csrc/lj/lj_cpu.cc and lj_cuda.cu.
_FORWARD = _call.target("lj_forward")
_BACKWARD = _call.target("lj_backward")


def _rows(x, idx):
    return x.at[idx].get(mode="fill", fill_value=0)


def _edge_vectors(positions, shifts, cells, system, senders, receivers):
    """d = x[s] - x[r] + shifts · cell of the receiver's system, [E, 3] (elementwise: no dot).
    Shifts of 0 rows: no edge has an image shift."""
    if shifts.shape[0] == 0:
        return _rows(positions, senders) - _rows(positions, receivers)
    n_cells = cells.shape[0]
    h = cells[jnp.clip(_rows(system, receivers), 0, n_cells - 1)]  # [E, 3, 3]
    n = shifts.astype(positions.dtype)
    image = n[:, 0:1] * h[:, 0] + n[:, 1:2] * h[:, 1] + n[:, 2:3] * h[:, 2]
    return _rows(positions, senders) - _rows(positions, receivers) + image


def _reference(positions, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff,
               half_list):
    """The kernel in jnp: (energies [n], forces [n, 3], virial [n, 3, 3]); see :func:`lennard_jones`."""
    n = positions.shape[0]
    k = sigma.shape[0]
    valid = mask & (senders >= 0) & (senders < n) & (receivers >= 0) & (receivers < n)

    def total(delta):  # delta: [E, 3] added to every edge vector, so dE/d(delta) = dE/dd
        d = _edge_vectors(positions, shifts, cells, system, senders, receivers) + delta
        r2 = jnp.sum(d * d, axis=-1)
        inside = valid & (r2 < cutoff * cutoff)
        r2 = jnp.where(inside, r2, 1.0)  # safe value keeps gradients finite on padding
        ab = jnp.clip(_rows(types, receivers), 0, k - 1) * k + jnp.clip(_rows(types, senders), 0, k - 1)
        sig2 = sigma.reshape(-1)[ab] ** 2
        s6 = (sig2 / r2) ** 3
        v = 4.0 * epsilon.reshape(-1)[ab] * (s6 * s6 - s6) - v_shift.reshape(-1)[ab]
        half = 0.5 * jnp.where(inside, v, 0.0)
        energies = (jax.ops.segment_sum(half, receivers, n)
                    + jnp.where(half_list, jax.ops.segment_sum(half, senders, n), 0.0))
        return jnp.sum(energies), (energies, d)

    g_edge, (energies, d) = jax.grad(total, has_aux=True)(jnp.zeros((senders.shape[0], 3), positions.dtype))
    # Half list: -dE/dx (each pair pushes both atoms). Full list: each receiver gets the
    # whole force of each of its pairs, twice its edge's share ("newton off").
    forces = jnp.where(half_list,
                       jax.ops.segment_sum(g_edge, receivers, n) - jax.ops.segment_sum(g_edge, senders, n),
                       2.0 * jax.ops.segment_sum(g_edge, receivers, n))
    edge_virial = -d[:, :, None] * g_edge[:, None, :]  # -d ⊗ dE/dd per edge
    on_receiver = jnp.where(half_list, 0.5, 1.0) * edge_virial
    virial = (jax.ops.segment_sum(on_receiver, receivers, n)
              + jnp.where(half_list, jax.ops.segment_sum(0.5 * edge_virial, senders, n), 0.0))
    return energies, forces, virial


def _kernel(positions, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff,
            half_list):
    n = positions.shape[0]
    dtype = positions.dtype
    suffix = _call.float_suffix(_NAME, "positions", positions)
    args = (positions, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff,
            half_list)
    # Two passes, so that a program that never reads the virial (dynamics) drops its pass.
    energies, forces, _ = _FORWARD(suffix, [((n,), dtype), ((n, 3), dtype), ((0, 3, 3), dtype)], *args,
                                   parts=np.int64(1))
    _, _, virial = _FORWARD(suffix, [((0,), dtype), ((0, 3), dtype), ((n, 3, 3), dtype)], *args, parts=np.int64(2))
    return energies, forces, virial


def _backward(args, cts):
    positions, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half = args
    ct_energy, ct_forces, ct_virial = cts
    g_pos, g_cells, g_sigma, g_eps, g_vs = jax.tree_util.tree_map(
        jnp.zeros_like, (positions, cells, sigma, epsilon, v_shift))
    suffix = _call.float_suffix(_NAME, "positions", positions)

    def reference(positions, cells, sigma, epsilon, v_shift):
        return _reference(positions, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon,
                          v_shift, cutoff, half)

    if ct_energy is not None:
        g_pos, g_cells = _BACKWARD(suffix, [(positions.shape, positions.dtype), (cells.shape, cells.dtype)], *args,
                                   ct_energy)
        # Parameter derivatives by the jnp formula; XLA drops them unless something asks.
        _, pullback = jax.vjp(lambda sg, ep, vs: reference(positions, cells, sg, ep, vs)[0], sigma, epsilon, v_shift)
        g_sigma, g_eps, g_vs = pullback(ct_energy)
    if ct_forces is not None or ct_virial is not None:  # second derivatives: the jnp formula
        _, pullback = jax.vjp(lambda *a: reference(*a)[1:], positions, cells, sigma, epsilon, v_shift)
        cf = jnp.zeros_like(positions) if ct_forces is None else ct_forces
        cw = jnp.zeros(positions.shape[:1] + (3, 3), positions.dtype) if ct_virial is None else ct_virial
        extra = pullback((cf, cw))
        g_pos, g_cells, g_sigma, g_eps, g_vs = (a + b for a, b in zip((g_pos, g_cells, g_sigma, g_eps, g_vs), extra))
    return g_pos, None, g_cells, None, None, None, None, None, g_sigma, g_eps, g_vs, None, None


LJ_OP = register_op("jaxdd_ffi::lj_pair", _kernel, bwd=_backward)


def _shift_table(sigma, epsilon, cutoff, shift: bool):
    if not shift:
        return jnp.zeros_like(sigma)
    c6 = (sigma * sigma / (cutoff * cutoff)) ** 3
    return 4.0 * epsilon * (c6 * c6 - c6)


def _prepare(positions, shifts, cells, senders, receivers, mask, sigma, epsilon, cutoff, system, types, shift,
             half_list):
    """Checked, kernel-ready arguments (a clear ValueError for any wrong dtype or shape)."""
    positions = jnp.asarray(positions)
    _call.float_suffix(_NAME, "positions", positions)
    dtype = positions.dtype
    _call.check_array(_NAME, "positions", positions, (None, 3), dtype)
    n = positions.shape[0]
    senders, receivers, mask = jnp.asarray(senders), jnp.asarray(receivers), jnp.asarray(mask)
    _call.check_array(_NAME, "senders", senders, (None,), np.int32)
    e = senders.shape[0]
    _call.check_array(_NAME, "receivers", receivers, (e,), np.int32)
    _call.check_array(_NAME, "mask", mask, (e,), np.bool_)
    shifts = jnp.asarray(shifts)
    _call.check_array(_NAME, "shifts", shifts, (0 if shifts.ndim == 2 and shifts.shape[0] == 0 else e, 3), np.int32)
    cells = jnp.asarray(cells)
    if cells.ndim == 2:
        cells = cells[None]
    _call.check_array(_NAME, "cells", cells, (None, 3, 3), dtype)
    system = jnp.zeros(n, jnp.int32) if system is None else jnp.asarray(system)
    _call.check_array(_NAME, "system", system, (n,), np.int32)
    types = jnp.zeros(n, jnp.int32) if types is None else jnp.asarray(types)
    _call.check_array(_NAME, "types", types, (n,), np.int32)
    sigma = jnp.asarray(sigma, dtype)
    epsilon = jnp.asarray(epsilon, dtype)
    if sigma.ndim == 0:
        sigma = sigma.reshape(1, 1)
    if epsilon.ndim == 0:
        epsilon = epsilon.reshape(1, 1)
    kk = sigma.shape[0]
    _call.check_array(_NAME, "sigma", sigma, (kk, kk), dtype)
    _call.check_array(_NAME, "epsilon", epsilon, (kk, kk), dtype)
    cutoff = jnp.asarray(cutoff, dtype)
    _call.check_array(_NAME, "cutoff", cutoff, (), dtype)
    v_shift = _shift_table(sigma, epsilon, cutoff, bool(shift))
    half = jnp.asarray(bool(half_list))
    return (positions, shifts, cells, system, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff,
            half)


def lennard_jones(positions, shifts, cells, senders, receivers, mask, sigma, epsilon, *, cutoff, system=None,
                  types=None, shift: bool = False, half_list: bool = False):
    """Fused Lennard-Jones pass over a COO list (the compiled kernel).

    Differentiable (reverse mode) in positions, cells, sigma and epsilon.

    Args:
      positions: [n, 3] Å (float32 or float64).
      shifts: [E, 3] int32 image shift of each edge's sender in cell vectors
        (``NeighborList.shifts``), or [0, 3] when no edge has one (a rank's list under
        decomposition: the pass then reads no shifts).
      cells: [S, 3, 3] Å (or one [3, 3]), row i the i-th cell vector.
      senders, receivers: [E] int32.
      mask: [E] bool, False on padding edges.
      sigma, epsilon: σ (Å) and ε (eV), scalars or [K, K] tables indexed by ``types``.
      cutoff: r_c (Å).
      system: [n] int32 system of each atom (default all 0); an edge uses its receiver's cell.
      types: [n] int32 in [0, K) (default all 0).
      shift: subtract V(r_c) from every pair.
      half_list: each pair is listed once (else twice, once per receiver).

    Returns:
      (energies [n] eV, forces [n, 3] eV/Å, virial [n, 3, 3] eV): each pair's energy and
      virial ``-d ⊗ dV/dd`` split evenly between its atoms (a full list credits the
      receiver of each of the pair's two edges). Forces: with a half list ``-dE/dx`` (E the
      sum of the energies); with a full list each receiver gets the whole force of each of
      its pairs (LAMMPS's "newton off"): ``-dE/dx`` on every atom that receives all its
      pairs (every atom of a symmetric list, every owned atom under decomposition), zero on
      rows that receive no edge.
    """
    return LJ_OP(*_prepare(positions, shifts, cells, senders, receivers, mask, sigma, epsilon, cutoff, system, types,
                           shift, half_list))


def lennard_jones_reference(positions, shifts, cells, senders, receivers, mask, sigma, epsilon, *, cutoff,
                            system=None, types=None, shift: bool = False, half_list: bool = False):
    """What :func:`lennard_jones` computes, in jnp (forces and virial by autodiff).

    Args:
      positions, shifts, cells, senders, receivers, mask, sigma, epsilon, cutoff, system,
        types, shift, half_list: as in :func:`lennard_jones` (Å, eV).

    Returns:
      (energies [n] eV, forces [n, 3] eV/Å, virial [n, 3, 3] eV).
    """
    return _reference(*_prepare(positions, shifts, cells, senders, receivers, mask, sigma, epsilon, cutoff, system,
                                types, shift, half_list))
