"""The registry of auto-fix rules the validator tries, in order.

``FIX_RULES`` holds the built-in rules; a user adds one with :func:`register_fix_rule`::

    from jaxdd.validate import FixCandidate, register_fix_rule

    def drop_my_adapter(ctx):                  # ctx: FixContext of a failed attempt
        if not ctx.spec.distribution.custom_ops:
            return []
        return [FixCandidate(ctx.spec.replace(...), "why it may help", "what was wrong: the fix")]

    register_fix_rule("drop_my_adapter", drop_my_adapter, description="...")
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator

from .ghost_sums import add_scatter_outputs
from .rule import FixCandidate, FixContext, FixRule
from .spec_rules import add_all_reduce, deep_halo_for_unfollowed_values, drop_extra_all_reduce, halo_correction_to_local

__all__ = ["FIX_RULES", "FixRuleRegistry", "register_fix_rule"]


class FixRuleRegistry:
    """Fix rules in the order the validator tries their candidates.

    Iterating yields the rule names (as the tuple of names this used to be); ``rules()``
    gives the :class:`FixRule` objects.
    """

    def __init__(self, rules: Iterable[FixRule] = ()):
        self._rules: list[FixRule] = []
        for rule in rules:
            self.register(rule)

    def register(self, rule: FixRule | str, propose: Callable[[FixContext], Iterable[FixCandidate]] | None = None,
                 *, description: str = "", before: str | None = None, replace: bool = False) -> FixRule:
        """Add a rule, given as a :class:`FixRule` or as ``(name, propose)``; return it.

        Args:
          rule: a FixRule, or the name of a new one.
          propose: with a name: ``propose(ctx) -> candidates`` for a failed attempt's FixContext.
          description: with a name: what the rule fixes, in a sentence.
          before: the name of a rule to try this one ahead of (default: after all others).
          replace: allow a rule of the same name to be replaced (in place, unless ``before``).
        """
        if not isinstance(rule, FixRule):
            rule = FixRule(rule, propose, description)
        elif propose is not None:
            raise ValueError("pass a FixRule, or a name and its propose function, not both")
        at = self._index(rule.name)
        if at is not None and not replace:
            raise ValueError(f"fix rule {rule.name!r} is already registered; pass replace=True")
        if at is not None:
            if before is None:
                self._rules[at] = rule
                return rule
            del self._rules[at]
        if before is None:
            self._rules.append(rule)
        else:
            where = self._index(before)
            if where is None:
                raise ValueError(f"before={before!r}: no such fix rule (rules: {list(self)})")
            self._rules.insert(where, rule)
        return rule

    def unregister(self, name: str) -> FixRule:
        """Remove the rule ``name`` and return it."""
        at = self._index(name)
        if at is None:
            raise ValueError(f"no fix rule {name!r} (rules: {list(self)})")
        return self._rules.pop(at)

    def rules(self) -> tuple[FixRule, ...]:
        """The registered rules, in the order they are tried."""
        return tuple(self._rules)

    def propose(self, ctx: FixContext) -> list[tuple[str, FixCandidate]]:
        """(rule name, candidate) for a failed attempt (its FixContext ``ctx``), rules in order.
        A rule that raises is skipped with a warning naming it: one faulty rule must not end a
        validation."""
        out = []
        for rule in self._rules:
            try:
                out += [(rule.name, c) for c in rule.propose(ctx)]
            except Exception as exc:
                warnings.warn(f"fix rule {rule.name!r} raised {type(exc).__name__}: {exc}; skipped", RuntimeWarning,
                              stacklevel=2)
        return out

    def _index(self, name: str) -> int | None:
        return next((i for i, r in enumerate(self._rules) if r.name == name), None)

    def __iter__(self) -> Iterator[str]:
        return iter([r.name for r in self._rules])

    def __len__(self) -> int:
        return len(self._rules)

    def __contains__(self, name) -> bool:
        return self._index(name) is not None

    def __getitem__(self, name: str) -> FixRule:
        at = self._index(name)
        if at is None:
            raise KeyError(name)
        return self._rules[at]

    def __repr__(self) -> str:
        return f"FixRuleRegistry({list(self)})"


# The targeted rule first: it only fires for an op adapter with an untransformed per-atom
# output, and when it is right it names the op; the policy rules would otherwise "fix" the
# same run with a deep halo that costs far more and says nothing about the op.
FIX_RULES = FixRuleRegistry([
    FixRule("add_scatter_outputs", add_scatter_outputs,
            "an op adapter's per-atom output holds ghost partial sums: add ScatterOutputs on it"),
    FixRule("halo_correction_to_local", halo_correction_to_local,
            "a halo correction fired and outputs still differ: local scatters over a deep ghost shell"),
    FixRule("deep_halo_for_unfollowed_values", deep_halo_for_unfollowed_values,
            "the dispatch could not follow some values and outputs differ: local scatters over a deep ghost shell"),
    FixRule("add_all_reduce", add_all_reduce, "per-system outputs that are per-rank partials: all-reduce them"),
    FixRule("drop_extra_all_reduce", drop_extra_all_reduce,
            "all-reduced outputs that come out world_size times the reference: drop them"),
])


def register_fix_rule(rule: FixRule | str, propose: Callable[[FixContext], Iterable[FixCandidate]] | None = None,
                      *, description: str = "", before: str | None = None, replace: bool = False) -> FixRule:
    """Add a rule to :data:`FIX_RULES`; returns it.

    Args:
      rule, propose, description, before, replace: as for :meth:`FixRuleRegistry.register`.
    """
    return FIX_RULES.register(rule, propose, description=description, before=before, replace=replace)
