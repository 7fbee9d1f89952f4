"""The offline API: ``LLM(model).generate(prompts, sampling_params, lora_request=...)`` (vLLM's shape).

One engine = the control plane (``Scheduler`` over a ``BlockManager``, an ``AdapterRegistry`` of
names -> uids) and the data plane (a ``LoRAMemoryPool`` of GPU slots with its CPU and disk tiers,
the model's projections wrapped by chapter 07's LoRA layers, the paged ``ModelRunner``). Each step
the scheduler says which sequences compute which tokens; the pool makes their adapters resident
(``prepare_lora_batch``, the running ones kept); the runner computes the logits of each sequence's
last token; the sampler picks the next tokens; the scheduler records them.

Requests are token ids (no tokenizer: the book's models are built from a config). Adapters are
registered by name from PEFT folders; a request names its adapter, and the engine serves the uid the
name had when the request arrived (chapter 05: re-registering a name gives a new uid, so a request
never meets another version's weights or KV).

Source: vLLM ``vllm/entrypoints/llm.py`` (``LLM.generate``, ``LoRARequest``), nano-vllm
``nanovllm/engine/llm_engine.py`` (the step loop), SGLang's per-request ``lora_path``.
"""
from __future__ import annotations

import numbers
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Hashable, Optional, Sequence as Seq, Union

import torch

from reference.adapters import load_peft_adapter
from reference.engine.block_manager import BlockManager
from reference.engine.cuda_graph_runner import enable_graph_decode
from reference.engine.policies import admit_requests, block_hashes, choose_drain
from reference.engine.model_runner import ModelRunner, SeqWork, sample_batch
from reference.engine.scheduler import Scheduler, SchedulerConfig, Work
from reference.engine.sequence import SamplingParams, Sequence, SeqStatus
from reference.layers import LoRABackend, LoRAContext, wrap_llama
from reference.mem_pool import AdapterRegistry, LoRAAdapter, LoRAMemoryPool
from reference.tp.model import llama_checkpoint, llama_pool_modules

__all__ = ["EngineConfig", "EnginePolicies", "RequestOutput", "LLM", "engine_step", "StepFn"]


@dataclass(frozen=True)
class EngineConfig:
    """Sizes of one engine. KV memory is ``num_kv_blocks * block_size`` positions in all."""

    max_loras_per_batch: int = 4  # GPU slots, the base model's included
    max_lora_rank: int = 16
    max_loaded_loras: Optional[int] = None  # CPU tier capacity (None: unbounded)
    num_kv_blocks: int = 64
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256
    drain_threshold: Optional[int] = None
    eviction_policy: str = "lru"
    # the LoRA kernels: "torch" or "triton" (chapter 07's backends), or a LoRABackend (get_backend)
    backend: Union[str, LoRABackend] = "torch"
    # decode steps through PagedDecodeGraphRunner (buckets up to max_num_seqs): None = on a CUDA
    # device (CUDA graphs), eager elsewhere; True = also on the CPU (the static path called without
    # capture, as the tests run it); False = always eager. With it, the pool has one slot more,
    # pinned to the base model: the rank-0 slot padding rows use, whatever adapters fill the others.
    cuda_graph: Optional[bool] = None
    # the attention kernel (``reference.engine.model_runner.paged_attention``): "torch" (gather, mask,
    # SDPA), "triton" (walks each block table up to its length); None = "triton" on CUDA, else "torch"
    attention_backend: Optional[str] = None
    # the decoder layer's residual add + RMSNorm, rotary embedding and SiLU-and-mul as one Triton kernel
    # each (``ModelRunner``'s ``fused_ops``); None = on CUDA for a SiLU model, the torch ops elsewhere
    fused_ops: Optional[bool] = None
    # with fused_ops, each layer's q|k|v and gate|up as one GEMM each and each packed LoRA module as one
    # expand (``ModelRunner``'s ``packed_projections``); None = on with fused_ops
    packed_projections: Optional[bool] = None
    # a step with prompt tokens gives the LoRA ops its rows grouped by adapter slot, one SGMV segment
    # per slot (``ModelRunner``'s ``sort_lora_by_slot``): on an H100 a step with prompt tokens spent
    # 5.7-8.2 ms in LoRA kernels against 12.4-12.7 ms by sequence (benchmarks/results/engine_sorted_h100.json
    # against engine_inline_h100.json, one session); the tokens are the same either way
    sort_lora_by_slot: bool = True
    # on CUDA, each layer's LoRA shrink on a side stream beside its base GEMM, joined before the expand
    # (``LoRAContext.overlap_shrink``; no effect on the CPU): decode TPOT p50 0.08-0.11 ms lower with
    # 1-64 adapters on an H100 (engine_overlap_shrink_h100.json against engine_inline_h100.json)
    overlap_lora_shrink: bool = True
    # mixed steps (``SchedulerConfig.mixed_steps``): every running decode rides along with prefill
    # chunks, so a long prompt never stalls the sequences already decoding; False = prefill first
    mixed_steps: bool = True
    # mixed steps only: the prompt tokens a step that also decodes may carry
    # (``SchedulerConfig.max_prefill_tokens_while_decoding``); None = what the token budget leaves
    max_prefill_tokens_while_decoding: Optional[int] = None
    # the longest prompt + max_new_tokens a request may ask (vLLM's --max-model-len); None = the
    # model's max_position_embeddings, and never more than it
    max_model_len: Optional[int] = None
    # decode steps overlapped with the host's work (SGLang's overlap scheduler, vLLM's asynchronous
    # scheduling), in generate(): while the GPU runs decode step N the host builds and launches step
    # N+1, whose input ids are N's sampled tokens on the device, and only then reads N's tokens and
    # records them; a sequence that stopped at N (a stop token, a non-finite row) has its row of N+1
    # discarded. Only between pure decode steps (no prompt in progress, no request asking for
    # logprobs, no waiting request the next step could admit: LLM._can_overlap); every other step,
    # add_request/step() and a custom step run as before.
    # On by default: on an H100 it took the benchmark's base decode step from 6.51 to 4.34 ms
    # (benchmarks/results/engine_plain_h100.json against engine_overlap_h100.json); False = the
    # plain loop, which reads each step's tokens before it builds the next.
    overlap_decode: bool = True


@dataclass(frozen=True)
class EnginePolicies:
    """The control-plane decisions the engine calls (chapter 11's exercises; the capstone plugs in
    the learner's own). Signatures and contracts: ``reference.engine.policies``."""

    block_hashes: Callable = block_hashes
    admit_requests: Callable = admit_requests
    choose_drain: Callable = choose_drain


#: One engine step: ``step(scheduler, runner) -> kind`` ("prefill", "decode", "mixed" or "idle"); see :func:`engine_step`.
StepFn = Callable[[Scheduler, ModelRunner], str]


def engine_step(scheduler: Scheduler, runner: ModelRunner) -> str:
    """One step of the engine with greedy decoding: the control plane picks the work, the data plane
    computes it, the control plane records the tokens (chapter 11's capstone, ch11.5).

    Semantics:
        kind, work = scheduler.schedule()            # Work(seq, start, end): compute seq.tokens[start:end]
        if not work: return kind                     # "idle": nothing could run
        batch = [SeqWork(w.seq.tokens[w.start:w.end], w.start, list(w.seq.block_table), w.seq.uid)
                 for w in work]
        logits = runner.forward(batch, running=[s.uid for s in scheduler.running])   # [len(work), vocab]
        next_tokens = {w.seq.seq_id: argmax(logits[i])   for each i whose w.end == w.seq.num_tokens}
        scheduler.postprocess(work, next_tokens)
        return kind
    ``running`` keeps the adapters of every running sequence resident, also those that compute nothing
    this step (decoding sequences during a prefill step); a chunk that ends before its sequence's last
    token has logits nobody samples. Greedy: ties go to the lowest token id (``torch.argmax``).
    Source: nano-vllm ``nanovllm/engine/llm_engine.py`` (``LLMEngine.step``: schedule, run, postprocess).
    Raises:
        ValueError: from ``runner.forward`` (see ``check_work``; more distinct adapters than slots).
    """
    kind, work = scheduler.schedule()
    if not work:
        return kind
    batch = [SeqWork(w.seq.tokens[w.start:w.end], w.start, list(w.seq.block_table), w.seq.uid) for w in work]
    logits = runner.forward(batch, running=[s.uid for s in scheduler.running])  # [len(work), vocab]
    rows = [i for i, w in enumerate(work) if w.end == w.seq.num_tokens]  # chunks that reached the end
    picked = logits[rows].argmax(dim=-1).tolist() if rows else []  # one device-to-host copy for the step
    scheduler.postprocess(work, {work[i].seq.seq_id: token for i, token in zip(rows, picked)})
    return kind


#: The host's stand-in for a token the device has sampled and the host has not read yet (overlapped
#: decode); never a model input (the device's token replaces it) and never left in an output.
_PENDING = -1


@dataclass
class _InFlight:
    """A decode step launched and not yet recorded (``EngineConfig.overlap_decode``)."""

    work: list  # its Work, in row order
    picked: torch.Tensor  # int64 [len(work)] on the device: the sampled tokens, -1 for a non-finite row
    host: torch.Tensor  # where they are copied for the host (pinned on CUDA; ``picked`` itself on the CPU)
    copied: Optional["torch.cuda.Event"]  # recorded after that copy (None on the CPU)
    provisional: set = field(default_factory=set)  # seq_ids whose output holds a placeholder for the step before's token
    discard: set = field(default_factory=set)  # seq_ids whose row is void: they ended at the step before


@dataclass
class RequestOutput:
    """One request's result: its generated ``token_ids``, or ``error`` (and no tokens) when it was refused."""

    request_id: int
    prompt: list[int]
    adapter: Optional[str]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    token_times: list[float] = field(default_factory=list)  # seconds after the request arrived, one per token
    logprobs: list[float] = field(default_factory=list)  # log-probability of each token (SamplingParams.logprobs)

    @property
    def finished(self) -> bool:
        """Whether the request is over: finished (``finish_reason``: "stop", "length", "abort" or
        "error") or refused (``error`` set)."""
        return self.finish_reason is not None or self.error is not None


class LLM:
    """A small multi-LoRA serving engine over a Hugging Face Llama.

    Args:
        model: a ``transformers`` LlamaForCausalLM (wrapped in place: keep a copy if you need the
            original) or the path of a saved one (``from_pretrained``, in ``dtype``).
        config: :class:`EngineConfig`.
        policies: :class:`EnginePolicies` (the reference's by default).
    Attributes:
        stats: counters of the last ``generate`` (steps, prefill/decode steps, preemptions, adapter
            loads from each tier, prefix-cache hit rate; ``graph_decode_steps``: steps served by
            the graph runner (every sequence computing one token: the decode steps, or a prefill
            of one-token prompts), ``graph_fallbacks``: such steps it sent back to the eager path,
            by reason; ``decode_mode``: "cuda_graph", "static" (the graph path without capture) or
            "eager").
    Raises:
        ValueError: see ``llama_checkpoint`` (models this forward does not serve) and the configs'
        checks; ``cuda_graph`` not None or a bool.
    """

    def __init__(self, model, config: EngineConfig = EngineConfig(), dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device, None] = None, policies: EnginePolicies = EnginePolicies()) -> None:
        if isinstance(model, (str, Path)):
            import transformers
            model = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
        device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model, self.config, self.policies = model.to(device).eval(), config, policies
        self.max_context = model.config.max_position_embeddings
        if config.max_model_len is not None:
            if not isinstance(config.max_model_len, int) or not 1 <= config.max_model_len <= self.max_context:
                raise ValueError(f"max_model_len must be an int in [1, {self.max_context}] (the model's "
                                 f"max_position_embeddings), got {config.max_model_len!r}")
            self.max_context = config.max_model_len
        self.modules = llama_pool_modules(llama_checkpoint(model))
        self.num_layers = model.config.num_hidden_layers
        self.registry = AdapterRegistry()
        if config.cuda_graph not in (None, True, False):
            raise ValueError(f"cuda_graph must be None, True or False, got {config.cuda_graph!r}")
        for flag in ("overlap_decode", "overlap_lora_shrink"):
            if not any(getattr(config, flag) is v for v in (True, False)):
                raise ValueError(f"{flag} must be True or False, got {getattr(config, flag)!r}")
        graphs = device.type == "cuda" if config.cuda_graph is None else config.cuda_graph
        self.decode_mode = "eager" if not graphs else "cuda_graph" if device.type == "cuda" else "static"
        self.pool = self._make_pool(config, model.dtype, device, reserve_base=graphs)
        self.context = LoRAContext(overlap_shrink=config.overlap_lora_shrink)
        wrap_llama(model, self.pool, self.context, config.backend)
        self.runner = ModelRunner(model, self.pool, self.context, config.num_kv_blocks, config.block_size,
                                  config.backend, config.attention_backend, config.fused_ops,
                                  config.packed_projections, config.sort_lora_by_slot)
        if graphs:  # captured now (nano-vllm's order), not inside the first timed decode step
            enable_graph_decode(self.runner, config.max_num_seqs, use_graphs=device.type == "cuda").capture()
        sched_cfg = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, config.max_loras_per_batch,
                                    config.drain_threshold, config.mixed_steps,
                                    config.max_prefill_tokens_while_decoding)
        # the prefix cache outlives a generate() call, as a server's does: keys carry the adapter's uid,
        # so a later call (or a re-registered name) reuses exactly the KV that is still valid for it
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, policies.block_hashes)
        pool = self.pool  # not self: a closure over the engine would keep it (and its KV cache) alive
        self.scheduler = Scheduler(sched_cfg, self.blocks, lambda: pool.uid_to_buffer_id.keys(),
                                   policies.admit_requests, policies.choose_drain)
        self.stats: dict = {}
        self._next_id = 0
        self._t0: Optional[float] = None  # when the first step of the current run began
        self._live: dict[int, tuple] = {}  # seq_id -> (RequestOutput, Sequence, arrival) of add_request's requests
        self._errors: dict[int, str] = {}  # seq_id -> why the engine failed that request alone
        self._retired: set = set()  # uids no name points to any more: dropped once no request uses them
        self._inflight: Optional[_InFlight] = None  # overlapped decode: the step launched, not yet recorded

    def _make_pool(self, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                   reserve_base: bool) -> LoRAMemoryPool:
        """The GPU slots: ``max_loras_per_batch``, plus with graph decode one slot pinned to the
        base model (rank 0), where the padding rows of a bucket point (chapter 08's runner keeps
        the base resident for the same reason; TensorRT-LLM gives base rows an extra slot). The
        scheduler's cap stays ``max_loras_per_batch``, so the adapters keep every other slot. The
        CPU tier needs at least as many copies as slots (the pool's check), though the base never
        takes one."""
        slots = config.max_loras_per_batch + reserve_base
        cpu = config.max_loaded_loras
        if reserve_base and cpu is not None and cpu >= config.max_loras_per_batch:
            cpu = max(cpu, slots)
        pool = LoRAMemoryPool(self.modules, self.num_layers, slots, config.max_lora_rank, dtype, device,
                              config.eviction_policy, adapter_source=self.registry.load, max_loaded_loras=cpu)
        if reserve_base:
            pool.prepare_lora_batch([None])
            pool.pin(None)
        return pool

    # ---- adapters --------------------------------------------------------------------------
    def register_adapter(self, name: str, path: Union[str, Path]) -> str:
        """Load the PEFT adapter in ``path`` under ``name``; returns its uid.

        Everything is validated first: a malformed folder raises and leaves the registry and the
        pool exactly as they were. Re-registering ``name`` with other weights gives a new uid;
        requests already queued keep the old one.
        Raises:
            FileNotFoundError, ValueError: see ``reference.adapters.load_peft_adapter``; an empty name.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter needs a non-empty name, got {name!r}")
        adapter = load_peft_adapter(path, self.modules, self.num_layers, self.config.max_lora_rank, uid=name)
        return self.register_adapter_weights(name, adapter)

    def register_adapter_weights(self, name: str, adapter: LoRAAdapter) -> str:
        """Register an adapter already in the pool's layout (``LoRAAdapter``: rank, scaling and
        weights keyed by (layer, pool module)) under ``name``; returns its uid.
        Raises:
            ValueError: an empty name; an adapter the pool would refuse (see ``LoRAMemoryPool.validate``).
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"an adapter needs a non-empty name, got {name!r}")
        self.pool.validate(adapter)
        old = self.registry.current(name)
        uid = self.registry.register(name, adapter.rank, adapter.scaling, adapter.weights)
        if old is not None and old != uid:  # the version it replaces goes once its requests finish
            self._retire(old)
        return uid

    def unregister_adapter(self, name: str) -> str:
        """Remove ``name``: new requests naming it are refused at once; requests already queued or
        running on it finish on its weights, and then its host copy, its GPU slot and its CPU-tier
        copy are released (vLLM's ``remove_lora``). Returns the uid it had.
        Raises:
            ValueError: no adapter is registered under ``name``.
        """
        uid = self.registry.unregister(name)
        self._retire(uid)
        return uid

    def _retire(self, uid) -> None:
        self._retired.add(uid)
        self._release_retired()

    def _release_retired(self) -> None:
        """Free every retired version no waiting or running request uses any more."""
        if not self._retired:
            return
        sched = self.scheduler
        in_use = {s.uid for s in sched.running} | {s.uid for s in sched.waiting}
        for uid in [u for u in self._retired if u not in in_use]:
            self._retired.discard(uid)
            self.pool.unload(uid)
            self.registry.forget(uid)

    # ---- requests --------------------------------------------------------------------------
    def _check_request(self, prompt: Seq[int], params: SamplingParams) -> list[int]:
        params.check()
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if isinstance(prompt, (str, bytes)) or not (all(type(t) is int for t in prompt) or  # noqa: E721 (fast path)
                                                    all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                        for t in prompt)):
            raise ValueError("a prompt is a sequence of int token ids (the engine has no tokenizer)")
        tokens = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not tokens:
            raise ValueError("the prompt is empty")
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"token ids must lie in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            # min_tokens masks these columns of the logits: an id past the vocabulary would index out of bounds
            raise ValueError(f"stop_token_ids must lie in [0, {vocab}), got {list(params.stop_token_ids)}")
        if len(tokens) + params.max_new_tokens > self.max_context:
            raise ValueError(f"prompt ({len(tokens)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                             f"model's context of {self.max_context} positions")
        return tokens

    def _new_sequence(self, prompt, params: SamplingParams, adapter: Optional[str]) -> tuple[RequestOutput, Optional[Sequence]]:
        out = RequestOutput(self._next_id, prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt), adapter)
        self._next_id += 1
        try:
            tokens = self._check_request(prompt, params)
            uid: Hashable = None if adapter is None else self.registry.uid_of(adapter)
            seq = Sequence(out.request_id, tokens, uid, params)
            self.scheduler.add(seq)
        except ValueError as exc:
            out.error = str(exc)
            return out, None
        return out, seq

    def generate(self, prompts: Seq[Seq[int]], sampling_params: Union[SamplingParams, Seq[SamplingParams]] = SamplingParams(),
                 lora_request: Optional[Seq[Optional[str]]] = None, step: Optional[StepFn] = None) -> list[RequestOutput]:
        """Run every request to completion; outputs in the order of ``prompts``.

        ``lora_request[i]``: the adapter name of request i, or None for the base model. A request
        that is refused (unknown adapter name, empty or out-of-vocabulary prompt, prompt +
        max_new_tokens past the model's context or the KV cache, max_new_tokens < 1) gets
        ``error`` set and no tokens; the others run as if it had never been sent.
        ``step``: a function that runs one engine step (:data:`StepFn`, e.g. :func:`engine_step`;
        chapter 11's capstone passes the learner's), called until every request finished; None runs
        the engine's own step (greedy and seeded sampling, per-token times). With ``step``, every
        request must be greedy (temperature 0) and ``token_times`` stay empty.
        Raises:
            ValueError: ``lora_request`` or a list of ``sampling_params`` of another length than
                ``prompts``; a request that samples (temperature > 0) with ``step``.
            Whatever ``step`` raises (the call's sequences are released first).
            RuntimeError: requests of :meth:`add_request` are still unfinished (step them first).
        """
        if self._live:
            raise RuntimeError(f"{len(self._live)} requests of add_request are unfinished: run step() until "
                               "has_unfinished() is False before generate()")
        n = len(prompts)
        if isinstance(lora_request, str):
            raise ValueError("lora_request is one adapter name (or None) per prompt: a list, not a string")
        params = [sampling_params] * n if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        names = [None] * n if lora_request is None else list(lora_request)
        if len(params) != n or len(names) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(names)} lora requests")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be a SamplingParams or one per prompt")
        if step is not None and any(isinstance(p.temperature, (int, float)) and p.temperature > 0 for p in params):
            raise ValueError("a custom step decodes greedily: every request needs temperature 0")
        self._reset_step_state()
        self._t0 = time.perf_counter()
        self._inflight = None
        pairs = [self._new_sequence(p, sp, name) for p, sp, name in zip(prompts, params, names)]
        try:
            while self.scheduler.has_unfinished():
                if step is None:
                    self._overlap_step() if self.config.overlap_decode else self._step()
                else:
                    self.steps[step(self.scheduler, self.runner)] += 1
        except BaseException:
            self._inflight = None  # its sequences are aborted below; later kernels follow it in stream order
            self._abort([seq for _, seq in pairs if seq is not None])  # the engine stays usable
            for _, seq in pairs:  # a request that had failed alone before the exception
                if seq is not None:
                    self._errors.pop(seq.seq_id, None)
            self._t0 = None
            raise
        finally:
            self._release_retired()
        for out, seq in pairs:
            if seq is not None:
                out.token_ids, out.finish_reason = list(seq.output), seq.finish_reason
                out.token_times = [t - self._t0 for t in self._token_times.pop(seq.seq_id, [])]
                out.logprobs = self._logprobs.pop(seq.seq_id, [])
                if seq.seq_id in self._errors:
                    out.error = self._errors.pop(seq.seq_id)
        self._collect_stats()
        self._t0 = None
        return [out for out, _ in pairs]

    # ---- arrivals: vLLM's LLMEngine shape (add_request / step / abort_request) ---------------------
    def add_request(self, prompt: Seq[int], params: SamplingParams = SamplingParams(),
                    adapter: Optional[str] = None) -> RequestOutput:
        """Queue one request now; it joins the running batch at the next :meth:`step` the scheduler
        admits it. Returns its :class:`RequestOutput`, which every step updates in place
        (``token_ids``, ``token_times``, ``logprobs`` grow as tokens are sampled; ``finish_reason``
        is set when it ends), so a caller can stream it. ``error`` is set at once, and nothing
        queued, for a refused request (see :meth:`generate`). ``token_times`` count from this call.
        Requests added this way are reported by :meth:`step`, not by ``generate``."""
        out, seq = self._new_sequence(prompt, params, adapter)
        if seq is not None:
            self._live[seq.seq_id] = (out, seq, time.perf_counter())
        return out

    def step(self) -> list[RequestOutput]:
        """One engine step over everything queued (:meth:`add_request`): the requests that finished in
        it, their outputs complete. Returns [] when nothing is unfinished. A request the engine
        cannot serve (a non-finite row of logits: e.g. an adapter whose weights are NaN) finishes
        alone with ``finish_reason`` "error" and ``error`` set; the others go on exactly as they would
        without it. Raises what the step raises (the engine's own bugs: bad requests were refused when
        added); the caller may then abort the requests it holds (:meth:`abort_request`)."""
        if not self.scheduler.has_unfinished():
            return []
        if self._t0 is None:
            self._reset_step_state()
            self._t0 = time.perf_counter()
        tokens = self._step()
        done = []
        for seq_id in tokens:
            entry = self._live.get(seq_id)
            if entry is None:
                continue
            out, seq, arrived = entry
            out.token_ids.append(tokens[seq_id])
            out.token_times.append(self._token_times[seq_id][-1] - arrived)
            if seq_id in self._logprobs:
                out.logprobs.append(self._logprobs[seq_id][-1])
        for seq_id in self._step_failed:
            if seq_id in self._live:
                out, seq, _ = self._live[seq_id]
                out.error = self._errors.pop(seq_id)
        for seq_id, (out, seq, arrived) in list(self._live.items()):
            if seq.finish_reason is not None:
                del self._live[seq_id]
                self._token_times.pop(seq_id, None)
                self._logprobs.pop(seq_id, None)
                out.finish_reason = seq.finish_reason
                done.append(out)
        self._release_retired()
        if not self.scheduler.has_unfinished():  # the run is over: its stats, and a fresh clock next time
            self._collect_stats()
            self._t0 = None
        return done

    def abort_request(self, request_id: int) -> bool:
        """Stop a request of :meth:`add_request` now (a client that went away): it leaves the queues,
        its KV blocks are released and its adapter no longer counts as running; its output keeps the
        tokens so far with ``finish_reason`` "abort". Returns False when it had already finished (or
        was never added). vLLM ``LLMEngine.abort_request``."""
        entry = self._live.pop(request_id, None)
        if entry is None:
            return False
        out, seq, _ = entry
        self._abort([seq])
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "abort"
        out.finish_reason = "abort"
        self._token_times.pop(request_id, None)
        self._logprobs.pop(request_id, None)
        self._release_retired()
        if not self.scheduler.has_unfinished() and self._t0 is not None:
            self._collect_stats()
            self._t0 = None
        return True

    def has_unfinished(self) -> bool:
        """Whether some request added by :meth:`add_request` is still waiting or running."""
        return self.scheduler.has_unfinished()

    def trim_event_logs(self) -> bool:
        """Empty the pool's and the scheduler's event logs when no request is unfinished (no step
        counts from a mark into them then); a long-running server calls it so they stay bounded.
        The decode graphs' slot tracker keeps an owner change it had not yet seen
        (``PagedDecodeGraphRunner.trim_pool_events``). Returns whether the logs were emptied."""
        if self.has_unfinished():
            return False
        trim = getattr(self.runner.graph_runner, "trim_pool_events", None)
        if trim is not None:
            trim()
        else:
            del self.pool.events[:]
        del self.scheduler.events[:]
        return True

    def _abort(self, seqs: list[Sequence]) -> None:
        """Drop these unfinished sequences from the queues and release their blocks."""
        sched = self.scheduler
        for seq in seqs:
            if seq in sched.running:
                sched.running.remove(seq)
                self.blocks.release(seq)
            elif seq in sched.waiting:
                sched.waiting.remove(seq)
        if sched.drain_for is not None and not any(s.uid == sched.drain_for for s in sched.waiting):
            sched.drain_active, sched.draining, sched.drain_for = False, None, None
        elif not sched.has_unfinished():
            sched.drain_active, sched.draining, sched.drain_for = False, None, None

    def _reset_step_state(self) -> None:
        graph = self.runner.graph_runner
        self._marks = (len(self.pool.events), len(self.scheduler.events), self.blocks.hit_tokens,
                       self.blocks.query_tokens, graph.steps if graph else 0, Counter(graph.eager if graph else ()))
        self.steps = Counter()
        self._token_times: dict[int, list[float]] = {}
        self._logprobs: dict[int, list[float]] = {}
        self._step_failed: list[int] = []

    def _step(self) -> dict[int, int]:
        """One step; returns {seq_id: token} of the tokens sampled. Token times are recorded as
        absolute perf_counter readings (each caller turns them into times after its requests'
        arrival). Sequences whose logits were not finite are failed alone (``_step_failed``)."""
        return self._run(self._schedule()[1])

    def _schedule(self) -> tuple[str, list[Work]]:
        """The scheduler's next step, counted; raises RuntimeError (an engine bug, not input) when
        it found nothing to run while requests are unfinished."""
        kind, work = self.scheduler.schedule()
        self.steps[kind] += 1
        if not work:
            raise RuntimeError("the scheduler found nothing to run with requests unfinished")  # a bug, not input
        return kind, work

    def _forward(self, work: list[Work], running: list, input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The runner on a step's work: the tables are passed, not copied (the runner reads them
        during the call and keeps nothing), unchecked (this scheduler's work is valid by construction:
        ModelRunner.forward's ``check``); ``input_ids``: see ModelRunner.forward."""
        return self.runner.forward([SeqWork(w.seq.token_slice(w.start, w.end), w.start, w.seq.block_table, w.seq.uid)
                                    for w in work], running=running, check=False, input_ids=input_ids)

    def _run(self, work: list[Work]) -> dict[int, int]:
        """Compute, sample and record one scheduled step (the body of :meth:`_step`)."""
        logits = self._forward(work, [s.uid for s in self.scheduler.running])
        tokens, logprobs = self._sample(work, logits)
        self._step_failed = [seq_id for seq_id, t in tokens.items() if t < 0]
        if self._step_failed:
            work = self._fail(work, tokens)
        self.scheduler.postprocess(work, tokens)
        now = time.perf_counter()  # the tokens exist once sampled (sample reads them to the host)
        times = self._token_times
        for seq_id in tokens:
            times.setdefault(seq_id, []).append(now)
        for seq_id, lp in logprobs.items():
            if seq_id in tokens:  # not for a row that failed (its logprob is NaN, its token none)
                self._logprobs.setdefault(seq_id, []).append(lp)
        return tokens

    def _fail(self, work: list[Work], tokens: dict[int, int]) -> list[Work]:
        """Finish the sequences whose row was not finite with an error, alone: their blocks are
        released before anything is recorded, so no other sequence sees a trace of them (their
        full blocks may stay in the prefix cache, keyed by their own adapter's uid). Returns the
        work of the others."""
        kept = []
        for w in work:
            if tokens.get(w.seq.seq_id, 0) >= 0:
                kept.append(w)
                continue
            del tokens[w.seq.seq_id]
            self._fail_one(w.seq)
        return kept

    def _fail_one(self, seq: Sequence) -> None:
        """Finish ``seq`` with an error (its row of logits was not finite); see :meth:`_fail`."""
        self.scheduler.running.remove(seq)
        self.blocks.release(seq)
        seq.status, seq.finish_reason = SeqStatus.FINISHED, "error"
        self.scheduler.events.append(("finish", seq.seq_id, "error"))
        self._errors[seq.seq_id] = (
            f"the model's output for this request is not finite (NaN or inf logits after {len(seq.output)} "
            f"tokens{'' if seq.uid is None else f' with adapter {seq.uid!r}'}): the request was stopped; "
            "the other requests were not affected")

    # ---- overlapped decode (EngineConfig.overlap_decode) ------------------------------------------
    def _overlap_step(self) -> dict[int, int]:
        """One iteration of generate()'s loop with overlapped decode: {seq_id: token} recorded in it.

        With no step in flight: schedule; a pure decode step that may overlap is launched and left
        in flight, any other runs as :meth:`_step` does. With step N in flight: launch step N+1 first
        (:meth:`_launch_next`, when the batch can go on as it is), then wait for N's tokens and
        record them (:meth:`_record`). The GPU runs N+1 while the host records N and builds N+2.
        """
        prev = self._inflight
        if prev is None:
            kind, work = self._schedule()
            # the scheduler composed this step itself (requests may wait: it admitted none of them)
            if kind == "decode" and self._pure_decode():
                self._inflight = self._launch(work, None)
                return {}
            return self._run(work)
        nxt = self._launch_next(prev) if self._can_overlap() else None
        self._inflight = nxt
        tokens = self._record(prev, nxt)
        if nxt is not None and len(nxt.discard) == len(nxt.work):
            self._inflight = None  # every row of it is void: nothing left to record
        return tokens

    def _pure_decode(self) -> bool:
        """No drain, no prompt in progress, and no request asking for logprobs (read with the tokens)."""
        sched = self.scheduler
        return not sched.drain_active and not any(s.in_prefill or s.params.logprobs for s in sched.running)

    def _can_overlap(self) -> bool:
        """Whether the step after the one in flight may be launched before the latter's tokens are
        read: a pure decode (:meth:`_pure_decode`) with nothing waiting, or with requests waiting
        that the next step could not admit anyway (:meth:`_may_stay_blocked` here, then
        ``Scheduler.next_step_admits_none`` in :meth:`_launch_next` once that step's KV blocks are
        counted out). A request is then admitted later than the plain loop would only where the
        host could not foresee it: a row of the step in flight turns non-finite and frees a seat and
        its blocks, while the step launched ahead has taken blocks of its own (so the wait can last
        until another sequence ends). Its greedy tokens are the same; its logprobs may differ in the
        last bits (its rows are batched with others). Found by helper-32's fuzz, as are the effects
        of running ahead that outlive the call: a row discarded at N+1 has taken a KV block (which
        can evict a cached prefix) and refreshed its adapter in the pool's LRU."""
        return self._pure_decode() and (not self.scheduler.waiting or self._may_stay_blocked())

    def _may_stay_blocked(self) -> bool:
        """With requests waiting, what the plain loop's next step could change without the host's
        tokens: a drain may start (``drain_threshold``), and a sequence that ends at the step in flight
        (by length, or by a stop token it may sample) frees a seat, blocks and perhaps a slot."""
        sched, prev = self.scheduler, self._inflight
        if sched.config.drain_threshold is not None or prev is None:
            return False
        for w in prev.work:
            seq, p = w.seq, w.seq.params
            if seq.seq_id in prev.discard:
                continue
            if len(seq.output) + 1 >= p.max_new_tokens or (p.stop_token_ids and len(seq.output) >= p.min_tokens):
                return False
        return True

    def _launch(self, work: list[Work], input_ids: Optional[torch.Tensor],
                running: Optional[list] = None) -> "_InFlight":
        """Run a decode step's model and sampler on the device and start the copy of its tokens to the
        host (pinned memory, an event after it); nothing here waits for the device. ``running``: the
        uids the pool keeps resident (default: every running sequence's)."""
        logits = self._forward(work, [s.uid for s in self.scheduler.running] if running is None else running, input_ids)
        picked = self._sample_on_device(work, logits)[-1]
        host, copied = picked, None
        if picked.is_cuda:
            host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
            host.copy_(picked, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return _InFlight(work, picked, host, copied)

    def _launch_next(self, prev: "_InFlight") -> Optional["_InFlight"]:
        """Launch the decode step after ``prev`` before ``prev``'s tokens are known: every sequence of
        ``prev`` that is still running and will not reach ``max_new_tokens`` with ``prev``'s token
        computes that token (a placeholder on the host, ``prev``'s sample on the device). Returns
        None, changing nothing, when none goes on or the new positions need more free KV blocks
        than there are (the next step is then scheduled as usual, preemption included)."""
        go_on = [i for i, w in enumerate(prev.work) if w.seq.seq_id not in prev.discard
                 and len(w.seq.output) + 1 < w.seq.params.max_new_tokens]
        if not go_on:
            return None
        blocks = self.blocks
        need = sum(blocks.blocks_for(prev.work[i].seq.num_tokens + 1) > len(prev.work[i].seq.block_table)
                   for i in go_on)
        if need > blocks.num_free:
            return None
        # requests wait (_can_overlap found no sequence ending at prev): the plain loop's next step must
        # admit none of them either; and the blocks prev completes, registered only when it is
        # recorded, must not be in a waiting prompt's prefix: their hits would lower what it needs
        sched = self.scheduler
        if sched.waiting:
            fresh = {key for i in go_on for key in blocks.pending_keys(prev.work[i].seq, prev.work[i].seq.num_tokens)}
            if any(blocks.looks_up_any(s, fresh) for s in sched.waiting) or not sched.next_step_admits_none(len(go_on), need):
                return None
        work = []
        for i in go_on:
            seq = prev.work[i].seq
            # prev's KV, written before this step in stream order; its blocks enter the prefix cache
            # only in _record, once prev's row is known finite (a failed row's KV is never cached)
            seq.num_computed = seq.num_tokens
            seq.output.append(_PENDING)
            blocks.append_slot(seq)
            self.scheduler.events.append(("decode", seq.seq_id))
            work.append(Work(seq, seq.num_tokens - 1, seq.num_tokens))
        self.scheduler.step_no += 1
        self.steps["decode"] += 1
        ids = prev.picked
        if len(go_on) < len(prev.work):
            index = torch.tensor(go_on, dtype=torch.int64)
            if ids.is_cuda:  # pinned, so the copy does not wait for the stream's earlier work
                index = index.pin_memory().to(ids.device, non_blocking=True)
            ids = ids.index_select(0, index)
        # running: the sequences that go on (those ending at prev by length are still listed by the
        # scheduler, and would refresh their adapters in the pool one step late)
        nxt = self._launch(work, ids.clamp(min=0), running=[w.seq.uid for w in work])  # -1: any id, row discarded
        nxt.provisional = {prev.work[i].seq.seq_id for i in go_on}
        return nxt

    def _record(self, prev: "_InFlight", nxt: Optional["_InFlight"]) -> dict[int, int]:
        """Wait for ``prev``'s tokens and record them as :meth:`Scheduler.postprocess` does (KV
        computed, token appended, stop / length / error), filling the placeholders ``nxt`` was
        launched with; a sequence that ends here has its row of ``nxt`` discarded."""
        if prev.copied is not None:
            prev.copied.synchronize()
        values = prev.host.tolist()
        ahead = nxt.provisional if nxt is not None else set()
        tokens: dict[int, int] = {}
        failed = []
        for w, token in zip(prev.work, values):
            seq = w.seq
            if seq.seq_id in prev.discard:
                continue
            placeholder = seq.seq_id in ahead
            if token < 0:  # a non-finite row: this request fails alone
                if placeholder:
                    seq.output.pop()
                    nxt.discard.add(seq.seq_id)
                failed.append(seq.seq_id)
                self._fail_one(seq)
                continue
            if placeholder:
                seq.output[-1] = token
            else:
                seq.num_computed, seq.in_prefill = w.end, False
                seq.output.append(token)
            self.blocks.mark_computed(seq)  # in row order, as postprocess registers them
            tokens[seq.seq_id] = token
            reason = ("stop" if token in seq.params.stop_token_ids else
                      "length" if len(seq.output) >= seq.params.max_new_tokens else None)
            if reason:
                self.scheduler._finish(seq, reason)
                if placeholder:
                    nxt.discard.add(seq.seq_id)
        self._step_failed = failed
        now = time.perf_counter()
        times = self._token_times
        for seq_id in tokens:
            times.setdefault(seq_id, []).append(now)
        return tokens

    def _sample_on_device(self, work: list[Work], logits: torch.Tensor) -> tuple[list[int], list[Sequence],
                                                                                  Optional[torch.Tensor],
                                                                                  Optional[torch.Tensor]]:
        """(rows, their sequences, their logits, their tokens int64 on the device, -1 where a row is not
        finite) for the chunks that reached their sequence's end; no device read."""
        rows = [i for i, w in enumerate(work) if w.end == w.seq.num_tokens]  # chunks that reached the end
        if not rows:
            return rows, [], None, None
        seqs = [work[i].seq for i in rows]
        sel = logits[rows] if len(rows) < len(work) else logits
        ps = [s.params for s in seqs]
        banned = [p.stop_token_ids if len(s.output) < p.min_tokens else () for s, p in zip(seqs, ps)]
        picked = sample_batch(sel, [p.temperature for p in ps], [p.seed or 0 for p in ps],
                              [len(s.output) for s in seqs],
                              top_ks=[p.top_k for p in ps] if any(p.top_k for p in ps) else None,
                              top_ps=[p.top_p for p in ps] if any(p.top_p < 1 for p in ps) else None,
                              banned=banned if any(banned) else None)
        return rows, seqs, sel, torch.where(torch.isfinite(sel).all(dim=-1), picked, -1)

    def _sample(self, work: list[Work], logits: torch.Tensor) -> tuple[dict[int, int], dict[int, float]]:
        """Every finished chunk's next token, greedy and seeded rows together, with one pass on the
        device and one device-to-host copy (:func:`~reference.engine.model_runner.sample_batch`):
        ({seq_id: token}, {seq_id: logprob} for the requests that asked). A row that is not finite
        gets token -1 (its request fails alone: a NaN row's argmax is meaningless)."""
        rows, seqs, sel, picked = self._sample_on_device(work, logits)
        if not rows:
            return {}, {}
        ps = [s.params for s in seqs]
        ids = [s.seq_id for s in seqs]
        if not any(p.logprobs for p in ps):
            return dict(zip(ids, picked.tolist())), {}
        lse = torch.logsumexp(sel.float(), dim=-1)
        chosen = sel.float().gather(1, picked.clamp(min=0)[:, None])[:, 0] - lse
        host = torch.stack((picked.double(), chosen.double())).tolist()  # still one copy
        tokens = dict(zip(ids, (int(t) for t in host[0])))
        return tokens, {i: lp for i, lp, p in zip(ids, host[1], ps) if p.logprobs}

    def _collect_stats(self) -> None:
        pool_mark, sched_mark, hits0, queries0, graph0, eager0 = self._marks
        graph = self.runner.graph_runner
        fallbacks = (graph.eager - eager0) if graph else Counter()
        fallbacks.pop("prefill", None)  # prefill steps are eager by design, not a fallback
        kinds = Counter(e[0] for e in self.pool.events[pool_mark:])
        sched = Counter(e[0] for e in self.scheduler.events[sched_mark:])
        hits, queries = self.blocks.hit_tokens - hits0, self.blocks.query_tokens - queries0
        self.stats = dict(steps=sum(self.steps.values()), prefill_steps=self.steps["prefill"],
                          decode_steps=self.steps["decode"], mixed_steps=self.steps["mixed"], preemptions=sched["preempt"], drains=sched["drain"],
                          pool_events=dict(kinds), prefix_hit_tokens=hits, prefix_query_tokens=queries,
                          prefix_hit_rate=hits / queries if queries else 0.0,
                          graph_decode_steps=(graph.steps - graph0) if graph else 0,
                          graph_fallbacks=dict(fallbacks), decode_mode=self.decode_mode)
