"""Chapter 10's judge: a tiny Llama at TP=2 (two gloo processes) with multi-LoRA, against TP=1 and PEFT.

A seeded tiny GQA Llama (4 q heads, 2 kv heads: one kv head per rank) and three PEFT adapters of
ranks 4, 8 (rsLoRA) and 16 in a pool of max rank 16 with different target sets, plus base requests,
in ONE mixed batch: prefill, then greedy decode over the static per-row cache. Every (column,
row) variant pair runs. References: TP=1 (the unsharded ``LoRAMemoryPool`` + ``wrap_llama`` +
``StaticKVLlama``, same batches, real decode) and PEFT (one teacher-forced forward over prompt +
generated tokens with ``adapter_names``), both within the tolerance table's fp32 CPU matmul row.

ONE ``spawn_ranks`` call runs every scenario (process start-up costs seconds on 2 cores) and
returns tensors and strings; the tests assert on them. The children import this module to find
``_worker``, so transformers and peft (~10 s to import) are imported only in fixtures: the children
get the base weights as a :class:`~reference.tp.model.LlamaCheckpoint` and read the PEFT
directories themselves, each its own view, as ranks on separate machines would.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from graders.machine.tolerances import tolerance
from reference.adapters import load_peft_adapter
from reference.layers import LoRAContext, wrap_llama
from reference.mem_pool import LoRAMemoryPool, events_to_json, snapshot_diff
from reference.tp.lora import VARIANTS, shard_pool_buffers, spawn_ranks, tp_device, tp_unavailable_reason
from reference.tp.model import (TPLlama, greedy_generate, llama_checkpoint, llama_pool_modules, llama_tp_layouts,
                                prepare_batch)
from reference.tp.pool import TPLoRAMemoryPool, demonstrate_disagreement

TP = 2  # the failure scenarios run here
# TP=4 (one q head per rank, each kv head replicated on two ranks, fully sharded A at R/4 = 4 rows)
# passes too, but 4 processes on 2 cores cost ~15 s of start-up alone (measured on the 2-core box:
# the file's pytest time went from 18-26 s to 34-41 s), too much for the CI budget: opt in with
# TP_MODEL_TP4=1.
TP_SIZES = (2, 4) if os.environ.get("TP_MODEL_TP4") == "1" else (2,)
# (tp, process-group backend): gloo on the CPU; NCCL at TP=2 with a GPU per rank, the same runs on
# cuda:rank (skipped, with the reason, on a machine without two GPUs: issue #14)
TP_RUNS = [(tp, "gloo") for tp in TP_SIZES] + [(2, "nccl")]
TP_IDS = [f"tp{tp}-{backend}" for tp, backend in TP_RUNS]
RTOL, ATOL, _ = tolerance("cpu", torch.float32, "matmul")
CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
LAYERS, MAX_RANK, MAX_LEN = CFG["num_hidden_layers"], 16, 16
ADAPTERS = {
    "r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "r8": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "r16": dict(r=16, lora_alpha=24, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
BATCH = (["r8", None, "r4", "r16"], [5, 7, 3, 6])  # one request per row, right-padded to 7
STEPS = 3
# 3 slots for 3 adapters + the base: batch 3 loads the base into the free slot and evicts r4 (LRU:
# batch 2 used r8 last); batch 4 evicts r8 (the base only as a last resort) and reloads r4 from the
# CPU cache
EVICTION = [(["r4", "r8"], [4, 6]), (["r8"], [5]), (["r16", None], [6, 3]), (["r4", "r16"], [5, 4])]
COMBOS = [f"{c}+{r}" for c, r in itertools.product(VARIANTS["column"], VARIANTS["row"])]


# ---- shared by the ranks and the TP=1 reference -----------------------------------------------
def _prompts(lens: list[int], seed: int) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (len(lens), max(lens)), generator=torch.Generator().manual_seed(seed))


def _generate(run, pool, uids, lens, seed, steps=STEPS) -> dict:
    return greedy_generate(run, pool, uids, lens, _prompts(lens, seed), steps)


def _source(dirs: dict, modules):
    def load(uid):
        return load_peft_adapter(dirs[uid], modules, LAYERS, MAX_RANK, uid=uid)  # KeyError: unknown uid
    return load


def _variants(combo: str) -> dict:
    column, row = combo.split("+")
    return {"qkv_proj": column, "gate_up_proj": column, "o_proj": row, "down_proj": row}


# ---- one rank -------------------------------------------------------------------------------------
def _runs(rank: int, world_size: int, ckpt, dirs: dict) -> dict:
    """Every variant pair: the mixed batch's prefill and decode, the TP base forward, the shards, and
    the eviction sequence."""
    modules, layouts = llama_pool_modules(ckpt), llama_tp_layouts(ckpt, world_size)
    source = _source(dirs, modules)
    device = tp_device(dist.get_backend(), rank)  # cuda:rank under NCCL: pools, model and batches there
    out = {"runs": {}, "evict": {}}
    for combo in COMBOS:
        pool = TPLoRAMemoryPool(layouts, _variants(combo), LAYERS, 4, MAX_RANK, adapter_source=source, device=device)
        model = TPLlama(ckpt, pool, max_rows=4, max_len=MAX_LEN)
        run = _generate(model, pool, *BATCH, seed=1)
        ids = _prompts(BATCH[1], 1)
        base_info = prepare_batch(pool, [None] * 4, [ids.shape[1]] * 4)  # the TP base forward: no adapter active
        run["base_prefill"] = model(ids, torch.arange(ids.shape[1]).expand_as(ids), torch.arange(4), base_info)
        run["shard_mismatches"] = _shard_mismatches(pool, layouts, _variants(combo), modules, source, rank)
        out["runs"][combo] = run
        pool = TPLoRAMemoryPool(layouts, _variants(combo), LAYERS, 3, MAX_RANK, adapter_source=source,
                                max_loaded_loras=3, device=device)
        model = TPLlama(ckpt, pool, max_rows=2, max_len=MAX_LEN)
        logits = [_generate(model, pool, uids, lens, seed=10 + i, steps=0)["prefill"]
                  for i, (uids, lens) in enumerate(EVICTION)]
        pool.check_agreement()  # raises on every rank if the victims differed
        out["evict"][combo] = {"logits": logits, "events": json.dumps(events_to_json(pool.events))}
    return out


def _worker(rank: int, world_size: int, ckpt, dirs: dict) -> dict:
    """Everything at TP=2: the runs, then the failures (every rank must take part in each)."""
    out = _runs(rank, world_size, ckpt, dirs)
    layouts = llama_tp_layouts(ckpt, world_size)
    out["rejections"] = _rejections(rank, ckpt, dirs, layouts, llama_pool_modules(ckpt))
    out["construction"] = _construction_errors(rank, layouts)
    out["demo"] = demonstrate_disagreement(rank, world_size)
    return out


def _shard_mismatches(pool, layouts, variants, modules, source, rank) -> list[str]:
    """(module, layer) where the rank's buffers differ from shard_pool_buffers of the unsharded pool."""
    full = LoRAMemoryPool(modules, LAYERS, 4, MAX_RANK, adapter_source=source)
    full.prepare_lora_batch(BATCH[0])
    bad = [] if full.buffer_id_to_uid == pool.buffer_id_to_uid else ["slot map"]
    for layout, layer in itertools.product(layouts, range(LAYERS)):
        name = layout.spec.name
        want = shard_pool_buffers(full.A_buffer[name][layer], full.B_buffer[name][layer], full.lora_ranks_host,
                                  layout, variants[name], rank)
        got = pool.shard(name, layer)
        A, B = got.A.cpu(), got.B.cpu()
        if not (torch.equal(A, want.A) and torch.equal(B, want.B) and got.slice_offsets == want.slice_offsets):
            bad.append(f"{name}/{layer}")
    return bad


def _count_all_reduces(fn) -> int:
    calls, saved = [], dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return saved(*args, **kwargs)
    dist.all_reduce = counting
    try:
        fn()
    finally:
        dist.all_reduce = saved
    return len(calls)


def _rejections(rank, ckpt, dirs, layouts, modules) -> dict:
    """A malformed or missing adapter on rank 1 only, and an unknown uid everywhere: every rank must
    raise and no rank may change. Then the pool still serves (no collective was left unpaired)."""
    good = _source(dirs, modules)

    def source(uid):
        if uid == "bad_shape":  # rank 1's copy of r8 lost a row of layer 1's qkv A
            adapter = copy.copy(good("r8"))
            adapter.uid, adapter.weights = uid, dict(adapter.weights)
            if rank == 1:
                A, B = adapter.weights[(1, "qkv_proj")]
                adapter.weights[(1, "qkv_proj")] = (A[:-1], B)
            return adapter
        if uid == "missing":  # only rank 0 has the directory
            return load_peft_adapter(dirs["r16"] if rank == 0 else dirs["r16"] + "-absent", modules, LAYERS,
                                     MAX_RANK, uid=uid)
        return good(uid)

    pool = TPLoRAMemoryPool(layouts, _variants(COMBOS[0]), LAYERS, 4, MAX_RANK, adapter_source=source)
    counts = {"first_load": _count_all_reduces(lambda: pool.prepare_lora_batch(["r4", None]))}
    counts["resident"] = _count_all_reduces(lambda: pool.prepare_lora_batch(["r4", None]))
    before, results = pool.snapshot(), {}
    bad_adapter = source("bad_shape")
    attempts = {"bad_shape": lambda: pool.prepare_lora_batch(["r4", "bad_shape"]),
                "missing": lambda: pool.prepare_lora_batch(["missing", None]),
                "load_to_slot": lambda: pool.load_to_slot(bad_adapter, 2),
                "unknown": lambda: pool.prepare_lora_batch(["nobody"])}
    for name, attempt in attempts.items():
        try:
            attempt()
            error = ""
        except ValueError as err:
            error = str(err)
        results[name] = {"error": error, "diff": snapshot_diff(before, pool.snapshot())}
    model = TPLlama(ckpt, pool, max_rows=4, max_len=MAX_LEN)
    results["after"] = _generate(model, pool, *BATCH, seed=1, steps=0)["prefill"]
    pool.check_agreement()
    return {**results, "counts": counts}


def _construction_errors(rank, layouts) -> dict:
    """Configurations that differ between ranks: caught at construction, on every rank."""
    variants, errors = _variants(COMBOS[0]), {}
    cases = {"policy": dict(eviction_policy="fifo" if rank == 1 else "lru"),
             "cpu_cache": dict(max_loaded_loras=2 if rank == 1 else None)}  # rank 1: below the 4 slots
    for name, kw in cases.items():
        try:
            TPLoRAMemoryPool(layouts, variants, LAYERS, 4, MAX_RANK, **kw)
            errors[name] = ""
        except ValueError as err:
            errors[name] = str(err)
    return errors


# ---- fixtures (the parent) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """The base model, its checkpoint, the PEFT adapter directories and PEFT's model of all three."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
    root, dirs = tmp_path_factory.mktemp("tp_adapters"), {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed, (name, kw) in enumerate(ADAPTERS.items()):
            torch.manual_seed(200 + seed)
            peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(
                root / name)
            dirs[name] = str(root / name)
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs["r4"], adapter_name="r4")
        for name in ("r8", "r16"):
            pm.load_adapter(dirs[name], adapter_name=name)
    return dict(base=base, ckpt=llama_checkpoint(base), dirs=dirs, peft=pm.eval())


@pytest.fixture(scope="module")
def spawned(hf):
    """tp -> every rank's results: everything at TP=2, the runs only at TP=4 (one spawn each)."""
    cache = {}

    def get(tp: int, backend: str = "gloo") -> list:
        reason = tp_unavailable_reason(backend, tp)
        if reason is not None:
            pytest.skip(f"{tp}-process TP tests need {backend}: {reason}")
        if (tp, backend) not in cache:  # the failure scenarios run at (TP, gloo) only
            cache[(tp, backend)] = spawn_ranks(_worker if (tp, backend) == (TP, "gloo") else _runs, world_size=tp,
                                               backend=backend, args=(hf["ckpt"], hf["dirs"]))
        return cache[(tp, backend)]
    return get


@pytest.fixture(scope="module")
def ranks(spawned) -> list:
    return spawned(TP)


@pytest.fixture(scope="module")
def tp1(hf) -> dict:
    """TP=1: the unsharded pool, wrap_llama and StaticKVLlama on the same batches (real decode)."""
    from reference.static_llama import StaticKVLlama
    source = _source(hf["dirs"], llama_pool_modules(hf["ckpt"]))

    def runner(slots, max_loaded_loras=None):
        pool = LoRAMemoryPool(llama_pool_modules(hf["ckpt"]), LAYERS, slots, MAX_RANK, adapter_source=source,
                              max_loaded_loras=max_loaded_loras)
        context = LoRAContext()
        llm = StaticKVLlama(wrap_llama(copy.deepcopy(hf["base"]), pool, context), max_rows=4, max_len=MAX_LEN)

        def run(ids, positions, rows, info):
            context.set_batch(info)
            with torch.no_grad():
                return llm(ids, positions, rows)
        return pool, run

    pool, run = runner(4)
    main = _generate(run, pool, *BATCH, seed=1)
    pool, run = runner(3, 3)
    evict = [_generate(run, pool, uids, lens, seed=10 + i, steps=0)["prefill"]
             for i, (uids, lens) in enumerate(EVICTION)]
    return {"main": main, "evict": evict, "evict_events": json.dumps(events_to_json(pool.events))}


def _peft_logits(hf, uids, lens, tokens: torch.Tensor, seed: int) -> torch.Tensor:
    """PEFT's logits over prompt + generated tokens (teacher forcing), right-padded: [B, max_len, V]."""
    prompts, steps = _prompts(lens, seed), tokens.shape[0] - 1
    ids = torch.zeros(len(lens), max(lens) + steps, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lens):
        ids[b, :n + steps] = torch.cat([prompts[b, :n], tokens[:steps, b]])
        mask[b, :n + steps] = 1
    names = ["__base__" if u is None else u for u in uids]
    with torch.no_grad():
        return hf["peft"](input_ids=ids, attention_mask=mask, adapter_names=names).logits


def _close(got, want, what, backend="gloo"):
    """The tolerance table's fp32 matmul row: the CPU's, or the GPU's for ranks that ran on NCCL."""
    rtol, atol, _ = tolerance("cuda", torch.float32, "matmul") if backend == "nccl" else (RTOL, ATOL, "")
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def _real(lens) -> torch.Tensor:
    """[B, max(lens)] mask of the prompts' real tokens."""
    return torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]


# ---- the judge ----------------------------------------------------------------------------------
@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("tp, backend", TP_RUNS, ids=TP_IDS)
def test_tp_prefill_and_decode_equal_tp1(spawned, tp1, tp, backend, combo):
    """Full logits on every rank, bit-identical between them, close to TP=1; the same greedy tokens."""
    runs = [r["runs"][combo] for r in spawned(tp, backend)]
    for key, j in itertools.product(("prefill", "decode", "tokens", "base_prefill"), range(1, tp)):
        assert torch.equal(runs[0][key], runs[j][key]), f"{combo}: rank {j} disagrees with rank 0 on {key}"
    assert torch.equal(runs[0]["tokens"], tp1["main"]["tokens"]), f"{combo}: greedy tokens differ from TP=1"
    real = _real(BATCH[1])
    _close(runs[0]["prefill"][real], tp1["main"]["prefill"][real], f"tp {tp} {combo} prefill vs TP=1", backend)
    _close(runs[0]["decode"], tp1["main"]["decode"], f"tp {tp} {combo} decode vs TP=1", backend)


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("tp, backend", TP_RUNS, ids=TP_IDS)
def test_tp_matches_peft(hf, spawned, tp, backend, combo):
    uids, lens = BATCH
    run = spawned(tp, backend)[0]["runs"][combo]
    want = _peft_logits(hf, uids, lens, run["tokens"], seed=1)
    rows = torch.arange(len(lens))
    real = _real(lens)
    _close(run["prefill"][real], want[:, :max(lens)][real], f"tp {tp} {combo} prefill vs PEFT", backend)
    for s in range(STEPS):
        _close(run["decode"][s], want[rows, torch.tensor(lens) + s], f"tp {tp} {combo} decode step {s} vs PEFT",
               backend)
    predicted = torch.stack([want[rows, torch.tensor(lens) - 1 + s].argmax(-1) for s in range(STEPS + 1)])
    assert torch.equal(run["tokens"], predicted), f"tp {tp} {combo}: greedy tokens differ from PEFT's"
    for b, uid in enumerate(uids):  # not vacuous: every adapter changes its row
        if uid is not None:
            assert (run["prefill"][b, :lens[b]] - run["base_prefill"][b, :lens[b]]).abs().max() > 1e-3, uid


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("tp, backend", TP_RUNS, ids=TP_IDS)
def test_base_rows_bit_exact_with_the_tp_base_forward(spawned, tp1, tp, backend, combo):
    """The base request's logits equal the TP forward with no adapter active, bit for bit (same shapes,
    LoRA adds exactly nothing to rank-0 slots); against TP=1 they are only close (other GEMM shapes)."""
    run = spawned(tp, backend)[0]["runs"][combo]
    assert torch.equal(run["prefill"][1], run["base_prefill"][1])
    _close(run["base_prefill"][1], tp1["main"]["prefill"][1], f"tp {tp} {combo} base row vs TP=1", backend)


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("tp, backend", TP_RUNS, ids=TP_IDS)
def test_each_rank_holds_exactly_its_shard(spawned, tp, backend, combo):
    """The rank's buffers == shard_pool_buffers of the unsharded pool after the same decisions."""
    for j, r in enumerate(spawned(tp, backend)):
        assert r["runs"][combo]["shard_mismatches"] == [], f"rank {j}"


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("tp, backend", TP_RUNS, ids=TP_IDS)
def test_eviction_between_batches_same_victims_and_still_equal(hf, spawned, tp1, tp, backend, combo):
    ranks = spawned(tp, backend)
    events = [r["evict"][combo]["events"] for r in ranks]
    assert events == [tp1["evict_events"]] * tp, "victims or loads differ between ranks / TP=1"
    log = json.loads(events[0])
    assert ["evict", "r4", 0] in log and ["evict", "r8", 1] in log and ["load", "r4", 1, "cpu"] in log, log
    for i, (uids, lens) in enumerate(EVICTION):
        got, real = ranks[0]["evict"][combo]["logits"][i], _real(lens)
        assert all(torch.equal(got, r["evict"][combo]["logits"][i]) for r in ranks)
        _close(got[real], tp1["evict"][i][real], f"tp {tp} {combo} eviction batch {i} vs TP=1", backend)
        want = _peft_logits(hf, uids, lens, torch.zeros(1, len(lens), dtype=torch.long), seed=10 + i)
        _close(got[real], want[real], f"tp {tp} {combo} eviction batch {i} vs PEFT", backend)


@pytest.mark.parametrize("case", ["bad_shape", "missing", "load_to_slot"])
def test_a_rank_that_rejects_an_adapter_makes_every_rank_raise_and_nothing_change(ranks, case):
    r0, r1 = (r["rejections"][case] for r in ranks)
    assert r0["diff"] == [] and r1["diff"] == [], "a rejected adapter changed a rank's pool"
    assert "was rejected by rank(s) [1] of 2" in r0["error"] and "passed on rank 0" in r0["error"], r0["error"]
    assert "nothing was written on any rank" in r0["error"] and "nothing was written on any rank" in r1["error"]
    assert r1["error"].startswith("rank 1 rejected adapter") and "rejected by rank(s) [1] of 2" in r1["error"]
    shape = "A of (1, 'qkv_proj') has shape (23, 64), expected (24, 64)"  # r8's qkv A is [3 * 8, 64]
    why = {"bad_shape": shape, "missing": "PEFT adapter file not found", "load_to_slot": shape}[case]
    assert why in r1["error"], r1["error"]  # the failing rank says why


def test_a_uid_unknown_everywhere_is_rejected_by_all(ranks):
    for j, r in enumerate(ranks):
        res = r["rejections"]["unknown"]
        assert res["diff"] == [] and "unknown adapter uid 'nobody'" in res["error"], res["error"]
        assert "rejected by rank(s) [0, 1] of 2" in res["error"]


def test_pool_still_serves_after_rejections(ranks, tp1):
    """The agreement collectives stayed paired: a later batch runs and still equals TP=1."""
    real = _real(BATCH[1])
    _close(ranks[0]["rejections"]["after"][real], tp1["main"]["prefill"][real], "after rejections")


def test_collectives_only_on_loads(ranks):
    """2 all-reduces per disk load (fetch, slot write), none for the base model or a resident batch."""
    for r in ranks:
        assert r["rejections"]["counts"] == {"first_load": 2, "resident": 0}


def test_ranks_configured_differently_are_caught_at_construction(ranks):
    for j, r in enumerate(ranks):
        policy, cache = r["construction"]["policy"], r["construction"]["cpu_cache"]
        assert policy.endswith("rank 1 eviction_policy: 'FIFOEvictionPolicy' (rank 0: 'LRUEvictionPolicy')"), policy
        assert "rank(s) [1] of 2" in cache, cache
    assert "max_loaded_loras (2) must be >= max_loras_per_batch (4)" in ranks[1]["construction"]["cpu_cache"]


def test_disagreeing_ranks_garble_the_output_and_the_check_catches_it(ranks):
    d0, d1 = (r["demo"] for r in ranks)
    assert d0["slot_map"] == ["a", "c"] and d1["slot_map"] == ["c", "b"]
    assert d0["leader_max_error"] > 1.0, "rank 1 read b's shard for c's tokens: the output must be garbage"
    assert d0["own_max_error"] < 1e-5
    for d in (d0, d1):
        assert "rank 1 buffer_id_to_uid: ['c', 'b'] (rank 0: ['a', 'c'])" in d["agreement_error"], d["agreement_error"]


def test_pool_and_model_refuse_bad_configurations(hf):
    ckpt = hf["ckpt"]
    layouts = llama_tp_layouts(ckpt, 1)
    with pytest.raises(ValueError, match="variants must name exactly"):
        TPLoRAMemoryPool(layouts, {"qkv_proj": "replicated_A"}, LAYERS, 2, MAX_RANK)
    with pytest.raises(ValueError, match="is not one of"):
        TPLoRAMemoryPool(layouts, {**_variants(COMBOS[0]), "o_proj": "fully_sharded"}, LAYERS, 2, MAX_RANK)
    with pytest.raises(ValueError, match="initialized process group"):
        TPLoRAMemoryPool(llama_tp_layouts(ckpt, 2), _variants(COMBOS[0]), LAYERS, 2, MAX_RANK)
    with pytest.raises(ValueError, match="cannot be split over 3"):
        llama_tp_layouts(ckpt, 3)
    pool = TPLoRAMemoryPool(layouts, _variants(COMBOS[0]), LAYERS + 1, 2, MAX_RANK)
    with pytest.raises(ValueError, match="3 layers"):
        TPLlama(ckpt, pool, 2, 8)
