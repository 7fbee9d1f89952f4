"""The torch reference ops against a dense per-token computation written independently."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.batch_info import build_batch_info, stable_sort_by_slot
from reference.ops import torch_ref

JUNK = 1e3


def _pool(g, ranks, max_rank, d_in, d_out, stack=1):
    A = torch.randn(len(ranks), stack * max_rank, d_in, generator=g, dtype=torch.float64)
    B = torch.randn(len(ranks), d_out, max_rank, generator=g, dtype=torch.float64)
    for s, r in enumerate(ranks):  # junk everywhere an op must not read
        A[s, stack * r:] = JUNK
        B[s, :, r:] = JUNK
    return A, B


def _dense_delta(x, A, B, slots, ranks, scalings):
    """Row by row, no batching: delta[tok] = s * B[:, :r] @ (A[:r] @ x[tok])."""
    out = torch.zeros(x.shape[0], B.shape[1], dtype=x.dtype)
    for tok, s in enumerate(slots):
        r = ranks[s]
        out[tok] = scalings[s] * (B[s, :, :r] @ (A[s, :r] @ x[tok]))
    return out


batch = st.fixed_dictionaries({
    "lens": st.lists(st.integers(0, 5), min_size=0, max_size=6),
    "ranks": st.lists(st.sampled_from([0, 1, 3, 4]), min_size=1, max_size=4),
    "seed": st.integers(0, 2**16),
    "d_in": st.sampled_from([1, 8, 13]),
    "d_out": st.sampled_from([1, 6, 9]),
})


@settings(max_examples=40, deadline=None)
@given(batch, st.data())
def test_every_path_equals_dense_rows(b, data):
    n_slots = len(b["ranks"])
    slots = [data.draw(st.integers(0, n_slots - 1)) for _ in b["lens"]]
    scalings = [0.0 if r == 0 else 0.5 + s for s, r in enumerate(b["ranks"])]
    g = torch.Generator().manual_seed(b["seed"])
    A, B = _pool(g, b["ranks"], 4, b["d_in"], b["d_out"])
    info = build_batch_info(b["lens"], slots, b["ranks"], scalings, "cpu")
    x = torch.randn(sum(b["lens"]), b["d_in"], generator=g, dtype=torch.float64)
    base = torch.randn(x.shape[0], b["d_out"], generator=g, dtype=torch.float64)
    token_slots = info.token_slots.tolist()
    expected = base + _dense_delta(x, A, B, token_slots, b["ranks"], scalings)

    assert torch.allclose(torch_ref.lora_loop(x, A, B, info, base.clone()), expected)
    assert torch.allclose(torch_ref.fused_decode(x, A, B, info, base.clone()), expected)
    for shrink, expand in [(torch_ref.bgmv_shrink, torch_ref.bgmv_expand), (torch_ref.sgmv_shrink, torch_ref.sgmv_expand)]:
        t = torch.zeros(x.shape[0], 4, dtype=x.dtype)
        assert torch.allclose(expand(shrink(x, A, info, t), B, info, base.clone()), expected)

    # the same tokens grouped by slot through a permutation: outputs stay in x order
    perm, _ = stable_sort_by_slot(info.token_slots)
    groups, counts = torch.unique_consecutive(info.token_slots[perm], return_counts=True)
    sorted_info = build_batch_info(counts.tolist(), groups.tolist(), b["ranks"], scalings, "cpu", perm)
    assert sorted_info.token_slots.tolist() == token_slots
    t = torch.zeros(x.shape[0], 4, dtype=x.dtype)
    out = torch_ref.sgmv_expand(torch_ref.sgmv_shrink(x, A, sorted_info, t), B, sorted_info, base.clone())
    assert torch.allclose(out, expected)


def test_rank_zero_adds_exactly_nothing_and_shrink_leaves_undefined_columns():
    g = torch.Generator().manual_seed(0)
    A, B = _pool(g, [0, 2], 4, 8, 8)
    info = build_batch_info([3, 2], [0, 1], [0, 2], [0.0, 1.0], "cpu")
    x = torch.randn(5, 8, generator=g, dtype=torch.float64)
    base = torch.randn(5, 8, generator=g, dtype=torch.float64)
    out = torch_ref.sgmv_expand(torch.randn(5, 4, generator=g, dtype=torch.float64), B, info, base.clone())
    assert torch.equal(out[:3], base[:3])
    t = torch.full((5, 4), float("nan"), dtype=torch.float64)
    torch_ref.sgmv_shrink(x, A, info, t)
    assert torch.isnan(t[:3]).all() and torch.isnan(t[3:, 2:]).all() and not torch.isnan(t[3:, :2]).any()


def test_stacked_qkv_expand_writes_each_slice():
    """GQA-shaped slices (q 8 wide, k and v 4 wide) with parts packed at the adapter's rank."""
    g = torch.Generator().manual_seed(1)
    r, max_rank, d_in, offsets = 2, 4, 6, (0, 8, 12, 16)
    A, B = _pool(g, [0, r], max_rank, d_in, 16, stack=3)
    info = build_batch_info([3], [1], [0, r], [0.0, 2.0], "cpu")
    x = torch.randn(3, d_in, generator=g, dtype=torch.float64)
    t = torch.zeros(3, 3 * max_rank, dtype=torch.float64)
    torch_ref.sgmv_shrink(x, A, info, t, stack_num=3)
    out = torch_ref.sgmv_expand(t, B, info, torch.zeros(3, 16, dtype=torch.float64), slice_offsets=offsets)
    for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
        part = x @ A[1, i * r:(i + 1) * r].T
        assert torch.allclose(out[:, lo:hi], 2.0 * part @ B[1, lo:hi, :r].T)
    out_bgmv = torch_ref.bgmv_expand(t, B, info, torch.zeros(3, 16, dtype=torch.float64), slice_offsets=offsets)
    assert torch.allclose(out_bgmv, out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_outputs_keep_dtype(dtype, device):
    g = torch.Generator().manual_seed(2)
    A, B = (w.to(dtype).to(device) for w in _pool(g, [0, 4], 4, 16, 16))
    info = build_batch_info([2, 3], [1, 0], [0, 4], [0.0, 1.0], device)
    x = torch.randn(5, 16, generator=g).to(dtype).to(device)
    out = torch_ref.lora_loop(x, A, B, info, torch.zeros(5, 16, dtype=dtype, device=device))
    assert out.dtype == dtype and out.device.type == device.type
    assert torch.equal(out[2:], torch.zeros(3, 16, dtype=dtype, device=device))
