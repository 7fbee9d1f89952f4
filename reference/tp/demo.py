"""Chapter 10's multi-process runs, as a script, so the notebook itself stays single-process:

    python -m reference.tp.demo layer [--tp 2] [--tokens 16] [--reps 30]
    python -m reference.tp.demo model [--tp 2] [--steps 3]

``layer``: one Llama-style decoder layer's four LoRA modules (qkv_proj and gate_up_proj
column-parallel, o_proj and down_proj row-parallel) at a small size, every variant, on ``tp`` gloo
processes: the bytes each collective really carried (logged by wrapping ``torch.distributed``,
:class:`reference.tp.lora.CollectiveLog`) beside :func:`reference.tp.lora.lora_comm_bytes`'s
prediction, the largest difference from the unsharded (TP=1) layer, and the median time of each
variant's forward through gloo on this machine's CPU.

``model``: a tiny Llama (built from a config, no download) with three PEFT adapters of ranks 4, 8
(rsLoRA) and 16 and the base model in one batch, at TP=``tp`` on a :class:`~reference.tp.pool.
TPLoRAMemoryPool` and :class:`~reference.tp.model.TPLlama`, for two variant pairs (replicated A with
the delta inside the base all-reduce; fully sharded with the shrink output reduced): prefill and
greedy decode against TP=1 (chapter 07's layers) and against PEFT; then an eviction sequence on a
pool of 3 slots (the victims on every rank), an adapter that only rank 1 finds malformed (every rank
refuses it, no rank's pool changes), and ranks whose request streams differed once
(:func:`~reference.tp.pool.demonstrate_disagreement`).

Each prints one JSON object. The tests (tests/test_tp_lora.py, tests/test_tp_model.py) hold the
same rules to more cases; this is what the notebook shows.
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
from reference.tp.lora import (VARIANTS, CollectiveLog, TPLayout, TPModelConfig, lora_comm_bytes, shard_base_weight,
                               shard_pool_buffers, spawn_ranks, tp_lora_linear)

__all__ = ["LAYER_CONFIG", "MODEL_CONFIG", "layer_run", "model_run"]

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

    Raises RuntimeError where gloo cannot run (see ``reference.tp.lora.tp_unavailable_reason``).
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


# ---- the model run -------------------------------------------------------------------------------
#: The tiny Llama: 4 query heads and 2 kv heads, 2 layers.
MODEL_CONFIG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=96, vocab_size=128, max_position_embeddings=64)
MODEL_ADAPTERS = {
    "r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]),
    "r8": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "r16": dict(r=16, lora_alpha=24, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"]),
}
BATCH = (["r8", None, "r4", "r16"], [5, 7, 3, 6])  # one request per row, right-padded
PAIRS = (("replicated_A", "reduce_with_base"), ("fully_sharded", "reduce_shrink"))
#: 3 slots for 3 adapters and the base: the third batch evicts r4, the fourth r8 (LRU)
EVICTION = [["r4", "r8"], ["r8"], ["r16", None], ["r4", "r16"]]


def _variants(column: str, row: str) -> dict:
    return {"qkv_proj": column, "gate_up_proj": column, "o_proj": row, "down_proj": row}


def _model_rank(rank: int, world_size: int, ckpt, dirs: dict, ids: torch.Tensor, steps: int) -> dict:
    from reference.adapters import load_peft_adapter
    from reference.mem_pool import LoRAAdapter, snapshot_diff
    from reference.tp.model import TPLlama, greedy_generate, llama_pool_modules, llama_tp_layouts
    from reference.tp.pool import TPLoRAMemoryPool, demonstrate_disagreement

    modules, layouts, layers = llama_pool_modules(ckpt), llama_tp_layouts(ckpt, world_size), ckpt.num_layers

    def source(uid):
        if uid == "bad":  # r4's weights, with one A one row short on rank 1 only
            good = load_peft_adapter(dirs["r4"], modules, layers, MAX_RANK, uid="bad")
            if rank != 1:
                return good
            key = next(iter(good.weights))
            return LoRAAdapter("bad", good.rank, good.scaling,
                               {**good.weights, key: (good.weights[key][0][:-1], good.weights[key][1])})
        return load_peft_adapter(dirs[uid], modules, layers, MAX_RANK, uid=uid)

    out = {"runs": {}}
    for column, row in PAIRS:
        pool = TPLoRAMemoryPool(layouts, _variants(column, row), layers, 4, MAX_RANK, adapter_source=source)
        model = TPLlama(ckpt, pool, max_rows=ids.shape[0], max_len=ids.shape[1] + steps)
        out["runs"][f"{column}+{row}"] = greedy_generate(model, pool, *BATCH, ids, steps)
    pool = TPLoRAMemoryPool(layouts, _variants(*PAIRS[1]), layers, 3, MAX_RANK, adapter_source=source)
    model = TPLlama(ckpt, pool, max_rows=2, max_len=ids.shape[1])
    slot_maps = []
    for uids in EVICTION:
        greedy_generate(model, pool, uids, [4] * len(uids), ids[:len(uids), :4], 0)
        slot_maps.append([str(u) for u in pool.buffer_id_to_uid])
    pool.check_agreement()  # raises on every rank if the victims differed
    before = pool.snapshot()
    try:
        pool.prepare_lora_batch(["bad"])
        refused = ""
    except ValueError as err:
        refused = str(err)
    out.update(slot_maps=slot_maps, evictions=[list(map(str, e)) for e in pool.events if e[0] == "evict"],
               refused=refused, changed_by_refusal=snapshot_diff(before, pool.snapshot()),
               disagreement=demonstrate_disagreement(rank, world_size))
    return out


def model_run(tp: int = 2, steps: int = 3) -> dict:
    """The ``model`` run (module docstring); returns the dict the script prints.

    Raises RuntimeError where gloo cannot run; ImportError without transformers and peft.
    """
    import copy
    import tempfile
    import warnings

    import peft
    import transformers

    from reference.adapters import load_peft_adapter
    from reference.layers import LoRAContext, wrap_llama
    from reference.static_llama import StaticKVLlama
    from reference.tp.model import greedy_generate, llama_checkpoint, llama_pool_modules

    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL_CONFIG)).eval()
    uids, lens = BATCH
    ids = torch.randint(0, MODEL_CONFIG["vocab_size"], (len(lens), max(lens)), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory(prefix="tp_demo_") as root, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dirs = {}
        for seed, (name, kw) in enumerate(MODEL_ADAPTERS.items()):
            torch.manual_seed(200 + seed)
            peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(
                f"{root}/{name}")
            dirs[name] = f"{root}/{name}"
        ckpt = llama_checkpoint(base)
        ranks = spawn_ranks(_model_rank, world_size=tp, backend="gloo", args=(ckpt, dirs, ids, steps))
        modules, layers = llama_pool_modules(ckpt), ckpt.num_layers
        pool = LoRAMemoryPool(modules, layers, 4, MAX_RANK, adapter_source=lambda u: load_peft_adapter(
            dirs[u], modules, layers, MAX_RANK, uid=u))
        context = LoRAContext()
        llm = StaticKVLlama(wrap_llama(copy.deepcopy(base), pool, context), max_rows=len(lens), max_len=max(lens) + steps)

        def run(x, positions, rows, info):
            context.set_batch(info)
            with torch.no_grad():
                return llm(x, positions, rows)
        tp1 = greedy_generate(run, pool, uids, lens, ids, steps)
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs["r4"], adapter_name="r4")
        for name in ("r8", "r16"):
            pm.load_adapter(dirs[name], adapter_name=name)
        pm.eval()
        with torch.no_grad():
            base_logits = base(input_ids=ids).logits  # right padding: the real tokens are causal prefixes
    rows = {}
    real = torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]
    adapter_rows = real & torch.tensor([u is not None for u in uids])[:, None]
    for pair, got in ranks[0]["runs"].items():
        tokens = got["tokens"]
        full = torch.zeros(len(lens), max(lens) + steps, dtype=torch.long)  # prompt + generated, for PEFT
        mask = torch.zeros_like(full)
        for b, n in enumerate(lens):
            full[b, :n + steps] = torch.cat([ids[b, :n], tokens[:steps, b]])
            mask[b, :n + steps] = 1
        with torch.no_grad():
            want = pm(input_ids=full, attention_mask=mask,
                      adapter_names=["__base__" if u is None else u for u in uids]).logits
        peft_decode = torch.stack([want[torch.arange(len(lens)), torch.tensor(lens) + s] for s in range(steps)])
        rows[pair] = {
            "ranks_bit_identical": all(torch.equal(r["runs"][pair]["prefill"], got["prefill"]) and
                                       torch.equal(r["runs"][pair]["tokens"], tokens) for r in ranks),
            "prefill_max_error_vs_tp1": (got["prefill"] - tp1["prefill"])[real].abs().max().item(),
            "decode_max_error_vs_tp1": (got["decode"] - tp1["decode"]).abs().max().item(),
            "prefill_max_error_vs_peft": (got["prefill"] - want[:, :max(lens)])[real].abs().max().item(),
            "decode_max_error_vs_peft": (got["decode"] - peft_decode).abs().max().item(),
            "tokens_equal_tp1": torch.equal(tokens, tp1["tokens"]),
            "logits_max_abs": tp1["prefill"][real].abs().max().item(),
            # not vacuous: what the adapters change, and that the base row gets exactly nothing
            "adapter_rows_max_delta_vs_base": (got["prefill"] - base_logits)[adapter_rows].abs().max().item(),
            "base_row_max_error_vs_base": (got["prefill"] - base_logits)[real & ~adapter_rows].abs().max().item(),
        }
    return {"tp": tp, "steps": steps, "batch": [str(u) for u in uids], "prompt_lens": lens, "dtype": "float32",
            "device": "cpu (gloo)", "torch": torch.__version__, "rows": rows,
            "slot_maps": [r["slot_maps"] for r in ranks], "evictions": [r["evictions"] for r in ranks],
            "refused": [r["refused"] for r in ranks], "changed_by_refusal": [r["changed_by_refusal"] for r in ranks],
            "disagreement": [r["disagreement"] for r in ranks]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["layer", "model"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    result = layer_run(args.tp, args.tokens, args.reps) if args.what == "layer" else model_run(args.tp, args.steps)
    json.dump(result, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
