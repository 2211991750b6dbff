"""The model factory the validator is given: resolved from a callable or a ``"module:qualname"``
(what a child process receives), and called to build the model wrapper, with a
:class:`ModelFactoryError` that names the factory when it cannot."""

from __future__ import annotations

from ..spec.adapters import reference_of, resolve_reference
from ..ops import SpecError
from ..model.protocol import model_config

__all__ = ["ModelFactoryError", "resolve_factory", "build_model"]


class ModelFactoryError(ValueError):
    """The model factory cannot build a model: it raised, or returned something that is not a
    model wrapper. The message names the factory and the cause."""


def resolve_factory(model_factory):
    """The factory callable, and a reference to it that a fresh process can import.

    Args:
        model_factory: a zero-argument callable, or its ``"module:function"`` string, resolved by
            import (what a worker process receives).

    Returns:
        ``(factory, reference)``: the callable, and its ``"module:qualname"`` (None when the
        callable cannot be imported by name, e.g. a lambda or a local function).
    """
    if isinstance(model_factory, str):
        fn = resolve_reference(model_factory, "model_factory")
        if not callable(fn):
            raise SpecError(f"model_factory {model_factory!r} is not callable")
        return fn, model_factory
    if not callable(model_factory):
        raise ValueError(f"model_factory must be a callable or a 'module:qualname' string, got {model_factory!r}")
    return model_factory, reference_of(model_factory)


def build_model(factory, name: str):
    """``factory()``, checked to be a model wrapper.

    Args:
        factory: the zero-argument callable of :func:`resolve_factory`.
        name: how the factory is named in an error (its reference, or its repr).

    Returns:
        The model wrapper; :class:`ModelFactoryError` naming ``name`` when the factory raises
        or returns something without a ``ModelConfig``.
    """
    try:
        model = factory()
    except Exception as exc:
        cause = (str(exc).strip().splitlines() or [""])[0]
        raise ModelFactoryError(f"model factory {name} raised {type(exc).__name__}"
                                + (f": {cause}" if cause else "") + "; fix it so that it builds the model") from exc
    try:
        model_config(model)
    except ValueError:
        shown = repr(model)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ModelFactoryError(f"model factory {name} returned {shown} ({type(model).__name__}), not a model "
                                "wrapper: it has no ModelConfig in .model_config; return an instance of a "
                                "jaxdd.BaseModel subclass") from None
    return model
