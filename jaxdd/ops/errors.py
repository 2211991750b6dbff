"""The one error type of specs, policies, transforms and named ops."""

from __future__ import annotations

from typing import Any

__all__ = ["SpecError", "check_choice"]


class SpecError(ValueError):
    """A distribution spec, or a file holding one, is invalid; the message says what to do."""


def check_choice(owner: str, field: str, value: Any, choices: tuple[str, ...]) -> None:
    """Raise a :class:`SpecError` naming ``owner.field`` unless ``value`` is one of ``choices``.

    Args:
      owner: the class or spec section, for the message.
      field: the field checked, for the message.
      value: the value given.
      choices: the values allowed.
    """
    if value not in choices:
        raise SpecError(f"{owner}.{field} must be one of {list(choices)}, got {value!r}")
