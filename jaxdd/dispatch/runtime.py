"""One rank's view of the decomposition inside ``shard_map``, and its collectives.

The rules of the dispatch decide *what* an equation means under decomposition; the
:class:`Runtime` does the communication: halo refresh and correction, masks of the rows a
reduction may count, the all-gathers and reduce-scatters of graph parallelism, and the
kernel transforms' gathers and sums.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..decomposition import halo
from ..ops import GraphParallelPolicy, HaloRefreshPolicy, HaloStoragePolicy, SpecError
from .layouts import Kind
from .report import DispatchError

__all__ = ["Runtime"]


@dataclasses.dataclass(frozen=True)
class Runtime:
    """One rank's view of the decomposition, inside ``shard_map``.

    layout / routing: the halo plan (static / traced). axis_names: mesh axes.
    policy: the storage policy. owned_rows: [n_padded] bool, real owned rows.
    edge_owned: [n_edges] bool, real edges whose receiver is owned (None: no edge list).
    ops: registered op name → :class:`~jaxdd.spec.OpAdapter` declared on the spec.
    batch_idx: [n_padded] int, the system of each local row (what a graph index the model
        builds from ``ptr`` or node counts stands for on this rank), or None.
    receivers_owned: the neighbour list's receivers are owned rows (or padding past every
        local row), as the framework's lists are outside a deep halo; a sum onto them then
        leaves no ghost partial to send home.
    atom_mask: [n_padded] bool, the local rows that hold real atoms (owned and ghosts), or
        None: what ``idx < count_nonzero(atom_mask)`` asks of a row number on this rank.
    """

    layout: halo.HaloLayout | None
    routing: halo.HaloRouting | None
    axis_names: tuple[str, ...]
    policy: object
    owned_rows: jax.Array
    edge_owned: jax.Array | None = None
    ops: dict = dataclasses.field(default_factory=dict)
    n_ranks: int = 1
    batch_idx: jax.Array | None = None
    receivers_owned: bool = False
    atom_mask: jax.Array | None = None

    @property
    def n_owned(self) -> int:
        """Rows this rank owns (they come first among its local rows)."""
        return self.layout.n_owned if self.layout is not None else int(self.owned_rows.shape[0])

    @property
    def n_padded(self) -> int:
        """This rank's local rows, owned, ghost and padding."""
        return int(self.owned_rows.shape[0])

    @property
    def n_edges(self) -> int:
        """Edge slots of this rank's neighbour list (0 when there is none)."""
        return 0 if self.edge_owned is None else int(self.edge_owned.shape[0])

    @property
    def scatter_mode(self) -> str:
        """How a scatter onto local rows is completed: ``"refresh"``, ``"halo_correction"`` or ``"local"``."""
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
        rank's along ``axis``; rows beyond the node rows (e.g. an appended padding row) follow unchanged."""
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
        """Inverse of :meth:`all_nodes` for sums: stacked rows of ``delta`` along ``axis`` summed
        over ranks, this rank's block kept; rows beyond the stacked node rows stay as they are."""
        delta = jnp.moveaxis(delta, axis, 0)
        n_all = self.n_all
        own = jax.lax.psum_scatter(delta[:n_all], self.axis_names, scatter_dimension=0, tiled=True)
        if delta.shape[0] > n_all:
            own = jnp.concatenate([own, delta[n_all:]])
        return jnp.moveaxis(own, 0, axis)

    # Masks of the rows a reduction may count, for an axis of ``length`` rows.
    def row_mask(self, kind: Kind, length: int, permuted: bool = False) -> jax.Array:
        """[length] bool: the rows of ``kind`` a reduction counts on this rank (owned atoms, edges
        of owned receivers). permuted: edges in another order (sorted within the rank), each
        this rank's own outside a deep halo, so every row counts."""
        if permuted:
            if kind is not Kind.EDGE or not self.receivers_owned:
                raise DispatchError(f"internal: a reduction over permuted per-{kind.value} rows needs edges that "
                                    "live on one rank only")
            return jnp.ones((length,), bool)
        base = self.owned_rows if kind is Kind.NODE else self.edge_owned
        if base is None:
            raise DispatchError("a per-edge reduction needs the framework's neighbour list; the model built its own")
        n = base.shape[0]
        if length <= n:
            return base[:length]
        return jnp.concatenate([base, jnp.zeros((length - n,), bool)])

    def real_rows(self, idx):
        """Whether each row number in ``idx`` is a real atom of this rank (owned or ghost); what
        ``idx < count_nonzero(atom_mask)`` means on one device, where padding rows come last.
        Negative numbers are below every count (true); numbers past the rows are not atoms."""
        if self.atom_mask is None:
            raise DispatchError("internal: testing row numbers against the atom count needs the rank's atom_mask")
        n = self.atom_mask.shape[0]
        inside = (idx >= 0) & (idx < n)
        return jnp.where(inside, self.atom_mask[jnp.clip(idx, 0, n - 1)], idx < 0)

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

    def halo_correct(self, x, axis: int = 0, combine: str = "add"):
        """Ghost partials of ``x`` (rows along ``axis``) combined into owners (summed, or the max / min
        with ``combine``), owners' results copied back to ghosts."""
        if self.layout is None or not self.layout.exchanges:
            return x
        return self._exchange(x, axis, lambda y: halo.halo_forward(
            halo.halo_reverse(y, self.layout, self.routing, self.axis_names, combine), self.layout,
            self.routing, self.axis_names).astype(y.dtype))

    def halo_refresh(self, x, axis: int = 0):
        """``x`` with its ghost rows (along ``axis``) re-read from their owners."""
        if self.layout is None or not self.layout.exchanges:
            return x
        n_owned = self.layout.n_owned
        return self._exchange(x, axis, lambda y: halo.halo_forward(
            y[:n_owned], self.layout, self.routing, self.axis_names).astype(y.dtype))

    def gather_full(self, x):
        """Owned rows of ``x`` of every rank, stacked in rank order, then one zero padding row:
        [n_ranks * n_owned + 1, *F] (the ``GatherInputsFull`` transform)."""
        full = jax.lax.all_gather(x[: self.n_owned], self.axis_names, tiled=True)
        return jnp.concatenate([full, jnp.zeros((1,) + full.shape[1:], full.dtype)])

    def all_reduce_sum(self, y, replicated_consumer: bool = False):
        """``y`` summed over ranks (the ``AllReduceSum`` transform).

        Args:
          y: this rank's partial.
          replicated_consumer: every rank uses the sum identically, so every rank's cotangent
            is the same and the backward pass is ``n_ranks`` times it, with no collective
            (see :class:`~jaxdd.ops.AllReduceSum`). Differentiable in reverse mode only then.
        """
        if not replicated_consumer:
            return jax.lax.psum(y, self.axis_names)
        return _psum_replicated_consumer(y, self.axis_names)

    def gather_inputs(self, x):
        """Owned rows ``x`` [n_owned, *F] → local rows [n_padded, *F] (ghosts read from their owners)."""
        if self.layout is None:
            return x
        return halo.halo_forward(x[: self.layout.n_owned], self.layout, self.routing, self.axis_names)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _psum_replicated_consumer(y, axis_names):
    return jax.lax.psum(y, axis_names)


def _psum_replicated_fwd(y, axis_names):
    return jax.lax.psum(y, axis_names), None


def _psum_replicated_bwd(axis_names, _, ct):
    # Every rank holds the same cotangent: their sum is n_ranks times this rank's own.
    return (ct * jax.lax.axis_size(axis_names),)


_psum_replicated_consumer.defvjp(_psum_replicated_fwd, _psum_replicated_bwd)
