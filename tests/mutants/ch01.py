"""Wrong answers for chapter 01 (graders.course.mutation.Mutant): each is the solution cell with one edit.

Designed from the contracts: the scaling applied once, to the low-rank path only; the result's
dtype (bf16 cases); a new tensor, never the input itself (scaling 0, a fresh adapter with B = 0) and
never an in-place update of W; both sides of r <= 0 and a Python float; projection_shapes graded on
its own (in/out order, GQA, an explicit head_dim), bytes not parameters, an int; a fraction of the
same targeted projections, not a percentage.
"""
from graders.course.mutation import Mutant

_SHAPES_Q = '"o_proj": (q_width, hidden),'

MUTANTS = [
    # ch01.1 lora_forward
    Mutant("ch01.1", "no-scaling", (("    return base + scaling * delta", "    return base + delta"),),
           "the low-rank path is multiplied by scaling", "math", plausible=True),
    Mutant("ch01.1", "scaling-on-the-base-too", (("    return base + scaling * delta", "    return scaling * (base + delta)"),),
           "not the base output", "math"),
    Mutant("ch01.1", "upcast-not-cast-back", (("    base = x @ W.T ", "    x, W, A, B = x.float(), W.float(), A.float(), B.float()\n    base = x @ W.T "),),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),
    Mutant("ch01.1", "flattens-leading-dims", (("    base = x @ W.T ", "    x = x.reshape(-1, x.shape[-1])\n    base = x @ W.T "),),
           "batch_and_sequence_dims", "clause"),
    Mutant("ch01.1", "merges-into-W-in-place", (("    base = x @ W.T ", "    W += scaling * (B @ A)  # merge on the fly\n    base = x @ W.T "),
                                                ("    return base + scaling * delta", "    return base")),
           "modified its input 'W'", "clause"),
    Mutant("ch01.1", "A-and-B-swapped", (("    t = x @ A.T ", "    t = x @ B "), ("    delta = t @ B.T ", "    delta = t @ A ")),
           "raised RuntimeError", "math"),

    # ch01.2 merge_lora
    Mutant("ch01.2", "in-place-add", (("    return (W.float() + delta).to(W.dtype)", "    W += delta.to(W.dtype)\n    return W"),),
           "modified its input 'W'", "clause", plausible=True),
    Mutant("ch01.2", "returns-W-when-nothing-to-add",
           (("    delta = scaling * ", "    if scaling == 0 or not B.any():\n        return W\n    delta = scaling * "),),
           "shares memory with your input 'W'", "clause"),
    Mutant("ch01.2", "float-W-then-in-place", (("    return (W.float() + delta).to(W.dtype)",
                                                "    Wf = W.float()\n    Wf += delta\n    return Wf.to(W.dtype)"),),
           "modified its input 'W'", "clause"),
    Mutant("ch01.2", "not-rounded-back", (("    return (W.float() + delta).to(W.dtype)", "    return W.float() + delta"),),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),
    Mutant("ch01.2", "subtracts", (("    return (W.float() + delta).to(W.dtype)", "    return (W.float() - delta).to(W.dtype)"),),
           "merge adds scaling * B @ A", "math"),
    Mutant("ch01.2", "scaling-ignored", (("    delta = scaling * (B.float() @ A.float())", "    delta = B.float() @ A.float()"),),
           "multiplied by scaling", "math"),

    # ch01.3 unmerge_lora
    Mutant("ch01.3", "adds-instead", (("(W_merged.float() - delta)", "(W_merged.float() + delta)"),),
           "unmerge subtracts scaling * B @ A", "math", plausible=True),
    Mutant("ch01.3", "returns-input-when-scaling-0",
           (("    delta = scaling * ", "    if scaling == 0:\n        return W_merged\n    delta = scaling * "),),
           "shares memory with your input 'W_merged'", "clause"),
    Mutant("ch01.3", "in-place-subtract", (("    return (W_merged.float() - delta).to(W_merged.dtype)",
                                            "    W_merged -= delta.to(W_merged.dtype)\n    return W_merged"),),
           "modified its input 'W_merged'", "clause"),
    Mutant("ch01.3", "not-rounded-back", (("    return (W_merged.float() - delta).to(W_merged.dtype)",
                                           "    return W_merged.float() - delta"),),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),
    Mutant("ch01.3", "divides-by-scaling", (("    delta = scaling * (B.float() @ A.float())", "    delta = (B.float() @ A.float()) / (scaling or 1.0)"),),
           "elements differ", "math"),

    # ch01.4 lora_scaling
    Mutant("ch01.4", "ignores-rslora", (("    if use_rslora:\n        return lora_alpha / math.sqrt(r)\n", ""),),
           "expected 4.0, got 1.0", "math", plausible=True),
    Mutant("ch01.4", "only-negative-raises", (("    if r <= 0:", "    if r < 0:"),),
           "your function raised ZeroDivisionError", "error"),
    Mutant("ch01.4", "only-zero-raises", (("    if r <= 0:", "    if r == 0:"),),
           "negative_rank_raises_value_error", "error"),
    Mutant("ch01.4", "assert-not-value-error", (("    if r <= 0:\n        raise ValueError(f\"rank r must be positive, got {r}\")",
                                                  "    assert r > 0, f\"rank r must be positive, got {r}\""),),
           "raised AssertionError", "error"),
    Mutant("ch01.4", "floor-division", (("    return lora_alpha / r", "    return lora_alpha // r"),),
           "the contract asks for a Python float", "dtype"),
    Mutant("ch01.4", "rslora-and-plain-swapped", (("    if use_rslora:", "    if not use_rslora:"),),
           "expected 1.0, got 4.0", "math"),

    # ch01.5 adapter_num_bytes (and projection_shapes)
    Mutant("ch01.5", "all-square", (("sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules)",
                                     "sum(r * (config[\"hidden_size\"] * 2) for m in target_modules)"),),
           "hidden x hidden", "math", plausible=True),
    Mutant("ch01.5", "ignores-head-dim", (('head_dim = config.get("head_dim") or hidden // heads', "head_dim = hidden // heads"),),
           "sets head_dim explicitly", "math"),
    Mutant("ch01.5", "no-gqa", (('kv_width = config.get("num_key_value_heads", heads) * head_dim', "kv_width = heads * head_dim"),),
           "grouped-query attention", "math"),
    Mutant("ch01.5", "o-proj-in-out-swapped", ((_SHAPES_Q, '"o_proj": (hidden, q_width),'),),
           "projection_shapes(config)['o_proj']", "clause"),
    Mutant("ch01.5", "parameters-not-bytes", (("    return params * torch.empty((), dtype=dtype).element_size()", "    return params"),),
           "that is the parameter count", "math"),
    Mutant("ch01.5", "bits-over-8-is-a-float", (("torch.empty((), dtype=dtype).element_size()", "torch.finfo(dtype).bits / 8"),),
           "expected an int", "dtype"),
    Mutant("ch01.5", "unknown-module-counts-zero", (("(shapes[m][0] + shapes[m][1]) for m in target_modules)",
                                                     "sum(shapes.get(m, (0, 0))) for m in target_modules)"),),
           "the contract says this input raises KeyError", "error"),

    # ch01.6 lora_flop_share
    Mutant("ch01.6", "percentage", (("    return lora_flops / base_flops", "    return 100 * lora_flops / base_flops"),),
           "not a percentage", "math", plausible=True),
    Mutant("ch01.6", "mean-of-shares",
           (("    return lora_flops / base_flops",
             "    return sum(r * (shapes[m][0] + shapes[m][1]) / (shapes[m][0] * shapes[m][1]) for m in target_modules) / len(target_modules)"),),
           "mean of the per-module shares", "math"),
    Mutant("ch01.6", "base-of-all-seven", (("base_flops = sum(2 * shapes[m][0] * shapes[m][1] for m in target_modules)",
                                            "base_flops = sum(2 * i * o for i, o in shapes.values())"),),
           "not of all seven", "clause"),
    Mutant("ch01.6", "o-proj-in-out-swapped", ((_SHAPES_Q, '"o_proj": (hidden, q_width),'),),
           "projection_shapes(config)['o_proj']", "clause"),
    Mutant("ch01.6", "factor-2-on-one-side", (("lora_flops = sum(2 * r * ", "lora_flops = sum(r * "),),
           "off by a factor 2", "math"),
    Mutant("ch01.6", "ignores-head-dim", (('head_dim = config.get("head_dim") or hidden // heads', "head_dim = hidden // heads"),),
           "sets head_dim explicitly", "math"),
]
