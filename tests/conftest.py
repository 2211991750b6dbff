"""Test configuration: 8 virtual CPU devices and float64, set before JAX initialises.

The tests mirror the packages (``tests/<package>/test_*.py``; ``tests/project`` checks the
repository as a whole, ``tests/bench`` the benchmarks). Modules shared by several folders
(``plain_models``, ``plain_helpers``, the worker scripts) sit here, and a test module may import
another's systems and helpers by name (``from test_dispatch import SYSTEM``): every test folder
is on ``sys.path``, and on ``PYTHONPATH`` for the processes the tests start.
"""

import os
import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_FOLDERS = [str(_TESTS)] + sorted({str(p.parent) for p in _TESTS.glob("*/test_*.py")})
sys.path[:0] = [f for f in _FOLDERS if f not in sys.path]
os.environ["PYTHONPATH"] = os.pathsep.join(_FOLDERS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p and p not in _FOLDERS])

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite checks numbers, not speed, and spends most of its time compiling: XLA's CPU backend
# compiles it without LLVM's optimisation passes (a third less time), with its elemental
# emitters instead of the newer MLIR fusion emitters (a quarter less again), and each program as
# one LLVM module rather than split into pieces for parallel code generation (a sixth less again:
# with one core per test process the pieces only add work). None reassociates floating point, so
# the numbers agree with the default build to rounding. XLA's plain scheduler
# (--xla_cpu_enable_concurrency_optimized_scheduler=false) is left out: with the two above it
# made XLA recompute a masked edge value in two fusions that round differently, and the
# gradient of segment_max, which finds the maximum by ==, went wrong by 1e-4 (the slow
# dispatch idiom segment_max_receivers). Child processes the tests start inherit the flags
# (SPEED_FLAGS lists those a test that needs XLA's default code takes out).
# JAXDD_TEST_XLA_OPTIMIZE=1 keeps XLA's defaults.
SPEED_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")


def _xla_knows(flag: str) -> bool:
    """Whether the installed jaxlib has an XLA flag (an unknown one aborts the process)."""
    import glob
    import importlib.util
    import mmap

    spec = importlib.util.find_spec("jaxlib")
    for path in glob.glob(os.path.join(os.path.dirname(spec.origin), "*.so")) if spec and spec.origin else ():
        if os.path.getsize(path):
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(flag.encode()) >= 0:
                    return True
    return False


_flags = os.environ.get("XLA_FLAGS", "")
if os.environ.get("JAXDD_TEST_XLA_OPTIMIZE", "0") != "1":
    if "xla_backend_optimization_level" not in _flags:
        _flags += " --xla_backend_optimization_level=0"
    for _flag in SPEED_FLAGS:
        _name = _flag[2:].split("=")[0]
        if _name not in _flags and _xla_knows(_name):
            _flags += " " + _flag
    os.environ["XLA_FLAGS"] = _flags.strip()

# Most of the suite's time is XLA compiling, and its programs change only with the code: they
# persist between runs in a compilation cache (JAX keys each entry by the program, the JAX and
# XLA versions and the flags, so a changed program is compiled afresh, never taken stale).
# Child processes the tests start inherit it. JAXDD_TEST_CACHE: its directory, or 0 for none;
# delete the directory to reclaim its space (a few hundred MB at most).
_cache = os.environ.get("JAXDD_TEST_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "jaxdd", "xla-tests")
if _cache != "0":
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _cache)
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # the suite's programs are small

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from hypothesis import settings  # noqa: E402

# Physics comparisons are deterministic: the same examples on every run and in CI.
settings.register_profile("jaxdd", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("jaxdd")


import gc  # noqa: E402

import pytest  # noqa: E402

from jaxdd import programs  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every module's compiled programs when it ends.

    One process compiling hundreds of XLA CPU programs (each distributed case is a new one)
    keeps growing its code mappings until XLA's compiler aborts; no test reuses another
    module's programs, so they are released between modules.
    """
    yield
    jax.clear_caches()
    gc.collect()


def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 3
    except (OSError, ValueError):
        return 1 << 62


@pytest.fixture(autouse=True)
def _bound_code_mappings():
    """Within a module too: drop the compiled programs once the mappings pass a third of the limit.

    A long module (the adversarial suite's slow set compiles a program per geometry, grid and
    path) would otherwise reach ``vm.max_map_count`` on its own and XLA would crash mid-compile.
    """
    yield
    if (programs.mapped() or 0) > _map_limit():
        jax.clear_caches()
        gc.collect()


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (-p no:xdist) the hook is unknown
def pytest_xdist_auto_num_workers(config):
    """Workers for ``-n auto``: one per core, at most 4 (each holds 8 virtual devices and its
    own compiled programs, up to ~3 GB); JAXDD_TEST_WORKERS sets the number."""
    if os.environ.get("JAXDD_TEST_WORKERS"):
        return int(os.environ["JAXDD_TEST_WORKERS"])
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 4))


#: The modules that take longest with a cold compilation cache, longest first, in the default
#: suite and in the slow set (by the worker-seconds of the last measured run). pytest-xdist
#: hands out whole modules (--dist loadfile): the long ones go first, so that the run does not
#: end on one long module while the other workers wait; the rest follow in collection order.
LONG_MODULES = (
    "test_docs.py", "test_dispatch.py", "test_dynamics.py", "test_zoo_models.py", "test_nose_hoover.py",
    "test_distributed.py", "test_sevennet.py", "test_dispatch_idioms.py", "test_neighbors.py",
    "test_adversarial.py", "test_interop_jax_md.py", "test_zoo_qeq_backbone.py", "test_validate_cli.py",
    "test_heat_flux.py", "test_validate_scatter_fix.py", "test_balance.py", "test_bad_inputs.py",
    "test_training.py", "test_lj.py", "test_ffi_neighbors.py", "test_mace.py", "test_lammps_reference.py",
    "test_ase_calculator.py", "test_community_models.py",
    "test_compute.py", "test_graph_parallel.py", "test_replan.py", "test_multiprocess.py",
)
LONG_SLOW_MODULES = (
    "test_adversarial.py", "test_examples.py", "test_nose_hoover.py", "test_mace_families.py",
    "test_zoo_models.py", "test_dispatch_idioms.py", "test_gpu_check.py", "test_mace.py", "test_distributed.py",
    "test_multiprocess.py", "test_compile_reuse.py", "test_dynamics.py", "test_bench_sevennet_md.py",
    "test_interop_jax_md.py", "test_chgnet.py", "test_sevennet.py", "test_balance.py", "test_validate_zoo.py",
    "test_bench_mlip.py", "test_pme.py", "test_bench_balance.py", "test_graph_parallel.py", "test_dispatch.py",
    "test_training.py", "test_validate_cli.py", "test_validate.py",
)


def pytest_configure(config):
    # Hand the modules out in the order below, not sorted by their number of tests.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    marks = config.getoption("markexpr", "") or ""
    slow_stage = "slow" in marks and "not slow" not in marks
    rank = {name: i for i, name in enumerate(LONG_SLOW_MODULES if slow_stage else LONG_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: tests keep their order


# JAXDD_TEST_RAN_LOG=FILE: the id of every test that finishes is appended to FILE, one a line,
# as it finishes (flushed, so a run stopped at a time budget leaves the list of what did run:
# .ci/run compares it with the collected tests to name the ones that did not).
_ran_log = os.environ.get("JAXDD_TEST_RAN_LOG")
_is_worker = "PYTEST_XDIST_WORKER" in os.environ


def pytest_runtest_logreport(report):
    # With pytest-xdist the workers' reports reach the controlling process too; only the
    # process without ``workerinput`` writes, so each test is written once.
    if _ran_log and report.when == "teardown" and not _is_worker:
        with open(_ran_log, "a") as f:
            f.write(report.nodeid + "\n")

