"""Figure for chapter 01: the shapes of a LoRA layer, and where an adapter's parameters go.

Left: the unmerged forward y = x W^T + s (x A^T) B^T drawn as blocks (schematic, not to scale: the
rank r is drawn far wider than it really is next to in and out).
Right: LoRA parameters per decoder layer of Llama-3-8B at rank 16, per projection, computed with
``reference.lora_math``: with the real shapes (GQA k/v, wide MLP) and with every projection taken
as hidden x hidden (the shortcut behind a published "~58 MB" estimate).

    python figures/src/lora_shapes.py

writes figures/lora_shapes.png and a copy into notebooks/01_lora_basics/ (nbgrader releases only
the chapter's folder, so the chapter needs its own copy).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from reference import lora_math  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures" / "lora_shapes.png"
COPIES = [ROOT / "notebooks" / "01_lora_basics" / "lora_shapes.png"]

RANK = 16
BASE_COLOR, A_COLOR, B_COLOR, ACT_COLOR = "#9db4d6", "#f2b880", "#e58f8f", "#d9d9d9"


def _block(ax, x: float, y_center: float, w: float, h: float, name: str, shape: str, color: str) -> None:
    """A matrix as a rectangle centred vertically on y_center, labelled underneath."""
    ax.add_patch(Rectangle((x, y_center - h / 2), w, h, facecolor=color, edgecolor="black", lw=1.0))
    ax.text(x + w / 2, y_center - h / 2 - 0.15, f"{name}\n{shape}", ha="center", va="top", fontsize=9)


def _op(ax, x: float, y: float, text: str) -> None:
    ax.text(x, y, text, ha="center", va="center", fontsize=15)


def draw_forward(ax) -> None:
    """The two paths of an unmerged LoRA layer, as matrix blocks."""
    d_in, d_out, r, n = 2.6, 2.6, 0.45, 0.7  # drawing units, not to scale
    top, bottom = 6.2, 1.7
    # Base path: x @ W^T, one GEMM shared by every request of the batch.
    _block(ax, 0.0, top, d_in, n, "x", "[n, in]", ACT_COLOR)
    _op(ax, 2.95, top, "·")
    _block(ax, 3.3, top, d_out, d_in, "Wᵀ", "[in, out]", BASE_COLOR)
    _op(ax, 6.25, top, "=")
    _block(ax, 6.6, top, d_out, n, "x Wᵀ", "[n, out]", ACT_COLOR)
    ax.text(0.0, top + d_in / 2 + 0.35, "base path: one GEMM for the whole batch", fontsize=10, weight="bold")
    # LoRA path: shrink to rank r, then expand back to out, then scale.
    _block(ax, 0.0, bottom, d_in, n, "x", "[n, in]", ACT_COLOR)
    _op(ax, 2.95, bottom, "·")
    _block(ax, 3.3, bottom, r, d_in, "Aᵀ", "[in, r]", A_COLOR)
    _op(ax, 4.1, bottom, "=")
    _block(ax, 4.45, bottom, r, n, "t", "[n, r]", ACT_COLOR)
    _op(ax, 5.25, bottom, "·")
    _block(ax, 5.6, bottom, d_out, r, "Bᵀ", "[r, out]", B_COLOR)
    _op(ax, 8.55, bottom, "=")
    _block(ax, 8.9, bottom, d_out, n, "t Bᵀ", "[n, out]", ACT_COLOR)
    ax.text(0.0, bottom + d_in / 2 + 0.35, "LoRA path: shrink (in → r), then expand (r → out)",
            fontsize=10, weight="bold")
    ax.text(0.0, -1.4, "y = x Wᵀ + s · (x Aᵀ) Bᵀ,   W [out, in],  A [r, in],  B [out, r]", fontsize=11)
    ax.set_xlim(-0.3, 11.8)
    ax.set_ylim(-1.9, 8.2)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title("Unmerged LoRA forward (schematic; r drawn far wider than it is)", fontsize=11)


def draw_params(ax) -> None:
    """LoRA parameters per layer and projection: real Llama-3-8B shapes vs all hidden x hidden."""
    cfg = lora_math.LLAMA3_8B_CONFIG
    shapes = lora_math.projection_shapes(cfg)
    hidden = cfg["hidden_size"]
    names = list(lora_math.LLAMA_PROJECTIONS)
    real = [RANK * sum(shapes[m]) / 1e3 for m in names]
    square = [RANK * 2 * hidden / 1e3 for _ in names]
    ys = range(len(names))
    ax.barh([y + 0.2 for y in ys], real, height=0.4, color=B_COLOR, edgecolor="black",
            label="real shapes (GQA k/v, wide MLP)")
    ax.barh([y - 0.2 for y in ys], square, height=0.4, color=BASE_COLOR, edgecolor="black",
            label="every projection hidden × hidden")
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.set_xlabel(f"LoRA parameters per layer, thousands (r = {RANK})")
    ax.legend(loc="upper right", fontsize=9)
    real_mib = lora_math.adapter_num_bytes(cfg, names, RANK, torch.bfloat16) / 2**20
    square_mib = 2 * hidden * RANK * len(names) * cfg["num_hidden_layers"] * 2 / 2**20
    ax.set_title(f"Llama-3-8B adapter, bf16: {real_mib:.1f} MiB (real) vs {square_mib:.1f} MiB (square)",
                 fontsize=11)


def main() -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.15, 1]})
    draw_forward(left)
    draw_params(right)
    fig.tight_layout()
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(OUT, dpi=130)
    plt.close(fig)
    for copy in COPIES:
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(OUT, copy)
    print(f"wrote {OUT.relative_to(ROOT)} and {len(COPIES)} chapter copy")


if __name__ == "__main__":
    main()
