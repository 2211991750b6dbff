"""CHGNet in JAX, with the weights of its published models (:meth:`CHGNet.load`), read without
torch."""

from .checkpoint import PRETRAINED, UnsupportedCheckpoint
from .model import CHGNet

__all__ = ["CHGNet", "PRETRAINED", "UnsupportedCheckpoint"]
