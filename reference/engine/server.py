"""An OpenAI-compatible HTTP endpoint over the engine: ``/v1/models`` and ``/v1/completions``.

Source: vLLM's OpenAI server (``vllm/entrypoints/openai``): the adapter is chosen by the request's
``model`` field (the base model's served name, or a registered adapter's name, as vLLM serves
``--lora-modules name=path``); an unknown model is a 404, a request the engine refuses a 400, both
in OpenAI's error shape (``{"error": {"message", "type", "code"}}``), so the official ``openai``
client raises ``NotFoundError`` / ``BadRequestError``.

Batching: one engine thread serves the requests in waves. It takes every request queued when it
becomes free and runs them as one ``LLM.generate`` call (one continuous-batching run over all of
their prompts and adapters); requests that arrive meanwhile wait for the next wave. The engine's
step loop is not exposed to add requests to a running wave (vLLM's ``AsyncLLMEngine`` does that).

Run::

    python -m reference.engine.server --model PATH [--adapter NAME=PEFT_DIR ...] [--port 8000]

``PATH`` is a saved Hugging Face Llama folder with its tokenizer. Client::

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.completions.create(model="NAME", prompt="Hello", max_tokens=8, temperature=0)
"""

import argparse
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Optional, Union

from reference.engine.llm import LLM
from reference.engine.sequence import SamplingParams

__all__ = ["create_app", "main"]

Prompt = Union[str, list[int], list[str], list[list[int]]]


class _Refused(Exception):
    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Waves:
    """The engine thread: queued requests run together, one ``generate`` call per wave."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.queue: "queue.Queue[tuple[list, list, list, Future]]" = queue.Queue()
        threading.Thread(target=self._loop, name="engine", daemon=True).start()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], names: list[Optional[str]]):
        done: Future = Future()
        self.queue.put((prompts, params, names, done))
        return done.result()

    def _loop(self) -> None:
        while True:
            wave = [self.queue.get()]
            while True:
                try:
                    wave.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            prompts = [p for w in wave for p in w[0]]
            params = [p for w in wave for p in w[1]]
            names = [n for w in wave for n in w[2]]
            try:
                outs = self.llm.generate(prompts, params, lora_request=names)
            except BaseException as exc:  # noqa: BLE001 (every waiting request hears of it)
                for w in wave:
                    w[3].set_exception(exc)
                continue
            at = 0
            for w in wave:
                w[3].set_result(outs[at:at + len(w[0])])
                at += len(w[0])


def _prompts(prompt: Prompt, tokenizer) -> list[list[int]]:
    """OpenAI's four prompt forms -> token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise _Refused(400, "prompt must be a string, a list of strings, a list of token ids or a list of those",
                       "BadRequestError")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(list(tokenizer.encode(p, add_special_tokens=False)))
        elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append(p)
        else:
            raise _Refused(400, "prompt must be a string, a list of strings, a list of token ids or a list of those",
                           "BadRequestError")
    return out


def create_app(llm: LLM, tokenizer, served_model_name: str = "base"):
    """A FastAPI app serving ``llm``: the base model as ``served_model_name``, each adapter
    registered in ``llm`` (``llm.register_adapter(name, path)``, before or after this call) under its
    name. ``tokenizer``: anything with ``encode(text, add_special_tokens=False)`` and ``decode(ids)``
    (a ``transformers`` tokenizer). Raises ImportError without fastapi."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI(title="multi-LoRA book engine")
    waves = _Waves(llm)
    created = int(time.time())

    def refuse(exc: _Refused) -> JSONResponse:
        return JSONResponse(status_code=exc.status,
                            content={"error": {"message": exc.message, "type": exc.kind, "param": None,
                                               "code": exc.status}})

    @app.get("/v1/models")
    def models() -> dict:
        data = [{"id": served_model_name, "object": "model", "created": created, "owned_by": "lora-book"}]
        data += [{"id": name, "object": "model", "created": created, "owned_by": "lora-book",
                  "parent": served_model_name} for name in sorted(llm.registry.names())]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = await request.json()
        except ValueError:
            return refuse(_Refused(400, "the request body is not JSON", "BadRequestError"))
        try:
            prompts, params, adapter, model = _parse(body, tokenizer, served_model_name, llm)
        except _Refused as exc:
            return refuse(exc)
        import anyio

        outs = await anyio.to_thread.run_sync(waves.submit, prompts, [params] * len(prompts),
                                              [adapter] * len(prompts))
        errors = [o.error for o in outs if o.error]
        if errors:
            return refuse(_Refused(400, errors[0], "BadRequestError"))
        choices = [{"index": i, "text": tokenizer.decode(o.token_ids), "logprobs": None,
                    "finish_reason": "stop" if o.finish_reason == "stop" else "length"}
                   for i, o in enumerate(outs)]
        completion = sum(len(o.token_ids) for o in outs)
        prompt_tokens = sum(len(p) for p in prompts)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    return app


def _parse(body: Any, tokenizer, served: str, llm: LLM):
    """(prompts, SamplingParams, adapter name or None, model) of a completions body, or _Refused."""
    if not isinstance(body, dict):
        raise _Refused(400, "the request body must be a JSON object", "BadRequestError")
    model = body.get("model")
    if model != served and model not in llm.registry.names():
        raise _Refused(404, f"The model `{model}` does not exist.", "NotFoundError")
    unsupported = [k for k, default in (("stream", False), ("echo", False), ("logprobs", None), ("suffix", None),
                                        ("n", 1), ("best_of", None), ("stop", None))
                   if body.get(k, default) not in (default, [] if k == "stop" else default)]
    if unsupported:
        raise _Refused(400, f"not supported by this server: {', '.join(unsupported)} (stop on token ids: "
                            "stop_token_ids)", "BadRequestError")
    if "prompt" not in body:
        raise _Refused(400, "prompt is required", "BadRequestError")
    prompts = _prompts(body["prompt"], tokenizer)
    temperature = body.get("temperature", 1.0)
    seed = body.get("seed")
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and temperature > 0 and seed is None:
        seed = secrets.randbelow(2 ** 31)  # OpenAI's seed is optional; the engine draws reproducibly from one
    params = SamplingParams(max_new_tokens=body.get("max_tokens", 16), temperature=temperature, seed=seed,
                            stop_token_ids=tuple(body.get("stop_token_ids") or ()))
    try:
        params.check()
    except ValueError as exc:
        raise _Refused(400, str(exc).replace("max_new_tokens", "max_tokens"), "BadRequestError") from None
    return prompts, params, (None if model == served else model), model


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a saved Hugging Face Llama folder (with its tokenizer)")
    ap.add_argument("--adapter", action="append", default=[], metavar="NAME=PEFT_DIR")
    ap.add_argument("--served-model-name", default="base")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    import transformers
    import uvicorn

    llm = LLM(args.model)
    for spec in args.adapter:
        name, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"--adapter takes NAME=PEFT_DIR, got {spec!r}")
        llm.register_adapter(name, path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    uvicorn.run(create_app(llm, tokenizer, args.served_model_name), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
