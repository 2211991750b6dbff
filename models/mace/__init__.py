"""MACE in JAX, built natively or from a mace-torch model's weights (:meth:`MACE.from_torch`)."""

from .model import INTERACTIONS, MACE, export_torch
from .torch_import import UnsupportedModel

__all__ = ["MACE", "INTERACTIONS", "export_torch", "UnsupportedModel"]
