"""Tune SGMV's expand at the engine's prefill shapes on a GPU (issue #30: the LoRA of a step with prompt tokens).

    python benchmarks/sweep_prefill_expand.py --out benchmarks/results/prefill_expand_<gpu>.json
    TRITON_INTERPRET=1 python benchmarks/sweep_prefill_expand.py --smoke --out /tmp/prefill_expand.json   # any machine

Why: in ``benchmark_engine.py``'s profile (``engine_packed_h100.json``, ``prefill_breakdown``) a step
with prompt tokens (7.7k on average) spends 12.4 ms in LoRA kernels against 34.6 ms of GEMMs, 10.7 ms
of it in ``_sgmv_expand_kernel``; that expand reads and writes each projection's whole output, about
3x its bytes at the copy bandwidth. Its defaults (``block_m`` 128, ``block_n`` 128, 4 warps at rank
16; ``tuned_configs.json``) were tuned on 4 requests of 2048 tokens, one 4096-wide projection.

Shapes: one mixed step as the engine builds it: prompt chunks of 128-1024 tokens (seeded) up to
``--prompt-tokens`` (default 7680) and ``--decodes`` one-token decode segments (default 150), one
segment per sequence, each on one of ``--adapters`` adapters (default 32) of rank 16 in a pool of
65 slots (slot 0 the base model, rank 0); bf16; the output widths of a Llama-3-8B layer's packed
modules: q|k|v (4096 + 1024 + 1024, 3 slices), o and down (4096), gate|up (14336 + 14336, 2 slices).

Method: each config's ``sgmv_expand`` captured in a CUDA graph, ``do_bench`` median of the replay
(``benchmark_lora_ops.graph_time``; each replay adds into the same output again). The first call of
each config is checked against the torch reference on a fresh output. The floor of a launch: its
bytes (t read, B of each distinct adapter read, the output read and written) at the copy bandwidth
measured in the same run. Prints per width the default's time, the best config and the floor, and
writes every row.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))

from reference.batch_info import batch_info_from_requests, build_batch_info  # noqa: E402
from reference.ops import sgmv_expand, torch_ref  # noqa: E402

WIDTHS = {"qkv_proj": (4096, 1024, 1024), "o_proj/down_proj": (4096,), "gate_up_proj": (14336, 14336)}
SMOKE_WIDTHS = {"qkv": (32, 16, 16), "o": (32,), "gate_up": (48, 48)}


#: The tile the defaults had before this sweep (tuned_configs.json: 4 requests of 2048 tokens).
BASELINE = {"block_m": 128, "block_n": 128, "num_warps": 4}


def configs(smoke: bool) -> list[dict]:
    if smoke:
        return [{}, dict(block_m=16, block_n=16), dict(block_m=32, block_n=32, num_warps=2)]
    out = [{}, dict(BASELINE)]  # the defaults, and the tile before them
    for bm in (64, 128):
        for bn in (128, 256):
            for w in (4, 8):
                for st in (1, 3):
                    out.append(dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st))
    out += [dict(block_m=32, block_n=bn, num_warps=w, num_stages=st) for bn, w in ((256, 4), (128, 4), (512, 4), (512, 8))
            for st in (1, 3)]
    out += [dict(block_m=16, block_n=bn, num_warps=4, num_stages=1) for bn in (256, 512)]
    out += [dict(block_m=256, block_n=64, num_warps=8, num_stages=st) for st in (1, 3)]
    return out


def mixed_step(prompt_tokens: int, decodes: int, adapters: int, rank: int, slots: int, seed: int = 0):
    """(segment lengths, their slots, pool ranks, scalings) of one mixed step."""
    rng = random.Random(seed)
    lens = []
    while sum(lens) < prompt_tokens:
        lens.append(min(rng.randint(128, 1024), prompt_tokens - sum(lens)))
    lens += [1] * decodes
    rng.shuffle(lens)
    seg_slots = [1 + rng.randrange(adapters) for _ in lens]
    ranks = [0] + [rank] * (slots - 1)
    scalings = [0.0] + [rng.uniform(0.5, 2.0) for _ in range(slots - 1)]
    return lens, seg_slots, ranks, scalings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, three configs (the CPU interpreter)")
    ap.add_argument("--prompt-tokens", type=int, default=7680)
    ap.add_argument("--decodes", type=int, default=150)
    ap.add_argument("--adapters", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--sort-by-slot", action="store_true",
                    help="the rows grouped by adapter slot, one segment per slot (EngineConfig.sort_lora_by_slot)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        raise SystemExit("the sweep needs a CUDA device; --smoke runs in the interpreter")
    if args.smoke:
        prompt_tokens, decodes, n_adapters, rank, slots, widths = 40, 6, 3, 4, 5, SMOKE_WIDTHS
        dtype = torch.float32
    else:
        prompt_tokens, decodes, n_adapters, rank, slots, widths = (args.prompt_tokens, args.decodes, args.adapters,
                                                                   args.rank, 65, WIDTHS)
        dtype = torch.bfloat16
    lens, seg_slots, ranks, scalings = mixed_step(prompt_tokens, decodes, n_adapters, rank, slots)
    if args.sort_by_slot:
        info = batch_info_from_requests(seg_slots, lens, {u: u for u in range(slots)}, ranks, scalings, device,
                                        sort_by_slot=True)
    else:
        info = build_batch_info(lens, seg_slots, ranks, scalings, device)
    n, distinct = sum(lens), len(set(seg_slots))
    g = torch.Generator().manual_seed(1)
    if device == "cuda":
        from benchmark_lora_ops import copy_bandwidth, graph_time
        bandwidth = copy_bandwidth()  # GB/s

        def timed(fn):
            return graph_time(fn, warmup=10, rep=40)
    else:
        bandwidth = None

        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return 1e6 * (time.perf_counter() - t0)
    rows, best = [], []
    print(f"{n} tokens in {info.num_segments} segments" + (" (rows grouped by slot)" if args.sort_by_slot else ""))
    start = time.perf_counter()
    for name, parts in widths.items():
        out_total = sum(parts)
        offsets = tuple([0] + [sum(parts[:i + 1]) for i in range(len(parts))])
        t = (torch.randn(n, len(parts) * rank, generator=g) * 0.1).to(device, dtype)
        B = (torch.randn(slots, out_total, rank, generator=g) * rank ** -0.5).to(device, dtype)
        base = torch.randn(n, out_total, generator=g).to(device, dtype)
        want = torch_ref.sgmv_expand(t.float(), B.float(), info, base.float().clone(),
                                     offsets if len(parts) > 1 else None)
        nbytes = t.element_size() * (t.numel() + distinct * out_total * rank + 2 * n * out_total)
        floor_us = nbytes / (bandwidth * 1e9) * 1e6 if bandwidth else None
        results = []
        for cfg in configs(args.smoke):
            row = dict(width=name, parts=list(parts), tokens=n, segments=len(lens), config=cfg or "defaults")
            try:
                check = sgmv_expand(t, B, info, base.clone(), offsets if len(parts) > 1 else None, **cfg)
                err = (check.float() - want).abs().max().item()
                tol = 0.05 * want.abs().max().item() if dtype == torch.bfloat16 else 1e-4
                if not err <= tol:
                    raise AssertionError(f"max abs error {err:.3g} over {tol:.3g}")
                out = base.clone()
                row["us"] = round(timed(lambda: sgmv_expand(t, B, info, out, offsets if len(parts) > 1 else None,
                                                            **cfg)), 2)
            except Exception as e:  # a config that does not compile or fails its check is recorded, not timed
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            results.append(row)
        ok = [r for r in results if "us" in r]
        default = next((r for r in ok if r["config"] == "defaults"), None)
        before = next((r for r in ok if r["config"] == BASELINE), None)
        top = min(ok, key=lambda r: r["us"]) if ok else None
        summary = dict(width=name, tokens=n, bytes=nbytes, floor_us=round(floor_us, 2) if floor_us else None,
                       defaults_us=default["us"] if default else None, best_us=top["us"] if top else None,
                       baseline_us=before["us"] if before else None,
                       best=top["config"] if top else None)
        best.append(summary)
        print(f"{name:18} {n} tokens: defaults {summary['defaults_us']} us, best {summary['best_us']} us "
              f"{summary['best']}" + (f", floor {floor_us:.1f} us" if floor_us else ""), flush=True)
    from reference.ops.sgmv_expand import default_tiles
    result = dict(sort_by_slot=args.sort_by_slot, defaults_config={**default_tiles(rank), "num_warps": 4},
                  baseline_config=BASELINE,
                  device=torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
                  torch=torch.__version__, triton=triton.__version__, smoke=args.smoke, rank=rank, slots=slots,
                  adapters=n_adapters, distinct=distinct, tokens=n, segments=len(lens), decodes=decodes,
                  copy_bandwidth_GBps=round(bandwidth, 1) if bandwidth else None,
                  method="sgmv_expand in a CUDA graph, do_bench(warmup=10 ms, rep=40 ms) median, us; bf16; each "
                         "config checked against torch_ref.sgmv_expand first",
                  seconds=round(time.perf_counter() - start, 1), best=best, rows=rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
