"""The one owner of the device choice for the whole book.

Importing :mod:`reference` calls :func:`configure_triton` before anything imports triton: with no
CUDA device present it sets ``TRITON_INTERPRET=1``, so every ``@triton.jit`` kernel of the book (and
of a learner) runs in Triton's CPU interpreter. The graders' child processes import ``reference``
first for the same reason. Nothing else in the project reads or writes that variable.
"""
from __future__ import annotations

import os

import torch

__all__ = ["cuda_available", "configure_triton", "default_device", "interpreting"]


def cuda_available() -> bool:
    """True when torch sees a usable CUDA device."""
    return torch.cuda.is_available()


def configure_triton() -> None:
    """Set ``TRITON_INTERPRET=1`` when there is no CUDA device; never override a value already set.

    Must run before the first ``@triton.jit`` is decorated: the interpreter flag is read then.
    """
    if not cuda_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_device() -> torch.device:
    """``cuda`` when a CUDA device is present, else ``cpu``: where graders and notebooks run."""
    return torch.device("cuda" if cuda_available() else "cpu")
