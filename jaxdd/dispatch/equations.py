"""Reading and re-binding one jaxpr equation: what every rule needs from JAX's IR."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from jax.extend import core as jcore

__all__ = ["bind", "enclosing", "equations", "is_literal", "scan_counts", "shape_of", "sub_jaxpr", "where"]


def bind(eqn, invals) -> list:
    """``eqn``'s primitive bound again on ``invals`` with its own parameters; a list of outputs."""
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


def is_literal(v) -> bool:
    """True when ``v`` is a constant written into the jaxpr (it has no layout of its own)."""
    return isinstance(v, jcore.Literal)


def shape_of(v) -> tuple[int, ...]:
    """The static shape of a jaxpr variable ``v`` (``()`` for scalars and tokens)."""
    return tuple(getattr(v.aval, "shape", ()))


def sub_jaxpr(closed_or_open, consts=None):
    """``(jaxpr, consts)`` of a sub-jaxpr parameter ``closed_or_open`` (an open one takes ``consts``)."""
    if hasattr(closed_or_open, "jaxpr") and hasattr(closed_or_open, "consts"):
        return closed_or_open.jaxpr, closed_or_open.consts
    return closed_or_open, (consts or ())


def scan_counts(params) -> tuple[int, int]:
    """``(consts, carry)``: how many of a ``scan`` equation's inputs are loop constants and how
    many the carry, read from its ``params``; the scanned inputs follow. JAX before 0.11 names the
    counts (``num_consts``, ``num_carry``); from 0.11 they are the first two groups of ``ft_in``."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


# The user's lines of the calls being analysed, innermost last: an equation inside a library's
# jit (jnp.repeat's, say) has no user frame of its own, but the call that traced it does.
_ENCLOSING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("jaxdd_enclosing_lines", default=())


def _user_line(eqn) -> str | None:
    try:
        from jax._src import source_info_util

        frame = source_info_util.user_frame(eqn.source_info.traceback)
        if frame is not None:
            return f"{frame.file_name.rsplit('/', 1)[-1]}:{frame.start_line}"
    except Exception:  # source information is a courtesy; never fail on it
        pass
    return None


def equations(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` and, recursively, of the jaxprs in its equations' parameters
    (jit bodies, custom derivatives, scan/while/cond bodies and branches, remat)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _nested(value):
                yield from equations(sub)


def _nested(value) -> Iterator:
    if hasattr(value, "eqns"):  # a Jaxpr
        yield value
    elif hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a ClosedJaxpr
        yield value.jaxpr
    elif isinstance(value, (tuple, list)):  # cond branches
        for v in value:
            yield from _nested(v)


def where(eqn) -> str:
    """A short ``file:line (primitive)`` of the user code that produced ``eqn`` (the line of the
    enclosing call when ``eqn`` lies inside a library's function)."""
    line = _user_line(eqn)
    if line is None and _ENCLOSING.get():
        line = _ENCLOSING.get()[-1]
    return f"{line} ({eqn.primitive.name})" if line is not None else eqn.primitive.name


@contextlib.contextmanager
def enclosing(eqn):
    """While a rule analyses ``eqn`` (and any body it holds), its user line stands in for the
    lines of equations inside that have none."""
    line = _user_line(eqn)
    if line is None:
        yield
        return
    token = _ENCLOSING.set(_ENCLOSING.get() + (line,))
    try:
        yield
    finally:
        _ENCLOSING.reset(token)
