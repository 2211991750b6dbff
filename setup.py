"""Build of jaxdd's compiled kernels; everything else about the package is in pyproject.toml.

Each kernel keeps its sources in a folder of its own, csrc/<name>/ (``<name>_cpu.cc``,
and ``<name>_cuda.cu`` when it has a GPU version), beside its Python op module
jaxdd/ffi/<name>.py; headers shared by several kernels sit in csrc/ itself. The sources
are found, not listed: every .cc file under csrc/ (the vendored third_party/ aside) goes
into the CPU library, every .cu file into the CUDA one.

The CPU kernels (XLA FFI handlers) are built as a setuptools extension module
``jaxdd.ffi._kernels``: setuptools then compiles them on every ``pip install`` (editable
installs included, where the library lands beside jaxdd/ffi/__init__.py) and puts them in
the wheel, with nothing to install by hand but a C++17 compiler. jaxdd loads the library
with ctypes (jaxdd/ffi/_library.py); the module stub (csrc/kernels_module.cc) only makes
it a valid extension.

Why setuptools rather than scikit-build-core + CMake: the package layout maps models/
and specs/ into jaxdd (see pyproject.toml) and relies on setuptools' editable-install
finder for that; one compiled library does not justify a second build system. Why the
XLA FFI headers are vendored (csrc/third_party/xla) rather than read from
``jax.ffi.include_dir()``: an isolated build environment has no jax, and installing
jaxlib into it just for three headers would make every build slow and need the
network; see csrc/third_party/xla/README.md.

CUDA: the .cu files under csrc/ are compiled into jaxdd/ffi/_kernels_cuda.so when a CUDA
compiler is found -- nvcc on PATH, under $CUDA_HOME/bin or $CUDA_PATH/bin, or the one
NVIDIA's ``nvidia-cuda-nvcc`` wheel puts at site-packages/nvidia/cu13/bin (``jax[cuda13]``
installs it) -- and a CUDA build is wanted: JAXDD_CUDA=1, or (the default, JAXDD_CUDA=auto)
a jax CUDA plugin is installed or an NVIDIA driver is loaded. JAXDD_CUDA=0 never builds it.
JAXDD_CUDA_ARCH picks the GPU architectures ("90", "80;90"; default: sm_80 and sm_90 code
with compute_90 PTX, which newer GPUs compile when loading). An automatic CUDA build that
fails only warns: the CPU kernels and the pure-jnp paths do not need it.

pip builds in an isolated environment that does not see the packages of the environment
it installs into, so the plugin and the nvcc wheel are looked up by asking that
environment's own interpreter (``sys.executable -I``).
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
VENDORED = "third_party"
# Another copy of the headers (a folder holding xla/ffi/api/ffi.h), e.g. jax.ffi.include_dir().
FFI_INCLUDE = os.environ.get("JAXDD_FFI_INCLUDE") or f"{CSRC}/{VENDORED}"


def kernel_files(suffix: str) -> list[str]:
    """Files under csrc/ ending in ``suffix`` (".cc", ".cu", ".h"), the vendored headers aside.

    Returns: paths relative to the repository root, "/"-separated and sorted, as setuptools
    wants them (the sorted order keeps builds reproducible)."""
    root = ROOT / CSRC
    found = (p for p in root.rglob(f"*{suffix}") if p.is_file() and VENDORED not in p.relative_to(root).parts)
    return sorted(p.relative_to(ROOT).as_posix() for p in found)


CPU_SOURCES = kernel_files(".cc")
CUDA_SOURCES = kernel_files(".cu")
HEADERS = kernel_files(".h")


_TRUE = ("1", "yes", "on", "true")
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
_NVCC_WHEEL = ("nvidia", "cu13", "bin", "nvcc")


def _target_environment() -> dict:
    """site-packages folders of the installing interpreter and whether it has a jax CUDA plugin.

    Run in a fresh interpreter with -I: under pip's build isolation this process's
    sys.path holds only the build environment."""
    probe = (
        "import importlib.util, json, site, sys\n"
        "def has(name):\n"
        "    try:\n"
        "        return importlib.util.find_spec(name) is not None\n"
        "    except (ImportError, ValueError):\n"
        "        return False\n"
        f"print(json.dumps({{'paths': site.getsitepackages() + [site.getusersitepackages()] + sys.path, "
        f"'plugin': any(has(n) for n in {_CUDA_PLUGINS!r})}}))\n"
    )
    try:
        out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True, timeout=60, check=True)
        return __import__("json").loads(out.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return {"paths": [], "plugin": False}


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _find_nvcc(search_paths) -> str | None:
    """nvcc on PATH, under $CUDA_HOME/bin or $CUDA_PATH/bin, or from the nvidia-cuda-nvcc wheel."""
    found = shutil.which("nvcc")
    if found:
        return found
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidate = os.path.join(os.environ[var], "bin", "nvcc")
            if os.access(candidate, os.X_OK):
                return candidate
    for folder in list(sys.path) + list(search_paths):
        candidate = os.path.join(folder or ".", *_NVCC_WHEEL)
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _want_cuda() -> str | None:
    """nvcc's path when a CUDA build is wanted, else None."""
    mode = os.environ.get("JAXDD_CUDA", "auto").strip().lower()
    if mode in ("0", "no", "off", "false"):
        return None
    target = _target_environment()
    nvcc = _find_nvcc(target["paths"])
    if nvcc is None:
        if mode in _TRUE:
            raise RuntimeError("JAXDD_CUDA=1 but no nvcc was found on PATH, under $CUDA_HOME/bin or $CUDA_PATH/bin, "
                               "or as site-packages/nvidia/cu13/bin/nvcc (pip install nvidia-cuda-nvcc)")
        return None
    if mode in _TRUE:
        return nvcc
    plugin = target["plugin"] or any(_has_module(n) for n in _CUDA_PLUGINS)
    driver = os.path.exists("/proc/driver/nvidia/version")
    return nvcc if (plugin or driver) else None


def _arch_flags() -> list[str]:
    """-gencode flags from JAXDD_CUDA_ARCH ("90", "80;90"), or sm_80 + sm_90 + compute_90 PTX."""
    archs = [a.strip() for a in os.environ.get("JAXDD_CUDA_ARCH", "").replace(",", ";").split(";") if a.strip()]
    if not archs:
        return ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=[sm_90,compute_90]"]
    flags = []
    for a in archs:
        if not a.isdigit():
            raise RuntimeError(f"JAXDD_CUDA_ARCH entries must be compute capabilities like 90, got {a!r}")
        flags += ["-gencode", f"arch=compute_{a},code=[sm_{a},compute_{a}]"]
    return flags


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
        # The nvcc wheel keeps the CUDA headers (cuda_runtime.h, from nvidia-cuda-runtime) beside it.
        wheel_include = Path(nvcc).resolve().parent.parent / "include"
        includes = ["-isystem", str(wheel_include)] if (wheel_include / "cuda_runtime.h").is_file() else []
        # -fmad=false: no fused multiply-adds, so that a pair at the cutoff is decided as the CPU
        # kernel decides it (the two lists are equal edge for edge) and sums round as there.
        cmd = [nvcc, "-std=c++17", "-O3", "-fmad=false", "-shared", "-Xcompiler", "-fPIC", *_arch_flags(), "-I", CSRC,
               "-isystem", FFI_INCLUDE, *includes, *CUDA_SOURCES, "-o", str(out)]
        print("jaxdd: building the CUDA kernels:", " ".join(cmd))
        try:
            subprocess.run(cmd, check=True, cwd=ROOT)
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.environ.get("JAXDD_CUDA", "auto").strip().lower() in _TRUE:
                raise
            print(f"jaxdd: warning: CUDA kernels not built ({exc}); the CPU kernels and the jnp paths still work",
                  file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "jaxdd.ffi._kernels",
            sources=CPU_SOURCES,
            depends=HEADERS,
            include_dirs=[CSRC],
            # -isystem: the vendored headers are not ours to warn about.
            extra_compile_args=["-std=c++17", "-O3", "-isystem", FFI_INCLUDE],
            language="c++",
        )
    ],
    cmdclass={"build_ext": BuildKernels},
)
