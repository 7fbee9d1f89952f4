"""SGMV expand in Triton: per segment, add the scaled low-rank product into the base output.

Source: Punica's SGMV (Chen et al., 2023) and SGLang's
``python/sglang/srt/lora/triton_ops/sgemm_lora_b.py`` / ``qkv_lora_b.py`` (slices for fused QKV).

Call signature (the book's contract, shared with ``reference.ops.torch_ref.expand``)::

    sgmv_expand(t, B_stack, batch_info, out, slice_offsets=None) -> out

Semantics:
    for seg: rows, s, r as in sgmv_shrink
        for i, (lo, hi) in enumerate(slices):
            out[rows, lo:hi] += scalings[s] * t[rows, i*r:(i+1)*r] @ B_stack[s, lo:hi, :r].T
``slice_offsets`` is a host tuple of at most 4 ints (default ``(0, out.shape[1])``); the kernel gets
them as scalars, so a CUDA graph can capture the launch. Rank 0 adds exactly nothing (no program
writes its rows). K is the rank: the K block is at least 16 (a GPU ``tl.dot`` needs it) and masked.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import (check_same_device, next_pow2_at_least, packed_block, packed_blocks,
                                         seg_block, summed_partials, tl_float32_dot, upcast, use_packed)

__all__ = ["sgmv_expand", "slice_bounds", "default_tiles"]


@triton.jit
def _slice_bound(i, OFF0, OFF1, OFF2, OFF3):
    """Offset ``i`` of the (at most four) slice offsets, chosen without a memory load."""
    return tl.where(i == 0, OFF0, tl.where(i == 1, OFF1, tl.where(i == 2, OFF2, OFF3)))


# num_segments changes step to step: specialized, a new count could compile mid-serving (_triton_util.seg_block)
@triton.jit(do_not_specialize=["num_segments"])
def _sgmv_expand_kernel(
    # pointers
    t_ptr, b_ptr, out_ptr,
    # sizes
    num_n_tiles, num_segments, OFF0, OFF1, OFF2, OFF3,
    # strides
    stride_tm, stride_tk, stride_bs, stride_bn, stride_bk, stride_om, stride_on,
    # batch metadata
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, permutation_ptr,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
    PACKED: tl.constexpr = False, SEG_BLOCK: tl.constexpr = 16,
):
    # offsets in int64: a row (or slot) index times its stride passes 2^31 elements at real sizes
    # (x [600000, 4096], out [80000, 28672]), where an int32 offset wraps to an illegal address.
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr and stays a constant (contiguous loads).
    stride_tm, stride_tk = tl.cast(stride_tm, tl.int64), tl.cast(stride_tk, tl.int64)
    stride_bs, stride_bn = tl.cast(stride_bs, tl.int64), tl.cast(stride_bn, tl.int64)
    stride_bk, stride_om = tl.cast(stride_bk, tl.int64), tl.cast(stride_om, tl.int64)
    stride_on = tl.cast(stride_on, tl.int64)
    # 1. map the program to (segment, slice, row tile, column tile)
    part = tl.program_id(2)
    pid_n = tl.program_id(0) % num_n_tiles
    if PACKED:  # row blocks of every segment back to back (_triton_util.packed_blocks): none wasted on empty ones
        # (a block past the last gets length 0 and returns below; its segment index is clamped for the load)
        seg, pid_m, start, seg_len = packed_block(tl.program_id(0) // num_n_tiles, seg_indptr_ptr, num_segments,
                                                  BLOCK_M, SEG_BLOCK)
        seg = tl.minimum(seg, num_segments - 1)
    else:
        seg = tl.program_id(1)
        pid_m = tl.program_id(0) // num_n_tiles
        start = tl.load(seg_indptr_ptr + seg)
        seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)
    lo = _slice_bound(part, OFF0, OFF1, OFF2, OFF3)
    hi = _slice_bound(part + 1, OFF0, OFF1, OFF2, OFF3)
    if (rank == 0) | (pid_m * BLOCK_M >= seg_len) | (lo + pid_n * BLOCK_N >= hi):
        return
    scaling = tl.load(scalings_ptr + slot)
    # 2. pointers: t's columns of this part [part*r, (part+1)*r), B rows [lo, hi), B columns [0, r)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len
    n_mask = offs_n < hi
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + start + offs_m, mask=m_mask, other=0)
    else:
        rows = start + offs_m
    t_ptrs = t_ptr + rows[:, None] * stride_tm + (part * rank + offs_k)[None, :] * stride_tk
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    # 3. loop over K = the rank, masked (the padding past the rank is never read)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(rank, BLOCK_K)):
        k_mask = offs_k < rank - k * BLOCK_K
        t_tile = tl.load(t_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            t_tile = t_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        else:  # an fp32 t (the split-K partials' sum) meets a 16-bit B: rounded to B's dtype, as a
            # two-kernel path rounds t to x's
            t_tile = t_tile.to(b_ptr.dtype.element_ty)
        if IEEE_FP32:
            acc += tl.dot(t_tile, b_tile, input_precision="ieee")
        else:
            acc += tl.dot(t_tile, b_tile)
        t_ptrs += BLOCK_K * stride_tk
        b_ptrs += BLOCK_K * stride_bk
    # 4. read-modify-write the base output
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + scaling * acc).to(out_ptr.dtype.element_ty), mask=mask)


def default_tiles(max_rank: int) -> dict:
    """:func:`sgmv_expand`'s default ``block_m`` / ``block_n`` for a pool of this max rank (host int):
    32 / 256 up to rank 16, 64 / 128 above (its docstring says where they were measured)."""
    return {"block_m": 32, "block_n": 256} if max_rank <= 16 else {"block_m": 64, "block_n": 128}


def slice_bounds(slice_offsets: Optional[Sequence[int]], out_width: int) -> tuple[int, ...]:
    """The slice offsets as host ints, padded to four entries for the kernels' scalar arguments.

    Raises:
        ValueError: more than three slices, offsets not increasing, or past ``out_width``.
    """
    offsets = (0, out_width) if slice_offsets is None else tuple(int(o) for o in slice_offsets)
    if not 2 <= len(offsets) <= 4 or list(offsets) != sorted(offsets) or offsets[0] < 0 or offsets[-1] > out_width:
        raise ValueError(f"slice_offsets {offsets} must be 2-4 increasing ints within [0, {out_width}]")
    return offsets + (offsets[-1],) * (4 - len(offsets))


def sgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= num_slices * max_rank], or [S, num_tokens, ...]: split-K partials
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out_total], updated in place
    slice_offsets: Optional[Sequence[int]] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: int = 4,
    max_len: Optional[int] = None,
    num_stages: Optional[int] = None,
    packed: bool = True,
) -> torch.Tensor:
    """Launch the SGMV expand kernel (see the module docstring). Returns ``out``.

    ``t`` may be the split-K shrink's fp32 partials [S, num_tokens, width] (``bgmv_shrink`` with a
    3-D out): they are summed first by one torch reduction (``_triton_util.summed_partials``, which
    says why not in the kernel), and the kernel rounds the sum to B's dtype. ``max_len`` (default
    ``batch_info.max_len``) is the longest segment the grid covers: a decode batch's slot-sorted
    view (``bgmv_expand(schedule="sorted")``) passes its token count, since its ``max_len`` of 1
    is what routes the layers to BGMV. ``num_stages`` (default: Triton's) is the K loop's software
    pipelining depth. ``packed`` (default) launches every segment's row blocks back to back
    (:func:`reference.ops._triton_util.packed_blocks`: at most ``cdiv(tokens, block_m) +
    min(segments, tokens)`` blocks, instead of ``cdiv(max_len, block_m)`` for each segment) where
    that launches fewer blocks (``_triton_util.use_packed``): the decode path's slot-sorted view
    has a segment per pool slot, and an engine's mixed step a prompt chunk of many tokens beside
    hundreds of one-token decode segments; False keeps the grid over every (segment, row block).
    Same results.

    ``block_m`` / ``block_n`` default by the pool's max rank: 32 / 256 up to rank 16, measured on
    an H100 at an engine's mixed step (7.8k tokens in 162 segments, rank 16, every output width of
    a Llama-3-8B layer: 1.5-1.6x faster than the 128 / 128 tuned before on 4 requests of 2048 tokens,
    the gate|up expand 549 against 865 us; ``benchmarks/sweep_prefill_expand.py`` ->
    ``benchmarks/results/prefill_expand_h100.json``: a tile of 8k outputs per 4 warps, read and
    written once, is what the read-modify-write of the output wants); 64 / 128 above (tuned on an
    H200 at rank 64, ``tuned_configs.json``). A ``block_m`` given without ``block_n`` keeps the tile
    at most 16k outputs (128 rows: 128 columns).

    Raises:
        ValueError: mismatched shapes or devices, or bad ``slice_offsets``.
    """
    check_same_device(t, B_stack, out)
    rows = summed_partials(t)
    bounds = slice_bounds(slice_offsets, out.shape[1])
    num_slices = sum(1 for a, b in zip(bounds[:-1], bounds[1:]) if b > a) if slice_offsets is None else len(slice_offsets) - 1
    if out.shape[0] != rows.shape[0] or B_stack.shape[1] < bounds[-1]:
        raise ValueError(f"shapes t {list(t.shape)}, B_stack {list(B_stack.shape)}, out {list(out.shape)}")
    max_len = batch_info.max_len if max_len is None else max_len
    if batch_info.num_segments == 0 or max_len == 0 or rows.shape[0] == 0:
        return out
    max_rank = B_stack.shape[2]
    tiles = default_tiles(max_rank)
    block_m = block_m or tiles["block_m"]
    # a caller's taller block gets narrower columns: 128 x 256 fp32 accumulators on 4 warps spill (the
    # sweep: 3271 against 853 us for 128 x 128 on the gate|up expand)
    block_n = block_n or min(tiles["block_n"], max(16, 16384 // block_m))
    widest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    num_n_tiles = triton.cdiv(max(widest, 1), block_n)
    packed = packed and use_packed(rows.shape[0], max_len, batch_info.num_segments, block_m)
    if packed:
        grid = (packed_blocks(rows.shape[0], batch_info.num_segments, block_m) * num_n_tiles, 1, max(num_slices, 1))
    else:
        grid = (triton.cdiv(max_len, block_m) * num_n_tiles, batch_info.num_segments, max(num_slices, 1))
    perm = batch_info.permutation
    _sgmv_expand_kernel[grid](
        rows, B_stack, out,
        num_n_tiles, batch_info.num_segments, *bounds,
        rows.stride(0), rows.stride(1), B_stack.stride(0),
        B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks, batch_info.scalings,
        perm if perm is not None else batch_info.seg_indptr,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=next_pow2_at_least(max_rank),
        HAS_PERMUTATION=perm is not None, UPCAST=upcast(t), IEEE_FP32=tl_float32_dot(rows, B_stack),
        PACKED=packed, SEG_BLOCK=seg_block(batch_info.num_segments, packed, batch_info.lora_ranks.shape[0]),
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
    return out
