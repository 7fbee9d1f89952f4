# %% ch01.1
def lora_forward(x, W, A, B, scaling):
    base = x @ W.T
    # shrink to rank r, then expand back to out_features
    low_rank = (x @ A.T) @ B.T
    return base + scaling * low_rank

# %% ch01.2
def merge_lora(W, A, B, scaling):
    delta = scaling * (B.float() @ A.float())
    return (W.float() + delta).to(W.dtype)

# %% ch01.3
def unmerge_lora(W_merged, A, B, scaling):
    delta = scaling * (B.float() @ A.float())
    return (W_merged.float() - delta).to(W_merged.dtype)

# %% ch01.4
import math

def lora_scaling(lora_alpha, r, use_rslora):
    if r <= 0:
        raise ValueError(f"the rank must be positive, got r={r}")
    if use_rslora:
        return lora_alpha / math.sqrt(r)
    return lora_alpha / r

# %% ch01.5
def _shapes(config):
    h = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // n_heads
    kv = config.get("num_key_value_heads", n_heads) * hd
    inter = config["intermediate_size"]
    return {"q_proj": (h, n_heads * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (n_heads * hd, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def adapter_num_bytes(config, target_modules, r, dtype):
    shapes = _shapes(config)
    params = 0
    for name in target_modules:
        d_in, d_out = shapes[name]
        params += r * d_in + d_out * r  # A is [r, in], B is [out, r]
    params *= config["num_hidden_layers"]
    return params * torch.tensor([], dtype=dtype).element_size()

# %% ch01.6
def lora_flop_share(config, target_modules, r):
    h = config["hidden_size"]
    n_heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // n_heads
    kv = config.get("num_key_value_heads", n_heads) * hd
    inter = config["intermediate_size"]
    shapes = {"q_proj": (h, n_heads * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (n_heads * hd, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    base = sum(2 * shapes[m][0] * shapes[m][1] for m in target_modules)
    lora = sum(2 * r * (shapes[m][0] + shapes[m][1]) for m in target_modules)
    return lora / base
