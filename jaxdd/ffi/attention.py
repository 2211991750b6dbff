"""Kernel 2: the fused message kernel of a small graph transformer, and its VJP kernel.

Attention-weighted aggregation of neighbour values onto receivers, with a softmax
"sink" of weight 1 (so an atom without neighbours gets a zero message and the result
stays smooth as edges enter and leave the cutoff through their weights):

    u_e = w_e exp(q[r] · k[s] / sqrt(F)),   z[r] = 1 + Σ_e u_e,   m[r] = Σ_e u_e v[s] / z[r]

The named op ``"jaxdd_ffi::attention_message"`` is a ``custom_vjp`` whose backward is
the second compiled kernel. Under decomposition only owned atoms receive edges, so ghost
rows of ``m`` come out zero: a spec declares the op's output ``ScatterOutputs()``, which
sends ghost partials home and refreshes the ghost rows for the next layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import register_op
from . import _call

__all__ = ["attention_message", "attention_message_reference", "ATTENTION_OP"]

_NAME = "attention_message"
# The handlers of csrc/attention/attention_cpu.cc and attention_cuda.cu.
_FORWARD = _call.target("attention_forward")
_BACKWARD = _call.target("attention_backward")


def _reference(q, k, v, w, senders, receivers):
    n, nf = q.shape
    valid = (senders >= 0) & (senders < n) & (receivers >= 0) & (receivers < n)
    qr = q.at[receivers].get(mode="fill", fill_value=0)
    ks = k.at[senders].get(mode="fill", fill_value=0)
    vs = v.at[senders].get(mode="fill", fill_value=0)
    u = jnp.where(valid, w * jnp.exp(jnp.sum(qr * ks, axis=-1) / np.sqrt(nf)), 0.0)
    z = 1.0 + jax.ops.segment_sum(u, receivers, n)
    return jax.ops.segment_sum(u[:, None] * vs, receivers, n) / z[:, None]


def _forward(q, k, v, w, senders, receivers):
    suffix = _call.float_suffix(_NAME, "q", q)
    m, z = _FORWARD(suffix, [(q.shape, q.dtype), (q.shape[:1], q.dtype)], q, k, v, w, senders, receivers)
    return m, (q, k, v, w, senders, receivers, m, z)


def _kernel(q, k, v, w, senders, receivers):
    return _forward(q, k, v, w, senders, receivers)[0]


def _backward(residuals, ct):
    q, k, v, w, senders, receivers, m, z = residuals
    if ct is None:
        return (None,) * 6
    suffix = _call.float_suffix(_NAME, "q", q)
    gq, gk, gv, gw = _BACKWARD(suffix, [(q.shape, q.dtype)] * 3 + [(w.shape, w.dtype)], q, k, v, w, senders,
                               receivers, m, z, ct)
    return gq, gk, gv, gw, None, None


ATTENTION_OP = register_op("jaxdd_ffi::attention_message", _kernel, fwd=_forward, bwd=_backward)


def _prepare(q, k, v, w, senders, receivers):
    """Checked arguments (a clear ValueError for any wrong dtype or shape)."""
    q = jnp.asarray(q)
    _call.float_suffix(_NAME, "q", q)
    if q.ndim != 2:
        raise ValueError(f"{_NAME}: q must have shape [n, F], got {list(q.shape)}")
    n, nf = q.shape
    k, v, w = jnp.asarray(k), jnp.asarray(v), jnp.asarray(w)
    _call.check_array(_NAME, "k", k, (n, nf), q.dtype)
    _call.check_array(_NAME, "v", v, (n, nf), q.dtype)
    _call.check_array(_NAME, "w", w, (None,), q.dtype)
    senders, receivers = jnp.asarray(senders), jnp.asarray(receivers)
    _call.check_array(_NAME, "senders", senders, w.shape, np.int32)
    _call.check_array(_NAME, "receivers", receivers, w.shape, np.int32)
    return q, k, v, w, senders, receivers


def attention_message(q, k, v, w, senders, receivers):
    """Attention-weighted messages onto receivers (the compiled kernel).

    Differentiable (reverse mode) in q, k, v and w.

    Args:
      q, k, v: [n, F] queries, keys, values (float32 or float64).
      w: [E] edge weights >= 0 (0 on padding edges), q's dtype.
      senders, receivers: [E] int32 (an index outside [0, n) skips the edge).

    Returns:
      m: [n, F] messages (formula in the module docstring).
    """
    return ATTENTION_OP(*_prepare(q, k, v, w, senders, receivers))


def attention_message_reference(q, k, v, w, senders, receivers):
    """What :func:`attention_message` computes, in jnp.

    Args:
      q, k, v, w, senders, receivers: as in :func:`attention_message`.

    Returns:
      m: [n, F] messages.
    """
    return _reference(*_prepare(q, k, v, w, senders, receivers))
