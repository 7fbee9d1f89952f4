"""Chapter 11's judge: the engine's greedy output, request by request, token for token equal to
PEFT's own greedy ``generate`` of that request alone.

The workload (issue #15): 8 PEFT adapters of different ranks and targets plus base requests, shared
prefixes within and across adapters, a GPU pool of 3 slots and a CPU tier of 4 copies for 8 adapters
(evictions from both tiers), a KV cache small enough to force preemption, prompts longer than the
token budget (chunked prefill). fp32, on the CPU (and on CUDA when present). Bad requests get an
error and leave the others' outputs unchanged.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import random
import warnings

import pytest
import torch
import transformers

from reference.engine.llm import LLM, EngineConfig, EnginePolicies, engine_step
from reference.engine.model_runner import SeqWork
from reference.engine.policies import block_hashes
from reference.engine.sequence import SamplingParams

peft = pytest.importorskip("peft")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
ADAPTERS = {  # ranks 1-16, every kind of target, rsLoRA, alpha != r
    "a0": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "a1": dict(r=8, lora_alpha=16, target_modules=["k_proj", "v_proj"]),
    "a2": dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "a3": dict(r=2, lora_alpha=3, target_modules=["o_proj", "down_proj"]),
    "a4": dict(r=6, lora_alpha=12, target_modules=r".*\.mlp\.(gate|up|down)_proj"),
    "a5": dict(r=1, lora_alpha=4, target_modules=["q_proj"]),
    "a6": dict(r=12, lora_alpha=6, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "a7": dict(r=8, lora_alpha=32, target_modules=["gate_proj", "up_proj"]),
}
CONFIG = EngineConfig(max_loras_per_batch=3, max_lora_rank=16, max_loaded_loras=4, num_kv_blocks=24, block_size=4,
                      max_num_seqs=6, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_adapters")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(300 + seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)
                                ).save_pretrained(root / name)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def peft_model(base, adapter_dirs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dirs["a0"], adapter_name="a0")
        for name in list(ADAPTERS)[1:]:
            pm.load_adapter(adapter_dirs[name], adapter_name=name)
    return pm.to(DEVICE).eval()


def peft_greedy(pm, prompt, adapter, params: SamplingParams) -> list[int]:
    """PEFT's greedy generate of one request alone, cut at the first stop token (kept)."""
    ids = torch.tensor([prompt], device=DEVICE)
    kw = dict(max_new_tokens=params.max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if adapter is None:
            with pm.disable_adapter():
                out = pm.generate(input_ids=ids, **kw)
        else:
            pm.set_adapter(adapter)
            out = pm.generate(input_ids=ids, **kw)
    tokens = out[0, len(prompt):].tolist()
    for i, t in enumerate(tokens):
        if t in params.stop_token_ids:
            return tokens[:i + 1]
    return tokens


_PEFT_WANTS: dict = {}


def peft_want(pm, prompt, adapter, params: SamplingParams) -> list[int]:
    """:func:`peft_greedy`, computed once per module's PEFT model and request: the engine, graph
    and other-attention judges compare three engine runs of the same workload with the same PEFT
    tokens (each recomputed them: about 50 generate calls per judge). PEFT's greedy generate is a
    pure function of the model and the request, so the comparison is the same; the calls that check
    generate itself still call :func:`peft_greedy`."""
    key = (id(pm), tuple(prompt), adapter, repr(params))
    if key not in _PEFT_WANTS:
        _PEFT_WANTS[key] = (pm, peft_greedy(pm, prompt, adapter, params))  # pm kept: its id stays its own
    return list(_PEFT_WANTS[key][1])


# skewed, with reuse inside the CPU tier's 4 copies (a cycle over all 8 would never hit it under LRU)
ORDER = [None, "a0", "a1", "a2", "a0", "a3", "a1", "a4", "a5", "a0", "a6", "a7", "a2", "a0", None, "a3", "a1",
         "a0", "a7", "a6", "a2", "a5"]


def workload():
    g = torch.Generator().manual_seed(7)
    rand = lambda n: torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist()
    shared = rand(13)  # a system prompt: across adapters it must not be shared, within one it may
    prompts, names, params = [], [], []
    for i in range(22):
        name = ORDER[i]
        head = shared if i % 3 else []
        prompts.append(head + rand(3 + (i * 7) % 30))  # up to 45 tokens: longer than the 24-token budget
        names.append(name)
        params.append(SamplingParams(max_new_tokens=4 + i % 5, stop_token_ids=(i % 2 and 5,) if i % 2 else ()))
    prompts.append(list(prompts[1]))  # the very same request again: a full prefix hit
    names.append(names[1])
    params.append(params[1])
    return prompts, names, params


def make_engine(base, adapter_dirs, config=CONFIG, policies=EnginePolicies()):
    llm = LLM(copy.deepcopy(base), config, device=DEVICE, policies=policies)
    for name, path in adapter_dirs.items():
        llm.register_adapter(name, path)
    return llm


def run_workload(base, adapter_dirs, **config_changes):
    """(engine, outputs) of the judge's workload on an engine of CONFIG with ``config_changes``."""
    llm = make_engine(base, adapter_dirs, dataclasses.replace(CONFIG, **config_changes))
    prompts, names, params = workload()
    return llm, llm.generate(prompts, params, lora_request=names)


@pytest.fixture(scope="module")
def engine_run(base, adapter_dirs):
    llm = make_engine(base, adapter_dirs)
    prompts, names, params = workload()
    return llm, llm.generate(prompts, params, lora_request=names)


def test_every_request_equals_peft_generate_alone(engine_run, peft_model):
    llm, outs = engine_run
    prompts, names, params = workload()
    base_tokens = {}
    for out, prompt, name, p in zip(outs, prompts, names, params):
        assert out.error is None
        want = peft_want(peft_model, prompt, name, p)
        assert out.token_ids == want, f"request {out.request_id} ({name}): {out.token_ids} != PEFT {want}"
        base_tokens.setdefault(tuple(prompt), {})[name] = want
    # the adapters matter: some request's tokens differ from the base model's for the same prompt
    differs = sum(peft_want(peft_model, pr, None, p) != o.token_ids for pr, n, p, o in zip(prompts, names, params, outs)
                  if n is not None)
    assert differs >= 5


def test_a_prompt_cap_while_decoding_keeps_every_request_equal_to_peft(base, adapter_dirs, peft_model):
    """max_prefill_tokens_while_decoding (mixed steps, the engine's default): steps that decode carry
    at most 5 prompt tokens, so the prompts are chunked differently; the tokens stay PEFT's."""
    llm, outs = run_workload(base, adapter_dirs, max_prefill_tokens_while_decoding=5)
    prompts, names, params = workload()
    for out, prompt, name, p in zip(outs, prompts, names, params):
        assert out.error is None
        want = peft_want(peft_model, prompt, name, p)
        assert out.token_ids == want, f"request {out.request_id} ({name}): {out.token_ids} != PEFT {want}"
    assert llm.stats["mixed_steps"] >= 1, llm.stats


@pytest.fixture(scope="module")
def graph_run(base, adapter_dirs):
    return run_workload(base, adapter_dirs, cuda_graph=True, mixed_steps=False)


def test_graph_decode_every_request_equals_peft_generate_alone(graph_run, peft_model):
    """The judge again, every decode step through the graph runner: CUDA graphs replayed on a GPU,
    on the CPU the same static-shape step called (buckets 1, 2, 4, 6, padding rows in the steps of
    3 sequences; the pool has a slot more, pinned to the base model, for the padding). Prefill-first
    steps here (``mixed_steps=False``), so every decode step is a pure one the graph serves."""
    llm, outs = graph_run
    prompts, names, params = workload()
    for out, prompt, name, p in zip(outs, prompts, names, params):
        assert out.error is None
        want = peft_want(peft_model, prompt, name, p)
        assert out.token_ids == want, f"request {out.request_id} ({name}): {out.token_ids} != PEFT {want}"
    s = llm.stats
    assert s["decode_mode"] == ("cuda_graph" if DEVICE == "cuda" else "static"), s
    assert s["graph_decode_steps"] == s["decode_steps"] > 0 and s["graph_fallbacks"] == {}, s
    assert s["preemptions"] >= 1 and {"evict", "cpu_evict"} <= set(s["pool_events"]), s
    assert llm.pool.num_slots == CONFIG.max_loras_per_batch + 1 and None in llm.pool.pinned
    graph = llm.runner.graph_runner
    assert graph.buckets == (1, 2, 4, 6) and len(graph.graphs) == 8, graph.graphs  # LoRA and base-only
    assert any(lora for _, lora in graph.replays) and len(graph.replays) > 1, graph.replays
    assert graph.padding_rows > 0


# the attention kernel and the layer's elementwise ops the device does not default to: on the CPU the
# Triton kernels (interpreted), on CUDA the torch gather path and Hugging Face's torch ops; both
# through graph decode and the eager prefill/chunk steps
OTHER_ATTENTION = "triton" if DEVICE == "cpu" else "torch"
OTHER_FUSED = DEVICE == "cpu"


@pytest.fixture(scope="module")
def other_attention_run(base, adapter_dirs):
    return run_workload(base, adapter_dirs, cuda_graph=True, attention_backend=OTHER_ATTENTION, fused_ops=OTHER_FUSED)


def test_the_other_attention_kernel_equals_peft_generate_alone(other_attention_run, peft_model):
    """The judge once more with the attention path and the elementwise ops (fused Triton kernels or
    the torch ops) this device does not take by default, so both are judged on both devices
    (prefill, chunks over a cached prefix, graph decode)."""
    llm, outs = other_attention_run
    assert llm.runner.attention_backend == OTHER_ATTENTION and llm.runner.fused_ops == OTHER_FUSED
    prompts, names, params = workload()
    for out, prompt, name, p in zip(outs, prompts, names, params):
        assert out.error is None
        want = peft_want(peft_model, prompt, name, p)
        assert out.token_ids == want, f"request {out.request_id} ({name}): {out.token_ids} != PEFT {want}"
    assert llm.stats["graph_decode_steps"] > 0 and llm.stats["preemptions"] >= 1, llm.stats


def test_requests_added_while_others_run_join_the_batch_and_equal_peft(base, adapter_dirs, peft_model):
    """vLLM's add_request / step shape: three requests arrive at steps 0, 2 and 5 of a running
    engine, each joins the running batch (a step holds tokens of an earlier and a later arrival),
    step() returns each as it finishes, and every output equals PEFT's greedy generate alone."""
    llm = make_engine(base, adapter_dirs)
    prompts, names, _ = workload()
    params = SamplingParams(max_new_tokens=8)
    arrivals = {0: 3, 2: 5, 5: 1}
    outs, finished, step_no, seen_together = {}, [], 0, False
    while step_no in arrivals or llm.has_unfinished() or step_no < max(arrivals):
        if step_no in arrivals:
            i = arrivals[step_no]
            outs[i] = llm.add_request(prompts[i], params, names[i])
        if step_no >= 1 and not outs.get(2):
            with pytest.raises(RuntimeError, match="unfinished"):
                llm.generate([[1, 2]])
        finished += llm.step()
        seen_together |= len({e[1] for e in llm.scheduler.events[-4:] if e[0] in ("decode", "prefill")}) >= 2
        step_no += 1
        assert step_no < 200
    assert sorted(o.request_id for o in finished) == sorted(o.request_id for o in outs.values())
    assert seen_together
    for i, out in outs.items():
        assert out.error is None and out.finish_reason == "length" and len(out.token_times) == 8
        assert out.token_ids == peft_greedy(peft_model, prompts[i], names[i], params), i
        assert all(0 <= a <= b for a, b in zip(out.token_times, out.token_times[1:]))
    assert llm.step() == [] and llm.stats["steps"] >= 1
    assert llm.generate([prompts[0]], params, lora_request=[names[0]])[0].token_ids == \
        peft_greedy(peft_model, prompts[0], names[0], params)  # generate works again after the run
    bad = llm.add_request([], params)
    assert bad.error and not llm.has_unfinished()


def test_eager_decode_is_the_default_on_the_cpu(engine_run):
    llm, _ = engine_run
    if DEVICE == "cuda":
        assert llm.stats["decode_mode"] == "cuda_graph" and llm.stats["graph_decode_steps"] > 0
        return
    assert llm.runner.graph_runner is None and llm.pool.num_slots == CONFIG.max_loras_per_batch
    assert llm.stats["decode_mode"] == "eager" and llm.stats["graph_decode_steps"] == 0
    with pytest.raises(ValueError, match="cuda_graph"):
        LLM(copy.deepcopy(llm.model), dataclasses.replace(CONFIG, cuda_graph="yes"))


def test_the_workload_exercised_every_mechanism(engine_run):
    llm, _ = engine_run
    s = llm.stats
    assert s["preemptions"] >= 1, s
    assert s["mixed_steps"] >= 1, s  # decodes rode along with prefill chunks (the engine's default)
    assert s["prefix_hit_tokens"] > 0 and 0 < s["prefix_hit_rate"] < 1, s
    assert {"evict", "cpu_evict"} <= set(s["pool_events"]), s["pool_events"]
    prompts = workload()[0]
    chunks = [e for e in llm.scheduler.events if e[0] == "prefill" and e[3] - e[2] < len(prompts[e[1]])]
    assert chunks, "no prompt was prefilled in chunks"
    # admission preferring resident adapters groups the requests by adapter, so each was loaded from
    # disk once; an adapter evicted from its slot but still in the CPU tier comes back from there
    cached = [u for u in llm.pool.cpu_cache if u not in llm.pool.uid_to_buffer_id]
    assert cached, list(llm.pool.cpu_cache)
    name = cached[0].split("@")[0]
    mark = len(llm.pool.events)
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=1), lora_request=[name])
    assert ("load", cached[0]) == tuple(e for e in llm.pool.events[mark:] if e[0] == "load")[0][:2]
    assert [e[3] for e in llm.pool.events[mark:] if e[0] == "load"] == ["cpu"]


def test_an_adapter_blind_prefix_cache_serves_another_adapters_kv(base, adapter_dirs, peft_model):
    """The unsafe key (tokens only) lets a request reuse blocks another adapter computed: wrong tokens."""
    blind = EnginePolicies(block_hashes=lambda tokens, adapter_id, bs: block_hashes(tokens, "any", bs))
    prompt = list(range(40, 57))
    params = SamplingParams(max_new_tokens=6)
    config = EngineConfig(max_loras_per_batch=3, max_lora_rank=16, num_kv_blocks=24, block_size=4, max_num_seqs=1)
    outs = {}
    for label, policies in (("isolated", EnginePolicies()), ("blind", blind)):
        llm = make_engine(base, adapter_dirs, config, policies)
        outs[label] = llm.generate([prompt, prompt], params, lora_request=["a1", "a6"])  # one after the other
    want = peft_greedy(peft_model, prompt, "a6", params)
    assert outs["isolated"][1].token_ids == want
    assert outs["blind"][1].token_ids != want  # a6 read a1's K/V for the shared 16 tokens


def test_bad_requests_get_an_error_and_disturb_nothing(base, adapter_dirs, engine_run, tmp_path):
    _, good = engine_run
    prompts, names, params = workload()
    llm = make_engine(base, adapter_dirs)
    bad = [([1, 2, 3], "no-such-adapter", SamplingParams(max_new_tokens=3), "no adapter named"),
           (list(range(60)), None, SamplingParams(max_new_tokens=8), "context"),
           ([1, 2], None, SamplingParams(max_new_tokens=0), "max_new_tokens"),
           ([], None, SamplingParams(max_new_tokens=2), "empty"),
           ([1, 500], None, SamplingParams(max_new_tokens=2), "token ids")]
    mixed_prompts = [b[0] for b in bad[:2]] + prompts + [b[0] for b in bad[2:]]
    mixed_names = [b[1] for b in bad[:2]] + names + [b[1] for b in bad[2:]]
    mixed_params = [b[2] for b in bad[:2]] + params + [b[2] for b in bad[2:]]
    outs = llm.generate(mixed_prompts, mixed_params, lora_request=mixed_names)
    refused = outs[:2] + outs[-3:]
    for out, (_, _, _, words) in zip(refused, bad):
        assert out.error and words in out.error and out.token_ids == []
    assert [o.token_ids for o in outs[2:-3]] == [o.token_ids for o in good]


def test_a_malformed_adapter_folder_changes_nothing(base, adapter_dirs, tmp_path):
    llm = make_engine(base, adapter_dirs)
    before = (dict(llm.registry._current), llm.pool.snapshot())
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                                              "peft_type": "LORA"}))
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError):
        llm.register_adapter("a0", broken)
    with pytest.raises(FileNotFoundError):
        llm.register_adapter("a9", tmp_path / "missing")
    assert dict(llm.registry._current) == before[0]
    from reference.mem_pool import snapshot_diff
    assert snapshot_diff(before[1], llm.pool.snapshot()) == []


def test_a_re_registered_name_serves_its_new_weights_and_never_the_old_kv(base, adapter_dirs, peft_model):
    llm = make_engine(base, adapter_dirs)
    prompt, params = list(range(10, 27)), SamplingParams(max_new_tokens=5)
    first = llm.generate([prompt], params, lora_request=["a0"])[0].token_ids
    assert first == peft_greedy(peft_model, prompt, "a0", params)
    old_uid = llm.registry.uid_of("a0")
    new_uid = llm.register_adapter("a0", adapter_dirs["a6"])  # the name now means other weights
    assert new_uid != old_uid
    again = llm.generate([prompt], params, lora_request=["a0"])[0].token_ids
    assert again == peft_greedy(peft_model, prompt, "a6", params)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(base, adapter_dirs):
    llm = make_engine(base, adapter_dirs)
    p = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)
    alone = llm.generate([[3, 4, 5]], p, lora_request=["a2"])[0].token_ids
    crowd = llm.generate([[9, 9], [3, 4, 5], [1]], [SamplingParams(max_new_tokens=3, temperature=0.7, seed=1), p,
                                                      SamplingParams(max_new_tokens=4)], lora_request=[None, "a2", "a5"])
    assert crowd[1].token_ids == alone
    with pytest.raises(ValueError):
        SamplingParams(temperature=0.5).check()  # sampling needs a seed


def test_malformed_sampling_params_and_requests_are_refused_alone_and_the_engine_stays_usable(base, adapter_dirs):
    llm = make_engine(base, adapter_dirs)
    good = SamplingParams(max_new_tokens=3)
    bad = [SamplingParams(max_new_tokens=3, stop_token_ids=28), SamplingParams(temperature=float("nan"), seed=1),
           SamplingParams(temperature=float("inf"), seed=1), SamplingParams(temperature=0.5, seed="1"),
           SamplingParams(max_new_tokens=2.5), SamplingParams(max_new_tokens=True)]
    outs = llm.generate([[1, 2, 3]] * (len(bad) + 1) + [[1.7, 2.2]], bad + [good, good], lora_request=None)
    assert all(o.error and o.token_ids == [] for o in outs[:len(bad)]), [o.error for o in outs]
    assert outs[-1].error and "int token ids" in outs[-1].error
    assert outs[len(bad)].error is None and len(outs[len(bad)].token_ids) == 3
    with pytest.raises(ValueError, match="not a string"):
        llm.generate([[1], [2]], good, lora_request="a0")
    # an error escaping a step (here: a broken runner) leaves nothing queued or held behind
    real = llm.runner.forward
    llm.runner.forward = lambda work, running=(), **kw: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate([[1, 2, 3]], good, lora_request=["a0"])
    llm.runner.forward = real
    assert not llm.scheduler.has_unfinished() and llm.blocks.num_free == llm.blocks.num_blocks
    assert llm.generate([[1, 2, 3]], good)[0].token_ids == outs[len(bad)].token_ids


def test_the_public_engine_step_runs_the_same_engine(base, adapter_dirs):
    """generate(step=engine_step), chapter 11's capstone reference, gives the engine's own run: the same
    tokens, scheduler log, pool log and step counts, against the plain loop (overlapped decode, the
    default, logs step N+1's decodes before step N's finishes; its tokens are checked equal elsewhere)."""
    prompts, names, params = workload()
    own = make_engine(base, adapter_dirs, dataclasses.replace(CONFIG, overlap_decode=False))
    stepped = make_engine(base, adapter_dirs)
    want = own.generate(prompts, params, lora_request=names)
    got = stepped.generate(prompts, params, lora_request=names, step=engine_step)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stepped.scheduler.events == own.scheduler.events and stepped.pool.events == own.pool.events
    assert stepped.stats == own.stats
    with pytest.raises(ValueError, match="greedily"):
        stepped.generate([[1, 2]], SamplingParams(temperature=0.5, seed=1), step=engine_step)
    assert not stepped.scheduler.has_unfinished()


def test_the_engine_trusts_its_own_work_and_a_step_function_is_checked(base, adapter_dirs):
    """The engine's own step skips check_work (its scheduler's work is valid by construction; the pass
    was the largest item of a decode step's host time), a step function's calls keep it: the same
    broken work item is refused through the public runner call and not re-checked in the engine's."""
    llm = make_engine(base, adapter_dirs)
    real, seen = llm.runner.forward, []

    def spy(work, running=(), **kw):
        seen.append(kw.get("check", True))
        return real(work, running, **kw)

    llm.runner.forward = spy
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3))
    assert seen and not any(seen)
    seen.clear()
    llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), step=engine_step)
    assert seen and all(seen)
    with pytest.raises(ValueError, match="block table"):
        real([SeqWork([1, 2, 3], 0, [])])


def _outputs(outs):
    return [(o.token_ids, o.finish_reason, o.error) for o in outs]


def _spy_input_ids(llm):
    """Count the runner calls that took their input ids from the device (overlapped decode)."""
    real, calls = llm.runner.forward, []

    def spy(work, running=(), **kw):
        calls.append(kw.get("input_ids") is not None)
        return real(work, running, **kw)

    llm.runner.forward = spy
    return calls


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "static_graph"])
def test_overlapped_decode_gives_the_plain_loops_outputs(base, adapter_dirs, graph):
    """overlap_decode launches decode step N+1 before the host reads step N's tokens (N's samples feed
    N+1 on the device). Outputs equal the plain loop's: on the judge's workload (admission in waves,
    prefix hits, evictions, prompts longer than the budget: the pipeline starts and stops around
    them), and on a long decode of a few requests where stop tokens end some sequences mid-pipeline
    (their next row discarded), others run to max_new_tokens, some sample with seeds and min_tokens."""
    plain_llm = make_engine(base, adapter_dirs, dataclasses.replace(CONFIG, cuda_graph=graph))
    over_llm = make_engine(base, adapter_dirs, dataclasses.replace(CONFIG, cuda_graph=graph, overlap_decode=True))
    calls = _spy_input_ids(over_llm)
    prompts, names, params = workload()
    assert _outputs(over_llm.generate(prompts, params, lora_request=names)) == \
        _outputs(plain_llm.generate(prompts, params, lora_request=names))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, CFG["vocab_size"], (3 + 4 * i,), generator=g).tolist() for i in range(5)]
    names = [None, "a0", "a1", "a0", "a1"]  # the base and two adapters: CONFIG's slots, so nobody waits
    free = [SamplingParams(max_new_tokens=14 + i) for i in range(5)]
    first = plain_llm.generate(prompts, free, lora_request=names)
    assert _outputs(over_llm.generate(prompts, free, lora_request=names)) == _outputs(first)  # same cache state after
    # stop tokens the plain run meets mid-way (requests 0, 2, 4), seeded sampling (3), min_tokens (2)
    params = [SamplingParams(max_new_tokens=14, stop_token_ids=(first[0].token_ids[5],)),
              SamplingParams(max_new_tokens=15),
              SamplingParams(max_new_tokens=16, stop_token_ids=(first[2].token_ids[3],), min_tokens=6),
              SamplingParams(max_new_tokens=17, temperature=0.8, seed=3),
              SamplingParams(max_new_tokens=18, stop_token_ids=(first[4].token_ids[9],))]
    calls.clear()
    want = plain_llm.generate(prompts, params, lora_request=names)
    got = over_llm.generate(prompts, params, lora_request=names)
    assert _outputs(got) == _outputs(want)
    reasons = [o.finish_reason for o in want]  # request 2's stop token is banned at its first place (min_tokens)
    assert (reasons[0], reasons[1], reasons[3], reasons[4]) == ("stop", "length", "length", "stop")
    assert sum(calls) >= 8, "the pipeline ran for most of the decode steps"
    assert over_llm._inflight is None and over_llm.blocks.num_free == plain_llm.blocks.num_free


def test_overlapped_decode_fails_a_non_finite_row_alone(base, adapter_dirs):
    """A row that turns non-finite in the middle of the pipeline (planted in the runner's logits at one
    decode step): that request ends with an error and the tokens before it, its next row (already
    launched) is discarded, and every other request keeps the plain loop's tokens."""
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, CFG["vocab_size"], (4 + 3 * i,), generator=g).tolist() for i in range(4)]
    names, params = [None, "a0", "a1", None], [SamplingParams(max_new_tokens=12)] * 4

    def planted(llm, seen):
        real, count = llm.runner.forward, [0]

        def forward(work, running=(), **kw):
            out = real(work, running, **kw)
            count[0] += 1
            if count[0] == 6:  # a decode step of every request
                seen.append(kw.get("input_ids") is not None)
                # request 1 is a0's only request; its row is found by uid, not position (the row
                # order follows the pool's slots, and a CUDA device's pool has one slot more)
                row = [w.uid for w in work].index(llm.registry.uid_of("a0"))
                out = out.clone()
                out[row] = float("nan")
            return out

        llm.runner.forward = forward

    outs, seen = [], []
    for overlap in (False, True):
        llm = make_engine(base, adapter_dirs, dataclasses.replace(CONFIG, overlap_decode=overlap))
        planted(llm, seen)
        outs.append(llm.generate(prompts, params, lora_request=names))
        assert llm.blocks.num_free == llm.blocks.num_blocks and not llm.scheduler.has_unfinished()
    plain, over = outs
    assert seen == [False, True], "the planted step ran inside the pipeline"
    assert _outputs(over) == _outputs(plain)
    assert plain[1].finish_reason == "error" and "not finite" in plain[1].error and 0 < len(plain[1].token_ids) < 12
    assert all(o.finish_reason == "length" for i, o in enumerate(plain) if i != 1)


def test_overlap_decode_and_overlap_lora_shrink_are_bools(base):
    with pytest.raises(ValueError, match="overlap_decode"):
        LLM(copy.deepcopy(base), dataclasses.replace(CONFIG, overlap_decode="yes"))
    with pytest.raises(ValueError, match="overlap_lora_shrink"):
        LLM(copy.deepcopy(base), dataclasses.replace(CONFIG, overlap_lora_shrink=1))
    llm = LLM(copy.deepcopy(base), dataclasses.replace(CONFIG, overlap_lora_shrink=True), device=DEVICE)
    assert llm.context.overlap_shrink is True


def test_a_row_that_fails_inside_the_pipeline_leaves_no_kv_in_the_prefix_cache(base, adapter_dirs):
    """helper-31's find: the look-ahead registered step N's KV in the prefix cache before N's row was
    known finite, so a NaN row's block was served to a later request of the same adapter and prefix
    (which then failed after 0 tokens). Now the blocks are registered once the token is known finite,
    as the plain loop does: the later call equals the plain loop's, prefix hits included."""
    # eager decode on every device: the hook below plants the fault in Python, which a CUDA graph's
    # replay never runs
    cfg = dataclasses.replace(CONFIG, num_kv_blocks=32, block_size=1, max_num_seqs=4, max_num_batched_tokens=16,
                              cuda_graph=False)
    prompt = [21, 22, 23]
    got = []
    for overlap in (False, True):
        llm = make_engine(base, adapter_dirs, dataclasses.replace(cfg, overlap_decode=overlap))
        real, count, poison = llm.runner.forward, [0], [False]

        def hook(module, inputs, out):
            if poison[0]:
                out = out.clone()
                out[0] = float("nan")  # row 0's hidden state: its KV in the later layers is NaN too
                return out

        # down_proj, not the MLP module: the fused decoder (fused_ops, CUDA's default) calls the
        # projections itself and never the MLP's forward
        llm.model.model.layers[0].mlp.down_proj.register_forward_hook(hook)

        def forward(work, running=(), **kw):
            count[0] += 1
            poison[0] = count[0] == 5  # a decode step (inside the pipeline with overlap)
            try:
                return real(work, running, **kw)
            finally:
                poison[0] = False

        llm.runner.forward = forward
        first = llm.generate([prompt], SamplingParams(max_new_tokens=10), ["a0"])[0]
        second = llm.generate([prompt + first.token_ids + [7]], SamplingParams(max_new_tokens=3), ["a0"])[0]
        got.append((first.token_ids, first.finish_reason, second.token_ids, second.finish_reason,
                    llm.stats["prefix_hit_tokens"]))
    assert got[0][1] == "error" and got[0][3] == "length"
    assert got[1] == got[0]


def test_a_drain_ends_when_its_request_finished_in_the_step_that_admitted_it(base, adapter_dirs):
    """helper-31's find (the plain loop too): a drain lasted until its adapter was seen running, but a
    request of max_new_tokens 1 finishes in its admitting step, so the drain never ended and the
    scheduler found nothing to run. It now also ends once nothing of that adapter waits."""
    cfg = dataclasses.replace(CONFIG, block_size=2, num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=8,
                              max_loras_per_batch=1, drain_threshold=2, mixed_steps=False, max_loaded_loras=4)
    prompts = [[123, 87], [5, 22, 108, 70, 111, 91, 118], [55, 22, 90, 79, 88, 55, 7, 91, 10, 29, 111],
               [48, 78, 35, 120, 90]]
    params = [SamplingParams(max_new_tokens=3), SamplingParams(max_new_tokens=9), SamplingParams(max_new_tokens=3),
              SamplingParams(max_new_tokens=1)]
    for overlap in (False, True):
        llm = make_engine(base, adapter_dirs, dataclasses.replace(cfg, overlap_decode=overlap))
        outs = llm.generate(prompts, params, lora_request=["a0", "a0", "a0", "a1"])
        assert [len(o.token_ids) for o in outs] == [3, 9, 3, 1] and not llm.scheduler.drain_active
        assert ("drain_end", "a0@0") in llm.scheduler.events


def test_a_failed_request_gets_no_logprob_for_its_failed_row_and_no_error_outlives_an_exception(base, adapter_dirs):
    """A row that is not finite gives its request no token, so no logprob either (it got a NaN one);
    and when the runner raises later in the same call, the failed request's error does not stay
    behind in the engine."""
    llm = make_engine(base, adapter_dirs)
    real, count = llm.runner.forward, [0]

    def forward(work, running=(), **kw):
        count[0] += 1
        out = real(work, running, **kw)
        if count[0] == 2:
            out = out.clone()
            out[0] = float("nan")
        return out

    llm.runner.forward = forward
    outs = llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=4, logprobs=True))
    assert outs[0].finish_reason == "error" and len(outs[0].logprobs) == len(outs[0].token_ids) == 1
    assert len(outs[1].logprobs) == 4 and not llm._errors
    count[0], calls = 0, [0]

    def failing(work, running=(), **kw):
        calls[0] += 1
        if calls[0] == 4:  # after call 2's row failed
            raise RuntimeError("planted")
        return forward(work, running, **kw)

    llm.runner.forward = failing
    with pytest.raises(RuntimeError, match="planted"):
        llm.generate([[1, 2, 3], [4, 5, 6]], SamplingParams(max_new_tokens=8))
    assert not llm._errors and llm.blocks.num_free == llm.blocks.num_blocks


def _random_case(r):
    """A random small engine config and 1-2 calls of 1-6 requests (helper-31's differential fuzz,
    condensed): prompts sharing prefixes, adapters up to more than the slots, stop tokens, seeds,
    top-k/p, min_tokens, logprobs, a refused request, and a NaN row planted at one (uid, position)."""
    bs = r.choice([1, 2, 4])
    cfg = dict(block_size=bs, num_kv_blocks=r.choice([6, 12, 24, 64]) * (4 // bs), max_num_seqs=r.choice([1, 2, 3, 6]),
               max_num_batched_tokens=r.choice([4, 8, 24]), max_loras_per_batch=r.choice([1, 2, 3]),
               drain_threshold=r.choice([None, 0, 2]), mixed_steps=r.random() < .6,
               max_prefill_tokens_while_decoding=r.choice([None, 3]), cuda_graph=r.random() < .5)
    heads = [[r.randrange(CFG["vocab_size"]) for _ in range(r.randint(1, 8))] for _ in range(3)]
    calls = []
    for _ in range(r.choice([1, 2])):
        prompts, names, params = [], [], []
        for _ in range(r.randint(1, 6)):
            prompts.append((list(r.choice(heads)) if r.random() < .5 else [])
                           + [r.randrange(CFG["vocab_size"]) for _ in range(r.randint(1, 5))])
            names.append(r.choice([None, None, "a0", "a1", "a2", "a3"]))
            kw = dict(max_new_tokens=r.choice([0, 1, 2, 3, 5, 8, 10]) if r.random() < .05 else r.choice([1, 2, 3, 5, 8, 10]))
            if r.random() < .3:
                kw.update(temperature=r.choice([0.5, 1.0]), seed=r.randint(0, 99), top_k=r.choice([0, 3]),
                          top_p=r.choice([1.0, 0.8]))
            kw["logprobs"] = r.random() < .1
            params.append(kw)
        calls.append((prompts, names, params))
    fault = (r.choice([None, "a0", "a1"]), r.randint(2, 12)) if r.random() < .25 else None
    return cfg, calls, fault


def _with_fault(llm, fault):
    if fault is None:
        return
    real = llm.runner.forward

    def forward(work, running=(), **kw):
        out = real(work, running, **kw)
        bad = [i for i, w in enumerate(work)
               if (w.uid.split("@")[0] if w.uid else None) == fault[0] and w.start + len(w.token_ids) - 1 == fault[1]]
        if bad:
            out = out.clone()
            out[bad] = float("nan")
        return out

    llm.runner.forward = forward


def test_overlap_goes_on_while_requests_wait_for_a_slot_and_admits_them_when_the_plain_loop_does(base, adapter_dirs):
    """Requests of more adapters than the GPU has slots: the first wave decodes while the others wait
    (the adapter cap blocks them). No sequence can end before its length, so the overlapped loop
    keeps launching ahead through the wave (the admission policy, asked with the next step's state,
    admits no one), stops at the step where the wave ends, and admits the second wave at the very
    step the plain loop does: the same scheduler log counts, steps and tokens. With a stop token a
    sequence may end at any step, so the loop does not launch ahead while requests wait."""
    names = ["a0", "a1", "a2", "a3", "a0", "a1"]
    prompts = [[3 + i, 9, 27, 5 + 2 * i] for i in range(len(names))]
    cfg = dataclasses.replace(CONFIG, max_loras_per_batch=3, num_kv_blocks=40, max_num_seqs=6, max_num_batched_tokens=24)
    for stop in ((), (0,)):
        params = SamplingParams(max_new_tokens=8, stop_token_ids=stop, min_tokens=0)
        engines = [make_engine(base, adapter_dirs, dataclasses.replace(cfg, overlap_decode=o)) for o in (False, True)]
        seen = _spy_input_ids(engines[1])
        waiting_when_launched = []
        real = engines[1].runner.forward

        def forward(work, running=(), _real=real, _llm=engines[1], **kw):
            if kw.get("input_ids") is not None:
                waiting_when_launched.append(len(_llm.scheduler.waiting))
            return _real(work, running, **kw)

        engines[1].runner.forward = forward
        outs = [llm.generate(prompts, params, lora_request=names) for llm in engines]
        assert _outputs(outs[0]) == _outputs(outs[1])
        plain, over = engines
        assert plain.stats["drains"] == 0 and plain.stats["prefill_steps"] + plain.stats["mixed_steps"] >= 2
        assert {k: v for k, v in over.stats.items() if k != "pool_events"} == \
            {k: v for k, v in plain.stats.items() if k != "pool_events"}
        assert sorted(e for e in over.scheduler.events if e[0] != "decode") == \
            sorted(e for e in plain.scheduler.events if e[0] != "decode")
        assert any(seen), "the pipeline ran"
        if stop:
            assert not any(waiting_when_launched), "launched ahead while a stop token could free a slot"
        else:
            assert any(waiting_when_launched), "the pipeline stopped while requests waited for a slot"


def test_overlap_leaves_the_prefix_cache_as_the_plain_loop_does(base):
    """helper-32's repro: with two KV blocks, a sequence's next block evicted the free block that held
    the prefix its current block was computing. The plain loop registered the key first (kept by the
    free block, then evicted with it); the overlapped loop took the new block first and registered the
    key on the live one, so later calls got prefix hits the plain loop did not. BlockManager now gives
    the key to the live block either way: the same cache, hits and steps."""
    cfg = dict(num_kv_blocks=2, block_size=4, max_num_seqs=1, max_num_batched_tokens=2, max_loras_per_batch=2,
               mixed_steps=True, cuda_graph=False)
    got = []
    for overlap in (False, True):
        llm = LLM(copy.deepcopy(base), EngineConfig(overlap_decode=overlap, **cfg), device=DEVICE)
        prompt = [11, 22, 33]
        first = llm.generate([prompt], SamplingParams(max_new_tokens=5))[0].token_ids
        llm.generate([prompt], SamplingParams(max_new_tokens=5))
        keys = len(llm.blocks.key_to_block)
        outs = llm.generate([prompt + first[:2], [5, 6, 7]], SamplingParams(max_new_tokens=3))
        got.append((keys, llm.stats["prefix_hit_tokens"], llm.stats["steps"], _outputs(outs)))
    assert got[0] == got[1]


def test_a_prefill_first_step_admits_with_the_blocks_its_decodes_have_not_taken(base):
    """helper-32's repro: the look-ahead asked the admission policy with the blocks left after the
    next step's decodes, but a prefill-first step admits before they take them. After a row fails
    (its blocks freed, which the host could not foresee), a waiting prompt that fits only in the
    blocks before the decodes waited until a sequence ended (step 21 against the plain loop's 6);
    now it is admitted one step after the plain loop, the delay the look-ahead cannot avoid."""
    def admit_step(overlap):
        llm = LLM(copy.deepcopy(base), EngineConfig(overlap_decode=overlap, num_kv_blocks=30, block_size=1, max_num_seqs=2,
                                                    max_num_batched_tokens=24, mixed_steps=False, cuda_graph=False),
                  device=DEVICE)
        real, fired = llm.runner.forward, [False]

        def forward(work, running=(), **kw):  # the row at position 8 turns non-finite, once
            out = real(work, running, **kw)
            bad = [i for i, w in enumerate(work) if w.start + len(w.token_ids) - 1 == 8]
            if bad and not fired[0]:
                fired[0] = True
                out = out.clone()
                out[bad[0]] = float("nan")
            return out

        llm.runner.forward = forward
        admitted = {}

        class Log(list):
            def append(self, event):
                super().append(event)
                if event[0] == "admit":
                    admitted.setdefault(event[1], llm.scheduler.step_no)

        llm.scheduler.events = Log()
        outs = llm.generate([[1, 2], [3, 4, 5, 6, 7], list(range(10, 33))],
                            [SamplingParams(max_new_tokens=20)] * 2 + [SamplingParams(max_new_tokens=1)])
        return admitted[2] - admitted[0], _outputs(outs)

    (plain, plain_out), (over, over_out) = admit_step(False), admit_step(True)
    assert plain_out == over_out and plain_out[1][1] == "error"
    assert plain <= over <= plain + 1, (plain, over)


@pytest.mark.parametrize("mixed", [False, True], ids=["prefill_first", "mixed_steps"])
def test_a_block_the_step_in_flight_completes_can_admit_a_waiting_prompt(base, mixed):
    """helper-33's repro: B's first block is A's once A has decoded one token. The block is registered
    when that step is recorded, so the look-ahead's admission dry run, made before, saw B's full
    need and ran ahead, and B was admitted four steps after the plain loop (prefill first). The
    look-ahead now stays behind when a block the step in flight completes is in a waiting prompt's
    prefix: the same admission step, preemptions and prefix hits."""
    cfg = dict(num_kv_blocks=2, block_size=4, max_num_seqs=2, max_num_batched_tokens=24, mixed_steps=mixed,
               cuda_graph=False)
    prompt = [11, 22, 33]
    o1 = LLM(copy.deepcopy(base), EngineConfig(**cfg), device=DEVICE).generate(
        [prompt], SamplingParams(max_new_tokens=1))[0].token_ids[0]
    got = []
    for overlap in (False, True):
        llm = LLM(copy.deepcopy(base), EngineConfig(overlap_decode=overlap, **cfg), device=DEVICE)
        admitted = {}

        class Log(list):
            def append(self, event, _llm=llm, _admitted=admitted):
                super().append(event)
                if event[0] == "admit":
                    _admitted.setdefault(event[1], _llm.scheduler.step_no)

        llm.scheduler.events = Log()
        outs = llm.generate([prompt, prompt + [o1, 7]], [SamplingParams(max_new_tokens=6), SamplingParams(max_new_tokens=2)])
        got.append((admitted, llm.stats["preemptions"], llm.stats["prefix_hit_tokens"], _outputs(outs)))
    assert got[0] == got[1]


def test_overlapped_decode_equals_the_plain_loop_on_random_workloads(base, adapter_dirs):
    """Seeded random configs and workloads, each through a plain and an overlapped engine (stop tokens
    taken from a first, unstopped run so that they do stop requests mid-way): every call's outputs
    (tokens, finish reasons, errors, logprobs) are equal, and both engines end with every block free."""
    rng = random.Random(31)
    overlapped = 0
    for case in range(14):
        cfg, calls, fault = _random_case(rng)
        engines = [make_engine(base, adapter_dirs, dataclasses.replace(CONFIG, overlap_decode=o, **cfg))
                   for o in (False, True)]
        calls_seen = _spy_input_ids(engines[1])
        for o, llm in enumerate(engines):
            _with_fault(llm, fault)
        for prompts, names, kws in calls:
            unstopped = [SamplingParams(max_new_tokens=max(1, k["max_new_tokens"])) for k in kws]
            first, again = (llm.generate(prompts, unstopped, lora_request=names) for llm in engines)
            assert _outputs(first) == _outputs(again), (case, cfg, fault)
            params = []
            for k, out in zip(kws, first):
                if out.token_ids and rng.random() < .6:
                    k = dict(k, stop_token_ids=(rng.choice(out.token_ids),))
                params.append(SamplingParams(**k))
            got = [[(*out, o.logprobs) for out, o in zip(_outputs(outs), outs)]
                   for outs in (llm.generate(prompts, params, lora_request=names) for llm in engines)]
            assert got[0] == got[1], (case, cfg, fault)
        assert all(llm.blocks.num_free == llm.blocks.num_blocks and llm._inflight is None for llm in engines)
        overlapped += sum(calls_seen)
    assert overlapped >= 20, "the pipeline ran in the random cases"
