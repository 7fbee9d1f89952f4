"""The engine as a long-running server uses it (issue #32): requests that fail alone, aborts that
free what they held, adapters unregistered and replaced with host memory flat, the drain bounding a
cold adapter's wait whichever limit binds, and the sampling options (top-k, top-p, min_tokens,
logprobs) against their definitions."""
from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch

from reference.engine.block_manager import BlockManager
from reference.engine.llm import LLM, EngineConfig
from reference.engine.model_runner import sample_batch
from reference.engine.scheduler import Scheduler, SchedulerConfig
from reference.engine.sequence import SamplingParams, Sequence, SeqStatus
from reference.engine.tiny import tiny_llama
from reference.mem_pool import LoRAAdapter


def _engine(**cfg) -> LLM:
    config = dict(max_loras_per_batch=3, max_lora_rank=8, num_kv_blocks=64, block_size=4, max_num_seqs=8,
                  max_num_batched_tokens=32)
    return LLM(tiny_llama(1), EngineConfig(**{**config, **cfg}), device="cpu")


def _adapter(llm: LLM, name: str, seed: int, fill: float | None = None) -> LoRAAdapter:
    """A random rank-4 adapter on q_proj and down_proj of every layer (``fill``: every B entry)."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(llm.num_layers):
        for module in ("qkv_proj", "down_proj"):
            spec = llm.pool.modules[module]
            a = torch.randn(spec.stack_num * 4, spec.in_features, generator=g) * 0.3
            b = torch.randn(spec.out_total, 4, generator=g) * 0.3
            weights[(layer, module)] = (a, b if fill is None else torch.full_like(b, fill))
    return LoRAAdapter(name, 4, 2.0, weights)


@pytest.fixture(scope="module")
def llm():
    engine = _engine()
    engine.register_adapter_weights("a", _adapter(engine, "a", 1))
    engine.register_adapter_weights("b", _adapter(engine, "b", 2))
    engine.register_adapter_weights("nan", _adapter(engine, "nan", 3, fill=float("nan")))
    return engine


PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [5, 5, 5, 5, 5, 5, 5], [100, 3]]
PARAMS = [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=7, temperature=0.8, seed=4),
          SamplingParams(max_new_tokens=5, temperature=1.3, seed=9, top_k=20, top_p=0.8),
          SamplingParams(max_new_tokens=4)]


def test_a_nan_adapter_fails_alone_and_the_others_keep_their_tokens(llm):
    names = ["a", None, "b", "a"]
    alone = [llm.generate([p], sp, [n])[0].token_ids for p, sp, n in zip(PROMPTS, PARAMS, names)]
    # the broken request rides in the middle of the batch, greedy and seeded, and then last
    for broken in (SamplingParams(max_new_tokens=5), SamplingParams(max_new_tokens=5, temperature=0.7, seed=1)):
        outs = llm.generate(PROMPTS[:2] + [[4, 4, 4]] + PROMPTS[2:], PARAMS[:2] + [broken] + PARAMS[2:],
                            names[:2] + ["nan"] + names[2:])
        bad = outs.pop(2)
        assert bad.finish_reason == "error" and "not finite" in bad.error and bad.token_ids == []
        assert [o.token_ids for o in outs] == alone
        assert all(o.error is None for o in outs)
    assert llm.blocks.num_free == llm.blocks.num_blocks  # the failed request's blocks came back
    assert llm.generate([PROMPTS[0]], PARAMS[0], ["a"])[0].token_ids == alone[0]  # the engine goes on


def test_what_would_fail_on_the_device_is_refused_when_added(llm):
    """A seed past 64 bits, a stop token past the vocabulary (min_tokens masks its column)."""
    out = llm.add_request([1, 2], SamplingParams(max_new_tokens=2, temperature=0.5, seed=2 ** 64))
    assert out.error is not None and "seed" in out.error and not llm.has_unfinished()
    far = llm.add_request([1, 2], SamplingParams(max_new_tokens=2, stop_token_ids=(5, llm.model.config.vocab_size),
                                                 min_tokens=1))
    assert far.error is not None and "stop_token_ids" in far.error and not llm.has_unfinished()
    ok = llm.add_request([1, 2], SamplingParams(max_new_tokens=2, temperature=0.5, seed=2 ** 64 - 1))
    assert ok.error is None
    for _ in range(10):
        llm.step()
    assert ok.finished and len(ok.token_ids) == 2


def test_outputs_grow_step_by_step_and_abort_frees_blocks_and_the_adapter(llm):
    a = llm.add_request([1, 2, 3], SamplingParams(max_new_tokens=30), "a")
    b = llm.add_request([4, 5, 6], SamplingParams(max_new_tokens=5), "b")
    seen = []
    for _ in range(4):
        llm.step()
        seen.append(len(a.token_ids))
    assert seen == sorted(seen) and seen[-1] >= 2 and len(a.token_times) == len(a.token_ids)
    assert llm.abort_request(a.request_id) and a.finish_reason == "abort"
    assert not llm.abort_request(a.request_id)  # already over
    assert all(s.uid != "a@0" for s in llm.scheduler.running)
    while llm.has_unfinished():
        llm.step()
    assert b.finish_reason == "length" and len(b.token_ids) == 5
    assert llm.blocks.num_free == llm.blocks.num_blocks


def test_two_hundred_swaps_keep_host_memory_flat():
    """Re-registering a name frees the version it replaces once no request uses it; unregistering
    frees the last one. Every replaced version's weights are garbage afterwards (weak references die),
    and the registry never holds more than the running version and the newest."""
    llm = _engine()
    dead, alive = [], None
    running = None
    for i in range(200):
        adapter = _adapter(llm, "hot", 1000 + i)
        refs = [weakref.ref(t) for pair in adapter.weights.values() for t in pair]
        llm.register_adapter_weights("hot", adapter)
        del adapter
        if alive is not None:
            dead.append(alive)
        alive = refs
        if i % 40 == 0:  # a request that runs across the next swaps keeps its version until it ends
            running = llm.add_request([1, 2, 3], SamplingParams(max_new_tokens=6), "hot")
        if llm.has_unfinished():
            llm.step()
        assert llm.registry.num_versions() <= 2 + (running is not None and not running.finished)
    while llm.has_unfinished():
        llm.step()
    gc.collect()
    leaked = sum(r() is not None for refs in dead for r in refs)
    assert leaked == 0, f"{leaked} tensors of replaced versions are still alive"
    assert llm.registry.num_versions() == 1 and len(llm.pool.cpu_cache) <= 1
    llm.unregister_adapter("hot")
    gc.collect()
    assert llm.registry.num_versions() == 0 and all(r() is None for r in alive)
    assert all(u is None for u in llm.pool.uid_to_buffer_id) and not llm.pool.cpu_cache
    assert llm.add_request([1], SamplingParams(max_new_tokens=1), "hot").error is not None
    with pytest.raises(ValueError, match="no adapter named"):
        llm.unregister_adapter("hot")


def test_max_model_len_bounds_requests():
    llm = _engine(max_model_len=12)
    assert llm.add_request(list(range(8)), SamplingParams(max_new_tokens=5)).error is not None
    assert llm.add_request(list(range(8)), SamplingParams(max_new_tokens=4)).error is None
    with pytest.raises(ValueError, match="max_model_len"):
        _engine(max_model_len=10 ** 6)


# ---- the drain when seats bind ------------------------------------------------------------------
def _seat_trace(threshold):
    """2 seats, a cap of 4 adapters: a hot "a" always has a request waiting, "c" arrives at step 1.
    Returns the step "c" is admitted at (None: not within 120 steps)."""
    sched = Scheduler(SchedulerConfig(2, 64, 4, drain_threshold=threshold), BlockManager(256, 4), lambda: {"a"})
    sid = 0

    def hot():
        nonlocal sid
        sid += 1
        sched.add(Sequence(sid, [sid % 50, 1], "a", SamplingParams(max_new_tokens=6)))

    for _ in range(3):
        hot()
    c = Sequence(1000, [7, 7], "c", SamplingParams(max_new_tokens=2))
    for step in range(1, 120):
        if step == 1:
            sched.add(c)
        if sum(s.uid == "a" for s in sched.waiting) < 2:
            hot()
        _, work = sched.schedule()
        if c.status is not SeqStatus.WAITING:
            return step
        sched.postprocess(work, {w.seq.seq_id: 1 for w in work if w.end == w.seq.num_tokens})
    return None


def test_the_drain_bounds_a_cold_wait_when_seats_bind_not_the_cap():
    assert _seat_trace(None) is None  # resident first: the hot adapter takes every freed seat
    admitted = _seat_trace(4)
    assert admitted is not None and admitted <= 4 + 1 + 7, admitted  # threshold, then one request's lifetime


# ---- sampling options against their definitions --------------------------------------------------
def _kept(logits, t, top_k, top_p):
    """The tokens top-k then top-p keep, written the plain way, one row at a time."""
    z = logits.double() / t
    order = z.argsort(descending=True, stable=True)
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k:
        keep[order[top_k:]] = False
    probs = torch.softmax(torch.where(keep, z, float("-inf")), -1)
    mass = 0.0
    for rank, v in enumerate(order.tolist()):
        if mass >= top_p and rank > 0:
            keep[v] = False
        mass += probs[v].item()
    return keep


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (3, 0.9), (0, 1e-9)])
def test_top_k_and_top_p_only_ever_pick_kept_tokens_and_never_depend_on_the_batch(top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    temps, seeds, counters = [0.7, 1.0, 2.0, 0.0, 1.5, 0.9], [1, 2, 3, 4, 5, 6], [0, 3, 1, 2, 9, 4]
    ks, ps = [top_k] * 6, [top_p] * 6
    picked = sample_batch(logits, temps, seeds, counters, top_ks=ks, top_ps=ps).tolist()
    for i in range(6):
        alone = sample_batch(logits[i:i + 1], temps[i:i + 1], seeds[i:i + 1], counters[i:i + 1],
                             top_ks=ks[i:i + 1], top_ps=ps[i:i + 1]).item()
        assert alone == picked[i]
        if temps[i] == 0:
            assert picked[i] == logits[i].argmax().item()
            continue
        assert _kept(logits[i], temps[i], top_k, top_p)[picked[i]], (i, picked[i])
    if top_k == 1 or top_p < 1e-6:
        assert picked == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {sample_batch(logits, [1.0], [s], [0], top_ps=[0.7]).item() for s in range(200)}
    assert draws == {0, 1}  # 0.5 < 0.7 <= 0.5 + 0.3
    draws = {sample_batch(logits, [1.0], [s], [0], top_ps=[0.8]).item() for s in range(200)}
    assert draws == {0, 1}  # the mass reaches 0.8 with two tokens exactly
    draws = {sample_batch(logits, [1.0], [s], [0], top_ks=[3]).item() for s in range(300)}
    assert draws == {0, 1, 2}


def test_min_tokens_bans_stop_tokens_until_reached(llm):
    free = llm.generate([[3, 3, 3]], SamplingParams(max_new_tokens=6), ["a"])[0].token_ids
    stop = free[1]
    assert llm.generate([[3, 3, 3]], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,)), ["a"])[0].token_ids \
        == free[:free.index(stop) + 1]
    held = llm.generate([[3, 3, 3]], SamplingParams(max_new_tokens=6, stop_token_ids=(stop,), min_tokens=4),
                        ["a"])[0].token_ids
    assert len(held) >= 4 and stop not in held[:4]


def test_logprobs_are_the_models_log_softmax_of_the_chosen_tokens(llm):
    out = llm.generate([[7, 1, 7]], SamplingParams(max_new_tokens=4, logprobs=True, temperature=0.9, seed=2),
                       [None])[0]
    seq = [7, 1, 7] + out.token_ids
    plain = tiny_llama(1)  # the engine's base model: same seed, same weights, unwrapped
    with torch.no_grad():
        lp = plain(input_ids=torch.tensor([seq])).logits[0].log_softmax(-1)
    want = [lp[2 + i, seq[3 + i]].item() for i in range(4)]
    assert out.logprobs == pytest.approx(want, abs=1e-4)
    assert all(math.isfinite(x) and x <= 0 for x in out.logprobs)
