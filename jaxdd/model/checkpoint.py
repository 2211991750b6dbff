"""Checkpoints of model wrappers: parameters through orbax, the spec beside them as JSON.

A checkpoint is a folder::

    path/params/      orbax checkpoint of the wrapper's array leaves (the parameters)
    path/spec.json    the distribution spec (a deployment artefact shipped with the weights)

The wrapper's structure and static configuration are not stored: load into a wrapper built
the same way (``load(path, like=Model(...))``), as with any JAX pytree checkpoint.

A checkpoint folder that is damaged (a file missing, empty or cut short, e.g. by a write that
was interrupted) raises :class:`CheckpointError` naming the file and what is wrong with it;
the reading helpers here serve :meth:`jaxdd.DomainParallel.restore` too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from ..spec import MLIPSpec

__all__ = ["save", "load", "CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint is damaged or incomplete: the message names the file, what is wrong with it
    and what to do."""


def damaged(file, problem: str) -> CheckpointError:
    """The error for a checkpoint ``file`` (or folder) with ``problem``, saying what to do."""
    return CheckpointError(f"damaged checkpoint: {file} {problem}; the checkpoint cannot be used as it is; "
                           "restore an intact copy of the folder, or resume from another checkpoint")


def _cause(exc: BaseException) -> str:
    """The first line of an orbax / tensorstore error, without the tensorstore spec it appends."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = text.split(" [tensorstore_spec", 1)[0]
    return text if len(text) <= 300 else text[:300] + " ..."


def read_json(file: Path) -> dict:
    """The JSON object in a checkpoint ``file``; CheckpointError when it is missing, empty, cut
    short or not an object."""
    file = Path(file)
    try:
        text = file.read_text()
    except FileNotFoundError:
        raise damaged(file, "is missing") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise damaged(file, f"cannot be read ({exc})") from None
    if not text.strip():
        raise damaged(file, "is empty (its write was probably interrupted)")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise damaged(file, f"is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}; "
                            "it was probably cut short)") from None
    if not isinstance(value, dict):
        raise damaged(file, f"holds a JSON {type(value).__name__}, not the object it was written with")
    return value


def array_tree(folder: Path) -> Mapping:
    """The metadata (shape and dtype of every array) of the orbax checkpoint ``folder``;
    CheckpointError when the folder is missing or orbax cannot read it."""
    import orbax.checkpoint as ocp

    folder = Path(folder)
    if not folder.is_dir():
        raise damaged(folder, "is missing (the folder of the checkpoint's arrays)")
    broken = _broken_file(folder, ("_METADATA",))  # files every orbax release writes: no need to ask it
    if broken is not None:
        raise broken
    try:
        meta = ocp.StandardCheckpointer().metadata(folder)
        inner = getattr(meta, "item_metadata", meta)  # the layout differs between orbax releases
        tree = getattr(inner, "tree", inner)
    except Exception as exc:  # orbax raises whatever its reader hit
        raise _unreadable(folder, exc) from exc
    if not isinstance(tree, Mapping):
        # This orbax logs the reader's error and returns no tree; ask its handler for the cause.
        try:
            from etils import epath

            ocp.StandardCheckpointHandler().metadata(epath.Path(folder))
            cause = None
        except Exception as exc:
            cause = exc
        raise _unreadable(folder, cause)
    return tree


def _broken_file(folder: Path, names=None) -> CheckpointError | None:
    """The error for a broken orbax file of ``folder``, if any: one of its JSON files (``names``;
    default every ``_*`` file) empty or cut short, or the index of its OCDBT array store missing."""
    files = sorted(folder.glob("_*")) if names is None else [folder / n for n in names]
    for file in files:
        if not file.is_file():
            continue
        try:
            json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            size = file.stat().st_size
            return damaged(file, "is empty" if size == 0 else
                           f"is not valid JSON ({size} bytes; it was probably cut short)")
    ocdbt = (folder / "d").is_dir() or any(folder.glob("ocdbt.process_*"))
    if ocdbt and not (folder / "manifest.ocdbt").is_file():
        return damaged(folder / "manifest.ocdbt", "is missing (the index of the arrays in that folder)")
    return None


def _unreadable(folder: Path, cause: BaseException | None) -> CheckpointError:
    """The error for an orbax folder whose metadata cannot be read: the broken file when one can
    be named, else orbax's reason."""
    broken = _broken_file(folder)
    if broken is not None:
        return broken
    reason = "it describes no arrays" if cause is None else _cause(cause)
    return damaged(folder, f"cannot be read by orbax ({reason}): a file in it is missing or cut short")


def restore_arrays(folder: Path, target):
    """``target`` (a tree of ShapeDtypeStructs or arrays) read from the orbax checkpoint ``folder``;
    CheckpointError naming the folder when its data cannot be read."""
    import orbax.checkpoint as ocp

    try:
        return ocp.StandardCheckpointer().restore(Path(folder), target)
    except Exception as exc:  # orbax raises whatever its reader hit
        raise damaged(folder, f"holds arrays that cannot be read ({_cause(exc)})") from exc


def save(path: str | Path, model, spec: MLIPSpec | None = None) -> Path:
    """Write ``model``'s parameters and its spec (default: ``model.distribution_spec``) under ``path``.

    Args:
      path: the checkpoint folder; it must not exist yet or be empty (a checkpoint is never overwritten).
      model: the model wrapper whose array leaves are saved.
      spec: the MLIPSpec saved beside them (None: ``model.distribution_spec``, if any).

    Returns:
      ``path`` as an absolute ``Path``.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"checkpoint folder {path} is not empty; choose a new path")
    spec = spec if spec is not None else getattr(model, "distribution_spec", None)
    params, _ = eqx.partition(model, eqx.is_array)
    leaves = jax.tree_util.tree_leaves(params)
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / "params", {f"{i:05d}": leaf for i, leaf in enumerate(leaves)})
    checkpointer.wait_until_finished()
    if spec is not None:
        spec.save(path / "spec.json")
    return path


def load(path: str | Path, like):
    """(model, spec) from a checkpoint written by :func:`save`.

    Args:
      path: the checkpoint folder.
      like: a wrapper built with the same configuration (its parameter values are replaced);
        shapes and dtypes must match ``like``'s.

    Returns:
      ``(model, spec)``: ``like`` with the stored parameters, and the stored MLIPSpec (None
      when the checkpoint holds none).
    """
    path = Path(path).absolute()
    if not (path / "params").exists():
        raise FileNotFoundError(f"{path} holds no checkpoint (no params/ folder)")
    params, rest = eqx.partition(like, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    target = {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}
    stored = array_tree(path / "params")  # a damaged folder is named here, before any mismatch
    if sorted(stored) != sorted(target):
        raise ValueError(f"checkpoint {path} holds {len(stored)} parameter arrays but the wrapper given as like= "
                         f"has {len(target)}; build it with the same settings as the saved one")
    for key, leaf in target.items():
        if tuple(getattr(stored[key], "shape", ())) != tuple(np.shape(leaf)):
            raise ValueError(f"checkpoint {path} does not fit the wrapper given as like=: parameter {int(key)} is "
                             f"stored with shape {tuple(stored[key].shape)} but the wrapper's has shape "
                             f"{tuple(np.shape(leaf))}; build it with the same settings as the saved one")
    restored = restore_arrays(path / "params", target)
    # Through the host: restored arrays are committed to one device, which would pin a
    # DistributedModel's mesh program to it; fresh arrays go wherever they are used.
    new = [jax.numpy.asarray(np.asarray(restored[f"{i:05d}"])) for i in range(len(leaves))]
    for i, (old, got) in enumerate(zip(leaves, new)):
        if np.shape(old) != np.shape(got) or np.asarray(old).dtype != np.asarray(got).dtype:
            raise ValueError(f"checkpoint leaf {i} is {np.shape(got)} {np.asarray(got).dtype} but the wrapper given as "
                             f"like= expects {np.shape(old)} {np.asarray(old).dtype}; build it with the same settings")
    model = eqx.combine(jax.tree_util.tree_unflatten(treedef, new), rest)
    spec = MLIPSpec.load(path / "spec.json") if (path / "spec.json").exists() else None
    return model, spec
