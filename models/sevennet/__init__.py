"""SevenNet in JAX, with the weights of its published checkpoints (:meth:`SevenNet.from_checkpoint`),
read without torch."""

from .checkpoint import PRETRAINED, UnsupportedCheckpoint
from .model import E3NN_TORCH_SILU_CONSTANT, SevenNet

__all__ = ["SevenNet", "PRETRAINED", "UnsupportedCheckpoint", "E3NN_TORCH_SILU_CONSTANT"]
