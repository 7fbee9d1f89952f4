"""Small helpers shared by the book's Triton ops: host-side checks, the split-K partials' reduction
for the ops that tile t, and the device helper with which the per-token expand sums them instead."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference.device import interpreting

__all__ = ["upcast", "next_pow2_at_least", "check_same_device", "tl_float32_dot", "shrink_rows", "summed_partials",
           "load_summed"]


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


def shrink_rows(t: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """What a kernel reading a shrink's output needs: ``(S, rows, stride_s)``.

    ``t`` [num_tokens, width] -> (1, t, 0); the split-K shrink's fp32 partials [S, num_tokens, width]
    (``bgmv_shrink`` with a 3-D out) -> (S, t[0], t.stride(0)), whose sum over S is the shrink.

    Raises:
        ValueError: t neither 2-D nor 3-D, or 3-D partials not in float32.
    """
    if t.dim() == 2:
        return 1, t, 0
    if t.dim() == 3 and t.dtype == torch.float32:
        return t.shape[0], t[0], t.stride(0)
    raise ValueError(f"t must be [num_tokens, width] or fp32 split-K partials [S, num_tokens, width], got "
                     f"{list(t.shape)} ({t.dtype})")


def summed_partials(t: torch.Tensor) -> torch.Tensor:
    """t as one [num_tokens, width] tensor: 2-D as it is; the split-K shrink's fp32 partials
    [S, num_tokens, width] summed by one torch reduction (fp32).

    For the kernels that load t as [rows, rank] tiles for ``tl.dot`` (SGMV's expand, the fused
    GEMM's epilogue): summed inside them, the S partial tiles are live together and spill (an H200
    expand at 16 partials: 352 against 44 us, ``benchmarks/results/decode_expand_s16_h200.json``).
    The per-token expand, which loads one row, sums them as it loads (:func:`load_summed`).

    Raises:
        ValueError: as :func:`shrink_rows`.
    """
    shrink_rows(t)
    return t.sum(0) if t.dim() == 3 else t


@triton.jit
def load_summed(ptrs, stride_s, mask, NUM_SPLITS: tl.constexpr):
    """Load a tile of the shrink's output: with NUM_SPLITS > 1 the sum of its fp32 split-K partials
    (``stride_s`` apart), added as they are loaded, so the split needs no reduction kernel."""
    stride_s = tl.cast(stride_s, tl.int64)  # S * stride_s passes 2^31 at real sizes, as every stride here
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):
        acc += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
    return acc
