"""Dispatch: run a single-device model under decomposition by re-interpreting its jaxpr.

The model is traced once on one rank's padded shapes; the resulting jaxpr is evaluated
again, equation by equation, inside ``shard_map``. Every value carries a :class:`Layout`
known from provenance: inputs are tagged (positions per node, edge indices per edge and
pointing at nodes, the system index pointing at systems), and each rule below says how a
primitive moves the tag. Most equations are re-bound unchanged; a few get a distributed
meaning under the spec's storage policy:

- scatter-add into a per-node value: ``halo_correction`` → reverse then forward halo
  exchange; ``local`` → nothing (deep halo); refresh-only policy → forward only. Other
  scatters (max, min, set) into per-node values refresh the ghost rows.
- a reduction of per-node or per-edge values over atoms (``reduce_sum/max/min``, a
  ``dot_general`` contracting the atom axis, a scatter into per-system rows) → ghost and pad
  rows masked, then ``psum``/``pmax``/``pmin`` across ranks.
- a registered custom op with an :class:`~jaxdd.spec.OpAdapter` → its transforms; the intent
  verbs of :mod:`jaxdd.intent` → their distributed meaning.
- jit, closed_call, remat, custom_jvp/vjp, scan, cond and while are entered recursively when
  something inside them needs a rule, and re-bound untouched otherwise (so custom derivative
  rules survive wherever the body needs nothing).

The invariant kept: after every equation, ghost rows of a per-node value equal their owner's
row. Forces and stress are never computed here: the engine differentiates the re-interpreted
function from outside. Shape is consulted only where provenance says nothing, and every such
guess is recorded in the :class:`DispatchReport`.
"""

from __future__ import annotations

import dataclasses
import enum
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from . import halo as _halo
from .intent import VERBS
from .mesh import MESH_VERBS
from .ops import GraphParallelPolicy, HaloRefreshPolicy, HaloStoragePolicy, SpecError

__all__ = ["Kind", "Layout", "REPLICATED", "DispatchError", "DispatchWarning", "DispatchReport", "Runtime",
           "Dispatcher", "batch_layouts", "call_model"]


class DispatchError(ValueError):
    """A model does something the dispatch cannot distribute; the message says what and where."""


class DispatchWarning(UserWarning):
    """The dispatch had to guess (shape fallback) or left an operation rank-local."""


class Kind(str, enum.Enum):
    """What the distributed axis of a value runs over."""

    NODE = "node"  # local padded atoms: [owned | ghosts | pad]
    EDGE = "edge"  # neighbour-list edges of this rank
    GRAPH = "graph"  # systems; the same on every rank
    # Only as an index kind: every rank's node rows stacked in rank order (the senders of a
    # graph-parallel neighbour list). Reading per-node values through it all-gathers them.
    ALL_NODES = "all_nodes"


@dataclasses.dataclass(frozen=True)
class Layout:
    """kind: the distributed axis' kind (None: nothing distributed). axis: which axis that
    is. index: the values are indices into this kind's axis (edge receivers point at nodes,
    ``batch_idx`` at systems). local: no distributed axis, but the value differs between
    ranks (one atom's value, a rank-local partial); never set together with ``kind``."""

    kind: Kind | None = None
    axis: int = 0
    index: Kind | None = None
    local: bool = False
    columns: tuple | None = None  # per-column index kinds of an index array built column by column

    def moved(self, axis: int | None) -> "Layout":
        return Layout(self.kind, axis, self.index) if axis is not None else Layout(None, 0, self.index)

    def plain(self) -> "Layout":
        return Layout(self.kind, self.axis, None) if self.kind is not None else REPLICATED


REPLICATED = Layout()
_ROWS = (Kind.NODE, Kind.EDGE)  # rank-local rows: reductions over them need masks and collectives


# --------------------------------------------------------------------------- report


@dataclasses.dataclass
class DispatchReport:
    """What the dispatch did to one traced program.

    counts: rule name → times applied (``scatter_add.halo_correction``, ``reduce.sum`` ...).
    fallbacks: places where shape decided a layout, or an operation over atoms was left
    rank-local (each may be wrong under decomposition). policy: the storage policy used.
    """

    policy: object = None
    counts: Counter = dataclasses.field(default_factory=Counter)
    fallbacks: list = dataclasses.field(default_factory=list)

    def count(self, rule: str) -> None:
        self.counts[rule] += 1

    def note(self, message: str) -> None:
        if message not in self.fallbacks:
            self.fallbacks.append(message)

    def fired(self, prefix: str) -> int:
        """Total applications of the rules whose names start with ``prefix``."""
        return sum(n for k, n in self.counts.items() if k.startswith(prefix))

    def __str__(self) -> str:
        rows = [f"dispatch under {self.policy}:"]
        rows += [f"  {k}: {n}" for k, n in sorted(self.counts.items())] or ["  no rule fired"]
        rows += [f"  fallback: {m}" for m in self.fallbacks]
        return "\n".join(rows)


# --------------------------------------------------------------------------- runtime


@dataclasses.dataclass(frozen=True)
class Runtime:
    """One rank's view of the decomposition, inside ``shard_map``.

    layout / routing: the halo plan (static / traced). axis_names: mesh axes.
    policy: the storage policy. owned_rows: [n_padded] bool, real owned rows.
    edge_owned: [n_edges] bool, real edges whose receiver is owned (None: no edge list).
    ops: registered op name → :class:`~jaxdd.spec.OpAdapter` declared on the spec.
    """

    layout: _halo.HaloLayout | None
    routing: _halo.HaloRouting | None
    axis_names: tuple[str, ...]
    policy: object
    owned_rows: jax.Array
    edge_owned: jax.Array | None = None
    ops: dict = dataclasses.field(default_factory=dict)
    n_ranks: int = 1

    @property
    def n_owned(self) -> int:
        return self.layout.n_owned if self.layout is not None else int(self.owned_rows.shape[0])

    @property
    def n_padded(self) -> int:
        return int(self.owned_rows.shape[0])

    @property
    def n_edges(self) -> int:
        return 0 if self.edge_owned is None else int(self.edge_owned.shape[0])

    @property
    def scatter_mode(self) -> str:
        if isinstance(self.policy, HaloRefreshPolicy):
            return "refresh"
        if isinstance(self.policy, HaloStoragePolicy):
            return self.policy.scatter_mode
        if isinstance(self.policy, GraphParallelPolicy):
            return "local"  # receivers are own rows; there are no ghost rows to correct
        raise SpecError(f"the dispatch runs under a halo or graph-parallel storage policy, got {self.policy!r}")

    @property
    def n_all(self) -> int:
        """Rows of every rank's node rows stacked (graph-parallel sender index space)."""
        return self.n_padded * self.n_ranks

    def all_nodes(self, x, axis: int = 0):
        """Per-node ``x`` with every rank's node rows, stacked in rank order, in place of this
        rank's; rows beyond the node rows (e.g. an appended padding row) follow unchanged."""
        x = jnp.moveaxis(x, axis, 0)
        n = self.n_padded
        if x.shape[0] < n:
            raise DispatchError(f"a per-node value has {x.shape[0]} rows, fewer than the {n} local rows; reading it "
                                "through graph-parallel senders needs every local row")
        full = jax.lax.all_gather(x[:n], self.axis_names, tiled=True)
        if x.shape[0] > n:
            full = jnp.concatenate([full, x[n:]])
        return jnp.moveaxis(full, 0, axis)

    def reduce_scatter(self, delta, axis: int = 0):
        """Inverse of :meth:`all_nodes` for sums: stacked rows summed over ranks, this rank's
        block kept; rows beyond the stacked node rows stay as they are."""
        delta = jnp.moveaxis(delta, axis, 0)
        n_all = self.n_all
        own = jax.lax.psum_scatter(delta[:n_all], self.axis_names, scatter_dimension=0, tiled=True)
        if delta.shape[0] > n_all:
            own = jnp.concatenate([own, delta[n_all:]])
        return jnp.moveaxis(own, 0, axis)

    # Masks of the rows a reduction may count, for an axis of ``length`` rows.
    def row_mask(self, kind: Kind, length: int) -> jax.Array:
        base = self.owned_rows if kind is Kind.NODE else self.edge_owned
        if base is None:
            raise DispatchError("a per-edge reduction needs the framework's neighbour list; the model built its own")
        n = base.shape[0]
        if length <= n:
            return base[:length]
        return jnp.concatenate([base, jnp.zeros((length - n,), bool)])

    def _exchange(self, x, axis: int, fn):
        """Apply ``fn`` to the first n_padded rows along ``axis``; further rows are untouched."""
        x = jnp.moveaxis(x, axis, 0)
        n = self.n_padded
        if x.shape[0] < n:
            raise DispatchError(
                f"a per-node value has {x.shape[0]} rows, fewer than the {n} local rows; the halo exchange "
                "needs every local row (use to_local() if this value is deliberately rank-local)"
            )
        head = fn(x[:n])
        out = head if x.shape[0] == n else jnp.concatenate([head, x[n:]])
        return jnp.moveaxis(out, 0, axis)

    def halo_correct(self, x, axis: int = 0):
        """Ghost partials summed into owners, owners' totals copied back to ghosts."""
        if self.layout is None or not self.layout.exchanges:
            return x
        return self._exchange(x, axis, lambda y: _halo.halo_forward(
            _halo.halo_reverse(y, self.layout, self.routing, self.axis_names), self.layout, self.routing,
            self.axis_names))

    def halo_refresh(self, x, axis: int = 0):
        """Ghost rows re-read from their owners."""
        if self.layout is None or not self.layout.exchanges:
            return x
        n_owned = self.layout.n_owned
        return self._exchange(x, axis, lambda y: _halo.halo_forward(
            y[:n_owned], self.layout, self.routing, self.axis_names).astype(y.dtype))

    def gather_full(self, x):
        """Owned rows of every rank, stacked in rank order, then one zero padding row:
        [n_ranks * n_owned + 1, *F] (the ``GatherInputsFull`` transform)."""
        full = jax.lax.all_gather(x[: self.n_owned], self.axis_names, tiled=True)
        return jnp.concatenate([full, jnp.zeros((1,) + full.shape[1:], full.dtype)])

    def gather_inputs(self, x):
        """Owned rows [n_owned, *F] → local rows [n_padded, *F]."""
        if self.layout is None:
            return x
        return _halo.halo_forward(x[: self.layout.n_owned], self.layout, self.routing, self.axis_names)


# --------------------------------------------------------------------------- plans


@dataclasses.dataclass(frozen=True)
class _Decision:
    """What to do with one equation: the layouts of its outputs, and an action or None
    (re-bind unchanged). ``rule`` is counted when the action runs; ``notes`` are recorded."""

    outs: tuple[Layout, ...]
    apply: Callable | None = None
    rule: str | None = None
    notes: tuple[str, ...] = ()
    passive: bool = False  # the action changes nothing: a body of such actions is bound as traced
    replicates: bool = False  # the outputs are the same on every rank (a reduction with a collective)


@dataclasses.dataclass(frozen=True)
class _Plan:
    decisions: tuple[_Decision, ...]
    outs: tuple[Layout, ...]
    active: bool
    notes: tuple[str, ...]


def _bind(eqn, invals):
    got = eqn.primitive.get_bind_params(eqn.params)
    # Older JAX returned (subfuns, params); newer returns params only.
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    manager = getattr(getattr(eqn, "ctx", None), "manager", None)
    if manager is not None:
        with manager:
            out = eqn.primitive.bind(*subfuns, *invals, **params)
    else:
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _is_literal(v) -> bool:
    return isinstance(v, jcore.Literal)


def _shape(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


# --------------------------------------------------------------------------- the interpreter


class Dispatcher:
    """Re-interprets jaxprs under one rank's :class:`Runtime` and records a :class:`DispatchReport`.

    sizes: (n_padded, n_edges, n_systems) of the traced shapes, for the shape fallback.
    """

    def __init__(self, runtime: Runtime | None, report: DispatchReport, sizes: tuple[int, int, int]):
        self.rt = runtime
        self.report = report
        self.n_padded, self.n_edges, self.n_systems = sizes
        self._plans: dict = {}

    # ---------------------------------------------------------------- entry points

    def run_closed(self, closed, args: Sequence, layouts: Sequence[Layout]) -> list:
        """Evaluate a ClosedJaxpr on ``args`` tagged with ``layouts``; returns its outputs."""
        return self.eval(closed.jaxpr, closed.consts, args, tuple(layouts))

    def out_layouts(self, closed, layouts: Sequence[Layout]) -> tuple[Layout, ...]:
        return self.analyse(closed.jaxpr, tuple(layouts)).outs

    # ---------------------------------------------------------------- analysis

    def analyse(self, jaxpr, in_layouts: tuple[Layout, ...]) -> _Plan:
        key = (id(jaxpr), in_layouts)
        hit = self._plans.get(key)
        if hit is not None:
            return hit[1]
        env: dict = {}

        def read(v):
            return REPLICATED if _is_literal(v) else env.get(v, REPLICATED)

        for v, lay in zip(jaxpr.invars, in_layouts):
            env[v] = lay
        decisions, notes = [], []
        for eqn in jaxpr.eqns:
            ins = tuple(read(v) for v in eqn.invars)
            d = self._decide(eqn, ins)
            decisions.append(d)
            notes.extend(d.notes)
            # Whatever comes from rank-dependent data without keeping a distributed axis (one
            # atom's value, a partial left local) differs between ranks, unless a collective
            # made it the same everywhere.
            tainted = not d.replicates and any(i.local or i.kind in _ROWS for i in ins)
            for v, lay in zip(eqn.outvars, d.outs):
                lay = _clean(lay, v)
                if tainted and lay.kind is None and not lay.local:
                    lay = dataclasses.replace(lay, local=True)
                env[v] = lay
        plan = _Plan(tuple(decisions), tuple(read(v) for v in jaxpr.outvars),
                     any(d.apply is not None and not d.passive for d in decisions), tuple(dict.fromkeys(notes)))
        self._plans[key] = (jaxpr, plan)  # holding the jaxpr keeps its id unique
        return plan

    # ---------------------------------------------------------------- evaluation

    def eval(self, jaxpr, consts, args, in_layouts: tuple[Layout, ...]) -> list:
        plan = self.analyse(jaxpr, in_layouts)
        env: dict = {}

        def read(v):
            return v.val if _is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn, d in zip(jaxpr.eqns, plan.decisions):
            invals = [read(v) for v in eqn.invars]
            for message in d.notes:
                self.report.note(message)
            if d.apply is None:
                outvals = _bind(eqn, invals)
            else:
                outvals = d.apply(eqn, invals)
                if d.rule:
                    self.report.count(d.rule)
            for v, x in zip(eqn.outvars, outvals):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _sub(self, closed_or_open, consts=None):
        """(jaxpr, consts) of a sub-jaxpr parameter."""
        if hasattr(closed_or_open, "jaxpr") and hasattr(closed_or_open, "consts"):
            return closed_or_open.jaxpr, closed_or_open.consts
        return closed_or_open, (consts or ())

    # ---------------------------------------------------------------- rules

    def _decide(self, eqn, ins: tuple[Layout, ...]) -> _Decision:
        name = eqn.primitive.name
        rule = _RULES.get(name)
        if rule is not None:
            return rule(self, eqn, ins)
        if name.startswith("reduce_") and "axes" in eqn.params:
            return self._reduce(eqn, ins)
        if name.startswith("scatter"):
            return self._scatter(eqn, ins)
        if name.startswith("cum"):
            return self._cumulative(eqn, ins)
        return self._generic(eqn, ins)

    def _generic(self, eqn, ins) -> _Decision:
        """Elementwise and unknown primitives: a tag survives where the output keeps its axis."""
        keep_index = eqn.primitive.name in _INDEX_KEEPING
        outs = []
        for v in eqn.outvars:
            shape = _shape(v)
            found = []
            for lay, iv in zip(ins, eqn.invars):
                if lay.kind is None:
                    continue
                ishape = _shape(iv)
                if len(ishape) == len(shape) and lay.axis < len(shape) and ishape[lay.axis] == shape[lay.axis]:
                    found.append((lay.kind, lay.axis))
            kinds = list(dict.fromkeys(found))
            index = None
            if keep_index or eqn.primitive.name in ("add", "sub"):
                idx = {lay.index for lay in ins if lay.index is not None}
                index = idx.pop() if len(idx) == 1 else None
            if not kinds:
                outs.append(Layout(None, 0, index))
                continue
            kinds.sort(key=lambda ka: list(Kind).index(ka[0]))
            outs.append(Layout(kinds[0][0], kinds[0][1], index))
        return _Decision(tuple(outs))

    def _fallback_kind(self, length: int) -> Kind | None:
        """A kind guessed from an axis length alone (None when ambiguous or unknown)."""
        hits = [k for k, n in ((Kind.NODE, self.n_padded), (Kind.EDGE, self.n_edges)) if n and length == n]
        return hits[0] if len(hits) == 1 else None

    # reductions -----------------------------------------------------------

    def _reduce(self, eqn, ins) -> _Decision:
        (lay,) = ins[:1]
        axes = tuple(eqn.params["axes"])
        shape = _shape(eqn.invars[0])
        notes = ()
        kind = lay.kind
        if kind is None and lay.local:  # rank data whose layout was lost; parameters never are
            guessed = [(a, self._fallback_kind(shape[a])) for a in axes]
            guessed = [(a, k) for a, k in guessed if k is not None]
            if len(guessed) == 1 and shape:
                a, kind = guessed[0]
                lay = Layout(kind, a)
                notes = (f"{eqn.primitive.name} over an axis of {shape[a]} rows with no provenance taken as per-{kind.value} "
                         f"(shape fallback) in {_where(eqn)}",)
        if kind is None or lay.axis not in axes:
            if kind is None:
                return _Decision((REPLICATED,), notes=notes)
            shift = sum(1 for a in axes if a < lay.axis)
            return _Decision((Layout(kind, lay.axis - shift),), notes=notes)
        if kind is Kind.GRAPH:
            return _Decision((REPLICATED,), notes=notes)
        op = eqn.primitive.name[len("reduce_"):]
        collective = {"sum": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin,
                      "or": jax.lax.pmax, "and": jax.lax.pmin}.get(op)
        if collective is None:
            notes += (f"reduce_{op} over per-{kind.value} rows left rank-local in {_where(eqn)} (no collective for it)",)
            return _Decision((REPLICATED,), notes=notes)
        axis = lay.axis

        def apply(eqn, invals):
            x = invals[0]
            mask = _along(self.rt.row_mask(kind, x.shape[axis]), x.ndim, axis)
            x = jnp.where(mask, x, _identity_of(op, x.dtype))
            (out,) = _bind(eqn, [x])
            if op in ("or", "and"):
                return [collective(out.astype(jnp.int32), self.rt.axis_names).astype(out.dtype)]
            return [collective(out, self.rt.axis_names)]

        return _Decision((REPLICATED,), apply, f"reduce.{op}", notes, replicates=True)

    def _cumulative(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind in _ROWS and eqn.params.get("axis") == lay.axis:
            return _Decision((lay.plain(),), notes=(
                f"{eqn.primitive.name} runs along per-{lay.kind.value} rows in {_where(eqn)}: left rank-local, which is "
                "wrong under decomposition unless the model accounts for it (use system_sum or an adapter)",))
        return self._generic(eqn, ins)

    def _arg(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind in _ROWS and lay.axis in tuple(eqn.params["axes"]):
            return _Decision((REPLICATED,), notes=(
                f"{eqn.primitive.name} over per-{lay.kind.value} rows in {_where(eqn)} gives a local row index: "
                "left rank-local",))
        if lay.kind is None:
            return _Decision((REPLICATED,))
        shift = sum(1 for a in eqn.params["axes"] if a < lay.axis)
        return _Decision((Layout(lay.kind, lay.axis - shift),))

    def _dot_general(self, eqn, ins) -> _Decision:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        lshape, rshape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
        notes = []
        sides = [lhs, rhs]
        for i, (lay, shape, contract) in enumerate(((lhs, lshape, lc), (rhs, rshape, rc))):
            if lay.kind is None and lay.local and len(contract) == 1:
                k = self._fallback_kind(shape[contract[0]])
                if k is not None:
                    sides[i] = Layout(k, contract[0])
                    notes.append(f"dot_general contracting {shape[contract[0]]} rows with no provenance taken as "
                                 f"per-{k.value} (shape fallback) in {_where(eqn)}")
        lhs, rhs = sides
        # A contraction over a rank-local axis is a reduction over atoms (or edges).
        reduce_side = None
        for i, (lay, contract) in enumerate(((lhs, lc), (rhs, rc))):
            if lay.kind in _ROWS and lay.axis in contract:
                reduce_side = (i, lay)
                break
        n_lhs_free = len(lshape) - len(lc) - len(lb)

        def out_axis(lay, side):
            if lay.kind is None or lay.kind in _ROWS and reduce_side is not None:
                return None
            own_c, own_b = (lc, lb) if side == 0 else (rc, rb)
            if lay.axis in own_c:
                return None
            if lay.axis in own_b:
                return own_b.index(lay.axis)
            shape = lshape if side == 0 else rshape
            free = [d for d in range(len(shape)) if d not in own_c and d not in own_b]
            return len(lb) + (0 if side == 0 else n_lhs_free) + free.index(lay.axis)

        candidates = [(lay.kind, out_axis(lay, s)) for s, lay in enumerate((lhs, rhs))]
        candidates = [(k, a) for k, a in candidates if a is not None]
        out = Layout(*candidates[0]) if candidates else REPLICATED
        if len({c for c in candidates}) > 1:
            notes.append(f"dot_general of two distributed operands in {_where(eqn)}: kept the first operand's layout")
        if reduce_side is None:
            return _Decision((out,), notes=tuple(notes))
        side, lay = reduce_side

        def apply(eqn, invals):
            invals = list(invals)
            x = invals[side]
            mask = _along(self.rt.row_mask(lay.kind, x.shape[lay.axis]), x.ndim, lay.axis)
            invals[side] = jnp.where(mask, x, jnp.zeros((), x.dtype))
            (y,) = _bind(eqn, invals)
            return [jax.lax.psum(y, self.rt.axis_names)]

        return _Decision((out,), apply, "reduce.dot_general", tuple(notes), replicates=True)

    # structure ------------------------------------------------------------

    def _broadcast_in_dim(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind is None:
            return _Decision((Layout(None, 0, lay.index),))
        dims = eqn.params["broadcast_dimensions"]
        ishape, oshape = _shape(eqn.invars[0]), eqn.params["shape"]
        a = dims[lay.axis]
        if oshape[a] != ishape[lay.axis]:
            return _Decision((Layout(None, 0, lay.index),))
        return _Decision((Layout(lay.kind, a, lay.index),))

    def _reshape(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind is None:
            return _Decision((Layout(None, 0, lay.index),))
        ishape, oshape = _shape(eqn.invars[0]), tuple(eqn.params["new_sizes"])
        before = int(np.prod(ishape[: lay.axis], dtype=np.int64))
        for j in range(len(oshape)):
            if int(np.prod(oshape[:j], dtype=np.int64)) == before and oshape[j] == ishape[lay.axis]:
                return _Decision((Layout(lay.kind, j, lay.index),))
        note = ()
        if lay.kind in _ROWS:
            note = (f"reshape {ishape}->{oshape} merges the per-{lay.kind.value} axis in {_where(eqn)}: layout lost",)
        return _Decision((Layout(None, 0, lay.index),), notes=note)

    def _squeeze(self, eqn, ins) -> _Decision:
        lay = ins[0]
        dims = tuple(eqn.params["dimensions"])
        if lay.kind is None or lay.axis in dims:
            return _Decision((Layout(None, 0, lay.index),))
        return _Decision((Layout(lay.kind, lay.axis - sum(1 for d in dims if d < lay.axis), lay.index),))

    def _transpose(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind is None:
            return _Decision((lay,))
        return _Decision((Layout(lay.kind, tuple(eqn.params["permutation"]).index(lay.axis), lay.index),))

    def _slice(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind is None:
            return _Decision((Layout(None, 0, lay.index),))
        a = lay.axis
        start, limit = eqn.params["start_indices"][a], eqn.params["limit_indices"][a]
        strides = eqn.params.get("strides") or (1,) * len(eqn.params["start_indices"])
        full = _shape(eqn.invars[0])[a]
        if start == 0 and strides[a] == 1:
            return _Decision((lay,))  # a prefix keeps every row where it was
        note = ()
        if lay.kind in _ROWS:
            note = (f"slice [{start}:{limit}:{strides[a]}] of the per-{lay.kind.value} axis ({full} rows) in "
                    f"{_where(eqn)}: rows renumbered, layout lost",)
        return _Decision((Layout(None, 0, lay.index),), notes=note)

    def _dynamic_slice(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind is None:
            return _Decision((Layout(None, 0, lay.index),))
        if eqn.params["slice_sizes"][lay.axis] == _shape(eqn.invars[0])[lay.axis]:
            return _Decision((lay,))
        note = ()
        if lay.kind in _ROWS:
            note = (f"dynamic_slice of the per-{lay.kind.value} axis in {_where(eqn)} picks rank-local rows: layout lost",)
        return _Decision((Layout(None, 0, lay.index),), notes=note)

    def _concatenate(self, eqn, ins) -> _Decision:
        dim = eqn.params["dimension"]
        first = ins[0]
        oshape = _shape(eqn.outvars[0])
        if dim == len(oshape) - 1 and oshape[dim] <= 8 and any(lay.index is not None or lay.columns for lay in ins):
            # Index columns side by side (x.at[receivers, kind]): keep what each column points at.
            columns = ()
            for lay, v in zip(ins, eqn.invars):
                width = _shape(v)[dim]
                columns += lay.columns if lay.columns and len(lay.columns) == width else (lay.index,) * width
            d = self._generic(eqn, ins)
            return _Decision((dataclasses.replace(d.outs[0], columns=columns),), notes=d.notes)
        if first.kind is not None and first.axis == dim:
            return _Decision((first,))  # rows appended after the tagged rows keep their place
        along = [lay for lay in ins if lay.kind is not None and lay.axis == dim]
        if along:
            return _Decision((REPLICATED,), notes=(
                f"concatenate puts per-{along[0].kind.value} rows after other rows in {_where(eqn)}: layout lost",))
        return self._generic(eqn, ins)

    def _pad(self, eqn, ins) -> _Decision:
        lay = ins[0]
        if lay.kind is None:
            return _Decision((REPLICATED,))
        lo, _, interior = eqn.params["padding_config"][lay.axis]
        if lo == 0 and interior == 0:
            return _Decision((lay,))
        return _Decision((REPLICATED,), notes=(f"pad shifts the per-{lay.kind.value} rows in {_where(eqn)}: layout lost",))

    def _select_n(self, eqn, ins) -> _Decision:
        d = self._generic(eqn, ins)
        idx = {lay.index for lay in ins[1:] if lay.index is not None}
        out = d.outs[0]
        return _Decision((Layout(out.kind, out.axis, idx.pop() if len(idx) == 1 else None),))

    def _dynamic_update_slice(self, eqn, ins) -> _Decision:
        return _Decision((ins[0],))

    def _iota(self, eqn, ins) -> _Decision:
        shape, dim = tuple(eqn.params["shape"]), eqn.params["dimension"]
        kind = self._fallback_kind(shape[dim])
        if kind is None:
            return _Decision((REPLICATED,))
        return _Decision((Layout(kind, dim, kind),), notes=(
            f"iota of {shape[dim]} rows taken as per-{kind.value} indices (shape fallback) in {_where(eqn)}",))

    def _sort(self, eqn, ins) -> _Decision:
        dim = eqn.params["dimension"]
        tagged = [lay for lay in ins if lay.kind in _ROWS and lay.axis == dim]
        if tagged:
            return _Decision((REPLICATED,) * len(eqn.outvars), notes=(
                f"sort along the per-{tagged[0].kind.value} axis in {_where(eqn)} reorders rows: layout lost",))
        return self._generic(eqn, ins)

    def _pvary(self, eqn, ins) -> _Decision:
        # Per-rank typing recorded by a trace with manual axis types: an identity on values.
        return _Decision(tuple(ins), lambda eqn, invals: list(invals), passive=True)

    # gather / scatter -----------------------------------------------------

    def _gather(self, eqn, ins) -> _Decision:
        op, idx = ins
        dn = eqn.params["dimension_numbers"]
        oshape = _shape(eqn.outvars[0])
        ishape = _shape(eqn.invars[1])
        batch_out = [d for d in range(len(oshape)) if d not in dn.offset_dims]
        notes = []
        index = op.index
        if idx.index is Kind.ALL_NODES and op.kind is Kind.NODE and op.axis in dn.start_index_map:
            # Graph-parallel senders point at any rank's atoms: read from all ranks' rows.
            rows = idx.kind is not None and idx.axis < len(ishape) - 1
            out = Layout(idx.kind, batch_out[idx.axis], index) if rows else Layout(None, 0, index)
            axis = op.axis

            def gather_all(eqn, invals):
                x, indices = invals
                return _bind(eqn, [self.rt.all_nodes(x, axis), indices])

            return _Decision((out,), gather_all, "gather.all_nodes")
        if idx.kind is not None and idx.axis < len(ishape) - 1:
            if op.kind in _ROWS + (Kind.GRAPH,) and op.axis in dn.start_index_map:
                if idx.index is None:
                    notes.append(f"gather from per-{op.kind.value} rows by indices of unknown provenance in "
                                 f"{_where(eqn)}: assumed to point at local rows")
                elif idx.index is not op.kind:
                    notes.append(f"gather from per-{op.kind.value} rows by per-{idx.index.value} indices in {_where(eqn)}")
            return _Decision((Layout(idx.kind, batch_out[idx.axis], index),), notes=tuple(notes))
        if op.kind is None:
            return _Decision((Layout(None, 0, index),))
        a = op.axis
        if a in dn.start_index_map or a in dn.collapsed_slice_dims:
            if op.kind in _ROWS:
                notes.append(f"gather picks single per-{op.kind.value} rows by replicated indices in {_where(eqn)} "
                             "(e.g. x[0]): the row differs between ranks")
            return _Decision((Layout(None, 0, index),), notes=tuple(notes))
        if a in getattr(dn, "operand_batching_dims", ()):
            k = dn.operand_batching_dims.index(a)
            return _Decision((Layout(op.kind, batch_out[dn.start_indices_batching_dims[k]], index),))
        if eqn.params["slice_sizes"][a] != _shape(eqn.invars[0])[a]:
            return _Decision((Layout(None, 0, index),))
        offset_operand = [d for d in range(len(_shape(eqn.invars[0])))
                          if d not in dn.collapsed_slice_dims and d not in getattr(dn, "operand_batching_dims", ())]
        return _Decision((Layout(op.kind, dn.offset_dims[offset_operand.index(a)], index),))

    def _scatter(self, eqn, ins) -> _Decision:
        name = eqn.primitive.name
        op, idx, upd = ins[0], ins[1], ins[2]
        dn = eqn.params["dimension_numbers"]
        if len(ins) != 3:
            return self._generic(eqn, ins)
        notes = []
        sdod = dn.scatter_dims_to_operand_dims
        known = [(c, k) for c, k in enumerate(idx.columns or ()) if k is not None]
        if len(sdod) == 1:
            a = sdod[0]
            target = idx.index
        elif idx.columns and len(idx.columns) == len(sdod) and len(known) == 1:
            a, target = sdod[known[0][0]], known[0][1]  # the one column that points somewhere
        else:
            # Several index columns (x.at[receivers, kind].add(...)): which column points at
            # atoms is not tracked per column, so the operand's axis as long as the local rows
            # is taken as the atom axis.
            oshape = _shape(eqn.invars[0])
            axes = [d for d in dn.scatter_dims_to_operand_dims if self._fallback_kind(oshape[d]) is Kind.NODE]
            if len(axes) == 1:
                a, target = axes[0], Kind.NODE
                notes.append(f"{name} with {len(dn.scatter_dims_to_operand_dims)} index columns in {_where(eqn)}: the "
                             f"column into the {oshape[a]} local rows taken as the atom index (shape fallback)")
            else:
                a, target = dn.scatter_dims_to_operand_dims[0], None
                if idx.kind in _ROWS or upd.kind in _ROWS:
                    notes.append(f"{name} with several index columns in {_where(eqn)}: no column could be told to "
                                 "point at atoms; left rank-local")
                return _Decision((op.plain() if op.kind else REPLICATED,), notes=tuple(notes))
        # Indices that are per-row data without a known meaning are suspicious; replicated
        # ones (constants, or indices passed through to_local) are a deliberate local scatter.
        if target is None and op.kind is None and idx.kind in _ROWS:
            notes.append(f"{name} of per-row values by indices of unknown provenance in {_where(eqn)}: left rank-local")
        if target is None:
            out = op if op.kind is not None else REPLICATED
            return _Decision((out.plain() if out.kind else out,), notes=tuple(notes))
        out = Layout(target, a)
        kind = name.split("-", 1)[1] if "-" in name else "set"
        ishape = _shape(eqn.invars[1])
        if target is Kind.ALL_NODES:
            return self._scatter_all_nodes(eqn, kind, a, tuple(notes))
        if target is Kind.NODE:
            mode = self.rt.scatter_mode if self.rt is not None else "local"
            if mode == "local":
                return _Decision((out,), self._noop, f"scatter_{kind}.local", tuple(notes))
            if kind == "add" and mode == "halo_correction":
                def apply(eqn, invals):
                    operand, indices, updates = invals
                    (delta,) = _bind(eqn, [jnp.zeros_like(operand), indices, updates])
                    return [operand + self.rt.halo_correct(delta, a)]
                return _Decision((out,), apply, "scatter_add.halo_correction", tuple(notes))

            def refresh(eqn, invals):
                (y,) = _bind(eqn, invals)
                return [self.rt.halo_refresh(y, a)]
            return _Decision((out,), refresh, f"scatter_{kind}.refresh", tuple(notes))
        if target is Kind.GRAPH:
            rows = idx.kind if idx.kind in _ROWS and idx.axis < len(ishape) - 1 else None
            if rows is None and upd.kind in _ROWS:
                notes.append(f"{name} into per-system rows from per-{upd.kind.value} values whose index has no row "
                             f"layout in {_where(eqn)}: left rank-local")
            if rows is None:
                return _Decision((out,), notes=tuple(notes))
            if kind not in ("add", "max", "min"):
                notes.append(f"{name} into per-system rows in {_where(eqn)} has no collective: left rank-local")
                return _Decision((out,), notes=tuple(notes))
            upd_scatter = [d for d in range(len(_shape(eqn.invars[2]))) if d not in dn.update_window_dims]
            upd_axis = upd_scatter[idx.axis]
            collective = {"add": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[kind]

            def apply(eqn, invals):
                operand, indices, updates = invals
                mask = _along(self.rt.row_mask(rows, updates.shape[upd_axis]), updates.ndim, upd_axis)
                updates = jnp.where(mask, updates, _identity_of(kind, updates.dtype))
                if kind == "add":
                    (delta,) = _bind(eqn, [jnp.zeros_like(operand), indices, updates])
                    return [operand + collective(delta, self.rt.axis_names)]
                (y,) = _bind(eqn, [operand, indices, updates])
                return [collective(y, self.rt.axis_names)]

            return _Decision((out,), apply, f"segment_reduce.{kind}", tuple(notes), replicates=True)
        return _Decision((out,), notes=tuple(notes))

    def _scatter_all_nodes(self, eqn, kind: str, a: int, notes) -> _Decision:
        """A scatter into per-node rows by graph-parallel sender indices: made on every
        rank's rows stacked, combined across ranks, this rank's block kept."""
        if kind not in ("add", "max", "min"):
            raise DispatchError(
                f"{eqn.primitive.name} into per-atom rows by neighbour-list senders in {_where(eqn)}: under the "
                "graph-parallel strategy only add, max and min can be combined across ranks; scatter onto receivers "
                "(each edge's own atom) instead, or use the halo strategy")

        def apply(eqn, invals):
            operand, indices, updates = invals
            rt = self.rt
            shape = list(operand.shape)
            shape[a] += rt.n_all - rt.n_padded
            fill = jnp.zeros((), operand.dtype) if kind == "add" else _identity_of(kind, operand.dtype)
            (delta,) = _bind(eqn, [jnp.full(shape, fill, operand.dtype), indices, updates])
            if kind == "add":
                return [operand + rt.reduce_scatter(delta, a)]
            # Every rank's values for this rank's block (all_to_all: differentiable, unlike pmax).
            rows = jnp.moveaxis(delta, a, 0)
            blocks = rows[: rt.n_all].reshape((rt.n_ranks, rt.n_padded) + rows.shape[1:])
            mine = jax.lax.all_to_all(blocks, rt.axis_names, 0, 0)
            own = jnp.max(mine, axis=0) if kind == "max" else jnp.min(mine, axis=0)
            own = jnp.moveaxis(jnp.concatenate([own, rows[rt.n_all:]]), 0, a)
            pick = jnp.maximum if kind == "max" else jnp.minimum
            return [pick(operand, own)]

        return _Decision((Layout(Kind.NODE, a),), apply, f"scatter_{kind}.all_nodes", notes)

    def _index_bound(self, eqn, ins) -> _Decision:
        """Comparisons and clamps of graph-parallel senders against the local row count.

        A single-device model tells padding edges by ``senders < n`` and keeps indices in
        range by ``jnp.minimum(senders, n - 1)`` or a clip, with ``n`` its atom count. Senders
        index every rank's rows, so ``n`` (this rank's rows) becomes the stacked count there.
        """
        d = self._generic(eqn, ins)
        if not any(lay.index is Kind.ALL_NODES for lay in ins):
            return d
        last = eqn.primitive.name in ("min", "clamp")  # bounds are the last valid index, n - 1
        local = self.n_padded - 1 if last else self.n_padded
        at = [i for i, v in enumerate(eqn.invars) if _is_literal(v) and np.ndim(v.val) == 0 and v.val == local
              and np.issubdtype(np.asarray(v.val).dtype, np.integer)]
        if not at:
            return d

        def apply(eqn, invals):
            invals = list(invals)
            for i in at:
                invals[i] = jnp.asarray(self.rt.n_all - 1 if last else self.rt.n_all, jnp.result_type(invals[i]))
            return _bind(eqn, invals)

        return _Decision(d.outs, apply, "bound.all_nodes", d.notes)

    @staticmethod
    def _noop(eqn, invals):
        return _bind(eqn, invals)

    # named ops and verbs --------------------------------------------------

    def _call(self, eqn, ins) -> _Decision:
        """jit / pjit / closed_call: named ops and verbs, else entered when their body needs a rule."""
        name = eqn.params.get("name")
        if name in VERBS:
            return self._verb(name, eqn, ins)
        if name in MESH_VERBS:
            return self._mesh_verb(name, eqn, ins)
        if self.rt is not None and name in self.rt.ops:
            return self._custom_op(self.rt.ops[name], eqn, ins)
        sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        jaxpr, consts = self._sub(sub)
        plan = self.analyse(jaxpr, ins)
        if not plan.active:
            return _Decision(plan.outs, notes=plan.notes)

        def apply(eqn, invals):
            return self.eval(jaxpr, consts, invals, ins)

        return _Decision(plan.outs, apply)

    def _mesh_verb(self, name, eqn, ins) -> _Decision:
        """A verb of :mod:`jaxdd.mesh`: per-atom inputs in, per-system sums out, the same on
        every rank; its distributed body owns the mesh exchange and the distributed FFT."""
        from .mesh import DISTRIBUTED

        def apply(eqn, invals):
            return [DISTRIBUTED[name](self.rt, *invals)]

        return _Decision((Layout(Kind.GRAPH, 0),), apply, "verb." + name.split("::", 1)[1], replicates=True)

    def _verb(self, name, eqn, ins) -> _Decision:
        jaxpr, consts = self._sub(eqn.params["jaxpr"])
        lay = ins[0]
        if name == "jaxdd::to_local":
            return _Decision((REPLICATED,), self._noop, "verb.to_local")
        if name == "jaxdd::autograd_target":
            return _Decision((lay,), self._noop, "verb.autograd_target")
        if name in ("jaxdd::system_sum", "jaxdd::system_sum_local"):
            rows = lay.kind if lay.kind in _ROWS else None
            total = name == "jaxdd::system_sum"

            def apply(eqn, invals):
                values, index = invals
                if rows is not None:  # each atom (edge) counted on its owner's rank only
                    mask = _along(self.rt.row_mask(rows, values.shape[lay.axis]), values.ndim, lay.axis)
                    values = jnp.where(mask, values, jnp.zeros((), values.dtype))
                (y,) = _bind(eqn, [values, index])
                return [jax.lax.psum(y, self.rt.axis_names) if rows is not None and total else y]

            if total:
                return _Decision((Layout(Kind.GRAPH, 0),), apply, "verb.system_sum", replicates=rows is not None)
            return _Decision((Layout(local=rows is not None),), apply, "verb.system_sum_local")
        if lay.kind is not Kind.NODE:
            rows = _shape(eqn.invars[0])[:1]
            if not rows or rows[0] < self.n_padded:
                raise DispatchError(
                    f"{name} takes per-atom values with one row per local atom ({self.n_padded}); got shape "
                    f"{_shape(eqn.invars[0])} in {_where(eqn)}")
            lay = Layout(Kind.NODE, 0)  # the caller says these rows are atoms
        if name == "jaxdd::refresh_neighbors":
            return _Decision((lay,), lambda eqn, invals: [self.rt.halo_refresh(invals[0], lay.axis)],
                             "verb.refresh_neighbors")
        return _Decision((lay,), lambda eqn, invals: [self.rt.halo_correct(invals[0], lay.axis)],
                         "verb.scatter_to_owners")

    def _custom_op(self, adapter, eqn, ins) -> _Decision:
        from .ops import AllReduceSum, GatherInputs, GatherInputsFull, ScatterOutputs, SliceOutputsOwned, SliceOwned

        jaxpr, _ = self._sub(eqn.params["jaxpr"])
        plan = self.analyse(jaxpr, ins)
        outs = list(plan.outs)
        for pos, tr in adapter.output_transforms.items():
            if pos >= len(outs):
                raise DispatchError(f"OpAdapter for {adapter.op}: output position {pos} but the op returns {len(outs)}")
            if isinstance(tr, ScatterOutputs):
                outs[pos] = Layout(Kind.NODE, 0)
            elif isinstance(tr, AllReduceSum):
                outs[pos] = REPLICATED
            elif isinstance(tr, SliceOutputsOwned):
                outs[pos] = Layout(Kind.NODE, 0)
        for pos in adapter.arg_transforms:
            if pos >= len(ins):
                raise DispatchError(f"OpAdapter for {adapter.op}: argument position {pos} but the op takes {len(ins)}")
        rt = self.rt
        if isinstance(getattr(rt, "policy", None), GraphParallelPolicy):
            return self._custom_op_graph_parallel(adapter, eqn, ins, tuple(outs))

        def arg(x, tr):
            if isinstance(tr, GatherInputs):
                return rt.gather_inputs(x)
            if isinstance(tr, SliceOwned):
                return x[: rt.n_owned]
            if isinstance(tr, GatherInputsFull):
                return rt.gather_full(x)
            raise DispatchError(f"{type(tr).__name__} is an output transform; OpAdapter for {adapter.op} lists it "
                                "under arg_transforms")

        def out(y, tr):
            if isinstance(tr, ScatterOutputs):
                return rt.halo_correct(y)
            if isinstance(tr, AllReduceSum):
                return jax.lax.psum(y, rt.axis_names)
            if isinstance(tr, SliceOutputsOwned):  # this rank's block of the gathered rows, then the padding row
                start = jax.lax.axis_index(rt.axis_names) * rt.n_owned
                return jnp.concatenate([jax.lax.dynamic_slice_in_dim(y, start, rt.n_owned, axis=0), y[-1:]])
            raise DispatchError(f"{type(tr).__name__} is an input transform; OpAdapter for {adapter.op} lists it "
                                "under output_transforms")

        def apply(eqn, invals):
            invals = [arg(x, adapter.arg_transforms[i]) if i in adapter.arg_transforms else x
                      for i, x in enumerate(invals)]
            if any(getattr(x, "shape", None) != getattr(v.aval, "shape", None) for x, v in zip(invals, eqn.invars)):
                # A transform changed a shape (owned rows only): trace the kernel again on it.
                outvals = jax.tree_util.tree_leaves(adapter.op(*invals))
            else:
                outvals = _bind(eqn, invals)
            return [out(y, adapter.output_transforms[i]) if i in adapter.output_transforms else y
                    for i, y in enumerate(outvals)]

        reduced = any(isinstance(tr, AllReduceSum) for tr in adapter.output_transforms.values())
        return _Decision(tuple(outs), apply, f"custom_op.{adapter.op}", replicates=reduced)

    def _custom_op_graph_parallel(self, adapter, eqn, ins, outs) -> _Decision:
        """A kernel under graph parallelism sees every rank's rows: per-atom arguments
        (untransformed or ``GatherInputs``, whose halo meaning is "the rows the local edges
        read") arrive stacked in rank order and atom indices in that numbering, so senders
        and receivers agree. Per-atom results in that frame come back as this rank's block:
        ``ScatterOutputs`` sums every rank's partials (reduce-scatter), an untransformed one
        is sliced. ``SliceOwned``, ``GatherInputsFull``, ``SliceOutputsOwned`` and
        ``AllReduceSum`` keep their meaning."""
        from .ops import AllReduceSum, GatherInputs, GatherInputsFull, ScatterOutputs, SliceOutputsOwned, SliceOwned

        rt = self.rt
        shapes = [_shape(v) for v in eqn.invars]
        out_rows = [_shape(v)[:1] for v in eqn.outvars]

        def arg(i, x):
            tr = adapter.arg_transforms.get(i)
            lay = ins[i]
            if isinstance(tr, SliceOwned):
                return x[: rt.n_owned]
            if isinstance(tr, GatherInputsFull):
                return rt.gather_full(x)
            if tr is not None and not isinstance(tr, GatherInputs):
                raise DispatchError(f"{type(tr).__name__} is an output transform; OpAdapter for {adapter.op} lists "
                                    "it under arg_transforms")
            if lay.index is Kind.NODE:  # this rank's row numbers → stacked numbering (padding: one past)
                offset = jax.lax.axis_index(rt.axis_names) * rt.n_padded
                x = jnp.where(x < rt.n_padded, x + offset.astype(x.dtype), rt.n_all).astype(x.dtype)
            if lay.kind is Kind.NODE:
                x = rt.all_nodes(x, lay.axis)
            return x

        def out(i, y):
            tr = adapter.output_transforms.get(i)
            if isinstance(tr, AllReduceSum):
                return jax.lax.psum(y, rt.axis_names)
            if isinstance(tr, (GatherInputs, GatherInputsFull, SliceOwned)):
                raise DispatchError(f"{type(tr).__name__} is an input transform; OpAdapter for {adapter.op} lists it "
                                    "under output_transforms")
            stacked = y.ndim > 0 and out_rows[i] and y.shape[0] != out_rows[i][0] and y.shape[0] >= rt.n_all
            if isinstance(tr, ScatterOutputs) and stacked:
                return rt.reduce_scatter(y)
            if isinstance(tr, SliceOutputsOwned) or stacked:  # this rank's block, then any rows after the stack
                start = jax.lax.axis_index(rt.axis_names) * rt.n_padded
                return jnp.concatenate([jax.lax.dynamic_slice_in_dim(y, start, rt.n_padded, axis=0), y[rt.n_all:]])
            return y

        def apply(eqn, invals):
            invals = [arg(i, x) for i, x in enumerate(invals)]
            if any(getattr(x, "shape", None) != shape for x, shape in zip(invals, shapes)):
                outvals = jax.tree_util.tree_leaves(adapter.op(*invals))  # traced again on the stacked rows
            else:
                outvals = _bind(eqn, invals)
            return [out(i, y) for i, y in enumerate(outvals)]

        reduced = any(isinstance(tr, AllReduceSum) for tr in adapter.output_transforms.values())
        return _Decision(outs, apply, f"custom_op.{adapter.op}", replicates=reduced)

    # higher-order ---------------------------------------------------------

    def _custom_derivative(self, eqn, ins) -> _Decision:
        sub = eqn.params.get("call_jaxpr", eqn.params.get("fun_jaxpr"))
        jaxpr, consts = self._sub(sub)
        plan = self.analyse(jaxpr, ins)
        if not plan.active:
            return _Decision(plan.outs, notes=plan.notes)  # the custom rule survives
        note = (f"{eqn.primitive.name} in {_where(eqn)} contains operations that need halo rules: entered, so its "
                "custom derivative rule is replaced by differentiation of its body",)

        def apply(eqn, invals):
            return self.eval(jaxpr, consts, invals, ins)

        return _Decision(plan.outs, apply, "enter." + eqn.primitive.name, plan.notes + note)

    def _remat(self, eqn, ins) -> _Decision:
        jaxpr, consts = self._sub(eqn.params["jaxpr"])
        plan = self.analyse(jaxpr, ins)
        if not plan.active:
            return _Decision(plan.outs, notes=plan.notes)
        prevent_cse = eqn.params.get("prevent_cse", True)
        policy = eqn.params.get("policy")

        def apply(eqn, invals):
            body = jax.checkpoint(lambda *a: self.eval(jaxpr, consts, a, ins), prevent_cse=prevent_cse, policy=policy)
            return list(body(*invals))

        return _Decision(plan.outs, apply, "enter.remat", plan.notes)

    def _scan(self, eqn, ins) -> _Decision:
        p = eqn.params
        jaxpr, consts = self._sub(p["jaxpr"])
        nc, nk = p["num_consts"], p["num_carry"]
        const_l, carry_l, xs_l = ins[:nc], list(ins[nc:nc + nk]), ins[nc + nk:]
        notes = []
        xs_in = []
        over_rows = None  # the kind of rows the scan walks over (lax.map over atoms), if any
        for lay in xs_l:
            if lay.kind is not None and lay.axis == 0:
                if lay.kind in _ROWS:
                    over_rows = lay.kind
                xs_in.append(Layout(None, 0, lay.index))
            else:
                xs_in.append(lay.moved(lay.axis - 1) if lay.kind is not None else lay)
        if over_rows is not None and nk:
            notes.append(f"scan over the per-{over_rows.value} axis with a carry in {_where(eqn)}: what the carry "
                         "accumulates over rows is rank-local")
        for _ in range(8):
            plan = self.analyse(jaxpr, tuple(const_l) + tuple(carry_l) + tuple(xs_in))
            joined = [_join(c, o) for c, o in zip(carry_l, plan.outs[:nk])]
            if joined == carry_l:
                break
            carry_l = joined
        ys = [lay.moved(lay.axis + 1) if lay.kind is not None else
              (Layout(over_rows, 0, lay.index) if over_rows is not None else lay) for lay in plan.outs[nk:]]
        outs = tuple(carry_l) + tuple(ys)
        if not plan.active:
            return _Decision(outs, notes=plan.notes + tuple(notes))
        layouts = tuple(const_l) + tuple(carry_l) + tuple(xs_in)

        def apply(eqn, invals):
            cvals, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]

            def body(carry, x):
                res = self.eval(jaxpr, consts, list(cvals) + list(carry) + list(x), layouts)
                return res[:nk], res[nk:]

            carry, ys = jax.lax.scan(body, list(init), list(xs), length=p["length"],
                                     reverse=p["reverse"], unroll=p.get("unroll", 1))
            return list(carry) + list(ys)

        return _Decision(outs, apply, "enter.scan", plan.notes + tuple(notes))

    def _while(self, eqn, ins) -> _Decision:
        p = eqn.params
        cj, cc = self._sub(p["cond_jaxpr"])
        bj, bc = self._sub(p["body_jaxpr"])
        ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
        cconst_l, bconst_l, carry_l = ins[:ncc], ins[ncc:ncc + nbc], list(ins[ncc + nbc:])
        for _ in range(8):
            bplan = self.analyse(bj, tuple(bconst_l) + tuple(carry_l))
            joined = [_join(c, o) for c, o in zip(carry_l, bplan.outs)]
            if joined == carry_l:
                break
            carry_l = joined
        cplan = self.analyse(cj, tuple(cconst_l) + tuple(carry_l))
        notes = bplan.notes + cplan.notes
        if not (bplan.active or cplan.active):
            return _Decision(tuple(carry_l), notes=notes)
        if cplan.outs[0].kind in _ROWS or cplan.outs[0].local:
            raise DispatchError(
                f"a while loop in {_where(eqn)} stops on a value that differs between ranks while its body needs "
                "halo exchanges: ranks would loop a different number of times. Reduce the condition over atoms first "
                "(e.g. jnp.max over atoms), which the dispatch turns into a collective"
            )
        b_l = tuple(bconst_l) + tuple(carry_l)
        c_l = tuple(cconst_l) + tuple(carry_l)

        def apply(eqn, invals):
            cvals, bvals, init = invals[:ncc], invals[ncc:ncc + nbc], invals[ncc + nbc:]

            cond = lambda carry: self.eval(cj, cc, list(cvals) + list(carry), c_l)[0]  # noqa: E731
            body = lambda carry: self.eval(bj, bc, list(bvals) + list(carry), b_l)  # noqa: E731
            return list(jax.lax.while_loop(cond, body, list(init)))

        return _Decision(tuple(carry_l), apply, "enter.while", notes)

    def _cond(self, eqn, ins) -> _Decision:
        branches = eqn.params["branches"]
        plans = [self.analyse(b.jaxpr, tuple(ins[1:])) for b in branches]
        outs = list(plans[0].outs)
        for plan in plans[1:]:
            outs = [_join(a, b) for a, b in zip(outs, plan.outs)]
        notes = tuple(n for plan in plans for n in plan.notes)
        if not any(plan.active for plan in plans):
            return _Decision(tuple(outs), notes=notes)
        if ins[0].kind in _ROWS or ins[0].local:
            raise DispatchError(
                f"a cond/switch in {_where(eqn)} branches on a value that differs between ranks (e.g. one atom's "
                "value) while a branch needs halo exchanges: ranks would take different branches. Branch on a value "
                "reduced over atoms, or use jnp.where"
            )

        def apply(eqn, invals):
            index, ops = invals[0], invals[1:]
            fns = [(lambda *a, b=b: self.eval(b.jaxpr, b.consts, a, tuple(ins[1:])))
                   for b in branches]
            return list(jax.lax.switch(index, fns, *ops))

        return _Decision(tuple(outs), apply, "enter.cond", notes)


def _join(a: Layout, b: Layout) -> Layout:
    """The layout of a value that may be either ``a`` or ``b`` (loop carries, branches)."""
    if a == b:
        return a
    if a.kind is None and b.kind is not None:
        return b if a.index in (None, b.index) else b.plain()
    if b.kind is None and a.kind is not None:
        return a if b.index in (None, a.index) else a.plain()
    if a.kind == b.kind and a.axis == b.axis:
        return Layout(a.kind, a.axis, a.index if a.index == b.index else None)
    if a.kind is None and b.kind is None:
        return Layout(None, 0, a.index if a.index == b.index else None, a.local or b.local)
    return a.plain()


def _clean(lay: Layout, var) -> Layout:
    shape = _shape(var)
    if lay.kind is not None and lay.axis >= len(shape):
        return Layout(None, 0, lay.index)
    return lay


def _along(mask, ndim: int, axis: int):
    return mask.reshape((1,) * axis + (-1,) + (1,) * (ndim - axis - 1))


def _identity_of(op: str, dtype):
    dtype = jnp.dtype(dtype)
    if op in ("sum", "add", "or", "xor"):
        return jnp.zeros((), dtype)
    if op in ("prod", "mul"):
        return jnp.ones((), dtype)
    if op == "and":
        return jnp.ones((), dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(-jnp.inf if op == "max" else jnp.inf, dtype)
    if dtype == jnp.bool_:
        return jnp.array(op == "min", dtype)
    info = jnp.iinfo(dtype)
    return jnp.array(info.min if op == "max" else info.max, dtype)


def _where(eqn) -> str:
    """A short ``file:line`` of the user code that produced ``eqn``."""
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is not None:
            return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line} ({eqn.primitive.name})"
    except Exception:  # source information is a courtesy; never fail on it
        pass
    return eqn.primitive.name


_INDEX_KEEPING = {"convert_element_type", "copy", "copy_p", "clamp", "max", "min", "reduce_precision",
                  "optimization_barrier"}

_RULES: dict[str, Callable] = {
    "dot_general": Dispatcher._dot_general,
    "broadcast_in_dim": Dispatcher._broadcast_in_dim,
    "reshape": Dispatcher._reshape,
    "squeeze": Dispatcher._squeeze,
    "transpose": Dispatcher._transpose,
    "slice": Dispatcher._slice,
    "dynamic_slice": Dispatcher._dynamic_slice,
    "dynamic_update_slice": Dispatcher._dynamic_update_slice,
    "concatenate": Dispatcher._concatenate,
    "pad": Dispatcher._pad,
    "select_n": Dispatcher._select_n,
    "iota": Dispatcher._iota,
    "sort": Dispatcher._sort,
    "lt": Dispatcher._index_bound,
    "le": Dispatcher._index_bound,
    "gt": Dispatcher._index_bound,
    "ge": Dispatcher._index_bound,
    "eq": Dispatcher._index_bound,
    "ne": Dispatcher._index_bound,
    "min": Dispatcher._index_bound,
    "clamp": Dispatcher._index_bound,
    "argmax": Dispatcher._arg,
    "argmin": Dispatcher._arg,
    "gather": Dispatcher._gather,
    "pvary": Dispatcher._pvary,
    "pcast": Dispatcher._pvary,
    "pjit": Dispatcher._call,
    "jit": Dispatcher._call,
    "closed_call": Dispatcher._call,
    "core_call": Dispatcher._call,
    "custom_jvp_call": Dispatcher._custom_derivative,
    "custom_vjp_call": Dispatcher._custom_derivative,
    "custom_vjp_call_jaxpr": Dispatcher._custom_derivative,
    "remat": Dispatcher._remat,
    "remat2": Dispatcher._remat,
    "checkpoint": Dispatcher._remat,
    "scan": Dispatcher._scan,
    "while": Dispatcher._while,
    "cond": Dispatcher._cond,
}


# --------------------------------------------------------------------------- input tags


def batch_layouts(batch, graph_parallel: bool = False) -> object:
    """A pytree like ``batch`` (a :class:`~jaxdd.Batch` with its neighbour list) holding the
    :class:`Layout` of every array leaf. graph_parallel: the list's senders index every
    rank's rows (:data:`Kind.ALL_NODES`)."""
    node = Layout(Kind.NODE, 0)
    graph = Layout(Kind.GRAPH, 0)
    tags = dict(
        positions=node, atomic_numbers=node, atom_mask=node, charges=node, masses=node, velocities=node,
        batch_idx=Layout(Kind.NODE, 0, Kind.GRAPH), cell=graph, pbc=graph, system_mask=graph, ptr=REPLICATED,
    )
    fields = {name: (tags[name] if getattr(batch, name) is not None else None) for name in tags}
    nl = batch.neighbors
    if nl is not None:
        nl = _neighbor_layouts(nl, Kind.ALL_NODES if graph_parallel else Kind.NODE)
    return batch.__class__.unchecked(**fields, neighbors=nl)


def _neighbor_layouts(nl, senders: Kind = Kind.NODE):
    from .neighbors import NeighborList

    if not isinstance(nl, NeighborList):
        return jax.tree_util.tree_map(lambda _: REPLICATED, nl)
    edge = Layout(Kind.EDGE, 0)
    node = Layout(Kind.NODE, 0)
    tags = dict(
        senders=Layout(Kind.EDGE, 0, senders), receivers=Layout(Kind.EDGE, 0, Kind.NODE), shifts=edge, mask=edge,
        matrix=Layout(Kind.NODE, 0, senders), matrix_shifts=node, num_neighbors=node,
    )
    return jax.tree_util.tree_map_with_path(
        lambda path, _: tags.get(getattr(path[-1], "name", None), REPLICATED), nl)


def call_model(model, batch, runtime: Runtime | None, report: DispatchReport):
    """``model(batch)`` traced on this rank's values and evaluated through the dispatch.

    model: a wrapper (its array leaves are parameters, replicated); batch: the rank's local
    :class:`~jaxdd.Batch` with its neighbour list. Call inside ``shard_map`` (and inside the
    DD scope, so the model can read :func:`~jaxdd.current_dd_context`). Returns the outputs
    and a matching pytree of their :class:`Layout`.
    """
    import equinox as eqx

    params, rest = eqx.partition(model, eqx.is_array)
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    b_leaves, b_def = jax.tree_util.tree_flatten(batch)
    graph_parallel = runtime is not None and isinstance(runtime.policy, GraphParallelPolicy)
    b_layouts = jax.tree_util.tree_leaves(batch_layouts(batch, graph_parallel), is_leaf=lambda x: isinstance(x, Layout))
    if len(b_layouts) != len(b_leaves):
        raise RuntimeError("internal: the batch's layouts do not match its leaves")
    n_p = len(p_leaves)

    def flat(*leaves):
        m = eqx.combine(jax.tree_util.tree_unflatten(p_def, leaves[:n_p]), rest)
        return m(jax.tree_util.tree_unflatten(b_def, leaves[n_p:]))

    leaves = p_leaves + b_leaves
    # Traced on this rank's own values, so the jaxpr carries their types (which vary
    # between ranks); only the rules change what the program does.
    closed, out_shape = jax.make_jaxpr(flat, return_shape=True)(*leaves)
    nl = batch.neighbors
    sizes = (int(batch.positions.shape[0]), int(nl.senders.shape[0]) if nl is not None else 0, int(batch.cell.shape[0]))
    dispatcher = Dispatcher(runtime, report, sizes)
    in_layouts = [REPLICATED] * n_p + b_layouts
    outs = dispatcher.run_closed(closed, leaves, in_layouts)
    tree = jax.tree_util.tree_structure(out_shape)
    return (jax.tree_util.tree_unflatten(tree, outs),
            jax.tree_util.tree_unflatten(tree, list(dispatcher.out_layouts(closed, in_layouts))))


def warn_fallbacks(report: DispatchReport, model_name: str) -> None:
    """One warning listing the fallbacks of a traced program (if any)."""
    if report.fallbacks:
        listing = "\n  ".join(report.fallbacks)
        warnings.warn(f"{model_name} under decomposition: the dispatch had to guess or leave operations rank-local:\n  "
                      f"{listing}\nCheck the result with jaxdd.validate, or say it explicitly with the intent verbs "
                      "(jaxdd.system_sum, jaxdd.to_local ...) or a helper adapter on the spec.", DispatchWarning,
                      stacklevel=4)  # the caller of DistributedModel

