"""Dispatch: run a single-device model under decomposition by re-interpreting its jaxpr.

The model is traced once on one rank's padded shapes; the resulting jaxpr is evaluated
again, equation by equation, inside ``shard_map`` (:mod:`.interpreter`). Every value
carries a :class:`Layout` known from provenance (:mod:`.layouts`): inputs are tagged
(positions per node, edge indices per edge and pointing at nodes, the system index
pointing at systems), and the rule registered for each primitive (:mod:`.registry`,
:mod:`.rules`) says how it moves the tag and what it means under the spec's storage
policy. Most equations are re-bound unchanged; a few get a distributed meaning:

- scatter-add into a per-node value: ``halo_correction`` → reverse then forward halo
  exchange; ``local`` → nothing (deep halo); refresh-only policy → forward only. Other
  scatters (max, min, set) into per-node values refresh the ghost rows.
- a reduction of per-node or per-edge values over atoms (``reduce_sum/max/min``, a
  ``dot_general`` contracting the atom axis, a scatter into per-system rows) → ghost and pad
  rows masked, then ``psum``/``pmax``/``pmin`` across ranks.
- a registered custom op with an :class:`~jaxdd.spec.OpAdapter` → its transforms; a verb
  (a named ``jax.jit`` with a registered rule, like those of :mod:`jaxdd.dispatch.intent`) → its
  distributed meaning.
- jit, closed_call, remat, custom_jvp/vjp, scan, cond and while are entered recursively when
  something inside them needs a rule, and re-bound untouched otherwise (so custom derivative
  rules survive wherever the body needs nothing).

The invariant kept: after every equation, ghost rows of a per-node value equal their owner's
row. Forces and stress are never computed here: the engine differentiates the re-interpreted
function from outside. Shape is consulted only where provenance says nothing, and every such
guess is recorded in the :class:`DispatchReport` (:mod:`.report`). The per-rank collectives
are the :class:`Runtime`'s (:mod:`.runtime`).

A primitive of one's own gets a distributed meaning with :func:`register_rule`.
"""

from .decision import Decision, Plan
from .layouts import ATOM_COUNT, OFFSETS, REPLICATED, TOTAL, Kind, Layout
from .registry import register_rule, registered_rules
from .report import DispatchError, DispatchReport, DispatchWarning, unfollowed_error, warn_fallbacks
from .runtime import Runtime
from .interpreter import Dispatcher, batch_layouts, call_model  # noqa: E402  (imports the rules, which register)

__all__ = ["Kind", "Layout", "REPLICATED", "ATOM_COUNT", "TOTAL", "OFFSETS", "DispatchError", "DispatchWarning", "DispatchReport", "Runtime",
           "Dispatcher", "Decision", "Plan", "batch_layouts", "call_model", "warn_fallbacks", "unfollowed_error", "register_rule",
           "registered_rules"]
