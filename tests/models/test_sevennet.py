"""Specification of ``jaxdd.models.sevennet``: SevenNet with the weights of its published
checkpoints, read without torch.

The checkpoints are the files of the ``sevenn`` wheel, installed without its dependencies as
their carrier (the README's test command does it). The references are sevenn's own float64
energies, forces and stress on four small structures (``tests/data/sevennet/make_reference.py``,
which needs torch and sevenn; the file it wrote is read here without either). Where torch and
sevenn are installed, the live test compares against sevenn directly.
"""

import functools
import importlib.util
import math
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocked_imports import run_blocking
from ase import Atoms
from jax.sharding import AxisType, Mesh

import jaxdd
from jaxdd import DistributedModel, DomainConfig

pytestmark = [
    pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning"),
    pytest.mark.skipif(importlib.util.find_spec("sevenn") is None,
                       reason="the sevenn wheel (the carrier of SevenNet's checkpoints) is not installed: "
                              "pip install --no-deps sevenn==0.13.0"),
]

from jaxdd.models.sevennet import E3NN_TORCH_SILU_CONSTANT, SevenNet, UnsupportedCheckpoint  # noqa: E402
from jaxdd.models.sevennet import checkpoint as ckpt  # noqa: E402

DATA = pathlib.Path(__file__).parents[1] / "data" / "sevennet"
PERIODIC = ("triclinic_close", "oxide", "slab")
HAVE_SEVENN_TORCH = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("e3nn") is not None
CASES = [("7net-0", None), ("7net-l3i5", None), ("7net-mf-0", "PBE"), ("7net-mf-0", "R2SCAN")]


@functools.lru_cache(maxsize=None)
def reference():
    with np.load(DATA / "reference.npz") as f:
        return {k: f[k] for k in f.files}


def system(name):
    p = f"systems/{name}/"
    ref = reference()
    return Atoms(numbers=ref[p + "numbers"], positions=ref[p + "positions"], cell=ref[p + "cell"], pbc=ref[p + "pbc"])


@functools.lru_cache(maxsize=None)
def model(name, modal=None, dtype=jnp.float64):
    return SevenNet.from_checkpoint(name, modal=modal, dtype=dtype)


def voigt(stress):
    """``[S, 3, 3]`` -> ASE's ``[S, 6]`` (xx, yy, zz, yz, xz, xy)."""
    s = np.asarray(stress)
    return np.stack([s[:, 0, 0], s[:, 1, 1], s[:, 2, 2], s[:, 1, 2], s[:, 0, 2], s[:, 0, 1]], axis=-1)


def assert_equal_to_sevenn(name, modal, names, dtype=jnp.float64, e_rtol=1e-10, f_atol=1e-9, s_atol=1e-9):
    """jaxdd's energy, forces and (periodic systems) stress on the systems ``names``, evaluated
    in one batch, equal sevenn's (forces to ``f_atol · max(1, |F|max)``)."""
    atoms = [system(n) for n in names]
    outputs = ("energy", "forces", "stress") if all(a.pbc.any() for a in atoms) else ("energy", "forces")
    out = jaxdd.compute(model(name, modal, dtype), jaxdd.Batch.from_ase(atoms, dtype=dtype), outputs)
    start = 0
    for k, (n, a) in enumerate(zip(names, atoms)):
        key = f"{name}/{modal or 'default'}/{n}/"
        want_f = reference()[key + "forces"]
        np.testing.assert_allclose(out["energy"][k], reference()[key + "energy"], rtol=e_rtol, atol=0, err_msg=n)
        np.testing.assert_allclose(out["forces"][start:start + len(a)], want_f, rtol=0,
                                   atol=f_atol * max(1.0, np.abs(want_f).max()), err_msg=n)
        if "stress" in out:
            np.testing.assert_allclose(voigt(out["stress"])[k], reference()[key + "stress"], rtol=0, atol=s_atol,
                                       err_msg=n)
        start += len(a)


# ----------------------------------------------------------------------------- equal to sevenn


def test_7net_0_equals_sevenn_on_the_periodic_structures():
    assert_equal_to_sevenn("7net-0", None, PERIODIC)


def test_the_r2scan_fidelity_of_7net_mf_0_equals_sevenn():
    assert_equal_to_sevenn("7net-mf-0", "R2SCAN", ("triclinic_close",))


@pytest.mark.slow
@pytest.mark.parametrize("name, modal", CASES, ids=lambda v: str(v))
def test_each_checkpoint_equals_sevenn_on_every_reference_structure(name, modal):
    assert_equal_to_sevenn(name, modal, PERIODIC)
    assert_equal_to_sevenn(name, modal, ("molecule",))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["7net-0", "7net-l3i5"])
def test_float32_weights_and_positions_stay_close_to_float64_sevenn(name):
    assert_equal_to_sevenn(name, None, PERIODIC, dtype=jnp.float32, e_rtol=1e-5, f_atol=1e-4, s_atol=1e-5)


def test_loading_imports_neither_sevenn_nor_torch():
    # Where torch is absent (CI) every test of this module runs without it; this one shows the
    # installed sevenn package, the carrier of the files, is never imported either.
    model("7net-0")
    assert "sevenn" not in sys.modules
    assert HAVE_SEVENN_TORCH or "torch" not in sys.modules


@pytest.mark.slow
def test_loading_and_running_need_no_torch():
    # A child process in which `import torch` fails, loading by name and evaluating the molecule.
    ref = reference()
    stdout = run_blocking(('torch', 'e3nn', 'sevenn'), f"""
        import numpy as np
        import jaxdd
        from ase import Atoms
        from jaxdd.models.sevennet import SevenNet
        model = SevenNet.from_checkpoint("7net-0")
        atoms = Atoms(numbers={ref['systems/molecule/numbers'].tolist()},
                      positions={ref['systems/molecule/positions'].tolist()})
        out = jaxdd.compute(model, jaxdd.Batch.from_ase(atoms), ("energy", "forces"))
        print(repr(float(out["energy"][0])), repr(float(np.abs(np.asarray(out["forces"])
                                                              - np.asarray({ref['7net-0/default/molecule/forces'].tolist()})).max())))
    """)
    energy, force_error = map(float, stdout.split()[-2:])
    np.testing.assert_allclose(energy, ref["7net-0/default/molecule/energy"], rtol=1e-10)
    assert force_error < 1e-9 * max(1.0, np.abs(ref["7net-0/default/molecule/forces"]).max())


def test_the_silu_constant_is_the_one_torch_computed():
    assert E3NN_TORCH_SILU_CONSTANT == float(reference()["silu_cst"])


@pytest.mark.parametrize("name, count", [("7net-0", 842_623), ("7net-l3i5", 1_171_327), ("7net-mf-0", 846_168)])
def test_each_published_checkpoint_has_its_published_parameter_count(name, count):
    m = model(name, "PBE" if name == "7net-mf-0" else None)
    other_fidelity = 89 if name == "7net-mf-0" else 0  # the shifts of the fidelity not chosen are not loaded
    weights = sum(x.size for x in jax.tree_util.tree_leaves(m.params)) - m.arch.n_modalities  # less the modality's one-hot
    assert weights == count - other_fidelity


@pytest.mark.skipif(not HAVE_SEVENN_TORCH, reason="torch and sevenn are not installed (the torch side of "
                    "tests/data/sevennet/make_reference.py): live comparison skipped")
@pytest.mark.slow
def test_live_sevenn_reproduces_the_stored_references():
    sys.path.insert(0, str(DATA))
    import make_reference

    for name, modal in CASES:
        for n in PERIODIC:
            energy, forces, stress = make_reference.live_reference(name, modal or "default", system(n))
            key = f"{name}/{modal or 'default'}/{n}/"
            np.testing.assert_allclose(energy, reference()[key + "energy"], rtol=1e-12)
            np.testing.assert_allclose(forces, reference()[key + "forces"], atol=1e-10)


# ----------------------------------------------------------------------------- checkpoints and errors


def test_checkpoints_before_sevenn_0_11_have_their_weight_columns_put_in_sorted_path_order():
    _, old = ckpt.read("7net-0")
    stored = ckpt.pth.load(ckpt.resolve("7net-0"))["model_state_dict"]
    raw = np.asarray(stored["1_convolution.weight_nn.layer2.weight"], np.float64)
    got = old["layers"][1]["radial"][-1]
    assert got.shape == raw.shape and not np.array_equal(got, raw)
    # The same columns, moved as whole blocks of one path's channels.
    assert sorted(map(tuple, got.T.round(12))) == sorted(map(tuple, raw.T.round(12)))
    # Layer 0 has one path per harmonic, found in sorted order already.
    np.testing.assert_array_equal(old["layers"][0]["radial"][-1], stored["0_convolution.weight_nn.layer2.weight"])


def test_checkpoints_from_sevenn_0_11_on_keep_their_columns(monkeypatch):
    checkpoint = ckpt.pth.load(ckpt.resolve("7net-0"))
    checkpoint["config"]["version"] = "0.11.2"
    monkeypatch.setattr(ckpt.pth, "load", lambda path: checkpoint)
    _, weights = ckpt.read("7net-0")
    np.testing.assert_array_equal(weights["layers"][1]["radial"][-1],
                                  checkpoint["model_state_dict"]["1_convolution.weight_nn.layer2.weight"])


def test_a_multi_fidelity_checkpoint_without_modal_lists_its_modalities():
    with pytest.raises(ValueError, match=r"multi-fidelity and was given no modal.*\['R2SCAN', 'PBE'\]"):
        SevenNet.from_checkpoint("7net-mf-0")


def test_an_unknown_modality_is_refused_with_the_list():
    with pytest.raises(ValueError, match=r"modal 'SCAN'.*\['R2SCAN', 'PBE'\]"):
        SevenNet.from_checkpoint("7net-mf-0", modal="SCAN")


def test_a_modality_for_a_single_fidelity_checkpoint_is_refused():
    with pytest.raises(ValueError, match="one fidelity; drop modal='PBE'"):
        SevenNet.from_checkpoint("7net-0", modal="PBE")


def test_an_element_the_checkpoint_does_not_know_is_named():
    atoms = Atoms("SiAm", positions=[[0, 0, 0], [2.3, 0, 0]], cell=np.eye(3) * 10, pbc=True)
    with pytest.raises(ValueError, match=r"atoms \[1\] are \['Am'\].*not trained on"):
        jaxdd.compute(model("7net-0"), jaxdd.Batch.from_ase(atoms), ("energy",))


@pytest.mark.parametrize("change, name", [
    ({"self_connection_type": "nequip"}, "self_connection_type 'nequip'"),
    ({"readout_as_fcn": True}, "readout_as_fcn"),
    ({"cuequivariance_config": {"use": True}}, "cuEquivariance"),
    ({"use_flash_tp": True}, "FlashTP"),
    ({"is_parity": True}, "is_parity"),
    ({"interaction_type": "mace"}, "interaction_type 'mace'"),
    ({"radial_basis": {"radial_basis_name": "gaussian"}}, "radial basis 'gaussian'"),
])
def test_an_option_none_of_the_published_checkpoints_uses_is_refused_by_name(monkeypatch, change, name):
    checkpoint = ckpt.pth.load(ckpt.resolve("7net-0"))
    checkpoint["config"].update(change)
    monkeypatch.setattr(ckpt.pth, "load", lambda path: checkpoint)
    with pytest.raises(UnsupportedCheckpoint, match=name):
        SevenNet.from_checkpoint("7net-0")


def test_a_published_name_without_the_sevenn_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(ckpt.carrier, "package_folder", lambda package: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps sevenn"):
        SevenNet.from_checkpoint("7net-0")


def test_an_unknown_name_lists_the_published_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="'7net-1'.*'7net-0', '7net-l3i5', '7net-mf-0'"):
        SevenNet.from_checkpoint("7net-1")


def test_a_torch_file_that_is_not_a_sevennet_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.pth, "load", lambda path: {"state_dict": {}})
    path = tmp_path / "other.pth"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a SevenNet checkpoint.*'state_dict'"):
        SevenNet.from_checkpoint(path)


def test_half_precision_is_refused():
    with pytest.raises(ValueError, match="float32 or float64"):
        SevenNet.from_checkpoint("7net-0", dtype=jnp.float16)


# ----------------------------------------------------------------------------- distributed


def mesh_of(n):
    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def crystal():
    """64 atoms of a rattled Si/O mixture on the diamond lattice in its primitive (triclinic,
    60° angles) cell repeated 4x4x2."""
    from ase.build import bulk

    rng = np.random.default_rng(0)
    atoms = bulk("Si", "diamond", a=5.43).repeat((4, 4, 2))
    atoms.numbers = rng.choice([14, 8], len(atoms))
    atoms.rattle(0.05, seed=2)
    return jaxdd.AtomicData.from_ase(atoms)


@functools.lru_cache(maxsize=None)
def one_device():
    out = jaxdd.compute(model("7net-0"), crystal(), ("energy", "forces", "stress"))
    return {k: np.asarray(v) for k, v in out.items()}


@pytest.mark.parametrize("grid", [(2, 2, 1), pytest.param((3, 2, 1), marks=pytest.mark.slow)],
                         ids=lambda g: "x".join(map(str, g)))
def test_distributed_7net_0_on_a_triclinic_cell_equals_one_device(grid):
    dm = DistributedModel(model("7net-0"), DomainConfig(5.0, mesh=mesh_of(math.prod(grid)), grid=grid))
    got = {k: np.asarray(v) for k, v in dm(crystal(), outputs=("energy", "forces", "stress")).items()}
    want = one_device()
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)
    assert dm.dispatch_report.fallbacks == []


@pytest.mark.slow
def test_7net_0_passes_the_validator_at_world_size_4_with_its_own_spec():
    from jaxdd.validate import trace_and_validate

    report = trace_and_validate(lambda: model("7net-0"), crystal(), world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None


def test_a_rank_whose_atom_count_equals_a_hidden_width_is_followed_by_the_dispatch():
    # The 64 atoms of the crystal on one rank: the radial network's hidden width. The edge blocks
    # are declared rank-local (jaxdd.to_local), so no layout is guessed for their 64-wide features.
    assert crystal().positions.shape[0] == 64
    dm = DistributedModel(model("7net-0"), DomainConfig(5.0, mesh=mesh_of(1), grid=(1, 1, 1)))
    got = np.asarray(dm(crystal(), outputs=("energy",))["energy"])
    np.testing.assert_allclose(got, one_device()["energy"], rtol=1e-10)
