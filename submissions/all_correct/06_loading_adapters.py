# %% ch06.1
import re


def parse_lora_key(key):
    """(layer or None, module, "A" | "B") of one PEFT safetensors key; ValueError otherwise."""
    m = re.match(r"^(?:base_model\.model\.)?(?P<path>\w+(?:\.\w+)*)\.lora_(?P<matrix>[AB])\.weight$", key)
    if m is None:
        raise ValueError(f"not a PEFT LoRA key: {key!r}")
    path = m.group("path")
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
    return (None if layer is None else int(layer.group(1))), path.rsplit(".", 1)[-1], m.group("matrix")

# %% ch06.2
import re


def targets_module(target_modules, path):
    """PEFT's target_modules rule for one module path; returns a bool."""
    if isinstance(target_modules, str):
        return target_modules.lower() == "all-linear" or re.fullmatch(target_modules, path) is not None
    return any(path == t or path.endswith("." + t) for t in target_modules)

# %% ch06.3
import math
import re


def module_scaling(config, path):
    """(rank, scaling) of the module at path under PEFT's rank_pattern / alpha_pattern / rsLoRA rules."""
    def first_match(patterns, default):
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", path):
                return value
        return default

    r = first_match(config.get("rank_pattern"), config["r"])
    alpha = first_match(config.get("alpha_pattern"), config["lora_alpha"])
    if r < 1:
        raise ValueError(f"rank must be positive, got {r}")
    return r, float(alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r)

# %% ch06.4
import torch


def pack_fused_module(tensors, prefix, parts, out_features, rank):
    """One layer's fused (A, B) from PEFT tensors: parts padded to rank, a missing part zeros; None if none."""
    if len(parts) != len(out_features):
        raise ValueError("parts and out_features differ in length")
    found = []
    for p in parts:
        a, b = tensors.get(f"{prefix}{p}.lora_A.weight"), tensors.get(f"{prefix}{p}.lora_B.weight")
        if (a is None) != (b is None):
            raise ValueError(f"{prefix}{p}: lora_A and lora_B come in pairs")
        found.append(None if a is None else (a, b))
    present = [f for f in found if f is not None]
    if not present:
        return None
    like = present[0][0]
    offsets = [0]
    for w in out_features:
        offsets.append(offsets[-1] + w)
    A = like.new_zeros(len(parts) * rank, like.shape[1])
    B = like.new_zeros(offsets[-1], rank)
    for i, f in enumerate(found):
        if f is None:
            continue
        a, b = f
        r = a.shape[0]
        if not 1 <= r <= rank or a.shape[1] != like.shape[1] or tuple(b.shape) != (out_features[i], r):
            raise ValueError(f"{prefix}{parts[i]}: A {list(a.shape)}, B {list(b.shape)} do not fit")
        if a.dtype != like.dtype or b.dtype != like.dtype:
            raise ValueError(f"{prefix}{parts[i]}: dtypes differ")
        A[i * rank:i * rank + r] = a
        B[offsets[i]:offsets[i + 1], :r] = b
    return A, B
