"""Figure for chapter 08: a StaticLoRABatch's buffers before and after an in-place update.

Real data from ``reference.cuda_graph.StaticLoRABatch`` (4 slots, max_seqs 8, one token per
sequence; the base model in slot 2, so padding points at slot 2, not 0):
- step A: 5 sequences in the bucket of 8, slots [0, 1, 0, 3, 2], ownership changed (the tables are
  copied);
- step B: 3 sequences in the bucket of 4, slots [3, 3, 1], ownership unchanged (other tables are
  passed and must not be copied).
Rows: token_slots (every token of the buffer; cells past the bucket hatched), seg_lens and
seg_indptr (the slot-sorted view of the padded bucket), lora_ranks; the title of each panel gives
every buffer's data_ptr check (the same addresses after the update).

    python figures/src/static_batch.py

writes figures/static_batch.png and a copy into notebooks/08_cuda_graphs/ (nbgrader releases only the
chapter's folder). Deterministic: Agg backend, no software tag in the PNG.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

import reference  # noqa: E402,F401  (device choice)
from reference.cuda_graph import StaticLoRABatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "static_batch.png"
COPIES = [ROOT / "notebooks" / "08_cuda_graphs" / "static_batch.png"]

NUM_SLOTS, MAX_SEQS, PAD = 4, 8, 2
RANKS_A, SCAL_A = [8, 4, 0, 16], [2.0, 1.0, 0.0, 0.5]
RANKS_B, SCAL_B = [1, 1, 0, 1], [9.0, 9.0, 0.0, 9.0]  # passed with the flag off: never copied
STEPS = [("A", [0, 1, 0, 3, 2], 8, RANKS_A, SCAL_A, True), ("B", [3, 3, 1], 4, RANKS_B, SCAL_B, False)]
SLOT_COLORS = ["#0072B2", "#E69F00", "#BBBBBB", "#009E73"]  # Okabe-Ito; slot 2 (base, rank 0) grey
ROWS = ("token_slots", "seg_lens", "seg_indptr", "lora_ranks")


def snapshots() -> list[tuple[str, dict, int, bool]]:
    """(title, buffer values, bucket, addresses unchanged) after each step."""
    static = StaticLoRABatch(NUM_SLOTS, MAX_SEQS)
    ptrs = static.data_ptrs()
    out = []
    for name, slots, bucket, ranks, scal, changed in STEPS:
        static.update(slots, bucket, PAD, ranks, scal, ownership_changed=changed)
        values = {k: static.buffers[k].tolist() for k in ROWS}
        title = (f"step {name}: seq_slots {slots}, bucket {bucket}, pad slot {PAD}, ownership_changed={changed}")
        out.append((title, values, bucket, static.data_ptrs() == ptrs))
    return out


def draw(ax, title: str, values: dict, bucket: int, same_ptrs: bool) -> None:
    for row, name in enumerate(ROWS):
        y = len(ROWS) - 1 - row
        for i, v in enumerate(values[name]):
            slot_row = name == "token_slots"
            color = SLOT_COLORS[v] if slot_row else ("#F0F0F0" if name != "lora_ranks" else SLOT_COLORS[i])
            hatch = "//" if slot_row and i >= bucket else None
            ax.add_patch(Rectangle((i, y), 0.95, 0.8, facecolor=color, edgecolor="black", lw=0.6, hatch=hatch,
                                   alpha=0.85 if name == "lora_ranks" else 1.0))
            ax.text(i + 0.47, y + 0.4, str(v), ha="center", va="center", fontsize=9)
        ax.text(-0.3, y + 0.4, name, ha="right", va="center", fontsize=10, family="monospace")
    ax.set_xlim(-3.2, MAX_SEQS + 0.2)
    ax.set_ylim(-0.3, len(ROWS))
    ax.axis("off")
    ax.set_title(title + f"\nevery data_ptr as allocated: {same_ptrs}", fontsize=10)


def main() -> None:
    fig, axes = plt.subplots(1, 2, figsize=(14, 3.4))
    for ax, snap in zip(axes, snapshots()):
        draw(ax, *snap)
    fig.text(0.5, 0.01, "token_slots colored by slot (grey: slot 2, the base model, rank 0); hatched: past the "
             "bucket, held at the pad slot. lora_ranks keeps step A's values in step B (flag off).",
             ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=110, metadata={"Software": None})
    for copy in COPIES:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT, copy)
    print(f"wrote {OUT.relative_to(ROOT)} and {len(COPIES)} copy")


if __name__ == "__main__":
    main()
