"""Reading the version-2 JSON spec format: a parsed file checked field by field, each
mistake a :class:`~jaxdd.ops.SpecError` that names where it is (``spec.core.policy.kind``).

:func:`read_spec_fields` gives the keyword arguments of an ``MLIPSpec``; the spec classes
write the format with their ``to_dict`` methods.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Iterable
from typing import Any

from .adapters import HELPER_ADAPTERS, HelperAdapter
from ..ops import POLICIES, TRANSFORMS, HaloStoragePolicy, SpecError, StoragePolicy, Transform, get_op
from .compile_policy import CompilePolicy
from .distribution import DEFAULT_SHARD_FIELDS, DistributionSpec, OpAdapter
from .outputs import OutputKind

__all__ = ["SPEC_VERSION", "read_spec_fields"]

SPEC_VERSION = 2


def read_spec_fields(data: Any, source: str = "spec") -> dict[str, Any]:
    """The keyword arguments of an ``MLIPSpec`` read from a version-2 JSON object.

    Op handles and helper adapters are resolved; the distribution and compile policy are
    built (and checked) here, the spec itself by the caller.

    Args:
      data: the parsed JSON (dicts, lists, strings, numbers, booleans, None).
      source: where it came from (a file path), the start of every error's location.

    Returns:
      distribution, output_kinds, owned_only_outputs, all_reduce_outputs,
      system_reductions, node_energy_key, node_virial_key and compile.

    Raises:
      SpecError: naming the offending field and what is wrong with it.
    """
    return _read_spec(_Node(data, source))


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


def _read_spec(node: _Node) -> dict[str, Any]:
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
    return dict(
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
