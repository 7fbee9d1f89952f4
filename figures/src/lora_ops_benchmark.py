"""Figure: the book's Triton LoRA ops on the GPU, from the committed benchmark results.

Reads benchmarks/results/lora_ops_*.json (written by benchmarks/benchmark_lora_ops.py on a GPU) and
writes figures/lora_ops_benchmark.png: prefill ops as a fraction of copy bandwidth, decode ops as
microseconds against the base projection's GEMM. Runs on any machine (no GPU needed).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    path = sorted((ROOT / "benchmarks" / "results").glob("lora_ops_*.json"))[-1]
    res = json.loads(path.read_text())
    rows = res["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    pre = [r for r in rows if r["kind"] == "prefill"]
    labels = [f"{r['op']}\nr{r['rank']}" + (f"\nN {r['d_out']}" if r["op"] == "expand" else "\nK 4096") for r in pre]
    ax1.bar(range(len(pre)), [100 * r["frac_copy"] for r in pre], color="#4c72b0")
    ax1.axhline(85, color="#c44e52", ls="--", lw=1)
    ax1.text(len(pre) - 0.5, 86, "target 85%", color="#c44e52", ha="right", va="bottom", fontsize=9)
    ax1.set_xticks(range(len(pre)), labels, fontsize=8)
    ax1.set_ylabel("% of copy bandwidth")
    ax1.set_title(f"prefill: 4 x 2048 tokens, 4 adapters (copy {res['copy_bandwidth_gbps']:.0f} GB/s)")
    dec = [r for r in rows if r["kind"] == "decode"]
    cases = sorted({(r["n_req"], r["adapters"]) for r in dec})
    width = 0.27
    for j, op in enumerate(["shrink", "expand", "fused"]):
        vals = [next(r["us"] for r in dec if (r["n_req"], r["adapters"]) == c and r["op"] == op) for c in cases]
        ax2.bar([i + (j - 1) * width for i in range(len(cases))], vals, width, label=op)
    base = [next(r["base_gemm_us"] for r in dec if (r["n_req"], r["adapters"]) == c) for c in cases]
    ax2.plot(range(len(cases)), base, "k_", ms=18, mew=2, label="base GEMM")
    ax2.set_xticks(range(len(cases)), [f"{n} req\n{d} ad." for n, d in cases], fontsize=8)
    ax2.set_ylabel("microseconds (CUDA graph replay, median)")
    ax2.set_title("decode: hidden 4096 -> 4096, rank 16")
    ax2.legend(fontsize=8)
    title = f"{res['device']}, torch {res['torch']}, triton {res['triton']}"
    if res.get("note"):
        title += "\n(copy bandwidth measured with a uint8 copy, below the memory's speed: % of copy reads high; see the JSON's note)"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out = ROOT / "figures" / "lora_ops_benchmark.png"
    fig.savefig(out, dpi=120)
    shutil.copy(out, ROOT / "notebooks" / "03_triton_sgmv" / out.name)  # nbgrader ships only the chapter folder
    print(f"wrote {out} and its copy in notebooks/03_triton_sgmv/")


if __name__ == "__main__":
    main()
