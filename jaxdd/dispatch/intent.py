"""Intent verbs: say explicitly what the dispatch would otherwise infer.

Each verb is a small named ``jax.jit`` (``"jaxdd::<verb>"``) whose body is the
single-device meaning, so outside a DD scope every verb is that plain computation (an
identity, or a ``segment_sum``). Under :class:`~jaxdd.DistributedModel` the dispatch
recognises the name and applies the distributed meaning instead (the rules registered
under these names in :mod:`jaxdd.dispatch.rules.verbs`):

=====================  ===============================  ==========================================
verb                   single device                    under decomposition
=====================  ===============================  ==========================================
``system_sum``         ``segment_sum(values, index, n)``  OWNED: own rows only, summed over ranks;
                                                          LOCAL: own rows only, this rank's share
                                                          (no communication)
``refresh_neighbors``  identity                         ghost rows re-read from their owners
``scatter_to_owners``  identity                         ghost partials added to owners, then refreshed
``to_local``           identity                         the rank's rows as a plain array: no rule
                                                        fires on anything computed from it
``autograd_target``    identity                         identity (positions handed to the model are
                                                        already what forces are taken against)
=====================  ===============================  ==========================================
"""

from __future__ import annotations

import enum
import functools

import jax

from ..data.checks import integral

__all__ = ["Scope", "OWNED", "LOCAL", "system_sum", "refresh_neighbors", "scatter_to_owners", "to_local",
           "autograd_target", "VERBS"]


class Scope(str, enum.Enum):
    """What a reduction returns: OWNED (each atom once, summed over all ranks) or LOCAL (this rank's
    share: its owned atoms only, no communication; the ranks' shares add up to the OWNED sum)."""

    OWNED = "owned"
    LOCAL = "local"


OWNED = Scope.OWNED
LOCAL = Scope.LOCAL


def _verb(name: str, fn, **jit_kwargs):
    fn.__name__ = fn.__qualname__ = name
    return jax.jit(fn, **jit_kwargs)


def _segment_sum(values, index, n):
    return jax.ops.segment_sum(values, index, num_segments=n)


_system_sum_owned = _verb("jaxdd::system_sum", functools.partial(_segment_sum), static_argnums=2)
_system_sum_local = _verb("jaxdd::system_sum_local", functools.partial(_segment_sum), static_argnums=2)


def _identity(x):
    return x


_refresh = _verb("jaxdd::refresh_neighbors", functools.partial(_identity))
_scatter_home = _verb("jaxdd::scatter_to_owners", functools.partial(_identity))
_to_local = _verb("jaxdd::to_local", functools.partial(_identity))
_autograd_target = _verb("jaxdd::autograd_target", functools.partial(_identity))

VERBS = ("jaxdd::system_sum", "jaxdd::system_sum_local", "jaxdd::refresh_neighbors", "jaxdd::scatter_to_owners",
         "jaxdd::to_local", "jaxdd::autograd_target")


def system_sum(values, index, n: int, scope: Scope | str = Scope.OWNED):
    """Per-system sums of per-atom (or per-edge) values.

    Args:
      values: [n_rows, *F] per-row values.
      index: [n_rows] int system of each row (rows with index >= n are dropped).
      n: number of systems.
      scope: OWNED (each atom once, summed over ranks) or LOCAL (this rank's share) under decomposition.

    Returns:
      [n, *F] sums.
    """
    scope = Scope(scope)
    fn = _system_sum_owned if scope is Scope.OWNED else _system_sum_local
    return fn(values, index, integral("system_sum: n", n, minimum=0))


def refresh_neighbors(x):
    """Per-atom values ``x`` [n_rows, *F] with ghost rows re-read from their owners."""
    return _refresh(x)


def scatter_to_owners(x):
    """Per-atom partial sums ``x`` [n_rows, *F]: ghost rows added into their owners, then refreshed."""
    return _scatter_home(x)


def to_local(x):
    """This rank's rows of ``x`` as a plain array; the dispatch stops tracking its layout."""
    return _to_local(x)


def autograd_target(x):
    """Mark ``x`` as the positions forces are taken with respect to (an identity in jaxdd)."""
    return _autograd_target(x)
