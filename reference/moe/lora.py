"""MoE LoRA: one delta per (adapter, expert) pair, scheduled as "virtual experts" (chapter 09).

A token of a mixture-of-experts layer goes to ``top_k`` experts, and each of those experts has its
own LoRA weights in every adapter. The buffers of a MoE module gain an expert axis (SGLang's 4-D MoE
LoRA buffers; TRT-LLM offsets both pointers by ``expert_index * dim * rank``)::

    A [num_slots, num_experts, stack_num * max_rank, in]    B [num_slots, num_experts, out_total, max_rank]
    lora_ranks [num_slots, num_experts]  (rank 0: this adapter has no weights for this expert here)

A (token, choice) *pair* ``p = token * top_k + j`` runs expert ``e = topk_ids[token, j]`` under the
token's adapter slot ``s``. Indexing the pair by ``virtual = s * num_experts + e`` (SGLang's virtual
experts) turns the problem into an ordinary routed MoE over ``num_slots * num_experts`` experts, so
the grouped GEMM's own machinery schedules it: sort the pairs by virtual expert and pad each group
to the block size (vLLM / SGLang ``moe_align_block_size``), then one program per block of pairs
that share one (slot, expert) and so one A and one B.

Contract of the MoE LoRA op (the torch reference here, the Triton kernel in
``reference.moe.fused_moe_lora``, identical signatures)::

    fused_moe_lora(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k,
                   rows_per_pair, slice_offsets=None, topk_weights=None) -> out

    for every pair p = (t, j) with e = topk_ids[t, j] >= 0, s = token_slots[t], r = lora_ranks[s, e] > 0:
        row = x[p] if rows_per_pair else x[t]          # down reads the pair's activation, gate_up the token
        for slice i (out columns [o_i, o_{i+1})):
            h = row @ A[s, e, i*r:(i+1)*r].T           # shrink, fp32, rounded to x.dtype
            out[p, o_i:o_{i+1}] += scalings[s] * (w[t, j] if topk_weights is given else 1) * h @ B[s, e, o_i:o_{i+1}, :r].T

Where the routing weight goes: transformers' Mixtral and Qwen2-MoE multiply it into the expert's
output after ``down_proj`` (so into the base and the LoRA delta alike); a model layer that does that
itself passes ``topk_weights=None``; a fused kernel that writes the weighted sum in its epilogue (as
vLLM's second GEMM does) passes the weights.

Sources: SGLang ``python/sglang/srt/lora/`` (virtual experts, 4-D MoE buffers,
``moe_use_local_expert_ids``); vLLM ``fused_moe`` / ``moe_align_block_size`` and its MoE-LoRA ops;
TRT-LLM MoE LoRA (per-expert pointer offsets, one table of where each fused half lives).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

__all__ = ["GATE_UP_HALVES", "gate_up_half", "virtual_expert_ids", "AlignedBlocks", "moe_align_block_size",
           "fused_moe_lora_torch", "to_local_expert_ids", "check_moe_lora_args"]

#: Where each half of the fused ``gate_up_proj`` lives in its output (transformers' Mixtral and
#: Qwen2-MoE: ``gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)``). The one table every part
#: of the book reads (the pool's slices, the loader, the kernels' slice offsets): a gate LoRA written
#: into the up half is numerically plausible and semantically wrong, and nothing downstream can tell.
GATE_UP_HALVES = {"gate": 0, "up": 1}


def gate_up_half(name: str, intermediate_size: int) -> tuple[int, int]:
    """The output columns [start, end) of ``name`` ("gate" or "up") in the fused gate_up output.

    Raises:
        KeyError: a name that is not a half of gate_up.
    """
    half = GATE_UP_HALVES[name]
    return half * intermediate_size, (half + 1) * intermediate_size


def virtual_expert_ids(topk_ids: torch.Tensor, token_slots: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The virtual expert of every (token, choice) pair: ``slot * num_experts + expert``.

    Args:
        topk_ids: [num_tokens, top_k] integer expert ids; a negative id (an expert this rank does
            not hold, see :func:`to_local_expert_ids`) stays -1.
        token_slots: [num_tokens] the adapter slot of each token.
        num_experts: the experts of the buffers' expert axis.
    Returns:
        [num_tokens, top_k] int64.
    Raises:
        ValueError: mismatched shapes, or an expert id >= num_experts.
    Source: SGLang's virtual experts.
    """
    if topk_ids.dim() != 2 or token_slots.shape != (topk_ids.shape[0],):
        raise ValueError(f"topk_ids [num_tokens, top_k] and token_slots [num_tokens], got "
                         f"{list(topk_ids.shape)} and {list(token_slots.shape)}")
    ids = topk_ids.long()
    if ids.numel() and int(ids.max()) >= num_experts:
        raise ValueError(f"expert id {int(ids.max())} out of range for {num_experts} experts")
    virtual = token_slots.long().view(-1, 1) * num_experts + ids
    return torch.where(ids < 0, torch.full_like(virtual, -1), virtual)


class AlignedBlocks(NamedTuple):
    """The pairs sorted by id and padded per id to whole blocks (vLLM ``moe_align_block_size``).

    sorted_pair_ids: [num_blocks * block_size] int32, pair indices ``t * top_k + j`` in id order
        (stable: pairs of one id keep their order); padding entries hold ``num_pairs`` (a sentinel
        past the last pair: a kernel masks rows with ``pair < num_pairs``).
    block_ids: [num_blocks] int32, the one id every real pair of block b has.
    num_pairs: the number of real pairs (num_tokens * top_k).
    """
    sorted_pair_ids: torch.Tensor
    block_ids: torch.Tensor
    num_pairs: int


def moe_align_block_size(ids: torch.Tensor, block_size: int, num_ids: int,
                         skip: Optional[torch.Tensor] = None) -> AlignedBlocks:
    """Sort the (token, choice) pairs by id and pad each id's group to a multiple of ``block_size``.

    Args:
        ids: [num_tokens, top_k] integer ids (experts, or virtual experts); negative ids are left out.
        block_size: pairs per block (the kernel's BLOCK_M), >= 1.
        num_ids: ids are in [0, num_ids).
        skip: optional [num_ids] bool; groups whose id is set get no blocks (e.g. a (slot, expert)
            of rank 0: no program ever reads its absent weights).
    Returns:
        :class:`AlignedBlocks`; ids with no pairs get no blocks.
    Raises:
        ValueError: block_size < 1 or an id >= num_ids.
    Source: vLLM / SGLang ``moe_align_block_size``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    if num_pairs and int(flat.max()) >= num_ids:
        raise ValueError(f"id {int(flat.max())} out of range for {num_ids} ids")
    keep = flat >= 0
    if skip is not None:
        keep &= ~skip.to(flat.device)[flat.clamp(min=0)]
    pairs = torch.nonzero(keep).view(-1)
    order = torch.sort(flat[pairs], stable=True).indices
    pairs, kept = pairs[order], flat[pairs][order]
    counts = torch.bincount(kept, minlength=num_ids)
    blocks = (counts + block_size - 1) // block_size
    block_ids = torch.repeat_interleave(torch.arange(num_ids, device=flat.device), blocks)
    sorted_ids = torch.full((int(blocks.sum()) * block_size,), num_pairs, dtype=torch.int32, device=flat.device)
    # where each group's real pairs go: its first block's first row, then consecutively
    group_start = torch.cumsum(blocks, 0) * block_size - blocks * block_size
    first_of_group = torch.cumsum(counts, 0) - counts
    rank_in_group = torch.arange(pairs.numel(), device=flat.device) - first_of_group[kept]
    sorted_ids[group_start[kept] + rank_in_group] = pairs.to(torch.int32)
    return AlignedBlocks(sorted_ids, block_ids.to(torch.int32), num_pairs)


def check_moe_lora_args(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k, rows_per_pair,
                        slice_offsets=None, topk_weights=None, check_values=True) -> list[tuple[int, int]]:
    """Shape checks of the MoE LoRA contract; returns the output slices [(start, end)].

    ``check_values``: also check that ``token_slots`` lie in ``[0, num_slots)``, which reads the device
    (a host synchronization). A caller that launches inside a CUDA graph capture passes False, having
    checked the values where it built the alignment (``align_moe_lora`` does).

    Raises:
        ValueError: a shape, dtype or slice that breaks the contract (see the module docstring).
    """
    if A.dim() != 4 or B.dim() != 4 or A.shape[:2] != B.shape[:2]:
        raise ValueError(f"A [slots, experts, stack*r, in] and B [slots, experts, out, r], got "
                         f"{list(A.shape)} and {list(B.shape)}")
    num_slots, num_experts = A.shape[:2]
    offsets = (0, out.shape[1]) if slice_offsets is None else tuple(int(o) for o in slice_offsets)
    stack = len(offsets) - 1
    if stack < 1 or offsets[0] != 0 or offsets[-1] != out.shape[1] or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"slice_offsets must rise from 0 to out's width {out.shape[1]}, got {offsets}")
    max_rank = B.shape[3]
    if A.shape[2] != stack * max_rank or B.shape[2] != out.shape[1]:
        raise ValueError(f"A's rows {A.shape[2]} != {stack} slices x max_rank {max_rank}, "
                         f"or B's rows {B.shape[2]} != out's width {out.shape[1]}")
    if topk_ids.dim() != 2 or topk_ids.shape[1] != top_k or token_slots.shape != (topk_ids.shape[0],):
        raise ValueError(f"topk_ids [num_tokens, {top_k}] and token_slots [num_tokens], got "
                         f"{list(topk_ids.shape)} and {list(token_slots.shape)}")
    pairs = topk_ids.shape[0] * top_k
    rows = pairs if rows_per_pair else topk_ids.shape[0]
    if x.dim() != 2 or x.shape != (rows, A.shape[3]) or out.shape[0] != pairs:
        raise ValueError(f"x [{rows}, {A.shape[3]}] and out [{pairs}, out], got {list(x.shape)} and {list(out.shape)}")
    if lora_ranks.shape != (num_slots, num_experts) or scalings.shape != (num_slots,):
        raise ValueError(f"lora_ranks [{num_slots}, {num_experts}] and scalings [{num_slots}], got "
                         f"{list(lora_ranks.shape)} and {list(scalings.shape)}")
    if topk_weights is not None and topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights must be shaped like topk_ids {list(topk_ids.shape)}")
    if check_values:
        check_token_slots(token_slots, num_slots)
    return list(zip(offsets[:-1], offsets[1:]))


def check_token_slots(token_slots: torch.Tensor, num_slots: int) -> None:
    """Raises ValueError unless every entry of ``token_slots`` lies in ``[0, num_slots)`` (reads the device)."""
    if token_slots.numel() and (int(token_slots.min()) < 0 or int(token_slots.max()) >= num_slots):
        raise ValueError(f"token_slots must lie in [0, {num_slots}), got {int(token_slots.min())}.."
                         f"{int(token_slots.max())}")


def fused_moe_lora_torch(
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
) -> torch.Tensor:
    """The MoE LoRA op in plain PyTorch, one (slot, expert) group at a time (module docstring).

    Reads only rows ``[i*r, (i+1)*r)`` of A and columns ``[:r]`` of B for a group of rank r, and
    nothing of a group of rank 0. Accumulates in fp32, rounds the shrink to x.dtype (as a two-kernel
    path does) and writes ``out.dtype``. Returns ``out``.

    Raises:
        ValueError: see :func:`check_moe_lora_args`.
    """
    slices = check_moe_lora_args(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k, rows_per_pair,
                                 slice_offsets, topk_weights)
    num_slots, num_experts = A.shape[:2]
    virtual = virtual_expert_ids(topk_ids, token_slots, num_experts).view(-1)
    ranks = lora_ranks.reshape(-1).tolist()
    acc = torch.promote_types(out.dtype, torch.float32)
    for v in torch.unique(virtual[virtual >= 0]).tolist():
        s, e = divmod(v, num_experts)
        r = int(ranks[v])
        if r == 0:
            continue
        pairs = torch.nonzero(virtual == v).view(-1)
        rows = x[pairs if rows_per_pair else pairs // top_k].to(acc)
        scale = float(scalings[s])
        if topk_weights is not None:
            weight = topk_weights.reshape(-1)[pairs].to(acc).view(-1, 1) * scale
        else:
            weight = torch.full((pairs.numel(), 1), scale, dtype=acc, device=x.device)
        for i, (lo, hi) in enumerate(slices):
            h = (rows @ A[s, e, i * r:(i + 1) * r].to(acc).T).to(x.dtype).to(acc)
            delta = weight * (h @ B[s, e, lo:hi, :r].to(acc).T)
            out[pairs, lo:hi] = (out[pairs, lo:hi].to(acc) + delta).to(out.dtype)
    return out


def to_local_expert_ids(topk_ids: torch.Tensor, ep_rank: int, ep_size: int, num_experts: int) -> torch.Tensor:
    """Global expert ids to this expert-parallel rank's local ids (-1: held by another rank).

    Experts are split in contiguous blocks: rank q holds global experts
    ``[q * E / ep_size, (q + 1) * E / ep_size)``, local id = global - first. A dispatcher that
    remaps (SGLang ``moe_use_local_expert_ids=True``) feeds these to buffers with
    ``num_experts / ep_size`` experts; one that keeps global ids feeds the global ids to buffers
    indexed globally, with only this rank's experts filled. Pairing local ids with global buffers
    (or the reverse) reads another expert's weights.

    Raises:
        ValueError: ep_size does not divide num_experts, or ep_rank out of range.
    """
    if ep_size < 1 or num_experts % ep_size or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_size {ep_size} must divide {num_experts} experts and 0 <= ep_rank < ep_size")
    per_rank = num_experts // ep_size
    local = topk_ids.long() - ep_rank * per_rank
    return torch.where((local >= 0) & (local < per_rank) & (topk_ids >= 0), local, torch.full_like(local, -1))
