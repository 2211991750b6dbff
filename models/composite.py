"""Energies of several models added together, in one call and one decomposition.

The usual production stack is a short-range MLIP plus dispersion plus long-range
electrostatics, e.g. ``SumModel(SchNet(cutoff=5), DFTD3(cutoff=10), PME(cutoff=8))``.
Summed here, the members share one neighbour list at the largest of their ranges
(``cutoff + skin``), so under :class:`~jaxdd.DistributedModel` there is one partition
and one ghost shell at that range, and one compiled program evaluates them all.

Each member sees the shared COO list with the pairs beyond its own range masked out, so it
computes exactly what it computes alone. MATRIX rows are shared as they are: a member that
reads the MATRIX must mask by its own cutoff (every zoo model does). So are the bonds: the list
carries them to the largest bond range of the members that ask for bonds, and a member masks
them by its own bond cutoff (``jaxdd.models.angle_mpnn`` does). Forces and stress are
the framework's derivatives of the summed energy; members that compute forces themselves
(kernel-direct forces) are refused.

Outputs: ``energy`` [S] eV, ``atomic_energies`` [V] eV (the members' sums; when every member
has them), and from the
framework's autodiff ``forces`` [V, 3] eV/Å and ``stress`` [S, 3, 3] eV/Å³. The spec is
the members' specs merged: one storage policy (they must agree), every member's op and
helper adapters, and the union of their output kinds.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax.numpy as jnp

from jaxdd.model.base import BaseModel, ModelConfig, NeighborConfig
from jaxdd.neighbors import NeighborListFormat, edge_vectors

__all__ = ["SumModel", "merge_specs"]

_OUTPUTS = frozenset({"energy", "atomic_energies", "forces", "stress"})


def merge_specs(specs, names):
    """One spec that distributes every member: the policy they share, all their adapters, all
    their output kinds. specs: the members' specs; names: the members' names, for errors."""
    from jaxdd.spec import SPEC_MPNN_HALO

    specs = [SPEC_MPNN_HALO if s is None else s for s in specs]
    merged, first = specs[0], names[0]
    for spec, name in zip(specs[1:], names[1:]):
        if spec.policy != merged.policy:
            raise ValueError(
                f"SumModel members store atoms differently: {first} uses {merged.policy} and {name} uses "
                f"{spec.policy}; one decomposition serves all members, so their specs must share a storage policy")
        for key, kind in spec.output_kinds.items():
            if key in merged.output_kinds and merged.kind_of(key) is not kind:
                raise ValueError(f"SumModel members disagree on the kind of output {key!r}: "
                                 f"{merged.kind_of(key).value} ({first}) and {kind.value} ({name})")
        merged = merged.with_custom_ops(*spec.distribution.custom_ops).with_helpers(
            *spec.distribution.third_party_helpers)
        merged = merged.with_output_kinds(**dict(spec.output_kinds))
        merged = merged.replace(owned_only_outputs=merged.owned_only_outputs | spec.owned_only_outputs,
                                all_reduce_outputs=merged.all_reduce_outputs | spec.all_reduce_outputs)
    return merged


class SumModel(eqx.Module, BaseModel):
    """The sum of ``members``' energies (see the module docstring).

    members: two or more models (``BaseModel`` wrappers) that each compute ``energy``, take
    forces from the framework's autodiff and need a neighbour list. ``atomic_energies`` is an
    output when every member has it.
    """

    members: tuple
    ranges: tuple = eqx.field(static=True)
    model_config: ModelConfig = eqx.field(static=True)

    def __init__(self, *members):
        if len(members) < 2:
            raise ValueError(f"SumModel needs at least two members, got {len(members)}")
        ranges, fmt = [], NeighborListFormat.COO
        for k, m in enumerate(members):
            name = f"members[{k}] ({type(m).__name__})"
            cfg = getattr(m, "model_config", None)
            if not isinstance(m, BaseModel) or not isinstance(cfg, ModelConfig):
                raise ValueError(f"SumModel {name} is not a jaxdd model wrapper (BaseModel with a model_config)")
            if "energy" not in cfg.outputs:
                raise ValueError(f"SumModel {name} does not compute 'energy'")
            direct = {"forces", "stress"} & (cfg.outputs - cfg.autograd_outputs)
            if direct:
                raise ValueError(f"SumModel {name} computes {sorted(direct)} itself; the sum's forces come from "
                                 "the summed energy, so members must leave them to the framework's autodiff")
            nc = cfg.neighbor_config
            if nc is None:
                raise ValueError(f"SumModel {name} builds its own graph (no neighbor_config); members share the "
                                 "framework's neighbour list")
            if nc.half_list:
                raise ValueError(f"SumModel {name} asks for a half list; members share one full list")
            ranges.append(nc.search_cutoff)
            if nc.format is NeighborListFormat.MATRIX:
                fmt = NeighborListFormat.MATRIX
        widths = [m.model_config.neighbor_config.max_neighbors for m in members]
        widths = [w for w in widths if w is not None]
        # Bonds to the largest bond range asked for (each member masks by its own, as with a skin).
        bond_ranges = [m.model_config.neighbor_config.bond_search_cutoff for m in members]
        bond_ranges = [b for b in bond_ranges if b is not None]
        self.members = tuple(members)
        self.ranges = tuple(float(r) for r in ranges)
        per_atom = all("atomic_energies" in m.model_config.outputs for m in members)
        self.model_config = ModelConfig(
            outputs=_OUTPUTS if per_atom else _OUTPUTS - {"atomic_energies"},
            active_outputs=frozenset({"energy", "forces"}),
            autograd_outputs=frozenset({"forces", "stress"}),
            autograd_inputs=frozenset({"positions", "cell"}),
            neighbor_config=NeighborConfig(cutoff=max(ranges), format=fmt,
                                           max_neighbors=max(widths) if widths else None,
                                           bond_cutoff=max(bond_ranges) if bond_ranges else None),
        )

    @property
    def distribution_spec(self):
        return merge_specs([m.distribution_spec for m in self.members],
                           [f"members[{k}] ({type(m).__name__})" for k, m in enumerate(self.members)])

    def validate_input(self, data) -> None:
        for m in self.members:
            m.validate_input(data)

    def distributed_setup(self, ctx) -> None:
        for m in self.members:
            m.distributed_setup(ctx)

    def adapt_input(self, data, **kwargs) -> dict:
        if data.neighbors is None:
            raise ValueError("SumModel needs data.neighbors; call it through jaxdd.compute or DistributedModel")
        return dict(data=data)

    def forward(self, data):
        nl = data.neighbors
        vec = edge_vectors(data.positions, data.cell, data.batch_idx, nl)
        r2 = jnp.sum(vec * vec, axis=-1)
        per_atom = "atomic_energies" in self.model_config.outputs
        energy = atomic = 0.0
        for member, reach in zip(self.members, self.ranges):
            # The member's own range: pairs beyond it are masked, as in its own list.
            own = nl if reach >= max(self.ranges) else dataclasses.replace(nl, mask=nl.mask & (r2 < reach * reach))
            out = member(data.replace(neighbors=own))
            energy = energy + out["energy"]
            if per_atom:
                atomic = atomic + out["atomic_energies"]
        return {"energy": energy, "atomic_energies": atomic} if per_atom else {"energy": energy}
