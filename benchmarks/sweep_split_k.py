"""Tune the decode LoRA kernels per projection shape on a GPU: the split-K shrink, then the expand's
schedule (chapter 08, issue #16).

    python benchmarks/sweep_split_k.py --out benchmarks/results/decode_split_k_<gpu>.json [--budget-s 240]
    python benchmarks/sweep_split_k.py --expand --out benchmarks/results/decode_expand_<gpu>.json
    python benchmarks/sweep_split_k.py --grouped --out benchmarks/results/decode_shrink_grouped_<gpu>.json
    TRITON_INTERPRET=1 python benchmarks/sweep_split_k.py [--expand | --grouped] --smoke --out /tmp/split.json   # any machine

``--grouped``: the shrink alone with its partials' reduction (``_triton_util.summed_partials``, as
the layers run it before the sorted expand), per projection (the four below), ranks 16 and 64, 64
and 256 tokens on 8 and 32 adapters (``--adapter-counts``), over the slot-sorted view: the "token"
schedule (its defaults: ``decode_splits`` + ``split_config``) against the "sorted" schedule (one A
tile per slot for a block of ``block_m`` of its tokens, ``bgmv_shrink(schedule="sorted")``) over S
(1: unsplit, no reduction) x block_k x block_m, and its defaults at the token schedule's S. Best per (projection, rank, tokens): least
time summed over both adapter counts.

``--expand``: the expand alone, per output width of one layer call (4096: q, o, down; 1024: k, v;
14336: gate, up), ranks 16 and 64, 16 / 32 / 64 / 256 tokens, 8 and 32 adapters, reading the
shrink's split-K partials (S = 4; ``--partials 16`` as the decode step's widest shrinks): the "token" schedule (its defaults) against the "sorted"
schedule (SGMV's expand over the slot-sorted view a CUDA-graph decode batch carries: one segment
per pool slot, the base slot's empty) over block_m x block_n x num_warps, and the "sorted"
defaults. Since the pool's adapter count is not known when a graph is captured, the best config
per (width, rank, tokens) is the one with the least time summed over both adapter counts.

A decode step's LoRA on one projection is two launches: ``bgmv_shrink`` (x [T, hidden] -> t) and
``bgmv_expand`` (t -> out). Unsplit, the shrink has one program per token: 64 programs for 64
sequences on a GPU of 132 SMs, each streaming its adapter's whole A. Split-K gives it S times as
many programs; the expand then sums S fp32 partials as it loads t. So the pair is timed, not the
shrink alone: a split that speeds the shrink but slows the expand shows as a loss.

Shapes: the projections of a Llama-3-8B layer (hidden 4096, intermediate 14336, GQA 32/8), with
the pool's stacking: qkv_proj (4096 -> [4096, 1024, 1024], 3 parts), o_proj (4096 -> 4096),
gate_up_proj (4096 -> [14336, 14336], 2 parts), down_proj (14336 -> 4096); ranks 16 and 64; 16,
64 and 256 tokens (one per sequence) over 8 adapters (token i on slot 1 + i mod 8), bf16.

Each replay adds into the same output again (no reset copy in the timed graph); the check runs on
the first call. Configs per shape: unsplit with its tuned defaults; S in 2..32 (no piece under 256 columns) x
block_k in {piece, piece / 2} (one or two passes per program) x num_warps in {4, 8, 16}; and the
defaults' own pick (``decode_splits`` + ``split_config``). Method: shrink + expand captured in one
CUDA graph, ``triton.testing.do_bench`` median of the replay; every config first checked against
the torch reference (one that fails or does not compile is recorded with its error, not timed).
Prints, per shape: unsplit, the defaults' pick and the best, and writes every row.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from sweep_decode_ranks import graph_us  # noqa: E402
from reference.batch_info import build_batch_info  # noqa: E402
from reference.ops import bgmv_expand, bgmv_shrink, torch_ref  # noqa: E402
from reference.ops._triton_util import summed_partials  # noqa: E402
from reference.ops.bgmv_shrink import decode_splits, split_config  # noqa: E402

#: name -> (in_features, output slices, stack_num)
PROJECTIONS = {"qkv_proj": (4096, (4096, 1024, 1024), 3), "o_proj": (4096, (4096,), 1),
               "gate_up_proj": (4096, (14336, 14336), 2), "down_proj": (14336, (4096,), 1)}
SMOKE_PROJECTIONS = {"qkv_proj": (1100, (24, 8, 8), 3), "down_proj": (1500, (40,), 1)}
TOKENS, RANKS, ADAPTERS = (16, 64, 256), (16, 64), 8


def problem(tokens: int, in_features: int, slices, stack: int, rank: int, device, dtype, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    num_slots = ADAPTERS + 1
    ranks = [0] + [rank] * ADAPTERS
    out_total = sum(slices)
    A = (torch.randn(num_slots, stack * rank, in_features, generator=g) * in_features ** -0.5).to(dtype).to(device)
    B = (torch.randn(num_slots, out_total, rank, generator=g) * rank ** -0.5).to(dtype).to(device)
    info = build_batch_info([1] * tokens, [1 + i % ADAPTERS for i in range(tokens)], ranks,
                            [0.0] + [2.0] * ADAPTERS, device)
    x = torch.randn(tokens, in_features, generator=g).to(dtype).to(device)
    out = torch.randn(tokens, out_total, generator=g).to(dtype).to(device)
    offsets = [0]
    for w in slices:
        offsets.append(offsets[-1] + w)
    t = torch_ref.bgmv_shrink(x, A, info, torch.zeros(tokens, stack * rank, dtype=dtype, device=device), stack)
    expected = torch_ref.bgmv_expand(t, B, info, out.clone(), offsets)
    return dict(x=x, A=A, B=B, info=info, out=out, offsets=offsets, stack=stack, expected=expected)


def configs(tokens: int, in_features: int, width: int, smoke: bool) -> list[dict]:
    """Unsplit defaults, the defaults' pick, then every (S, block_k, num_warps) of the grid."""
    S0 = decode_splits(tokens, in_features, width)
    out = [dict(splits=1, label="unsplit"), dict(splits=S0, label="defaults", **split_config(tokens, in_features, width, S0))]
    splits = [s for s in (2, 4, 8, 16, 32) if in_features // s >= 256]
    for S in splits[:2] if smoke else splits:
        piece = triton.next_power_of_2(triton.cdiv(in_features, S))
        for bk in (piece, max(64, piece // 2)):
            for w in (4,) if smoke else (4, 8, 16):
                out.append(dict(splits=S, block_k=min(bk, 4096), num_warps=w))
    return out


def pair(p: dict, cfg: dict):
    """The shrink (split per ``cfg``) and the expand reading its output, writing into a fresh out."""
    x, A, B, info, stack = p["x"], p["A"], p["B"], p["info"], p["stack"]
    S = cfg["splits"]
    width = A.shape[1]
    t = (torch.empty(S, x.shape[0], width, dtype=torch.float32, device=x.device) if S > 1
         else torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device))
    kw = {k: cfg[k] for k in ("block_k", "num_warps") if k in cfg}
    buf = p["out"].clone()

    def call():  # replays keep adding into buf: the check is on the first call only
        bgmv_shrink(x, A, info, t, stack, **kw)
        bgmv_expand(t, B, info, buf, p["offsets"])
    return call, buf


EXPAND_WIDTHS, EXPAND_ADAPTERS, EXPAND_TOKENS = (4096, 1024, 14336), (8, 32), (16, 32, 64, 256)


def expand_configs(smoke: bool, stages=(None,)) -> list[dict]:
    grid = [dict(schedule="sorted", block_m=bm, block_n=bn, num_warps=w,
                 **({} if ns is None else {"num_stages": ns}))
            for bm in (16, 32, 64) for bn in (64, 128, 256) for w in (4, 8) for ns in stages]
    return [dict(schedule="token"), dict(schedule="sorted")] + (grid[:2] if smoke else grid)


def sorted_decode_info(slots: list[int], ranks: list[int], scalings: list[float], device):
    """A decode batch as a CUDA graph carries it: ``StaticLoRABatch``'s view (token_slots in batch
    order and the slot-sorted view, one segment per pool slot, empty ones included)."""
    from reference.cuda_graph import StaticLoRABatch

    static = StaticLoRABatch(len(ranks), len(slots), device=device)
    static.update(slots, len(slots), 0, ranks, scalings, ownership_changed=True)  # slot 0: rank 0
    return static.batch_info(len(slots))


def sweep_expand(args, device, dtype, start) -> None:
    rows, best = [], []
    S = args.partials
    for rank in (4,) if args.smoke else args.ranks or RANKS:
        for tokens in (20,) if args.smoke else args.tokens or EXPAND_TOKENS:
            for width in (24,) if args.smoke else args.widths or EXPAND_WIDTHS:
                if time.monotonic() - start > args.budget_s:
                    break
                totals: dict = {}
                for D in (2,) if args.smoke else args.adapter_counts or EXPAND_ADAPTERS:
                    g = torch.Generator().manual_seed(rank + tokens + D)
                    A = (torch.randn(D + 1, rank, 64, generator=g) * 0.125).to(dtype).to(device)
                    B = (torch.randn(D + 1, width, rank, generator=g) * rank ** -0.5).to(dtype).to(device)
                    info = sorted_decode_info([1 + i % D for i in range(tokens)], [0] + [rank] * D,
                                              [0.0] + [2.0] * D, device)
                    x = torch.randn(tokens, 64, generator=g).to(dtype).to(device)
                    t = torch.zeros(S, tokens, rank, dtype=torch.float32, device=device)
                    bgmv_shrink(x, A, info, t if S > 1 else t[0])
                    out = torch.randn(tokens, width, generator=g).to(dtype).to(device)
                    expected = torch_ref.bgmv_expand(t, B, info, out.clone())
                    group = dict(width=width, rank=rank, tokens=tokens, adapters=D)
                    if S == 1:
                        t = t[0]
                    for cfg in expand_configs(args.smoke, args.stages):
                        buf = out.clone()
                        try:
                            bgmv_expand(t, B, info, buf, **cfg)
                            torch.testing.assert_close(buf.float(), expected.float(), rtol=3e-2, atol=3e-2)
                            us = graph_us(lambda: bgmv_expand(t, B, info, buf, **cfg))
                        except Exception as exc:  # an invalid config (resources, compile): recorded
                            rows.append(dict(group, config=cfg, error=str(exc).splitlines()[0][:200]))
                            continue
                        rows.append(dict(group, config=cfg, us=round(us, 2)))
                        key = json.dumps(cfg, sort_keys=True)
                        totals.setdefault(key, []).append(us)
                n_cases = 1 if args.smoke else len(args.adapter_counts or EXPAND_ADAPTERS)
                full = {k: sum(v) for k, v in totals.items() if len(v) == n_cases}
                token = full.get(json.dumps(dict(schedule="token"), sort_keys=True), float("nan"))
                default = full.get(json.dumps(dict(schedule="sorted"), sort_keys=True), float("nan"))
                key = min(full, key=full.get) if full else None
                best.append(dict(width=width, rank=rank, tokens=tokens, token_us_sum=round(token, 2),
                                 sorted_defaults_us_sum=round(default, 2),
                                 best_us_sum=round(full[key], 2) if key else None,
                                 best=json.loads(key) if key else None))
                print(f"expand r={rank:2d} T={tokens:4d} width {width:5d}: token {token:7.1f} us  sorted defaults "
                      f"{default:7.1f} us  best {full.get(key, float('nan')):7.1f} us (sum over adapters "
                      f"{args.adapter_counts or EXPAND_ADAPTERS})  {json.loads(key) if key else None}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", torch=torch.__version__,
        triton=triton.__version__, adapters=list(args.adapter_counts or EXPAND_ADAPTERS), partials=S,
        method="bgmv_expand alone in a CUDA graph, do_bench(warmup=10 ms, rep=40 ms) median, us; bf16; "
               "best = least sum over the adapter counts",
        seconds=round(time.monotonic() - start, 1), best=best, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out} ({len(best)} shapes in {time.monotonic() - start:.0f} s)")


GROUPED_TOKENS, GROUPED_ADAPTERS = (64, 256), (8, 32)


def grouped_configs(tokens: int, in_features: int, width: int, smoke: bool) -> list[dict]:
    S0 = decode_splits(tokens, in_features, width)
    out = [dict(schedule="token", splits=S0, label="token defaults"),
           dict(schedule="sorted", splits=S0, label="sorted defaults")]
    # S = 1: no partials and no reduction (t in x's dtype, as the layers take it unsplit); block_m: tokens of
    # one slot per program (vLLM's shrink takes 32 from 128 tokens up, SGLang's 16-64); 4 warps as both do
    for S in (2,) if smoke else (1, 2, 4, 8, 16):
        for bk in (64,) if smoke else (128, 256):
            for bm in (16,) if smoke else (16, 32, 64):
                if in_features // S >= bk:
                    out.append(dict(schedule="sorted", splits=S, block_k=bk, block_m=bm, num_warps=4))
    return out


def sweep_grouped(args, device, dtype, start) -> None:
    rows, best = [], []
    projections = SMOKE_PROJECTIONS if args.smoke else PROJECTIONS
    for rank in (4,) if args.smoke else args.ranks or RANKS:
        for tokens in (20,) if args.smoke else args.tokens or GROUPED_TOKENS:
            for name, (K, _, stack) in projections.items():
                if time.monotonic() - start > args.budget_s:
                    break
                width = stack * rank
                group = dict(projection=name, rank=rank, tokens=tokens, in_features=K, width=width)
                totals: dict = {}
                for D in (2,) if args.smoke else args.adapter_counts or GROUPED_ADAPTERS:
                    g = torch.Generator().manual_seed(rank + tokens + D)
                    A = (torch.randn(D + 1, width, K, generator=g) * K ** -0.5).to(dtype).to(device)
                    info = sorted_decode_info([1 + i % D for i in range(tokens)], [0] + [rank] * D,
                                              [0.0] + [2.0] * D, device)
                    x = torch.randn(tokens, K, generator=g).to(dtype).to(device)
                    expected = torch_ref.bgmv_shrink(x, A, info, torch.zeros(tokens, width, device=device), stack)
                    for cfg in grouped_configs(tokens, K, width, args.smoke):
                        S = cfg["splits"]
                        t = (torch.empty(S, tokens, width, dtype=torch.float32, device=device) if S > 1
                             else torch.empty(tokens, width, dtype=dtype, device=device))
                        kw = {k: cfg[k] for k in ("schedule", "block_k", "block_m", "num_warps") if k in cfg}

                        def call():
                            return summed_partials(bgmv_shrink(x, A, info, t, stack, **kw))
                        try:
                            torch.testing.assert_close(call().float(), expected, rtol=3e-2, atol=3e-2)
                            us = graph_us(call)
                        except Exception as exc:  # an invalid config (resources, compile): recorded
                            rows.append(dict(group, adapters=D, config=cfg, error=str(exc).splitlines()[0][:200]))
                            continue
                        rows.append(dict(group, adapters=D, config=cfg, us=round(us, 2)))
                        totals.setdefault(json.dumps(cfg, sort_keys=True), []).append(us)
                n_cases = 1 if args.smoke else len(args.adapter_counts or GROUPED_ADAPTERS)
                full = {k: sum(v) for k, v in totals.items() if len(v) == n_cases}
                by = {json.loads(k).get("label"): v for k, v in full.items()}
                key = min(full, key=full.get) if full else None
                nan = float("nan")
                best.append(dict(group, token_us_sum=round(by.get("token defaults", nan), 2),
                                 sorted_defaults_us_sum=round(by.get("sorted defaults", nan), 2),
                                 best_us_sum=round(full[key], 2) if key else None,
                                 best=json.loads(key) if key else None))
                print(f"shrink r={rank:2d} T={tokens:4d} {name:13s}: token {by.get('token defaults', nan):7.1f} us  "
                      f"sorted defaults {by.get('sorted defaults', nan):7.1f} us  best "
                      f"{full.get(key, nan):7.1f} us (sum over adapters)  {json.loads(key) if key else None}",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", torch=torch.__version__,
        triton=triton.__version__, adapters=list(args.adapter_counts or GROUPED_ADAPTERS),
        method="bgmv_shrink + summed_partials in a CUDA graph, do_bench(warmup=10 ms, rep=40 ms) median, us; "
               "bf16; best = least sum over the adapter counts",
        seconds=round(time.monotonic() - start, 1), best=best, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out} ({len(best)} shapes in {time.monotonic() - start:.0f} s)")

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--expand", action="store_true", help="sweep the expand's schedule instead")
    parser.add_argument("--grouped", action="store_true",
                        help="sweep the shrink's slot-grouped schedule (with its partials' reduction) instead")
    parser.add_argument("--smoke", action="store_true", help="tiny fp32 shapes, few configs (CPU interpreter)")
    parser.add_argument("--partials", type=int, default=4,
                        help="--expand: split-K partials the expand reads (1: one unsplit t; the step's shrink "
                             "uses up to 16, ops.decode_splits)")
    parser.add_argument("--ranks", type=int, nargs="+", default=None, help="--expand / --grouped: ranks (default 16 64)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="--expand / --grouped: token counts")
    parser.add_argument("--adapter-counts", type=int, nargs="+", default=None,
                        help="--expand / --grouped: distinct adapters per batch (default 8 32)")
    parser.add_argument("--widths", type=int, nargs="+", default=None, help="--expand: output widths")
    parser.add_argument("--stages", type=int, nargs="+", default=[None],
                        help="--expand: num_stages values for the sorted grid (default: the launch's own)")
    args = parser.parse_args()
    start = time.monotonic()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.expand:
        return sweep_expand(args, device, dtype, start)
    if args.grouped:
        return sweep_grouped(args, device, dtype, start)
    projections = SMOKE_PROJECTIONS if args.smoke else PROJECTIONS
    rows, best = [], []
    for rank in (4,) if args.smoke else RANKS:
        for tokens in (3,) if args.smoke else TOKENS:
            for name, (K, slices, stack) in projections.items():
                if time.monotonic() - start > args.budget_s:
                    break
                p = problem(tokens, K, slices, stack, rank, device, dtype)
                width = stack * rank
                group = dict(projection=name, tokens=tokens, rank=rank, in_features=K, width=width)
                timed = []
                for cfg in configs(tokens, K, width, args.smoke):
                    call, buf = pair(p, cfg)
                    try:
                        call()
                        torch.testing.assert_close(buf.float(), p["expected"].float(), rtol=3e-2, atol=3e-2)
                        us = graph_us(call)
                    except Exception as exc:  # an invalid config (resources, compile): recorded
                        rows.append(dict(group, config=cfg, error=str(exc).splitlines()[0][:200]))
                        continue
                    rows.append(dict(group, config=cfg, us=round(us, 2)))
                    timed.append((us, cfg))
                by = {c.get("label"): u for u, c in timed if c.get("label")}
                us, cfg = min(timed, key=lambda uc: uc[0]) if timed else (float("nan"), None)
                best.append(dict(group, unsplit_us=round(by.get("unsplit", float("nan")), 2),
                                 defaults_us=round(by.get("defaults", float("nan")), 2),
                                 defaults=next((c for _, c in timed if c.get("label") == "defaults"), None),
                                 best_us=round(us, 2), best=cfg))
                print(f"r={rank:2d} T={tokens:4d} {name:13s} unsplit {by.get('unsplit', float('nan')):7.1f} us  "
                      f"defaults {by.get('defaults', float('nan')):7.1f} us  best {us:7.1f} us  {cfg}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)", torch=torch.__version__,
        triton=triton.__version__, adapters=ADAPTERS,
        method="shrink + expand in one CUDA graph, do_bench(warmup=10 ms, rep=40 ms) median, us; bf16",
        seconds=round(time.monotonic() - start, 1), best=best, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out} ({len(best)} shapes in {time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
