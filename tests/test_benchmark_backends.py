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
from benchmark_decode_step import FORCED_FROM_TOKENS, _sorted_variant, backend_named, schedule_rule_for  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("name", ["triton_sorted", "triton_sorted_presum", "triton_sorted:block_n=16,block_m=32",
                                  "triton_grouped"])  # the others: token-schedule ops tested elsewhere
def test_decode_expand_variants_match_the_reference_on_a_graph_batch(name):
    """64 tokens in the CUDA-graph decode view of the variant's schedule (the runner's graph marks its
    batch so) over 4 slots (slot 0 of rank 0 holds the padding), three slices, split-K partials S = 3
    and unsplit t."""
    g = torch.Generator().manual_seed(5)
    ranks, T, K, widths = [0, 4, 8, 8], 64, 48, (24, 8, 8)
    static = StaticLoRABatch(len(ranks), 68, device=DEVICE)
    slots = [1 + (5 * i) % 3 for i in range(T)]
    static.update(slots, 68, 0, ranks, [0.0, 2.0, 0.5, 1.0], ownership_changed=True)
    info = static.batch_info(68, _sorted_variant(name)[0])
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


@pytest.mark.parametrize("schedule", ["token", "grouped"])
def test_the_grouped_variant_shrinks_by_slot_on_grouped_batches(schedule):
    """``triton_grouped``: on a batch marked "grouped" (the runner's grouped graph) the shrink runs
    grouped by slot, elsewhere per token; both sum, with the expand, to the reference. A grouped
    batch without its permutation is refused by the grouped shrink, proof that it ran."""
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
    if schedule == "grouped":
        with pytest.raises(ValueError, match="permutation"):
            backend.decode_shrink(x, A, no_view, torch.zeros(3, 68, 24, device=DEVICE), stack_num=3)
    else:
        backend.decode_shrink(x, A, no_view, torch.zeros(3, 68, 24, device=DEVICE), stack_num=3)


def test_each_variant_replays_the_graph_of_its_schedule():
    """The runner's rule per backend: "default" (and "triton") the layers' table; the forcing variants
    their schedule from FORCED_FROM_TOKENS tokens (every bucket of issue #35's grid), the token one below."""
    from reference.ops.decode_schedule import choose_decode_schedule

    assert schedule_rule_for("default") is choose_decode_schedule is schedule_rule_for("triton")
    assert backend_named("default").name == "default"
    assert backend_named("default")._replace(name="triton") == backend_named("triton")
    for name, want in (("triton_token", "token"), ("triton_nosplit", "token"), ("triton_sorted", "sorted"),
                       ("triton_sorted_presum", "sorted"), ("triton_sorted:block_n=64", "sorted"),
                       ("triton_grouped", "grouped"), ("triton_fused", "token")):
        rule = schedule_rule_for(name)
        assert rule(FORCED_FROM_TOKENS, 8, 16) == want, name
        assert rule(FORCED_FROM_TOKENS - 1, 1, 64) == "token", name
    assert FORCED_FROM_TOKENS == 16


def test_a_sorted_override_it_does_not_know_stops_the_run():
    with pytest.raises(SystemExit, match="blocks_n"):
        backend_named("triton_sorted:blocks_n=64")


def test_issue_35_targets_hold_the_default_path_to_the_best_peer_of_each_case():
    """The "default" backend's rows against the best timed peer of the same case (a peer whose check
    failed has no time and is not a bar) and against 15% (rank 16) / 25% (rank 64)."""
    from benchmark_decode_step import targets

    def row(backend, n, D, r, overhead, **kw):
        return dict(backend=backend, seqs=n, adapters=D, rank=r, graph="token", graph_speedup=None,
                    lora_overhead=overhead, **kw)
    rows = [row("default", 64, 1, 16, 0.16), row("vllm", 64, 1, 16, 0.18, peer="0.33.0"),
            row("sglang-csgmv", 64, 1, 16, None, peer="0.5.23", check={"ok": False}),
            row("default", 256, 8, 64, 0.20), row("sglang-triton", 256, 8, 64, 0.19, peer="0.5.23"),
            dict(backend="vllm", rank=64, error="RuntimeError: no")]
    got = {t["target"]: t["met"] for t in targets(rows) if t["target"].startswith("#35")}
    assert got == {
        "#35: the default path (token) at or below the best peer (vllm 18.0%) at 64 seqs / 1 adapters / rank 16": True,
        "#35: the default path (token) adds <= 15% at 64 seqs / 1 adapters / rank 16": False,
        "#35: the default path (token) at or below the best peer (sglang-triton 19.0%) at 256 seqs / 8 adapters / "
        "rank 64": False,
        "#35: the default path (token) adds <= 25% at 256 seqs / 8 adapters / rank 64": True}
