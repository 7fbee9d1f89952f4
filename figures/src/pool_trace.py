"""Figure for chapter 05: LRU vs FIFO eviction on a seeded Zipf request trace.

The trace and the replay come from ``reference.pool_trace`` (the real pool bookkeeping with tiny
modules): 64 adapters with Zipf(1.1) popularity, 2 arrivals per step on average, 10 % base-model
requests, each request decoding 1-3 steps, seed 0.
Left: hit rate over a sliding window of steps, 12 slots. Middle: cumulative slot evictions, 12 slots.
Right: hit rate over the whole trace against the number of slots (too few slots = thrashing).

    python figures/src/pool_trace.py

writes figures/pool_trace.png and a copy into notebooks/05_memory_pool/ (nbgrader releases only the
chapter's folder). Deterministic: Agg backend, no software tag in the PNG.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from reference.pool_trace import TraceConfig, make_trace, simulate_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "pool_trace.png"
COPIES = [ROOT / "notebooks" / "05_memory_pool" / "pool_trace.png"]

SLOTS = 12
SLOT_SWEEP = [4, 6, 8, 12, 16, 24, 32]
WINDOW = 40  # steps in the sliding hit-rate window
POLICIES = {"lru": ("LRU", "#0072B2", "-"), "fifo": ("FIFO", "#E69F00", "--")}  # Okabe-Ito


def windowed_hit_rate(hits: list, loads: list, window: int) -> np.ndarray:
    """hits / (hits + loads) summed over the last ``window`` steps (fewer at the start)."""
    h, n = np.cumsum(hits, dtype=float), np.cumsum(np.add(hits, loads), dtype=float)
    lagged = lambda c: np.concatenate([np.zeros(window), c[:-window]])  # noqa: E731
    total = n - lagged(n)
    return np.divide(h - lagged(h), total, out=np.zeros_like(total), where=total > 0)


def main() -> None:
    trace = make_trace(TraceConfig())
    runs = {p: simulate_trace(trace, p, SLOTS, max_loaded_loras=2 * SLOTS) for p in POLICIES}
    fig, (left, mid, right) = plt.subplots(1, 3, figsize=(14, 4.2))
    for policy, (label, color, style) in POLICIES.items():
        stats = runs[policy]
        left.plot(windowed_hit_rate(stats.hits, stats.loads, WINDOW), color=color, ls=style,
                  label=f"{label} (overall {stats.hit_rate():.0%})")
        mid.plot(np.cumsum(stats.evictions), color=color, ls=style, label=label)
        sweep = [simulate_trace(trace, policy, s, max_loaded_loras=2 * s).hit_rate() for s in SLOT_SWEEP]
        right.plot(SLOT_SWEEP, sweep, color=color, ls=style, marker="o", label=label)
    left.set(xlabel="step", ylabel=f"hit rate (last {WINDOW} steps)", ylim=(0, 1),
             title=f"Slot hit rate, {SLOTS} slots")
    mid.set(xlabel="step", ylabel="evictions so far", title=f"Cumulative evictions, {SLOTS} slots")
    right.set(xlabel="GPU slots (max_loras_per_batch)", ylabel="hit rate, whole trace", ylim=(0, 1),
              title="Hit rate vs slot count")
    for ax in (left, mid, right):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right" if ax is not mid else "upper left", fontsize=9)
    fig.suptitle("Adapter memory pool on a Zipf(1.1) trace of 64 adapters (seed 0)", fontsize=12)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=130, facecolor="white", metadata={"Software": None})
    plt.close(fig)
    for copy in COPIES:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT, copy)
    print(f"wrote {OUT.relative_to(ROOT)} and {len(COPIES)} chapter copy")


if __name__ == "__main__":
    main()
