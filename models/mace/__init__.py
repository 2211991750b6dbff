"""MACE in JAX, built natively or from a mace-torch model's weights (:meth:`MACE.from_torch`)."""

from .blocks import INTERACTIONS, READOUTS
from .model import MACE, export_torch
from .torch_import import UnsupportedModel

__all__ = ["MACE", "INTERACTIONS", "READOUTS", "export_torch", "UnsupportedModel"]
