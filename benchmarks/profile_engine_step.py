"""Where an engine step's time goes: the host's Python (cProfile, by function) and the GPU's kernels
(torch.profiler, by kernel), over one ``generate`` of benchmark_engine.py's workload.

    python benchmarks/profile_engine_step.py [--requests 256] [--adapters 64] [--new-tokens 64] [--top 25]

Prints two tables (host functions by own time; GPU kernels by total time, with the share of GPU
time) and writes them to ``benchmarks/results/engine_profile_<device>.json``. Model and workload:
benchmark_engine.py's (8 Llama-3-8B-shaped layers, bf16, prompts 128-1024 tokens, Zipf adapters).
"""
from __future__ import annotations

import argparse
import cProfile
import copy
import io
import json
import pstats
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_decode_step import FULL, SMOKE, random_adapter  # noqa: E402
from benchmark_engine import build_model, workload, zipf_choice  # noqa: E402
from reference.engine import LLM, EngineConfig, SamplingParams  # noqa: E402
from reference.tp.model import llama_checkpoint, llama_pool_modules  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--attention", default=None, choices=["torch", "triton"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg, layers, n, lo, hi, dtype = ((SMOKE, 2, 8, 8, 24, torch.float32) if args.smoke else
                                     (FULL, args.layers, args.requests, 128, 1024, torch.bfloat16))
    new, block = (4 if args.smoke else args.new_tokens), 16
    model = build_model(cfg, layers, hi + new + 8, device, dtype)
    mods = llama_pool_modules(llama_checkpoint(model))
    ecfg = EngineConfig(max_loras_per_batch=33 if not args.smoke else 4, max_lora_rank=16,
                        num_kv_blocks=n * -(-(hi + new) // block) + 8, block_size=block, max_num_seqs=n,
                        max_num_batched_tokens=8192 if not args.smoke else 64,
                        backend="triton" if device.type == "cuda" else "torch", attention_backend=args.attention)
    llm = LLM(copy.deepcopy(model) if device.type == "cpu" else model, ecfg, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(1)
    names = [f"a{k}" for k in zipf_choice(torch.Generator().manual_seed(2), n, args.adapters)] if args.adapters else [None] * n
    for name in sorted({x for x in names if x}):
        a = random_adapter(name, 16, mods, layers, gen)
        llm.register_adapter_weights(name, type(a)(a.uid, a.rank, a.scaling,
                                                   {k: (A.to(dtype), B.to(dtype)) for k, (A, B) in a.weights.items()}))
    prompts, params = workload(n, lo, hi, cfg["vocab_size"]), SamplingParams(max_new_tokens=new)
    llm.generate(prompts, SamplingParams(max_new_tokens=2), lora_request=names)  # warm-up: compiles, allocator
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, params, lora_request=names)
    prof.disable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream).sort_stats("tottime")
    stats.print_stats(args.top)
    print(stream.getvalue())
    host = [dict(function=f"{Path(f).name}:{line}:{fn}", calls=nc, own_s=round(tt, 4), cum_s=round(ct, 4))
            for (f, line, fn), (cc, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:args.top]]
    kernels = []
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            llm.generate(prompts, params, lora_request=names)
        events = [e for e in tp.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in events) or 1
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:args.top]:
            kernels.append(dict(kernel=e.key[:120], calls=e.count, total_ms=round(e.self_device_time_total / 1e3, 3),
                                share=round(e.self_device_time_total / total, 4)))
            print(f"{kernels[-1]['share']:7.2%} {kernels[-1]['total_ms']:10.2f} ms {e.count:7d}  {e.key[:100]}")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    out = args.out or ROOT / "benchmarks" / "results" / ("engine_profile_smoke.json" if args.smoke else "engine_profile_h200.json")
    out.write_text(json.dumps(dict(device=name, torch=torch.__version__, requests=n, adapters=args.adapters,
                                   new_tokens=new, layers=layers, attention=llm.runner.attention_backend,
                                   host_by_own_time=host, gpu_kernels=kernels), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
