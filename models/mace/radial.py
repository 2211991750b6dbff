"""MACE's edge-length functions, as mace-torch writes them: radial bases, distance transforms
and the Ziegler-Biersack-Littmark (ZBL) pair repulsion.

Lengths are in Å; every function is elementwise over edges (``r [E]``) and safe on padding
edges as long as their length is a positive placeholder (the model puts 1 there and masks).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = ["RADIAL_TYPES", "DISTANCE_TRANSFORMS", "bessel", "gaussian", "chebyshev", "agnesi", "soft",
           "polynomial_cutoff", "zbl_edge_energy", "default_transform_params", "default_zbl_params"]

#: Radial bases (mace-torch's ``radial_type``).
RADIAL_TYPES = ("bessel", "gaussian", "chebyshev")
#: Distance transforms (mace-torch's ``distance_transform``), applied to the length the basis reads.
DISTANCE_TRANSFORMS = ("Agnesi", "Soft")


def bessel(r, weights, r_max):
    """``sqrt(2/r_max) sin(w_n r) / r`` (mace's ``BesselBasis``).

    Args:
      r: ``[E]`` lengths (Å).
      weights: ``[n]`` frequencies ``w_n`` (1/Å; ``nπ/r_max`` unless trained).
      r_max: the cutoff (Å).

    Returns:
      ``[E, n]``.
    """
    return math.sqrt(2.0 / r_max) * jnp.sin(weights * r[:, None]) / r[:, None]


def gaussian(r, centres, r_max):
    """``exp(-(r - μ_n)² / (2 δ²))`` with ``δ = r_max / (n - 1)`` (mace's ``GaussianBasis``).

    Args:
      r: ``[E]`` lengths (Å).
      centres: ``[n]`` centres ``μ_n`` (Å).
      r_max: the cutoff (Å).

    Returns:
      ``[E, n]``.
    """
    coeff = -0.5 / (r_max / (centres.shape[0] - 1)) ** 2
    return jnp.exp(coeff * (r[:, None] - centres) ** 2)


def chebyshev(r, n: int):
    """Chebyshev polynomials of the first kind ``T_1(r) .. T_n(r)`` of the length itself, not
    scaled (mace's ``ChebychevBasis``; meant for a transformed length in [-1, 1]), by the
    three-term recurrence.

    As in mace-torch, whose ``torch.special.chebyshev_polynomial_t`` has no derivative, the
    basis is a constant to differentiation: forces and stress do not see its dependence on the
    length (only the envelope's, the harmonics' and ZBL's).

    Args:
      r: ``[E]`` lengths (Å).
      n: the number of polynomials.

    Returns:
      ``[E, n]``.
    """
    r = jax.lax.stop_gradient(r)
    prev, cur, out = jnp.ones_like(r), r, []
    for _ in range(n):
        out.append(cur)
        prev, cur = cur, 2 * r * cur - prev
    return jnp.stack(out, axis=-1)


def polynomial_cutoff(r, r_max, p: int):
    """mace's ``PolynomialCutoff``: ``1 - (p+1)(p+2)/2 x^p + p(p+2) x^(p+1) - p(p+1)/2 x^(p+2)``
    for ``x = r / r_max < 1``, zero beyond.

    Args:
      r: ``[E]`` lengths (Å).
      r_max: ``[E]`` or scalar cutoff (Å).
      p: the degree.

    Returns:
      ``[E]``.
    """
    x = r / r_max
    env = 1.0 - (p + 1.0) * (p + 2.0) / 2.0 * x**p + p * (p + 2.0) * x ** (p + 1) - p * (p + 1.0) / 2 * x ** (p + 2)
    return jnp.where(r < r_max, env, 0.0)


def agnesi(r, r0, a, q, p):
    """Agnesi transform ``1 / (1 + a (r/r0)^q / (1 + (r/r0)^(q-p)))`` (ACEpotentials.jl), with
    ``r0`` the mean covalent radius of the pair.

    Args:
      r: ``[E]`` lengths (Å).
      r0: ``[E]`` half the sum of the two atoms' covalent radii (Å).
      a, q, p: the transform's parameters (mace-torch: 1.0805, 0.9183, 4.5791).

    Returns:
      ``[E]`` transformed lengths (dimensionless, in (0, 1]).
    """
    x = r / r0
    return 1.0 / (1.0 + a * x**q / (1.0 + x ** (q - p)))


def soft(r, r0, alpha):
    """Soft transform ``p0 + (r - p0) (1 + tanh(α (r - m) / (p1 - p0))) / 2`` with
    ``p0 = 3/4 r0``, ``p1 = 4/3 r0``, ``m = (p0 + p1) / 2``: lengths well below the pair's
    covalent distance are lifted towards ``p0``, those above kept.

    Args:
      r: ``[E]`` lengths (Å).
      r0: ``[E]`` the sum of the two atoms' covalent radii (Å).
      alpha: steepness (mace-torch: 4.0).

    Returns:
      ``[E]`` transformed lengths (Å).
    """
    p0, p1 = 0.75 * r0, (4.0 / 3.0) * r0
    m = 0.5 * (p0 + p1)
    s = 0.5 * (1.0 + jnp.tanh(alpha / (p1 - p0) * (r - m)))
    return p0 + (r - p0) * s


def zbl_edge_energy(r, z_sender, z_receiver, rc_sender, rc_receiver, params, p: int):
    """Half the ZBL screened nuclear repulsion of each edge (eV), enveloped to zero at the sum of
    the two covalent radii (mace's ``ZBLBasis``; summed over a receiver's edges it is that atom's
    pair energy).

    Args:
      r: ``[E]`` lengths (Å).
      z_sender, z_receiver: ``[E]`` atomic numbers (floats).
      rc_sender, rc_receiver: ``[E]`` covalent radii (Å).
      params: ``c [4]`` screening coefficients, ``a_exp``, ``a_prefactor``
        (:func:`default_zbl_params`).
      p: degree of the polynomial envelope (the model's ``num_polynomial_cutoff``).

    Returns:
      ``[E]`` (eV).
    """
    c = params["c"]
    a = params["a_prefactor"] * 0.529 / (z_sender ** params["a_exp"] + z_receiver ** params["a_exp"])
    x = r / a
    phi = (c[0] * jnp.exp(-3.2 * x) + c[1] * jnp.exp(-0.9423 * x) + c[2] * jnp.exp(-0.4028 * x)
           + c[3] * jnp.exp(-0.2016 * x))
    v = (14.3996 * z_sender * z_receiver) / r * phi
    return 0.5 * v * polynomial_cutoff(r, rc_sender + rc_receiver, p)


def default_transform_params(name):
    """The untrained parameters mace-torch gives the distance transform ``name``.

    Args:
      name: ``"Agnesi"`` or ``"Soft"``.

    Returns:
      dict of floats.
    """
    return {"a": 1.0805, "q": 0.9183, "p": 4.5791} if name == "Agnesi" else {"alpha": 4.0}


def default_zbl_params():
    """The untrained parameters of mace-torch's ``ZBLBasis``.

    Returns:
      dict with ``c [4]``, ``a_exp`` and ``a_prefactor``.
    """
    return {"c": [0.1818, 0.5099, 0.2802, 0.02817], "a_exp": 0.300, "a_prefactor": 0.4543}
