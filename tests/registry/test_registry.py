"""One registry, one duplicate-name rule, at every extension point."""

from __future__ import annotations

import pytest

from jaxdd.registry import Registry, same_definition


def _define(body: str):
    namespace = {"__name__": "tests.registry.cell"}
    exec(body, namespace)  # a notebook cell run again: a new function of the same source
    return namespace["f"]


def test_a_registry_reads_like_a_mapping_in_registration_order():
    reg = Registry("widget")
    reg.register("b", 2)
    reg.register("a", 1)
    reg.register("c", 3, before="a")
    assert list(reg) == ["b", "c", "a"] and reg.names() == ("b", "c", "a")
    assert reg["c"] == 3 and reg.get("z") is None and "a" in reg and len(reg) == 3
    assert reg.items() == (("b", 2), ("c", 3), ("a", 1)) and reg.values() == (2, 3, 1)
    copy = reg.copy()
    copy["d"] = 4
    assert "d" not in reg
    assert reg.unregister("b") == 2 and "b" not in reg
    with pytest.raises(ValueError, match="no widget 'b'"):
        reg.unregister("b")
    with pytest.raises(ValueError, match="before='nope': no such widget"):
        reg.register("e", 5, before="nope")


def test_a_taken_name_refuses_a_different_value_naming_what_is_there():
    class Refused(Exception):
        pass

    reg = Registry("gadget", Refused)
    reg.register("x", same_definition)
    with pytest.raises(Refused, match=r"gadget 'x' is already registered \(jaxdd\.registry\.same_definition\); "
                                      r"pass replace=True"):
        reg.register("x", lambda: None)
    other = reg.register("x", len, replace=True)
    assert reg["x"] is other


def test_the_same_definition_run_again_is_allowed():
    reg = Registry("rule")
    first, again = _define("def f(x):\n    return x + 1\n"), _define("def f(x):\n    return x + 1\n")
    changed = _define("def f(x):\n    return x + 2\n")
    assert first is not again and same_definition(first, again) and not same_definition(first, changed)
    reg.register("f", first)
    assert reg.register("f", again) is again and reg["f"] is again
    with pytest.raises(ValueError, match="already registered"):
        reg.register("f", changed)


def test_a_class_defined_again_is_the_same_definition_unless_a_method_changed():
    def make(step):
        class Stepper:
            def step(self, x):
                return x + 1 if step == 1 else x + 2

        return Stepper

    a, b = make(1), make(1)
    assert same_definition(a, b)

    class Stepper:  # same qualname elsewhere: another definition
        def step(self, x):
            return x

    assert not same_definition(a, Stepper)


def test_data_entries_are_the_same_when_equal():
    reg = Registry("namespace")
    reg.register("ns", ("a.b",))
    assert reg.register("ns", ("a.b",)) == ("a.b",)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("ns", ("a.c",))
