"""Build of jaxdd's compiled kernels; everything else about the package is in pyproject.toml.

The CPU kernels (csrc/cpu_kernels.cc, XLA FFI handlers) are built as a setuptools
extension module ``jaxdd.ffi._kernels``: setuptools then compiles them on every
``pip install`` (editable installs included, where the library lands beside
jaxdd/ffi/__init__.py) and puts them in the wheel, with nothing to install by hand but
a C++17 compiler. jaxdd loads the library with ctypes (jaxdd/ffi/_library.py); the
module stub in it only makes it a valid extension.

Why setuptools rather than scikit-build-core + CMake: the package layout maps models/
and specs/ into jaxdd (see pyproject.toml) and relies on setuptools' editable-install
finder for that; one compiled file does not justify a second build system. Why the
XLA FFI headers are vendored (csrc/third_party/xla) rather than read from
``jax.ffi.include_dir()``: an isolated build environment has no jax, and installing
jaxlib into it just for three headers would make every build slow and need the
network; see csrc/third_party/xla/README.md.

CUDA: when nvcc is on PATH and either JAXDD_CUDA=1 or a jax CUDA plugin is importable
in the build environment, csrc/cuda_kernels.cu is compiled into
jaxdd/ffi/_kernels_cuda.so as well (JAXDD_CUDA=0 never builds it). An automatic CUDA
build that fails only warns: the CPU kernels and the pure-jnp paths do not need it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
# Another copy of the headers (a folder holding xla/ffi/api/ffi.h), e.g. jax.ffi.include_dir().
FFI_INCLUDE = os.environ.get("JAXDD_FFI_INCLUDE") or f"{CSRC}/third_party"


def _want_cuda() -> str | None:
    """nvcc's path when a CUDA build is wanted, else None."""
    mode = os.environ.get("JAXDD_CUDA", "auto").strip().lower()
    if mode in ("0", "no", "off", "false"):
        return None
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if os.environ.get("CUDA_HOME") else None)
    if nvcc is None or not os.path.exists(nvcc):
        if mode in ("1", "yes", "on", "true"):
            raise RuntimeError("JAXDD_CUDA=1 but nvcc was not found on PATH or under $CUDA_HOME/bin")
        return None
    if mode in ("1", "yes", "on", "true"):
        return nvcc
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    for name in plugins:
        try:
            if importlib.util.find_spec(name) is not None:
                return nvcc
        except (ImportError, ValueError):
            continue
    return None


class BuildKernels(build_ext):
    """build_ext, plus the optional CUDA library next to the CPU one."""

    def run(self):
        super().run()
        nvcc = _want_cuda()
        if nvcc is None:
            return
        cpu_lib = Path(self.get_ext_fullpath("jaxdd.ffi._kernels"))
        out = cpu_lib.parent / "_kernels_cuda.so"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [nvcc, "-std=c++17", "-O3", "-shared", "-Xcompiler", "-fPIC", "-I", CSRC, "-isystem", FFI_INCLUDE,
               f"{CSRC}/cuda_kernels.cu", "-o", str(out)]
        print("jaxdd: building the CUDA kernels:", " ".join(cmd))
        try:
            subprocess.run(cmd, check=True, cwd=ROOT)
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.environ.get("JAXDD_CUDA", "auto").strip().lower() in ("1", "yes", "on", "true"):
                raise
            print(f"jaxdd: warning: CUDA kernels not built ({exc}); the CPU kernels are", file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "jaxdd.ffi._kernels",
            sources=[f"{CSRC}/cpu_kernels.cc", f"{CSRC}/cpu_neighbors.cc"],
            depends=[f"{CSRC}/kernels_math.h", f"{CSRC}/parallel.h"],
            include_dirs=[CSRC],
            # -isystem: the vendored headers are not ours to warn about.
            extra_compile_args=["-std=c++17", "-O3", "-isystem", FFI_INCLUDE],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
