"""What makes a dynamics checkpoint know it is whole: a sha256 of every array (of each block as
the ranks saved it), of ``md.json`` and of ``spec.json``, and an id that ``md.json`` and the
arrays share, written by :func:`~jaxdd.dynamics.checkpoints.save` and checked by ``restore``.

Format 2 (:data:`FORMAT`) records them in ``md.json`` (``format``, ``checkpoint_id``,
``checksums``); format 1, written before them (no ``format`` field), has none and is restored
unchecked. A mismatch raises :class:`~jaxdd.CheckpointError` naming the file and the array.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from pathlib import Path

import jax
import numpy as np

from ..model.checkpoint import damaged

__all__ = ["FORMAT", "RUN_DTYPES", "new_id", "array_digests", "seal", "check_md_json", "check_arrays"]

#: The format :func:`seal` writes; md.json without a ``format`` field is format 1 (no checksums).
FORMAT = 2
#: The dtypes a run's positions can have.
RUN_DTYPES = ("float32", "float64")
ID_KEY = "checkpoint_id"


def new_id() -> np.ndarray:
    """A fresh checkpoint id, 16 random bytes (uint8[16]), the same on every process."""
    value = np.frombuffer(uuid.uuid4().bytes, np.uint8).copy()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        value = np.asarray(multihost_utils.broadcast_one_to_all(value), np.uint8)
    return value


def _digest(a: np.ndarray) -> str:
    """sha256 (hex) of an array's dtype, shape and bytes."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()


def _key(index, shape) -> str:
    """The block ``index`` (a tuple of slices) of an array of ``shape`` as ``"0:1,0:65,0:3"``."""
    return ",".join(f"{s.indices(n)[0]}:{s.indices(n)[1]}" for s, n in zip(index, shape))


def _slices(key: str) -> tuple:
    return tuple(slice(*map(int, part.split(":"))) for part in key.split(",") if part)


def _leaves(tree: dict):
    """(``"group/name"``, array) of a checkpoint's two-level tree of arrays."""
    for group, value in tree.items():
        if isinstance(value, dict):
            for name, x in value.items():
                yield f"{group}/{name}", x
        elif group != ID_KEY:
            yield group, value


def _blocks(x):
    """(key, host copy) of every block of ``x`` this process saves (replica 0 of its shards)."""
    if isinstance(x, jax.Array):
        for shard in x.addressable_shards:
            if shard.replica_id == 0:
                yield _key(shard.index, x.shape), np.asarray(shard.data)
    else:
        a = np.asarray(x)
        yield _key((slice(None),) * a.ndim, a.shape), a


def _narrow(dtype: np.dtype) -> np.dtype | None:
    """The 32-bit dtype JAX reads a 64-bit array as when float64 is off (None: no change)."""
    return {"f": np.dtype(np.float32), "i": np.dtype(np.int32), "u": np.dtype(np.uint32)}.get(
        dtype.kind) if dtype.itemsize == 8 else None


def array_digests(tree: dict, run_dtype: str) -> dict:
    """The checksums of the arrays of a checkpoint's tree, gathered from every process.

    Args:
      tree: ``{group: {name: array}}`` or ``{group: array}`` as saved.
      run_dtype: the run's float dtype; a float32 run's 64-bit arrays also get the checksum
        of their 32-bit copy (``narrow``), what they are read back as when float64 is off.

    Returns:
      ``{"group/name": {"dtype": str, "blocks": {key: sha256}, ["narrow": {key: sha256}]}}``.
    """
    out = {}
    for name, x in _leaves(tree):
        dtype = np.dtype(x.dtype)
        entry = out.setdefault(name, {"dtype": str(dtype), "blocks": {}})
        narrow = _narrow(dtype) if run_dtype == "float32" else None
        for key, block in _blocks(x):
            entry["blocks"][key] = _digest(block)
            if narrow is not None:
                entry.setdefault("narrow", {})[key] = _digest(block.astype(narrow))
    return _gathered(out)


def _gathered(digests: dict) -> dict:
    """``digests`` of every process merged (each process holds some blocks of each array)."""
    if jax.process_count() == 1:
        return digests
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(digests).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([raw.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:raw.size] = raw
    everyone = np.asarray(multihost_utils.process_allgather(padded))
    merged: dict = {}
    for row, size in zip(everyone, sizes):
        for name, entry in json.loads(bytes(row[:size]).decode()).items():
            mine = merged.setdefault(name, {"dtype": entry["dtype"]})
            for part in ("blocks", "narrow"):
                if part in entry:
                    mine.setdefault(part, {}).update(entry[part])
    return merged


def _md_digest(meta: dict) -> str:
    """sha256 of md.json's content, its own checksum left out."""
    body = dict(meta, checksums={k: v for k, v in meta.get("checksums", {}).items() if k != "md.json"})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(meta: dict, checkpoint_id: np.ndarray, arrays: dict, spec_file: Path | None) -> dict:
    """``meta`` (md.json's content) with the format, the checkpoint id and the checksums.

    Args:
      meta: md.json's fields. checkpoint_id: the id saved with the arrays (uint8[16]).
      arrays: :func:`array_digests` of the saved tree. spec_file: the written spec.json (None: none).

    Returns:
      the dict to write as md.json.
    """
    checksums = {"arrays": arrays}
    if spec_file is not None:
        checksums["spec.json"] = hashlib.sha256(Path(spec_file).read_bytes()).hexdigest()
    meta = dict(meta, format=FORMAT, checkpoint_id=bytes(checkpoint_id).hex(), checksums=checksums)
    meta["checksums"]["md.json"] = _md_digest(meta)
    return meta


def check_md_json(file: Path, meta: dict) -> int:
    """The format of the checkpoint whose md.json (at ``file``) holds ``meta``, after checking
    md.json and spec.json against their checksums (format 2).

    CheckpointError naming md.json when a format-2 md.json lacks its checksums or id or was
    edited, naming spec.json when it does not match; format 1 has nothing to check.

    Args:
      file: the checkpoint's md.json. meta: its content, as read.

    Returns:
      the format: 1 (no checksums) or :data:`FORMAT`.
    """
    file = Path(file)
    fmt = meta.get("format", 1)
    if fmt == 1 and "checksums" not in meta:
        return 1
    if fmt != FORMAT:
        raise damaged(file, f"field 'format' is {str(fmt)[:50]}, not one this jaxdd reads (1 or {FORMAT}); "
                            "restore it with the jaxdd that wrote it")
    sums = meta.get("checksums")
    if not (isinstance(sums, dict) and isinstance(sums.get("arrays"), dict) and isinstance(sums.get("md.json"), str)
            and isinstance(meta.get(ID_KEY), str)):
        raise damaged(file, f"has no checksums or no checkpoint id, which every checkpoint of format {FORMAT} "
                            "records (they were removed)")
    if _md_digest(meta) != sums["md.json"]:
        raise damaged(file, "does not match the checksum it records (it was edited after it was written)")
    spec = file.parent / "spec.json"
    if "spec.json" in sums and spec.is_file() and hashlib.sha256(spec.read_bytes()).hexdigest() != sums["spec.json"]:
        raise damaged(spec, "does not match its checksum in md.json (it was edited, or comes from another checkpoint)")
    return FORMAT


def check_arrays(folder: Path, file: Path, meta: dict, fmt: int, arrays: dict) -> None:
    """Check the arrays read back from ``folder`` against md.json (``meta``, at ``file``).

    CheckpointError naming md.json when it belongs to other arrays (another checkpoint id, or
    none where the arrays carry one); naming the folder and the array when an array is missing,
    unrecorded, or its data does not match its checksum. Format 1 has no checksums to check.

    Args:
      folder: the checkpoint's ``arrays/`` folder. file: its md.json. meta: md.json's content.
      fmt: the format :func:`check_md_json` found. arrays: the arrays as read (two-level dict).
    """
    stored = arrays.get(ID_KEY)
    stored = None if stored is None else bytes(np.asarray(stored, np.uint8)).hex()
    if fmt == 1:
        if stored is not None:
            raise damaged(file, f"has no checksums, but the arrays in {folder} were written with them (checkpoint id "
                                f"{stored}): this md.json comes from another, older checkpoint")
        return
    if stored != meta[ID_KEY]:
        raise damaged(file, f"belongs to another checkpoint (id {meta[ID_KEY]}) than the arrays in {folder} (id "
                            f"{stored}): the files of two checkpoints were mixed")
    recorded = meta["checksums"]["arrays"]
    held = dict(_leaves(arrays))
    for name in sorted(set(held) ^ set(recorded)):
        problem = "which md.json records" if name in recorded else "which md.json does not record"
        raise damaged(folder, f"{'lacks' if name in recorded else 'holds'} the array {name}, {problem}")
    bad = sorted(name for name, x in held.items() if not _matches(x, recorded[name]))
    bad = _everyone(bad)
    if bad:
        raise damaged(folder, f"holds data of the array{'s' if len(bad) > 1 else ''} {', '.join(bad)} that does not "
                              "match its checksum in md.json (its bytes were altered after it was written)")


def _matches(x, entry: dict) -> bool:
    """Whether every block of ``x`` this process holds has the checksum of ``entry``."""
    dtype = np.dtype(x.dtype)
    sums = entry.get("blocks", {}) if str(dtype) == entry.get("dtype") else (
        entry.get("narrow") if _narrow(np.dtype(entry.get("dtype", "V"))) == dtype else None)
    if not isinstance(sums, dict):
        return False
    shards = x.addressable_shards if isinstance(x, jax.Array) else None
    for key, want in sums.items():
        block = _block(x, shards, _slices(key))
        if block is not None and _digest(block) != want:
            return False
    return True


def _block(x, shards, region: tuple):
    """The host copy of ``region`` of ``x`` when this process holds it (else None)."""
    if shards is None:
        return np.asarray(x)[region]
    for shard in shards:
        have = [s.indices(n)[:2] for s, n in zip(shard.index, x.shape)]
        if all(a <= r.start and r.stop <= b for (a, b), r in zip(have, region)):
            return np.asarray(shard.data)[tuple(slice(r.start - a, r.stop - a) for (a, _), r in zip(have, region))]
    return None


def _everyone(bad: list) -> list:
    """The arrays found bad on any process (every process raises the same error)."""
    if jax.process_count() == 1:
        return bad
    merged = _gathered({name: {"dtype": ""} for name in bad})
    return sorted(merged)
