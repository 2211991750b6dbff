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
from collections.abc import Callable, Iterable

from ..registry import Registry
from .ghost_sums import add_scatter_outputs
from .rule import FixCandidate, FixContext, FixRule
from .spec_rules import add_all_reduce, deep_halo_for_unfollowed_values, drop_extra_all_reduce, halo_correction_to_local

__all__ = ["FIX_RULES", "FixRuleRegistry", "register_fix_rule"]


class FixRuleRegistry(Registry[FixRule]):
    """Fix rules by name, in the order the validator tries their candidates.

    A :class:`~jaxdd.registry.Registry`: iterating yields the rule names, ``registry[name]``
    the :class:`FixRule`, ``rules()`` all of them in order.

    Args:
      rules: the rules to start with, in order.
    """

    def __init__(self, rules: Iterable[FixRule] = ()):
        super().__init__("fix rule", ValueError, definition=lambda rule: rule.propose)
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
          replace: allow a different rule of the same name to be replaced (in place, unless ``before``).
        """
        if not isinstance(rule, FixRule):
            rule = FixRule(rule, propose, description)
        elif propose is not None:
            raise ValueError("pass a FixRule, or a name and its propose function, not both")
        return super().register(rule.name, rule, replace=replace, before=before)

    def rules(self) -> tuple[FixRule, ...]:
        """The registered rules, in the order they are tried."""
        return self.values()

    def propose(self, ctx: FixContext) -> list[tuple[str, FixCandidate]]:
        """(rule name, candidate) for a failed attempt (its FixContext ``ctx``), rules in order.
        A rule that raises is skipped with a warning naming it: one faulty rule must not end a
        validation."""
        out = []
        for rule in self.values():
            try:
                out += [(rule.name, c) for c in rule.propose(ctx)]
            except Exception as exc:
                warnings.warn(f"fix rule {rule.name!r} raised {type(exc).__name__}: {exc}; skipped", RuntimeWarning,
                              stacklevel=2)
        return out


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
