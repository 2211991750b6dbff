"""Specification of smooth particle-mesh Ewald (``jaxdd.models.pme.PME``) and its distributed mesh.

Physics: the Madelung constants of NaCl, CsCl and zincblende to 1e-5, pymatgen's
``EwaldSummation`` on rattled triclinic cells (neutral and charged), and Ewald on a random
neutral 1,000-ion triclinic box (slow) to 1e-5. Under decomposition, with the mesh
distributed (blocks, mesh halo, all_to_all FFT) or replicated (all-reduced), the outputs
equal ``jaxdd.compute``: energy to 1e-10 relative, forces and stress to 1e-9 absolute.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxdd
from jaxdd import Batch
from jaxdd.engine import DistributedModel, DomainConfig
from jaxdd.engine.driver import neighbor_list_for
from jaxdd.models.pme_grid import mesh_problems
from jaxdd.models.ewald import Ewald
from jaxdd.models.pme import MESH_MULTIPLE, PME
from jaxdd.neighbors import neighbor_capacity
from jaxdd.spec import SPEC_PME_HALO

from test_ewald import (CUTOFF, KEYS, MADELUNG, SYSTEMS, assert_distributed_matches, crystal, index_of, ion_box,
                        madelung_of, mesh_of, pymatgen_reference, rattled, rows_of, small_batch)

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")


@functools.cache
def pme_outputs():
    out = jaxdd.compute(PME(CUTOFF), small_batch(), KEYS)
    return {k: np.asarray(v) for k, v in out.items()}


# --------------------------------------------------------------------------- physics


@pytest.mark.parametrize("name", list(MADELUNG))
def test_madelung_constant_to_1e_5(name):
    energy = pme_outputs()["energy"][index_of(name)]
    assert madelung_of(energy, name) == pytest.approx(MADELUNG[name][2], rel=1e-5)


@pytest.mark.parametrize("name", ["rattled", "charged"])
def test_energy_and_forces_match_pymatgen_ewald_summation(name):
    energy, forces = pymatgen_reference(SYSTEMS[name]())
    assert pme_outputs()["energy"][index_of(name)] == pytest.approx(energy, rel=1e-5)
    np.testing.assert_allclose(pme_outputs()["forces"][rows_of(name)], forces, rtol=0,
                               atol=1e-5 * np.abs(forces).max())


@pytest.mark.parametrize("name", ["rattled", "charged"])
def test_virial_trace_is_minus_the_energy_as_coulomb_energy_scales_as_one_over_length(name):
    out = pme_outputs()
    i = index_of(name)
    volume = abs(np.linalg.det(np.asarray(small_batch().cell)[i]))
    assert np.trace(out["stress"][i]) * volume == pytest.approx(-out["energy"][i], rel=1e-5)


@pytest.mark.slow
def test_forces_pass_check_grads():
    model = PME(CUTOFF, mesh=(12, 12, 12))
    batch = Batch.from_data(rattled())
    capacity = neighbor_capacity(batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
                                 cutoff=CUTOFF, headroom=1.5)

    @jax.jit
    def energy(positions):
        moved = batch.replace(positions=positions)
        return model(moved.replace(neighbors=neighbor_list_for(model, moved, capacity)))["energy"][0]

    check_grads(energy, (batch.positions,), order=1, modes=("rev",), eps=1e-4, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
def test_agrees_with_ewald_to_1e_5_on_a_random_neutral_1000_ion_triclinic_box():
    data = ion_box(10)
    want = jaxdd.compute(Ewald(8.0), data, KEYS)
    got = jaxdd.compute(PME(8.0), data, KEYS)
    assert float(got["energy"][0]) == pytest.approx(float(want["energy"][0]), rel=1e-5)
    for key in ("forces", "stress"):
        scale = np.abs(np.asarray(want[key])).max()
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=0, atol=1e-5 * scale)


# --------------------------------------------------------------------------- the mesh


def test_auto_mesh_divides_by_the_multiple_and_grows_with_the_cell():
    model = PME(CUTOFF)
    model.validate_input(Batch.from_data(crystal("CsCl")))
    small = model.mesh
    model.validate_input(Batch.from_data(ion_box(6)))
    assert all(k % MESH_MULTIPLE == 0 for k in model.mesh + small)
    assert all(b > a for a, b in zip(small, model.mesh))


@pytest.mark.parametrize("grid", [(2, 2, 2), (4, 2, 1), (3, 2, 1), (1, 1, 8), (8, 1, 1), (2, 3, 2)])
def test_auto_mesh_sizes_fit_rank_grids_of_twos_and_threes(grid):
    assert mesh_problems((MESH_MULTIPLE,) * 3, grid) == []


def test_a_given_mesh_is_kept_whatever_the_batch():
    model = PME(CUTOFF, mesh=(20, 22, 24))
    model.validate_input(Batch.from_data(ion_box(6)))
    assert model.mesh == (20, 22, 24)


def test_the_spec_follows_the_mesh_mode():
    assert PME(CUTOFF).distribution_spec == SPEC_PME_HALO
    (adapter,) = PME(CUTOFF, distributed_fft=False).distribution_spec.distribution.custom_ops
    assert adapter.op.name == "jaxdd_mesh::spread"
    assert adapter.output_transforms[0].replicated_consumer


# --------------------------------------------------------------------------- decomposition


def test_distributed_mesh_equals_single_device_on_an_uneven_grid_in_a_triclinic_cell():
    dm = assert_distributed_matches(PME(CUTOFF, mesh=(12, 12, 12)), ion_box(4), (3, 2, 1))
    assert dm.dispatch_report.counts["verb.pme_energy"] == 1


# (3, 2, 1) with the distributed mesh is in the default suite above.
SWEEP = [((2, 2, 2), True), ((4, 2, 1), True), ((1, 1, 8), True), ((2, 2, 2), False), ((3, 2, 1), False)]


@pytest.mark.slow
@pytest.mark.parametrize("grid, distributed_fft", SWEEP,
                         ids=[f"{'x'.join(map(str, g))}-{'distributed' if d else 'replicated'}" for g, d in SWEEP])
def test_distributed_equals_single_device_in_a_triclinic_cell(grid, distributed_fft):
    model = PME(CUTOFF, mesh=(24, 24, 24), distributed_fft=distributed_fft)
    assert_distributed_matches(model, ion_box(4), grid, want=single_device(distributed_fft))


@functools.cache
def single_device(distributed_fft):
    model = PME(CUTOFF, mesh=(24, 24, 24), distributed_fft=distributed_fft)
    return jaxdd.compute(model, ion_box(4), KEYS)


@pytest.mark.slow
def test_distributed_batch_of_two_cells_with_an_auto_mesh_equals_single_device():
    data = Batch.from_data_list([ion_box(4, seed=1), rattled(net_charge=0.6)])
    assert_distributed_matches(PME(CUTOFF), data, (2, 2, 2))


@functools.cache
def two_rank_mesh_sums():
    """A jitted map from fractional coordinates [2, 3] of two atoms (charges +1, -1) in a
    10 Å cube, mesh 12³, to (the distributed verb body on ranks of grid (2, 1, 1), rank r
    owning atom r; the plain single-device sum)."""
    from jax.sharding import PartitionSpec as P

    from jaxdd.models import pme_grid as mesh
    from jaxdd.dispatch import Runtime
    from jaxdd.decomposition.halo import HaloLayout
    from jaxdd.models.ewald import reciprocal
    from jaxdd.ops import HaloStoragePolicy

    layout = HaloLayout(grid=(2, 1, 1), n_owned=1, exchanges=())
    moduli = tuple(jnp.asarray(mesh.bspline_moduli(12, 6)) for _ in range(3))

    def sums(frac):
        recip, volume = reciprocal(jnp.eye(3, dtype=frac.dtype)[None] * 10.0)
        q = jnp.asarray([1.0, -1.0], frac.dtype)
        base, weights = mesh.bspline_weights(frac * 12.0, 6)
        system = jnp.zeros(2, jnp.int32)

        def rank(q, weights, base, system):
            runtime = Runtime(layout, None, ("dd",), HaloStoragePolicy(), owned_rows=jnp.ones(1, bool))
            return mesh.distributed_pme_energy(runtime, q, weights, base, system, recip, volume, 0.5, *moduli)

        on_ranks = jax.shard_map(rank, mesh=mesh_of(2), in_specs=(P("dd"),) * 4, out_specs=P(), check_vma=False)
        return on_ranks(q, weights, base, system), mesh.pme_energy(q, weights, base, system, recip, volume, 0.5, moduli)

    return jax.jit(sums)


def test_the_distributed_mesh_sum_equals_the_plain_one_for_atoms_in_their_blocks():
    got, want = two_rank_mesh_sums()(jnp.asarray([[0.2, 0.5, 0.5], [0.7, 0.3, 0.6]]))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-12)


def test_an_owned_atom_far_outside_its_block_gives_nan_not_a_clipped_mesh():
    got, want = two_rank_mesh_sums()(jnp.asarray([[0.8, 0.5, 0.5], [0.7, 0.3, 0.6]]))  # rank 0 owns x < 0.5
    assert np.isnan(np.asarray(got)).all() and np.isfinite(np.asarray(want)).all()


# --------------------------------------------------------------------------- errors


def test_a_mesh_that_does_not_fit_the_rank_grid_is_refused_naming_mesh():
    dm = DistributedModel(PME(CUTOFF, mesh=(20, 24, 24)), DomainConfig(CUTOFF, mesh=mesh_of(6), grid=(3, 2, 1)))
    with pytest.raises(ValueError, match=r"mesh\[0\] = 20 is not a multiple of Px = 3"):
        dm(ion_box(4), KEYS)


def test_the_distributed_mesh_under_graph_parallelism_is_refused_naming_the_replicated_mode():
    dm = DistributedModel(PME(CUTOFF, mesh=(12, 12, 12)),
                          DomainConfig(CUTOFF, mesh=mesh_of(2), strategy="graph_partition"))
    with pytest.raises(ValueError, match="distributed_fft=False"):
        dm(ion_box(4), ("energy",))


def test_a_batch_without_charges_is_refused():
    with pytest.raises(ValueError, match="charges"):
        jaxdd.compute(PME(CUTOFF), crystal("NaCl").replace(charges=None))


def test_a_cell_not_periodic_in_three_dimensions_is_refused():
    with pytest.raises(ValueError, match="periodic along all three axes"):
        jaxdd.compute(PME(CUTOFF), crystal("NaCl").replace(pbc=jnp.asarray([False, True, True])))


@pytest.mark.parametrize("order", [3, 5, 2, 4.5])
def test_an_odd_or_small_spline_order_is_refused(order):
    with pytest.raises(ValueError, match="order"):
        PME(CUTOFF, order=order)


@pytest.mark.parametrize("mesh", [(24, 24), (4, 24, 24), "auto"])
def test_a_malformed_mesh_is_refused(mesh):
    with pytest.raises(ValueError, match="mesh"):
        PME(CUTOFF, mesh=mesh)


def test_a_model_called_before_sizing_says_how_to_size_it():
    with pytest.raises(ValueError, match="mesh="):
        PME(CUTOFF)(Batch.from_data(crystal("NaCl")))


@pytest.mark.slow
def test_dynamics_on_the_distributed_mesh_replans_drifted_atoms_and_equals_one_device():
    """Atoms that drift a mesh row past their rank's block make the mesh refuse them (NaN);
    DomainParallel then migrates them and takes the step again, so the trajectory is the
    single-device one. Ions with a Lennard-Jones core, 200 steps, a 2 Å skin (1 Å of drift)."""
    from jax.sharding import AxisType, Mesh

    from jaxdd.dynamics import DomainParallel, VelocityVerlet
    from jaxdd.models.composite import SumModel
    from jaxdd.models.lj import LennardJones

    data = ion_box(6, seed=3).replace(velocities=np.random.default_rng(0).normal(0, 0.3, (216, 3)))
    final = {}
    for grid in ((1, 1, 1), (2, 2, 1)):
        mesh = Mesh(np.asarray(jax.devices()[:int(np.prod(grid))]), ("dd",), axis_types=(AxisType.Auto,))
        model = SumModel(LennardJones(2.3, 0.2, 6.0), PME(6.0))
        md = DomainParallel(DistributedModel(model, DomainConfig(6.0, skin=2.0, mesh=mesh, grid=grid)),
                            VelocityVerlet(0.05))
        state = md.run(md.init(data), 200)
        final[grid] = (np.asarray(md.gather(state).positions), md.thermo(state)["total_energy"])
    np.testing.assert_allclose(final[(2, 2, 1)][0], final[(1, 1, 1)][0], rtol=0, atol=1e-9)
    np.testing.assert_allclose(final[(2, 2, 1)][1], final[(1, 1, 1)][1], rtol=1e-10)
