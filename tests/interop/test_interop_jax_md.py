"""jax-md potentials, as jax-md users build them, run by jaxdd unchanged (jaxdd.interop.jax_md).

The references are jax-md's own evaluation: its neighbour list, its spaces, ``jax.grad`` of its
``energy_fn`` and ``quantity.stress``. Distributed runs are compared with ``jaxdd.compute``.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax_md = pytest.importorskip("jax_md", reason="jax-md is a test dependency (pip install -e '.[test]')")
from jax_md import energy, partition, quantity, space  # noqa: E402
from jax_md._nn import nequip  # noqa: E402

import jaxdd  # noqa: E402
from jaxdd.engine import DistributedModel, DomainConfig  # noqa: E402
from jaxdd.interop.jax_md import JaxMDModel  # noqa: E402

# jax-md's own neighbour search casts int64 into int32 arrays (its references, not jaxdd).
pytestmark = pytest.mark.filterwarnings("ignore:scatter inputs have incompatible types:FutureWarning")

FORMATS = {"Sparse": partition.Sparse, "OrderedSparse": partition.OrderedSparse, "Dense": partition.Dense}
SPECIES = (6, 8)  # atomic numbers of jax-md species 0 and 1
CUTOFF = 2.0


# ----------------------------------------------------------------------------- systems


def _crystal(n, a, cell_shape, seed=0):
    """A jittered simple-cubic crystal of n³ atoms, spacing ``a`` Å, in a (possibly skewed) cell."""
    rng = np.random.default_rng(seed)
    k = np.stack(np.meshgrid(*[np.arange(n)] * 3, indexing="ij"), -1).reshape(-1, 3)
    cell = np.asarray(cell_shape, float) * a * n
    frac = (k + 0.5 + rng.uniform(-0.1, 0.1, k.shape)) / n
    z = np.asarray(SPECIES)[rng.integers(0, 2, len(k))]
    return frac, frac @ cell, cell, z


def system(kind, n=6, a=1.6):
    """(jaxdd AtomicData, jax-md R, jax-md box or None, species ids) for a space kind."""
    if kind == "triclinic_fractional":
        frac, pos, cell, z = _crystal(n, a, [[1, 0, 0], [0.05, 1, 0], [0.03, -0.06, 1]])
        return jaxdd.AtomicData(positions=pos, atomic_numbers=z, cell=cell, pbc=[True] * 3), frac, cell.T, z
    if kind == "cubic":
        frac, pos, cell, z = _crystal(n, a, np.eye(3), seed=1)
        return jaxdd.AtomicData(positions=pos, atomic_numbers=z, cell=cell, pbc=[True] * 3), pos, cell.T, z
    frac, pos, cell, z = _crystal(n, a, np.eye(3), seed=2)  # free space: a cluster, no images
    vacuum = np.eye(3) * (pos.max() + 10.0)  # a box around the cluster: stress has a volume to refer to
    return jaxdd.AtomicData(positions=pos + 5.0, atomic_numbers=z, cell=vacuum, pbc=[False] * 3), pos + 5.0, None, z


def jax_md_space(kind, box):
    """The displacement a jax-md user writes for each space."""
    if kind == "triclinic_fractional":
        return space.periodic_general(jnp.asarray(box), fractional_coordinates=True)[0]
    if kind == "cubic":
        return space.periodic(jnp.asarray(box[0, 0]))[0]
    return space.free()[0]


def wrap(factory, kind, fmt, **kwargs):
    return JaxMDModel(factory, cutoff=CUTOFF, format=fmt, periodic=kind != "free",
                      fractional_coordinates=kind == "triclinic_fractional", species=SPECIES, **kwargs)


# ----------------------------------------------------------------------------- potentials
# Each is a factory (displacement, box, **jax-md options) -> (neighbor_fn, energy_fn), written
# as jax-md's documentation writes it; ``ids`` are the jax-md species of the user's system.

SIGMA = jnp.array([[1.0, 1.1], [1.1, 1.2]])
EPS = jnp.array([[1.0, 0.8], [0.8, 0.6]])


def lennard_jones(ids):
    return lambda d, box, **kw: energy.lennard_jones_neighbor_list(
        d, box, species=jnp.asarray(ids), sigma=SIGMA, epsilon=EPS, r_onset=1.3, r_cutoff=CUTOFF / 1.2, **kw)


def morse(ids):
    return lambda d, box, **kw: energy.morse_neighbor_list(
        d, box, species=jnp.asarray(ids), sigma=1.1, epsilon=EPS, alpha=jnp.array([[5.0, 4.0], [4.0, 6.0]]),
        r_onset=1.5, r_cutoff=CUTOFF, **kw)


def soft_sphere(ids):
    return lambda d, box, **kw: energy.soft_sphere_neighbor_list(
        d, box, species=jnp.asarray(ids), sigma=jnp.array([[1.6, 1.8], [1.8, CUTOFF]]), epsilon=EPS, alpha=2.5, **kw)


PAIR = {"lennard_jones": lennard_jones, "morse": morse, "soft_sphere": soft_sphere}


def _ids(z):
    return np.searchsorted(SPECIES, z)


def _box_size(kind, box):
    """The box a jax-md user gives its neighbour list: the lattice matrix, the side of a cube
    (space.periodic), or a box around the cluster in free space."""
    return {"triclinic_fractional": box, "cubic": None if box is None else box[0, 0]}.get(kind, 100.0)


def jax_md_reference(factory, kind, fmt, data, R, box, z):
    """jax-md's own energy, forces and stress (jaxdd's sign: ASE's) on its own neighbour list."""
    fractional = kind == "triclinic_fractional"
    d = jax_md_space(kind, box)
    box_size = _box_size(kind, box)
    # jax-md's cell list misses pairs in skewed cells (soft spheres in the triclinic cell here lose a
    # third of their energy with it, and its formats disagree); its all-pairs search is complete.
    neighbor_fn, energy_fn = factory(d, jnp.asarray(box_size), format=fmt, fractional_coordinates=fractional,
                                     disable_cell_list=True)
    R = jnp.asarray(R)
    nbr = neighbor_fn.allocate(R)

    @jax.jit  # one program, not one per operation
    def evaluate(R):
        e = energy_fn(R, nbr)
        f = -jax.grad(energy_fn)(R, nbr)  # jax-md's derivatives live in real space, fractional or not
        stress = None  # no cell in free space
        if kind != "free":
            stress = -quantity.stress(energy_fn, R, jnp.asarray(box_size), neighbor=nbr)
        return e, f, stress

    e, f, stress = evaluate(R)
    return float(e), np.asarray(f), stress


def assert_equal_to(ref, out, stress=True):
    e, f, s = ref
    assert abs(float(out["energy"][0]) - e) <= 1e-12 * abs(e)
    np.testing.assert_allclose(np.asarray(out["forces"]), f, rtol=0, atol=1e-10)
    if s is not None and stress:
        np.testing.assert_allclose(np.asarray(out["stress"][0]), np.asarray(s), rtol=0, atol=1e-10)


# ----------------------------------------------------------------------------- one device = jax-md

# Every potential on every space, the three formats rotating over them; the full product is slow.
ROTATION = [("lennard_jones", "triclinic_fractional", "Sparse"), ("morse", "cubic", "OrderedSparse"),
            ("soft_sphere", "free", "Dense")]
PRODUCT = [(p, k, f) for p in PAIR for k in ("triclinic_fractional", "cubic", "free") for f in FORMATS]


def _pair_case(name, kind, fmt):
    data, R, box, z = system(kind)
    ref = jax_md_reference(PAIR[name](_ids(z)), kind, FORMATS[fmt], data, R, box, z)
    out = jaxdd.compute(wrap(lambda d, b: PAIR[name](_ids(z))(d, b, format=FORMATS[fmt]), kind, fmt), data)
    assert_equal_to(ref, out)


@pytest.mark.parametrize("name, kind, fmt", ROTATION)
def test_pair_potential_through_compute_equals_jax_md(name, kind, fmt):
    _pair_case(name, kind, fmt)


@pytest.mark.slow
@pytest.mark.parametrize("name, kind, fmt", [c for c in PRODUCT if c not in ROTATION])
def test_pair_potential_through_compute_equals_jax_md_every_format(name, kind, fmt):
    _pair_case(name, kind, fmt)


# ----------------------------------------------------------------------------- jax-md's NequIP


def nequip_config():
    cfg = nequip.default_config()
    cfg.graph_net_steps, cfg.hidden_irreps, cfg.sh_irreps = 2, "8x0e + 4x1o", "1x0e + 1x1o"
    cfg.n_elements, cfg.r_max, cfg.shift, cfg.scale = len(SPECIES), CUTOFF, 0.3, 1.7
    cfg.radial_net_n_hidden, cfg.n_neighbors = 8, 6.0
    return cfg


@functools.lru_cache(maxsize=None)
def nequip_model(kind, n=4, a=1.3):
    """jaxdd data, jax-md's NequIP (random weights from its own init) as a jaxdd model, and what
    jax-md's own evaluation needs: (energy_fn, params, R, its neighbour list, one-hot atoms)."""
    data, R, box, z = system(kind, n=n, a=a)
    cfg = nequip_config()
    fractional = kind == "triclinic_fractional"
    d = jax_md_space(kind, box)
    neighbor_fn, init_fn, energy_fn = energy.nequip_neighbor_list(
        d, jnp.asarray(_box_size(kind, box)), cfg, fractional_coordinates=fractional, disable_cell_list=True)
    R = jnp.asarray(R)
    nbr = neighbor_fn.allocate(R)
    atoms = jax.nn.one_hot(_ids(z), len(SPECIES))
    init = jax.jit(lambda key: init_fn(key, R, nbr, atoms=atoms))  # one program, not one per operation
    params = jax.tree.map(lambda x: x.astype(jnp.float64), init(jax.random.PRNGKey(0)))
    model = wrap(lambda d, b: energy.nequip_neighbor_list(d, b, cfg), kind, "Sparse", species_as="atoms",
                 params=params)
    return data, model, (energy_fn, params, R, nbr, atoms)


def nequip_reference(kind, n=4, a=1.3):
    """jaxdd data, jax-md's NequIP as a jaxdd model, and jax-md's own energy and forces."""
    data, model, (energy_fn, params, R, nbr, atoms) = nequip_model(kind, n, a)
    e, g = jax.jit(jax.value_and_grad(energy_fn, argnums=1))(params, R, nbr, atoms=atoms)
    return data, model, (float(e), -np.asarray(g), None)


@pytest.mark.slow
def test_jax_md_nequip_through_compute_equals_jax_md():
    data, model, ref = nequip_reference("triclinic_fractional")
    assert_equal_to(ref, jaxdd.compute(model, data))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cubic", "free"])
def test_jax_md_nequip_through_compute_equals_jax_md_in_other_spaces(kind):
    data, model, ref = nequip_reference(kind)
    assert_equal_to(ref, jaxdd.compute(model, data))


# ----------------------------------------------------------------------------- distributed = one device


def assert_distributed_equals_one_device(model, data, grid):
    ref = jaxdd.compute(model, data)
    dist = DistributedModel(model, DomainConfig(cutoff=CUTOFF, grid=grid))
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxdd.DispatchWarning)
        warnings.simplefilter("ignore", RuntimeWarning)  # a ghost shell covering every atom of a small cell
        got = dist(data)
    e = float(ref["energy"][0])
    assert abs(float(got["energy"][0]) - e) <= 1e-10 * abs(e)
    np.testing.assert_allclose(np.asarray(got["forces"]), np.asarray(ref["forces"]), rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got["stress"]), np.asarray(ref["stress"]), rtol=0, atol=1e-9)
    assert not dist.dispatch_report.fallbacks
    return dist


@pytest.mark.parametrize("fmt, grid, kind", [("Sparse", (3, 2, 1), "triclinic_fractional"),
                                             pytest.param("OrderedSparse", (2, 2, 2), "cubic", marks=pytest.mark.slow),
                                             pytest.param("Dense", (4, 1, 1), "triclinic_fractional",
                                                          marks=pytest.mark.slow)])
def test_pair_potential_distributed_equals_one_device(fmt, grid, kind):
    data, _, _, z = system(kind, n=8)
    model = wrap(lambda d, b: morse(_ids(z))(d, b, format=FORMATS[fmt]), kind, fmt)
    assert_distributed_equals_one_device(model, data, grid)


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 2), (3, 2, 1), (4, 1, 1)])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", list(PAIR))
def test_every_pair_potential_distributed_on_every_grid_and_format(name, fmt, grid):
    data, _, _, z = system("triclinic_fractional", n=8)
    model = wrap(lambda d, b: PAIR[name](_ids(z))(d, b, format=FORMATS[fmt]), "triclinic_fractional", fmt)
    assert_distributed_equals_one_device(model, data, grid)


def test_jax_md_nequip_distributed_equals_one_device():
    """jax-md's own NequIP call, n_node = [N, 1] with its padding graph and the jnp.repeat
    readout, distributed with no change and no fallback."""
    data, model, _ = nequip_model("triclinic_fractional", n=6, a=1.3)
    dist = assert_distributed_equals_one_device(model, data, (2, 2, 2))
    assert dist.dispatch_report.counts.get("segment_reduce.add", 0) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(3, 2, 1), (4, 1, 1)])
def test_jax_md_nequip_distributed_on_uneven_grids(grid):
    data, model, _ = nequip_model("triclinic_fractional", n=6, a=1.3)
    assert_distributed_equals_one_device(model, data, grid)


# ----------------------------------------------------------------------------- dynamics


def velocity_verlet(model, data, dt, n_steps):
    """The one-device trajectory: velocity Verlet on jaxdd.compute's forces (ASE units: Å, amu, eV)."""
    x, v = np.asarray(data.positions), np.asarray(data.velocities)
    m = np.asarray(data.masses)[:, None]
    f = np.asarray(jaxdd.compute(model, data, outputs=["forces"])["forces"])
    for _ in range(n_steps):
        v = v + 0.5 * dt * f / m
        x = x + dt * v
        f = np.asarray(jaxdd.compute(model, data.replace(positions=x), outputs=["forces"])["forces"])
        v = v + 0.5 * dt * f / m
    return x


@pytest.mark.slow
def test_domain_parallel_trajectory_of_a_jax_md_potential_equals_one_device():
    data, _, _, z = system("cubic", n=8)
    model = wrap(lambda d, b: morse(_ids(z))(d, b, format=partition.Sparse), "cubic", "Sparse", skin=0.3)
    rng = np.random.default_rng(3)
    data = data.replace(velocities=rng.normal(0.0, 0.02, (len(z), 3)), masses=np.full(len(z), 12.0))
    md = jaxdd.DomainParallel(DistributedModel(model, DomainConfig(CUTOFF, skin=0.3, grid=(2, 2, 1))),
                              jaxdd.VelocityVerlet(0.05))
    state = md.run(md.init(data), 100)
    np.testing.assert_allclose(np.asarray(md.gather(state).positions), velocity_verlet(model, data, 0.05, 100),
                               rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- errors


def _morse_model(kind="cubic", **kwargs):
    return wrap(lambda d, b: morse(np.zeros(2, int))(d, b, format=partition.Sparse), kind, "Sparse", **kwargs)


def test_a_cell_narrower_than_twice_the_cutoff_is_refused_with_the_numbers():
    data, _, _, _ = system("cubic", n=2)
    with pytest.raises(ValueError, match=r"wide across lattice vector 0.*twice the cutoff \(2 Å\).*repeat the cell"):
        jaxdd.compute(_morse_model(), data)


def test_a_periodic_system_given_to_a_free_space_potential_is_refused():
    data, _, _, _ = system("cubic")
    with pytest.raises(ValueError, match=r"pbc is \[True, True, True\].*periodic=False.*space.free"):
        jaxdd.compute(_morse_model("free"), data)


def test_an_atom_outside_the_species_is_named():
    data, _, _, _ = system("cubic")
    z = np.asarray(data.atomic_numbers).copy()
    z[5] = 1
    with pytest.raises(ValueError, match=r"atoms \[5\] have atomic numbers \[1\] outside .* \(6, 8\)"):
        jaxdd.compute(_morse_model(), data.replace(atomic_numbers=z))


def test_a_factory_with_weights_needs_params():
    with pytest.raises(ValueError, match="pass params="):
        JaxMDModel(lambda d, b: energy.nequip_neighbor_list(d, b, nequip_config()), cutoff=CUTOFF,
                   species=SPECIES, species_as="atoms")


def test_a_factory_that_returns_something_else_is_refused():
    with pytest.raises(ValueError, match=r"must return \(neighbor_fn, energy_fn\)"):
        JaxMDModel(lambda d, b: energy.morse, cutoff=CUTOFF)


def test_a_jax_md_list_handed_to_the_potential_cannot_update_itself():
    data, _, _, z = system("cubic")
    seen = {}

    def factory(d, box):
        neighbor_fn, energy_fn = morse(_ids(z))(d, box, format=partition.Sparse)

        def spy(R, neighbor, **kwargs):
            seen["neighbor"] = neighbor
            return energy_fn(R, neighbor, **kwargs)
        return neighbor_fn, spy

    jaxdd.compute(wrap(factory, "cubic", "Sparse"), data, outputs=["energy"])
    with pytest.raises(RuntimeError, match="jaxdd builds, rebuilds and grows the neighbour list"):
        seen["neighbor"].update(data.positions)


# ----------------------------------------------------------------------------- the rest of jaxdd


@pytest.mark.slow
def test_a_jax_md_potential_passes_trace_and_validate_with_no_fix():
    from jaxdd.validate import trace_and_validate

    data, _, _, z = system("triclinic_fractional", n=6)
    report = trace_and_validate(
        lambda: wrap(lambda d, b: morse(_ids(z))(d, b, format=partition.Sparse), "triclinic_fractional", "Sparse"),
        data, world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok and report.fix_applied is None, report.summary()


def test_a_jax_md_potential_drives_ase_through_the_calculator():
    from jaxdd.interop.ase import Calculator

    data, _, _, z = system("cubic")
    # The model of test_pair_potential_through_compute_equals_jax_md's morse case: ``ref`` is its program.
    model = wrap(lambda d, b: morse(_ids(z))(d, b, format=partition.OrderedSparse), "cubic", "OrderedSparse")
    atoms = data.to_ase()
    atoms.calc = Calculator(model)
    ref = jaxdd.compute(model, data)
    assert abs(atoms.get_potential_energy() - float(ref["energy"][0])) <= 1e-10 * abs(float(ref["energy"][0]))
    np.testing.assert_allclose(atoms.get_forces(), np.asarray(ref["forces"]), rtol=0, atol=1e-10)
