"""LoRA batching ops in plain PyTorch, written for clarity, not speed: the references that every
Triton kernel of the book (chapters 03-04) is checked against, with identical signatures.

Sources: Punica (Chen et al., 2023) for BGMV and SGMV; SGLang ``python/sglang/srt/lora/`` and
vLLM ``vllm/lora/ops/torch_ops`` for the shrink/expand split and the ``out=`` convention.

Layout (the book's contract, see ``reference.batch_info``):
    A_stack [num_slots, stack_num * max_rank, in]   B_stack [num_slots, out_total, max_rank]
A slot of rank r uses rows [:stack_num * r] of A (part i at rows [i*r, (i+1)*r)) and columns [:r]
of B; everything past that is padding that an op must never read. Every op accumulates in fp32 and
writes in ``out.dtype``; callers preallocate ``out``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from reference.batch_info import LoRABatchInfo

__all__ = [
    "lora_loop",
    "bgmv_shrink",
    "bgmv_expand",
    "sgmv_shrink",
    "sgmv_expand",
    "shrink",
    "expand",
    "fused_decode",
    "lora_gemm",
]


def _acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulation precision: fp32 for 16-bit inputs, never below the input's own precision."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _segment_rows(batch_info: LoRABatchInfo, seg: int, seg_indptr: list[int]) -> torch.Tensor:
    """Rows of x that segment ``seg`` covers, through the permutation when there is one."""
    rows = torch.arange(seg_indptr[seg], seg_indptr[seg + 1], device=batch_info.seg_indptr.device)
    return rows if batch_info.permutation is None else batch_info.permutation[rows]


def _slices(slice_offsets: Optional[Sequence[int]], out_width: int) -> list[tuple[int, int]]:
    offsets = (0, out_width) if slice_offsets is None else tuple(slice_offsets)
    return list(zip(offsets[:-1], offsets[1:]))


def lora_loop(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out], the base output, updated in place
) -> torch.Tensor:
    """The per-request loop: the simplest correct multi-adapter LoRA, one request at a time.

    Semantics:
        for seg in segments:
            rows = seg_indptr[seg]:seg_indptr[seg+1]; s = weight_indices[seg]; r = lora_ranks[s]
            out[rows] += scalings[s] * (x[rows] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
    A rank-0 slot (base model or empty) adds nothing. The intermediate is rounded to x.dtype, as
    between a shrink and an expand kernel. Returns ``out``.
    """
    indptr = batch_info.seg_indptr.tolist()
    slots = batch_info.weight_indices.tolist()
    ranks = batch_info.lora_ranks.tolist()
    for seg, slot in enumerate(slots):
        r = ranks[slot]
        if r == 0 or indptr[seg] == indptr[seg + 1]:
            continue
        rows = _segment_rows(batch_info, seg, indptr)
        t = (_acc(x[rows]) @ _acc(A_stack[slot, :r]).T).to(x.dtype)
        delta = batch_info.scalings[slot] * (_acc(t) @ _acc(B_stack[slot, :, :r]).T)
        out[rows] = (_acc(out[rows]) + delta).to(out.dtype)
    return out


def bgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, stack_num * max_rank, in]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, >= stack_num * max_rank]
    stack_num: int = 1,
) -> torch.Tensor:
    """BGMV shrink: every token gathers its own slot's A (the decode case).

    Semantics:
        s = token_slots[tok]; r = lora_ranks[s]
        out[tok, :stack_num*r] = x[tok] @ A_stack[s, :stack_num*r].T      (fp32 accumulation)
    Columns past stack_num*r are left as they were. Reads only ``token_slots``. Returns ``out``.
    A 3-D ``out`` [S, num_tokens, width] (fp32) gets split-K partials: ``out[s]`` sums the s-th of
    S pieces of ``in`` (whole pieces of ceil(in / S) columns; a trailing piece may be empty), so
    ``out.sum(0)`` is the shrink; ``bgmv_expand`` reads such an ``out`` as its sum.
    """
    slots = batch_info.token_slots.long()
    A = _acc(A_stack[slots])  # [num_tokens, stack_num * max_rank, in]: the per-token gather
    width = stack_num * batch_info.lora_ranks[slots].long()
    defined = torch.arange(A.shape[1], device=x.device)[None, :] < width[:, None]
    if out.dim() == 3:
        piece = -(-x.shape[1] // out.shape[0])
        for s in range(out.shape[0]):
            cols = slice(s * piece, (s + 1) * piece)
            t = torch.einsum("ti,tri->tr", _acc(x[:, cols]), A[:, :, cols])
            region = out[s, :, : A.shape[1]]
            region.copy_(torch.where(defined, t.to(out.dtype), region))
        return out
    t = torch.einsum("ti,tri->tr", _acc(x), A)
    region = out[:, : A.shape[1]]
    region.copy_(torch.where(defined, t.to(out.dtype), region))
    return out


def bgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= stack_num * max_rank]
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out_total], updated in place
    slice_offsets: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """BGMV expand: every token gathers its own slot's B and adds its scaled product in place.

    Semantics:
        s = token_slots[tok]; r = lora_ranks[s]
        for i, (lo, hi) in enumerate(slices):
            out[tok, lo:hi] += scalings[s] * t[tok, i*r:(i+1)*r] @ B_stack[s, lo:hi, :r].T
    Rank 0 adds exactly nothing. Reads only ``token_slots``. Returns ``out``. A 3-D ``t`` holds
    split-K partials ([S, num_tokens, width], see ``bgmv_shrink``): their fp32 sum is read.
    """
    if t.dim() == 3:
        t = _acc(t).sum(0)
    slots = batch_info.token_slots.long()
    ranks = batch_info.lora_ranks[slots].long()
    scale = batch_info.scalings[slots].float()
    max_rank = B_stack.shape[2]
    k = torch.arange(max_rank, device=t.device)
    for i, (lo, hi) in enumerate(_slices(slice_offsets, out.shape[1])):
        cols = (i * ranks[:, None] + k[None, :]).clamp(max=t.shape[1] - 1)  # part i of each token
        part = torch.gather(_acc(t), 1, cols)
        keep = k[None, :] < ranks[:, None]
        part = torch.where(keep, part, 0.0)
        B = torch.where(keep[:, None, :], _acc(B_stack[slots, lo:hi]), 0.0)  # per-token gather
        delta = scale[:, None] * torch.einsum("tr,tor->to", part, B)
        out[:, lo:hi] = (_acc(out[:, lo:hi]) + delta).to(out.dtype)
    return out


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, stack_num * max_rank, in]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, >= stack_num * max_rank]
    stack_num: int = 1,
) -> torch.Tensor:
    """SGMV shrink: one small GEMM per segment of tokens that share a slot (the prefill case).

    Semantics:
        for seg: rows = perm[seg_indptr[seg]:seg_indptr[seg+1]]; s = weight_indices[seg]
                 r = lora_ranks[s]
                 out[rows, :stack_num*r] = x[rows] @ A_stack[s, :stack_num*r].T
    ``perm`` is ``batch_info.permutation`` or the identity. No scaling here (expand applies it).
    Columns past stack_num*r are left as they were. Returns ``out``.
    """
    indptr = batch_info.seg_indptr.tolist()
    ranks = batch_info.lora_ranks.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        width = stack_num * ranks[slot]
        if width == 0 or indptr[seg] == indptr[seg + 1]:
            continue
        rows = _segment_rows(batch_info, seg, indptr)
        out[rows, :width] = (_acc(x[rows]) @ _acc(A_stack[slot, :width]).T).to(out.dtype)
    return out


def sgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= stack_num * max_rank]
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out_total], updated in place
    slice_offsets: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """SGMV expand: per segment, add the scaled low-rank product into the base output in place.

    Semantics:
        for seg: rows, s, r as in sgmv_shrink
            for i, (lo, hi) in enumerate(slices):
                out[rows, lo:hi] += scalings[s] * t[rows, i*r:(i+1)*r] @ B_stack[s, lo:hi, :r].T
    ``slices`` come from ``slice_offsets`` (host ints), default one slice ``(0, out.shape[1])``.
    Rank 0 adds exactly nothing. Returns ``out``.
    """
    indptr = batch_info.seg_indptr.tolist()
    ranks = batch_info.lora_ranks.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = ranks[slot]
        if r == 0 or indptr[seg] == indptr[seg + 1]:
            continue
        rows = _segment_rows(batch_info, seg, indptr)
        for i, (lo, hi) in enumerate(_slices(slice_offsets, out.shape[1])):
            part = _acc(t[rows, i * r : (i + 1) * r])
            delta = batch_info.scalings[slot] * (part @ _acc(B_stack[slot, lo:hi, :r]).T)
            out[rows, lo:hi] = (_acc(out[rows, lo:hi]) + delta).to(out.dtype)
    return out


#: The contract names of the book's ops; the torch references use the SGMV form.
shrink = sgmv_shrink
expand = sgmv_expand


def fused_decode(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: LoRABatchInfo,
    out: torch.Tensor,  # [num_tokens, out], updated in place
) -> torch.Tensor:
    """Shrink then expand for decode (reads ``token_slots``); the Triton version does both in one
    launch so the intermediate never leaves the chip.

    Semantics:
        out[tok] += scalings[s] * (x[tok] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
    Returns ``out``.
    """
    t = torch.zeros(x.shape[0], A_stack.shape[1], dtype=x.dtype, device=x.device)
    bgmv_shrink(x, A_stack, batch_info, t)
    return bgmv_expand(t, B_stack, batch_info, out)


def lora_gemm(
    x: torch.Tensor,  # [M, K]
    W: torch.Tensor,  # [N, K]
    out: Optional[torch.Tensor] = None,  # [M, N]
    t: Optional[torch.Tensor] = None,  # [M, stack_num * max_rank]
    B_stack: Optional[torch.Tensor] = None,  # [num_slots, N, max_rank]
    batch_info: Optional[LoRABatchInfo] = None,
    part: int = 0,
    config: Optional[dict] = None,  # accepted for the Triton op's signature; unused here
) -> torch.Tensor:
    """The base GEMM with each row's LoRA expand added before the one rounding (reads ``token_slots``).

    Semantics:
        s = token_slots[m]; r = lora_ranks[s]
        out[m] = x[m] @ W.T + scalings[s] * t[m, part*r:(part+1)*r] @ B_stack[s, :, :r].T
    accumulated in fp32 (fp64 for fp64 inputs) and rounded once. Returns ``out``.
    """
    y = _acc(x) @ _acc(W).T
    if batch_info is not None:
        slots = batch_info.token_slots.long()
        ranks = batch_info.lora_ranks[slots].long()
        scale = batch_info.scalings[slots].to(y.dtype)
        k = torch.arange(B_stack.shape[2], device=x.device)
        cols = (part * ranks[:, None] + k[None, :]).clamp(max=t.shape[1] - 1)
        keep = k[None, :] < ranks[:, None]
        tp = torch.where(keep, torch.gather(_acc(t.to(x.dtype)), 1, cols), 0.0)
        B = torch.where(keep[:, None, :], _acc(B_stack[slots]), 0.0)
        y = y + scale[:, None] * torch.einsum("tr,tor->to", tp, B)
    if out is None:
        out = x.new_empty(y.shape)
    out.copy_(y.to(out.dtype))
    return out
