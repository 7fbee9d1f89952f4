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

from graders.machine.exercise import Case, Exercise
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
        _key_case("number_before_the_layers_component", P + "model.blocks.0.layers.5.mlp.up_proj.lora_A.weight",
                  "the layer is the number after the 'layers' component, not the first number of the path"),
        _key_case("sublayers_is_not_the_layers_component", P + "model.sublayers.3.self_attn.q_proj.lora_A.weight",
                  "'sublayers' is another component: no layer"),
        _key_case("layers_N_must_be_followed_by_a_component", P + "model.layers.3.lora_B.weight",
                  "'layers.3' is the path's end, the module is '3': no 'layers.N.' inside the path"),
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
        _key_case("empty_component_raises_value_error", P + "model..self_attn.q_proj.lora_A.weight",
                  "'model..self_attn': an empty component between two dots"),
        _key_case("leading_dot_raises_value_error", ".q_proj.lora_B.weight", "the path starts with an empty component"),
        _key_case("component_with_a_hyphen_raises_value_error", P + "model.layers.0.self-attn.q_proj.lora_A.weight",
                  "'self-attn': components are letters, digits and underscores"),
        _key_case("lora_A_inside_a_component_raises_value_error", P + _path(3, "q_proj") + ".my_lora_A.weight",
                  "'my_lora_A' only ends in 'lora_A': the matrix must be a whole component"),
        _key_case("lowercase_lora_a_raises_value_error", P + _path(3, "q_proj") + ".lora_a.weight",
                  "the matrix letter is 'A' or 'B', upper case"),
        _key_case("weight_scale_raises_value_error", P + _path(3, "q_proj") + ".lora_A.weight_scale",
                  "a quantized checkpoint's scale: the key must end in '.weight'"),
    ]


def _key_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw has one key of each family (at a fixed index), with random names and numbers."""
    cases = []
    for i in range(12):
        proj, layer = rng.choice(sorted(PROJ)), rng.randrange(80)
        prefix = rng.choice(["base_model.model.", ""])
        root = rng.choice(["model", "model", "model.language_model"])
        matrix = rng.choice("AB")
        path = _path(layer, proj, root)
        key = f"{prefix}{path}.lora_{matrix}.weight"
        if i == 0:  # an in-memory key, with some adapter name
            key = key.replace(".weight", f".{rng.choice(['default', 'sql', 'chat_v2'])}.weight")
        elif i == 1:
            key = f"{prefix}lm_head.lora_{matrix}.weight"
        elif i == 2:
            key = rng.choice([key.replace(f"lora_{matrix}.weight", "lora_magnitude_vector"),
                              key.replace(f"lora_{matrix}.weight", "lora_B.bias"),
                              key.replace(f"lora_{matrix}", "base_layer")])
        elif i == 3:  # a number before the layers component
            key = key.replace(f"{root}.layers.", f"{root}.{rng.choice(['blocks', 'stage', 'h'])}.{rng.randrange(4)}.layers.")
        elif i == 4:  # 'layers' as the end of another component
            key = key.replace(".layers.", f".{rng.choice(['sub', 'my', 'x'])}layers.")
        elif i == 5:  # an empty component somewhere
            parts = key.split(".")
            parts.insert(rng.randrange(1, len(parts) - 2), "")
            key = ".".join(parts)
        elif i == 6:  # a component with a character outside letters, digits and underscores
            key = key.replace(PROJ[proj], rng.choice(["self-attn", "mlp-1", "self attn", "m+lp"]) if PROJ[proj] == "self_attn"
                              else rng.choice(["ml-p", "mlp-1", "m lp", "m+lp"]))
        elif i == 7:  # the matrix name inside a longer component
            key = key.replace(f".lora_{matrix}.", f".{rng.choice(['my_', 'x', 'q_'])}lora_{matrix}.")
        elif i == 8:  # layers.N at the path's end: no layer
            key = f"{prefix}{root}.layers.{layer}.lora_{matrix}.weight"
        elif i == 9:  # something after ".weight"
            key += rng.choice(["_scale", "s", ".bak", "_1"])
        cases.append(_key_case(f"random_{i}", key))
    return cases


def _key_hint(case: Case, expected, got) -> Optional[str]:
    key = case.args[0]
    if not (isinstance(got, tuple) and len(got) == 3):
        return "return a tuple (layer, module, matrix): an int or None, a str, and 'A' or 'B'"
    if isinstance(got[0], str):
        return f"the layer is an int (int({got[0]!r})), not the string it was parsed from; None when there is none"
    if got[0] != expected[0]:
        if expected[0] is None and re.search(r"layers\.\d+\.", key):
            return ("'layers' must be a whole component, followed by a number and then another component: "
                    "'sublayers.3.' is not a layer, nor is a 'layers.3' that ends the path; match "
                    "(^|\\.)layers\\.(\\d+)\\. on the path")
        return ("the layer is the whole number right after the FIRST 'layers' component (it may have several "
                "digits, other numbers may come before it, and the key may lack the 'base_model.model.' "
                "prefix); None when the path has no 'layers.N.' (lm_head)")
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
        _target_case("list_dotted_suffix_starts_at_a_dot", ["f_attn.o_proj"], o1),
        _target_case("list_whole_path", [up1], up1),
        _target_case("list_entries_are_not_regexes", [".*proj"], q0),
        _target_case("list_all_linear_is_a_name", ["all-linear"], q0),
        _target_case("regex_must_match_the_whole_path", "q_proj", q0),
        _target_case("regex_alternation_partial", "q_proj|v_proj", _path(2, "v_proj")),
        _target_case("regex_full_path", r".*\.mlp\.(gate|up|down)_proj", up1),
        _target_case("regex_full_path_not_attention", r".*\.mlp\.(gate|up|down)_proj", o1),
        _target_case("regex_layer_1_not_10", r".*layers\.1\..*", _path(10, "up_proj")),
        _target_case("regex_prefix_is_not_enough", r".*layers\.1", o1),  # re.match would say True
        _target_case("regex_alternation_is_not_anchored_per_branch", r".*q_proj|v_proj", _path(2, "v_proj")),
        # re.match(regex + "$"): the "$" ends only the last branch, so the first still accepts a prefix
        _target_case("regex_dollar_binds_only_the_last_branch", r".*layers\.1|zz_proj", o1),
        _target_case("regex_first_branch_prefix_of_the_path", r".*self_attn|.*mlp\.up_proj", q0),
        _target_case("regex_second_branch_whole_path", r".*self_attn|.*mlp\.up_proj", up1),
        _target_case("all_linear", "all-linear", _path(5, "down_proj")),
        _target_case("all_linear_any_case", "All-Linear", q0),
    ]


def _random_regex(rng: random.Random) -> str:
    mods = rng.sample(sorted(PROJ), 2)
    names = "|".join(m.removesuffix("_proj") for m in mods)
    return rng.choice([rf".*\.({names})_proj", rf"({names})_proj", rf".*layers\.{rng.randrange(4)}\..*({names})_proj",
                       rf"model\.layers\.\d+\.{PROJ[mods[0]]}\.({names})_proj"])


def _target_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw has one case of each family (at a fixed index), with random names and layers."""
    cases = []
    for i in range(13):
        proj, layer = rng.choice(sorted(PROJ)), rng.randrange(4)
        path = _path(layer, proj)
        short = proj.removesuffix("_proj")
        if i == 0:  # a regex that matches only the end of the path (re.search says yes)
            targets = rf"({short}|zz)_proj"
        elif i == 1:  # a regex that matches only a prefix of the path (re.match says yes)
            targets = rf".*layers\.{layer}" + rng.choice(["", r"\.", rf"\.{PROJ[proj]}"])
        elif i == 2:  # an alternation whose second branch matches only the path's end
            other = rng.choice([p for p in sorted(PROJ) if p != proj])
            targets = rf".*{other}|{proj}"
        elif i == 3:  # "all-linear" in some letter case
            targets = rng.choice(["ALL-LINEAR", "All-linear", "all-Linear", "All-Linear"])
        elif i < 7:
            targets = _random_regex(rng)
        elif i == 7:  # a list entry that is a substring of the path's last component
            targets = [proj[1:], rng.choice(sorted(PROJ))]
        elif i == 8:  # a dotted list entry that starts inside a component
            targets = [f"{PROJ[proj][1:]}.{proj}"]
        elif i == 9:  # a list entry that would select the path as a regex
            targets = [rng.choice([".*proj", f".*{short}.*", f"{short}_pro."])]
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
        if got and "|" in targets and (re.search(f"^{targets}$", path) or re.match(targets + "$", path)):
            return ("anchors added to a regex do not reach inside an alternation: '^' + regex + '$' anchors "
                    "only the first and the last branch ('^q_proj|v_proj$' accepts any path ending in v_proj), "
                    "and re.match(regex + '$') ends only its LAST branch, so an earlier branch still accepts "
                    "a prefix of the path ('.*layers\\.1|x'): use re.fullmatch, which anchors the whole regex")
        if got and re.search(f"^{targets}$", path):
            return ("'^' + regex + '$' is not re.fullmatch: use re.fullmatch, which anchors the whole regex")
        if got and re.match(targets, path):
            return ("a string target_modules is a regex that must match the WHOLE path (re.fullmatch): "
                    "re.match only anchors the START, so a pattern that matches a prefix of the path "
                    "('.*layers\\.1' on 'model.layers.1.self_attn.o_proj') is accepted")
        if got and re.search(targets, path):
            return ("a string target_modules is a regex that must match the WHOLE path (re.fullmatch): "
                    "re.search accepts a match anywhere, so 'q_proj' would select every q projection, "
                    "while PEFT's 'q_proj' as a string selects nothing")
        return "the regex is matched against the full path, e.g. 'model.layers.0.self_attn.q_proj', with re.fullmatch"
    if got:
        return ("a list entry selects a path equal to it or ending in '.' + entry: a dot-separated suffix "
                "('q_proj', 'self_attn.q_proj'); a substring ('proj') or a suffix that does not start at a "
                "dot ('p_proj' for up_proj) selects nothing, and list entries are not regexes (nor is "
                "'all-linear' inside a list)")
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
        # the key is grouped: "(.*\.)?self_attn|mlp$" would accept the prefix "model.layers.1.self_attn"
        _scaling_case("alternation_key_reaches_the_end_in_every_branch",
                      {"r": 4, "lora_alpha": 8, "rank_pattern": {"self_attn|mlp": 2}}, k1),
        _scaling_case("alternation_key_selects_either_branch",
                      {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj|k_proj": 2}}, k1),
        _scaling_case("dotted_pattern", {"r": 4, "lora_alpha": 8, "rank_pattern": {"layers.1.self_attn.o_proj": 7}}, o1),
        _scaling_case("first_match_wins_not_most_specific",
                      {"r": 4, "lora_alpha": 8, "rank_pattern": {"gate_proj": 5, "layers.1.mlp.gate_proj": 2}}, g1),
        _scaling_case("rslora_with_patterns", {"r": 8, "lora_alpha": 16, "use_rslora": True,
                                               "rank_pattern": {"o_proj": 2}, "alpha_pattern": {"o_proj": 4}}, o1),
        _scaling_case("alpha_pattern_first_match_wins",
                      {"r": 4, "lora_alpha": 8, "alpha_pattern": {"o_proj": 2, "layers.1.self_attn.o_proj": 32}}, o1),
        _scaling_case("rank_0_raises_value_error", {"r": 0, "lora_alpha": 8}, q0),
        _scaling_case("negative_rank_raises_value_error", {"r": -4, "lora_alpha": 8}, q0),
        _scaling_case("rank_pattern_0_raises_value_error", {"r": 4, "lora_alpha": 8, "rank_pattern": {"q_proj": 0}}, q0),
        _scaling_case("negative_rank_pattern_raises_value_error",
                      {"r": 4, "lora_alpha": 8, "use_rslora": True, "rank_pattern": {"q_proj": -1}}, q0),
        _scaling_case("global_r_0_but_the_module_has_rank_2",
                      {"r": 0, "lora_alpha": 8, "rank_pattern": {"k_proj": 2}}, k1),
    ]


def _scaling_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw has each family at a fixed index: rsLoRA with and without patterns, plain LoRA
    with patterns, overlapping keys where the first is not the most specific, patterns for other
    modules only, no patterns (i = 7, 8, 9; rsLoRA at even i, always with r >= 2)."""
    cases = []
    for i in range(10):
        r = rng.choice([2, 4, 8, 16, 64])
        config = {"r": r, "lora_alpha": rng.choice([r, 2 * r, 16, 32])}
        if i % 2 == 0:  # every other case is rsLoRA
            config["use_rslora"] = True
        proj, layer = rng.choice(sorted(PROJ)), rng.randrange(4)
        full = f"layers.{layer}.{PROJ[proj]}.{proj}"
        if i in (0, 1):  # overlapping keys: the general one first, so the first match is not the most specific
            config["rank_pattern"] = {proj: rng.choice([1, 3]), full: rng.choice([5, 6])}
            config["alpha_pattern"] = {proj: rng.choice([3, 12]), full: rng.choice([20, 40])}
        elif i in (2, 3):  # the module's own rank differs from r, alpha from lora_alpha
            config["rank_pattern"] = {rng.choice([proj, full]): rng.choice([3, 5, r + 5])}
            config["alpha_pattern"] = {rng.choice([proj, full]): rng.choice([3, 12])}
        elif i in (4, 5):  # patterns that do not apply to this module
            others = [p for p in sorted(PROJ) if p != proj]
            config["rank_pattern"] = {p: rng.choice([1, 3, 8]) for p in rng.sample(others, 2)}
            config["alpha_pattern"] = {rng.choice(others): rng.choice([3, 12])}
        elif i == 6:
            names = rng.sample(sorted(PROJ), 3)
            config["rank_pattern"] = {n: rng.choice([1, 3, 8]) for n in names[:2]}
            config["alpha_pattern"] = {rng.choice([names[2], full]): rng.choice([3, 12])}
        cases.append(_scaling_case(f"random_{i}", config, _path(layer, proj)))
    return cases


def _ungrouped_key_matches(patterns, path: str, value) -> bool:
    """Whether the first key that matches without its group (rf"(.*\\.)?{key}$") gives ``value``, and
    that key does not match with it: the symptom of the group left out."""
    for key, v in (patterns or {}).items():
        if re.match(rf"(.*\.)?{key}$", path):
            return v == value and not re.match(rf"(.*\.)?({key})$", path)
    return False


def _scaling_hint(case: Case, expected, got) -> Optional[str]:
    config, path = case.args
    if not (isinstance(got, tuple) and len(got) == 2):
        return "return a tuple (r, scaling): the module's rank (an int) and its scaling (a float)"
    r_exp, s_exp = expected
    r_got, s_got = got
    if r_got != r_exp and _ungrouped_key_matches(config.get("rank_pattern"), path, r_got):
        return ("a rank_pattern key is a regex put inside a group, re.match(rf'(.*\\.)?({key})$', path): "
                "without the parentheses an alternation key ('self_attn|mlp') binds '(.*\\.)?' to its first "
                "branch and '$' to its last, so the first branch accepts a prefix of the path")
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
               ranks: dict, dtype=torch.float32, extra: bool = True, drop: Optional[str] = None,
               b_width: Optional[dict] = None, b_rank: Optional[dict] = None, a_in: Optional[dict] = None,
               part_dtype: Optional[dict] = None, sub: Optional[str] = None) -> Case:
    """``ranks``: part -> its own rank (absent parts are missing). ``extra``: add other modules' and
    other layers' keys (layer + 10, o_proj) that must be ignored. The error families: ``drop`` a
    key ("k_proj.lora_B" drops k's B), and per part ``b_width`` (B's rows), ``b_rank`` (B's columns),
    ``a_in`` (A's columns), ``part_dtype`` (both matrices' dtype, or {"up_proj.B": dtype} for one)."""
    sub = sub or PROJ[parts[0]]
    prefix = f"base_model.model.model.layers.{layer}.{sub}."
    tensors = {}
    b_width, b_rank, a_in, part_dtype = b_width or {}, b_rank or {}, a_in or {}, part_dtype or {}
    for p, w in zip(parts, out_features):
        if p in ranks:
            r = ranks[p]
            dt_a = part_dtype.get(f"{p}.A", part_dtype.get(p, dtype))
            dt_b = part_dtype.get(f"{p}.B", part_dtype.get(p, dtype))
            tensors[f"{prefix}{p}.lora_A.weight"] = torch.randn(r, a_in.get(p, d_in), generator=gen).to(dt_a)
            tensors[f"{prefix}{p}.lora_B.weight"] = torch.randn(b_width.get(p, w), b_rank.get(p, r), generator=gen).to(dt_b)
    if drop is not None:
        del tensors[f"{prefix}{drop}.weight"]
    if extra:
        other = f"base_model.model.model.layers.{layer + 10}.{sub}."
        for p, w in zip(parts, out_features):
            tensors[f"{other}{p}.lora_A.weight"] = torch.randn(2, d_in, generator=gen).to(dtype)
            tensors[f"{other}{p}.lora_B.weight"] = torch.randn(w, 2, generator=gen).to(dtype)
        tensors[f"base_model.model.model.layers.{layer}.self_attn.o_proj.lora_A.weight"] = torch.randn(3, 8, generator=gen).to(dtype)

    def shape(p):
        a, b = tensors.get(f"{prefix}{p}.lora_A.weight"), tensors.get(f"{prefix}{p}.lora_B.weight")
        if a is None and b is None:
            return f"{p} missing"
        return " ".join(f"{m} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}" if t is not None else f"no {m}"
                        for m, t in (("A", a), ("B", b)))

    own = {f"{prefix}{p}.lora_{m}.weight" for p in parts for m in "AB"}
    others = sum(k not in own for k in tensors)
    desc = (f"prefix {prefix!r}, parts {list(parts)}, out_features {list(out_features)}, rank {rank}; "
            f"in tensors: {'; '.join(shape(p) for p in parts)}; {others} other key(s)")
    return Case(name, [tensors, prefix, list(parts), list(out_features), rank], desc, op="exact")


QKV, GATE_UP = ["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]


def _pack_edge() -> list[Case]:
    g = torch.Generator().manual_seed(61)
    full = {p: 4 for p in QKV}
    bf16, fp16 = torch.bfloat16, torch.float16
    return [
        _pack_case("one_part_o_proj", g, 0, ["o_proj"], [16], 2, 16, {"o_proj": 2}, extra=False),
        _pack_case("qkv_gqa_24_8_8", g, 1, QKV, [24, 8, 8], 4, 16, full),
        _pack_case("qkv_missing_k_is_zeros", g, 1, QKV, [24, 8, 8], 4, 16, {"q_proj": 4, "v_proj": 4}),
        _pack_case("qkv_missing_q_is_zeros", g, 1, QKV, [24, 8, 8], 4, 16, {"k_proj": 4, "v_proj": 2}),
        _pack_case("gate_before_up", g, 0, GATE_UP, [20, 20], 3, 12, {"gate_proj": 3, "up_proj": 3}),
        _pack_case("up_only_gate_zeros_bf16", g, 2, GATE_UP, [20, 20], 3, 12, {"up_proj": 3}, bf16),
        _pack_case("qkv_fp16", g, 1, QKV, [24, 8, 8], 4, 16, {"q_proj": 4, "v_proj": 3}, fp16),
        _pack_case("ranks_2_and_4_padded_to_7", g, 0, QKV, [24, 8, 8], 7, 16, {"q_proj": 4, "k_proj": 2}),
        _pack_case("no_part_in_this_layer_gives_none", g, 3, QKV, [24, 8, 8], 4, 16, {}),
        _pack_case("A_without_B_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full, drop="k_proj.lora_B"),
        _pack_case("B_without_A_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full, drop="v_proj.lora_A"),
        _pack_case("rank_above_slot_rank_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, {"q_proj": 5}),
        _pack_case("rank_0_part_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, {"q_proj": 4, "k_proj": 0}),
        _pack_case("A_rank_4_B_rank_3_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full, b_rank={"k_proj": 3}),
        _pack_case("A_rank_2_B_rank_3_raises_value_error", g, 0, GATE_UP, [20, 20], 4, 12,
                   {"gate_proj": 2, "up_proj": 2}, b_rank={"up_proj": 3}),
        _pack_case("B_wider_than_out_features_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full,
                   b_width={"v_proj": 9}),
        _pack_case("B_narrower_than_out_features_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full,
                   b_width={"q_proj": 23}),
        _pack_case("parts_disagree_on_in_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full, a_in={"v_proj": 12}),
        _pack_case("first_part_narrower_in_raises_value_error", g, 0, GATE_UP, [20, 20], 3, 12,
                   {"gate_proj": 3, "up_proj": 3}, a_in={"gate_proj": 8}),
        _pack_case("parts_disagree_on_dtype_raises_value_error", g, 1, QKV, [24, 8, 8], 4, 16, full,
                   part_dtype={"v_proj": bf16}),
        _pack_case("A_and_B_disagree_on_dtype_raises_value_error", g, 0, GATE_UP, [20, 20], 3, 12,
                   {"gate_proj": 3, "up_proj": 3}, fp16, part_dtype={"gate_proj.B": torch.float32}),
    ]


def _pack_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    """Every draw: q/k/v and gate/up in fp32, bf16 and fp16 (by index), a missing part before a
    present one in the first two, ranks below the slot rank, other layers' keys to ignore."""
    cases = []
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    for i in range(6):
        parts = QKV if i % 2 == 0 else GATE_UP
        q = rng.choice([8, 24, 40, 72])
        widths = [q, q // 4 or 1, q // 4 or 1] if parts is QKV else [q, q]
        rank = rng.choice([4, 7, 16])
        present = [p for p in parts if rng.random() < 0.7] or [parts[-1]]
        if i < 2:  # always one missing part before a present one
            present = [p for p in parts if p != parts[-2]]
        ranks = {p: rng.choice([1, rank // 2 or 1, rank]) for p in present}
        ranks[present[-1]] = rng.choice([1, rank // 2 or 1])  # always a part past the first below the slot's rank
        cases.append(_pack_case(f"random_{i}", gen, rng.randrange(32), parts, widths, rank, rng.choice([8, 16, 40]),
                                ranks, dtypes[i % 3]))
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
    if A_got.dtype != A_exp.dtype or B_got.dtype != B_exp.dtype:
        return ("A and B are in the parts' dtype: allocate with like.new_zeros(...) or "
                "torch.zeros(..., dtype=a.dtype, device=a.device)")
    if len(parts) == 2 and A_got.shape == A_exp.shape:
        if torch.equal(A_got[:rank], A_exp[rank:]) and torch.equal(A_got[rank:], A_exp[:rank]):
            return "parts go in the order of `parts`: gate before up (TensorRT-LLM's swapped order is converted at load)"
    if A_got.shape == A_exp.shape:
        blocks = range(len(parts))
        got_b = [A_got[i * rank:(i + 1) * rank] for i in blocks]
        exp_b = [A_exp[i * rank:(i + 1) * rank] for i in blocks]
        if any(torch.equal(got_b[i], exp_b[j]) and bool(exp_b[j].any()) and not bool(exp_b[i].any())
               for i in blocks for j in blocks if i != j):  # a present part moved into a missing part's place
            return ("a missing part still takes its place, as zeros: part i is rows [i*rank, (i+1)*rank) of A "
                    "and slice i of B, so a part after a missing one must not move into the missing part's place")
    if A_got.shape == A_exp.shape and B_got.shape == B_exp.shape and not torch.equal(A_got, A_exp):
        return ("A: part i occupies rows [i*rank, i*rank + r_i), its own rank r_i from its lora_A's rows; "
                "the rows after it up to (i+1)*rank are zeros")
    return None


EXERCISES = [
    Exercise("ch06.1", "parse_lora_key", ("key",), parse_lora_key, _key_edge, _key_random, _key_hint,
             result_names=("layer", "module", "matrix")),
    Exercise("ch06.2", "targets_module", ("target_modules", "path"), targets_module, _target_edge, _target_random,
             _target_hint),
    Exercise("ch06.3", "module_scaling", ("config", "path"), module_scaling, _scaling_edge, _scaling_random,
             _scaling_hint, result_names=("r", "scaling")),
    Exercise("ch06.4", "pack_fused_module", ("tensors", "prefix", "parts", "out_features", "rank"),
             pack_fused_module, _pack_edge, _pack_random, _pack_hint, result_names=("A", "B"), default_device_probe=True),
]
