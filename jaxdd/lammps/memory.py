"""The process's allocator told to keep the memory it frees, so each force call reuses it.

On a CPU, XLA allocates a program's temporaries afresh at every call. glibc hands large
blocks out by ``mmap`` and gives them back when freed, so the next call takes fresh pages
from the kernel, zeroed one page fault at a time: for the 32,000-atom LJ melt about 120 MB
per call, and a one-step call of the LJ model took 170 ms instead of 63 (``DomainParallel``
keeps its temporaries inside one many-step device loop and never meets this; the bridge
makes one device call per LAMMPS step). :func:`reuse_freed_memory` sets glibc's ``mallopt``
so that freed blocks stay in the heap: one arena, no ``mmap`` for large blocks, no trimming.
Memory the process once used is then kept until it exits. Call it before JAX starts its
threads (``python -m jaxdd.lammps`` does, first thing); elsewhere than glibc it does nothing
and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["reuse_freed_memory"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -2, -4, -8


def reuse_freed_memory() -> bool:
    """Keep freed heap memory for reuse (glibc ``mallopt``); True when glibc took the settings.

    Returns:
      False where the C library is not glibc (nothing is changed there).
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))
    return all(mallopt(param, value) == 1 for param, value in settings)
