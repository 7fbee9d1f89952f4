"""BGMV expand in Triton: every token gathers its own slot's B and adds its scaled product in place.

Source: Punica's BGMV (Chen et al., 2023); vLLM ``vllm/lora/ops/triton_ops/`` (per-token indices,
slices for fused QKV).

Call signature (as ``reference.ops.torch_ref.bgmv_expand``)::

    bgmv_expand(t, B_stack, batch_info, out, slice_offsets=None) -> out

Semantics:
    s = token_slots[tok]; r = lora_ranks[s]
    for i, (lo, hi) in enumerate(slices):
        out[tok, lo:hi] += scalings[s] * t[tok, i*r:(i+1)*r] @ B_stack[s, lo:hi, :r].T
Rank 0 adds exactly nothing. Reads only ``token_slots``.

``t`` may be the split-K shrink's fp32 partials, [S, num_tokens, width]: the expand then reads
``t.sum(0)`` (summed in fp32 as it loads), so the split needs no reduction kernel.

Two schedules, same result:

- ``"token"``: one program per (token, column tile, slice): the token gathers its slot's B tile.
  At 64 tokens on 8 adapters each B tile is read 8 times (from L2), and at rank 64 a token's B is
  512 KB for 4096 columns: the reads, not the FLOPs, set the time.
- ``"slot"``: one program per (pool slot, column tile, slice), adapter-grouped: it reads its
  slot's B tile once, scans ``token_slots`` in blocks of ``block_t`` for its tokens, and applies
  one ``tl.dot`` per block ([block_t, r] x [r, block_n]; t rounded to B's dtype first, as a
  two-kernel path rounds it to x's dtype). Slots with no token in the batch exit after the scan.
  (vLLM's LoRA kernels group tokens by adapter the same way, from a sort by lora id.)

The default is "token": on an H200 (``benchmarks/sweep_split_k.py --expand`` ->
``benchmarks/results/decode_expand_h200.json``; Llama-3-8B widths, ranks 16 and 64, 16-256
tokens, 8 and 32 adapters) the slot schedule's best config was 1.06-2.06x slower than the token
schedule at every swept shape: a decode expand's B reads come from L2 (8-32 adapters' tiles fit),
so reading each tile once saves little, while every slot program scans all the tokens and runs a
[block_t, r] x [r, block_n] product for the few rows that are its own.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import check_same_device, next_pow2_at_least, tl_float32_dot, upcast
from reference.ops.sgmv_expand import _slice_bound, slice_bounds

__all__ = ["bgmv_expand"]


@triton.jit
def _bgmv_expand_kernel(
    # pointers
    t_ptr, b_ptr, out_ptr,
    # sizes
    OFF0, OFF1, OFF2, OFF3,
    # strides
    stride_ts, stride_tm, stride_tk, stride_bs, stride_bn, stride_bk, stride_om, stride_on,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    # offsets in int64: a row (or slot) index times its stride passes 2^31 elements at real sizes
    # (x [600000, 4096], out [80000, 28672]), where an int32 offset wraps to an illegal address.
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr and stays a constant (contiguous loads).
    stride_tm, stride_tk = tl.cast(stride_tm, tl.int64), tl.cast(stride_tk, tl.int64)
    stride_bs, stride_bn = tl.cast(stride_bs, tl.int64), tl.cast(stride_bn, tl.int64)
    stride_bk, stride_om = tl.cast(stride_bk, tl.int64), tl.cast(stride_om, tl.int64)
    stride_on, stride_ts = tl.cast(stride_on, tl.int64), tl.cast(stride_ts, tl.int64)
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    slot = tl.load(token_slots_ptr + tok)
    rank = tl.load(lora_ranks_ptr + slot)
    lo = _slice_bound(part, OFF0, OFF1, OFF2, OFF3)
    hi = _slice_bound(part + 1, OFF0, OFF1, OFF2, OFF3)
    if (rank == 0) | (lo + pid_n * BLOCK_N >= hi):
        return
    scaling = tl.load(scalings_ptr + slot)
    offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)  # one block covers max_rank: K is the rank
    n_mask = offs_n < hi
    k_mask = offs_k < rank
    t_ptrs = t_ptr + tok * stride_tm + (part * rank + offs_k) * stride_tk
    t_row = tl.load(t_ptrs, mask=k_mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, NUM_SPLITS):  # split-K partials: their sum is the shrink
        t_row += tl.load(t_ptrs + s * stride_ts, mask=k_mask, other=0.0).to(tl.float32)
    b_tile = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk,
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    delta = tl.sum(b_tile.to(tl.float32) * t_row[None, :], axis=1)
    out_ptrs = out_ptr + tok * stride_om + offs_n * stride_on
    base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + scaling * delta).to(out_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _bgmv_expand_by_slot_kernel(
    # pointers
    t_ptr, b_ptr, out_ptr,
    # sizes
    T, OFF0, OFF1, OFF2, OFF3,
    # strides
    stride_ts, stride_tm, stride_tk, stride_bs, stride_bn, stride_bk, stride_om, stride_on,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # offsets in int64, as in _bgmv_expand_kernel
    stride_tm, stride_tk = tl.cast(stride_tm, tl.int64), tl.cast(stride_tk, tl.int64)
    stride_bs, stride_bn = tl.cast(stride_bs, tl.int64), tl.cast(stride_bn, tl.int64)
    stride_bk, stride_om = tl.cast(stride_bk, tl.int64), tl.cast(stride_om, tl.int64)
    stride_on, stride_ts = tl.cast(stride_on, tl.int64), tl.cast(stride_ts, tl.int64)
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    rank = tl.load(lora_ranks_ptr + slot)
    lo = _slice_bound(part, OFF0, OFF1, OFF2, OFF3)
    hi = _slice_bound(part + 1, OFF0, OFF1, OFF2, OFF3)
    if (rank == 0) | (lo + pid_n * BLOCK_N >= hi):
        return
    scaling = tl.load(scalings_ptr + slot)
    offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)  # one block covers max_rank
    n_mask = offs_n < hi
    k_mask = offs_k < rank
    b_tile = tl.load(b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                     mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N], read once
    if UPCAST:
        b_tile = b_tile.to(tl.float32)
    for tb in range(0, tl.cdiv(T, BLOCK_T)):
        offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
        mine = tl.load(token_slots_ptr + offs_t, mask=offs_t < T, other=-1) == slot
        if tl.max(mine.to(tl.int32), axis=0) > 0:  # a block without this slot's tokens costs the scan only
            t_ptrs = t_ptr + offs_t[:, None] * stride_tm + (part * rank + offs_k)[None, :] * stride_tk
            t_mask = mine[:, None] & k_mask[None, :]
            t_tile = tl.load(t_ptrs, mask=t_mask, other=0.0).to(tl.float32)
            for s in tl.static_range(1, NUM_SPLITS):  # split-K partials: their sum is the shrink
                t_tile += tl.load(t_ptrs + s * stride_ts, mask=t_mask, other=0.0).to(tl.float32)
            if UPCAST:
                delta = tl.dot(t_tile, b_tile, input_precision="ieee")
            elif IEEE_FP32:
                delta = tl.dot(t_tile, b_tile, input_precision="ieee")
            else:
                delta = tl.dot(t_tile.to(b_ptr.dtype.element_ty), b_tile)
            out_ptrs = out_ptr + offs_t[:, None] * stride_om + offs_n[None, :] * stride_on
            o_mask = mine[:, None] & n_mask[None, :]
            base = tl.load(out_ptrs, mask=o_mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, (base + scaling * delta).to(out_ptr.dtype.element_ty), mask=o_mask)


def bgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= num_slices * max_rank], or [S, num_tokens, ...]: split-K partials
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out_total], updated in place
    slice_offsets: Optional[Sequence[int]] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    schedule: Optional[str] = None,
    block_t: int = 64,
) -> torch.Tensor:
    """Launch the BGMV expand kernel (see the module docstring). Returns ``out``.

    ``schedule`` "token" (default) or "slot" (see the module docstring); ``block_t`` is the slot
    schedule's token block (16 to 64, at most the tokens rounded up).

    ``block_n`` (output columns per program) defaults by the pool's max rank, from a sweep on an
    H200 (hidden 4096, bf16, 16-256 tokens; ``benchmarks/results/decode_rank_sweep_h200.json``):
    256 up to rank 16, 128 up to 32, 64 beyond (each program's B tile is block_n x rank: wider
    ranks want narrower tiles and more programs; rank 64 at 256 tokens 52.8 -> 46.4 us).

    Raises:
        ValueError: mismatched shapes or devices, bad ``slice_offsets``, no ``token_slots``, or an
        unknown schedule.
    """
    check_same_device(t, B_stack, out)
    if t.dim() not in (2, 3):
        raise ValueError(f"t must be [num_tokens, width] or split-K partials [S, num_tokens, width], got "
                         f"{list(t.shape)}")
    splits, rows = (t.shape[0], t[0]) if t.dim() == 3 else (1, t)
    if batch_info.token_slots is None or batch_info.token_slots.shape[0] != rows.shape[0]:
        raise ValueError("bgmv_expand needs batch_info.token_slots with one slot per row of t")
    bounds = slice_bounds(slice_offsets, out.shape[1])
    num_slices = 1 if slice_offsets is None else len(slice_offsets) - 1
    if out.shape[0] != rows.shape[0] or B_stack.shape[1] < bounds[-1]:
        raise ValueError(f"shapes t {list(t.shape)}, B_stack {list(B_stack.shape)}, out {list(out.shape)}")
    if rows.shape[0] == 0:
        return out
    schedule = "token" if schedule is None else schedule
    if schedule not in ("token", "slot"):
        raise ValueError(f"schedule must be 'token' or 'slot', got {schedule!r}")
    widest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if schedule == "slot":
        block_n = 64 if block_n is None else block_n
        grid = (B_stack.shape[0], triton.cdiv(max(widest, 1), block_n), num_slices)
        _bgmv_expand_by_slot_kernel[grid](
            t, B_stack, out, rows.shape[0], *bounds,
            t.stride(0) if t.dim() == 3 else 0, rows.stride(0), rows.stride(1), B_stack.stride(0),
            B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
            batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
            BLOCK_T=max(16, min(block_t, triton.next_power_of_2(rows.shape[0]))), BLOCK_N=block_n,
            BLOCK_K=next_pow2_at_least(B_stack.shape[2]), NUM_SPLITS=splits, UPCAST=upcast(t),
            IEEE_FP32=tl_float32_dot(rows, B_stack), num_warps=4 if num_warps is None else num_warps,
        )
        return out
    if block_n is None:
        block_n = 256 if B_stack.shape[2] <= 16 else 128 if B_stack.shape[2] <= 32 else 64
    grid = (rows.shape[0], triton.cdiv(max(widest, 1), block_n), num_slices)
    _bgmv_expand_kernel[grid](
        t, B_stack, out, *bounds,
        t.stride(0) if t.dim() == 3 else 0, rows.stride(0), rows.stride(1), B_stack.stride(0), B_stack.stride(1), B_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
        BLOCK_N=block_n, BLOCK_K=next_pow2_at_least(B_stack.shape[2]), NUM_SPLITS=splits,
        num_warps=2 if num_warps is None else num_warps,
    )
    return out
