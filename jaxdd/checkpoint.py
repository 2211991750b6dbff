"""Checkpoints of model wrappers: parameters through orbax, the spec beside them as JSON.

A checkpoint is a folder::

    path/params/      orbax checkpoint of the wrapper's array leaves (the parameters)
    path/spec.json    the distribution spec (a deployment artefact shipped with the weights)

The wrapper's structure and static configuration are not stored: load into a wrapper built
the same way (``load(path, like=Model(...))``), as with any JAX pytree checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from .spec import MLIPSpec

__all__ = ["save", "load"]


def save(path: str | Path, model, spec: MLIPSpec | None = None) -> Path:
    """Write ``model``'s parameters and its spec (default: ``model.distribution_spec``) under ``path``.

    ``path`` must not exist yet or be an empty folder (a checkpoint is never overwritten).
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

    like: a wrapper built with the same configuration (its parameter values are replaced).
    spec is None when the checkpoint holds none. Shapes and dtypes must match ``like``'s.
    """
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not (path / "params").exists():
        raise FileNotFoundError(f"{path} holds no checkpoint (no params/ folder)")
    params, rest = eqx.partition(like, eqx.is_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    target = {f"{i:05d}": leaf for i, leaf in enumerate(leaves)}
    try:
        restored = ocp.StandardCheckpointer().restore(path / "params", target)
    except ValueError as exc:
        raise ValueError(f"checkpoint {path} does not fit the wrapper given as like= ({exc}); build it with the "
                         "same settings as the saved one") from exc
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
