"""The book's LoRA ops. ``reference.ops.torch_ref`` holds the plain-PyTorch references."""
from reference.ops import torch_ref

__all__ = ["torch_ref"]
