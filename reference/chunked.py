"""Chunked SGMV segments (SGLang's "csgmv" backend): merge, then cut into fixed-size chunks.

Source: SGLang ``python/sglang/srt/lora/backend/chunked_backend.py`` and its
``triton_ops/chunked_sgmv_*`` kernels. Per-request segments are the natural SGMV view, but a skewed
batch (98 of 100 requests on one adapter) then launches 100 tiny segments; merging adjacent requests
that share a slot gives few segments, and cutting those into chunks of at most ``chunk_size`` tokens
gives every program the same amount of work. The chunk size trades the number of programs (launch
and scheduling overhead) against load balance; it has no universal best value.

Running example (chunk_size 4): seg_lens [3, 2, 6, 1] with slots [1, 1, 2, 0]
    merged:  seg_lens [5, 6, 1], slots [1, 2, 0]
    chunked: seg_lens [4, 1, 4, 2, 1], slots [1, 1, 2, 2, 0]
Chapter 04 teaches it; chapter 07 keeps the per-request view beside it (MoE needs request bounds).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

# merge and cut live beside the other segment helpers in batch_info (batch_info_from_requests uses
# them too); they are this module's API as well
from reference.batch_info import (LoRABatchInfo, build_batch_info, cut_into_chunks, merge_adjacent_segments,
                                  stable_sort_by_slot)

__all__ = ["merge_adjacent_segments", "cut_into_chunks", "build_chunked_batch_info"]


def build_chunked_batch_info(
    req_lens: Sequence[int],
    req_slots: Sequence[int],
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    device: torch.device | str,
    chunk_size: int = 16,
    group_by_slot: bool = False,
) -> LoRABatchInfo:
    """A :class:`LoRABatchInfo` whose segments are chunks of merged same-slot runs.

    With ``group_by_slot`` the tokens are first grouped by slot through a stable permutation (all
    requests of an adapter become one run, wherever they arrived); otherwise only requests that are
    already adjacent merge. ``bs`` stays the number of requests. The ops' results are identical to
    the per-request segments' (the tests check this); only the work split changes.

    Raises:
        ValueError: as :func:`build_batch_info`, :func:`merge_adjacent_segments`, :func:`cut_into_chunks`.
    """
    permutation: Optional[torch.Tensor] = None
    lens, slots = list(req_lens), list(req_slots)
    if group_by_slot:
        token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32),
                                              torch.tensor(lens, dtype=torch.int64))
        permutation, _ = stable_sort_by_slot(token_slots)
        order = sorted(range(len(slots)), key=lambda i: slots[i])  # stable, like the permutation
        lens, slots = [lens[i] for i in order], [slots[i] for i in order]
    lens, slots = cut_into_chunks(*merge_adjacent_segments(lens, slots), chunk_size)
    info = build_batch_info(lens, slots, lora_ranks, scalings, device, permutation)
    info.bs = len(req_lens)
    return info
