"""Which named ops a model's single-device program calls, and the shapes of their outputs."""

from __future__ import annotations

from collections.abc import Iterable

import jax

from ..data import Batch
from ..dispatch.equations import equations

__all__ = ["named_op_outputs"]


def named_op_outputs(model, batch: Batch, names: Iterable[str]) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The output shapes of each op in ``names`` that ``model``'s forward calls on one device.

    Args:
      model: a model wrapper.
      batch: a Batch with its neighbour list (nothing is run: the forward is traced to a jaxpr).
      names: op handles ``"namespace::op"``.

    Returns:
      op name -> one shape per output, in output order, from the op's first call
      (a per-atom output has ``batch.n_atoms`` rows). Empty when the forward cannot be traced:
      callers use it as evidence for a hypothesis, never as a requirement.
    """
    wanted = set(names)
    if not wanted:
        return {}
    try:
        closed = jax.make_jaxpr(lambda b: model(b))(batch)
    except Exception:  # a courtesy for diagnostics; the comparison does not depend on it
        return {}
    found: dict[str, tuple[tuple[int, ...], ...]] = {}
    for eqn in equations(closed.jaxpr):
        # A registered op is a jit named after its handle (see jaxdd.ops.OpHandle).
        name = eqn.params.get("name")
        if name in wanted and name not in found:
            found[name] = tuple(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
    return found
