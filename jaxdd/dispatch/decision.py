"""What a rule returns for one equation (:class:`Decision`), and what the analysis of a
whole jaxpr gives (:class:`Plan`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .layouts import Layout

__all__ = ["Decision", "Plan"]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do with one equation under decomposition.

    outs: the :class:`~jaxdd.dispatch.Layout` of each output, one per ``eqn.outvars``.
    apply: ``apply(eqn, invals) -> list`` of output values, called inside ``shard_map``
        when the program runs (read the rank's :class:`~jaxdd.dispatch.Runtime` there);
        None re-binds the equation unchanged.
    rule: the name counted in the :class:`~jaxdd.dispatch.DispatchReport` each time
        ``apply`` runs (e.g. ``"reduce.sum"``); None counts nothing.
    notes: messages recorded as fallbacks (guesses, operations left rank-local).
    passive: ``apply`` changes no value (an identity): a body made only of such decisions
        is bound exactly as traced, custom derivative rules included.
    replicates: the outputs are the same on every rank (the action ends in a collective),
        so what is computed from them is not rank-dependent.
    resolves: the rule has accounted for the index spaces of its inputs itself (a total
        meeting row numbers rewritten soundly, a graph index recognised): the outputs' index
        spaces are the rule's, and no meeting is recorded (:mod:`jaxdd.dispatch.provenance`).
    guess: the outputs' layout is a guess from shape (an ``iota`` as long as the rows); its
        notes are dropped when every consumer confirms it.
    confirms: positions of the inputs whose guessed row layout this rule relies on soundly
        (the payload of a sort along those rows, an index tested against the atom count).
    refreshes: ``apply`` re-reads every ghost row of its per-node outputs from the owner, so
        none is ``stale`` whatever its inputs were (:class:`~jaxdd.dispatch.Layout`).
    """

    outs: tuple[Layout, ...]
    apply: Callable | None = None
    rule: str | None = None
    notes: tuple[str, ...] = ()
    passive: bool = False
    replicates: bool = False
    resolves: bool = False
    guess: bool = False
    confirms: tuple[int, ...] = ()
    refreshes: bool = False


@dataclasses.dataclass(frozen=True)
class Plan:
    """The analysis of one jaxpr for given input layouts.

    decisions: one :class:`Decision` per equation. outs: layouts of the jaxpr's outputs.
    active: some decision acts (so a call or loop around this jaxpr must be entered).
    notes: every decision's notes, in order, without repeats.
    """

    decisions: tuple[Decision, ...]
    outs: tuple[Layout, ...]
    active: bool
    notes: tuple[str, ...]
