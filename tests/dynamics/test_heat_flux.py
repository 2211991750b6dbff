"""Specification of the heat flux J = Σᵢ eᵢ vᵢ + Σᵢ Wᵢ · vᵢ (``HeatFlux``, ``heat_flux``).

Without periodic images J is the time derivative of Σᵢ rᵢ eᵢ along Newton's trajectory
(e = potential + kinetic; the potential-only flux is that derivative plus Σᵢ rᵢ (Fᵢ · vᵢ),
the work the forces do at each atom's place). With periodic images Σᵢ rᵢ eᵢ of the unwrapped
positions places the pairs across the boundary an image away, so there J is checked
against the pair sum of the minimum images. Distributed runs record the same series as one
device, for LJ and for SchNet (many-body: J of its per-atom virials).

Systems: the 256-atom LJ melt at T = 1 (reduced units, cutoff 2.5 with the energy shifted to
zero there; skin 0.3), as a periodic crystal and as a free cluster; SchNet on 108 atoms of
solid argon (eV, Å, amu).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.dynamics import DomainParallel, VelocityVerlet
from jaxdd.dynamics.heat_flux import HeatFlux, heat_flux
from jaxdd.models.lj import LennardJones
from jaxdd.models.mpnn import SchNet
from jaxdd.data.systems import fcc_lattice, lj_melt_data

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

CUTOFF, SKIN, DT = 2.5, 0.3, 0.005


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def lj_model(grid):
    """The LJ DistributedModel on ``grid``: one per grid, so that the runs of several time steps
    share its compiled force and per-atom programs."""
    model = LennardJones(1.0, 1.0, CUTOFF, shift=True)
    return DistributedModel(model, DomainConfig(CUTOFF, skin=SKIN, mesh=mesh_of(math.prod(grid)), grid=grid))


def lj_md(grid=(1, 1, 1), dt=DT):
    return DomainParallel(lj_model(grid), VelocityVerlet(dt), kB=1.0)


@functools.lru_cache(maxsize=None)
def melt():
    return lj_melt_data(4, temperature=1.0, dtype=np.float64)


@functools.lru_cache(maxsize=None)
def lj_series(grid):
    """(the DomainParallel, its state after 20 steps of the melt, J recorded every 5 steps)."""
    md = lj_md(grid)
    flux = HeatFlux(every=5)
    state = md.run(md.init(melt()), 20, observers=[flux])
    return md, state, flux


# ----------------------------------------------------------------------------- the formula


def test_velocity_contracts_with_the_gradient_index_of_the_virial():
    """Σᵢ eᵢ vᵢ + Σ_b Wᵢ_ab vᵢ_b, kinetic energy ½ m v² added; padding rows left out."""
    energies = jnp.asarray([1.0, 5.0, 7.0])
    virials = jnp.zeros((3, 3, 3)).at[0, 0, 1].set(3.0).at[2].set(1.0)  # W₀ = 3 x̂ ⊗ ŷ, not symmetric
    velocities = jnp.asarray([[0.0, 2.0, 0.0], [1.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    masses = jnp.asarray([0.5, 2.0, 1.0])
    system = jnp.asarray([0, 1, 2])  # the third row is padding (n_systems = 2)
    potential = heat_flux(energies, virials, velocities, masses, system, 2, include_kinetic=False)
    np.testing.assert_allclose(potential, [[6.0, 2.0, 0.0], [5.0, 0.0, 0.0]])
    total = heat_flux(energies, virials, velocities, masses, system, 2)
    np.testing.assert_allclose(total - potential, [[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]])  # ½ m v² v


# ----------------------------------------------------------------------------- against the trajectory


@functools.lru_cache(maxsize=None)
def cluster():
    """The melt after 20 steps, cut free as a cluster (no periodic axis)."""
    md, state, _ = lj_series((1, 1, 1))
    return md.gather(state).replace(pbc=jnp.asarray([[False, False, False]]))


def energy_moment(md, state, include_kinetic):
    """(Σᵢ rᵢ eᵢ [3] of the unwrapped positions, Σᵢ rᵢ (Fᵢ · vᵢ) [3])."""
    batch = md.gather(state)
    r, v, m = (np.asarray(x) for x in (batch.positions, batch.velocities, batch.masses))
    terms = md.atom_terms(state)
    ids = np.asarray(state.arrays["ids"]).ravel()
    e = np.zeros(len(r))
    e[ids[ids >= 0]] = np.asarray(terms["atomic_energies"]).ravel()[ids >= 0]
    if include_kinetic:
        e = e + 0.5 * m * np.sum(v * v, axis=1)
    power = np.sum(md.forces(state) * v, axis=1)
    return r.T @ e, r.T @ power


@functools.lru_cache(maxsize=None)
def steps_around(dt):
    """(DomainParallel of step dt, the cluster one step back, now, one step ahead)."""
    md = lj_md(dt=dt)
    start = cluster()
    # Velocity Verlet is time-reversible: one step with the velocities reversed is the step back.
    back = md.run(md.init(start.replace(velocities=-start.velocities)), 1)
    return md, back, md.init(start), md.run(md.init(start), 1)


def central_difference(dt, include_kinetic):
    """(J [3] of the cluster, d/dt Σᵢ rᵢ eᵢ [3] by a central difference over ±dt, pairs that
    crossed the cutoff between -dt and +dt)."""
    md, back, here, ahead = steps_around(dt)
    (before, _), (_, power), (after, _) = (energy_moment(md, s, include_kinetic) for s in (back, here, ahead))
    derivative = (after - before) / (2 * dt)
    if not include_kinetic:
        derivative = derivative + power
    flux = HeatFlux(every=1, include_kinetic=include_kinetic).compute(md, here)[0]
    return flux, derivative, crossings(md.gather(back).positions, md.gather(ahead).positions)


def crossings(a, b):
    def inside(x):
        x = np.asarray(x)
        d = np.linalg.norm(x[:, None] - x[None], axis=-1)
        return d[np.triu_indices(len(x), 1)] < CUTOFF

    return int(np.sum(inside(a) != inside(b)))


@pytest.mark.parametrize("include_kinetic", [True, False], ids=["total", "potential"])
def test_flux_is_the_time_derivative_of_the_energy_moment_of_a_cluster(include_kinetic):
    """Without images, J = d/dt Σᵢ rᵢ eᵢ (total energy), or d/dt Σᵢ rᵢ uᵢ + Σᵢ rᵢ (Fᵢ · vᵢ)
    (potential energy uᵢ). Σᵢ rᵢ eᵢ is smooth while no pair crosses the cutoff (the shifted
    potential's force jumps there), and then the central difference and the Verlet steps
    are off by O(dt²): 1.2e-5 (total) and 3.1e-5 (potential) of |J| at dt = 5e-5 τ, a
    quarter of that at dt/2. A wrong sign, contraction or half of the virial term is off
    by O(|J|)."""
    flux, derivative, crossed = central_difference(5e-5, include_kinetic)
    _, finer, crossed_finer = central_difference(2.5e-5, include_kinetic)
    assert crossed == crossed_finer == 0  # Σᵢ rᵢ eᵢ is smooth over both windows
    error, finer_error = np.abs(derivative - flux).max(), np.abs(finer - flux).max()
    assert error < 1e-4 * np.abs(flux).max()
    assert 3.5 < error / finer_error < 4.5


def pair_flux(batch):
    """J [3] of one periodic LJ system from its pairs: Σᵢ eᵢ vᵢ - ¼ Σᵢⱼ rᵢⱼ (fᵢⱼ · (vᵢ + vⱼ)),
    rᵢⱼ the minimum image of rⱼ - rᵢ, fᵢⱼ = ∇φ(rᵢⱼ), eᵢ = ½ mᵢ vᵢ² + ½ Σⱼ φ(rᵢⱼ)."""
    r, v, m = (np.asarray(x, np.float64) for x in (batch.positions, batch.velocities, batch.masses))
    cell = np.asarray(batch.cell[0], np.float64)
    d = r[None, :, :] - r[:, None, :]
    frac = d @ np.linalg.inv(cell)
    d = (frac - np.round(frac)) @ cell  # one image per pair: the cell is wider than 2 cutoffs
    dist = np.linalg.norm(d, axis=-1)
    near = (dist < CUTOFF) & ~np.eye(len(r), dtype=bool)
    x = np.where(near, dist, 1.0)
    phi = np.where(near, 4 * (x**-12 - x**-6) - 4 * (CUTOFF**-12 - CUTOFF**-6), 0.0)
    slope = np.where(near, 4 * (-12 * x**-13 + 6 * x**-7), 0.0)
    f = (slope / x)[..., None] * d
    e = 0.5 * m * np.sum(v * v, axis=1) + 0.5 * phi.sum(axis=1)
    return e @ v - 0.25 * np.einsum("ija,ijb,ijb->a", d, f, v[:, None, :] + v[None, :, :])


def test_periodic_flux_equals_the_pair_sum_over_minimum_images():
    md, state, _ = lj_series((1, 1, 1))
    flux = HeatFlux(every=1).compute(md, state)[0]
    np.testing.assert_allclose(flux, pair_flux(md.gather(state)), rtol=1e-10, atol=1e-10)


@functools.lru_cache(maxsize=None)
def two_systems():
    """(the one-device DomainParallel, a batch of the melt and the melt with its velocities
    reversed, at step 0)."""
    md, _, _ = lj_series((1, 1, 1))
    data = melt()
    return md, md.init(jaxdd.Batch.from_data_list([data, data.replace(velocities=-data.velocities)]))


def test_each_system_of_a_batch_has_its_own_flux():
    """Reversing every velocity reverses J (energies and virials are even in v)."""
    md, both = two_systems()
    alone = HeatFlux(every=1).compute(md, md.init(melt()))
    flux = HeatFlux(every=1).compute(md, both)
    np.testing.assert_allclose(flux, np.concatenate([alone, -alone]), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- distributed = one device


@pytest.mark.parametrize("grid", [pytest.param((2, 2, 1), marks=pytest.mark.slow), (3, 2, 1)], ids=["2x2x1", "3x2x1"])
def test_distributed_records_the_one_device_series(grid):
    _, _, one = lj_series((1, 1, 1))
    _, _, many = lj_series(grid)
    np.testing.assert_array_equal(one.steps, [5, 10, 15, 20])
    np.testing.assert_array_equal(many.steps, one.steps)
    assert one.values.shape == (4, 1, 3)
    np.testing.assert_allclose(many.values, one.values, rtol=0, atol=1e-9)


@functools.lru_cache(maxsize=None)
def schnet_series(grid):
    atoms = fcc_lattice(3, 5.26, symbol="Ar")  # 108 atoms of solid argon
    atoms.rattle(0.02, seed=4)
    atoms.set_velocities(np.random.default_rng(5).normal(0.0, 0.01, (len(atoms), 3)))
    model = SchNet((18,), 5.0, features=16, n_interactions=2, seed=1)
    assert "atomic_energies" in model.model_config.outputs
    dm = DistributedModel(model, DomainConfig(5.0, skin=0.5, mesh=mesh_of(math.prod(grid)), grid=grid))
    md = DomainParallel(dm, VelocityVerlet(1.0))
    flux = HeatFlux(every=5)
    md.run(md.init(jaxdd.AtomicData.from_ase(atoms, dtype=np.float64)), 10, observers=[flux])
    return flux


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 1), (3, 2, 1)])
def test_many_body_model_distributed_records_the_one_device_series(grid):
    one, many = schnet_series((1, 1, 1)), schnet_series(grid)
    assert np.abs(one.values).max() > 1e-3  # eV·Å per time unit: a flux, not round-off
    np.testing.assert_allclose(many.values, one.values, rtol=0, atol=1e-9 * np.abs(one.values).max())


# ----------------------------------------------------------------------------- output and settings


def test_file_has_a_header_and_one_line_per_system_per_record(tmp_path):
    md, both = two_systems()
    path = tmp_path / "flux.txt"
    flux = HeatFlux(every=5, path=path)
    flux(md, both)
    flux(md, dataclasses.replace(both, step=5))
    lines = path.read_text().splitlines()
    header = [line for line in lines if line.startswith("#")]
    assert lines[:len(header)] == header and "eV*Angstrom" in header[0] and header[-1] == "# step system Jx Jy Jz"
    rows = np.loadtxt(path)
    np.testing.assert_array_equal(rows[:, :2], [[0, 0], [0, 1], [5, 0], [5, 1]])
    np.testing.assert_array_equal(rows[:, 2:], flux.values.reshape(-1, 3))  # written to full precision
    np.testing.assert_array_equal(flux.steps, [0, 5])


def test_a_new_observer_continues_an_existing_file(tmp_path):
    """A restarted run appends to its file under the one header."""
    md, both = two_systems()
    path = tmp_path / "flux.txt"
    HeatFlux(every=1, path=path)(md, both)
    HeatFlux(every=1, path=path)(md, both)
    lines = path.read_text().splitlines()
    assert sum(line.startswith("#") for line in lines) == 2
    assert len(np.loadtxt(path)) == 4


@pytest.mark.parametrize("every", [0, -5, 2.5, True, "5", None])
def test_every_must_be_a_positive_int(every):
    with pytest.raises(ValueError, match=r"HeatFlux\.every must be an int > 0"):
        HeatFlux(every=every)


def test_node_blocks_are_refused_with_what_to_do():
    """Per-atom virials need each rank's full list of its owned atoms: node blocks say so."""
    dm = DistributedModel(LennardJones(1.0, 1.0, CUTOFF, shift=True),
                          DomainConfig(CUTOFF, mesh=mesh_of(2), strategy="graph_partition"))
    md = DomainParallel(dm, VelocityVerlet(DT), kB=1.0)
    with pytest.raises(ValueError, match=r"node blocks.*strategy='halo'"):
        md.run(md.init(lj_melt_data(3, temperature=1.0, dtype=np.float64)), 5, observers=[HeatFlux(every=5)])
