"""Models, meshes and the stored LAMMPS runs the bridge tests share.

The model is LAMMPS's ``pair_style lj/cut 6.5`` for argon in metal units (ε = 0.0104 eV,
σ = 3.4 Å, no shift), as ``tests/data/lammps/make_bridge_reference.py`` ran it; its Verlet
skin of 0.5 Å lets the bridge keep its neighbour lists between LAMMPS's steps.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxdd.lammps import ForceEvaluator
from jaxdd.models.lj import LennardJones

REFERENCE = np.load(Path(__file__).parents[1] / "data" / "lammps" / "bridge_reference.npz")
ARGON = 18
#: Ghost shell beyond the model's reach (Å) the tests decompose with: on a (2, 2, 1) grid of
#: the 15.8 Å box each block is 7.9 Å wide, and the shell 6.5 + 1.0.
SKIN = 1.0


def argon_lj():
    """LAMMPS's ``lj/cut 6.5`` of argon (eV, Å), kept as a Verlet list with a 0.5 Å skin."""
    return LennardJones(3.4, 0.0104, 6.5, species=(ARGON,), skin=0.5)


def mesh_of(grid):
    return Mesh(np.asarray(jax.devices()[:math.prod(grid)]), ("dd",), axis_types=(AxisType.Auto,))


def evaluator(grid=(1, 1, 1), **kwargs):
    """A :class:`~jaxdd.lammps.ForceEvaluator` of :func:`argon_lj` on ``grid``."""
    return ForceEvaluator(argon_lj(), skin=SKIN, mesh=mesh_of(grid), grid=grid, **kwargs)


def wrapped(x, cell, origin=np.zeros(3)):
    """Positions wrapped into the box as LAMMPS wraps them when it re-neighbours."""
    frac = (x - origin) @ np.linalg.inv(cell)
    return (frac - np.floor(frac)) @ cell + origin


def argon_distributed():
    """:func:`argon_lj` as a DistributedModel with its own DomainConfig (one device, skin 1 Å)."""
    from jaxdd import DistributedModel, DomainConfig

    return DistributedModel(argon_lj(), DomainConfig(6.5, skin=SKIN, mesh=mesh_of((1, 1, 1)), grid=(1, 1, 1)))
