"""NVIDIA Warp kernels as jaxdd ops (optional: ``pip install "jaxdd[warp]"``, warp-lang >= 1.16).

Warp compiles Python kernels for the CPU (LLVM) and CUDA, and ``warp.jax_kernel`` calls them
from JAX as XLA FFI calls, with Warp's own adjoint kernels as their derivative. Wrapped by
:func:`warp_op`, such a kernel is a named jaxdd op like the C++ ones: the dispatch
recognises it, a spec can declare an :class:`~jaxdd.spec.OpAdapter` for it, and the JSON
name resolves once the defining module is imported.

:func:`lj_edge_energy` is the worked example (used by
:class:`jaxdd.models.lj_warp.LennardJonesWarp`): Lennard-Jones pair energies per edge from
edge vectors, differentiated by Warp. Scatters and sums stay in jax.numpy around it, so the
dispatch sees them and the model needs no adapter.

Without warp-lang, importing this module works; :func:`available` is False and the ops
raise an error saying how to install it.
"""

import functools

import jax.numpy as jnp
import numpy as np

from ..ops import register_op

__all__ = ["available", "warp_op", "lj_edge_energy", "LJ_EDGE_OP", "WarpUnavailableError", "MIN_VERSION"]

MIN_VERSION = (1, 16)


class WarpUnavailableError(RuntimeError):
    """warp-lang is missing or too old; the message says how to install it."""


@functools.cache
def _warp():
    try:
        import warp
    except ImportError:
        raise WarpUnavailableError('warp-lang is not installed: pip install "jaxdd[warp]" (warp-lang >= 1.16) to '
                                   "use Warp kernels") from None
    version = tuple(int(p) for p in warp.__version__.split(".")[:2])
    if version < MIN_VERSION:
        raise WarpUnavailableError(f"warp-lang {warp.__version__} is too old for JAX interop; "
                                   f"pip install 'warp-lang>={'.'.join(map(str, MIN_VERSION))}'")
    warp.config.quiet = True
    return warp


def available() -> bool:
    """True when a usable warp-lang is installed."""
    try:
        _warp()
    except WarpUnavailableError:
        return False
    return True


def warp_op(name: str, kernels, *, num_outputs: int = 1):
    """Register Warp ``kernels`` as the named op ``name``; returns its handle.

    All arguments of the kernel are arrays, inputs before outputs as Warp's JAX interop
    requires; the kernel launches over the first argument's rows, and its outputs have that
    many rows. Derivatives come from Warp's adjoint kernels.

    Args:
      name: the op's name, ``"namespace::op"``.
      kernels: a Warp kernel, or a mapping numpy dtype → kernel for ops that come in several
        precisions (chosen by the first argument's dtype); a kernel or mapped value may also be a
        function of no arguments that builds the kernel on first use.
      num_outputs: output arrays of the kernel.

    Returns:
      The op's :class:`~jaxdd.ops.OpHandle`: a call returns one array, or a tuple of
      ``num_outputs`` arrays.
    """
    table = kernels if isinstance(kernels, dict) else None

    def call(*args):
        wp = _warp()
        kernel = kernels if table is None else table.get(np.dtype(args[0].dtype))
        if kernel is None:
            raise TypeError(f"{name}: no Warp kernel for {args[0].dtype} (have {sorted(map(str, table))})")
        if callable(kernel) and not hasattr(kernel, "adj"):
            kernel = kernel()  # built on first use, so importing needs no warp
        outs = _jax_kernel(wp, kernel, num_outputs)(*args)
        return outs[0] if num_outputs == 1 else tuple(outs)

    return register_op(name, call)


@functools.cache
def _jax_kernel(wp, kernel, num_outputs):
    return wp.jax_kernel(kernel, num_outputs=num_outputs, enable_backward=True)


# --------------------------------------------------------------------------- Lennard-Jones


@functools.cache
def _lj_kernel(dtype_name: str):
    wp = _warp()
    scalar, vec3 = (wp.float64, wp.vec3d) if dtype_name == "float64" else (wp.float32, wp.vec3f)

    def lj_edge(vec: wp.array(dtype=vec3), mask: wp.array(dtype=scalar), params: wp.array(dtype=scalar),
                energy: wp.array(dtype=scalar)):
        # params: sigma (Å), epsilon (eV), cutoff (Å), energy subtracted per pair (eV)
        e = wp.tid()
        v = vec[e]
        r2 = wp.dot(v, v)
        rc = params[2]
        out = scalar(0.0)
        if mask[e] > scalar(0.0) and r2 < rc * rc:
            s2 = params[0] * params[0] / r2
            s6 = s2 * s2 * s2
            out = scalar(2.0) * params[1] * (s6 * s6 - s6) - scalar(0.5) * params[3]
        energy[e] = out

    lj_edge.__name__ = lj_edge.__qualname__ = f"lj_edge_{dtype_name}"
    return wp.kernel(lj_edge, module="unique")


LJ_EDGE_OP = warp_op("jaxdd_warp::lj_edge",
                     {np.dtype("float64"): lambda: _lj_kernel("float64"),
                      np.dtype("float32"): lambda: _lj_kernel("float32")})


def lj_edge_energy(vectors, mask, sigma, epsilon, cutoff, shift: bool = False):
    """Half the Lennard-Jones energy of each edge (eV): the receiver's share of its pair.

    Summed over a full list's edges by receiver, these are the atomic energies; Warp
    differentiates them.

    Args:
      vectors: [E, 3] Å, receiver → sender (float32 or float64).
      mask: [E] bool, True on real edges.
      sigma: σ (Å), scalar.
      epsilon: ε (eV), scalar.
      cutoff: r_c (Å), scalar.
      shift: subtract V(r_c) per pair.

    Returns:
      [E] eV, vectors' dtype (0 on masked edges and beyond the cutoff).
    """
    dtype = vectors.dtype
    if vectors.ndim != 2 or vectors.shape[1] != 3:
        raise ValueError(f"lj_edge_energy: vectors must be [E, 3], got shape {vectors.shape}")
    if mask.shape != vectors.shape[:1]:
        raise ValueError(f"lj_edge_energy: mask must be [E] = {vectors.shape[:1]}, got shape {mask.shape}")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        raise TypeError(f"lj_edge_energy: vectors must be float32 or float64, got {dtype}")
    sigma, epsilon = jnp.asarray(sigma, dtype), jnp.asarray(epsilon, dtype)
    v_cut = 4.0 * epsilon * ((sigma / cutoff) ** 12 - (sigma / cutoff) ** 6) if shift else jnp.zeros((), dtype)
    params = jnp.stack([sigma, epsilon, jnp.asarray(cutoff, dtype), v_cut]).astype(dtype)
    return LJ_EDGE_OP(vectors, mask.astype(dtype), params)
