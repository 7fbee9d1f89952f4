"""LoRABatchInfo builders against hand-worked examples and brute force."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.batch_info import (build_batch_info, seg_indptr_from_seg_lens, stable_sort_by_slot,
                                  token_slots_from_segments)


def test_running_example():
    indptr = seg_indptr_from_seg_lens(torch.tensor([3, 10, 5], dtype=torch.int32))
    assert indptr.tolist() == [0, 3, 13, 18] and indptr.dtype == torch.int32
    slots = token_slots_from_segments(indptr, torch.tensor([2, 0, 1], dtype=torch.int32))
    assert slots.tolist() == [2] * 3 + [0] * 10 + [1] * 5 and slots.dtype == torch.int32


def test_empty_and_zero_length_segments():
    assert seg_indptr_from_seg_lens(torch.zeros(0, dtype=torch.int32)).tolist() == [0]
    indptr = seg_indptr_from_seg_lens(torch.tensor([2, 0, 3], dtype=torch.int32))
    assert token_slots_from_segments(indptr, torch.tensor([1, 2, 1], dtype=torch.int32)).tolist() == [1, 1, 1, 1, 1]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40))
def test_stable_sort_matches_brute_force(slots):
    t = torch.tensor(slots, dtype=torch.int32)
    perm, inv = stable_sort_by_slot(t)
    expected = sorted(range(len(slots)), key=lambda i: (slots[i], i))  # stable: ties keep order
    assert perm.tolist() == expected and perm.dtype == torch.int64
    assert [expected.index(j) for j in range(len(slots))] == inv.tolist()


def test_build_batch_info_host_fields_and_permutation():
    perm = torch.tensor([1, 3, 0, 2])
    info = build_batch_info([2, 2], [1, 0], [0, 4], [0.0, 2.0], "cpu", permutation=perm)
    assert (info.bs, info.num_segments, info.max_len, info.has_active_lora) == (2, 2, 2, True)
    # sorted rows 0,1 (segment 0, slot 1) are x rows 1 and 3
    assert info.token_slots.tolist() == [0, 1, 0, 1]
    base_only = build_batch_info([3], [0], [0, 4], [0.0, 2.0], "cpu")
    assert base_only.has_active_lora is False
    empty_adapter_segment = build_batch_info([0, 2], [1, 0], [0, 4], [0.0, 2.0], "cpu")
    assert empty_adapter_segment.has_active_lora is False


@pytest.mark.parametrize("args, match", [
    (([1, 2], [0], [0], [0.0]), "weight_indices"),
    (([1], [0], [0, 4], [0.0]), "scalings"),
    (([-1], [0], [0], [0.0]), "negative"),
    (([1], [3], [0, 4], [0.0, 1.0]), "outside slots"),
])
def test_build_batch_info_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        build_batch_info(*args, "cpu")


def test_build_batch_info_rejects_wrong_permutation_length():
    with pytest.raises(ValueError, match="permutation"):
        build_batch_info([2], [0], [0], [0.0], "cpu", permutation=torch.arange(3))
