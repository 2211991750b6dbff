"""Specification of ``jaxdd.interop.pth``: files written by ``torch.save``, read without torch.

The files read are the published SevenNet checkpoints of the ``sevenn`` wheel (installed
without its dependencies, as the carrier of the files); the damaged and foreign files are made
here from them and from plain pickles.
"""

import importlib.util
import pathlib
import pickle
import zipfile

import numpy as np
import pytest

from jaxdd.interop import pth


def _sevenn_file(relative):
    spec = importlib.util.find_spec("sevenn")
    if spec is None:
        pytest.skip("the sevenn wheel (the carrier of SevenNet's checkpoints) is not installed: "
                    "pip install --no-deps sevenn==0.13.0")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / relative


@pytest.fixture(scope="module")
def sevennet_0():
    return _sevenn_file("pretrained_potentials/SevenNet_0__11Jul2024/checkpoint_sevennet_0.pth")


def test_a_checkpoint_reads_as_nested_containers_of_numpy_arrays(sevennet_0):
    checkpoint = pth.load(sevennet_0)
    assert set(checkpoint) >= {"model_state_dict", "config"}
    state = checkpoint["model_state_dict"]
    weight = state["0_convolution.weight_nn.layer2.weight"]
    assert isinstance(weight, np.ndarray) and weight.dtype == np.float32 and weight.shape == (64, 384)
    assert checkpoint["config"]["cutoff"] == 5.0


def test_a_tensor_viewed_with_strides_and_an_offset_is_copied_out_of_its_storage(sevennet_0):
    # The Wigner 3j buffers of e3nn are small views; their values are the coupling coefficients.
    w3j = pth.load(sevennet_0)["model_state_dict"]["1_convolution.convolution._compiled_main_left_right._w3j_1_1_2"]
    assert w3j.shape == (3, 3, 5)
    np.testing.assert_allclose(np.linalg.norm(w3j), 1.0, rtol=1e-6)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.pth"):
        pth.load(tmp_path / "nothing.pth")


def test_a_file_that_is_not_a_zip_archive_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / "legacy.pth"
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(pth.UnreadableCheckpoint, match="not a torch.save zip archive.*re-saved"):
        pth.load(path)


def test_a_file_cut_short_is_refused_not_read_in_part(tmp_path, sevennet_0):
    path = tmp_path / "cut.pth"
    data = sevennet_0.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(pth.UnreadableCheckpoint, match="cut.pth"):
        pth.load(path)


def test_a_missing_tensor_storage_is_named(tmp_path, sevennet_0):
    path = tmp_path / "missing.pth"
    with zipfile.ZipFile(sevennet_0) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            if not item.filename.endswith("/data/0"):
                dst.writestr(item, src.read(item.filename))
    with pytest.raises(pth.UnreadableCheckpoint, match="storage '0' is missing"):
        pth.load(path)


class Payload:
    """A class of this test module: unpickling it would import and run this package's code."""


def test_a_pickled_object_of_another_package_is_refused_by_name_not_imported(tmp_path):
    path = tmp_path / "object.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps({"model": Payload()}))
    with pytest.raises(pth.UnreadableCheckpoint, match=r"test_pth\.Payload.*state dict"):
        pth.load(path)


def test_plain_containers_and_numpy_arrays_round_trip(tmp_path):
    value = {"list": [1, 2.5, "x"], "tuple": (True, None), "array": np.arange(6.0).reshape(2, 3)}
    path = tmp_path / "plain.pth"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(value, protocol=2))
    got = pth.load(path)
    assert got["list"] == value["list"] and got["tuple"] == value["tuple"]
    np.testing.assert_array_equal(got["array"], value["array"])


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(pth.UnreadableCheckpoint, match="directory"):
        pth.load(tmp_path)
