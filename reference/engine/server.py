"""An OpenAI-compatible HTTP server over the engine, shaped like vLLM's.

Endpoints: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (both streamed as
server-sent events with ``stream: true``), ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's runtime adapter API), ``/health`` and ``/metrics`` (Prometheus),
and vLLM's ``/tokenize``, ``/detokenize`` and ``/version``. With ``--api-key`` every route but
``/health``, ``/metrics`` and ``/version`` needs ``Authorization: Bearer KEY`` (401 otherwise): the
adapter API reads any folder the server can read. That is stricter than vLLM's ``--api-key``,
which guards only the ``/v1`` routes (its ``/tokenize`` stays open) and lets OPTIONS through.

Source: vLLM's OpenAI server (``vllm/entrypoints/openai``) and ``AsyncLLMEngine``. The adapter is
chosen by the request's ``model`` field (the base model's served name, or a registered adapter's
name, as vLLM serves ``--lora-modules name=path``).

Continuous batching: one engine thread owns the :class:`~reference.engine.llm.LLM` and runs its step
loop (``add_request`` / ``step`` / ``abort_request``); an HTTP request hands its prompts to that
thread, which adds them before its next step, so a request that arrives while others decode joins
their batch at once. Every step updates each request's output in place and wakes its handler,
which streams the new text or waits for the end. A client that disconnects aborts its requests:
their KV blocks are freed and their adapter no longer counts as running.

Errors, in OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``, so the official
``openai`` client raises the matching exception): 400 for what a request asked that the server
refuses (with the parameter named), 404 for an unknown model, 500 for the server's own faults. A
request the engine cannot serve (a NaN adapter's logits) fails alone; every other request's tokens
are exactly what they would have been without it (``LLM.step``).

Every parameter of OpenAI's API is either honoured or refused with a 400 that names it. Honoured:
``max_tokens`` (``max_completion_tokens`` in chat), ``temperature``, ``top_p``, ``seed``, ``stop``
(strings), ``n`` = 1, ``logprobs`` (the chosen token's only: 0 / ``true`` with ``top_logprobs`` 0),
``stream`` and ``stream_options.include_usage``, ``user`` (recorded nowhere); vLLM's extras
``top_k``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``. The engine stops at the tokenizer's
eos token unless ``ignore_eos``.

Run (``python -m reference.engine.tiny /tmp/tiny --adapter sql`` makes a folder to try it with)::

    python -m reference.engine.server --model /tmp/tiny/model --lora-modules sql=/tmp/tiny/sql --port 8000

Client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="sql", prompt="Hello", max_tokens=8, temperature=0)
"""

import argparse
import asyncio
import contextlib
import json
import queue
import secrets
import sys
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from reference.engine.llm import LLM, EngineConfig, RequestOutput
from reference.engine.sequence import SamplingParams

__all__ = ["EngineLoop", "create_app", "main"]

# OpenAI parameters refused unless they carry their default (the engine has no such feature)
_REFUSED = {"echo": False, "suffix": None, "best_of": None, "presence_penalty": 0, "frequency_penalty": 0,
            "logit_bias": None, "top_logprobs": 0, "tools": None, "tool_choice": None, "functions": None,
            "function_call": None, "response_format": None, "parallel_tool_calls": None,
            "repetition_penalty": 1.0, "min_p": 0.0, "prompt_logprobs": None, "n": 1, "guided_json": None,
            "audio": None, "modalities": None, "prediction": None, "reasoning_effort": None}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "stream", "stream_options",
           "user", "top_k", "min_tokens", "ignore_eos", "stop_token_ids", "include_stop_str_in_output",
           "skip_special_tokens", *_REFUSED}
_COMPLETION_KEYS = _COMMON | {"prompt"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "add_generation_prompt", "chat_template_kwargs",
                        "continue_final_message", "store", "metadata"}


class Refused(Exception):
    """A request the server answers with an error: HTTP ``status``, OpenAI ``kind`` and ``param``."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class _Stream:
    """One prompt's request inside the engine, as its HTTP handler sees it."""

    out: Optional[RequestOutput] = None  # set by the engine thread when added
    wake: Callable[[], None] = lambda: None  # thread-safe: tells the handler something changed
    failure: Optional[Refused] = None  # a server fault that ended it (500)
    arrived: float = field(default_factory=time.perf_counter)
    reported: int = 0  # tokens the metrics counted
    by_stop_string: bool = False  # its handler ended it at a stop string (finish reason "stop")


class EngineLoop:
    """The engine thread: owns ``llm``; everything else talks to it through :meth:`call`.

    Each turn it runs the calls queued (adds, aborts, adapter loads), then one ``llm.step()``, then
    wakes every handler whose request changed. A step that raises is the engine's own fault: every
    request in flight ends with a 500 and is aborted, and the loop goes on (the engine stays usable).
    """

    def __init__(self, llm: LLM, metrics: "Optional[_Metrics]" = None) -> None:
        self.llm, self.metrics = llm, metrics
        self.inbox: "queue.Queue[tuple[Callable, Future]]" = queue.Queue()
        self.streams: dict[int, _Stream] = {}
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn()`` on the engine thread before its next step; its result (or exception) in the future."""
        done: Future = Future()
        self.inbox.put((fn, done))
        return done

    def add(self, prompt: list[int], params: SamplingParams, adapter: Optional[str], stream: _Stream) -> None:
        """(engine thread) Add one request; a refused one ends at once with its error set."""
        out = self.llm.add_request(prompt, params, adapter)
        stream.out = out
        if out.error is None:
            self.streams[out.request_id] = stream
        stream.wake()

    def abort(self, stream: _Stream) -> None:
        """(engine thread) Abort a request whose client went away, or that a stop string ended."""
        if stream.out is not None and self.streams.pop(stream.out.request_id, None) is not None:
            self.llm.abort_request(stream.out.request_id)
            if self.metrics is not None:
                self.metrics.observe(stream, "stop" if stream.by_stop_string else "abort")
            stream.wake()  # a handler that stopped it (a stop string) waits for its end

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put((lambda: None, Future()))
        self.thread.join(timeout=30)

    def _loop(self) -> None:
        while not self.stopped.is_set():
            idle = not self.llm.has_unfinished()
            try:
                item = self.inbox.get(timeout=0.5) if idle else self.inbox.get_nowait()
            except queue.Empty:
                item = None
            while item is not None:
                fn, done = item
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                    done.set_exception(exc)
                try:
                    item = self.inbox.get_nowait()
                except queue.Empty:
                    item = None
            if not self.llm.has_unfinished():
                continue
            try:
                self.llm.step()
            except Exception as exc:  # noqa: BLE001 (the engine's fault: every request in flight hears of it)
                failure = Refused(500, f"the engine failed while serving this request: {type(exc).__name__}: {exc}",
                                  "InternalServerError")
                for rid, stream in list(self.streams.items()):
                    self.llm.abort_request(rid)
                    stream.failure = failure
            for rid, stream in list(self.streams.items()):
                over = stream.out.finished or stream.failure is not None
                if over:
                    del self.streams[rid]
                if self.metrics is not None:
                    self.metrics.observe(stream, (stream.out.finish_reason or "error") if over else None)
                stream.wake()
            if self.metrics is not None:
                self.metrics.after_step(self.llm)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _prompts(prompt: Any, tokenizer) -> list[list[int]]:
    """OpenAI's four prompt forms -> token id lists."""
    bad = Refused(400, "prompt must be a string, a list of strings, a list of token ids or a list of those",
                  param="prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise bad
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(_encode(tokenizer, p))
        elif isinstance(p, list) and all(_is_int(t) for t in p):
            out.append(p)
        else:
            raise bad
    return out


def _encode(tokenizer, text: str) -> list[int]:
    if tokenizer is None:
        raise Refused(400, "this server has no tokenizer: send token ids", param="prompt")
    return list(tokenizer.encode(text, add_special_tokens=False))


def _content(content: Any) -> Optional[str]:
    """A message's content as text: a string, a list of text parts (OpenAI's content parts), or
    None (an assistant turn with no text); None when it is something else."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                         for p in content):
        return "".join(p["text"] for p in content)
    return None


def _chat_prompt(messages: Any, tokenizer, add_generation_prompt: bool, continue_final: bool = False,
                 template_kwargs: Optional[dict] = None) -> list[int]:
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise Refused(400, "this model's tokenizer has no chat template: use /v1/completions", param="messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and _content(m.get("content")) is not None
            for m in messages):
        raise Refused(400, "messages must be a non-empty list of {role, content} objects whose content is a string "
                           "or a list of text parts (images and audio are not supported)", param="messages")
    messages = [{**m, "content": _content(m.get("content"))} for m in messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                                             continue_final_message=continue_final, **(template_kwargs or {}))
    except Exception as exc:  # noqa: BLE001 (a template error is about this request's messages)
        raise Refused(400, f"the chat template could not render these messages: {exc}", param="messages") from None
    return _encode(tokenizer, text)


def _chat_body_prompt(body: dict, tokenizer) -> list[int]:
    """A chat body's prompt tokens (``messages`` with ``add_generation_prompt``,
    ``continue_final_message`` and ``chat_template_kwargs``, checked as vLLM does), or Refused."""
    agp = body.get("add_generation_prompt", True)
    if not isinstance(agp, bool):
        raise Refused(400, "add_generation_prompt must be a boolean", param="add_generation_prompt")
    if "messages" not in body:
        raise Refused(400, "messages is required", param="messages")
    kwargs = body.get("chat_template_kwargs") or {}
    final = body.get("continue_final_message", False)
    if not isinstance(kwargs, dict) or not isinstance(final, bool):
        raise Refused(400, "chat_template_kwargs must be an object and continue_final_message a boolean",
                      param="chat_template_kwargs" if not isinstance(kwargs, dict) else "continue_final_message")
    if final and agp and "add_generation_prompt" in body:
        raise Refused(400, "continue_final_message and add_generation_prompt cannot both be true",
                      param="continue_final_message")
    return _chat_prompt(body["messages"], tokenizer, agp and not final, final, kwargs)


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    adapter: Optional[str]
    model: str
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool
    include_stop: bool = False
    skip_special: bool = True


def _object_with(body: Any, allowed: set) -> dict:
    """``body`` if it is a JSON object whose keys are all in ``allowed``, else Refused (400) naming the first
    other key."""
    if not isinstance(body, dict):
        raise Refused(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise Refused(400, f"unknown parameter(s): {', '.join(unknown)}", param=unknown[0])
    return body


def _served_model(body: dict, served: str, llm: LLM) -> str:
    """The model a body names: the base model's served name or a registered adapter's; a body that names
    none gets the served model (vLLM's fallback). Refused (404) for any other name."""
    model = body.get("model")
    if model is None:
        return served
    if model != served and model not in llm.registry.names():
        raise Refused(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    return model


def _parse(body: Any, tokenizer, served: str, llm: LLM, chat: bool) -> _Request:
    """The request a body asks for, or Refused (400 / 404) naming what is wrong."""
    body = _object_with(body, _CHAT_KEYS if chat else _COMPLETION_KEYS)
    for key, default in _REFUSED.items():
        value = body.get(key)
        if value is None or value == default or (key != "n" and value in ({}, [])):
            continue
        if key == "response_format" and value == {"type": "text"}:  # plain text is what the server returns
            continue
        raise Refused(400, f"{key} is not supported by this server (only its default, {default!r}, is)", param=key)
    model = _served_model(body, served, llm)
    if chat:
        prompts = [_chat_body_prompt(body, tokenizer)]
    else:
        if "prompt" not in body:
            raise Refused(400, "prompt is required", param="prompt")
        prompts = _prompts(body["prompt"], tokenizer)
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(max_key)
    if max_tokens is None:
        max_tokens = 16 if not chat else llm.max_context - max(len(p) for p in prompts)
    temperature = body.get("temperature")
    temperature = 1.0 if temperature is None else temperature
    seed = body.get("seed")
    if _is_num(temperature) and temperature > 0 and seed is None:
        seed = secrets.randbelow(2 ** 31)  # OpenAI's seed is optional; the engine draws reproducibly from one
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise Refused(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
    if stop and tokenizer is None:
        raise Refused(400, "stop strings need a tokenizer; this server has none (use stop_token_ids)", param="stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list) or not all(_is_int(t) for t in stop_ids):
        raise Refused(400, "stop_token_ids must be a list of token ids", param="stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise Refused(400, "ignore_eos must be a boolean", param="ignore_eos")
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None and not ignore_eos and eos not in stop_ids:
        stop_ids = [*stop_ids, eos]
    logprobs = body.get("logprobs")
    if chat:
        if logprobs not in (None, False, True):
            raise Refused(400, "logprobs must be a boolean", param="logprobs")
    elif logprobs not in (None, 0, 1) or isinstance(logprobs, bool):
        raise Refused(400, "logprobs: only the chosen token's (0 or 1) is supported", param="logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise Refused(400, "stream must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise Refused(400, "stream_options supports include_usage only", param="stream_options")
    flags = {k: body.get(k, d) for k, d in (("include_stop_str_in_output", False), ("skip_special_tokens", True))}
    for k, v in flags.items():
        if not isinstance(v, bool):
            raise Refused(400, f"{k} must be a boolean", param=k)
    top_k, top_p, min_tokens = body.get("top_k"), body.get("top_p"), body.get("min_tokens")
    params = dict(max_new_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=tuple(stop_ids),
                  top_k=0 if top_k in (None, -1) else top_k, top_p=1.0 if top_p is None else top_p,
                  min_tokens=0 if min_tokens is None else min_tokens,
                  logprobs=logprobs is not None and logprobs is not False)
    try:
        sp = SamplingParams(**params)
        sp.check()
    except (ValueError, TypeError) as exc:
        text = str(exc).replace("max_new_tokens", max_key)
        # the parameter the message is about; a message may name two ("sampling (temperature > 0)
        # needs an int seed" is about the seed, "min_tokens must be ... [0, max_tokens]" about min_tokens)
        param = next((k for k in ("seed", "stop_token_ids", "top_k", "top_p", "min_tokens", "logprobs", "temperature")
                      if k in text), max_key)
        raise Refused(400, text, param=param) from None
    vocab = llm.model.config.vocab_size
    for p in prompts:
        if not p:
            raise Refused(400, "the prompt is empty", param="prompt")
        if min(p) < 0 or max(p) >= vocab:
            raise Refused(400, f"token ids must lie in [0, {vocab})", param="prompt")
        if any(not 0 <= t < vocab for t in sp.stop_token_ids):
            raise Refused(400, f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids")
        if len(p) + sp.max_new_tokens > llm.max_context:
            raise Refused(400, f"This model's maximum context length is {llm.max_context} tokens; the prompt "
                               f"({len(p)} token{'s' if len(p) != 1 else ''}) plus {max_key} ({sp.max_new_tokens}) exceeds it", param=max_key)
    return _Request(prompts, sp, None if model == served else model, model, stop, stream,
                    bool(options.get("include_usage", False)), chat, flags["include_stop_str_in_output"],
                    flags["skip_special_tokens"])


class _Metrics:
    """Prometheus metrics in a registry of the app's own (vLLM's set, under the ``lora_book:`` prefix)."""

    def __init__(self, llm: LLM) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = reg = CollectorRegistry()
        self.running = Gauge("lora_book:num_requests_running", "Requests running in the batch", registry=reg)
        self.waiting = Gauge("lora_book:num_requests_waiting", "Requests waiting to be admitted", registry=reg)
        self.kv_used = Gauge("lora_book:kv_blocks_in_use", "KV blocks held by running requests", registry=reg)
        self.kv_total = Gauge("lora_book:kv_blocks_total", "KV blocks of the cache", registry=reg)
        self.kv_total.set(llm.blocks.num_blocks)
        self.prompt_tokens = Counter("lora_book:prompt_tokens", "Prompt tokens of admitted requests", registry=reg)
        self.generation_tokens = Counter("lora_book:generation_tokens", "Tokens generated", registry=reg)
        self.finished = Counter("lora_book:request_success", "Requests finished, by reason", ["finished_reason"],
                                registry=reg)
        buckets = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("lora_book:time_to_first_token_seconds", "Time to first token", registry=reg,
                              buckets=buckets)
        self.tpot = Histogram("lora_book:time_per_output_token_seconds", "Time between two tokens of a request",
                              registry=reg, buckets=buckets)
        self.e2e = Histogram("lora_book:e2e_request_latency_seconds", "Arrival to last token", registry=reg,
                             buckets=buckets)
        self.lora_events = Counter("lora_book:lora_pool_events", "Adapter pool events (load, evict, unload)",
                                   ["event"], registry=reg)
        self._pool_seen = len(llm.pool.events)

    def after_step(self, llm: LLM) -> None:
        """(engine thread) Fold the step's changes in; the pool's event log is read then trimmed."""
        events = llm.pool.events
        for e in events[self._pool_seen:]:
            if e[0] != "hit":
                self.lora_events.labels(e[0]).inc()
        llm.trim_event_logs()  # between requests only; the graphs' slot tracker keeps what it had not seen
        self._pool_seen = len(events)
        self.refresh(llm)

    def refresh(self, llm: LLM) -> None:
        sched = llm.scheduler
        self.running.set(len(sched.running))
        self.waiting.set(len(sched.waiting))
        self.kv_used.set(sum(1 for c in llm.blocks.ref_count if c > 0))

    def observe(self, stream: _Stream, finished: Optional[str] = None) -> None:
        """(engine thread) Count a request's new tokens and, when it ended (``finished``: its reason),
        the end and its latency. A request refused when it was added is not counted."""
        out = stream.out
        if out is None:
            return
        times = out.token_times
        new = len(times) - stream.reported
        if new > 0:
            if stream.reported == 0:
                self.prompt_tokens.inc(len(out.prompt))
                self.ttft.observe(times[0])
            for a, b in zip(times[max(0, stream.reported - 1):], times[max(1, stream.reported):]):
                self.tpot.observe(b - a)
            self.generation_tokens.inc(new)
            stream.reported = len(times)
        if finished is not None:
            self.finished.labels(finished).inc()
            if times:
                self.e2e.observe(times[-1])


class _Detok:
    """Incremental text of one request: what is safe to send now (no half UTF-8 character, nothing
    that could still become a stop string), and where a stop string ends it."""

    def __init__(self, tokenizer, stop: list[str], min_tokens: int = 0, include_stop: bool = False,
                 skip_special: bool = True) -> None:
        self.tokenizer, self.stop, self.min_tokens = tokenizer, stop, min_tokens
        self.include_stop, self.skip_special = include_stop, skip_special
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0
        self.stopped = False
        self.stop_tokens: Optional[int] = None  # tokens up to the one that completed the stop string

    def decode(self, token_ids: list[int]) -> str:
        # special tokens (eos) are not text by default, as vLLM's skip_special_tokens default has it
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special) if self.tokenizer else ""

    def _find(self, token_ids: list[int]) -> Optional[tuple[int, int]]:
        """(start, end) of the first stop string that ends after the min_tokens-th token (vLLM checks
        stop strings only from there on), or None."""
        text = self.decode(token_ids)
        floor = len(self.decode(token_ids[:self.min_tokens])) if self.min_tokens else 0
        found = None
        for s in self.stop:
            at = text.find(s, max(0, floor - len(s) + 1))
            while at >= 0 and at + len(s) <= floor:
                at = text.find(s, at + 1)
            if at >= 0 and (found is None or at < found[0]):
                found = (at, at + len(s))
        return found

    def text(self, token_ids: list[int]) -> str:
        text = self.decode(token_ids)
        if not self.stop or len(token_ids) < self.min_tokens:
            return text
        found = self._find(token_ids)
        if found is None:
            return text
        if not self.stopped:
            self.stopped = True
            self.stop_tokens = next(n for n in range(1, len(token_ids) + 1) if self._find(token_ids[:n]) is not None)
        return text[:found[1] if self.include_stop else found[0]]

    def delta(self, token_ids: list[int], final: bool) -> str:
        text = self.text(token_ids)
        end = len(text)
        if not final and not self.stopped:
            if text.endswith("\ufffd"):  # a character whose bytes are not all here yet
                end = len(text.rstrip("\ufffd"))
            end = max(self.sent, end - self.hold)
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return piece


def api_key_problem(api_key: Any) -> Optional[str]:
    """Why no HTTP client could send ``api_key`` in a header (not a string, empty, surrounding spaces,
    which HTTP strips, or not printable ASCII, which httpx refuses), or None when it is fine."""
    if not isinstance(api_key, str) or not api_key or api_key != api_key.strip() \
            or not (api_key.isascii() and api_key.isprintable()):
        return "the API key must be non-empty printable ASCII without surrounding spaces (what an HTTP client can " \
               "send in a header)"
    return None


#: Routes open without the API key: a load balancer's probes and a metrics scraper hold no key.
OPEN_ROUTES = ("/health", "/metrics", "/version")


class _BearerAuth:
    """ASGI middleware: a request outside :data:`OPEN_ROUTES` (any method) passes only with
    ``Authorization: Bearer <key>`` (the scheme in any case, RFC 7235; the key compared in constant
    time, so it is not guessed byte by byte); else ``refusal``. Pure ASGI, not Starlette's
    ``BaseHTTPMiddleware``, which wraps every response and the request's ``receive``: the handlers'
    disconnect watch (``request.is_disconnected``) must see the client's own."""

    def __init__(self, app, key: bytes, refusal: Refused) -> None:
        self.app, self.key, self.refusal = app, key, refusal

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_ROUTES:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = given.partition(b" ")
            if not (scheme.lower() == b"bearer") & secrets.compare_digest(token, self.key):
                from fastapi.responses import JSONResponse
                await JSONResponse(status_code=self.refusal.status, content=self.refusal.body(),
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(llm: LLM, tokenizer=None, served_model_name: str = "base", max_loras: Optional[int] = None,
               api_key: Optional[str] = None):
    """A FastAPI app serving ``llm``: the base model as ``served_model_name``, each adapter
    registered in ``llm`` under its name (``llm.register_adapter``, or at run time through
    ``/v1/load_lora_adapter``). ``tokenizer``: a ``transformers`` tokenizer (None: token-id prompts
    only, no stop strings, no chat). ``max_loras``: how many adapters may be registered at once
    (None: any number). ``api_key``: when given, every route outside :data:`OPEN_ROUTES` answers 401
    (OpenAI's ``AuthenticationError``) unless the request carries ``Authorization: Bearer <api_key>``
    (vLLM's ``--api-key``). The engine thread starts now; ``app.state.engine.stop()`` ends it.
    Raises ImportError without fastapi or prometheus_client; ValueError for an ``api_key`` no HTTP
    client could send (not a string, empty, surrounding spaces, not printable ASCII)."""
    if api_key is not None and (problem := api_key_problem(api_key)):
        raise ValueError(f"api_key: {problem}; None: no key")
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    metrics = _Metrics(llm)
    engine = EngineLoop(llm, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.stop()  # the server shuts down: the engine thread ends with it

    app = FastAPI(title="multi-LoRA book engine", lifespan=lifespan)
    app.state.engine = engine
    created = int(time.time())
    admin = threading.Lock()  # one adapter load/unload at a time (they read folders off the engine thread)

    def error(exc: Refused) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content=exc.body())

    if api_key is not None:
        app.add_middleware(_BearerAuth, key=api_key.encode(),
                           refusal=Refused(401, "Unauthorized: send the server's API key as 'Authorization: Bearer "
                                                "KEY'", "AuthenticationError"))

    async def engine_call(fn):
        return await asyncio.wrap_future(engine.call(fn))

    @app.get("/health")
    def health():
        if not engine.thread.is_alive():
            return error(Refused(500, "the engine thread is not running", "InternalServerError"))
        return {}

    @app.get("/metrics")
    def metrics_endpoint():
        metrics.refresh(llm)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    def version() -> dict:
        from importlib.metadata import PackageNotFoundError, version as package_version
        try:
            return {"version": package_version("multi-lora-book")}
        except PackageNotFoundError:  # run from a checkout that was not installed
            return {"version": "unknown"}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's ``/tokenize``: the token ids a completion (``prompt``) or a chat (``messages``) request
        would feed the engine, their count and the model's length limit."""
        try:
            body = _object_with(await json_body(request), {
                "model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "continue_final_message",
                "chat_template_kwargs"})
            _served_model(body, served_model_name, llm)
            if body.get("add_special_tokens", False) is not False:
                raise Refused(400, "add_special_tokens must be false: this server adds no special tokens to a "
                                   "prompt (a chat template writes its own)", param="add_special_tokens")
            if ("prompt" in body) == ("messages" in body):
                raise Refused(400, "send exactly one of prompt (a string) and messages", param="prompt")
            if "prompt" in body:
                if not isinstance(body["prompt"], str):
                    raise Refused(400, "prompt must be a string", param="prompt")
                tokens = _encode(tokenizer, body["prompt"])
            else:  # the chat endpoint's own parsing: the same tokens it would feed the engine
                tokens = _chat_body_prompt(body, tokenizer)
        except Refused as exc:
            return error(exc)
        return {"count": len(tokens), "max_model_len": llm.max_context, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's ``/detokenize``: the text of a list of token ids."""
        try:
            body = _object_with(await json_body(request), {"model", "tokens"})
            _served_model(body, served_model_name, llm)
            if tokenizer is None:
                raise Refused(400, "this server has no tokenizer", param="tokens")
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(_is_int(t) and 0 <= t < len(tokenizer) for t in tokens):
                raise Refused(400, f"tokens must be a list of token ids in [0, {len(tokenizer)})", param="tokens")
        except Refused as exc:
            return error(exc)
        return {"prompt": tokenizer.decode(tokens)}

    @app.get("/v1/models")
    def models() -> dict:
        data = [{"id": served_model_name, "object": "model", "created": created, "owned_by": "lora-book",
                 "root": served_model_name, "parent": None, "max_model_len": llm.max_context}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "lora-book", "root": name,
                  "parent": served_model_name, "max_model_len": llm.max_context} for name in sorted(llm.registry.names())]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id}")
    def model(model_id: str):
        found = [m for m in models()["data"] if m["id"] == model_id]
        if not found:
            return error(Refused(404, f"The model `{model_id}` does not exist.", "NotFoundError", "model"))
        return found[0]

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc):  # an unknown path or method, in OpenAI's shape too
        return error(Refused(exc.status_code, str(exc.detail), "NotFoundError" if exc.status_code == 404 else
                             "BadRequestError"))

    async def json_body(request: Request):
        try:
            return await request.json()
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than Python's parser recurses
            raise Refused(400, "the request body is not JSON (or nests too deeply)") from None

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        try:
            body = await json_body(request)
            name, path = (body.get("lora_name"), body.get("lora_path")) if isinstance(body, dict) else (None, None)
            if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
                raise Refused(400, "lora_name and lora_path (strings) are required", param="lora_name")
            if name == served_model_name:
                raise Refused(400, f"{name!r} is the base model's name", param="lora_name")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                raise Refused(400, "load_inplace must be a boolean", param="load_inplace")
            if name in llm.registry.names() and not inplace:
                # vLLM's rule: replacing a loaded adapter is asked for explicitly
                raise Refused(400, f"an adapter named {name!r} is already loaded: pass \"load_inplace\": true to "
                                   "replace it (requests already running finish on the old weights)",
                              param="lora_name")
            if max_loras is not None and name not in llm.registry.names() and len(llm.registry.names()) >= max_loras:
                raise Refused(400, f"{max_loras} adapters are loaded (--max-loras): unload one first", param="lora_name")
            from reference.adapters import load_peft_adapter

            def read():
                with admin:
                    return load_peft_adapter(path, llm.modules, llm.num_layers, llm.config.max_lora_rank, uid=name)
            import anyio

            try:
                adapter = await anyio.to_thread.run_sync(read)  # disk reads off the engine thread
            except (OSError, ValueError) as exc:
                raise Refused(400, f"could not load the adapter in {path!r}: {exc}", param="lora_path") from None
            try:
                await engine_call(lambda: llm.register_adapter_weights(name, adapter))
            except ValueError as exc:
                raise Refused(400, str(exc), param="lora_path") from None
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
        except Refused as exc:
            return error(exc)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        try:
            body = await json_body(request)
            name = body.get("lora_name") if isinstance(body, dict) else None
            if not isinstance(name, str) or name not in llm.registry.names():
                raise Refused(404, f"no adapter named {name!r} is loaded", "NotFoundError", "lora_name")
            await engine_call(lambda: llm.unregister_adapter(name))
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
        except Refused as exc:
            return error(exc)
        except ValueError as exc:  # unloaded by another request meanwhile
            return error(Refused(404, str(exc), "NotFoundError", "lora_name"))

    async def serve(request: Request, chat: bool):
        try:
            body = await json_body(request)
            req = _parse(body, tokenizer, served_model_name, llm, chat)
        except Refused as exc:
            return error(exc)
        loop = asyncio.get_running_loop()
        changed = asyncio.Event()
        streams = [_Stream(wake=lambda: loop.call_soon_threadsafe(changed.set)) for _ in req.prompts]
        for prompt, stream in zip(req.prompts, streams):
            engine.call(lambda p=prompt, s=stream: engine.add(p, req.params, req.adapter, s))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        detoks = [_Detok(tokenizer, req.stop, req.params.min_tokens, req.include_stop, req.skip_special)
                  for _ in streams]

        async def updates():
            """Yields after every change until every request is over; aborts them all if cancelled."""
            try:
                over = False
                while not over:
                    await changed.wait()
                    changed.clear()
                    for i, s in enumerate(streams):
                        if s.out is not None and s.out.error is None and s.failure is None and detoks[i].stopped \
                                and not s.out.finished:
                            s.by_stop_string = True
                            engine.call(lambda s=s: engine.abort(s))  # a stop string ended it
                    # read before the caller looks, not after: the engine thread updates the outputs in
                    # place, and a request that finished while the caller read it (checked after the
                    # yield) ended the stream before the caller saw its last tokens (a streamed reply
                    # lost its last character); what the caller reads is at least this new
                    over = all(_over(s, d) for s, d in zip(streams, detoks))
                    yield
            finally:
                if not all(_over(s, d) for s, d in zip(streams, detoks)):  # the client went away
                    for s in streams:
                        engine.call(lambda s=s: engine.abort(s))

        if req.stream:
            return StreamingResponse(_sse(req, rid, streams, detoks, updates(), metrics, chat),
                                     media_type="text/event-stream")
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        gone = False
        try:
            async for _ in updates():
                for s, d in zip(streams, detoks):
                    if s.out is not None:
                        d.text(s.out.token_ids)  # notices stop strings as tokens arrive
                if watcher.done():
                    gone = True
                    break  # leaving the loop closes updates(), which aborts what still runs
        finally:
            watcher.cancel()
        if gone:  # nobody reads this answer (nginx's 499: client closed request)
            return JSONResponse(status_code=499, content=Refused(499, "the client closed the request").body())
        failed = next((_failure(s) for s in streams if _failure(s) is not None), None)
        if failed is not None:
            return error(failed)
        choices = []
        for i, (s, d) in enumerate(zip(streams, detoks)):
            text = d.text(s.out.token_ids)
            n = _generated(s, d)
            choice = {"index": i, "finish_reason": _reason(s, d), "logprobs": _logprobs(s.out, 0, n, tokenizer, chat)}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            choices.append(choice)
        prompt_tokens = sum(len(p) for p in req.prompts)
        completion = sum(_generated(s, d) for s, d in zip(streams, detoks))
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": req.model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


async def _watch_disconnect(request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.2)


def _failure(s: _Stream) -> Optional[Refused]:
    if s.failure is not None:
        return s.failure
    if s.out is not None and s.out.error is not None:
        # refused when added (400: what it asked), or failed while generating (500: the served model's fault)
        return Refused(500 if s.out.finish_reason == "error" else 400, s.out.error,
                       "InternalServerError" if s.out.finish_reason == "error" else "BadRequestError")
    return None


def _over(s: _Stream, d: _Detok) -> bool:
    return s.failure is not None or (s.out is not None and (s.out.finished or (d.stopped and s.out.finish_reason)))


def _reason(s: _Stream, d: _Detok) -> str:
    if d.stopped or s.out.finish_reason == "stop":
        return "stop"
    return "length" if s.out.finish_reason == "length" else s.out.finish_reason or "stop"


def _generated(s: _Stream, d: _Detok) -> int:
    """The tokens a request generated as its caller sees them (usage, logprobs): up to the one that
    completed its stop string, though the engine may have sampled one or two more before the abort
    reached it (vLLM counts the same)."""
    n = len(s.out.token_ids)
    return min(n, d.stop_tokens) if d.stopped and d.stop_tokens is not None else n


def _logprobs(out: RequestOutput, start: int, end: int, tokenizer, chat: bool):
    """OpenAI's logprobs object for tokens [start, end) of ``out`` (the chosen tokens only); None
    when the request did not ask for them."""
    if not out.logprobs:
        return None
    ids, lps = out.token_ids[start:end], out.logprobs[start:end]
    toks = [tokenizer.decode([t]) if tokenizer is not None else str(t) for t in ids]
    if chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(toks, lps)]}
    return {"tokens": toks, "token_logprobs": lps, "top_logprobs": None, "text_offset": None}


async def _sse(req: _Request, rid: str, streams: list[_Stream], detoks: list[_Detok], updates, metrics, chat: bool):
    """Server-sent events as the ``openai`` client reads them: one chunk per change, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    created = int(time.time())
    sent_role = [False] * len(streams)
    done = [False] * len(streams)
    logged = [0] * len(streams)

    def chunk(i: int, text: str, reason: Optional[str], lps=None) -> str:
        if chat:
            delta = {"content": text}
            if not sent_role[i]:
                delta["role"], sent_role[i] = "assistant", True
            choice = {"index": i, "delta": delta, "finish_reason": reason, "logprobs": lps}
        else:
            choice = {"index": i, "text": text, "finish_reason": reason, "logprobs": lps}
        return "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": req.model,
                                      "choices": [choice]}) + "\n\n"

    async for _ in updates:
        for i, (s, d) in enumerate(zip(streams, detoks)):
            if done[i] or s.out is None and s.failure is None:
                continue
            failed = _failure(s)
            if failed is not None:
                done[i] = True
                yield "data: " + json.dumps(failed.body()) + "\n\n"
                continue
            final = _over(s, d)
            piece = d.delta(s.out.token_ids, final)
            lps = None
            if s.out.logprobs and len(s.out.token_ids) > logged[i]:
                upto = _generated(s, d)
                lps = _logprobs(s.out, logged[i], upto, d.tokenizer, chat) if upto > logged[i] else None
                logged[i] = upto
            if piece or final or lps:
                yield chunk(i, piece, _reason(s, d) if final else None, lps)
            if final:
                done[i] = True
    if req.include_usage:
        prompt_tokens = sum(len(p) for p in req.prompts)
        completion = sum(_generated(s, d) for s, d in zip(streams, detoks) if s.out is not None)
        yield "data: " + json.dumps({"id": rid, "object": kind, "created": created, "model": req.model, "choices": [],
                                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                                               "total_tokens": prompt_tokens + completion}}) + "\n\n"
    yield "data: [DONE]\n\n"


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a saved Hugging Face Llama folder (with its tokenizer, "
                                                   "or pass --tokenizer / --skip-tokenizer-init)")
    ap.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PEFT_DIR",
                    help="adapters served under their names (vLLM's flag)")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=PEFT_DIR", help=argparse.SUPPRESS)
    ap.add_argument("--served-model-name", default="base")
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder, when the model folder has none")
    ap.add_argument("--skip-tokenizer-init", action="store_true",
                    help="serve without a tokenizer: token-id prompts only (no chat, no stop strings)")
    ap.add_argument("--max-loras", type=int, default=3,
                    help="adapters in one batch, as vLLM counts them: the GPU slots are these plus one for the base model")
    ap.add_argument("--max-cpu-loras", type=int, default=None, help="host copies kept (the CPU tier)")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--num-kv-blocks", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-adapters", type=int, default=None, help="adapters registered at once (None: any)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--cuda-graph", choices=["auto", "on", "off"], default="auto",
                    help="decode steps through the graph runner: auto = CUDA graphs on a GPU, eager elsewhere; "
                         "on = also on the CPU (the same static buffers, called without capture: how the tests "
                         "check the graph path); off = eager (vLLM's --enforce-eager)")
    ap.add_argument("--api-key", default=None,
                    help="every route but /health, /metrics and /version needs 'Authorization: Bearer KEY' "
                         "(vLLM's flag); without it, anyone who reaches the port can load adapters from any "
                         "folder the server can read")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    if args.api_key is not None and (problem := api_key_problem(args.api_key)):
        ap.error(f"--api-key: {problem}")
    import torch
    import transformers
    import uvicorn

    cfg = EngineConfig(max_loras_per_batch=args.max_loras + 1, max_lora_rank=args.max_lora_rank,
                       max_loaded_loras=args.max_cpu_loras, num_kv_blocks=args.num_kv_blocks,
                       block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                       cuda_graph={"auto": None, "on": True, "off": False}[args.cuda_graph])
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    llm = LLM(args.model, cfg, dtype=getattr(torch, args.dtype), device=device)
    for spec in [*args.lora_modules, *args.adapter]:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--lora-modules takes NAME=PEFT_DIR, got {spec!r}")
        llm.register_adapter(name, path)
    tokenizer = None
    if not args.skip_tokenizer_init:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.model)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"no tokenizer in {args.tokenizer or args.model} ({exc}); pass --tokenizer DIR, or "
                             "--skip-tokenizer-init to serve token-id prompts only") from None
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: serving on {args.host} without --api-key: anyone who reaches port {args.port} can load "
              "adapters from any folder this process can read", file=sys.stderr)
    uvicorn.run(create_app(llm, tokenizer, args.served_model_name, args.max_adapters, args.api_key), host=args.host,
                port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
