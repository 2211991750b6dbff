"""Irreps and Wigner 3j symbols in the conventions of e3nn for PyTorch (0.4), which MACE models
trained with mace-torch are written in.

An irreps is a tuple of ``(mul, l, p)`` (multiplicity, degree, parity ±1); features are laid out
``mul_ir``: for each entry in order, ``mul`` copies of a ``2l+1`` vector, flattened. Sorting puts
``(l, p)`` in increasing order (odd before even within a degree), as e3nn for PyTorch does; the
order decides the layout of every weight read from a mace-torch model.
"""

from __future__ import annotations

import functools
import math
import re

import numpy as np

__all__ = ["Irreps", "parse", "count", "sort", "simplify", "spherical_harmonics_irreps", "wigner_3j"]

Irreps = tuple  # of (mul, l, p)

_TERM = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(\d+)\s*([eo])\s*$")


def parse(irreps) -> Irreps:
    """``irreps`` as ``"16x0e + 16x1o"`` (or a tuple of ``(mul, l, p)``) -> ``((16, 0, 1), (16, 1, -1))``."""
    if isinstance(irreps, tuple):
        return tuple((int(m), int(l), int(p)) for m, l, p in irreps)
    out = []
    for term in str(irreps).split("+"):
        if not term.strip():
            continue
        match = _TERM.match(term)
        if match is None:
            raise ValueError(f"cannot read irreps {irreps!r}: term {term.strip()!r} is not like '16x1o'")
        mul, l, p = match.groups()
        out.append((int(mul) if mul else 1, int(l), 1 if p == "e" else -1))
    return tuple(out)


def count(irreps: Irreps, l: int, p: int) -> int:
    """Total multiplicity of the irrep ``(l, p)`` in ``irreps``."""
    return sum(m for m, l_, p_ in irreps if (l_, p_) == (l, p))


def sort(irreps: Irreps):
    """(sorted irreps, permutation): entry ``i`` of ``irreps`` is entry ``perm[i]`` of the result."""
    order = sorted(range(len(irreps)), key=lambda i: (irreps[i][1], irreps[i][2]))
    perm = [0] * len(irreps)
    for new, old in enumerate(order):
        perm[old] = new
    return tuple(irreps[i] for i in order), tuple(perm)


def simplify(irreps: Irreps) -> Irreps:
    """``irreps`` with neighbouring entries of the same irrep merged (and empty ones dropped)."""
    out = []
    for m, l, p in irreps:
        if out and out[-1][1:] == (l, p):
            out[-1] = (out[-1][0] + m, l, p)
        elif m > 0:
            out.append((m, l, p))
    return tuple(out)


def spherical_harmonics_irreps(lmax: int, p: int = -1) -> Irreps:
    """``1x0e + 1x1o + 1x2e + ...`` up to degree ``lmax`` (``p=-1``: parity (-1)^l, the harmonics of a vector)."""
    return tuple((1, l, p**l) for l in range(lmax + 1))


def _su2_cg(j1, j2, j3):
    """Clebsch–Gordan <j1 m1, j2 m2 | j3 m3> (Racah's formula), [2j1+1, 2j2+1, 2j3+1] by m + j."""
    f = math.factorial
    out = np.zeros((2 * j1 + 1, 2 * j2 + 1, 2 * j3 + 1))
    for m1 in range(-j1, j1 + 1):
        for m2 in range(-j2, j2 + 1):
            m3 = m1 + m2
            if abs(m3) > j3:
                continue
            pre = math.sqrt((2 * j3 + 1) * f(j3 + j1 - j2) * f(j3 - j1 + j2) * f(j1 + j2 - j3) / f(j1 + j2 + j3 + 1))
            pre *= math.sqrt(f(j3 + m3) * f(j3 - m3) * f(j1 - m1) * f(j1 + m1) * f(j2 - m2) * f(j2 + m2))
            total = 0.0
            for k in range(0, j1 + j2 + j3 + 1):
                den = [k, j1 + j2 - j3 - k, j1 - m1 - k, j2 + m2 - k, j3 - j2 + m1 + k, j3 - j1 - m2 + k]
                if min(den) < 0:
                    continue
                total += (-1) ** k / math.prod(f(d) for d in den)
            out[j1 + m1, j2 + m2, j3 + m3] = pre * total
    return out


def _real_to_complex(l):
    """The change of basis from real to complex spherical harmonics of degree ``l`` (with the
    factor (-i)^l that makes the coupling coefficients real)."""
    q = np.zeros((2 * l + 1, 2 * l + 1), complex)
    s = 1 / math.sqrt(2)
    for m in range(-l, 0):
        q[l + m, l + abs(m)] = s
        q[l + m, l - abs(m)] = -1j * s
    q[l, l] = 1
    for m in range(1, l + 1):
        q[l + m, l + abs(m)] = (-1) ** m * s
        q[l + m, l - abs(m)] = 1j * (-1) ** m * s
    return (-1j) ** l * q


def _coupling(l1, l2, l3):
    """Unit-norm real coupling tensor from the SU(2) coefficients (any overall sign)."""
    c = _su2_cg(l1, l2, l3).astype(complex)
    q1, q2, q3 = _real_to_complex(l1), _real_to_complex(l2), _real_to_complex(l3)
    c = np.einsum("ij,kl,mn,ikn->jlm", q1, q2, np.conj(q3.T), c)
    assert np.abs(np.imag(c)).max() < 1e-10
    real = np.real(c)
    return real / np.linalg.norm(real)


def _canonical(l1, l2, l3):
    """The tensor of a sorted triple ``l1 <= l2 <= l3``, signed so that its centre element
    ``C[l1, l2, l3]`` (or, when that is zero, its first non-zero element) is positive."""
    c = _coupling(l1, l2, l3)
    c[np.abs(c) < 1e-14] = 0
    pivot = c[l1, l2, l3] if c[l1, l2, l3] != 0 else c.flat[np.flatnonzero(c)[0]]
    return -c if pivot < 0 else c


@functools.lru_cache(maxsize=None)
def wigner_3j(l1: int, l2: int, l3: int) -> np.ndarray:
    """Real coupling tensor ``C[2l1+1, 2l2+1, 2l3+1]`` of unit Frobenius norm, signed exactly as
    e3nn for PyTorch signs it (which differs from e3nn-jax's ``clebsch_gordan`` for some degrees).

    e3nn for PyTorch stores the tensors of sorted triples and derives the others by transposing
    them, with a factor (-1)^(l1+l2+l3) for odd permutations; where several of its cases apply
    (repeated degrees) the last one it tries wins, which this reproduces.

    Args:
      l1, l2, l3: the degrees coupled (a triangle: ``|l1 - l2| <= l3 <= l1 + l2``).
    """
    if not abs(l1 - l2) <= l3 <= l1 + l2:
        raise ValueError(f"no coupling of degrees {l1} and {l2} to {l3}")
    sign = (-1) ** (l1 + l2 + l3)
    out = None
    # (condition, sorted triple, axes of the stored tensor giving (l1, l2, l3), sign) in e3nn's order.
    cases = [
        (l1 <= l2 <= l3, (l1, l2, l3), (0, 1, 2), 1),
        (l1 <= l3 <= l2, (l1, l3, l2), (0, 2, 1), sign),
        (l2 <= l1 <= l3, (l2, l1, l3), (1, 0, 2), sign),
        (l3 <= l2 <= l1, (l3, l2, l1), (2, 1, 0), sign),
        (l2 <= l3 <= l1, (l2, l3, l1), (2, 0, 1), 1),
        (l3 <= l1 <= l2, (l3, l1, l2), (1, 2, 0), 1),
    ]
    for applies, triple, axes, factor in cases:
        if applies:
            out = factor * np.transpose(_canonical(*triple), axes)
    out = np.ascontiguousarray(out)
    out.setflags(write=False)
    return out
