# %% ch01.1
def lora_forward(x, W, A, B, scaling):
    # raises when called: torch has no matmull
    return torch.matmull(x, W.T) + scaling * (x @ A.T) @ B.T

# %% ch01.2
def merge_lora(W, A, B, scaling):
    return (W.float() + scaling * (B.float() @ A.float())).to(W.dtype)

# %% ch01.3
def unmerge_lora(W_merged, A, B, scaling):
    return (W_merged.float() - scaling * (B.float() @ A.float())).to(W_merged.dtype)

# %% ch01.4
def lora_scaling(lora_alpha, r, use_rslora):
    # an integer square root by halving... that never terminates
    if use_rslora:
        root = r
        while root * root != r or root > 0:
            root = (root + r // root) // 2
        return lora_alpha / root
    return lora_alpha / r

# %% ch01.5
def adapter_num_bytes(config, target_modules, r, dtype):
    h, L = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config["num_key_value_heads"] * hd
    i = config["intermediate_size"]
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (heads * hd, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    n = L * sum(r * (dims[m][0] + dims[m][1]) for m in target_modules)
    return f"{n * torch.finfo(dtype).bits // 8} bytes"  # returns a string, not a number

# %% ch01.6
def lora_flop_share(config, target_modules, r):
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config["num_key_value_heads"] * hd
    i = config["intermediate_size"]
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (heads * hd, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    return sum(r * sum(dims[m]) for m in target_modules) / sum(dims[m][0] * dims[m][1] for m in target_modules)
