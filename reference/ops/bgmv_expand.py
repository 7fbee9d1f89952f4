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
- ``"sorted"``: SGMV's expand kernel (``reference.ops.sgmv_expand``) over the batch's slot-sorted
  view: ``seg_indptr`` / ``weight_indices`` / ``num_segments`` group the tokens by slot and
  ``permutation`` lists them (sorted row i is token permutation[i]), so one program per (segment,
  block of ``block_m`` of its tokens, column tile) reads its B tile once for the whole block and
  applies one ``tl.dot``; the grid covers segments up to the batch's token count. A CUDA-graph
  decode batch carries that view (``reference.cuda_graph.StaticLoRABatch``; TensorRT-LLM's per-slot
  counts, offsets and sorted token ids; vLLM sorts token indices by lora id the same way).

Which one: the expand's part of the step's decode schedule (``reference.ops.decode_schedule``,
a table of measured whole steps; :func:`choose_expand_schedule` gives that part), from host values
(tokens, distinct adapters, the pool's max rank), so a CUDA-graph runner captures both and replays
the one that fits the step (``schedule=None`` reads the batch's ``expand_schedule``, "token" unless
its builder chose). Measured on an H200 in the whole 8-layer decode step, one run
(``benchmarks/results/decode_step_schedule_h200.json``, LoRA overhead over the base step): at rank
64 "sorted" wins at 8 or more tokens per adapter (64 x 8: +35.0% against +39.4%; 256 x 32: +41.3%
against +53.8%) and not at 4 or 2 (64 x 16: +41.2% against +40.7%; 64 x 32: +54.8% against
+43.2%), where a block of 16 rows is mostly padding while per token the B tile is re-read only a
few times; at rank 16 it wins by less than the noise at 256 x 8 and 256 x 16 and loses at every
64-sequence batch and at 256 x 32 (64 x 8: +19.9% against +15.0%): the B tiles are 4x smaller, so
their re-reads cost less than the sorted launch's padding and its partials' reduction.

"sorted" sums split-K partials with one torch reduction before its launch (``sgmv_expand`` does,
``_triton_util.summed_partials``). Summed inside the
``tl.dot`` kernel (as "token" does, per row) the S = 16 [16, rank 64] fp32 tiles of the widest
shrinks cost registers and spills: 351.4 against 43.6 us for one gate/up expand at 64 tokens on 8
adapters (``benchmarks/results/decode_expand_s16_h200.json``), and +233.7% against +35.0% with the
reduction first on the whole step at 64 x 8, rank 64 (``benchmarks/results/decode_step_r64_h200.json``).

A first adapter-grouped schedule without the sorted view (each slot's program scanned all of
``token_slots`` for its tokens) was 1.06-2.06x slower than "token" at every swept shape
(``benchmarks/results/decode_expand_slot_h200.json``): every program paid the scan and a
[block_t, r] x [r, block_n] product per token block for the few rows that were its own.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import check_same_device, load_summed, next_pow2_at_least, shrink_rows
from reference.ops.decode_schedule import choose_decode_schedule, schedule_parts
from reference.ops.sgmv_expand import _slice_bound, sgmv_expand, slice_bounds

__all__ = ["bgmv_expand", "choose_expand_schedule"]


def choose_expand_schedule(num_tokens: int, num_adapters: int, max_rank: int) -> str:
    """The decode expand's schedule for a batch of ``num_tokens`` tokens over ``num_adapters``
    distinct adapters of rank > 0, served from a pool of max rank ``max_rank`` (host ints): "sorted"
    when the step's decode schedule (:func:`reference.ops.decode_schedule.choose_decode_schedule`,
    the committed H200 runs' table) groups the expand by slot ("sorted" or "grouped"), else "token".
    Examples: (64, 8, 64) -> "sorted"; (64, 16, 64) -> "token"; (64, 8, 16) -> "token";
    (16, 1, 64) -> "token"."""
    return schedule_parts(choose_decode_schedule(num_tokens, num_adapters, max_rank))[1]


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
    t_row = load_summed(t_ptrs, stride_ts, k_mask, NUM_SPLITS).to(tl.float32)  # split-K partials summed
    b_tile = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_k[None, :] * stride_bk,
                     mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    delta = tl.sum(b_tile.to(tl.float32) * t_row[None, :], axis=1)
    out_ptrs = out_ptr + tok * stride_om + offs_n * stride_on
    base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + scaling * delta).to(out_ptr.dtype.element_ty), mask=n_mask)


def bgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= num_slices * max_rank], or [S, num_tokens, ...]: split-K partials
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out_total], updated in place
    slice_offsets: Optional[Sequence[int]] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    schedule: Optional[str] = None,
    block_m: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> torch.Tensor:
    """Launch the BGMV expand kernel (see the module docstring). Returns ``out``.

    ``schedule`` "token" or "sorted" (see the module docstring; default: the batch's
    ``expand_schedule``); "sorted" needs the batch's slot-sorted view (``permutation``, segments by
    slot), sums split-K partials first (one torch reduction) and takes ``block_m`` (tokens per
    program, default 16), ``block_n`` (default 256), ``num_warps`` (default 4) and ``num_stages``
    (default 1: its K loop is one pass).

    ``block_n`` (output columns per program) of the "token" schedule defaults by the pool's max
    rank, from a sweep on an H200 (hidden 4096, bf16, 16-256 tokens;
    ``benchmarks/results/decode_rank_sweep_h200.json``): 256 up to rank 16, 128 up to 32, 64 beyond
    (each program's B tile is block_n x rank: wider ranks want narrower tiles and more programs;
    rank 64 at 256 tokens 52.8 -> 46.4 us).

    Raises:
        ValueError: mismatched shapes or devices, bad ``slice_offsets``, no ``token_slots``, an
        unknown schedule, or "sorted" without a permutation.
    """
    check_same_device(t, B_stack, out)
    splits, rows, stride_ts = shrink_rows(t)
    if batch_info.token_slots is None or batch_info.token_slots.shape[0] != rows.shape[0]:
        raise ValueError("bgmv_expand needs batch_info.token_slots with one slot per row of t")
    bounds = slice_bounds(slice_offsets, out.shape[1])
    num_slices = 1 if slice_offsets is None else len(slice_offsets) - 1
    if out.shape[0] != rows.shape[0] or B_stack.shape[1] < bounds[-1]:
        raise ValueError(f"shapes t {list(t.shape)}, B_stack {list(B_stack.shape)}, out {list(out.shape)}")
    schedule = batch_info.expand_schedule if schedule is None else schedule
    if schedule not in ("token", "sorted"):
        raise ValueError(f"schedule must be 'token' or 'sorted', got {schedule!r}")
    if schedule == "sorted" and (batch_info.permutation is None or batch_info.permutation.shape[0] != rows.shape[0]):
        raise ValueError("the 'sorted' schedule needs batch_info.permutation (the slot-sorted view) with one "
                         "entry per row of t")
    if rows.shape[0] == 0:
        return out
    if schedule == "sorted":
        # sgmv_expand sums split-K partials first (see the module docstring)
        return sgmv_expand(t, B_stack, batch_info, out, slice_offsets, block_m=16 if block_m is None else block_m,
                           block_n=256 if block_n is None else block_n,
                           num_warps=4 if num_warps is None else num_warps, max_len=rows.shape[0],
                           num_stages=1 if num_stages is None else num_stages, packed=True)
    widest = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
    if block_n is None:
        block_n = 256 if B_stack.shape[2] <= 16 else 128 if B_stack.shape[2] <= 32 else 64
    grid = (rows.shape[0], triton.cdiv(max(widest, 1), block_n), num_slices)
    _bgmv_expand_kernel[grid](
        t, B_stack, out, *bounds,
        stride_ts, rows.stride(0), rows.stride(1), B_stack.stride(0), B_stack.stride(1), B_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
        BLOCK_N=block_n, BLOCK_K=next_pow2_at_least(B_stack.shape[2]), NUM_SPLITS=splits,
        num_warps=2 if num_warps is None else num_warps,
    )
    return out
