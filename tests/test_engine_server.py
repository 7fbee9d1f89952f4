"""The engine's OpenAI-compatible endpoint (``reference.engine.server``), driven by the official
``openai`` client against a uvicorn server this test starts on localhost: the adapter chosen by the
``model`` field, every greedy completion equal to PEFT's own generate of that request alone, requests
sent at once (served in waves) each still its own, and refusals in OpenAI's error shape that disturb nothing."""
from __future__ import annotations

import copy
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

from reference.engine.llm import LLM, EngineConfig  # noqa: E402
from reference.engine.sequence import SamplingParams  # noqa: E402
from reference.engine.server import create_app  # noqa: E402
from test_engine import DEVICE, peft_greedy as _peft_greedy  # noqa: E402  (PEFT's generate of one request)

CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=256, max_position_embeddings=64)
ADAPTERS = {"sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "chat": dict(r=8, lora_alpha=16, target_modules="all-linear")}


def byte_tokenizer():
    """A byte-level tokenizer of 256 ids built in place (nothing downloaded): every text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
    root = tmp_path_factory.mktemp("server_adapters")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed, (name, kw) in enumerate(ADAPTERS.items()):
            torch.manual_seed(500 + seed)
            peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)
                                ).save_pretrained(root / name)
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), root / "sql", adapter_name="sql")
        pm.load_adapter(root / "chat", adapter_name="chat")
    llm = LLM(copy.deepcopy(base), EngineConfig(max_loras_per_batch=2, max_lora_rank=8, num_kv_blocks=32,
                                                block_size=4, max_num_seqs=4, max_num_batched_tokens=32),
              device="cpu")
    for name in ADAPTERS:
        llm.register_adapter(name, root / name)
    tokenizer = byte_tokenizer()
    server = uvicorn.Server(uvicorn.Config(create_app(llm, tokenizer, "tiny-llama"), host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    yield client, tokenizer, pm.to(DEVICE).eval()
    server.should_exit = True
    thread.join(timeout=30)


def peft_greedy(pm, prompt: list[int], adapter, max_new_tokens: int) -> list[int]:
    return _peft_greedy(pm, prompt, adapter, SamplingParams(max_new_tokens=max_new_tokens))


MODELS = {"tiny-llama": None, "sql": "sql", "chat": "chat"}


def test_models_lists_the_base_and_every_adapter(setup):
    client, _, _ = setup
    assert [m.id for m in client.models.list().data] == ["tiny-llama", "chat", "sql"]


@pytest.mark.parametrize("model", list(MODELS))
def test_a_greedy_completion_is_pefts_generate(setup, model):
    client, tokenizer, pm = setup
    prompt = "Serve many LoRAs"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    got = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0)
    want = peft_greedy(pm, ids, MODELS[model], 6)
    assert got.model == model and got.object == "text_completion"
    assert got.choices[0].text == tokenizer.decode(want)
    assert got.choices[0].finish_reason == "length"
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), 6)


def test_token_id_prompts_and_requests_sent_at_once(setup):
    """Six requests from six threads over three models: served in waves, each still its own."""
    client, tokenizer, pm = setup
    jobs = [(model, [[3 + i, 40 + 7 * i, 200 - i], [9, 8, 7, 6 + i]]) for i, model in enumerate(list(MODELS) * 2)]

    def ask(job):
        model, prompts = job
        return client.completions.create(model=model, prompt=prompts, max_tokens=4, temperature=0)

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(ask, jobs))
    for (model, prompts), got in zip(jobs, answers):
        assert [c.index for c in got.choices] == [0, 1]
        for prompt, choice in zip(prompts, got.choices):
            assert choice.text == tokenizer.decode(peft_greedy(pm, prompt, MODELS[model], 4)), (model, prompt)


def test_refusals_have_openais_shape_and_disturb_nothing(setup):
    client, tokenizer, pm = setup
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="sql", prompt="x", max_tokens=0, temperature=0)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model="sql", prompt="x" * 70, max_tokens=2, temperature=0)
    with pytest.raises(openai.BadRequestError, match="stream"):
        client.completions.create(model="sql", prompt="x", max_tokens=2, temperature=0, stream=True)
    with pytest.raises(openai.BadRequestError, match="token ids must lie"):
        client.completions.create(model="chat", prompt=[[5, 999]], max_tokens=2, temperature=0)
    got = client.completions.create(model="chat", prompt="after the refusals", max_tokens=3, temperature=0)
    ids = tokenizer.encode("after the refusals", add_special_tokens=False)
    assert got.choices[0].text == tokenizer.decode(peft_greedy(pm, ids, "chat", 3))


def test_sampling_is_reproducible_with_a_seed(setup):
    client, _, _ = setup
    a, b = (client.completions.create(model="sql", prompt="seeded", max_tokens=5, temperature=0.9, seed=11)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
