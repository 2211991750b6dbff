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

from .report import DispatchError

__all__ = ["register_rule", "rule_for", "verb_rule", "registered_rules", "Rule"]

#: ``rule(ctx, eqn, in_layouts) -> Decision``.
Rule = Callable

_EXACT: dict[str, Rule] = {}
_PREFIX: dict[str, Rule] = {}
_VERBS: dict[str, Rule] = {}


def _name_of(primitive) -> str:
    name = primitive if isinstance(primitive, str) else getattr(primitive, "name", None)
    if not isinstance(name, str) or not name or name == "*":
        raise DispatchError(f"register_rule: the primitive must be a jax.extend.core.Primitive or its name "
                            f"(a 'namespace::op' verb name, or a 'prefix*'), got {primitive!r}")
    return name


def _same_rule(a: Rule, b: Rule) -> bool:
    """True for the same function, or the same function defined again (a module or notebook run twice)."""
    if a is b:
        return True
    keys = ("__module__", "__qualname__", "__code__")
    return all(getattr(a, k, None) is not None and getattr(a, k, None) == getattr(b, k, None) for k in keys)


def register_rule(primitive, rule: Rule | None = None, *, replace: bool = False):
    """Register ``rule`` as the distributed meaning of ``primitive``; returns ``rule``.

    Args:
        primitive: a ``jax.extend.core.Primitive`` or its name; ``"prefix*"`` for every
            primitive whose name starts with ``prefix``; ``"namespace::op"`` for a verb
            (a ``jax.jit`` whose function is named so).
        rule: ``rule(ctx, eqn, in_layouts) -> Decision``. Omit it to use
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
    table, key = (_VERBS, name) if "::" in name else (_PREFIX, name[:-1]) if name.endswith("*") else (_EXACT, name)
    old = table.get(key)
    if old is not None and not replace and not _same_rule(old, rule):
        raise DispatchError(f"a dispatch rule for {name!r} is already registered "
                            f"({getattr(old, '__module__', '?')}.{getattr(old, '__qualname__', old)}); "
                            "pass replace=True to replace it")
    table[key] = rule
    return rule


def rule_for(name: str) -> Rule | None:
    """The rule of the primitive called ``name``: its own, else the longest matching prefix's, else None."""
    rule = _EXACT.get(name)
    if rule is not None:
        return rule
    prefixes = [p for p in _PREFIX if name.startswith(p)]
    return _PREFIX[max(prefixes, key=len)] if prefixes else None


def verb_rule(name: str | None) -> Rule | None:
    """The rule of the verb (named ``jax.jit``) called ``name``, or None."""
    return _VERBS.get(name) if name is not None else None


def registered_rules() -> dict[str, Rule]:
    """Every registered rule by name (prefix rules end in ``*``); a copy."""
    return {**_EXACT, **{p + "*": r for p, r in _PREFIX.items()}, **_VERBS}
