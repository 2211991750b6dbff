"""Equivariant layers of MACE as pure functions of (static structure, weights, features), with
the normalisations of e3nn for PyTorch so that a mace-torch model's weights apply unchanged.

Features are ``[..., dim]`` arrays in the ``mul_ir`` layout of :mod:`.irreps`. Each layer is a
small frozen description (built once, hashable, static) with a ``__call__(weights, ...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import irreps as ir

__all__ = ["split", "Linear", "TensorProduct", "uvu_messages", "conv_tp_irreps", "radial_mlp", "normalized_silu_constant",
           "symmetric_contraction", "symmetric_basis", "symmetrize_basis", "monomials"]


def split(irreps, x):
    """``x [..., dim]`` (``mul_ir`` layout) -> one ``[..., mul, 2l+1]`` block per entry of ``irreps``."""
    out, start = [], 0
    for mul, l, _ in irreps:
        d = 2 * l + 1
        out.append(x[..., start:start + mul * d].reshape(x.shape[:-1] + (mul, d)))
        start += mul * d
    return out


def _join(irreps, blocks, batch_shape, dtype):
    parts = [
        (b if b is not None else jnp.zeros(batch_shape + (mul, 2 * l + 1), dtype)).reshape(batch_shape + (-1,))
        for b, (mul, l, _) in zip(blocks, irreps)
    ]
    return jnp.concatenate(parts, axis=-1) if parts else jnp.zeros(batch_shape + (0,), dtype)


@dataclasses.dataclass(frozen=True)
class Linear:
    """Channel mixing of equal irreps (e3nn ``o3.Linear``, no biases): every input entry feeds
    every output entry of the same irrep, each path scaled by 1/sqrt(its output's fan-in).

    Weights: ``[numel]``, one ``[mul_in, mul_out]`` block per path, input-major order.
    """

    irreps_in: tuple
    irreps_out: tuple

    @property
    def paths(self):
        """``(input entry, output entry)`` of each pair of the same irrep, in order."""
        return tuple((i, o) for i, (_, li, pi) in enumerate(self.irreps_in)
                     for o, (_, lo, po) in enumerate(self.irreps_out) if (li, pi) == (lo, po))

    @property
    def numel(self) -> int:
        """The number of weights: Σ over paths of m_in · m_out."""
        return sum(self.irreps_in[i][0] * self.irreps_out[o][0] for i, o in self.paths)

    def __call__(self, weight, x):
        blocks = split(self.irreps_in, x)
        out = [None] * len(self.irreps_out)
        fan_in = [sum(self.irreps_in[i][0] for i, o2 in self.paths if o2 == o) for o in range(len(self.irreps_out))]
        offset = 0
        for i, o in self.paths:
            m_in, m_out = self.irreps_in[i][0], self.irreps_out[o][0]
            w = weight[offset:offset + m_in * m_out].reshape(m_in, m_out)
            offset += m_in * m_out
            y = jnp.einsum("...ui,uw->...wi", blocks[i], w) / math.sqrt(fan_in[o])
            out[o] = y if out[o] is None else out[o] + y
        return _join(self.irreps_out, out, x.shape[:-1], x.dtype)


@dataclasses.dataclass(frozen=True)
class TensorProduct:
    """e3nn ``o3.TensorProduct`` with ``component`` irrep and ``element`` path normalisation, for
    the connection modes MACE uses: ``"uvu"`` (one weight per channel of input 1; MACE's
    convolution, weights per edge) and ``"uvw"`` (all channels mixed; MACE's element-dependent
    self-connection).

    instructions: ``(i_in1, i_in2, i_out, mode)``. Weights ``[..., numel]``, one block per
    instruction in order (``uvu``: ``[mul1, mul2]``; ``uvw``: ``[mul1, mul2, mul_out]``).
    """

    irreps_in1: tuple
    irreps_in2: tuple
    irreps_out: tuple
    instructions: tuple

    @classmethod
    def fully_connected(cls, irreps_in1, irreps_in2, irreps_out):
        """Every path ``irreps_in1 x irreps_in2 -> irreps_out`` allowed by the selection rules, mode ``uvw``."""
        ins = tuple((i1, i2, o, "uvw") for i1, (_, l1, p1) in enumerate(irreps_in1)
                    for i2, (_, l2, p2) in enumerate(irreps_in2) for o, (_, lo, po) in enumerate(irreps_out)
                    if abs(l1 - l2) <= lo <= l1 + l2 and p1 * p2 == po)
        return cls(irreps_in1, irreps_in2, irreps_out, ins)

    def _shape(self, ins):
        i1, i2, o, mode = ins
        m1, m2, mo = self.irreps_in1[i1][0], self.irreps_in2[i2][0], self.irreps_out[o][0]
        return (m1, m2) if mode == "uvu" else (m1, m2, mo)

    def _elements(self, ins):
        i1, i2, _, mode = ins
        return self.irreps_in2[i2][0] if mode == "uvu" else self.irreps_in1[i1][0] * self.irreps_in2[i2][0]

    @property
    def numel(self) -> int:
        """The number of weights of every instruction together."""
        return sum(math.prod(self._shape(ins)) for ins in self.instructions)

    def __call__(self, weight, x1, x2):
        b1, b2 = split(self.irreps_in1, x1), split(self.irreps_in2, x2)
        batch = jnp.broadcast_shapes(x1.shape[:-1], x2.shape[:-1])
        out = [None] * len(self.irreps_out)
        offset = 0
        for ins in self.instructions:
            i1, i2, o, mode = ins
            l1, l2, lo = self.irreps_in1[i1][1], self.irreps_in2[i2][1], self.irreps_out[o][1]
            shape = self._shape(ins)
            size = math.prod(shape)
            w = weight[..., offset:offset + size].reshape(weight.shape[:-1] + shape)
            offset += size
            fan_in = sum(self._elements(other) for other in self.instructions if other[2] == o)
            alpha = math.sqrt((2 * lo + 1) / fan_in)
            if mode == "uvu" and shape[1] == 1:
                y = _uvu_single(ir.wigner_3j(l1, l2, lo), alpha * w[..., 0], b1[i1], b2[i2][..., 0, :])
            else:
                c = jnp.asarray(ir.wigner_3j(l1, l2, lo), x1.dtype)
                spec = "...uv,ijk,...ui,...vj->...uk" if mode == "uvu" else "...uvw,ijk,...ui,...vj->...wk"
                y = alpha * jnp.einsum(spec, w, c, b1[i1], b2[i2])
            out[o] = y if out[o] is None else out[o] + y
        return _join(self.irreps_out, out, batch, x1.dtype)


def _uvu_single(c, w, x1, x2):
    """``y[..., u, k] = w[..., u] Σ_ij C[i, j, k] x1[..., u, i] x2[..., j]`` (second input of
    multiplicity one, MACE's convolution with the edge harmonics), written out over the
    non-zero coupling coefficients: per edge a few fused multiply-adds instead of batched
    matrix products of a handful of rows, which XLA runs slowly (3x in the backward pass)."""
    wx = w[..., :, None] * x1  # [..., u, i]
    cols = []
    for k in range(c.shape[2]):
        acc = None
        for i in range(c.shape[0]):
            nonzero = [j for j in range(c.shape[1]) if c[i, j, k] != 0]
            if not nonzero:
                continue
            g = sum(float(c[i, j, k]) * x2[..., j] for j in nonzero)
            term = wx[..., i] * g[..., None]
            acc = term if acc is None else acc + term
        cols.append(acc if acc is not None else jnp.zeros(wx.shape[:-1], x1.dtype))
    return jnp.stack(cols, axis=-1)


def uvu_messages(conv, weight, source, sh):
    """The convolution's tensor product ``conv`` (``uvu`` paths, second input of multiplicity
    one) on a block of ``b`` edges.

    Each path is ``y[e, u, k] = α w[e, u] Σ_i x[e, u, i] G[e, i, k]`` with the harmonics folded
    into the coupling, ``G[e, i, k] = Σ_j C[i, j, k] Y[e, j]``, written as a broadcast product
    summed over ``i``: its gradient is the same form, with no slices of the inputs (whose
    gradients are padded copies, one per path, that XLA's CPU fusions sum element by element).

    Args:
      conv: the :class:`TensorProduct` (its irreps and instructions; every one ``uvu``).
      weight: ``[b, numel]`` per-edge weights, one block of ``mul`` per instruction, in order.
      source: the senders' features, one ``[b, mul, 2l+1]`` array per entry of ``irreps_in1``.
      sh: ``[b, (lmax+1)²]`` the edges' harmonics (``irreps_in2``).

    Returns:
      ``[b, dim(irreps_out)]``.
    """
    harmonics = split(conv.irreps_in2, sh)
    out = [None] * len(conv.irreps_out)
    offset = 0
    for i1, i2, o, _ in conv.instructions:
        mul, l1, _ = conv.irreps_in1[i1]
        l2, lo = conv.irreps_in2[i2][1], conv.irreps_out[o][1]
        fan_in = sum(conv.irreps_in2[j2][0] for _, j2, o2, _ in conv.instructions if o2 == o)
        alpha = math.sqrt((2 * lo + 1) / fan_in)
        w = weight[:, offset:offset + mul] * alpha
        offset += mul
        c = jnp.asarray(ir.wigner_3j(l1, l2, lo), sh.dtype)
        g = jnp.einsum("ijk,bj->bik", c, harmonics[i2][:, 0, :])  # [b, 2l1+1, 2lo+1]
        y = jnp.sum(source[i1][:, :, :, None] * g[:, None, :, :], axis=2)  # [b, mul, 2lo+1]
        out[o] = (w[:, :, None] * y).reshape(y.shape[0], -1)
    return jnp.concatenate(out, axis=-1)


def conv_tp_irreps(irreps1, irreps2, target):
    """MACE's convolution: the ``uvu`` paths of ``irreps1 x irreps2`` that land on an irrep of
    ``target``, their outputs sorted. Returns ``(irreps_mid, instructions)``."""
    wanted = {(l, p) for _, l, p in target}
    mids, ins = [], []
    for i, (mul, l1, p1) in enumerate(irreps1):
        for j, (_, l2, p2) in enumerate(irreps2):
            for lo in range(abs(l1 - l2), l1 + l2 + 1):
                if (lo, p1 * p2) in wanted:
                    ins.append((i, j, len(mids), "uvu"))
                    mids.append((mul, lo, p1 * p2))
    mids, perm = ir.sort(tuple(mids))
    ins = sorted(((i, j, perm[k], mode) for i, j, k, mode in ins), key=lambda t: t[2])
    return mids, tuple(ins)


def normalized_silu_constant(fn=None) -> float:
    """1 / sqrt(E[f(z)^2]) for z ~ N(0, 1), by Gauss–Hermite quadrature (e3nn normalises
    activations to unit second moment; a model read from PyTorch keeps the constant it was
    trained with instead).

    Args:
      fn: the activation f (numpy-compatible); None for silu.

    Returns:
      the constant.
    """
    z, w = np.polynomial.hermite_e.hermegauss(200)
    f = z / (1 + np.exp(-z)) if fn is None else np.asarray(fn(z))
    return float(1 / np.sqrt(np.sum(w * f**2) / np.sqrt(2 * np.pi)))


def radial_mlp(weights, x, act_constant):
    """e3nn ``FullyConnectedNet`` without biases: ``x @ W / sqrt(fan_in)``, normalised silu
    between layers, none after the last.

    Args:
      weights: ``[h_in, h_out]`` per layer.
      x: ``[..., h_in]`` inputs of the first layer.
      act_constant: the factor normalising silu (e3nn's second moment of the activation).
    """
    for k, w in enumerate(weights):
        x = x @ (w / math.sqrt(w.shape[0]))
        if k < len(weights) - 1:
            x = jax.nn.silu(x) * act_constant
    return x


def monomials(n_ell: int, nu: int) -> list:
    """The degree-``nu`` monomials of ``n_ell`` variables as sorted index tuples, in colex order
    (by last index, then the prefix in colex order): the monomials ending in index ``L`` are
    the first ``C(L + nu - 1, nu - 1)`` monomials of degree ``nu - 1`` times ``x_L``, so each
    degree is the previous one's leading rows times one variable."""
    if nu == 0:
        return [()]
    prev = monomials(n_ell, nu - 1)
    return [t + (last,) for last in range(n_ell) for t in prev[:math.comb(last + nu - 1, nu - 1)]]


def symmetrize_basis(u: np.ndarray, l_out: int) -> np.ndarray:
    """``U_ν [(2l+1,)] + [n_ell]*ν + [k]`` -> ``S_ν [2l+1, n_monomials, k]``: the coefficient of
    each monomial ``x_i1 ⋯ x_iν`` (:func:`monomials` order), i.e. the sum of U over the
    orderings of its indices, so that ``Σ_{i..} U[m, i.., k] x_i1 ⋯ x_iν = Σ_t S[m, t, k] x^t``.

    Args:
      u: the basis ``U_ν`` (its leading ``2l+1`` axis absent for ``l_out = 0``).
      l_out: the output degree l.
    """
    import itertools

    u = np.asarray(u, np.float64)
    if l_out == 0:
        u = u[None]
    nu = u.ndim - 2
    tuples = monomials(u.shape[1], nu)
    out = np.zeros((u.shape[0], len(tuples), u.shape[-1]))
    for t, idx in enumerate(tuples):
        for perm in set(itertools.permutations(idx)):
            out[:, t, :] += u[(slice(None),) + perm]
    return out


@functools.lru_cache(maxsize=None)
def _extension_table(n_ell: int, nu: int) -> np.ndarray:
    """``[n_monomials(ν-1), n_ell]``: the row of monomial ``t' · x_l`` among the degree-ν
    monomials when ``t'`` has no index above ``l`` (so the product is listed once), else one
    past the last row (a zero coefficient)."""
    rows = {t: k for k, t in enumerate(monomials(n_ell, nu))}
    none = len(rows)
    return np.asarray([[rows[t + (l,)] if not t or t[-1] <= l else none for l in range(n_ell)]
                       for t in monomials(n_ell, nu - 1)], np.int32)


def symmetric_contraction(bases, weights, x, species, n_species):
    """MACE's symmetric contraction to one output irrep: ``Σ_ν Σ_k W_ν[species, k, c] ·
    U_ν[m, i_1..i_ν, k] x[c, i_1] ⋯ x[c, i_ν]`` for ν = 1..correlation.

    Evaluated on the distinct monomials of x, by their last index: with the node-independent
    coefficients ``C_ν[c, t, e, m] = Σ_k S_ν[m, t, k] W_ν[e, k, c]`` of every element, the
    polynomial is ``Σ_l x_l · Σ_ν (monomials of degree ν-1) @ C_ν[…·x_l]`` — one dense matmul
    per channel of the monomials up to degree ν_max - 1 (153 for 16 components and ν = 3)
    instead of a product with the dense ``U`` (~10⁷ flops per node).

    Args:
      bases: ``S_ν [2l+1, n_monomials, k]`` for ν = 1..ν_max (:func:`symmetrize_basis`).
      weights: ``W_ν`` for ν = ν_max..1, ``[n_elements, k, channels]``.
      x: ``[n, channels, n_ell]``.
      species: ``[n]`` row of each node.
      n_species: the number of elements (rows of each ``W_ν``).

    Returns:
      ``[n, channels * (2l+1)]``, channel-major.
    """
    n, c, n_ell = x.shape
    xt = jnp.swapaxes(x, 0, 1)  # [c, n, n_ell]: channels lead, as the matmuls batch over them
    lower, current, blocks = [], jnp.ones((c, n, 1), x.dtype), []
    for nu, (s, w) in enumerate(zip(bases, reversed(weights)), start=1):
        if nu > 1:
            # Degree ν-1 from ν-2: the monomials ending in index L are the first C(L + ν - 2, ν - 2)
            # of degree ν-2 times x_L (colex order, see monomials()).
            d = nu - 1
            prev = np.concatenate([np.arange(math.comb(l + d - 1, d - 1)) for l in range(n_ell)])
            last = np.concatenate([np.full(math.comb(l + d - 1, d - 1), l) for l in range(n_ell)])
            current = current[..., prev] * xt[..., last]
        lower.append(current)  # [c, n, n_monomials(ν-1)]
        m_dim, e_dim = s.shape[0], w.shape[0]
        coef = jnp.einsum("mtk,ekc->ctem", s, w).reshape(c, s.shape[1], e_dim * m_dim)
        coef = jnp.concatenate([coef, jnp.zeros((c, 1, e_dim * m_dim), x.dtype)], axis=1)
        blocks.append(coef[:, _extension_table(n_ell, nu)])  # [c, n_monomials(ν-1), n_ell, e·m]
    r = jnp.einsum("cnt,ctle->cnle", jnp.concatenate(lower, axis=-1), jnp.concatenate(blocks, axis=1))
    per_element = jnp.einsum("cnl,cnle->cne", xt, r).reshape(c, n, e_dim, m_dim)
    onehot = jax.nn.one_hot(species, n_species, dtype=x.dtype)
    out = jnp.einsum("cnem,ne->ncm", per_element, onehot)
    return out.reshape(n, -1)


def symmetric_basis(coupling, l_out: int, p_out: int, nu: int) -> np.ndarray:
    """A basis ``U_ν`` of the symmetric, equivariant maps ``x^{⊗ν} -> (l_out, p_out)`` for a
    newly built model: ``[(2l+1,)] + [n_ell]*ν + [n_params]`` (the leading axis dropped for
    l = 0), from e3nn-jax's reduced symmetric tensor products. Any basis spans the same
    functions; a model read from mace-torch uses the one it was trained with.

    Args:
      coupling: the irreps ``(mul, l, p)`` of the node features contracted (one component each).
      l_out, p_out: the output irrep.
      nu: the correlation order ν.
    """
    import e3nn_jax as e3nn

    irreps = e3nn.Irreps([(1, (l, p)) for _, l, p in coupling])
    target = e3nn.Irrep(l_out, p_out)
    with jax.ensure_compile_time_eval():
        basis = e3nn.reduced_symmetric_tensor_product_basis(irreps, nu, keep_ir=[target])
    arr = np.asarray(basis.array, np.float64)  # [n_ell]*ν + [n_params * (2l+1)]
    d = 2 * l_out + 1
    arr = arr.reshape(arr.shape[:-1] + (-1, d))  # mul_ir: [..., n_params, 2l+1]
    arr = np.moveaxis(arr, -1, 0)  # [2l+1, n_ell.., n_params]
    return arr[0] if l_out == 0 else arr
