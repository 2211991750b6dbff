"""The compiled programs jaxdd holds, and the bound that keeps a long-lived process alive.

XLA's CPU backend maps the code of every compiled program into the process as separate small
memory mappings, about three per fused kernel: a few hundred for a jaxdd force program, more
for a distributed one, against a handful for a small ``jax.jit`` function. The mappings stay
until the program is dropped, and Linux allows a process ``vm.max_map_count`` of them
(65,530 by default); past that, XLA's compiler fails ("LLVM compilation error: Cannot
allocate memory") and the process dies. No XLA flag reduces the count per program.

So jaxdd does two things. Its capacities come in buckets (:func:`jaxdd.neighbors.capacity_bucket`),
so systems of similar size share one program. And it bounds what its own entry points hold:
before :func:`jaxdd.compute` or a :class:`~jaxdd.DistributedModel` call, if a program was
compiled since the last look and the process's mappings exceed :data:`MAP_FRACTION` of
``vm.max_map_count``, every program held by jaxdd's entry points is dropped (each is compiled
again when next needed). Programs of other code in the process (your own ``jax.jit``
functions) are not touched. Where ``/proc/self/maps`` does not exist (not Linux) only the
buckets apply.
"""

from __future__ import annotations

__all__ = ["MAP_FRACTION", "track", "held", "release", "check", "mapped", "map_limit"]

#: Share of ``vm.max_map_count`` above which jaxdd drops the programs it holds (None: never).
MAP_FRACTION = 0.5

#: Times the programs were dropped in this process.
releases = 0

_TRACKED: list = []  # jitted functions whose compiled programs jaxdd may drop
_seen = 0  # programs held at the last check
_after_release = None  # mappings counted right after the last drop


def _jitted(fn):
    """The ``jax.jit`` object under ``fn`` (an equinox filter_jit wrapper keeps it in ``_cached``)."""
    inner = getattr(fn, "_cached", fn)
    return inner if hasattr(inner, "_cache_size") and hasattr(inner, "clear_cache") else None


def track(fn):
    """Register a jitted function whose programs jaxdd may drop; returns ``fn`` (a decorator)."""
    if _jitted(fn) is not None:
        _TRACKED.append(fn)
    return fn


def held() -> int:
    """Compiled programs the tracked functions hold now."""
    return sum(_jitted(fn)._cache_size() for fn in _TRACKED)


def release() -> int:
    """Drop every program the tracked functions hold; returns how many were dropped."""
    global _seen, releases
    n = held()
    for fn in _TRACKED:
        _jitted(fn).clear_cache()
    _seen = 0
    releases += 1
    return n


def mapped() -> int | None:
    """Memory mappings of this process now (lines of ``/proc/self/maps``), or None where unknown."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def map_limit() -> int | None:
    """Mappings above which jaxdd drops its programs: :data:`MAP_FRACTION` of ``vm.max_map_count``."""
    if MAP_FRACTION is None:
        return None
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(MAP_FRACTION * int(f.read()))
    except (OSError, ValueError):
        return None


def check() -> bool:
    """Drop jaxdd's programs when the process's mappings are over :func:`map_limit`.

    Cheap unless a tracked program was compiled since the last check (only then are the
    mappings counted). Returns True when programs were dropped."""
    global _seen, _after_release
    now = held()
    if now <= _seen:
        _seen = now
        return False
    _seen = now
    count, limit = mapped(), map_limit()
    if count is None or limit is None or count <= limit:
        _after_release = None
        return False
    # Programs jaxdd does not hold (a dynamics loop, the user's own) may keep the count above
    # the limit after a drop. Drop again only once jaxdd's new programs have added a real share
    # of the limit since the last drop: else every call would drop and compile afresh.
    if _after_release is not None and count - _after_release < limit // 8:
        return False
    release()
    _after_release = mapped()
    return True
