"""Test configuration: 8 virtual CPU devices and float64, set before JAX initialises."""

import os

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

from hypothesis import settings  # noqa: E402

# Physics comparisons are deterministic: the same examples on every run and in CI.
settings.register_profile("jaxdd", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("jaxdd")


import gc  # noqa: E402

import pytest  # noqa: E402


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
