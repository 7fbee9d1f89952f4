"""Cases for chapter 06 (loading PEFT adapters: key names, target matching, scaling, fused packing).

The references are ``reference.adapters`` (``parse_lora_key``, ``targets_module``,
``module_rank_alpha`` with ``reference.lora_math.lora_scaling``) and ``reference.packed``
(``stack_lora_parts``), behind small wrappers with the learner's signatures. Every random group
contains the inputs that the anticipated mistakes get wrong (an in-memory key, a regex that only
matches part of a path, an rsLoRA config, a missing part), so a mistake costs the same points under
any hidden-case secret.
"""
from __future__ import annotations

import json
import math
import random
import re
from typing import Optional

import torch

from graders.core import Case, Exercise
from reference.adapters import AdapterConfig, module_rank_alpha, targets_module
from reference.adapters import parse_lora_key as _parse_lora_key
from reference.lora_math import lora_scaling
from reference.packed import stack_lora_parts

__all__ = ["EXERCISES", "parse_lora_key", "module_scaling", "pack_fused_module"]

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def _path(layer: int, proj: str, root: str = "model") -> str:
    return f"{root}.layers.{layer}.{PROJ[proj]}.{proj}"


# ---------------------------------------------------------------------------------------------
# ch06.1 parse_lora_key


def parse_lora_key(key: str) -> tuple[Optional[int], str, str]:
    """The exercise's contract: (layer, module, "A" | "B") of ``reference.adapters.parse_lora_key``
    (which also returns the path); ValueError on anything else."""
    k = _parse_lora_key(key)
    return k.layer, k.module, k.matrix


def _key_case(name: str, key: str, note: str = "") -> Case:
    return Case(name, [key], f"key {key!r}" + (f" ({note})" if note else ""), op="exact")


def _key_edge() -> list[Case]:
    P = "base_model.model."
    return [
        _key_case("q_proj_A_layer_3", P + _path(3, "q_proj") + ".lora_A.weight"),
        _key_case("down_proj_B_layer_0", P + _path(0, "down_proj") + ".lora_B.weight"),
        _key_case("two_digit_layer_31", P + _path(31, "v_proj") + ".lora_A.weight"),
        _key_case("without_the_base_model_prefix", _path(7, "o_proj") + ".lora_B.weight",
                  "vLLM and SGLang accept keys without 'base_model.model.'"),
        _key_case("lm_head_has_no_layer", P + "lm_head.lora_A.weight", "a module outside the decoder layers"),
        _key_case("moe_expert_in_layer_2", P + "model.layers.2.mlp.experts.5.up_proj.lora_B.weight",
                  "the layer is the number after 'layers.', not the expert's"),
        _key_case("in_memory_key_raises_value_error", P + _path(3, "q_proj") + ".lora_A.default.weight",
                  "a live PeftModel's state_dict key, with the adapter name 'default': saved files have none"),
        _key_case("dora_magnitude_raises_value_error", P + _path(3, "q_proj") + ".lora_magnitude_vector",
                  "DoRA's magnitude vector is not a LoRA matrix"),
        _key_case("lora_bias_raises_value_error", P + _path(3, "q_proj") + ".lora_B.bias",
                  "lora_bias=True adds a bias to lora_B"),
        _key_case("base_weight_raises_value_error", P + _path(3, "q_proj") + ".base_layer.weight",
                  "the base model's own weight"),
        _key_case("embedding_lora_raises_value_error", P + "model.embed_tokens.lora_embedding_A",
                  "LoRA on embeddings uses other names"),
    ]


def _key_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(8):
        proj, layer = rng.choice(sorted(PROJ)), rng.randrange(80)
        prefix = rng.choice(["base_model.model.", ""])
        root = rng.choice(["model", "model", "model.language_model"])
        key = f"{prefix}{_path(layer, proj, root)}.lora_{rng.choice('AB')}.weight"
        if i == 0:  # always one in-memory key, with some adapter name
            key = key.replace(".weight", f".{rng.choice(['default', 'sql', 'chat_v2'])}.weight")
        elif i == 1:
            key = f"{prefix}lm_head.lora_{rng.choice('AB')}.weight"
        elif i == 2:
            key = rng.choice([key.replace("lora_A.weight", "lora_magnitude_vector").replace("lora_B.weight", "lora_B.bias"),
                              key.replace(f"lora_{key[-8]}", "base_layer")])
        cases.append(_key_case(f"random_{i}", key))
    return cases


def _key_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 3):
        return "return a tuple (layer, module, matrix): an int or None, a str, and 'A' or 'B'"
    if isinstance(got[0], str):
        return f"the layer is an int (int({got[0]!r})), not the string it was parsed from; None when there is none"
    if got[0] != expected[0]:
        return ("the layer is the whole number right after the 'layers.' component (it may have several "
                "digits, and the key may lack the 'base_model.model.' prefix); None when the path has no "
                "'layers.N.' (lm_head)")
    if got[1] != expected[1]:
        return "the module is the path's last component, the one right before '.lora_A' / '.lora_B'"
    if got[2] != expected[2]:
        return "the matrix is the one-letter string 'A' or 'B'"
    return None


# ---------------------------------------------------------------------------------------------
# ch06.2 targets_module


def _target_case(name: str, targets, path: str) -> Case:
    kind = "a regex string" if isinstance(targets, str) and targets.lower() != "all-linear" else (
        "the all-linear shorthand" if isinstance(targets, str) else "a list of names")
    return Case(name, [targets, path], f"target_modules {targets!r} ({kind}), path {path!r}", op="exact")


def _target_edge() -> list[Case]:
    q0, up1, o1 = _path(0, "q_proj"), _path(1, "up_proj"), _path(1, "o_proj")
    return [
        _target_case("list_name_selects", ["q_proj", "v_proj"], q0),
        _target_case("list_other_name_does_not", ["q_proj", "v_proj"], _path(0, "k_proj")),
        _target_case("list_substring_is_not_a_name", ["proj"], q0),
        _target_case("list_suffix_starts_at_a_dot", ["p_proj"], up1),
        _target_case("list_dotted_suffix", ["layers.1.self_attn.o_proj"], o1),
        _target_case("list_dotted_suffix_other_layer", ["layers.1.self_attn.o_proj"], _path(11, "o_proj")),
        _target_case("list_whole_path", [up1], up1),
        _target_case("list_entries_are_not_regexes", [".*proj"], q0),
        _target_case("regex_must_match_the_whole_path", "q_proj", q0),
        _target_case("regex_alternation_partial", "q_proj|v_proj", _path(2, "v_proj")),
        _target_case("regex_full_path", r".*\.mlp\.(gate|up|down)_proj", up1),
        _target_case("regex_full_path_not_attention", r".*\.mlp\.(gate|up|down)_proj", o1),
        _target_case("regex_layer_1_not_10", r".*layers\.1\..*", _path(10, "up_proj")),
        _target_case("regex_prefix_is_not_enough", r".*layers\.1", o1),  # re.match would say True
        _target_case("all_linear", "all-linear", _path(5, "down_proj")),
        _target_case("all_linear_any_case", "All-Linear", q0),
    ]


def _random_regex(rng: random.Random) -> str:
    mods = rng.sample(sorted(PROJ), 2)
    names = "|".join(m.removesuffix("_proj") for m in mods)
    return rng.choice([rf".*\.({names})_proj", rf"({names})_proj", rf".*layers\.{rng.randrange(4)}\..*({names})_proj",
                       rf"model\.layers\.\d+\.{PROJ[mods[0]]}\.({names})_proj"])


def _target_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(10):
        proj, layer = rng.choice(sorted(PROJ)), rng.randrange(4)
        path = _path(layer, proj)
        if i == 0:  # always a regex that matches only part of a matching path
            targets = rf"({proj.removesuffix('_proj')}|zz)_proj"
        elif i < 5:
            targets = _random_regex(rng)
        elif i == 5:  # always a list entry that is a substring of the path's last component
            targets = [proj[1:], rng.choice(sorted(PROJ))]
        else:
            pool = sorted(PROJ) + [f"{PROJ[proj]}.{proj}", f"layers.{rng.randrange(4)}.{PROJ[proj]}.{proj}", "proj", "mlp"]
            targets = rng.sample(pool, rng.randint(1, 3))
        cases.append(_target_case(f"random_{i}", targets, path))
    return cases


def _target_hint(case: Case, expected, got) -> Optional[str]:
    targets, path = case.args
    if not isinstance(got, bool):
        return "return True or False (a bool): a re.Match object, None or a number is not a bool"
    if isinstance(targets, str) and targets.lower() == "all-linear":
        return "'all-linear' (in any case) selects every linear projection: return True"
    if isinstance(targets, str):
        if got and re.search(targets, path):
            return ("a string target_modules is a regex that must match the WHOLE path (re.fullmatch): "
                    "re.search accepts a match anywhere, so 'q_proj' would select every q projection, "
                    "while PEFT's 'q_proj' as a string selects nothing")
        return "the regex is matched against the full path, e.g. 'model.layers.0.self_attn.q_proj', with re.fullmatch"
    if got:
        return ("a list entry selects a path equal to it or ending in '.' + entry: a dot-separated suffix "
                "('q_proj', 'self_attn.q_proj'); a substring ('proj') or a suffix that does not start at a "
                "dot ('p_proj' for up_proj) selects nothing, and list entries are not regexes")
    return ("a list entry may be the module's name, a longer dot-separated suffix "
            "('layers.1.self_attn.o_proj') or the whole path")


# ---------------------------------------------------------------------------------------------
# ch06.3 module_scaling


def module_scaling(config: dict, path: str) -> tuple[int, float]:
    """The exercise's contract: (r, scaling) of the module at ``path`` under PEFT's rules."""
    cfg = AdapterConfig(r=config["r"], lora_alpha=config["lora_alpha"], target_modules="all-linear",
                        use_rslora=bool(config.get("use_rslora", False)),
                        rank_pattern=dict(config.get("rank_pattern") or {}),
                        alpha_pattern=dict(config.get("alpha_pattern") or {}))
    r, alpha = module_rank_alpha(cfg, path)
    return r, float(lora_scaling(alpha, r, cfg.use_rslora))


def _scaling_case(name: str, config: dict, path: str) -> Case:
    return Case(name, [config, path], f"config {json.dumps(config)}, path {path!r}", op="exact")


def _scaling_edge() -> list[Case]:
    q0, k1, up1, g1, o1 = (_path(0, "q_proj"), _path(1, "k_proj"), _path(1, "up_proj"), _path(1, "gate_proj"),
                           _path(1, "o_proj"))
    return [
        _scaling_case("plain_alpha_over_r", {"r": 8, "lora_alpha": 16}, q0),
        _scaling_case("rslora_alpha_over_sqrt_r", {"r": 8, "lora_alpha": 16, "use_rslora": True}, q0),
        _scaling_case("rslora_r_16_is_4x", {"r": 16, "lora_alpha": 16, "use_rslora": True}, up1),
        _scaling_case("use_rslora_false", {"r": 4, "lora_alpha": 8, "use_rslora": False}, q0),
        _scaling_case("rank_pattern_applies", {"r": 4, "lora_alpha": 8, "rank_pattern": {"k_proj": 2}}, k1),
        _scaling_case("rank_pattern_other_module", {"r": 4, "lora_alpha": 8, "rank_pattern": {"k_proj": 2}}, q0),
        _scaling_case("alpha_pattern_applies", {"r": 4, "lora_alpha": 8, "alpha_pattern": {"q_proj": 20}}, q0),
        _scaling_case("suffix_starts_at_a_dot", {"r": 4, "lora_alpha": 8, "rank_pattern": {"p_proj": 3}}, up1),
        _scaling_case("pattern_is_a_regex", {"r": 4, "lora_alpha": 8,
                                             "rank_pattern": {r"layers\.[01]\.self_attn\.(q|k)_proj": 6}}, k1),
        _scaling_case("pattern_must_reach_the_end", {"r": 4, "lora_alpha": 8, "rank_pattern": {"self_attn": 2}}, k1),
        _scaling_case("dotted_pattern", {"r": 4, "lora_alpha": 8, "rank_pattern": {"layers.1.self_attn.o_proj": 7}}, o1),
        _scaling_case("first_match_wins_not_most_specific",
                      {"r": 4, "lora_alpha": 8, "rank_pattern": {"gate_proj": 5, "layers.1.mlp.gate_proj": 2}}, g1),
        _scaling_case("rslora_with_patterns", {"r": 8, "lora_alpha": 16, "use_rslora": True,
                                               "rank_pattern": {"o_proj": 2}, "alpha_pattern": {"o_proj": 4}}, o1),
        _scaling_case("rank_0_raises_value_error", {"r": 0, "lora_alpha": 8}, q0),
        _scaling_case("rank_pattern_0_raises_value_error", {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 0}}, q0),
    ]


def _scaling_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(8):
        r = rng.choice([2, 4, 8, 16, 64])
        config = {"r": r, "lora_alpha": rng.choice([r, 2 * r, 16, 32])}
        if i % 2 == 0:  # every other case is rsLoRA
            config["use_rslora"] = True
        proj, layer = rng.choice(sorted(PROJ)), rng.randrange(4)
        if i % 4 != 3:
            names = rng.sample(sorted(PROJ), 3)
            config["rank_pattern"] = {n: rng.choice([1, 3, 8]) for n in names[:2]}
            config["alpha_pattern"] = {rng.choice([names[2], f"layers.{layer}.{PROJ[proj]}.{proj}"]): rng.choice([4, 12])}
        cases.append(_scaling_case(f"random_{i}", config, _path(layer, proj)))
    return cases


def _scaling_hint(case: Case, expected, got) -> Optional[str]:
    config, path = case.args
    if not (isinstance(got, tuple) and len(got) == 2):
        return "return a tuple (r, scaling): the module's rank (an int) and its scaling (a float)"
    r_exp, s_exp = expected
    r_got, s_got = got
    if r_got != r_exp:
        return ("the module's rank: the value of the FIRST rank_pattern key (in the dict's order) that "
                "matches a dot-separated suffix of the path as a regex, re.match(rf'(.*\\.)?({key})$', path); "
                "the global r when no key matches")
    if not isinstance(s_got, (int, float)):
        return None
    alpha = s_exp * (math.sqrt(r_exp) if config.get("use_rslora") else r_exp)
    if config.get("use_rslora") and math.isclose(s_got, alpha / r_exp, rel_tol=1e-9):
        return ("use_rslora: the scaling is lora_alpha / sqrt(r) (rsLoRA), not lora_alpha / r; read with "
                f"alpha / r this module would be sqrt({r_exp}) = {math.sqrt(r_exp):.3g} times too weak")
    if math.isclose(s_got * (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"]),
                    alpha, rel_tol=1e-9) and config["r"] != r_exp:
        return "the scaling uses the module's own rank (from rank_pattern), not the global r"
    return ("the module's alpha: the FIRST alpha_pattern key that matches the path (same rule as "
            "rank_pattern), else lora_alpha; scaling = alpha / r, or alpha / sqrt(r) with use_rslora")


# ---------------------------------------------------------------------------------------------
# ch06.4 pack_fused_module


def pack_fused_module(tensors: dict, prefix: str, parts, out_features, rank: int):
    """The exercise's contract: one layer's fused module from PEFT tensors, parts padded to ``rank``,
    a missing part zeros (``reference.packed.stack_lora_parts``); None when no part is present."""
    if len(parts) != len(out_features):
        raise ValueError(f"{len(parts)} parts but {len(out_features)} out_features")
    A_parts, B_parts = [], []
    for p in parts:
        a, b = tensors.get(f"{prefix}{p}.lora_A.weight"), tensors.get(f"{prefix}{p}.lora_B.weight")
        if a is None and b is None:
            A_parts.append(None)
            B_parts.append(None)
            continue
        if a is None or b is None:
            raise ValueError(f"{prefix}{p}: lora_A and lora_B come in pairs")
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r or not 1 <= r <= rank:
            raise ValueError(f"{prefix}{p}: A {list(a.shape)}, B {list(b.shape)} do not fit rank {rank}")
        A_pad, B_pad = a.new_zeros(rank, a.shape[1]), b.new_zeros(b.shape[0], rank)
        A_pad[:r], B_pad[:, :r] = a, b
        A_parts.append(A_pad)
        B_parts.append(B_pad)
    if all(a is None for a in A_parts):
        return None
    return stack_lora_parts(A_parts, B_parts, out_features)


def _pack_case(name: str, gen: torch.Generator, layer: int, parts, out_features, rank: int, d_in: int,
               ranks: dict, dtype=torch.float32, extra: bool = True, drop_b: Optional[str] = None,
               wide_b: Optional[str] = None, sub: Optional[str] = None) -> Case:
    """``ranks``: part -> its own rank (absent parts are missing). ``extra``: add other modules' and
    other layers' keys (layer + 10, o_proj) that must be ignored."""
    sub = sub or PROJ[parts[0]]
    prefix = f"base_model.model.model.layers.{layer}.{sub}."
    tensors = {}
    for p, w in zip(parts, out_features):
        if p in ranks:
            tensors[f"{prefix}{p}.lora_A.weight"] = torch.randn(ranks[p], d_in, generator=gen).to(dtype)
            width = w + 1 if p == wide_b else w
            tensors[f"{prefix}{p}.lora_B.weight"] = torch.randn(width, ranks[p], generator=gen).to(dtype)
    if drop_b is not None:
        del tensors[f"{prefix}{drop_b}.lora_B.weight"]
    if extra:
        other = f"base_model.model.model.layers.{layer + 10}.{sub}."
        for p, w in zip(parts, out_features):
            tensors[f"{other}{p}.lora_A.weight"] = torch.randn(2, d_in, generator=gen).to(dtype)
            tensors[f"{other}{p}.lora_B.weight"] = torch.randn(w, 2, generator=gen).to(dtype)
        tensors[f"base_model.model.model.layers.{layer}.self_attn.o_proj.lora_A.weight"] = torch.randn(3, 8, generator=gen).to(dtype)
    shapes = ", ".join(f"{p} A {list(tensors[f'{prefix}{p}.lora_A.weight'].shape)}"
                       f" B {list(tensors[f'{prefix}{p}.lora_B.weight'].shape)}" if f"{prefix}{p}.lora_B.weight" in tensors
                       else (f"{p} A only" if f"{prefix}{p}.lora_A.weight" in tensors else f"{p} missing")
                       for p in parts)
    own = {f"{prefix}{p}.lora_{m}.weight" for p in parts for m in "AB"}
    others = sum(k not in own for k in tensors)
    desc = (f"prefix {prefix!r}, parts {list(parts)}, out_features {list(out_features)}, rank {rank}; "
            f"in tensors: {shapes}; {others} other key(s); {dtype}")
    return Case(name, [tensors, prefix, list(parts), list(out_features), rank], desc, op="exact")


QKV, GATE_UP = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]


def _pack_edge() -> list[Case]:
    g = torch.Generator().manual_seed(61)
    return [
        _pack_case("one_part_o_proj", g, 0, ["o_proj"], [16], 2, 16, {"o_proj": 2}, extra=False),
        _pack_case("qkv_gqa_24_8_8", g, 1, QKV, [24, 8, 8], 4, 16, {p: 4 for p in QKV}),
        _pack_case("qkv_missing_k_is_zeros", g, 1, QKV, [24, 8, 8], 4, 16, {"q_proj": 4, "v_proj": 4}),
        _pack_case("gate_before_up", g, 0, GATE_UP, [20, 20], 3, 12, {"gate_proj": 3, "up_proj": 3}),
        _pack_case("up_only_gate_zeros_bf16", g, 2, GATE_UP, [20, 20], 3, 12, {"up_proj": 3}, torch.bfloat16),
        _pack_case("ranks_2_and_4_padded_to_7", g, 0, QKV, [24, 8, 8], 7, 16, {"q_proj": 4, "k_proj": 2}),
        _pack_case("no_part_in_this_layer_gives_none", g, 3, QKV, [24, 8, 8], 4, 16, {}),
        _pack_case("A_without_B_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, {p: 4 for p in QKV}, drop_b="k_proj"),
        _pack_case("rank_above_slot_rank_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, {"q_proj": 5}),
        _pack_case("B_wider_than_out_features_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16,
                   {p: 4 for p in QKV}, wide_b="v_proj"),
    ]


def _pack_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        parts = QKV if i % 2 == 0 else GATE_UP
        q = rng.choice([8, 24, 40, 72])
        widths = [q, q // 4 or 1, q // 4 or 1] if parts is QKV else [q, q]
        rank = rng.choice([4, 7, 16])
        present = [p for p in parts if rng.random() < 0.7] or [parts[-1]]
        if i < 2:  # always one missing part before a present one
            present = [p for p in parts if p != parts[-2]]
        ranks = {p: rng.choice([1, rank // 2 or 1, rank]) for p in present}
        cases.append(_pack_case(f"random_{i}", gen, rng.randrange(32), parts, widths, rank, rng.choice([8, 16, 40]),
                                ranks, rng.choice([torch.float32, torch.bfloat16])))
    return cases


def _pack_hint(case: Case, expected, got) -> Optional[str]:
    tensors, prefix, parts, out_features, rank = case.args
    if expected is None:
        return "when the layer has no part of this module, return None (the pool's zero-fill covers it)"
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
        return "return a tuple (A, B) of two tensors"
    (A_exp, B_exp), (A_got, B_got) = expected, got
    if A_got.shape[0] < A_exp.shape[0] and A_got.shape[0] % rank == 0:
        return ("a missing part still takes its place, as zeros: part i is rows [i*rank, (i+1)*rank) of A, "
                "so dropping k moves v to where the kernels read k")
    if A_got.shape[0] != A_exp.shape[0] or B_got.shape[1:] != B_exp.shape[1:]:
        return ("every part is padded to the slot's rank: A [len(parts) * rank, in] and B "
                "[sum(out_features), rank]; a part of rank r_i fills A rows [i*rank, i*rank + r_i) and B "
                "columns [0, r_i)")
    if len(parts) == 2 and A_got.shape == A_exp.shape:
        if torch.equal(A_got[:rank], A_exp[rank:]) and torch.equal(A_got[rank:], A_exp[:rank]):
            return "parts go in the order of `parts`: gate before up (TensorRT-LLM's swapped order is converted at load)"
    if A_got.shape == A_exp.shape and B_got.shape == B_exp.shape and not torch.equal(A_got, A_exp):
        return ("A: part i occupies rows [i*rank, i*rank + r_i), its own rank r_i from its lora_A's rows; "
                "the rows after it up to (i+1)*rank are zeros")
    return None


EXERCISES = [
    Exercise("ch06.1", "parse_lora_key", ("key",), parse_lora_key, _key_edge, _key_random, _key_hint),
    Exercise("ch06.2", "targets_module", ("target_modules", "path"), targets_module, _target_edge, _target_random,
             _target_hint),
    Exercise("ch06.3", "module_scaling", ("config", "path"), module_scaling, _scaling_edge, _scaling_random,
             _scaling_hint),
    Exercise("ch06.4", "pack_fused_module", ("tensors", "prefix", "parts", "out_features", "rank"),
             pack_fused_module, _pack_edge, _pack_random, _pack_hint),
]
