"""Gathers and scatters: where indices point decides the layout and the exchange.

``h[senders]`` is per edge; ``segment_sum(messages, receivers)`` is per node and, under
``halo_correction``, sends ghost partials home (reverse then forward exchange), or, when the
indices are receivers that only this rank's owned atoms are (the framework's lists outside a
deep halo), only copies owners' sums to their ghosts (forward exchange);
``segment_sum(x, batch_idx)`` is per system and ends in a collective. Graph-parallel
senders index every rank's rows: reading through them all-gathers, scattering onto them
reduce-scatters.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..decision import Decision
from ..equations import bind, is_literal, shape_of, where
from ..layouts import REPLICATED, ROWS, Kind, Layout, columns_axis, rows_of
from ..masks import along, identity_of
from ..registry import register_rule
from ..report import DispatchError
from .elementwise import elementwise
from .shapes import is_iota

__all__ = ["gather", "scatter", "scatter_all_nodes", "uniform_along"]


@register_rule("gather")
def gather(ctx, eqn, ins) -> Decision:
    """``x[idx]``: rows gathered by atom or edge indices keep the indices' layout; graph-parallel
    senders read from every rank's rows; a gather along untouched axes keeps the operand's layout.
    """
    op, idx = ins
    dn = eqn.params["dimension_numbers"]
    if idx.index is Kind.ALL_NODES and op.kind is Kind.NODE and op.axis in dn.start_index_map:
        # Graph-parallel senders point at any rank's atoms: read from all ranks' rows.
        batch_out = [d for d in range(len(shape_of(eqn.outvars[0]))) if d not in dn.offset_dims]
        rows = idx.kind is not None and idx.axis < len(shape_of(eqn.invars[1])) - 1
        out = Layout(idx.kind, batch_out[idx.axis], op.index) if rows else Layout(None, 0, op.index)
        axis = op.axis

        def gather_all(eqn, invals):
            x, indices = invals
            return bind(eqn, [ctx.runtime.all_nodes(x, axis), indices])

        return Decision((out,), gather_all, "gather.all_nodes")
    if op.kind is Kind.NODE and op.stale and op.axis in dn.start_index_map and idx.index is not Kind.OWNED_NODE:
        # Rows made from the rank's neighbour rows, read through atom indices that may name
        # ghosts: the ghost rows are re-read from their owners first (one forward exchange).
        fresh = _gather_layout(ctx, eqn, (dataclasses.replace(op, stale=False), idx))
        axis = op.axis

        def refreshed(eqn, invals):
            x, indices = invals
            return bind(eqn, [ctx.runtime.halo_refresh(x, axis), indices])

        # Read through indices that are not stale themselves, the rows come out complete.
        return dataclasses.replace(fresh, apply=refreshed, rule="gather.refresh", refreshes=not idx.stale)
    return _gather_layout(ctx, eqn, ins)


def _gather_layout(ctx, eqn, ins) -> Decision:
    """The layout of ``x[idx]`` read where the rows already are (the decision binds it unchanged)."""
    op, idx = ins
    dn = eqn.params["dimension_numbers"]
    oshape = shape_of(eqn.outvars[0])
    ishape = shape_of(eqn.invars[1])
    batch_out = [d for d in range(len(oshape)) if d not in dn.offset_dims]
    notes = []
    index = op.index
    if idx.kind is not None and idx.axis < len(ishape) - 1:
        if op.kind in ROWS + (Kind.GRAPH,) and op.axis in dn.start_index_map:
            pointer = _column_into(idx, ishape, dn.start_index_map.index(op.axis))
            if pointer is None:
                notes.append(f"gather from per-{op.kind.value} rows by indices of unknown provenance in "
                             f"{where(eqn)}: assumed to point at local rows")
            elif rows_of(pointer) is not op.kind:
                notes.append(f"gather from per-{op.kind.value} rows by per-{pointer.value} indices in {where(eqn)}")
        return Decision((Layout(idx.kind, batch_out[idx.axis], index),), notes=tuple(notes))
    if op.kind is None:
        return Decision((Layout(None, 0, index),))
    a = op.axis
    if a in dn.start_index_map or a in dn.collapsed_slice_dims:
        if op.kind in ROWS:
            notes.append(f"gather picks single per-{op.kind.value} rows by replicated indices in {where(eqn)} "
                         "(e.g. x[0]): the row differs between ranks")
        return Decision((Layout(None, 0, index),), notes=tuple(notes))
    if a in getattr(dn, "operand_batching_dims", ()):
        k = dn.operand_batching_dims.index(a)
        return Decision((Layout(op.kind, batch_out[dn.start_indices_batching_dims[k]], index),))
    if eqn.params["slice_sizes"][a] != shape_of(eqn.invars[0])[a]:
        return Decision((Layout(None, 0, index),))
    offset_operand = [d for d in range(len(shape_of(eqn.invars[0])))
                      if d not in dn.collapsed_slice_dims and d not in getattr(dn, "operand_batching_dims", ())]
    return Decision((Layout(op.kind, dn.offset_dims[offset_operand.index(a)], index),))


def _column_into(idx: Layout, ishape, column: int) -> Kind | None:
    """What the index column ``column`` of a gather's indices points at: the indices' own
    meaning, or, for indices put together column by column (``x[partner, reverse]``: atom
    rows, then bond slots), that column's."""
    if idx.index is not None:
        return idx.index
    if columns_axis(idx, ishape) == len(ishape) - 1 and column < len(idx.columns):
        return idx.columns[column]
    return None


@register_rule("scatter*")
def scatter(ctx, eqn, ins) -> Decision:
    """``x.at[idx].add / set / max / min / mul``: by what the indices point at (owned rows, local
    rows, graph-parallel senders), the scatter is bound locally, its ghost partials sent home, or
    its rows refreshed; indices of unknown provenance are left rank-local and recorded.
    """
    name = eqn.primitive.name
    if len(ins) != 3:
        return elementwise(ctx, eqn, ins)
    op, idx, upd = ins[0], ins[1], ins[2]
    dn = eqn.params["dimension_numbers"]
    kept = _rows_in_window(ctx, eqn, ins)
    if kept is not None:
        return Decision((kept,))
    own = _own_rows(ctx, eqn, ins)
    if own is not None:
        return Decision((own,), bind, f"{name}.own_rows", confirms=(1,))
    notes = []
    sdod = dn.scatter_dims_to_operand_dims
    ishape = shape_of(eqn.invars[1])
    columns = idx.columns if columns_axis(idx, ishape) == len(ishape) - 1 else None
    known = [(c, k) for c, k in enumerate(columns or ()) if k is not None]
    if len(sdod) == 1:
        a = sdod[0]
        target = idx.index
    elif columns and len(columns) == len(sdod) and len(known) == 1:
        a, target = sdod[known[0][0]], known[0][1]  # the one column that points somewhere
    else:
        # Several index columns (x.at[receivers, kind].add(...)): which column points at
        # atoms is not tracked per column, so the operand's axis as long as the local rows
        # is taken as the atom axis.
        oshape = shape_of(eqn.invars[0])
        axes = [d for d in dn.scatter_dims_to_operand_dims if ctx.fallback_kind(oshape[d]) is Kind.NODE]
        if len(axes) == 1:
            a, target = axes[0], Kind.NODE
            notes.append(f"{name} with {len(dn.scatter_dims_to_operand_dims)} index columns in {where(eqn)}: the "
                         f"column into the {oshape[a]} local rows taken as the atom index (shape fallback)")
        else:
            a, target = dn.scatter_dims_to_operand_dims[0], None
            if idx.kind in ROWS or upd.kind in ROWS:
                notes.append(f"{name} with several index columns in {where(eqn)}: no column could be told to "
                             "point at atoms; left rank-local")
            return Decision((op.plain() if op.kind else REPLICATED,), notes=tuple(notes))
    if target is None and len(sdod) == 1:
        whole = _one_group_of_atoms(ctx, eqn, ins, name)
        if whole is not None:
            return whole
    if target is None and len(sdod) == 1:
        binned = _bins_of_rows(ctx, eqn, ins, sdod[0])
        if binned is not None:
            return binned
    # Indices that are per-row data without a known meaning are suspicious; replicated
    # ones (constants, or indices passed through to_local) are a deliberate local scatter.
    if target is None and op.kind is None and idx.kind in ROWS:
        notes.append(f"{name} of per-row values by indices of unknown provenance in {where(eqn)}: left rank-local")
    if target is None:
        out = op if op.kind is not None else REPLICATED
        return Decision((out.plain() if out.kind else out,), notes=tuple(notes))
    owned = target is Kind.OWNED_NODE
    target = rows_of(target)
    out = Layout(target, a)
    kind = name.split("-", 1)[1] if "-" in name else "set"
    if target is Kind.ALL_NODES:
        return scatter_all_nodes(ctx, eqn, kind, a, tuple(notes))
    if target is Kind.NODE:
        mode = ctx.runtime.scatter_mode if ctx.runtime is not None else "local"
        if mode == "local":
            # bound unchanged, but counted
            return Decision((out,), bind, f"scatter_{kind}.local", tuple(notes))
        if kind == "add" and mode == "halo_correction":
            # Onto owned rows only, no ghost row holds a partial: owners' sums are complete
            # and only copied to their ghosts (one exchange, not two).
            rule = "scatter_add.owned_rows" if owned else "scatter_add.halo_correction"

            def apply(eqn, invals):
                operand, indices, updates = invals
                (delta,) = bind(eqn, [jnp.zeros_like(operand), indices, updates])
                complete = ctx.runtime.halo_refresh if owned else ctx.runtime.halo_correct
                return [operand + complete(delta, a)]
            return Decision((out,), apply, rule, tuple(notes))

        if kind in ("max", "min") and mode == "halo_correction" and not owned:
            # A ghost row holds this rank's partial extremum (segment_max onto senders): the
            # owner takes the max / min of its own and its ghosts' rows, then ghosts re-read it.
            # Both are idempotent, so operand rows that already equal their owner's are safe.
            def extremum(eqn, invals):
                (y,) = bind(eqn, invals)
                return [ctx.runtime.halo_correct(y, a, combine=kind)]
            return Decision((out,), extremum, f"scatter_{kind}.halo_correction", tuple(notes))
        if kind in ("set", "mul") and mode == "halo_correction" and not owned:
            raise DispatchError(
                f"{name} into per-atom rows by atom indices that may name ghost rows in {where(eqn)}: a "
                f"{'write' if kind == 'set' else 'product'} this rank makes into a ghost's row never reaches "
                "the owner, so the result would differ from one device. Scatter onto the list's receivers, "
                "use .add / .max / .min (whose ghost partials are sent home), or mark a deliberately "
                "rank-local value with jaxdd.to_local")

        def refresh(eqn, invals):
            (y,) = bind(eqn, invals)
            return [ctx.runtime.halo_refresh(y, a)]
        return Decision((out,), refresh, f"scatter_{kind}.refresh", tuple(notes))
    if target is Kind.GRAPH:
        rows = idx.kind if idx.kind in ROWS and idx.axis < len(ishape) - 1 else None
        if rows is None and upd.kind in ROWS:
            notes.append(f"{name} into per-system rows from per-{upd.kind.value} values whose index has no row "
                         f"layout in {where(eqn)}: left rank-local")
        if rows is None:
            return Decision((out,), notes=tuple(notes))
        if kind not in ("add", "max", "min"):
            notes.append(f"{name} into per-system rows in {where(eqn)} has no collective: left rank-local")
            return Decision((out,), notes=tuple(notes))
        upd_scatter = [d for d in range(len(shape_of(eqn.invars[2]))) if d not in dn.update_window_dims]
        permuted = idx.permuted or upd.permuted
        return Decision((out,), _segment_reduce(ctx, kind, rows, upd_scatter[idx.axis], permuted),
                        f"segment_reduce.{kind}", tuple(notes), replicates=True)
    return Decision((out,), notes=tuple(notes))


def _own_rows(ctx, eqn, ins) -> Layout | None:
    """``x.at[jnp.arange(n)].add(u)``: indices ``0 .. n-1`` along the operand's row axis write
    each row from the same row of the updates, an elementwise op on rows (ghost rows get what
    their owners get). The rows' layout, or None when the scatter is not that."""
    op, _, upd = ins
    dn = eqn.params["dimension_numbers"]
    if len(dn.scatter_dims_to_operand_dims) != 1 or dn.inserted_window_dims != dn.scatter_dims_to_operand_dims:
        return None
    a = dn.scatter_dims_to_operand_dims[0]
    n = shape_of(eqn.invars[0])[a]
    ishape = shape_of(eqn.invars[1])
    if ishape != (n, 1) or not is_iota(ctx, eqn.invars[1], 0, n):
        return None
    upd_rows = [d for d in range(len(shape_of(eqn.invars[2]))) if d not in dn.update_window_dims]
    if op.kind in ROWS and op.axis == a:
        return op.plain()
    if upd.kind in ROWS and upd_rows == [upd.axis]:
        return Layout(upd.kind, a)
    return None


def _rows_in_window(ctx, eqn, ins) -> Layout | None:
    """The layout of a scatter that leaves the rows where they are: indices the same on every
    rank that address other axes only, the rows a whole window (eSEN's per-edge Wigner matrices,
    ``d = jnp.zeros((n_edges, k, k)); d.at[:, 1:4, 1:4].set(rot)``). Each output row then
    depends on the same row of the operand and the updates alone; None when that is not so."""
    op, idx, upd = ins
    if idx.kind is not None or idx.local or idx.total or idx.mixed:
        return None
    dn = eqn.params["dimension_numbers"]
    oshape, ushape = shape_of(eqn.invars[0]), shape_of(eqn.invars[2])
    dropped = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
    window = [d for d in range(len(oshape)) if d not in dropped]  # operand axes, in update_window_dims order
    if len(window) != len(dn.update_window_dims):
        return None
    to_operand = dict(zip(dn.update_window_dims, window))
    rows = None
    if upd.kind in ROWS and upd.axis in to_operand:
        rows = Layout(upd.kind, to_operand[upd.axis])
        if op.kind is not None and (op.kind, op.axis) != (rows.kind, rows.axis) or op.local:
            return None
        if op.kind is None and not uniform_along(ctx, eqn.invars[0], rows.axis):
            return None  # a replicated operand whose rows differ (a parameter table): not per row
    elif op.kind in ROWS and op.axis in window and upd.kind is None and not upd.local:
        rows = Layout(op.kind, op.axis)
    if rows is None or rows.axis in dn.scatter_dims_to_operand_dims:
        return None
    u = next(k for k, a in to_operand.items() if a == rows.axis)
    if ushape[u] != oshape[rows.axis]:
        return None  # a window shorter than the rows: only some rows are written
    return Layout(rows.kind, rows.axis, permuted=op.permuted or upd.permuted)


def uniform_along(ctx, var, axis: int, depth: int = 8) -> bool:
    """Whether ``var`` is the same at every position along ``axis``: a literal, a broadcast that
    adds that axis (``jnp.zeros``), or such a value written by a scatter whose indices leave
    that axis whole and whose updates are themselves the same along it (``d.at[:, 0, 0].set(1.0)``),
    as far as the dispatcher ``ctx`` traces producers back (``depth`` equations)."""
    eqn = ctx.producer(var)
    if depth <= 0 or eqn is None:
        return is_literal(var)
    name = eqn.primitive.name
    if name == "broadcast_in_dim":
        return axis not in eqn.params["broadcast_dimensions"] or shape_of(eqn.invars[0])[
            list(eqn.params["broadcast_dimensions"]).index(axis)] == 1
    if name in ("convert_element_type", "copy"):
        return uniform_along(ctx, eqn.invars[0], axis, depth - 1)
    if name.startswith("scatter") and len(eqn.invars) == 3:
        dn = eqn.params["dimension_numbers"]
        if axis in dn.scatter_dims_to_operand_dims or axis in dn.inserted_window_dims:
            return False
        dropped = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
        window = [d for d in range(len(shape_of(eqn.invars[0]))) if d not in dropped]
        if axis not in window or len(window) != len(dn.update_window_dims):
            return False
        u = dn.update_window_dims[window.index(axis)]
        return (uniform_along(ctx, eqn.invars[0], axis, depth - 1)
                and uniform_along(ctx, eqn.invars[2], u, depth - 1))
    return False


def _segment_reduce(ctx, kind: str, rows: Kind, axis: int, permuted: bool = False):
    """The action of a scatter (add/max/min) of per-``rows`` updates (rows along ``axis``) into
    groups the same on every rank: rows this rank does not own masked, then a collective."""
    collective = {"add": jax.lax.psum, "max": jax.lax.pmax, "min": jax.lax.pmin}[kind]

    def segment_reduce(eqn, invals):
        rt = ctx.runtime
        operand, indices, updates = invals
        mask = along(rt.row_mask(rows, updates.shape[axis], permuted), updates.ndim, axis)
        updates = jnp.where(mask, updates, identity_of(kind, updates.dtype))
        if kind == "add":
            (delta,) = bind(eqn, [jnp.zeros_like(operand), indices, updates])
            return [operand + collective(delta, rt.axis_names)]
        (y,) = bind(eqn, [operand, indices, updates])
        return [collective(y, rt.axis_names)]

    return segment_reduce


def _bins_of_rows(ctx, eqn, ins, a: int) -> Decision | None:
    """``jnp.bincount(species, weights, length=k)``, ``jnp.zeros(k).at[species].add(w)``: per-row
    updates added (or maxed) into bins named by a per-row value that is no row number (a
    species, a type), in an array with no rows of its own. A row's bin is the same on every rank
    that holds it, so this is a per-bin total: rows this rank does not own masked, then a
    collective, as for per-system rows."""
    op, idx, upd = ins
    name = eqn.primitive.name
    kind = name.split("-", 1)[1] if "-" in name else "set"
    ishape = shape_of(eqn.invars[1])
    if (kind not in ("add", "max", "min") or op.kind is not None or op.local or idx.kind not in ROWS
            or idx.index is not None or idx.local or idx.axis >= len(ishape) - 1
            or ctx.fallback_kind(shape_of(eqn.invars[0])[a]) is not None):
        return None
    dn = eqn.params["dimension_numbers"]
    upd_scatter = [d for d in range(len(shape_of(eqn.invars[2]))) if d not in dn.update_window_dims]
    permuted = idx.permuted or upd.permuted
    return Decision((REPLICATED,), _segment_reduce(ctx, kind, idx.kind, upd_scatter[idx.axis], permuted),
                    f"segment_reduce.{kind}", replicates=True)


def _one_group_of_atoms(ctx, eqn, ins, name) -> Decision | None:
    """A scatter of per-atom (or per-edge) rows by a constant index that puts every such row in
    one group: jraph's readout ``segment_sum(x, jnp.repeat(arange(n_graph), n_node,
    total_repeat_length=n), n_graph)`` with fixed node counts (jax-md's ``n_node = [N, 1]``: the
    atoms, then a padding graph of the one row appended after them), and the same over edges
    with ``n_edge``. Whatever the partition, every atom (edge) belongs to that group, so it is a
    per-system sum: rows this rank does not own masked, then a collective. The groups of
    appended rows alone (padding graphs) read zero under decomposition."""
    op, idx, upd = ins
    dn = eqn.params["dimension_numbers"]
    kind = name.split("-", 1)[1] if "-" in name else "set"
    if (kind not in ("add", "max", "min") or op.kind is not None or op.local or idx.kind is not None or idx.local
            or upd.kind not in ROWS):
        return None
    rows = upd.kind
    n_rows = ctx.n_padded if rows is Kind.NODE else ctx.n_edges
    ishape, ushape = shape_of(eqn.invars[1]), shape_of(eqn.invars[2])
    upd_scatter = [d for d in range(len(ushape)) if d not in dn.update_window_dims]
    if len(ishape) != 2 or upd_scatter != [upd.axis] or not n_rows or ushape[upd.axis] < n_rows:
        return None
    groups = ctx.constant(eqn.invars[1])
    if groups is None:
        return None
    real = groups.reshape(-1)[:n_rows]
    if not (real == real[0]).all():
        return None
    return Decision((REPLICATED,), _segment_reduce(ctx, kind, rows, upd.axis, upd.permuted),
                    f"segment_reduce.{kind}", replicates=True)


def scatter_all_nodes(ctx, eqn, kind: str, a: int, notes) -> Decision:
    """A scatter into per-node rows by graph-parallel sender indices: made on every
    rank's rows stacked, combined across ranks, this rank's block kept.

    Args:
      ctx, eqn: the dispatcher and the scatter's equation.
      kind: ``"add"``, ``"max"`` or ``"min"`` (any other is refused).
      a: the operand's axis of node rows.
      notes: fallback messages recorded with the decision.
    """
    if kind not in ("add", "max", "min"):
        raise DispatchError(
            f"{eqn.primitive.name} into per-atom rows by neighbour-list senders in {where(eqn)}: under the "
            "graph-parallel strategy only add, max and min can be combined across ranks; scatter onto receivers "
            "(each edge's own atom) instead, or use the halo strategy")

    def apply(eqn, invals):
        operand, indices, updates = invals
        rt = ctx.runtime
        shape = list(operand.shape)
        shape[a] += rt.n_all - rt.n_padded
        fill = jnp.zeros((), operand.dtype) if kind == "add" else identity_of(kind, operand.dtype)
        (delta,) = bind(eqn, [jnp.full(shape, fill, operand.dtype), indices, updates])
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

    return Decision((Layout(Kind.NODE, a),), apply, f"scatter_{kind}.all_nodes", notes)
