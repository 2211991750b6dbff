"""Specification of ``jaxdd.models.mace`` on the architectures of the MACE foundation models:
ZBL pair repulsion, the Agnesi and Soft distance transforms, density-normalised and non-linear
interaction blocks, several heads, the Gaussian and Chebyshev bases, ``edge_irreps``,
``apply_cutoff=False`` and the biased readout.

The references are reduced-width mace-torch models of each family and their energies, forces
and stress (every head) on the systems of ``reference.npz`` and on a cell with close pairs
(``tests/data/mace/make_reference.py families``; read here without torch). ``old036`` is a file
pickled by mace-torch 0.3.6, read by the current mace-torch, against 0.3.6's own numbers.
"""

import functools
import importlib.util
import math
import pathlib

import numpy as np
import pytest

import jaxdd
from jaxdd import DistributedModel, DomainConfig
from jaxdd.models.mace import MACE, UnsupportedModel
from jaxdd.models.mace import radial as rad

import test_mace
from test_mace import mesh_of

pytestmark = pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")

DATA = pathlib.Path(__file__).parents[1] / "data" / "mace"
# (file, head) of every model the references hold; head None: a model with one head.
MODELS = [("mp0b3", None), ("mpa0", None), ("twohead", "pt_head"), ("twohead", "default"),
          ("options", "pt_head"), ("options", "default"), ("chebyshev", None), ("mh", "pt_head"),
          ("mh", "default"), ("old036", None)]
SYSTEMS = ("close", "cubic", "triclinic", "slab", "batch", "molecule", "isolated")
HAVE_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("mace") is not None


def model_id(m):
    return m[0] if m[1] is None else f"{m[0]}:{m[1]}"


@functools.lru_cache(maxsize=None)
def reference():
    out = {}
    for name in ("reference.npz", "families.npz"):
        with np.load(DATA / name) as f:
            out.update({k: f[k] for k in f.files})
    return out


def systems(name):
    """The ase.Atoms of stored system ``name``, ``families.npz``'s ``close`` cell included."""
    return test_mace.systems(name, reference())


@functools.lru_cache(maxsize=None)
def converted(file, head):
    return MACE.from_torch(DATA / f"{file}.npz", head=head)


def check(model, system):
    """The converted model equals mace-torch on ``system``: energy 1e-10 relative, forces
    1e-9 × max(1, |F|max), stress 1e-9 (eV/Å³)."""
    atoms = systems(system)
    periodic = all(a.cell.rank == 3 for a in atoms)
    outputs = ("energy", "forces", "stress") if periodic else ("energy", "forces")
    got = jaxdd.compute(converted(*model), jaxdd.Batch.from_ase(atoms), outputs)
    key = f"{model_id(model)}/{system}/"
    ref = reference()
    np.testing.assert_allclose(np.asarray(got["energy"]), ref[key + "energy"], rtol=1e-10, atol=0)
    f = ref[key + "forces"]
    np.testing.assert_allclose(np.asarray(got["forces"]), f, rtol=0, atol=1e-9 * max(1.0, np.abs(f).max()))
    if periodic:
        np.testing.assert_allclose(np.asarray(got["stress"]), ref[key + "stress"], rtol=0, atol=1e-9)


# ----------------------------------------------------------------------------- converted = mace-torch


def test_the_mpa0_family_equals_mace_torch_on_close_pairs():
    """Density blocks, ZBL and the Agnesi transform together, where the short range matters."""
    check(("mpa0", None), "close")


@pytest.mark.slow
@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("model", MODELS, ids=model_id)
def test_each_family_equals_mace_torch_on_each_system(model, system):
    check(model, system)


def test_zbl_equals_its_formula_written_out():
    """mace's ZBLBasis for one C-O pair at 0.9 Å, by hand in numpy."""
    z1, z2, r = 6.0, 8.0, 0.9
    rc1, rc2 = 0.76, 0.66
    c = [0.1818, 0.5099, 0.2802, 0.02817]
    a = 0.4543 * 0.529 / (z1**0.3 + z2**0.3)
    phi = sum(ci * math.exp(-k * r / a) for ci, k in zip(c, (3.2, 0.9423, 0.4028, 0.2016)))
    x, p = r / (rc1 + rc2), 5
    env = 1 - (p + 1) * (p + 2) / 2 * x**p + p * (p + 2) * x ** (p + 1) - p * (p + 1) / 2 * x ** (p + 2)
    want = 0.5 * 14.3996 * z1 * z2 / r * phi * env
    got = rad.zbl_edge_energy(np.asarray([r]), np.asarray([z1]), np.asarray([z2]), np.asarray([rc1]),
                              np.asarray([rc2]), rad.default_zbl_params(), p)
    np.testing.assert_allclose(np.asarray(got), [want], rtol=1e-14)
    beyond = rad.zbl_edge_energy(np.asarray([1.5]), np.asarray([z1]), np.asarray([z2]), np.asarray([rc1]),
                                 np.asarray([rc2]), rad.default_zbl_params(), p)
    assert float(beyond[0]) == 0.0


# ----------------------------------------------------------------------------- heads


def test_a_multi_head_model_without_a_head_is_refused_with_its_heads():
    with pytest.raises(UnsupportedModel, match=r"2 heads \['pt_head', 'default'\].*head="):
        MACE.from_torch(DATA / "twohead.npz")


def test_a_head_the_model_does_not_have_is_refused_with_its_heads():
    with pytest.raises(ValueError, match=r"'dft' is not a head.*\['pt_head', 'default'\]"):
        MACE.from_torch(DATA / "twohead.npz", head="dft")


def test_the_configuration_of_each_family_is_read():
    mpa0 = converted("mpa0", None)
    assert (mpa0.pair_repulsion, mpa0.distance_transform) == (True, "Agnesi")
    assert mpa0.interactions == ("RealAgnosticDensityInteractionBlock",
                                 "RealAgnosticDensityResidualInteractionBlock")
    options = converted("options", "default")
    assert (options.radial_type, options.distance_transform, options.apply_cutoff) == ("gaussian", "Soft", False)
    assert options.readout == "NonLinearBiasReadoutBlock"
    assert options.edge_irreps == ((2, 0, 1), (2, 1, -1)) and options.use_edge_irreps_first
    old = converted("old036", None)
    assert (old.pair_repulsion, old.distance_transform, old.radial_type) == (True, "Agnesi", "bessel")
    head = converted("twohead", "default")
    np.testing.assert_allclose(head.params["atomic_energies"], [-1.0, -3.0, -5.0])
    assert (float(head.params["scale"]), float(head.params["shift"])) == (0.9, 0.1)


# ----------------------------------------------------------------------------- distributed


def crystal():
    """test_mace's 216-atom crystal with five close pairs (about 1.0 Å): ZBL and the transforms act."""
    return test_mace.crystal(seed=8, close_pairs=5)


@functools.lru_cache(maxsize=None)
def one_device(model):
    out = jaxdd.compute(converted(*model), crystal(), ("energy", "forces", "stress"))
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("grid", [(2, 2, 1), (3, 2, 1)], ids=lambda g: "x".join(map(str, g)))
@pytest.mark.parametrize("model", [("mp0b3", None), ("mpa0", None), ("twohead", "default"),
                                   ("options", "pt_head"), ("chebyshev", None), ("mh", "default")], ids=model_id)
def test_each_family_distributed_equals_one_device(model, grid):
    dm = DistributedModel(converted(*model), DomainConfig(5.0, mesh=mesh_of(math.prod(grid)), grid=grid))
    got = {k: np.asarray(v) for k, v in dm(crystal(), outputs=("energy", "forces", "stress")).items()}
    want = one_device(model)
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)
    assert dm.dispatch_report.fallbacks == []


@pytest.mark.slow
@pytest.mark.parametrize("model", [("mp0b3", None), ("mpa0", None), ("twohead", "default"),
                                   ("options", "pt_head"), ("chebyshev", None), ("mh", "default")], ids=model_id)
def test_each_family_passes_the_validator_at_world_size_4(model):
    from jaxdd.validate import trace_and_validate

    report = trace_and_validate(lambda: converted(*model), crystal(), world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None


# ----------------------------------------------------------------------------- live mace-torch


@pytest.mark.skipif(not HAVE_TORCH, reason="torch and mace-torch are not installed: live comparison skipped")
@pytest.mark.parametrize("family", ["mpa0", "options"])
def test_live_family_models_reproduce_the_stored_references(family):
    import os
    import sys

    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch

    sys.path.insert(0, str(DATA))
    import make_reference

    torch.set_default_dtype(torch.float64)
    model = make_reference.build_family(family)
    head = "default" if len(model.heads) > 1 else None
    e, f, s = make_reference.evaluate(model, systems("close"), model.heads.index(head) if head else 0)
    key = f"{family}:{head}/close/" if head else f"{family}/close/"
    np.testing.assert_allclose(e, reference()[key + "energy"], rtol=1e-12)
    got = jaxdd.compute(MACE.from_torch(model, head=head), jaxdd.Batch.from_ase(systems("close")),
                        ("energy", "forces", "stress"))
    np.testing.assert_allclose(np.asarray(got["energy"]), e, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(got["forces"]), f, atol=1e-9 * max(1.0, np.abs(f).max()))
    np.testing.assert_allclose(np.asarray(got["stress"]), s, atol=1e-9)


@pytest.mark.skipif(not (HAVE_TORCH and importlib.util.find_spec("cuequivariance_torch") is not None),
                    reason="torch, mace-torch and cuequivariance-torch are not installed: live comparison skipped")
def test_live_a_model_in_cuequivariance_layout_is_converted_back():
    import os
    import sys

    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    import torch
    from mace.cli.convert_e3nn_cueq import run as to_cueq

    sys.path.insert(0, str(DATA))
    import make_reference

    torch.set_default_dtype(torch.float64)
    model = to_cueq(make_reference.build_family("mpa0"), return_model=True, device="cpu")
    assert model.interactions[0].cueq_config.enabled
    e, f, s = make_reference.evaluate(model, systems("close"))
    got = jaxdd.compute(MACE.from_torch(model), jaxdd.Batch.from_ase(systems("close")), ("energy", "forces", "stress"))
    np.testing.assert_allclose(np.asarray(got["energy"]), e, rtol=1e-10)
    np.testing.assert_allclose(np.asarray(got["forces"]), f, atol=1e-9 * max(1.0, np.abs(f).max()))
    np.testing.assert_allclose(np.asarray(got["stress"]), s, atol=1e-9)
    assert torch.get_default_dtype() == torch.float64


@pytest.mark.slow
def test_a_native_model_with_every_option_is_invariant_under_rotation():
    """Built in JAX (no mace-torch): non-linear blocks, ZBL, Soft transform, Gaussian basis,
    no cutoff on the basis, edge irreps, the biased readout."""
    model = MACE((1, 6, 8), 4.0, hidden_irreps="4x0e + 4x1o", mlp_irreps="4x0e", radial_mlp=(8,), correlation=2,
                 interaction="RealAgnosticResidualNonLinearInteractionBlock", pair_repulsion=True,
                 distance_transform="Soft", radial_type="gaussian", apply_cutoff=False, edge_irreps="2x0e + 2x1o",
                 use_edge_irreps_first=True, readout="NonLinearBiasReadoutBlock", seed=2)
    mol = systems("close")[0]
    q, r = np.linalg.qr(np.random.default_rng(0).normal(size=(3, 3)))
    q = q * np.sign(np.diag(r)) * np.sign(np.linalg.det(q * np.sign(np.diag(r))))
    turned = mol.copy()
    turned.set_cell(mol.cell.array @ q.T, scale_atoms=True)
    a = jaxdd.compute(model, jaxdd.AtomicData.from_ase(mol), ("energy", "forces"))
    b = jaxdd.compute(model, jaxdd.AtomicData.from_ase(turned), ("energy", "forces"))
    np.testing.assert_allclose(b["energy"], a["energy"], rtol=1e-12)
    np.testing.assert_allclose(np.asarray(b["forces"]), np.asarray(a["forces"]) @ q.T, atol=1e-9)
    assert np.abs(np.asarray(a["forces"])).max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("model", [("mh", "default"), ("options", "default"), ("mpa0", None)], ids=model_id)
def test_a_neighbour_list_skin_changes_nothing(model):
    """Pairs between r_max and r_max + skin are in the list but not in the model (the non-linear
    block's networks have biases, so they must be masked, not merely enveloped)."""
    skinned = MACE.from_torch(DATA / f"{model[0]}.npz", head=model[1], skin=1.0)
    atoms = jaxdd.Batch.from_ase(systems("close"))
    got = jaxdd.compute(skinned, atoms, ("energy", "forces"))
    key = f"{model_id(model)}/close/"
    np.testing.assert_allclose(np.asarray(got["energy"]), reference()[key + "energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(np.asarray(got["forces"]), reference()[key + "forces"], rtol=0, atol=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("model", [("mh", "default")], ids=model_id)
def test_a_float32_family_model_is_close_to_mace_torch_in_float64(model):
    import jax.numpy as jnp

    single = MACE.from_torch(DATA / f"{model[0]}.npz", head=model[1], dtype=jnp.float32)
    got = jaxdd.compute(single, jaxdd.Batch.from_ase(systems("close"), dtype=jnp.float32), ("energy", "forces"))
    assert got["forces"].dtype == np.float32
    key = f"{model_id(model)}/close/"
    np.testing.assert_allclose(np.asarray(got["energy"]), reference()[key + "energy"], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got["forces"]), reference()[key + "forces"], atol=1e-4)


@pytest.mark.parametrize("model", [("mh", "default"), pytest.param(("mpa0", None), marks=pytest.mark.slow),
                                   pytest.param(("options", "default"), marks=pytest.mark.slow)], ids=model_id)
def test_the_convolution_summed_in_blocks_of_edges_equals_mace_torch(model):
    """13 edges per block: many blocks, the last one padded."""
    blocked = MACE.from_torch(DATA / f"{model[0]}.npz", head=model[1], edge_block=13)
    atoms = systems("close")
    got = jaxdd.compute(blocked, jaxdd.Batch.from_ase(atoms), ("energy", "forces", "stress"))
    key = f"{model_id(model)}/close/"
    ref = reference()
    np.testing.assert_allclose(np.asarray(got["energy"]), ref[key + "energy"], rtol=1e-10, atol=0)
    f = ref[key + "forces"]
    np.testing.assert_allclose(np.asarray(got["forces"]), f, rtol=0, atol=1e-9 * max(1.0, np.abs(f).max()))
    np.testing.assert_allclose(np.asarray(got["stress"]), ref[key + "stress"], rtol=0, atol=1e-9)
