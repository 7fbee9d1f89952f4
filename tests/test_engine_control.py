"""Chapter 11's control plane without a model: block keys, admission, drain, routing, the block
manager and the scheduler, driven by a fake model whose next token is a function of the whole
sequence (so any scheduling mistake that loses, repeats or reorders a token changes the output)."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from reference.engine.block_manager import BlockManager
from reference.engine.policies import (Candidate, admit_requests, block_hashes, choose_drain, ring_walk, route,
                                       stable_hash)
from reference.engine.scheduler import Scheduler, SchedulerConfig
from reference.engine.sequence import SamplingParams, Sequence, SeqStatus

V = 97


def fake_next(tokens) -> int:
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return h % V


def expected_output(prompt, uid, params) -> list[int]:
    toks = list(prompt) + [hash(("uid", uid)) % 3]  # the adapter changes the "model"
    out = []
    while True:
        t = fake_next(toks + out)
        out.append(t)
        if t in params.stop_token_ids or len(out) == params.max_new_tokens:
            return out


# ---- block keys ------------------------------------------------------------------------------
def test_block_hashes_chain_adapter_and_full_blocks_only():
    h = block_hashes([5, 6, 7, 8, 9], "a@0", 2)
    assert len(h) == 2
    assert h[0] == stable_hash((None, "a@0", (5, 6)))
    assert h[1] == stable_hash((h[0], "a@0", (7, 8)))
    assert block_hashes([5, 6, 7, 8], "b@1", 2) != h[:2]  # another adapter: other keys
    assert block_hashes([5, 6, 7, 8], None, 2)[0] != h[0]  # the base model is an identity too
    assert block_hashes([9, 6, 7, 8], "a@0", 2)[1] != h[1]  # a changed prefix changes every later key
    assert block_hashes([1, 2], "a1", 1)[0] != block_hashes([12], "a", 2)  # no string concatenation
    assert block_hashes([], "a", 4) == [] and block_hashes([1, 2, 3], "a", 4) == []
    with pytest.raises(ValueError):
        block_hashes([1], "a", 0)


def test_stable_hash_is_process_independent():
    # Python's hash of a str changes with PYTHONHASHSEED (random per process unless set); a fixed
    # value here holds in every process, so a grader, its child and two engines agree on keys
    assert stable_hash((None, "a@0", (1, 2))) == 8205066425357111827


# ---- admission ---------------------------------------------------------------------------------
def C(i, uid, blocks=1, waited=0):
    return Candidate(i, uid, blocks, waited)


def test_admit_docstring_example_and_each_clause():
    assert admit_requests([C(0, "b"), C(1, "a"), C(2, "a")], [None], {"a"}, 2, 10, 8) == [1, 2]
    assert admit_requests([C(0, "b"), C(1, "a")], [], (), 2, 10, 8) == [0, 1]  # arrival order when all cold
    assert admit_requests([C(0, "a"), C(1, "b"), C(2, "c"), C(3, "a")], [], (), 2, 10, 8) == [0, 1, 3]  # skip, go on
    assert admit_requests([C(0, "a", 3), C(1, "a", 1)], [], (), 2, 2, 8) == []  # KV stops, no overtaking
    assert admit_requests([C(0, "a", 2), C(1, "b", 1)], [], (), 4, 2, 8) == [0]
    assert admit_requests([C(0, "a"), C(1, "a"), C(2, "a")], [], (), 2, 10, 2) == [0, 1]  # max_new_seqs
    assert admit_requests([C(0, "a"), C(1, "b")], [], (), 3, 10, 8, "a", True) == [1]  # drained adapter held
    assert admit_requests([C(0, None), C(1, "b")], [], (), 3, 10, 8, None, True) == [1]  # draining the base
    assert admit_requests([C(0, None), C(1, "b")], [], (), 3, 10, 8, None, False) == [0, 1]  # None, no drain
    assert admit_requests([C(0, None), C(1, "b")], ["a"], (), 2, 10, 8) == [0]  # the base takes a slot
    with pytest.raises(ValueError):
        admit_requests([], [], (), 0, 1, 1)


def test_choose_drain():
    assert choose_drain([C(9, "c", waited=5)], {"a": 30, "b": 4}, 2, 4) == (True, "b")
    assert choose_drain([C(9, "c", waited=4)], {"a": 30, "b": 4}, 2, 4) == (False, None)  # not past it yet
    assert choose_drain([C(9, "c", waited=9)], {"a": 30, "b": 4}, 3, 4) == (False, None)  # a slot is free
    assert choose_drain([C(9, "a", waited=9)], {"a": 30, "b": 4}, 2, 4) == (False, None)  # its adapter runs
    assert choose_drain([C(9, "c", waited=9)], {"a": 5, None: 5}, 2, 4) == (True, None)  # tie: base first
    with pytest.raises(ValueError):
        choose_drain([], {}, 2, -1)


def test_route_bounded_and_sticky():
    walk = ring_walk("a@0", 4, 8)
    assert sorted(walk) == [0, 1, 2, 3]
    assert route("a@0", [0, 0, 0, 0], 8, 1.25) == walk[0]
    loads = [0] * 4
    for _ in range(40):  # one hot adapter: the bound spreads it, never more than ceil(1.25 * n / 4)
        loads[route("a@0", loads, 8, 1.25)] += 1
        assert max(loads) <= -(-1.25 * sum(loads) // 4)
    loads = [3, 0, 0, 0]
    first = ring_walk("k", 4, 8)
    got = route("k", loads, 8, 2.0, replicas=2)
    assert got == min(first[:2], key=lambda i: (loads[i], first.index(i)))
    with pytest.raises(ValueError):
        route("k", [0, 0], 8, 0.9)


# ---- block manager ---------------------------------------------------------------------------
def seq(i, prompt, uid=None, n=4):
    return Sequence(i, list(prompt), uid, SamplingParams(max_new_tokens=n))


def test_block_keys_extended_as_a_sequence_grows_equal_the_whole_chain():
    """BlockManager keeps each sequence's reference keys and extends them block by block: at every
    length, for lookups and for registration, they equal block_hashes over the whole prefix."""
    bm = BlockManager(64, 3)
    s = seq(0, [4, 8, 15, 16, 23], "a@0", n=20)
    for t in range(20):
        want = block_hashes(s.tokens, "a@0", 3)
        assert bm._chained_keys(s, len(want)) == want, t
        assert bm._lookup_keys(s) == block_hashes(s.tokens[:s.num_tokens - 1], "a@0", 3), t
        s.output.append((t * 7) % V)
    s.uid = "b@1"  # another adapter (or block size) recomputes from the start
    assert bm._lookup_keys(s) == block_hashes(s.tokens[:s.num_tokens - 1], "b@1", 3)
    assert BlockManager(64, 4)._lookup_keys(s) == block_hashes(s.tokens[:s.num_tokens - 1], "b@1", 4)


def test_blocks_prefix_hits_only_after_compute_and_per_adapter():
    bm = BlockManager(8, 2)
    a = seq(0, [1, 2, 3, 4, 5], "x")
    bm.allocate(a)
    assert len(a.block_table) == 3 and a.num_computed == 0
    b = seq(1, [1, 2, 3, 4, 9], "x")
    assert bm.blocks_needed(b) == 3  # nothing computed yet: no hit
    a.num_computed = 5
    bm.mark_computed(a)
    assert bm.blocks_needed(b) == 1
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.num_computed == 4
    assert bm.ref_count[a.block_table[0]] == 2
    c = seq(2, [1, 2, 3, 4, 9], "y")  # same tokens, other adapter: no sharing
    assert bm.blocks_needed(c) == 3
    bm.release(a)
    bm.release(b)
    assert bm.num_free == 8 and all(r == 0 for r in bm.ref_count)
    d = seq(3, [1, 2, 3, 4, 7], "x")  # a freed block still hits until it is evicted
    assert bm.blocks_needed(d) == 3 and bm._hits(bm._lookup_keys(d)) != []
    bm.allocate(d)
    assert d.num_computed == 4


def test_blocks_whole_prompt_cached_still_computes_one_token_and_eviction_forgets():
    bm = BlockManager(2, 2)
    a = seq(0, [1, 2, 3, 4])
    bm.allocate(a)
    a.num_computed = 4
    bm.mark_computed(a)
    bm.release(a)
    b = seq(1, [1, 2, 3, 4])
    bm.allocate(b)
    assert b.num_computed == 2  # the last block is recomputed: its last token gives the logits
    bm.release(b)
    c = seq(2, [8, 8, 8, 8])
    bm.allocate(c)  # takes both blocks: the old keys are evicted
    assert bm.key_to_block == {} and bm.blocks_needed(seq(3, [1, 2, 3, 4])) == 2 + 0
    with pytest.raises(ValueError):
        bm.allocate(seq(4, [5, 5, 5]))


def test_a_free_block_hands_its_key_to_a_live_block_that_computes_the_same_prefix():
    """helper-32's find: a key already held by a FREE block (next in line for eviction) was not
    registered for a live block computing the same prefix, so whether the cache kept that prefix
    depended on the order of a step's block allocations and registrations (the engine's overlapped
    decode takes step N+1's blocks before registering step N's). Now the live block takes the key;
    a block a sequence holds keeps its own."""
    bm = BlockManager(6, 2)
    a, d, e = seq(0, [1, 2, 3]), seq(1, [1, 2, 7]), seq(2, [1, 2, 8])
    for s_ in (a, d, e):  # nothing computed yet: each gets blocks of its own
        bm.allocate(s_)
    a.num_computed = 2
    bm.mark_computed(a)
    key = bm.block_key[a.block_table[0]]
    old = a.block_table[0]
    bm.release(a)  # still cached, and free
    d.num_computed = 2
    bm.mark_computed(d)
    assert bm.key_to_block[key] == d.block_table[0] and bm.block_key[old] is None
    e.num_computed = 2
    bm.mark_computed(e)  # d holds the key's block: it keeps it
    assert bm.key_to_block[key] == d.block_table[0] and bm.block_key[e.block_table[0]] is None
    assert old in bm.free
    while old in bm.free:  # evicting the old free block no longer forgets the prefix
        bm._take_new()
    assert bm.blocks_needed(seq(3, [1, 2, 9])) == 1


# ---- the scheduler against the fake model ----------------------------------------------------
def run(seqs, config, num_blocks, block_size, resident=lambda: ()):
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(config, bm, resident)
    for s in seqs:
        sched.add(s)
    steps = 0
    while sched.has_unfinished():
        kind, work = sched.schedule()
        assert work, "idle with requests unfinished"
        assert len({w.seq.uid for w in work} | {s.uid for s in sched.running}) <= config.max_loras_per_batch
        assert sum(w.end - w.start for w in work) <= config.max_num_batched_tokens or (kind == "decode" and
                                                                                      not config.mixed_steps)
        cap = config.max_prefill_tokens_while_decoding
        if cap is not None and any(w.end - w.start == 1 and not w.seq.in_prefill for w in work):
            assert sum(w.end - w.start for w in work if w.seq.in_prefill) <= cap, (cap, work)
        if config.mixed_steps:  # every sequence past its prompt decodes in every step the budget allows
            decoding = [s for s in sched.running if not s.in_prefill and s.num_tokens - s.num_computed == 1]
            assert {w.seq.seq_id for w in work if w.end - w.start == 1} >= {s.seq_id for s in decoding
                                                                           if s.num_computed == s.num_tokens - 1} or \
                len(work) == config.max_num_batched_tokens
        nxt = {w.seq.seq_id: fake_next(w.seq.prompt + [hash(("uid", w.seq.uid)) % 3] + w.seq.output)
               for w in work if w.end == w.seq.num_tokens}
        sched.postprocess(work, nxt)
        held = Counter(b for s in sched.running for b in s.block_table)
        assert all(bm.ref_count[b] == held[b] for b in range(num_blocks))
        assert all((bm.ref_count[b] == 0) == (b in bm.free) for b in range(num_blocks))
        steps += 1
        assert steps < 10_000
    return sched, bm


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed_steps"])
@pytest.mark.parametrize("seed", range(6))
def test_scheduler_outputs_survive_chunking_preemption_and_prefix_sharing(seed, mixed):
    rng = random.Random(seed)
    shared = [rng.randrange(V) for _ in range(10)]
    seqs = []
    for i in range(14):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(V) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(max_new_tokens=rng.randint(1, 9), stop_token_ids=(rng.randrange(V),))
        seqs.append(Sequence(i, prompt, rng.choice([None, "a", "b", "c", "d"]), params))
    config = SchedulerConfig(max_num_seqs=5, max_num_batched_tokens=rng.choice([4, 7, 64]), max_loras_per_batch=3,
                             drain_threshold=rng.choice([None, 3]), mixed_steps=mixed,
                             max_prefill_tokens_while_decoding=rng.choice([None, 1, 3]) if mixed else None)
    sched, bm = run(seqs, config, num_blocks=16, block_size=rng.choice([2, 4]))
    # the fake model's "adapter" token is added to the prompt: compute what each sequence must give
    for s in seqs:
        toks, out = s.prompt + [hash(("uid", s.uid)) % 3], []
        while True:
            t = fake_next(toks + out)
            out.append(t)
            if t in s.params.stop_token_ids or len(out) == s.params.max_new_tokens:
                break
        assert s.output == out, f"sequence {s.seq_id}"
        assert s.status is SeqStatus.FINISHED
    kinds = Counter(e[0] for e in sched.events)
    assert kinds["finish"] == len(seqs)
    assert bm.num_free == 16


def test_scheduler_preempts_when_kv_runs_out_and_chunks_long_prompts():
    seqs = [seq(i, list(range(i, i + 6)), None, n=8) for i in range(3)]
    sched, _ = run(seqs, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=4, max_loras_per_batch=2),
                   num_blocks=7, block_size=2)
    kinds = Counter(e[0] for e in sched.events)
    assert kinds["preempt"] >= 1
    chunks = [e for e in sched.events if e[0] == "prefill" and e[1] == 0]
    assert chunks[:2] == [("prefill", 0, 0, 4), ("prefill", 0, 4, 6)]


def test_mixed_steps_keep_decoding_while_a_long_prompt_is_chunked():
    """Sarathi-Serve's point: with mixed steps a 30-token prompt admitted while two sequences decode
    is prefilled in chunks of what the budget leaves, and the two decode in every one of those steps;
    prefill first, they wait for the whole prompt."""
    def trace(mixed):
        sched = Scheduler(SchedulerConfig(4, 8, 4, mixed_steps=mixed), BlockManager(64, 4))
        for s in (seq(0, [1, 2], n=12), seq(1, [3, 4], n=12)):
            sched.add(s)
        kinds, decoded_while_prefilling = [], 0
        for step in range(40):
            if step == 2:
                sched.add(seq(2, list(range(30)), n=2))
            kind, work = sched.schedule()
            if not work:
                break
            kinds.append(kind)
            assert sum(w.end - w.start for w in work) <= 8 or not mixed
            prefilling = any(w.seq.seq_id == 2 and w.end < w.seq.num_tokens for w in work)
            decoded_while_prefilling += prefilling and {0, 1} <= {w.seq.seq_id for w in work if w.end - w.start == 1}
            sched.postprocess(work, {w.seq.seq_id: 5 for w in work if w.end == w.seq.num_tokens})
        return kinds, decoded_while_prefilling

    kinds, overlap = trace(True)
    assert "mixed" in kinds and overlap >= 4, (kinds, overlap)  # 30 tokens in chunks of 6
    kinds, overlap = trace(False)
    assert "mixed" not in kinds and overlap == 0, kinds


def test_a_step_that_decodes_carries_at_most_the_prompt_cap_and_one_that_does_not_takes_the_budget():
    """max_prefill_tokens_while_decoding: while sequences decode, the prompts of a step take at most 3
    tokens together (not the 6-7 the budget of 8 leaves); alone, a prompt takes the whole budget; the
    outputs are those of the uncapped run."""
    def trace(cap):
        sched = Scheduler(SchedulerConfig(4, 8, 4, mixed_steps=True, max_prefill_tokens_while_decoding=cap),
                          BlockManager(64, 4))
        seqs = [seq(0, list(range(20)), n=12), seq(1, [3, 4], n=12), seq(2, list(range(30)), n=2)]
        sched.add(seqs[0])
        chunks, step = [], 0
        while sched.has_unfinished() or step <= 4:
            if step == 4:
                for s in seqs[1:]:
                    sched.add(s)
            kind, work = sched.schedule()
            decoding = any(w.end - w.start == 1 and not w.seq.in_prefill for w in work)
            chunks += [(w.seq.seq_id, w.end - w.start, decoding) for w in work if w.seq.in_prefill]
            sched.postprocess(work, {w.seq.seq_id: (7 * w.end) % 11 for w in work if w.end == w.seq.num_tokens})
            step += 1
        return chunks, {s.seq_id: list(s.output) for s in seqs}

    capped, outs = trace(3)
    assert capped[:3] == [(0, 8, False), (0, 8, False), (0, 4, False)], capped  # alone: the whole budget
    assert all(n <= 3 for _, n, decoding in capped if decoding) and any(d for *_, d in capped), capped
    # the cap is per step, over every prompt in it: seq 1's 2 tokens and 1 of seq 2's, then 3 a step
    assert [n for i, n, d in capped if i in (1, 2)][:5] == [2, 1, 3, 3, 3], capped
    uncapped, outs_uncapped = trace(None)
    assert max(n for i, n, d in uncapped if i == 2 and d) > 3, uncapped  # the cap made the difference
    assert outs == outs_uncapped
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        SchedulerConfig(max_prefill_tokens_while_decoding=0).check()


def _drain_trace(threshold, resident=tuple):
    """Cap 2: "b" decodes for long, a hot "a" gets a new request every 3 steps, "c" waits for a slot.
    Returns the step at which "c" finishes (None: not within 90 steps) and the scheduler."""
    sched = Scheduler(SchedulerConfig(8, 64, 2, drain_threshold=threshold), BlockManager(256, 4), resident)
    c = Sequence(101, [7, 7], "c", SamplingParams(max_new_tokens=2))
    for s in (Sequence(0, [0, 1], "a", SamplingParams(max_new_tokens=10)),
              Sequence(100, [5, 5], "b", SamplingParams(max_new_tokens=60)), c):
        sched.add(s)
    for step in range(1, 90):
        if step % 3 == 0:
            sched.add(Sequence(step, [step % 50, 1], "a", SamplingParams(max_new_tokens=10)))
        _, work = sched.schedule()
        sched.postprocess(work, {w.seq.seq_id: 1 for w in work if w.end == w.seq.num_tokens})
        if c.status is SeqStatus.FINISHED:
            return step, sched
    return None, sched


@pytest.mark.parametrize("resident", [tuple, lambda: {"a", "b"}], ids=["nothing_resident", "drained_stays_resident"])
def test_drain_frees_a_slot_for_a_starving_adapter(resident):
    without, sched = _drain_trace(None, resident)
    assert not any(e[0] == "drain" for e in sched.events)
    with_drain, sched = _drain_trace(4, resident)
    assert with_drain is not None and with_drain <= 20 and (without is None or with_drain < without), (with_drain, without)
    drains = [e for e in sched.events if e[0] in ("drain", "drain_end")]
    assert drains[:2] == [("drain", "a"), ("drain_end", "a")]  # "a"'s requests finish long before "b"'s


def test_add_refuses_a_request_larger_than_the_cache():
    sched = Scheduler(SchedulerConfig(), BlockManager(2, 2))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add(seq(0, [1, 2, 3], n=3))
    assert not sched.has_unfinished()


# ---- the cluster simulation ------------------------------------------------------------------
def test_adapter_affinity_beats_round_robin_on_swap_ins_and_prefix_hits():
    from reference.engine.cluster import simulate_cluster, zipf_trace

    trace = zipf_trace(160, 24, seed=3)
    rr = simulate_cluster(trace, 4, "round_robin")
    aff = simulate_cluster(trace, 4, "affinity")
    assert sum(rr["per_instance"]) == sum(aff["per_instance"]) == 160
    assert aff["swap_ins"] < rr["swap_ins"], (aff, rr)
    assert aff["prefix_hit_rate"] > rr["prefix_hit_rate"], (aff, rr)
    assert aff["adapters_per_batch"] < rr["adapters_per_batch"], (aff, rr)
    with pytest.raises(ValueError):
        simulate_cluster(trace, 4, "random")


@pytest.mark.parametrize("starving", [None, "c"], ids=["base_model", "adapter"])
def test_a_drain_ends_when_the_request_it_served_finished_in_its_admitting_step(starving):
    """Cap 1: "a" decodes, a one-token request of ``starving`` waits past the threshold, so "a" is
    drained for it. It is admitted when "a" finishes and ends in that same step (one new token), so
    its adapter is never seen running: the drain must still end (nothing of it waits any more), or a
    later request of "a" is held forever and the scheduler idles with requests unfinished (found by a
    differential fuzz of the engine; the base model's uid None was the case that hid it longest)."""
    sched = Scheduler(SchedulerConfig(8, 64, 1, drain_threshold=1), BlockManager(64, 4))
    sched.add(seq(0, [1, 2], "a", n=4))
    sched.schedule()  # "a" admitted
    sched.add(seq(1, [3, 4], starving, n=1))
    later_added = False
    for step in range(30):
        kind, work = sched.schedule()
        if not work:
            break
        sched.postprocess(work, {w.seq.seq_id: 9 for w in work if w.end == w.seq.num_tokens})
        if not later_added and not any(s.seq_id == 1 for s in [*sched.waiting, *sched.running]):
            sched.add(seq(2, [5, 6], "a", n=2))
            later_added = True
    assert ("drain", "a") in sched.events and later_added
    assert not sched.has_unfinished(), (kind, sched.waiting, sched.drain_active, sched.events[-6:])
