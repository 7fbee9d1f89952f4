"""The Triton ops against the torch references (one suite, several backends: the interpreter on the
CPU, compiled kernels on CUDA). CPU grids use weird small sizes (rank 1 and 7, hidden 72); the GPU
adds real model sizes. Poisoned padding (NaN past every rank) proves no kernel reads it."""
from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

import reference

from reference.batch_info import build_batch_info, stable_sort_by_slot
from reference.moe.fused_moe_lora import fused_moe_lora
from reference.ops import _triton_util, bgmv_expand, bgmv_shrink, fused_decode, sgmv_expand, sgmv_shrink, torch_ref
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


@pytest.mark.parametrize("splits, block_k", [(2, 64), (3, 64), (4, 512), (5, 256)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_shrink_partials_sum_to_the_shrink_and_the_expand_reads_their_sum(splits, block_k, dtype):
    """Split-K BGMV shrink (out [S, T, width] fp32): pieces of whole block_k blocks, each crossing the
    K loop at least twice where block_k is 64; (4, 512) on hidden 1100 leaves the last piece empty,
    which must be written as zeros (the expand sums every partial). Stacked parts, ranks 0/3/16/8,
    NaN past every rank in A and B and in the unwritten partial columns."""
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(10 * splits + block_k)
    ranks, K, stack = [0, 3, 16, 8], 1100, 2
    A, B = _pool(g, ranks, 16, K, 40, dtype, device, stack=stack)
    info = _batch([1] * 7, [1, 2, 0, 3, 3, 2, 1], ranks, device)
    x = torch.randn(7, K, generator=g).to(dtype).to(device)
    width = stack * torch.tensor(ranks, device=device)[info.token_slots.long()]
    defined = torch.arange(stack * 16, device=device)[None, :] < width[:, None]
    whole = torch_ref.bgmv_shrink(x, A, info, torch.zeros(7, stack * 16, device=device), stack_num=stack)
    parts = bgmv_shrink(x, A, info, torch.full((splits, 7, stack * 16), NAN, device=device), stack_num=stack,
                        block_k=block_k)
    assert parts.shape == (splits, 7, stack * 16)
    _close(parts.sum(0), whole, torch.float32 if dtype == torch.float32 else dtype, defined)
    if (splits, block_k) == (4, 512):  # pieces 512, 512, 76, 0 columns: the last one sums nothing
        assert torch.equal(parts[3][defined], torch.zeros_like(parts[3][defined]))
    ref_parts = torch_ref.bgmv_shrink(x, A, info, torch.full((splits, 7, stack * 16), NAN, device=device),
                                      stack_num=stack)
    _close(ref_parts.sum(0), whole, torch.float32, defined)
    base = torch.randn(7, 40, generator=g).to(dtype).to(device)
    slices = [0, 24, 40]
    summed = torch.where(defined, parts.sum(0), 0.0)
    want = torch_ref.bgmv_expand(summed, B, info, base.clone(), slices)
    got = bgmv_expand(parts, B, info, base.clone(), slices)
    _close(got, want, dtype)
    _close(torch_ref.bgmv_expand(parts, B, info, base.clone(), slices), want, dtype)
    rank0 = info.token_slots == 0
    assert torch.equal(got[rank0], base[rank0])  # rank 0 adds exactly nothing, whatever its partials


def _static_decode_info(slots, ranks, bucket, device):
    """A CUDA-graph decode batch: StaticLoRABatch's view (token_slots, the slot-sorted segments of
    every pool slot, the permutation), padding rows in slot 0 (rank 0)."""
    from reference.cuda_graph import StaticLoRABatch

    static = StaticLoRABatch(len(ranks), bucket, device=device)
    scalings = [0.0 if r == 0 else 0.5 + s for s, r in enumerate(ranks)]
    static.update(slots, bucket, 0, ranks, scalings, ownership_changed=True)
    return static.batch_info(bucket)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bgmv_expand_sorted_schedule_matches_the_token_schedule(splits, dtype):
    """The slot-sorted expand on a CUDA-graph decode view: 80 tokens in a bucket of 84 (4 padding
    rows), slot 2 holds 40 of them (three 16-row blocks, the last partial), slots 1/3 about 13 each,
    slot 0 (rank 0) the rest and the padding, slot 4 none (an empty segment); ranks 0/3/16/9/5, three
    slices (one empty), 16-column tiles over slices of 24 and 20 (two tiles each), NaN past every
    rank, split-K partials summed as t loads."""
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(30 + splits)
    ranks = [0, 3, 16, 9, 5]
    A, B = _pool(g, ranks, 16, 48, 44, dtype, device, stack=3)
    slots = [2 if i % 2 == 0 else (1, 3, 0)[(i // 2) % 3] for i in range(80)]
    info = _static_decode_info(slots, ranks, 84, device)
    assert info.num_segments == 5 and info.permutation.shape[0] == 84
    x = torch.randn(84, 48, generator=g).to(dtype).to(device)
    shape = (84, 48) if splits == 1 else (splits, 84, 48)
    t = bgmv_shrink(x, A, info, torch.full(shape, NAN, dtype=dtype if splits == 1 else torch.float32,
                                           device=device), stack_num=3, block_k=16)
    base = torch.randn(84, 44, generator=g).to(dtype).to(device)
    rank0 = info.token_slots == 0
    base[rank0] = -0.0  # a program that rewrote rows of other slots (adding 0) would turn -0.0 into +0.0
    slices = [0, 24, 24, 44]
    want = bgmv_expand(t, B, info, base.clone(), slices, schedule="token")
    got = bgmv_expand(t, B, info, base.clone(), slices, schedule="sorted", block_m=16, block_n=16)
    _close(got, want, dtype)
    summed = t if splits == 1 else torch.where(torch.isnan(t).any(0), NAN, t.sum(0))
    _close(got, torch_ref.bgmv_expand(torch.nan_to_num(summed, nan=0.0), B, info, base.clone(), slices), dtype)
    assert torch.equal(torch.signbit(got[rank0]), torch.signbit(base[rank0]))  # rows it does not own: untouched
    with pytest.raises(ValueError, match="schedule"):
        bgmv_expand(t, B, info, base.clone(), slices, schedule="slot")
    plain = build_batch_info([1] * 84, info.token_slots.tolist(), ranks, [0.5 + s for s in range(5)], device)
    with pytest.raises(ValueError, match="permutation"):
        bgmv_expand(t, B, plain, base.clone(), slices, schedule="sorted")



@pytest.mark.parametrize("splits, block_k", [(1, 16), (3, 16), (4, 64)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bgmv_shrink_sorted_schedule_matches_the_token_schedule(splits, block_k, dtype):
    """The slot-grouped shrink on a CUDA-graph decode view, against the per-token shrink and the torch
    reference: 80 tokens in a bucket of 84 (4 padding rows), slot 2 holds 40 of them (blocks of 16
    rows: three, the last partial), slot 4 none; ranks 0/3/16/9/5, three stacked parts (width up to
    48 in 16-column tiles: three), hidden 160. Split-K: (3, 16) gives pieces of 64 columns (four
    passes of the K loop, the last piece 32); (4, 64) pieces 64/64/32/0, the empty one written as
    zeros. NaN past every rank in A and in every output column no token owns: no program reads A
    past its slot's width or writes rows of other slots (the rank-0 rows stay NaN)."""
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(40 + splits)
    ranks, K, stack = [0, 3, 16, 9, 5], 160, 3
    A, _ = _pool(g, ranks, 16, K, 8, dtype, device, stack=stack)
    slots = [2 if i % 2 == 0 else (1, 3, 0)[(i // 2) % 3] for i in range(80)]
    info = _static_decode_info(slots, ranks, 84, device)
    x = torch.randn(84, K, generator=g).to(dtype).to(device)
    width = stack * torch.tensor(ranks, device=device)[info.token_slots.long()]
    defined = torch.arange(stack * 16, device=device)[None, :] < width[:, None]
    shape, out_dtype = ((84, 48), dtype) if splits == 1 else ((splits, 84, 48), torch.float32)
    got = bgmv_shrink(x, A, info, torch.full(shape, NAN, dtype=out_dtype, device=device), stack_num=stack,
                      schedule="sorted", block_k=block_k, block_m=16, block_n=16)
    want = bgmv_shrink(x, A, info, torch.full(shape, NAN, dtype=out_dtype, device=device), stack_num=stack,
                       block_k=block_k)
    whole = torch_ref.bgmv_shrink(x, A, info, torch.zeros(84, 48, device=device), stack_num=stack)
    summed, summed_want = (got, want) if splits == 1 else (got.sum(0), want.sum(0))
    _close(summed, summed_want, dtype, defined)
    _close(summed, whole, dtype, defined)
    assert torch.isnan(summed[~defined]).all(), "a program wrote columns or rows its slot does not own"
    if splits == 4:  # the last piece sums nothing and still writes zeros where its tokens are defined
        assert torch.equal(got[3][defined], torch.zeros_like(got[3][defined]))
    # the sorted schedule's defaults (one 16-row block, the width's tile, one piece in one pass)
    default = bgmv_shrink(x, A, info, torch.full(shape, NAN, dtype=out_dtype, device=device), stack_num=stack,
                          schedule="sorted")
    _close(default if splits == 1 else default.sum(0), whole, dtype, defined)
    # a slot-sorted batch of a few slots only (chapter 07's sort_by_slot): segments 0, 1, 2 are slots
    # 3, 1, 4 (weight_indices), so a kernel reading segment i as slot i computes with other adapters
    sparse = _batch([1] * 7, [3, 1, 4, 3, 1, 3, 4], ranks, device, sort=True)
    assert sparse.weight_indices.tolist() == [1, 3, 4] and sparse.permutation is not None
    xs = x[:7]
    want_s = torch_ref.bgmv_shrink(xs, A, sparse, torch.zeros(7, 48, device=device), stack_num=stack)
    width_s = stack * torch.tensor(ranks, device=device)[sparse.token_slots.long()]
    defined_s = torch.arange(48, device=device)[None, :] < width_s[:, None]
    got_s = bgmv_shrink(xs, A, sparse, torch.full((7, 48) if splits == 1 else (splits, 7, 48), NAN,
                                                  dtype=out_dtype, device=device), stack_num=stack,
                        schedule="sorted", block_k=block_k)
    _close(got_s if splits == 1 else got_s.sum(0), want_s, dtype, defined_s)


def test_bgmv_shrink_schedule_arguments_are_checked():
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(4)
    ranks = [0, 4]
    A, _ = _pool(g, ranks, 4, 64, 16, torch.float32, device)
    info = _static_decode_info([1, 0, 1], ranks, 4, device)
    x = torch.randn(4, 64, generator=g).to(device)
    out = torch.full((4, 4), NAN, device=device)
    with pytest.raises(ValueError, match="schedule must be"):
        bgmv_shrink(x, A, info, out, schedule="slot")
    plain = build_batch_info([1] * 4, info.token_slots.tolist(), ranks, [0.0, 1.0], device)
    with pytest.raises(ValueError, match="permutation"):
        bgmv_shrink(x, A, plain, out, schedule="sorted")
    with pytest.raises(ValueError, match="'sorted' schedule only"):
        bgmv_shrink(x, A, info, out, block_m=16)
    for bad in (dict(block_m=8), dict(block_n=48), dict(block_k=4)):  # a GPU tl.dot needs >= 16, powers of two
        with pytest.raises(ValueError, match="powers of two >= 16"):
            bgmv_shrink(x, A, info, out, schedule="sorted", **bad)
    assert torch.isnan(out).all(), "a refused call wrote its output"

def test_split_k_arguments_are_checked():
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(3)
    A, B = _pool(g, [0, 4], 4, 64, 16, torch.float32, device)
    info = _batch([1] * 3, [1, 0, 1], [0, 4], device)
    x = torch.randn(3, 64, generator=g).to(device)
    with pytest.raises(ValueError, match="float32"):
        bgmv_shrink(x, A, info, torch.zeros(2, 3, 4, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="shapes"):
        bgmv_shrink(x, A, info, torch.zeros(2, 4, 4, device=device))
    with pytest.raises(ValueError, match="split-K partials"):
        bgmv_expand(torch.zeros(1, 2, 3, 4, device=device), B, info, torch.zeros(3, 16, device=device))


def test_decode_split_rule_fills_the_gpu_and_never_splits_small_hidden_sizes():
    from reference.ops.bgmv_shrink import MIN_PIECE, TARGET_PROGRAMS, rule_splits, split_config

    assert rule_splits(64, 4096, 16) == 8 and rule_splits(256, 4096, 16) == 2
    assert rule_splits(64, 64, 16) == 1 and rule_splits(1024, 4096, 16) == 1
    for tokens in (1, 16, 64, 256):
        for K in (1024, 2048, 5120):  # hidden sizes the H200 table does not hold
            for width in (16, 32, 48, 128, 192):
                S = rule_splits(tokens, K, width)
                cap = triton.next_power_of_2(K // MIN_PIECE + 1) // 2  # largest power of 2 <= K / MIN_PIECE
                assert S & (S - 1) == 0 and 1 <= S <= max(1, cap)
                # the smallest power of two that reaches the target, unless the piece size caps it
                assert S == cap or tokens * S >= TARGET_PROGRAMS
                assert S == 1 or tokens * (S // 2) < TARGET_PROGRAMS
                block_n = triton.next_power_of_2(max(width, 16))
                cfg = split_config(tokens, K, width, S)
                expect_k = 4096 if S == 1 else min(4096, triton.next_power_of_2(-(-K // S)))
                assert cfg["block_k"] == min(expect_k, max(64, 65536 // block_n)) or S == 1


def test_tuned_split_table_is_the_committed_sweep():
    """TUNED_H200 holds exactly the best config of every shape in the committed H200 sweep, and the
    defaults pick it (nearest swept token count for the buckets between)."""
    import json

    from reference.ops.bgmv_shrink import TUNED_H200, decode_splits, split_config

    sweep = json.loads((Path(__file__).parents[1] / "benchmarks/results/decode_split_k_h200.json").read_text())
    table = {}
    for row in sweep["best"]:
        b = row["best"]
        table.setdefault((row["in_features"], row["width"]), {})[row["tokens"]] = (
            b["splits"], b.get("block_k"), b.get("num_warps"))
    assert table == TUNED_H200
    for (K, width), by_tokens in TUNED_H200.items():
        for tokens, (S, block_k, num_warps) in by_tokens.items():
            assert decode_splits(tokens, K, width) == S
            if block_k is not None:
                assert split_config(tokens, K, width, S) == {"block_k": block_k, "num_warps": num_warps}
    assert decode_splits(48, 4096, 16) == TUNED_H200[(4096, 16)][64][0]  # bucket 48: nearest is 64
    assert decode_splits(128, 4096, 32) == TUNED_H200[(4096, 32)][64][0]  # a tie in log2 takes the smaller


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


@pytest.mark.parametrize("tokens,max_rank,num_slots,schedule", [
    (16, 16, 3, "token"), (72, 32, 3, "token"), (64, 64, 3, "slot"), (64, 64, 33, "token"), (16, 64, 3, "token"),
])
def test_fused_decode_defaults_by_rank_tokens_and_pool_size(tokens, max_rank, num_slots, schedule):
    """Each branch of the per-rank defaults (decode_rank_sweep_h200.json) picks its schedule and
    gives the reference's result; bgmv_expand's per-rank block_n too."""
    from reference.ops.fused_decode import default_config

    cfg = default_config(tokens, max_rank, num_slots)
    assert cfg["schedule"] == schedule
    assert default_config(tokens, max_rank, num_slots, "slot")["schedule"] == "slot"
    if (tokens, max_rank) == (72, 32):
        assert (cfg["block_k"], cfg["num_warps"]) == (512, 8)
    device = TRITON_DEVICE
    g = torch.Generator().manual_seed(tokens + max_rank + num_slots)
    ranks = [0] + [max_rank - s % 3 for s in range(1, num_slots)]
    A, B = _pool(g, ranks, max_rank, 24, 40, torch.float32, device)
    info = _batch([1] * tokens, [(7 * i) % num_slots for i in range(tokens)], ranks, device)
    x = torch.randn(tokens, 24, generator=g).to(device)
    base = torch.randn(tokens, 40, generator=g).to(device)
    _close(fused_decode(x, A, B, info, base.clone()), torch_ref.fused_decode(x, A, B, info, base.clone()),
           torch.float32)
    t = torch_ref.bgmv_shrink(x, A, info, torch.zeros(tokens, max_rank, device=device))
    _close(bgmv_expand(t, B, info, base.clone()), torch_ref.bgmv_expand(t, B, info, base.clone()), torch.float32)


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


# ---- offsets past 2^31 elements ----------------------------------------------------------------
# A row (or slot) index times its stride passes 2^31 elements at real sizes (x [600000, 4096], out
# [80000, 28672]); int32 offsets wrap there to an illegal address. The kernels take every stride in
# int64. The far layout below puts the last index of one dimension past 2^31 elements while the
# tensor stays small: that dimension's stride is about 2^31 / (size - 1), the other dimensions stay
# packed. Its storage is mostly never touched (on the CPU it is never committed, so this is cheap).
TWO_31 = 2 ** 31


def _far(v: torch.Tensor, dim: int, reach: int = 0) -> torch.Tensor:
    """A copy of ``v`` in which index ``reach`` (default: the last) along ``dim`` lies past 2^31
    elements of its storage; the other dimensions stay packed.

    The stride of ``dim`` stays below 2^31, so Triton passes it as an int32 (the case that wrapped):
    ``reach`` must be at least 2. A K dimension that a kernel walks in blocks gets ``reach`` = the
    block, so the pointer step of its loop (block x stride) passes 2^31 as well. Storage: about
    2^31 * (shape[dim] - 1) / reach elements of ``v.dtype``, almost all of it never touched.
    """
    sizes = list(v.shape)
    reach = reach or sizes[dim] - 1
    assert 2 <= reach < sizes[dim], "the stride must fit an int32 and the index must exist"
    strides, span = [0] * v.dim(), 1
    for d in reversed(range(v.dim())):
        if d != dim:
            strides[d], span = span, span * sizes[d]
    far = -(-TWO_31 // reach)
    far = max(span, far + (-far) % 16)  # a multiple of 16: the GPU specializes like a packed tensor
    assert reach * far >= TWO_31 > far
    strides[dim] = far
    storage = torch.empty((sizes[dim] - 1) * far + span, dtype=v.dtype, device=v.device)
    out = storage.as_strided(sizes, strides)
    out.copy_(v)
    return out


FAR_BLOCK_K = 64  # the K block every shrink-side op gets below; hidden = FAR_BLOCK_K + 2: two steps


def _far_cases():
    """(name, run(*args) -> output, args, arg names, {(arg, dim): reach}) for every op and schedule."""
    device, dtype = TRITON_DEVICE, torch.float16
    g = torch.Generator().manual_seed(5)
    ranks, max_rank, d_in, d_out, bk = [0, 4, 3], 4, FAR_BLOCK_K + 2, 40, FAR_BLOCK_K
    A, B = _pool(g, ranks, max_rank, d_in, d_out, torch.float32, device)
    A, B = torch.nan_to_num(A, 0.0).to(dtype), torch.nan_to_num(B, 0.0).to(dtype)
    x = torch.randn(5, d_in, generator=g).to(dtype).to(device)
    base = torch.randn(5, d_out, generator=g).to(dtype).to(device)
    seg = _batch([2, 3], [1, 2], ranks, device)
    seg_perm = _batch([1, 2, 2], [2, 1, 2], ranks, device, sort=True)
    dec = _batch([1] * 5, [1, 2, 0, 2, 1], ranks, device)
    t = torch_ref.sgmv_shrink(x, A, seg, torch.zeros(5, max_rank, dtype=dtype, device=device))
    nan_t = torch.full((5, max_rank), NAN, dtype=dtype, device=device)
    shrink_k = {(0, 1): bk, (1, 2): bk}  # x's and A's hidden dimension, walked in blocks of bk
    cases = []
    for kind, info in [("segments", seg), ("permuted", seg_perm)]:
        cases.append((f"sgmv_shrink/{kind}", lambda x_, A_, o, info=info: sgmv_shrink(x_, A_, info, o, block_k=bk),
                      (x, A, nan_t), ("x", "A_stack", "out"), shrink_k))
        cases.append((f"sgmv_expand/{kind}", lambda t_, B_, o, info=info: sgmv_expand(t_, B_, info, o),
                      (t, B, base), ("t", "B_stack", "out"), {}))
    cases.append(("bgmv_shrink", lambda x_, A_, o: bgmv_shrink(x_, A_, dec, o, block_k=bk),
                  (x, A, nan_t), ("x", "A_stack", "out"), shrink_k))
    cases.append(("bgmv_expand", lambda t_, B_, o: bgmv_expand(t_, B_, dec, o),
                  (t, B, base), ("t", "B_stack", "out"), {}))
    cases.append(("fused_decode/token",
                  lambda x_, A_, B_, o: fused_decode(x_, A_, B_, dec, o, block_k=bk, num_splits=2, block_n=16),
                  (x, A, B, base), ("x", "A_stack", "B_stack", "out"), shrink_k))
    cases.append(("fused_decode/slot",
                  lambda x_, A_, B_, o: fused_decode(x_, A_, B_, dec, o, schedule="slot", block_k=bk, block_t=16,
                                                     block_n=16),
                  (x, A, B, base), ("x", "A_stack", "B_stack", "out"), shrink_k))
    return cases + _far_moe_cases(bk)


def _far_moe_cases(bk: int):
    """The MoE LoRA op (chapter 09) in both roles: gate_up (token rows, two slices) and down (pair
    rows), with routing weights; every dimension of every tensor argument has at least 3 entries."""
    device, dtype = TRITON_DEVICE, torch.float16
    g = torch.Generator().manual_seed(6)
    ranks = torch.tensor([[0, 0, 0], [4, 3, 0], [2, 4, 1]], dtype=torch.int32)
    tokens, top_k, d_in, width, max_rank = 4, 3, bk + 2, 40, 4
    ids = torch.tensor([[0, 1, 2], [2, 1, -1], [1, 0, 2], [0, 2, 1]])
    meta = dict(topk_ids=ids.to(device), token_slots=torch.tensor([1, 2, 0, 1], dtype=torch.int32).to(device),
                lora_ranks=ranks.to(device), scalings=torch.tensor([0.0, 0.5, 2.0]).to(device), top_k=top_k)
    weights = torch.rand(tokens, top_k, generator=g).to(dtype).to(device)
    cases = []
    for role, stack, rows in [("gate_up", 2, tokens), ("down", 1, tokens * top_k)]:
        A = (torch.randn(3, 3, stack * max_rank, d_in, generator=g) * d_in ** -0.5).to(dtype).to(device)
        B = (torch.randn(3, 3, stack * width, max_rank, generator=g) * 0.5).to(dtype).to(device)
        x = torch.randn(rows, d_in, generator=g).to(dtype).to(device)
        base = torch.randn(tokens * top_k, stack * width, generator=g).to(dtype).to(device)
        offsets = (0, width, 2 * width) if stack == 2 else None

        def run(x_, A_, B_, o, w, offsets=offsets, per_pair=role == "down"):
            return fused_moe_lora(x_, A_, B_, o, rows_per_pair=per_pair, slice_offsets=offsets, topk_weights=w,
                                  block_m=16, block_k=bk, block_n=16, **meta)

        cases.append((f"fused_moe_lora/{role}", run, (x, A, B, base, weights),
                      ("x", "A", "B", "out", "topk_weights"), {(0, 1): bk, (1, 3): bk}))
    return cases


def _run_far_checks() -> None:
    """Run every op (the MoE op of chapter 09 too) with each argument in turn laid out far along each
    dimension; print one line per check (``run`` before the launch, then ``ok`` or ``bad``), so a
    crash names its check."""
    for name, run, args, arg_names, reach in _far_cases():
        expected = run(*[a.clone() for a in args])
        for i, arg in enumerate(args):
            for dim in range(arg.dim()):
                check = f"{name} with {arg_names[i]} far along dim {dim}"
                print("run", check, flush=True)
                call = [a.clone() for a in args]
                call[i] = _far(arg, dim, reach.get((i, dim), 0))
                got = run(*call).clone()
                del call
                try:
                    assert torch.equal(torch.isnan(got), torch.isnan(expected)), "another region written"
                    _close(got, expected, torch.float16, ~torch.isnan(expected))
                except AssertionError as e:
                    print("bad", check, str(e).replace("\n", " ")[:300], flush=True)
                else:
                    print("ok", check, flush=True)


def test_offsets_past_2_31_elements_in_every_kernel_and_argument():
    """Every kernel, every tensor argument, every dimension: an index times its stride past 2^31
    elements reads and writes the right element (in int32 it wrapped: a crash or garbage).

    Runs in a child process: a wrapped offset is an illegal address, which kills the process on
    the CPU and poisons the CUDA context on the GPU."""
    here = Path(__file__).resolve().parent
    path = [str(here.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    code = f"import reference, sys; sys.path.insert(0, {str(here)!r}); import test_triton_ops as t; t._run_far_checks()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    lines = proc.stdout.splitlines()
    started = [line[4:] for line in lines if line.startswith("run ")]
    bad = [line[4:] for line in lines if line.startswith("bad ")]
    assert started, f"no check ran (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert not bad, "wrong results:\n" + "\n".join(bad)
    assert proc.returncode == 0, f"crashed (rc {proc.returncode}) during: {started[-1]}\n{proc.stderr[-2000:]}"
    ok = [line for line in lines if line.startswith("ok ")]
    assert len(ok) == len(started) == sum(a.dim() for _, _, args, _, _ in _far_cases() for a in args)


def test_every_reference_kernel_takes_its_strides_in_int64():
    """A kernel added later is held to the rule the far-layout test checks for the current ones:
    every ``stride_*`` parameter is cast to int64 (``tl.cast``: a stride of 1 is a constexpr)."""
    import triton.runtime.interpreter  # noqa: F401  (not imported by triton itself on a GPU)

    kernels = {}
    for info in pkgutil.walk_packages(reference.__path__, "reference."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if isinstance(obj, (triton.runtime.jit.JITFunction, triton.runtime.interpreter.InterpretedFunction)) \
                    and getattr(fn, "__module__", None) == info.name:
                kernels[f"{info.name}:{name}"] = fn
    assert {"reference.ops.sgmv_shrink:_sgmv_shrink_kernel", "reference.ops.fused_decode:_fused_decode_by_slot_kernel"} \
        <= set(kernels)
    missing = []
    for key, fn in kernels.items():
        source = inspect.getsource(fn)
        for p in inspect.signature(fn).parameters:
            if p.startswith("stride") and not re.search(rf"\b{p}\b[^\n]*= [^\n]*tl\.cast\({p}, tl\.int64\)", source):
                missing.append(f"{key}: {p}")
    assert not missing, "strides not cast to int64:\n" + "\n".join(missing)


# ---- the same on the GPU at the sizes that crashed (H200: an illegal memory access) ---------------
def _rows_past_2_31(n_rows: int, width: int) -> list[int]:
    """A few rows on both sides of 2^31 elements, the first rows and the last ones."""
    cross = TWO_31 // width
    return sorted({0, 1, cross - 1, cross, cross + 1, n_rows - 2, n_rows - 1} & set(range(n_rows)))


def _check_shrink_rows(n: int, hidden: int, rank: int, device) -> None:
    """x [n, hidden] bf16, three slots (ranks rank, rank, 8; slot 0 the base): sgmv (segments and a
    permutation), bgmv and fused decode (both schedules), sampled rows against torch on those rows."""
    g = torch.Generator(device=device).manual_seed(6)
    ranks = [0, rank, rank, 8]
    A = torch.randn(len(ranks), rank, hidden, generator=g, device=device, dtype=torch.bfloat16) * hidden ** -0.5
    x = torch.randn(n, hidden, generator=g, device=device, dtype=torch.bfloat16)
    a, b = max(1, n // 600), max(1, n // 300)
    lens = [a, n - a - b, b]
    seg = _batch(lens, [1, 2, 3], ranks, device)
    rows = _rows_past_2_31(n, hidden)
    slot_of = seg.token_slots[rows].long()
    want = torch.einsum("tk,trk->tr", x[rows].float(), A[slot_of].float())  # [rows, rank]
    r_of = torch.tensor(ranks, device=device)[slot_of]
    defined = torch.arange(rank, device=device)[None, :] < r_of[:, None]

    def check(out, what):
        torch.testing.assert_close(out[rows].float()[defined], want[defined], rtol=3e-2, atol=3e-2, msg=what)

    check(sgmv_shrink(x, A, seg, torch.zeros(n, rank, dtype=torch.bfloat16, device=device)), "sgmv_shrink")
    perm = torch.arange(n, device=device).flip(0)  # sorted row i is row n-1-i of x: same slots per row
    flipped = build_batch_info(lens[::-1], [3, 2, 1], ranks, [0.0] * len(ranks), device, perm)
    check(sgmv_shrink(x, A, flipped, torch.zeros(n, rank, dtype=torch.bfloat16, device=device)), "sgmv permuted")
    check(bgmv_shrink(x, A, seg, torch.zeros(n, rank, dtype=torch.bfloat16, device=device)), "bgmv_shrink")
    B = torch.randn(len(ranks), 64, rank, generator=g, device=device, dtype=torch.bfloat16) * rank ** -0.5
    t = torch.where(defined, want, 0.0).bfloat16().float()  # the rounding a two-kernel path has
    exp = seg.scalings[slot_of][:, None] * torch.einsum("tr,tnr->tn", t, B[slot_of].float())
    for schedule in ("token", "slot"):
        out = fused_decode(x, A, B, seg, torch.zeros(n, 64, dtype=torch.bfloat16, device=device), schedule=schedule)
        torch.testing.assert_close(out[rows].float(), exp, rtol=3e-2, atol=3e-2, msg=f"fused {schedule}")


def _check_expand_rows(expand_op, n: int, width: int, rank: int, device) -> None:
    """out [n, width] bf16 updated in place through two slices (a gate_up), sampled rows against
    torch on those rows (their base values saved before the call)."""
    g = torch.Generator(device=device).manual_seed(7)
    ranks = [0, rank, 8]
    B = torch.randn(len(ranks), width, rank, generator=g, device=device, dtype=torch.bfloat16) * rank ** -0.5
    t = torch.randn(n, 2 * rank, generator=g, device=device, dtype=torch.bfloat16)
    a, b = max(1, n // 16), max(1, n // 80)
    info = _batch([a, n - a - b, b], [1, 2, 0], ranks, device)
    out = torch.randn(n, width, generator=g, device=device, dtype=torch.bfloat16)
    rows = _rows_past_2_31(n, width)
    want = out[rows].float()
    offsets = (0, width // 2, width)
    expand_op(t, B, info, out, slice_offsets=offsets)
    for j, (row, slot) in enumerate(zip(rows, info.token_slots[rows].tolist())):
        r = ranks[slot]
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            if r:
                want[j, lo:hi] += info.scalings[slot] * (B[slot, lo:hi, :r].float() @ t[row, i * r:(i + 1) * r].float())
    torch.testing.assert_close(out[rows].float(), want, rtol=3e-2, atol=3e-2)


def test_sampled_row_checks_at_small_sizes():
    """The checks of the two GPU tests below, at sizes the interpreter runs in a moment (so a
    mistake in the checks themselves shows on the CPU, not first on the GPU)."""
    _check_shrink_rows(40, 72, 16, TRITON_DEVICE)
    for expand_op in (sgmv_expand, bgmv_expand):
        _check_expand_rows(expand_op, 40, 48, 16, TRITON_DEVICE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="2^31-element tensors run on the GPU only")
def test_shrink_of_x_past_2_31_elements_on_gpu():
    """x [600000, 4096] bf16 (4.9 GB, 2.46e9 elements), rank 16: the shape that crashed an H200
    with an illegal memory access while offsets were int32. About 5 GB of GPU memory."""
    _check_shrink_rows(600_000, 4096, 16, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="2^31-element tensors run on the GPU only")
@pytest.mark.parametrize("expand_op", [sgmv_expand, bgmv_expand], ids=["sgmv", "bgmv"])
def test_expand_into_out_past_2_31_elements_on_gpu(expand_op):
    """out [80000, 28672] bf16 (4.6 GB, 2.29e9 elements; a gate_up of 2 x 14336), rank 16: the
    other shape that crashed. About 5 GB of GPU memory."""
    _check_expand_rows(expand_op, 80_000, 28_672, 16, "cuda")


def _spy_use_packed(monkeypatch, modules, fallback: bool) -> list[bool]:
    """Replace ``use_packed`` in these op modules: it records each launch's grid choice in the returned
    list (True: packed), and with ``fallback`` always answers False (the grid over every segment)."""
    launched: list[bool] = []
    real = _triton_util.use_packed

    def use_packed(*args):
        launched.append(not fallback and real(*args))
        return launched[-1]
    for module in modules:
        monkeypatch.setattr(sys.modules[module], "use_packed", use_packed)
    return launched


# a prefill or mixed step's SGMV launches every segment's row blocks back to back too (packed=True, the
# default, where use_packed says it launches fewer blocks): (segment lengths, their slots, pool ranks)
_MIXED_LAYOUTS = {
    "a prompt chunk beside one-token decode segments": ([1] * 12 + [40] + [1] * 11,
                                                        [1, 2, 3, 0, 2, 1, 3, 2, 1, 3, 0, 2] + [3] + [2, 1, 3, 2, 0, 1, 2, 3, 1, 2, 3],
                                                        [0, 4, 8, 2]),
    "segments ending mid-block, on a block edge, empty, rank 0": ([16, 5, 0, 17, 2, 33, 1], [1, 2, 3, 1, 0, 2, 3],
                                                                  [0, 4, 8, 2]),
    "two chunks and decodes of the rank-0 base model between": ([20, 1, 1, 1, 1, 37, 1], [2, 0, 0, 1, 0, 3, 0],
                                                                [0, 4, 8, 6]),
}


@pytest.mark.parametrize("fallback", [False, True], ids=["packed", "grid over every segment"])
@pytest.mark.parametrize("layout", _MIXED_LAYOUTS, ids=list(_MIXED_LAYOUTS))
def test_sgmv_kernels_cover_every_segments_rows_once_in_a_mixed_step(layout, fallback, monkeypatch):
    """A mixed step's segments (a long prompt chunk among one-token decodes, as the engine's mixed steps
    are): the SGMV shrink and expand, by the packed grid and by the grid over every (segment, row
    block), compute each segment's row blocks once: a block skipped leaves NaN in the shrink's
    output, a block run twice adds the expand twice. Both grids were chosen as asked."""
    launched = _spy_use_packed(monkeypatch, ("reference.ops.sgmv_shrink", "reference.ops.sgmv_expand"), fallback)
    device, dtype = TRITON_DEVICE, torch.float32
    lens, slots, ranks = _MIXED_LAYOUTS[layout]
    g = torch.Generator().manual_seed(len(lens))
    A, B = _pool(g, ranks, 8, 32, 40, dtype, device, stack=2)
    info = _batch(lens, slots, ranks, device)
    n = sum(lens)
    x = torch.randn(n, 32, generator=g).to(device)
    got = sgmv_shrink(x, A, info, torch.full((n, 16), NAN, device=device), stack_num=2, block_m=16)
    exp = torch_ref.sgmv_shrink(x, A, info, torch.full((n, 16), NAN, device=device), stack_num=2)
    assert torch.equal(torch.isnan(got), torch.isnan(exp))
    _close(got, exp, dtype, ~torch.isnan(exp))
    t = torch.nan_to_num(exp, nan=0.0)
    base = torch.randn(n, 40, generator=g).to(device)
    offsets = (0, 24, 40)  # two slices, as a packed gate|up
    got_out = sgmv_expand(t, B, info, base.clone(), offsets, block_m=16, block_n=16)
    _close(got_out, torch_ref.sgmv_expand(t, B, info, base.clone(), offsets), dtype)
    assert launched == [not fallback] * 2, "every layout here launches fewer blocks packed"


# the sorted decode kernels launch every segment's row blocks back to back (_triton_util.packed_block)
_PACKED_LAYOUTS = {
    # name: (slots of the tokens, the pool's ranks): pool slots are the segments, empty ones included
    "many empty slots around one long segment": ([7] * 37 + [0] * 3, [0] + [4] * 19),
    "segments ending mid-block and on a block edge": ([1] * 16 + [2] * 5 + [3] * 17 + [5] * 2, [0, 4, 8, 2, 4, 6]),
    "every slot one token (as many segments as tokens)": (list(range(12)), [0] + [4] * 11),
    "17 segments (not a power of two), the last slot used": ([16, 3, 16, 9, 0, 16, 3] * 4, [0] + [5] * 16),
}


@pytest.mark.parametrize("fallback", [False, True], ids=["packed", "grid over every segment"])
@pytest.mark.parametrize("layout", _PACKED_LAYOUTS, ids=list(_PACKED_LAYOUTS))
def test_the_sorted_decode_kernels_cover_every_segments_rows_once_whatever_the_empty_slots(layout, fallback,
                                                                                         monkeypatch):
    """The slot-grouped shrink and the sorted expand on decode views whose segments are pool slots,
    most of them empty: each row block of each segment is computed once (a block run twice would add
    the expand twice; a block skipped leaves NaN in the shrink's output), by the packed grid and by
    the grid over every (segment, row block) a batch with too many segments falls back to. The
    packed grid's bound holds for every layout."""
    launched = _spy_use_packed(monkeypatch, ("reference.ops.bgmv_shrink", "reference.ops.sgmv_expand"), fallback)
    device, dtype = TRITON_DEVICE, torch.float32
    slots, ranks = _PACKED_LAYOUTS[layout]
    g = torch.Generator().manual_seed(len(slots) + len(ranks))
    A, B = _pool(g, ranks, 8, 32, 40, dtype, device)
    info = _static_decode_info(slots, ranks, len(slots), device)
    lengths = info.seg_indptr.diff().tolist()
    blocks = sum(-(-n // 16) for n in lengths)
    assert blocks <= _triton_util.packed_blocks(len(slots), info.num_segments, 16)
    x = torch.randn(len(slots), 32, generator=g).to(device)
    want_t = bgmv_shrink(x, A, info, torch.full((len(slots), 8), NAN, device=device), schedule="token")
    got_t = bgmv_shrink(x, A, info, torch.full((len(slots), 8), NAN, device=device), schedule="sorted",
                        block_m=16, block_n=16, block_k=32)
    for i, s in enumerate(slots):
        _close(got_t[i, :ranks[s]], want_t[i, :ranks[s]], dtype)
    t = torch.nan_to_num(want_t, nan=0.0)
    base = torch.randn(len(slots), 40, generator=g).to(device)
    want = bgmv_expand(t, B, info, base.clone(), schedule="token")
    got = bgmv_expand(t, B, info, base.clone(), schedule="sorted", block_m=16, block_n=16)
    _close(got, want, dtype)
    # every layout here but one token per slot (12 tokens: one block per segment either way) packs
    assert launched == [not fallback and layout != "every slot one token (as many segments as tokens)"] * 2


@pytest.mark.parametrize("fallback", [False, True], ids=["packed", "grid over every segment"])
def test_sgmv_shrink_takes_max_len_for_a_decode_view_whose_segments_are_slots(fallback, monkeypatch):
    """helper-34's find: a decode batch's slot-sorted view says ``max_len`` 1 (what routes the layers to
    BGMV) while slot 7's segment holds 37 tokens; a backend that runs that view through SGMV's shrink
    passes ``max_len`` = its token count (as through SGMV's expand), and every row is computed, by
    either grid. Without it the grid over every segment covered one block of 16 rows per slot."""
    launched = _spy_use_packed(monkeypatch, ("reference.ops.sgmv_shrink",), fallback)
    device, dtype = TRITON_DEVICE, torch.float32
    slots, ranks = _PACKED_LAYOUTS["many empty slots around one long segment"]
    g = torch.Generator().manual_seed(7)
    A, _ = _pool(g, ranks, 8, 32, 40, dtype, device)
    info = _static_decode_info(slots, ranks, len(slots), device)
    assert info.max_len == 1
    x = torch.randn(len(slots), 32, generator=g).to(device)
    want = bgmv_shrink(x, A, info, torch.full((len(slots), 8), NAN, device=device), schedule="token")
    got = sgmv_shrink(x, A, info, torch.full((len(slots), 8), NAN, device=device), block_m=16,
                      max_len=len(slots))
    for i, s in enumerate(slots):
        _close(got[i, :ranks[s]], want[i, :ranks[s]], dtype)
    assert launched == [not fallback]
    if fallback:  # the view's own max_len: the first block of 16 rows of slot 7's 37, the rest untouched
        short = sgmv_shrink(x, A, info, torch.full((len(slots), 8), NAN, device=device), block_m=16)
        assert int(torch.isnan(short[:37, :4]).any(1).sum()) == 37 - 16


_SPECIALIZATION_PROBE = r"""
import os, sys, json
os.environ["TRITON_INTERPRET"] = "0"  # the compiled kernels' JITFunction, whose binder decides the variant
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature
import reference.ops.sgmv_expand, reference.ops.sgmv_shrink, reference.ops.bgmv_shrink
from reference.ops._triton_util import seg_block
kernels = [sys.modules["reference.ops.sgmv_expand"]._sgmv_expand_kernel,
           sys.modules["reference.ops.sgmv_shrink"]._sgmv_shrink_kernel,
           sys.modules["reference.ops.bgmv_shrink"]._bgmv_shrink_sorted_kernel]
backend = make_backend(GPUTarget("cuda", 90, 32))
out = {}
for k in kernels:
    binder = create_function_from_signature(k.signature, k.params, backend)
    keys = set()
    for count in (1, 2, 16, 31, 32, 47, 48, 64, 65):  # a step's distinct adapters, in a pool of 65 slots
        args = []
        for p in k.params:
            if p.name == "num_segments":
                args.append(count)
            elif p.name == "SEG_BLOCK":
                args.append(seg_block(count, True, 65))
            elif p.name.endswith("_ptr"):
                args.append(torch.empty(64, dtype=torch.int32))
            elif p.is_constexpr:
                args.append(16)
            else:
                args.append(4096)
        keys.add(str(binder(*args)[1]))
    out[k.fn.__name__] = len(keys)
print(json.dumps(out))
"""


def test_a_steps_segment_count_never_selects_another_compiled_variant():
    """With rows grouped by adapter, a step's segment count is its number of distinct adapters, which
    changes from step to step: no count of them may compile a kernel variant of its own mid-serving
    (Triton specializes an integer argument of 1 or divisible by 16, and SEG_BLOCK is a constexpr).
    Checked with Triton's own argument binder for the compiled kernels, in a process without the
    interpreter (binding needs no GPU)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(reference.__file__).parents[1]),
                                                                    os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", _SPECIALIZATION_PROBE], capture_output=True, text=True, env=env,
                       timeout=300)
    if r.returncode != 0 and ("ImportError" in r.stderr or "cannot import name" in r.stderr):
        pytest.skip(f"this Triton's binder API differs: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-2000:]
    import json

    variants = json.loads(r.stdout.strip().splitlines()[-1])
    assert variants == {"_sgmv_expand_kernel": 1, "_sgmv_shrink_kernel": 1, "_bgmv_shrink_sorted_kernel": 1}, variants
    # and the rule itself: the slots bound the block; a view with more segments than slots still fits them
    assert {_triton_util.seg_block(n, True, 65) for n in range(1, 66)} == {128}
    assert _triton_util.seg_block(200, True, 65) == 256 and _triton_util.seg_block(5, False, 65) == 16
