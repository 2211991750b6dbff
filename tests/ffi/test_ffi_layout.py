"""A kernel is one place: its sources, its op module and their registration find each other.

Each kernel is a folder of sources, ``csrc/<name>/`` (``<name>_cpu.cc``, optionally
``<name>_cuda.cu`` and its own headers), beside its op module ``jaxdd/ffi/<name>.py``, which
declares the FFI handlers it calls and registers its named op. Nothing lists the kernels:
setup.py compiles every source under csrc/, the library loader registers the handlers the
imported modules declare, and ``jaxdd.ops.get_op`` finds jaxdd's op modules by reading them.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import setuptools

from jaxdd import ffi
from jaxdd.ffi import _library
from jaxdd.ops.registry import op_providers

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
KERNEL_FOLDERS = sorted(p for p in CSRC.iterdir() if p.is_dir() and p.name != "third_party")


def test_there_are_kernel_folders():
    assert {p.name for p in KERNEL_FOLDERS} >= {"lj", "attention", "neighbors"}


@pytest.mark.parametrize("folder", KERNEL_FOLDERS, ids=lambda p: p.name)
def test_a_kernel_folder_holds_its_sources_beside_an_op_module(folder):
    name = folder.name
    assert (folder / f"{name}_cpu.cc").is_file(), f"csrc/{name}/ has no {name}_cpu.cc"
    assert (ROOT / "jaxdd" / "ffi" / f"{name}.py").is_file(), f"csrc/{name}/ has no op module jaxdd/ffi/{name}.py"
    allowed = {f"{name}_cpu.cc", f"{name}_cuda.cu"}
    strays = [p.name for p in folder.iterdir() if p.name not in allowed and p.suffix != ".h"]
    assert not strays, f"csrc/{name}/ holds files that are neither its sources nor headers: {strays}"


def _run_setup(monkeypatch) -> tuple[dict, dict]:
    """setup.py run with setuptools.setup replaced (nothing is built): the arguments it passes
    to setup and its globals."""
    seen = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: seen.update(kwargs))
    return seen, runpy.run_path(str(ROOT / "setup.py"), run_name="setup")


def _sources(suffix: str) -> list[str]:
    return sorted(p.relative_to(ROOT).as_posix() for p in CSRC.rglob(f"*{suffix}") if "third_party" not in p.parts)


def test_setup_compiles_every_source_under_csrc(monkeypatch):
    kwargs, setup_globals = _run_setup(monkeypatch)
    (extension,) = kwargs["ext_modules"]
    assert extension.name == "jaxdd.ffi._kernels"
    assert sorted(extension.sources) == _sources(".cc")
    assert all(f"csrc/{p.name}/{p.name}_cpu.cc" in extension.sources for p in KERNEL_FOLDERS)
    assert sorted(setup_globals["CUDA_SOURCES"]) == _sources(".cu")
    assert {"csrc/lj/lj_cuda.cu", "csrc/attention/attention_cuda.cu"} <= set(setup_globals["CUDA_SOURCES"])


@pytest.mark.skipif(not ffi.available(), reason="compiled kernels not built (pip install -e .)")
def test_the_library_exports_every_handler_the_kernel_modules_declare():
    importlib.import_module("jaxdd.ffi.neighbors")  # the one kernel module jaxdd.ffi does not import
    declared = _library.declared()
    assert {"lj_forward", "lj_backward", "attention_forward", "attention_backward", "cell_list"} <= set(declared)
    lib = ctypes.CDLL(str(_library.library_path()))
    missing = [f"jaxdd_{k}_{d}" for k in declared for d in _library.DTYPES if not hasattr(lib, f"jaxdd_{k}_{d}")]
    assert not missing


def test_jaxdd_own_op_namespaces_are_declared_with_the_modules_that_register_their_ops():
    providers = op_providers()
    assert {"jaxdd.ffi.attention", "jaxdd.ffi.lj"} <= set(providers["jaxdd_ffi"])
    assert providers["jaxdd_warp"] == ("jaxdd.ffi.warp",)
    assert providers["jaxdd_mesh"] == ("jaxdd.models.pme_grid",)
    assert "jaxdd" not in providers  # dispatch rules and verbs ("jaxdd::...") are not named ops


def test_a_spec_naming_a_warp_op_imports_its_module_on_first_use():
    code = ("import sys, jaxdd.ops\n"
            "assert 'jaxdd.ffi.warp' not in sys.modules\n"
            "assert jaxdd.ops.get_op('jaxdd_warp::lj_edge').name == 'jaxdd_warp::lj_edge'\n"
            "assert 'jaxdd.ffi.warp' in sys.modules\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
