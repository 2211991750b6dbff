"""MACE in JAX, built natively or from a mace-torch model's weights (:meth:`MACE.from_torch`)."""

from .model import INTERACTIONS, MACE
from .torch_import import UnsupportedModel, export_torch

__all__ = ["MACE", "INTERACTIONS", "export_torch", "UnsupportedModel"]
