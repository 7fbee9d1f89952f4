"""Fused decode LoRA in Triton: shrink and expand in one launch; the intermediate never leaves the chip.

Source: the fused "shrink+expand" decode kernels of vLLM (``vllm/lora/ops/triton_ops``) and the
launch-bound analysis of decode in the book's chapter 03: at 64 requests the LoRA bytes take about a
microsecond at HBM speed while each launch costs several, so one launch instead of two matters.

Call signature (as ``reference.ops.torch_ref.fused_decode``)::

    fused_decode(x, A_stack, B_stack, batch_info, out) -> out

Semantics:
    s = token_slots[tok]; r = lora_ranks[s]
    out[tok] += scalings[s] * (x[tok] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
One program per (token, output split): it computes the token's shrink in registers (fp32), rounds
it to x.dtype as a two-kernel path would, then expands over its share of the output columns.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import check_same_device, next_pow2_at_least

__all__ = ["fused_decode"]


@triton.jit
def _fused_decode_kernel(
    # pointers
    x_ptr, a_ptr, b_ptr, out_ptr,
    # sizes
    K, N, n_per_split,
    # strides
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_bs, stride_bn, stride_br,
    stride_om, stride_on,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tok = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(token_slots_ptr + tok)
    rank = tl.load(lora_ranks_ptr + slot)
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    # phase 1: shrink, t = A[slot, :r] @ x[tok], kept in registers
    offs_k = tl.arange(0, BLOCK_K)
    acc_t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_row = tl.load(x_ptr + tok * stride_xm + (k * BLOCK_K + offs_k) * stride_xk, mask=k_mask, other=0.0)
        a_tile = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar
                         + (k * BLOCK_K + offs_k)[None, :] * stride_ak,
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)
        acc_t += tl.sum(a_tile.to(tl.float32) * x_row.to(tl.float32)[None, :], axis=1)
    t = acc_t.to(x_ptr.dtype.element_ty).to(tl.float32)  # the rounding a two-kernel path has
    scaling = tl.load(scalings_ptr + slot)
    # phase 2: expand this program's share of the output columns, in place
    n_start = split * n_per_split
    for n in range(0, tl.cdiv(n_per_split, BLOCK_N)):
        offs_n = n_start + n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < N) & (offs_n < n_start + n_per_split)
        b_tile = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                         mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        delta = tl.sum(b_tile.to(tl.float32) * t[None, :], axis=1)
        out_ptrs = out_ptr + tok * stride_om + offs_n * stride_on
        base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (base + scaling * delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def fused_decode(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out], updated in place
    num_splits: int = 8,
    block_k: int = 256,
    block_n: int = 128,
) -> torch.Tensor:
    """Launch the fused decode kernel (see the module docstring). Returns ``out``.

    ``num_splits`` programs share one token's output columns; each recomputes the (small) shrink,
    which trades re-reading A from L2 for more programs in flight.

    Raises:
        ValueError: mismatched shapes or devices, or no ``token_slots``.
    """
    check_same_device(x, A_stack, B_stack, out)
    if batch_info.token_slots is None or batch_info.token_slots.shape[0] != x.shape[0]:
        raise ValueError("fused_decode needs batch_info.token_slots with one slot per row of x")
    if x.shape[1] != A_stack.shape[2] or out.shape != (x.shape[0], B_stack.shape[1]) or A_stack.shape[1] != B_stack.shape[2]:
        raise ValueError(f"shapes x {list(x.shape)}, A_stack {list(A_stack.shape)}, "
                         f"B_stack {list(B_stack.shape)}, out {list(out.shape)}")
    if x.shape[0] == 0:
        return out
    n = out.shape[1]
    splits = max(1, min(num_splits, triton.cdiv(n, block_n)))
    n_per_split = triton.cdiv(n, splits)
    _fused_decode_kernel[(x.shape[0], splits)](
        x, A_stack, B_stack, out, x.shape[1], n, n_per_split,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        B_stack.stride(0), B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
        batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
        BLOCK_R=next_pow2_at_least(A_stack.shape[1], floor=16), BLOCK_K=block_k, BLOCK_N=block_n,
    )
    return out
