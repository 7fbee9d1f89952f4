"""Reference implementation of the multi-LoRA serving book (``import reference``).

It contains the solution of every exercise: self-study with it installed is an honor system.
Importing it fixes the device choice first (see :mod:`reference.device`).
"""
from reference.device import configure_triton as _configure_triton

_configure_triton()

from reference.device import cuda_available, default_device, interpreting  # noqa: E402

__all__ = ["cuda_available", "default_device", "interpreting"]
