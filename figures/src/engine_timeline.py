"""Figure: an engine's steps over time: queues, KV blocks and adapter slots (chapter 11).

    python figures/src/engine_timeline.py

Writes figures/engine_timeline.png and a copy into notebooks/11_serving_engine/ (nbgrader releases
only the chapter folder). Deterministic: Agg backend, no timestamps or software tag in the PNG.

The run: ``reference.engine.cluster.SimulatedEngine`` (the real scheduler, block manager and pool
bookkeeping with a fake model) on a Zipf trace of 36 requests over 6 adapters, 3 GPU slots (the
base model's included), 32 KV blocks of 8 positions: small enough that the KV cache fills, some
sequences are preempted, and the slots change owner as adapters come and go.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from reference.engine.cluster import SimulatedEngine, zipf_trace  # noqa: E402
from reference.engine.scheduler import SchedulerConfig  # noqa: E402
from reference.engine.sequence import SamplingParams, Sequence  # noqa: E402
from reference.mem_pool import EMPTY_SLOT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "engine_timeline.png"
COPIES = [ROOT / "notebooks" / "11_serving_engine" / "engine_timeline.png"]
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442"]  # Okabe-Ito
INK, MUTED, BASE = "#222222", "#6B6B6B", "#BBBBBB"


def record() -> list[dict]:
    engine = SimulatedEngine(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_loras_per_batch=3),
                             num_blocks=32, block_size=8, max_loaded=4)
    trace = zipf_trace(36, 6, seed=4, per_step=1, prefix_len=12, tail=(4, 20), new_tokens=(6, 20))
    trace = [t if i % 5 else type(t)(t.arrival, t.prompt, None, t.max_new_tokens) for i, t in enumerate(trace)]
    frames, step, pending = [], 0, list(enumerate(trace))
    while pending or engine.sched.has_unfinished():
        while pending and pending[0][1].arrival <= step:
            idx, req = pending.pop(0)
            engine.sched.add(Sequence(idx, list(req.prompt), req.uid, SamplingParams(max_new_tokens=req.max_new_tokens)))
        mark = len(engine.sched.events)
        engine.step()
        blocks = engine.blocks
        frames.append(dict(kind=engine.last_step[0], waiting=len(engine.sched.waiting),
                           running=len(engine.sched.running),
                           held=sum(1 for r in blocks.ref_count if r > 0),
                           cached=sum(1 for b in blocks.free if blocks.block_key[b] is not None),
                           slots=list(engine.pool.buffer_id_to_uid),
                           preempted=sum(1 for e in engine.sched.events[mark:] if e[0] == "preempt")))
        step += 1
    return frames


def colour(uid) -> str:
    if uid is None:
        return BASE
    return PALETTE[int(str(uid).replace("adapter", "")) % len(PALETTE)]


def draw(frames: list[dict]) -> plt.Figure:
    steps = range(len(frames))
    fig, (ax_q, ax_kv, ax_s) = plt.subplots(3, 1, figsize=(10, 6.4), sharex=True,
                                            gridspec_kw=dict(height_ratios=[1.1, 1.1, 0.9]))
    ax_q.step(steps, [f["running"] for f in frames], where="mid", color=PALETTE[0], label="running")
    ax_q.step(steps, [f["waiting"] for f in frames], where="mid", color=PALETTE[1], label="waiting")
    for i, f in enumerate(frames):
        if f["kind"] == "prefill":
            ax_q.axvspan(i - 0.5, i + 0.5, color="#EEEEEE", lw=0, zorder=0)
        if f["preempted"]:
            ax_q.plot(i, f["running"] + 0.4, "v", color=PALETTE[5], ms=6)
    ax_q.set_ylabel("sequences", color=INK)
    ax_q.legend(loc="upper right", frameon=False, fontsize=8,
                title="shaded: prefill steps; red marks: preemptions", title_fontsize=8)
    total = 32
    held = [f["held"] for f in frames]
    cached = [f["cached"] for f in frames]
    ax_kv.stackplot(steps, held, cached, colors=[PALETTE[0], PALETTE[4]], labels=["held by a sequence",
                    "free, prefix still cached"], alpha=0.85)
    ax_kv.axhline(total, color=MUTED, lw=0.8, ls="--")
    ax_kv.set_ylim(0, total + 3)
    ax_kv.set_ylabel("KV blocks", color=INK)
    ax_kv.legend(loc="lower center", frameon=False, fontsize=8, ncol=2)
    for i, f in enumerate(frames):
        for s, uid in enumerate(f["slots"]):
            if uid is EMPTY_SLOT:
                continue
            ax_s.add_patch(Rectangle((i - 0.5, s - 0.4), 1, 0.8, color=colour(uid), lw=0))
    ax_s.set_ylim(-0.6, len(frames[0]["slots"]) - 0.4)
    ax_s.set_yticks(range(len(frames[0]["slots"])), [f"slot {s}" for s in range(len(frames[0]["slots"]))])
    ax_s.set_xlabel("scheduler step", color=INK)
    ax_s.set_title("GPU adapter slots (grey: the base model; one colour per adapter)", fontsize=9, color=MUTED, loc="left")
    ax_q.set_title("An engine's steps: queues, paged KV blocks and adapter slots", fontsize=11, color=INK, loc="left")
    for ax in (ax_q, ax_kv, ax_s):
        ax.spines[["top", "right"]].set_visible(False)
    ax_s.set_xlim(-0.5, len(frames) - 0.5)
    fig.tight_layout()
    return fig


def main() -> None:
    fig = draw(record())
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=130, metadata={"Software": None})
    for copy in COPIES:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT, copy)
    print(f"wrote {OUT} and {len(COPIES)} cop{'y' if len(COPIES) == 1 else 'ies'}")


if __name__ == "__main__":
    main()
