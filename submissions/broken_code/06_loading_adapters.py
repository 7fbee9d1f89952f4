# %% ch06.1
import re


def parse_lora_key(key):
    m = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$", key)
    if m is None:
        raise ValueError(key)
    layer = re.search(r"layers\.(\d+)\.", m.group(1))
    # the layer comes back as the string it was parsed from, not an int
    return (layer.group(1) if layer else None), m.group(1).split(".")[-1], m.group(2)

# %% ch06.2
import re


def targets_module(target_modules, path):
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, path)  # a re.Match object or None, not a bool
    return any(path == t or path.endswith("." + t) for t in target_modules)

# %% ch06.3
def module_scaling(config, path):
    raise NotImplementedError("ch06.3: module_scaling")

# %% ch06.4
import torch


def pack_fused_module(tensors, prefix, parts, out_features, rank):
    A = []
    B = []
    for p in parts:
        A.append(tensors[f"{prefix}{p}.lora_A.weight"])  # KeyError when the adapter lacks a part
        B.append(tensors[f"{prefix}{p}.lora_B.weight"])
    r = A[0].shape[0]
    return (torch.cat([torch.cat([a, a.new_zeros(rank - r, a.shape[1])]) for a in A]),
            torch.cat([torch.cat([b, b.new_zeros(b.shape[0], rank - r)], dim=1) for b in B]))
