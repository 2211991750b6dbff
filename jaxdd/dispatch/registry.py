"""The rule registry: what each primitive, and each named call, means under decomposition.

A *rule* is ``rule(ctx, eqn, in_layouts) -> Decision``: ``ctx`` is the running
:class:`~jaxdd.dispatch.Dispatcher` (see its docstring for what a rule may use), ``eqn`` the
jaxpr equation, ``in_layouts`` the :class:`~jaxdd.dispatch.Layout` of each of its inputs.
Rules are looked up by the primitive's name; a name ending in ``*`` covers every primitive
whose name starts with what precedes it (``"reduce_*"``); a name ``"namespace::op"`` is a
*verb*: a ``jax.jit`` whose function carries that name (as the verbs of :mod:`jaxdd.dispatch.intent`
do), seen in a jaxpr as one ``jit`` equation. A primitive with no rule gets the
elementwise rule (:func:`jaxdd.dispatch.rules.elementwise.elementwise`).
"""

from __future__ import annotations

from collections.abc import Callable

from ..registry import Registry
from .report import DispatchError

__all__ = ["register_rule", "rule_for", "verb_rule", "registered_rules", "Rule", "RULES"]

#: The rule protocol: ``rule(ctx, eqn, in_layouts) -> Decision``. ``ctx`` is the running
#: :class:`~jaxdd.dispatch.Dispatcher`, ``eqn`` the jaxpr equation, ``in_layouts`` the
#: :class:`~jaxdd.dispatch.Layout` of each input of ``eqn``; the :class:`~jaxdd.dispatch.Decision`
#: gives the layout of each output (and any rewrite of the equation). A registered rule's own
#: docstring says in one line what it decides.
Rule = Callable

#: Every rule by the name it was registered under: a primitive's name, ``"prefix*"`` or a
#: ``"namespace::op"`` verb.
RULES: Registry[Rule] = Registry("dispatch rule", DispatchError)


def _name_of(primitive) -> str:
    name = primitive if isinstance(primitive, str) else getattr(primitive, "name", None)
    if not isinstance(name, str) or not name or name == "*":
        raise DispatchError(f"register_rule: the primitive must be a jax.extend.core.Primitive or its name "
                            f"(a 'namespace::op' verb name, or a 'prefix*'), got {primitive!r}")
    return name


def register_rule(primitive, rule: Rule | None = None, *, replace: bool = False):
    """Register ``rule`` as the distributed meaning of ``primitive``; returns ``rule``.

    Args:
        primitive: a ``jax.extend.core.Primitive`` or its name; ``"prefix*"`` for every
            primitive whose name starts with ``prefix``; ``"namespace::op"`` for a verb
            (a ``jax.jit`` whose function is named so).
        rule: ``rule(ctx, eqn, in_layouts) -> Decision`` (see :data:`Rule`). Omit it to use
            ``register_rule(p)`` as a decorator.
        replace: allow replacing a different rule already registered under that name
            (registering the same function again is always allowed).

    Returns:
        ``rule`` (so the call works as a decorator).
    """
    name = _name_of(primitive)
    if rule is None:
        return lambda r: register_rule(primitive, r, replace=replace)
    if not callable(rule):
        raise DispatchError(f"register_rule({name!r}, ...): the rule must be callable, got {rule!r}")
    return RULES.register(name, rule, replace=replace)


def rule_for(name: str) -> Rule | None:
    """The rule of the primitive called ``name``: its own, else the longest matching prefix's, else None."""
    rule = RULES.get(name)
    if rule is not None and "::" not in name:
        return rule
    prefixes = [p for p in RULES if p.endswith("*") and name.startswith(p[:-1])]
    return RULES[max(prefixes, key=len)] if prefixes else None


def verb_rule(name: str | None) -> Rule | None:
    """The rule of the verb (named ``jax.jit``) called ``name``, or None."""
    return RULES.get(name) if name is not None and "::" in name else None


def registered_rules() -> dict[str, Rule]:
    """Every registered rule by name (prefix rules end in ``*``); a copy."""
    return RULES.copy()
