"""One FFI call of a jaxdd kernel: the kernel's declaration, dtype checks, result types,
manual mesh axes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import match_varying, varying_axes
from ._library import declare, ensure_registered

__all__ = ["KERNEL_DTYPES", "Target", "target", "float_suffix", "check_array"]

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


@dataclasses.dataclass(frozen=True)
class Target:
    """A kernel's FFI handlers, ``jaxdd_{kernel}_f32`` and ``_f64`` (see :func:`target`)."""

    kernel: str

    def __call__(self, suffix: str, results: Sequence[tuple[tuple[int, ...], object]], *args, **attrs):
        """``jaxdd_{kernel}_{suffix}`` on ``args``; results given as (shape, dtype) pairs, ``attrs``
        the handler's static attributes (numpy scalars or bools).

        Inside ``shard_map`` (with ``check_vma=True``) an FFI call needs all operands varying
        over the same mesh axes, and result types that say so: operands are made varying over
        the union of their axes, and each result type is derived from an operand's type
        (``jax.typeof``), which carries those axes. Without that the backward pass of a
        ``custom_vjp`` around the call fails ("manual axis types do not match").
        """
        ensure_registered((self.kernel,))
        args = match_varying(tuple(jnp.asarray(a) for a in args))
        if varying_axes(args[0]):
            ref = jax.typeof(args[0])
            types = [ref.update(shape=tuple(shape), dtype=np.dtype(dtype)) for shape, dtype in results]
        else:
            types = [jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for shape, dtype in results]
        return jax.ffi.ffi_call(f"jaxdd_{self.kernel}_{suffix}", types, vmap_method="sequential")(*args, **attrs)


def target(kernel: str) -> Target:
    """Declare the FFI handlers a kernel module calls and return them as a callable :class:`Target`.

    kernel: the handlers' stem: csrc/<name>/<name>_cpu.cc (and _cuda.cu) export
    ``jaxdd_{kernel}_f32`` and ``jaxdd_{kernel}_f64``, which the first call registers with XLA.
    """
    return Target(declare(kernel))
