"""Files written by ``torch.save`` (``.pth``, ``.pt``, ``.pth.tar``), read without torch.

Since PyTorch 1.6 such a file is a zip archive: ``<name>/data.pkl`` is a pickle of the saved
object whose tensors refer, by key, to raw little- or big-endian storages ``<name>/data/<key>``.
:func:`load` unpickles it with a restricted unpickler that builds every tensor as a numpy array
(a view of its storage with the tensor's offset, shape and strides, copied) and admits only the
globals a checkpoint of plain containers, tensors and numpy arrays needs; anything else (a
pickled module or class of a package) is refused by name, never imported or executed.

Published weights (SevenNet, CHGNet) are read this way, so loading them needs no torch.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile

import numpy as np

__all__ = ["load", "load_dict", "UnreadableCheckpoint"]


class UnreadableCheckpoint(ValueError):
    """A file that is not a ``torch.save`` zip archive, or one holding objects other than plain
    containers, tensors and numpy arrays."""


#: torch's storage classes -> numpy dtype of their elements.
_STORAGE_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": None,  # no numpy dtype: read as float32 (see _storage_array)
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_, "ComplexDoubleStorage": np.complex128,
    "ComplexFloatStorage": np.complex64,
}

#: ``torch.<name>`` dtypes pickled as globals (e.g. in a configuration) -> their numpy dtype name.
_TORCH_DTYPES = {"float64": "float64", "float32": "float32", "float16": "float16", "int64": "int64",
                 "int32": "int32", "bool": "bool", "double": "float64", "float": "float32", "long": "int64"}


#: numpy's own reconstructors of pickled arrays, scalars and dtypes.
_NUMPY = {"ndarray": np.ndarray, "dtype": np.dtype, "_reconstruct": np.ndarray.__reduce__(np.zeros(0))[0],
          "scalar": np.float64(0).__reduce__()[0]}
_BUILTINS = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list, "dict": dict, "slice": slice,
             "complex": complex}


class _Storage:
    """A storage referred to by the pickle: its element type and key in the archive."""

    def __init__(self, kind: str, key: str):
        self.kind, self.key = kind, key


class _StorageType:
    def __init__(self, kind: str):
        self.kind = kind


def _rebuild_parameter(data, *_):
    return data


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, archive, prefix, byteorder, source):
        super().__init__(file)
        self._archive, self._prefix, self._byteorder, self._source = archive, prefix, byteorder, source
        self._cache = {}

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(name)  # a marker in the storages' persistent ids, never called
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor"):
            return self._tensor
        if module == "torch._utils" and name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            return _rebuild_parameter
        if module == "torch" and name == "device":
            return str
        if module == "torch" and name in _TORCH_DTYPES:
            return np.dtype(_TORCH_DTYPES[name])
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if (module, name) == ("_codecs", "encode"):
            return lambda text, encoding="latin1": text.encode(encoding)
        if module in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray") and name in _NUMPY:
            return _NUMPY[name]
        if module == "numpy.dtypes" and name.endswith("DType"):
            return getattr(np.dtypes, name)
        if module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        raise UnreadableCheckpoint(
            f"{self._source!r} pickles {module}.{name}, which a checkpoint of tensors and plain containers does "
            "not need; it is not imported (reading it would run that package's code). Save the state dict "
            "instead of the object (torch.save(model.state_dict(), path)) or load it with torch")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and pid and pid[0] == "storage"):
            raise UnreadableCheckpoint(f"{self._source!r} refers to an object {pid!r} that is not a tensor storage")
        _, kind, key, _location, _numel = pid
        name = kind.kind if isinstance(kind, _StorageType) else getattr(kind, "__name__", str(kind))
        return _Storage(name, str(key))

    def _tensor(self, storage, offset, size, stride, *_):
        data = self._storage_array(storage)
        if not size:
            return np.array(data[offset])
        itemsize = data.dtype.itemsize
        view = np.lib.stride_tricks.as_strided(data[offset:], shape=size,
                                               strides=tuple(s * itemsize for s in stride))
        return np.array(view)

    def _storage_array(self, storage):
        if storage.key in self._cache:
            return self._cache[storage.key]
        try:
            raw = self._archive.read(f"{self._prefix}data/{storage.key}")
        except KeyError:
            raise UnreadableCheckpoint(f"{self._source!r} is cut short: tensor storage {storage.key!r} is "
                                       "missing from the archive") from None
        if storage.kind not in _STORAGE_DTYPES:
            raise UnreadableCheckpoint(f"{self._source!r} holds a tensor of storage type {storage.kind}, "
                                       "which cannot be read without torch")
        if storage.kind == "BFloat16Storage":  # the upper half of a float32
            bits = np.frombuffer(raw, dtype=self._byteorder + "u2").astype(np.uint32) << 16
            array = bits.view(np.float32)
        else:
            array = np.frombuffer(raw, dtype=np.dtype(_STORAGE_DTYPES[storage.kind]).newbyteorder(self._byteorder))
            array = array.astype(array.dtype.newbyteorder("="))
        self._cache[storage.key] = array
        return array


def load(path) -> object:
    """The object ``torch.save`` wrote to ``path``, its tensors as numpy arrays.

    Args:
      path: a file written by ``torch.save`` (the zip format of PyTorch >= 1.6).

    Returns:
      the saved object: dicts (``OrderedDict`` kept), lists, tuples, numbers, strings and numpy
      arrays (each tensor copied out of its storage, in its own dtype; bfloat16 as float32).

    Raises:
      FileNotFoundError: ``path`` does not exist.
      UnreadableCheckpoint: not a ``torch.save`` zip archive (e.g. the legacy non-zip format of
        PyTorch < 1.6, or a TorchScript archive), cut short, or pickling other objects.
    """
    source = os.fspath(path)
    if not os.path.isfile(source):
        if os.path.isdir(source):
            raise UnreadableCheckpoint(f"{source!r} is a directory, not a file written by torch.save")
        raise FileNotFoundError(f"checkpoint {source!r} does not exist")
    try:
        archive = zipfile.ZipFile(source)
    except zipfile.BadZipFile as e:
        raise UnreadableCheckpoint(
            f"{source!r} is not a torch.save zip archive ({e}); a file in the legacy format of PyTorch < 1.6 "
            "must be re-saved with a newer torch first") from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            what = "a TorchScript archive" if any(n.endswith("/constants.pkl") for n in archive.namelist()) \
                else "a zip archive"
            raise UnreadableCheckpoint(f"{source!r} is {what} without the one <name>/data.pkl of a torch.save file")
        prefix = pickles[0][: -len("data.pkl")]
        byteorder = "<"
        if f"{prefix}byteorder" in archive.namelist():
            byteorder = "<" if archive.read(f"{prefix}byteorder").strip() == b"little" else ">"
        try:
            data = archive.read(pickles[0])
        except (zipfile.BadZipFile, EOFError, OSError) as e:
            raise UnreadableCheckpoint(f"{source!r} is damaged: {e}") from None
        unpickler = _Unpickler(io.BytesIO(data), archive, prefix, byteorder, source)
        try:
            return unpickler.load()
        except UnreadableCheckpoint:
            raise
        except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, ValueError, TypeError) as e:
            raise UnreadableCheckpoint(f"{source!r} is damaged: {type(e).__name__}: {e}") from None


def load_dict(path, keys, what: str, inside: str | None = None) -> dict:
    """The dict a published model's checkpoint holds, checked for the keys its reader needs.

    Args:
      path: a file written by ``torch.save``.
      keys: the keys the dict must hold.
      what: the checkpoint's kind, for the message (``"a CHGNet checkpoint"``).
      inside: a key the dict may be nested under (a trainer's ``{"model": {...}}``), or None.

    Returns:
      the (inner) dict.

    Raises:
      ValueError: the file holds something else; the message names what it holds.
    """
    source = os.fspath(path)
    saved = load(source)
    inner = saved.get(inside, saved) if inside is not None and isinstance(saved, dict) else saved
    if not isinstance(inner, dict) or any(k not in inner for k in keys):
        held = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{source!r} is not {what}: it holds {held}, not {' and '.join(map(repr, keys))}")
    return inner
