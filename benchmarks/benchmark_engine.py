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
(CPU), ``max_loras_per_batch`` 33 (32 adapters and the base), every adapter in the CPU tier.

Reported per run: output tokens/s over the whole ``generate`` wall time; time per output token (the
gap between a request's consecutive tokens) P50 / P99; time to first token P50 / P99; steps,
preemptions, adapter loads, prefix-cache hit rate. ``--peft``: the same workload through PEFT
(``adapter_names`` mixed batches of ``--peft-batch`` requests, left-padded, ``generate`` greedy),
at 1 adapter and at 64 (or the largest D asked for): output tokens/s.

Decode: on CUDA the engine's decode steps replay CUDA graphs (``EngineConfig.cuda_graph``, the
default there: ``reference/engine/cuda_graph_runner.py``, buckets up to ``max_num_seqs``, captured
when the engine is built, outside the timed ``generate``); ``--no-cuda-graph`` runs them eagerly.
The result JSON records which (``decode``, and per row ``decode_mode``, ``graph_decode_steps`` and
``graph_fallbacks``); its file name gets ``_eager`` without graphs. With graphs the pool has one
slot more, pinned to the base model (the padding rows' rank-0 slot); the scheduler's cap is the same.

Targets (issue #15): at 64 adapters, >= 80% of the single-adapter throughput and >= 70% of the base
model's; the engine >= 20x PEFT's throughput at 64. The script prints which are met.
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

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_decode_step import FULL, SMOKE, random_adapter  # noqa: E402  (the same model shapes and adapters)
from reference.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from reference.tp_model import llama_checkpoint, llama_pool_modules  # noqa: E402


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


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_engine(model, cfg: EngineConfig, prompts, names, new_tokens: int, adapters: dict, device) -> dict:
    llm = LLM(copy.deepcopy(model) if device.type == "cpu" else model, cfg, dtype=model.dtype, device=device)
    for name, adapter in adapters.items():
        llm.register_adapter_weights(name, adapter)
    params = SamplingParams(max_new_tokens=new_tokens)
    llm.generate([prompts[0][:8]], SamplingParams(max_new_tokens=2), lora_request=[names[0]])  # warm-up (Triton compiles)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=names)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    tpot = [b - a for o in outs for a, b in zip(o.token_times, o.token_times[1:])]
    ttft = [o.token_times[0] for o in outs if o.token_times]
    from reference.layers import unwrap_llama

    unwrap_llama(llm.model)
    return dict(output_tokens=tokens, wall_s=round(wall, 3), tokens_per_s=round(tokens / wall, 2),
                tpot_ms_p50=round(1e3 * percentile(tpot, 0.5), 3), tpot_ms_p99=round(1e3 * percentile(tpot, 0.99), 3),
                ttft_s_p50=round(percentile(ttft, 0.5), 3), ttft_s_p99=round(percentile(ttft, 0.99), 3),
                **{k: v for k, v in llm.stats.items() if k != "pool_events"},
                adapter_loads=llm.stats["pool_events"].get("load", 0))


def run_peft(model, adapters_peft: int, prompts, names, new_tokens: int, batch: int, rank: int, device) -> dict:
    """HF PEFT mixed-adapter batches (``adapter_names``), greedy, ``batch`` requests at a time."""
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


def targets(rows: list[dict]) -> list[dict]:
    by = {(r["system"], r["adapters"]): r for r in rows}
    out = []
    one, base, many = by.get(("engine", 1)), by.get(("engine", 0)), by.get(("engine", 64))
    if many and one:
        v = many["tokens_per_s"] / one["tokens_per_s"]
        out.append(dict(target="64 adapters >= 80% of 1 adapter's throughput", value=round(v, 3), met=v >= 0.8))
    if many and base:
        v = many["tokens_per_s"] / base["tokens_per_s"]
        out.append(dict(target="64 adapters >= 70% of the base model's throughput", value=round(v, 3), met=v >= 0.7))
    peft64 = by.get(("peft", 64))
    if many and peft64:
        v = many["tokens_per_s"] / peft64["tokens_per_s"]
        out.append(dict(target="engine >= 20x PEFT's throughput at 64 adapters", value=round(v, 2), met=v >= 20))
    return out


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
    ap.add_argument("--no-cuda-graph", action="store_true", help="decode eagerly (default on CUDA: CUDA graphs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
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
    engine_cfg = EngineConfig(max_loras_per_batch=33 if not args.smoke else 4, max_lora_rank=args.rank,
                              num_kv_blocks=n * -(-(hi + new) // block) + 8, block_size=block,
                              max_num_seqs=n, max_num_batched_tokens=8192 if not args.smoke else 64,
                              backend="triton" if device.type == "cuda" else "torch",
                              cuda_graph=False if args.no_cuda_graph else None)
    decode = "cuda_graph" if device.type == "cuda" and not args.no_cuda_graph else "eager"
    gen = torch.Generator().manual_seed(1)
    adapters = {f"a{k}": random_adapter(f"a{k}", args.rank, mods, layers, gen) for k in range(max(adapter_counts))}
    adapters = {k: type(a)(a.uid, a.rank, a.scaling, {key: (A.to(dtype), B.to(dtype)) for key, (A, B) in a.weights.items()})
                for k, a in adapters.items()}
    prompts = workload(n, lo, hi, cfg["vocab_size"])
    from tqdm import tqdm

    rows = []
    cases = [0] + adapter_counts
    for D in tqdm(cases, desc="engine runs"):
        names = [None] * n if D == 0 else [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(2), n, D)]
        used = {k: adapters[k] for k in set(names) if k is not None}
        row = dict(system="engine", adapters=D, distinct_in_trace=len(used),
                   **run_engine(model, engine_cfg, prompts, names, new, used, device))
        rows.append(row)
        tqdm.write(f"engine  D={D:4d}: {row['tokens_per_s']:9.1f} tok/s, TPOT p50 {row['tpot_ms_p50']:.2f} ms "
                   f"p99 {row['tpot_ms_p99']:.2f} ms, TTFT p50 {row['ttft_s_p50']:.2f} s, steps {row['steps']}, "
                   f"preemptions {row['preemptions']}, loads {row['adapter_loads']}, "
                   f"graph decode steps {row['graph_decode_steps']}/{row['decode_steps']}")
    if args.peft:
        for D in sorted({1, min(64, max(adapter_counts))}):
            names = [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(2), n, D)]
            row = dict(system="peft", adapters=D, **run_peft(model, D, prompts, names, new, args.peft_batch, args.rank, device))
            rows.append(row)
            print(f"peft    D={D:4d}: {row['tokens_per_s']:9.1f} tok/s (batches of {args.peft_batch})")
    met = targets(rows)
    for t in met:
        print(f"{'met' if t['met'] else 'MISSED'}: {t['target']} (measured {t['value']})")
    import transformers

    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    result = dict(device=name, torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
                  smoke=args.smoke, model=cfg, layers=layers, requests=n, prompt_lens=[lo, hi], new_tokens=new,
                  rank=args.rank, decode=decode, engine_config=engine_cfg.__dict__, rows=rows, targets=met,
                  method="one generate() per row after a warm-up call; tokens/s over its wall time; TPOT = gaps "
                         "between a request's consecutive tokens; Zipf(1.0) adapter popularity")
    stem = ("engine_smoke" if args.smoke else "engine_h200") + ("_eager" if args.no_cuda_graph else "")
    out = args.out or ROOT / "benchmarks" / "results" / f"{stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
