"""Per-batch LoRA metadata: the only object that crosses from the control plane to the kernels.

Source: SGLang ``python/sglang/srt/lora/utils.py`` (``LoRABatchInfo``) and Punica's SGMV segments
(Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023). Chapter 02 builds it from segment lists;
chapter 07 builds it from requests and the memory pool.

Running example used in the comments below: three requests of 3, 10 and 5 tokens using slots 2, 0, 1
(slot 0 holds the base model, rank 0):
    seg_lens [3, 10, 5] -> seg_indptr [0, 3, 13, 18]; weight_indices [2, 0, 1];
    token_slots [2, 2, 2, 0 x 10, 1 x 5].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = [
    "LoRABatchInfo",
    "seg_indptr_from_seg_lens",
    "token_slots_from_segments",
    "stable_sort_by_slot",
    "build_batch_info",
]


@dataclass
class LoRABatchInfo:
    """What the LoRA ops of one forward pass read. Tensors live on x's device; host fields are
    Python values, so reading them never synchronizes the device.

    Which ops read what: ``sgmv_*`` read ``seg_indptr``, ``weight_indices`` and ``permutation``;
    ``bgmv_*`` and ``fused_decode`` read only ``token_slots``. Every op reads ``lora_ranks`` and
    ``scalings``. A slot of rank 0 (the base model, or an empty slot) contributes exactly zero.
    """

    bs: int  # host: number of requests
    num_segments: int  # host: number of segments (== bs unless segments are merged or chunked)
    max_len: int  # host: longest segment, in tokens
    has_active_lora: bool  # host: some segment uses a slot of rank > 0 (from host lists)
    seg_lens: torch.Tensor  # [num_segments] int32
    seg_indptr: torch.Tensor  # [num_segments + 1] int32, seg_indptr[0] == 0
    weight_indices: torch.Tensor  # [num_segments] int32, slot of each segment
    lora_ranks: torch.Tensor  # [num_slots] int32, 0 = base model or empty slot
    scalings: torch.Tensor  # [num_slots] float32, 0 for base and empty slots
    permutation: Optional[torch.Tensor] = None  # [num_tokens] int64: sorted row i is x[permutation[i]]
    token_slots: Optional[torch.Tensor] = None  # [num_tokens] int32, slot of each token (x order)

    @property
    def num_tokens(self) -> int:
        """Tokens in the batch (host int, from the sizes, no device read)."""
        if self.permutation is not None:
            return self.permutation.shape[0]
        if self.token_slots is not None:
            return self.token_slots.shape[0]
        raise ValueError("num_tokens needs permutation or token_slots; use seg_indptr on the host")


def seg_indptr_from_seg_lens(seg_lens: torch.Tensor) -> torch.Tensor:
    """CSR offsets of segments: seg_lens [3, 10, 5] -> seg_indptr [0, 3, 13, 18].

    Args:
        seg_lens: [num_segments] integer tensor (any device), lengths >= 0.
    Returns:
        [num_segments + 1] int32 on seg_lens' device, starting at 0: segment i is rows
        seg_indptr[i] : seg_indptr[i+1].
    """
    out = torch.zeros(seg_lens.shape[0] + 1, dtype=torch.int32, device=seg_lens.device)
    out[1:] = torch.cumsum(seg_lens, dim=0)
    return out


def token_slots_from_segments(seg_indptr: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """Per-token slot ids, the view BGMV reads: segment i's slot repeated seg_lens[i] times.

    seg_indptr [0, 3, 13, 18], weight_indices [2, 0, 1] -> [2, 2, 2, 0 (x10), 1 (x5)].

    Args:
        seg_indptr: [num_segments + 1] int32, starting at 0.
        weight_indices: [num_segments] int32 slot per segment.
    Returns:
        [seg_indptr[-1]] int32 on weight_indices' device (empty segments contribute nothing).
    """
    seg_lens = (seg_indptr[1:] - seg_indptr[:-1]).long()
    return torch.repeat_interleave(weight_indices.to(torch.int32), seg_lens)


def stable_sort_by_slot(token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group tokens by slot for SGMV when requests arrive in any order.

    A *stable* sort keeps the tokens of one request in their original order inside their group.
    token_slots [1, 0, 1, 2] -> permutation [1, 0, 2, 3], inverse [1, 0, 2, 3]:
    sorted row i is row permutation[i] of x; row j of x is sorted row inverse[j].

    Returns:
        (permutation, inverse), both [num_tokens] int64 on token_slots' device.
    """
    permutation = torch.sort(token_slots, stable=True).indices
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.shape[0], device=permutation.device)
    return permutation, inverse


def build_batch_info(
    seg_lens: Sequence[int],
    weight_indices: Sequence[int],
    lora_ranks: Sequence[int],
    scalings: Sequence[float],
    device: torch.device | str,
    permutation: Optional[torch.Tensor] = None,
) -> LoRABatchInfo:
    """Build a :class:`LoRABatchInfo` from host lists, one segment per request.

    Host fields come from the lists, so nothing here waits for the device. ``token_slots`` is in x
    order: with a permutation, sorted row i (segment of i) belongs to token permutation[i].

    Raises:
        ValueError: mismatched lengths, a slot out of range, a negative length, or a permutation
        whose length differs from sum(seg_lens).
    """
    if len(seg_lens) != len(weight_indices):
        raise ValueError(f"{len(seg_lens)} seg_lens but {len(weight_indices)} weight_indices")
    if len(lora_ranks) != len(scalings):
        raise ValueError(f"{len(lora_ranks)} lora_ranks but {len(scalings)} scalings")
    if any(n < 0 for n in seg_lens):
        raise ValueError(f"negative segment length in {list(seg_lens)}")
    if any(not 0 <= s < len(lora_ranks) for s in weight_indices):
        raise ValueError(f"weight_indices {list(weight_indices)} outside slots 0..{len(lora_ranks) - 1}")
    num_tokens = sum(seg_lens)
    if permutation is not None and permutation.shape[0] != num_tokens:
        raise ValueError(f"permutation has {permutation.shape[0]} rows, segments cover {num_tokens}")
    lens = torch.tensor(list(seg_lens), dtype=torch.int32, device=device)
    indptr = seg_indptr_from_seg_lens(lens)
    w_idx = torch.tensor(list(weight_indices), dtype=torch.int32, device=device)
    sorted_slots = token_slots_from_segments(indptr, w_idx)
    token_slots = sorted_slots
    if permutation is not None:
        permutation = permutation.to(device=device, dtype=torch.int64)
        token_slots = torch.empty_like(sorted_slots)
        token_slots[permutation] = sorted_slots
    return LoRABatchInfo(
        bs=len(seg_lens),
        num_segments=len(seg_lens),
        max_len=max(seg_lens, default=0),
        has_active_lora=any(n > 0 and lora_ranks[s] > 0 for n, s in zip(seg_lens, weight_indices)),
        seg_lens=lens,
        seg_indptr=indptr,
        weight_indices=w_idx,
        lora_ranks=torch.tensor(list(lora_ranks), dtype=torch.int32, device=device),
        scalings=torch.tensor(list(scalings), dtype=torch.float32, device=device),
        permutation=permutation,
        token_slots=token_slots,
    )
