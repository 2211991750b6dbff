"""Single-device driver: neighbour list, model call, and the framework's autodiff.

``compute(model, data)`` is the reference every distributed run is compared with. It
builds the neighbour list the model's :class:`~jaxdd.model.base.NeighborConfig` asks for, calls
the wrapper, and derives the outputs listed in ``autograd_outputs`` itself:

* forces = -dE/dR (eV/Å), taken with respect to the positions as given;
* stress = (1/V) dE/dε (eV/Å³, ASE's sign convention), with the strain ε applied to the
  positions and the cell together: R' = R (I + ε), h' = h (I + ε).

Overflowing capacities grow on the host and the call is retried; pairs are never dropped.

Compiled programs are shared between systems of similar size: the atom rows are padded (on
the host, masked) up to :func:`~jaxdd.neighbors.capacity_bucket` of the atom count, and the
neighbour capacities ``compute`` sizes or grows are rounded up to buckets too, so a process
evaluating many differently sized structures compiles one program per bucket, not per size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import equinox as eqx
import jax
import jax.numpy as jnp

from .. import programs
from . import virials
from ..data import AtomicData, Batch, as_batch
from ..model.base import BaseModel, ModelOutputs
from ..neighbors import NeighborCapacity, NeighborListFormat, build_neighbor_list, edge_vectors, neighbor_capacity
from ..neighbors.capacity import run_until_fits
from ..model.protocol import (bucketed_atoms, check_stress_cells, model_config, pad_atoms, requested_outputs,
                       unpad_atoms)
from ..data.segments import per_system_sum
from ..spec import MLIPSpec

__all__ = ["compute", "energy_and_derivatives", "neighbor_list_for"]


def neighbor_list_for(model, batch: Batch, capacity: NeighborCapacity):
    """Build (traceable) the neighbour list ``model`` asks for, or None if it needs none.

    Args:
      model: the wrapper whose ``neighbor_config`` sets cutoff, half list and format.
      batch: the Batch to search.
      capacity: the NeighborCapacity of the list.
    """
    nc = model_config(model).neighbor_config
    if nc is None:
        return None
    return build_neighbor_list(
        batch.positions,
        batch.cell,
        batch.pbc,
        batch.batch_idx,
        batch.atom_mask,
        cutoff=nc.search_cutoff,
        capacity=capacity,
        half=nc.half_list,
        format=nc.format,
        bond_cutoff=nc.bond_search_cutoff,
    )


def energy_and_derivatives(model, batch: Batch, outputs: tuple[str, ...], virial_key: str | None = None
                           ) -> ModelOutputs:
    """Call ``model`` on ``batch`` (neighbours attached) and add the autograd outputs.

    Traceable; the caller builds the neighbour list.

    Args:
      model: the wrapper (``BaseModel``).
      batch: the Batch, ``neighbors`` attached.
      outputs: the keys to return.
      virial_key: the key under which per-atom virials are derived when requested
        (:mod:`jaxdd.engine.virials`; the spec's ``node_virial_key``), or None.

    Returns:
      ModelOutputs with only the requested keys.
    """
    cfg = model_config(model)
    want_forces = "forces" in outputs and "forces" in cfg.autograd_outputs
    want_stress = "stress" in outputs and "stress" in cfg.autograd_outputs
    want_virials = virial_key is not None and virial_key in outputs
    if not (want_forces or want_stress or want_virials):
        out = model(batch)
        return _select(out, outputs, model)

    n_sys = batch.n_systems
    system = jnp.clip(batch.batch_idx, 0, n_sys - 1)

    def total_energy(positions, strain, displacement=None):
        nl = batch.neighbors if displacement is None else dataclasses.replace(batch.neighbors,
                                                                               displacement=displacement)
        if strain is None:
            out = model(batch.replace(positions=positions, neighbors=nl))
        else:
            # Identity strain by default; the gradient at zero strain is the virial.
            deform = jnp.eye(3, dtype=positions.dtype) + strain
            pos = jnp.einsum("vi,vij->vj", positions, deform[system])
            cell = jnp.einsum("sij,sjk->sik", batch.cell, deform)
            out = model(batch.replace(positions=pos, cell=cell, neighbors=nl))
        energy = _energy(out, model)
        return jnp.sum(jnp.where(batch.system_mask, energy, 0.0)), out

    extra = {}
    if want_virials:
        dtype = batch.positions.dtype
        strain = jnp.zeros((n_sys, 3, 3), dtype)
        nl = batch.neighbors
        probe = jnp.zeros(nl.shifts.shape, dtype)  # a zero offset of every edge vector: dE/dr_e
        (_, out), (g_pos, g_strain, g_edges) = jax.value_and_grad(total_energy, argnums=(0, 1, 2), has_aux=True)(
            batch.positions, strain, probe)
        vectors = edge_vectors(batch.positions, batch.cell, batch.batch_idx, nl)
        per_atom = virials.atomic_virials(vectors, g_edges, nl.mask, nl.receivers, batch.n_atoms)
        per_atom = jnp.where(batch.atom_mask[:, None, None], per_atom, 0.0)
        summed = per_system_sum(per_atom, batch.batch_idx, n_sys)
        extra[virial_key] = virials.enforce_sum_rule(per_atom, summed, g_strain, batch.system_mask)
    elif want_stress:
        strain = jnp.zeros((n_sys, 3, 3), batch.positions.dtype)
        (_, out), (g_pos, g_strain) = jax.value_and_grad(total_energy, argnums=(0, 1), has_aux=True)(
            batch.positions, strain
        )
    else:
        # Forces alone: no strain in the graph, so nothing is spent on the virial.
        (_, out), g_pos = jax.value_and_grad(total_energy, has_aux=True)(batch.positions, None)
    if want_forces:
        extra["forces"] = jnp.where(batch.atom_mask[:, None], -g_pos, 0.0)
    if want_stress:
        volume = jnp.abs(jnp.linalg.det(batch.cell))
        safe = jnp.where(volume > 0, volume, 1.0)
        extra["stress"] = jnp.where((volume > 0)[:, None, None], g_strain / safe[:, None, None], 0.0)
    return _select(ModelOutputs({**out, **extra}), outputs, model)


def _energy(out, model):
    if "energy" not in out:
        raise ValueError(f"{type(model).__name__} returned no 'energy'; autograd outputs are derived from it")
    return out["energy"]


def _select(out, outputs, model) -> ModelOutputs:
    missing = [k for k in outputs if k not in out]
    if missing:
        raise ValueError(
            f"{type(model).__name__} did not return {missing} (it returned {list(out)}); "
            "compute them in the model or list them in ModelConfig.autograd_outputs"
        )
    return ModelOutputs({k: out[k] for k in outputs})


@programs.track
@eqx.filter_jit
def _run(model, batch, outputs, capacity, virial_key=None):
    nl = neighbor_list_for(model, batch, capacity) if capacity is not None else None
    out = energy_and_derivatives(model, batch.replace(neighbors=nl), outputs, virial_key)
    overflow = jnp.asarray(False) if nl is None else nl.overflow
    return out, overflow, nl


def compute(
    model: BaseModel,
    data: AtomicData | Batch,
    outputs: Iterable[str] | str | None = None,
    *,
    capacity: NeighborCapacity | None = None,
    max_rebuilds: int = 8,
    spec: MLIPSpec | None = None,
) -> ModelOutputs:
    """Evaluate ``model`` on one device.

    Args:
      model: a wrapper (``BaseModel``) whose parameters are pytree leaves.
      data: an AtomicData or a (possibly padded) Batch.
      outputs: keys to return; each must be in the model's ``ModelConfig.outputs``
        (default: its ``active_outputs``).
      capacity: a starting neighbour-list capacity (sized from the data when None).
      max_rebuilds: how many times an overflowing neighbour list is grown and rebuilt before
        giving up.
      spec: the :class:`~jaxdd.spec.MLIPSpec` whose ``node_virial_key`` names per-atom virials
        that may be requested beside the model's outputs ([V, 3, 3] eV, :mod:`jaxdd.engine.virials`;
        default: the model's ``distribution_spec``).

    Returns:
      ModelOutputs with ``energy [S]``, ``forces [V, 3]``, ``stress [S, 3, 3]``,
      ... as requested; rows of padding atoms and systems are zero.
    """
    cfg = model_config(model)
    spec = spec if spec is not None else getattr(model, "distribution_spec", None)
    virial_key = spec.node_virial_key if isinstance(spec, MLIPSpec) else None
    outputs, wants_virials = requested_outputs(cfg, outputs, virial_key)
    if wants_virials:
        virials.check_supported(cfg.neighbor_config, type(model).__name__, virial_key)
    else:
        virial_key = None
    batch = as_batch(data)
    model.validate_input(batch)
    if "stress" in outputs:
        check_stress_cells(batch)
    programs.check()  # a long-lived process: drop jaxdd's programs when its code mappings crowd
    n_atoms = batch.n_atoms
    if cfg.padding_atoms:
        batch = pad_atoms(batch, bucketed_atoms(batch))
    nc = cfg.neighbor_config
    if nc is not None and capacity is None:
        capacity = program_capacity(neighbor_capacity(
            batch.positions, batch.cell, batch.pbc, batch.batch_idx, batch.atom_mask,
            cutoff=nc.search_cutoff, half=nc.half_list, headroom=1.0, bond_cutoff=nc.bond_search_cutoff,
        ), nc)
    held = {"capacity": capacity}

    def attempt():
        out, overflow, nl = _run(model, batch, outputs, held["capacity"], virial_key)
        return out, (nl.stats() if bool(overflow) else None)

    def grow_to(needed):
        held["capacity"] = program_capacity(held["capacity"].grown(needed), nc)

    out = run_until_fits(attempt, grow_to, max_regrowths=max_rebuilds, what="the neighbour list")
    if virial_key is not None:
        virials.refuse_broken(out[virial_key], type(model).__name__, virial_key)
    return unpad_atoms(out, n_atoms, batch.n_atoms, spec)


def program_capacity(capacity: NeighborCapacity, nc) -> NeighborCapacity:
    """The neighbour capacity a program is compiled for: ``capacity`` rounded up to buckets
    (:meth:`NeighborCapacity.bucketed`), with at least the model's ``max_neighbors`` and ``max_bonds``
    slots. A COO list has no neighbour slots and a list without a bond cutoff no bond slots, so
    there the unused counts are not kept in the program's key."""
    capacity = capacity.bucketed()
    slots = capacity.max_neighbors if NeighborListFormat(nc.format) is NeighborListFormat.MATRIX else 1
    bonds = 1 if nc.bond_cutoff is None else max(capacity.max_bonds, nc.max_bonds or 1)
    return dataclasses.replace(capacity, max_neighbors=max(slots, nc.max_neighbors or 1), max_bonds=bonds)
