"""Static capacities and the one rule by which they are sized and grown.

Every array a compiled program holds per rank has a static size: owned rows, slots of each
halo exchange, neighbour-list slots, migration slots. A capacity is sized with headroom
over what a configuration needs (:func:`headroom`); when a later configuration needs more,
it grows (:func:`grow`) and the program compiles again. Nothing is ever dropped to fit.

Which factors apply: ``DomainConfig.capacity_factor`` when it is given, else the spec's
``CompilePolicy.capacity_factor``, else 1.2; growth by ``CompilePolicy.growth_factor``
(default 1.5). See :func:`factors`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported for annotations only: neighbors imports this module
    from .formats import NeighborCapacity

__all__ = ["Capacities", "headroom", "grow", "factors", "run_until_fits", "DEFAULT_CAPACITY_FACTOR",
           "DEFAULT_GROWTH_FACTOR"]

#: Headroom of a capacity sized afresh, when neither the domain config nor the spec sets one.
DEFAULT_CAPACITY_FACTOR = 1.2
#: Growth of a capacity that overflowed, when the spec sets none.
DEFAULT_GROWTH_FACTOR = 1.5


def headroom(needed: int, factor: float) -> int:
    """Slots for ``needed`` items with ``factor`` (>= 1) headroom: ``ceil(needed * factor)``, at least 1."""
    return max(1, int(math.ceil(int(needed) * float(factor))))


def grow(capacity: int, needed: int, factor: float) -> int:
    """``capacity`` if it holds ``needed`` items, else ``headroom(needed, factor)``; never smaller."""
    return int(capacity) if int(needed) <= int(capacity) else max(int(capacity), headroom(needed, factor))


def factors(domain_factor: float | None, compile_policy) -> tuple[float, float]:
    """(capacity factor, growth factor) of a run.

    Args:
      domain_factor: ``DomainConfig.capacity_factor`` (None: not given).
      compile_policy: the spec's :class:`~jaxdd.spec.CompilePolicy` or None.

    Returns:
      The capacity factor: the domain config's when given (a run's setting overrides the
      model's), else the compile policy's, else :data:`DEFAULT_CAPACITY_FACTOR`; and the
      growth factor: the compile policy's, else :data:`DEFAULT_GROWTH_FACTOR`.
    """
    policy_factor = None if compile_policy is None else compile_policy.capacity_factor
    capacity = domain_factor if domain_factor is not None else policy_factor
    growth = DEFAULT_GROWTH_FACTOR if compile_policy is None else compile_policy.growth_factor
    return float(DEFAULT_CAPACITY_FACTOR if capacity is None else capacity), float(growth)


def run_until_fits(attempt, grow_to, *, max_regrowths: int, what: str):
    """Run ``attempt`` until it fits: jaxdd's one overflow → grow → retry loop.

    Args:
      attempt: ``attempt() -> (result, needs)``: one run with the capacities as they are now;
        ``needs`` says what it needed when it overflowed, None when it fitted.
      grow_to: ``grow_to(needs)``: grow the capacities the next attempt reads to hold ``needs``.
      max_regrowths: growths before giving up. what: what overflows, for the error.

    Returns:
      The result of the first attempt that fitted.

    Raises:
      RuntimeError: still overflowing after ``max_regrowths`` growths.
    """
    for _ in range(int(max_regrowths) + 1):
        result, needs = attempt()
        if needs is None:
            return result
        grow_to(needs)
    raise RuntimeError(f"{what} still overflowed after {max_regrowths} capacity increases")


@dataclasses.dataclass(frozen=True)
class Capacities:
    """The static sizes of one rank program (hashable).

    owned: owned rows per rank. exchange: slots of each halo exchange, in plan order.
    neighbors: the neighbour-list capacity (None: not sized yet). migrate: slots for atoms
    leaving a rank in one on-device rebuild (dynamics; 0 where nothing migrates).
    """

    owned: int
    exchange: tuple[int, ...] = ()
    neighbors: NeighborCapacity | None = None
    migrate: int = 0

    def __post_init__(self):
        object.__setattr__(self, "owned", int(self.owned))
        object.__setattr__(self, "exchange", tuple(int(c) for c in self.exchange))
        object.__setattr__(self, "migrate", int(self.migrate))

    @property
    def halo(self) -> tuple[int, tuple[int, ...]]:
        """(owned rows, exchange slots): the capacity argument of :func:`~jaxdd.decomposition.halo_plan.build_halo_plan`."""
        return self.owned, self.exchange

    def grown(self, factor: float, *, owned: int = 0, exchange=(), neighbors=None, migrate: int = 0) -> Capacities:
        """These capacities grown (:func:`grow`) to hold the needs given.

        Args:
          factor: growth factor (>= 1).
          owned, exchange, migrate: rows and slots needed.
          neighbors: a :class:`~jaxdd.neighbors.NeighborStats` the neighbour list needs, or None.
        """
        exchange = tuple(exchange) + (0,) * (len(self.exchange) - len(tuple(exchange)))
        nl = self.neighbors
        if neighbors is not None and nl is not None:
            nl = nl.grown(neighbors, factor)
        return Capacities(owned=grow(self.owned, owned, factor),
                          exchange=tuple(grow(c, n, factor) for c, n in zip(self.exchange, exchange)),
                          neighbors=nl, migrate=grow(self.migrate, migrate, factor))
