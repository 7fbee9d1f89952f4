"""Tune the decode kernels per LoRA rank on a GPU (chapter 08, issue #11).

    python benchmarks/sweep_decode_ranks.py --out benchmarks/results/decode_rank_sweep_<gpu>.json [--budget-s 300]
    TRITON_INTERPRET=1 python benchmarks/sweep_decode_ranks.py --smoke --out /tmp/sweep.json   # any machine

For ranks 16, 32 and 64 and the decode batches of ``benchmark_lora_ops.py`` (hidden 4096 -> 4096,
bf16, request i on adapter 1 + i mod D), times every config of each decode kernel:

- ``fused_decode``, both schedules ("token": one program per token and output split; "slot": one
  program per adapter slot and split, reading the slot's A once for all its tokens);
- ``bgmv_shrink`` and ``bgmv_expand`` (the two-kernel decode path the layers take);
- and, on one prefill batch (4 x 2048 tokens, 4 adapters), ``sgmv_shrink`` / ``sgmv_expand``.

Method: each call captured in a CUDA graph, ``triton.testing.do_bench`` median of the replay; every
config checked against the torch reference first (a config that fails or does not compile is
recorded with its error, not timed). Each (case, rank, op) also times the op's current defaults, so
the table shows what tuning buys. The sweep stops starting new groups after ``--budget-s`` seconds
and records which groups it covered. Prints the best config per group and writes all rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_lora_ops import graph_time, problem  # noqa: E402
from reference.ops import bgmv_expand, bgmv_shrink, fused_decode, sgmv_expand, sgmv_shrink, torch_ref  # noqa: E402

RANKS = (64, 32, 16)
#: (kind, requests, tokens per request, adapters), in the order they are swept
CASES = [("decode", 64, 1, 8), ("decode", 256, 1, 32), ("decode", 16, 1, 8), ("decode", 64, 1, 32),
         ("decode", 256, 1, 8), ("prefill", 4, 2048, 4)]


def configs(op: str, tokens: int) -> list[dict]:
    bt = max(16, min(64, triton.next_power_of_2(tokens)))
    return {
        "fused_decode": [dict(schedule="token", num_splits=s, block_k=bk, block_n=bn, num_warps=w)
                         for s in (1, 2, 4, 8) for bk in (512, 1024, 2048) for bn in (128, 256, 512) for w in (8, 16)]
                        + [dict(schedule="slot", num_splits=s, block_k=bk, block_n=bn, block_t=bt, num_warps=w)
                           for s in (4, 8, 16, 32) for bk in (64, 128) for bn in (64, 128) for w in (4, 8)],
        "bgmv_shrink": [dict(block_k=bk, num_warps=w) for bk in (512, 1024, 2048, 4096) for w in (4, 8, 16)],
        "bgmv_expand": [dict(block_n=bn, num_warps=w) for bn in (64, 128, 256, 512) for w in (2, 4, 8)],
        "sgmv_shrink": [dict(block_m=bm, block_k=bk, num_warps=w) for bm in (32, 64, 128) for bk in (64, 128, 256)
                        for w in (4, 8)],
        "sgmv_expand": [dict(block_m=bm, block_n=bn, num_warps=w) for bm in (32, 64, 128) for bn in (64, 128, 256)
                        for w in (4, 8)],
    }[op]


def graph_us(fn) -> float:
    if not torch.cuda.is_available():  # --smoke on the CPU: no graphs, one timed call
        start = time.perf_counter()
        fn()
        return 1e6 * (time.perf_counter() - start)
    return graph_time(fn, warmup=10, rep=40)


def calls(p: dict, kind: str):
    """op -> (call(cfg, out buffer), reference result) for the case ``p``."""
    x, A, B, t, info, out0 = p["x"], p["A"], p["B"], p["t"], p["info"], p["out"]
    t_ref = (torch_ref.bgmv_shrink if kind == "decode" else torch_ref.sgmv_shrink)(x, A, info, torch.zeros_like(t))
    expanded = (torch_ref.bgmv_expand if kind == "decode" else torch_ref.sgmv_expand)(t_ref, B, info, out0.clone())
    if kind == "prefill":
        return {"sgmv_shrink": (lambda cfg, buf: sgmv_shrink(x, A, info, buf, **cfg), t_ref, t),
                "sgmv_expand": (lambda cfg, buf: sgmv_expand(t_ref, B, info, buf, **cfg), expanded, out0)}
    fused = torch_ref.fused_decode(x, A, B, info, out0.clone())
    return {"fused_decode": (lambda cfg, buf: fused_decode(x, A, B, info, buf, **cfg), fused, out0),
            "bgmv_shrink": (lambda cfg, buf: bgmv_shrink(x, A, info, buf, **cfg), t_ref, t),
            "bgmv_expand": (lambda cfg, buf: bgmv_expand(t_ref, B, info, buf, **cfg), expanded, out0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes, two configs per op (CPU interpreter)")
    args = parser.parse_args()
    start = time.monotonic()
    rows, covered, best = [], [], {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden = 64 if args.smoke else 4096
    cases = [("decode", 4, 1, 2), ("prefill", 2, 8, 2)] if args.smoke else CASES
    for kind, n_req, tokens, D in cases:
        for rank in (16,) if args.smoke else RANKS:
            p = problem(n_req, tokens, D, hidden, hidden, rank, device,
                        torch.float32 if args.smoke else torch.bfloat16)
            for op, (call, expected, template) in calls(p, kind).items():
                if time.monotonic() - start > args.budget_s:
                    break
                group = dict(kind=kind, n_req=n_req, tokens=tokens, adapters=D, rank=rank, op=op)
                candidates = configs(op, n_req * tokens)
                for cfg in [None, *(candidates[:1] + candidates[-1:] if args.smoke else candidates)]:
                    buf = template.clone()
                    try:
                        call(cfg or {}, buf)
                        torch.testing.assert_close(buf.float(), expected.float(), rtol=3e-2, atol=3e-2)
                        us = graph_us(lambda: call(cfg or {}, buf))
                    except Exception as exc:  # an invalid config (resources, compile): recorded
                        rows.append(dict(group, config=cfg, error=str(exc).splitlines()[0][:200]))
                        continue
                    rows.append(dict(group, config=cfg if cfg is not None else "defaults", us=round(us, 2)))
                    key = (kind, n_req * tokens, D, rank, op)
                    if cfg is not None and (key not in best or us < best[key][0]):
                        best[key] = (us, cfg)
                default = next((r["us"] for r in rows if r.get("config") == "defaults" and
                                all(r[k] == group[k] for k in group)), float("nan"))
                us, cfg = best.get((kind, n_req * tokens, D, rank, op), (float("nan"), None))
                covered.append(dict(group, default_us=default, best_us=round(us, 2), best=cfg))
                print(f"{kind:7s} {n_req * tokens:5d} tok D={D:2d} r={rank:2d} {op:13s} defaults {default:7.1f} us"
                      f"  best {us:7.1f} us  {cfg}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", torch=torch.__version__, triton=triton.__version__,
        method="CUDA graph replay, do_bench(warmup=10 ms, rep=40 ms) median, us; bf16, hidden 4096 -> 4096",
        seconds=round(time.monotonic() - start, 1), best=covered, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out} ({len(covered)} groups in {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
