"""The DD context: what a model may ask about the decomposition it runs under.

A :class:`DDContext` is set (a scoped context variable, never global state) while
:class:`~jaxdd.DistributedModel` traces the model on one rank's padded shapes; outside that
scope :func:`current_dd_context` returns an inert context (one rank, nothing owned or
padded), so code that reads it runs unchanged on a single device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax

__all__ = ["DDContext", "current_dd_context", "dd_scope"]


@dataclasses.dataclass(frozen=True)
class DDContext:
    """The decomposition a model is being traced for (static; read it while tracing).

    active: False outside a DD scope. mesh: the device mesh (None when inactive).
    axis_names: mesh axes collectives run over. policy: the spec's storage policy.
    world_size: ranks. n_owned: owned rows per rank (capacity). n_padded: local rows per
    rank, ``[owned | ghosts | pad]``. n_edges: neighbour-list edge slots per rank.
    n_systems: systems in the batch. halo_layers: message-passing depth the ghost shell
    covers. adapters: the :class:`~jaxdd.spec.adapters.AdapterRegistry` of this trace, for
    replacements built in ``distributed_setup(ctx)`` (None when inactive).
    """

    active: bool = False
    mesh: Any = None
    axis_names: tuple[str, ...] = ()
    policy: Any = None
    world_size: int = 1
    n_owned: int = 0
    n_padded: int = 0
    n_edges: int = 0
    n_systems: int = 0
    halo_layers: int = 1
    adapters: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def rank(self):
        """This rank's index, a traced int32 scalar (0 when inactive)."""
        if not self.active:
            return 0
        return jax.lax.axis_index(self.axis_names)


_CONTEXT: contextvars.ContextVar[DDContext] = contextvars.ContextVar("jaxdd_dd_context", default=DDContext())


def current_dd_context() -> DDContext:
    """The active :class:`DDContext`, or an inert one outside a DD scope."""
    return _CONTEXT.get()


@contextlib.contextmanager
def dd_scope(ctx: DDContext):
    """Make ``ctx`` the active context for the duration of the ``with`` block."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)
