"""Distribution specs: how a single-device model runs under domain decomposition.

A model author declares distribution on an :class:`MLIPSpec` instead of coding it into the
model: the storage policy, adapters for opaque kernels and third-party helpers, and the
kind of each output. Specs are immutable and hashable (usable as static ``jax.jit``
arguments) and persist as version-2 JSON, the format of the PyTorch system jaxdd
re-imagines, so files read the same::

    spec = MLIPSpec.load("my_model_spec.json")
    spec.save("copy.json")

The shipped presets (``SPEC_MPNN_HALO`` ...) are stored once as JSON under ``specs/`` and
loaded here. Every error is a :class:`~jaxdd.ops.SpecError` with a message to act on.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.resources
import json
import math
import re
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from .checks import integral
from .adapters import HELPER_ADAPTERS, HelperAdapter
from .ops import POLICIES, TRANSFORMS, HaloStoragePolicy, OpHandle, SpecError, StoragePolicy, Transform, get_op

__all__ = [
    "SPEC_VERSION",
    "SpecError",
    "PER_ATOM_FIELDS",
    "SpecWarning",
    "OutputKind",
    "OpAdapter",
    "CompilePolicy",
    "DistributionSpec",
    "MLIPSpec",
    "FORCE_STRATEGIES",
    "DEFAULT_SHARD_FIELDS",
    "PRESETS",
    "SPEC_MPNN_HALO",
    "SPEC_LJ_HALO",
    "SPEC_UMA_HALO",
    "SPEC_EWALD_HALO",
    "SPEC_PME_HALO",
    "SPEC_DFTD3_HALO",
    "SPEC_MPNN_GP",
]

SPEC_VERSION = 2
#: The per-atom fields of a Batch, in the order ranks receive them.
PER_ATOM_FIELDS = ("positions", "atomic_numbers", "charges", "masses", "velocities")
DEFAULT_SHARD_FIELDS = PER_ATOM_FIELDS
FORCE_STRATEGIES = ("framework_from_node_energy", "framework_from_global_energy", "model_internal")


class SpecWarning(UserWarning):
    """A spec is usable but incomplete (e.g. an output without a declared kind)."""


class OutputKind(str, enum.Enum):
    """Shape class of a model output under decomposition.

    PER_NODE: per atom, ``[n_atoms, *F]`` (``[n_padded, *F]`` on a rank).
    PER_GRAPH: per system, ``[n_systems, *F]``; per-rank partials are summed.
    GLOBAL: already correct on every rank; passed through.
    UNKNOWN: not declared; the shape decides (``shape[0] == n_padded``) with a warning.
    """

    PER_NODE = "per_node"
    PER_GRAPH = "per_graph"
    GLOBAL = "global"
    UNKNOWN = "unknown"


class FrozenMap(Mapping):
    """An immutable, hashable mapping (iteration in key order)."""

    __slots__ = ("_items", "_dict")

    def __init__(self, items: Mapping | Iterable = ()):
        d = dict(items.items() if isinstance(items, Mapping) else items)
        object.__setattr__(self, "_dict", d)
        object.__setattr__(self, "_items", tuple(sorted(d.items(), key=lambda kv: kv[0])))

    def __getitem__(self, key):
        return self._dict[key]

    def __iter__(self) -> Iterator:
        return (k for k, _ in self._items)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        return hash(self._items)

    def __eq__(self, other):
        return isinstance(other, Mapping) and dict(self._items) == dict(other.items())

    def __setattr__(self, name, value):
        raise AttributeError("FrozenMap is immutable")

    def __repr__(self):
        return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in self._items) + "}"


# --------------------------------------------------------------------------- adapters


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
        return {
            "op": self.op.name,
            "arg_transforms": {str(k): v.to_dict() for k, v in self.arg_transforms.items()},
            "output_transforms": {str(k): v.to_dict() for k, v in self.output_transforms.items()},
        }


@dataclasses.dataclass(frozen=True)
class CompilePolicy:
    """How a distributed call is compiled and differentiated.

    capacity_factor: headroom over the sizes a partition needs when capacities are chosen (>= 1).
    growth_factor: capacity multiplier when a capacity overflows (> 1).
    max_regrowths: overflow → grow → re-jit rounds before giving up (>= 1).
    force_strategy: ``framework_from_node_energy`` (forces from the sum of owned per-atom
        energies), ``framework_from_global_energy`` (from the all-reduced energy; graph
        parallel), or ``model_internal`` (the model returns forces as a PER_NODE output).
    stress_via_strain: stress from the derivative with respect to a strain of positions and
        cell: the only way jaxdd derives stress, so False is refused (a model that computes
        its own stress returns it as an output that is not in ``autograd_outputs``).
    """

    capacity_factor: float = 1.2
    growth_factor: float = 1.5
    max_regrowths: int = 8
    force_strategy: str = "framework_from_node_energy"
    stress_via_strain: bool = True

    def __post_init__(self):
        for field, low, strict in (("capacity_factor", 1.0, False), ("growth_factor", 1.0, True)):
            v = getattr(self, field)
            try:
                finite = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(float(v))
            except OverflowError:
                finite = False
            if not finite or v < low or (strict and v == low):
                raise SpecError(f"CompilePolicy.{field} must be a finite number {'>' if strict else '>='} {low}, got {v!r}")
            object.__setattr__(self, field, float(v))
        object.__setattr__(self, "max_regrowths",
                           integral("CompilePolicy.max_regrowths", self.max_regrowths, minimum=1, error=SpecError))
        if self.force_strategy not in FORCE_STRATEGIES:
            raise SpecError(f"CompilePolicy.force_strategy must be one of {list(FORCE_STRATEGIES)}, got {self.force_strategy!r}")
        if not isinstance(self.stress_via_strain, bool):
            raise SpecError(f"CompilePolicy.stress_via_strain must be a bool, got {self.stress_via_strain!r}")
        if not self.stress_via_strain:
            raise SpecError(
                "CompilePolicy.stress_via_strain=False: jaxdd derives stress only from the derivative with respect to "
                "a strain of positions and cell; a model that computes its own stress returns 'stress' as an output "
                "and leaves it out of ModelConfig.autograd_outputs")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
        return dataclasses.replace(self, policy=policy)

    def with_custom_ops(self, *adapters: OpAdapter) -> "DistributionSpec":
        """Add op adapters (replacing any for the same op)."""
        new = {a.op.name for a in adapters}
        return dataclasses.replace(self, custom_ops=tuple(a for a in self.custom_ops if a.op.name not in new) + adapters)

    def with_helpers(self, *adapters: HelperAdapter) -> "DistributionSpec":
        """Add helper adapters (replacing any for the same target)."""
        new = {a.target for a in adapters}
        kept = tuple(h for h in self.third_party_helpers if h.target not in new)
        return dataclasses.replace(self, third_party_helpers=kept + adapters)

    def to_dict(self) -> dict:
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


def _tuple_of(owner, field, value, cls) -> tuple:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise SpecError(f"{owner}.{field} must be a sequence of {cls.__name__}, got {value!r}")
    items = tuple(value)
    bad = [x for x in items if not isinstance(x, cls)]
    if bad:
        raise SpecError(f"{owner}.{field} must hold {cls.__name__} items, got {bad[0]!r}")
    return items


def _key_set(owner: str, field: str, value: Any) -> frozenset:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise SpecError(f"{owner}.{field} must be a collection of output names, got {value!r}")
    items = list(value)
    bad = [k for k in items if not isinstance(k, str) or not k]
    if bad:
        raise SpecError(f"{owner}.{field} must hold non-empty strings, got {bad[0]!r}")
    return frozenset(items)


def _output_kind(key: str, kind: Any) -> OutputKind:
    try:
        return OutputKind(kind)
    except ValueError:
        raise SpecError(
            f"output kind of {key!r} must be one of {[k.value for k in OutputKind]}, got {kind!r}"
        ) from None


@dataclasses.dataclass(frozen=True)
class MLIPSpec:
    """Everything jaxdd needs to run a model distributed.

    distribution: storage policy and adapters (:class:`DistributionSpec`).
    output_kinds: output key → :class:`OutputKind`.
    owned_only_outputs: per-atom keys sliced to owned rows before they are gathered: they
        are PER_NODE outputs (:meth:`kind_of`) without an entry in ``output_kinds``.
    all_reduce_outputs: keys summed across ranks (per-rank partials).
    system_reductions: reduce per-atom → per-system sums across ranks automatically (what
        makes a distributed energy complete; False is refused: list per-rank partials in
        ``all_reduce_outputs`` instead).
    node_energy_key: the model's per-atom energy output, which forces are differentiated from.
    node_virial_key: the key under which jaxdd returns per-atom virials [V, 3, 3] eV when asked
        (derived from the energy by edge vector, :mod:`jaxdd.virials`; None: not available).
    compile: a :class:`CompilePolicy`, or None for the defaults.
    """

    distribution: DistributionSpec = DistributionSpec()
    output_kinds: Mapping[str, OutputKind] = FrozenMap()
    owned_only_outputs: frozenset = frozenset()
    all_reduce_outputs: frozenset = frozenset()
    system_reductions: bool = True
    node_energy_key: str | None = None
    node_virial_key: str | None = None
    compile: CompilePolicy | None = None

    def __post_init__(self):
        if not isinstance(self.distribution, DistributionSpec):
            raise SpecError(f"MLIPSpec.distribution must be a DistributionSpec, got {self.distribution!r}")
        if not isinstance(self.output_kinds, Mapping):
            raise SpecError(f"MLIPSpec.output_kinds must map output keys to OutputKind, got {self.output_kinds!r}")
        kinds = {}
        for key, kind in self.output_kinds.items():
            if not isinstance(key, str) or not key:
                raise SpecError(f"MLIPSpec.output_kinds keys must be non-empty strings, got {key!r}")
            kinds[key] = _output_kind(key, kind)
        owned = _key_set("MLIPSpec", "owned_only_outputs", self.owned_only_outputs)
        reduced = _key_set("MLIPSpec", "all_reduce_outputs", self.all_reduce_outputs)
        both = sorted(owned & reduced)
        if both:
            raise SpecError(
                f"{both} are both owned-only and all-reduced; an owned-only key is sliced per rank, an all-reduced "
                "key is summed across ranks: keep each in one of the two"
            )
        if not isinstance(self.system_reductions, bool):
            raise SpecError(f"MLIPSpec.system_reductions must be a bool, got {self.system_reductions!r}")
        if not self.system_reductions:
            raise SpecError(
                "MLIPSpec.system_reductions=False: the dispatch always reduces per-atom sums to per-system ones across "
                "ranks (it is what makes a distributed energy complete); list keys that are per-rank partials in "
                "all_reduce_outputs instead")
        clash = sorted(k for k in owned if kinds.get(k, OutputKind.PER_NODE) is not OutputKind.PER_NODE)
        if clash:
            raise SpecError(f"{clash} are owned-only outputs (per-atom, sliced to owned rows) but declared "
                            f"{[kinds[k].value for k in clash]} in output_kinds; declare them PER_NODE or drop them "
                            "from owned_only_outputs")
        for field in ("node_energy_key", "node_virial_key"):
            v = getattr(self, field)
            if v is not None and (not isinstance(v, str) or not v):
                raise SpecError(f"MLIPSpec.{field} must be an output name or None, got {v!r}")
        if self.compile is not None and not isinstance(self.compile, CompilePolicy):
            raise SpecError(f"MLIPSpec.compile must be a CompilePolicy or None, got {self.compile!r}")
        object.__setattr__(self, "output_kinds", FrozenMap(kinds))
        object.__setattr__(self, "owned_only_outputs", owned)
        object.__setattr__(self, "all_reduce_outputs", reduced)

    # ------------------------------------------------------------------ queries

    @property
    def policy(self) -> StoragePolicy:
        return self.distribution.policy

    def kind_of(self, key: str) -> OutputKind:
        """Declared kind of ``key``: its ``output_kinds`` entry, PER_NODE for an owned-only
        output and for the per-atom energy and virial keys, else UNKNOWN."""
        if key in self.output_kinds:
            return self.output_kinds[key]
        per_atom = key in self.owned_only_outputs or key in (self.node_energy_key, self.node_virial_key)
        return OutputKind.PER_NODE if per_atom else OutputKind.UNKNOWN

    def check_outputs(self, keys: Iterable[str], *, strict: bool = False) -> None:
        """Every active output should have a declared kind: warn (or raise when ``strict``)."""
        missing = sorted(k for k in set(keys) if self.kind_of(k) is OutputKind.UNKNOWN)
        if missing:
            msg = (
                f"outputs {missing} have no declared OutputKind; the legacy shape heuristic will be used. "
                f"Declare them: spec.with_output_kinds({', '.join(f'{k}=OutputKind.PER_NODE' for k in missing[:1])} ...)"
            )
            if strict:
                raise SpecError(msg)
            warnings.warn(msg, SpecWarning, stacklevel=2)

    # ------------------------------------------------------------------ variants

    def replace(self, **changes) -> "MLIPSpec":
        return dataclasses.replace(self, **changes)

    def with_policy(self, policy: StoragePolicy) -> "MLIPSpec":
        return self.replace(distribution=self.distribution.with_policy(policy))

    def with_distribution(self, distribution: DistributionSpec) -> "MLIPSpec":
        return self.replace(distribution=distribution)

    def with_custom_ops(self, *adapters: OpAdapter) -> "MLIPSpec":
        return self.replace(distribution=self.distribution.with_custom_ops(*adapters))

    def with_helpers(self, *adapters: HelperAdapter) -> "MLIPSpec":
        return self.replace(distribution=self.distribution.with_helpers(*adapters))

    def with_output_kinds(self, **kinds: OutputKind | str) -> "MLIPSpec":
        return self.replace(output_kinds={**self.output_kinds, **kinds})

    def with_all_reduce(self, *keys: str) -> "MLIPSpec":
        return self.replace(all_reduce_outputs=self.all_reduce_outputs | set(keys))

    def without_all_reduce(self, *keys: str) -> "MLIPSpec":
        return self.replace(all_reduce_outputs=self.all_reduce_outputs - set(keys))

    def with_owned_only(self, *keys: str) -> "MLIPSpec":
        return self.replace(owned_only_outputs=self.owned_only_outputs | set(keys))

    def with_compile(self, compile: CompilePolicy | None = None, **fields) -> "MLIPSpec":
        """Set the compile policy, or change some of its fields: ``with_compile(growth_factor=2)``."""
        base = compile if compile is not None else (self.compile or CompilePolicy())
        return self.replace(compile=dataclasses.replace(base, **fields) if fields else base)

    # ------------------------------------------------------------------ persistence

    def to_dict(self) -> dict:
        """The version-2 JSON object (plain dicts and lists, canonical order)."""
        return {
            "version": SPEC_VERSION,
            "core": self.distribution.to_dict(),
            "system_reductions": self.system_reductions,
            "node_energy_key": self.node_energy_key,
            "node_virial_key": self.node_virial_key,
            "owned_only_outputs": sorted(self.owned_only_outputs),
            "all_reduce_outputs": sorted(self.all_reduce_outputs),
            "output_kinds": [[k, v.value] for k, v in self.output_kinds.items()],
            "compile": None if self.compile is None else self.compile.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the spec as version-2 JSON; returns the path."""
        text = self.to_json()
        path = Path(path)
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as exc:
            raise SpecError(f"cannot write spec file {path}: {exc.strerror or exc}") from None
        return path

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "spec") -> "MLIPSpec":
        """Build a spec from a version-2 JSON object; op handles and helpers are resolved."""
        try:
            return _read_spec(_Node(data, source))
        except SpecError:
            raise
        except Exception as exc:  # a reader gap must still surface as an actionable SpecError
            raise SpecError(f"{source}: invalid spec ({type(exc).__name__}: {exc})") from None

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "spec") -> "MLIPSpec":
        if not isinstance(text, (str, bytes, bytearray)):
            raise SpecError(f"{source}: expected JSON text (str or bytes), got {type(text).__name__}")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SpecError(f"{source}: malformed JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from None
        except (UnicodeDecodeError, RecursionError, ValueError) as exc:
            raise SpecError(f"{source}: not a JSON text ({type(exc).__name__}: {exc})") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | Path) -> "MLIPSpec":
        """Read a version-2 spec file."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise SpecError(f"cannot read spec file {path}: {exc.strerror or exc}") from None
        return cls.from_json(raw, source=str(path))


# --------------------------------------------------------------------------- reading


class _Node:
    """A value read from JSON, with its path for messages."""

    def __init__(self, value: Any, path: str):
        self.value = value
        self.path = path

    def fail(self, what: str):
        raise SpecError(f"{self.path}: {what}")

    def obj(self, allowed: Iterable[str], required: Iterable[str] = ()) -> dict:
        if not isinstance(self.value, dict):
            self.fail(f"expected an object, got {_type_name(self.value)}")
        unknown = sorted(set(self.value) - set(allowed))
        if unknown:
            self.fail(f"unknown field(s) {unknown}; allowed: {sorted(allowed)}")
        missing = sorted(set(required) - set(self.value))
        if missing:
            self.fail(f"missing field(s) {missing}")
        return self.value

    def get(self, key: str, default: Any = None) -> "_Node":
        return _Node(self.value.get(key, default), f"{self.path}.{key}")

    def items(self) -> list["_Node"]:
        if not isinstance(self.value, list):
            self.fail(f"expected a list, got {_type_name(self.value)}")
        return [_Node(v, f"{self.path}[{i}]") for i, v in enumerate(self.value)]

    def string(self, *, optional: bool = False) -> str | None:
        if optional and self.value is None:
            return None
        if not isinstance(self.value, str) or not self.value:
            self.fail(f"expected a non-empty string{' or null' if optional else ''}, got {_json_repr(self.value)}")
        return self.value

    def integer(self) -> int:
        if isinstance(self.value, bool) or not isinstance(self.value, int):
            self.fail(f"must be an integer, got {self.value!r}")
        return self.value

    def boolean(self) -> bool:
        if not isinstance(self.value, bool):
            self.fail(f"expected true or false, got {_json_repr(self.value)}")
        return self.value

    def strings(self) -> list[str]:
        return [n.string() for n in self.items()]


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(v), "a number"
    )


def _json_repr(v: Any) -> str:
    try:
        text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    except (RecursionError, ValueError, TypeError):
        return f"{_type_name(v)} nested too deeply to show"
    return text if len(text) <= 60 else text[:57] + "..."


def _read_spec(node: _Node) -> MLIPSpec:
    fields = ("version", "core", "system_reductions", "node_energy_key", "node_virial_key",
              "owned_only_outputs", "all_reduce_outputs", "output_kinds", "compile")
    if not isinstance(node.value, dict):
        node.fail(f"expected an object, got {_type_name(node.value)}")
    # The version first: a newer file's new fields are not the problem to report.
    if "version" not in node.value:
        node.fail("missing field(s) ['version']")
    version = node.get("version")
    if type(version.value) is not int or version.value != SPEC_VERSION:
        version.fail(f"unsupported spec version {_json_repr(version.value)}; this jaxdd reads version {SPEC_VERSION}")
    node.obj(fields, required=("version", "core"))
    kinds = {}
    for pair in node.get("output_kinds", []).items():
        if not isinstance(pair.value, list) or len(pair.value) != 2:
            pair.fail(f"expected a [key, kind] pair, got {_json_repr(pair.value)}")
        key_node, kind_node = pair.items()
        key = key_node.string()
        if key in kinds:
            key_node.fail(f"output {key!r} is listed twice")
        kind = kind_node.string()
        try:
            kinds[key] = OutputKind(kind)
        except ValueError:
            kind_node.fail(f"unknown output kind {kind!r}; expected one of {[k.value for k in OutputKind]}")
    compile_node = node.get("compile")
    return MLIPSpec(
        distribution=_read_core(node.get("core")),
        output_kinds=kinds,
        owned_only_outputs=node.get("owned_only_outputs", []).strings(),
        all_reduce_outputs=node.get("all_reduce_outputs", []).strings(),
        system_reductions=node.get("system_reductions", True).boolean(),
        node_energy_key=node.get("node_energy_key").string(optional=True),
        node_virial_key=node.get("node_virial_key").string(optional=True),
        compile=None if compile_node.value is None else _read_compile(compile_node),
    )


def _read_core(node: _Node) -> DistributionSpec:
    node.obj(("policy", "custom_ops", "third_party_helpers", "shard_fields"), required=("policy",))
    shard = node.get("shard_fields")
    return DistributionSpec(
        policy=_read_policy(node.get("policy")),
        custom_ops=tuple(_read_op_adapter(n) for n in node.get("custom_ops", []).items()),
        third_party_helpers=tuple(_read_helper(n) for n in node.get("third_party_helpers", []).items()),
        shard_fields=DEFAULT_SHARD_FIELDS if shard.value is None else tuple(shard.strings()),
    )


def _read_policy(node: _Node) -> StoragePolicy:
    node.obj(("kind", "scatter_mode", "gather_mode", "halo_layers"), required=("kind",))
    kind = node.get("kind").string()
    if kind not in POLICIES:
        node.get("kind").fail(f"unknown policy kind {kind!r}; expected one of {sorted(POLICIES)}")
    cls = POLICIES[kind]
    if cls is HaloStoragePolicy:
        return HaloStoragePolicy(
            scatter_mode=node.get("scatter_mode", "halo_correction").string(),
            gather_mode=node.get("gather_mode", "halo_read").string(),
            halo_layers=node.get("halo_layers", 1).integer(),
        )
    extra = sorted(set(node.value) - {"kind"})
    if extra:
        node.fail(f"policy kind {kind!r} takes no fields, got {extra}")
    return cls()


def _read_transform(node: _Node) -> Transform:
    node.obj(("type", "replicated_consumer"), required=("type",))
    name = node.get("type").string()
    if name not in TRANSFORMS:
        node.get("type").fail(f"unknown transform type {name!r}; expected one of {sorted(TRANSFORMS)}")
    cls = TRANSFORMS[name]
    if name == "all_reduce_sum":
        return cls(replicated_consumer=node.get("replicated_consumer", False).boolean())
    if "replicated_consumer" in node.value:
        node.fail(f"transform {name!r} takes no 'replicated_consumer'")
    return cls()


def _read_positions(node: _Node) -> dict[int, Transform]:
    if not isinstance(node.value, dict):
        node.fail(f"expected an object mapping positions to transforms, got {_type_name(node.value)}")
    out = {}
    for key in node.value:
        if not re.fullmatch(r"0|[1-9][0-9]*", key, re.ASCII):
            node.fail(f"position {key!r} must be a non-negative integer written in ASCII decimal")
        out[int(key)] = _read_transform(node.get(key))
    return out


def _read_op_adapter(node: _Node) -> OpAdapter:
    node.obj(("op", "arg_transforms", "output_transforms"), required=("op",))
    name = node.get("op").string()
    try:
        handle = get_op(name)
    except SpecError as exc:
        node.get("op").fail(str(exc))
    return OpAdapter(
        op=handle,
        arg_transforms=_read_positions(node.get("arg_transforms", {})),
        output_transforms=_read_positions(node.get("output_transforms", {})),
    )


def _read_helper(node: _Node) -> HelperAdapter:
    if not isinstance(node.value, dict):
        node.fail(f"expected an object, got {_type_name(node.value)}")
    kind = node.get("kind").string()
    if kind not in HELPER_ADAPTERS:
        node.get("kind").fail(f"unknown helper kind {kind!r}; expected one of {sorted(HELPER_ADAPTERS)}")
    cls = HELPER_ADAPTERS[kind]
    names = cls._names + ("replacement",)
    node.obj(("kind",) + names, required=("kind",) + names)
    try:
        return cls(**{n: node.get(n).string() for n in names})
    except SpecError as exc:
        node.fail(str(exc))


def _read_compile(node: _Node) -> CompilePolicy:
    names = [f.name for f in dataclasses.fields(CompilePolicy)]
    values = node.obj(names)
    for key, v in values.items():
        if key == "stress_via_strain" and not isinstance(v, bool):
            node.get(key).fail(f"expected true or false, got {_json_repr(v)}")
        if key == "force_strategy" and not isinstance(v, str):
            node.get(key).fail(f"expected a string, got {_json_repr(v)}")
        if key in ("capacity_factor", "growth_factor", "max_regrowths") and (
            isinstance(v, bool) or not isinstance(v, (int, float))
        ):
            node.get(key).fail(f"expected a number, got {_json_repr(v)}")
    try:
        return CompilePolicy(**values)
    except SpecError as exc:
        node.fail(str(exc))


# --------------------------------------------------------------------------- presets


def _preset(name: str) -> MLIPSpec:
    ref = importlib.resources.files("jaxdd.specs").joinpath(f"{name}.json")
    return MLIPSpec.from_json(ref.read_bytes(), source=f"jaxdd/specs/{name}.json")


#: Preset name (file stem under ``specs/``) → spec.
PRESETS: Mapping[str, MLIPSpec] = FrozenMap(
    (name, _preset(name))
    for name in ("mpnn_halo", "lj_halo", "uma_halo", "ewald_halo", "pme_halo", "dftd3_halo", "mpnn_gp")
)

SPEC_MPNN_HALO = PRESETS["mpnn_halo"]  # scatter-heavy MPNNs with autograd forces
SPEC_LJ_HALO = PRESETS["lj_halo"]  # pair potentials (Lennard-Jones, Morse, Buckingham)
SPEC_UMA_HALO = PRESETS["uma_halo"]  # backbones that build their own graph: scatter "local"
SPEC_EWALD_HALO = PRESETS["ewald_halo"]  # Ewald: real space on the halo, structure factors by system_sum
SPEC_PME_HALO = PRESETS["pme_halo"]  # PME: distributed mesh by the jaxdd.mesh verb (replicated mode adds an OpAdapter)
SPEC_DFTD3_HALO = PRESETS["dftd3_halo"]  # DFT-D3 dispersion
SPEC_MPNN_GP = PRESETS["mpnn_gp"]  # MPNNs under graph parallelism
