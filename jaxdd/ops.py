"""Storage policies, the six kernel transforms, and the named-op registry.

A *storage policy* says how per-atom arrays live on each rank; a *transform* says what the
framework does to one input or output of an opaque kernel under decomposition; a *named
op* (``"namespace::op"``) is a kernel the dispatch cannot see into, declared on a spec by
an :class:`~jaxdd.spec.OpAdapter`. Everything here is immutable and hashable, so specs
holding them can be static arguments of ``jax.jit``. All errors are :class:`SpecError`.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Callable
from typing import Any, ClassVar

import jax

from ._checks import integral

__all__ = [
    "SpecError",
    "StoragePolicy",
    "HaloStoragePolicy",
    "HaloRefreshPolicy",
    "GraphParallelPolicy",
    "Transform",
    "GatherInputs",
    "GatherInputsFull",
    "SliceOwned",
    "ScatterOutputs",
    "AllReduceSum",
    "SliceOutputsOwned",
    "OpHandle",
    "register_op",
    "get_op",
    "registered_ops",
]


class SpecError(ValueError):
    """A distribution spec, or a file holding one, is invalid; the message says what to do."""


def _check_choice(owner: str, field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise SpecError(f"{owner}.{field} must be one of {list(choices)}, got {value!r}")


# --------------------------------------------------------------------------- policies


@dataclasses.dataclass(frozen=True)
class StoragePolicy:
    """How per-atom arrays are stored across ranks. Subclasses name their JSON ``kind``."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return {"kind": self.kind}


@dataclasses.dataclass(frozen=True)
class HaloStoragePolicy(StoragePolicy):
    """``[owned | halo]`` rows on every rank (spatial domains with a ghost shell).

    scatter_mode: what a scatter-add into a per-atom array does.
        ``"halo_correction"`` (default): ghost partial sums are sent home and owners'
        totals copied back out (reverse then forward exchange); right for models whose
        scatters follow the framework's edge list (MPNNs).
        ``"local"``: nothing; the ghost shell is deep enough that each rank's own rows are
        already right (backbones that build their own full graph inside the block).
    gather_mode: how per-atom values are read for neighbours.
        ``"halo_read"`` (default): ghost rows are kept equal to their owners' rows.
        ``"local"``: ghost rows are whatever the rank computed itself.
    halo_layers: message-passing layers the ghost shell must cover. With
        ``scatter_mode="local"`` the shell is ``halo_layers`` × (cutoff + skin) deep and every
        local atom, ghosts included, receives edges, so owned rows come out exact after that
        many layers. Ignored by ``halo_correction`` (one cutoff always suffices there).
    """

    scatter_mode: str = "halo_correction"
    gather_mode: str = "halo_read"
    halo_layers: int = 1
    kind: ClassVar[str] = "halo"

    def __post_init__(self):
        _check_choice("HaloStoragePolicy", "scatter_mode", self.scatter_mode, ("halo_correction", "local"))
        _check_choice("HaloStoragePolicy", "gather_mode", self.gather_mode, ("halo_read", "local"))
        object.__setattr__(self, "halo_layers",
                           integral("HaloStoragePolicy.halo_layers", self.halo_layers, minimum=1, error=SpecError))

    @property
    def deep(self) -> bool:
        """True when ranks compute ghost rows themselves (no scatter exchange)."""
        return self.scatter_mode == "local"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "scatter_mode": self.scatter_mode, "gather_mode": self.gather_mode}
        if self.halo_layers != 1:  # files of single-layer specs stay in the common schema
            d["halo_layers"] = self.halo_layers
        return d


@dataclasses.dataclass(frozen=True)
class HaloRefreshPolicy(StoragePolicy):
    """Halo storage whose only exchange is the forward refresh of ghost rows.

    Scatters fold nothing back (a no-op); ghosts are re-read from their owners before use.
    For backbones that build their own graph and never scatter onto ghost rows.
    """

    kind: ClassVar[str] = "halo_refresh"


@dataclasses.dataclass(frozen=True)
class GraphParallelPolicy(StoragePolicy):
    """Contiguous node blocks per rank, no spatial halo; node features all-gathered per layer."""

    kind: ClassVar[str] = "graph_parallel"


POLICIES: dict[str, type[StoragePolicy]] = {
    cls.kind: cls for cls in (HaloStoragePolicy, HaloRefreshPolicy, GraphParallelPolicy)
}


# --------------------------------------------------------------------------- transforms


@dataclasses.dataclass(frozen=True)
class Transform:
    """What the framework does to one kernel input (before) or output (after)."""

    type: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return {"type": self.type}


@dataclasses.dataclass(frozen=True)
class GatherInputs(Transform):
    """Owned-only input ``[n_owned, *F]`` → halo-padded ``[n_padded, *F]`` (forward exchange)."""

    type: ClassVar[str] = "gather_inputs"


@dataclasses.dataclass(frozen=True)
class GatherInputsFull(Transform):
    """Sharded input → full ``[n_global + 1, *F]`` on every rank (all-gather; graph-parallel)."""

    type: ClassVar[str] = "gather_inputs_full"


@dataclasses.dataclass(frozen=True)
class SliceOwned(Transform):
    """Halo-padded input → owned rows ``[n_owned, *F]``, so each atom counts exactly once."""

    type: ClassVar[str] = "slice_owned"


@dataclasses.dataclass(frozen=True)
class ScatterOutputs(Transform):
    """Per-atom output with ghost partial sums → ``halo_reverse`` then ``halo_forward``."""

    type: ClassVar[str] = "scatter_outputs"


@dataclasses.dataclass(frozen=True)
class AllReduceSum(Transform):
    """Per-rank partial → sum over all ranks.

    replicated_consumer: every rank consumes the reduced value identically (e.g. a PME
    mesh), so the backward pass is the identity instead of another sum.
    """

    replicated_consumer: bool = False
    type: ClassVar[str] = "all_reduce_sum"

    def __post_init__(self):
        if not isinstance(self.replicated_consumer, bool):
            raise SpecError(f"AllReduceSum.replicated_consumer must be a bool, got {self.replicated_consumer!r}")

    def to_dict(self) -> dict:
        return {"type": self.type, "replicated_consumer": self.replicated_consumer}


@dataclasses.dataclass(frozen=True)
class SliceOutputsOwned(Transform):
    """Full ``[n_global + 1, F]`` output → this rank's ``[n_owned + 1, F]`` rows."""

    type: ClassVar[str] = "slice_outputs_owned"


TRANSFORMS: dict[str, type[Transform]] = {
    cls.type: cls
    for cls in (GatherInputs, GatherInputsFull, SliceOwned, ScatterOutputs, AllReduceSum, SliceOutputsOwned)
}


# --------------------------------------------------------------------------- named ops

_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_.]*", re.ASCII)
_REGISTRY: dict[str, "OpHandle"] = {}
# Namespaces of ops that jaxdd itself provides → the module that registers them, imported
# on first use so that a spec file naming them loads without importing it first.
_PROVIDERS = {"jaxdd_ffi": "jaxdd.ffi", "jaxdd_warp": "jaxdd.ffi.warp", "jaxdd_mesh": "jaxdd.mesh"}


@dataclasses.dataclass(frozen=True, eq=False)
class OpHandle:
    """A named op: a kernel the dispatch treats as opaque, called as ``handle(*args)``.

    Calls go through a ``jax.jit`` named after the handle, so the op appears in a traced
    program as one call the dispatch can recognise by name (and re-binds whole, its
    derivative rule included). Handles compare by name.

    fwd, bwd: the op's reverse-mode rule, when it has one (see :func:`register_op`).
    """

    name: str
    fn: Callable = dataclasses.field(repr=False)
    module: str = ""
    fwd: Callable | None = dataclasses.field(default=None, repr=False)
    bwd: Callable | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self):
        inner = self.fn if self.bwd is None else _with_vjp(self.fn, self.fwd, self.bwd)

        def call(*args, **kwargs):
            return inner(*args, **kwargs)

        call.__name__ = call.__qualname__ = self.name
        object.__setattr__(self, "_jitted", jax.jit(call))

    @property
    def namespace(self) -> str:
        return self.name.split("::", 1)[0]

    @property
    def differentiable(self) -> bool:
        """True when the op carries its own reverse-mode rule (a ``custom_vjp``)."""
        return self.bwd is not None

    def __call__(self, *args, **kwargs):
        return self._jitted(*args, **kwargs)

    def __eq__(self, other):
        return isinstance(other, OpHandle) and other.name == self.name

    def __hash__(self):
        return hash(("OpHandle", self.name))

    def __str__(self):
        return self.name


def _with_vjp(fn: Callable, fwd: Callable | None, bwd: Callable) -> Callable:
    """``fn`` as a ``jax.custom_vjp`` whose rule is ``fwd``/``bwd`` (see :func:`register_op`).

    Symbolic zeros are asked for so that ``bwd`` learns which outputs nothing depends on
    (``None`` there) and can skip their work, e.g. a second-derivative formula for kernel
    forces when only the energy is differentiated.
    """
    from jax.custom_derivatives import SymbolicZero

    core = jax.custom_vjp(fn)

    def fwd_rule(*primals):
        args = tuple(p.value for p in primals)
        return fwd(*args) if fwd is not None else (fn(*args), args)

    def bwd_rule(residuals, cts):
        cts = jax.tree_util.tree_map(lambda c: None if isinstance(c, SymbolicZero) else c, cts,
                                     is_leaf=lambda c: isinstance(c, SymbolicZero))
        return tuple(bwd(residuals, cts))

    core.defvjp(fwd_rule, bwd_rule, symbolic_zeros=True)

    def op(*args):
        # Inside shard_map, the rule sees its arguments varying over the same mesh axes
        # (what an FFI call needs); the casts happen out here, where JAX differentiates
        # them, so an argument that did not vary gets its cotangent summed over ranks.
        return core(*match_varying(args))

    return op


def varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` varies inside ``shard_map`` (empty outside, or for non-arrays)."""
    try:
        aval = jax.typeof(x)
    except TypeError:
        return frozenset()
    mat = getattr(aval, "mat", None)  # jax 0.10
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # later releases


def match_varying(args: tuple) -> tuple:
    """``args`` with every array made varying over the union of their mesh axes (identity
    outside ``shard_map``, or with ``check_vma=False``)."""
    axes = frozenset().union(*(varying_axes(a) for a in args))
    if not axes:
        return tuple(args)

    def cast(x):
        missing = tuple(sorted(axes - varying_axes(x)))
        if not missing or not hasattr(x, "dtype"):
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)

    return tuple(cast(a) for a in args)


def register_op(name: str, fn: Callable | None = None, *, fwd: Callable | None = None,
                bwd: Callable | None = None, replace: bool = False):
    """Register ``fn`` as the named op ``"namespace::op"`` and return its :class:`OpHandle`.

    fn(*arrays) -> array or tuple of arrays. All arguments are arrays (scalars as 0-d
    arrays): the dispatch may call the op again on transformed arguments, so nothing may
    hide in keyword arguments.

    bwd: the op's reverse-mode rule (a backward kernel or a jnp formula), making the op a
    ``jax.custom_vjp``: ``bwd(residuals, cotangents)`` returns one cotangent per argument
    (``None`` for integer, boolean or non-differentiated ones); an entry of
    ``cotangents`` is ``None`` when nothing depends on that output. fwd(*arrays) ->
    (outputs, residuals) computes them (default: ``fn`` and the arguments themselves).
    Without ``bwd``, JAX differentiates ``fn`` itself (it must then be made of jax ops).

    Usable as a decorator: ``@register_op("mymodel::fused_message")``. Registering a name
    twice with different functions is refused unless ``replace=True`` (re-running a module,
    e.g. in a notebook, re-registers the same function and is allowed).
    """
    if not isinstance(name, str) or not _OP_NAME.fullmatch(name):
        raise SpecError(f"op name must look like 'namespace::op' (identifiers), got {name!r}")
    if fn is None:
        return lambda f: register_op(name, f, fwd=fwd, bwd=bwd, replace=replace)
    if not callable(fn):
        raise SpecError(f"register_op({name!r}, ...): the implementation must be callable, got {fn!r}")
    for field, rule in (("fwd", fwd), ("bwd", bwd)):
        if rule is not None and not callable(rule):
            raise SpecError(f"register_op({name!r}, ...): {field} must be callable, got {rule!r}")
    if fwd is not None and bwd is None:
        raise SpecError(f"register_op({name!r}, ...): fwd without bwd; pass the backward rule too")
    old = _REGISTRY.get(name)
    if old is not None and not (replace or old.fn is fn or _same_source(old.fn, fn)):
        raise SpecError(f"op {name!r} is already registered by {old.module or 'another module'}; pass replace=True")
    handle = OpHandle(name, fn, getattr(fn, "__module__", "") or "", fwd=fwd, bwd=bwd)
    _REGISTRY[name] = handle
    return handle


def _same_source(a: Callable, b: Callable) -> bool:
    """True for the same function defined again (a module or notebook cell run twice)."""
    keys = ("__module__", "__qualname__", "__code__")
    return all(getattr(a, k, None) is not None and getattr(a, k, None) == getattr(b, k, None) for k in keys)


def get_op(name: str) -> OpHandle:
    """The registered op ``name``; a :class:`SpecError` naming the handle if nobody registered it."""
    if isinstance(name, OpHandle):
        return name
    if not isinstance(name, str) or "::" not in name:
        raise SpecError(f"an op handle is a 'namespace::op' string, got {name!r}")
    namespace = name.split("::", 1)[0]
    if name not in _REGISTRY and namespace in _PROVIDERS:
        importlib.import_module(_PROVIDERS[namespace])
    try:
        return _REGISTRY[name]
    except KeyError:
        raise SpecError(
            f"op {name!r} is not registered; import the module that registers the {namespace!r} ops "
            f"(it calls jaxdd.ops.register_op({name!r}, ...)) before loading this spec"
        ) from None


def registered_ops() -> tuple[str, ...]:
    """Names of all registered ops, sorted."""
    return tuple(sorted(_REGISTRY))
