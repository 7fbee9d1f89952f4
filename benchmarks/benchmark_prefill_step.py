"""One prefill step of a Llama-shaped model with multi-LoRA: the LoRA overhead over the base step
(issue #16's prefill target).

    python benchmarks/benchmark_prefill_step.py [--layers 4] [--seqs 4] [--seq-len 2048] [--out PATH]
    python benchmarks/benchmark_prefill_step.py --smoke        # tiny sizes, CPU or GPU, seconds

Model: the decode-step benchmark's (``benchmarks/benchmark_decode_step.py``: hidden 4096, GQA 32/8,
intermediate 14336, vocab 32000, bf16, random weights, ``--layers`` layers), wrapped by
``reference.layers.wrap_llama`` over a pool of fused modules (qkv_proj, o_proj, gate_up_proj,
down_proj) with LoRA on all of them. One step is the decoder stack (``model.model``: embeddings,
layers, final norm; no LM head, which a serving engine runs on the last token of each prompt
only) over ``--seqs`` prompts of ``--seq-len`` tokens each, causal attention, no KV cache, eager
(prefill is not graphed, chapter 08). Request i uses adapter (i mod D); every prompt is one SGMV
segment (chapter 07's batch info, requests in order).

Cases: D = 0 (the base model: the layers add nothing when no request has an adapter), 1 and
``--seqs`` distinct adapters x ranks 16 and 64, for each ``--backends`` entry ("triton": cuBLAS
projections and the separate SGMV kernels, the layers' default; "triton_fused": the expand in the
epilogue of the book's Triton projection GEMM). Timed with ``triton.testing.do_bench`` (median) in
one run; the LoRA overhead is against the first backend's base step: ``lora_us / base_us - 1``.

Target (issue #16): LoRA adds <= 5 % to the prefill step. The script prints whether it is met.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_decode_step import (FULL, SMOKE, backend_named, modules, profile_kernels,  # noqa: E402
                                  random_adapter, timer)

from reference.batch_info import batch_info_from_requests  # noqa: E402
from reference.layers import LoRAContext, unwrap_llama, wrap_llama  # noqa: E402
from reference.mem_pool import LoRAMemoryPool  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def run(layers: int, seqs: int, seq_len: int, adapter_counts, ranks, cfg: dict, device: torch.device,
        backends=("triton",), profiles: dict | None = None) -> list[dict]:
    """Every (rank, backend, adapters) case; rows in that order (see the module docstring). With
    ``profiles`` (a dict), the first backend's base step and its step with the most adapters are
    profiled per kernel into it, per rank."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=layers, max_position_embeddings=seq_len + 8, **cfg)
    with torch.device(device):
        base = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    mods = modules(cfg)
    timeit = timer(device)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (seqs, seq_len), generator=g).to(device)
    positions = torch.arange(seq_len, device=device).expand(seqs, seq_len)
    rows = []
    for rank in ranks:
        n_adapters = max(adapter_counts)
        gen = torch.Generator().manual_seed(rank)
        registry = {f"a{k}": random_adapter(f"a{k}", rank, mods, layers, gen) for k in range(n_adapters)}
        pool = LoRAMemoryPool(mods, layers, n_adapters + 1, rank, dtype=torch.bfloat16, device=device,
                              adapter_source=registry.__getitem__)
        reference_us = None
        for backend in backends:
            context = LoRAContext()
            model = wrap_llama(base, pool, context, backend_named(backend))
            for D in adapter_counts:
                uids = [None] * seqs if D == 0 else [f"a{i % D}" for i in range(seqs)]
                uid_to_slot = pool.prepare_lora_batch(uids)
                info = batch_info_from_requests(uids, [seq_len] * seqs, uid_to_slot, pool.lora_ranks_host,
                                                pool.scalings_host, device)

                def step():
                    context.set_batch(info)
                    with torch.inference_mode():
                        return model.model(input_ids=ids, position_ids=positions, use_cache=False)
                us = timeit(step)
                if reference_us is None:
                    reference_us = us  # the first backend's base step
                row = dict(backend=backend, rank=rank, seqs=seqs, seq_len=seq_len, adapters=D, us=round(us, 1),
                           reference_base_us=round(reference_us, 1),
                           lora_overhead=round(us / reference_us - 1, 4) if D > 0 else None)
                rows.append(row)
                extra = "" if D == 0 else f", LoRA {100 * row['lora_overhead']:+.1f}% of {reference_us:.0f} us"
                print(f"{backend:13s} rank {rank:3d} {seqs} x {seq_len} tokens, {D:2d} adapters: {us:10.1f} us{extra}",
                      flush=True)
                if profiles is not None and backend == backends[0] and D in (0, max(adapter_counts)):
                    profiles.setdefault(f"rank {rank} {backend}", {}).update(
                        profile_kernels({"base" if D == 0 else f"lora {D} adapters": step}, what="prefill step"))
            unwrap_llama(model)
        del pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """Issue #16: LoRA adds <= 5 % to the prefill step, per backend, rank and adapter count."""
    return [dict(target=f"#16: LoRA adds <= 5% to the prefill step ({r['seqs']} x {r['seq_len']} tokens, "
                        f"{r['adapters']} adapters, rank {r['rank']}, {r['backend']} backend)",
                 value=r["lora_overhead"], met=r["lora_overhead"] <= 0.05)
            for r in rows if r["lora_overhead"] is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--backends", nargs="+", default=["triton"],
                    help="layer backends compared in one run (e.g. triton triton_fused); overheads are against "
                         "the first one's base step")
    ap.add_argument("--profile", action="store_true", help="also profile the base and the most-adapters step per kernel")
    ap.add_argument("--smoke", action="store_true", help="tiny model and batch (any machine)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        raise SystemExit("the full benchmark needs a CUDA device; --smoke runs anywhere")
    if args.smoke:
        layers, seqs, seq_len, cfg, ranks = 1, 2, 8, SMOKE, [4]
    else:
        layers, seqs, seq_len, cfg, ranks = args.layers, args.seqs, args.seq_len, FULL, args.ranks
    profiles = {} if args.profile else None
    rows = run(layers, seqs, seq_len, sorted({0, 1, seqs}), ranks, cfg, device, backends=args.backends,
               profiles=profiles)
    met = targets(rows)
    for t in met:
        print(f"{'met' if t['met'] else 'MISSED'}: {t['target']} (measured {t['value']})")
    import triton
    import transformers

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    result = dict(device=name, torch=torch.__version__, triton=triton.__version__,
                  transformers=transformers.__version__, layers=layers, seqs=seqs, seq_len=seq_len,
                  smoke=args.smoke, model=cfg, backends=args.backends, rows=rows, targets=met, kernel_profiles=profiles,
                  method="do_bench median (us) of one eager prefill of the decoder stack (no LM head)")
    out = args.out or (ROOT / "benchmarks" / "results" /
                       ("prefill_step_smoke.json" if args.smoke else "prefill_step_h200.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
