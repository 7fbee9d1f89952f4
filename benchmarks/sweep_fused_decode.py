"""Sweep the fused decode kernel's two schedules per batch shape (H200 notes for chapter 03).

    python benchmarks/sweep_fused_decode.py --out benchmarks/results/fused_decode_sweep_<gpu>.json

For each decode case of benchmark_lora_ops.py (hidden 4096, rank 16, bf16), times every config of
the "token" and "slot" schedules (CUDA graph replay, do_bench median) and prints the best of each.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_lora_ops import graph_time, problem  # noqa: E402
from reference.ops import fused_decode, torch_ref  # noqa: E402

CASES = [(16, 8), (64, 8), (64, 32), (256, 8), (256, 32)]
TOKEN = [dict(schedule="token", num_splits=s, block_k=bk, block_n=bn, num_warps=w)
         for s in (1, 2, 4, 8) for bk in (1024, 2048) for bn in (256, 512) for w in (8, 16)]
SLOT = [dict(schedule="slot", num_splits=s, block_k=bk, block_n=bn, block_t=bt, num_warps=w)
        for s in (8, 16, 32) for bk in (64, 128) for bn in (64, 128) for bt in (16, 64) for w in (4, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for n, d in CASES:
        p = problem(n, 1, d, 4096, 4096, 16)
        expected = torch_ref.fused_decode(p["x"], p["A"], p["B"], p["info"], p["out"].clone())
        best = {}
        for cfg in TOKEN + SLOT:
            out = p["out"].clone()
            try:
                fused_decode(p["x"], p["A"], p["B"], p["info"], out, **cfg)
                torch.testing.assert_close(out.float(), expected.float(), rtol=3e-2, atol=3e-2)
                us = graph_time(lambda: fused_decode(p["x"], p["A"], p["B"], p["info"], out, **cfg))
            except Exception as exc:  # an invalid config (resources): recorded, not fatal
                rows.append(dict(n_req=n, adapters=d, config=cfg, error=str(exc).splitlines()[0][:200]))
                continue
            rows.append(dict(n_req=n, adapters=d, config=cfg, us=us))
            s = cfg["schedule"]
            if s not in best or us < best[s][0]:
                best[s] = (us, cfg)
        for s, (us, cfg) in best.items():
            print(f"{n:4d} req {d:3d} adapters  best {s:5s} {us:6.1f} us  {cfg}", flush=True)
    args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                        triton=triton.__version__, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
