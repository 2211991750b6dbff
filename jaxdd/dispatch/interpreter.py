"""The interpreter: a jaxpr analysed for layouts, then evaluated equation by equation.

:func:`call_model` traces a model on one rank's padded block and evaluates the jaxpr again
through a :class:`Dispatcher`. The dispatcher first *analyses* a jaxpr for the layouts of
its inputs, asking the registered rule of every equation for a :class:`Decision`
(:mod:`jaxdd.dispatch.registry`), then *evaluates* it, binding each equation as traced or
running its decision's action. Plans are cached per (jaxpr, input layouts), so a loop
body or a function called twice is analysed once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..ops import GraphParallelPolicy
from .decision import Decision, Plan
from .equations import bind, enclosing, is_literal, shape_of, where
from .layouts import OFFSETS, REPLICATED, ROWS, Kind, Layout, bare, clean
from .provenance import mixed_error, propagate
from .registry import rule_for
from .report import DispatchError, DispatchReport
from .rules.elementwise import elementwise
from .runtime import Runtime
from .system_index import SYSTEM_FIELDS, is_system_index, probes

__all__ = ["Dispatcher", "batch_layouts", "call_model"]


class Dispatcher:
    """Re-interprets jaxprs under one rank's :class:`Runtime` and records a :class:`DispatchReport`.

    Args:
        runtime: the rank's :class:`Runtime` inside ``shard_map``; None to analyse layouts only.
        report: where applied rules and fallbacks are recorded.
        sizes: ``(n_padded, n_edges, n_systems)`` of the traced shapes (rows, edge slots,
            systems), for the shape fallback.

    A rule (``rule(ctx, eqn, in_layouts) -> Decision``) receives the dispatcher as ``ctx``
    and may use: :attr:`runtime` (inside a decision's ``apply``, where it is never None),
    :attr:`n_padded`, :attr:`n_edges`, :attr:`n_systems`, :meth:`fallback_kind`,
    :meth:`default` (the rule of a primitive nobody registered), :meth:`constant` (the value
    of an input computed from constants alone), :meth:`producer`, and for primitives with bodies
    :meth:`analyse` and :meth:`eval`.
    """

    def __init__(self, runtime: Runtime | None, report: DispatchReport, sizes: tuple[int, int, int],
                 system_inputs: dict[int, str] | None = None):
        self.runtime = runtime
        self.report = report
        self.n_padded, self.n_edges, self.n_systems = sizes
        # Which inputs of the top-level jaxpr are the batch's description (ptr, batch_idx, ...),
        # by position: graph indices built from them are recognised (jaxdd.dispatch.system_index).
        self.system_inputs = dict(system_inputs or {})
        self._plans: dict = {}
        self._folds: list[_Constants] = []  # one per jaxpr being analysed, innermost last
        self._top = None  # the top-level jaxpr (the one whose inputs are the batch's fields)

    # ---------------------------------------------------------------- entry points

    def run_closed(self, closed, args: Sequence, layouts: Sequence[Layout]) -> list:
        """Evaluate a ClosedJaxpr ``closed`` on ``args`` tagged with ``layouts``; its outputs."""
        self._top = closed.jaxpr
        return self.eval(closed.jaxpr, closed.consts, args, tuple(layouts))

    def out_layouts(self, closed, layouts: Sequence[Layout]) -> tuple[Layout, ...]:
        """Layouts of the outputs of a ClosedJaxpr ``closed`` for inputs tagged with ``layouts``."""
        self._top = closed.jaxpr
        return self.analyse(closed.jaxpr, tuple(layouts), closed.consts).outs

    # ---------------------------------------------------------------- analysis

    def analyse(self, jaxpr, in_layouts: tuple[Layout, ...], consts: Sequence | None = None,
                known: dict[int, object] | None = None) -> Plan:
        """The :class:`Plan` of an open ``jaxpr`` for inputs tagged ``in_layouts`` (cached).
        ``consts``: the values of its constvars, when known (for :meth:`constant`); ``known``:
        input position → the integer scalar every call passes there (a literal of the caller)."""
        known = {i: np.asarray(x) for i, x in (known or {}).items() if np.ndim(x) == 0}
        key = (id(jaxpr), in_layouts, tuple(sorted((i, x.dtype.str, x.item()) for i, x in known.items())))
        hit = self._plans.get(key)
        if hit is not None:
            return hit[1]
        inputs = {}
        if jaxpr is self._top:
            inputs = {jaxpr.invars[i]: name for i, name in self.system_inputs.items() if i < len(jaxpr.invars)}
        fold = _Constants(jaxpr, consts, inputs)
        fold.values.update({jaxpr.invars[i]: x for i, x in known.items() if i < len(jaxpr.invars)})
        self._folds.append(fold)
        try:
            return self._analyse(jaxpr, in_layouts, key)
        finally:
            self._folds.pop()

    def constant(self, var) -> np.ndarray | None:
        """The value of ``var`` (of the jaxpr being analysed) when it is computed from literals
        and constants alone — the same on every rank and known before anything runs, like
        the graph index ``jnp.repeat`` builds from fixed node counts — else None."""
        return self._folds[-1].value(var) if self._folds else None

    def producer(self, var):
        """The equation of the jaxpr being analysed that computes ``var`` (None for its inputs,
        constants and literals)."""
        if is_literal(var) or not self._folds:
            return None
        return self._folds[-1].producer.get(var)

    def _analyse(self, jaxpr, in_layouts, key) -> Plan:
        env: dict = {}

        def read(v):
            return REPLICATED if is_literal(v) else env.get(v, REPLICATED)

        for v, lay in zip(jaxpr.invars, in_layouts):
            env[v] = lay
        decisions = []
        for eqn in jaxpr.eqns:
            ins = tuple(read(v) for v in eqn.invars)
            d = self._local_systems(eqn, self.decide(eqn, ins))
            decisions.append(d)
            # Whatever comes from rank-dependent data without keeping a distributed axis (one
            # atom's value, a partial left local) differs between ranks, unless a collective
            # made it the same everywhere.
            rank_ins = [i for i in ins if i.local or i.kind in ROWS]
            tainted = not d.replicates and bool(rank_ins)
            # Computed from values the model declared rank-local alone: declared so too.
            deliberate = tainted and all(i.deliberate for i in rank_ins)
            outs = []
            for v, lay in zip(eqn.outvars, d.outs):
                lay = clean(lay, shape_of(v))
                if tainted and lay.kind is None and (not lay.local or deliberate):
                    lay = dataclasses.replace(lay, local=True, deliberate=deliberate)
                outs.append(lay)
            for v, lay in zip(eqn.outvars, propagate(self, eqn, ins, d, outs)):
                env[v] = lay
        decisions = _confirmed(jaxpr, decisions)
        notes = [m for d in decisions for m in d.notes]
        plan = Plan(tuple(decisions), tuple(read(v) for v in jaxpr.outvars),
                    any(d.apply is not None and not d.passive for d in decisions), tuple(dict.fromkeys(notes)))
        self._plans[key] = (jaxpr, plan)  # holding the jaxpr keeps its id unique
        return plan

    def _local_systems(self, eqn, d: Decision) -> Decision:
        """``d``, or — when an output is a graph index the model built from the batch's
        description (:mod:`jaxdd.dispatch.system_index`) — ``d`` with that output replaced by
        this rank's ``batch_idx`` and tagged like it (per node, values index systems)."""
        fold = self._folds[-1] if self._folds else None
        if fold is None or not fold.inputs or not self.n_padded:
            return d
        n = self.n_padded
        # Replicated (computed from the global description), or per node without an index
        # meaning (computed from such a value already replaced: arange(n_graph)[graph]).
        found = [i for i, (v, lay) in enumerate(zip(eqn.outvars, d.outs))
                 if bare(lay) in (REPLICATED, Layout(Kind.NODE, 0)) and len(shape_of(v)) == 1 and shape_of(v)[0] >= n
                 and np.issubdtype(v.aval.dtype, np.integer)
                 and is_system_index(lambda case, v=v: fold.probe(v, case), probes(n, self.n_systems))]
        if not found:
            return d
        outs = tuple(Layout(Kind.NODE, 0, Kind.GRAPH) if i in found else lay for i, lay in enumerate(d.outs))

        def local_systems(eqn, invals):
            vals = list(bind(eqn, invals) if d.apply is None else d.apply(eqn, invals))
            mine = self.runtime.batch_idx
            if mine is None:
                raise DispatchError("internal: a graph index needs the rank's batch_idx, which the runtime lacks")
            for i in found:
                x = vals[i]
                head = mine.astype(x.dtype)
                vals[i] = head if x.shape[0] == n else jnp.concatenate([head, x[n:]])
            return vals

        # What the rule said about losing this value's layout no longer matters: it is recognised.
        notes = () if len(eqn.outvars) == 1 else d.notes
        # Recognised, the value no longer stands for the counts it was built from.
        outs = tuple(o if i in found else dataclasses.replace(o, mixed=None) for i, o in enumerate(outs))
        return dataclasses.replace(d, outs=outs, apply=local_systems, rule="graph_index.local", passive=False,
                                   notes=notes, resolves=True)

    def decide(self, eqn, ins: tuple[Layout, ...]) -> Decision:
        """The registered rule's :class:`Decision` for ``eqn`` with input layouts ``ins`` (the default
        rule if none is registered)."""
        rule = rule_for(eqn.primitive.name)
        if rule is not None:
            with enclosing(eqn):
                return rule(self, eqn, ins)
        d = self.default(eqn, ins)
        rows = [(lay.kind, shape_of(v)[lay.axis]) for lay, v in zip(ins, eqn.invars) if lay.kind in ROWS]
        lengths = {n for v in eqn.outvars for n in shape_of(v)}
        dropped = [kind for kind, n in rows if n not in lengths]
        if dropped and all(out.kind is None for out in d.outs):
            # An unknown primitive that consumes rank rows and returns no axis as long (a
            # reduction of its own, say) has no distributed meaning the dispatch could infer.
            d = dataclasses.replace(d, notes=d.notes + (
                f"{eqn.primitive.name} in {where(eqn)} has no dispatch rule and drops the per-{dropped[0].value} "
                "axis of its input: left rank-local (give it a distributed meaning with jaxdd.register_rule)",))
        return d

    def default(self, eqn, ins: tuple[Layout, ...]) -> Decision:
        """The rule of elementwise and unregistered primitives, for ``eqn`` with input layouts ``ins``:
        a tag survives where an output keeps the tagged axis."""
        return elementwise(self, eqn, ins)

    def fallback_kind(self, length: int) -> Kind | None:
        """A kind guessed from an axis length alone (None when ambiguous or unknown)."""
        hits = [k for k, n in ((Kind.NODE, self.n_padded), (Kind.EDGE, self.n_edges)) if n and length == n]
        return hits[0] if len(hits) == 1 else None

    # ---------------------------------------------------------------- evaluation

    def eval(self, jaxpr, consts, args, in_layouts: tuple[Layout, ...], known: dict | None = None) -> list:
        """Evaluate an open ``jaxpr`` on ``consts`` and ``args`` tagged ``in_layouts`` (``known``:
        as for :meth:`analyse`, the plan's key); its outputs."""
        plan = self.analyse(jaxpr, in_layouts, consts, known)
        env: dict = {}

        def read(v):
            return v.val if is_literal(v) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn, d in zip(jaxpr.eqns, plan.decisions):
            invals = [read(v) for v in eqn.invars]
            for message in d.notes:
                self.report.note(message)
            if d.apply is None:
                outvals = bind(eqn, invals)
            else:
                outvals = d.apply(eqn, invals)
                if d.rule:
                    self.report.count(d.rule)
            for v, x in zip(eqn.outvars, outvals):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]


def _confirmed(jaxpr, decisions: list[Decision]) -> list[Decision]:
    """``decisions`` with the notes of layouts guessed from shape dropped where every consumer
    confirms the guess (``Decision.confirms``): an ``iota`` as long as the edges that only
    a sort along the edges carries (``argsort``) is a permutation of them, not a guess.
    Equations on the guessed value and literals alone (``jnp``'s wrap of negative indices,
    a reshape into scatter indices) are followed to their consumers."""
    guessed = {v: i for i, d in enumerate(decisions) if d.guess for v in jaxpr.eqns[i].outvars}
    if not guessed:
        return decisions
    outputs = {v for v in jaxpr.outvars if not is_literal(v)}

    def confirmed(root) -> bool:
        derived, through = {root}, set()
        for j, eqn in enumerate(jaxpr.eqns):  # in order: the values made from root and literals
            ins = [u for u in eqn.invars if not is_literal(u)]
            if ins and all(u in derived for u in ins) and not decisions[j].confirms:
                derived.update(eqn.outvars)
                through.add(j)
        for j, eqn in enumerate(jaxpr.eqns):
            for pos, u in enumerate(eqn.invars):
                if not is_literal(u) and u in derived and j not in through and pos not in decisions[j].confirms:
                    return False
        used = any(not is_literal(u) and u in derived for eqn in jaxpr.eqns for u in eqn.invars)
        return used and not derived & outputs

    decisions = list(decisions)
    for v, i in guessed.items():
        if confirmed(v):
            decisions[i] = dataclasses.replace(decisions[i], notes=())
    return decisions


class _Constants:
    """Values of one jaxpr's variables that follow from its literals and constants alone,
    folded on demand (never for inputs, never for values larger than ``limit`` elements)."""

    limit = 1 << 16

    def __init__(self, jaxpr, consts, inputs: dict | None = None):
        self.producer = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
        self.values: dict = {} if consts is None else dict(zip(jaxpr.constvars, consts))
        self.unknown: set = set()
        self.inputs = dict(inputs or {})  # input var -> batch field, for probe()

    def probe(self, var, case: dict) -> np.ndarray | None:
        """The value of ``var`` with the batch fields among the inputs set to ``case``."""
        fork = _Constants.__new__(_Constants)
        fork.producer, fork.unknown, fork.inputs = self.producer, set(), {}
        fork.values = dict(self.values)
        fork.values.update({v: case[name] for v, name in self.inputs.items() if name in case})
        return fork.value(var)

    def value(self, var) -> np.ndarray | None:
        if is_literal(var):
            return np.asarray(var.val)
        if var in self.values:
            return np.asarray(self.values[var])
        eqn = self.producer.get(var)
        if var in self.unknown or eqn is None or any(np.prod(shape_of(v)) > self.limit for v in eqn.outvars):
            return None
        ins = [self.value(v) for v in eqn.invars]
        if any(x is None for x in ins):
            self.unknown.update(eqn.outvars)
            return None
        try:
            with jax.ensure_compile_time_eval():  # evaluated now, even inside the rank program's trace
                outs = bind(eqn, ins)
        except Exception:  # a primitive that cannot run eagerly: simply not known
            self.unknown.update(eqn.outvars)
            return None
        for v, x in zip(eqn.outvars, outs):
            self.values[v] = x
        return np.asarray(self.values[var])


def batch_layouts(batch, graph_parallel: bool = False, receivers_owned: bool = False) -> object:
    """A pytree like ``batch`` (a :class:`~jaxdd.Batch` with its neighbour list) holding the
    :class:`Layout` of every array leaf. graph_parallel: the list's senders index every
    rank's rows (:data:`Kind.ALL_NODES`). receivers_owned: its receivers are owned rows
    (:data:`Kind.OWNED_NODE`)."""
    node = Layout(Kind.NODE, 0)
    graph = Layout(Kind.GRAPH, 0)
    tags = dict(
        positions=node, atomic_numbers=node, atom_mask=Layout(Kind.NODE, 0, real=True), charges=node, masses=node,
        velocities=node, batch_idx=Layout(Kind.NODE, 0, Kind.GRAPH), cell=graph, pbc=graph, system_mask=graph,
        ptr=Layout(total=OFFSETS),
    )
    fields = {name: (tags[name] if getattr(batch, name) is not None else None) for name in tags}
    nl = batch.neighbors
    if nl is not None:
        nl = _neighbor_layouts(nl, Kind.ALL_NODES if graph_parallel else Kind.NODE,
                               Kind.OWNED_NODE if receivers_owned and not graph_parallel else Kind.NODE)
    return batch.__class__.unchecked(**fields, neighbors=nl)


def _neighbor_layouts(nl, senders: Kind = Kind.NODE, receivers: Kind = Kind.NODE):
    """The layouts of a neighbour list's leaves: COO edges per edge; the MATRIX rows, the
    neighbour counts and the bonds per node — ``stale`` when only owned rows are receivers
    (their ghost rows are empty, unlike their owners')."""
    from ..neighbors import NeighborList

    if not isinstance(nl, NeighborList):
        return jax.tree_util.tree_map(lambda _: REPLICATED, nl)
    edge = Layout(Kind.EDGE, 0)
    stale = receivers is Kind.OWNED_NODE
    node = Layout(Kind.NODE, 0, stale=stale)
    tags = dict(
        senders=Layout(Kind.EDGE, 0, senders), receivers=Layout(Kind.EDGE, 0, receivers), shifts=edge, mask=edge,
        displacement=edge,
        matrix=Layout(Kind.NODE, 0, senders, stale=stale), matrix_shifts=node, num_neighbors=node,
    )

    def tag(path, _):
        names = [getattr(k, "name", None) for k in path]
        if "bonds" in names:  # slot, mask, count, reverse: rows of atoms, values index their bond slots
            return node
        return tags.get(names[-1], REPLICATED)

    return jax.tree_util.tree_map_with_path(tag, nl)


def call_model(model, batch, runtime: Runtime | None, report: DispatchReport):
    """``model(batch)`` traced on this rank's values and evaluated through the dispatch.

    Call inside ``shard_map`` (and inside the DD scope, so the model can read
    :func:`~jaxdd.current_dd_context`).

    Args:
      model: a wrapper (its array leaves are parameters, replicated).
      batch: the rank's local :class:`~jaxdd.Batch` with its neighbour list.
      runtime: the rank's :class:`Runtime`; None to analyse layouts only.
      report: the :class:`DispatchReport` where rules and fallbacks are recorded.

    Returns:
      The outputs and a matching pytree of their :class:`Layout`.
    """
    import equinox as eqx

    params, rest = eqx.partition(model, eqx.is_array)
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    b_leaves, b_def = jax.tree_util.tree_flatten(batch)
    graph_parallel = runtime is not None and isinstance(runtime.policy, GraphParallelPolicy)
    owned = runtime is not None and runtime.receivers_owned
    b_layouts = jax.tree_util.tree_leaves(batch_layouts(batch, graph_parallel, owned),
                                          is_leaf=lambda x: isinstance(x, Layout))
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
    paths = [getattr(path[0], "name", None) for path, _ in jax.tree_util.tree_flatten_with_path(batch)[0]]
    fields = {n_p + i: name for i, name in enumerate(paths) if name in SYSTEM_FIELDS}
    dispatcher = Dispatcher(runtime, report, sizes, fields)
    in_layouts = [REPLICATED] * n_p + b_layouts
    out_layouts = dispatcher.out_layouts(closed, in_layouts)
    for i, ((path, _), lay) in enumerate(zip(jax.tree_util.tree_flatten_with_path(out_shape)[0], out_layouts)):
        if lay.mixed:
            keys = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
            name = ".".join(k for k in keys if k and not k.isdigit()) or f"number {i}"
            raise mixed_error(lay, f"its output {name!r}", type(model).__name__)
    outs = dispatcher.run_closed(closed, leaves, in_layouts)
    tree = jax.tree_util.tree_structure(out_shape)
    return jax.tree_util.tree_unflatten(tree, outs), jax.tree_util.tree_unflatten(tree, list(out_layouts))
