"""Cases for chapter 01 (LoRA from first principles).

Every clause the exercises state has a case: bf16 as well as fp32 (results keep the input's dtype),
scaling 0 and a fresh adapter (B = 0), where returning the input itself is tempting but the contract
asks for a new tensor (core's fresh_result check); r < 0 as well as r = 0; a Python float where one
is asked for (an int or a tensor that equals it is the wrong type); ``projection_shapes`` graded on
its own through a driver (ch01.5 and ch01.6), since a byte count or a FLOP ratio cannot tell in from
out.
"""
from __future__ import annotations

import random

import torch

from graders.machine.drivers import driven_reference, returns_python_float
from graders.machine.exercise import Case, Exercise
from reference import lora_math as ref
from reference.lora_math import LLAMA3_8B_CONFIG, LLAMA_PROJECTIONS

__all__ = ["EXERCISES", "size_driver", "share_driver"]


def _randn(gen: torch.Generator, *shape: int, std: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


def _layer(gen, lead: tuple[int, ...], d_in: int, d_out: int, r: int, dtype) -> list:
    x = _randn(gen, *lead, d_in, dtype=dtype)
    W = _randn(gen, d_out, d_in, std=d_in**-0.5, dtype=dtype)
    A = _randn(gen, r, d_in, std=d_in**-0.5, dtype=dtype)
    B = _randn(gen, d_out, r, std=r**-0.5, dtype=dtype)
    return [x, W, A, B]


def _forward_case(name, gen, lead, d_in, d_out, r, scaling, dtype) -> Case:
    x, W, A, B = _layer(gen, lead, d_in, d_out, r, dtype)
    desc = f"x {list(x.shape)}, W [{d_out}, {d_in}], A [{r}, {d_in}], B [{d_out}, {r}], scaling {scaling}, {dtype}"
    return Case(name, [x, W, A, B, scaling], desc)


def _forward_edge() -> list[Case]:
    g = torch.Generator().manual_seed(1)
    return [
        _forward_case("one_token_rank_1", g, (1,), 8, 8, 1, 2.0, torch.float32),
        _forward_case("scaling_0_is_base", g, (3,), 16, 24, 4, 0.0, torch.float32),
        _forward_case("non_square_odd_sizes", g, (5,), 72, 40, 7, 0.5, torch.float32),
        _forward_case("batch_and_sequence_dims", g, (2, 3), 32, 48, 8, 1.5, torch.float32),
        _forward_case("bf16_non_square", g, (4,), 40, 24, 4, 2.0, torch.bfloat16),
        _forward_case("bf16_batch_and_sequence_dims", g, (2, 2), 24, 40, 3, 0.5, torch.bfloat16),
    ]


def _forward_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32]):
        d_in, d_out, r = rng.randint(8, 160), rng.randint(8, 160), rng.choice([1, 2, 7, 8, 16])
        lead = (rng.randint(1, 12),) if i != 2 else (rng.randint(1, 3), rng.randint(1, 5))
        cases.append(_forward_case(f"random_{i}", gen, lead, d_in, d_out, r, rng.choice([0.25, 1.0, 2.0, 4.0]), dtype))
    return cases


def _close(got, alt, dtype) -> bool:
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    return isinstance(got, torch.Tensor) and got.shape == alt.shape and bool(
        torch.allclose(got.double(), alt, rtol=tol, atol=tol))


def _forward_hint(case: Case, expected, got) -> str | None:
    x, W, A, B, s = (a.cpu().double() if isinstance(a, torch.Tensor) else a for a in case.args)
    base, delta = x @ W.T, (x @ A.T) @ B.T
    if not isinstance(got, torch.Tensor) or s == 1.0:
        return None
    if _close(got, base + delta, case.args[0].dtype):
        return "the low-rank path is multiplied by scaling: x W^T + scaling * (x A^T) B^T"
    if _close(got, s * (base + delta), case.args[0].dtype):
        return "scaling multiplies only the low-rank path, not the base output x W^T"
    return None


def _merge_hint(merged: bool):
    def hint(case: Case, expected, got) -> str | None:
        W, A, B, s = (a.cpu().double() if isinstance(a, torch.Tensor) else a for a in case.args)
        if not isinstance(got, torch.Tensor):
            return None
        sign = -1.0 if merged else 1.0
        if s and _close(got, W - sign * s * (B @ A), case.args[0].dtype):
            return ("unmerge subtracts scaling * B @ A" if merged else "merge adds scaling * B @ A") + ", with this sign"
        if s != 1.0 and _close(got, W + sign * (B @ A), case.args[0].dtype):
            return "the product B @ A is multiplied by scaling"
        return None
    return hint


def _weights_case(name, gen, d_in, d_out, r, scaling, dtype, merged: bool, fresh_adapter: bool = False) -> Case:
    _, W, A, B = _layer(gen, (1,), d_in, d_out, r, dtype)
    if fresh_adapter:  # B = 0, as PEFT initializes it: the merge changes nothing, and still returns a new tensor
        B = torch.zeros_like(B)
    if merged:
        W = ref.merge_lora(W, A, B, scaling)
    what = "W_merged" if merged else "W"
    desc = f"{what} [{d_out}, {d_in}], A [{r}, {d_in}], B [{d_out}, {r}], scaling {scaling}, {dtype}"
    return Case(name, [W, A, B, scaling], desc, op="merge")


def _merge_edge(merged: bool):
    def make() -> list[Case]:
        g = torch.Generator().manual_seed(2 + merged)
        return [
            _weights_case("rank_1", g, 8, 8, 1, 1.0, torch.float32, merged),
            _weights_case("scaling_0_changes_nothing", g, 16, 12, 4, 0.0, torch.float32, merged),
            _weights_case("non_square_odd_sizes", g, 72, 40, 7, 2.0, torch.float32, merged),
            _weights_case("fresh_adapter_B_zero", g, 24, 16, 4, 2.0, torch.float32, merged, fresh_adapter=True),
            _weights_case("bf16_non_square", g, 40, 24, 4, 0.5, torch.bfloat16, merged),
            _weights_case("bf16_scaling_0", g, 16, 24, 2, 0.0, torch.bfloat16, merged),
        ]
    return make


def _merge_random(merged: bool):
    def make(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
        return [
            _weights_case(f"random_{i}", gen, rng.randint(8, 128), rng.randint(8, 128),
                          rng.choice([1, 4, 7, 16]), rng.choice([0.5, 1.0, 4.0]), dtype, merged)
            for i, dtype in enumerate([torch.float32, torch.bfloat16])
        ]
    return make


def _scaling_case(name, alpha, r, rs) -> Case:
    return Case(name, [alpha, r, rs], f"lora_alpha={alpha}, r={r}, use_rslora={rs}")


def _scaling_edge() -> list[Case]:
    return [
        _scaling_case("plain_r16_alpha16", 16, 16, False),
        _scaling_case("rslora_r16_alpha16", 16, 16, True),
        _scaling_case("plain_r8_alpha32", 32, 8, False),
        _scaling_case("rslora_r64_alpha8", 8, 64, True),
        _scaling_case("rank_1", 4, 1, True),
        _scaling_case("float_alpha_rslora", 0.5, 4, True),
        _scaling_case("rank_0_raises_value_error", 16, 0, False),
        _scaling_case("rank_0_rslora_raises_value_error", 16, 0, True),
        _scaling_case("negative_rank_raises_value_error", 16, -4, False),
        _scaling_case("negative_rank_rslora_raises_value_error", 16, -4, True),
    ]


def _scaling_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = [_scaling_case(f"random_{i}", rng.choice([1, 7, 8, 16, 32, 64, 128]), rng.choice([2, 3, 8, 12, 16, 64, 256]),
                           i % 2 == 1) for i in range(6)]
    cases[0] = _scaling_case("random_0", rng.choice([7, 9, 15]), rng.choice([2, 4, 8]), False)  # alpha / r not whole
    cases.append(_scaling_case("random_negative_rank", rng.choice([8, 16]), -rng.randint(1, 16), rng.random() < 0.5))
    return cases


def _learner_shapes(fn, config: dict) -> tuple:
    """The answer cell's own projection_shapes(config), as (in, out) pairs in the table's order."""
    shapes_fn = getattr(fn, "__globals__", {}).get("projection_shapes")
    if shapes_fn is None:
        raise NameError("the answer cell defines no projection_shapes (the exercise asks for it as well)")
    shapes = shapes_fn(config)
    if not isinstance(shapes, dict) or sorted(shapes) != sorted(LLAMA_PROJECTIONS):
        keys = sorted(shapes) if isinstance(shapes, dict) else type(shapes).__name__
        raise TypeError(f"projection_shapes(config) must return a dict with the seven module names as keys; got {keys}")
    out = []
    for m in LLAMA_PROJECTIONS:
        pair = shapes[m]
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"projection_shapes(config)[{m!r}] must be a tuple (in_features, out_features); got {pair!r}")
        out.append(tuple(pair))
    return tuple(out)


def size_driver(fn, *args):
    """ch01.5: a one-argument case grades projection_shapes(config); the others adapter_num_bytes."""
    if len(args) == 1:
        return _learner_shapes(fn, args[0])
    return fn(*args)


def share_driver(fn, *args):
    """ch01.6: a one-argument case grades the cell's projection_shapes(config) when the cell defines
    one (a cell that inlines the shapes in lora_flop_share is fine: the exercise asks for the share);
    the others lora_flop_share, which must return a Python float."""
    if len(args) == 1:
        if "projection_shapes" not in getattr(fn, "__globals__", {}):
            return _learner_shapes(ref.lora_flop_share, args[0])  # nothing of the learner's to check
        return _learner_shapes(fn, args[0])
    return returns_python_float(fn, *args)


_SHAPE_NAMES = tuple(f"projection_shapes(config)[{m!r}]" for m in LLAMA_PROJECTIONS)


def _shapes_case(name, cfg) -> Case:
    fields = ", ".join(f"{k}={v}" for k, v in cfg.items())
    return Case(name, [dict(cfg)], f"projection_shapes(config) with config {{{fields}}}", op="exact")


def _shapes_edge() -> list[Case]:
    return [_shapes_case("shapes_tiny_gqa", _TINY_GQA), _shapes_case("shapes_head_dim_given_explicitly", _HEAD_DIM),
            _shapes_case("shapes_no_gqa", _MHA), _shapes_case("shapes_llama3_8b", LLAMA3_8B_CONFIG)]


def _shapes_random(rng: random.Random) -> list[Case]:
    cfg = _random_config(rng)
    cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"] * 2  # always given, and not hidden // heads
    return [_shapes_case("shapes_random_0", _random_config(rng)), _shapes_case("shapes_random_head_dim", cfg)]


def _shapes_hint(case: Case, expected, got) -> str | None:
    if len(case.args) != 1 or not isinstance(got, tuple) or len(got) != 7:
        return None
    if all(isinstance(g, tuple) and tuple(g) == tuple(e[::-1]) for g, e in zip(got, expected) if g != tuple(e)):
        return "(in_features, out_features): a Linear's weight is [out, in], but the pair is in first, out second"
    cfg = case.args[0]
    if "head_dim" in cfg and isinstance(got[0], tuple) and got[0][1] == cfg["hidden_size"] != expected[0][1]:
        return "this config sets head_dim explicitly: q/k/v/o widths are heads x head_dim, not hidden"
    return None


_TINY_GQA = {"hidden_size": 72, "num_attention_heads": 6, "num_key_value_heads": 2, "intermediate_size": 200,
             "num_hidden_layers": 3}
_HEAD_DIM = {"hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
             "intermediate_size": 14336, "num_hidden_layers": 40}
_MHA = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
        "num_hidden_layers": 32}


def _config_desc(cfg: dict, targets, r, extra: str = "") -> str:
    fields = ", ".join(f"{k}={v}" for k, v in cfg.items())
    return f"config {{{fields}}}, target_modules {list(targets)}, r={r}{extra}"


def _size_case(name, cfg, targets, r, dtype) -> Case:
    return Case(name, [dict(cfg), list(targets), r, dtype], _config_desc(cfg, targets, r, f", dtype {dtype}"), op="exact")


def _size_edge() -> list[Case]:
    return [
        _size_case("tiny_gqa_q_only", _TINY_GQA, ["q_proj"], 2, torch.float32),
        _size_case("tiny_gqa_k_v", _TINY_GQA, ["k_proj", "v_proj"], 3, torch.float16),
        _size_case("llama3_8b_all_seven_r16_bf16", LLAMA3_8B_CONFIG, LLAMA_PROJECTIONS, 16, torch.bfloat16),
        _size_case("head_dim_given_explicitly", _HEAD_DIM, ["q_proj", "o_proj"], 8, torch.bfloat16),
        _size_case("no_gqa_mlp_only", _MHA, ["gate_proj", "up_proj", "down_proj"], 64, torch.float32),
        _size_case("unknown_module_raises_key_error", _TINY_GQA, ["q_proj", "lm_head"], 2, torch.float32),
        _size_case("unknown_module_only_raises_key_error", _MHA, ["qkv_proj"], 8, torch.bfloat16),
    ] + _shapes_edge()


def _random_config(rng: random.Random) -> dict:
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2, 3, 4])
    head_dim = rng.choice([8, 16, 64, 128])
    cfg = {"hidden_size": heads * head_dim, "num_attention_heads": heads, "num_key_value_heads": kv,
           "intermediate_size": rng.randint(2, 40) * 64, "num_hidden_layers": rng.randint(1, 48)}
    if rng.random() < 0.3:
        cfg["head_dim"] = head_dim * 2
    return cfg


def _size_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16]):
        targets = rng.sample(LLAMA_PROJECTIONS, rng.randint(2, 7)) if i else list(LLAMA_PROJECTIONS)
        cfg = _random_config(rng)
        if i == 1:  # an explicit head_dim that differs from hidden // heads, in every draw
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"] * 2
            targets = ["q_proj", *[t for t in targets if t != "q_proj"]]
        cases.append(_size_case(f"random_{i}", cfg, targets, rng.choice([1, 4, 8, 16, 64]), dtype))
    return cases + _shapes_random(rng)


def _size_hint(case: Case, expected, got) -> str | None:
    if len(case.args) == 1:
        return _shapes_hint(case, expected, got)
    cfg, targets, r, dtype = case.args
    if not isinstance(got, (int, float)):
        return None
    h = cfg["hidden_size"]
    if "head_dim" in cfg and cfg["head_dim"] != h // cfg["num_attention_heads"]:
        without = dict(cfg)
        del without["head_dim"]
        try:
            if got == ref.adapter_num_bytes(without, targets, r, dtype):
                return "this config sets head_dim explicitly: q/k/v/o widths are heads x head_dim, not hidden"
        except KeyError:
            pass
    if cfg.get("num_key_value_heads", cfg["num_attention_heads"]) != cfg["num_attention_heads"]:
        try:
            if got == ref.adapter_num_bytes({**cfg, "num_key_value_heads": cfg["num_attention_heads"]}, targets, r, dtype):
                return ("k_proj and v_proj are num_key_value_heads x head_dim wide (grouped-query attention), "
                        "not num_attention_heads x head_dim")
        except KeyError:
            pass
    square = 2 * h * r * len(targets) * cfg["num_hidden_layers"] * torch.empty((), dtype=dtype).element_size()
    if got == square and got != expected:
        return "that is the size if every projection were hidden x hidden; k/v (GQA) and the MLP are not square"
    if expected and got * torch.empty((), dtype=dtype).element_size() == expected:
        return "that is the parameter count; the exercise asks for bytes in the given dtype"
    return None


def _share_case(name, cfg, targets, r) -> Case:
    return Case(name, [dict(cfg), list(targets), r], _config_desc(cfg, targets, r), op="exact")


def _share_edge() -> list[Case]:
    return [
        _share_case("tiny_gqa_q_only", _TINY_GQA, ["q_proj"], 2),
        _share_case("llama3_8b_all_seven_r16", LLAMA3_8B_CONFIG, LLAMA_PROJECTIONS, 16),
        _share_case("head_dim_given_explicitly", _HEAD_DIM, ["q_proj", "k_proj", "o_proj"], 8),
        _share_case("no_gqa_mlp_only", _MHA, ["gate_proj", "up_proj", "down_proj"], 64),
    ] + _shapes_edge()


def _share_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i in range(5):
        targets = rng.sample(LLAMA_PROJECTIONS, rng.randint(2, 6))  # two or more, never all seven
        cfg = _random_config(rng)
        if i == 1:
            cfg["head_dim"] = cfg["hidden_size"] // cfg["num_attention_heads"] * 2
            targets = ["q_proj", *[t for t in targets if t != "q_proj"]]
        if i == 2:  # a module of the attention and one of the MLP: their shares differ
            targets = ["k_proj", "down_proj"]
        cases.append(_share_case(f"random_{i}", cfg, targets, rng.choice([1, 8, 16, 64])))
    return cases + _shapes_random(rng)


def _share_hint(case: Case, expected, got) -> str | None:
    if len(case.args) == 1:
        return _shapes_hint(case, expected, got)
    if isinstance(got, (int, float)) and expected and abs(got - 100 * expected) < 1e-9 * abs(100 * expected):
        return "return a fraction (0.006), not a percentage (0.6)"
    cfg, targets, r = case.args
    if isinstance(got, (int, float)) and abs(got - expected) > 1e-12:
        try:
            without = {k: v for k, v in cfg.items() if k != "head_dim"}
            if "head_dim" in cfg and abs(got - ref.lora_flop_share(without, targets, r)) <= 1e-9 * abs(got):
                return "this config sets head_dim explicitly: q/k/v/o widths are heads x head_dim, not hidden"
            no_gqa = {**cfg, "num_key_value_heads": cfg["num_attention_heads"]}
            if no_gqa != cfg and abs(got - ref.lora_flop_share(no_gqa, targets, r)) <= 1e-9 * abs(got):
                return ("k_proj and v_proj are num_key_value_heads x head_dim wide (grouped-query attention), "
                        "not num_attention_heads x head_dim")
        except (KeyError, ZeroDivisionError):
            pass
        try:
            shapes = ref.projection_shapes(cfg)
            lora = sum(r * (shapes[m][0] + shapes[m][1]) for m in targets)
            all_base = sum(i * o for i, o in shapes.values())
            mean = sum(r * (shapes[m][0] + shapes[m][1]) / (shapes[m][0] * shapes[m][1]) for m in targets) / len(targets)
        except (KeyError, ZeroDivisionError):
            return None
        if any(abs(got - k * expected) <= 1e-9 * abs(got) for k in (0.5, 2.0)):
            return "off by a factor 2: count 2 FLOPs per multiply-add on both sides (LoRA and base) or on neither"
        if abs(got - lora / all_base) <= 1e-9 * abs(got):
            return "the base FLOPs are those of the same targeted projections, not of all seven"
        if abs(got - mean) <= 1e-9 * abs(got):
            return "that is the mean of the per-module shares; the contract divides the sums (sum of LoRA FLOPs / sum of base FLOPs)"
    return None


EXERCISES = [
    Exercise("ch01.1", "lora_forward", ("x", "W", "A", "B", "scaling"), ref.lora_forward, _forward_edge, _forward_random,
             _forward_hint, default_device_probe=True),
    Exercise("ch01.2", "merge_lora", ("W", "A", "B", "scaling"), ref.merge_lora, _merge_edge(False), _merge_random(False),
             _merge_hint(False), default_device_probe=True),
    Exercise("ch01.3", "unmerge_lora", ("W_merged", "A", "B", "scaling"), ref.unmerge_lora, _merge_edge(True), _merge_random(True),
             _merge_hint(True), default_device_probe=True),
    Exercise("ch01.4", "lora_scaling", ("lora_alpha", "r", "use_rslora"),
             driven_reference(returns_python_float, ref.lora_scaling), _scaling_edge, _scaling_random,
             driver=returns_python_float),
    Exercise("ch01.5", "adapter_num_bytes", ("config", "target_modules", "r", "dtype"),
             driven_reference(size_driver, ref.adapter_num_bytes), _size_edge, _size_random, _size_hint,
             driver=size_driver, result_names=_SHAPE_NAMES),
    Exercise("ch01.6", "lora_flop_share", ("config", "target_modules", "r"),
             driven_reference(share_driver, ref.lora_flop_share), _share_edge, _share_random, _share_hint,
             driver=share_driver, result_names=_SHAPE_NAMES),
]
