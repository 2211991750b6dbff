"""The chemistry-free part of a spec: the storage policy, adapters for named ops
(:class:`OpAdapter`) and third-party helpers, and the per-atom fields every rank receives
(:class:`DistributionSpec`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from .adapters import HelperAdapter
from ..data.checks import integral
from ..ops import POLICIES, TRANSFORMS, HaloStoragePolicy, OpHandle, SpecError, StoragePolicy, Transform, get_op
from .frozen_map import FrozenMap

__all__ = ["OpAdapter", "DistributionSpec", "PER_ATOM_FIELDS", "DEFAULT_SHARD_FIELDS"]

#: The per-atom fields of a Batch, in the order ranks receive them.
PER_ATOM_FIELDS = ("positions", "atomic_numbers", "charges", "masses", "velocities")
DEFAULT_SHARD_FIELDS = PER_ATOM_FIELDS


def _transform_map(owner: str, field: str, value: Any) -> FrozenMap:
    if not isinstance(value, Mapping):
        raise SpecError(f"{owner}.{field} must map positions (ints >= 0) to transforms, got {value!r}")
    out = {}
    for pos, tr in value.items():
        pos = integral(f"{owner}.{field}: position", pos, minimum=0, error=SpecError)
        if not isinstance(tr, Transform) or type(tr) is Transform:
            raise SpecError(
                f"{owner}.{field}[{pos}] must be a transform ({', '.join(c.__name__ for c in TRANSFORMS.values())}), "
                f"got {tr!r}"
            )
        out[pos] = tr
    return FrozenMap(out)


def _tuple_of(owner, field, value, cls) -> tuple:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise SpecError(f"{owner}.{field} must be a sequence of {cls.__name__}, got {value!r}")
    items = tuple(value)
    bad = [x for x in items if not isinstance(x, cls)]
    if bad:
        raise SpecError(f"{owner}.{field} must hold {cls.__name__} items, got {bad[0]!r}")
    return items


@dataclasses.dataclass(frozen=True)
class OpAdapter:
    """How the framework treats one named op (``"namespace::op"``) under decomposition.

    op: the registered :class:`~jaxdd.ops.OpHandle`, or its name.
    arg_transforms: input position → transform applied before the kernel.
    output_transforms: output position → transform applied after it.
    """

    op: OpHandle | str
    arg_transforms: Mapping[int, Transform] = FrozenMap()
    output_transforms: Mapping[int, Transform] = FrozenMap()

    def __post_init__(self):
        object.__setattr__(self, "op", get_op(self.op))
        for field in ("arg_transforms", "output_transforms"):
            object.__setattr__(self, field, _transform_map("OpAdapter", field, getattr(self, field)))

    def to_dict(self) -> dict:
        """The adapter's object in a version-2 spec file: the op's name and its transforms by
        position (positions written as strings)."""
        return {
            "op": self.op.name,
            "arg_transforms": {str(k): v.to_dict() for k, v in self.arg_transforms.items()},
            "output_transforms": {str(k): v.to_dict() for k, v in self.output_transforms.items()},
        }


@dataclasses.dataclass(frozen=True)
class DistributionSpec:
    """The chemistry-free part of a spec: storage policy, op adapters, helper adapters.

    shard_fields: the per-atom Batch fields (of :data:`PER_ATOM_FIELDS`) every rank receives
        for its rows; the others reach the model as None. ``positions`` and
        ``atomic_numbers`` are always among them. Default: all of them.
    """

    policy: StoragePolicy = HaloStoragePolicy()
    custom_ops: tuple[OpAdapter, ...] = ()
    third_party_helpers: tuple[HelperAdapter, ...] = ()
    shard_fields: tuple[str, ...] = DEFAULT_SHARD_FIELDS

    def __post_init__(self):
        if not isinstance(self.policy, StoragePolicy) or type(self.policy) is StoragePolicy:
            raise SpecError(
                f"DistributionSpec.policy must be one of {[c.__name__ for c in POLICIES.values()]}, got {self.policy!r}"
            )
        ops = _tuple_of("DistributionSpec", "custom_ops", self.custom_ops, OpAdapter)
        names = [a.op.name for a in ops]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SpecError(f"DistributionSpec.custom_ops declares {dup} more than once; merge the adapters")
        helpers = _tuple_of("DistributionSpec", "third_party_helpers", self.third_party_helpers, HelperAdapter)
        targets = [h.target for h in helpers]
        dup = sorted({t for t in targets if targets.count(t) > 1})
        if dup:
            raise SpecError(f"DistributionSpec.third_party_helpers replaces {dup} more than once")
        fields = _tuple_of("DistributionSpec", "shard_fields", self.shard_fields, str)
        if len(set(fields)) != len(fields) or not all(fields):
            raise SpecError(f"DistributionSpec.shard_fields must be distinct non-empty names, got {list(fields)}")
        unknown = [f for f in fields if f not in PER_ATOM_FIELDS]
        if unknown:
            raise SpecError(f"DistributionSpec.shard_fields has {unknown}, which are not per-atom Batch fields; "
                            f"choose among {list(PER_ATOM_FIELDS)}")
        lacking = [f for f in ("positions", "atomic_numbers") if f not in fields]
        if lacking:
            raise SpecError(f"DistributionSpec.shard_fields lacks {lacking}: every rank needs its atoms' positions "
                            "and atomic numbers")
        object.__setattr__(self, "custom_ops", ops)
        object.__setattr__(self, "third_party_helpers", helpers)
        object.__setattr__(self, "shard_fields", fields)

    def with_policy(self, policy: StoragePolicy) -> "DistributionSpec":
        """A copy with the storage ``policy`` replaced."""
        return dataclasses.replace(self, policy=policy)

    def with_custom_ops(self, *adapters: OpAdapter) -> "DistributionSpec":
        """Add op ``adapters`` (replacing any for the same op); returns a copy."""
        new = {a.op.name for a in adapters}
        return dataclasses.replace(self, custom_ops=tuple(a for a in self.custom_ops if a.op.name not in new) + adapters)

    def with_helpers(self, *adapters: HelperAdapter) -> "DistributionSpec":
        """Add helper ``adapters`` (replacing any for the same target); returns a copy."""
        new = {a.target for a in adapters}
        kept = tuple(h for h in self.third_party_helpers if h.target not in new)
        return dataclasses.replace(self, third_party_helpers=kept + adapters)

    def to_dict(self) -> dict:
        """The ``core`` object of a version-2 spec file (``shard_fields`` only when it is not
        the default)."""
        core = {
            "policy": self.policy.to_dict(),
            "custom_ops": [a.to_dict() for a in self.custom_ops],
            "third_party_helpers": [h.to_dict() for h in self.third_party_helpers],
        }
        # Written only when it differs from the default, so default specs keep exactly the
        # schema's fields (files of the PyTorch system have no such key).
        if self.shard_fields != DEFAULT_SHARD_FIELDS:
            core["shard_fields"] = list(self.shard_fields)
        return core
