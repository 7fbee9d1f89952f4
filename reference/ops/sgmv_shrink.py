"""SGMV shrink in Triton: one small GEMM per segment of tokens that share an adapter slot.

Source: Punica's SGMV (Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023) and SGLang's
``python/sglang/srt/lora/triton_ops/sgemm_lora_a.py`` (grid over tiles x segments, rank clip,
early exit on rank 0, an "already sorted" constexpr).

Call signature (the book's contract, shared with ``reference.ops.torch_ref.shrink``)::

    sgmv_shrink(x, A_stack, batch_info, out, stack_num=1) -> out

Semantics:
    for seg: rows = perm[seg_indptr[seg]:seg_indptr[seg+1]]; s = weight_indices[seg]; r = lora_ranks[s]
             out[rows, :stack_num*r] = x[rows] @ A_stack[s, :stack_num*r].T     (fp32 accumulation)
Columns past stack_num*r are not written. ``perm`` is ``batch_info.permutation`` or the identity.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import (check_same_device, next_pow2_at_least, packed_block, packed_blocks,
                                         seg_block, tl_float32_dot, upcast, use_packed)

__all__ = ["sgmv_shrink"]


# num_segments changes step to step: specialized, a new count could compile mid-serving (_triton_util.seg_block)
@triton.jit(do_not_specialize=["num_segments"])
def _sgmv_shrink_kernel(
    # pointers
    x_ptr, a_ptr, out_ptr,
    # sizes
    K, num_n_tiles, num_segments,
    # strides
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_om, stride_on,
    # batch metadata
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, permutation_ptr,
    # constexpr
    STACK_NUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
    PACKED: tl.constexpr = False, SEG_BLOCK: tl.constexpr = 16,
):
    # offsets in int64: a row (or slot) index times its stride passes 2^31 elements at real sizes
    # (x [600000, 4096], out [80000, 28672]), where an int32 offset wraps to an illegal address.
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr and stays a constant (contiguous loads).
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_as, stride_an = tl.cast(stride_as, tl.int64), tl.cast(stride_an, tl.int64)
    stride_ak, stride_om = tl.cast(stride_ak, tl.int64), tl.cast(stride_om, tl.int64)
    stride_on = tl.cast(stride_on, tl.int64)
    # 1. map the program to (segment, row tile, column tile); leave at once when there is no work
    pid_n = tl.program_id(0) % num_n_tiles
    if PACKED:  # row blocks of every segment back to back (_triton_util.packed_blocks), as sgmv_expand's
        seg, pid_m, start, seg_len = packed_block(tl.program_id(0) // num_n_tiles, seg_indptr_ptr, num_segments,
                                                  BLOCK_M, SEG_BLOCK)
        seg = tl.minimum(seg, num_segments - 1)  # a block past the last has length 0 and returns below
    else:
        seg = tl.program_id(1)
        pid_m = tl.program_id(0) // num_n_tiles
        start = tl.load(seg_indptr_ptr + seg)
        seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    slot = tl.load(weight_indices_ptr + seg)
    width = tl.load(lora_ranks_ptr + slot) * STACK_NUM  # rank clip: N of this GEMM
    if (width == 0) | (pid_m * BLOCK_M >= seg_len) | (pid_n * BLOCK_N >= width):
        return
    # 2. pointers: rows of x (through the permutation), rows [0, width) of the slot's A
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len
    n_mask = offs_n < width
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + start + offs_m, mask=m_mask, other=0)
    else:
        rows = start + offs_m
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_n[None, :] * stride_an + offs_k[:, None] * stride_ak
    # 3. loop over K (the hidden size), fp32 accumulation
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        if IEEE_FP32:
            acc += tl.dot(x_tile, a_tile, input_precision="ieee")
        else:
            acc += tl.dot(x_tile, a_tile)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    # 4. write back the defined region only
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, stack_num * max_rank, in]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, >= stack_num * max_rank]
    stack_num: int = 1,
    block_m: Optional[int] = None,
    block_k: Optional[int] = None,
    num_warps: int = 4,
    packed: bool = True,
    max_len: Optional[int] = None,
) -> torch.Tensor:
    """Launch the SGMV shrink kernel (see the module docstring). Returns ``out``.

    Defaults are the configs tuned on an H200 (benchmarks/results/tuned_configs.json). The grid
    comes from host ints (``max_len``, ``num_segments``), so launching never synchronizes.
    ``packed`` (default) launches every segment's row blocks back to back where that launches fewer
    blocks than a grid of ``cdiv(max_len, block_m)`` blocks for each segment
    (:func:`reference.ops._triton_util.use_packed`), as ``sgmv_expand`` does: an engine's mixed
    step holds a prompt chunk of many tokens beside hundreds of one-token decode segments, and the
    grid over every (segment, row block) launched the chunk's block count for each of them; False
    keeps that grid. Same results. ``max_len`` (default ``batch_info.max_len``) is the longest
    segment the grid covers, as ``sgmv_expand``'s: a decode batch's slot-sorted view says 1 (what
    routes the layers to BGMV) while a slot's segment holds many tokens, so a backend that runs it
    through SGMV passes the token count.

    Raises:
        ValueError: mismatched shapes or devices.
    """
    check_same_device(x, A_stack, out)
    width = A_stack.shape[1]
    if x.shape[1] != A_stack.shape[2] or out.shape[0] != x.shape[0] or out.shape[1] < width:
        raise ValueError(f"shapes x {list(x.shape)}, A_stack {list(A_stack.shape)}, out {list(out.shape)}")
    max_len = batch_info.max_len if max_len is None else max_len
    if batch_info.num_segments == 0 or max_len == 0 or x.shape[0] == 0:
        return out
    block_n = next_pow2_at_least(min(width, 64))
    block_m = block_m or (32 if width <= 16 else 64)  # tuned on an H200 at rank 16 and 64
    # the tuned block_k is 256 bf16 columns; in fp32 the same bytes are 128 columns (at 256, two
    # pipeline stages of x and A tiles need 256 KiB of shared memory, over the H200's 227 KiB)
    block_k = block_k or (256 if x.element_size() <= 2 else 128)
    num_n_tiles = triton.cdiv(width, block_n)
    packed = packed and use_packed(x.shape[0], max_len, batch_info.num_segments, block_m)
    if packed:
        grid = (packed_blocks(x.shape[0], batch_info.num_segments, block_m) * num_n_tiles, 1)
    else:
        grid = (triton.cdiv(max_len, block_m) * num_n_tiles, batch_info.num_segments)
    perm = batch_info.permutation
    _sgmv_shrink_kernel[grid](
        x, A_stack, out,
        x.shape[1], num_n_tiles, batch_info.num_segments,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks,
        perm if perm is not None else batch_info.seg_indptr,
        STACK_NUM=stack_num, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_PERMUTATION=perm is not None, UPCAST=upcast(x), IEEE_FP32=tl_float32_dot(x, A_stack),
        PACKED=packed, SEG_BLOCK=seg_block(batch_info.num_segments, packed, batch_info.lora_ranks.shape[0]),
        num_warps=num_warps,
    )
    return out
