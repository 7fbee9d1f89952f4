"""BGMV shrink in Triton: every token gathers its own slot's A (the decode case).

Source: Punica's BGMV (Chen et al., 2023); vLLM ``vllm/lora/ops/triton_ops/`` (per-token lora
indices) and SGLang's decode path.

Call signature (as ``reference.ops.torch_ref.bgmv_shrink``)::

    bgmv_shrink(x, A_stack, batch_info, out, stack_num=1) -> out

Semantics:
    s = token_slots[tok]; r = lora_ranks[s]
    out[tok, :stack_num*r] = x[tok] @ A_stack[s, :stack_num*r].T      (fp32 accumulation)
Reads only ``token_slots`` (and ``lora_ranks``). One program per (token, column tile): a GEMV, so
the product is an elementwise multiply and a row sum, not a ``tl.dot`` (M = 1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import check_same_device, next_pow2_at_least, upcast

__all__ = ["bgmv_shrink"]


@triton.jit
def _bgmv_shrink_kernel(
    # pointers
    x_ptr, a_ptr, out_ptr,
    # sizes
    K,
    # strides
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_om, stride_on,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr,
    # constexpr
    STACK_NUM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):
    # offsets in int64: a row (or slot) index times its stride passes 2^31 elements at real sizes
    # (x [600000, 4096], out [80000, 28672]), where an int32 offset wraps to an illegal address.
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr and stays a constant (contiguous loads).
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_as, stride_an = tl.cast(stride_as, tl.int64), tl.cast(stride_an, tl.int64)
    stride_ak, stride_om = tl.cast(stride_ak, tl.int64), tl.cast(stride_om, tl.int64)
    stride_on = tl.cast(stride_on, tl.int64)
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(token_slots_ptr + tok)
    width = tl.load(lora_ranks_ptr + slot) * STACK_NUM
    if (width == 0) | (pid_n * BLOCK_N >= width):
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < width
    x_ptrs = x_ptr + tok * stride_xm + offs_k * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :] * stride_ak
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_row = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        a_tile = tl.load(a_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a_tile * x_row[None, :], axis=1)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    tl.store(out_ptr + tok * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


def bgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, stack_num * max_rank, in]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, >= stack_num * max_rank]
    stack_num: int = 1,
    block_k: int = 4096,
    num_warps: int = 16,
) -> torch.Tensor:
    """Launch the BGMV shrink kernel (see the module docstring). Returns ``out``.

    Raises:
        ValueError: mismatched shapes or devices, or no ``token_slots`` in ``batch_info``.
    """
    check_same_device(x, A_stack, out)
    if batch_info.token_slots is None or batch_info.token_slots.shape[0] != x.shape[0]:
        raise ValueError("bgmv_shrink needs batch_info.token_slots with one slot per row of x")
    width = A_stack.shape[1]
    if x.shape[1] != A_stack.shape[2] or out.shape[0] != x.shape[0] or out.shape[1] < width:
        raise ValueError(f"shapes x {list(x.shape)}, A_stack {list(A_stack.shape)}, out {list(out.shape)}")
    if x.shape[0] == 0:
        return out
    block_n = next_pow2_at_least(width, floor=16)
    block_k = min(block_k, max(64, 65536 // block_n))  # one tile of A stays in registers
    grid = (x.shape[0], triton.cdiv(width, block_n))
    _bgmv_shrink_kernel[grid](
        x, A_stack, out, x.shape[1],
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.token_slots, batch_info.lora_ranks,
        STACK_NUM=stack_num, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast(x),
        num_warps=num_warps,
    )
    return out
