"""Kernel 1: fused Lennard-Jones energies, forces and virial on a COO neighbour list.

One pass over the edges gives per-atom energies, forces and per-atom virials; the named
op ``"jaxdd_ffi::lj_pair"`` wraps the compiled kernel with a ``custom_vjp``: the
energies' derivative is a second kernel (positions, shifts) and a jnp formula
(parameters); derivatives of the forces and virials (second derivatives) come from the
jnp reference, and cost nothing when nothing depends on them.

Edges follow :mod:`jaxdd.neighbors`: edge e points from receiver r to sender s,
``d_e = x[s] - x[r] + shift_e`` (shift_e in Å, already multiplied by the cell); padding
edges have ``mask`` False (and may index one past the last atom).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import register_op
from . import _call

__all__ = ["lennard_jones", "lennard_jones_reference", "LJ_OP"]

_NAME = "lennard_jones"


def _rows(x, idx):
    return x.at[idx].get(mode="fill", fill_value=0)


def _reference(positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half_list):
    """The kernel in jnp: (energies [n], forces [n, 3], virial [n, 3, 3]); see :func:`lennard_jones`."""
    n = positions.shape[0]
    k = sigma.shape[0]

    def energies_of(positions, shifts):
        d = _rows(positions, senders) - _rows(positions, receivers) + shifts
        r2 = jnp.sum(d * d, axis=-1)
        valid = mask & (senders >= 0) & (senders < n) & (receivers >= 0) & (receivers < n)
        inside = valid & (r2 < cutoff * cutoff)
        r2 = jnp.where(inside, r2, 1.0)  # safe value keeps gradients finite on padding
        ab = jnp.clip(_rows(types, receivers), 0, k - 1) * k + jnp.clip(_rows(types, senders), 0, k - 1)
        sig2 = sigma.reshape(-1)[ab] ** 2
        s6 = (sig2 / r2) ** 3
        v = 4.0 * epsilon.reshape(-1)[ab] * (s6 * s6 - s6) - v_shift.reshape(-1)[ab]
        half = 0.5 * jnp.where(inside, v, 0.0)
        return (jax.ops.segment_sum(half, receivers, n)
                + jnp.where(half_list, jax.ops.segment_sum(half, senders, n), 0.0)), d

    def total(positions, shifts):
        energies, d = energies_of(positions, shifts)
        return jnp.sum(energies), (energies, d)

    (g_pos, g_shift), (energies, d) = jax.grad(total, argnums=(0, 1), has_aux=True)(positions, shifts)
    edge_virial = -d[:, :, None] * g_shift[:, None, :]  # -d ⊗ dE/dd per edge
    on_receiver = jnp.where(half_list, 0.5, 1.0) * edge_virial
    virial = (jax.ops.segment_sum(on_receiver, receivers, n)
              + jnp.where(half_list, jax.ops.segment_sum(0.5 * edge_virial, senders, n), 0.0))
    return energies, -g_pos, virial


def _kernel(positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half_list):
    n, e = positions.shape[0], senders.shape[0]
    dtype = positions.dtype
    suffix = _call.float_suffix(_NAME, "positions", positions)
    return tuple(_call.call(
        "lj_forward", suffix, [((n,), dtype), ((n, 3), dtype), ((n, 3, 3), dtype)],
        positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half_list))


def _backward(args, cts):
    positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half_list = args
    ct_energy, ct_forces, ct_virial = cts
    zeros = jax.tree_util.tree_map(jnp.zeros_like, (positions, shifts, sigma, epsilon, v_shift))
    g_pos, g_shift, g_sigma, g_eps, g_vs = zeros
    suffix = _call.float_suffix(_NAME, "positions", positions)
    if ct_energy is not None:
        g_pos, g_shift = _call.call(
            "lj_backward", suffix, [(positions.shape, positions.dtype), (shifts.shape, shifts.dtype)],
            positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half_list,
            ct_energy)

        # Parameter derivatives by the jnp formula; XLA drops them unless something asks.
        def energies(sigma, epsilon, v_shift):
            return _reference(positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff,
                              half_list)[0]

        _, pullback = jax.vjp(energies, sigma, epsilon, v_shift)
        g_sigma, g_eps, g_vs = pullback(ct_energy)
    if ct_forces is not None or ct_virial is not None:
        def forces_virial(positions, shifts, sigma, epsilon, v_shift):
            out = _reference(positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff,
                             half_list)
            return out[1], out[2]

        _, pullback = jax.vjp(forces_virial, positions, shifts, sigma, epsilon, v_shift)
        cf = jnp.zeros_like(positions) if ct_forces is None else ct_forces
        cw = jnp.zeros(positions.shape[:1] + (3, 3), positions.dtype) if ct_virial is None else ct_virial
        extra = pullback((cf, cw))
        g_pos, g_shift, g_sigma, g_eps, g_vs = (a + b for a, b in zip((g_pos, g_shift, g_sigma, g_eps, g_vs), extra))
    return g_pos, g_shift, None, None, None, None, g_sigma, g_eps, g_vs, None, None


LJ_OP = register_op("jaxdd_ffi::lj_pair", _kernel, bwd=_backward)


def _shift_table(sigma, epsilon, cutoff, shift: bool):
    if not shift:
        return jnp.zeros_like(sigma)
    c6 = (sigma * sigma / (cutoff * cutoff)) ** 3
    return 4.0 * epsilon * (c6 * c6 - c6)


def _prepare(positions, shifts, senders, receivers, mask, types, sigma, epsilon, cutoff, shift, half_list):
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
    _call.check_array(_NAME, "shifts", shifts, (e, 3), dtype)
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
    return positions, shifts, senders, receivers, mask, types, sigma, epsilon, v_shift, cutoff, half


def lennard_jones(positions, shifts, senders, receivers, mask, sigma, epsilon, *, cutoff, types=None,
                  shift: bool = False, half_list: bool = False):
    """Fused Lennard-Jones pass over a COO list (the compiled kernel).

    positions: [n, 3] Å (float32 or float64); shifts: [E, 3] Å, the sender's periodic
    image shift (``nl.shifts @ cell``); senders, receivers: [E] int32; mask: [E] bool;
    sigma, epsilon: σ (Å) and ε (eV), scalars or [K, K] tables indexed by ``types`` ([n]
    int32 in [0, K), default all 0); cutoff: r_c (Å); shift: subtract V(r_c) from every
    pair; half_list: each pair is listed once (else twice, once per receiver).

    Returns (energies [n] eV, forces [n, 3] eV/Å, virial [n, 3, 3] eV): each pair's energy
    and virial ``-d ⊗ dE/dd`` split evenly between its atoms (a full list credits the
    receiver of each of the pair's two edges), forces ``-dE/dx`` with E the sum of the
    energies. Differentiable (reverse mode) in positions, shifts, sigma and epsilon.
    """
    return LJ_OP(*_prepare(positions, shifts, senders, receivers, mask, types, sigma, epsilon, cutoff, shift,
                           half_list))


def lennard_jones_reference(positions, shifts, senders, receivers, mask, sigma, epsilon, *, cutoff, types=None,
                            shift: bool = False, half_list: bool = False):
    """What :func:`lennard_jones` computes, in jnp (forces and virial by autodiff)."""
    return _reference(*_prepare(positions, shifts, senders, receivers, mask, types, sigma, epsilon, cutoff, shift,
                                half_list))
