"""Benchmark the MoE LoRA op (chapter 09) on a GPU, beside the base MoE layer it rides on.

    python benchmarks/benchmark_moe_lora.py [--out benchmarks/results/moe_lora_<gpu>.json] [--skip-torch-ref]
    python benchmarks/benchmark_moe_lora.py --smoke     # tiny shapes, CPU interpreter (or GPU), seconds

Models: Mixtral-8x7B (hidden 4096, 8 experts of intermediate 14336, top-2) and Qwen3-30B-A3B
(hidden 2048, 128 experts of intermediate 768, top-8). Batches: decode (16, 64, 256 tokens) and
prefill (4 x 2048 tokens). Adapters: 1, 8, 32 of rank 16 on every expert; token i runs adapter
1 + (i mod D); slot 0 holds the base model (rank 0). bf16. Routing: top-k of random router logits,
softmax weights.

Ops per case (``reference.moe.fused_moe_lora``):
- ``gate_up``: token rows, two slices (gate | up, ``slice_offsets`` (0, I, 2I)), no routing weights;
- ``down``: pair rows (the activation of each (token, expert) pair), one slice, routing weights
  applied in the epilogue (as vLLM's second GEMM does);
- ``align``: ``align_moe_lora`` (virtual ids + ``moe_align_block_size``), done once per layer for
  both ops. It synchronizes with the device (host counts), so it cannot be captured: it is timed
  eagerly, and gate_up / down are captured with that precomputed alignment (``aligned=``).

Method (as benchmarks/benchmark_lora_ops.py, whose helpers this imports): each op is captured in a
CUDA graph and timed as ``triton.testing.do_bench(graph.replay, return_mode="median")``; the torch
reference (``reference.moe.lora.fused_moe_lora_torch``, host loops and syncs) eagerly. The copy
bandwidth of the same run (fastest 1 GiB device-to-device copy) is the ceiling for ``%copy``.

Bytes (the minimum traffic): shrink = the distinct x rows read + A of each (slot, expert) group in
use + the intermediate written; expand = the intermediate read + B of each group in use + ``out``
read and written for the pairs with LoRA work. ``%base`` is the LoRA op's time over the base MoE
layer's own time in the same run: a **torch** grouped GEMM (per expert, ``torch.mm`` over its sorted
pairs for gate_up, SiLU-and-mul, ``torch.mm`` for down, index copies; graph-captured), not a fused
MoE kernel such as vLLM's Triton ``fused_moe``, which would be faster and make the fraction larger.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import reference  # noqa: F401  (first: with no CUDA device it selects the Triton interpreter before triton loads)
import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_lora_ops import copy_bandwidths, eager_time, graph_time  # noqa: E402
from reference.moe.lora import fused_moe_lora_torch, virtual_expert_ids  # noqa: E402
from reference.moe.fused_moe_lora import fused_moe_lora  # noqa: E402
from reference.moe.fused_moe_lora import align_moe_lora  # noqa: E402

RANK = 16
MODELS = {  # hidden, expert intermediate, experts, top_k (the published config.json values)
    "Mixtral-8x7B": (4096, 14336, 8, 2),
    "Qwen3-30B-A3B": (2048, 768, 128, 8),
}
BATCHES = (("decode", 16), ("decode", 64), ("decode", 256), ("prefill", 4 * 2048))
ADAPTERS = (1, 8, 32)
SMOKE_MODELS = {"tiny-8e-top2": (64, 48, 8, 2), "tiny-16e-top4": (32, 24, 16, 4)}
SMOKE_BATCHES = (("decode", 4), ("prefill", 24))
SMOKE_ADAPTERS = (1, 3)


def routing(tokens: int, experts: int, top_k: int, gen: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [tokens, top_k] and softmax weights of random router logits."""
    logits = torch.randn(tokens, experts, generator=gen, device=device)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return ids, weights / weights.sum(-1, keepdim=True)


def problem(model: tuple, tokens: int, adapters: int, device, dtype=torch.bfloat16) -> dict:
    """Buffers, routing and inputs of one case (gate_up and down share the routing)."""
    hidden, inter, E, top_k = model
    g = torch.Generator(device=device).manual_seed(0)
    slots = adapters + 1

    def randn(*shape, scale):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    ids, weights = routing(tokens, E, top_k, g, device)
    ranks = torch.full((slots, E), RANK, dtype=torch.int32, device=device)
    ranks[0] = 0
    p = dict(model=model, tokens=tokens, adapters=adapters, topk_ids=ids, topk_weights=weights, lora_ranks=ranks,
             token_slots=(1 + torch.arange(tokens, device=device) % adapters).to(torch.int32),
             scalings=torch.tensor([0.0] + [2.0] * adapters, device=device), top_k=top_k)
    p["gate_up"] = dict(x=randn(tokens, hidden, scale=1.0), A=randn(slots, E, 2 * RANK, hidden, scale=hidden ** -0.5),
                        B=randn(slots, E, 2 * inter, RANK, scale=RANK ** -0.5),
                        out=torch.zeros(tokens * top_k, 2 * inter, dtype=dtype, device=device),
                        rows_per_pair=False, slice_offsets=(0, inter, 2 * inter), topk_weights=None)
    p["down"] = dict(x=randn(tokens * top_k, inter, scale=1.0), A=randn(slots, E, RANK, inter, scale=inter ** -0.5),
                     B=randn(slots, E, hidden, RANK, scale=RANK ** -0.5),
                     out=torch.zeros(tokens * top_k, hidden, dtype=dtype, device=device),
                     rows_per_pair=True, slice_offsets=None, topk_weights=weights)
    p["aligned"] = align_moe_lora(ids, p["token_slots"], ranks)
    return p


def op_args(p: dict, op: str) -> dict:
    keys = ("topk_ids", "token_slots", "lora_ranks", "scalings", "top_k")
    return {**{k: p[k] for k in keys}, **p[op]}


def nbytes(p: dict, op: str, el: int = 2) -> int:
    """Minimum bytes of one op (module docstring): distinct x rows, each used group's A and B once,
    the intermediate written and read, out read and written for the pairs with LoRA work."""
    a = op_args(p, op)
    virtual = virtual_expert_ids(a["topk_ids"], a["token_slots"], a["A"].shape[1]).view(-1)
    kept = (virtual >= 0) & (a["lora_ranks"].view(-1)[virtual.clamp(min=0)] > 0)
    groups = int(torch.unique(virtual[kept]).numel())
    pairs = int(kept.sum())
    rows = pairs if a["rows_per_pair"] else int(kept.view(-1, a["top_k"]).any(1).sum())
    k_in, n_out, width = a["x"].shape[1], a["out"].shape[1], a["A"].shape[2]  # width = stack * rank
    shrink = rows * k_in + groups * width * k_in + pairs * width
    expand = pairs * width + groups * n_out * RANK + 2 * pairs * n_out
    return (shrink + expand) * el


class BaseMoE:
    """The base MoE layer in torch (not a fused MoE kernel): per expert, ``torch.mm`` over its pairs
    for gate_up, SiLU(gate) * up, ``torch.mm`` for down. Pair lists are built once (host), so a
    call is capturable in a CUDA graph."""

    def __init__(self, model: tuple, topk_ids: torch.Tensor, x: torch.Tensor, gen: torch.Generator):
        hidden, inter, E, top_k = model
        dev, dt = x.device, x.dtype
        self.w_gate_up = (torch.randn(E, 2 * inter, hidden, generator=gen, device=dev) * hidden ** -0.5).to(dt)
        self.w_down = (torch.randn(E, hidden, inter, generator=gen, device=dev) * inter ** -0.5).to(dt)
        flat = topk_ids.reshape(-1)
        self.groups = [(e, pairs, pairs // top_k) for e in range(E)
                       if (pairs := torch.nonzero(flat == e).view(-1)).numel()]
        self.x, self.inter = x, inter
        self.out = torch.zeros(flat.numel(), hidden, dtype=dt, device=dev)

    def __call__(self) -> torch.Tensor:
        for e, pairs, rows in self.groups:
            h = torch.mm(self.x[rows], self.w_gate_up[e].T)
            act = torch.nn.functional.silu(h[:, :self.inter]) * h[:, self.inter:]
            self.out.index_copy_(0, pairs, torch.mm(act, self.w_down[e].T))
        return self.out


def wall_time(fn, reps: int = 3) -> float:
    """Median microseconds of a few eager calls (the smoke run: no CUDA graph on the CPU)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def run_case(name: str, model: tuple, phase: str, tokens: int, adapters: int, device, bw: float,
             skip_torch_ref: bool, graphed: bool) -> list[dict]:
    p = problem(model, tokens, adapters, device)
    timed = graph_time if graphed else wall_time
    eager = eager_time if graphed else wall_time
    base = BaseMoE(model, p["topk_ids"], p["gate_up"]["x"], torch.Generator(device=device).manual_seed(1))
    base_us = timed(base)
    case = dict(model=name, phase=phase, tokens=tokens, adapters=adapters, rank=RANK, hidden=model[0],
                intermediate=model[1], experts=model[2], top_k=model[3], base_layer_us=base_us,
                blocks=int(p["aligned"].block_ids.numel()))
    rows = [dict(case, op="align", us=eager(lambda: align_moe_lora(p["topk_ids"], p["token_slots"], p["lora_ranks"])),
                 bytes=0, torch_ref_us_eager=float("nan"))]
    for op in ("gate_up", "down"):
        a = op_args(p, op)
        us = timed(lambda a=a: fused_moe_lora(**a, aligned=p["aligned"]))
        ref_us = float("nan") if skip_torch_ref else eager(lambda a=a: fused_moe_lora_torch(**a))
        rows.append(dict(case, op=op, us=us, bytes=nbytes(p, op), torch_ref_us_eager=ref_us))
    total = sum(r["us"] for r in rows)
    rows.append(dict(case, op="align+gate_up+down", us=total, bytes=sum(r["bytes"] for r in rows),
                     torch_ref_us_eager=sum(r["torch_ref_us_eager"] for r in rows[1:])))
    for r in rows:
        r["gbps"] = r["bytes"] / (r["us"] * 1e-6) / 1e9
        r["frac_copy"] = r["gbps"] / bw
        r["frac_base"] = r["us"] / base_us
    return rows


def check_smoke(device) -> None:
    """The smoke run also checks the op against the torch reference on one tiny case."""
    p = problem(SMOKE_MODELS["tiny-8e-top2"], 5, 2, device, torch.float32)
    for op in ("gate_up", "down"):
        a = op_args(p, op)
        got = fused_moe_lora(**{**a, "out": a["out"].clone()}, aligned=p["aligned"])
        torch.testing.assert_close(got, fused_moe_lora_torch(**{**a, "out": a["out"].clone()}), rtol=1e-4, atol=1e-4)


def print_row(r: dict) -> None:
    case = f"{r['model']} {r['phase']} {r['tokens']} D={r['adapters']}"
    print(f"{case:36s} {r['op']:18s} {r['us']:9.1f} {r['bytes'] / 1e6:8.2f} {r['gbps']:7.0f} "
          f"{100 * r['frac_copy']:5.0f}% {100 * r['frac_base']:5.0f}% {r['base_layer_us']:9.1f} "
          f"{r['torch_ref_us_eager']:10.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any machine (CPU: the Triton interpreter)")
    parser.add_argument("--skip-torch-ref", action="store_true", help="do not time the (slow) torch reference")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.error("needs a CUDA device (or --smoke)")
    device = torch.device("cuda" if cuda else "cpu")
    device_name = torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})"
    if args.smoke:
        check_smoke(device)
    copies = copy_bandwidths() if cuda else {}
    bw = max(copies.values()) if copies else float("nan")
    print(f"{device_name}: copy bandwidth {bw:.0f} GB/s" + (" (smoke: wall-clock times, interpreter)" if not cuda else ""))
    print(f"{'case':36s} {'op':18s} {'us':>9s} {'MB':>8s} {'GB/s':>7s} {'%copy':>6s} {'%base':>6s} "
          f"{'base us':>9s} {'torch us':>10s}")
    models, batches, adapters = (SMOKE_MODELS, SMOKE_BATCHES, SMOKE_ADAPTERS) if args.smoke else (MODELS, BATCHES, ADAPTERS)
    rows = []
    for name, model in models.items():
        for phase, tokens in batches:
            for d in adapters:
                for r in run_case(name, model, phase, tokens, d, device, bw, args.skip_torch_ref, graphed=cuda):
                    rows.append(r)
                    print_row(r)
                if cuda:
                    torch.cuda.empty_cache()
    result = dict(device=device_name, torch=torch.__version__, triton=triton.__version__,
                  python=platform.python_version(), smoke=args.smoke, copy_bandwidth_gbps=bw, copy_bandwidths_gbps=copies,
                  method=("CUDA graph replay, triton.testing.do_bench median; align and torch_ref eager; "
                          "base layer = torch per-expert mm (not a fused MoE kernel)") if cuda
                  else "wall-clock median of 3 eager calls (CPU, Triton interpreter): checks the script, not speed",
                  rank=RANK, rows=rows)
    slug = device_name.lower().replace("nvidia", "").strip().replace(" ", "_") if cuda else "cpu"
    default = (Path(tempfile.gettempdir()) / f"moe_lora_smoke_{slug}.json" if args.smoke
               else ROOT / "benchmarks" / "results" / f"moe_lora_{slug}.json")
    out = args.out or default
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
