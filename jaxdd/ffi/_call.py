"""One FFI call of a jaxdd kernel: dtype checks, result types, manual mesh axes."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import match_varying, varying_axes
from ._library import ensure_registered

__all__ = ["KERNEL_DTYPES", "float_suffix", "call", "check_array"]

KERNEL_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def float_suffix(kernel: str, name: str, x) -> str:
    """The handler suffix for ``x``'s dtype; a ValueError naming ``name`` for any other dtype."""
    dtype = np.dtype(x.dtype)
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"{kernel}: {name} must be float32 or float64, got {dtype}; cast it with .astype(...)")
    return KERNEL_DTYPES[dtype]


def check_array(kernel: str, name: str, x, shape: Sequence[int | None], dtype) -> None:
    """A ValueError naming ``name`` unless ``x`` has ``dtype`` and ``shape`` (None: any size)."""
    if np.dtype(x.dtype) != np.dtype(dtype):
        raise ValueError(f"{kernel}: {name} must be {np.dtype(dtype)}, got {np.dtype(x.dtype)}; "
                         f"pass {name}.astype({np.dtype(dtype).name})")
    want = "[" + ", ".join("?" if s is None else str(s) for s in shape) + "]"
    if len(x.shape) != len(shape) or any(s is not None and s != t for s, t in zip(shape, x.shape)):
        raise ValueError(f"{kernel}: {name} must have shape {want}, got {list(x.shape)}")


def call(kernel: str, suffix: str, results: Sequence[tuple[tuple[int, ...], object]], *args, **attrs):
    """``jaxdd_{kernel}_{suffix}`` on ``args``; results given as (shape, dtype) pairs, ``attrs``
    the handler's static attributes (numpy scalars or bools).

    Inside ``shard_map`` (with ``check_vma=True``) an FFI call needs all operands varying
    over the same mesh axes, and result types that say so: operands are made varying over
    the union of their axes, and each result type is derived from an operand's type
    (``jax.typeof``), which carries those axes. Without that the backward pass of a
    ``custom_vjp`` around the call fails ("manual axis types do not match").
    """
    ensure_registered()
    args = match_varying(tuple(jnp.asarray(a) for a in args))
    if varying_axes(args[0]):
        ref = jax.typeof(args[0])
        types = [ref.update(shape=tuple(shape), dtype=np.dtype(dtype)) for shape, dtype in results]
    else:
        types = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for shape, dtype in results]
    return jax.ffi.ffi_call(f"jaxdd_{kernel}_{suffix}", types, vmap_method="sequential")(*args, **attrs)
