"""Chapter 11's model runner: a Llama forward over a paged KV cache equals Hugging Face and PEFT.

Block tables are shuffled and non-contiguous, every unwritten cache entry is NaN (so a read of a
padding block, or of the tail of a sequence's last block, would show), prompts are computed in one
shot or in chunks mixed with other sequences' decode tokens, and a mixed-adapter batch runs through
a pool with fewer slots than adapters + base (evictions between batches). Then the refusals (nothing
written when one is raised) and the sampler.

On the CPU the LoRA runs use the torch backend (the Triton interpreter is slow); on a GPU the
Triton backend runs too.
"""
import copy
import warnings

import pytest
import torch

from reference.adapters import load_peft_adapter
from reference.engine.model_runner import (AttentionMetadata, ModelRunner, PagedKVCache, SeqWork,
                                           build_attention_metadata, paged_attention, sample)
from reference.layers import LoRAContext, uses_token_slots, wrap_llama
from reference.mem_pool import LoRAMemoryPool, ModuleSpec, snapshot_diff

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BACKENDS = ["torch"] + (["triton"] if CUDA else [])
CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
LAYERS, MAX_RANK, BLOCK_SIZE, NUM_BLOCKS = CFG["num_hidden_layers"], 8, 4, 48
MODULES = (ModuleSpec("qkv_proj", 64, (64, 32, 32)), ModuleSpec("o_proj", 64, (64,)),
           ModuleSpec("gate_up_proj", 64, (96, 96)), ModuleSpec("down_proj", 96, (64,)))
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=6, lora_alpha=12, target_modules=r".*\.mlp\.(gate|up|down)_proj"),
    "rs": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
}
ATOL, RTOL = 1e-5, 1e-4  # fp32; our attention sums in another order than HF's


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).to(DEVICE).eval()


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(300 + seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)
                                ).save_pretrained(root / name)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def peft_model(base, adapter_dirs):
    names = list(ADAPTERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dirs[names[0]], adapter_name=names[0])
        for name in names[1:]:
            pm.load_adapter(adapter_dirs[name], adapter_name=name)
    return pm.eval()


@pytest.fixture(scope="module")
def adapters(adapter_dirs):
    return {name: load_peft_adapter(adapter_dirs[name], MODULES, LAYERS, MAX_RANK, uid=name) for name in ADAPTERS}


# ---- the test's control plane: a shuffled free list and sequences that own blocks ----------------
class Blocks:
    """Free blocks in a shuffled order: sequences get non-contiguous, out-of-order block tables."""

    def __init__(self, seed: int) -> None:
        self.free = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()

    def grow(self, table: list, length: int) -> None:
        while len(table) * BLOCK_SIZE < length:
            table.append(self.free.pop())


class Seq:
    """A sequence's tokens, how many of them are in the cache, its block table and adapter."""

    def __init__(self, prompt, uid=None) -> None:
        self.tokens, self.cached, self.table, self.uid = list(prompt), 0, [], uid

    def work(self, n: int, blocks: Blocks) -> SeqWork:
        """The next n uncached tokens (a prefill chunk, or the last token at decode)."""
        blocks.grow(self.table, self.cached + n)
        w = SeqWork(self.tokens[self.cached:self.cached + n], self.cached, list(self.table), self.uid)
        self.cached += n
        return w


def _runner(base, pool=None, context=None, backend="torch", **kw):
    runner = ModelRunner(copy.deepcopy(base), pool, context, NUM_BLOCKS, BLOCK_SIZE, backend, **kw)
    runner.kv_cache.k.fill_(float("nan"))  # every entry not written by the runner is NaN
    runner.kv_cache.v.fill_(float("nan"))
    return runner


def _hf_last(model, tokens, uid=None, use_peft=False):
    with torch.inference_mode():
        ids = torch.tensor([tokens], device=DEVICE)
        out = model(input_ids=ids, adapter_names=[uid or "__base__"]) if use_peft else model(input_ids=ids)
    return out.logits[0, -1].float()


def _close(got, want, what):
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= ATOL + RTOL * scale, f"{what}: max abs error {err:.3g}, scale {scale:.3g}"


def _step(runner, batch, blocks, chunks=None):
    """One forward over every uncached token of each sequence (or ``chunks[i]`` of them); a sequence
    whose tokens are all cached afterwards gets its greedy next token appended. Returns (logits, work)."""
    chunks = chunks or [None] * len(batch)
    work = [s.work(len(s.tokens) - s.cached if n is None else n, blocks) for s, n in zip(batch, chunks)]
    logits = runner.forward(work)
    for s, t in zip(batch, sample(logits, 0.0).tolist()):
        if s.cached == len(s.tokens):
            s.tokens.append(t)
    return logits, work


def _check(model, batch, work, logits, what, use_peft=False):
    """Each row equals HF's (or PEFT's, with the sequence's adapter alone) last logits of the
    sequence up to the work's last token."""
    for i, (s, w) in enumerate(zip(batch, work)):
        end = w.start + len(w.token_ids)
        want = _hf_last(model, s.tokens[:end], s.uid, use_peft)
        _close(logits[i], want, f"{what}: row {i} (uid {s.uid!r}, positions {w.start}..{end - 1})")


def _prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist() for n in lengths]


# ---- base model ---------------------------------------------------------------------------------
def test_base_prefill_and_decode_equal_hf_with_shuffled_blocks(base):
    runner, blocks = _runner(base), Blocks(seed=1)
    seqs = [Seq(p) for p in _prompts(0, (5, 9, 1, 4))]
    logits, work = _step(runner, seqs, blocks)  # one batch of four prompts
    assert logits.shape == (4, CFG["vocab_size"]) and logits.dtype == torch.float32
    _check(base, seqs, work, logits, "prefill")
    for step in range(4):
        logits, work = _step(runner, seqs, blocks)
        assert all(len(w.token_ids) == 1 for w in work)
        _check(base, seqs, work, logits, f"decode step {step}")
    tables = [s.table for s in seqs if len(s.table) > 1]
    assert any(t != list(range(t[0], t[0] + len(t))) for t in tables), "block tables should be non-contiguous"


def test_chunked_prefill_mixed_with_decode_equals_one_shot(base):
    runner, blocks = _runner(base), Blocks(seed=2)
    prompts = _prompts(1, (11, 3, 6))
    long, others = Seq(prompts[0]), [Seq(p) for p in prompts[1:]]
    batch = [others[0], long, others[1]]
    # forward 1: the others' prompts and chunk 1 (3 tokens); forwards 2, 3: their decode tokens beside
    # chunks 2 (6 tokens) and 3 (2 tokens), which start and end in the middle of blocks
    for k, n in enumerate((3, 6, 2)):
        logits, work = _step(runner, batch, blocks, [None, n, None])
        _check(base, batch, work, logits, f"forward {k} (chunk of {n})")
    assert long.cached == 11 and len(long.tokens) == 12
    one_shot, _ = _step(_runner(base), [Seq(prompts[0])], Blocks(seed=3))
    _close(logits[1], one_shot[0], "three chunks vs one shot")


# ---- LoRA: a mixed batch through a pool that must evict ------------------------------------------
# the decoder's two paths: Hugging Face's modules, and the fused one (fused elementwise kernels, with the
# q|k|v and gate|up projections packed into one GEMM and one LoRA expand each, or left separate)
DECODERS = {"hf": dict(fused_ops=False), "fused_packed": dict(fused_ops=True),
            "fused_separate": dict(fused_ops=True, packed_projections=False),
            # and the LoRA rows of a step with prompt tokens grouped by slot (one SGMV segment per slot)
            "hf_sorted": dict(fused_ops=False, sort_lora_by_slot=True),
            "fused_packed_sorted": dict(fused_ops=True, sort_lora_by_slot=True)}


@pytest.mark.parametrize("decoder", list(DECODERS))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_adapters_with_evictions_equal_peft(backend, decoder, base, adapters, peft_model):
    pool = LoRAMemoryPool(MODULES, LAYERS, 3, MAX_RANK, device=DEVICE, adapter_source=adapters.__getitem__)
    context = LoRAContext()
    runner, blocks = _runner(base, pool, context, backend, **DECODERS[decoder]), Blocks(seed=4)
    assert runner.packed_projections == decoder.startswith("fused_packed")
    if runner.packed_projections:  # every layer packed, each with its pool module's LoRA
        assert all(qkv.lora.spec.name == "qkv_proj" and gu.lora.spec.name == "gate_up_proj" for qkv, gu in runner.packed)
    uids = ["qv", None, "mlp", "rs", "qv"]
    A, B, C, D, E = [Seq(p, u) for p, u in zip(_prompts(2, (6, 3, 5, 7, 2)), uids)]
    # 3 slots for 3 adapters + the base: every batch below evicts someone
    # the second step: D and E's prompts beside B's and A's decode tokens, A and E on one adapter
    for what, batch in [("prefill", (A, B, C)), ("prefill beside decode tokens", (D, B, E, A)),
                        ("decode", (A, C, B)), ("decode", (D, E, B)), ("decode", (C, A)), ("decode", (D, C, B))]:
        logits, work = _step(runner, batch, blocks)
        _check(peft_model, batch, work, logits, what, use_peft=True)
        info = context.batch_info
        grouped = runner.sort_lora_by_slot and what != "decode"
        # grouped: one segment per distinct slot (A and E share one); else one per sequence
        assert info.num_segments == (len({s.uid for s in batch}) if grouped else len(batch)), (what, info)
        if what == "decode":
            assert uses_token_slots(context.batch_info), "a decode batch should take the BGMV ops"
    assert sum(e[0] == "evict" for e in pool.events) >= 4, pool.events


def test_runner_accepts_a_wrapped_model_and_refuses_mismatches(base, adapters):
    pool = LoRAMemoryPool(MODULES, LAYERS, 2, MAX_RANK, device=DEVICE, adapter_source=adapters.__getitem__)
    context = LoRAContext()
    wrapped = wrap_llama(copy.deepcopy(base), pool, context, "torch")
    runner = ModelRunner(wrapped, pool, context, 4, BLOCK_SIZE, "torch")
    assert runner.model is wrapped
    for args, msg in [((wrapped, None, None, "torch"), "no pool"), ((wrapped, pool, None, "torch"), "LoRAContext"),
                      ((wrapped, pool, context, "triton"), "backend")]:
        model, p, c, backend = args
        with pytest.raises(ValueError, match=msg):
            ModelRunner(model, p, c, 4, BLOCK_SIZE, backend)
    with pytest.raises(ValueError, match="no pool"):
        _runner(base).forward([SeqWork([1], 0, [0], "qv")])


def test_fused_ops_default_follows_the_device_and_refuses_what_it_cannot_run(base):
    assert ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE).fused_ops == (DEVICE == "cuda")
    with pytest.raises(ValueError, match="fused_ops must be"):
        ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE, fused_ops="yes")
    gelu = copy.deepcopy(base)
    gelu.config.hidden_act = "gelu"  # the kernel is SiLU-and-mul: another activation keeps the torch ops
    with pytest.raises(ValueError, match="SiLU"):
        ModelRunner(gelu, None, None, 4, BLOCK_SIZE, fused_ops=True)
    assert not ModelRunner(gelu, None, None, 4, BLOCK_SIZE).fused_ops
    # helper-33: a head_dim that is not a power of two (OpenLLaMA-3B's 100) crashed the first forward
    # on CUDA; it is refused when asked for and left to the torch ops by default
    odd = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**CFG, "hidden_size": 96, "num_attention_heads": 2,
                                                                     "num_key_value_heads": 2})).eval()
    with pytest.raises(ValueError, match="power of two"):
        ModelRunner(odd, None, None, 4, BLOCK_SIZE, fused_ops=True)
    assert not ModelRunner(odd, None, None, 4, BLOCK_SIZE).fused_ops


def test_packed_projections_follow_fused_ops_and_refuse_bad_values(base):
    assert ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE).packed_projections == (DEVICE == "cuda")
    runner = ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE, fused_ops=True)
    assert runner.packed_projections and all(qkv.lora is None and gu.lora is None for qkv, gu in runner.packed)
    assert not ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE, fused_ops=True,
                           packed_projections=False).packed_projections
    with pytest.raises(ValueError, match="packed_projections must be"):
        ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE, packed_projections=1)
    with pytest.raises(ValueError, match="needs fused_ops"):
        ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE, fused_ops=False, packed_projections=True)
    with pytest.raises(ValueError, match="sort_lora_by_slot must be"):
        ModelRunner(copy.deepcopy(base), None, None, 4, BLOCK_SIZE, sort_lora_by_slot=1)


# ---- refusals: nothing is written -----------------------------------------------------------------
def test_bad_work_raises_and_writes_nothing(base, adapters):
    pool = LoRAMemoryPool(MODULES, LAYERS, 2, MAX_RANK, device=DEVICE, adapter_source=adapters.__getitem__)
    runner = _runner(base, pool, LoRAContext())
    runner.forward([SeqWork([1, 2, 3, 4, 5], 0, [3, 8], "qv")])
    good = SeqWork([6], 5, [3, 8], "qv")  # valid on its own: its write must not happen either
    cases = [
        ([], "empty batch"),
        ([SeqWork([], 0, [1])], "non-empty"),
        ([good, SeqWork([1, 2, 3, 4, 5], 0, [1])], "need 2"),  # 5 positions need 2 blocks of 4
        ([good, SeqWork([1], 0, [NUM_BLOCKS])], "outside"),
        ([good, SeqWork([1], 0, [-1])], "outside"),
        ([good, SeqWork([1, 2], 63, list(range(16)))], "max_position_embeddings"),
        ([good, SeqWork([1], -1, [0])], "start"),
        ([good, SeqWork([CFG["vocab_size"]], 0, [0])], "token ids"),
        ([good, SeqWork([1, 2], 4, [0, 8])], "both write"),  # position 5 in block 8 offset 1, as `good`
        ([good, SeqWork([1], 0, [0], "nope")], "unknown adapter"),
        ([good, SeqWork([1], 0, [0], "rs"), SeqWork([1], 0, [1], "mlp")], "slots"),
    ]
    k, v, snap = runner.kv_cache.k.clone(), runner.kv_cache.v.clone(), pool.snapshot()
    for work, msg in cases:
        with pytest.raises(ValueError, match=msg):
            runner.forward(work)
        for got, want, name in ((runner.kv_cache.k, k, "k"), (runner.kv_cache.v, v, "v")):
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num()), \
                f"{msg}: the {name} cache changed"
        assert snapshot_diff(pool.snapshot(), snap) == [], msg
    top, table = CFG["max_position_embeddings"] - 1, list(range(16, 32))
    runner.forward([SeqWork([2] * top, 0, table)])
    last = runner.forward([SeqWork([1], top, table)])  # the last position the model has
    assert last.shape == (1, CFG["vocab_size"]) and last.isfinite().all()


# ---- the pieces ------------------------------------------------------------------------------------
def test_attention_metadata_running_example():
    work = [SeqWork([1, 2, 3], 0, [5, 1]), SeqWork([4], 6, [0, 3, 9])]
    meta = build_attention_metadata(work, 4, "cpu")
    assert isinstance(meta, AttentionMetadata)
    assert meta.positions.tolist() == [0, 1, 2, 6] and meta.slot_mapping.tolist() == [20, 21, 22, 14]
    assert meta.token_seq.tolist() == [0, 0, 0, 1] and meta.token_local.tolist() == [0, 1, 2, 0]
    assert meta.block_tables.tolist() == [[5, 0], [0, 3]]  # only the blocks positions 0..len-1 need
    assert meta.context_lens.tolist() == [3, 7] and meta.last_token.tolist() == [2, 3]
    assert meta.max_query_len == 3
    cache = PagedKVCache(1, 10, 4, 1, 2)
    assert cache.slot([7, 2, 5], 9) == (5, 1) and cache.num_blocks == 10 and cache.block_size == 4


def test_paged_attention_equals_dense_causal_attention():
    """Random q/k/v, shuffled blocks, some positions already cached, NaN everywhere unwritten."""
    g = torch.Generator().manual_seed(5)
    heads, kv_heads, hd, bs, nb = 4, 2, 8, 4, 16
    lens, starts = [7, 1, 10], [0, 0, 6]  # total lengths, and positions cached before the call
    tables = torch.randperm(nb, generator=g).tolist()
    tables = [tables[0:2], tables[2:3], tables[3:6]]
    full_k = [torch.randn(n, kv_heads, hd, generator=g) for n in lens]
    full_v = [torch.randn(n, kv_heads, hd, generator=g) for n in lens]
    k_cache = torch.full((nb, bs, kv_heads, hd), float("nan"))
    v_cache = k_cache.clone()
    for t, K, V, s in zip(tables, full_k, full_v, starts):
        for p in range(s):
            k_cache[t[p // bs], p % bs], v_cache[t[p // bs], p % bs] = K[p], V[p]
    work = [SeqWork([0] * (n - s), s, t) for n, s, t in zip(lens, starts, tables)]
    meta = build_attention_metadata(work, bs, "cpu")
    q = torch.randn(len(meta.positions), heads, hd, generator=g)
    k = torch.cat([K[s:] for K, s in zip(full_k, starts)])
    v = torch.cat([V[s:] for V, s in zip(full_v, starts)])
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    for t_i, (p, s_i) in enumerate(zip(meta.positions.tolist(), meta.token_seq.tolist())):
        K = full_k[s_i][:p + 1].repeat_interleave(heads // kv_heads, dim=1)  # [p+1, heads, hd]
        V = full_v[s_i][:p + 1].repeat_interleave(heads // kv_heads, dim=1)
        w = torch.softmax(torch.einsum("hd,phd->hp", q[t_i], K) / hd ** 0.5, dim=-1)
        torch.testing.assert_close(out[t_i], torch.einsum("hp,phd->hd", w, V).reshape(-1), atol=1e-5, rtol=1e-5)
    for t, K, n in zip(tables, full_k, lens):  # every position of every sequence is now in its slot
        for p in range(n):
            assert torch.equal(k_cache[t[p // bs], p % bs], K[p])


def test_sample_greedy_and_seeded():
    assert sample(torch.tensor([1.0, 3.0, 3.0, 2.0]), 0.0).item() == 1  # a tie goes to the lowest id
    assert sample(torch.tensor([[0.0, 5.0, 5.0], [7.0, 7.0, 1.0]]), 0).tolist() == [1, 0]
    logits = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))

    def draws(seed, temperature=0.8, n=20):
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits, temperature, gen).tolist() for _ in range(n)]

    assert draws(7) == draws(7) and draws(7) != draws(8)
    flat = torch.zeros(64)
    gen = torch.Generator().manual_seed(1)
    picks = [sample(flat, 1.0, gen).item() for _ in range(50)]
    assert sample(flat, 0.0).item() == 0 and len(set(picks)) > 10 and set(picks) != {0}
    assert sample(logits, 0.5, gen).shape == (4,) and sample(logits[0], 0.5, gen).shape == ()
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            sample(logits, bad, gen)
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(2, 2, 2), 0.0)
