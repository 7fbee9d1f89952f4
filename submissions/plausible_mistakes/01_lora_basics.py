# %% ch01.1
def lora_forward(x, W, A, B, scaling):
    # the adapter's update is B @ A, so add its product with x
    # (mistake: forgets the scaling factor)
    return x @ W.T + (x @ A.T) @ B.T

# %% ch01.2
def merge_lora(W, A, B, scaling):
    # merge in place to save memory (mistake: the caller's W is modified)
    W += scaling * (B @ A)
    return W

# %% ch01.3
def unmerge_lora(W_merged, A, B, scaling):
    return W_merged - scaling * (B.float() @ A.float()).to(W_merged.dtype)

# %% ch01.4
def lora_scaling(lora_alpha, r, use_rslora):
    # mistake: alpha / r whatever use_rslora says
    return lora_alpha / r

# %% ch01.5
def adapter_num_bytes(config, target_modules, r, dtype):
    # mistake: every projection taken as hidden x hidden (the "58 MB" estimate)
    h = config["hidden_size"]
    per_layer = len(target_modules) * r * (h + h)
    return per_layer * config["num_hidden_layers"] * torch.tensor(0, dtype=dtype).element_size()

# %% ch01.6
def lora_flop_share(config, target_modules, r):
    h = config["hidden_size"]
    heads = config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    kv = config["num_key_value_heads"] * hd
    i = config["intermediate_size"]
    dims = {"q_proj": (h, heads * hd), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (heads * hd, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    lora = sum(r * (dims[m][0] + dims[m][1]) for m in target_modules)
    base = sum(dims[m][0] * dims[m][1] for m in target_modules)
    # mistake: reported as a percentage
    return 100 * lora / base
