"""The decode-step benchmark's backend variants (benchmarks/benchmark_decode_step.py) compute what
the layers' default computes: a variant is timed only if it is right."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from reference.cuda_graph import StaticLoRABatch
from reference.ops import bgmv_shrink, torch_ref

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchmark_decode_step import backend_named  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["triton_sorted", "triton_sorted_presum", "triton_sorted:block_n=16,block_m=32",
                                  "triton_grouped"])  # the others: token-schedule ops tested elsewhere
def test_decode_expand_variants_match_the_reference_on_a_graph_batch(name):
    """64 tokens (the sorted variants' threshold) in a CUDA-graph decode view over 4 slots (slot 0 of
    rank 0 holds the padding), three slices, split-K partials S = 3 and unsplit t."""
    g = torch.Generator().manual_seed(5)
    ranks, T, K, widths = [0, 4, 8, 8], 64, 48, (24, 8, 8)
    static = StaticLoRABatch(len(ranks), 68, device=DEVICE)
    slots = [1 + (5 * i) % 3 for i in range(T)]
    static.update(slots, 68, 0, ranks, [0.0, 2.0, 0.5, 1.0], ownership_changed=True)
    info = static.batch_info(68)
    A = torch.randn(len(ranks), 3 * 8, K, generator=g).to(DEVICE)
    B = torch.randn(len(ranks), sum(widths), 8, generator=g).to(DEVICE)
    for s, r in enumerate(ranks):  # past each rank: never read
        A[s, 3 * r:] = float("nan")
        B[s, :, r:] = float("nan")
    x = torch.randn(68, K, generator=g).to(DEVICE)
    offsets = [0, 24, 32, 40]
    expand = backend_named(name).decode_expand
    for splits in (1, 3):
        shape = (68, 24) if splits == 1 else (splits, 68, 24)
        t = bgmv_shrink(x, A, info, torch.zeros(shape, device=DEVICE), stack_num=3, block_k=16)
        base = torch.randn(68, 40, generator=g).to(DEVICE)
        want = torch_ref.bgmv_expand(t if splits == 1 else t.sum(0), B, info, base.clone(), offsets)
        got = expand(t, B, info, base.clone(), offsets)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("schedule", ["token", "sorted"])
def test_the_grouped_variant_shrinks_by_slot_on_sorted_batches(schedule):
    """``triton_grouped``: on a batch marked "sorted" (the runner's sorted graph) the shrink runs
    grouped by slot, elsewhere per token; both sum, with the sorted expand, to the reference. A
    sorted batch without its permutation is refused by the grouped shrink, proof that it ran."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(6)
    ranks, T, K, widths = [0, 4, 8, 8], 64, 48, (24, 8, 8)
    static = StaticLoRABatch(len(ranks), 68, device=DEVICE)
    static.update([1 + (5 * i) % 3 for i in range(T)], 68, 0, ranks, [0.0, 2.0, 0.5, 1.0], ownership_changed=True)
    info = static.batch_info(68, schedule)
    A = torch.randn(len(ranks), 3 * 8, K, generator=g).to(DEVICE)
    B = torch.randn(len(ranks), sum(widths), 8, generator=g).to(DEVICE)
    x = torch.randn(68, K, generator=g).to(DEVICE)
    backend = backend_named("triton_grouped")
    t = backend.decode_shrink(x, A, info, torch.zeros(3, 68, 24, device=DEVICE), stack_num=3)
    want_t = torch_ref.bgmv_shrink(x, A, info, torch.zeros(68, 24, device=DEVICE), stack_num=3)
    width = 3 * torch.tensor(ranks, device=DEVICE)[info.token_slots.long()]
    defined = torch.arange(24, device=DEVICE)[None, :] < width[:, None]
    torch.testing.assert_close(t.sum(0)[defined], want_t[defined], rtol=1e-4, atol=1e-4)
    base = torch.randn(68, 40, generator=g).to(DEVICE)
    got = backend.decode_expand(t, B, info, base.clone(), [0, 24, 32, 40])
    want = torch_ref.bgmv_expand(want_t, B, info, base.clone(), [0, 24, 32, 40])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    no_view = replace(info, permutation=None)
    if schedule == "sorted":
        with pytest.raises(ValueError, match="permutation"):
            backend.decode_shrink(x, A, no_view, torch.zeros(3, 68, 24, device=DEVICE), stack_num=3)
    else:
        backend.decode_shrink(x, A, no_view, torch.zeros(3, 68, 24, device=DEVICE), stack_num=3)


def test_a_sorted_override_it_does_not_know_stops_the_run():
    with pytest.raises(SystemExit, match="blocks_n"):
        backend_named("triton_sorted:blocks_n=64")
