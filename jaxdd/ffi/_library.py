"""Finding, loading and registering the compiled kernel libraries.

The CPU library is ``jaxdd/ffi/_kernels<EXT_SUFFIX>``, built by ``pip install`` from every
kernel's csrc/<name>/<name>_cpu.cc (setup.py); a CUDA build, when there is one, is
``jaxdd/ffi/_kernels_cuda.so``, from the csrc/<name>/<name>_cuda.cu files. There is no list
of kernels here: each kernel module declares the handlers it calls (:func:`declare`, through
``_call.target``) when it is imported. Nothing is loaded when jaxdd is imported: the first
call of a kernel loads the library (ctypes) and registers that kernel's handlers with XLA
(``jax.ffi.register_ffi_target``), so a missing library fails that call with a
:class:`KernelLibraryError` that says how to build it, and nothing else.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import os
import threading
from collections.abc import Iterable
from pathlib import Path

import jax

__all__ = ["KernelLibraryError", "DTYPES", "declare", "declared", "library_path", "cuda_library_path", "available",
           "cuda_available", "ensure_registered"]

# Handler symbols are f"jaxdd_{kernel}_{f32|f64}"; the XLA target names are the same. Both
# libraries export every declared kernel's (csrc/<name>/<name>_cpu.cc and _cuda.cu).
DTYPES = ("f32", "f64")

_HERE = Path(__file__).resolve().parent
_BUILD_HINT = (
    "build it by reinstalling jaxdd from its source folder: `pip install -e .` (or `./dev test`, which "
    "installs), with a C++17 compiler (g++ or clang++) on PATH; `python setup.py build_ext --inplace` "
    "rebuilds just the kernels. The pure-jnp paths (e.g. jaxdd.models.lj.LennardJones, "
    "GraphTransformer(backend='jnp')) work without it"
)
_lock = threading.Lock()
# Kernels declared by the kernel modules imported so far, in declaration order (a dict as an
# ordered set), and per platform ("cpu", "CUDA") those whose handlers XLA has.
_declared: dict[str, None] = {}
_registered: dict[str, set[str]] = {}


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


def declare(kernel: str) -> str:
    """Declare a kernel: its handlers ``jaxdd_{kernel}_f32`` and ``_f64`` are exported by the CPU
    library (and the CUDA one, when built), and :func:`ensure_registered` registers them.

    Called by each kernel module, when imported, for the kernels it calls. Returns ``kernel``.
    """
    if not (isinstance(kernel, str) and kernel.isidentifier()):
        raise ValueError(f"a kernel name is an identifier (its handlers are jaxdd_<kernel>_f32/_f64), got {kernel!r}")
    with _lock:
        _declared.setdefault(kernel, None)
    return kernel


def declared() -> tuple[str, ...]:
    """Names of the kernels declared so far (by the kernel modules imported), in declaration order."""
    return tuple(_declared)


def _register(path: Path, platform: str, kernels: Iterable[str]) -> None:
    done = _registered.setdefault(platform, set())
    pending = [k for k in kernels if k not in done]
    if not pending:
        return
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelLibraryError(f"jaxdd's kernel library {path} could not be loaded ({exc}); {_BUILD_HINT}") from exc
    for kernel in pending:
        symbols = [f"jaxdd_{kernel}_{dtype}" for dtype in DTYPES]
        missing = [symbol for symbol in symbols if not hasattr(lib, symbol)]
        if missing:
            raise KernelLibraryError(
                f"jaxdd's kernel library {path} has no handler {missing[0]} (built from older sources?); "
                f"{_BUILD_HINT}")
        for symbol in symbols:
            jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(lib, symbol)), platform=platform)
        done.add(kernel)


def ensure_registered(kernels: Iterable[str] | None = None) -> None:
    """Load the kernel libraries and register the handlers of ``kernels`` with XLA, once per process.

    kernels: declared kernel names (default: every kernel declared so far).

    Raises :class:`KernelLibraryError` when the CPU library was not built or lacks a handler.
    The CUDA library is registered too when it exists and JAX has CUDA devices.
    """
    kernels = tuple(_declared if kernels is None else kernels)
    unknown = [k for k in kernels if k not in _declared]
    if unknown:
        raise ValueError(f"kernel {unknown[0]!r} was not declared (a kernel module declares the kernels it "
                         "calls when it is imported)")
    cpu = _registered.get("cpu")
    if cpu is not None and all(k in cpu for k in kernels):
        return
    with _lock:
        path = library_path()
        if path is None:
            raise KernelLibraryError(f"jaxdd's compiled kernels (jaxdd/ffi/_kernels*.so) are not built; {_BUILD_HINT}")
        _register(path, "cpu", kernels)
        cuda = cuda_library_path()
        if cuda is not None and _has_cuda_backend():
            _register(cuda, "CUDA", kernels)
