"""Specification of jaxdd.data.checks: integers given by users are never truncated."""

import re

import numpy as np
import pytest

from jaxdd.data.checks import integral, integral_array


@pytest.mark.parametrize("value", [3, 3.0, np.int64(3), np.float32(3.0), np.asarray(3)])
def test_an_integer_or_a_whole_float_is_accepted_as_an_int(value):
    got = integral("count", value)
    assert got == 3 and type(got) is int


@pytest.mark.parametrize("value", [18.7, 17.9999999, float("nan"), float("inf"), True, "3", None, [3]])
def test_anything_but_a_whole_number_is_refused_naming_the_field_and_the_value(value):
    with pytest.raises(ValueError, match=rf"^count must be an integer, got {re.escape(repr(value))}$"):
        integral("count", value)


def test_a_value_below_the_minimum_is_refused_with_the_bound():
    with pytest.raises(ValueError, match="count must be an integer >= 1, got 0"):
        integral("count", 0, minimum=1)


def test_an_array_of_whole_floats_becomes_integers():
    assert integral_array("z", [18.0, 1.0]).tolist() == [18, 1]


def test_an_array_with_fractions_is_refused_naming_the_entries_and_values():
    with pytest.raises(ValueError, match=r"z must be whole numbers; atoms \[1\] have \[17.9999999\]"):
        integral_array("z", [18.0, 17.9999999], what="atoms")


def test_a_bool_array_is_refused():
    with pytest.raises(ValueError, match="z must be integers, got an array of bool"):
        integral_array("z", [True, False])
