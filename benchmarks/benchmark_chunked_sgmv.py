"""Benchmark chunked SGMV segments against per-request segments on a GPU (chapter 04).

    python benchmarks/benchmark_chunked_sgmv.py [--out benchmarks/results/chunked_sgmv_<gpu>.json]

The same tokens and the same kernels (the book's Triton sgmv_shrink + sgmv_expand, hidden 4096,
rank 16, bf16); only the segments change:
- ``per_request``: one segment per request (chapter 02's view), default blocks;
- ``merged``: adjacent requests with the same slot merged (no cut), default blocks;
- ``chunk_C``: merged, then cut into chunks of C tokens, with BLOCK_M = min(C, 128) so one program
  row tile covers one chunk (SGLang's csgmv sizes its programs the same way).
Batches: ``skewed`` (100 requests, 98 on one adapter, 2 on others), ``uniform`` (100 requests,
round-robin over 8 adapters: nothing is adjacent, so nothing merges), ``long_and_short`` (one
4000-token request and 63 requests of 8 tokens, 8 adapters: the grid of per-request segments is
sized by the longest one). Timing as in benchmark_lora_ops.py: CUDA graph replay, do_bench median.
Also reported per layout: segments, programs launched by the shrink (grid size) and how many of
them have rows to work on, and how many times adapter weights are read (one A per busy program).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_lora_ops import DT, copy_bandwidth, graph_time  # noqa: E402
from reference.batch_info import build_batch_info  # noqa: E402
from reference.chunked import cut_into_chunks, merge_adjacent_segments  # noqa: E402
from reference.ops import sgmv_expand, sgmv_shrink  # noqa: E402

HIDDEN, RANK = 4096, 16
CHUNKS = (16, 32, 64, 128, 256)


def batches() -> dict[str, tuple[list[int], list[int], int]]:
    """name -> (request lengths, request slots, adapters); slot 0 is the base model."""
    skew_slots = [1] * 100
    skew_slots[33], skew_slots[77] = 2, 3
    return {
        "skewed_100x32": ([32] * 100, skew_slots, 3),
        "skewed_100x256": ([256] * 100, skew_slots, 3),
        "uniform_100x32": ([32] * 100, [1 + i % 8 for i in range(100)], 8),
        "long_and_short": ([4000] + [8] * 63, [1 + i % 8 for i in range(64)], 8),
    }


def layouts(lens: list[int], slots: list[int]) -> dict[str, tuple[list[int], list[int], int | None]]:
    """layout name -> (segment lengths, segment slots, BLOCK_M or None for the op's default)."""
    merged = merge_adjacent_segments(lens, slots)
    out = {"per_request": (lens, slots, None), "merged": (*merged, None)}
    for c in CHUNKS:
        out[f"chunk_{c}"] = (*cut_into_chunks(*merged, c), min(c, 128))
    return out


def work(seg_lens: list[int], block_m: int) -> dict:
    """Programs the shrink launches (one rank tile at r 16) and how many have rows to do."""
    grid = triton.cdiv(max(seg_lens), block_m) * len(seg_lens)
    busy = sum(triton.cdiv(n, block_m) for n in seg_lens)
    return dict(segments=len(seg_lens), programs=grid, busy_programs=busy, a_reads=busy)


def measure(lens, slots, n_adapters) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(lens)
    A = (torch.randn(n_adapters + 1, RANK, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(DT)
    B = (torch.randn(n_adapters + 1, HIDDEN, RANK, generator=g, device="cuda") * RANK**-0.5).to(DT)
    x = torch.randn(n, HIDDEN, generator=g, device="cuda").to(DT)
    t = torch.zeros(n, RANK, dtype=DT, device="cuda")
    out = torch.zeros(n, HIDDEN, dtype=DT, device="cuda")
    ranks, scalings = [0] + [RANK] * n_adapters, [0.0] + [1.0] * n_adapters
    rows, expected = [], None
    for name, (seg_lens, seg_slots, block_m) in layouts(lens, slots).items():
        info = build_batch_info(seg_lens, seg_slots, ranks, scalings, "cuda")
        kw = {} if block_m is None else {"block_m": block_m}
        out.zero_()
        sgmv_shrink(x, A, info, t, **kw)
        sgmv_expand(t, B, info, out, **kw)
        expected = out.clone() if expected is None else expected
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)  # same result, any layout
        s_us = graph_time(lambda: sgmv_shrink(x, A, info, t, **kw))
        e_us = graph_time(lambda: sgmv_expand(t, B, info, out, **kw))
        bm = block_m or (32 if RANK <= 16 else 64)  # sgmv_shrink's default at this rank
        rows.append(dict(layout=name, block_m=block_m, shrink_us=s_us, expand_us=e_us, total_us=s_us + e_us,
                         **work(seg_lens, bm)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{device}: copy bandwidth {bw:.0f} GB/s")
    print(f"{'batch':16s} {'layout':12s} {'segs':>5s} {'programs':>9s} {'busy':>6s} {'shrink us':>10s} "
          f"{'expand us':>10s} {'total us':>9s}")
    result = dict(device=device, torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
                  copy_bandwidth_gbps=bw, hidden=HIDDEN, rank=RANK, dtype="bfloat16",
                  method="CUDA graph replay, triton.testing.do_bench median", batches={})
    for bname, (lens, slots, n_adapters) in batches().items():
        rows = measure(lens, slots, n_adapters)
        result["batches"][bname] = dict(req_lens=lens, req_slots=slots, adapters=n_adapters, rows=rows)
        for r in rows:
            print(f"{bname:16s} {r['layout']:12s} {r['segments']:5d} {r['programs']:9d} {r['busy_programs']:6d} "
                  f"{r['shrink_us']:10.1f} {r['expand_us']:10.1f} {r['total_us']:9.1f}", flush=True)
    slug = device.lower().replace("nvidia", "").strip().replace(" ", "_")
    out = args.out or ROOT / "benchmarks" / "results" / f"chunked_sgmv_{slug}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
