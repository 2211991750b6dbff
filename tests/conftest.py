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
