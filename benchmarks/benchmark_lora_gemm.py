"""LoRA in the base GEMM's epilogue (issue #16): the Triton base GEMM against cuBLAS, and one layer's
seven projections with LoRA as separate kernels against LoRA fused into the projections.

    python benchmarks/benchmark_lora_gemm.py [--out PATH]
    python benchmarks/benchmark_lora_gemm.py --smoke        # tiny sizes, CPU or GPU, seconds

Shapes: a Llama-3-8B layer as a Hugging Face Llama calls it (hidden 4096, GQA 32/8 so k and v are
4096 -> 1024, intermediate 14336; q, k, v, o, gate, up, down: seven GEMMs), bf16.

Part 1, the GEMM: for each distinct projection shape and row count (16, 64, 256 decode rows; 8192
prefill rows = 4 x 2048), cuBLAS (``F.linear``) and the book's Triton GEMM (``ops.lora_gemm``
without LoRA) over a few tile configs each; reported: the best config and its time / cuBLAS.

Part 2, one layer's projections, each path captured in a CUDA graph and replayed:
  - ``base``: the seven cuBLAS GEMMs;
  - ``separate``: the layers' ``"triton"`` backend (cuBLAS, then per packed module one shared shrink
    and per projection one expand: 4 shrinks + 7 expands);
  - ``fused``: the ``"triton_fused"`` backend (4 shrinks + 7 ``lora_gemm`` with the expand in their
    epilogue: no expand kernel), and ``fused_gather``: the same with the "gather" epilogue;
  - ``fused_base``: the fused backend with no adapter in the batch (its Triton base GEMMs).
Cases: decode 16 x 8, 64 x 8, 64 x 32, 256 x 32 (rows x distinct adapters), prefill 4 x 2048 rows
over 4 adapters; ranks 16 and 64; LoRA on every projection; row i on adapter (i mod D). Reported:
each path's LoRA overhead as a fraction of the cuBLAS base projections (``path_us / base_us - 1``);
the projections are most of a decode step's time, so the overhead on the whole step is smaller
(``benchmarks/benchmark_decode_step.py --backends triton triton_fused`` measures that).

Timing: ``triton.testing.do_bench(..., return_mode="median")``, all paths of a case in one run.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_decode_step import FULL, SMOKE, backend_named, modules, random_adapter, timer  # noqa: E402
from reference import ops  # noqa: E402
from reference.batch_info import batch_info_from_requests  # noqa: E402
from reference.layers import LoRAContext, LoRALinear, SharedShrink  # noqa: E402
from reference.mem_pool import LoRAMemoryPool  # noqa: E402

# (block_m, block_n, block_k, num_warps, num_stages) candidates per row count
CANDIDATES = {
    16: [(16, 32, 256, 4, 4), (16, 64, 256, 4, 4), (16, 32, 512, 4, 3), (16, 64, 128, 4, 5)],
    64: [(64, 32, 128, 4, 4), (64, 64, 128, 4, 4), (64, 32, 256, 4, 3), (32, 32, 256, 4, 4)],
    256: [(64, 64, 128, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)],
    8192: [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)],
}
DECODE = [(16, 8), (64, 8), (64, 32), (256, 32)]
PREFILL = [(8192, 4)]  # 4 requests x 2048 tokens


def shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """Projection -> (in, out), as a Hugging Face Llama calls them."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    return dict(q_proj=(h, h), k_proj=(h, kv), v_proj=(h, kv), o_proj=(h, h), gate_proj=(h, i), up_proj=(h, i),
                down_proj=(i, h))


def gemm_sweep(cfg: dict, rows_list, device, timeit) -> list[dict]:
    out = []
    distinct = sorted(set(shapes(cfg).values()))
    for M in rows_list:
        for (K, N) in distinct:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            W = torch.randn(N, K, device=device, dtype=torch.bfloat16) * K ** -0.5
            cublas = timeit(lambda: torch.nn.functional.linear(x, W))
            y = torch.empty(M, N, device=device, dtype=torch.bfloat16)
            best = None
            tried = []
            for (bm, bn, bk, w, s) in CANDIDATES.get(M, CANDIDATES[min(CANDIDATES, key=lambda c: abs(c - M))]):
                config = dict(block_m=bm, block_n=bn, block_k=bk, group_m=8, num_warps=w, num_stages=s)
                try:
                    us = timeit(lambda: ops.lora_gemm(x, W, out=y, config=config))
                except Exception as exc:  # noqa: BLE001 (a config that does not fit: recorded, skipped)
                    tried.append(dict(config=config, error=type(exc).__name__))
                    continue
                tried.append(dict(config=config, us=round(us, 2)))
                if best is None or us < best[0]:
                    best = (us, config)
            default_us = timeit(lambda: ops.lora_gemm(x, W, out=y))
            torch.testing.assert_close(ops.lora_gemm(x, W).float(), torch.nn.functional.linear(x, W).float(),
                                       rtol=3e-2, atol=3e-2)
            row = dict(rows=M, K=K, N=N, cublas_us=round(cublas, 2), default_us=round(default_us, 2),
                       best_us=round(best[0], 2), best_config=best[1], best_over_cublas=round(best[0] / cublas, 3),
                       default_over_cublas=round(default_us / cublas, 3), tried=tried)
            out.append(row)
            print(f"GEMM {M:5d} x {K:5d} -> {N:5d}: cuBLAS {cublas:8.1f} us, Triton default {default_us:8.1f} us "
                  f"({default_us / cublas:.2f}x), best {best[0]:8.1f} us ({best[0] / cublas:.2f}x) {best[1]}", flush=True)
    return out


class Projections:
    """One layer's seven projections as LoRALinear modules over a pool (one layer), per backend."""

    def __init__(self, cfg, rank, n_adapters, device):
        self.cfg, self.device = cfg, device
        mods = modules(cfg)
        gen = torch.Generator().manual_seed(rank)
        self.registry = {f"a{k}": random_adapter(f"a{k}", rank, mods, 1, gen) for k in range(n_adapters)}
        self.pool = LoRAMemoryPool(mods, 1, n_adapters + 1, rank, dtype=torch.bfloat16, device=device,
                                   adapter_source=self.registry.__getitem__)
        torch.manual_seed(0)
        self.bases = {name: nn.Linear(i, o, bias=False, device=device, dtype=torch.bfloat16)
                      for name, (i, o) in shapes(cfg).items()}

    def layers(self, backend: str):
        context = LoRAContext()
        packed = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                  "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
                  "down_proj": ("down_proj", 0)}
        shared = {m: SharedShrink(self.pool.modules[m].stack_num) for m in {p[0] for p in packed.values()}}
        backend = backend_named(backend)
        wrapped = {name: LoRALinear(self.bases[name], self.pool, m, 0, context, backend, part=part, shared=shared[m])
                   for name, (m, part) in packed.items()}
        return wrapped, context

    def batch(self, rows, adapters, seg):
        """``rows`` rows in requests of ``seg`` tokens, request j on adapter j mod D (None: base)."""
        n_req = rows // seg
        uids = [None] * n_req if adapters == 0 else [f"a{j % adapters}" for j in range(n_req)]
        uid_to_slot = self.pool.prepare_lora_batch(uids)
        return batch_info_from_requests(uids, [seg] * n_req, uid_to_slot, self.pool.lora_ranks_host,
                                        self.pool.scalings_host, self.device)


def graph_of(fn, device):
    """A CUDA graph of ``fn`` (its replay), or ``fn`` itself on the CPU."""
    if device.type != "cuda":
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def layer_paths(cfg, ranks, cases, device, timeit) -> list[dict]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    out = []
    for rank in ranks:
        max_adapters = max(d for _, d in cases)
        proj = Projections(cfg, rank, max_adapters, device)
        for rows, D in cases:
            seg = 1 if rows <= 256 else rows // 4
            x = torch.randn(rows, h, device=device, dtype=torch.bfloat16)
            x_o = torch.randn(rows, h, device=device, dtype=torch.bfloat16)
            x_d = torch.randn(rows, i, device=device, dtype=torch.bfloat16)

            def run(layers):
                def step():
                    for n in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                        layers[n](x)
                    layers["o_proj"](x_o)
                    layers["down_proj"](x_d)
                return step

            times, results = {}, {}
            with torch.inference_mode():
                times["base"] = timeit(graph_of(run(proj.bases), device))
                for path, backend, adapters in (("separate", "triton", D), ("fused", "triton_fused", D),
                                                ("fused_gather", "triton_fused_gather", D),
                                                ("fused_base", "triton_fused", 0)):
                    layers, context = proj.layers(backend)
                    context.set_batch(proj.batch(rows, adapters, seg))
                    times[path] = timeit(graph_of(run(layers), device))
                    results[path] = layers["down_proj"](x_d).float()
            err = max((results[p] - results["separate"]).abs().max().item() for p in ("fused", "fused_gather"))
            scale = results["separate"].abs().max().item()
            row = dict(rows=rows, seg=seg, adapters=D, rank=rank, **{f"{k}_us": round(v, 2) for k, v in times.items()},
                       separate_overhead=round(times["separate"] / times["base"] - 1, 4),
                       fused_overhead=round(times["fused"] / times["base"] - 1, 4),
                       fused_gather_overhead=round(times["fused_gather"] / times["base"] - 1, 4),
                       fused_base_over_base=round(times["fused_base"] / times["base"], 4),
                       fused_vs_separate_max_abs_diff=round(err, 5), scale=round(scale, 3))
            out.append(row)
            print(f"{'decode' if seg == 1 else 'prefill'} {rows:5d} rows x {D:2d} adapters rank {rank:2d}: base "
                  f"{times['base']:8.1f} us, separate {times['separate']:8.1f} (+{100 * row['separate_overhead']:.1f}%), "
                  f"fused {times['fused']:8.1f} (+{100 * row['fused_overhead']:.1f}%), gather epilogue "
                  f"{times['fused_gather']:8.1f} (+{100 * row['fused_gather_overhead']:.1f}%), fused base {times['fused_base']:8.1f}"
                  f" ({row['fused_base_over_base']:.2f}x); |fused - separate| {err:.3g} of {scale:.3g}", flush=True)
        del proj
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (any machine)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--skip-sweep", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.smoke and device.type != "cuda":
        raise SystemExit("the full benchmark needs a CUDA device; --smoke runs anywhere")
    cfg = SMOKE if args.smoke else FULL
    timeit = timer(device, rep=40)
    if args.smoke:
        sweep = [] if args.skip_sweep else gemm_sweep(cfg, [16], device, timeit)
        paths = layer_paths(cfg, [4], [(4, 2), (16, 2)], device, timeit)
    else:
        sweep = [] if args.skip_sweep else gemm_sweep(cfg, [16, 64, 256, 8192], device, timeit)
        paths = layer_paths(cfg, args.ranks, DECODE + PREFILL, device, timeit)
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu"
    result = dict(device=name, torch=torch.__version__, triton=triton.__version__, smoke=args.smoke, model=cfg,
                  gemm=sweep, layer=paths,
                  method="do_bench median (us); layer paths: CUDA graph replay of one layer's 7 projections")
    out = args.out or (ROOT / "benchmarks" / "results" /
                       ("lora_gemm_smoke.json" if args.smoke else "lora_gemm_h200.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
