"""CHGNet's expansions of bond lengths and angles (chgnet/model/basis.py, encoders.py)."""

from __future__ import annotations

import math

import jax.numpy as jnp

__all__ = ["polynomial_envelope", "radial_bessel", "fourier", "ACOS_SHRINK"]

#: chgnet multiplies every cosine by this before ``acos``, whose slope is infinite at ±1.
ACOS_SHRINK = 1.0 - 1e-6


def polynomial_envelope(r, cutoff: float, p: float):
    """GemNet's envelope ``1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2)``, x = r/r_c,
    zero from ``r_c`` on (value and first two derivatives vanish there).

    Args:
      r: distances (Å), any shape.
      cutoff: r_c (Å).
      p: the exponent (chgnet's ``cutoff_coeff``; 8 for 0.3.0).

    Returns:
      the envelope, shaped like ``r``.
    """
    x = r / cutoff
    a, b, c = -(p + 1) * (p + 2) / 2, p * (p + 2), -p * (p + 1) / 2
    p = int(p) if float(p).is_integer() else p  # integer powers are products, as torch's x**8
    value = 1 + a * x**p + b * x ** (p + 1) + c * x ** (p + 2)
    return jnp.where(x < 1, value, 0.0)


def radial_bessel(r, frequencies, cutoff: float, p: float):
    """The enveloped Bessel basis ``sqrt(2/r_c) sin(f_n r / r_c) / r · envelope(r)``.

    Args:
      r: distances (Å), shape ``[...]``, positive (pass a safe value on padding).
      frequencies: the trained ``f_n`` [n] (chgnet starts them at ``n π``).
      cutoff: r_c (Å).
      p: the envelope's exponent.

    Returns:
      ``[..., n]`` (Å⁻¹).
    """
    r = r[..., None]
    bessel = math.sqrt(2.0 / cutoff) * jnp.sin(frequencies * (r / cutoff)) / r
    return polynomial_envelope(r, cutoff, p) * bessel


def fourier(theta, frequencies):
    """The Fourier basis of an angle, ``[1/√2, sin(f_k θ), cos(f_k θ)] / √π``.

    Args:
      theta: angles (rad), shape ``[...]``.
      frequencies: the trained ``f_k`` [m] (chgnet starts them at ``k``).

    Returns:
      ``[..., 2m + 1]``.
    """
    t = theta[..., None] * frequencies
    const = jnp.full(theta.shape + (1,), 1.0 / math.sqrt(2.0), theta.dtype)
    return jnp.concatenate([const, jnp.sin(t), jnp.cos(t)], axis=-1) / math.sqrt(math.pi)
