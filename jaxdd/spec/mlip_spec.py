"""Everything jaxdd needs to run a model distributed: :class:`MLIPSpec`, its queries,
variants and persistence as version-2 JSON."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .adapters import HelperAdapter
from ..ops import SpecError, StoragePolicy
from ..ops.errors import check_always_true
from .compile_policy import CompilePolicy
from .distribution import DistributionSpec, OpAdapter
from .frozen_map import FrozenMap
from .json_format import SPEC_VERSION, read_spec_fields
from .outputs import OutputKind, SpecWarning, output_kind

__all__ = ["MLIPSpec"]


def _key_set(owner: str, field: str, value: Any) -> frozenset:
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise SpecError(f"{owner}.{field} must be a collection of output names, got {value!r}")
    items = list(value)
    bad = [k for k in items if not isinstance(k, str) or not k]
    if bad:
        raise SpecError(f"{owner}.{field} must hold non-empty strings, got {bad[0]!r}")
    return frozenset(items)


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
        (derived from the energy by edge vector, :mod:`jaxdd.engine.virials`; None: not available).
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
            kinds[key] = output_kind(key, kind)
        owned = _key_set("MLIPSpec", "owned_only_outputs", self.owned_only_outputs)
        reduced = _key_set("MLIPSpec", "all_reduce_outputs", self.all_reduce_outputs)
        both = sorted(owned & reduced)
        if both:
            raise SpecError(
                f"{both} are both owned-only and all-reduced; an owned-only key is sliced per rank, an all-reduced "
                "key is summed across ranks: keep each in one of the two"
            )
        check_always_true(
            "MLIPSpec", "system_reductions", self.system_reductions,
            "the dispatch always reduces per-atom sums to per-system ones across ranks (it is what makes a "
            "distributed energy complete); list keys that are per-rank partials in all_reduce_outputs instead")
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
        """The storage policy of :attr:`distribution`."""
        return self.distribution.policy

    def kind_of(self, key: str) -> OutputKind:
        """Declared kind of ``key``: its ``output_kinds`` entry, PER_NODE for an owned-only
        output and for the per-atom energy and virial keys, else UNKNOWN."""
        if key in self.output_kinds:
            return self.output_kinds[key]
        per_atom = key in self.owned_only_outputs or key in (self.node_energy_key, self.node_virial_key)
        return OutputKind.PER_NODE if per_atom else OutputKind.UNKNOWN

    def check_outputs(self, keys: Iterable[str], *, strict: bool = False) -> None:
        """Every active output should have a declared kind: warn (or raise when ``strict``).

        Args:
          keys: the output keys the model returns.
          strict: raise a SpecError instead of warning with a :class:`SpecWarning`.
        """
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
        """A checked copy with the given fields changed (``changes``: field name → value)."""
        return dataclasses.replace(self, **changes)

    def with_policy(self, policy: StoragePolicy) -> "MLIPSpec":
        """A copy with the storage ``policy`` replaced."""
        return self.replace(distribution=self.distribution.with_policy(policy))

    def with_distribution(self, distribution: DistributionSpec) -> "MLIPSpec":
        """A copy with the whole ``distribution`` replaced."""
        return self.replace(distribution=distribution)

    def with_custom_ops(self, *adapters: OpAdapter) -> "MLIPSpec":
        """A copy with op ``adapters`` added (replacing any for the same op)."""
        return self.replace(distribution=self.distribution.with_custom_ops(*adapters))

    def with_helpers(self, *adapters: HelperAdapter) -> "MLIPSpec":
        """A copy with helper ``adapters`` added (replacing any for the same target)."""
        return self.replace(distribution=self.distribution.with_helpers(*adapters))

    def with_output_kinds(self, **kinds: OutputKind | str) -> "MLIPSpec":
        """A copy with output kinds declared (``kinds``: output key → OutputKind or its value)."""
        return self.replace(output_kinds={**self.output_kinds, **kinds})

    def with_all_reduce(self, *keys: str) -> "MLIPSpec":
        """A copy that also sums the outputs ``keys`` across ranks."""
        return self.replace(all_reduce_outputs=self.all_reduce_outputs | set(keys))

    def without_all_reduce(self, *keys: str) -> "MLIPSpec":
        """A copy that no longer sums the outputs ``keys`` across ranks."""
        return self.replace(all_reduce_outputs=self.all_reduce_outputs - set(keys))

    def with_owned_only(self, *keys: str) -> "MLIPSpec":
        """A copy that also slices the per-atom outputs ``keys`` to owned rows."""
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
        """The version-2 JSON text (indented, keys sorted, a final newline)."""
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
        """Build a spec from a version-2 JSON object; op handles and helpers are resolved.

        Args:
          data: the parsed JSON object.
          source: where it came from, named in every error.

        Returns:
          The spec. Every mistake in ``data`` is a SpecError.
        """
        try:
            return MLIPSpec(**read_spec_fields(data, source))
        except SpecError:
            raise
        except Exception as exc:  # a reader gap must still surface as an actionable SpecError
            raise SpecError(f"{source}: invalid spec ({type(exc).__name__}: {exc})") from None

    @classmethod
    def from_json(cls, text: str | bytes, *, source: str = "spec") -> "MLIPSpec":
        """Build a spec from version-2 JSON ``text`` (str or bytes); ``source`` names where
        it came from in every error."""
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
        """Read a version-2 spec file at ``path``; a SpecError when it cannot be read or is
        not a valid spec."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise SpecError(f"cannot read spec file {path}: {exc.strerror or exc}") from None
        return cls.from_json(raw, source=str(path))
