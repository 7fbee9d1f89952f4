"""Chapter 07: LoRABatchInfo from requests and the pool, and the slot-sorted view of CUDA-graph paths.

Hand-worked examples (the running examples of reference/batch_info.py), brute force under
hypothesis (every view covers every token once, with its request's slot, and the ops give the
per-token LoRA result), edge cases, and on a GPU a proof that building a batch never synchronizes.
"""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.batch_info import LoRABatchInfo, batch_info_from_requests, slot_sorted_view
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec
from reference.ops import torch_ref

UIDS = ["a", None, "b"]
LENS = [3, 10, 5]
SLOTS = {None: 0, "b": 1, "a": 2}
RANKS, SCALINGS = [0, 4, 8], [0.0, 0.5, 2.0]


def _build(uids=UIDS, lens=LENS, **kw):
    return batch_info_from_requests(uids, lens, SLOTS, RANKS, SCALINGS, "cpu", **kw)


def _fields(info):
    return {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in vars(info).items()}


# ---- hand-worked: the running example ---------------------------------------------------------
def test_per_request_segments():
    info = _build()
    assert _fields(info) == dict(
        bs=3, num_segments=3, max_len=10, has_active_lora=True,
        seg_lens=[3, 10, 5], seg_indptr=[0, 3, 13, 18], weight_indices=[2, 0, 1],
        lora_ranks=[0, 4, 8], scalings=[0.0, 0.5, 2.0], permutation=None,
        token_slots=[2] * 3 + [0] * 10 + [1] * 5,
        req_seg_indptr=[0, 3, 13, 18], req_weight_indices=[2, 0, 1], expand_schedule="token", shrink_schedule="token")
    dtypes = {k: v.dtype for k, v in vars(info).items() if isinstance(v, torch.Tensor)}
    assert dtypes == {k: torch.int32 for k in dtypes} | {"scalings": torch.float32}
    assert info.num_tokens == 18


def test_sorted_by_slot():
    info = _build(sort_by_slot=True)
    assert (info.seg_lens.tolist(), info.weight_indices.tolist(), info.max_len) == ([10, 5, 3], [0, 1, 2], 10)
    assert info.permutation.tolist() == list(range(3, 18)) + [0, 1, 2] and info.permutation.dtype == torch.int64
    assert info.token_slots.tolist() == [2] * 3 + [0] * 10 + [1] * 5  # x order, unchanged
    assert info.req_seg_indptr.tolist() == [0, 3, 13, 18] and info.req_weight_indices.tolist() == [2, 0, 1]
    already = _build(["b", "b", "a"], [2, 1, 4], sort_by_slot=True)  # grouped already: no permutation
    assert already.permutation is None and already.seg_lens.tolist() == [3, 4]


def test_chunked_segments_keep_the_request_view():
    info = _build(chunk_size=4)
    assert info.seg_lens.tolist() == [3, 4, 4, 2, 4, 1] and info.weight_indices.tolist() == [2, 0, 0, 0, 1, 1]
    assert (info.bs, info.num_segments, info.max_len, info.permutation) == (3, 6, 4, None)
    # chunks lose request boundaries; the per-request view keeps them (MoE LoRA needs them)
    assert info.req_seg_indptr.tolist() == [0, 3, 13, 18] and info.req_weight_indices.tolist() == [2, 0, 1]
    both = _build(["a", "b", "a"], [3, 2, 2], sort_by_slot=True, chunk_size=4)
    assert both.seg_lens.tolist() == [2, 4, 1] and both.weight_indices.tolist() == [1, 2, 2]
    assert both.permutation.tolist() == [3, 4, 0, 1, 2, 5, 6]


def test_decode_batch():
    info = _build(["a", "b", None, "a"], [1, 1, 1, 1])
    assert (info.bs, info.num_segments, info.max_len, info.has_active_lora) == (4, 4, 1, True)
    assert info.token_slots.tolist() == [2, 1, 0, 2]  # what BGMV reads
    assert info.seg_indptr.tolist() == [0, 1, 2, 3, 4]


# ---- edge cases ---------------------------------------------------------------------------------
def test_empty_batch():
    info = _build([], [])
    assert _fields(info) == dict(
        bs=0, num_segments=0, max_len=0, has_active_lora=False, seg_lens=[], seg_indptr=[0],
        weight_indices=[], lora_ranks=RANKS, scalings=SCALINGS, permutation=None, token_slots=[],
        req_seg_indptr=[0], req_weight_indices=[], expand_schedule="token", shrink_schedule="token")
    assert _build([], [], sort_by_slot=True, chunk_size=2).num_segments == 0


def test_has_active_lora_from_host_lists():
    assert _build([None, None], [4, 1]).has_active_lora is False  # all base
    assert _build(["a", None], [0, 3]).has_active_lora is False  # the adapter request has no token
    zero_rank = batch_info_from_requests(["e"], [2], {"e": 1}, [0, 0], [0.0, 0.0], "cpu")
    assert zero_rank.has_active_lora is False  # a rank-0 slot (e.g. empty) adds nothing


def test_zero_length_segment_and_one_token():
    info = _build(["a", "b", None], [0, 1, 2])
    assert info.seg_lens.tolist() == [0, 1, 2] and info.seg_indptr.tolist() == [0, 0, 1, 3]
    assert info.max_len == 2 and info.token_slots.tolist() == [1, 0, 0]
    merged = _build(["a", "b", None], [0, 1, 2], chunk_size=8)
    assert merged.seg_lens.tolist() == [1, 2]  # merging drops the empty segment
    assert merged.req_seg_indptr.tolist() == [0, 0, 1, 3]  # the request view keeps it


@pytest.mark.parametrize("args, kw, match", [
    ((["a"], [1, 2], SLOTS, RANKS, SCALINGS), {}, "1 req_uids but 2 req_lens"),
    ((["a"], [1], SLOTS, RANKS, SCALINGS[:2]), {}, "3 lora_ranks but 2 scalings"),
    ((["a"], [-1], SLOTS, RANKS, SCALINGS), {}, "req_lens must be ints >= 0"),
    ((["a"], [1.0], SLOTS, RANKS, SCALINGS), {}, "req_lens must be ints >= 0"),
    ((["zz"], [1], SLOTS, RANKS, SCALINGS), {}, "uid 'zz', which is not resident"),
    ((["a"], [1], {"a": 3}, RANKS, SCALINGS), {}, "slot 3, outside slots 0..2"),
    (([None], [1], {None: 1}, RANKS, SCALINGS), {}, "the base model .* rank is 4, not 0"),
    ((["a"], [1], SLOTS, RANKS, SCALINGS), {"chunk_size": 0}, "chunk_size must be at least 1"),
])
def test_rejects_bad_input(args, kw, match):
    with pytest.raises(ValueError, match=match):
        batch_info_from_requests(*args, "cpu", **kw)


def test_from_a_pool_with_host_mirrors():
    pool = LoRAMemoryPool([ModuleSpec("q_proj", 4, (4,))], 1, 3, 4,
                          adapter_source=lambda uid: LoRAAdapter(uid, {"x": 2, "y": 3}[uid], 0.75, {}))
    uids = ["y", None, "x", "y"]
    uid_to_slot = pool.prepare_lora_batch(uids)
    assert pool.lora_ranks_host == pool.lora_ranks.tolist() == [0, 2, 3]
    assert pool.scalings_host == pool.scalings.tolist() == [0.0, 0.75, 0.75]
    info = batch_info_from_requests(uids, [1, 1, 1, 1], uid_to_slot, pool.lora_ranks_host, pool.scalings_host, "cpu")
    assert info.weight_indices.tolist() == [2, 0, 1, 2] and torch.equal(info.lora_ranks, pool.lora_ranks)


# ---- brute force ------------------------------------------------------------------------------
UID_POOL = [None, "a", "b", "c", "d"]
SLOT_OF = {None: 0, "a": 3, "b": 1, "c": 2, "d": 4}  # slot 5 stays empty
POOL_RANKS, POOL_SCALINGS = [0, 2, 3, 0, 1, 0], [0.0, 0.5, 2.0, 0.0, 1.5, 0.0]  # "a" has rank 0


def _rows_of_segments(info):
    """Rows of x each segment covers, through the permutation (brute force, in Python)."""
    indptr, perm = info.seg_indptr.tolist(), info.permutation
    order = list(range(indptr[-1])) if perm is None else perm.tolist()
    return [order[indptr[i]:indptr[i + 1]] for i in range(info.num_segments)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(UID_POOL), st.integers(0, 6)), max_size=9),
       st.booleans(), st.one_of(st.none(), st.integers(1, 5)))
def test_every_view_matches_brute_force(requests, sort_by_slot, chunk_size):
    uids, lens = [u for u, _ in requests], [n for _, n in requests]
    info = batch_info_from_requests(uids, lens, SLOT_OF, POOL_RANKS, POOL_SCALINGS, "cpu",
                                    sort_by_slot=sort_by_slot, chunk_size=chunk_size)
    token_slot = [SLOT_OF[u] for u, n in requests for _ in range(n)]  # brute force, x order
    assert info.token_slots.tolist() == token_slot
    segments = _rows_of_segments(info)
    assert sorted(r for rows in segments for r in rows) == list(range(len(token_slot)))  # each row once
    for rows, slot in zip(segments, info.weight_indices.tolist()):
        assert all(token_slot[r] == slot for r in rows)
    if chunk_size is not None:
        assert all(0 < len(rows) <= chunk_size for rows in segments)
    if sort_by_slot:
        sorted_slots = [token_slot[r] for rows in segments for r in rows]
        assert sorted_slots == sorted(token_slot)  # grouped by slot
        assert len(set(info.weight_indices.tolist())) == info.num_segments or chunk_size is not None
    if not sort_by_slot and chunk_size is None:
        assert info.seg_lens.tolist() == lens  # one segment per request
    assert info.max_len == max((len(r) for r in segments), default=0)
    assert (info.bs, info.req_weight_indices.tolist()) == (len(uids), [SLOT_OF[u] for u in uids])
    assert info.req_seg_indptr.tolist() == [sum(lens[:i]) for i in range(len(lens) + 1)]
    assert info.has_active_lora == any(POOL_RANKS[s] > 0 for s in token_slot)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(UID_POOL), st.integers(0, 5)), max_size=7),
       st.booleans(), st.one_of(st.none(), st.integers(1, 4)))
def test_ops_on_any_view_give_the_per_token_lora(requests, sort_by_slot, chunk_size):
    uids, lens = [u for u, _ in requests], [n for _, n in requests]
    info = batch_info_from_requests(uids, lens, SLOT_OF, POOL_RANKS, POOL_SCALINGS, "cpu",
                                    sort_by_slot=sort_by_slot, chunk_size=chunk_size)
    g = torch.Generator().manual_seed(len(requests))
    x = torch.randn(sum(lens), 6, generator=g, dtype=torch.float64)
    A = torch.randn(6, 3, 6, generator=g, dtype=torch.float64)
    B = torch.randn(6, 5, 3, generator=g, dtype=torch.float64)
    t = torch.zeros(x.shape[0], 3, dtype=x.dtype)
    out = torch.zeros(x.shape[0], 5, dtype=x.dtype)
    torch_ref.expand(torch_ref.shrink(x, A, info, t), B, info, out)
    for tok, slot in enumerate(info.token_slots.tolist()):  # brute force, token by token
        r = POOL_RANKS[slot]
        want = POOL_SCALINGS[slot] * (x[tok] @ A[slot, :r].T) @ B[slot, :, :r].T
        torch.testing.assert_close(out[tok], want)


# ---- the slot-sorted view (CUDA-graph paths) ----------------------------------------------------
def test_slot_sorted_view_example():
    counts, offsets, ids = slot_sorted_view([2, 0, 2, 1], 4, tokens_per_seq=2)
    assert counts.tolist() == [2, 2, 4, 0] and offsets.tolist() == [0, 2, 4, 8, 8]
    assert ids.tolist() == [2, 3, 6, 7, 0, 1, 4, 5]
    assert (counts.dtype, offsets.dtype, ids.dtype) == (torch.int32, torch.int32, torch.int64)
    counts, offsets, ids = slot_sorted_view(torch.tensor([1, 0, 1], dtype=torch.int32), 2)
    assert (counts.tolist(), offsets.tolist(), ids.tolist()) == ([1, 2], [0, 1, 3], [1, 0, 2])
    counts, offsets, ids = slot_sorted_view([], 3, tokens_per_seq=4)
    assert (counts.tolist(), offsets.tolist(), ids.tolist()) == ([0, 0, 0], [0, 0, 0, 0], [])


@pytest.mark.parametrize("args, match", [
    (([0, 3], 3), "ints in 0..2"), (([0], 0), "num_slots"), (([0], 2, 0), "tokens_per_seq"),
    ((torch.zeros(2, 2, dtype=torch.int32), 2), "one-dimensional"),
])
def test_slot_sorted_view_rejects(args, match):
    with pytest.raises(ValueError, match=match):
        slot_sorted_view(*args)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=12), st.integers(1, 4))
def test_slot_sorted_view_matches_brute_force(seq_slots, tps):
    counts, offsets, ids = slot_sorted_view(seq_slots, 5, tokens_per_seq=tps)
    assert counts.tolist() == [tps * seq_slots.count(s) for s in range(5)]
    assert offsets.tolist() == [sum(counts.tolist()[:s]) for s in range(6)]
    order = sorted(range(len(seq_slots)), key=lambda q: (seq_slots[q], q))
    assert ids.tolist() == [q * tps + j for q in order for j in range(tps)]
    tensor_view = slot_sorted_view(torch.tensor(seq_slots, dtype=torch.int32), 5, tps)
    assert all(torch.equal(a, b) for a, b in zip(tensor_view, (counts, offsets, ids)))


def test_slot_sorted_view_as_a_fixed_size_segment_table():
    """Segments = slots (fixed shape), permutation = sorted ids: the ops give the per-request result,
    with tokens_per_seq 3 (speculative verification: 3 tokens per sequence)."""
    seq_uids, tps = ["b", None, "c", "b"], 3
    seq_slots = [SLOT_OF[u] for u in seq_uids]
    counts, offsets, ids = slot_sorted_view(seq_slots, 6, tokens_per_seq=tps)
    graph = LoRABatchInfo(bs=4, num_segments=6, max_len=len(ids), has_active_lora=True, seg_lens=counts,
                          seg_indptr=offsets, weight_indices=torch.arange(6, dtype=torch.int32),
                          lora_ranks=torch.tensor(POOL_RANKS, dtype=torch.int32),
                          scalings=torch.tensor(POOL_SCALINGS), permutation=ids)
    eager = batch_info_from_requests(seq_uids, [tps] * 4, SLOT_OF, POOL_RANKS, POOL_SCALINGS, "cpu")
    g = torch.Generator().manual_seed(0)
    x, A, B = torch.randn(12, 6, generator=g), torch.randn(6, 3, 6, generator=g), torch.randn(6, 5, 3, generator=g)
    outs = []
    for info in (graph, eager):
        t, out = torch.zeros(12, 3), torch.zeros(12, 5)
        outs.append(torch_ref.expand(torch_ref.shrink(x, A, info, t), B, info, out))
    torch.testing.assert_close(outs[0], outs[1])


# ---- the GPU: building a batch never synchronizes ------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_building_a_batch_does_not_synchronize():
    cases = [dict(), dict(sort_by_slot=True), dict(chunk_size=4), dict(sort_by_slot=True, chunk_size=2)]
    uid_lists = [(UIDS, LENS), (["a", "b", None, "a"], [1, 1, 1, 1]), ([], []), ([None, None], [2, 3])]
    warm = [batch_info_from_requests(u, n, SLOTS, RANKS, SCALINGS, "cuda", **kw) for u, n in uid_lists for kw in cases]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):  # the check is live: a pageable copy syncs
            torch.tensor([1, 2, 3], device="cuda")
        built = [batch_info_from_requests(u, n, SLOTS, RANKS, SCALINGS, "cuda", **kw)
                 for u, n in uid_lists for kw in cases]
        views = slot_sorted_view(built[4].token_slots, 3, tokens_per_seq=2)
        host_views = slot_sorted_view([2, 1, 0, 2], 3, tokens_per_seq=2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for got, want in zip(built, warm):
        assert _fields(got) == _fields(want) and got.seg_lens.device.type == "cuda"
    assert all(torch.equal(a.cpu(), b) for a, b in zip(views, host_views))
