"""The halo guardrail: before a program compiles, the engine counts the busiest rank's owned
atoms, ghost rows, edges and a lower bound of its memory; it warns (with those numbers) when
ghosts exceed ten times the owned atoms, and refuses (with the numbers and what to change)
when the lower bound exceeds ``DomainConfig.memory_limit`` or the device's memory."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.decomposition.guardrail import HaloSizeWarning, halo_size
from jaxdd.models.lj import LennardJones

CUTOFF = 3.0


def slab_and_a_loner():
    """250 atoms filling half of a periodic 40 x 10 x 10 Å box along x, one atom in the other half."""
    k = np.stack(np.meshgrid(np.arange(10), np.arange(5), np.arange(5), indexing="ij"), -1).reshape(-1, 3) * 2.0
    positions = np.concatenate([k + 0.5, [[30.0, 5.0, 5.0]]])
    return jaxdd.AtomicData(positions=positions, atomic_numbers=np.full(len(positions), 18),
                            cell=np.diag([40.0, 10.0, 10.0]), pbc=np.array([True] * 3))


def model():
    return LennardJones(1.0, 1.0, CUTOFF)


def test_a_rank_with_ten_times_more_ghosts_than_atoms_warns_with_the_numbers():
    dm = DistributedModel(model(), DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1)))
    with pytest.warns(HaloSizeWarning, match=r"\d+ ghost rows for 1 owned atoms .* neighbour-list edges and at least "
                                             r"[\d.]+ MiB"):
        dm.prepare(slab_and_a_loner())  # the host work of a call: the check comes before any program


def test_a_balanced_halo_does_not_warn():
    data = slab_and_a_loner()
    data = data.replace(positions=np.asarray(data.positions)[:-1], atomic_numbers=np.asarray(data.atomic_numbers)[:-1],
                        cell=np.diag([20.0, 10.0, 10.0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", HaloSizeWarning)
        DistributedModel(model(), DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1))).prepare(data)


def test_a_halo_over_the_memory_limit_is_refused_before_compiling():
    dm = DistributedModel(model(), DomainConfig(cutoff=CUTOFF, grid=(2, 1, 1), memory_limit=4096))
    with pytest.raises(ValueError, match=r"ghost rows for \d+ owned atoms.*more than the memory limit of 0\.0 MiB; "
                                         r"use fewer ranks"):
        dm.prepare(slab_and_a_loner())
    assert dm.last_program is None  # refused before a program was made


def test_the_memory_bound_counts_rows_and_edges():
    size = halo_size([10, 4], [20, 200], edges=1000, itemsize=8)
    assert (size.owned, size.ghosts, size.rows, size.edges) == (4, 200, 204, 1000)
    assert size.min_bytes == 204 * (6 * 8 + 12) + 1000 * (6 * 8 + 21)


def test_memory_limit_must_be_a_positive_integer():
    with pytest.raises(ValueError, match="DomainConfig.memory_limit"):
        DomainConfig(cutoff=CUTOFF, memory_limit=0)
