"""Tensor-parallel multi-LoRA (chapter 10): every variant at TP=2 equals the unsharded layer.

One spawned gloo run (world_size 2, CPU) does every forward and returns the rank-local outputs and
the bytes seen by the collectives (counted by wrapping ``torch.distributed.all_reduce`` /
``all_gather`` inside the children); the tests below assemble and assert on them, so process start-up
(~3 s) is paid once per module. The batch mixes three adapters of ranks 4, 8 and 16 in a pool of max
rank 16 with base tokens (a prefill batch sorted by slot through a permutation, a decode batch on the
BGMV path, and a batch of base tokens only), fp32 throughout.

Bit-exactness of base rows (tokens of the rank-0 base slot): LoRA adds exactly nothing to them, so in
every variant they equal the rank's own TP base layer output bit for bit (after the base all-reduce
for row-parallel layers: a 2-rank sum is commutative, so both ranks agree). Against the UNSHARDED
(TP=1) base output they are only close: a row-parallel all-reduce sums two partial dot products, a
different rounding than one dot product over all of ``in``; a column shard computes the same dot
products, but with a GEMM of another shape, whose blocking the library may choose differently.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from reference.batch_info import batch_info_from_requests
from reference.mem_pool import AdapterRegistry, LoRAMemoryPool, ModuleSpec
from reference.ops import torch_ref
from reference.tp.lora import (VARIANTS, CollectiveLog, TPLayout, TPModelConfig, column_part_ranges, garbled_column_rule,
                               interleave_packed, lora_comm_bytes, ring_bytes_per_rank, shard_base_weight,
                               shard_lora_weights, shard_pool_buffers, spawn_ranks, take_rows, tp_lora_linear,
                               tp_unavailable_reason)

TP, MAX_RANK, H, I = 2, 16, 16, 20
RANKS = {"a": 4, "b": 8, "c": 16}
SCALINGS = {"a": 0.5, "b": 2.0, "c": 1.25}
# name -> (spec, parallel, heads per part). qkv: 4 q heads and 2 kv heads of width 4 (split over tp 2);
# qkv_mqa: 1 kv head, replicated on both ranks.
MODULES = {
    "q_proj": (ModuleSpec("q_proj", H, (H,)), "column", (4,)),
    "qkv_proj": (ModuleSpec("qkv_proj", H, (16, 8, 8)), "column", (4, 2, 2)),
    "qkv_mqa_proj": (ModuleSpec("qkv_mqa_proj", H, (16, 4, 4)), "column", (4, 1, 1)),
    "gate_up_proj": (ModuleSpec("gate_up_proj", H, (I, I)), "column", None),
    "o_proj": (ModuleSpec("o_proj", H, (H,)), "row", None),
    "down_proj": (ModuleSpec("down_proj", I, (H,)), "row", None),
}
BATCHES = {  # name -> (req_uids, req_lens, sort_by_slot)
    "prefill": (["b", None, "a", "c", None, "a"], [3, 2, 4, 1, 2, 3], True),
    "decode": (["c", None, "a", "b", None], [1, 1, 1, 1, 1], False),
    "base_only": ([None, None], [2, 3], False),
}
TOL = dict(rtol=1e-5, atol=1e-5)  # fp32, sums of <= 20 products in another order: errors ~1e-6


def _layout(name: str) -> TPLayout:
    spec, parallel, units = MODULES[name]
    return TPLayout(spec, parallel, TP, units)


def _setup() -> dict:
    """Everything both ranks and the parent need, from fixed seeds (identical in every process)."""
    g = torch.Generator().manual_seed(10)
    specs = [spec for spec, _, _ in MODULES.values()]
    registry = AdapterRegistry()
    for uid, r in RANKS.items():
        weights = {(0, s.name): (torch.randn(s.stack_num * r, s.in_features, generator=g) / 4,
                                 torch.randn(s.out_total, r, generator=g) / 4) for s in specs}
        registry.register(uid, r, SCALINGS[uid], weights)
    pool = LoRAMemoryPool(specs, 1, 5, MAX_RANK, adapter_source=registry.load)
    uid_to_slot = pool.prepare_lora_batch([None, *(registry.uid_of(u) for u in RANKS)])
    uid_to_slot.update({u: uid_to_slot[registry.uid_of(u)] for u in RANKS})
    base_W = {name: torch.randn(s.out_total, s.in_features, generator=g) / 4 for name, (s, _, _) in MODULES.items()}
    batches = {}
    for bname, (uids, lens, sort) in BATCHES.items():
        info = batch_info_from_requests(uids, lens, uid_to_slot, pool.lora_ranks_host, pool.scalings_host, "cpu",
                                        sort_by_slot=sort)
        xs = {name: torch.randn(sum(lens), s.in_features, generator=g) for name, (s, _, _) in MODULES.items()}
        batches[bname] = (info, xs)
    return dict(pool=pool, registry=registry, base_W=base_W, batches=batches)


def _worker(rank: int, world_size: int) -> dict:
    """Every (module, variant, batch) forward on this rank: local output, TP base output, collectives."""
    setup = _setup()
    pool, results = setup["pool"], {}
    for name in MODULES:
        layout = _layout(name)
        W_local = shard_base_weight(setup["base_W"][name], layout, rank)
        lo, hi = layout.in_range(rank)
        for variant in VARIANTS[layout.parallel]:
            shard = shard_pool_buffers(pool.A_buffer[name][0], pool.B_buffer[name][0], pool.lora_ranks_host,
                                       layout, variant, rank)
            for bname, (info, xs) in setup["batches"].items():
                x = xs[name][:, lo:hi]
                base_out = x @ W_local.T
                if layout.parallel == "row":
                    dist.all_reduce(base_out)  # the TP base layer alone (outside the counted block)
                with CollectiveLog() as log:
                    out = tp_lora_linear(x, lambda v: v @ W_local.T, shard, info)
                results[f"{name}/{variant}/{bname}"] = {"out": out, "base": base_out, "collectives": log.log}
    return results


@pytest.fixture(scope="module")
def tp_results() -> list:
    reason = tp_unavailable_reason("gloo", TP)
    if reason is not None:
        pytest.skip(f"two-process TP tests need gloo: {reason}")
    return spawn_ranks(_worker, world_size=TP, backend="gloo")


@pytest.fixture(scope="module")
def setup() -> dict:
    return _setup()


def _unsharded(setup: dict, name: str, bname: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TP=1: (base, base + LoRA) through the book's torch ops on the whole pool buffers."""
    spec = MODULES[name][0]
    info, xs = setup["batches"][bname]
    x, pool = xs[name], setup["pool"]
    base = x @ setup["base_W"][name].T
    A, B = pool.A_buffer[name][0], pool.B_buffer[name][0]
    t = torch_ref.sgmv_shrink(x, A, info, torch.zeros(x.shape[0], A.shape[1]), stack_num=spec.stack_num)
    return base, torch_ref.sgmv_expand(t, B, info, base.clone(), spec.slice_offsets)


def _assemble(results: list, key: str, name: str) -> torch.Tensor:
    """The full output from the ranks: row layers are already full; column layers by their part rows."""
    layout = _layout(name)
    if layout.parallel == "row":
        torch.testing.assert_close(results[0][key]["out"], results[1][key]["out"], rtol=0, atol=0)
        return results[0][key]["out"]
    full = torch.full((results[0][key]["out"].shape[0], layout.spec.out_total), float("nan"))
    for j, res in enumerate(results):
        local = res[key]["out"]
        offs = [0]
        for lo, hi in layout.part_ranges(j):
            piece = local[:, offs[-1]:offs[-1] + hi - lo]
            if not torch.isnan(full[:, lo:hi]).all():  # a replicated kv head: both ranks must agree
                assert torch.equal(full[:, lo:hi], piece), f"{key}: replicas of rows {lo}:{hi} differ"
            full[:, lo:hi] = piece
            offs.append(offs[-1] + hi - lo)
    assert not torch.isnan(full).any(), f"{key}: some output columns are owned by no rank"
    return full


def _base_rows(setup: dict, bname: str) -> torch.Tensor:
    uids, lens, _ = BATCHES[bname]
    return torch.tensor([u is None for u, n in zip(uids, lens) for _ in range(n)])


CASES = [(name, variant, bname) for name in MODULES for variant in VARIANTS[MODULES[name][1]] for bname in BATCHES]


# ---- the two-process checks ---------------------------------------------------------------------
def test_unsharded_reference_matches_each_adapters_own_formula(setup):
    """Guard for the TP=1 reference: per token, base + s (x A_i^T) B_i^T per part with the adapter's weights."""
    uids, lens, _ = BATCHES["prefill"]
    for name, (spec, _, _) in MODULES.items():
        _, got = _unsharded(setup, name, "prefill")
        x, W = setup["batches"]["prefill"][1][name], setup["base_W"][name]
        want, row = x @ W.T, 0
        for uid, n in zip(uids, lens):
            if uid is not None:
                adapter, r = setup["registry"].load(setup["registry"].uid_of(uid)), RANKS[uid]
                A, B = adapter.weights[(0, name)]
                for i, (lo, hi) in enumerate(zip(spec.slice_offsets[:-1], spec.slice_offsets[1:])):
                    want[row:row + n, lo:hi] += SCALINGS[uid] * (x[row:row + n] @ A[i * r:(i + 1) * r].T) @ B[lo:hi].T
            row += n
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name, variant, bname", CASES, ids=["/".join(c) for c in CASES])
def test_tp2_equals_unsharded(tp_results, setup, name, variant, bname):
    """Each variant at TP=2 (gathered over ranks) equals the TP=1 LoRA layer output."""
    key = f"{name}/{variant}/{bname}"
    _, want = _unsharded(setup, name, bname)
    torch.testing.assert_close(_assemble(tp_results, key, name), want, **TOL)


@pytest.mark.parametrize("name, variant, bname", CASES, ids=["/".join(c) for c in CASES])
def test_base_rows_bit_exact_with_the_tp_base_layer(tp_results, setup, name, variant, bname):
    """Rank-0 (base) rows: bit-exact with the rank's own TP base output; only close to TP=1 (module doc)."""
    key, base_rows = f"{name}/{variant}/{bname}", _base_rows(setup, bname)
    for res in tp_results:
        assert torch.equal(res[key]["out"][base_rows], res[key]["base"][base_rows]), key
    base, _ = _unsharded(setup, name, bname)
    torch.testing.assert_close(_assemble(tp_results, key, name)[base_rows], base[base_rows], **TOL)


def test_gqa_replicated_kv_head_is_held_by_both_ranks():
    layout = _layout("qkv_mqa_proj")
    assert layout.part_ranges(0) == ((0, 8), (16, 20), (20, 24))
    assert layout.part_ranges(1) == ((8, 16), (16, 20), (20, 24))
    assert _layout("qkv_proj").part_ranges(1) == ((8, 16), (20, 24), (28, 32))


def test_gqa_kv_heads_replicated_over_groups_of_ranks():
    """tp 4, 2 kv heads: ranks 0-1 share kv head 0, ranks 2-3 kv head 1 (vLLM's num_kv_head_replicas)."""
    ranges = [column_part_ranges((16, 8, 8), (4, 2, 2), j, 4) for j in range(4)]
    assert [r[1] for r in ranges] == [(16, 20), (16, 20), (20, 24), (20, 24)]
    assert [r[0] for r in ranges] == [(0, 4), (4, 8), (8, 12), (12, 16)]


def test_fully_sharded_never_moves_padding_junk():
    """Junk past a slot's rank (a pool that broke its zero-fill invariant) never reaches a shard:
    A copies only rows below r, B's columns [r, R) are zeroed (the fully sharded expand reads all R)."""
    layout = _layout("q_proj")
    A, B = torch.full((2, MAX_RANK, H), float("nan")), torch.full((2, H, MAX_RANK), float("nan"))
    A[1, :4], B[1, :, :4] = 1.0, 1.0
    for j in range(TP):
        shard = shard_pool_buffers(A, B, [0, 4], layout, "fully_sharded", j)
        assert not torch.isnan(shard.A).any() and not torch.isnan(shard.B).any()
        assert shard.A[1].sum() == (4 * H if j == 0 else 0) and shard.B[1].sum() == 4 * 8


def _lora_bytes(collectives: list, base_bytes: int, row: bool) -> tuple[int, int]:
    """(LoRA's bytes, the base all-reduce's bytes) of one forward's logged collectives."""
    total = sum(n for _, n in collectives)
    base = base_bytes if row else 0
    assert not row or ("all_reduce", base_bytes) in collectives, "a row-parallel layer must all-reduce its output"
    return total - base, base


def test_comm_bytes_match_the_collectives_of_a_run(tp_results):
    """lora_comm_bytes' prediction == the bytes the wrapped collectives saw, per module and variant."""
    T = sum(BATCHES["prefill"][1])
    predicted = lora_comm_bytes(TPModelConfig(H, I, 4, 2), MAX_RANK, T, 4, TP)
    for name, module in [("qkv_proj", "qkv_proj"), ("qkv_mqa_proj", "qkv_proj"), ("gate_up_proj", "gate_up_proj"),
                         ("o_proj", "o_proj"), ("down_proj", "down_proj")]:
        row = MODULES[name][1] == "row"
        for variant in VARIANTS[MODULES[name][1]]:
            for res in tp_results:
                log = res[f"{name}/{variant}/prefill"]["collectives"]
                lora, base = _lora_bytes(log, T * H * 4, row)
                assert lora == predicted[module][variant], (name, variant, log)
                assert base == (predicted["base"][module] if row else 0)


def test_a_batch_without_adapters_runs_no_lora_collective(tp_results):
    for name in MODULES:
        for variant in VARIANTS[MODULES[name][1]]:
            log = tp_results[0][f"{name}/{variant}/base_only"]["collectives"]
            assert log == ([("all_reduce", 5 * H * 4)] if MODULES[name][1] == "row" else []), (name, variant)


# ---- single-process checks ------------------------------------------------------------------------
def test_comm_bytes_by_hand_llama3_8b():
    """Llama-3-8B sizes, rank 16, 512 tokens, bf16, tp 2."""
    got = lora_comm_bytes(TPModelConfig(4096, 14336, 32, 8), 16, 512, 2, 2)
    assert got["qkv_proj"] == {"replicated_A": 0, "fully_sharded": 512 * 48 * 2}  # 49152
    assert got["gate_up_proj"] == {"replicated_A": 0, "fully_sharded": 512 * 32 * 2}
    assert got["o_proj"] == got["down_proj"] == {"reduce_shrink": 512 * 16 * 2, "reduce_with_base": 0}
    assert got["base"] == {"o_proj": 512 * 4096 * 2, "down_proj": 512 * 4096 * 2}  # 4 MiB each: 256x LoRA's
    assert all(v == 0 for m in lora_comm_bytes(TPModelConfig(4096, 14336, 32, 8), 16, 512, 2, 1).values()
               for v in m.values())
    assert ring_bytes_per_rank("all_reduce", 1000, 2) == 1000 and ring_bytes_per_rank("all_gather", 1000, 4) == 750
    with pytest.raises(ValueError, match="split"):
        lora_comm_bytes(TPModelConfig(4096, 14336, 32, 3), 16, 512, 2, 2)


def test_garbled_column_rule_fails():
    """ "A split on its output dimension, B kept whole": shapes do not compose; the repair is wrong."""
    g = torch.Generator().manual_seed(3)
    x, A, B = torch.randn(5, 12, generator=g), torch.randn(8, 12, generator=g), torch.randn(10, 8, generator=g)
    res = garbled_column_rule(x, A, B, 2)
    assert "cannot be multiplied" in res["shape_error"] or "size" in res["shape_error"]
    assert res["repaired_max_error"] > 1.0  # every rank holds a partial sum, not its own columns
    assert res["sum_of_partials_max_error"] < 1e-4 and res["correct_rule_max_error"] < 1e-4


def test_interleave_packed_is_trtllm_rank_major_order():
    """[q_r0, k_r0, v_r0, q_r1, k_r1, v_r1]: block j of the interleaved weight is rank j's shard."""
    layout = _layout("qkv_proj")
    W = torch.arange(32.0)[:, None]
    inter = interleave_packed(W, layout)
    assert inter[:, 0].tolist() == [*range(0, 8), *range(16, 20), *range(24, 28),
                                    *range(8, 16), *range(20, 24), *range(28, 32)]
    for j in range(TP):
        assert torch.equal(inter[j * 16:(j + 1) * 16], shard_base_weight(W, layout, j))
    assert interleave_packed(torch.arange(24.0)[:, None], _layout("qkv_mqa_proj")).shape[0] == 32  # kv twice


def test_fully_sharded_rank_padding_layout_and_exactness():
    """An adapter of rank 4 in a pool of max rank 16, tp 2: rank 0 holds its 4 rows of each part at
    local stride 8, rank 1 holds zeros; gathered part-major, the shrink equals the unsharded one padded."""
    g = torch.Generator().manual_seed(4)
    layout, r = _layout("qkv_proj"), 4
    A, B = torch.randn(3 * r, H, generator=g), torch.randn(32, r, generator=g)
    (A0, B0), (A1, B1) = (shard_lora_weights(A, B, layout, "fully_sharded", j, max_rank=MAX_RANK) for j in range(TP))
    assert A0.shape == A1.shape == (3 * 8, H) and B0.shape == (16, MAX_RANK)
    for i in range(3):
        assert torch.equal(A0[i * 8:i * 8 + r], A[i * r:(i + 1) * r]) and not A0[i * 8 + r:(i + 1) * 8].any()
    assert not A1.any() and not B0[:, r:].any()
    x = torch.randn(3, H, generator=g)
    t = torch.stack([x @ A0.T, x @ A1.T]).view(TP, 3, 3, 8).permute(1, 2, 0, 3).reshape(3, 48)
    padded = torch.zeros(3, 3, MAX_RANK)
    padded[:, :, :r] = (x @ A.T).view(3, 3, r)
    torch.testing.assert_close(t, padded.reshape(3, 48), rtol=0, atol=1e-6)
    # an odd rank spreads over both ranks: r 11 -> 8 rows on rank 0, 3 on rank 1
    A11 = torch.randn(3 * 11, H, generator=g)
    A11_1, _ = shard_lora_weights(A11, torch.randn(32, 11, generator=g), layout, "fully_sharded", 1, max_rank=16)
    assert torch.equal(A11_1[8:11], A11[11 + 8:11 + 11]) and not A11_1[11:16].any()


def test_column_and_row_shards_of_one_adapter():
    g = torch.Generator().manual_seed(5)
    A, B = torch.randn(2 * 4, H, generator=g), torch.randn(2 * I, 4, generator=g)
    A1, B1 = shard_lora_weights(A, B, _layout("gate_up_proj"), "replicated_A", 1)
    assert torch.equal(A1, A) and torch.equal(B1, torch.cat([B[10:20], B[30:40]]))
    A, B = torch.randn(4, I, generator=g), torch.randn(H, 4, generator=g)
    A1, B1 = shard_lora_weights(A, B, _layout("down_proj"), "reduce_shrink", 1)
    assert torch.equal(A1, A[:, 10:20]) and torch.equal(B1, B)
    assert take_rows(torch.arange(6), [(4, 6), (0, 1)]).tolist() == [4, 5, 0]


@pytest.mark.parametrize("make, match", [
    (lambda: column_part_ranges((12,), (3,), 0, 2), "cannot be split"),
    (lambda: column_part_ranges((10,), (4,), 0, 2), "multiple"),
    (lambda: TPLayout(MODULES["o_proj"][0], "diagonal", 2), "column"),
    (lambda: TPLayout(ModuleSpec("o_proj", 15, (16,)), "row", 2), "divisible"),
    (lambda: shard_pool_buffers(torch.zeros(1, 15, H), torch.zeros(1, H, 15), [0], _layout("q_proj"),
                                "fully_sharded", 0), "divisible"),
    (lambda: shard_pool_buffers(torch.zeros(1, 16, H), torch.zeros(1, H, 16), [0], _layout("q_proj"),
                                "reduce_shrink", 0), "not one of"),
    (lambda: shard_pool_buffers(torch.zeros(1, 16, 8), torch.zeros(1, H, 16), [0], _layout("q_proj"),
                                "replicated_A", 0), "do not match"),
])
def test_bad_layouts_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---- backends and machines --------------------------------------------------------------------------
def test_nccl_on_one_gpu_gives_a_skip_reason(monkeypatch):
    """The GPU suite runs on one H200: NCCL with 2 ranks must be refused with a reason, not hang."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    reason = tp_unavailable_reason("nccl", 2)
    assert reason is not None and "2 GPUs" in reason and "has 1" in reason
    with pytest.raises(RuntimeError, match="2 GPUs"):
        spawn_ranks(_worker, world_size=2, backend="nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "CUDA" in tp_unavailable_reason("nccl", 2)


def _nccl_worker(rank: int, world_size: int) -> dict:
    layout = _layout("o_proj")
    device = torch.device("cuda", rank)
    A, B = torch.zeros(2, MAX_RANK, H), torch.zeros(2, H, MAX_RANK)
    A[1, :4], B[1, :, :4] = torch.ones(4, H), torch.ones(H, 4)
    shard = shard_pool_buffers(A.to(device), B.to(device), [0, 4], layout, "reduce_shrink", rank)
    info = batch_info_from_requests(["a", None], [2, 1], {"a": 1, None: 0}, [0, 4], [0.0, 1.0], device)
    x = torch.ones(3, H // world_size, device=device)
    return {"out": tp_lora_linear(x, lambda v: v.new_zeros(3, H), shard, info)}


def test_two_process_nccl_when_two_gpus():
    """Skips (with the reason) unless there are 2 GPUs; then the same code path runs on NCCL."""
    reason = tp_unavailable_reason("nccl", 2)
    if reason is not None:
        pytest.skip(reason)
    out = spawn_ranks(_nccl_worker, world_size=2, backend="nccl")[0]["out"]
    assert torch.equal(out[:2], torch.full((2, H), 4.0 * H)) and not out[2].any()
