"""Figure: the serving engine's throughput and per-token latency against the number of adapters,
beside the base model and HF PEFT's mixed batches (chapter 11, section 8; S-LoRA's and Punica's figure).

    python figures/src/engine_throughput.py

Reads benchmarks/results/engine_h200.json (``benchmarks/benchmark_engine.py`` on an H200: the device,
versions, model and workload are in the file and in the title). Writes figures/engine_throughput.png
and a copy into notebooks/11_serving_engine/ (nbgrader releases only the chapter folder).
Deterministic: Agg backend, no timestamps or software tag in the PNG.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "engine_h200.json"
OUT = ROOT / "figures" / "engine_throughput.png"
COPIES = [ROOT / "notebooks" / "11_serving_engine" / "engine_throughput.png"]
ENGINE, BASE, PEFT, MUTED = "#0072B2", "#6B6B6B", "#D55E00", "#6B6B6B"  # Okabe-Ito


def main() -> None:
    bench = json.loads(RESULTS.read_text())
    engine = sorted((r for r in bench["rows"] if r["system"] == "engine" and r["adapters"] > 0),
                    key=lambda r: r["adapters"])
    base = next(r for r in bench["rows"] if r["system"] == "engine" and r["adapters"] == 0)
    peft = sorted((r for r in bench["rows"] if r["system"] == "peft"), key=lambda r: r["adapters"])
    slots = bench["engine_config"]["max_loras_per_batch"]
    xs = [r["adapters"] for r in engine]

    fig, (ax, lat) = plt.subplots(1, 2, figsize=(10.5, 3.9))
    ax.plot(xs, [r["tokens_per_s"] for r in engine], "o-", color=ENGINE, label="the book's engine")
    ax.axhline(base["tokens_per_s"], color=BASE, ls="--", lw=1.2, label="base model alone (same engine)")
    if peft:
        ax.plot([r["adapters"] for r in peft], [r["tokens_per_s"] for r in peft], "s-", color=PEFT,
                label=f"HF PEFT mixed batches (batch {peft[0]['batch']})")
    ax.axvline(slots, color=MUTED, ls=":", lw=1)
    ax.text(slots * 1.08, base["tokens_per_s"] * 0.12,
            f"{slots} GPU slots", color=MUTED, fontsize=8)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("adapters D in the trace's popularity (Zipf 1.0)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="lower left")

    lat.plot(xs, [r["tpot_ms_p50"] for r in engine], "o-", color=ENGINE, label="TPOT P50")
    lat.plot(xs, [r["tpot_ms_p99"] for r in engine], "o--", color=ENGINE, alpha=0.6, label="TPOT P99")
    lat.axhline(base["tpot_ms_p50"], color=BASE, ls="--", lw=1.2, label="base TPOT P50")
    lat.axvline(slots, color=MUTED, ls=":", lw=1)
    lat.set_xscale("log", base=2)
    lat.set_ylim(0, max(r["tpot_ms_p99"] for r in engine) * 1.2)
    lat.set_xlabel("adapters D")
    lat.set_ylabel("ms between a request's tokens")
    lat.set_title("time per output token (the engine)", fontsize=10)
    lat.legend(fontsize=8, frameon=False, loc="lower left")
    fig.suptitle(f"{bench['device']}, {bench['layers']} Llama-3-8B-shaped layers (bf16), {bench['requests']} requests, "
                 f"prompts {bench['prompt_lens'][0]}-{bench['prompt_lens'][1]}, {bench['new_tokens']} new tokens, "
                 f"rank {bench['rank']}", fontsize=9)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=130, metadata={"Software": None})
    for copy in COPIES:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT, copy)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
