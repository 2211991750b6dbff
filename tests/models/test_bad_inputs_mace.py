"""Specification by probes: the MACE import (``MACE.from_torch``, ``export_torch``) refuses bad
input with an error that names the argument or the file and what is wrong, instead of loading
wrong weights silently or passing on a raw torch, numpy or zipfile error.

Bad files are made in ``tmp_path`` from the reference exports in ``tests/data/mace``; torch is
needed only where torch itself must judge a file (skipped without it).
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
import zipfile

import jax.numpy as jnp
import numpy as np
import pytest

from jaxdd.models.mace import MACE, export_torch

DATA = pathlib.Path(__file__).parents[1] / "data" / "mace"
EXPORT = DATA / "residual.npz"
HAVE_TORCH = importlib.util.find_spec("torch") is not None


def named(path) -> str:
    """A ``match`` pattern for a message that names ``path``."""
    return re.escape(repr(str(path)))


# ----------------------------------------------------------------------------- dtype


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int64, np.int64, bool, jnp.bool_, "int32", jnp.complex64, None,
                                   jnp.float16, jnp.bfloat16, "float16"],
                         ids=lambda d: getattr(d, "__name__", repr(d)))
@pytest.mark.parametrize("loader", ["from_torch", "constructor"])
def test_a_dtype_other_than_float32_or_float64_is_refused_naming_dtype(loader, dtype):
    # int32 used to truncate the weights: -25.12 eV instead of -36.16 eV, without a word; float16
    # and bfloat16 ran 3.7 and 17.6 meV off on 8 atoms under an error text naming float32 or float64.
    load = {"from_torch": lambda: MACE.from_torch(EXPORT, dtype=dtype),
            "constructor": lambda: MACE((1, 6, 8), 4.0, dtype=dtype)}[loader]
    with pytest.raises(ValueError, match=r"dtype must be float32 or float64"):
        load()


def test_a_floating_dtype_given_by_name_is_accepted():
    model = MACE((1, 6, 8), 4.0, hidden_irreps="4x0e + 4x1o", mlp_irreps="4x0e", radial_mlp=(8,),
                 correlation=2, dtype="float32")
    assert model.params["embedding"].dtype == jnp.float32


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", ["model.npz", "model.model"])
def test_config_with_an_npz_export_is_refused_naming_config_and_the_file(tmp_path, name):
    # The export carries its own (complete) configuration; config is mace-torch constructor
    # arguments for a state dict, so it would be ignored. An export is one whatever its name.
    path = tmp_path / name
    path.write_bytes(EXPORT.read_bytes())
    with pytest.raises(ValueError, match=r"config .*" + named(path) + ".*carries its own configuration"):
        MACE.from_torch(path, config={"r_max": 5.0})


def test_config_with_a_model_object_is_refused_naming_config():
    with pytest.raises(ValueError, match="config is for a state-dict file only; a mace-torch model object"):
        MACE.from_torch(object(), config={"r_max": 5.0})


# ----------------------------------------------------------------------------- bad files


def _truncated(path):
    path.write_bytes(EXPORT.read_bytes()[: EXPORT.stat().st_size // 2])


def _corrupted(path):
    # The table of contents (at the end) intact, the compressed arrays in the middle zeroed.
    data = bytearray(EXPORT.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4096] = bytes(4096)
    path.write_bytes(bytes(data))


def _config_not_json(path):
    with np.load(EXPORT) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["__config__"] = np.asarray("{not json")
    np.savez(path, **arrays)


def _foreign_zip(path):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "not a model")


MAKERS = {
    "empty": lambda p: p.write_bytes(b""),
    "truncated": _truncated,
    "random bytes": lambda p: p.write_bytes(np.random.default_rng(0).bytes(4096)),
    "text": lambda p: p.write_text("energy: -36.16 eV\n"),
    "directory": lambda p: p.mkdir(),
    "missing": lambda p: None,
    "corrupted": _corrupted,
    "config not json": _config_not_json,
    "foreign zip": _foreign_zip,
}

# (file made, suffix, error, what the message says); each case is tried on from_torch and,
# for a torch file, on export_torch too.
CASES = [
    ("empty", ".npz", ValueError, "is empty"),
    ("empty", ".model", ValueError, "is empty"),
    ("truncated", ".npz", ValueError, "is truncated or damaged.*not a complete"),
    ("truncated", ".model", ValueError, "is truncated or damaged.*not a complete"),
    ("random bytes", ".npz", ValueError, "is not a .npz archive"),
    ("text", ".npz", ValueError, "is not a .npz archive"),
    ("directory", ".npz", ValueError, "is a directory"),
    ("directory", ".model", ValueError, "is a directory"),
    ("missing", ".npz", FileNotFoundError, "does not exist"),
    ("missing", ".model", FileNotFoundError, "does not exist"),
    ("corrupted", ".npz", ValueError, "is damaged"),
    ("config not json", ".npz", ValueError, "is damaged.*configuration"),
    ("foreign zip", ".model", ValueError, "is a zip archive but not a torch file"),
]


@pytest.mark.parametrize("kind, suffix, error, says", CASES, ids=[f"{k}{s}" for k, s, *_ in CASES])
def test_a_bad_model_file_is_refused_naming_it_and_what_is_wrong(tmp_path, kind, suffix, error, says):
    path = tmp_path / f"model{suffix}"
    MAKERS[kind](path)
    loaders = [MACE.from_torch] + ([lambda p: export_torch(p, tmp_path / "out.npz")] if suffix == ".model" else [])
    for load in loaders:
        with pytest.raises(error, match=named(path) + ".*" + says) as info:
            load(path)
        if kind in ("truncated", "corrupted", "config not json"):
            assert info.value.__cause__ is not None  # the numpy / zipfile error, chained
    assert not (tmp_path / "out.npz").exists()


@pytest.mark.parametrize("kind", ["random bytes", "text"])
def test_a_file_torch_cannot_read_is_refused_naming_it(tmp_path, kind):
    pytest.importorskip("torch", reason="torch is not installed: torch.load's refusal cannot be checked")
    path = tmp_path / "model.model"
    MAKERS[kind](path)
    with pytest.raises(ValueError, match=named(path) + " cannot be read by torch.load") as info:
        MACE.from_torch(path)
    assert info.value.__cause__ is not None


@pytest.mark.skipif(HAVE_TORCH, reason="torch is installed: the file is read")
def test_without_torch_a_torch_file_is_refused_naming_it_and_torch(tmp_path):
    path = tmp_path / "model.model"
    MAKERS["random bytes"](path)
    with pytest.raises(ModuleNotFoundError, match=named(path) + ".*needs torch and mace-torch.*export_torch"):
        MACE.from_torch(path)


@pytest.mark.parametrize("name", ["model.npz", "model.model"])
def test_an_export_given_to_export_torch_is_refused_naming_it(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(EXPORT.read_bytes())
    with pytest.raises(ValueError, match=named(path) + r" is a \.npz file \(a jaxdd MACE export.*MACE\.from_torch"):
        export_torch(path, tmp_path / "out.npz")
    assert not (tmp_path / "out.npz").exists()


def test_an_export_under_another_name_loads_as_the_export(tmp_path):
    # Told by its content, not refused for its name: the same model as from the .npz.
    path = tmp_path / "model.model"
    path.write_bytes(EXPORT.read_bytes())
    got, want = MACE.from_torch(path), MACE.from_torch(EXPORT)
    np.testing.assert_array_equal(got.params["embedding"], want.params["embedding"])
    assert got.hidden_irreps == want.hidden_irreps


# ----------------------------------------------------------------------------- architecture options


@pytest.mark.parametrize("kwargs, match", [
    (dict(radial_type="spline"), r"radial_type must be one of \('bessel', 'gaussian', 'chebyshev'\)"),
    (dict(radial_type="gaussian", num_bessel=1), "gaussian' needs num_bessel >= 2"),
    (dict(distance_transform="agnesi"), r"distance_transform must be None or one of \('Agnesi', 'Soft'\)"),
    (dict(readout="LinearReadoutBlock"), "readout must be one of"),
    (dict(pair_repulsion="yes"), "pair_repulsion must be True or False"),
    (dict(apply_cutoff=1), "apply_cutoff must be True or False"),
    (dict(edge_irreps="4x1o"), "edge_irreps must start with scalars 0e"),
    (dict(interaction="RealAgnosticAttResidualInteractionBlock"), "RealAgnosticAttResidualInteractionBlock"),
])
def test_a_bad_architecture_option_is_refused_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MACE((1, 6, 8), 4.0, **kwargs)


def test_a_head_given_for_a_single_head_model_must_be_its_own():
    # A single-head model's head is mace-torch's "Default"; any other name is a mistake.
    with pytest.raises(ValueError, match=r"'pbe' is not a head of this model; its heads are \['Default'\]"):
        MACE.from_torch(EXPORT, head="pbe")
