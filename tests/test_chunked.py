"""Chunked SGMV segments: the running example, invariants, and identical op results."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.batch_info import build_batch_info
from reference.chunked import build_chunked_batch_info, cut_into_chunks, merge_adjacent_segments
from reference.ops import torch_ref


def test_running_example():
    merged = merge_adjacent_segments([3, 2, 6, 1], [1, 1, 2, 0])
    assert merged == ([5, 6, 1], [1, 2, 0])
    assert cut_into_chunks(*merged, 4) == ([4, 1, 4, 2, 1], [1, 1, 2, 2, 0])


def test_skewed_batch_98_of_100_requests_on_one_adapter():
    slots = [1] * 49 + [2] + [1] * 49 + [3]
    lens = [7] * 100
    per_request = build_batch_info(lens, slots, [0, 8, 8, 8], [0.0, 1.0, 1.0, 1.0], "cpu")
    chunked = build_chunked_batch_info(lens, slots, [0, 8, 8, 8], [0.0, 1.0, 1.0, 1.0], "cpu",
                                       chunk_size=64, group_by_slot=True)
    assert per_request.num_segments == 100
    assert chunked.num_segments == 11 + 1 + 1  # 686 tokens of slot 1 in chunks of 64, then slots 2 and 3
    assert chunked.bs == 100 and chunked.max_len == 64


@pytest.mark.parametrize("bad", [dict(chunk_size=0)])
def test_rejects_bad_chunk_size(bad):
    with pytest.raises(ValueError):
        build_chunked_batch_info([2], [0], [0], [0.0], "cpu", **bad)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 3)), max_size=8), st.integers(1, 5), st.booleans(),
       st.integers(0, 2**16))
def test_chunked_segments_give_the_same_results(reqs, chunk_size, group, seed):
    lens, slots = [n for n, _ in reqs], [s for _, s in reqs]
    ranks, scalings = [0, 2, 3, 1], [0.0, 0.5, 2.0, 1.0]
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(4, 3, 6, generator=g, dtype=torch.float64)
    B = torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    x = torch.randn(sum(lens), 6, generator=g, dtype=torch.float64)
    base = torch.randn(sum(lens), 5, generator=g, dtype=torch.float64)
    plain = build_batch_info(lens, slots, ranks, scalings, "cpu")
    chunked = build_chunked_batch_info(lens, slots, ranks, scalings, "cpu", chunk_size, group)
    assert all(0 < n <= chunk_size for n in chunked.seg_lens.tolist())
    assert torch.equal(chunked.token_slots, plain.token_slots)  # x order is unchanged
    expected = torch_ref.lora_loop(x, A, B, plain, base.clone())
    t = torch.zeros(x.shape[0], 3, dtype=x.dtype)
    got = torch_ref.sgmv_expand(torch_ref.sgmv_shrink(x, A, chunked, t), B, chunked, base.clone())
    assert torch.allclose(got, expected)
