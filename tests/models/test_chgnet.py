"""Specification of ``jaxdd.models.chgnet``: CHGNet with the weights of its published models,
read without torch.

The models are the files of the ``chgnet`` wheel, installed without its dependencies as their
carrier (``./dev`` does it). The references are chgnet's own float64 energies, site energies,
forces, stress and magnetic moments on six small structures
(``tests/data/chgnet/make_reference.py``, which needs torch and chgnet; the file it wrote is
read here without either). Where torch and chgnet are installed, the live test compares
against chgnet directly.
"""

import functools
import importlib.util
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from blocked_imports import run_blocking
from ase import Atoms

import jaxdd

pytestmark = pytest.mark.skipif(importlib.util.find_spec("chgnet") is None,
                                reason="the chgnet wheel (the carrier of CHGNet's pretrained models) is not installed: "
                                       "pip install --no-deps chgnet==0.4.2")

from jaxdd.models.chgnet import CHGNet, UnsupportedCheckpoint  # noqa: E402
from jaxdd.models.chgnet import checkpoint as ckpt  # noqa: E402

DATA = pathlib.Path(__file__).parents[1] / "data" / "chgnet"
STRUCTURES = ("fe2o3", "li2o", "limno2_triclinic", "close_pair", "isolated", "slab")
MODELS = ("0.3.0", "0.2.0", "r2scan")
HAVE_CHGNET_TORCH = all(importlib.util.find_spec(m) is not None for m in ("torch", "pymatgen"))


@functools.lru_cache(maxsize=None)
def reference():
    with np.load(DATA / "reference.npz") as f:
        return {k: f[k] for k in f.files}


def system(name):
    p = f"systems/{name}/"
    ref = reference()
    return Atoms(numbers=ref[p + "numbers"], positions=ref[p + "positions"], cell=ref[p + "cell"], pbc=ref[p + "pbc"])


@functools.lru_cache(maxsize=None)
def model(name, dtype=jnp.float64, skin=0.0):
    return CHGNet.load(name, dtype=dtype, skin=skin)


@functools.lru_cache(maxsize=None)
def evaluate(name, names, dtype=jnp.float64, skin=0.0):
    """jaxdd's outputs on the structures ``names``, evaluated in one batch, as numpy arrays."""
    batch = jaxdd.Batch.from_ase([system(n) for n in names], dtype=dtype)
    out = jaxdd.compute(model(name, dtype, skin), batch, ("energy", "atomic_energies", "forces", "stress", "magmoms"))
    return {k: np.asarray(v) for k, v in out.items()}


def assert_equal_to_chgnet(name, names, dtype=jnp.float64, e_rtol=1e-10, f_atol=1e-9, s_atol=1e-9, m_atol=1e-9,
                           skin=0.0):
    """jaxdd's energy and site energies (relative ``e_rtol``), forces (``f_atol · max(1, |F|max)``
    eV/Å), stress (``s_atol`` eV/Å³) and magnetic moments (``m_atol`` μB) on the structures
    ``names`` equal chgnet's."""
    out = evaluate(name, tuple(names), dtype, skin)
    start = 0
    for k, n in enumerate(names):
        ref = {key: reference()[f"{name}/{n}/{key}"] for key in ("energy", "energies", "forces", "stress", "magmoms")}
        rows = slice(start, start + len(ref["forces"]))
        np.testing.assert_allclose(out["energy"][k], ref["energy"], rtol=e_rtol, atol=0, err_msg=n)
        np.testing.assert_allclose(out["atomic_energies"][rows], ref["energies"], rtol=0,
                                   atol=e_rtol * abs(ref["energy"]), err_msg=n)
        np.testing.assert_allclose(out["forces"][rows], ref["forces"], rtol=0,
                                   atol=f_atol * max(1.0, np.abs(ref["forces"]).max()), err_msg=n)
        np.testing.assert_allclose(out["stress"][k], ref["stress"], rtol=0, atol=s_atol, err_msg=n)
        np.testing.assert_allclose(out["magmoms"][rows], ref["magmoms"], rtol=0, atol=m_atol, err_msg=n)
        start = rows.stop


# ----------------------------------------------------------------------------- equal to chgnet


def test_0_3_0_equals_chgnet_on_every_reference_structure():
    assert_equal_to_chgnet("0.3.0", STRUCTURES)


@pytest.mark.slow  # by default 0.3.0 is checked on every structure
def test_0_2_0_with_its_output_biases_and_no_layer_norms_equals_chgnet_with_and_without_angles():
    # "isolated" has no angle: chgnet skips its bond convolutions there, output biases included.
    assert_equal_to_chgnet("0.2.0", ("isolated", "close_pair"))


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_each_published_model_equals_chgnet_on_every_reference_structure(name):
    assert_equal_to_chgnet(name, STRUCTURES)


@pytest.mark.slow
def test_float32_weights_and_positions_stay_close_to_float64_chgnet():
    assert_equal_to_chgnet("0.3.0", STRUCTURES, dtype=jnp.float32, e_rtol=1e-5, f_atol=1e-4, s_atol=1e-5,
                           m_atol=1e-4)


@pytest.mark.slow
def test_a_skin_leaves_the_numbers_unchanged():
    assert_equal_to_chgnet("0.3.0", ("li2o", "close_pair"), skin=0.3)


needs_chgnet_torch = pytest.mark.skipif(not HAVE_CHGNET_TORCH, reason="torch and pymatgen are not installed (the "
                                        "torch side of tests/data/chgnet/make_reference.py): live comparison skipped")


@needs_chgnet_torch
@pytest.mark.slow
def test_live_chgnet_reproduces_the_stored_references():
    sys.path.insert(0, str(DATA))
    import make_reference

    for name in MODELS:
        for n in STRUCTURES:
            live = make_reference.live_reference(name, system(n))
            for key, value in live.items():
                np.testing.assert_allclose(value, reference()[f"{name}/{n}/{key}"], rtol=1e-12, atol=1e-12,
                                           err_msg=f"{name} {n} {key}")


@needs_chgnet_torch
@pytest.mark.slow
def test_equals_live_chgnet_on_a_structure_not_stored():
    # Rocksalt CoO with Li on a third of the cation sites, sheared, rattled: computed by both now.
    sys.path.insert(0, str(DATA))
    import make_reference
    from ase.build import bulk

    atoms = bulk("CoO", "rocksalt", a=4.26, cubic=True).repeat((1, 1, 2))
    atoms.numbers[[0, 4, 10]] = 3
    atoms.set_cell(atoms.cell.array @ np.array([[1.0, 0.06, 0.0], [0.0, 1.0, -0.05], [0.04, 0.0, 1.0]]),
                   scale_atoms=True)
    atoms.rattle(0.08, seed=11)
    atoms.wrap()
    for name in MODELS:
        live = make_reference.live_reference(name, atoms)
        out = jaxdd.compute(model(name), jaxdd.Batch.from_ase(atoms), ("energy", "forces", "stress", "magmoms"))
        np.testing.assert_allclose(out["energy"][0], live["energy"], rtol=1e-10, err_msg=name)
        np.testing.assert_allclose(out["forces"], live["forces"], atol=1e-9 * max(1.0, np.abs(live["forces"]).max()),
                                   err_msg=name)
        np.testing.assert_allclose(out["stress"][0], live["stress"], atol=1e-9, err_msg=name)
        np.testing.assert_allclose(out["magmoms"], live["magmoms"], atol=1e-9, err_msg=name)


# ----------------------------------------------------------------------------- loading and errors


class BlockImports:
    """A meta-path finder under which importing one of ``names`` (and their submodules) fails."""

    def __init__(self, *names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ImportError(f"{name} is blocked in this test")


def test_loading_needs_neither_chgnet_nor_torch(monkeypatch):
    # chgnet, torch and pymatgen cannot be imported while the published model is found and read;
    # none of them is imported by it (where an earlier test imported them, they stay as they were).
    monkeypatch.setattr(sys, "meta_path", [BlockImports("torch", "chgnet", "pymatgen")] + sys.meta_path)
    before = set(sys.modules)
    loaded = CHGNet.load("0.3.0")
    assert loaded.arch.version == "0.3.0"
    assert not {m for m in set(sys.modules) - before if m.split(".")[0] in ("torch", "chgnet", "pymatgen")}


@pytest.mark.slow
def test_loading_and_running_need_no_torch():
    # A child process in which `import torch` fails, loading by name and evaluating the close pair.
    ref = reference()
    stdout = run_blocking(('torch', 'chgnet', 'pymatgen'), f"""
        import numpy as np
        import jaxdd
        from ase import Atoms
        from jaxdd.models.chgnet import CHGNet
        model = CHGNet.load("0.3.0")
        atoms = Atoms(numbers={ref['systems/close_pair/numbers'].tolist()},
                      positions={ref['systems/close_pair/positions'].tolist()},
                      cell={ref['systems/close_pair/cell'].tolist()}, pbc=True)
        out = jaxdd.compute(model, jaxdd.Batch.from_ase(atoms), ("energy", "forces"))
        want = np.asarray({ref['0.3.0/close_pair/forces'].tolist()})
        print(repr(float(out["energy"][0])), repr(float(np.abs(np.asarray(out["forces"]) - want).max())))
    """)
    energy, force_error = map(float, stdout.split()[-2:])
    np.testing.assert_allclose(energy, ref["0.3.0/close_pair/energy"], rtol=1e-10)
    assert force_error < 1e-9 * max(1.0, np.abs(ref["0.3.0/close_pair/forces"]).max())


@pytest.mark.parametrize("name, count", [("0.3.0", 412_525), ("0.2.0", 400_438), ("r2scan", 412_525)])
def test_each_published_model_has_its_published_parameter_count(name, count):
    assert sum(x.size for x in jax.tree_util.tree_leaves(model(name).params)) == count


@pytest.mark.parametrize("name, atom, bias", [("0.3.0", 6.0, False), ("0.2.0", 5.0, True), ("r2scan", 6.0, False)])
def test_the_cutoffs_and_output_biases_come_from_the_checkpoint(name, atom, bias):
    arch = model(name).arch
    assert (arch.atom_cutoff, arch.bond_cutoff, arch.mlp_out_bias) == (atom, 3.0, bias)
    assert model(name).model_config.neighbor_config.cutoff == atom
    assert model(name).model_config.neighbor_config.bond_cutoff == 3.0


def test_a_name_is_resolved_to_the_installed_wheels_file_without_importing_it(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [BlockImports("chgnet")] + sys.meta_path)
    path = pathlib.Path(ckpt.resolve("R2SCAN"))
    assert path.is_file() and path.parts[-3:-1] == ("pretrained", "r2scan")


def test_a_path_loads_like_its_name():
    by_path = CHGNet.load(ckpt.resolve("0.2.0"))
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(np.array_equal, by_path.params, model("0.2.0").params))


@pytest.mark.parametrize("change, name", [
    ({"update_angle": False}, "update_angle=False"),
    ({"mlp_first": False}, "mlp_first=False"),
    ({"non_linearity": "relu"}, "non_linearity='relu'"),
    ({"gMLP_norm": "batch"}, "gMLP_norm='batch'"),
    ({"conv_norm": "layer"}, "conv_norm='layer'"),
    ({"is_intensive": False}, "is_intensive=False"),
    ({"dimenet_basis": True}, "the option dimenet_basis=True"),
])
def test_an_option_none_of_the_published_models_uses_is_refused_by_name(monkeypatch, change, name):
    checkpoint = ckpt.pth.load(ckpt.resolve("0.3.0"))
    checkpoint["model"]["model_args"].update(change)
    monkeypatch.setattr(ckpt.pth, "load", lambda path: checkpoint)
    with pytest.raises(UnsupportedCheckpoint, match=name):
        CHGNet.load("0.3.0")


def test_a_state_dict_without_a_weight_names_it(monkeypatch):
    checkpoint = ckpt.pth.load(ckpt.resolve("0.3.0"))
    del checkpoint["model"]["state_dict"]["angle_embedding.weight"]
    monkeypatch.setattr(ckpt.pth, "load", lambda path: checkpoint)
    with pytest.raises(UnsupportedCheckpoint, match="has no angle_embedding.weight"):
        CHGNet.load("0.3.0")


def test_the_options_chgnet_itself_ignores_are_ignored():
    # 0.2.0's model_args carry skip_connection and a misspelt cutofff_coeff, which chgnet never reads.
    args = ckpt.pth.load(ckpt.resolve("0.2.0"))["model"]["model_args"]
    assert {"skip_connection", "cutofff_coeff"} <= set(args)
    assert model("0.2.0").arch.envelope_p == args["cutoff_coeff"] == 5


def test_a_published_name_without_the_chgnet_wheel_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(ckpt.carrier, "package_folder", lambda package: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps chgnet"):
        CHGNet.load("0.3.0")


def test_an_unknown_name_lists_the_published_ones():
    with pytest.raises(FileNotFoundError, match="'0.4.0'.*'0.3.0', '0.2.0', 'r2scan'"):
        CHGNet.load("0.4.0")


def test_a_torch_file_that_is_not_a_chgnet_checkpoint_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(ckpt.pth, "load", lambda path: {"config": {}, "model_state_dict": {}})
    path = tmp_path / "other.pth"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a CHGNet checkpoint.*'config', 'model_state_dict'"):
        CHGNet.load(path)


def test_half_precision_is_refused():
    with pytest.raises(ValueError, match="float32 or float64"):
        CHGNet.load("0.3.0", dtype=jnp.float16)


def test_an_element_beyond_plutonium_is_named():
    atoms = Atoms("LiAm", positions=[[0, 0, 0], [2.3, 0, 0]], cell=np.eye(3) * 8, pbc=True)
    with pytest.raises(ValueError, match=r"atoms \[1\] have atomic numbers \[95\].*1 to 94"):
        jaxdd.compute(model("0.3.0"), jaxdd.Batch.from_ase(atoms), ("energy",))


# ----------------------------------------------------------------------------- distributed


def mesh_of(n):
    from jax.sharding import AxisType, Mesh

    return Mesh(np.asarray(jax.devices()[:n]), ("dd",), axis_types=(AxisType.Auto,))


@functools.lru_cache(maxsize=None)
def crystal(repeat):
    """Antifluorite Li2O with an Fe on every tenth cation site, ``repeat`` conventional cells, rattled."""
    from ase.build import bulk

    atoms = bulk("Li2O", "fluorite", a=4.61, cubic=True).repeat(repeat)
    atoms.numbers[np.flatnonzero(atoms.numbers == 3)[::10]] = 26
    atoms.rattle(0.05, seed=3)
    return jaxdd.AtomicData.from_ase(atoms)


@functools.lru_cache(maxsize=None)
def triclinic_crystal():
    """Diamond Si with a Ge on every ninth site in its primitive cell (vectors at 60°) repeated
    (6, 4, 3), sheared further and rattled: 144 atoms in a triclinic cell. Sparser than Li2O, so
    six ranks, each holding most of the cell as ghosts, fit in a few GB."""
    from ase.build import bulk

    atoms = bulk("Si", "diamond", a=5.43).repeat((6, 4, 3))
    atoms.numbers[::9] = 32
    atoms.set_cell(atoms.cell.array @ np.array([[1.0, 0.0, 0.0], [0.1, 1.0, 0.0], [0.05, -0.08, 1.0]]),
                   scale_atoms=True)
    atoms.rattle(0.05, seed=5)
    atoms.wrap()
    return jaxdd.AtomicData.from_ase(atoms)


def assert_distributed_equals_one_device(name, data, grid):
    keys = ("energy", "forces", "stress", "magmoms")
    want = {k: np.asarray(v) for k, v in jaxdd.compute(model(name), data, keys).items()}
    dm = jaxdd.DistributedModel(model(name), jaxdd.DomainConfig(model(name).cutoff, mesh=mesh_of(int(np.prod(grid))),
                                                               grid=grid))
    got = {k: np.asarray(v) for k, v in dm(data, outputs=keys).items()}
    np.testing.assert_allclose(got["energy"], want["energy"], rtol=1e-10, atol=0)
    np.testing.assert_allclose(got["forces"], want["forces"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["stress"], want["stress"], rtol=0, atol=1e-9)
    np.testing.assert_allclose(got["magmoms"], want["magmoms"], rtol=0, atol=1e-9)
    assert dm.dispatch_report.fallbacks == []


@pytest.mark.slow  # by default the angle engine runs distributed through tests/models/test_angle_mpnn.py
def test_distributed_0_3_0_equals_one_device():
    # 27.7 Å along the split: each rank's ghost shell (6 Å) leaves atoms it does not see.
    assert_distributed_equals_one_device("0.3.0", crystal((6, 1, 1)), (2, 1, 1))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")
@pytest.mark.parametrize("name", ["0.2.0", "r2scan"])
def test_distributed_models_equal_one_device_on_a_2x2_grid(name):
    # The sparse Si/Ge cell: four ranks of dense Li2O, each holding most of it as ghosts, peak at 20 GB.
    assert_distributed_equals_one_device(name, triclinic_crystal(), (2, 2, 1))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")
def test_distributed_0_3_0_equals_one_device_on_a_triclinic_cell_on_a_3x2x1_grid():
    # No two cell vectors at a right angle: the ranks' blocks and ghost shells are sheared, and
    # bonds and angles cross rank boundaries along two axes.
    data = triclinic_crystal()
    cell = np.asarray(data.cell)[0]
    assert all(abs(cell[i] @ cell[j]) > 1.0 for i, j in ((0, 1), (0, 2), (1, 2)))
    assert_distributed_equals_one_device("0.3.0", data, (3, 2, 1))


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the ghost shell of some ranks covers every atom:RuntimeWarning")
def test_0_3_0_passes_the_validator_at_world_size_4_with_its_own_spec():
    from jaxdd.validate import trace_and_validate

    report = trace_and_validate(lambda: model("0.3.0"), triclinic_crystal(), world_size=4, atol=1e-9, rtol=1e-10)
    assert report.ok, report.summary()
    assert report.fix_applied is None
