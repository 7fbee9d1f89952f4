"""MoE LoRA in Triton: a shrink and an expand grouped GEMM over the pairs sorted by virtual expert.

Source: SGLang's virtual experts (``python/sglang/srt/lora/``: a (token, choice) pair of adapter slot
s and expert e runs virtual expert ``s * num_experts + e``), vLLM's ``fused_moe`` grouped GEMM and
``moe_align_block_size`` (one program per block of pairs that share one expert, padding entries
masked), and vLLM's MoE-LoRA shrink/expand ops (two launches, the rank-wide intermediate in HBM).

Call signature (the book's contract, shared with ``reference.moe.lora.fused_moe_lora_torch``)::

    fused_moe_lora(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k,
                   rows_per_pair, slice_offsets=None, topk_weights=None) -> out

Semantics (``reference.moe.lora``'s module docstring is the contract):
    for every pair p = (t, j) with e = topk_ids[t, j] >= 0, s = token_slots[t], r = lora_ranks[s, e] > 0:
        row = x[p] if rows_per_pair else x[t]
        for slice i (out columns [o_i, o_{i+1})):
            h = row @ A[s, e, i*r:(i+1)*r].T                    # shrink, fp32, rounded to x.dtype
            out[p, o_i:o_{i+1}] += scalings[s] * (w[t, j] if topk_weights is given else 1) * h @ B[s, e, o_i:o_{i+1}, :r].T

Phases of one call:

1. ``virtual_expert_ids`` and ``moe_align_block_size`` (torch, ``reference.moe.lora``): the pairs
   sorted by virtual expert, each group padded to whole blocks of BLOCK_M pairs; groups of rank 0
   (the base model's slot, an expert an adapter does not train) and pairs of expert -1 (held by
   another expert-parallel rank) get no block at all, so no program reads absent weights and their
   rows of ``out`` stay bit-exact.
2. Shrink: one program per (block, slice) computes ``t[pairs, i*r:(i+1)*r]`` (the slice's part of
   the rank-wide intermediate, packed at the group's own rank as the book's shrink output is) for
   the block's BLOCK_M pairs, rows of x gathered through ``sorted_pair_ids``; rounded to x.dtype.
3. Expand: one program per (block, N tile, slice) adds ``scaling * w * t @ B.T`` into its tile of
   ``out`` in place.

Step 1 synchronizes with the device (``moe_align_block_size`` needs host counts); a caller that
launches the same routing twice (gate_up then down of one layer) or captures the kernels in a CUDA
graph computes it once with :func:`align_moe_lora` and passes ``aligned=``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from reference.moe.lora import (AlignedBlocks, check_moe_lora_args, check_token_slots, moe_align_block_size,
                                virtual_expert_ids)
from reference.ops._triton_util import check_same_device, next_pow2_at_least, tl_float32_dot, upcast
from reference.ops.sgmv_expand import _slice_bound, slice_bounds

__all__ = ["fused_moe_lora", "align_moe_lora", "default_block_m"]


@triton.jit
def _moe_lora_shrink_kernel(
    # pointers
    x_ptr, a_ptr, t_ptr,
    # sizes
    K, num_pairs, num_experts, top_k,
    # strides
    stride_xm, stride_xk, stride_as, stride_ae, stride_ar, stride_ak, stride_tm, stride_tr,
    stride_ls, stride_le,
    # batch metadata
    sorted_pair_ids_ptr, block_ids_ptr, lora_ranks_ptr,
    # constexpr
    ROWS_PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # offsets in int64 (as every kernel of the book): a pair index times its stride passes 2^31
    # elements at prefill sizes (65536 pairs x 14336 columns of the down input).
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_as, stride_ae = tl.cast(stride_as, tl.int64), tl.cast(stride_ae, tl.int64)
    stride_ar, stride_ak = tl.cast(stride_ar, tl.int64), tl.cast(stride_ak, tl.int64)
    stride_tm, stride_tr = tl.cast(stride_tm, tl.int64), tl.cast(stride_tr, tl.int64)
    stride_ls, stride_le = tl.cast(stride_ls, tl.int64), tl.cast(stride_le, tl.int64)
    # 1. map the program to (block of pairs, slice); the block's one virtual expert gives slot, expert, rank
    pid_b = tl.program_id(0)
    part = tl.program_id(1)
    virtual = tl.load(block_ids_ptr + pid_b).to(tl.int64)
    slot = virtual // num_experts
    expert = virtual % num_experts
    rank = tl.load(lora_ranks_ptr + slot * stride_ls + expert * stride_le)
    if rank == 0:  # never true after the aligner's skip; kept so the kernel alone honours the contract
        return
    # 2. pointers: the block's rows of x (pair, or pair // top_k), rows [part*r, (part+1)*r) of A[s, e]
    offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    m_mask = pairs < num_pairs  # padding entries hold num_pairs
    if ROWS_PER_PAIR:
        rows = pairs
    else:
        rows = pairs // top_k
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    r_mask = offs_r < rank
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = (a_ptr + slot * stride_as + expert * stride_ae + (part * rank + offs_r)[None, :] * stride_ar
              + offs_k[:, None] * stride_ak)
    # 3. loop over K (the layer's input width), fp32 accumulation
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        if IEEE_FP32:
            acc += tl.dot(x_tile, a_tile, input_precision="ieee")
        else:
            acc += tl.dot(x_tile, a_tile)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    # 4. write the slice's part of the intermediate, rounded to its dtype (x.dtype)
    t_ptrs = t_ptr + pairs[:, None] * stride_tm + (part * rank + offs_r)[None, :] * stride_tr
    tl.store(t_ptrs, acc.to(t_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _moe_lora_expand_kernel(
    # pointers
    t_ptr, b_ptr, out_ptr, topk_weights_ptr,
    # sizes
    num_pairs, num_experts, top_k, num_n_tiles, OFF0, OFF1, OFF2, OFF3,
    # strides
    stride_tm, stride_tr, stride_bs, stride_be, stride_bn, stride_br, stride_om, stride_on,
    stride_ls, stride_le, stride_wm, stride_wk,
    # batch metadata
    sorted_pair_ids_ptr, block_ids_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    HAS_WEIGHTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # offsets in int64, as in _moe_lora_shrink_kernel
    stride_tm, stride_tr = tl.cast(stride_tm, tl.int64), tl.cast(stride_tr, tl.int64)
    stride_bs, stride_be = tl.cast(stride_bs, tl.int64), tl.cast(stride_be, tl.int64)
    stride_bn, stride_br = tl.cast(stride_bn, tl.int64), tl.cast(stride_br, tl.int64)
    stride_om, stride_on = tl.cast(stride_om, tl.int64), tl.cast(stride_on, tl.int64)
    stride_ls, stride_le = tl.cast(stride_ls, tl.int64), tl.cast(stride_le, tl.int64)
    stride_wm, stride_wk = tl.cast(stride_wm, tl.int64), tl.cast(stride_wk, tl.int64)
    # 1. map the program to (block of pairs, N tile, slice); leave when the tile is past the slice
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    part = tl.program_id(2)
    virtual = tl.load(block_ids_ptr + pid_b).to(tl.int64)
    slot = virtual // num_experts
    expert = virtual % num_experts
    rank = tl.load(lora_ranks_ptr + slot * stride_ls + expert * stride_le)
    lo = _slice_bound(part, OFF0, OFF1, OFF2, OFF3)
    hi = _slice_bound(part + 1, OFF0, OFF1, OFF2, OFF3)
    if (rank == 0) | (lo + pid_n * BLOCK_N >= hi):
        return
    # 2. pointers: the block's pairs, t's columns [part*r, (part+1)*r), B[s, e] rows [lo, hi) columns [0, r)
    offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    m_mask = pairs < num_pairs
    offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < hi
    r_mask = offs_r < rank
    t_tile = tl.load(t_ptr + pairs[:, None] * stride_tm + (part * rank + offs_r)[None, :] * stride_tr,
                     mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    b_tile = tl.load(b_ptr + slot * stride_bs + expert * stride_be + offs_n[None, :] * stride_bn
                     + offs_r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    # 3. one dot over K = the rank (BLOCK_R covers the pool's max rank, masked past this group's)
    if UPCAST:
        t_tile = t_tile.to(tl.float32)
        b_tile = b_tile.to(tl.float32)
    if IEEE_FP32:
        acc = tl.dot(t_tile, b_tile, input_precision="ieee")
    else:
        acc = tl.dot(t_tile, b_tile)
    # 4. the pair's factor (scaling, times its routing weight), then read-modify-write out
    scale = tl.load(scalings_ptr + slot).to(tl.float32)
    if HAS_WEIGHTS:
        w = tl.load(topk_weights_ptr + (pairs // top_k) * stride_wm + (pairs % top_k) * stride_wk,
                    mask=m_mask, other=0.0).to(tl.float32)
        factor = w * scale
    else:
        factor = tl.full((BLOCK_M,), 1.0, tl.float32) * scale
    out_ptrs = out_ptr + pairs[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + factor[:, None] * acc).to(out_ptr.dtype.element_ty), mask=mask)


def default_block_m(num_pairs: int) -> int:
    """Pairs per block when none is given: 16 for decode-sized batches (few pairs per group, as
    vLLM's fused_moe configs pick for small M), 64 for prefill. Untuned (no GPU sweep yet)."""
    return 16 if num_pairs <= 4096 else 64


def align_moe_lora(
    topk_ids: torch.Tensor,  # [num_tokens, top_k], -1: not on this rank
    token_slots: torch.Tensor,  # [num_tokens]
    lora_ranks: torch.Tensor,  # [num_slots, num_experts]
    block_m: Optional[int] = None,
) -> AlignedBlocks:
    """The pairs sorted by virtual expert and padded to blocks of ``block_m``; rank-0 groups skipped.

    Example: 2 experts, top_k 1, token_slots [1, 0, 1], topk_ids [[1], [0], [1]], lora_ranks
    [[0, 0], [4, 4]] -> virtual ids [3, 0, 3]; group 0 (slot 0, the base) is skipped; with
    block_m 2: sorted_pair_ids [0, 2], block_ids [3].

    ``block_m`` None: :func:`default_block_m`. Synchronizes with the device (host counts).
    Raises ValueError: a token slot outside ``[0, num_slots)`` (checked here, so that a launch given
    this alignment need not read the device again), and see ``virtual_expert_ids`` and
    ``moe_align_block_size``.
    """
    check_token_slots(token_slots, lora_ranks.shape[0])
    num_experts = lora_ranks.shape[1]
    virtual = virtual_expert_ids(topk_ids, token_slots, num_experts)
    skip = lora_ranks.reshape(-1) == 0
    return moe_align_block_size(virtual, block_m or default_block_m(topk_ids.numel()), lora_ranks.numel(), skip=skip)


def _check_block(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16 (tl.arange, and a GPU tl.dot), got {value}")


def _block_m_of(aligned: AlignedBlocks, block_m: Optional[int]) -> int:
    """The block size ``aligned`` was built with (``block_m`` when it has no blocks)."""
    blocks = aligned.block_ids.numel()
    got = aligned.sorted_pair_ids.numel() // blocks if blocks else (block_m or 16)
    if block_m is not None and got != block_m:
        raise ValueError(f"aligned was built with block_m {got}, not {block_m}")
    return got


def fused_moe_lora(
    x: torch.Tensor,  # [num_tokens or num_pairs, in]
    A: torch.Tensor,  # [num_slots, num_experts, stack_num * max_rank, in]
    B: torch.Tensor,  # [num_slots, num_experts, out_total, max_rank]
    out: torch.Tensor,  # [num_pairs, out_total], updated in place
    topk_ids: torch.Tensor,  # [num_tokens, top_k], -1: not on this rank
    token_slots: torch.Tensor,  # [num_tokens]
    lora_ranks: torch.Tensor,  # [num_slots, num_experts]
    scalings: torch.Tensor,  # [num_slots]
    top_k: int,
    rows_per_pair: bool,
    slice_offsets: Optional[Sequence[int]] = None,
    topk_weights: Optional[torch.Tensor] = None,  # [num_tokens, top_k]
    *,
    aligned: Optional[AlignedBlocks] = None,
    block_m: Optional[int] = None,
    block_k: Optional[int] = None,
    block_n: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """Launch the MoE LoRA shrink and expand kernels (see the module docstring). Returns ``out``.

    ``aligned``: ``align_moe_lora(topk_ids, token_slots, lora_ranks, block_m)`` computed beforehand
    for these very arguments (not re-checked), so the launches need no device synchronization
    (CUDA graph capture) and a layer aligns once for gate_up and down; its block size is used.
    ``block_m``: pairs per block (default :func:`default_block_m`); ``block_k``: the shrink's K tile
    (default 128, clamped so one staged A tile stays within 32 KiB at large ranks); ``block_n``: the
    expand's output tile. The rank tile is the pool's max rank rounded up to a power of two, at
    least 16 (a GPU ``tl.dot`` needs it). The defaults are untuned: no GPU sweep has run yet.

    Raises:
        ValueError: the contract's checks (``check_moe_lora_args``), tensors on several devices, A or
            B of another dtype than x, more than three slices, a block size that is not a power of
            two >= 16, or an ``aligned`` built with another ``block_m``.
    """
    slices = check_moe_lora_args(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k, rows_per_pair,
                                 slice_offsets, topk_weights, check_values=aligned is None)
    check_same_device(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, topk_weights)
    if A.dtype != x.dtype or B.dtype != x.dtype:
        raise ValueError(f"A ({A.dtype}) and B ({B.dtype}) must have x's dtype {x.dtype}")
    bounds = slice_bounds(slice_offsets, out.shape[1])  # at most 3 slices, padded to 4 scalars
    block_m = _block_m_of(aligned, block_m) if aligned is not None else block_m or default_block_m(topk_ids.numel())
    block_r = next_pow2_at_least(B.shape[3], floor=16)
    block_k = block_k or min(128, max(16, 32768 // (block_r * x.element_size())))
    for name, value in [("block_m", block_m), ("block_k", block_k), ("block_n", block_n)]:
        _check_block(name, value)
    if aligned is None:
        aligned = align_moe_lora(topk_ids, token_slots, lora_ranks, block_m)
    num_blocks, stack, num_pairs = aligned.block_ids.numel(), len(slices), topk_ids.shape[0] * top_k
    if num_blocks == 0 or B.shape[3] == 0:
        return out
    t = torch.empty((num_pairs, stack * B.shape[3]), dtype=x.dtype, device=x.device)  # [num_pairs, stack*max_rank]
    _moe_lora_shrink_kernel[(num_blocks, stack)](
        x, A, t,
        x.shape[1], num_pairs, A.shape[1], top_k,
        x.stride(0), x.stride(1), A.stride(0), A.stride(1), A.stride(2), A.stride(3), t.stride(0), t.stride(1),
        lora_ranks.stride(0), lora_ranks.stride(1),
        aligned.sorted_pair_ids, aligned.block_ids, lora_ranks,
        ROWS_PER_PAIR=bool(rows_per_pair), BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
        UPCAST=upcast(x), IEEE_FP32=tl_float32_dot(x, A), num_warps=num_warps,
    )
    num_n_tiles = triton.cdiv(max(max(hi - lo for lo, hi in slices), 1), block_n)
    has_weights = topk_weights is not None
    weights = topk_weights if has_weights else scalings  # a placeholder pointer, never read
    _moe_lora_expand_kernel[(num_blocks, num_n_tiles, stack)](
        t, B, out, weights,
        num_pairs, B.shape[1], top_k, num_n_tiles, *bounds,
        t.stride(0), t.stride(1), B.stride(0), B.stride(1), B.stride(2), B.stride(3), out.stride(0), out.stride(1),
        lora_ranks.stride(0), lora_ranks.stride(1), weights.stride(0), weights.stride(-1) if has_weights else 0,
        aligned.sorted_pair_ids, aligned.block_ids, lora_ranks, scalings,
        HAS_WEIGHTS=has_weights, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        UPCAST=upcast(t), IEEE_FP32=tl_float32_dot(t, B), num_warps=num_warps,
    )
    return out
