"""Warp as a kernel source: the Lennard-Jones edge kernel and the model built on it.

The kernel equals its jnp formula (float64 1e-12, float32 1e-5 relative) and passes
``check_grads`` through Warp's adjoint; ``LennardJonesWarp`` equals ``LennardJones`` on one
device and under decomposition (8 virtual devices, two grids: energy 1e-10 relative,
forces and stress 1e-9 absolute). Skipped, with the reason, when warp-lang is missing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxdd
from jaxdd import DistributedModel, DomainConfig
from jaxdd.engine import default_mesh
from jaxdd.ffi import warp
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import fcc_lattice

pytestmark = pytest.mark.skipif(not warp.available(), reason='warp-lang not installed (pip install "jaxdd[warp]")')

OUTPUTS = ("energy", "forces", "stress")


def edges(dtype, n=40, seed=0):
    """Edge vectors 0.9-2.8 Å long (some beyond the 2.5 Å cutoff); a fifth of them padding."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(n, 3))
    vectors = directions / np.linalg.norm(directions, axis=1, keepdims=True) * rng.uniform(0.9, 2.8, (n, 1))
    mask = rng.random(n) > 0.2
    return jnp.asarray(vectors, dtype), jnp.asarray(mask)


def reference(vectors, mask, sigma, epsilon, cutoff, shift):
    r2 = jnp.sum(vectors * vectors, axis=-1)
    inside = mask & (r2 < cutoff * cutoff)
    s6 = (sigma * sigma / jnp.where(inside, r2, 1.0)) ** 3
    c6 = (sigma / cutoff) ** 6
    pair = 4.0 * epsilon * (s6 * s6 - s6) - (4.0 * epsilon * (c6 * c6 - c6) if shift else 0.0)
    return jnp.where(inside, 0.5 * pair, 0.0)


@pytest.mark.parametrize("dtype, rtol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
@pytest.mark.parametrize("shift", [False, True])
def test_edge_kernel_equals_its_formula(dtype, rtol, shift):
    vectors, mask = edges(dtype)
    got = warp.lj_edge_energy(vectors, mask, 1.1, 0.9, 2.5, shift)
    want = reference(vectors, mask, 1.1, 0.9, 2.5, shift)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=rtol * float(jnp.abs(want).max()))


def test_edge_kernel_passes_check_grads():
    vectors, mask = edges(jnp.float64)
    check_grads(lambda v: warp.lj_edge_energy(v, mask, 1.1, 0.9, 2.5), (vectors,), order=1, modes=("rev",))


def test_edge_kernel_refuses_misshaped_vectors():
    with pytest.raises(ValueError, match="vectors must be"):
        warp.lj_edge_energy(jnp.zeros((4, 2)), jnp.ones(4, bool), 1.0, 1.0, 2.5)


def crystal(n_cells):
    atoms = fcc_lattice(n_cells, 1.6796)
    atoms.rattle(0.05, seed=1)
    return jaxdd.AtomicData.from_ase(atoms)


def assert_same(got, want):
    e = np.asarray(want["energy"])
    assert np.max(np.abs(np.asarray(got["energy"]) - e) / np.abs(e)) <= 1e-10
    for key in ("forces", "stress"):
        assert np.max(np.abs(np.asarray(got[key]) - np.asarray(want[key]))) <= 1e-9, key


def test_warp_lennard_jones_equals_the_jnp_model_on_one_device():
    from jaxdd.models.lj_warp import LennardJonesWarp

    data = crystal(3)
    assert_same(jaxdd.compute(LennardJonesWarp(1.0, 1.0, 2.5, shift=True), data, OUTPUTS),
                jaxdd.compute(LennardJones(1.0, 1.0, 2.5, shift=True), data, OUTPUTS))


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 2), (4, 2, 1)], ids=str)
def test_warp_lennard_jones_under_decomposition_equals_one_device(grid):
    from jaxdd.models.lj_warp import LennardJonesWarp

    data = crystal(6)
    dm = DistributedModel(LennardJonesWarp(1.0, 1.0, 2.5), DomainConfig(2.5, mesh=default_mesh(jax.devices()[:8]),
                                                                        grid=grid))
    assert_same(dm(data, OUTPUTS), jaxdd.compute(LennardJones(1.0, 1.0, 2.5), data, OUTPUTS))
