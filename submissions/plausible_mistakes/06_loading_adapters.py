# %% ch06.1
def parse_lora_key(key):
    # mistake: any key that mentions lora_A / lora_B is accepted, so an in-memory key
    # ("...q_proj.lora_A.default.weight") or a LoRA bias ("...lora_B.bias") passes as a weight
    parts = key.split(".")
    matrix = "A" if "lora_A" in parts else "B"
    i = parts.index("lora_" + matrix)  # ValueError when neither is there
    layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else None
    return layer, parts[i - 1], matrix

# %% ch06.2
import re


def targets_module(target_modules, path):
    if isinstance(target_modules, str):
        # mistake: re.search finds the pattern anywhere in the path; PEFT needs a full match
        return target_modules.lower() == "all-linear" or re.search(target_modules, path) is not None
    return any(path == t or path.endswith("." + t) for t in target_modules)

# %% ch06.3
import re


def module_scaling(config, path):
    def first_match(patterns, default):
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", path):
                return value
        return default

    r = first_match(config.get("rank_pattern"), config["r"])
    alpha = first_match(config.get("alpha_pattern"), config["lora_alpha"])
    if r < 1:
        raise ValueError("rank must be positive")
    return r, float(alpha / r)  # mistake: use_rslora ignored, alpha / r for every adapter

# %% ch06.4
import torch


def pack_fused_module(tensors, prefix, parts, out_features, rank):
    # mistake: only the present parts are stacked, so a missing k moves v up into k's rows
    A_parts, B_parts = [], []
    for p, w in zip(parts, out_features):
        a, b = tensors.get(f"{prefix}{p}.lora_A.weight"), tensors.get(f"{prefix}{p}.lora_B.weight")
        if a is None and b is None:
            continue
        if a is None or b is None or a.shape[0] > rank or tuple(b.shape) != (w, a.shape[0]):
            raise ValueError(f"{prefix}{p}: bad part")
        A_parts.append(torch.cat([a, a.new_zeros(rank - a.shape[0], a.shape[1])]))
        B_parts.append(torch.cat([b, b.new_zeros(b.shape[0], rank - b.shape[1])], dim=1))
    if not A_parts:
        return None
    A = torch.cat(A_parts)
    B = torch.cat(B_parts)
    if B.shape[0] < sum(out_features):  # pad B at the end to the fused width
        B = torch.cat([B, B.new_zeros(sum(out_features) - B.shape[0], rank)])
    return A, B
