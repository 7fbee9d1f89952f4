"""The serving engine (chapter 11) under load: throughput and per-token latency against the number of
distinct adapters, beside the base model alone and HF PEFT's mixed-adapter batches.

    python benchmarks/benchmark_engine.py [--layers 8] [--requests 256] [--adapters 1 8 32 64 256] [--peft]
    python benchmarks/benchmark_engine.py --no-cuda-graph  # the same, every decode step eager
    python benchmarks/benchmark_engine.py --smoke          # tiny model, CPU or GPU, about a minute

Model (full run): Llama-3-8B's layer shapes (hidden 4096, 32 heads, 8 KV heads, intermediate 14336,
vocab 32000), random bf16 weights, ``--layers`` layers (the results record how many). Workload
(S-LoRA's and Punica's figure): ``--requests`` requests, prompt lengths uniform in [128, 1024],
128 new tokens each, greedy; request i's adapter drawn from a Zipf(1.0) popularity over D adapters
of rank 16 on every projection; the same prompts for every D and for the base run (every request on
the base model). The engine: ``reference.engine.LLM`` with the Triton LoRA backend (CUDA) or torch
(CPU), ``max_loras_per_batch`` ``--max-loras`` (default 65: 64 adapters and the base, so the
64-adapter row's 47 distinct adapters are resident at once, as S-LoRA's and Punica's figure
serves them; the committed runs before it used 33, and that row then ran in two waves through the
slot cap), every adapter in the CPU tier. On CUDA the decoder takes the fused elementwise kernels
and packed q|k|v and gate|up projections (``EngineConfig.fused_ops`` / ``packed_projections``;
``--no-fused-ops``, ``--no-packed-projections`` turn them off); every layer's LoRA shrink runs on a
side stream beside its base GEMM (``overlap_lora_shrink``; ``--no-overlap-lora-shrink``), and a step
with prompt tokens gives the LoRA ops its rows grouped by adapter slot (``sort_lora_by_slot``;
``--no-sort-lora-by-slot``). ``--decode-shrink-splits S`` splits every decode shrink into S
split-K pieces (1: unsplit) instead of each shape's S from ``reference.ops.decode_splits``.

Reported per run: output tokens/s over the whole ``generate`` wall time; time per output token (the
gap between a request's consecutive tokens) P50 / P99; time to first token P50 / P99; steps,
preemptions, adapter loads, prefix-cache hit rate. ``--peft``: the same workload through PEFT
(``adapter_names`` mixed batches of ``--peft-batch`` requests, left-padded, ``generate`` greedy),
at 1 adapter and at 64 (or the largest D asked for): output tokens/s (``--peft-requests N``: over the
first N requests only, for time).

Extras (``--no-extras`` skips them), in ``extras`` of the JSON: the prefix cache on 4 system prompts
of 512 tokens shared by 8 adapters' requests (suffixes of 64-512 tokens), keyed by (adapter, tokens)
against the unsafe tokens-only key of chapter 11 (more hits, every one across adapters serving
another adapter's KV); and the drain on a skewed trace (Zipf(1.2) over 32 adapters through 4 slots),
``drain_threshold`` off and 8 steps: TTFT P50 / P99 (every request arrives at once, so TTFT is its
waiting time plus its prefill).

Decode: on CUDA the engine's decode steps replay CUDA graphs (``EngineConfig.cuda_graph``, the
default there: ``reference/engine/cuda_graph_runner.py``, buckets up to ``max_num_seqs``, captured
when the engine is built, outside the timed ``generate``); ``--no-cuda-graph`` runs them eagerly.
The result JSON records which (``decode``, and per row ``decode_mode``, ``graph_decode_steps`` and
``graph_fallbacks``); its file name gets ``_eager`` without graphs. With graphs the pool has one
slot more, pinned to the base model (the padding rows' rank-0 slot); the scheduler's cap is the same.

The floor (issue #30): a decode step must read every weight but the input embedding and the KV of
every position it attends, so (weight bytes + attended KV bytes) / copy bandwidth (measured here:
a device-to-device copy, read + write) bounds its time from below; each row records the median
floor over its decode steps and TPOT p50 / floor. Beside it, rows with adapters record the floor with
the adapters' own bytes (each decode step also reads A and B of each of its distinct adapters once:
``decode_floor_with_lora_ms_p50``, ``tpot_p50_over_floor_with_lora``); the targets keep the issue's
floor, which counts the base model's weights. ``--profile`` adds the GPU-busy fraction of the
decode steps' wall time (torch.profiler, one more generate). ``--arrival-loads``: the workload
arriving as a Poisson process (``LLM.add_request`` / ``step``) at fractions of the base row's
request rate, for TPOT p99 and TTFT under continuous arrivals. ``--attention torch triton`` runs
every row with both attention kernels in one process (a ratio in one run). ``--token-budget`` sets
``max_num_batched_tokens`` (default 8192): a mixed step holds every running decode plus prefill
chunks up to that many tokens, so a smaller budget bounds how long one step with a new prompt stalls
the running sequences (TPOT p99 under arrivals) at the cost of more steps per prompt (the stall
against throughput trade-off of Sarathi-Serve, Agrawal et al., OSDI 2024).

Targets (issues #15 and #30): at 64 adapters, >= 80% of the single-adapter throughput and >= 70% of
the base model's; the engine >= 20x PEFT's throughput at 64; decode TPOT p50 <= 1.5x the floor with
no adapter and <= 1.7x with 32; TPOT p99 <= 3x TPOT p50 under Poisson arrivals. The script prints
which are met.
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Optional, Union

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_decode_step import FULL, SMOKE, random_adapter  # noqa: E402  (the same model shapes and adapters)
from reference.engine import LLM, EngineConfig, EnginePolicies, SamplingParams  # noqa: E402
from reference.engine.policies import block_hashes  # noqa: E402
from reference.layers import LoRABackend, get_backend  # noqa: E402
from reference.tp.model import llama_checkpoint, llama_pool_modules  # noqa: E402


def build_model(cfg: dict, layers: int, max_pos: int, device: torch.device, dtype: torch.dtype):
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max_pos, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.LlamaForCausalLM(config).to(dtype).eval()


def zipf_choice(gen: torch.Generator, n: int, num_adapters: int, alpha: float = 1.0) -> list[int]:
    weights = torch.tensor([1.0 / (k + 1) ** alpha for k in range(num_adapters)])
    return torch.multinomial(weights, n, replacement=True, generator=gen).tolist()


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (m,), generator=gen).tolist() for m in lens]


def shared_prefix_workload(n: int, prefixes: int, prefix_len: int, lo: int, hi: int, vocab: int,
                           seed: int = 3) -> list[list[int]]:
    """``n`` prompts, each one of ``prefixes`` shared system prompts of ``prefix_len`` tokens followed
    by its own suffix of ``lo``-``hi`` tokens (request i takes system prompt i % prefixes)."""
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, vocab, (prefix_len,), generator=gen).tolist() for _ in range(prefixes)]
    lens = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [heads[i % prefixes] + torch.randint(0, vocab, (m,), generator=gen).tolist() for i, m in enumerate(lens)]


#: The unsafe cache of chapter 11: block keys over tokens only, so two adapters share KV blocks
#: (every adapter's request is served the KV another adapter computed: wrong outputs, more hits).
BLIND = EnginePolicies(block_hashes=lambda tokens, adapter_id, size: block_hashes(tokens, "shared", size))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy of ``nbytes``: the median of
    ``reps`` timed copies (CUDA events). The decode floor divides the bytes a step must read by it."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / statistics.median(times)


def step_bytes(model) -> tuple[int, int]:
    """(bytes of the weights a decode step reads: every parameter but the input embedding, whose one
    row per token is negligible; KV bytes per cached position over all layers, keys and values)."""
    embed = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    cfg = model.config
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return weights, cfg.num_hidden_layers * 2 * kv_heads * head_dim * embed.element_size()


def record_decode_steps(llm) -> tuple[list[int], list[int]]:
    """Wrap ``llm.runner.forward`` to log, for every decode step (one token per sequence), the
    positions it attends in all (sum of start + 1: the KV a perfect step must read) and its distinct
    adapters (the base model's rows none: the adapters whose A and B its LoRA must read)."""
    contexts: list[int] = []
    adapters: list[int] = []
    forward = llm.runner.forward

    def logged(work, running=(), **kw):  # kw: ModelRunner.forward's check
        if all(len(w.token_ids) == 1 for w in work):
            contexts.append(sum(w.start + 1 for w in work))
            adapters.append(len({w.uid for w in work if w.uid is not None}))
        return forward(work, running, **kw)

    llm.runner.forward = logged
    return contexts, adapters


def adapter_bytes(modules, layers: int, rank: int, element_size: int) -> int:
    """Bytes of one adapter's A and B over every pool module and layer at ``rank``:
    rank * (stack_num * in_features + out_total) elements per module and layer (A is
    [stack_num * rank, in], B [out_total, rank]): what a step reads per distinct adapter."""
    return layers * rank * element_size * sum(m.stack_num * m.in_features + m.out_total for m in modules)


KERNEL_CLASSES = (  # first match wins: a kernel's name -> what it does in a decode step
    # _merge_splits_kernel is paged attention's flash-decoding merge (reference/ops/paged_attention.py)
    ("attention", ("attention", "flash", "fmha", "sdpa", "merge_splits")),
    ("lora", ("sgmv", "bgmv", "lora", "fused_decode")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "sm80_")),
    # torch's elementwise and reduction kernels: norms, rotary embedding, SiLU-and-mul, residual adds,
    # copies, sampling, and also the sorted / grouped LoRA schedules' sum of split-K partials
    ("other", ("",)),
)
STEP_LABEL = "engine_step"  # the record_function range around each LLM._step: schedule, model, sample, postprocess


def kernel_class(name: str) -> str:
    low = name.lower()
    return next(label for label, keys in KERNEL_CLASSES if any(k in low for k in keys))


def _step_ranges(events, label: str = STEP_LABEL) -> list[tuple[int, int]]:
    """The host ranges of ``label`` (record_function), in time order. Kineto also mirrors each such
    range on the GPU timeline (a CUDA-device event of the same name, spanning the kernels it
    launched): counted as a kernel, it made the steps look busy (H100 run of b6e9033: "the rest"
    9.9 ms of a 10.5 ms step; the H200's committed gpu_busy_decode 0.88-0.91 was counted that way)."""
    return sorted((e.start_ns(), e.start_ns() + e.duration_ns()) for e in events
                  if e.name() == label and e.device_type() == torch.autograd.DeviceType.CPU)


def _gpu_work(events, labels: tuple[str, ...] = (STEP_LABEL,)):
    """Kernels, copies and memsets: CUDA-device events with a duration, not the GPU mirrors of the
    step ranges."""
    return [e for e in events if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
            and e.name() not in labels]


def _union_inside(intervals, ranges) -> int:
    """ns covered by the union of ``intervals`` inside the (disjoint) ``ranges``."""
    merged: list[list[int]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in ranges for a, b in merged if a < hi and b > lo)


def decode_ranges(prof, step_kv: list[Optional[int]], label: str = STEP_LABEL) -> list[tuple[int, int]]:
    """The ``label`` ranges of the decode steps: ``step_kv`` holds one entry per labelled step, in
    order, the KV positions a decode step attends or None for any other step. Raises ValueError when
    the trace holds another number of ranges (the labels and the record would not line up)."""
    ranges = _step_ranges(list(prof.profiler.kineto_results.events()), label)
    if len(ranges) != len(step_kv):
        raise ValueError(f"{len(ranges)} {label} ranges in the trace but {len(step_kv)} steps recorded")
    return [r for r, kv in zip(ranges, step_kv) if kv is not None]


def decode_breakdown(prof, step_kv: list[Optional[int]], floor: Optional[dict], label: str = STEP_LABEL,
                     step_adapters: Optional[list[Optional[int]]] = None, top: int = 12) -> Optional[dict]:
    """Where a decode step's time goes, from a torch.profiler trace whose engine steps are each one
    ``label`` range (``step_kv``: see :func:`decode_ranges`). Per decode step, mean over them, in ms:
    ``wall_ms`` (the whole engine step: schedule, model, sampling with its device-to-host read,
    postprocess), ``gpu_busy_ms`` (the union of kernel and copy intervals inside it), ``host_ms``
    (wall minus busy: no kernel running), and ``gpu_ms`` per kernel class (:data:`KERNEL_CLASSES`,
    each kernel clipped to the ranges; the classes sum past ``gpu_busy_ms`` only where kernels
    overlap). With ``floor`` (the benchmark's copy bandwidth, weight and KV bytes), ``floor_ms``: the
    GEMMs must read every weight once, attention the KV of the positions the step attends (the mean
    over these steps: a ratio of means), ``launches_per_step`` per class (every kernel and copy, not
    only the top ones), and with ``step_adapters`` (one entry per labelled step, as
    ``step_kv``: the distinct adapters of a decode step) and ``floor["lora_per_adapter"]`` the LoRA
    kernels must read each of the step's adapters once (the mean over the decode steps); the rest
    has no floor of its own. ``top_kernels``: the ``top`` kernels by time per decode step (ms, with
    their class and launches per step), the profile's own names. Issue #30: "state what limits each
    target that is missed, from a profile"."""
    ranges = decode_ranges(prof, step_kv, label)
    if not ranges:
        return None
    events = list(prof.profiler.kineto_results.events())
    per_class: dict[str, float] = {}
    per_kernel: dict[str, list] = {}  # name -> [ns inside the ranges, launches]
    launches: dict[str, int] = {}  # class -> kernels (and copies) launched inside the ranges
    intervals = []
    for e in _gpu_work(events, (label,)):
        a, b = e.start_ns(), e.start_ns() + e.duration_ns()
        inside = sum(max(0, min(b, hi) - max(a, lo)) for lo, hi in ranges if a < hi and b > lo)
        if inside:
            intervals.append((a, b))
            per_class[kernel_class(e.name())] = per_class.get(kernel_class(e.name()), 0) + inside
            launches[kernel_class(e.name())] = launches.get(kernel_class(e.name()), 0) + 1
            entry = per_kernel.setdefault(e.name(), [0, 0])
            entry[0] += inside
            entry[1] += 1
    n = len(ranges)
    wall = sum(hi - lo for lo, hi in ranges) / n / 1e6
    busy = _union_inside(intervals, ranges) / n / 1e6
    out = dict(range="engine step: schedule, model, sampling, postprocess", decode_steps=n, wall_ms=round(wall, 4),
               gpu_busy_ms=round(busy, 4), host_ms=round(wall - busy, 4),
               gpu_ms={k: round(v / n / 1e6, 4) for k, v in sorted(per_class.items(), key=lambda kv: -kv[1])})
    out["launches_per_step"] = {k: round(v / n, 2) for k, v in sorted(launches.items())}
    out["top_kernels"] = [dict(name=name[:120], kind=kernel_class(name), ms=round(ns / n / 1e6, 4),
                               launches_per_step=round(count / n, 2))
                          for name, (ns, count) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]]
    kv = [k for k in step_kv if k is not None]
    if floor is not None:
        out["floor_ms"] = dict(gemm=round(1e3 * floor["weights"] / floor["bandwidth"], 3),
                               attention=round(1e3 * sum(kv) / len(kv) * floor["kv_per_position"] / floor["bandwidth"], 3))
        used = [a for k, a in zip(step_kv, step_adapters or []) if k is not None and a is not None]
        if used and floor.get("lora_per_adapter"):
            out["floor_ms"]["lora"] = round(1e3 * sum(used) / len(used) * floor["lora_per_adapter"] / floor["bandwidth"], 3)
    return out


def release_engines(device) -> None:
    """Free the engines of earlier rows before building the next. With graph decode an engine's
    model runner and its graph runner point at each other (and this benchmark wraps the runner's
    forward in closures), so dropping the last name frees its KV cache only at a full garbage
    collection; each row's KV cache is 8.5 GiB at the default workload, and on
    an H100 (80 GB) the sixth engine's KV allocation failed with out-of-memory (or its graph
    capture did, "operation failed due to a previous error during capture")."""
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def other_prompts(prompts, shift: int, vocab: int) -> list[list[int]]:
    """The prompts with another first token: the same lengths and step shapes, but no prefix-cache hit
    on the originals (a block's key chains every token before it)."""
    return [[(p[0] + shift) % vocab] + p[1:] for p in prompts]


def warm_up_row(llm, prompts, names, new_tokens: int) -> None:
    """An untimed pass of the row's own workload (its prompts' lengths, its adapter mix, its new
    tokens) on prompts the timed call will not find cached, so the timed call's steps hold what the
    warm-up's held. Triton compiles a kernel anew for each new combination of its compile-time
    constants and of its integer and pointer arguments' alignment (divisible by 16 or not), which
    depend on what a step holds (its segments, its tokens). With only the tiny call below and the
    process's first warm-up pass, the D=1 and D=32 rows compiled kernels inside their timed call
    (the H100 runs engine_separate_h100.json, engine_sgmv_segments_h100.json: 1.7-7.2k tok/s against
    9-12k, TTFT p99 2.4-7.3 s against 1.0-1.5 s); with a warm-up of 2 new tokens, whose mixed steps
    hold fewer decode rows than the timed call's, some rows still did (engine_inline_h100.json: D=1
    at 2.4k tok/s, TTFT p99 4.6 s). A first tiny call compiles the decode graphs' kernels."""
    llm.generate([prompts[0][:8]], SamplingParams(max_new_tokens=2), lora_request=[names[0]])
    llm.generate(other_prompts(prompts, 2, llm.model.config.vocab_size), SamplingParams(max_new_tokens=new_tokens),
                 lora_request=names)


def run_engine(model, cfg: EngineConfig, prompts, names, new_tokens: int, adapters: dict, device,
               policies: EnginePolicies = EnginePolicies(), floor: Optional[dict] = None, profile: bool = False,
               check_work: bool = False) -> dict:
    """One timed ``generate`` of the workload. ``floor``: {"bandwidth": B/s, "weights": bytes,
    "kv_per_position": bytes} adds each decode step's floor, (weights + attended KV) / bandwidth, and
    TPOT p50 over the median floor. ``profile``: a second, profiled generate for the GPU-busy
    fraction of its decode steps (the timed one stays unprofiled). ``check_work``: the engine's
    step checks its own work every step (``ModelRunner.forward(check=True)``, as it did before
    it trusted its scheduler): the host time that pass costs, by difference."""
    release_engines(device)
    llm = LLM(copy.deepcopy(model) if device.type == "cpu" else model, cfg, dtype=model.dtype, device=device,
              policies=policies)
    if check_work:
        unchecked = llm.runner.forward

        def checked(work, running=(), **kw):
            return unchecked(work, running, **{**kw, "check": True})

        llm.runner.forward = checked
    for name, adapter in adapters.items():
        llm.register_adapter_weights(name, adapter)
    params = SamplingParams(max_new_tokens=new_tokens)
    warm_up_row(llm, prompts, names, new_tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    contexts, step_adapters = record_decode_steps(llm)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=names)
    wall = time.perf_counter() - t0
    # this call's counters, before the profiled call below replaces them: that one finds every prompt
    # in the prefix cache (one prefill step), where this one prefilled all of them (committed runs
    # before this fix reported the profiled call's steps and hits beside this call's times)
    stats = dict(llm.stats)
    extra = {}
    if floor is not None and contexts:
        floors = [(floor["weights"] + c * floor["kv_per_position"]) / floor["bandwidth"] for c in contexts]
        extra["decode_floor_ms_p50"] = round(1e3 * percentile(floors, 0.5), 3)
        if floor.get("lora_per_adapter") and any(step_adapters):
            # the floor counts the base model's weights; a step with adapters also reads each
            # distinct adapter's A and B once: reported beside it, the targets keep the floor
            with_lora = [f + a * floor["lora_per_adapter"] / floor["bandwidth"] for f, a in zip(floors, step_adapters)]
            extra["decode_floor_with_lora_ms_p50"] = round(1e3 * percentile(with_lora, 0.5), 3)
    if profile and device.type == "cuda":
        # the same prompts with another first token: no prefix-cache hit, so the profiled call prefills
        # what the timed one did (a block's key chains every earlier token)
        cold = other_prompts(prompts, 1, llm.model.config.vocab_size)
        extra["gpu_busy_decode"], extra["decode_breakdown"], extra["prefill_breakdown"] = profiled_busy(
            llm, cold, params, names, floor)
    tokens = sum(len(o.token_ids) for o in outs)
    tpot = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])]
    ttft = [o.token_times[0] for o in outs if o.token_times]
    from reference.layers import unwrap_llama

    unwrap_llama(llm.model)
    if "decode_floor_ms_p50" in extra:
        extra["tpot_p50_over_floor"] = round(1e3 * percentile(tpot, 0.5) / extra["decode_floor_ms_p50"], 2)
    if "decode_floor_with_lora_ms_p50" in extra:
        extra["tpot_p50_over_floor_with_lora"] = round(1e3 * percentile(tpot, 0.5) / extra["decode_floor_with_lora_ms_p50"], 2)
    return dict(output_tokens=tokens, wall_s=round(wall, 3), tokens_per_s=round(tokens / wall, 2), **extra,
                tpot_ms_p50=round(1e3 * percentile(tpot, 0.5), 3), tpot_ms_p99=round(1e3 * percentile(tpot, 0.99), 3),
                ttft_s_p50=round(percentile(ttft, 0.5), 3), ttft_s_p99=round(percentile(ttft, 0.99), 3),
                **{k: v for k, v in stats.items() if k != "pool_events"},
                adapter_loads=stats["pool_events"].get("load", 0))


def profiled_busy(llm, prompts, params, names, floor: Optional[dict] = None
                  ) -> tuple[Optional[float], Optional[dict], Optional[dict]]:
    """The workload once more under torch.profiler (CPU and CUDA activity, as issue #30 measured),
    each engine step one ``engine_step`` range (``LLM._step``: schedule, model, sampling, which reads
    the tokens to the host, and postprocess): the GPU-busy fraction of the decode steps' wall time,
    :func:`decode_breakdown` of them, and the same breakdown of the steps that carried prompt tokens
    (prefill and mixed steps; no floor; ``prompt_tokens`` per such step, mean). (Before this, the
    ranges held the model call only, so the host's scheduling and sampling fell outside them:
    the first engine_breakdown_h100.json, until its re-run with overlapped decode.) The caller passes prompts
    the prefix cache does not hold if the prefill steps are to be those of a cold call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    # generate()'s loop calls one of them per iteration: with overlapped decode an iteration launches
    # step N+1 and records step N, so its range is one TPOT and its GPU work that of N+1 (and of N's
    # tail); the range's KV is that of the decode step launched in it (None: none launched, e.g. the
    # pipeline's last record). Where the pipeline breaks (a sequence ends by length, a stop token may
    # end one while requests wait), one decode step spans two iterations: a record-only one, left
    # out, and a launch-only one, counted with its host time alone (helper-33). This workload has
    # no stop tokens and breaks only where a wave of requests ends; a workload that breaks every
    # step would need ranges from each launch to its record instead.
    name = "_overlap_step" if llm.config.overlap_decode else "_step"
    forward, step = llm.runner.forward, getattr(llm, name)
    step_kv: list[Optional[int]] = []
    step_adapters: list[Optional[int]] = []
    step_prompt: list[Optional[int]] = []  # prompt tokens of a step that carried some, else None

    def recorded(work, running=(), **kw):  # kw: ModelRunner.forward's check, input_ids
        decode = all(len(w.token_ids) == 1 for w in work)
        step_kv[-1] = sum(w.start + 1 for w in work) if decode else None
        step_adapters[-1] = len({w.uid for w in work if w.uid is not None}) if decode else None
        step_prompt[-1] = None if decode else sum(len(w.token_ids) for w in work if len(w.token_ids) > 1) or None
        return forward(work, running, **kw)

    def labelled():
        step_kv.append(None)
        step_adapters.append(None)
        step_prompt.append(None)
        with record_function(STEP_LABEL):
            return step()

    llm.runner.forward = recorded
    setattr(llm, name, labelled)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, lora_request=names)
    finally:
        llm.runner.forward = forward
        delattr(llm, name)  # the bound method again
    breakdown = decode_breakdown(prof, step_kv, floor, step_adapters=step_adapters)
    busy = breakdown["gpu_busy_ms"] / breakdown["wall_ms"] if breakdown and breakdown["wall_ms"] else None
    prefill = decode_breakdown(prof, step_prompt, None)  # the same sums over the steps with prompt tokens
    if prefill is not None:
        carried = [t for t in step_prompt if t is not None]
        prefill.update(range="engine steps that carried prompt tokens (prefill or mixed)", steps=prefill.pop("decode_steps"),
                       prompt_tokens=round(sum(carried) / len(carried), 1))
    return (None if busy is None else round(busy, 3)), breakdown, prefill


def run_arrivals(model, cfg: EngineConfig, prompts, names, new_tokens: int, adapters: dict, device,
                 rate: float, seed: int = 3) -> dict:
    """The workload arriving over time: request i is added (``LLM.add_request``) at the i-th event
    of a Poisson process of ``rate`` requests/s, the engine stepping whenever something is
    unfinished. TTFT from each request's arrival; TPOT as in :func:`run_engine`."""
    release_engines(device)
    llm = LLM(copy.deepcopy(model) if device.type == "cpu" else model, cfg, dtype=model.dtype, device=device)
    for name, adapter in adapters.items():
        llm.register_adapter_weights(name, adapter)
    warm_up_row(llm, prompts, names, new_tokens)
    gen = torch.Generator().manual_seed(seed)
    gaps = torch.empty(len(prompts), dtype=torch.float64).exponential_(rate, generator=gen).tolist()
    due, t = [], 0.0
    for g in gaps:
        t += g
        due.append(t)
    params, outs, i = SamplingParams(max_new_tokens=new_tokens), [], 0
    work_of_step = record_step_work(llm)
    steps: list[list] = []  # [ms, decode rows, prefill tokens] per step
    t0 = time.perf_counter()
    while i < len(prompts) or llm.has_unfinished():
        now = time.perf_counter() - t0
        while i < len(prompts) and due[i] <= now:
            outs.append(llm.add_request(prompts[i], params, names[i]))
            i += 1
        if llm.has_unfinished():
            work_of_step[:] = [0, 0]
            s0 = time.perf_counter()
            llm.step()  # ends on the host's copy of the sampled tokens: the step's GPU work is done
            steps.append([round(1e3 * (time.perf_counter() - s0), 3), *work_of_step])
        elif i < len(prompts):
            time.sleep(max(0.0, due[i] - (time.perf_counter() - t0)))
    wall = time.perf_counter() - t0
    from reference.layers import unwrap_llama

    unwrap_llama(llm.model)
    tpot = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])]
    ttft = [o.token_times[0] for o in outs if o.token_times]
    tokens = sum(len(o.token_ids) for o in outs)
    return dict(rate_per_s=round(rate, 3), output_tokens=tokens, wall_s=round(wall, 3), tokens_per_s=round(tokens / wall, 2),
                tpot_ms_p50=round(1e3 * percentile(tpot, 0.5), 3), tpot_ms_p99=round(1e3 * percentile(tpot, 0.99), 3),
                tpot_p99_over_p50=round(percentile(tpot, 0.99) / percentile(tpot, 0.5), 2),
                ttft_s_p50=round(percentile(ttft, 0.5), 3), ttft_s_p99=round(percentile(ttft, 0.99), 3),
                step_costs=step_costs(steps, percentile(tpot, 0.5), percentile(tpot, 0.99)), step_log=steps,
                **{k: v for k, v in llm.stats.items() if k in ("steps", "mixed_steps", "prefill_steps", "decode_steps",
                                                               "preemptions")})


def record_step_work(llm) -> list[int]:
    """Wrap ``llm.runner.forward`` to add up, per step, the decode rows (one new token) and the
    prefill tokens (rows of more) it ran; the caller zeroes the returned [rows, tokens] before
    each step and reads it after."""
    work_of_step = [0, 0]
    forward = llm.runner.forward

    def counted(work, running=(), **kw):  # kw: ModelRunner.forward's check
        for w in work:
            n = len(w.token_ids)
            if n == 1:
                work_of_step[0] += 1
            else:
                work_of_step[1] += n
        return forward(work, running, **kw)

    llm.runner.forward = counted
    return work_of_step


def step_costs(steps: list[list], tpot_p50_s: float, tpot_p99_s: float) -> dict:
    """What a step costs by what it carries, from ``steps`` ([ms, decode rows, prefill tokens] each):
    a least-squares line ms = fixed + per_token * prefill tokens over the steps that decoded; the
    median of the decode-only steps; the steps at least as long as TPOT p99 (a request decoding
    every step waits one step per token, so those are the steps its slowest gaps sat in) and the
    prefill they carried; and the prefill tokens per step the line allows for TPOT p99 <= 3x p50
    (None when the line does not rise). Issue #30 asked what limits the p99 target."""
    decoding = [s for s in steps if s[1] > 0]
    pure = [s[0] for s in decoding if s[2] == 0]
    out: dict = dict(steps=len(steps), decode_only_steps=len(pure),
                     decode_only_ms_p50=round(statistics.median(pure), 3) if pure else None)
    if len({s[2] for s in decoding}) >= 2:
        fit = statistics.linear_regression([s[2] for s in decoding], [s[0] for s in decoding])
        out.update(fixed_ms=round(fit.intercept, 3), ms_per_1k_prefill_tokens=round(1e3 * fit.slope, 3))
        room_ms = 3 * 1e3 * tpot_p50_s - fit.intercept
        out["prefill_tokens_for_p99_3x_p50"] = int(room_ms / fit.slope) if fit.slope > 0 and room_ms > 0 else None
    slow = [s for s in decoding if s[0] >= 1e3 * tpot_p99_s]
    if slow:
        carried = sorted(s[2] for s in slow)
        out.update(steps_at_or_over_tpot_p99=len(slow), their_prefill_tokens_min=carried[0],
                   their_prefill_tokens_p50=carried[len(carried) // 2], their_prefill_tokens_max=carried[-1])
    return out


def run_peft(model, adapters_peft: int, prompts, names, new_tokens: int, batch: int, rank: int, device) -> dict:
    """HF PEFT mixed-adapter batches (``adapter_names``), greedy, ``batch`` requests at a time."""
    release_engines(device)
    import warnings

    import peft

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        pm = peft.get_peft_model(copy.deepcopy(model), cfg, adapter_name="a0")
        for k in range(1, adapters_peft):
            pm.add_adapter(f"a{k}", cfg)
    pm.eval()
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(prompts), batch):
        chunk, chunk_names = prompts[start:start + batch], names[start:start + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=device)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = pm.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False, eos_token_id=None, pad_token_id=0,
                              adapter_names=[n or "__base__" for n in chunk_names])
        tokens += (out.shape[1] - width) * len(chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return dict(output_tokens=tokens, wall_s=round(wall, 3), tokens_per_s=round(tokens / wall, 2), batch=batch)


def targets(rows: list[dict], attention: Optional[str] = None) -> list[dict]:
    """The issue's targets over the rows of one attention kernel (``attention``; None: any)."""
    by = {(r["system"], r["adapters"]): r for r in rows if attention is None or r.get("attention", attention) == attention}
    out = []
    one, base, many = by.get(("engine", 1)), by.get(("engine", 0)), by.get(("engine", 64))
    if many and one:
        v = many["tokens_per_s"] / one["tokens_per_s"]
        out.append(dict(target="64 adapters >= 80% of 1 adapter's throughput", value=round(v, 3), met=v >= 0.8))
    if many and base:
        v = many["tokens_per_s"] / base["tokens_per_s"]
        out.append(dict(target="64 adapters >= 70% of the base model's throughput", value=round(v, 3), met=v >= 0.7))
    for D, limit in ((0, 1.5), (32, 1.7)):
        row = by.get(("engine", D))
        if row and "tpot_p50_over_floor" in row:
            v = row["tpot_p50_over_floor"]
            out.append(dict(target=f"decode TPOT p50 <= {limit}x the floor with {D} adapters", value=v, met=v <= limit))
    peft64 = by.get(("peft", 64))
    if many and peft64:
        v = many["tokens_per_s"] / peft64["tokens_per_s"]
        out.append(dict(target="engine >= 20x PEFT's throughput at 64 adapters", value=round(v, 2), met=v >= 20))
    return out


def lora_backend(device: torch.device, splits: Optional[int]) -> Union[str, LoRABackend]:
    """The engine's LoRA backend: "triton" on CUDA ("torch" elsewhere), with every decode shrink split
    into ``splits`` pieces when given (``LoRABackend.split_k``; 1: unsplit)."""
    name = "triton" if device.type == "cuda" else "torch"
    if splits is None:
        return name
    return get_backend(name)._replace(split_k=lambda num_tokens, in_features, width: splits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny model and workload (any machine)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peft", action="store_true", help="also time HF PEFT's mixed-adapter batches")
    ap.add_argument("--peft-batch", type=int, default=16)
    ap.add_argument("--peft-requests", type=int, default=None,
                    help="PEFT runs the first N requests only (its tokens/s is over those; default: all)")
    ap.add_argument("--no-extras", action="store_true",
                    help="skip the prefix-cache (isolated vs shared key) and drain (on vs off) experiments")
    ap.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (default on CUDA: CUDA graphs)")
    ap.add_argument("--attention", nargs="+", default=[None], choices=["torch", "triton"],
                    help="attention kernels to run every row with (default: the device's, triton on CUDA); two "
                         "give a ratio in one run")
    ap.add_argument("--arrival-loads", type=float, nargs="*", default=[0.5, 0.8],
                    help="Poisson arrivals at these fractions of the base row's request rate (requests over "
                         "its wall time), with 1 adapter and with the largest adapter count; none to skip")
    ap.add_argument("--profile", action="store_true",
                    help="per row, one more profiled generate: GPU-busy fraction of the decode steps")
    ap.add_argument("--token-budget", type=int, default=None,
                    help="max_num_batched_tokens of the engine (default 8192; --smoke: 64)")
    ap.add_argument("--prefill-while-decoding", type=int, default=None,
                    help="max_prefill_tokens_while_decoding of the engine: the prompt tokens a step that also "
                         "decodes may carry (default: what the token budget leaves)")
    ap.add_argument("--no-overlap-decode", action="store_true",
                    help="EngineConfig.overlap_decode=False: the plain loop, which reads step N's tokens before "
                         "it launches step N+1 (default: overlapped)")
    ap.add_argument("--no-packed-projections", action="store_true",
                    help="each projection its own GEMM and LoRA expand (EngineConfig.packed_projections=False)")
    ap.add_argument("--no-packed-sgmv", action="store_true",
                    help="the SGMV kernels' grid over every (segment, row block) instead of the packed row blocks "
                         "(reference.ops.sgmv_shrink / sgmv_expand packed=False): the prefill and mixed steps before it")
    ap.add_argument("--no-sort-lora-by-slot", action="store_true",
                    help="steps with prompt tokens give the LoRA ops one segment per sequence instead of their rows "
                         "grouped by adapter slot (EngineConfig.sort_lora_by_slot=False: the default before run 9, "
                         "engine_run9_h100.json)")
    ap.add_argument("--no-overlap-lora-shrink", action="store_true",
                    help="each layer's LoRA shrink in line after its base GEMM (EngineConfig.overlap_lora_shrink=False)")
    ap.add_argument("--decode-shrink-splits", type=int, default=None, metavar="S",
                    help="every decode shrink split over the hidden size into S fp32 partials (1: unsplit) instead of "
                         "reference.ops.decode_splits' choice, which was swept with the shrink in line "
                         "(decode_split_k_h200.json), not on the side stream beside the base GEMM")
    ap.add_argument("--max-loras", type=int, default=65,
                    help="GPU adapter slots, the base model's included (default 65: a 64-adapter row fits at once)")
    ap.add_argument("--no-fused-ops", action="store_true",
                    help="EngineConfig.fused_ops=False: the decoder layer's norms, rope and SiLU-and-mul as "
                         "Hugging Face's torch ops instead of the fused Triton kernels")
    ap.add_argument("--check-work", action="store_true",
                    help="the engine's step checks its own work every step (as before it trusted its scheduler)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.no_packed_sgmv:  # the layers' backend looks the ops up on reference.ops when it is built
        import functools

        import reference.ops as ops

        ops.sgmv_shrink = functools.partial(ops.sgmv_shrink, packed=False)
        ops.sgmv_expand = functools.partial(ops.sgmv_expand, packed=False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.decode_shrink_splits is not None and args.decode_shrink_splits < 1:
        ap.error(f"--decode-shrink-splits must be >= 1, got {args.decode_shrink_splits}")
    if not args.smoke and device.type != "cuda":
        raise SystemExit("the full benchmark needs a CUDA device; --smoke runs anywhere")
    if args.smoke:
        cfg, layers, n, lo, hi, new, adapter_counts = SMOKE, 2, 12, 8, 24, 6, [1, 4, 8]
        dtype = torch.float32
    else:
        cfg, layers, n, lo, hi, new, adapter_counts = FULL, args.layers, args.requests, 128, 1024, args.new_tokens, args.adapters
        dtype = torch.bfloat16
    block = 16
    model = build_model(cfg, layers, hi + new + 8, device, dtype)
    mods = llama_pool_modules(llama_checkpoint(model))
    engine_cfg = EngineConfig(max_loras_per_batch=args.max_loras if not args.smoke else 4, max_lora_rank=args.rank,
                              num_kv_blocks=n * -(-(hi + new) // block) + 8, block_size=block,
                              max_num_seqs=n, max_num_batched_tokens=args.token_budget or (8192 if not args.smoke else 64),
                              backend=lora_backend(device, args.decode_shrink_splits),
                              cuda_graph=False if args.no_cuda_graph else None,
                              max_prefill_tokens_while_decoding=args.prefill_while_decoding,
                              overlap_decode=not args.no_overlap_decode, fused_ops=False if args.no_fused_ops else None,
                              packed_projections=False if args.no_packed_projections else None,
                              sort_lora_by_slot=not args.no_sort_lora_by_slot,
                              overlap_lora_shrink=not args.no_overlap_lora_shrink)
    decode = "cuda_graph" if device.type == "cuda" and not args.no_cuda_graph else "eager"
    gen = torch.Generator().manual_seed(1)
    adapters = {f"a{k}": random_adapter(f"a{k}", args.rank, mods, layers, gen) for k in range(max(adapter_counts))}
    adapters = {k: type(a)(a.uid, a.rank, a.scaling, {key: (A.to(dtype), B.to(dtype)) for key, (A, B) in a.weights.items()})
                for k, a in adapters.items()}
    prompts = workload(n, lo, hi, cfg["vocab_size"])
    from tqdm import tqdm

    import transformers

    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    stem = ("engine_smoke" if args.smoke else "engine_h200") + ("_eager" if args.no_cuda_graph else "")
    out = args.out or ROOT / "benchmarks" / "results" / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    extras: list[dict] = []
    floor_info: dict = {}

    def save() -> list[dict]:  # after every row: a run cut short by a time limit keeps what it measured
        met = targets(rows, rows[-1].get("attention") if rows else None)
        for row in (e for e in extras if e.get("experiment") == "poisson_arrivals"):
            v = row["tpot_p99_over_p50"]
            met.append(dict(target=f"TPOT p99 <= 3x p50 under Poisson arrivals (load {row['load']}, {row['adapters']} "
                                   "adapters)", value=v, met=v <= 3))
        result = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                      transformers=transformers.__version__, smoke=args.smoke, model=cfg, layers=layers, requests=n,
                      prompt_lens=[lo, hi], new_tokens=new, rank=args.rank, decode=decode,
                      engine_config={**engine_cfg.__dict__, "backend": get_backend(engine_cfg.backend).name},
                      # None: each shape's S from reference.ops.decode_splits (the default)
                      decode_shrink_splits=args.decode_shrink_splits, engine_checks_its_work=args.check_work, rows=rows, targets=met, extras=extras,
                      peft_requests=args.peft_requests or n,
                      copy_bandwidth_TBps=round(floor_info["bandwidth"] / 1e12, 3) if floor_info else None,
                      weight_bytes=floor_info.get("weights"), kv_bytes_per_position=floor_info.get("kv_per_position"),
                      lora_bytes_per_adapter=floor_info.get("lora_per_adapter"),
                      sgmv_grid="segments" if args.no_packed_sgmv else "packed",
                      method="one untimed pass of the whole workload (4 new tokens) first; one generate() per "
                             "row after its warm-up (a tiny call, then the row's whole workload on other prompts: "
                             "warm_up_row); tokens/s over its wall time; TPOT = gaps "
                             "between a request's consecutive tokens; TTFT from the call's start (every request "
                             "arrives at once: it is the request's waiting time plus its prefill); Zipf(1.0) "
                             "adapter popularity")
        out.write_text(json.dumps(result, indent=1))
        return met

    # One untimed pass of the whole workload first (half base, half one adapter, 4 new tokens): the
    # first engine in a process grows the CUDA caching allocator, creates cuBLAS/SDPA handles and
    # compiles the Triton LoRA kernels for the prefill shapes; measured first, the base row paid all
    # of it (TTFT P50 2.6 s against 1.5 s for the one-adapter row run after it, H200)
    warm = run_engine(model, engine_cfg, prompts, [None if i % 2 else "a0" for i in range(n)], 4,
                      {"a0": adapters["a0"]}, device)
    tqdm.write(f"warm-up pass (untimed): {warm['wall_s']:.1f} s")
    floor = None
    if device.type == "cuda":
        weights, per_position = step_bytes(model)
        floor = dict(bandwidth=copy_bandwidth(device), weights=weights, kv_per_position=per_position,
                     lora_per_adapter=adapter_bytes(mods, layers, args.rank, torch.finfo(dtype).bits // 8))
        tqdm.write(f"copy bandwidth {floor['bandwidth'] / 1e12:.2f} TB/s, weights {weights / 2**30:.2f} GiB, "
                   f"KV {per_position} B per position")
    floor_info.update(floor or {})
    cases = [(D, a) for a in args.attention for D in [0] + adapter_counts]
    for D, attention in tqdm(cases, desc="engine runs"):
        names = [None] * n if D == 0 else [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(2), n, D)]
        used = {k: adapters[k] for k in set(names) if k is not None}
        cfg_row = EngineConfig(**{**engine_cfg.__dict__, "attention_backend": attention})
        row = dict(system="engine", adapters=D, distinct_in_trace=len(used),
                   **run_engine(model, cfg_row, prompts, names, new, used, device, floor=floor, profile=args.profile,
                              check_work=args.check_work))
        row["attention"] = attention or ("triton" if device.type == "cuda" else "torch")
        rows.append(row)
        save()
        tqdm.write(f"engine  D={D:4d} {row['attention']:6}: {row['tokens_per_s']:9.1f} tok/s, TPOT p50 {row['tpot_ms_p50']:.2f} ms "
                   f"(floor {row.get('decode_floor_ms_p50', float('nan')):.2f} ms, busy {row.get('gpu_busy_decode')}) "
                   f"p99 {row['tpot_ms_p99']:.2f} ms, TTFT p50 {row['ttft_s_p50']:.2f} s, steps {row['steps']}, "
                   f"preemptions {row['preemptions']}, loads {row['adapter_loads']}, "
                   f"graph decode steps {row['graph_decode_steps']}/{row['decode_steps']}")
        if row.get("decode_breakdown"):
            tqdm.write(f"  a decode step: {row['decode_breakdown']}")
    base_row = next((r for r in rows if r["adapters"] == 0), None)
    for load in (args.arrival_loads if base_row else []):
        rate = load * n / base_row["wall_s"]
        for D in sorted({1, max(adapter_counts)}):
            names = [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(2), n, D)]
            used = {k: adapters[k] for k in set(names)}
            row = dict(experiment="poisson_arrivals", load=load, adapters=D, distinct_in_trace=len(used),
                       **run_arrivals(model, engine_cfg, prompts, names, new, used, device, rate))
            extras.append(row)
            save()
            tqdm.write(f"arrivals load {load:.2f} ({rate:.1f} req/s) D={D}: TPOT p50 {row['tpot_ms_p50']:.2f} ms p99 "
                       f"{row['tpot_ms_p99']:.2f} ms (x{row['tpot_p99_over_p50']}), TTFT p50 {row['ttft_s_p50']:.3f} s "
                       f"p99 {row['ttft_s_p99']:.3f} s, {row['tokens_per_s']:.1f} tok/s")
            tqdm.write(f"  its steps: {row['step_costs']}")
    if not args.no_extras:
        # Prefix cache: 8 adapters over 4 shared system prompts; the adapter-keyed cache against the
        # unsafe tokens-only key (its extra hits are other adapters' KV: wrong outputs)
        D = min(8, max(adapter_counts))
        sys_len = 16 if args.smoke else 512  # whole blocks of 16
        shared = shared_prefix_workload(n, 4, sys_len, lo // 2, hi // 2, cfg["vocab_size"])
        names = [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(4), n, D)]
        used = {k: adapters[k] for k in set(names)}
        for label, policies in (("adapter-keyed (isolated)", EnginePolicies()), ("tokens-only (unsafe)", BLIND)):
            row = dict(experiment="prefix_cache", key=label, adapters=D, system_prompts=4, system_prompt_len=sys_len,
                       **run_engine(model, engine_cfg, shared, names, new, used, device, policies))
            extras.append(row)
            save()
            tqdm.write(f"prefix  {label:26}: hit rate {row['prefix_hit_rate']:.3f}, {row['tokens_per_s']:9.1f} tok/s")
        # Drain: a skewed trace (Zipf(1.2) over 32 adapters) through 4 slots, the drain off and on
        D = min(32, max(adapter_counts))
        names = [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(5), n, D, alpha=1.2)]
        used = {k: adapters[k] for k in set(names)}
        for threshold in (None, 8):
            small = EngineConfig(**{**engine_cfg.__dict__, "max_loras_per_batch": 4, "drain_threshold": threshold})
            row = dict(experiment="drain", drain_threshold=threshold, adapters=D, max_loras_per_batch=4,
                       **run_engine(model, small, prompts, names, new, used, device))
            extras.append(row)
            save()
            tqdm.write(f"drain   threshold {threshold!s:>4}: TTFT p50 {row['ttft_s_p50']:.2f} s p99 "
                       f"{row['ttft_s_p99']:.2f} s, {row['tokens_per_s']:9.1f} tok/s, drains {row['drains']}")
    if args.peft:
        m = args.peft_requests or n
        for D in sorted({1, min(64, max(adapter_counts))}):
            names = [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(2), n, D)]
            row = dict(system="peft", adapters=D, requests=m,
                       **run_peft(model, D, prompts[:m], names[:m], new, args.peft_batch, args.rank, device))
            rows.append(row)
            save()
            print(f"peft    D={D:4d}: {row['tokens_per_s']:9.1f} tok/s ({m} requests in batches of {args.peft_batch})")
    met = save()
    for t in met:
        print(f"{'met' if t['met'] else 'MISSED'}: {t['target']} (measured {t['value']})")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
