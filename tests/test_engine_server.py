"""The engine's OpenAI-compatible server (``reference.engine.server``), started the README's way
(``python -m reference.engine.server`` on a folder made by ``python -m reference.engine.tiny``) and
driven by the official ``openai`` client on 127.0.0.1 (issue #32): every greedy completion and chat,
streamed or not, equal to PEFT's own generate of that request alone; continuous batching across
arrivals; every bad request a 400 in OpenAI's shape that disturbs nothing; a broken adapter failing
alone; adapters loaded, unloaded and reloaded while requests run; a client that disconnects freeing
its blocks. Every wait is bounded in time; the server is stopped by its PID."""
from __future__ import annotations

import copy
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
openai = pytest.importorskip("openai")
peft = pytest.importorskip("peft")

from reference.engine.sequence import SamplingParams  # noqa: E402
from reference.engine.tiny import save_tiny  # noqa: E402
from test_engine import DEVICE, peft_greedy as _peft_greedy  # noqa: E402  (PEFT's generate of one request)

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = {"sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "chat": dict(r=8, lora_alpha=16, target_modules="all-linear"),
            "sql2": dict(r=8, lora_alpha=8, target_modules=["q_proj", "down_proj"]),
            "broken": dict(r=4, lora_alpha=8, target_modules=["o_proj"])}
EOS = 257


class _Reply:
    def __init__(self, status: int, text: str, headers: dict | None = None) -> None:
        self.status_code, self.text, self.headers = status, text, headers or {}

    def json(self):
        return json.loads(self.text)


def _request(method: str, url: str, body=None, timeout: float = 60, raw: bytes | None = None,
             headers: dict | None = None) -> _Reply:
    """One plain HTTP request (the standard library: the client's own HTTP stack is not what is tested)."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, parts.path, body=data,
                     headers={**({"Content-Type": "application/json"} if data else {}), **(headers or {})})
        r = conn.getresponse()
        return _Reply(r.status, r.read().decode(), {k.lower(): v for k, v in r.getheaders()})
    finally:
        conn.close()


def _get(url: str, timeout: float = 60, headers: dict | None = None) -> _Reply:
    return _request("GET", url, timeout=timeout, headers=headers)


def _post(url: str, body=None, timeout: float = 60, raw: bytes | None = None, headers: dict | None = None) -> _Reply:
    return _request("POST", url, body, timeout, raw, headers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _poison(folder: Path) -> None:
    """Every weight of a saved PEFT adapter set to NaN: it loads, and its logits are NaN."""
    from safetensors.torch import load_file, save_file

    path = folder / "adapter_model.safetensors"
    save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(path).items()}, path)


def _start(paths: dict, *args: str) -> tuple[subprocess.Popen, str]:
    """The README's server on a free port of 127.0.0.1 over ``paths["model"]``, once ``/health`` answers:
    (its process, its base URL). ``args``: more flags."""
    port = _free_port()
    cmd = [sys.executable, "-m", "reference.engine.server", "--model", str(paths["model"]), "--served-model-name",
           "tiny-llama", "--max-loras", "2", "--max-lora-rank", "8", "--max-num-seqs", "8", "--num-kv-blocks", "160",
           "--block-size", "4", "--max-num-batched-tokens", "64", "--port", str(port), "--device", str(DEVICE),
           # decode through the graph runner on the CPU too (its static path): a GPU serves every decode
           # step that way, and a log trimmed under its slot tracker once went unseen on the CPU
           "--cuda-graph", "on", *args]
    # ROOT first, then whatever the environment had (the GPU run's packages live on PYTHONPATH)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if _get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except OSError:
            time.sleep(0.2)
    _stop(proc)
    out = proc.stdout.read()
    pytest.fail(f"the server did not become healthy in 120 s:\n{out[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    paths = save_tiny(root, ADAPTERS, seed=3)
    _poison(paths["broken"])
    proc, base = _start(paths, "--lora-modules", f"sql={paths['sql']}", f"chat={paths['chat']}",
                        f"broken={paths['broken']}")
    try:
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(paths["model"])
        base_model = transformers.AutoModelForCausalLM.from_pretrained(paths["model"]).eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pm = peft.PeftModel.from_pretrained(copy.deepcopy(base_model), paths["sql"], adapter_name="sql")
            for name in ("chat", "sql2"):
                pm.load_adapter(paths[name], adapter_name=name)
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
        yield dict(client=client, tokenizer=tokenizer, pm=pm.to(DEVICE), base=base, paths=paths, proc=proc)
    finally:
        _stop(proc)


def want(s, prompt_ids: list[int], adapter, max_tokens: int) -> list[int]:
    """PEFT's greedy tokens of one request alone, cut at eos (the server stops there, as vLLM does)."""
    return _peft_greedy(s["pm"], prompt_ids, adapter, SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(EOS,)))


def text_of(s, ids: list[int]) -> str:
    return s["tokenizer"].decode([t for t in ids if t != EOS])


MODELS = {"tiny-llama": None, "sql": "sql", "chat": "chat"}


def test_models_health_and_metrics(served):
    assert [m.id for m in served["client"].models.list().data] == ["tiny-llama", "broken", "chat", "sql"]
    assert _get(served["base"] + "/health", timeout=10).status_code == 200
    text = _get(served["base"] + "/metrics", timeout=10).text
    for name in ("lora_book:num_requests_running", "lora_book:num_requests_waiting", "lora_book:kv_blocks_in_use",
                 "lora_book:time_to_first_token_seconds_bucket", "lora_book:time_per_output_token_seconds_bucket",
                 "lora_book:generation_tokens_total", "lora_book:lora_pool_events_total"):
        assert name in text, name


@pytest.mark.parametrize("model", list(MODELS))
def test_completions_streamed_or_not_are_pefts_generate(served, model):
    client, tok = served["client"], served["tokenizer"]
    prompt = "Serve many LoRAs"
    ids = tok.encode(prompt, add_special_tokens=False)
    expect = want(served, ids, MODELS[model], 8)
    got = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert got.model == model and got.object == "text_completion"
    assert got.choices[0].text == text_of(served, expect)
    assert got.choices[0].finish_reason == ("stop" if expect[-1] == EOS else "length")
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), len(expect))
    chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text_of(served, expect)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == got.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(expect)


@pytest.mark.parametrize("model", ["tiny-llama", "chat"])
def test_chat_streamed_or_not_is_pefts_generate_of_the_template(served, model):
    client, tok = served["client"], served["tokenizer"]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)
    expect = text_of(served, want(served, ids, MODELS[model], 7))
    got = client.chat.completions.create(model=model, messages=messages, max_tokens=7, temperature=0)
    assert got.object == "chat.completion" and got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expect
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=7, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expect


def test_fifty_staggered_clients_and_a_late_arrival_joins_the_running_batch(served):
    """Continuous batching: 50 clients arriving over time all get PEFT's tokens; a request sent
    while a long one decodes gets its first token long before the long one ends."""
    client, tok = served["client"], served["tokenizer"]
    jobs = [(list(MODELS)[i % 3], [3 + i % 7, 40 + 7 * (i % 5), 200 - i % 4, 9]) for i in range(50)]

    def ask(i):
        time.sleep(0.01 * i)
        model, prompt = jobs[i]
        return client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(50)))
    cache = {}
    for (model, prompt), got in zip(jobs, answers):
        key = (model, tuple(prompt))
        if key not in cache:
            cache[key] = text_of(served, want(served, prompt, MODELS[model], 5))
        assert got.choices[0].text == cache[key], key

    t0 = time.perf_counter()
    long = client.completions.create(model="sql", prompt=[1, 2, 3], max_tokens=200, temperature=0, stream=True,
                                     extra_body={"ignore_eos": True})
    first = next(iter(long))  # the long request is decoding now
    assert first.choices[0].text is not None
    late = {}

    def late_request():
        t = time.perf_counter()
        stream = client.completions.create(model="chat", prompt=[5, 6, 7], max_tokens=3, temperature=0, stream=True)
        for _ in stream:
            late.setdefault("ttft", time.perf_counter() - t)

    th = threading.Thread(target=late_request)
    th.start()
    rest = "".join(c.choices[0].text for c in long)
    total = time.perf_counter() - t0
    th.join(timeout=120)
    assert len(tok.encode(first.choices[0].text + rest, add_special_tokens=False)) >= 190
    assert late["ttft"] < 0.5 * total, (late, total)  # waves would make it wait for the whole long request


BAD = [  # (body changes, the parameter the 400 names)
    (dict(max_tokens=0), "max_tokens"),
    (dict(prompt="x" * 300), "max_tokens"),
    (dict(prompt=[[5, 999]]), None),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=True), "stop_token_ids"),
    (dict(stop_token_ids=[999]), None),
    (dict(seed=2 ** 64, temperature=0.5), "seed"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(min_tokens=9, max_tokens=2), "min_tokens"),
    (dict(logit_bias={"5": 10}), "logit_bias"),
    (dict(presence_penalty=0.5), "presence_penalty"),
    (dict(frequency_penalty=0.5), "frequency_penalty"),
    (dict(n=2), "n"),
    (dict(best_of=3), "best_of"),
    (dict(echo=True), "echo"),
    (dict(logprobs=3), "logprobs"),
    (dict(no_such_option=1), "no_such_option"),
    (dict(stop=5), "stop"),
    (dict(stream="yes"), "stream"),
]


@pytest.mark.parametrize("change,param", BAD, ids=[next(iter(c)) for c, _ in BAD])
def test_every_bad_request_is_a_400_naming_it(served, change, param):
    body = {"model": "sql", "prompt": "x", "max_tokens": 2, "temperature": 0, **change}
    r = _post(served["base"] + "/v1/completions", body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    if param is not None:
        assert err["param"] == param and param in err["message"], err
    assert "stop on token ids" not in err["message"]


def test_refusals_disturb_nothing_and_chat_needs_a_template(served):
    client = served["client"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-adapter", prompt="x", max_tokens=2, temperature=0)
    r = _post(served["base"] + "/v1/completions", raw=b"{not json", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    got = client.completions.create(model="chat", prompt=[7, 8, 9], max_tokens=3, temperature=0)
    assert got.choices[0].text == text_of(served, want(served, [7, 8, 9], "chat", 3))


def test_sampling_options(served):
    client, tok = served["client"], served["tokenizer"]
    a, b = (client.completions.create(model="sql", prompt="seeded", max_tokens=5, temperature=0.9, seed=11)
            for _ in range(2))
    assert a.choices[0].text == b.choices[0].text
    greedy = client.completions.create(model="sql", prompt="top", max_tokens=5, temperature=0).choices[0].text
    top1 = client.completions.create(model="sql", prompt="top", max_tokens=5, temperature=1.5, seed=4,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy  # top_k 1 leaves only the argmax
    tiny_p = client.completions.create(model="sql", prompt="top", max_tokens=5, temperature=1.5, seed=4,
                                       top_p=1e-9).choices[0].text
    assert tiny_p == greedy
    ids = tok.encode("top", add_special_tokens=False)
    stop_at = want(served, ids, "sql", 5)[1]  # the second greedy token, as a stop token
    short = client.completions.create(model="sql", prompt="top", max_tokens=5, temperature=0,
                                      extra_body={"stop_token_ids": [stop_at], "ignore_eos": True})
    assert short.choices[0].finish_reason == "stop" and short.usage.completion_tokens <= 2
    held = client.completions.create(model="sql", prompt="top", max_tokens=5, temperature=0,
                                     extra_body={"stop_token_ids": [stop_at], "min_tokens": 5, "ignore_eos": True})
    assert held.usage.completion_tokens == 5
    lp = client.completions.create(model="sql", prompt=ids, max_tokens=3, temperature=0, logprobs=0)
    pm = served["pm"]
    pm.set_adapter("sql")
    seq = ids + want(served, ids, "sql", 3)
    with torch.no_grad():
        logits = pm(input_ids=torch.tensor([seq], device=DEVICE)).logits[0].float().log_softmax(-1)
    expect = [logits[len(ids) - 1 + i, seq[len(ids) + i]].item() for i in range(3)]
    assert lp.choices[0].logprobs.token_logprobs == pytest.approx(expect, abs=1e-4)
    text = client.completions.create(model="sql", prompt="stop here", max_tokens=12, temperature=0).choices[0].text
    if len(text) > 3:
        cut = client.completions.create(model="sql", prompt="stop here", max_tokens=12, temperature=0, stop=[text[2:4]])
        assert cut.choices[0].text == text[:text.index(text[2:4])] and cut.choices[0].finish_reason == "stop"


def test_a_broken_adapter_fails_alone(served):
    """A NaN adapter's request gets a 500 in OpenAI's shape; the requests sent beside it, greedy and
    seeded, get exactly their tokens alone."""
    client = served["client"]
    alone = {m: client.completions.create(model=m, prompt=[4, 5, 6], max_tokens=6, temperature=0.7, seed=5,
                                          extra_body={"ignore_eos": True}).choices[0].text for m in ("sql", "chat")}

    def ask(m):
        try:
            return client.completions.create(model=m, prompt=[4, 5, 6], max_tokens=6, temperature=0.7, seed=5,
                                             extra_body={"ignore_eos": True}).choices[0].text
        except openai.InternalServerError as exc:
            return exc

    with ThreadPoolExecutor(3) as pool:
        got = dict(zip(("sql", "broken", "chat"), pool.map(ask, ("sql", "broken", "chat"))))
    assert isinstance(got["broken"], openai.InternalServerError) and "not finite" in str(got["broken"])
    assert got["sql"] == alone["sql"] and got["chat"] == alone["chat"]
    with pytest.raises(openai.APIError, match="not finite"):
        list(client.completions.create(model="broken", prompt=[4, 5], max_tokens=3, temperature=0, stream=True))
    assert _get(served["base"] + "/health", timeout=10).status_code == 200


def _metric(s, name: str) -> float:
    for line in _get(s["base"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def _disconnect_frees_blocks(s, stream: bool, headers: dict | None = None) -> None:
    """A client that goes away before its request ends: the server aborts it and frees its KV blocks."""
    aborts = _metric_labeled(s, "lora_book:request_success_total", 'finished_reason="abort"')
    parts = urlsplit(s["base"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {"model": "sql", "prompt": [1, 2, 3], "max_tokens": 240, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **(headers or {})})
    if stream:
        r = conn.getresponse()
        assert r.status == 200
        while not r.readline().startswith(b"data:"):
            pass
    else:  # no answer comes before the end: wait until the request runs
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _metric(s, "lora_book:num_requests_running") == 0:
            time.sleep(0.05)
    assert _metric(s, "lora_book:kv_blocks_in_use") > 0
    conn.close()  # the client goes away: the server aborts the request
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_metric(s, "lora_book:kv_blocks_in_use") > 0
                                           or _metric(s, "lora_book:num_requests_running") > 0):
        time.sleep(0.1)
    assert _metric(s, "lora_book:kv_blocks_in_use") == 0
    assert _metric(s, "lora_book:num_requests_running") == 0
    assert _metric_labeled(s, "lora_book:request_success_total", 'finished_reason="abort"') == aborts + 1


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(served, stream):
    _disconnect_frees_blocks(served, stream)


def test_load_unload_reload_while_requests_run(served):
    client, base, paths = served["client"], served["base"], served["paths"]
    ids = [11, 12, 13]
    running = client.completions.create(model="sql", prompt=ids, max_tokens=60, temperature=0, stream=True,
                                        extra_body={"ignore_eos": True})
    head = next(iter(running)).choices[0].text  # decoding on the first version of "sql"
    r = _post(base + "/v1/load_lora_adapter", {"lora_name": "extra", "lora_path": str(paths["sql2"])},
                   timeout=60)
    assert r.status_code == 200, r.text
    got = client.completions.create(model="extra", prompt=ids, max_tokens=5, temperature=0)
    assert got.choices[0].text == text_of(served, want(served, ids, "sql2", 5))
    assert _post(base + "/v1/unload_lora_adapter", {"lora_name": "sql"}, timeout=60).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql", prompt=ids, max_tokens=2, temperature=0)
    # "sql" comes back with other weights while its old request still decodes
    r = _post(base + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(paths["sql2"])},
                   timeout=60)
    assert r.status_code == 200, r.text
    got = client.completions.create(model="sql", prompt=ids, max_tokens=5, temperature=0)
    assert got.choices[0].text == text_of(served, want(served, ids, "sql2", 5))
    old = head + "".join(c.choices[0].text for c in running)
    expect = served["tokenizer"].decode(_peft_greedy(served["pm"], ids, "sql", SamplingParams(max_new_tokens=60)))
    assert old == expect  # the running request finished on the version it started with
    bad = _post(base + "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no/such/folder"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    assert _post(base + "/v1/unload_lora_adapter", {"lora_name": "nope"}, timeout=60).status_code == 404
    # put "sql" back as the other tests know it: replacing a loaded name is asked for explicitly (vLLM)
    again = _post(base + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(paths["sql"])}, timeout=60)
    assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
    assert _post(base + "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": str(paths["sql"]),
                                                  "load_inplace": True}, timeout=60).status_code == 200
    assert _post(base + "/v1/unload_lora_adapter", {"lora_name": "extra"}, timeout=60).status_code == 200


# ---- what a first vLLM user found (stop strings, metrics, vLLM's defaults) -------------------------
def _metric_labeled(s, name: str, label: str) -> float:
    for line in _get(s["base"] + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and label in line:
            return float(line.split()[-1])
    return 0.0


def test_a_stop_string_counts_the_tokens_up_to_it_and_is_a_stop_in_metrics(served):
    client, tok = served["client"], served["tokenizer"]
    ids = [40, 41, 42]
    full = want(served, ids, "sql", 12)
    text = text_of(served, full)
    assert len(text) >= 4
    stop = text[2:4]
    reach = next(n for n in range(1, len(full) + 1) if stop in tok.decode(full[:n], skip_special_tokens=True))
    before = _metric_labeled(served, "lora_book:request_success_total", 'finished_reason="stop"')
    got = client.completions.create(model="sql", prompt=ids, max_tokens=12, temperature=0, stop=[stop], logprobs=0)
    assert got.choices[0].text == text[:text.index(stop)] and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens == reach  # not the tokens sampled before the abort landed
    assert len(got.choices[0].logprobs.token_logprobs) == reach
    chunks = list(client.completions.create(model="sql", prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text[:text.index(stop)]
    assert chunks[-1].usage.completion_tokens == reach
    kept = client.completions.create(model="sql", prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[:text.index(stop) + len(stop)]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _metric_labeled(
            served, "lora_book:request_success_total", 'finished_reason="stop"') < before + 3:
        time.sleep(0.05)
    assert _metric_labeled(served, "lora_book:request_success_total", 'finished_reason="stop"') >= before + 3


def test_min_tokens_holds_back_stop_strings_too(served):
    client = served["client"]
    ids = [40, 41, 42]
    full = want(served, ids, "sql", 12)
    text = text_of(served, full)
    stop = text[0]  # found at once without min_tokens
    early = client.completions.create(model="sql", prompt=ids, max_tokens=12, temperature=0, stop=[stop])
    assert early.choices[0].text == ""
    held = client.completions.create(model="sql", prompt=ids, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens >= 6 and held.choices[0].text.startswith(text_of(served, full[:1]))


def test_refusals_come_before_the_stream_and_name_their_parameter(served):
    base = served["base"]
    for body, param in ((dict(prompt=[1, 300], stream=True), "prompt"),
                        (dict(prompt=[1, 300]), "prompt"),
                        (dict(seed=1.5, temperature=0.5), "seed"),
                        (dict(stream=True, stream_options={"continuous_usage_stats": True}), "stream_options")):
        r = _post(base + "/v1/completions", {"model": "sql", "prompt": "x", "max_tokens": 2, "temperature": 0, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = _request("PUT", base + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert _get(base + "/v1/no-such-path").json()["error"]["code"] == 404


def test_vllm_defaults_a_client_relies_on(served):
    client, base = served["client"], served["base"]
    r = _post(base + "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["model"] == "tiny-llama"  # no model: the served one
    assert r.json()["choices"][0]["text"] == text_of(served, want(served, [7, 8, 9], None, 3))
    assert _get(base + "/v1/models/chat").json()["id"] == "chat"
    assert _get(base + "/v1/models/nope").status_code == 404
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": None}]
    plain = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": ""}]
    a = client.chat.completions.create(model="chat", messages=parts, max_tokens=4, temperature=0,
                                       response_format={"type": "text"})
    b = client.chat.completions.create(model="chat", messages=plain, max_tokens=4, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    r = _post(base + "/v1/chat/completions", {"model": "chat", "messages": plain, "max_tokens": 2, "temperature": 0,
                                             "chat_template_kwargs": "no"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_tokenize_and_detokenize_are_what_a_request_feeds_the_engine(served):
    base, tok = served["base"], served["tokenizer"]
    r = _post(base + "/tokenize", {"model": "sql", "prompt": "SELECT 1"})
    ids = tok.encode("SELECT 1", add_special_tokens=False)
    limit = _get(base + "/v1/models/sql").json()["max_model_len"]
    assert r.status_code == 200 and r.json() == {"count": len(ids), "max_model_len": limit, "tokens": ids}
    done = _post(base + "/v1/completions", {"model": "sql", "prompt": "SELECT 1", "max_tokens": 1, "temperature": 0})
    assert done.json()["usage"]["prompt_tokens"] == len(ids)
    messages = [{"role": "user", "content": "hi"}]
    r = _post(base + "/tokenize", {"model": "chat", "messages": messages})
    assert r.status_code == 200
    done = _post(base + "/v1/chat/completions", {"model": "chat", "messages": messages, "max_tokens": 1,
                                                 "temperature": 0})
    assert r.json()["count"] == done.json()["usage"]["prompt_tokens"] == len(r.json()["tokens"])
    assert r.json()["tokens"] == tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                                            add_special_tokens=False)
    assert _post(base + "/detokenize", {"model": "sql", "tokens": ids}).json() == {"prompt": "SELECT 1"}
    assert _post(base + "/detokenize", {"tokens": []}).json() == {"prompt": ""}
    for path, body, status, param in [
            ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
            ("/tokenize", {"prompt": "x", "messages": messages}, 400, "prompt"),
            ("/tokenize", {}, 400, "prompt"),
            ("/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
            ("/tokenize", {"prompt": "x", "add_special_tokens": True}, 400, "add_special_tokens"),
            ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools"),
            ("/tokenize", {"messages": "hi"}, 400, "messages"),
            ("/detokenize", {"tokens": [len(tok)]}, 400, "tokens"),
            ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
            ("/detokenize", {"tokens": [True]}, 400, "tokens"),
            ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
            ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "prompt"),
            ("/tokenize", {"messages": messages, "add_generation_prompt": "no"}, 400, "add_generation_prompt"),
            ("/tokenize", {"messages": messages, "chat_template_kwargs": 3}, 400, "chat_template_kwargs")]:
        r = _post(base + path, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (path, body, r.text)
    # the chat endpoint's own reading of its flags: continuing the final message drops the generation prompt
    go_on = {"model": "chat", "messages": messages + [{"role": "assistant", "content": "hel"}],
             "continue_final_message": True}
    done = _post(base + "/v1/chat/completions", {**go_on, "max_tokens": 1, "temperature": 0})
    assert done.status_code == 200
    assert _post(base + "/tokenize", go_on).json()["count"] == done.json()["usage"]["prompt_tokens"]
    for raw in (b"{", b'{"tokens": ' + b"[" * 100000 + b"]" * 100000 + b"}"):  # not JSON; nested past the parser
        for path in ("/tokenize", "/detokenize", "/v1/completions"):
            r = _post(base + path, raw=raw)
            assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"], (path, r.text[:200])
    v = _get(base + "/version")
    assert v.status_code == 200 and isinstance(v.json()["version"], str) and v.json()["version"]


def test_an_api_key_guards_every_route_but_the_probes(tmp_path):
    paths = save_tiny(tmp_path, {"sql": ADAPTERS["sql"]}, seed=3)
    proc, base = _start(paths, "--api-key", "s3cret", "--lora-modules", f"sql={paths['sql']}")
    try:
        key = {"Authorization": "Bearer s3cret"}
        load = {"lora_name": "late", "lora_path": str(paths["sql"])}
        for headers in (None, {"Authorization": "Bearer s3cre"}, {"Authorization": "s3cret"},
                        {"Authorization": "Bearer s3cret2"}, {"Authorization": "Basic s3cret"},
                        {"Authorization": "Bearer  s3cret"}, {"X-Api-Key": "s3cret"}):
            for method, path, body in [("GET", "/v1/models", None), ("GET", "/v1/models/sql", None),
                                       ("POST", "/v1/completions", {"model": "sql", "prompt": [1, 2], "max_tokens": 1}),
                                       ("POST", "/v1/load_lora_adapter", load),
                                       ("POST", "/v1/unload_lora_adapter", {"lora_name": "sql"}),
                                       ("POST", "/tokenize", {"prompt": "x"}), ("POST", "/detokenize", {"tokens": [1]}),
                                       ("GET", "/v1/nowhere", None), ("OPTIONS", "/v1/load_lora_adapter", None),
                                       ("GET", "/docs", None)]:
                r = _request(method, base + path, body, timeout=30, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError", (path, headers)
                assert r.headers.get("www-authenticate") == "Bearer", (path, r.headers)
        for path in ("/health", "/metrics", "/version"):
            assert _get(base + path, timeout=30).status_code == 200, path
        # nothing a refused request asked for happened
        assert [m["id"] for m in _get(base + "/v1/models", headers=key).json()["data"]] == ["tiny-llama", "sql"]
        wrong = openai.OpenAI(base_url=base + "/v1", api_key="guess", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="sql", prompt=[1, 2], max_tokens=1)
        right = openai.OpenAI(base_url=base + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert right.completions.create(model="sql", prompt=[1, 2], max_tokens=2, temperature=0).usage.completion_tokens >= 1
        assert _post(base + "/v1/load_lora_adapter", load, headers=key).status_code == 200
        assert _post(base + "/tokenize", {"prompt": "x"}, headers=key).status_code == 200
        assert _post(base + "/tokenize", {"prompt": "x"}, headers={"Authorization": "bearer s3cret"}).status_code == 200
        for stream in (True, False):  # the key's middleware leaves the handlers' disconnect watch working
            _disconnect_frees_blocks({"base": base}, stream, key)
    finally:
        _stop(proc)


def test_create_app_refuses_an_empty_api_key():
    from reference.engine.server import create_app

    for bad in ("", 7, "k1 ", " k1", "k\n1", "clé"):
        with pytest.raises(ValueError, match="api_key"):
            create_app(None, api_key=bad)
    from reference.engine.server import main

    with pytest.raises(SystemExit):  # refused before any model is loaded
        main(["--model", "/nonexistent", "--api-key", "k1 "])


def test_a_stream_sends_the_tokens_that_arrive_while_its_handler_reads(tmp_path, monkeypatch):
    """In process, with the handler's detokenizer slowed (30 ms a decode) so the engine thread
    finishes the request while the handler reads its output: the streamed text still equals the
    whole reply. The stream once ended on a look after the handler's read, and lost what arrived
    during it (its last characters)."""
    from fastapi.testclient import TestClient

    from reference.engine import LLM, EngineConfig
    from reference.engine import server

    paths = save_tiny(tmp_path, {}, seed=3)
    llm = LLM(str(paths["model"]), EngineConfig(max_loras_per_batch=2, max_lora_rank=8, num_kv_blocks=64,
                                                block_size=4, max_num_seqs=4, max_num_batched_tokens=64),
              dtype=torch.float32, device=torch.device("cpu"))
    import transformers

    app = server.create_app(llm, transformers.AutoTokenizer.from_pretrained(paths["model"]), "tiny-llama")
    slow_decode = server._Detok.decode

    def decode(self, token_ids):
        time.sleep(0.03)
        return slow_decode(self, token_ids)

    body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0}
    try:
        with TestClient(app) as client:
            whole = client.post("/v1/completions", json=body).json()["choices"][0]
            monkeypatch.setattr(server._Detok, "decode", decode)
            with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                events = [line[len("data: "):] for line in reply.iter_lines() if line.startswith("data: ")]
    finally:
        app.state.engine.stop()
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert len(whole["text"]) >= 4  # the reply is text, not nothing (a tokenizer-less server has none)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["finish_reason"] == whole["finish_reason"]
