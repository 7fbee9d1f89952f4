"""The engine's graph decode (reference/engine/cuda_graph_runner.py) against its eager path.

Two runners get the same work: one eager, one with ``cuda_graph_runner.enable_graph_decode`` (CUDA graphs captured
and replayed on a GPU; on the CPU the same static-shape step is called, so CI checks it). Every
cache entry starts NaN, scratch block included, so a read of a padding block, of a table's padding
or of the tail of a sequence's last block would show. The trace mixes adapters and base rows, runs
batches of 1 to 7 sequences over buckets (1, 2, 4, 8) (padding rows in most), sequences whose
lengths cross block boundaries with tables of different lengths (one longer than it needs), and a
pool of 3 adapter slots (plus the base, pinned) for 4 adapters, so slots change owner between
decode steps. Then: the static inputs' running example, the steps sent back to the eager path, a
missed slot-change flag (the stale-table bug, reproduced), and GPU-only checks of the replay (no
device read, no allocation but the returned copy, one graph pool).

Tolerances: ``graders.machine.tolerances`` (fp32 matmul rows; the Triton row for the Triton backend on a GPU).
"""
import copy

import pytest
import torch

from graders.machine.tolerances import tolerance
from reference.cuda_graph import bucket_for
from reference.engine.cuda_graph_runner import PagedDecodeGraphRunner, StaticDecodeInputs, enable_graph_decode
from reference.engine.model_runner import ModelRunner, SeqWork, sample
from reference.layers import LoRAContext
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec

transformers = pytest.importorskip("transformers")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKENDS = ["torch"] + (["triton"] if CUDA else [])  # the interpreter is slow: chapter 08 runs it on the CPU
CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
LAYERS, MAX_RANK, BLOCK_SIZE, NUM_BLOCKS = CFG["num_hidden_layers"], 8, 4, 40
MODULES = (ModuleSpec("qkv_proj", 64, (64, 32, 32)), ModuleSpec("o_proj", 64, (64,)),
           ModuleSpec("gate_up_proj", 64, (96, 96)), ModuleSpec("down_proj", 96, (64,)))
ALL = tuple(m.name for m in MODULES)
# (rank, scaling, modules): ranks 1-8, every module somewhere, scalings that differ (a stale table shows)
ADAPTERS = {"qv": (4, 2.0, ("qkv_proj",)), "mlp": (6, 0.5, ("gate_up_proj", "down_proj")),
            "all": (8, 1.5, ALL), "one": (1, 3.0, ("o_proj", "qkv_proj"))}
BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).to(DEVICE).eval()


@pytest.fixture(scope="module")
def adapters():
    g = torch.Generator().manual_seed(11)
    out = {}
    for uid, (rank, scaling, names) in ADAPTERS.items():
        weights = {}
        for layer in range(LAYERS):
            for m in (m for m in MODULES if m.name in names):
                A = torch.randn(m.stack_num * rank, m.in_features, generator=g) * m.in_features ** -0.5
                B = torch.randn(m.out_total, rank, generator=g) * 0.3
                weights[(layer, m.name)] = (A, B)
        out[uid] = LoRAAdapter(uid, rank, scaling, weights)
    return out


def _close(got, want, what, op="matmul"):
    rtol, atol, _ = tolerance(torch.device(DEVICE).type, torch.float32, op)
    assert got.isfinite().all(), f"{what}: NaN or inf (a padding read?)"
    err = (got - want).abs()
    bad = err > atol + rtol * want.abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} logits differ, max abs error {err.max().item():.3g}"


def _pool(adapters, slots, pin_base=True):
    pool = LoRAMemoryPool(MODULES, LAYERS, slots, MAX_RANK, device=DEVICE, adapter_source=adapters.__getitem__)
    if pin_base:  # as the engine does with graph decode: the padding rows' rank-0 slot
        pool.prepare_lora_batch([None])
        pool.pin(None)
    return pool


def _runner(base, pool, backend="torch", graph=False, buckets=BUCKETS):
    runner = ModelRunner(copy.deepcopy(base), pool, None if pool is None else LoRAContext(), NUM_BLOCKS,
                         BLOCK_SIZE, backend)
    runner.kv_cache.k.fill_(float("nan"))  # every entry not written by the runner is NaN, scratch block too
    runner.kv_cache.v.fill_(float("nan"))
    if graph:
        enable_graph_decode(runner, max(buckets), buckets)
    return runner


class Seq:
    """A sequence's tokens, how many are cached, its block table (grown from a shuffled free list)."""

    def __init__(self, prompt, uid, spare=0) -> None:
        self.tokens, self.cached, self.table, self.uid, self.spare = list(prompt), 0, [], uid, spare

    def work(self, free: list) -> SeqWork:
        """Every uncached token (the prompt, or the last token at decode)."""
        while len(self.table) * BLOCK_SIZE < len(self.tokens) + self.spare * BLOCK_SIZE:
            self.table.append(free.pop())
        w = SeqWork(self.tokens[self.cached:], self.cached, list(self.table), self.uid)
        self.cached = len(self.tokens)
        return w


SEQ_UIDS = ["qv", None, "mlp", "all", "qv", None, "one"]
PROMPT_LENS = (3, 1, 5, 8, 4, 11, 2)  # tables of 1 to 3 blocks, growing across boundaries of 4
PREFILLS = [[0, 1, 2], [3, 4, 5], [6]]
DECODES = [[0, 1, 2], [3, 4, 5, 6, 1], [2], [5, 1], [6, 0, 3, 5, 4, 1], [0, 2, 3], [4], [1, 6, 5, 0, 3, 4]]


def _seqs():
    g = torch.Generator().manual_seed(3)
    return [Seq(torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist(), uid, spare=2 if i == 2 else 0)
            for i, (n, uid) in enumerate(zip(PROMPT_LENS, SEQ_UIDS))]


def _trace(eager, graph, op="matmul"):
    """Prefill (eager in both), then the decode steps, compared step by step; returns the sequences
    and the loads into the graph runner's pool during the decode steps."""
    seqs, free = _seqs(), torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    loads = 0
    for kind, step in [("prefill", s) for s in PREFILLS] + [("decode", s) for s in DECODES]:
        mark = len(graph.pool.events) if graph.pool is not None else 0
        work = [seqs[i].work(free) for i in step]
        want, got = eager.forward(work), graph.forward(work)
        what = f"{kind} {step} (uids {[seqs[i].uid for i in step]})"
        _close(got, want, what, op)
        assert torch.equal(sample(got, 0.0), sample(want, 0.0)), f"{what}: greedy tokens differ"
        for i, t in zip(step, sample(want, 0.0).tolist()):
            seqs[i].tokens.append(t)
        if kind == "decode" and graph.pool is not None:
            loads += sum(e[0] == "load" for e in graph.pool.events[mark:])
    return seqs, loads


# ---- the static path equals the eager path ----------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_graph_decode_equals_eager_across_buckets_blocks_adapters_and_slot_changes(backend, base, adapters):
    eager = _runner(base, _pool(adapters, 4), backend)
    graph = _runner(base, _pool(adapters, 4), backend, graph=True)
    g = graph.graph_runner
    seqs, loads = _trace(eager, graph, "triton" if backend == "triton" and CUDA else "matmul")
    assert g.steps == len(DECODES) and g.eager == {"prefill": len(PREFILLS)}, (g.steps, g.eager)
    assert {b for b, _ in g.replays} == set(BUCKETS) and (2, False) in g.replays, g.replays
    assert g.padding_rows == sum(bucket_for(len(s), BUCKETS) - len(s) for s in DECODES) > 0
    if CUDA:
        assert all(gr is not None for gr, _ in g.graphs.values()), "no CUDA graph was captured"
    assert len(g.graphs) == 2 * len(BUCKETS)  # a LoRA graph and a base-only graph per bucket
    assert loads >= 2, "slots should change owner between decode steps"
    assert max(len(s.table) for s in seqs) > min(len(s.table) for s in seqs)
    # padding wrote only the scratch block: the real blocks hold NaN exactly where the eager cache does
    for name in ("k", "v"):
        got, want = getattr(graph.kv_cache, name), getattr(eager.kv_cache, name)
        real = got[:, :NUM_BLOCKS].isnan()
        assert torch.equal(real, want[:, :NUM_BLOCKS].isnan()), f"{name}: padding wrote into a real block"
        scratch = got[:, graph.scratch_block]
        assert scratch[:, 0].isfinite().all() and scratch[:, 1:].isnan().all(), "padding writes scratch offset 0"
    assert eager.kv_cache.k[:, eager.scratch_block].isnan().all(), "the eager path never touches the scratch block"


@pytest.mark.parametrize("schedule", ["sorted", "grouped"])
def test_graph_decode_replays_the_decode_schedule_its_rule_picks(schedule, base, adapters):
    """The engine decodes through chapter 08's decode schedules (issue #35): ``schedule_rule`` (by
    default ``reference.ops.decode_schedule.choose_decode_schedule``) picks each step's from its real
    rows and distinct adapters; a bucket captures a LoRA graph per schedule the rule can pick for its
    sizes. Here the rule forces ``schedule`` from 2 rows: bucket 1 keeps its two graphs, the others get
    a third; the layers' decode ops see the views of the schedule replayed (a spy around the torch
    references); the logits stay the eager path's."""
    from reference.layers import get_backend
    from reference.ops import torch_ref
    from reference.ops.decode_schedule import choose_decode_schedule, schedule_parts

    seen = set()

    def spy(op):
        def run(*args, **kwargs):
            seen.add((args[2].shrink_schedule, args[2].expand_schedule))
            return op(*args, **kwargs)
        return run

    backend = get_backend("torch")._replace(name="spy", decode_shrink=spy(torch_ref.bgmv_shrink),
                                            decode_expand=spy(torch_ref.bgmv_expand))
    eager = _runner(base, _pool(adapters, 4))
    graph = _runner(base, _pool(adapters, 4), backend)
    g = enable_graph_decode(graph, max(BUCKETS), BUCKETS,
                            schedule_rule=lambda tokens, adapters, rank: schedule if tokens >= 2 else "token")
    _trace(eager, graph)
    assert set(g.graphs) == {(b, lora) for b in BUCKETS for lora in (True, False)} | {(b, schedule) for b in (2, 4, 8)}
    # the trace's steps of 2+ rows with an adapter (its one 2-row step is base-only: [5, 1])
    assert {b for (b, lora) in g.replays if lora == schedule} == {4, 8}, g.replays
    assert {lora for (b, lora) in g.replays if b == 1} <= {True, False}
    assert schedule_parts(schedule) in seen and ("token", "token") in seen
    assert enable_graph_decode(_runner(base, _pool(adapters, 4)), 2).schedule_rule is choose_decode_schedule


@pytest.mark.parametrize("schedule", ["token", "grouped"])
def test_shrinks_on_a_side_stream_give_the_same_logits_eager_and_replayed(schedule, base, adapters):
    """``LoRAContext.overlap_shrink`` (``EngineConfig.overlap_lora_shrink``): every layer's shrink on a
    side stream beside its base GEMM, joined before the expand, in the eager prefill steps and inside
    the captured decode graphs (the fork and join are graph edges), with the packed projections and
    the fused decoder the runner takes on a GPU; the grouped schedule's split-K partials are summed on
    the side stream too. The logits equal the in-line runner's exactly on a GPU (same kernels, same
    inputs, only the stream differs); on the CPU the flag changes nothing (no stream)."""
    backend = "triton" if CUDA else "torch"
    rule = lambda tokens, n, rank: schedule if tokens >= 2 else "token"  # noqa: E731
    inline = _runner(base, _pool(adapters, 4), backend)
    enable_graph_decode(inline, max(BUCKETS), BUCKETS, schedule_rule=rule)
    context = LoRAContext(overlap_shrink=True)
    side = ModelRunner(copy.deepcopy(base), _pool(adapters, 4), context, NUM_BLOCKS, BLOCK_SIZE, backend)
    side.kv_cache.k.fill_(float("nan"))
    side.kv_cache.v.fill_(float("nan"))
    enable_graph_decode(side, max(BUCKETS), BUCKETS, schedule_rule=rule)
    seqs, free = _seqs(), torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(5)).tolist()
    for kind, step in [("prefill", s) for s in PREFILLS] + [("decode", s) for s in DECODES]:
        work = [seqs[i].work(free) for i in step]
        want, got = inline.forward(work), side.forward(work)
        if CUDA:  # exact: the same kernels on the same inputs, only the stream differs
            assert torch.equal(got, want), f"{kind} {step}: logits differ with the shrinks on a side stream"
        else:
            _close(got, want, f"{kind} {step}")
        for i, t in zip(step, sample(want, 0.0).tolist()):
            seqs[i].tokens.append(t)
    if CUDA:
        assert context._side_streams, "no shrink ran on the side stream"
    if schedule != "token":  # the trace's 4- and 8-row steps replay the grouped graphs
        assert any(lora == schedule for (b, lora) in side.graph_runner.replays), side.graph_runner.replays
    with pytest.raises(ValueError, match="overlap_shrink must be True or False"):
        LoRAContext(overlap_shrink=1)
    assert LoRAContext(overlap_shrink=True).side_stream(torch.zeros(1)) is None


def test_static_buffers_never_move_and_base_only_steps_replay_the_base_graph(base, adapters):
    graph = _runner(base, _pool(adapters, 4), graph=True)
    g = graph.graph_runner
    seqs, free = _seqs(), list(range(NUM_BLOCKS))
    g.capture()
    ptrs = (g.inputs.data_ptrs(), g.static.data_ptrs())
    for step in ([1, 5, 0], [1, 5], [5], [1], [0, 1]):  # prefill; base rows only; an adapter beside one
        logits = graph.forward([seqs[i].work(free) for i in step])
        for i, t in zip(step, sample(logits, 0.0).tolist()):
            seqs[i].tokens.append(t)
    assert g.replays == {(2, False): 1, (1, False): 2, (2, True): 1}, g.replays
    assert (g.inputs.data_ptrs(), g.static.data_ptrs()) == ptrs, "a static buffer was reallocated"


# ---- the pieces ------------------------------------------------------------------------------------
def test_static_inputs_running_example_and_refusals():
    inputs = StaticDecodeInputs(max_seqs=4, max_blocks=3, block_size=4, scratch_block=9)
    ptrs = inputs.data_ptrs()
    inputs.update([SeqWork([5], 6, [2, 7]), SeqWork([8], 0, [4, 1])], bucket=4)
    b = inputs.buffers
    assert b["input_ids"].tolist() == [5, 8, 0, 0] and b["positions"].tolist() == [6, 0, 0, 0]
    assert b["slot_mapping"].tolist() == [30, 16, 36, 36] and b["context_lens"].tolist() == [7, 1, 1, 1]
    assert b["block_tables"].tolist() == [[2, 7, 9], [4, 9, 9], [9, 9, 9], [9, 9, 9]]
    meta = inputs.metadata(2)
    assert meta.block_tables.shape == (2, 3) and meta.max_query_len == 1
    assert meta.token_seq.tolist() == meta.last_token.tolist() == [0, 1] and meta.token_local.tolist() == [0, 0]
    assert meta is inputs.metadata(2) and meta.positions.data_ptr() == ptrs["positions"]
    before = {k: v.clone() for k, v in b.items()}
    for work, bucket, msg in [([SeqWork([1], 0, [0])] * 3, 2, "n <= bucket"), ([], 5, "n <= bucket"),
                              ([SeqWork([1], 12, [0, 1, 2, 3])], 1, "max_blocks")]:
        with pytest.raises(ValueError, match=msg):
            inputs.update(work, bucket)
        assert all(torch.equal(before[k], v) for k, v in b.items()), msg
    assert inputs.data_ptrs() == ptrs
    with pytest.raises(ValueError, match="bucket"):
        inputs.metadata(5)
    with pytest.raises(ValueError, match=">= 1"):
        StaticDecodeInputs(0, 3, 4, 9)


def test_steps_sent_back_to_the_eager_path_say_why_and_stay_correct(base, adapters):
    eager, graph = _runner(base, None), _runner(base, None, graph=True, buckets=(1, 2))
    g = graph.graph_runner
    seqs, free = _seqs(), list(range(NUM_BLOCKS))
    for i in (1, 5, 6):
        seqs[i].uid = None
    prompts = [seqs[i].work(free) for i in (1, 5, 6)]
    _close(graph.forward(prompts), eager.forward(prompts), "prefill")
    work = [SeqWork([7], w.start + len(w.token_ids), w.block_table + [free.pop()]) for w in prompts]
    _close(graph.forward(work), eager.forward(work), "3 sequences, largest bucket 2")
    assert g.steps == 0 and g.eager == {"prefill": 1, "batch past the largest bucket": 1}
    # a pool whose every slot holds an adapter: no rank-0 slot for the padding rows
    full = _runner(base, _pool(adapters, 2, pin_base=False), graph=True)
    full.forward([SeqWork([1, 2], 0, [0], "qv"), SeqWork([3], 0, [1], "mlp")])
    full.forward([SeqWork([4], 2, [0], "qv")])
    assert full.graph_runner.steps == 0 and full.graph_runner.eager["no rank-0 slot for padding"] == 1
    with pytest.raises(ValueError, match="rank 0"):
        full.graph_runner.capture()
    # max_blocks is bounded by the cache: a table that reads a block twice reaches past it
    tiny = ModelRunner(copy.deepcopy(base), None, None, 2, BLOCK_SIZE)
    tg = enable_graph_decode(tiny, 2)
    assert tg.max_blocks == 2
    tiny.forward([SeqWork([1] * 8, 0, [0, 1])])
    tiny.forward([SeqWork([2], 8, [0, 1, 0])])
    assert tg.eager["context past max_blocks"] == 1
    with pytest.raises(ValueError, match="buckets"):
        PagedDecodeGraphRunner(tiny, 2, buckets=(1, 4))
    if not CUDA:
        with pytest.raises(ValueError, match="CUDA device"):
            PagedDecodeGraphRunner(tiny, 2, use_graphs=True)


def test_a_missed_slot_change_flag_serves_a_stale_adapter(base, adapters):
    """The stale-table bug of chapter 08 in the paged engine: the graph's per-slot ranks and
    scalings are rewritten only when the tracker says a slot changed owner."""
    def run(track):
        eager = _runner(base, _pool(adapters, 2))
        graph = _runner(base, _pool(adapters, 2), graph=True)
        if not track:
            graph.graph_runner.tracker.poll = lambda: False  # the bug: ownership changes go unnoticed
        out = []
        for work in ([SeqWork([1, 2, 3], 0, [0], "all")], [SeqWork([4], 3, [0], "all")],  # captures: "all" in slot 1
                     [SeqWork([5, 6], 0, [1], "one")], [SeqWork([7], 2, [1], "one")]):  # "one" replaces it
            out.append((graph.forward(work), eager.forward(work)))
        assert ("evict", "all", 1) in graph.pool.events
        return out[-1]

    _close(*run(track=True), "with the change flag")
    stale, want = run(track=False)
    assert (stale - want).abs().max() > 1e-3 * want.abs().max(), "the stale scaling went unnoticed"


def test_a_pool_log_trimmed_between_steps_loses_no_slot_change(base, adapters):
    """A long-running server empties the pool's event log between requests. Emptied under the slot
    tracker (which reads from its last position), the next load went unseen and the graphs kept the
    evicted adapter's rank and scaling (the GPU server's adapter tokens differed from PEFT's);
    ``trim_pool_events`` lets the tracker poll first and start again at the log's beginning."""
    def run(trim):
        eager = _runner(base, _pool(adapters, 2))
        graph = _runner(base, _pool(adapters, 2), graph=True)
        out = []
        for k, work in enumerate(([SeqWork([1, 2, 3], 0, [0], "all")], [SeqWork([4], 3, [0], "all")],
                                  [SeqWork([5, 6], 0, [1], "one")], [SeqWork([7], 2, [1], "one")])):
            out.append((graph.forward(work), eager.forward(work)))
            if k == 1:  # "all" finished: the log is emptied before "one" replaces it in slot 1
                trim(graph)
        return out[-1]

    def emptied_under_the_tracker(graph):
        del graph.pool.events[:]

    _close(*run(lambda graph: graph.graph_runner.trim_pool_events()), "with the log trimmed through the runner")
    stale, want = run(emptied_under_the_tracker)
    assert (stale - want).abs().max() > 1e-3 * want.abs().max(), "a log emptied under the tracker went unnoticed"


# ---- GPU only: what a replay does ------------------------------------------------------------------
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_replay_reads_no_device_value_and_allocates_only_its_output(backend, base, adapters):
    """Replays with slot changes between them equal eager; a step whose adapters are resident (a
    load copies weights, which synchronizes: chapter 06) runs with no device read at all and
    allocates nothing but the copy of the real rows' logits."""
    op = "triton" if backend == "triton" else "matmul"
    eager = _runner(base, _pool(adapters, 4), backend)
    graph = _runner(base, _pool(adapters, 4), backend, graph=True)
    g = graph.graph_runner
    seqs, _ = _trace(eager, graph, op)  # warm: every bucket replayed
    assert {gr.pool() for gr, _ in g.graphs.values()} == {g.mempool}, "every graph should share one memory pool"
    free = [b for b in range(NUM_BLOCKS) if all(b not in s.table for s in seqs)]

    def step(batch, strict):
        work = [seqs[i].work(free) for i in batch]
        torch.cuda.synchronize()
        allocs = torch.cuda.memory_stats()["allocation.all.allocated"]
        torch.cuda.set_sync_debug_mode("error" if strict else 0)  # a device read (.item(), a sync copy) raises
        try:
            got = graph.forward(work)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        if strict:
            assert torch.cuda.memory_stats()["allocation.all.allocated"] - allocs == 1, "only the returned copy"
        want = eager.forward(work)
        _close(got, want, f"replay {batch} ({'resident adapters' if strict else 'after slot changes'})", op)
        for i, t in zip(batch, sample(want, 0.0).tolist()):
            seqs[i].tokens.append(t)

    for batch in ([0, 2, 1], [3, 6, 5], [4, 2, 0, 1]):  # qv/mlp, then all/one, then qv/mlp: slots change
        step(batch, strict=False)
        step(batch, strict=True)  # the same adapters again: every one a hit
    assert g.steps == len(DECODES) + 6
