"""The Triton ops against the torch references (one suite, several backends: the interpreter on the
CPU, compiled kernels on CUDA). CPU grids use weird small sizes (rank 1 and 7, hidden 72); the GPU
adds real model sizes. Poisoned padding (NaN past every rank) proves no kernel reads it."""
from __future__ import annotations

import pytest
import torch

from reference.batch_info import build_batch_info, stable_sort_by_slot
from reference.ops import bgmv_expand, bgmv_shrink, fused_decode, sgmv_expand, sgmv_shrink, torch_ref
from reference.ops.sgmv_expand import slice_bounds

NAN = float("nan")
# Triton runs on one kind of device per process: CUDA when present, else the CPU interpreter.
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}


def _pool(g, ranks, max_rank, d_in, d_out, dtype, device, stack=1):
    A = torch.randn(len(ranks), stack * max_rank, d_in, generator=g) * d_in ** -0.5
    B = torch.randn(len(ranks), d_out, max_rank, generator=g) * max_rank ** -0.5
    for s, r in enumerate(ranks):
        A[s, stack * r:] = NAN
        B[s, :, r:] = NAN
    return A.to(dtype).to(device), B.to(dtype).to(device)


def _batch(lens, slots, ranks, device, sort=False):
    scalings = [0.0 if r == 0 else 0.5 + s for s, r in enumerate(ranks)]
    if not sort:
        return build_batch_info(lens, slots, ranks, scalings, device)
    token_slots = torch.repeat_interleave(torch.tensor(slots, dtype=torch.int32), torch.tensor(lens))
    perm, _ = stable_sort_by_slot(token_slots)
    groups, counts = torch.unique_consecutive(token_slots[perm], return_counts=True)
    return build_batch_info(counts.tolist(), groups.tolist(), ranks, scalings, device, perm)


def _close(got, exp, dtype, mask=None):
    rtol, atol = TOL[dtype]
    if mask is not None:
        got, exp = got[mask], exp[mask]
    torch.testing.assert_close(got.float(), exp.float(), rtol=rtol, atol=atol)


CASES = [  # (name, lens, slots, ranks, max_rank, d_in, d_out, sort)
    ("empty", [], [], [0, 4], 4, 16, 16, False),
    ("zero_len_middle", [2, 0, 3], [1, 2, 1], [0, 1, 7], 7, 72, 40, False),
    ("base_in_slot_2", [3, 5, 1], [0, 2, 1], [7, 1, 0], 7, 72, 24, False),
    ("unsorted_permutation", [2, 3, 1, 4], [2, 1, 2, 0], [0, 7, 1], 7, 40, 72, True),
    ("long_segment", [70, 3], [1, 2], [0, 16, 7], 16, 72, 40, False),
]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sgmv_shrink_and_expand_match_torch_ref(case, dtype):
    device = TRITON_DEVICE
    _, lens, slots, ranks, max_rank, d_in, d_out, sort = case
    g = torch.Generator().manual_seed(0)
    A, B = _pool(g, ranks, max_rank, d_in, d_out, dtype, device)
    info = _batch(lens, slots, ranks, device, sort)
    n = sum(lens)
    x = torch.randn(n, d_in, generator=g).to(dtype).to(device)
    got = sgmv_shrink(x, A, info, torch.full((n, max_rank), NAN, dtype=dtype, device=device))
    exp = torch_ref.sgmv_shrink(x, A, info, torch.full((n, max_rank), NAN, dtype=dtype, device=device))
    assert torch.equal(torch.isnan(got), torch.isnan(exp))  # same region written, nothing else
    _close(got, exp, dtype, ~torch.isnan(exp))
    t = torch.nan_to_num(exp, nan=NAN)  # expand must not read past each token's rank (NaN there)
    base = torch.randn(n, d_out, generator=g).to(dtype).to(device)
    got_out = sgmv_expand(t, B, info, base.clone())
    exp_out = torch_ref.sgmv_expand(t, B, info, base.clone())
    _close(got_out, exp_out, dtype)
    rank0 = torch.tensor([ranks[s] == 0 for s in info.token_slots.tolist()], dtype=torch.bool, device=device)
    assert torch.equal(got_out[rank0], base[rank0])  # rank 0 adds exactly nothing


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bgmv_and_fused_decode_match_torch_ref(dtype):
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(1)
    ranks = [0, 1, 7, 16]
    A, B = _pool(g, ranks, 16, 72, 40, dtype, device)
    info = _batch([1] * 9, [1, 2, 0, 3, 3, 2, 0, 1, 3], ranks, device)
    x = torch.randn(9, 72, generator=g).to(dtype).to(device)
    got = bgmv_shrink(x, A, info, torch.full((9, 16), NAN, dtype=dtype, device=device))
    exp = torch_ref.bgmv_shrink(x, A, info, torch.full((9, 16), NAN, dtype=dtype, device=device))
    assert torch.equal(torch.isnan(got), torch.isnan(exp))
    _close(got, exp, dtype, ~torch.isnan(exp))
    base = torch.randn(9, 40, generator=g).to(dtype).to(device)
    _close(bgmv_expand(exp, B, info, base.clone()), torch_ref.bgmv_expand(exp, B, info, base.clone()), dtype)
    expected = torch_ref.fused_decode(x, A, B, info, base.clone())
    _close(fused_decode(x, A, B, info, base.clone()), expected, dtype)
    got_slot = fused_decode(x, A, B, info, base.clone(), schedule="slot", block_t=16, num_splits=2, block_n=16)
    _close(got_slot, expected, dtype)  # 9 tokens in blocks of 16, two column splits
    rank0 = info.token_slots == 0
    assert torch.equal(got_slot[rank0], base[rank0])


def test_fused_decode_slot_schedule_over_several_token_blocks():
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(4)
    ranks = [3, 0, 16]
    A, B = _pool(g, ranks, 16, 40, 24, torch.float32, device)
    info = _batch([1] * 40, [(5 * i) % 3 for i in range(40)], ranks, device)
    x = torch.randn(40, 40, generator=g).to(device)
    base = torch.randn(40, 24, generator=g).to(device)
    got = fused_decode(x, A, B, info, base.clone(), schedule="slot", block_t=16, num_splits=3, block_n=16)
    _close(got, torch_ref.fused_decode(x, A, B, info, base.clone()), torch.float32)


@pytest.mark.parametrize("expand_op", [sgmv_expand, bgmv_expand], ids=["sgmv", "bgmv"])
def test_stacked_qkv_slices_with_gqa_widths(expand_op):
    device = TRITON_DEVICE
    """q is wider than k and v; parts are packed at each adapter's own rank."""
    g = torch.Generator().manual_seed(2)
    ranks, max_rank, offsets = [0, 3, 7], 7, (0, 32, 40, 48)
    A, B = _pool(g, ranks, max_rank, 24, 48, torch.float32, device, stack=3)
    info = _batch([1, 4, 2], [2, 1, 0], ranks, device)
    x = torch.randn(7, 24, generator=g, device="cpu").to(device)
    t = torch.full((7, 3 * max_rank), NAN, device=device)
    sgmv_shrink(x, A, info, t, stack_num=3)
    exp_t = torch_ref.sgmv_shrink(x, A, info, torch.full_like(t, NAN), stack_num=3)
    assert torch.equal(torch.isnan(t), torch.isnan(exp_t))
    base = torch.randn(7, 48, generator=g).to(device)
    got = expand_op(t, B, info, base.clone(), slice_offsets=offsets)
    _close(got, torch_ref.sgmv_expand(t, B, info, base.clone(), slice_offsets=offsets), torch.float32)


def test_slice_offsets_are_checked():
    assert slice_bounds(None, 8) == (0, 8, 8, 8)
    for bad in [(0,), (0, 9), (4, 2, 8), (0, 1, 2, 3, 4)]:
        with pytest.raises(ValueError):
            slice_bounds(bad, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="real model sizes run on the GPU only")
@pytest.mark.parametrize("n_out, rank", [(4096, 16), (14336, 64), (1024, 16)])
def test_model_sizes_on_gpu(n_out, rank):
    g = torch.Generator().manual_seed(3)
    ranks = [0] + [rank] * 4
    A, B = _pool(g, ranks, rank, 4096, n_out, torch.bfloat16, "cuda")
    info = _batch([300, 1, 700, 5], [1, 2, 3, 4], ranks, "cuda")
    x = torch.randn(1006, 4096, generator=g).bfloat16().cuda()
    t = sgmv_shrink(x, A, info, torch.zeros(1006, rank, dtype=torch.bfloat16, device="cuda"))
    _close(t, torch_ref.sgmv_shrink(x, A, info, torch.zeros_like(t)), torch.bfloat16)
    base = torch.randn(1006, n_out, generator=g).bfloat16().cuda()
    _close(sgmv_expand(t, B, info, base.clone()), torch_ref.sgmv_expand(t, B, info, base.clone()), torch.bfloat16)
    dec = _batch([1] * 64, [1 + i % 4 for i in range(64)], ranks, "cuda")
    xd = x[:64].contiguous()
    expected = torch_ref.fused_decode(xd, A, B, dec, base[:64].clone())
    _close(fused_decode(xd, A, B, dec, base[:64].clone()), expected, torch.bfloat16)
    _close(fused_decode(xd, A, B, dec, base[:64].clone(), schedule="slot"), expected, torch.bfloat16)
