"""Custom kernels as XLA FFI calls, wrapped as named, differentiable ops.

A kernel is one module here, ``jaxdd/ffi/<name>.py``, and one folder of C++/CUDA sources,
``csrc/<name>/`` (``<name>_cpu.cc``, ``<name>_cuda.cu``), compiled by ``pip install`` into
a library that is loaded on first use (:mod:`jaxdd.ffi._library`). The module declares the
FFI handlers it calls, which its first call registers with XLA, and the named op it
provides (:func:`jaxdd.ops.register_op`), with a ``custom_vjp``, so the dispatch
recognises it by name and applies the :class:`~jaxdd.spec.OpAdapter` a spec declares for
it; each has a jnp reference of the same signature.

- :func:`lennard_jones` (``"jaxdd_ffi::lj_pair"``): fused LJ energies, forces, virial.
- :func:`attention_message` (``"jaxdd_ffi::attention_message"``): a graph transformer's
  attention-weighted neighbour aggregation, with its VJP kernel.
- :func:`jaxdd.ffi.neighbors.cell_list`: each rank's open-boundary neighbour search.

Without the compiled library, importing this module works; the kernels raise
:class:`KernelLibraryError` saying how to build it. See docs/kernels.md.
"""

from ._library import KernelLibraryError, available, cuda_available, cuda_library_path, library_path
from .attention import ATTENTION_OP, attention_message, attention_message_reference
from .lj import LJ_OP, lennard_jones, lennard_jones_reference

__all__ = [
    "KernelLibraryError",
    "available",
    "cuda_available",
    "library_path",
    "cuda_library_path",
    "lennard_jones",
    "lennard_jones_reference",
    "LJ_OP",
    "attention_message",
    "attention_message_reference",
    "ATTENTION_OP",
]
