"""Figure: chunked SGMV against per-request segments on the GPU, from the committed results.

Reads benchmarks/results/chunked_sgmv_*.json (written by benchmarks/benchmark_chunked_sgmv.py on a
GPU) and writes figures/chunked_sgmv.png plus the copy chapter 04 shows. Runs on any machine.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHAPTER = ROOT / "notebooks" / "04_packed_and_chunked"


def main() -> None:
    path = sorted((ROOT / "benchmarks" / "results").glob("chunked_sgmv_*.json"))[-1]
    res = json.loads(path.read_text())
    names = list(res["batches"])
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 4.2), sharey=False)
    for ax, name in zip(axes, names):
        rows = res["batches"][name]["rows"]
        labels = [r["layout"].replace("per_request", "per req.").replace("chunk_", "c") for r in rows]
        colors = ["#c44e52" if r["layout"] == "per_request" else "#8172b2" if r["layout"] == "merged" else "#4c72b0"
                  for r in rows]
        ax.bar(range(len(rows)), [r["total_us"] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), labels, rotation=45, fontsize=8)
        ax.set_title(name.replace("_", " "), fontsize=10)
    axes[0].set_ylabel("shrink + expand, us (median, graph replay)")
    fig.suptitle(f"Segment layouts on {res['device']} (hidden {res['hidden']}, rank {res['rank']}, {res['dtype']})")
    fig.tight_layout()
    out = ROOT / "figures" / "chunked_sgmv.png"
    fig.savefig(out, dpi=110)
    CHAPTER.mkdir(parents=True, exist_ok=True)
    shutil.copy(out, CHAPTER / out.name)
    print(f"wrote {out} and {CHAPTER / out.name}")


if __name__ == "__main__":
    main()
