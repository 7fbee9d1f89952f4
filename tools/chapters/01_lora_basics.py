# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Chapter 01 · LoRA from first principles
#
# A multi-LoRA server runs one base model and many small adapters on the same GPUs, and mixes
# requests for different adapters in one batch. Before we batch anything (chapter 02), this
# chapter works through one adapter on one linear layer: what it computes, what it costs, and
# the two ways to deploy it.
#
# **What you will learn**
#
# - The LoRA forward pass in PyTorch's `nn.Linear` convention, and why the low-rank path is
#   computed as two thin matrix products.
# - How to merge an adapter into the base weight and unmerge it again, and why in bf16 the
#   round trip does not give the original weight back.
# - When merging is the right deployment, and when serving unmerged wins.
# - The scaling factor: `lora_alpha / r`, rsLoRA's `lora_alpha / sqrt(r)`, and the silent bug of
#   reading one as the other.
# - How to size an adapter from a model's config in bytes, MB and MiB, and why two published
#   figures for the same adapter disagree.
# - How many FLOPs LoRA adds, and why decode cost is about bytes read, not FLOPs.
#
# **How the exercises work.** There are six exercises, `ch01.1` to `ch01.6`. Each has a contract
# (a markdown cell), an answer cell in which you write the function body where your copy says
# `raise NotImplementedError()`, and a test cell that calls `graders.check`. The grader runs your
# answer cell *alone*, in a fresh Python process where only `math` and `torch` are imported: put
# any other import inside the cell, and do not call functions defined in other cells. It compares
# your function with the book's reference on fixed edge cases, seeded random cases and hidden
# cases, one point per group, and prints what went wrong in terms of the exercise. After each
# test, a cell shows the book's reference solution, but only once your own answer has passed
# (`graders.show_reference("ch01.1", reveal=True)` shows it anyway). A `lambda` is a valid answer
# too, e.g. `lora_scaling = lambda lora_alpha, r, use_rslora: ...`.
#
# **Devices.** Every tensor a function of the book creates, result or intermediate (an index, a
# mask, a scalar), lives on its inputs' device: `device=x.device`, `x.new_zeros(...)`,
# `torch.zeros_like(x)`. A server's process may have another default device than its inputs', so
# `torch.zeros(n)` without a device is a bug even where it runs. The CPU cannot show it by itself, so
# for the exercises that compute tensors from tensors in PyTorch (in chapters 01, 02, 06, 09 and
# 10) one edge case runs your function with torch's default device set to `meta`, a device that
# holds no data: a tensor made without `device=` lands there, and the report names the line that
# made it.

# %%
import math

import torch

import graders
import reference
from reference import lora_math

torch.manual_seed(0)
print(f"torch {torch.__version__}")

# %% [markdown]
# ## 1. The LoRA forward pass
#
# A linear layer in PyTorch stores its weight as `W` with shape `[out, in]` and computes
# $y = x W^\top$. Fine-tuning all of `W` means learning, storing and serving a second matrix of the
# same size for every task. LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language
# Models") freezes `W` and learns a low-rank update instead: two matrices `A` with shape `[r, in]`
# and `B` with shape `[out, r]`, where the rank `r` is much smaller than `in` and `out`. The layer
# becomes
#
# $$y = x W^\top + s \,(x A^\top) B^\top,$$
#
# where `s` is a scalar, the *scaling* (section 3). The update to the weight is
# $\Delta W = s\,B A$: shape `[out, in]`, like `W`, but of rank at most `r`.
#
# | tensor | shape | what it is |
# |---|---|---|
# | `x` | `[..., in]` | activations; any leading dims (tokens, or batch × sequence) |
# | `W` | `[out, in]` | frozen base weight, shared by every adapter |
# | `A` | `[r, in]` | the adapter's *down* matrix: maps `in` features to `r` |
# | `B` | `[out, r]` | the adapter's *up* matrix: maps `r` back to `out` |
# | `y` | `[..., out]` | output |
#
# ![The unmerged LoRA forward as matrix blocks (left) and where a Llama-3-8B adapter's parameters go (right)](lora_shapes.png)
#
# **Order of operations matters.** The parentheses in $(x A^\top) B^\top$ are deliberate. First
# $t = x A^\top$ squeezes each token down to `r` numbers (serving systems call this step
# **shrink**), then $t B^\top$ expands them back to `out` (**expand**). Per token this costs
# $2r(\mathit{in} + \mathit{out})$ FLOPs. Forming $B A$ first would build an `[out, in]` matrix,
# as large as `W`, for every adapter and every step. Training starts from $B = 0$ (Hu et al.
# initialize `A` randomly and `B` to zero), so a fresh adapter changes nothing.
#
# The cell below puts numbers on one square projection of a Llama-sized model.

# %%
d_in = d_out = 4096  # one square attention projection of a Llama-3-8B-sized model
r = 16
full_params = d_in * d_out
lora_params = r * d_in + d_out * r  # A [r, in] + B [out, r]
print(f"full fine-tune of W: {full_params:,} parameters")
print(f"LoRA at r={r}:        {lora_params:,} parameters  ({full_params / lora_params:.0f}x fewer)")
print(f"LoRA path per token, shrink then expand: {2 * r * (d_in + d_out):,} FLOPs")
print(f"forming B @ A instead:                   {2 * d_out * r * d_in:,} FLOPs (per adapter, per step)")

# A fresh adapter (B = 0) leaves the layer unchanged:
x = torch.randn(3, 64)
W = torch.randn(48, 64) / 8
A0, B0 = torch.randn(8, 64) / 8, torch.zeros(48, 8)
print("B = 0 gives the base output exactly:", torch.equal(lora_math.lora_forward(x, W, A0, B0, 2.0), x @ W.T))

# %% [markdown]
# ### Exercise ch01.1: lora_forward
#
# Write `lora_forward(x, W, A, B, scaling)`, the unmerged forward of one LoRA linear layer.
#
# - `x`: `[..., in]`, any number of leading dimensions (the grader uses `[n, in]` and
#   `[batch, seq, in]`); float32 or bfloat16.
# - `W`: `[out, in]`; `A`: `[r, in]`; `B`: `[out, r]`; same dtype as `x`.
# - `scaling`: a Python float (it can be `0.0`, which must give the base output).
# - **Returns** a new tensor `[..., out]` in `x.dtype` (the grader has bfloat16 cases):
#   $x W^\top + \text{scaling}\cdot(x A^\top) B^\top$; keep the leading dimensions of `x`.
# - Compute the low-rank path as two products (shrink, then expand). Forming `B @ A` gives the
#   same numbers (the grader cannot tell), but costs a full `[out, in]` matrix per step: the cell
#   above counts it. Do not modify any input. Results are compared within the rounding tolerance of the
#   dtype (`graders/machine/tolerances.py`).

# %% exercise="ch01.1" role="answer"
def lora_forward(x: torch.Tensor, W: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """Unmerged LoRA forward of one linear layer.

    x [..., in], W [out, in], A [r, in], B [out, r], scaling a float.
    Returns x @ W.T + scaling * (x @ A.T) @ B.T with shape [..., out] and dtype x.dtype.
    """
    ### BEGIN SOLUTION
    base = x @ W.T       # [..., out]: the frozen layer
    t = x @ A.T          # [..., r]:   shrink to the rank
    delta = t @ B.T      # [..., out]: expand back to the output width
    return base + scaling * delta
    ### END SOLUTION


# %% exercise="ch01.1" role="test"
graders.check("ch01.1", lora_forward)

# %% [markdown]
# The book's reference is the same two-product formula in one line; `@` broadcasts over the
# leading dimensions of `x`, so no reshaping is needed.

# %%
graders.show_reference("ch01.1")

# %% [markdown]
# ## 2. Merging and unmerging
#
# Matrix products distribute, so the two paths can be folded into one weight:
#
# $$x W^\top + s\,(x A^\top) B^\top = x\,(W + s\,B A)^\top = x\,W'^\top .$$
#
# **Merging** computes $W' = W + s\,B A$ once, ahead of time. The merged layer is an ordinary
# linear layer: exactly the base model's cost, no extra kernels, nothing LoRA-specific left in the
# serving stack. **Unmerging** subtracts the same product to recover `W`. The cell below checks
# the identity in float32 with the reference functions.

# %%
g = torch.Generator().manual_seed(1)
x = torch.randn(5, 72, generator=g)
W = torch.randn(40, 72, generator=g) / 72**0.5
A = torch.randn(7, 72, generator=g) / 72**0.5
B = torch.randn(40, 7, generator=g) / 7**0.5
s = 2.0
y_unmerged = lora_math.lora_forward(x, W, A, B, s)
y_merged = x @ lora_math.merge_lora(W, A, B, s).T
print(f"max |merged - unmerged| in float32: {(y_merged - y_unmerged).abs().max().item():.2e}"
      f"  (outputs are of order {y_unmerged.abs().mean().item():.2f})")

# %% [markdown]
# ### Exercise ch01.2: merge_lora
#
# Write `merge_lora(W, A, B, scaling)`.
#
# - `W`: `[out, in]`; `A`: `[r, in]`; `B`: `[out, r]`; float32 or bfloat16; `scaling` a float.
# - **Returns** a *new* tensor `[out, in]` with dtype `W.dtype`: $W + \text{scaling}\cdot B A$.
#   New even when there is nothing to add (`scaling` 0, or a fresh adapter whose `B` is zero):
#   never `W` itself or a view of it, since a caller that later writes one would change the other
#   (the grader checks that the result shares no memory with an input).
# - `W` must not be modified (the grader checks every input after the call): no in-place `+=`
#   on `W`.
# - Recommended: form the product and the sum in float32 and round to `W.dtype` once at the end,
#   so a bf16 merge loses as little as possible.

# %% exercise="ch01.2" role="answer"
def merge_lora(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Return the merged weight W + scaling * B @ A ([out, in], W.dtype); W is left unchanged.

    W [out, in], A [r, in], B [out, r]. Recommended: computed in float32, rounded to W.dtype once.
    """
    ### BEGIN SOLUTION
    delta = scaling * (B.float() @ A.float())   # [out, in] in float32
    return (W.float() + delta).to(W.dtype)      # a new tensor: W itself is never written
    ### END SOLUTION


# %% exercise="ch01.2" role="test"
graders.check("ch01.2", merge_lora)

# %% [markdown]
# The reference does the same: the product in float32, one rounding at the end.

# %%
graders.show_reference("ch01.2")

# %% [markdown]
# ### Exercise ch01.3: unmerge_lora
#
# Write `unmerge_lora(W_merged, A, B, scaling)`, the inverse of `merge_lora`.
#
# - `W_merged`: `[out, in]`; `A`: `[r, in]`; `B`: `[out, r]`; float32 or bfloat16.
# - **Returns** a new tensor `[out, in]` with dtype `W_merged.dtype`:
#   $W_\text{merged} - \text{scaling}\cdot B A$, new even when `scaling` is 0 or `B` is zero (never
#   `W_merged` itself or a view of it). `W_merged` must not be modified.
# - As in `merge_lora`, computing in float32 and rounding once is recommended.

# %% exercise="ch01.3" role="answer"
def unmerge_lora(W_merged: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Inverse of merge_lora: W_merged - scaling * B @ A ([out, in], W_merged.dtype).

    W_merged [out, in], A [r, in], B [out, r]. Recommended: computed in float32, rounded once.
    """
    ### BEGIN SOLUTION
    delta = scaling * (B.float() @ A.float())          # [out, in] in float32
    return (W_merged.float() - delta).to(W_merged.dtype)
    ### END SOLUTION


# %% exercise="ch01.3" role="test"
graders.check("ch01.3", unmerge_lora)

# %%
graders.show_reference("ch01.3")

# %% [markdown]
# ### Merge, then unmerge: do we get `W` back?
#
# On paper, yes. In floating point, no: $W + \Delta$ is rounded to the weight's dtype, and the
# rounding error survives the subtraction. bf16 keeps far fewer significant bits than float32
# (printed below from `torch.finfo`), so its error is of the order of one bf16 step of the
# weight. The cell below merges and unmerges a `[256, 256]` layer in float32 and in bf16 and
# counts the elements that did not come back bit for bit.

# %%
for dtype in (torch.float32, torch.bfloat16):
    eps = torch.finfo(dtype).eps
    print(f"{str(dtype):15} significant bits: {1 - math.log2(eps):.0f}   relative step (eps): {eps:.2e}")

g = torch.Generator().manual_seed(2)
W32 = torch.randn(256, 256, generator=g) / 16
A32 = torch.randn(16, 256, generator=g) / 16
B32 = torch.randn(256, 16, generator=g) / 40
for dtype in (torch.float32, torch.bfloat16):
    W0, A0, B0 = W32.to(dtype), A32.to(dtype), B32.to(dtype)
    back = lora_math.unmerge_lora(lora_math.merge_lora(W0, A0, B0, 2.0), A0, B0, 2.0)
    changed = (back != W0).float().mean().item()
    err = (back.float() - W0.float()).abs().max().item()
    step = torch.finfo(dtype).eps * W0.float().abs().mean().item()  # one step of the dtype at a typical |W|
    print(f"{str(dtype):15} elements not restored bit for bit: {changed:6.1%}   max |error| {err:.2e}"
          f"   (one {dtype} step at mean |W|: {step:.2e})")

# %% [markdown]
# Neither dtype restores `W` exactly. In float32 the leftover is negligible; in bf16 it is of
# the order of one bf16 step of a typical weight, as the last column shows. A server that
# switches adapters by merging and unmerging in place therefore drifts away from the base model
# it claims to serve, and its "base" requests are no longer answered by the original weights.
# Keeping an untouched copy of `W` (or reloading it) is the only exact way back.

# %% [markdown]
# ### When to merge, and when not
#
# Merging is the right deployment when **one adapter is hot enough to fill an instance on its
# own**: merge it once, serve it as a plain model, pay exactly the base model's cost per token.
#
# It breaks down when a batch mixes adapters. A merged weight serves one adapter, so a batch of
# requests for `k` adapters would need `k` full copies of the weights (or one GEMM per adapter
# group against its own copy). Unmerged serving keeps a single `W`: the base GEMM runs **once for
# the whole batch**, and only the thin per-adapter shrink and expand depend on the request. The
# toy batch below has three adapters; both ways give the same answer, with very different
# memory.

# %%
g = torch.Generator().manual_seed(3)
d_in, d_out, r, s = 64, 48, 8, 1.0
W = torch.randn(d_out, d_in, generator=g) / d_in**0.5
adapters = {name: (torch.randn(r, d_in, generator=g) / d_in**0.5, torch.randn(d_out, r, generator=g) / r**0.5)
            for name in ("sql", "chat", "legal")}
requests = ["sql", "chat", "chat", "legal", "sql", "chat"]  # one token per request
x = torch.randn(len(requests), d_in, generator=g)

# Unmerged: one base GEMM for the whole batch, then each request's own low-rank path.
y_unmerged = x @ W.T
for i, name in enumerate(requests):
    A, B = adapters[name]
    y_unmerged[i] += s * (x[i] @ A.T) @ B.T

# Merged: a full-size weight copy per adapter; each request multiplies by its adapter's copy.
merged = {name: lora_math.merge_lora(W, A, B, s) for name, (A, B) in adapters.items()}
y_merged = torch.stack([x[i] @ merged[name].T for i, name in enumerate(requests)])

print(f"max |merged - unmerged|: {(y_merged - y_unmerged).abs().max().item():.2e}")
print(f"full-size weights held: unmerged 1, merged {len(merged)}")

# %% [markdown]
# At real scale the gap is large. For Llama-3-8B in bf16, compare one full copy of the seven
# projection weights (all layers) with one rank-16 adapter on the same projections (section 4
# derives the adapter size; here we use the reference to compute it).

# %%
cfg = lora_math.LLAMA3_8B_CONFIG
shapes = lora_math.projection_shapes(cfg)
bf16_bytes = torch.bfloat16.itemsize
projection_bytes = sum(i * o for i, o in shapes.values()) * cfg["num_hidden_layers"] * bf16_bytes
adapter_bytes = lora_math.adapter_num_bytes(cfg, lora_math.LLAMA_PROJECTIONS, 16, torch.bfloat16)
print(f"one merged copy of the projection weights: {projection_bytes / 1e9:6.2f} GB")
print(f"one unmerged rank-16 adapter:              {adapter_bytes / 1e9:6.3f} GB")
print(f"ratio: {projection_bytes / adapter_bytes:.0f}x")

# %% [markdown]
# The usual production split follows: the few hot adapters are merged onto dedicated instances,
# and the long tail is served unmerged, many adapters per batch, on shared instances. Merging
# also makes switching adapters expensive (rewrite every targeted weight, with the drift shown
# above), while an unmerged server switches by pointing a request at another adapter.

# %% [markdown]
# ## 3. Scaling: `lora_alpha / r` and rsLoRA
#
# The scaling `s` comes from the adapter's `adapter_config.json` (PEFT's `LoraConfig`):
#
# - plain LoRA (Hu et al.): $s = \text{lora\_alpha} / r$;
# - rank-stabilized LoRA (Kalajdzievski, 2023, "A Rank Stabilization Scaling Factor for
#   Fine-Tuning with LoRA"), enabled by `use_rslora: true`: $s = \text{lora\_alpha} / \sqrt{r}$.
#   The paper argues that dividing by `r` shrinks the update too much as the rank grows, so
#   higher ranks learn slower; dividing by $\sqrt{r}$ keeps it stable.
#
# The two agree only at $r = 1$. The cell below prints both for a few common ranks.

# %%
alpha = 16
for rank in (1, 8, 16, 64):
    plain = lora_math.lora_scaling(alpha, rank, use_rslora=False)
    rs = lora_math.lora_scaling(alpha, rank, use_rslora=True)
    print(f"lora_alpha={alpha}, r={rank:>2}:  alpha/r = {plain:<7.4g} alpha/sqrt(r) = {rs:<7.4g}"
          f" ratio {rs / plain:.4g}")

# %% [markdown]
# **The silent bug.** Suppose a server ignores `use_rslora` and computes `lora_alpha / r` for an
# rsLoRA adapter. Nothing fails: the shapes are right, the weights load, every request is
# answered. The adapter's update is simply smaller by a factor $\sqrt{r}$, and the outputs drift
# back toward the base model. The only symptom is quality, which no shape check catches.

# %%
r, alpha = 16, 16
right = lora_math.lora_scaling(alpha, r, use_rslora=True)
wrong = lora_math.lora_scaling(alpha, r, use_rslora=False)
g = torch.Generator().manual_seed(4)
x = torch.randn(4, 128, generator=g)
W = torch.randn(96, 128, generator=g) / 128**0.5
A = torch.randn(r, 128, generator=g) / 128**0.5
B = torch.randn(96, r, generator=g) / r**0.5
base = x @ W.T
effect_right = (lora_math.lora_forward(x, W, A, B, right) - base).norm().item()
effect_wrong = (lora_math.lora_forward(x, W, A, B, wrong) - base).norm().item()
print(f"rsLoRA adapter, r={r}, lora_alpha={alpha}: correct scaling {right}, misread as alpha/r: {wrong}")
print(f"size of the adapter's effect on the output: {effect_right:.3f} correct vs {effect_wrong:.3f} misread"
      f"  ({effect_right / effect_wrong:.1f}x weaker), and no error raised")

# %% [markdown]
# ### Exercise ch01.4: lora_scaling
#
# Write `lora_scaling(lora_alpha, r, use_rslora)`.
#
# - `lora_alpha`: a number (int or float); `r`: an int, the rank; `use_rslora`: a bool.
# - **Returns** a Python `float`: `lora_alpha / sqrt(r)` if `use_rslora`, else `lora_alpha / r`
#   (an `int`, such as `16 // 16`, is the wrong type even when the number is right).
# - Raises `ValueError` if `r` is not positive, zero or negative (a rank of zero has no scaling).
#   A `ValueError`, not an `assert`.

# %% exercise="ch01.4" role="answer"
def lora_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """The factor s that multiplies the low-rank product.

    lora_alpha / r for LoRA, lora_alpha / sqrt(r) for rsLoRA (use_rslora=True).
    Raises ValueError if r <= 0.
    """
    ### BEGIN SOLUTION
    if r <= 0:
        raise ValueError(f"rank r must be positive, got {r}")
    if use_rslora:
        return lora_alpha / math.sqrt(r)
    return lora_alpha / r
    ### END SOLUTION


# %% exercise="ch01.4" role="test"
graders.check("ch01.4", lora_scaling)

# %%
graders.show_reference("ch01.4")

# %% [markdown]
# ## 4. How big is an adapter?
#
# An adapter on a projection with `in` inputs and `out` outputs holds `A` (`r · in` numbers) and
# `B` (`out · r`), so $r(\mathit{in} + \mathit{out})$ parameters. An adapter's size is that sum
# over the targeted projections of one decoder layer, times the number of layers, times the bytes
# per element of its dtype.
#
# The projection shapes come from the model's `config.json` (Hugging Face field names). A Llama
# decoder layer has seven projections, named as PEFT's `target_modules` name them:
#
# | module | in | out |
# |---|---|---|
# | `q_proj` | `hidden_size` | `num_attention_heads · head_dim` |
# | `k_proj`, `v_proj` | `hidden_size` | `num_key_value_heads · head_dim` |
# | `o_proj` | `num_attention_heads · head_dim` | `hidden_size` |
# | `gate_proj`, `up_proj` | `hidden_size` | `intermediate_size` |
# | `down_proj` | `intermediate_size` | `hidden_size` |
#
# Two details matter. With **grouped-query attention** (GQA), `num_key_value_heads` is smaller
# than `num_attention_heads`, so `k_proj` and `v_proj` are narrower than `q_proj`. And
# **`head_dim`** is `hidden_size // num_attention_heads` unless the config gives it explicitly;
# some models set it to something else, and then `q_proj` is not square either. The reference's
# `projection_shapes` prints Llama-3-8B's shapes:

# %%
cfg = lora_math.LLAMA3_8B_CONFIG
print(cfg)
print(f"{len(lora_math.LLAMA_PROJECTIONS)} projections per layer, (in, out):")
for name, (i, o) in lora_math.projection_shapes(cfg).items():
    print(f"  {name:10} ({i:>6}, {o:>6})")

# %% [markdown]
# ### Exercise ch01.5: adapter_num_bytes
#
# Write two functions in the cell below.
#
# `projection_shapes(config)`:
#
# - `config`: a dict of Hugging Face config fields: `hidden_size`, `num_attention_heads`,
#   `num_key_value_heads`, `intermediate_size`, `num_hidden_layers`, and optionally `head_dim`
#   (when absent, `head_dim = hidden_size // num_attention_heads`).
# - **Returns** a dict from each of the seven module names (`q_proj`, `k_proj`, `v_proj`,
#   `o_proj`, `gate_proj`, `up_proj`, `down_proj`) to a tuple `(in_features, out_features)` of
#   ints, as in the table above: in first, out second (the reverse of a weight's `[out, in]`).
# - The grader checks it on its own too (cases named `shapes_...`): a byte count cannot tell
#   `(in, out)` from `(out, in)`, so `adapter_num_bytes` passing is not enough.
#
# `adapter_num_bytes(config, target_modules, r, dtype)`:
#
# - `target_modules`: a list of module names from the seven above (any subset, any order);
#   `r`: the rank (int); `dtype`: a `torch.dtype` such as `torch.bfloat16`.
# - **Returns** an `int`: the number of bytes of the adapter's `A` and `B` weights over all
#   `num_hidden_layers` layers, in `dtype`. Bytes, not parameters.
# - A module name outside the seven raises `KeyError`.
# - Hint: `torch.empty((), dtype=dtype).element_size()` (or `dtype.itemsize`) is the size of one
#   element in bytes.

# %% exercise="ch01.5" role="answer"
def projection_shapes(config: dict) -> dict:
    """(in_features, out_features) of each Llama projection, from Hugging Face config fields."""
    ### BEGIN SOLUTION
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q_width = heads * head_dim
    kv_width = config.get("num_key_value_heads", heads) * head_dim  # narrower than q under GQA
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    ### END SOLUTION


def adapter_num_bytes(config: dict, target_modules: list, r: int, dtype: torch.dtype) -> int:
    """Bytes of one LoRA adapter's weights: r * (in + out) per targeted projection, times
    num_hidden_layers, times the element size of dtype."""
    ### BEGIN SOLUTION
    shapes = projection_shapes(config)
    params_per_layer = sum(r * (shapes[m][0] + shapes[m][1]) for m in target_modules)
    params = params_per_layer * config["num_hidden_layers"]
    return params * torch.empty((), dtype=dtype).element_size()
    ### END SOLUTION


# %% exercise="ch01.5" role="test"
graders.check("ch01.5", adapter_num_bytes)

# %% [markdown]
# The reference splits the same computation into `projection_shapes`, `adapter_num_params` and
# `adapter_num_bytes`:

# %%
graders.show_reference("ch01.5")

# %% [markdown]
# ### Two published figures, one adapter
#
# How big is a rank-16 adapter on all seven projections of an 8B Llama model? A handbook chapter
# on multi-LoRA serving gives **"~80 MB"**; a walkthrough of SGLang's multi-LoRA serving gives
# **"~58 MB"**, reached by treating every projection as `hidden × hidden`. The cell below
# computes both: the real shapes with the reference, and the all-square shortcut.

# %%
cfg, r, dtype = lora_math.LLAMA3_8B_CONFIG, 16, torch.bfloat16
targets = lora_math.LLAMA_PROJECTIONS
params = lora_math.adapter_num_params(cfg, targets, r)
real_bytes = lora_math.adapter_num_bytes(cfg, targets, r, dtype)
hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
# The shortcut: every projection taken as hidden x hidden.
square_bytes = len(targets) * r * (hidden + hidden) * layers * dtype.itemsize

MB, MiB = 10**6, 2**20
print(f"real shapes:  {params:,} parameters = {real_bytes:,} bytes"
      f" = {real_bytes / MiB:.1f} MiB = {real_bytes / MB:.1f} MB")
print(f"all square:   {square_bytes // dtype.itemsize:,} parameters = {square_bytes:,} bytes"
      f" = {square_bytes / MiB:.1f} MiB = {square_bytes / MB:.1f} MB")
print(f"the square shortcut undercounts by {1 - square_bytes / real_bytes:.0%}")

# %% [markdown]
# The handbook's "~80 MB" is the right size **in MiB**; in decimal megabytes the same adapter is
# larger, as printed. The "~58 MB" is the all-square figure in decimal MB. It is wrong because
# two assumptions fail for Llama-3-8B: under GQA `k_proj` and `v_proj` are much narrower than
# `hidden`, and the MLP projections are much wider (`intermediate_size`). The MLP side wins, so
# the shortcut undercounts. The figure at the top of this chapter shows it per projection.
#
# **MB vs MiB.** A megabyte (MB) is $10^6$ bytes; a mebibyte (MiB) is $2^{20}$ bytes. The two
# differ by about 5% (and GB vs GiB by about 7%; both computed below), which is enough to
# misjudge whether one more adapter slot fits. `nvidia-smi` and PyTorch's memory summaries
# count in binary units (MiB, GiB); disk sizes and bandwidth figures (TB/s) count in decimal
# ones. Write the unit you mean, and compute in bytes.

# %%
print(f"1 MiB / 1 MB = {2**20 / 10**6:.4f}    1 GiB / 1 GB = {2**30 / 10**9:.4f}")

# %% [markdown]
# ## 5. FLOPs vs bytes
#
# A projection costs $2\,\mathit{in}\cdot\mathit{out}$ FLOPs per token (one multiply and one add
# per weight). Its LoRA path costs $2r(\mathit{in} + \mathit{out})$: shrink, then expand. The
# ratio over the targeted projections tells how much compute LoRA adds. The factor 2 cancels, and
# so do the number of layers and the number of tokens, since every layer and every token pays the
# same.

# %% [markdown]
# ### Exercise ch01.6: lora_flop_share
#
# Write `lora_flop_share(config, target_modules, r)`.
#
# - `config`, `target_modules`, `r`: as in ch01.5.
# - **Returns** a Python `float`: the LoRA FLOPs per token divided by the base FLOPs per token of
#   the *same* targeted projections,
#   $\dfrac{\sum_m r(\mathit{in}_m + \mathit{out}_m)}{\sum_m \mathit{in}_m\,\mathit{out}_m}$.
#   A fraction, not a percentage: do not multiply by 100.
# - The grader runs this cell on its own, so it cannot see the `projection_shapes` you wrote for
#   ch01.5. Paste your `projection_shapes` into this cell as well (its stub is here for that).
#   If the grader reports "not implemented yet" although you wrote `lora_flop_share`, the
#   `projection_shapes` stub of this cell is still in place. The grader checks this cell's
#   `projection_shapes` on its own as well (cases named `shapes_...`), as in ch01.5, when the cell
#   defines one (computing the shapes inside `lora_flop_share` instead is fine too).

# %% exercise="ch01.6" role="answer"
def projection_shapes(config: dict) -> dict:
    """(in_features, out_features) of each Llama projection (the same function as in ch01.5)."""
    ### BEGIN SOLUTION
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q_width = heads * head_dim
    kv_width = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, q_width),
        "k_proj": (hidden, kv_width),
        "v_proj": (hidden, kv_width),
        "o_proj": (q_width, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    ### END SOLUTION


def lora_flop_share(config: dict, target_modules: list, r: int) -> float:
    """LoRA FLOPs per token / base FLOPs per token of the same projections, as a fraction."""
    ### BEGIN SOLUTION
    shapes = projection_shapes(config)
    lora_flops = sum(2 * r * (shapes[m][0] + shapes[m][1]) for m in target_modules)
    base_flops = sum(2 * shapes[m][0] * shapes[m][1] for m in target_modules)
    return lora_flops / base_flops
    ### END SOLUTION


# %% exercise="ch01.6" role="test"
graders.check("ch01.6", lora_flop_share)

# %%
graders.show_reference("ch01.6")

# %% [markdown]
# The reference drops the factor 2 from both sums; it cancels. For Llama-3-8B at rank 16 on all
# seven projections:

# %%
share = lora_math.lora_flop_share(lora_math.LLAMA3_8B_CONFIG, lora_math.LLAMA_PROJECTIONS, 16)
print(f"LoRA FLOPs / base FLOPs of the seven projections: {share:.4f} = {share:.2%}")

# %% [markdown]
# Well under one percent, and less still counting FLOPs LoRA does not touch here (the
# attention itself and the `lm_head`). If FLOPs were the cost, LoRA would be free.

# %% [markdown]
# ### Why decode is memory-bound anyway
#
# In decode, each request contributes one token per step. Every step must read **all** the base
# weights from GPU memory, however few tokens there are to multiply them with; the same weights
# serve every token of the batch. The adapters are read too: each *distinct* adapter in the batch
# once. So per step:
#
# - base FLOPs grow with the batch; base bytes do not;
# - LoRA FLOPs grow with the batch (a fixed fraction of the base, computed above); LoRA bytes grow
#   with the number of distinct adapters in the batch.
#
# The cell below counts both for a decode step of a batch of 32 requests on Llama-3-8B
# (projections only, bf16, rank 16), as the number of distinct adapters grows.

# %%
cfg, r, dtype = lora_math.LLAMA3_8B_CONFIG, 16, torch.bfloat16
targets = lora_math.LLAMA_PROJECTIONS
shapes = lora_math.projection_shapes(cfg)
layers = cfg["num_hidden_layers"]
base_params = sum(i * o for i, o in shapes.values()) * layers
lora_params = lora_math.adapter_num_params(cfg, targets, r)
batch = 32  # requests in the step, one token each

base_flops = 2 * base_params * batch
base_bytes = base_params * dtype.itemsize
lora_flops = 2 * lora_params * batch
print(f"decode step, batch {batch}: base weights {base_bytes / 1e9:.2f} GB read, "
      f"{base_flops / base_bytes:.0f} FLOP per byte read")
print(f"{'distinct adapters':>18} {'adapter bytes':>14} {'extra bytes':>12} {'extra FLOPs':>12}"
      f" {'LoRA FLOP/byte':>15}")
for k in (1, 2, 8, 32):
    adapter_bytes = k * lora_params * dtype.itemsize
    print(f"{k:>18} {adapter_bytes / 1e9:>11.2f} GB {adapter_bytes / base_bytes:>12.1%}"
          f" {lora_flops / base_flops:>12.2%} {lora_flops / adapter_bytes:>15.0f}")

# %% [markdown]
# Read the table row by row. The extra FLOPs stay at the small share computed above. The extra
# bytes grow with every distinct adapter, and with one request per adapter (the last row) they
# are a substantial fraction of the base weights' bytes. The LoRA path's own arithmetic
# intensity (FLOPs per byte read) is the number of tokens per adapter: one FLOP per byte when
# every request brings its own adapter.
#
# Is a few dozen FLOPs per byte low? Compare with what a GPU can do per byte it reads. NVIDIA's
# H200 datasheet lists 1,979 TFLOPS of BF16 Tensor Core throughput (a figure it footnotes as "with
# sparsity"; dense is half) and 4.8 TB/s of memory bandwidth. Their ratio, the *ridge point*:

# %%
h200_bf16_dense_flops = 1979e12 / 2  # NVIDIA H200 datasheet: 1,979 TFLOPS BF16 "with sparsity"
h200_hbm_bytes_per_s = 4.8e12        # NVIDIA H200 datasheet: 4.8 TB/s
ridge = h200_bf16_dense_flops / h200_hbm_bytes_per_s
print(f"H200 ridge point: {ridge:.0f} FLOP per byte")
print(f"decode step above: {base_flops / base_bytes:.0f} FLOP per byte -> "
      f"{'memory-bound' if base_flops / base_bytes < ridge else 'compute-bound'}")

# %% [markdown]
# A decode step sits far below the ridge point: its time is set by bytes read, and the tensor
# cores wait for memory. (Attention adds more reads, of the KV cache, which we have not counted.)
# That is why adapter cost in serving is a **bytes** question: what costs time is how many
# distinct adapters a batch touches. Chapter 02 builds the kernels that read each adapter once
# per batch, and later chapters the pool and scheduler that keep the number of distinct
# adapters per batch in check.

# %% [markdown]
# ## How production systems do it
#
# - **PEFT (training, offline merging).** `merge_and_unload()` (defined on the tuner base class
#   in `peft/tuners/tuners_utils.py`) folds every LoRA layer into its base weight and returns a
#   plain `transformers` model: nothing distinguishes it from a full fine-tune, so any server runs
#   it at base-model cost. The per-layer work is `Linear.merge` and `Linear.unmerge` in
#   `peft/tuners/lora/layer.py`, built on `get_delta_weight`, which returns `B @ A * scaling`.
#   `merge(safe_merge=True)` merges into a copy first and raises if the result is not finite.
#   `unmerge` subtracts the same delta in the weight's dtype, so it shows the drift measured in
#   section 2. The scaling is set in `LoraLayer.update_layer`: `lora_alpha / math.sqrt(r)` when
#   `use_rslora`, else `lora_alpha / r`.
# - **vLLM** serves adapters unmerged. The layer wrappers in `vllm/lora/layers/`
#   (`base_linear.py`, `column_parallel_linear.py`, `row_parallel_linear.py`) run the base
#   layer's GEMM once for the batch and then add the LoRA path through the Punica wrapper
#   (`vllm/lora/punica_wrapper/punica_gpu.py`), which launches shrink and expand Triton kernels
#   (`vllm/lora/ops/triton_ops/lora_shrink_op.py`, `lora_expand_op.py`). The scale is computed in
#   `vllm/lora/peft_helper.py` (with the `sqrt(r)` branch for `use_rslora`), and
#   `LoRALayerWeights.optimize()` in `vllm/lora/lora_weights.py` multiplies it into `B` once at
#   load time, so the kernels never see it.
# - **SGLang** serves unmerged too. `python/sglang/srt/lora/layers.py` wraps the base layers;
#   `lora_manager.py` and `mem_pool.py` keep adapters in fixed GPU slots; `utils.py` derives the
#   projection shapes from the Hugging Face config with the `head_dim` fallback you wrote in
#   ch01.5 (`get_default_hidden_dim`) and defines `LoRABatchInfo`, which carries one `scalings`
#   entry per adapter slot. The Triton kernels in `python/sglang/srt/lora/triton_ops/`
#   (`sgemm_lora_a.py` shrink, `sgemm_lora_b.py` expand, and fused `qkv_lora_b.py`,
#   `gate_up_lora_b.py`) apply the scaling in the expand step and add into the base output.
# - **Deployment.** The common split is the one derived in section 2: merge the few hot adapters
#   (PEFT's `merge_and_unload`, then serve the result as an ordinary model on dedicated
#   instances) and serve the long tail unmerged on shared instances, many adapters per batch.

# %% [markdown]
# ## Summary
#
# - A LoRA layer computes $y = x W^\top + s\,(x A^\top) B^\top$ with `W [out, in]`, `A [r, in]`,
#   `B [out, r]`: a shrink to rank `r`, then an expand, never the full `B @ A`.
# - Merging folds $s\,BA$ into `W`: base-model cost, one adapter per weight copy. In bf16,
#   merge-then-unmerge does not restore `W` bit for bit (measured in section 2).
# - Unmerged serving runs the base GEMM once per batch and only the thin LoRA path per adapter:
#   the right deployment when a batch mixes adapters.
# - The scaling is `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`. Mixing them up
#   raises no error; the adapter is weaker by $\sqrt{r}$.
# - Adapter size is $r(\mathit{in} + \mathit{out})$ per targeted projection, times layers, times
#   bytes per element; GQA and the MLP widths make Llama-3-8B's rank-16, seven-projection adapter
#   80.0 MiB in bf16, as computed in section 4. MB and MiB differ; say which.
# - LoRA adds well under one percent of the projections' FLOPs, but decode is memory-bound and
#   every distinct adapter in a batch adds its bytes to every step.

# %% [markdown]
# ## Review questions
#
# 1. A service merges an adapter into a bf16 model to serve it, then unmerges it to serve the
#    base model again. Is it serving the original base model? What would you do instead?
# 2. A handful of adapters receive most of your traffic, and hundreds of others receive a few
#    requests a day each. Which adapters would you merge, which would you serve unmerged, and why?
# 3. An adapter trained with `use_rslora=True`, `r=64`, is loaded by a server that always computes
#    `lora_alpha / r`. By what factor is its update scaled down, and how would you notice?
# 4. Why does the LoRA FLOP share not depend on the number of layers or the batch size, while the
#    extra bytes of a decode step depend on the number of distinct adapters in the batch?
# 5. A model's config has `hidden_size` 5120, `num_attention_heads` 32 and `head_dim` 128.
#    What are the shapes of its `q_proj` and `o_proj`, and what goes wrong if you assume
#    `hidden_size // num_attention_heads`?
