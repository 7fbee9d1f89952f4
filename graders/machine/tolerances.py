"""The one tolerance table of the graders, keyed by (device type, dtype, op kind).

A result passes where |got - expected| <= atol + rtol * |expected|, elementwise; NaN never passes.
Inputs are scaled so outputs are O(1) (x ~ N(0,1), A ~ N(0, 1/in), B ~ N(0, 1/r)), so atol is
meaningful. Every learner mistake the book anticipates moves outputs by O(1), far above these.
"""
from __future__ import annotations

import torch

__all__ = ["TOLERANCES", "tolerance"]

_F32, _F16, _BF16 = torch.float32, torch.float16, torch.bfloat16

#: (device_type, dtype, op) -> (rtol, atol, reason)
TOLERANCES: dict[tuple[str, torch.dtype, str], tuple[float, float, str]] = {
    ("cpu", _F32, "matmul"): (1e-5, 1e-5, "fp32, sums of <= a few hundred products in any order"),
    ("cuda", _F32, "matmul"): (1e-4, 1e-4, "fp32 on the GPU; a learner may enable TF32-free paths in any order"),
    ("cpu", _F16, "matmul"): (1e-2, 1e-2, "fp16 output rounding (2^-11) plus one rounded intermediate"),
    ("cuda", _F16, "matmul"): (1e-2, 1e-2, "fp16 output rounding (2^-11) plus one rounded intermediate"),
    ("cpu", _BF16, "matmul"): (3e-2, 3e-2, "bf16 keeps 8 bits: output rounding 2^-8 plus a rounded intermediate"),
    ("cuda", _BF16, "matmul"): (3e-2, 3e-2, "bf16 keeps 8 bits: output rounding 2^-8 plus a rounded intermediate"),
    # Triton kernels (chapter 03): the interpreter's fp32 tl.dot is exact; on the GPU a tl.dot of fp32
    # inputs uses TF32 (10-bit mantissa) unless the kernel asks for "ieee", and learners need not.
    ("cpu", _F32, "triton"): (1e-5, 1e-5, "the interpreter's fp32 tl.dot is exact numpy"),
    ("cuda", _F32, "triton"): (5e-3, 5e-3, "tl.dot on fp32 inputs is TF32 on the GPU: 2^-11 relative per product"),
    ("cpu", _F16, "triton"): (1e-2, 1e-2, "fp16 output rounding (2^-11) plus one rounded intermediate"),
    ("cuda", _F16, "triton"): (1e-2, 1e-2, "fp16 output rounding (2^-11) plus one rounded intermediate"),
    ("cuda", _BF16, "triton"): (3e-2, 3e-2, "bf16 keeps 8 bits: output rounding 2^-8 plus a rounded intermediate"),
    # paged attention (chapter 11): an online softmax (a running max, rescaled sums, split-KV partials
    # merged) against SDPA over the gathered keys: the same terms summed in another order; on the GPU
    # the 16-bit kernel rounds the probabilities to the cache dtype before P @ V, as FlashAttention does.
    ("cpu", _F32, "attention"): (1e-5, 1e-5, "fp32 online softmax vs SDPA: reordered sums of <= a few thousand terms"),
    ("cuda", _F32, "attention"): (1e-4, 1e-4, "fp32 (IEEE tl.dot) online softmax vs SDPA, reordered sums"),
    ("cpu", _F16, "attention"): (1e-2, 1e-2, "fp16 output rounding (2^-11) plus rounded probabilities"),
    ("cuda", _F16, "attention"): (1e-2, 1e-2, "fp16 output rounding (2^-11) plus rounded probabilities"),
    ("cpu", _BF16, "attention"): (3e-2, 3e-2, "bf16 keeps 8 bits: output rounding 2^-8 plus rounded probabilities"),
    ("cuda", _BF16, "attention"): (3e-2, 3e-2, "bf16 keeps 8 bits: output rounding 2^-8 plus rounded probabilities"),
    # fused elementwise kernels (chapter 11's engine: RMSNorm with the residual add, rotary embedding,
    # SiLU-and-mul) against the torch ops they replace: the same roundings, but the variance summed in
    # another order, and the interpreter casts to bf16 by truncation where the GPU rounds to nearest
    ("cpu", _F32, "elementwise"): (1e-5, 1e-5, "fp32: the mean square summed in another order"),
    ("cuda", _F32, "elementwise"): (1e-5, 1e-5, "fp32: the mean square summed in another order"),
    ("cpu", _F16, "elementwise"): (4e-3, 4e-3, "fp16: one rounding step (2^-11) from the variance's order or a cast"),
    ("cuda", _F16, "elementwise"): (4e-3, 4e-3, "fp16: one rounding step (2^-11) from the variance's order"),
    ("cpu", _BF16, "elementwise"): (2e-2, 2e-2, "bf16: one or two steps (2^-8): the interpreter truncates its casts"),
    ("cuda", _BF16, "elementwise"): (1e-2, 1e-2, "bf16: one rounding step (2^-8) from the variance's order"),
}

_MERGE_NOTE = "a merged weight rounds W + s*B@A once; accumulation order may differ"


def tolerance(device_type: str, dtype: torch.dtype, op: str) -> tuple[float, float, str]:
    """(rtol, atol, reason) for comparing a result of ``op`` in ``dtype`` on ``device_type``.

    Integer dtypes and ``op == "exact"`` compare exactly. ``merge`` uses the matmul row.

    Raises:
        KeyError: no row for this combination (add one with its reason).
    """
    if op == "exact" or not dtype.is_floating_point:
        return 0.0, 0.0, "exact: integer metadata or a pure gather"
    if op == "merge":
        rtol, atol, _ = TOLERANCES[(device_type, dtype, "matmul")]
        return rtol, atol, _MERGE_NOTE
    return TOLERANCES[(device_type, dtype, op)]
