"""Small helpers shared by the book's Triton ops (host side only)."""
from __future__ import annotations

import torch
import triton

from reference.device import interpreting

__all__ = ["upcast", "next_pow2_at_least", "check_same_device", "tl_float32_dot"]


def upcast(*tensors: torch.Tensor) -> bool:
    """True when kernels must convert 16-bit loads to fp32 before arithmetic.

    Triton's CPU interpreter computes bf16 arithmetic and bf16 ``tl.dot`` wrongly without an error;
    on the GPU the native bf16 dot (with fp32 accumulation) is both right and fast.
    """
    return interpreting()


def tl_float32_dot(*tensors: torch.Tensor) -> bool:
    """True when every input is fp32: the kernel then asks ``tl.dot`` for IEEE fp32, not TF32."""
    return all(t.dtype == torch.float32 for t in tensors)


def next_pow2_at_least(n: int, floor: int = 16) -> int:
    """Block size covering ``n``, at least ``floor`` (a GPU ``tl.dot`` needs K, N >= 16)."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


def check_same_device(*tensors: torch.Tensor) -> None:
    """Raises ValueError if the tensors are not all on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")
