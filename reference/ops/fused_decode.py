"""Fused decode LoRA in Triton: shrink and expand in one launch; the intermediate never leaves the chip.

Source: the fused "shrink+expand" decode kernels of vLLM (``vllm/lora/ops/triton_ops``) and the
launch-bound analysis of decode in the book's chapter 03: at 64 requests the LoRA bytes take about a
microsecond at HBM speed while each launch costs several, so one launch instead of two matters.

Call signature (as ``reference.ops.torch_ref.fused_decode``)::

    fused_decode(x, A_stack, B_stack, batch_info, out) -> out

Semantics:
    s = token_slots[tok]; r = lora_ranks[s]
    out[tok] += scalings[s] * (x[tok] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
Two schedules, same result:

- ``"token"``: one program per (token, output split). It computes the token's shrink in registers
  (fp32), rounds it to x.dtype as a two-kernel path would, then expands its share of the columns.
  Every token reads its adapter's whole A: simple, but each program streams 128 KB alone.
- ``"slot"``: one program per (slot, output split). It scans ``token_slots`` for its tokens, reads
  the slot's A once for all of them (a ``tl.dot`` over a masked block of token rows), then expands.
  Adapters shared by many tokens are read once per split instead of once per token.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import check_same_device, next_pow2_at_least, tl_float32_dot, upcast

__all__ = ["fused_decode", "default_config"]


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
    # offsets in int64: a row (or slot) index times its stride passes 2^31 elements at real sizes
    # (x [600000, 4096], out [80000, 28672]), where an int32 offset wraps to an illegal address.
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr and stays a constant (contiguous loads).
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_as, stride_ar = tl.cast(stride_as, tl.int64), tl.cast(stride_ar, tl.int64)
    stride_ak, stride_bs = tl.cast(stride_ak, tl.int64), tl.cast(stride_bs, tl.int64)
    stride_bn, stride_br = tl.cast(stride_bn, tl.int64), tl.cast(stride_br, tl.int64)
    stride_om, stride_on = tl.cast(stride_om, tl.int64), tl.cast(stride_on, tl.int64)
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


@triton.jit
def _fused_decode_by_slot_kernel(
    # pointers
    x_ptr, a_ptr, b_ptr, out_ptr,
    # sizes
    T, K, N, n_per_split,
    # strides
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_bs, stride_bn, stride_br,
    stride_om, stride_on,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # offsets in int64, as in _fused_decode_kernel
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_as, stride_ar = tl.cast(stride_as, tl.int64), tl.cast(stride_ar, tl.int64)
    stride_ak, stride_bs = tl.cast(stride_ak, tl.int64), tl.cast(stride_bs, tl.int64)
    stride_bn, stride_br = tl.cast(stride_bn, tl.int64), tl.cast(stride_br, tl.int64)
    stride_om, stride_on = tl.cast(stride_om, tl.int64), tl.cast(stride_on, tl.int64)
    slot = tl.program_id(0)
    split = tl.program_id(1)
    rank = tl.load(lora_ranks_ptr + slot)
    if rank == 0:
        return
    scaling = tl.load(scalings_ptr + slot)
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < rank
    n_start = split * n_per_split
    for tb in range(0, tl.cdiv(T, BLOCK_T)):
        # which rows of this token block belong to this slot (reads token_slots only)
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        mine = tl.load(token_slots_ptr + offs_t, mask=offs_t < T, other=-1) == slot
        # phase 1: shrink for all of them at once, t = x[mine] @ A[slot, :r].T
        acc_t = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k_mask = offs_k < K - k * BLOCK_K
            x_tile = tl.load(x_ptr + offs_t[:, None] * stride_xm + (k * BLOCK_K + offs_k)[None, :] * stride_xk,
                             mask=mine[:, None] & k_mask[None, :], other=0.0)
            a_tile = tl.load(a_ptr + slot * stride_as + offs_r[None, :] * stride_ar
                             + (k * BLOCK_K + offs_k)[:, None] * stride_ak,
                             mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            if UPCAST:
                x_tile = x_tile.to(tl.float32)
                a_tile = a_tile.to(tl.float32)
            if IEEE_FP32:
                acc_t += tl.dot(x_tile, a_tile, input_precision="ieee")
            else:
                acc_t += tl.dot(x_tile, a_tile)
        t = acc_t.to(x_ptr.dtype.element_ty)  # the rounding a two-kernel path has
        if UPCAST:
            t = t.to(tl.float32)
        # phase 2: expand this program's share of the columns for the same rows, in place
        for n in range(0, tl.cdiv(n_per_split, BLOCK_N)):
            offs_n = n_start + n * BLOCK_N + tl.arange(0, BLOCK_N)
            n_mask = (offs_n < N) & (offs_n < n_start + n_per_split)
            b_tile = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                             mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                b_tile = b_tile.to(tl.float32)
            if IEEE_FP32:
                delta = tl.dot(t, b_tile, input_precision="ieee")
            else:
                delta = tl.dot(t, b_tile)
            out_ptrs = out_ptr + offs_t[:, None] * stride_om + offs_n[None, :] * stride_on
            mask = mine[:, None] & n_mask[None, :]
            base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, (base + scaling * delta).to(out_ptr.dtype.element_ty), mask=mask)


def default_config(tokens: int, max_rank: int, num_slots: int, schedule: Optional[str] = None) -> dict:
    """The launch config :func:`fused_decode` uses when none is given: schedule, num_splits,
    block_k, block_n, num_warps (``schedule`` given: that schedule's defaults).

    From sweeps on an H200 (hidden 4096 -> 4096, bf16, CUDA graph replay):
    ``benchmarks/results/fused_decode_sweep_h200.json`` (rank 16: few tokens need more programs
    per token to fill the GPU, many tokens fill it alone and gain from doing each shrink once) and
    ``benchmarks/results/decode_rank_sweep_h200.json`` (ranks 32 and 64). At rank 32 and 256 tokens
    smaller K tiles with 8 warps win (57.5 -> 42.7 us). At rank 64 the token schedule streams each
    token's 512 KiB of A alone; with 64+ tokens over a pool of at most 16 slots the slot schedule,
    which reads each slot's A once for all its tokens, wins (64 tokens / 8 adapters 36.4 -> 27.2 us,
    256 / 8 97.9 -> 79.7 us). It scans every token once per slot, so over a large pool (32 adapters:
    282 us at 256 tokens) the token schedule stays.
    """
    block_r = next_pow2_at_least(max_rank, floor=16)
    if schedule is None:
        schedule = "slot" if block_r >= 64 and tokens >= 64 and num_slots <= 16 else "token"
    if schedule == "slot":
        return dict(schedule="slot", num_splits=16, block_k=128, block_n=128, num_warps=8)
    cfg = dict(schedule="token", num_splits=8 if tokens <= 16 else 2 if tokens <= 64 else 1,
               block_k=2048 if tokens <= 64 else 1024, block_n=512, num_warps=16)
    if block_r == 32 and tokens > 64:
        cfg.update(block_k=512, num_warps=8)
    return cfg


def fused_decode(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out], updated in place
    num_splits: Optional[int] = None,
    block_k: Optional[int] = None,
    block_n: Optional[int] = None,
    schedule: Optional[str] = None,
    block_t: int = 64,
    num_warps: Optional[int] = None,
) -> torch.Tensor:
    """Launch the fused decode kernel (see the module docstring). Returns ``out``.

    ``num_splits`` programs share one token's (or slot's) output columns; each recomputes the
    (small) shrink, which trades re-reading A from L2 for more programs in flight. ``schedule`` is
    ``"token"`` or ``"slot"``; ``block_t`` is the token block of the slot schedule. Every argument
    left None follows the batch size, the pool's max rank and its number of slots
    (:func:`default_config`, from sweeps on an H200).

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
    given = dict(schedule=schedule, num_splits=num_splits, block_k=block_k, block_n=block_n, num_warps=num_warps)
    cfg = {**default_config(x.shape[0], A_stack.shape[1], A_stack.shape[0], schedule),
           **{k: v for k, v in given.items() if v is not None}}
    schedule, num_splits, block_k, block_n, num_warps = (cfg[k] for k in given)
    splits = max(1, min(num_splits, triton.cdiv(n, block_n)))
    n_per_split = triton.cdiv(n, splits)
    if schedule == "slot":
        # x tiles [BLOCK_T, BLOCK_K] are staged in shared memory: 128 columns (64 in fp32) fit the
        # H200's 227 KiB with room for pipelining; 512 fp32 columns asked for 513 KiB there.
        block_k = min(block_k, 64 if x.dtype == torch.float32 else 128)
        _fused_decode_by_slot_kernel[(A_stack.shape[0], splits)](
            x, A_stack, B_stack, out, x.shape[0], x.shape[1], n, n_per_split,
            x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
            B_stack.stride(0), B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
            batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
            BLOCK_T=max(16, min(block_t, triton.next_power_of_2(x.shape[0]))),
            BLOCK_R=next_pow2_at_least(A_stack.shape[1], floor=16), BLOCK_K=block_k, BLOCK_N=block_n,
            UPCAST=upcast(x), IEEE_FP32=tl_float32_dot(x, A_stack, B_stack), num_warps=num_warps,
        )
        return out
    if schedule != "token":
        raise ValueError(f"schedule must be 'token' or 'slot', got {schedule!r}")
    block_r = next_pow2_at_least(A_stack.shape[1], floor=16)
    block_k = min(block_k, max(64, 32768 // block_r))  # tiles of A and B stay in registers
    block_n = min(block_n, max(32, 8192 // block_r))
    _fused_decode_kernel[(x.shape[0], splits)](
        x, A_stack, B_stack, out, x.shape[1], n, n_per_split,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        B_stack.stride(0), B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
        batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
        BLOCK_R=next_pow2_at_least(A_stack.shape[1], floor=16), BLOCK_K=block_k, BLOCK_N=block_n,
        num_warps=num_warps,
    )
    return out
