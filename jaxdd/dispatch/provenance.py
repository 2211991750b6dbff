"""Index spaces: what a value counts or numbers, and the meetings that cannot be distributed.

Under decomposition every rank numbers only its own rows (``[owned | ghosts | pad]`` atoms,
its own edges), while a value reduced across ranks is a total over every rank's rows. On one
device the two agree; spread over ranks they do not, so a *total* meeting a rank's *row
numbers* means something else: ``sender < count_nonzero(node_mask)`` compares a local row
number with every rank's atoms (e3j's ``GraphCSR.mask_edges``), ``dynamic_slice(x, (n,))``
starts at a global count inside local rows. The spaces a value can belong to (the fields of
:class:`~jaxdd.dispatch.Layout`):

==================  =========================================  ==========================
space               examples                                   field
==================  =========================================  ==========================
atom rows (local)   positions, ``h[receivers]`` sums, iota     ``kind=NODE``
edge rows (local)   edge vectors, messages                     ``kind=EDGE``
row numbers         senders, receivers, ``argsort`` of edges   ``index`` NODE / EDGE
systems             per-system energies, ``batch_idx`` values  ``kind`` / ``index`` GRAPH
totals (global)     ``count_nonzero(atom_mask)``, ``sum(x)``   ``total``
rank-local scalars  one atom's value, a partial left local     ``local``
==================  =========================================  ==========================

:func:`propagate` carries ``total``, ``mixed``, ``real`` and ``permuted`` through every
equation whose rule did not set them itself, and :func:`meeting` says where a total meets
row numbers: an elementwise op (comparison, arithmetic, ``min``/``max``/``clamp``, a
``where``) with a row index among its other inputs, or an indexing op (gather, scatter,
``dynamic_slice``, ``dynamic_update_slice``) indexing rows by it. The value produced is
*mixed*; a rule may recognise what it stands for (the graph index jraph builds from counts,
the test ``idx < count_nonzero(atom_mask)``, which means "a real atom"), else a mixed value
that reaches an output refuses the model, naming the line (:func:`mixed_error`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .equations import is_literal, shape_of, where
from .layouts import ATOM_COUNT, ROWS, TOTAL, Kind, Layout
from .report import DispatchError

__all__ = ["ROW_NUMBERS", "meeting", "propagate", "mixed_error", "LOCAL_FORM"]

#: Index kinds whose values are a rank's own row numbers.
ROW_NUMBERS = (Kind.NODE, Kind.OWNED_NODE, Kind.EDGE, Kind.ALL_NODES)

# Primitives whose output holds their input's values: the atom mask stays the atom mask.
_VALUE_KEEPING = {"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier",
                  "stop_gradient"}

#: What to write instead of a total meeting row numbers, for the refusal.
LOCAL_FORM = (
    "Write it in the local form, which means the same on one device and on every rank: test a row with the mask, "
    "not with a count (`node_mask[idx]`, or `jnp.where(node_mask[senders] & node_mask[receivers], ...)` for edges, "
    "instead of `idx < jnp.count_nonzero(node_mask)`); sum per system with the mask "
    "(`jnp.sum(jnp.where(atom_mask, atomic_energies, 0.0))`, or `jax.ops.segment_sum(atomic, batch_idx, n_systems)`) "
    "instead of a padding graph whose node counts come from the mask; offset by `batch_idx`, not by counts or `ptr`. "
    "A count compared directly with atom row numbers (`idx < jnp.count_nonzero(atom_mask)`) is understood as "
    "\"a real atom\" and needs nothing"
)


def _index_positions(eqn) -> tuple[int, ...]:
    name = eqn.primitive.name
    if name == "gather" or name.startswith("scatter"):
        return (1,)
    if name == "dynamic_slice":
        return tuple(range(1, len(eqn.invars)))
    if name == "dynamic_update_slice":
        return tuple(range(2, len(eqn.invars)))
    return ()


def _rows_axis(ctx, lay: Layout, var, axis: int | None = None) -> bool:
    """Whether the operand ``var`` has rows of this rank (along ``axis``, or any axis): tagged,
    or an axis as long as them."""
    shape = shape_of(var)
    if axis is None:
        return lay.kind in ROWS or any(ctx.fallback_kind(n) in ROWS for n in shape)
    return lay.kind in ROWS and lay.axis == axis or ctx.fallback_kind(shape[axis]) in ROWS


def _slices_rows_at(ctx, eqn, ins, positions) -> bool:
    """Whether a total is an index of ``eqn`` into rows: a gather's or scatter's indices into an
    operand with rows, or a dynamic slice's start along a row axis it does not take whole
    (a whole axis clamps every start to 0)."""
    name = eqn.primitive.name
    if not name.startswith("dynamic"):
        return any(ins[i].total for i in positions if i < len(ins)) and _rows_axis(ctx, ins[0], eqn.invars[0])
    shape = shape_of(eqn.invars[0])
    first = positions[0]
    sizes = eqn.params["slice_sizes"] if name == "dynamic_slice" else shape_of(eqn.invars[1])
    for i in positions:
        axis = i - first
        if ins[i].total and sizes[axis] < shape[axis] and _rows_axis(ctx, ins[0], eqn.invars[0], axis):
            return True
    return False


def meeting(ctx, eqn, ins: tuple[Layout, ...]) -> str | None:
    """Where a total meets a rank's row numbers in ``eqn`` (a message), or None.

    Args:
      ctx: the :class:`~jaxdd.dispatch.interpreter.Dispatcher`.
      eqn: the jaxpr equation.
      ins: the :class:`Layout` of each input.
    """
    totals = [i for i, lay in enumerate(ins) if lay.total]
    if not totals:
        return None
    what = {ATOM_COUNT: "the count of real atoms of every rank"}.get(ins[totals[0]].total, None)
    what = what or ("the batch's system offsets (ptr)" if ins[totals[0]].total == "offsets"
                    else "a count or sum over every rank's rows")
    positions = _index_positions(eqn)
    if positions:
        if _slices_rows_at(ctx, eqn, ins, positions):
            return (f"{where(eqn)}: {what} is used as a position inside this rank's rows, which each rank numbers "
                    "on its own")
        return None
    if len(eqn.outvars) != 1 or _has_body(eqn):
        return None  # calls, loops, branches: their bodies are checked equation by equation
    if eqn.primitive.name == "div" and ins[0].total and _row_count_divisor(ctx, eqn):
        return (f"{where(eqn)}: a sum over every rank's rows is divided by the number of rows of this rank's "
                "arrays, padding included (`jnp.mean` over atoms or edges), which each rank has its own of; "
                "divide by a count instead (`jnp.sum(jnp.where(mask, x, 0)) / jnp.count_nonzero(mask)`)")
    rows = [lay for i, lay in enumerate(ins) if i not in totals and lay.index in ROW_NUMBERS]
    if rows:
        return (f"{where(eqn)}: {what} meets this rank's own {_numbers(rows[0].index)}, which each rank numbers "
                "on its own")
    return None


# Between a sum and its normaliser, ``jnp.mean`` / ``jnp.var`` only reshape and cast.
_SHAPE_ONLY = {"broadcast_in_dim", "reshape", "squeeze", "convert_element_type", "expand_dims"}


def _row_count_divisor(ctx, eqn) -> bool:
    """Whether ``eqn`` (a ``div``) divides a sum over row axes by their static length, the
    normaliser ``jnp.mean`` writes as a literal (the rank's array shape, not a count)."""
    num, den = eqn.invars
    if not is_literal(den) or np.ndim(den.val) != 0:
        return False
    src = ctx.producer(num)
    while src is not None and src.primitive.name in _SHAPE_ONLY:
        src = ctx.producer(src.invars[0])
    if src is None or src.primitive.name != "reduce_sum":
        return False
    lengths = [shape_of(src.invars[0])[a] for a in src.params["axes"]]
    rows = [n for n in lengths if n in (ctx.n_padded, ctx.n_edges) and n]
    return bool(rows) and float(den.val) == float(np.prod(lengths))


def _has_body(eqn) -> bool:
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "eqns") or hasattr(v, "jaxpr") and hasattr(v, "consts"):
                return True
    return False


def _numbers(index: Kind) -> str:
    return "edge numbers" if index is Kind.EDGE else "atom row numbers"


def _is_zero_literal(v) -> bool:
    return is_literal(v) and np.ndim(v.val) == 0 and not bool(v.val)


def _real(eqn, ins) -> bool:
    """Whether ``eqn``'s output is still the atom mask (a cast, ``mask != 0``, ``mask > 0``)."""
    name = eqn.primitive.name
    if name in _VALUE_KEEPING:
        return bool(ins) and ins[0].real
    if name in ("ne", "gt") and len(ins) == 2:
        return ins[0].real and _is_zero_literal(eqn.invars[1]) or name == "ne" and ins[1].real and _is_zero_literal(
            eqn.invars[0])
    if name == "and" and len(ins) == 2:
        return ins[0].real and ins[1].real
    return False


def propagate(ctx, eqn, ins: tuple[Layout, ...], d, outs: list[Layout]) -> list[Layout]:
    """The index-space fields of ``eqn``'s outputs ``outs`` (laid out by its rule's decision ``d``).

    A rule that ``resolves`` sets them itself. Otherwise: a meeting (:func:`meeting`), or a
    mixed input, makes every output mixed; a collective over rows, or arithmetic on totals
    alone, gives a total; the atom mask stays the mask through casts and ``!= 0``; rows of a
    kind some input had permuted stay permuted.

    Args:
      ctx: the :class:`~jaxdd.dispatch.interpreter.Dispatcher`.
      eqn: the jaxpr equation.
      ins: the :class:`Layout` of each input.
      d: the rule's :class:`~jaxdd.dispatch.decision.Decision`.
      outs: the output layouts the decision gives.

    Per-node outputs of an equation with a ``stale`` per-node input are stale too, unless its
    action refreshes them (``d.refreshes``).

    Returns:
      ``outs`` with their index-space fields set.
    """
    outs = _staleness(ins, d, outs)
    if d.resolves:
        return outs
    met = meeting(ctx, eqn, ins)
    mixed = met or next((lay.mixed for lay in ins if lay.mixed), None)
    totals = {lay.total for lay in ins if lay.total}
    from_rows = d.replicates and any(lay.kind in ROWS for lay in ins)
    permuted = {lay.kind for lay in ins if lay.permuted}
    real = _real(eqn, ins)
    new = []
    for lay in outs:
        change = {}
        if mixed and not lay.mixed:
            change["mixed"] = mixed
        elif lay.total is None and lay.kind in (None, Kind.GRAPH):
            if from_rows:
                change["total"] = TOTAL
            elif totals:
                keep = eqn.primitive.name in _VALUE_KEEPING and len(totals) == 1
                change["total"] = next(iter(totals)) if keep else TOTAL
        if lay.kind in ROWS and lay.kind in permuted and not lay.permuted:
            change["permuted"] = True
        if real and lay.kind is Kind.NODE and not lay.real:
            change["real"] = True
        new.append(dataclasses.replace(lay, **change) if change else lay)
    return new


def _staleness(ins, d, outs: list[Layout]) -> list[Layout]:
    """``outs`` marked ``stale`` where they are per node and made from a stale per-node input
    (ghost rows computed from the rank's empty neighbour rows stay wrong through every
    elementwise step), cleared where the decision's action refreshes them."""
    if d.refreshes:
        return [dataclasses.replace(lay, stale=False) if lay.stale else lay for lay in outs]
    if not any(lay.stale for lay in ins):
        return outs
    return [dataclasses.replace(lay, stale=True) if lay.kind is Kind.NODE and not lay.stale else lay for lay in outs]


def mixed_error(lay: Layout, what: str, model_name: str) -> DispatchError:
    """The refusal of a model (``model_name``) whose output ``what`` was computed from a mixed value
    (its layout ``lay``)."""
    return DispatchError(
        f"{model_name} under decomposition: {lay.mixed}, so {what} would come out silently wrong; refused "
        f"(even with allow_unfollowed=True).\n{LOCAL_FORM} (docs/dispatch.md, \"Index spaces\").")
