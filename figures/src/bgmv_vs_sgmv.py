"""Figure: BGMV (per-token gather) vs SGMV (one GEMM per segment) on chapter 02's running example.

    python figures/src/bgmv_vs_sgmv.py

Writes figures/bgmv_vs_sgmv.png and a copy into notebooks/02_batching_adapters/ (nbgrader releases
only the chapter folder). Deterministic: Agg backend, no timestamps or software tag in the PNG.

Running example (reference/batch_info.py): three requests of 3, 10 and 5 tokens using slots 2, 0, 1;
seg_lens [3, 10, 5] -> seg_indptr [0, 3, 13, 18]. Slots: 0 = base model (rank 0), 1 = an adapter of
rank 4, 2 = an adapter of rank 8, 3 = empty (rank 0); max_rank 8.
"""
from __future__ import annotations

import shutil
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "bgmv_vs_sgmv.png"
COPIES = [ROOT / "notebooks" / "02_batching_adapters" / "bgmv_vs_sgmv.png"]

SEG_LENS = [3, 10, 5]
WEIGHT_INDICES = [2, 0, 1]
LORA_RANKS = [0, 4, 8, 0]
SLOT_NAMES = ["base model", "adapter", "adapter", "empty"]
MAX_RANK = 8
SEG_INDPTR = [0, *accumulate(SEG_LENS)]  # [0, 3, 13, 18]
TOKEN_SLOTS = [s for n, s in zip(SEG_LENS, WEIGHT_INDICES) for _ in range(n)]

# Okabe-Ito colours (colour-blind safe); rank-0 slots are grey.
FILL = {0: "#D9D9D9", 1: "#56B4E9", 2: "#E69F00", 3: "#FFFFFF"}
EDGE = {0: "#8C8C8C", 1: "#0072B2", 2: "#B07800", 3: "#8C8C8C"}
INK = "#222222"
MUTED = "#6B6B6B"
PAD_HATCH = "////"

TOK_W, TOK_GAP = 0.78, 0.12
TOK_X0 = 0.6


def tok_x(i: int) -> float:
    """Left edge of token i's box."""
    return TOK_X0 + i * (TOK_W + TOK_GAP)


def weight_block(ax, x, y, w, h, slot, label_rank=True, fontsize=8):
    """A [max_rank, in] block of one slot: rows below the slot's rank filled, padding hatched."""
    r = LORA_RANKS[slot]
    row_h = h / MAX_RANK
    # rows are drawn top-down: row 0 at the top
    if r:
        ax.add_patch(Rectangle((x, y + h - r * row_h), w, r * row_h, facecolor=FILL[slot],
                               edgecolor=EDGE[slot], lw=0.8))
    if r < MAX_RANK:
        ax.add_patch(Rectangle((x, y), w, h - r * row_h, facecolor="white", edgecolor="#A0A0A0",
                               hatch=PAD_HATCH, lw=0.6))
    ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor=EDGE[slot], lw=1.0))
    if label_rank:
        ax.text(x + w / 2, y + h + 0.08, f"r={r}", ha="center", va="bottom", fontsize=fontsize, color=MUTED)


def token_row(ax, y, title):
    for i, s in enumerate(TOKEN_SLOTS):
        ax.add_patch(FancyBboxPatch((tok_x(i), y), TOK_W, TOK_W, boxstyle="round,pad=0,rounding_size=0.08",
                                    facecolor=FILL[s], edgecolor=EDGE[s], lw=1.0))
        ax.text(tok_x(i) + TOK_W / 2, y + TOK_W / 2, str(i), ha="center", va="center", fontsize=8, color=INK)
    ax.text(TOK_X0 - 0.15, y + TOK_W / 2, title, ha="right", va="center", fontsize=9, color=INK)


def arrow(ax, start, end, color, rad=0.0, lw=1.0, alpha=1.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=9, color=color, lw=lw,
                                 alpha=alpha, connectionstyle=f"arc3,rad={rad}", shrinkA=2, shrinkB=2))


def slot_stack(ax, x, y_top):
    """The slot-stacked A weights, one block per slot, top to bottom; returns each block's anchor."""
    w, h, gap = 2.1, 1.55, 0.55
    ax.text(x + w / 2, y_top + 0.75, "slots: A_stack", ha="center", va="bottom", fontsize=11,
            color=INK, weight="bold")
    ax.text(x + w / 2, y_top + 0.3, "[num_slots, max_rank, in]", ha="center", va="bottom", fontsize=8.5,
            color=MUTED, family="monospace")
    anchors = {}
    for s in range(len(LORA_RANKS)):
        y = y_top - (s + 1) * h - s * gap
        weight_block(ax, x, y, w, h, s, label_rank=False)
        name = SLOT_NAMES[s]
        ax.text(x + w + 0.15, y + h * 0.62, f"slot {s}", ha="left", va="center", fontsize=9.5, color=INK,
                weight="bold")
        ax.text(x + w + 0.15, y + h * 0.28, f"{name}, rank {LORA_RANKS[s]}", ha="left", va="center",
                fontsize=8.5, color=MUTED)
        anchors[s] = (x, y + h / 2)
    ax.add_patch(Rectangle((x, y_top - len(LORA_RANKS) * (h + gap) - 0.55), 0.45, 0.3, facecolor="white",
                           edgecolor="#A0A0A0", hatch=PAD_HATCH, lw=0.6))
    ax.text(x + 0.6, y_top - len(LORA_RANKS) * (h + gap) - 0.4, "padding past the rank:\nnever read",
            ha="left", va="center", fontsize=8.5, color=MUTED)
    ax.text(x, y_top - len(LORA_RANKS) * (h + gap) - 1.05, "shrink shown; expand reads\nB_stack [num_slots, out, max_rank]\nthe same way",
            ha="left", va="top", fontsize=8.5, color=MUTED)
    return anchors


def main() -> None:
    fig, ax = plt.subplots(figsize=(13.5, 8.2), dpi=150)
    ax.set_xlim(-2.4, 24.3)
    ax.set_ylim(-0.2, 15.4)
    ax.set_aspect("equal")
    ax.axis("off")

    anchors = slot_stack(ax, 19.2, 13.6)

    # ---------------- BGMV -------------------------------------------------------------------
    y_tok = 13.2
    ax.text(-2.3, 14.75, "BGMV: every token gathers its own slot's weights", fontsize=12.5, weight="bold",
            color=INK, ha="left")
    ax.text(-2.3, 14.3, "one program per token; reads token_slots only (the decode case: one token per request)",
            fontsize=9, color=MUTED, ha="left")
    token_row(ax, y_tok, "x rows")
    y_ts = y_tok - 0.45
    ax.text(TOK_X0 - 0.15, y_ts, "token_slots", ha="right", va="center", fontsize=9, color=INK,
            family="monospace")
    for i, s in enumerate(TOKEN_SLOTS):
        ax.text(tok_x(i) + TOK_W / 2, y_ts, str(s), ha="center", va="center", fontsize=9, color=EDGE[s],
                family="monospace", weight="bold")
    y_g, h_g = 9.75, 1.9
    for i, s in enumerate(TOKEN_SLOTS):
        weight_block(ax, tok_x(i) + 0.04, y_g, TOK_W - 0.08, h_g, s, label_rank=False)
        arrow(ax, (tok_x(i) + TOK_W / 2, y_ts - 0.22), (tok_x(i) + TOK_W / 2, y_g + h_g + 0.02), EDGE[s], lw=0.8)
    ax.text(TOK_X0 - 0.15, y_g + h_g / 2 + 0.2, "A_stack[", ha="right", va="center", fontsize=9,
            family="monospace", color=INK)
    ax.text(TOK_X0 - 0.15, y_g + h_g / 2 - 0.2, "token_slots]", ha="right", va="center", fontsize=9,
            family="monospace", color=INK)
    ax.text(tok_x(9), y_g - 0.4, "18 gathered copies, one per token; rank-0 tokens (grey) add exactly nothing",
            ha="center", va="center", fontsize=9, color=MUTED)
    stack_left = anchors[0][0]
    arrow(ax, (stack_left - 0.1, anchors[1][1] - 0.3), (tok_x(17) + TOK_W + 0.15, y_g + h_g / 2), MUTED,
          rad=0.0, lw=1.4)
    ax.text((stack_left + tok_x(17) + TOK_W) / 2, y_g + h_g / 2 + 0.55, "gather\nby token", ha="center",
            va="center", fontsize=8.5, color=MUTED)

    # separator
    ax.plot([-2.3, 18.3], [8.05, 8.05], color="#CCCCCC", lw=1.0)

    # ---------------- SGMV -------------------------------------------------------------------
    ax.text(-2.3, 7.35, "SGMV: one small GEMM per segment of tokens that share a slot", fontsize=12.5,
            weight="bold", color=INK, ha="left")
    ax.text(-2.3, 6.9, "one program (tile) per segment; reads seg_indptr and weight_indices (the prefill case)",
            fontsize=9, color=MUTED, ha="left")
    y_tok2 = 5.6
    token_row(ax, y_tok2, "x rows")
    # segment boundaries: seg_indptr ticks
    y_br = y_tok2 - 0.2
    for k, p in enumerate(SEG_INDPTR):
        xb = tok_x(p) - TOK_GAP / 2 if p < len(TOKEN_SLOTS) else tok_x(p - 1) + TOK_W + TOK_GAP / 2
        ax.plot([xb, xb], [y_br - 0.35, y_tok2 + TOK_W + 0.15], color=INK, lw=1.2)
        ax.text(xb, y_br - 0.55, str(p), ha="center", va="top", fontsize=9, color=INK, family="monospace",
                weight="bold")
    ax.text(TOK_X0 - 0.4, y_br - 0.7, "seg_indptr", ha="right", va="center", fontsize=9, color=INK,
            family="monospace")
    y_gemm, h_gemm = 1.55, 1.6
    for seg, slot in enumerate(WEIGHT_INDICES):
        lo, hi = SEG_INDPTR[seg], SEG_INDPTR[seg + 1]
        x0 = tok_x(lo)
        x1 = tok_x(hi - 1) + TOK_W
        r = LORA_RANKS[slot]
        cx = (x0 + x1) / 2
        if r == 0:
            ax.add_patch(FancyBboxPatch((x0, y_gemm), x1 - x0, h_gemm, boxstyle="round,pad=0,rounding_size=0.12",
                                        facecolor="#F4F4F4", edgecolor=EDGE[slot], lw=1.0, linestyle="--"))
            ax.text(cx, y_gemm + h_gemm * 0.64, f"segment {seg}: slot {slot}, rank 0", ha="center", va="center",
                    fontsize=9, color=INK)
            ax.text(cx, y_gemm + h_gemm * 0.3, "the program returns at once: no work", ha="center",
                    va="center", fontsize=8.5, color=MUTED)
        else:
            ax.add_patch(FancyBboxPatch((x0, y_gemm), x1 - x0, h_gemm, boxstyle="round,pad=0,rounding_size=0.12",
                                        facecolor=FILL[slot], edgecolor=EDGE[slot], lw=1.2, alpha=0.55))
            ax.text(cx, y_gemm + h_gemm * 0.68, f"segment {seg}", ha="center", va="center", fontsize=9,
                    color=INK, weight="bold")
            ax.text(cx, y_gemm + h_gemm * 0.4, f"x[{lo}:{hi}] @", ha="center", va="center", fontsize=8.5,
                    color=INK, family="monospace")
            ax.text(cx, y_gemm + h_gemm * 0.16, f"A[{slot},:{r}].T", ha="center", va="center", fontsize=8.5,
                    color=INK, family="monospace")
        arrow(ax, (cx, y_br - 0.95), (cx, y_gemm + h_gemm + 0.03), EDGE[slot], lw=1.0)
    ax.text(TOK_X0 - 0.15, y_gemm + h_gemm / 2 + 0.2, "weight_indices", ha="right", va="center", fontsize=9,
            family="monospace", color=INK)
    ax.text(TOK_X0 - 0.15, y_gemm + h_gemm / 2 - 0.2, str(WEIGHT_INDICES), ha="right", va="center", fontsize=9,
            family="monospace", color=INK)
    arrow(ax, (stack_left - 0.1, anchors[3][1] - 0.3), (tok_x(17) + TOK_W + 0.15, y_gemm + h_gemm / 2), MUTED,
          rad=-0.25, lw=1.4)
    ax.text(tok_x(17) + TOK_W + 0.3, y_gemm - 0.15, "one slot\nper segment", ha="left",
            va="top", fontsize=8.5, color=MUTED)
    ax.text(tok_x(9), 0.95, "one GEMM per segment, clipped to its slot's rank r (rank 0: none); rows of A past r are never read",
            ha="center", va="center", fontsize=9, color=MUTED)

    fig.savefig(OUT, dpi=150, bbox_inches="tight", facecolor="white", metadata={"Software": None})
    plt.close(fig)
    for copy in COPIES:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT, copy)
    print(f"wrote {OUT.relative_to(ROOT)}", *(f"and {c.relative_to(ROOT)}" for c in COPIES))


if __name__ == "__main__":
    main()
