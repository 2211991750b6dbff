"""Specification of jaxdd.data.periodic: the one wrap rule.

Fractional coordinates fold into [0, 1) on periodic axes, with the lattice image recorded,
and the wrapped position ``r - image @ cell`` never lands on the upper face because of
rounding. The host (numpy) and the devices (jnp, under jit) give the same answer.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxdd.data import wrap_positions
from jaxdd.decomposition.partition import partition
from jaxdd.data.periodic import wrap_fractional

EDGES = [0.0, -0.0, -1e-17, -1e-300, -5e-324, 1e-300, np.nextafter(1.0, 0.0), 1.0, -1.0, 1.0 + 1e-16,
         -5e-16, 0.5, 7.25, -3.75, -1e-17 - 4.0]


@pytest.mark.parametrize("f", EDGES)
def test_a_wrapped_fraction_is_in_zero_one_and_the_image_restores_it(f):
    wrapped, image = wrap_fractional(np.array([f]), np.array([True]))
    assert 0.0 <= wrapped[0] < 1.0
    assert image[0] == np.round(image[0])
    assert abs((wrapped[0] + image[0]) - f) <= 2e-16 * max(1.0, abs(f))


def test_a_fraction_a_rounding_error_below_zero_stays_in_image_zero_at_zero():
    wrapped, image = wrap_fractional(np.array([-1e-17, -1e-300]), np.array([True, True]))
    np.testing.assert_array_equal(wrapped, [0.0, 0.0])
    np.testing.assert_array_equal(image, [0.0, 0.0])


def test_open_axes_are_left_as_they_are():
    wrapped, image = wrap_fractional(np.array([-3.5, 2.25]), np.array([False, False]))
    np.testing.assert_array_equal(wrapped, [-3.5, 2.25])
    np.testing.assert_array_equal(image, [0.0, 0.0])


def test_the_devices_fold_exactly_as_the_host():
    f = np.array(EDGES)
    periodic = np.arange(len(f)) % 5 != 3  # denormals (XLA flushes them) only on periodic entries
    host = wrap_fractional(f, periodic)
    device = jax.jit(wrap_fractional)(jnp.asarray(f), jnp.asarray(periodic))
    for h, d in zip(host, device):
        np.testing.assert_array_equal(h, np.asarray(d))


def test_the_partition_never_places_an_atom_on_the_upper_face():
    length = 12.0
    positions = np.array([[-1e-17, 6.0, 6.0], [-4e-17, -1e-300, 6.0], [length, 6.0, length], [6.0, 6.0, 6.0]])
    part = partition(positions, np.eye(3)[None] * length, np.ones((1, 3), bool), np.zeros(4, np.int32),
                     np.ones(4, bool), 2, grid=(2, 1, 1))
    wrapped = positions - part.wraps * length
    assert np.all(wrapped < length) and np.all(part.frac < 1.0) and np.all(part.frac >= 0.0)
    # The atom a rounding error below x = 0 is owned by the block at x = 0, and stays there.
    assert part.owner[0] == 0 and part.owner[1] == 0
    np.testing.assert_array_equal(wrapped[:2], positions[:2])


def test_wrap_positions_moves_no_atom_onto_the_upper_face():
    cell = np.eye(3) * 12.0
    positions = jnp.asarray([[-1e-17, 0.0, 0.0], [-13.0, 25.0, 12.0], [3.0, 4.0, 5.0]])
    got = np.asarray(wrap_positions(positions, cell, np.ones(3, bool)))
    assert np.all(got < 12.0)
    np.testing.assert_array_equal(got[0], [-1e-17, 0.0, 0.0])
    np.testing.assert_allclose(got[1], [11.0, 1.0, 0.0], atol=1e-14)
    np.testing.assert_array_equal(got[2], [3.0, 4.0, 5.0])
