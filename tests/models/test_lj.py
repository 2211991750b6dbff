"""Lennard-Jones against outside references: ASE's calculator and LAMMPS's melt energy."""

import ase
import numpy as np
import pytest
from ase.calculators.lj import LennardJones as AseLJ
from ase.geometry import get_distances
from ase.neighborlist import neighbor_list as ase_neighbor_list

import jaxdd
from jaxdd.models.lj import LennardJones
from jaxdd.data.systems import LAMMPS_MELT_ENERGY_PER_ATOM, fcc_lattice, lj_melt

# Published by oracles: ASE LennardJones(sigma=1, epsilon=1, rc=2.5, smooth=False) on the
# 256-atom fcc crystal with nearest-neighbour distance 2^(1/6) sigma.
ASE_FCC_ENERGY_PER_ATOM = -7.321032079117094


def ase_reference(atoms, sigma=1.0, epsilon=1.0, rc=2.5):
    atoms = atoms.copy()
    atoms.calc = AseLJ(sigma=sigma, epsilon=epsilon, rc=rc, smooth=False)
    return (
        atoms.get_potential_energy(),
        atoms.get_potential_energies(),
        atoms.get_forces(),
        atoms.get_stress(voigt=False),
    )


def ours(atoms, model, outputs=("energy", "atomic_energies", "forces", "stress")):
    out = jaxdd.compute(model, jaxdd.AtomicData.from_ase(atoms), outputs)
    return {k: np.asarray(v) for k, v in out.items()}


def assert_matches_ase(atoms, model, **ref_kw):
    energy, atomic, forces, stress = ase_reference(atoms, **ref_kw)
    got = ours(atoms, model)
    assert abs(got["energy"][0] - energy) <= 1e-10 * abs(energy)
    np.testing.assert_allclose(got["atomic_energies"], atomic, rtol=0, atol=1e-10)
    np.testing.assert_allclose(got["forces"], forces, rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"][0], stress, rtol=0, atol=1e-9)


def random_packing(n, cell, pbc, min_dist, seed):
    """Random positions with no pair closer than ``min_dist`` (periodic images included)."""
    rng = np.random.default_rng(seed)
    positions = [rng.random(3) @ cell]
    while len(positions) < n:
        p = rng.random(3) @ cell
        _, d = get_distances(p, np.array(positions), cell=cell, pbc=pbc)
        if d.min() >= min_dist:
            positions.append(p)
    return ase.Atoms(numbers=[18] * n, positions=positions, cell=cell, pbc=pbc)


def test_fcc_256_reproduces_the_ase_energy_per_atom():
    atoms = fcc_lattice(4, 2 ** (1 / 6) * np.sqrt(2))
    got = ours(atoms, LennardJones(1.0, 1.0, 2.5, shift=True), ("energy",))
    assert abs(got["energy"][0] / 256 - ASE_FCC_ENERGY_PER_ATOM) <= 1e-10 * abs(ASE_FCC_ENERGY_PER_ATOM)


def test_rattled_fcc_matches_ase_energy_forces_and_stress():
    atoms = fcc_lattice(4, 2 ** (1 / 6) * np.sqrt(2))
    atoms.rattle(0.05, seed=3)
    assert_matches_ase(atoms, LennardJones(1.0, 1.0, 2.5, shift=True))


def test_random_triclinic_slab_matches_ase():
    # 200 atoms, triclinic, periodic in x and y only.
    cell = np.array([[7.0, 0.0, 0.0], [1.8, 6.5, 0.0], [0.9, -1.1, 7.5]])
    atoms = random_packing(200, cell, (True, True, False), 0.9, seed=7)
    assert_matches_ase(atoms, LennardJones(1.0, 1.0, 2.5, shift=True))


def test_cell_smaller_than_twice_the_cutoff_matches_ase():
    # A 2-atom triclinic cell thinner than the cutoff: neighbours include images of the
    # atom itself and several images of the other atom.
    cell = np.array([[1.6, 0.0, 0.0], [0.5, 1.5, 0.0], [0.3, 0.4, 1.7]])
    atoms = ase.Atoms("Ar2", scaled_positions=[[0.1, 0.2, 0.3], [0.6, 0.55, 0.8]], cell=cell, pbc=True)
    assert_matches_ase(atoms, LennardJones(1.0, 1.0, 2.5, shift=True))


def test_small_cell_with_partial_pbc_matches_ase():
    cell = np.array([[1.7, 0.0, 0.0], [0.0, 1.9, 0.0], [0.0, 0.0, 8.0]])
    atoms = ase.Atoms("Ar3", positions=[[0.1, 0.2, 0.3], [0.9, 1.1, 1.4], [0.4, 0.3, 2.6]], cell=cell, pbc=(1, 1, 0))
    assert_matches_ase(atoms, LennardJones(1.0, 1.0, 2.5, shift=True))


def test_non_unit_sigma_and_epsilon_match_ase():
    atoms = fcc_lattice(3, 5.26, symbol="Ar")
    atoms.rattle(0.1, seed=1)
    model = LennardJones(3.4, 0.0104, 8.5, shift=True)
    assert_matches_ase(atoms, model, sigma=3.4, epsilon=0.0104, rc=8.5)


def test_unshifted_melt_lattice_reproduces_the_lammps_energy_per_atom():
    # The perfect lattice energy per atom does not depend on the supercell size.
    atoms = lj_melt(n_cells=5)
    got = ours(atoms, LennardJones(1.0, 1.0, 2.5), ("energy", "forces"))
    assert abs(got["energy"][0] / len(atoms) - LAMMPS_MELT_ENERGY_PER_ATOM) < 5e-11
    assert np.abs(got["forces"]).max() < 1e-11


def exact_fcc_lattice_sum(density, rc, digits=40):
    """E/N of the unshifted LJ fcc lattice (sigma = epsilon = 1) in exact decimal arithmetic."""
    import itertools
    from decimal import Decimal, localcontext

    with localcontext() as ctx:
        ctx.prec = digits
        a = (Decimal(4) / Decimal(str(density))) ** (Decimal(1) / Decimal(3))
        half = Decimal("0.5")
        basis = [(0, 0, 0), (0, half, half), (half, 0, half), (half, half, 0)]
        reach = int(float(rc) / float(a)) + 2
        total = Decimal(0)
        for i, j, k in itertools.product(range(-reach, reach + 1), repeat=3):
            for b in basis:
                r2 = ((i + b[0]) ** 2 + (j + b[1]) ** 2 + (k + b[2]) ** 2) * a * a
                if 0 < r2 < Decimal(str(rc)) ** 2:
                    s6 = 1 / r2**3
                    total += 2 * (s6 * s6 - s6)  # half of 4 (s12 - s6): each pair is shared
        return float(total)


def test_melt_lattice_energy_equals_the_exact_lattice_sum():
    # LAMMPS's printed value differs from the exact sum by ~2e-11; float64 can do better.
    atoms = lj_melt(n_cells=5)
    got = ours(atoms, LennardJones(1.0, 1.0, 2.5), ("energy",))
    assert abs(got["energy"][0] / len(atoms) - exact_fcc_lattice_sum(0.8442, 2.5)) < 1e-13


@pytest.mark.slow
def test_full_32000_atom_melt_reproduces_the_lammps_energy_per_atom():
    atoms = lj_melt(n_cells=20)
    got = ours(atoms, LennardJones(1.0, 1.0, 2.5), ("energy",))
    assert len(atoms) == 32_000
    assert abs(got["energy"][0] / len(atoms) - LAMMPS_MELT_ENERGY_PER_ATOM) < 5e-11


def test_shift_changes_energy_by_the_pair_count_times_the_cutoff_energy():
    atoms = fcc_lattice(3, 1.6796)
    atoms.rattle(0.05, seed=2)
    plain = ours(atoms, LennardJones(1.0, 1.0, 2.5))
    shifted = ours(atoms, LennardJones(1.0, 1.0, 2.5, shift=True))
    n_pairs = len(ase_neighbor_list("i", atoms, 2.5)) / 2
    v_rc = 4.0 * (2.5**-12 - 2.5**-6)
    assert shifted["energy"][0] == pytest.approx(plain["energy"][0] - n_pairs * v_rc, rel=1e-12)
    np.testing.assert_allclose(shifted["forces"], plain["forces"], atol=1e-12)


def two_species_lattice():
    atoms = fcc_lattice(3, 1.6796)
    atoms.numbers[::3] = 36  # some Kr among the Ar
    atoms.rattle(0.05, seed=5)
    return atoms


def test_per_species_parameters_match_a_direct_pair_sum():
    atoms = two_species_lattice()
    species = (18, 36)
    sigma = np.array([[1.0, 1.1], [1.1, 1.25]])
    epsilon = np.array([[1.0, 1.3], [1.3, 1.6]])
    rc = 2.5
    got = ours(atoms, LennardJones(sigma, epsilon, rc, species=species))

    # Independent reference: ASE's pair list and the textbook formula.
    i, j, d, D = ase_neighbor_list("ijdD", atoms, rc)
    kind = np.searchsorted(species, atoms.numbers)
    s, e = sigma[kind[i], kind[j]], epsilon[kind[i], kind[j]]
    pair = 4 * e * ((s / d) ** 12 - (s / d) ** 6)
    dvdr = 4 * e * (-12 * s**12 / d**13 + 6 * s**6 / d**7)
    forces = np.zeros((len(atoms), 3))
    np.add.at(forces, i, (dvdr / d)[:, None] * D)  # each pair appears twice in the full list
    assert got["energy"][0] == pytest.approx(0.5 * pair.sum(), rel=1e-12)
    np.testing.assert_allclose(got["forces"], forces, atol=1e-9)


def test_uniform_species_table_equals_the_single_species_model():
    atoms = two_species_lattice()
    one = ours(atoms, LennardJones(1.0, 1.0, 2.5))
    table = ours(atoms, LennardJones([[1.0, 1.0], [1.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]], 2.5, species=(18, 36)))
    for key in one:
        np.testing.assert_allclose(table[key], one[key], atol=1e-12)


def test_the_wrapper_declares_the_pair_potential_preset():
    from jaxdd.spec import SPEC_LJ_HALO

    assert LennardJones().distribution_spec is SPEC_LJ_HALO


def test_atoms_of_an_unlisted_species_are_named():
    atoms = two_species_lattice()
    atoms.numbers[4] = 54
    model = LennardJones(1.0, 1.0, 2.5, species=(18, 36))
    with pytest.raises(ValueError, match=r"atoms \[4\].*\[54\]"):
        jaxdd.compute(model, jaxdd.AtomicData.from_ase(atoms), ("energy",))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma=-1.0), "sigma"),
        (dict(epsilon=0.0), "epsilon"),
        (dict(cutoff=0.0), "cutoff"),
        (dict(sigma=[[1.0, 2.0], [1.0, 1.0]], species=(1, 2)), "symmetric"),
        (dict(sigma=[1.0, 2.0]), "scalar"),
        (dict(species=(1, 1)), "distinct"),
        (dict(species=(1, 2.5)), "species must be an integer >= 1, got 2.5"),
    ],
)
def test_bad_parameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LennardJones(**kwargs)


def pair_energy_function(atoms, model_kw, half):
    """E(positions, sigma, epsilon) of the LennardJones model on ``atoms``' pairs, and the same
    energy written out from its textbook formula on the same pairs, both plain JAX functions."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from jaxdd.neighbors import edge_vectors, neighbor_list

    jax.config.update("jax_enable_x64", True)
    pos0 = jnp.asarray(atoms.positions)
    cell = jnp.asarray(atoms.cell[:][None])
    pbc = np.asarray(atoms.pbc)[None]
    batch = jnp.zeros(len(atoms), jnp.int32)
    z = jnp.asarray(atoms.numbers)
    nl, _ = neighbor_list(pos0, cell, pbc, cutoff=model_kw["cutoff"], half=half)

    base = LennardJones(1.0, 1.0, half_list=half, **model_kw)

    def ours(pos, sigma, epsilon):  # a model whose parameters are traced, as in training
        model = eqx.tree_at(lambda m: (m.sigma, m.epsilon), base, (jnp.asarray(sigma), jnp.asarray(epsilon)))
        return model.forward(pos, cell, batch, z, nl, 1)["energy"][0]

    def textbook(pos, sigma, epsilon):
        d2 = jnp.sum(edge_vectors(pos, cell, batch, nl) ** 2, axis=-1)
        keep = nl.mask & (d2 < model_kw["cutoff"] ** 2)
        d = jnp.sqrt(jnp.where(keep, d2, 1.0))
        pair = jnp.where(keep, 4 * epsilon * ((sigma / d) ** 12 - (sigma / d) ** 6), 0.0)
        return pair.sum() * (1.0 if half else 0.5)

    return ours, textbook, pos0


@pytest.mark.parametrize("half", [False, True])
def test_gradients_in_sigma_and_epsilon_equal_the_textbook_formulas(half):
    import jax

    atoms = fcc_lattice(3, 1.6796)
    atoms.rattle(0.08, seed=3)
    ours, textbook, pos = pair_energy_function(atoms, dict(cutoff=2.5), half)
    got = jax.grad(ours, argnums=(0, 1, 2))(pos, 1.05, 0.9)
    want = jax.grad(textbook, argnums=(0, 1, 2))(pos, 1.05, 0.9)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-12, atol=1e-12)


def test_second_derivatives_equal_the_textbook_formulas():
    import jax

    atoms = fcc_lattice(3, 1.6796)
    atoms.rattle(0.08, seed=4)
    ours, textbook, pos = pair_energy_function(atoms, dict(cutoff=2.5), True)
    v = np.random.default_rng(0).normal(size=pos.shape)

    def hvp(f):
        return jax.jvp(jax.grad(f), (pos, 1.05, 0.9), (v, 0.3, -0.2))[1]

    np.testing.assert_allclose(np.asarray(hvp(lambda p, s, e: ours(p, s, e))),
                               np.asarray(hvp(lambda p, s, e: textbook(p, s, e))), rtol=1e-10, atol=1e-10)
