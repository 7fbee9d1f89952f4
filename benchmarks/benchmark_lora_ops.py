"""Benchmark the book's LoRA ops on a GPU (chapters 03-04).

    python benchmarks/benchmark_lora_ops.py [--sweep] [--out benchmarks/results/lora_ops_<gpu>.json]

Method: every op is captured in a CUDA graph and timed as
``triton.testing.do_bench(lambda: graph.replay(), return_mode="median")`` (do_bench clears the L2
before every run); the torch references cannot be captured (host loops) and are timed the same way
without a graph, marked so. A 1 GiB device-to-device copy in the same run gives the copy bandwidth
(2 x bytes / time); each case reports its bytes, achieved GB/s, the fraction of copy bandwidth and
the LoRA time as a fraction of the base projection's own bf16 GEMM (also graph-timed).

Bytes: shrink = x read + A of each distinct adapter read + t written; expand = t read + B of each
distinct adapter read + the base output read and written; fused = the shrink's reads + the expand's.
Cases: bf16, one adapter per request, request i uses adapter 1 + (i mod D), slot 0 holds the base
model (rank 0), the pool holds the adapters used plus that slot.
"""
from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from reference.batch_info import batch_info_from_requests, build_batch_info
from reference.ops import bgmv_expand, bgmv_shrink, fused_decode, sgmv_expand, sgmv_shrink, torch_ref

ROOT = Path(__file__).resolve().parents[1]
DT = torch.bfloat16
EL = 2  # bytes per bf16 element


def graph_time(fn, warmup: float = 25, rep: float = 100) -> float:
    """Median microseconds of one replay of ``fn`` captured in a CUDA graph (``warmup`` / ``rep``:
    do_bench's milliseconds)."""
    fn()  # compile and warm up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1e3 * do_bench(lambda: graph.replay(), warmup=warmup, rep=rep, return_mode="median")


def eager_time(fn) -> float:
    return 1e3 * do_bench(fn, return_mode="median")


def copy_bandwidths() -> dict[str, float]:
    """GB/s (2 x bytes / time) of a 1 GiB device-to-device copy, three ways.

    A captured ``copy_`` becomes a graph memcpy node, which on the H200 measured well below the
    memory system's speed (about 2.7 TB/s); an eager ``copy_`` and an elementwise kernel writing a
    copy show what a kernel can reach. The benchmark's ceiling is the fastest of the three.
    """
    src = torch.empty(2**27, dtype=torch.int64, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    times = {"graph_copy": graph_time(lambda: dst.copy_(src)), "eager_copy": eager_time(lambda: dst.copy_(src)),
             "graph_elementwise": graph_time(lambda: torch.bitwise_or(src, 0, out=dst))}
    return {k: nbytes / (us * 1e-6) / 1e9 for k, us in times.items()}


def copy_bandwidth() -> float:
    """The copy bandwidth the benchmarks compare with: the fastest way of copying, GB/s."""
    return max(copy_bandwidths().values())


def problem(n_req: int, tokens: int, n_adapters: int, d_in: int, d_out: int, rank: int, device: str = "cuda", dtype: torch.dtype = DT):
    g = torch.Generator(device=device).manual_seed(0)
    slots = n_adapters + 1
    A = (torch.randn(slots, rank, d_in, generator=g, device=device) * d_in**-0.5).to(dtype)
    B = (torch.randn(slots, d_out, rank, generator=g, device=device) * rank**-0.5).to(dtype)
    ranks = [0] + [rank] * n_adapters
    info = build_batch_info([tokens] * n_req, [1 + i % n_adapters for i in range(n_req)], ranks,
                            [0.0] + [1.0] * n_adapters, device)
    n = n_req * tokens
    uids = [1 + i % n_adapters for i in range(n_req)]
    info_sorted = batch_info_from_requests(uids, [tokens] * n_req, {u: u for u in range(slots)}, ranks,
                                           [0.0] + [1.0] * n_adapters, device, sort_by_slot=True)
    x = torch.randn(n, d_in, generator=g, device=device).to(dtype)
    return dict(A=A, B=B, info=info, info_sorted=info_sorted, x=x, t=torch.zeros(n, rank, dtype=dtype, device=device),
                out=torch.randn(n, d_out, generator=g, device=device).to(dtype), n=n, D=min(n_adapters, n_req),
                d_in=d_in, d_out=d_out, rank=rank)


def nbytes(p, op: str) -> int:
    n, D, r = p["n"], p["D"], p["rank"]
    shrink = EL * (n * p["d_in"] + D * r * p["d_in"] + n * r)
    expand = EL * (n * r + D * p["d_out"] * r + 2 * n * p["d_out"])
    fused = EL * (n * p["d_in"] + D * r * p["d_in"] + D * p["d_out"] * r + 2 * n * p["d_out"])
    return {"shrink": shrink, "expand": expand, "fused": fused}[op]


def ops_for(p, kind: str, cfg: dict):
    A, B, info, x, t, out = p["A"], p["B"], p["info"], p["x"], p["t"], p["out"]
    cfg = {op: cfg.get(config_key(op, p["rank"]), cfg.get(op, {})) for op in SWEEP}
    if kind == "decode":
        # every decode path a layer could take: BGMV (what the layers choose for one-token segments),
        # the fused kernel, SGMV over per-request one-token segments (the layers' path before
        # chapter 08) and SGMV over slot-sorted segments (the CUDA-graph view with tokens_per_seq > 1)
        srt = p["info_sorted"]
        return {
            "shrink": lambda: bgmv_shrink(x, A, info, t, **cfg.get("bgmv_shrink", {})),
            "expand": lambda: bgmv_expand(t, B, info, out, **cfg.get("bgmv_expand", {})),
            "fused": lambda: fused_decode(x, A, B, info, out, **cfg.get("fused_decode", {})),
            "sgmv_per_request:shrink": lambda: sgmv_shrink(x, A, info, t, **cfg.get("sgmv_shrink", {})),
            "sgmv_per_request:expand": lambda: sgmv_expand(t, B, info, out, **cfg.get("sgmv_expand", {})),
            "sgmv_slot_sorted:shrink": lambda: sgmv_shrink(x, A, srt, t, **cfg.get("sgmv_shrink", {})),
            "sgmv_slot_sorted:expand": lambda: sgmv_expand(t, B, srt, out, **cfg.get("sgmv_expand", {})),
        }
    return {
        "shrink": lambda: sgmv_shrink(x, A, info, t, **cfg.get("sgmv_shrink", {})),
        "expand": lambda: sgmv_expand(t, B, info, out, **cfg.get("sgmv_expand", {})),
    }


CASES = (
    [("decode", n, 1, D, 4096, 4096, 16) for n in (16, 64, 256) for D in (1, 8, 32) if not (n == 16 and D == 32)]
    + [("decode", n, 1, D, 4096, 4096, 64) for n, D in ((16, 8), (64, 8), (256, 32))]
    + [("prefill", 4, 2048, 4, 4096, 4096, 16), ("prefill", 4, 2048, 4, 4096, 4096, 64),
       ("prefill", 4, 2048, 4, 4096, 14336, 16), ("prefill", 4, 2048, 4, 4096, 14336, 64)]
)

SWEEP = {
    "sgmv_shrink": [dict(block_m=bm, block_k=bk, num_warps=w) for bm in (32, 64, 128) for bk in (64, 128, 256)
                    for w in (4, 8)],
    "sgmv_expand": [dict(block_m=bm, block_n=bn, num_warps=w) for bm in (32, 64, 128) for bn in (64, 128, 256)
                    for w in (4, 8)],
    "bgmv_shrink": [dict(block_k=bk, num_warps=w) for bk in (512, 1024, 2048, 4096) for w in (4, 8, 16)],
    "bgmv_expand": [dict(block_n=bn, num_warps=w) for bn in (128, 256, 512, 1024) for w in (2, 4, 8)],
    "fused_decode": [dict(schedule="token", num_splits=s, block_k=bk, block_n=bn, num_warps=w) for s in (1, 2, 4, 8)
                     for bk in (1024, 2048, 4096) for bn in (256, 512) for w in (8, 16)]
                    + [dict(schedule="slot", num_splits=s, block_k=bk, block_n=bn, block_t=64, num_warps=w)
                       for s in (8, 16, 32) for bk in (64, 128) for bn in (64, 128) for w in (4, 8)],
}
CONFIG_PATH = ROOT / "benchmarks" / "results" / "tuned_configs.json"


def sweep() -> dict:
    """Bounded sweep on the two cases the targets name; returns the best config per op."""
    best = {}
    tune_cases = [("sgmv_shrink", ("prefill", 4, 2048, 4, 4096, 4096, 16)),
                  ("sgmv_shrink", ("prefill", 4, 2048, 4, 4096, 4096, 64)),
                  ("sgmv_expand", ("prefill", 4, 2048, 4, 4096, 4096, 16)),
                  ("sgmv_expand", ("prefill", 4, 2048, 4, 4096, 4096, 64)),
                  ("bgmv_shrink", ("decode", 64, 1, 8, 4096, 4096, 16)),
                  ("bgmv_expand", ("decode", 64, 1, 8, 4096, 4096, 16))]
    # fused_decode is not tuned here: its defaults follow the batch size (benchmarks/sweep_fused_decode.py)
    for op, (kind, *shape) in tune_cases:
        p = problem(*shape)
        name = {"sgmv_shrink": "shrink", "sgmv_expand": "expand", "bgmv_shrink": "shrink",
                "bgmv_expand": "expand", "fused_decode": "fused"}[op]
        key = config_key(op, shape[-1])
        times = []
        for cfg in SWEEP[op]:
            try:
                times.append((graph_time(ops_for(p, kind, {key: cfg})[name]), cfg))
            except Exception as exc:  # e.g. out of registers or shared memory: not a candidate
                print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
        us, cfg = min(times, key=lambda tc: tc[0])
        best[key] = cfg
        print(f"sweep {key:17s}: best {cfg} {us:.1f} us (of {len(times)} configs)", flush=True)
    return best


def config_key(op: str, rank: int) -> str:
    """Tuned configs are kept per op and rank (rank 16 is the default entry)."""
    return op if rank <= 16 else f"{op}@r{rank}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sweep", action="store_true", help="re-tune and write benchmarks/results/tuned_configs.json")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    cfg = sweep() if args.sweep else (json.loads(CONFIG_PATH.read_text()) if CONFIG_PATH.exists() else {})
    if args.sweep:
        CONFIG_PATH.parent.mkdir(parents=True, exist_ok=True)
        CONFIG_PATH.write_text(json.dumps(cfg, indent=1) + "\n")
    copies = copy_bandwidths()
    bw = max(copies.values())
    print(f"{device}: copy bandwidth {bw:.0f} GB/s (1 GiB device-to-device, fastest of "
          + ", ".join(f"{k} {v:.0f}" for k, v in copies.items()) + ")")
    rows = []
    header = f"{'case':40s} {'op':24s} {'us':>8s} {'MB':>8s} {'GB/s':>7s} {'%copy':>6s} {'%base':>6s} {'torch us':>9s}"
    print(header)  # op "path:shrink" = that decode path's shrink; plain ops: BGMV / SGMV as the kind says
    for kind, n_req, tokens, D, d_in, d_out, rank in CASES:
        p = problem(n_req, tokens, D, d_in, d_out, rank)
        w = torch.randn(d_out, d_in, device="cuda").to(DT)
        base_us = graph_time(lambda: torch.matmul(p["x"], w.T))
        case = f"{kind} {n_req}x{tokens} D={D} r={rank} {d_in}->{d_out}"
        ref = {"shrink": lambda: torch_ref.bgmv_shrink(p["x"], p["A"], p["info"], p["t"]) if kind == "decode"
               else torch_ref.sgmv_shrink(p["x"], p["A"], p["info"], p["t"]),
               "expand": lambda: torch_ref.bgmv_expand(p["t"], p["B"], p["info"], p["out"]) if kind == "decode"
               else torch_ref.sgmv_expand(p["t"], p["B"], p["info"], p["out"]),
               "fused": lambda: torch_ref.fused_decode(p["x"], p["A"], p["B"], p["info"], p["out"])}
        for op, fn in ops_for(p, kind, cfg).items():
            us = graph_time(fn)
            b = nbytes(p, op.split(":")[-1])
            torch_us = eager_time(ref[op]) if op in ref else float("nan")
            row = dict(case=case, kind=kind, n_req=n_req, tokens=tokens, adapters=D, d_in=d_in, d_out=d_out,
                       rank=rank, op=op, us=us, bytes=b, gbps=b / (us * 1e-6) / 1e9, frac_copy=b / (us * 1e-6) / 1e9 / bw,
                       base_gemm_us=base_us, frac_base=us / base_us, torch_ref_us_eager=torch_us)
            rows.append(row)
            print(f"{case:40s} {op:24s} {us:8.1f} {b / 1e6:8.2f} {row['gbps']:7.0f} {100 * row['frac_copy']:5.0f}% "
                  f"{100 * row['frac_base']:5.0f}% {torch_us:9.1f}", flush=True)
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  copy_bandwidth_gbps=bw, copy_bandwidths_gbps=copies, method="CUDA graph replay, triton.testing.do_bench median; torch_ref eager",
                  configs=cfg, rows=rows)
    slug = device.lower().replace("nvidia", "").strip().replace(" ", "_")
    out = args.out or ROOT / "benchmarks" / "results" / f"lora_ops_{slug}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
