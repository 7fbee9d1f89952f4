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

Split-K (``out`` of shape [S, num_tokens, width], fp32): the hidden size is cut into S pieces and
program (token, tile, s) writes the fp32 partial sum over piece s into ``out[s]``; the sum over s
is the shrink, and the BGMV expand adds the S partials as it loads ``t`` (no reduction kernel, no
atomics: the result does not depend on which program finishes first). Why: a decode batch of 64
tokens gives 64 programs, each streaming its token's whole A (128 KB at hidden 4096, rank 16) on
one SM of 132; splitting K gives S times as many programs, each with 1/S of the bytes, so the
launch finishes in about the latency of one short pass (vLLM's ``lora_shrink`` has a SPLIT_K, with
atomics into a zeroed fp32 buffer; the partials here keep the step deterministic).

Two schedules, same result (as ``bgmv_expand``'s):

- ``"token"`` (the default): the GEMV per token above. Every token streams its adapter's whole A:
  at 64 tokens on 8 adapters each A is read 8 times (from L2), and at rank 64 the q/k/v stack's A
  is 1.5 MB per token. The profile of the H200 decode step at 64 x 8, rank 64, puts 522 us of the
  base step's 3961 us in these shrinks (``benchmarks/results/decode_step_schedule_h200.json``).
- ``"sorted"``: over the batch's slot-sorted view (``seg_indptr`` / ``weight_indices`` /
  ``permutation``, as the expand's "sorted" schedule reads it), one program per (segment, block of
  ``block_m`` of its tokens, column tile, K piece) loads each tile of its slot's A once for the
  whole block and applies one ``tl.dot`` (SGMV's shrink, ``reference.ops.sgmv_shrink``, with the
  split-K partials added). With the sorted expand it is the "grouped" decode schedule
  (``reference.ops.decode_schedule``), which a rule picks only where a committed whole-step run
  measured it best; ``benchmarks/benchmark_decode_step.py --backends triton_grouped`` measures it.

``schedule=None`` (the default) reads the batch's ``shrink_schedule`` ("token" unless its builder
chose), as ``bgmv_expand`` reads ``expand_schedule``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import (check_same_device, next_pow2_at_least, packed_block, packed_blocks,
                                         seg_block, tl_float32_dot, upcast, use_packed)

__all__ = ["bgmv_shrink", "split_config", "decode_splits", "tuned_config", "rule_splits", "SORTED_BLOCK_M"]

#: Tokens of one slot per program in the "sorted" schedule: a GPU ``tl.dot``'s least M.
SORTED_BLOCK_M = 16


@triton.jit
def _bgmv_shrink_kernel(
    # pointers
    x_ptr, a_ptr, out_ptr,
    # sizes
    K, K_SPLIT,
    # strides
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_os, stride_om, stride_on,
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
    stride_on, stride_os = tl.cast(stride_on, tl.int64), tl.cast(stride_os, tl.int64)
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)  # K columns [split * K_SPLIT, (split + 1) * K_SPLIT); one split: all of K
    slot = tl.load(token_slots_ptr + tok)
    width = tl.load(lora_ranks_ptr + slot) * STACK_NUM
    if (width == 0) | (pid_n * BLOCK_N >= width):
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)  # a split past K sums nothing and still writes its zeros
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    n_mask = offs_n < width
    x_ptrs = x_ptr + tok * stride_xm + offs_k * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :] * stride_ak
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k_mask = offs_k < k_hi - k * BLOCK_K
        x_row = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        a_tile = tl.load(a_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(a_tile * x_row[None, :], axis=1)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    out_ptrs = out_ptr + split * stride_os + tok * stride_om + offs_n * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=n_mask)


# num_segments changes step to step: specialized, a new count could compile mid-serving (_triton_util.seg_block)
@triton.jit(do_not_specialize=["num_segments"])
def _bgmv_shrink_sorted_kernel(
    # pointers
    x_ptr, a_ptr, out_ptr,
    # sizes
    K, K_SPLIT, num_n_tiles, num_segments,
    # strides
    stride_xm, stride_xk, stride_as, stride_an, stride_ak, stride_os, stride_om, stride_on,
    # batch metadata
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, permutation_ptr,
    # constexpr
    STACK_NUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr, PACKED: tl.constexpr = False, SEG_BLOCK: tl.constexpr = 16,
):
    # SGMV's shrink (reference.ops.sgmv_shrink) plus a K piece per program; kept apart from that
    # kernel because chapter 03 shows it as the exercise's reference, without split-K
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_as, stride_an = tl.cast(stride_as, tl.int64), tl.cast(stride_an, tl.int64)
    stride_ak, stride_om = tl.cast(stride_ak, tl.int64), tl.cast(stride_om, tl.int64)
    stride_on, stride_os = tl.cast(stride_on, tl.int64), tl.cast(stride_os, tl.int64)
    split = tl.program_id(2)
    pid_n = tl.program_id(0) % num_n_tiles
    if PACKED:  # every segment's row blocks back to back (_triton_util.packed_blocks), as the sorted expand
        seg, pid_m, start, seg_len = packed_block(tl.program_id(0) // num_n_tiles, seg_indptr_ptr, num_segments,
                                                  BLOCK_M, SEG_BLOCK)
        seg = tl.minimum(seg, num_segments - 1)  # past the last block: length 0, returns below
    else:
        seg = tl.program_id(1)
        pid_m = tl.program_id(0) // num_n_tiles
        start = tl.load(seg_indptr_ptr + seg)
        seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    slot = tl.load(weight_indices_ptr + seg)
    width = tl.load(lora_ranks_ptr + slot) * STACK_NUM
    if (width == 0) | (pid_m * BLOCK_M >= seg_len) | (pid_n * BLOCK_N >= width):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < seg_len
    n_mask = offs_n < width
    rows = tl.load(permutation_ptr + start + offs_m, mask=m_mask, other=0)
    k_lo = split * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)  # a piece past K sums nothing and still writes its zeros
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot * stride_as + offs_n[None, :] * stride_an + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_hi - k_lo, BLOCK_K)):
        k_mask = offs_k < k_hi - k * BLOCK_K
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
    out_ptrs = out_ptr + split * stride_os + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# Split-K configs measured on an H200 (benchmarks/sweep_split_k.py ->
# benchmarks/results/decode_split_k_h200.json: shrink + expand of one Llama-3-8B projection in a CUDA
# graph, bf16, 8 adapters): (in_features, width) -> {tokens: (S, block_k, num_warps)}; width is
# stack_num * max_rank (qkv 3 parts, gate_up 2); block_k None: the unsplit default. A shape in the
# table takes the swept token count nearest in log2; any other shape takes the rule below.
TUNED_H200 = {
    (4096, 16): {16: (8, 512, 16), 64: (8, 256, 16), 256: (1, None, None)},
    (4096, 32): {16: (8, 256, 16), 64: (4, 512, 16), 256: (2, 2048, 4)},
    (4096, 48): {16: (8, 512, 8), 64: (4, 1024, 4), 256: (4, 1024, 4)},
    (4096, 64): {16: (16, 128, 16), 64: (4, 1024, 4), 256: (4, 1024, 4)},
    (4096, 128): {16: (16, 256, 8), 64: (8, 256, 8), 256: (8, 256, 8)},
    (4096, 192): {16: (16, 128, 8), 64: (16, 128, 8), 256: (16, 128, 8)},
    (14336, 16): {16: (32, 256, 16), 64: (4, 4096, 16), 256: (4, 2048, 4)},
    (14336, 64): {16: (16, 1024, 4), 64: (16, 1024, 4), 256: (4, 4096, 4)},
}
# The rule for shapes outside the table: enough programs to fill the machine (an H200 has 132 SMs;
# about 4 short programs per SM), no piece under MIN_PIECE columns of the hidden size.
TARGET_PROGRAMS = 512
MIN_PIECE = 512


def tuned_config(num_tokens: int, in_features: int, width: int) -> Optional[dict]:
    """The H200 sweep's config for this shape (``splits``, ``block_k``, ``num_warps``), from the
    swept token count nearest in log2 (16, 64, 256); None when the shape was not swept."""
    row = TUNED_H200.get((in_features, width))
    if row is None:
        return None
    nearest = min(row, key=lambda n: (abs(math.log2(n) - math.log2(max(num_tokens, 1))), n))
    S, block_k, num_warps = row[nearest]
    return {"splits": S, "block_k": block_k, "num_warps": num_warps}


def decode_splits(num_tokens: int, in_features: int, width: int) -> int:
    """S, the number of K pieces the decode shrink splits ``in_features`` into (1: no split).

    A swept shape (:data:`TUNED_H200`) takes its measured S. Any other: enough programs to fill
    the GPU (``num_tokens * column_tiles * S >= TARGET_PROGRAMS``) with no piece under
    ``MIN_PIECE`` columns; S a power of two. Host ints in, a host int out (no device read).
    Examples: 64 tokens, hidden 4096, width 16 (o_proj, rank 16) -> 8 (swept); 64 tokens, hidden
    2048, width 16 -> 4 (the rule: capped at 2048 / 512); the CPU tests' hidden 64 -> 1.
    """
    tuned = tuned_config(num_tokens, in_features, width)
    if tuned is not None:
        return tuned["splits"]
    return rule_splits(num_tokens, in_features, width)


def rule_splits(num_tokens: int, in_features: int, width: int) -> int:
    """The fallback rule of :func:`decode_splits` (shapes the sweep did not cover)."""
    tiles = triton.cdiv(max(width, 1), next_pow2_at_least(width, floor=16))
    programs = max(num_tokens, 1) * tiles
    want = triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, programs))
    most = max(1, in_features // MIN_PIECE)
    while want > 1 and want > most:
        want //= 2
    return want


def split_config(num_tokens: int, in_features: int, width: int, splits: int) -> dict:
    """``block_k`` / ``num_warps`` for a shrink of S = ``splits`` pieces.

    The swept config when the shape is in :data:`TUNED_H200` with this S. Otherwise one piece is
    one block when it fits (``block_k`` = the piece, rounded up to a power of two, at most 4096):
    a split program makes a single pass, and warps follow the tile (block_n x block_k elements,
    about 64 per thread, 4 to 16 warps). Unsplit: the tuned H200 default (block_k 4096, 16 warps;
    ``benchmarks/results/tuned_configs.json``).
    """
    tuned = tuned_config(num_tokens, in_features, width)
    if tuned is not None and tuned["splits"] == splits and tuned["block_k"] is not None:
        return {"block_k": tuned["block_k"], "num_warps": tuned["num_warps"]}
    if splits <= 1:
        return {"block_k": 4096, "num_warps": 16}
    block_n = next_pow2_at_least(width, floor=16)
    block_k = min(4096, triton.next_power_of_2(triton.cdiv(in_features, splits)))
    block_k = min(block_k, max(64, 65536 // block_n))
    num_warps = max(4, min(16, triton.next_power_of_2(block_n * block_k // (64 * 32))))
    return {"block_k": block_k, "num_warps": num_warps}


def bgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, stack_num * max_rank, in]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, >= stack_num * max_rank], or [S, num_tokens, >= ...] fp32: split-K
    stack_num: int = 1,
    block_k: Optional[int] = None,
    num_warps: Optional[int] = None,
    schedule: Optional[str] = None,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Launch the BGMV shrink kernel (see the module docstring). Returns ``out``.

    A 3-D ``out`` asks for split-K: ``out[s]`` gets the fp32 partial over the s-th of S equal
    pieces of the hidden size (S = ``out.shape[0]``; pieces are whole ``block_k`` blocks, so a
    trailing piece may be empty and is written as zeros); ``out.sum(0)`` is the shrink.
    :func:`split_config` picks S, ``block_k`` and ``num_warps`` by shape; ``block_k`` /
    ``num_warps`` override it.

    ``schedule`` "token" or "sorted" (see the module docstring; default: the batch's
    ``shrink_schedule``); "sorted" needs the batch's slot-sorted view (``permutation``, segments
    by slot) and takes ``block_m`` (tokens per program,
    default :data:`SORTED_BLOCK_M`), ``block_n`` (default: the width up to 64), ``block_k``
    (default: one piece in one pass, at most 256 columns of 16-bit inputs, 128 of fp32 ones, whose
    pipelined tiles would outgrow an H200's shared memory) and ``num_warps`` (default 4) /
    ``num_stages`` (Triton's default); its blocks are powers of two >= 16, as a GPU ``tl.dot``
    needs (the CPU interpreter would accept smaller ones). The "token" schedule takes neither
    ``block_m``, ``block_n`` nor ``num_stages``.

    Raises:
        ValueError: mismatched shapes or devices, no ``token_slots`` in ``batch_info``, a 3-D
        ``out`` that is not fp32, an unknown schedule, "sorted" without a permutation, a "sorted"
        block that is not a power of two >= 16, or ``block_m`` / ``block_n`` / ``num_stages`` given
        to the "token" schedule.
    """
    check_same_device(x, A_stack, out)
    if batch_info.token_slots is None or batch_info.token_slots.shape[0] != x.shape[0]:
        raise ValueError("bgmv_shrink needs batch_info.token_slots with one slot per row of x")
    width = A_stack.shape[1]
    rows = out if out.dim() == 2 else out[0] if out.dim() == 3 else None
    if rows is None or x.shape[1] != A_stack.shape[2] or rows.shape[0] != x.shape[0] or rows.shape[1] < width:
        raise ValueError(f"shapes x {list(x.shape)}, A_stack {list(A_stack.shape)}, out {list(out.shape)}")
    splits = out.shape[0] if out.dim() == 3 else 1
    if out.dim() == 3 and out.dtype != torch.float32:
        raise ValueError(f"split-K partials must be float32 (they are summed by the expand), got {out.dtype}")
    schedule = batch_info.shrink_schedule if schedule is None else schedule
    if schedule not in ("token", "sorted"):
        raise ValueError(f"schedule must be 'token' or 'sorted', got {schedule!r}")
    if schedule == "sorted" and (batch_info.permutation is None or batch_info.permutation.shape[0] != x.shape[0]):
        raise ValueError("the 'sorted' schedule needs batch_info.permutation (the slot-sorted view) with one "
                         "entry per row of x")
    if schedule == "token" and (block_m, block_n, num_stages) != (None, None, None):
        raise ValueError("block_m, block_n and num_stages configure the 'sorted' schedule only")
    if schedule == "sorted":
        bad = {k: v for k, v in dict(block_m=block_m, block_n=block_n, block_k=block_k).items()
               if v is not None and (v < 16 or v & (v - 1))}
        if bad:
            raise ValueError(f"the 'sorted' schedule's blocks must be powers of two >= 16 (a GPU tl.dot's "
                             f"least size), got {bad}")
    if x.shape[0] == 0:
        return out
    if schedule == "sorted":
        return _shrink_sorted(x, A_stack, batch_info, out, rows, splits, stack_num, block_m, block_n, block_k,
                              num_warps, num_stages)
    K = x.shape[1]
    block_n = next_pow2_at_least(width, floor=16)
    cfg = split_config(x.shape[0], K, width, splits)
    block_k = cfg["block_k"] if block_k is None else block_k
    num_warps = cfg["num_warps"] if num_warps is None else num_warps
    block_k = min(block_k, max(64, 65536 // block_n))  # one tile of A stays in registers
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k  # whole blocks per piece
    grid = (x.shape[0], triton.cdiv(width, block_n), splits)
    _bgmv_shrink_kernel[grid](
        x, A_stack, out, K, k_split,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        out.stride(0) if out.dim() == 3 else 0, rows.stride(0), rows.stride(1),
        batch_info.token_slots, batch_info.lora_ranks,
        STACK_NUM=stack_num, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast(x),
        num_warps=num_warps,
    )
    return out


def _shrink_sorted(x, A_stack, batch_info, out, rows, splits, stack_num, block_m, block_n, block_k, num_warps,
                   num_stages) -> torch.Tensor:
    """The "sorted" schedule's launch (arguments checked by :func:`bgmv_shrink`)."""
    K, width = x.shape[1], A_stack.shape[1]
    block_m = SORTED_BLOCK_M if block_m is None else block_m
    block_n = next_pow2_at_least(min(width, 64)) if block_n is None else block_n
    if block_k is None:  # one piece in one pass where it fits; 256 bf16 columns is SGMV's tuned block
        block_k = min(next_pow2_at_least(triton.cdiv(K, splits)), 256 if x.element_size() <= 2 else 128)
    k_split = triton.cdiv(triton.cdiv(K, splits), block_k) * block_k  # whole blocks per piece
    num_n_tiles = triton.cdiv(width, block_n)
    # segments are slots, empty ones included: every segment's row blocks back to back (host ints: no
    # device read); a grid over (segment, row block) launched cdiv(tokens, block_m) blocks for each slot
    packed = use_packed(x.shape[0], x.shape[0], batch_info.num_segments, block_m)
    if packed:
        grid = (packed_blocks(x.shape[0], batch_info.num_segments, block_m) * num_n_tiles, 1, splits)
    else:
        grid = (triton.cdiv(x.shape[0], block_m) * num_n_tiles, batch_info.num_segments, splits)
    extra = {} if num_stages is None else {"num_stages": num_stages}
    _bgmv_shrink_sorted_kernel[grid](
        x, A_stack, out, K, k_split, num_n_tiles, batch_info.num_segments,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        out.stride(0) if out.dim() == 3 else 0, rows.stride(0), rows.stride(1),
        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks, batch_info.permutation,
        STACK_NUM=stack_num, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=upcast(x),
        IEEE_FP32=tl_float32_dot(x, A_stack), PACKED=packed,
        SEG_BLOCK=seg_block(batch_info.num_segments, packed, batch_info.lora_ranks.shape[0]),
        num_warps=4 if num_warps is None else num_warps, **extra,
    )
    return out
