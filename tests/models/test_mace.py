"""Specification of ``jaxdd.models.mace``: MACE in JAX, built natively or read from mace-torch.

The references are three mace-torch models and their energies, forces and stress on six
systems (``tests/data/mace/make_reference.py``, which needs torch and mace-torch; the files it
wrote are read here without either). Where torch and mace-torch are installed, the live tests
also rebuild the models and compare against them directly.
"""

import functools
import importlib.util
import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ase import Atoms
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import DistributedModel, DomainConfig
from jaxdd.models.mace import INTERACTIONS, MACE, UnsupportedModel

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

DATA = pathlib.Path(__file__).parents[1] / "data" / "mace"
MODELS = ("residual", "plain", "trained")
PERIODIC = ("cubic", "triclinic", "slab", "batch")  # every system has a cell: stress is defined
FREE = ("molecule", "isolated")
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("mace") is not None
needs_torch = pytest.mark.skipif(not HAVE_TORCH, reason="torch and mace-torch are not installed "
                                 "(pip install torch==2.13.0 mace-torch): live comparison skipped")


@functools.lru_cache(maxsize=None)
def reference():
    with np.load(DATA / "reference.npz") as f:
        return {k: f[k] for k in f.files}


def systems(name, ref=None):
    """The ase.Atoms of reference system ``name`` (two for "batch"), read from ``ref`` (the
    stored arrays; default :func:`reference`)."""
    ref = reference() if ref is None else ref
    out, k = [], 0
    while f"system/{name}/{k}/numbers" in ref:
        p = f"system/{name}/{k}/"
        out.append(Atoms(numbers=ref[p + "numbers"], positions=ref[p + "positions"], cell=ref[p + "cell"],
                         pbc=ref[p + "pbc"]))
        k += 1
    return out


def expected(model, names):
    """Reference energy [S], forces [V, 3], stress [S, 3, 3] of the systems ``names`` in a row."""
    ref = reference()
    return {key: np.concatenate([ref[f"{model}/{n}/{key}"] for n in names]) for key in ("energy", "forces", "stress")}


@functools.lru_cache(maxsize=None)
def converted(model, dtype=jnp.float64):
    return MACE.from_torch(DATA / f"{model}.npz", dtype=dtype)


def evaluate(model, names, dtype=jnp.float64):
    atoms = [a for n in names for a in systems(n)]
    outputs = ("energy", "forces", "stress") if all(a.cell.rank == 3 for a in atoms) else ("energy", "forces")
    out = jaxdd.compute(converted(model, dtype), jaxdd.Batch.from_ase(atoms, dtype=dtype), outputs)
    return {k: np.asarray(v) for k, v in out.items()}


def assert_equal_to_reference(got, want, e_rtol=1e-10, atol=1e-9):
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=e_rtol, atol=0, err_msg="energy")
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=atol, err_msg="forces")
    if "stress" in got:
        np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=atol, err_msg="stress")


# ----------------------------------------------------------------------------- converted = mace-torch


@pytest.mark.parametrize("model", MODELS)
def test_converted_model_equals_mace_torch_on_the_periodic_systems(model):
    assert_equal_to_reference(evaluate(model, PERIODIC), expected(model, PERIODIC))


@pytest.mark.parametrize("model", ["trained", pytest.param("plain", marks=pytest.mark.slow),
                                   pytest.param("residual", marks=pytest.mark.slow)])
def test_converted_model_equals_mace_torch_on_a_molecule_and_an_atom_without_neighbours(model):
    assert_equal_to_reference(evaluate(model, FREE), expected(model, FREE))


@pytest.mark.slow
@pytest.mark.parametrize("system", PERIODIC + FREE)
@pytest.mark.parametrize("model", MODELS)
def test_converted_model_equals_mace_torch_on_each_system_alone(model, system):
    assert_equal_to_reference(evaluate(model, (system,)), expected(model, (system,)))


@pytest.mark.slow
def test_float32_model_is_close_to_mace_torch_in_float64():
    got = evaluate("trained", PERIODIC, jnp.float32)
    assert got["forces"].dtype == np.float32
    assert_equal_to_reference(got, expected("trained", PERIODIC), e_rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- reading models


def test_the_configuration_is_read_from_the_model():
    m = converted("residual")
    assert m.species == (1, 6, 8)
    assert m.model_config.neighbor_config.cutoff == 5.0
    assert (m.max_ell, m.num_interactions, m.correlation) == (3, 2, (3, 3))
    assert m.interactions == (INTERACTIONS[0],) * 2
    assert converted("plain").interactions == (INTERACTIONS[1],) * 2
    np.testing.assert_allclose(m.params["atomic_energies"], [-1.2, -3.4, -5.6])
    assert (float(m.params["scale"]), float(m.params["shift"])) == (1.3, -0.2)


def _export_with(tmp_path, **changes):
    """The residual model's file with its configuration changed."""
    import json

    with np.load(DATA / "residual.npz") as f:
        arrays = {k: f[k] for k in f.files}
    config = json.loads(str(arrays["__config__"]))
    config.update(changes)
    arrays["__config__"] = json.dumps(config)
    path = tmp_path / "changed.npz"
    np.savez(path, **arrays)
    return path


def test_an_unsupported_interaction_block_is_refused_by_name(tmp_path):
    path = _export_with(tmp_path, interaction="RealAgnosticAttResidualInteractionBlock")
    with pytest.raises(ValueError, match="RealAgnosticAttResidualInteractionBlock"):
        MACE.from_torch(path)


def test_weights_that_do_not_fit_the_configuration_are_refused_with_their_name(tmp_path):
    path = _export_with(tmp_path, hidden_irreps="32x0e + 32x1o")
    with pytest.raises(UnsupportedModel, match="node_embedding.linear.weight"):
        MACE.from_torch(path)


def test_a_npz_that_is_not_an_export_is_refused_with_what_to_do(tmp_path):
    np.savez(tmp_path / "weights.npz", w=np.zeros(3))
    with pytest.raises(ValueError, match="not a MACE export.*export_torch"):
        MACE.from_torch(tmp_path / "weights.npz")


def test_an_unsupported_model_class_is_refused_by_name():
    from jaxdd.models.mace.torch_import import read

    fake = type("AtomicDipolesMACE", (), {})()
    with pytest.raises(UnsupportedModel, match="AtomicDipolesMACE"):
        read(fake)


# ----------------------------------------------------------------------------- a model built in JAX


@functools.lru_cache(maxsize=None)
def native():
    return MACE((1, 6, 8), 4.0, hidden_irreps="8x0e + 8x1o", mlp_irreps="8x0e", radial_mlp=(16,),
                correlation=(3, 2), atomic_energies=(-1.0, -2.0, -3.0), seed=3)


def test_a_native_model_is_invariant_under_rotation_and_its_forces_rotate():
    mol = systems("molecule")[0]
    q, r = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r))
    q = q * np.sign(np.linalg.det(q))
    turned = mol.copy()
    turned.positions = mol.positions @ q.T
    a = jaxdd.compute(native(), jaxdd.AtomicData.from_ase(mol), ("energy", "forces"))
    b = jaxdd.compute(native(), jaxdd.AtomicData.from_ase(turned), ("energy", "forces"))
    np.testing.assert_allclose(b["energy"], a["energy"], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(b["forces"]), np.asarray(a["forces"]) @ q.T, atol=1e-10)
    assert np.abs(np.asarray(a["forces"])).max() > 1e-3


def test_a_native_model_is_reproducible_from_its_seed_and_differs_between_seeds():
    again = MACE((1, 6, 8), 4.0, hidden_irreps="8x0e + 8x1o", mlp_irreps="8x0e", radial_mlp=(16,),
                 correlation=(3, 2), atomic_energies=(-1.0, -2.0, -3.0), seed=3)
    leaves = jax.tree_util.tree_leaves(native().params), jax.tree_util.tree_leaves(again.params)
    assert all(np.array_equal(x, y) for x, y in zip(*leaves))
    other = MACE((1, 6, 8), 4.0, hidden_irreps="8x0e + 8x1o", mlp_irreps="8x0e", radial_mlp=(16,),
                 correlation=(3, 2), seed=4)
    assert not np.array_equal(other.params["embedding"], native().params["embedding"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(hidden_irreps="16x0e + 8x1o"), "one multiplicity"),
    (dict(hidden_irreps="16x1o"), "start with scalars"),
    (dict(interaction="RealAgnosticAttResidualInteractionBlock"), "RealAgnosticAttResidualInteractionBlock"),
    (dict(correlation=(3, 3, 3)), "one order per interaction"),
    (dict(atomic_energies=(1.0,)), "atomic_energies"),
    (dict(mlp_irreps="8x1o"), "mlp_irreps"),
])
def test_bad_constructor_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MACE((1, 6, 8), 4.0, **kwargs)


def test_species_the_model_does_not_know_are_named():
    with pytest.raises(ValueError, match="not in MACE species"):
        jaxdd.compute(native(), jaxdd.AtomicData.from_ase(Atoms("CN", positions=[[0, 0, 0], [1.2, 0, 0]])),
                      ("energy",))


# ----------------------------------------------------------------------------- distributed


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def crystal(seed: int = 7, close_pairs: int = 0):
    """216 atoms of jittered diamond-lattice H/C/O, 10.8 Å cubic cell; ``close_pairs`` of them
    (atoms 0, 8, 16, ...) have their nearest neighbour pulled in to 1.0 Å (ZBL acts there)."""
    from ase.build import bulk

    rng = np.random.default_rng(seed)
    atoms = bulk("C", "diamond", a=3.6, cubic=True).repeat(3)
    atoms.numbers = rng.choice([1, 6, 8], len(atoms))
    atoms.positions += rng.normal(0, 0.1, atoms.positions.shape)
    for i in range(0, 8 * close_pairs, 8):
        d = atoms.get_distances(i, range(len(atoms)), mic=True, vector=True)
        r = np.linalg.norm(d, axis=1)
        r[i] = np.inf
        j = int(np.argmin(r))
        atoms.positions[j] -= d[j] * (1 - 1.0 / r[j])
    return jaxdd.AtomicData.from_ase(atoms)


@functools.lru_cache(maxsize=None)
def one_device():
    out = jaxdd.compute(converted("trained"), crystal(), ("energy", "forces", "stress"))
    return {k: np.asarray(v) for k, v in out.items()}


# Slow: the default set runs the same layers and blocked edge sums distributed through SevenNet
# (tests/models/test_sevennet.py), a model of the published size.
@pytest.mark.parametrize("grid", [pytest.param(g, marks=pytest.mark.slow)
                                  for g in ((2, 1, 1), (3, 2, 1), (2, 2, 2), (4, 1, 1))],
                         ids=lambda g: "x".join(map(str, g)))
def test_distributed_converted_model_equals_one_device(grid):
    grid_ids = tuple(grid)
    dm = DistributedModel(converted("trained"), DomainConfig(5.0, mesh=mesh_of(math.prod(grid_ids)), grid=grid_ids))
    got = {k: np.asarray(v) for k, v in dm(crystal(), outputs=("energy", "forces", "stress")).items()}
    want = one_device()
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)
    assert dm.dispatch_report.fallbacks == []


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_converted_model_passes_the_validator(world_size):
    from jaxdd.validate import trace_and_validate

    report = trace_and_validate(lambda: converted("trained"), crystal(), world_size=world_size, atol=1e-9,
                                rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None


@pytest.mark.slow
def test_domain_parallel_trajectory_equals_one_device():
    from ase.units import fs

    from jaxdd.dynamics import DomainParallel, VelocityVerlet

    dt, n_steps = 0.5 * fs, 20
    model = converted("trained")
    data = crystal()
    rng = np.random.default_rng(1)
    from ase.data import atomic_masses

    masses = atomic_masses[np.asarray(data.atomic_numbers)]
    velocities = rng.normal(0, 1, (data.n_atoms, 3)) * np.sqrt(0.025 / masses)[:, None]  # ~300 K
    data = data.replace(velocities=jnp.asarray(velocities), masses=jnp.asarray(masses))
    # Two ranks: on a 10.8 Å cell every rank's ghost shell holds nearly the whole system, so
    # more ranks would only repeat the same work on two cores.
    md = DomainParallel(DistributedModel(model, DomainConfig(5.0, skin=0.5, mesh=mesh_of(2), grid=(2, 1, 1))),
                        VelocityVerlet(dt))
    got = md.gather(md.run(md.init(data), n_steps))

    pos, vel = np.asarray(data.positions), velocities
    cap = jaxdd.neighbor_capacity(pos, data.cell, data.pbc, cutoff=5.0, headroom=1.5)

    def forces(x):
        return np.asarray(jaxdd.compute(model, data.replace(positions=jnp.asarray(x)), ("forces",),
                                        capacity=cap)["forces"])

    f = forces(pos)
    for _ in range(n_steps):
        vel = vel + 0.5 * dt * f / masses[:, None]
        pos = pos + dt * vel
        f = forces(pos)
        vel = vel + 0.5 * dt * f / masses[:, None]
    np.testing.assert_allclose(np.asarray(got.positions), pos, rtol=0, atol=1e-9)
    np.testing.assert_allclose(np.asarray(got.velocities), vel, rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- live mace-torch


@needs_torch
def test_live_mace_torch_models_reproduce_the_stored_references():
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import sys

    import torch

    sys.path.insert(0, str(DATA))
    import make_reference

    torch.set_default_dtype(torch.float64)
    model = make_reference.build_model("RealAgnosticResidualInteractionBlock", 1)
    e, f, s = make_reference.evaluate(model, systems("triclinic"))
    want = expected("residual", ("triclinic",))
    np.testing.assert_allclose(e, want["energy"], rtol=1e-12)
    np.testing.assert_allclose(f, want["forces"], atol=1e-12)
    got = jaxdd.compute(MACE.from_torch(model), jaxdd.Batch.from_ase(systems("triclinic")),
                        ("energy", "forces", "stress"))
    assert_equal_to_reference({k: np.asarray(v) for k, v in got.items()}, {"energy": e, "forces": f, "stress": s})


@needs_torch
@pytest.mark.parametrize("change, name", [
    (dict(interaction="RealAgnosticAttResidualInteractionBlock"), "RealAgnosticAttResidualInteractionBlock"),
    (dict(use_agnostic_product=True), "use_agnostic_product"),
    (dict(keep_last_layer_irreps=True), "keep_last_layer_irreps"),
    (dict(heads=["a", "b"], atomic_energies=np.zeros((2, 2))), r"2 heads \['a', 'b'\].*head="),
])
def test_live_unsupported_mace_torch_variants_are_refused_by_name(change, name):
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch
    from e3nn import o3
    from mace import modules

    torch.set_default_dtype(torch.float64)
    cls = getattr(modules, change.pop("interaction", "RealAgnosticResidualInteractionBlock"))
    kwargs = dict(r_max=4.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=2, interaction_cls=cls,
                  interaction_cls_first=cls, num_interactions=2, num_elements=2,
                  hidden_irreps=o3.Irreps("4x0e + 4x1o"), MLP_irreps=o3.Irreps("4x0e"),
                  atomic_energies=np.zeros(2), avg_num_neighbors=4.0, atomic_numbers=[1, 8], correlation=2,
                  gate=torch.nn.functional.silu, atomic_inter_scale=1.0, atomic_inter_shift=0.0,
                  radial_MLP=[8])
    kwargs.update(change)
    model = modules.ScaleShiftMACE(**kwargs)
    with pytest.raises(UnsupportedModel, match=name):
        MACE.from_torch(model)


@needs_torch
def test_live_a_saved_model_file_and_a_state_dict_with_its_configuration_convert(tmp_path):
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import sys

    import torch

    sys.path.insert(0, str(DATA))
    import make_reference

    torch.set_default_dtype(torch.float64)
    model = make_reference.build_model("RealAgnosticInteractionBlock", 2)
    torch.save(model, tmp_path / "plain.model")
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    data = jaxdd.Batch.from_ase(systems("cubic"))
    want = np.asarray(jaxdd.compute(converted("plain"), data, ("energy",))["energy"])
    got = np.asarray(jaxdd.compute(MACE.from_torch(tmp_path / "plain.model"), data, ("energy",))["energy"])
    np.testing.assert_allclose(got, want, rtol=1e-12)
    with pytest.raises(ValueError, match="state dict"):
        MACE.from_torch(tmp_path / "plain.pt")
