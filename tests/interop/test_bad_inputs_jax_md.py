"""A jax-md potential wrapped with a cutoff shorter than its own interaction range is refused.

jaxdd's neighbour list holds the pairs closer than ``cutoff``; a jax-md potential reaching
further would silently lose the rest (Lennard-Jones with ``r_cutoff=2.5`` σ wrapped with
``cutoff=1.5`` loses every pair between 1.5 and 2.5). The range is read from the arguments of jax-md's own
factories (given as the factory or a ``functools.partial`` of it), as jax_md/energy.py defines
it: ``r_cutoff × max(sigma)`` for Lennard-Jones, ``r_cutoff`` for Morse, ``max(sigma)`` for
soft spheres, ``cutoff`` for Stillinger-Weber; through ``functools.wraps`` wrappers and partials of
them too. A lambda hides its arguments: its range is not guessed, and a ``RangeUnreadWarning``
asks for ``interaction_range=``.
"""

import functools
import re

import jax.numpy as jnp
import numpy as np
import pytest

jax_md = pytest.importorskip("jax_md", reason="jax-md is a test dependency (pip install -e '.[test]')")
from jax_md import energy, partition, space  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.interop.jax_md import JaxMDModel, RangeUnreadWarning  # noqa: E402

# jax-md's own neighbour search casts int64 into int32 arrays (its references, not jaxdd).
pytestmark = pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")

SIGMA2 = jnp.array([[1.0, 1.1], [1.1, 1.2]])  # a per-species σ: its largest, 1.2, scales Lennard-Jones

# (factory, its range as jax-md defines it, a cutoff short of it)
SHORT = {
    "lennard_jones": (functools.partial(energy.lennard_jones_neighbor_list, sigma=1.0, r_cutoff=2.5), 2.5, 1.5),
    "lennard_jones_sigma": (functools.partial(energy.lennard_jones_neighbor_list, sigma=SIGMA2, r_cutoff=2.0),
                            2.4, 2.2),  # longer than r_cutoff, shorter than r_cutoff × σ
    "morse": (functools.partial(energy.morse_neighbor_list, sigma=1.0, r_onset=1.5, r_cutoff=2.0), 2.0, 1.8),
    "soft_sphere": (functools.partial(energy.soft_sphere_neighbor_list, sigma=SIGMA2), 1.2, 1.0),
}


def _numbers(message):
    return {float(x) for x in re.findall(r"\d+(?:\.\d+)?", message)}


@pytest.mark.parametrize("name", list(SHORT))
def test_a_cutoff_shorter_than_the_pair_potentials_range_is_refused_with_both_numbers(name):
    factory, reach, cutoff = SHORT[name]
    with pytest.raises(ValueError, match=rf"cutoff={cutoff:g} is shorter than .* interaction range, {reach:g}") as e:
        JaxMDModel(factory, cutoff=cutoff, periodic=False)
    assert f"Pass cutoff >= {reach:g}" in str(e.value)
    assert {cutoff, reach} <= _numbers(str(e.value))


def test_a_bare_jax_md_factory_is_read_with_its_defaults():
    """energy.lennard_jones_neighbor_list itself: r_cutoff=2.5 of σ=1, jax-md's defaults."""
    with pytest.raises(ValueError, match=r"cutoff=2 is shorter .* 2\.5 \(energy\.lennard_jones_neighbor_list: "
                                         r"r_cutoff × max\(sigma\) = 2\.5 × 1\)"):
        JaxMDModel(energy.lennard_jones_neighbor_list, cutoff=2.0, periodic=False)


def test_morse_r_cutoff_is_a_distance_not_scaled_by_sigma():
    model = JaxMDModel(functools.partial(energy.morse_neighbor_list, sigma=1.5, r_cutoff=2.0), cutoff=2.0,
                       periodic=False)
    assert model.interaction_range == 2.0


# ----------------------------------------------------------------------------- equal or longer: jax-md's energy


def _cluster(n=4, a=1.1, seed=0):
    """A jittered simple-cubic cluster of n³ atoms in free space (no images)."""
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    pos = (k + rng.uniform(-0.08, 0.08, k.shape)) * a + 5.0
    return pos, np.eye(3) * (pos.max() + 10.0)


def _jax_md_energy(factory, pos):
    neighbor_fn, energy_fn = factory(space.free()[0], 100.0, disable_cell_list=True)
    R = jnp.asarray(pos)
    return float(energy_fn(R, neighbor_fn.allocate(R)))


# (factory, cutoff): equal to the range (Lennard-Jones 2.0/1.2 × 1.2 is 2.0 only up to rounding), longer
EQUAL_OR_LONGER = {
    "lennard_jones_equal": (functools.partial(energy.lennard_jones_neighbor_list, sigma=SIGMA2, r_onset=1.3,
                                              r_cutoff=2.0 / 1.2, species=jnp.zeros(64, int),
                                              format=partition.Sparse), 2.0),
    "morse_longer": (functools.partial(energy.morse_neighbor_list, sigma=1.1, r_onset=1.5, r_cutoff=2.0,
                                       format=partition.Sparse), 2.6),
}


@pytest.mark.parametrize("name", list(EQUAL_OR_LONGER))
def test_a_cutoff_equal_to_or_longer_than_the_range_gives_jax_mds_energy(name):
    factory, cutoff = EQUAL_OR_LONGER[name]
    pos, cell = _cluster()
    assert jnp.asarray(0.0).dtype == jnp.float64  # conftest enables x64
    data = jaxdd.AtomicData(positions=pos, atomic_numbers=np.full(len(pos), 6), cell=cell, pbc=[False] * 3)
    model = JaxMDModel(factory, cutoff=cutoff, format=partition.Sparse, periodic=False)
    e = float(jaxdd.compute(model, data, outputs=["energy"])["energy"][0])
    ref = _jax_md_energy(factory, pos)
    assert ref < 0.0 and abs(e - ref) <= 1e-10 * abs(ref)


# ----------------------------------------------------------------------------- ranges that cannot be read


def _lj_lambda(d, box):
    return energy.lennard_jones_neighbor_list(d, box, sigma=1.0, r_cutoff=2.5, format=partition.Sparse)


def test_a_lambdas_range_is_not_guessed_and_a_warning_asks_for_it():
    """A lambda hides jax-md's arguments until it runs: cutoff is taken as given, not in silence."""
    with pytest.warns(RangeUnreadWarning, match=r"cannot read the interaction range of the factory .*<lambda>.*"
                                                 r"cutoff=1\.5 is taken as given.*Pass interaction_range="):
        model = JaxMDModel(lambda d, b: _lj_lambda(d, b), cutoff=1.5, format=partition.Sparse, periodic=False)
    assert model.interaction_range is None


def _users_lj(displacement, box, **kwargs):
    """A wrapper of the user's own, handing its arguments on to jax-md's factory."""
    return energy.lennard_jones_neighbor_list(displacement, box, **kwargs)


def test_a_partial_of_a_wraps_wrapper_is_read_through_the_wrapper():
    # functools.partial(_users_lj, ...) used to pass cutoff=1.5 against a range of 2.5 without a word.
    @functools.wraps(energy.lennard_jones_neighbor_list)
    def wrapper(displacement, box, **kwargs):
        return _users_lj(displacement, box, **kwargs)

    factory = functools.partial(wrapper, sigma=1.0, r_cutoff=2.5, format=partition.Sparse)
    with pytest.raises(ValueError, match=r"cutoff=1\.5 is shorter .* 2\.5 \(energy\.lennard_jones_neighbor_list"):
        JaxMDModel(factory, cutoff=1.5, format=partition.Sparse, periodic=False)


def test_a_partial_of_a_plain_wrapper_warns_that_its_range_is_unread():
    factory = functools.partial(_users_lj, sigma=1.0, r_cutoff=2.5, format=partition.Sparse)
    with pytest.warns(RangeUnreadWarning, match=r"_users_lj"):
        JaxMDModel(factory, cutoff=1.5, format=partition.Sparse, periodic=False)


def test_a_partial_of_stillinger_weber_is_range_checked():
    # Its cutoff is a distance (3.77118 Å = 1.8 σ by default), the radius of its own list.
    factory = functools.partial(energy.stillinger_weber_neighbor_list, cutoff=3.77118)
    with pytest.raises(ValueError, match=r"cutoff=3 is shorter .* 3\.77118 \(energy\.stillinger_weber_neighbor_list"):
        JaxMDModel(factory, cutoff=3.0, format=partition.Dense, periodic=False)
    assert JaxMDModel(factory, cutoff=3.8, format=partition.Dense, periodic=False).interaction_range == 3.77118


def test_a_declared_interaction_range_is_checked():
    with pytest.raises(ValueError, match=r"cutoff=1\.5 is shorter .* 2\.5 \(declared as interaction_range=2\.5\)"):
        JaxMDModel(lambda d, b: _lj_lambda(d, b), cutoff=1.5, format=partition.Sparse, periodic=False,
                   interaction_range=2.5)


def test_a_declared_range_must_agree_with_the_one_read():
    with pytest.raises(ValueError, match=r"interaction_range=1\.5 disagrees with the range read .*, 2\.5"):
        JaxMDModel(SHORT["lennard_jones"][0], cutoff=1.5, periodic=False, interaction_range=1.5)


# ----------------------------------------------------------------------------- a cell that shrinks


def _periodic_lj():
    return JaxMDModel(functools.partial(energy.lennard_jones_neighbor_list, sigma=1.0, epsilon=1.0, r_cutoff=2.5),
                      cutoff=2.5, periodic=True)


def test_a_barostat_shrinking_the_cell_to_twice_the_cutoff_stops_the_run_naming_step_cell_and_limit():
    # The 108-atom melt is 5.04 σ wide, just over 2 × 2.5 σ, at a pressure far below the target:
    # the barostat compresses it, and jax-md's minimum image would then miss images silently.
    from jaxdd.data.systems import lj_melt_data
    from jaxdd.dynamics import DomainParallel, MTKBarostat

    dm = jaxdd.DistributedModel(_periodic_lj(), jaxdd.DomainConfig(2.5, skin=0.3, grid=(1, 1, 1)))
    md = DomainParallel(dm, MTKBarostat(dt=0.005, temperature=1.44, pressure=1.0, t_period=0.5, p_period=0.5, kB=1.0),
                        kB=1.0)
    with pytest.raises(RuntimeError, match=r"step (\d+) would bring a periodic width of the cell to 5 Å or less, twice "
                                           r"JaxMDModel's minimum-image cutoff \(2\.5 Å\).*MTKBarostat to \[\[.*at step "
                                           r"\d+; the state passed to run\(\) is unchanged"):
        md.run(md.init(lj_melt_data(3, temperature=1.44, dtype=np.float64)), 400)


def test_a_cell_that_lammps_shrank_is_checked_at_the_call_that_brings_it():
    import jax

    from jaxdd.engine import default_mesh
    from jaxdd.lammps.evaluator import ForceEvaluator

    evaluate = ForceEvaluator(_periodic_lj(), skin=0.3, mesh=default_mesh(jax.devices()[:1]))
    with pytest.raises(ValueError, match=r"the cell LAMMPS passed at call 1 is 4\.9 Å wide across lattice vector 0, "
                                         r"not wider than twice the cutoff \(2\.5 Å\)"):
        evaluate(np.arange(1, 3), np.array([[0.0, 0.0, 0.0], [1.1, 0.0, 0.0]]), np.array([18, 18]),
                 np.diag([4.9, 6.0, 6.0]))
