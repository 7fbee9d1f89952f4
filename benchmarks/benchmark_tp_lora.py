"""Chapter 10 at real sizes: what LoRA adds to a tensor-parallel Llama step, TP=1 against TP=2 (issue #14).

    python benchmarks/benchmark_tp_lora.py --tp 1 2 --out benchmarks/results/tp_lora_h200x2.json  # NCCL, GPU per rank
    python benchmarks/benchmark_tp_lora.py --smoke --out /tmp/tp_lora.json   # gloo on the CPU, tiny sizes (any machine)

Model: Llama-3-8B's layer shapes (hidden 4096, intermediate 14336, 32 query heads and 8 kv heads of
128, vocab 32000), ``--layers`` layers (default 4), random weights from a fixed seed (the same
tensors in every rank's process), bf16, run by :class:`reference.tp.model.TPLlama` (qkv_proj and
gate_up_proj column-parallel, o_proj and down_proj row-parallel: two all-reduces per layer) over a
:class:`reference.tp.pool.TPLoRAMemoryPool` of max rank ``--rank`` holding ``--adapters`` adapters of
that rank, with the Triton backend on CUDA (the torch references on the CPU).

For each variant pair of chapter 10 (``replicated_A`` + ``reduce_with_base``: LoRA adds no
collective; ``fully_sharded`` + ``reduce_shrink``: an all-gather and an all-reduce of the shrink
output per layer and module) and each step:

- decode: ``--seqs`` sequences of one token, the cache holding ``--context`` positions each;
- prefill: ``--prefill-seqs`` prompts of ``--prefill-len`` tokens,

it times the base step (no adapter in the batch: no LoRA launch, no LoRA collective) and the LoRA
step (request i on adapter i mod D), eagerly (no CUDA graph: the collectives are launched from
Python), as the median over ``--reps`` repetitions of the slowest rank (every repetition starts
after a barrier and ends after a synchronization). LoRA overhead = lora_ms / base_ms - 1.

Collectives: one base step and one LoRA step run under :class:`reference.tp.lora.CollectiveLog`,
which logs (op, bytes) per call; each distinct (op, bytes) is then timed alone on the same group
(median of ``--reps``), so each row lists every collective with its count and time, and the step's
collective time (base and LoRA).

Checks beside the timings: the LoRA steps' logits at TP=2 against TP=1 (the decode step's, and the
prefill's last position), as the largest absolute difference over the logits' largest magnitude.
Target (issue #14): the LoRA overhead at TP=2 at most 1.2x the one at TP=1, per variant pair and
step; the script prints which are met.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmark_decode_step import random_adapter  # noqa: E402
from reference.batch_info import batch_info_from_requests  # noqa: E402
from reference.mem_pool import LoRAAdapter  # noqa: E402
from reference.tp.lora import CollectiveLog, spawn_ranks, tp_device, tp_unavailable_reason  # noqa: E402
from reference.tp.model import LlamaCheckpoint, TPLlama, llama_pool_modules, llama_tp_layouts  # noqa: E402
from reference.tp.pool import TPLoRAMemoryPool  # noqa: E402

FULL = dict(hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8, head_dim=128, vocab=32000)
SMOKE = dict(hidden=64, intermediate=128, num_heads=8, num_kv_heads=2, head_dim=8, vocab=128)
PAIRS = (("replicated_A", "reduce_with_base"), ("fully_sharded", "reduce_shrink"))
TARGET_RATIO = 1.2


def random_checkpoint(sizes: dict, layers: int, dtype: torch.dtype, seed: int = 0) -> LlamaCheckpoint:
    """A Llama's tensors from a fixed seed (identical in every process), scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    h, inter, hd = sizes["hidden"], sizes["intermediate"], sizes["head_dim"]
    q, kv = sizes["num_heads"] * hd, sizes["num_kv_heads"] * hd

    def lin(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=g) * in_f ** -0.5).to(dtype)

    w = {"model.embed_tokens.weight": torch.randn(sizes["vocab"], h, generator=g).to(dtype),
         "model.norm.weight": torch.ones(h, dtype=dtype), "lm_head.weight": lin(sizes["vocab"], h),
         "model.rotary_emb.inv_freq": 1.0 / (500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))}
    for i in range(layers):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
                  p + "self_attn.q_proj.weight": lin(q, h), p + "self_attn.k_proj.weight": lin(kv, h),
                  p + "self_attn.v_proj.weight": lin(kv, h), p + "self_attn.o_proj.weight": lin(h, q),
                  p + "mlp.gate_proj.weight": lin(inter, h), p + "mlp.up_proj.weight": lin(inter, h),
                  p + "mlp.down_proj.weight": lin(h, inter)})
    return LlamaCheckpoint(h, inter, layers, sizes["num_heads"], sizes["num_kv_heads"], hd, sizes["vocab"], 1e-5,
                           1.0, w)


def adapter_source(ckpt: LlamaCheckpoint, rank: int):
    """uid "a<i>" -> the decode-step benchmark's random adapter of rank ``rank`` on every module and
    layer, seeded by i (the same weights in every rank's process)."""
    modules = llama_pool_modules(ckpt)

    def source(uid: str) -> LoRAAdapter:
        gen = torch.Generator().manual_seed(1000 + int(uid[1:]))
        return random_adapter(uid, rank, modules, ckpt.num_layers, gen)
    return source


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_ms(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up (Triton compiles, NCCL connects)
    times = []
    for _ in range(reps):
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _collective_us(op: str, nbytes: int, world: int, dtype: torch.dtype, device: torch.device, reps: int) -> float:
    """One collective of the logged size, alone on the default group: median us."""
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()
    if op == "all_reduce":
        t = torch.zeros(numel, dtype=dtype, device=device)
        return 1e3 * _median_ms(lambda: dist.all_reduce(t), device, reps)
    piece = torch.zeros(numel // world, dtype=dtype, device=device)
    outs = [torch.empty_like(piece) for _ in range(world)]
    return 1e3 * _median_ms(lambda: dist.all_gather(outs, piece), device, reps)


def _step(model, pool, device, uids, ids, positions, rows):
    info = batch_info_from_requests(uids, [ids.shape[1]] * len(uids), pool.prepare_lora_batch(uids),
                                    pool.lora_ranks_host, pool.scalings_host, device)
    return lambda: model(ids, positions, rows, info)


def _rank(rank: int, world: int, opts: dict) -> dict:
    """One rank of one TP size: every variant pair, both steps (module docstring)."""
    device = tp_device(dist.get_backend(), rank)
    dtype = getattr(torch, opts["dtype"])
    ckpt = random_checkpoint(opts["sizes"], opts["layers"], dtype)
    layouts = llama_tp_layouts(ckpt, world)
    D, reps = opts["adapters"], opts["reps"]
    source = adapter_source(ckpt, opts["rank"])
    seqs, context, p_seqs, p_len = opts["seqs"], opts["context"], opts["prefill_seqs"], opts["prefill_len"]
    g = torch.Generator().manual_seed(7)
    steps = {
        "decode": (torch.randint(0, ckpt.vocab, (seqs, 1), generator=g),
                   torch.full((seqs, 1), context, dtype=torch.int64), torch.arange(seqs)),
        "prefill": (torch.randint(0, ckpt.vocab, (p_seqs, p_len), generator=g),
                    torch.arange(p_len).expand(p_seqs, p_len).contiguous(), torch.arange(p_seqs)),
    }
    out = {}
    for column, row in PAIRS:
        variants = {"qkv_proj": column, "gate_up_proj": column, "o_proj": row, "down_proj": row}
        pool = TPLoRAMemoryPool(layouts, variants, ckpt.num_layers, D + 1, opts["rank"], dtype=dtype, device=device,
                                adapter_source=source)
        model = TPLlama(ckpt, pool, max_rows=max(seqs, p_seqs), max_len=max(context + 1, p_len),
                        backend="triton" if device.type == "cuda" else "torch")
        for name, (ids, positions, rows) in steps.items():
            ids, positions, rows = ids.to(device), positions.to(device), rows.to(device)
            n = ids.shape[0]
            base = _step(model, pool, device, [None] * n, ids, positions, rows)
            lora = _step(model, pool, device, [f"a{i % D}" for i in range(n)], ids, positions, rows)
            with torch.inference_mode():
                with CollectiveLog() as base_log:
                    base()
                with CollectiveLog() as lora_log:
                    logits = lora()
                _sync(device)
                base_ms, lora_ms = _median_ms(base, device, reps), _median_ms(lora, device, reps)
                base_n, lora_n = Counter(base_log.log), Counter(lora_log.log)
                collectives = [dict(op=op, bytes=nbytes, base_count=base_n[(op, nbytes)],
                                    lora_count=lora_n[(op, nbytes)],
                                    us=_collective_us(op, nbytes, world, dtype, device, reps) if world > 1 else 0.0)
                               for op, nbytes in sorted(base_n | lora_n)]
            out[f"{column}+{row}/{name}"] = dict(
                base_ms=base_ms, lora_ms=lora_ms, collectives=collectives,
                logits=logits[:, -1].float().cpu() if rank == 0 else None)
    return out


def _summary(ranks: list) -> dict:
    rows = {}
    for key in ranks[0]:
        base_ms = max(r[key]["base_ms"] for r in ranks)
        lora_ms = max(r[key]["lora_ms"] for r in ranks)
        coll = ranks[0][key]["collectives"]
        rows[key] = dict(base_ms=round(base_ms, 3), lora_ms=round(lora_ms, 3),
                         lora_overhead=round(lora_ms / base_ms - 1, 4), collectives=coll,
                         base_collective_us=round(sum(c["base_count"] * c["us"] for c in coll), 1),
                         lora_collective_us=round(sum(c["lora_count"] * c["us"] for c in coll), 1))
    return rows


def run(tps, opts: dict, backend: str) -> dict:
    """Every TP size in ``tps`` (each in its own process group); returns the results dict."""
    results, logits, skipped = {}, {}, {}
    for tp in tps:
        reason = tp_unavailable_reason(backend, tp)
        if reason is not None:
            skipped[str(tp)] = reason
            print(f"TP={tp}: skipped ({reason})", flush=True)
            continue
        ranks = spawn_ranks(_rank, world_size=tp, backend=backend, args=(opts,))
        results[str(tp)] = _summary(ranks)
        logits[tp] = {k: v["logits"] for k, v in ranks[0].items()}
        for key, row in results[str(tp)].items():
            print(f"TP={tp} {key:38s} base {row['base_ms']:9.3f} ms  LoRA {row['lora_ms']:9.3f} ms  "
                  f"overhead {100 * row['lora_overhead']:6.1f}%  collectives base {row['base_collective_us']:8.1f} us"
                  f"  LoRA {row['lora_collective_us']:8.1f} us", flush=True)
    checks, targets = {}, []
    for tp in logits:
        if tp == 1 or 1 not in logits:
            continue
        for key, got in logits[tp].items():
            want = logits[1][key]
            checks[f"TP={tp} {key}"] = round(((got - want).abs().max() / want.abs().max()).item(), 6)
            one, many = results["1"][key]["lora_overhead"], results[str(tp)][key]["lora_overhead"]
            # an overhead at or under 0 at TP=1 is noise: no ratio, met only when TP=2's is too
            ratio = round(many / one, 3) if one > 0 else None
            met = ratio <= TARGET_RATIO if ratio is not None else many <= 0
            targets.append(dict(target=f"#14: LoRA overhead at TP={tp} <= {TARGET_RATIO}x TP=1 ({key})",
                                tp1=one, tp=many, ratio=ratio, met=bool(met)))
    return dict(results=results, skipped=skipped, logits_max_rel_diff_vs_tp1=checks, targets=targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-seqs", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, fp32, gloo on the CPU (no timing meaning)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    backend = "nccl" if cuda else "gloo"
    opts = dict(sizes=SMOKE if args.smoke else FULL, dtype="bfloat16" if cuda else "float32",
                layers=2 if args.smoke else args.layers, rank=4 if args.smoke else args.rank,
                adapters=3 if args.smoke else args.adapters, seqs=8 if args.smoke else args.seqs,
                context=12 if args.smoke else args.context, prefill_seqs=2 if args.smoke else args.prefill_seqs,
                prefill_len=16 if args.smoke else args.prefill_len, reps=3 if args.smoke else args.reps)
    start = time.monotonic()
    out = run(args.tp, opts, backend)
    for t in out["targets"]:
        print(("met:    " if t["met"] else "missed: ") + t["target"] + f" (TP=1 {100 * t['tp1']:.1f}%, "
              f"TP={t['target'].split('TP=')[1].split()[0]} {100 * t['tp']:.1f}%, ratio "
              f"{'n/a' if t['ratio'] is None else format(t['ratio'], '.2f')})")
    device = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if cuda
              else f"cpu ({platform.processor() or platform.machine()}, gloo)")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        device=device, backend=backend, torch=torch.__version__, nccl=nccl,
        triton=__import__("triton").__version__ if cuda else None, options=opts,
        method="eager steps; median of reps of the slowest rank, each after a barrier, synchronized; collectives "
               "logged by CollectiveLog and timed alone at the logged sizes",
        seconds=round(time.monotonic() - start, 1), **out), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
