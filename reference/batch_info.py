"""Per-batch LoRA metadata: the only object that crosses from the control plane to the kernels.

Source: SGLang ``python/sglang/srt/lora/utils.py`` (``LoRABatchInfo``) and Punica's SGMV segments
(Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023). Chapter 02 builds it from segment lists;
chapter 07 builds it from requests and the memory pool (:func:`batch_info_from_requests`, after
SGLang ``lora/backend/triton_backend.py`` / ``chunked_backend.py`` ``prepare_lora_batch`` and vLLM
``lora/punica_wrapper/punica_base.py``), and the slot-sorted view of CUDA-graph paths
(:func:`slot_sorted_view`, after TensorRT-LLM's LoRA CUDA-graph parameters).

Running example used in the comments below: three requests of 3, 10 and 5 tokens using slots 2, 0, 1
(slot 0 holds the base model, rank 0):
    seg_lens [3, 10, 5] -> seg_indptr [0, 3, 13, 18]; weight_indices [2, 0, 1];
    token_slots [2, 2, 2, 0 x 10, 1 x 5].
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Hashable, Mapping, Optional, Sequence, Union

import torch

__all__ = [
    "LoRABatchInfo",
    "seg_indptr_from_seg_lens",
    "token_slots_from_segments",
    "stable_sort_by_slot",
    "merge_adjacent_segments",
    "cut_into_chunks",
    "build_batch_info",
    "batch_info_from_requests",
    "slot_sorted_view",
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
    # The per-request view (chapter 07), beside the kernel's segments, which may be sorted, merged or
    # chunked: MoE LoRA needs request boundaries (virtual experts are per request), the kernels don't.
    req_seg_indptr: Optional[torch.Tensor] = None  # [bs + 1] int32: request i is x rows [p[i], p[i+1])
    req_weight_indices: Optional[torch.Tensor] = None  # [bs] int32, slot of each request
    # host: the BGMV expand's and shrink's schedules for this batch ("token" or "sorted": per token or
    # grouped by slot over the slot-sorted view; reference.ops.bgmv_expand / bgmv_shrink), chosen by
    # whoever built the batch from host values (reference.ops.decode_schedule: a CUDA-graph runner
    # picks its graph by them); "sorted" needs the permutation
    expand_schedule: str = "token"
    shrink_schedule: str = "token"

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


def merge_adjacent_segments(seg_lens: Sequence[int], slots: Sequence[int]) -> tuple[list[int], list[int]]:
    """Merge neighbouring segments that use the same slot; zero-length segments disappear.

    Host lists in, host lists out: [3, 2, 6, 1] / [1, 1, 2, 0] -> [5, 6, 1] / [1, 2, 0].

    Raises:
        ValueError: the lists differ in length, or a length is negative.
    """
    if len(seg_lens) != len(slots):
        raise ValueError(f"{len(seg_lens)} seg_lens but {len(slots)} slots")
    if any(n < 0 for n in seg_lens):
        raise ValueError(f"negative segment length in {list(seg_lens)}")
    lens: list[int] = []
    out_slots: list[int] = []
    for n, s in zip(seg_lens, slots):
        if n == 0:
            continue
        if out_slots and out_slots[-1] == s:
            lens[-1] += n
        else:
            lens.append(n)
            out_slots.append(s)
    return lens, out_slots


def cut_into_chunks(seg_lens: Sequence[int], slots: Sequence[int], chunk_size: int) -> tuple[list[int], list[int]]:
    """Cut every segment into pieces of ``chunk_size`` tokens (the last piece may be shorter).

    [5, 6, 1] / [1, 2, 0] with chunk_size 4 -> [4, 1, 4, 2, 1] / [1, 1, 2, 2, 0].

    Raises:
        ValueError: chunk_size < 1.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    lens: list[int] = []
    out_slots: list[int] = []
    for n, s in zip(seg_lens, slots):
        full, rest = divmod(n, chunk_size)
        lens += [chunk_size] * full + ([rest] if rest else [])
        out_slots += [s] * (full + (1 if rest else 0))
    return lens, out_slots


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


# ---------------------------------------------------------------------------------------------
# Chapter 07: from requests and the pool to a LoRABatchInfo, without touching the device.
# ---------------------------------------------------------------------------------------------

def _host_to_device(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """One host->device copy that never makes the host wait for the device.

    On CUDA a plain ``torch.tensor(list, device="cuda")`` copies from pageable memory, which
    synchronizes (``torch.cuda.set_sync_debug_mode("error")`` raises on it); staging the values in
    pinned memory makes the copy asynchronous. The caching host allocator keeps the pinned block
    until the copy has run. On the CPU the host tensor itself is returned.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return values
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


def _request_slots(req_uids: Sequence[Hashable], req_lens: Sequence[int], uid_to_slot: Mapping[Hashable, int],
                   lora_ranks: Sequence[int], scalings: Sequence[float]) -> list[int]:
    """Slot of each request, after checking every host input (raises ValueError, see the caller)."""
    if len(req_uids) != len(req_lens):
        raise ValueError(f"{len(req_uids)} req_uids but {len(req_lens)} req_lens")
    if len(lora_ranks) != len(scalings):
        raise ValueError(f"{len(lora_ranks)} lora_ranks but {len(scalings)} scalings (one of each per slot)")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in req_lens):
        raise ValueError(f"req_lens must be ints >= 0, got {list(req_lens)}")
    slots = []
    for i, uid in enumerate(req_uids):
        if uid not in uid_to_slot:
            raise ValueError(f"request {i} uses uid {uid!r}, which is not resident (uid_to_slot has "
                             f"{list(uid_to_slot)}): make the batch's uids resident first "
                             "(pool.prepare_lora_batch)")
        slot = uid_to_slot[uid]
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(lora_ranks):
            raise ValueError(f"uid {uid!r} maps to slot {slot!r}, outside slots 0..{len(lora_ranks) - 1}")
        if uid is None and lora_ranks[slot] != 0:
            raise ValueError(f"the base model (uid None) is in slot {slot}, whose rank is {lora_ranks[slot]}, not 0")
        slots.append(slot)
    return slots


def batch_info_from_requests(
    req_uids: Sequence[Hashable],  # [bs] uid per request, x order; None = the base model
    req_lens: Sequence[int],  # [bs] tokens each request has in this forward (1 when decoding)
    uid_to_slot: Mapping[Hashable, int],  # e.g. what pool.prepare_lora_batch returned
    lora_ranks: Sequence[int],  # [num_slots] host ints, 0 for the base model and empty slots
    scalings: Sequence[float],  # [num_slots] host floats, 0 for the base model and empty slots
    device: torch.device | str,
    *,
    sort_by_slot: bool = False,
    chunk_size: Optional[int] = None,
) -> LoRABatchInfo:
    """Build the :class:`LoRABatchInfo` of one forward from its requests, on the host only.

    Tokens of x are the requests' tokens in request order (request i is rows
    ``req_seg_indptr[i] : req_seg_indptr[i+1]``). Every field is computed from the host lists, and
    each tensor is sent with ONE host->device copy (pinned, non-blocking on CUDA), so building a
    batch never waits for the device; ``has_active_lora`` in particular comes from the lists, never
    from a ``.item()``. ``lora_ranks`` / ``scalings`` are host lists because reading the pool's
    device tensors would synchronize: the pool keeps host mirrors (``pool.lora_ranks_host``,
    ``pool.scalings_host``), updated where it writes a slot.

    Segment views (the kernel's; the per-request view ``req_seg_indptr`` / ``req_weight_indices``
    is always set beside it, since MoE LoRA needs request boundaries and chunked segments lose them):
        default:          one segment per request, zero-length ones kept (the kernels skip them)
        sort_by_slot:     requests grouped by slot through a stable ``permutation`` (None when the
                          requests already are grouped: the kernel's "already sorted" fast path), then
                          one segment per slot (Punica's SGMV: one small GEMM per adapter)
        chunk_size=c:     adjacent same-slot segments merged, then cut into chunks of at most c tokens
                          (SGLang's csgmv backend); combines with sort_by_slot
    ``token_slots`` (x order) is set for every batch: decode batches (every length 1) use it for
    BGMV, the slot-sorted view is built from it, and it gives ``num_tokens`` without a device read.

    Running example: req_uids ["a", None, "b"], req_lens [3, 10, 5], uid_to_slot {None: 0, "b": 1, "a": 2}
        req slots [2, 0, 1]  ->  req_seg_indptr [0, 3, 13, 18], req_weight_indices [2, 0, 1]
        default:        seg_lens [3, 10, 5]          weight_indices [2, 0, 1]        permutation None
        sort_by_slot:   seg_lens [10, 5, 3]          weight_indices [0, 1, 2]
                        permutation [3, ..., 12, 13, ..., 17, 0, 1, 2]
        chunk_size 4:   seg_lens [3, 4, 4, 2, 4, 1]  weight_indices [2, 0, 0, 0, 1, 1]  max_len 4
        token_slots (every view, x order) [2, 2, 2, 0 (x10), 1 (x5)]
        lora_ranks [0, 4, 8] -> has_active_lora True; all requests on the base -> False

    Shapes and dtypes: as :class:`LoRABatchInfo` (int32 metadata, float32 scalings, int64
    permutation), on ``device``; ``bs`` = len(req_uids), host ints for bs, num_segments, max_len.
    Raises:
        ValueError: req_uids and req_lens of different lengths; lora_ranks and scalings of different
        lengths; a length that is not an int >= 0; a uid missing from uid_to_slot (not resident); a
        slot outside 0..num_slots-1; the base model (None) in a slot of rank > 0; chunk_size < 1.
    """
    slots = _request_slots(req_uids, req_lens, uid_to_slot, lora_ranks, scalings)
    order = list(range(len(slots)))
    seg_lens, seg_slots = list(req_lens), list(slots)
    if sort_by_slot:
        order.sort(key=lambda i: slots[i])  # stable: requests of one slot keep their order
        seg_lens, seg_slots = merge_adjacent_segments([req_lens[i] for i in order], [slots[i] for i in order])
    if chunk_size is not None:
        seg_lens, seg_slots = cut_into_chunks(*merge_adjacent_segments(seg_lens, seg_slots), chunk_size)
    token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32),
                                          torch.tensor(list(req_lens), dtype=torch.int64))
    permutation = None  # identity: requests already grouped (or not asked to be)
    if order != sorted(order):
        permutation = _host_to_device(stable_sort_by_slot(token_slots)[0], device)

    def send(values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        return _host_to_device(torch.tensor(list(values), dtype=dtype), device)

    return LoRABatchInfo(
        bs=len(slots),
        num_segments=len(seg_lens),
        max_len=max(seg_lens, default=0),
        has_active_lora=any(n > 0 and lora_ranks[s] > 0 for n, s in zip(req_lens, slots)),
        seg_lens=send(seg_lens, torch.int32),
        seg_indptr=send([0, *accumulate(seg_lens)], torch.int32),
        weight_indices=send(seg_slots, torch.int32),
        lora_ranks=send(lora_ranks, torch.int32),
        scalings=send(scalings, torch.float32),
        permutation=permutation,
        token_slots=_host_to_device(token_slots, device),
        req_seg_indptr=send([0, *accumulate(req_lens)], torch.int32),
        req_weight_indices=send(slots, torch.int32),
    )


def slot_sorted_view(
    token_slots: Union[Sequence[int], torch.Tensor],  # [num_seqs] slot per sequence (= per token if tps 1)
    num_slots: int,
    tokens_per_seq: int = 1,
    device: Optional[torch.device | str] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens grouped by slot with a segment table of FIXED size: the layout of CUDA-graph paths.

    Segment s is slot s (empty slots give empty segments), so the table's shape never depends on
    the batch's content, which a captured graph requires (TensorRT-LLM's LoRA CUDA-graph
    parameters: per-slot counts by bincount, offsets by prefix sum, sorted ids). With speculative
    decoding each sequence verifies ``tokens_per_seq`` tokens (rows seq*tps .. seq*tps + tps - 1 of
    x): the sequence-level order is expanded to token level. As a LoRABatchInfo:
    ``seg_indptr = slot_offsets``, ``weight_indices = arange(num_slots)``,
    ``permutation = sorted_token_ids``. A graph path copies these into persistent buffers sized for
    its largest bucket (chapter 08's ``StaticLoRABatch``), where every token row past the batch holds
    the pad slot, a slot of rank 0: nothing that reads past the batch finds a stale slot id.

    Semantics:
        seq_counts[s] = #{q : token_slots[q] == s}            (bincount with minlength num_slots)
        slot_counts = seq_counts * tps;  slot_offsets = [0, cumsum(slot_counts)]
        seq_order = stable argsort(token_slots)
        sorted_token_ids = [q * tps + j for q in seq_order for j in range(tps)]
    Example: token_slots [2, 0, 2, 1], num_slots 4, tokens_per_seq 2
        slot_counts [2, 2, 4, 0], slot_offsets [0, 2, 4, 8, 8],
        sorted_token_ids [2, 3, 6, 7, 0, 1, 4, 5]
    Computed on ``device`` (default: where ``token_slots`` lives; the CPU for a host list) without a
    device read: a host list is sent with one pinned, non-blocking copy; the count is an
    ``index_add_``, because ``torch.bincount`` on CUDA reads the maximum on the host.

    Returns:
        (slot_counts [num_slots] int32, slot_offsets [num_slots + 1] int32,
         sorted_token_ids [num_seqs * tokens_per_seq] int64), all on ``device``.
    Raises:
        ValueError: num_slots or tokens_per_seq < 1; token_slots not one-dimensional; a host slot
        outside 0..num_slots-1 (a device tensor's values are not checked: that would synchronize).
    """
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
        raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
    if isinstance(tokens_per_seq, bool) or not isinstance(tokens_per_seq, int) or tokens_per_seq < 1:
        raise ValueError(f"tokens_per_seq must be an int >= 1, got {tokens_per_seq!r}")
    if not isinstance(token_slots, torch.Tensor):
        host = list(token_slots)
        if any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < num_slots for s in host):
            raise ValueError(f"token_slots {host} must be ints in 0..{num_slots - 1}")
        token_slots = _host_to_device(torch.tensor(host, dtype=torch.int64), device or "cpu")
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be one-dimensional, got shape {list(token_slots.shape)}")
    device = token_slots.device if device is None else torch.device(device)
    slots = token_slots.to(device).long()
    seq_counts = torch.zeros(num_slots, dtype=torch.int32, device=device)
    seq_counts.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
    slot_counts = seq_counts * tokens_per_seq
    slot_offsets = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
    slot_offsets[1:] = torch.cumsum(slot_counts, dim=0)
    seq_order = torch.sort(slots, stable=True).indices
    within = torch.arange(tokens_per_seq, dtype=torch.int64, device=device)
    sorted_token_ids = (seq_order[:, None] * tokens_per_seq + within[None, :]).reshape(-1)
    return slot_counts, slot_offsets, sorted_token_ids
