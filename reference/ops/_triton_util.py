"""Small helpers shared by the book's Triton ops: host-side checks, the split-K partials' reduction
for the ops that tile t, and the device helper with which the per-token expand sums them instead."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from reference.device import interpreting

__all__ = ["upcast", "next_pow2_at_least", "check_same_device", "tl_float32_dot", "shrink_rows", "summed_partials",
           "load_summed", "packed_block", "packed_blocks", "use_packed", "MAX_PACKED_SEGMENTS"]

#: The most segments whose row blocks a kernel packs (:func:`packed_block` holds one value per segment
#: in registers); a batch with more takes the grid over every (segment, row block) instead.
MAX_PACKED_SEGMENTS = 4096


def upcast(*tensors: torch.Tensor) -> bool:
    """True when kernels must convert 16-bit loads to fp32 before arithmetic.

    Triton's CPU interpreter computes bf16 arithmetic and bf16 ``tl.dot`` wrongly without an error;
    on the GPU the native bf16 dot (with fp32 accumulation) is both right and fast.
    """
    return interpreting()


def tl_float32_dot(*tensors: torch.Tensor) -> bool:
    """True when every input is fp32: the kernel then asks ``tl.dot`` for IEEE fp32, not TF32."""
    return all(t.dtype == torch.float32 for t in tensors)


def next_pow2_at_least(n: int, floor: int = 16) -> int:
    """Block size covering ``n``, at least ``floor`` (a GPU ``tl.dot`` needs K, N >= 16)."""
    return max(floor, triton.next_power_of_2(max(n, 1)))


def check_same_device(*tensors: torch.Tensor) -> None:
    """Raises ValueError if the tensors are not all on one device."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"tensors on several devices: {sorted(map(str, devices))}")


def shrink_rows(t: torch.Tensor) -> tuple[int, torch.Tensor, int]:
    """What a kernel reading a shrink's output needs: ``(S, rows, stride_s)``.

    ``t`` [num_tokens, width] -> (1, t, 0); the split-K shrink's fp32 partials [S, num_tokens, width]
    (``bgmv_shrink`` with a 3-D out) -> (S, t[0], t.stride(0)), whose sum over S is the shrink.

    Raises:
        ValueError: t neither 2-D nor 3-D, or 3-D partials not in float32.
    """
    if t.dim() == 2:
        return 1, t, 0
    if t.dim() == 3 and t.dtype == torch.float32:
        return t.shape[0], t[0], t.stride(0)
    raise ValueError(f"t must be [num_tokens, width] or fp32 split-K partials [S, num_tokens, width], got "
                     f"{list(t.shape)} ({t.dtype})")


def summed_partials(t: torch.Tensor) -> torch.Tensor:
    """t as one [num_tokens, width] tensor: 2-D as it is; the split-K shrink's fp32 partials
    [S, num_tokens, width] summed by one torch reduction (fp32).

    For the kernels that load t as [rows, rank] tiles for ``tl.dot`` (SGMV's expand, the fused
    GEMM's epilogue): summed inside them, the S partial tiles are live together and spill (an H200
    expand at 16 partials: 352 against 44 us, ``benchmarks/results/decode_expand_s16_h200.json``).
    The per-token expand, which loads one row, sums them as it loads (:func:`load_summed`).

    Raises:
        ValueError: as :func:`shrink_rows`.
    """
    shrink_rows(t)
    return t.sum(0) if t.dim() == 3 else t


@triton.jit
def load_summed(ptrs, stride_s, mask, NUM_SPLITS: tl.constexpr):
    """Load a tile of the shrink's output: with NUM_SPLITS > 1 the sum of its fp32 split-K partials
    (``stride_s`` apart), added as they are loaded, so the split needs no reduction kernel."""
    stride_s = tl.cast(stride_s, tl.int64)  # S * stride_s passes 2^31 at real sizes, as every stride here
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, NUM_SPLITS):
        acc += tl.load(ptrs + s * stride_s, mask=mask, other=0.0)
    return acc


def packed_blocks(num_tokens: int, num_segments: int, block_m: int) -> int:
    """Row blocks a packed grid launches (host ints): every segment's ``cdiv(len, block_m)`` blocks back
    to back need at most ``cdiv(num_tokens, block_m) + min(num_segments, num_tokens)`` (each segment
    holding a token adds at most one partial block to the ``num_tokens / block_m`` full ones).

    Why: a CUDA-graph decode batch's slot-sorted view has one segment per pool slot, empty ones
    included, and its token count as every segment's possible length; a grid over (segment, row
    block) launches ``cdiv(tokens, block_m)`` blocks for each slot. Measured on an H100 (rank 64, 256
    tokens on one adapter, the grouped schedule): 21.0% over the base step with 33 pool slots
    (``decode_step_peers2_h100.json``) against 12.1% with 9 (``decode_step_profile256_h100.json``),
    the same work: the difference was programs that found their segment empty and returned.
    """
    return triton.cdiv(num_tokens, block_m) + min(num_segments, num_tokens)


def seg_block(num_segments: int, packed: bool, num_slots: int = 0) -> int:
    """The ``SEG_BLOCK`` constexpr of a launch: for the packed grid a power of two >= ``num_segments``
    and >= ``num_slots`` (:func:`packed_block` holds one value per segment), a fixed 16 otherwise (not
    read then). Host ints.

    Why the slots: a constexpr that follows the step's segment count compiles one kernel variant per
    power of two it reaches, and with rows grouped by adapter (the engine's ``sort_lora_by_slot``) a
    step's segments are its distinct adapters, at most the pool's slots. Sized by the slots, the
    steps of one pool launch two variants of each kernel, packed or not (a step of one segment is
    not packed), whatever their adapter counts; a variant first met mid-serving costs a compile of
    about a second in which every running request waits (the likely cause of the stall in
    ``benchmarks/results/engine_run9_h100.json``'s D=64 row, its caveats; run 10, sized so, did
    not stall). For the same reason the kernels do not specialize their ``num_segments`` argument
    (``do_not_specialize``: Triton compiles a variant for an integer argument of 1 and for one
    divisible by 16). Not covered: a view with more segments than slots (one per sequence:
    ``sort_lora_by_slot`` off, or a chunked view), whose block still follows its count, and other
    arguments that follow the token count (the split-K partials' stride), which the CUDA-graph
    decode path fixes per bucket. The slots count at most :data:`MAX_PACKED_SEGMENTS` (beyond it
    the grid is not packed anyway).

    The cost: every program of a packed launch scans ``SEG_BLOCK`` offsets in :func:`packed_block`,
    so a step with fewer adapters than slots scans more than it needs (chapter 11 section 9,
    run 9 against run 10)."""
    return next_pow2_at_least(max(num_segments, min(num_slots, MAX_PACKED_SEGMENTS))) if packed else 16


def use_packed(num_tokens: int, max_len: int, num_segments: int, block_m: int) -> bool:
    """True when the packed grid launches fewer row blocks than the grid over every (segment, row block
    of ``max_len`` rows), and the segments fit :data:`MAX_PACKED_SEGMENTS` (host ints)."""
    return (num_segments <= MAX_PACKED_SEGMENTS
            and packed_blocks(num_tokens, num_segments, block_m) < triton.cdiv(max_len, block_m) * num_segments)


@triton.jit
def packed_block(pid_m, seg_indptr_ptr, num_segments, BLOCK_M: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """The ``pid_m``-th row block of a packed grid (:func:`packed_blocks`): ``(segment, its row block,
    start, length)`` of the segment whose blocks hold it; past the last block, a segment index of
    ``num_segments`` or more, length 0 and a row block >= 0 (so ``row block * BLOCK_M >= length``). Every program reads the ``num_segments + 1`` offsets of ``seg_indptr`` (SEG_BLOCK, a
    power of two >= num_segments, at a time) and finds its segment by a prefix sum of the segments'
    block counts, in registers: no metadata beyond the slot-sorted view, computed by nobody else.
    (SGLang's chunked SGMV and TensorRT-LLM's grouped GEMM get the same map from a host-built table.)"""
    offs = tl.arange(0, SEG_BLOCK)
    valid = offs < num_segments
    starts = tl.load(seg_indptr_ptr + offs, mask=valid, other=0)
    ends = tl.load(seg_indptr_ptr + offs + 1, mask=valid, other=0)
    blocks = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last = tl.cumsum(blocks, 0)  # one past each segment's last block
    seg = tl.sum((last <= pid_m).to(tl.int32), 0)  # empty segments end where the one before them does
    pick = offs == seg
    first = tl.sum(tl.where(pick, last - blocks, 0), 0)
    start = tl.sum(tl.where(pick, starts, 0), 0)
    length = tl.sum(tl.where(pick, ends - starts, 0), 0)
    return seg, pid_m - first, start, length
