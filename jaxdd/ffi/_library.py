"""Finding, loading and registering the compiled kernel library.

The CPU library is ``jaxdd/ffi/_kernels<EXT_SUFFIX>``, built by ``pip install`` from
csrc/cpu_kernels.cc (setup.py); a CUDA build, when there is one, is
``jaxdd/ffi/_kernels_cuda.so``. Nothing is loaded when jaxdd is imported: the first
kernel call loads the library (ctypes) and registers its handlers with XLA
(``jax.ffi.register_ffi_target``), so a missing library fails that call with a
:class:`KernelLibraryError` that says how to build it, and nothing else.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from pathlib import Path

import jax

__all__ = ["KernelLibraryError", "KERNELS", "library_path", "cuda_library_path", "available", "cuda_available",
           "ensure_registered"]

# Handler symbols are f"jaxdd_{kernel}_{f32|f64}"; the XLA target names are the same. Both
# libraries have every one (csrc/cpu_*.cc and csrc/cuda_*.cu).
KERNELS = ("lj_forward", "lj_backward", "attention_forward", "attention_backward", "cell_list")
DTYPES = ("f32", "f64")

_HERE = Path(__file__).resolve().parent
_BUILD_HINT = (
    "build it by reinstalling jaxdd from its source folder: `pip install -e .` (or `./dev test`, which "
    "installs), with a C++17 compiler (g++ or clang++) on PATH; `python setup.py build_ext --inplace` "
    "rebuilds just the kernels. The pure-jnp paths (e.g. jaxdd.models.lj.LennardJones, "
    "GraphTransformer(backend='jnp')) work without it"
)
_lock = threading.Lock()
_registered: set[str] = set()


class KernelLibraryError(RuntimeError):
    """The compiled kernel library is missing or unusable; the message says how to build it."""


def library_path() -> Path | None:
    """Path of the CPU kernel library, or None when it was not built.

    ``JAXDD_KERNELS_LIBRARY`` names another file (a build elsewhere; an empty value or a
    missing file counts as not built)."""
    override = os.environ.get("JAXDD_KERNELS_LIBRARY")
    if override is not None:
        return Path(override) if override and Path(override).is_file() else None
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = _HERE / f"_kernels{suffix}"
        if candidate.is_file():
            return candidate
    return None


def cuda_library_path() -> Path | None:
    """Path of the CUDA kernel library, or None when it was not built."""
    candidate = _HERE / "_kernels_cuda.so"
    return candidate if candidate.is_file() else None


def available() -> bool:
    """True when the CPU kernels are built (it does not load them)."""
    return library_path() is not None


def cuda_available() -> bool:
    """True when both libraries are built and JAX has CUDA devices to run the CUDA one on."""
    return available() and cuda_library_path() is not None and _has_cuda_backend()


def _has_cuda_backend() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def _register(path: Path, platform: str, kernels=KERNELS) -> None:
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelLibraryError(f"jaxdd's kernel library {path} could not be loaded ({exc}); {_BUILD_HINT}") from exc
    for kernel in kernels:
        for dtype in DTYPES:
            symbol = f"jaxdd_{kernel}_{dtype}"
            try:
                fn = getattr(lib, symbol)
            except AttributeError:
                raise KernelLibraryError(
                    f"jaxdd's kernel library {path} has no handler {symbol} (built from older sources?); "
                    f"{_BUILD_HINT}") from None
            jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(fn), platform=platform)


def ensure_registered() -> None:
    """Load the kernel libraries and register their handlers with XLA, once per process.

    Raises :class:`KernelLibraryError` when the CPU library was not built. The CUDA
    library is registered too when it exists and JAX has CUDA devices.
    """
    if "cpu" in _registered:
        return
    with _lock:
        if "cpu" in _registered:
            return
        path = library_path()
        if path is None:
            raise KernelLibraryError(f"jaxdd's compiled kernels (jaxdd/ffi/_kernels*.so) are not built; {_BUILD_HINT}")
        _register(path, "cpu", KERNELS)
        _registered.add("cpu")
        cuda = cuda_library_path()
        if cuda is not None and _has_cuda_backend():
            _register(cuda, "CUDA")
            _registered.add("cuda")
