"""The one error type of specs, policies, transforms and named ops."""

from __future__ import annotations

from typing import Any

__all__ = ["SpecError", "check_choice", "check_always_true"]


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


def check_always_true(owner: str, field: str, value: Any, why: str) -> None:
    """Raise a :class:`SpecError` unless the flag ``owner.field`` is True: a field of the
    version-2 schema that jaxdd keeps for files to read the same but supports only as True.

    Args:
      owner: the class or spec section, for the message.
      field: the flag checked, for the message.
      value: the value given (a bool).
      why: what jaxdd does instead, the reason False is refused.
    """
    if not isinstance(value, bool):
        raise SpecError(f"{owner}.{field} must be a bool, got {value!r}")
    if not value:
        raise SpecError(f"{owner}.{field}=False: {why}")
