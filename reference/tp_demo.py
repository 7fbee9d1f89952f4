"""Chapter 10's multi-process runs, as a script, so the notebook itself stays single-process:

    python -m reference.tp_demo layer [--tp 2] [--tokens 16] [--reps 30]

``layer``: one Llama-style decoder layer's four LoRA modules (qkv_proj and gate_up_proj
column-parallel, o_proj and down_proj row-parallel) at a small size, every variant, on ``tp`` gloo
processes: the bytes each collective really carried (logged by wrapping ``torch.distributed``,
:class:`reference.tp_lora.CollectiveLog`) beside :func:`reference.tp_lora.lora_comm_bytes`'s
prediction, the largest difference from the unsharded (TP=1) layer, and the median time of each
variant's forward through gloo on this machine's CPU. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from reference.batch_info import batch_info_from_requests
from reference.mem_pool import AdapterRegistry, LoRAMemoryPool, ModuleSpec
from reference.ops import torch_ref
from reference.tp_lora import (VARIANTS, CollectiveLog, TPLayout, TPModelConfig, lora_comm_bytes, shard_base_weight,
                               shard_pool_buffers, spawn_ranks, tp_lora_linear)

__all__ = ["LAYER_CONFIG", "layer_run"]

#: The layer of the run: 8 query heads and 2 kv heads of width 8, so kv heads split at tp 2 and
#: are replicated at tp 4.
LAYER_CONFIG = TPModelConfig(hidden=64, intermediate=128, num_heads=8, num_kv_heads=2)
MAX_RANK = 16
ADAPTERS = {"a": (4, 0.5), "b": (16, 2.0), "c": (8, 1.0)}  # uid -> (rank, scaling)


def _modules(cfg: TPModelConfig) -> dict:
    head = cfg.hidden // cfg.num_heads
    kv = cfg.num_kv_heads * head
    return {  # name -> (spec, parallel, heads per part)
        "qkv_proj": (ModuleSpec("qkv_proj", cfg.hidden, (cfg.hidden, kv, kv)), "column",
                     (cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads)),
        "gate_up_proj": (ModuleSpec("gate_up_proj", cfg.hidden, (cfg.intermediate, cfg.intermediate)), "column", None),
        "o_proj": (ModuleSpec("o_proj", cfg.hidden, (cfg.hidden,)), "row", None),
        "down_proj": (ModuleSpec("down_proj", cfg.intermediate, (cfg.hidden,)), "row", None),
    }


def _setup(tokens: int) -> dict:
    """Identical in every process (fixed seeds): pool, base weights, a mixed batch, inputs."""
    g = torch.Generator().manual_seed(3)
    modules = _modules(LAYER_CONFIG)
    registry = AdapterRegistry()
    for uid, (r, scaling) in ADAPTERS.items():
        registry.register(uid, r, scaling, {(0, s.name): (torch.randn(s.stack_num * r, s.in_features, generator=g) / 8,
                                                         torch.randn(s.out_total, r, generator=g) / 8)
                                            for s, _, _ in modules.values()})
    pool = LoRAMemoryPool([s for s, _, _ in modules.values()], 1, 4, MAX_RANK, adapter_source=registry.load)
    uids = [registry.uid_of(u) for u in ADAPTERS]
    slots = pool.prepare_lora_batch([None, *uids])
    requests = [uids[i % 3] if i % 4 else None for i in range(tokens)]  # one token per request: decode
    info = batch_info_from_requests(requests, [1] * tokens, slots, pool.lora_ranks_host, pool.scalings_host, "cpu")
    W = {n: torch.randn(s.out_total, s.in_features, generator=g) / 8 for n, (s, _, _) in modules.items()}
    x = {n: torch.randn(tokens, s.in_features, generator=g) for n, (s, _, _) in modules.items()}
    return dict(modules=modules, pool=pool, info=info, W=W, x=x)


def _unsharded(setup: dict, name: str) -> torch.Tensor:
    spec = setup["modules"][name][0]
    pool, info, x = setup["pool"], setup["info"], setup["x"][name]
    A, B = pool.A_buffer[name][0], pool.B_buffer[name][0]
    t = torch_ref.sgmv_shrink(x, A, info, torch.zeros(x.shape[0], A.shape[1]), stack_num=spec.stack_num)
    return torch_ref.sgmv_expand(t, B, info, x @ setup["W"][name].T, spec.slice_offsets)


def _rank(rank: int, world_size: int, tokens: int, reps: int) -> dict:
    setup = _setup(tokens)
    pool, info, out = setup["pool"], setup["info"], {}
    for name, (spec, parallel, units) in setup["modules"].items():
        layout = TPLayout(spec, parallel, world_size, units)
        W_local = shard_base_weight(setup["W"][name], layout, rank)
        lo, hi = layout.in_range(rank)
        x = setup["x"][name][:, lo:hi]
        want = _unsharded(setup, name)
        for variant in VARIANTS[parallel]:
            shard = shard_pool_buffers(pool.A_buffer[name][0], pool.B_buffer[name][0], pool.lora_ranks_host,
                                       layout, variant, rank)
            forward = lambda: tp_lora_linear(x, lambda v: v @ W_local.T, shard, info)  # noqa: E731
            with CollectiveLog() as log:
                y = forward()
            if parallel == "column":  # this rank's output rows of the packed output
                rows = torch.cat([torch.arange(a, b) for a, b in layout.part_ranges(rank)])
                err = (y - want[:, rows]).abs().max().item()
            else:
                err = (y - want).abs().max().item()
            times = []
            for _ in range(reps):
                dist.barrier()
                start = time.perf_counter()
                forward()
                times.append(time.perf_counter() - start)
            out[f"{name}/{variant}"] = {"collectives": log.log, "max_abs_error_vs_tp1": err,
                                        "median_ms": 1e3 * statistics.median(times)}
    return out


def layer_run(tp: int = 2, tokens: int = 16, reps: int = 30) -> dict:
    """The ``layer`` run (module docstring); returns the dict the script prints.

    Raises RuntimeError where gloo cannot run (see ``reference.tp_lora.tp_unavailable_reason``).
    """
    ranks = spawn_ranks(_rank, world_size=tp, backend="gloo", args=(tokens, reps))
    predicted = lora_comm_bytes(LAYER_CONFIG, MAX_RANK, tokens, 4, tp)
    rows = {}
    for key in ranks[0]:
        name, variant = key.split("/")
        logged = ranks[0][key]["collectives"]
        base_bytes = predicted["base"].get(name, 0) if variant in ("reduce_shrink", "reduce_with_base") else 0
        rows[key] = {
            "collectives": [list(c) for c in logged],
            "lora_bytes_logged": sum(b for _, b in logged) - base_bytes,
            "lora_bytes_predicted": predicted[name][variant],
            "max_abs_error_vs_tp1": max(r[key]["max_abs_error_vs_tp1"] for r in ranks),
            "median_ms": max(r[key]["median_ms"] for r in ranks),
        }
    return {"tp": tp, "tokens": tokens, "max_rank": MAX_RANK, "config": vars(LAYER_CONFIG), "dtype": "float32",
            "device": "cpu (gloo)", "torch": torch.__version__, "rows": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["layer"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    json.dump(layer_run(args.tp, args.tokens, args.reps), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
