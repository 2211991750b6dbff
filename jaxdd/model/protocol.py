"""What every path that calls a model agrees on, one device or many: the model's config, the
outputs a call asks for and their order, atom rows padded up to capacity buckets and per-atom
outputs cut back, and the cells a stress needs. :mod:`jaxdd.engine.driver` and :mod:`jaxdd.engine`
both build on it.
"""

from __future__ import annotations

import jax
import numpy as np

from ..data import Batch, is_concrete
from ..data.cell_widths import cell_widths
from .base import ModelConfig, ModelOutputs
from ..neighbors import capacity_bucket
from ..spec import MLIPSpec, OutputKind

__all__ = ["model_config", "requested_outputs", "default_order", "bucketed_atoms", "pad_atoms", "unpad_atoms",
           "systems_without_volume", "check_stress_cells", "minimum_image_cutoff", "narrow_cells",
           "check_cell_width"]


def model_config(model) -> ModelConfig:
    """The :class:`~jaxdd.ModelConfig` of ``model``; a ValueError naming its class when it has none."""
    cfg = getattr(model, "model_config", None)
    if not isinstance(cfg, ModelConfig):
        raise ValueError(
            f"model {type(model).__name__} has no ModelConfig in .model_config; "
            "mix in jaxdd.BaseModel and declare one"
        )
    return cfg


def bucketed_atoms(batch: Batch) -> int:
    """The atom rows ``compute`` runs ``batch`` with: :func:`~jaxdd.neighbors.capacity_bucket`
    of its atom count, or the count itself when the batch has as many systems as that (a
    per-atom output could then not be told from a per-system one)."""
    n = capacity_bucket(batch.n_atoms)
    return batch.n_atoms if batch.n_systems >= n else n


def pad_atoms(batch: Batch, n_atoms: int) -> Batch:
    """``batch`` with padding atom rows appended up to ``n_atoms``, built on the host (no
    program is compiled for it). Padding rows are as :meth:`Batch.pad` makes them: position 0,
    atomic number 0, ``atom_mask`` False, ``batch_idx`` = n_systems, masses 1."""
    v, s = batch.n_atoms, batch.n_systems
    if n_atoms <= v:
        return batch

    def fit(x, fill):
        if x is None:
            return None
        x = np.asarray(x)
        return jax.device_put(np.concatenate([x, np.full((n_atoms - v,) + x.shape[1:], fill, x.dtype)]))

    return Batch.unchecked(
        positions=fit(batch.positions, 0), atomic_numbers=fit(batch.atomic_numbers, 0), cell=batch.cell,
        pbc=batch.pbc, batch_idx=fit(batch.batch_idx, s), ptr=batch.ptr, atom_mask=fit(batch.atom_mask, False),
        system_mask=batch.system_mask, charges=fit(batch.charges, 0), masses=fit(batch.masses, 1),
        velocities=fit(batch.velocities, 0), neighbors=None,
    )


def unpad_atoms(out: ModelOutputs, n_atoms: int, n_padded: int, spec=None) -> ModelOutputs:
    """Per-atom outputs of a run on ``n_padded`` rows cut back to the first ``n_atoms``, on the
    host. An output is per-atom when ``spec`` declares it PER_NODE, or, undeclared, when its
    leading axis has ``n_padded`` entries (``forces``, ``atomic_energies``).

    Args:
      out: the outputs of the run.
      n_atoms: the real atoms, the rows kept.
      n_padded: the rows the run had.
      spec: an :class:`~jaxdd.spec.MLIPSpec` declaring the output kinds, or None.
    """
    if n_padded == n_atoms:
        return out
    kept = {}
    for key, value in out.items():
        kind = spec.kind_of(key) if isinstance(spec, MLIPSpec) else OutputKind.UNKNOWN
        per_atom = kind is OutputKind.PER_NODE or (kind is OutputKind.UNKNOWN and getattr(value, "ndim", 0) >= 1
                                                   and value.shape[0] == n_padded)
        if per_atom:
            value = _first_rows(value, n_atoms)
        kept[key] = value
    return ModelOutputs(kept)


def _first_rows(value, n: int):
    """The first ``n`` rows of an array, cut on the host and placed as the array was: on the same
    devices if it was committed to them (a replicated output of several processes included),
    else uncommitted, so that it combines with other arrays as the uncut one did."""
    if not isinstance(value, jax.Array) or not is_concrete(value):  # traced (a gradient of compute): cut in the trace
        return value[:n]
    local = value if value.is_fully_addressable else value.addressable_data(0)  # replicated: whole
    host = np.asarray(local)[:n]
    if not value.committed:
        return jax.device_put(host)
    return jax.make_array_from_callback(host.shape, value.sharding, lambda index: host[index])


def requested_outputs(cfg: ModelConfig, outputs, virial_key: str | None = None) -> tuple[tuple[str, ...], bool]:
    """The output keys of a call, checked against the model's ``cfg``, and whether they ask for
    the per-atom virials ``virial_key`` (a spec's ``node_virial_key``, which the model need not
    list among its outputs; then it comes last).

    Args:
      cfg: the model's :class:`~jaxdd.ModelConfig`. outputs: the keys asked for (a key, an
      iterable of keys, or None: the model's active outputs). virial_key: or None.
    """
    requested = default_order(cfg.active_outputs) if outputs is None else outputs
    requested = (requested,) if isinstance(requested, str) else tuple(requested)
    wants = virial_key is not None and virial_key in requested
    rest = tuple(k for k in requested if k != virial_key)
    checked = cfg.check_outputs(rest) if rest or not wants else ()
    return (checked + (virial_key,) if wants else checked), wants


def default_order(keys) -> tuple[str, ...]:
    """Output keys in the order outputs are returned: energy, forces, stress, then the rest sorted."""
    first = [k for k in ("energy", "forces", "stress") if k in keys]
    return tuple(first + sorted(set(keys) - set(first)))


def systems_without_volume(batch: Batch) -> np.ndarray:
    """Indices of the real systems of ``batch`` whose cell has zero volume (no stress there)."""
    volume = np.abs(np.linalg.det(np.asarray(batch.cell)))
    return np.flatnonzero(np.asarray(batch.system_mask) & ~(volume > 0))


def check_stress_cells(batch: Batch) -> None:
    """Raise ValueError naming the systems of ``batch`` whose cell has no volume (no stress there)."""
    flat = systems_without_volume(batch)
    if flat.size:
        raise ValueError(
            f"stress needs a cell of non-zero volume, but system(s) {flat[:8].tolist()} have a degenerate cell; "
            "give those systems a cell (vacuum box) or do not request 'stress'"
        )


def minimum_image_cutoff(model) -> float | None:
    """``model``'s :meth:`~jaxdd.BaseModel.minimum_image_cutoff` (Å), or None for a model
    without one (never limited)."""
    reach = getattr(model, "minimum_image_cutoff", None)
    return None if reach is None else reach()


def narrow_cells(model, cell, pbc) -> list[tuple[int, int, float]]:
    """The periodic widths of ``cell`` a minimum-image model cannot run on.

    Args:
      model: the model (its :meth:`~jaxdd.BaseModel.minimum_image_cutoff`; a model without
        one is never limited).
      cell: [S, 3, 3] or [3, 3] Å.
      pbc: [S, 3] or [3] bools.

    Returns:
      ``(system, lattice vector, width Å)`` of every periodic width not above twice the
      model's minimum-image cutoff; empty when the cell suits the model.
    """
    reach = minimum_image_cutoff(model)
    if reach is None:
        return []
    cell = np.asarray(cell, np.float64).reshape(-1, 3, 3)
    pbc = np.broadcast_to(np.asarray(pbc, bool).reshape(-1, 3), (cell.shape[0], 3))
    widths = cell_widths(cell)
    return [(int(s), int(k), float(widths[s, k])) for s, k in zip(*np.nonzero(pbc & (widths <= 2.0 * reach)))]


def check_cell_width(model, cell, pbc, *, at: str = "") -> None:
    """Refuse a cell narrower than a minimum-image model needs (:func:`narrow_cells`).

    Args:
      model: the model.
      cell: [S, 3, 3] or [3, 3] Å.
      pbc: [S, 3] or [3] bools.
      at: where the cell comes from, for the message (``" at step 120"``).

    Raises:
      ValueError: naming the system, the lattice vector, the width and the limit.
    """
    narrow = narrow_cells(model, cell, pbc)
    if narrow:
        s, k, width = narrow[0]
        reach = model.minimum_image_cutoff()
        system = f" (system {s})" if np.asarray(cell).reshape(-1, 3, 3).shape[0] > 1 else ""
        raise ValueError(
            f"the cell{at}{system} is {width:.4g} Å wide across lattice vector {k}, not wider than twice the cutoff "
            f"({reach:g} Å): {type(model).__name__}'s periodic displacements are minimum-image and would miss or "
            "double count images; repeat the cell (ase: atoms * (2, 2, 2)) until every width exceeds 2 × cutoff, "
            "or use a model on jaxdd's neighbour lists, which handle any cell")
