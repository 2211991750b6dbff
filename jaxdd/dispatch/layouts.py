"""Layouts: which axis of a value is distributed over ranks, and over what.

Every value the dispatch sees carries a :class:`Layout`, known from provenance: inputs are
tagged by field and each rule says how its primitive moves the tag.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["Kind", "Layout", "REPLICATED", "ROWS", "ATOM_COUNT", "TOTAL", "OFFSETS", "bare", "join", "clean", "columns_axis", "rows_of", "merge_index"]


class Kind(str, enum.Enum):
    """What the distributed axis of a value runs over."""

    NODE = "node"  # local padded atoms: [owned | ghosts | pad]
    EDGE = "edge"  # neighbour-list edges of this rank
    GRAPH = "graph"  # systems; the same on every rank
    # Only as an index kind: every rank's node rows stacked in rank order (the senders of a
    # graph-parallel neighbour list). Reading per-node values through it all-gathers them.
    ALL_NODES = "all_nodes"
    # Only as an index kind: node rows, but only the rows this rank owns, or past every local
    # row (padding edges) — the receivers of a list whose receivers are the owned atoms. A
    # sum scattered through it leaves nothing on a ghost row, so no partial has to go home.
    OWNED_NODE = "owned_node"


@dataclasses.dataclass(frozen=True)
class Layout:
    """kind: the distributed axis' kind (None: nothing distributed). axis: which axis that
    is. index: the values are indices into this kind's axis (edge receivers point at nodes,
    ``batch_idx`` at systems). local: no distributed axis, but the value differs between
    ranks (one atom's value, a rank-local partial); never set together with ``kind``.
    columns: per-column index kinds of an index array built column by column, along
    ``columns_axis`` (None: the last axis; ``jnp.stack([receivers, senders])`` has them along 0).

    The value's *index space* (docs/dispatch.md, "Index spaces"), in three more fields:

    total: the value is a total over every rank's rows: a count, sum or extremum reduced
        across ranks (:data:`ATOM_COUNT` for the count of real atoms, ``count_nonzero(atom_mask)``;
        :data:`TOTAL` for any other, :data:`OFFSETS` for the batch's ``ptr``). Such a value
        must never meet a rank's own row numbers (:mod:`jaxdd.dispatch.provenance`).
    mixed: where such a meeting happened (``file:line (primitive)`` and what met): the value
        means something else under decomposition, and so does all that is computed from it,
        unless a rule recognises it (a graph index rebuilt from counts).
    real: the values are the atom mask: true exactly on the rows of real atoms.
    permuted: the rows along ``axis`` are this rank's rows in another order (edges sorted
        within the rank); a row's position no longer says which row it is.
    deliberate: a ``local`` value that the model declared rank-local with
        :func:`jaxdd.to_local` (or computed from such values alone): no layout is guessed for
        it from its axis lengths, whatever they happen to equal.
    stale: per-node rows made from the rank's neighbour rows (the MATRIX list, its bonds,
        ``num_neighbors``), which only receiver rows have: owned rows hold their one-device
        values, ghost rows do not equal their owners' until re-read from them. Reading such
        rows through atom indices refreshes them first (:func:`~jaxdd.dispatch.rules.indexing.gather`)."""

    kind: Kind | None = None
    axis: int = 0
    index: Kind | None = None
    local: bool = False
    columns: tuple | None = None
    columns_axis: int | None = None
    total: str | None = None
    mixed: str | None = None
    real: bool = False
    permuted: bool = False
    deliberate: bool = False
    stale: bool = False

    def moved(self, axis: int | None) -> "Layout":
        """The same tag on another axis (``None``: the axis is gone; the index meaning stays)."""
        return Layout(self.kind, axis, self.index) if axis is not None else Layout(None, 0, self.index)

    def plain(self) -> "Layout":
        """The same distributed axis, with no index meaning."""
        return Layout(self.kind, self.axis, None) if self.kind is not None else REPLICATED

    def describe(self) -> str:
        """The layout in words, for messages to users."""
        if self.kind is not None:
            rows = {Kind.NODE: "one row per atom of this rank", Kind.EDGE: "one row per edge of this rank",
                    Kind.GRAPH: "one row per system", Kind.ALL_NODES: "every rank's atom rows"}[self.kind]
            return f"{rows} (axis {self.axis})"
        if self.local:
            return "a value that differs between ranks (a rank's partial result, or one of its atoms)"
        return "the same on every rank"


#: Nothing distributed, the same on every rank (parameters, constants).
REPLICATED = Layout()
#: ``Layout.total`` of the count of real atoms over every rank (``count_nonzero(atom_mask)``).
ATOM_COUNT = "atom_count"
#: ``Layout.total`` of any other count, sum or extremum reduced across ranks.
TOTAL = "total"
#: ``Layout.total`` of the batch's ``ptr``: offsets of systems along rows numbered on one device.
OFFSETS = "offsets"
#: Rank-local rows: reductions over them need masks and collectives.
ROWS = (Kind.NODE, Kind.EDGE)


def columns_axis(lay: Layout, shape: tuple[int, ...]) -> int | None:
    """The axis ``lay.columns`` run along, for a value of ``shape``; None when it has no
    columns, or not as many as that axis (a rule moved the axes and dropped nothing)."""
    axis = len(shape) - 1 if lay.columns_axis is None else lay.columns_axis
    if not lay.columns or not 0 <= axis < len(shape) or shape[axis] != len(lay.columns):
        return None
    return axis


def rows_of(index: Kind | None) -> Kind | None:
    """The kind of rows an index of kind ``index`` points into (owned rows are node rows)."""
    return Kind.NODE if index is Kind.OWNED_NODE else index


def merge_index(kinds) -> Kind | None:
    """The index meaning of a value that may hold indices of any of ``kinds`` (None: none of
    them has one): the one they share; owned rows with other node rows are node rows."""
    found = {k for k in kinds if k is not None}
    if found == {Kind.NODE, Kind.OWNED_NODE}:
        return Kind.NODE
    return found.pop() if len(found) == 1 else None


def join(a: Layout, b: Layout) -> Layout:
    """The layout of a value that may be either ``a`` or ``b`` (loop carries, branches)."""
    if a == b:
        return a
    extra = dict(total=a.total if a.total == b.total else (a.total or b.total) and TOTAL,
                 mixed=a.mixed or b.mixed, real=a.real and b.real, permuted=a.permuted or b.permuted,
                 stale=(a.stale or b.stale) and (a.kind is Kind.NODE or b.kind is Kind.NODE))
    base = _join(bare(a), bare(b))
    return dataclasses.replace(base, **extra)


def bare(lay: Layout) -> Layout:
    """``lay`` without its index-space fields (``total``, ``mixed``, ``real``, ``permuted``) and
    without ``stale``."""
    if not (lay.total or lay.mixed or lay.real or lay.permuted or lay.stale):
        return lay
    return dataclasses.replace(lay, total=None, mixed=None, real=False, permuted=False, stale=False)


def _join(a: Layout, b: Layout) -> Layout:
    if a == b:
        return a
    if {a.index, b.index} == {Kind.NODE, Kind.OWNED_NODE}:
        # Either index: node rows, not only owned ones.
        a, b = dataclasses.replace(a, index=Kind.NODE), dataclasses.replace(b, index=Kind.NODE)
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


def clean(lay: Layout, shape: tuple[int, ...]) -> Layout:
    """``lay`` for a value of ``shape``: a distributed axis the value does not have is dropped."""
    if lay.kind is not None and lay.axis >= len(shape):
        return Layout(None, 0, lay.index)
    return lay
