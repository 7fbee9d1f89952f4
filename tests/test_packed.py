"""The packed (fused q/k/v, gate/up) layout: offsets, zero parts, and the errors of the contract."""
import pytest
import torch

from reference.batch_info import build_batch_info
from reference.ops import torch_ref
from reference.packed import slice_offsets_for, stack_lora_parts


def test_llama3_8b_offsets():
    assert slice_offsets_for((4096, 1024, 1024)) == (0, 4096, 5120, 6144)
    assert slice_offsets_for((14336, 14336)) == (0, 14336, 28672)


def test_missing_k_is_zero_and_v_keeps_its_place():
    g = torch.Generator().manual_seed(0)
    Aq, Av = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    Bq, Bv = torch.randn(12, 2, generator=g), torch.randn(4, 2, generator=g)
    A, B = stack_lora_parts([Aq, None, Av], [Bq, None, Bv], [12, 4, 4])
    assert A.shape == (6, 8) and B.shape == (20, 2)
    assert torch.equal(A[0:2], Aq) and torch.equal(A[4:6], Av) and not A[2:4].any()
    assert torch.equal(B[0:12], Bq) and torch.equal(B[16:20], Bv) and not B[12:16].any()


def test_packed_slot_equals_separate_projections():
    """One stacked shrink + sliced expand == a LoRA per part, through the contract's torch ops."""
    g = torch.Generator().manual_seed(1)
    widths, r, d_in = (12, 4, 4), 3, 8
    parts = [(torch.randn(r, d_in, generator=g), torch.randn(w, r, generator=g)) for w in widths]
    A, B = stack_lora_parts([a for a, _ in parts], [b for _, b in parts], widths)
    A_stack, B_stack = torch.zeros(2, 3 * r, d_in), torch.zeros(2, sum(widths), r)
    A_stack[1], B_stack[1] = A, B
    info = build_batch_info([2, 3], [1, 0], [0, r], [0.0, 2.0], "cpu")
    x = torch.randn(5, d_in, generator=g)
    t = torch_ref.sgmv_shrink(x, A_stack, info, torch.zeros(5, 3 * r), stack_num=3)
    out = torch_ref.sgmv_expand(t, B_stack, info, torch.zeros(5, sum(widths)), slice_offsets_for(widths))
    expected = torch.cat([2.0 * (x[:2] @ a.T) @ b.T for a, b in parts], dim=1)
    torch.testing.assert_close(out[:2], expected)
    assert not out[2:].any()


@pytest.mark.parametrize("A_parts, B_parts, widths, match", [
    ([None, None], [None, None], [4, 4], "every part is missing"),
    ([torch.zeros(2, 8)], [None], [4], "needs both"),
    ([torch.zeros(2, 8), torch.zeros(3, 8)], [torch.zeros(4, 2), torch.zeros(4, 3)], [4, 4], "one rank"),
    ([torch.zeros(2, 8)], [torch.zeros(5, 2)], [4], r"B \[4, 2\]"),
    ([torch.zeros(2, 8)], [torch.zeros(4, 2)], [4, 4], "out_features"),
    ([torch.zeros(2, 8), torch.zeros(2, 8, dtype=torch.float16)], [torch.zeros(4, 2), torch.zeros(4, 2)], [4, 4], "dtypes"),
])
def test_bad_parts_raise_clear_errors(A_parts, B_parts, widths, match):
    with pytest.raises(ValueError, match=match):
        stack_lora_parts(A_parts, B_parts, widths)


def test_offsets_reject_empty_or_zero_widths():
    for bad in ([], [4, 0]):
        with pytest.raises(ValueError, match="positive widths"):
            slice_offsets_for(bad)
