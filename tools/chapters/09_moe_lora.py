# %% [markdown]
# # 09 · MoE LoRA with virtual experts
#
# In a mixture-of-experts (MoE) layer every token is routed to a few of many expert MLPs. An adapter
# fine-tuned on such a model has LoRA weights **per expert**, so the delta a token gets depends on
# two things at once: its adapter (as in every chapter so far) and the experts the router chose for
# it. This chapter builds multi-LoRA for MoE layers the way SGLang does: index every
# (adapter slot, expert) pair as one **virtual expert**, and let the routed MoE's own scheduling
# machinery (sort the (token, expert) pairs, pad each expert's group to whole blocks) schedule the
# LoRA as well.
#
# **What you will learn**
# - What an adapter on a MoE model holds: 4-D buffers with an expert axis, per-expert ranks, and
#   how big that gets for real MoE models.
# - Virtual experts (`slot * num_experts + expert`) and the aligned block layout of vLLM's and
#   SGLang's `moe_align_block_size`.
# - The MoE LoRA op: which rows it reads (the token for gate_up, the pair's activation for down),
#   where the routing weight goes, and one table that says where gate and up live.
# - The edge cases that break real servers: experts or layers an adapter lacks (rank 0, explicitly),
#   shared experts, base-model tokens.
# - A Triton kernel over the sorted blocks, and the whole thing judged against PEFT on a tiny Mixtral
#   here (the book's tests judge a tiny Qwen2-MoE the same way).
# - Expert parallelism: local against global expert ids, and what the wrong pairing does.
#
# **Exercises**: ch09.1 `virtual_expert_ids`, ch09.2 `moe_align_block_size`, ch09.3 `fused_moe_lora`,
# ch09.4 `to_local_expert_ids`, ch09.5 `split_expert_lora`.

# %%
import json
import tempfile
from pathlib import Path

import reference  # first: device choice
import torch

import graders
from reference.moe import lora as moe_lora
from reference.moe import sizes as moe_sizes
from reference.device import default_device

device = default_device()
print("device:", device)

# %% [markdown]
# ## 1. Per-expert LoRA buffers
#
# A dense projection's LoRA lives in the slot buffers of chapter 05: `A_buffer [slots, stack * r, in]`,
# `B_buffer [slots, out, r]`. A MoE layer has `E` experts, each with its own `gate_up_proj` and
# `down_proj`, and an adapter trained on the experts has separate LoRA weights for each. The buffers
# gain an expert axis (SGLang's 4-D MoE buffers; TensorRT-LLM offsets both pointers by
# `expert_index * dim * rank`):
#
#     A [num_slots, num_experts, stack_num * max_rank, in]     B [num_slots, num_experts, out_total, max_rank]
#     lora_ranks [num_slots, num_experts]
#
# As in chapter 04's stacked buffers, the slices of a stacked module are packed at the adapter's own
# rank, not at `max_rank`: for a rank-`r` adapter, slice `i` of `A[s, e]` is rows `i*r .. (i+1)*r - 1`,
# and the rows past `stack * r` (`stack` = `stack_num`) are padding; of `B[s, e]` only the first `r`
# columns hold weights.
#
# The ranks are per (slot, expert): an adapter that covers only some experts, or none of a layer's,
# carries **rank 0 there, explicitly**. A grouped kernel scheduled over those (slot, expert) groups
# would otherwise read weights that were never written (garbage in a reused slot, or a null pointer in
# a server that allocates per adapter); with rank 0 it never schedules them at all.
#
# How big that gets: an adapter's bytes for three published MoE configs (`reference.moe.sizes` holds
# the fields of their config.json files), at rank 16 in bf16, on attention only and on attention plus
# every MLP (routed experts, shared experts, dense layers). Each expert's gate, up and down count as
# separate LoRA targets, as PEFT's `target_modules` names them:

# %%
mlp = ["gate_proj", "up_proj", "down_proj"]
for name, config in (("Mixtral-8x7B", moe_sizes.MIXTRAL_8X7B), ("Qwen3-30B-A3B", moe_sizes.QWEN3_30B_A3B),
                     ("DeepSeek-V3", moe_sizes.DEEPSEEK_V3)):
    attention = sorted(moe_sizes.attention_shapes(config))  # DeepSeek-V3: latent attention's projections
    attn_only = moe_sizes.moe_adapter_bytes(config, 16, attention)
    everything = moe_sizes.moe_adapter_bytes(config, 16, attention + mlp)
    print(f"{name:14s}: attention only {attn_only['total'] / 2**20:7.1f} MiB; with every MLP "
          f"{everything['total'] / 2**20:8.1f} MiB ({everything['routed_experts'] / everything['total']:.0%} in "
          f"routed experts; {config.get('num_local_experts') or config.get('num_experts') or config.get('n_routed_experts')}"
          f" experts per layer)")

# %% [markdown]
# The routed experts dominate as soon as an adapter targets the MLP, and they grow with the number of
# experts, not with the active ones: a pool slot must hold every expert's weights, even though a token
# uses `top_k` of them.
#
# A (token, choice) **pair** `p = token * top_k + j` runs expert `e = topk_ids[token, j]` under the
# token's slot `s = token_slots[token]`. Every pair of one (slot, expert) reads the same A and B: the
# (slot, expert) pair *is* the unit of work, exactly as an expert is in the base MoE layer. Name it
# **virtual expert** `slot * num_experts + expert`, and the LoRA becomes an ordinary routed MoE over
# `num_slots * num_experts` experts. The numbering puts one slot's experts next to each other, so
# `A.view(num_slots * num_experts, ...)[v]` is `A[v // num_experts, v % num_experts]`.

# %%
topk_ids = torch.tensor([[1, 3], [0, 2], [3, 1]])  # 3 tokens, top_k 2, 4 experts
token_slots = torch.tensor([0, 2, 1])  # token 0 on slot 0 (the base model here), tokens 1, 2 on adapters
print(moe_lora.virtual_expert_ids(topk_ids, token_slots, num_experts=4))

# %% [markdown]
# ### Exercise ch09.1: `virtual_expert_ids`
#
# Write `virtual_expert_ids(topk_ids, token_slots, num_experts)`: for `topk_ids [num_tokens, top_k]`
# (integers) and `token_slots [num_tokens]`, return `[num_tokens, top_k]` **int64** ids
# `token_slots[t] * num_experts + topk_ids[t, j]`. A **negative** id (-1 marks an expert another
# expert-parallel rank holds, section 4) gives -1. Raise `ValueError` when `topk_ids` is not 2-D, when
# `token_slots` is not a 1-D tensor with one entry per token, or when an expert id is `>= num_experts`.
# Zero tokens (`topk_ids` of shape `[0, top_k]`, a step in which no token reaches this layer's
# experts) is not an error: return an empty `[0, top_k]` int64 tensor. The example above gives
# `[[1, 3], [8, 10], [7, 5]]`.

# %% exercise="ch09.1" role="answer"
def virtual_expert_ids(topk_ids, token_slots, num_experts):
    """[num_tokens, top_k] int64: slot * num_experts + expert; -1 stays -1."""
    ### BEGIN SOLUTION
    if topk_ids.dim() != 2 or token_slots.shape != (topk_ids.shape[0],):
        raise ValueError("topk_ids [num_tokens, top_k] and token_slots [num_tokens]")
    ids = topk_ids.long()
    if ids.numel() and int(ids.max()) >= num_experts:
        raise ValueError(f"expert id {int(ids.max())} >= num_experts {num_experts}")
    virtual = token_slots.long().view(-1, 1) * num_experts + ids
    return torch.where(ids < 0, torch.full_like(virtual, -1), virtual)
    ### END SOLUTION


# %% exercise="ch09.1" role="test"
graders.check("ch09.1", virtual_expert_ids)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch09.1")

# %% [markdown]
# ## 2. The aligned block layout
#
# A routed MoE kernel (vLLM's `fused_moe`, SGLang's) does not loop over experts. It sorts the pairs by
# expert, pads each expert's group to a whole number of blocks of `BLOCK_M` pairs, and launches one
# program per block: every real pair of a block shares one expert and so one weight matrix. The
# layout comes from `moe_align_block_size`:
#
# - `sorted_pair_ids [num_blocks * block_size]` (int32): pair indices in id order, **stable** inside
#   a group (pairs of one id keep their order); the padding of each group holds `num_pairs`, an index
#   past the last pair, which the kernel masks (`pair < num_pairs`);
# - `block_ids [num_blocks]` (int32): the id of block b's pairs;
# - `num_pairs = num_tokens * top_k`.
#
# Ids with no pairs get no blocks. Pairs with id -1 (not on this rank) are left out. Fed virtual
# expert ids, the same function schedules the LoRA: one block = one (slot, expert) = one A and one B.
# One more input matters for LoRA: `skip [num_ids]` (bool) marks groups that must get no blocks
# even when they have pairs, namely the (slot, expert) groups of rank 0. A base-model token, or
# an adapter without weights for that expert, then costs no program and reads nothing.

# %%
ids = torch.tensor([[2, 0], [1, 2], [0, 2]])  # pairs 0..5 have ids 2, 0, 1, 2, 0, 2
aligned = moe_lora.moe_align_block_size(ids, block_size=2, num_ids=3)
print("sorted_pair_ids", aligned.sorted_pair_ids.view(-1, 2).tolist(), " (rows = blocks; 6 = padding)")
print("block_ids      ", aligned.block_ids.tolist())
skipped = moe_lora.moe_align_block_size(ids, 2, 3, skip=torch.tensor([False, True, False]))
print("with id 1 skipped:", skipped.sorted_pair_ids.view(-1, 2).tolist(), skipped.block_ids.tolist())

# %% [markdown]
# Padding costs compute: a group of `c` pairs takes `ceil(c / block_size)` blocks. With virtual
# experts the groups are smaller than the base MoE's (a base expert's pairs are split over the
# adapters present), so more of each block is padding. The count for one decode batch (64 tokens,
# top-2 of 8 experts, tokens spread over 8 adapters, blocks of 16 pairs):

# %%
g = torch.Generator().manual_seed(0)
tok = 64
experts = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(tok)])
adapter = torch.arange(tok) % 8 + 1
for name, id_tensor, n in (("base experts", experts, 8),
                           ("virtual experts", moe_lora.virtual_expert_ids(experts, adapter, 8), 9 * 8)):
    a = moe_lora.moe_align_block_size(id_tensor, 16, n)
    print(f"{name:16s}: {a.block_ids.numel():3d} blocks, {a.sorted_pair_ids.numel()} rows for {a.num_pairs} pairs "
          f"({1 - a.num_pairs / a.sorted_pair_ids.numel():.0%} padding)")

# %% [markdown]
# ### Exercise ch09.2: `moe_align_block_size`
#
# Write `moe_align_block_size(ids, block_size, num_ids, skip=None)` returning the tuple
# `(sorted_pair_ids, block_ids, num_pairs)` described above (a plain tuple is enough; the reference
# returns `AlignedBlocks`, a named tuple of those three fields, which is why the demonstration reads
# them by name): `ids` is `[num_tokens, top_k]` integer ids in `[0, num_ids)`, or negative (left
# out); pair `p` is `ids.reshape(-1)[p]`, so
# `p = token * top_k + choice`. Groups in increasing id order, pairs stable inside a group; each group
# takes `ceil(count / block_size)` blocks of its own, its real pairs first and then the padding (the
# value `num_pairs`) that fills its last block. No blocks for ids without pairs, for negative ids, or
# for ids set in `skip` (a `[num_ids]` bool tensor). Both tensors are int32 on the device of `ids`;
# `num_pairs` is a Python int. Raise `ValueError` for `block_size < 1` or an id `>= num_ids`.

# %% exercise="ch09.2" role="answer"
def moe_align_block_size(ids, block_size, num_ids, skip=None):
    """(sorted_pair_ids int32, block_ids int32, num_pairs): pairs sorted by id, groups padded to blocks."""
    ### BEGIN SOLUTION
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    if num_pairs and int(flat.max()) >= num_ids:
        raise ValueError(f"id {int(flat.max())} >= num_ids {num_ids}")
    sorted_ids, block_ids = [], []
    for v in range(num_ids):
        if skip is not None and bool(skip[v]):
            continue
        group = torch.nonzero(flat == v).view(-1).tolist()  # in pair order: stable
        while group:
            chunk, group = group[:block_size], group[block_size:]
            sorted_ids += chunk + [num_pairs] * (block_size - len(chunk))
            block_ids.append(v)
    return (torch.tensor(sorted_ids, dtype=torch.int32, device=ids.device),
            torch.tensor(block_ids, dtype=torch.int32, device=ids.device), num_pairs)
    ### END SOLUTION


# %% exercise="ch09.2" role="test"
graders.check("ch09.2", moe_align_block_size)

# %% [markdown]
# The reference (shown once your check passed) does the same without a Python loop over ids:

# %%
graders.show_reference("ch09.2")

# %% [markdown]
# ## 3. The MoE LoRA op
#
# transformers' Mixtral and Qwen2-MoE experts compute, for each pair (token t, choice j, expert e):
#
#     gate, up = (x[t] @ gate_up_proj[e].T).chunk(2)        # [2 * I]: gate first, then up
#     y = (silu(gate) * up) @ down_proj[e].T                 # [H]
#     out[t] += topk_weights[t, j] * y
#
# LoRA adds a delta to each of the two projections **before** what follows them: to gate_up's output
# before the activation, to down's output before the routing weight multiplies it. So the op runs
# twice per layer, with different rows:
#
# - gate_up: the rows are **tokens** (`x [num_tokens, H]`, read as `x[p // top_k]`), two output slices
#   (gate | up), the delta added into the pair's `[num_pairs, 2 * I]` intermediate;
# - down: the rows are **pairs** (`x [num_pairs, I]`, the pair's own activation), one slice.
#
# The routing weight: a model layer that multiplies `y` (base + delta) by `topk_weights` itself, as
# transformers does, passes `topk_weights=None`; a fused kernel that writes the weighted sum in its
# epilogue (vLLM's second GEMM) passes the weights and the op multiplies the delta by them. Either
# way the weight multiplies the delta exactly once.
#
# **Where gate and up live.** One table, `moe_lora.GATE_UP_HALVES`, says which half of the fused
# output each one is. The pool, the loader and the kernels all read it. A gate LoRA added to the up
# half gives numbers of the right size and wrong meaning, and no shape check can catch it
# (TensorRT-LLM keeps the same single source of truth for its fused MoE LoRA modules):

# %%
print(moe_lora.GATE_UP_HALVES, "-> for intermediate 14336: gate", moe_lora.gate_up_half("gate", 14336),
      "up", moe_lora.gate_up_half("up", 14336))

# %% [markdown]
# ### Exercise ch09.3: `fused_moe_lora`
#
# Write `fused_moe_lora(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k, rows_per_pair,
# slice_offsets=None, topk_weights=None)`, updating `out [num_pairs, out_total]` in place and
# returning it. For every pair `p = t * top_k + j` with `e = topk_ids[t, j] >= 0`, `s = token_slots[t]`
# and `r = lora_ranks[s, e] > 0`:
#
#     row = x[p] if rows_per_pair else x[t]
#     for slice i, output columns [o_i, o_{i+1}) (slice_offsets; None = one slice, all of out):
#         h = row @ A[s, e, i*r:(i+1)*r].T
#         out[p, o_i:o_{i+1}] += scalings[s] * (topk_weights[t, j] if given else 1) * (h @ B[s, e, o_i:o_{i+1}, :r].T)
#
# Read nothing else of A and B (rows past `stack * r` and columns past `r` are padding; a group of rank
# 0 may hold anything). Pairs with rank 0 or expert -1 come back **bit for bit** unchanged. `x`, `A`,
# `B` and `out` share one floating dtype, fp32 or bf16 (`scalings` and `topk_weights` are float32);
# write in `out.dtype`. (The reference accumulates in fp32 and rounds `h` to `x.dtype`, as a
# two-kernel path does; at the graded bf16 tolerance, computing in bf16 throughout also passes, so
# that part is advice.)

# %% exercise="ch09.3" role="answer"
def fused_moe_lora(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k, rows_per_pair,
                   slice_offsets=None, topk_weights=None):
    """out[pair] += the (slot, expert) LoRA delta of every pair; returns out."""
    ### BEGIN SOLUTION
    offsets = list(slice_offsets) if slice_offsets is not None else [0, out.shape[1]]
    num_tokens = topk_ids.shape[0]
    for t in range(num_tokens):
        s = int(token_slots[t])
        for j in range(top_k):
            e = int(topk_ids[t, j])
            if e < 0:
                continue
            r = int(lora_ranks[s, e])
            if r == 0:
                continue
            p = t * top_k + j
            row = (x[p] if rows_per_pair else x[t]).float()
            scale = float(scalings[s]) * (float(topk_weights[t, j]) if topk_weights is not None else 1.0)
            for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
                h = (A[s, e, i * r:(i + 1) * r].float() @ row).to(x.dtype).float()
                delta = B[s, e, lo:hi, :r].float() @ h
                out[p, lo:hi] = (out[p, lo:hi].float() + scale * delta).to(out.dtype)
    return out
    ### END SOLUTION


# %% exercise="ch09.3" role="test"
graders.check("ch09.3", fused_moe_lora)

# %% [markdown]
# The reference (shown once your check passed) works one (slot, expert) group at a time, which is
# the loop the Triton kernel parallelizes:

# %%
graders.show_reference("ch09.3")

# %% [markdown]
# ## 4. Expert parallelism: local or global expert ids
#
# With expert parallelism (EP) the experts are split over ranks; rank q of `ep_size` holds the
# contiguous block `[q * E / ep_size, (q + 1) * E / ep_size)`. Each rank computes the pairs routed to
# its experts, and the outputs are summed across ranks. Dispatchers differ in one detail that decides
# how the LoRA buffers are laid out: some remap global expert ids to **local** ones before the MoE
# kernel (SGLang's `moe_use_local_expert_ids`), so the buffers have `E / ep_size` experts; others keep
# **global** ids, with buffers indexed by the global id (the rank's own experts filled, the rest never
# read). Either works; mixing them (local ids into global buffers) silently reads another expert's
# weights.
#
# ### Exercise ch09.4: `to_local_expert_ids`
#
# Write `to_local_expert_ids(topk_ids, ep_rank, ep_size, num_experts)`: the local id
# `global - ep_rank * (num_experts // ep_size)` for the experts rank `ep_rank` holds, -1 for every other
# expert (and for -1 inputs), as an int64 tensor shaped like `topk_ids`. Raise `ValueError` unless
# `ep_size >= 1` divides `num_experts` and `0 <= ep_rank < ep_size`.

# %% exercise="ch09.4" role="answer"
def to_local_expert_ids(topk_ids, ep_rank, ep_size, num_experts):
    """Global expert ids -> this EP rank's local ids; -1 for experts of other ranks."""
    ### BEGIN SOLUTION
    if ep_size < 1 or num_experts % ep_size != 0 or not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_size {ep_size} must divide {num_experts} experts, 0 <= ep_rank < ep_size")
    per_rank = num_experts // ep_size
    local = topk_ids.long() - ep_rank * per_rank
    mine = (topk_ids >= 0) & (local >= 0) & (local < per_rank)
    return torch.where(mine, local, torch.full_like(local, -1))
    ### END SOLUTION


# %% exercise="ch09.4" role="test"
graders.check("ch09.4", to_local_expert_ids)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch09.4")

# %% [markdown]
# Both conventions on two simulated EP ranks, with the op of section 3 (the reference's). Each rank
# holds half of the experts' LoRA weights; the sum over ranks must equal one rank holding all of
# them:

# %%
g = torch.Generator().manual_seed(3)
T, E, k, S, r, H, O = 6, 4, 2, 3, 4, 16, 12
A = torch.randn(S, E, r, H, generator=g)
B = torch.randn(S, E, O, r, generator=g)
ranks = torch.full((S, E), r, dtype=torch.int32)
ranks[0] = 0  # slot 0: the base model
sc = torch.tensor([0.0, 1.0, 0.5])
xt = torch.randn(T, H, generator=g)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
slots = torch.tensor([1, 2, 0, 1, 2, 1])


def run(A_, B_, ranks_, ids_):
    return moe_lora.fused_moe_lora_torch(xt, A_, B_, torch.zeros(T * k, O), ids_, slots, ranks_, sc, k, False)


full = run(A, B, ranks, ids)
half = E // 2
local_sum = sum(run(A[:, q * half:(q + 1) * half], B[:, q * half:(q + 1) * half], ranks[:, q * half:(q + 1) * half],
                    moe_lora.to_local_expert_ids(ids, q, 2, E)) for q in range(2))
global_sum = torch.zeros_like(full)
for q in range(2):
    mask = torch.zeros(E, dtype=torch.bool)
    mask[q * half:(q + 1) * half] = True
    global_ids = torch.where(mask[ids], ids, torch.full_like(ids, -1))
    global_sum += run(A * mask.view(1, E, 1, 1), B * mask.view(1, E, 1, 1), ranks * mask, global_ids)
wrong = torch.zeros_like(full)
for q in range(2):  # local ids fed to rank q's global buffers: local 0..1 name global experts 0..1
    mask = torch.zeros(E, dtype=torch.bool)
    mask[q * half:(q + 1) * half] = True
    wrong += run(A * mask.view(1, E, 1, 1), B * mask.view(1, E, 1, 1), ranks * mask,
                 moe_lora.to_local_expert_ids(ids, q, 2, E))
print("local ids, E/2 buffers   == one rank:", torch.allclose(local_sum, full, atol=1e-5))
print("global ids, E buffers    == one rank:", torch.allclose(global_sum, full, atol=1e-5))
print("local ids, global buffers == one rank:", torch.allclose(wrong, full, atol=1e-5),
      f"(max error {(wrong - full).abs().max():.3f})")

# %% [markdown]
# ## 5. Loading PEFT adapters on experts
#
# PEFT puts LoRA on transformers' 3-D expert parameters with
# `LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ...)`, beside
# ordinary `target_modules` such as the attention projections. Mixtral's `experts.gate_up_proj` is
# `[E, 2I, H]` and `experts.down_proj` `[E, H, I]`. For each targeted parameter the saved file holds one
# pair for all experts: `lora_A [E * r, in]` and `lora_B [out, E * r]`. The two `E * r` axes are **not**
# ordered the same way (found by experiment against PEFT's own `get_delta_weight`, transformers 5.24 /
# peft 0.21; `reference/moe/adapters.py` records how):
#
#     A_e = lora_A[e*r:(e+1)*r]      expert-major: one block of r rows per expert
#     B_e = lora_B[:, e::E]          rank-major: column k*E + e is expert e's k-th column
#
# Reading B in blocks like A gives every expert a delta of the right shape and size, built from other
# experts' columns. The check below builds a tiny Mixtral with one PEFT adapter on its experts and
# compares both readings with PEFT's delta for every expert:

# %%
import copy
import warnings

import peft
import transformers

from reference.moe.adapters import split_expert_lora

torch.manual_seed(0)
MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
           num_local_experts=4, num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64,
           experts_implementation="eager")
tiny = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MOE)).eval()
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    probe = peft.get_peft_model(copy.deepcopy(tiny), peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj"],
        target_parameters=["mlp.experts.down_proj"]))
wrapper = probe.base_model.model.model.layers[0].mlp.experts  # PEFT's ParamWrapper around down_proj
lora_A, lora_B = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
print("lora_A", list(lora_A.shape), " lora_B", list(lora_B.shape), " (E = 4, r = 4)")
with torch.no_grad():
    peft_delta = wrapper.get_delta_weight("default")  # [E, H, I]: scaling * B_e @ A_e
    scaling = wrapper.scaling["default"]
    for label, pairs in (("B_e = lora_B[:, e::E]        ", split_expert_lora(lora_A, lora_B, 4)),
                         ("B_e = lora_B[:, e*r:(e+1)*r] ", [(lora_A[e * 4:(e + 1) * 4], lora_B[:, e * 4:(e + 1) * 4])
                                                            for e in range(4)])):
        ok = [torch.allclose(scaling * B_e @ A_e, peft_delta[e].reshape(B_e.shape[0], -1), atol=1e-6)
              for e, (A_e, B_e) in enumerate(pairs)]
        print(label, "matches PEFT for experts", [e for e, good in enumerate(ok) if good])

# %% [markdown]
# ### Exercise ch09.5: `split_expert_lora`
#
# Write `split_expert_lora(lora_A, lora_B, num_experts)`: for PEFT's `lora_A [E * r, in]` and
# `lora_B [out, E * r]`, return a list of `num_experts` pairs `(A_e [r, in], B_e [out, r])` with the
# orders above, in the inputs' dtype (views of the inputs are fine: the pool copies them into its
# slots). Raise `ValueError` when `lora_A`'s rows are not a non-zero multiple of `num_experts` or when
# `lora_B` does not have as many columns as `lora_A` has rows.

# %% exercise="ch09.5" role="answer"
def split_expert_lora(lora_A, lora_B, num_experts):
    """PEFT's [E*r, in] / [out, E*r] expert LoRA -> [(A_e [r, in], B_e [out, r])] per expert."""
    ### BEGIN SOLUTION
    rows = lora_A.shape[0]
    if rows == 0 or rows % num_experts != 0 or lora_B.shape[1] != rows:
        raise ValueError(f"lora_A {list(lora_A.shape)} and lora_B {list(lora_B.shape)} do not split into "
                         f"{num_experts} experts")
    r = rows // num_experts
    return [(lora_A[e * r:(e + 1) * r], lora_B[:, e::num_experts]) for e in range(num_experts)]
    ### END SOLUTION


# %% exercise="ch09.5" role="test"
graders.check("ch09.5", split_expert_lora)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch09.5")

# %% [markdown]
# PEFT's gate_up LoRA is **one** pair over all `2I` output rows (the gate's rows first). The pool
# stores gate_up as two slices, each with its own A rows (section 3's layout, which also serves
# adapters trained with separate gate and up LoRAs), so a PEFT adapter's A goes into both slices and
# B's gate rows and up rows go where `GATE_UP_HALVES` says: one extra shrink per pair, traded for one
# layout.
#
# ## 6. A whole MoE model against PEFT
#
# `reference.moe.pool.MoELoRAMemoryPool` is chapter 05's pool with expert buffers: the same slots,
# eviction, pinning and `prepare_lora_batch`, and for every MoE layer the 4-D buffers and the
# `[slots, experts]` ranks, written by the same `load_to_slot` (validated before any write).
# `reference.moe.layers.wrap_moe_model` wraps attention with chapter 07's LoRA layers and replaces each
# routed experts module with `LoRAExperts`, which runs the base experts per pair and adds the op of
# section 3 twice (gate_up on token rows, down on pair rows) before the routing weight.
#
# PEFT cannot mix these adapters in one batch (`adapter_names=` refuses its `ParamWrapper` layers), so
# the judge runs PEFT once per adapter (`set_adapter`) on that adapter's requests and compares row by
# row with **one** mixed batch of ours: two adapters of ranks 4 and 8 (on attention and the experts),
# the second missing its layer-1 experts, and the base model, in one prefill.

# %%
from safetensors.torch import load_file, save_file

from reference.batch_info import batch_info_from_requests
from reference.layers import LoRAContext
from reference.moe.adapters import load_moe_peft_adapter
from reference.moe.layers import moe_module_specs, wrap_moe_model
from reference.moe.pool import MoELoRAMemoryPool

work = Path(tempfile.mkdtemp(prefix="ch09-"))
experts_targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
for seed, (name, r, targets) in enumerate((("r4", 4, ["q_proj", "v_proj"]), ("r8", 8, ["q_proj", "o_proj"]))):
    torch.manual_seed(10 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.get_peft_model(copy.deepcopy(tiny), peft.LoraConfig(
            r=r, lora_alpha=2 * r, init_lora_weights=False, target_modules=targets,
            target_parameters=experts_targets)).save_pretrained(work / name)
# adapter r8 without its layer-1 experts (PEFT then builds that layer's expert LoRA with B = 0)
kept = {k: v for k, v in load_file(str(work / "r8" / "adapter_model.safetensors")).items()
        if "layers.1.mlp.experts." not in k}
save_file(kept, str(work / "r8" / "adapter_model.safetensors"))
config = json.loads((work / "r8" / "adapter_config.json").read_text())
(work / "r8" / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": True}))

dense, expert_specs = moe_module_specs(tiny.config)
ours = {n: load_moe_peft_adapter(work / n, dense, expert_specs, 2, 8, uid=n) for n in ("r4", "r8")}
pool = MoELoRAMemoryPool(dense, 2, 3, 8, expert_modules=expert_specs, adapter_source=ours.__getitem__)
print("layer-1 expert ranks of r8 in its slot:",
      pool.moe_lora_ranks["down_proj"][1][pool.prepare_lora_batch(["r8"])["r8"]].tolist())

context = LoRAContext()
model = wrap_moe_model(copy.deepcopy(tiny), pool, context)
names, lens = ["r4", None, "r8", "r4"], [5, 3, 6, 4]
g = torch.Generator().manual_seed(1)
pad = max(lens)  # one request per row, right-padded (chapter 07's prefill layout): every row has pad tokens
ids = torch.randint(0, 128, (len(lens), pad), generator=g)
mask = (torch.arange(pad)[None, :] < torch.tensor(lens)[:, None]).long()
uid_to_slot = pool.prepare_lora_batch(names)
context.set_batch(batch_info_from_requests(names, [pad] * len(lens), uid_to_slot, pool.lora_ranks_host,
                                           pool.scalings_host, "cpu"))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    reference_model = peft.PeftModel.from_pretrained(copy.deepcopy(tiny), work / "r4", adapter_name="r4")
    reference_model.load_adapter(work / "r8", adapter_name="r8")
reference_model.eval()
with torch.no_grad():
    mine = model(input_ids=ids, attention_mask=mask).logits
    for i, name in enumerate(names):
        if name is None:
            want = tiny(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]).logits
        else:
            reference_model.set_adapter(name)
            want = reference_model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]).logits
        n = lens[i]
        err = (mine[i, :n] - want[0, :n]).abs().max().item()
        against = "the base model" if name is None else f"PEFT with adapter {name}"
        print(f"request {i}: max |ours - {against}| over its {n} tokens = {err:.2e} "
              f"(logits up to {want[0, :n].abs().max().item():.2f})")

# %% [markdown]
# The judge in `tests/test_moe_model.py` does this for a tiny Mixtral and a tiny Qwen2-MoE (whose
# `shared_expert`, applied to every token, is an ordinary MLP: its LoRA is chapter 07's dense LoRA,
# stored and computed apart from the routed experts), with greedy decode steps, evictions and reloads
# between batches, malformed adapters (the pool stays exactly as it was), and a swapped gate/up table
# (PEFT then disagrees). One difference from chapter 07 shows there: a base-model request is equal to
# the base model only within the tolerance, not bit for bit, because the other requests change how
# many rows each expert's matrix product runs on. At the layer, on identical inputs, a token routed
# only to experts its adapter lacks does get exactly the base output. Adapter r8 has no layer-1 expert
# LoRA (ranks 0 above); its tokens through our layer-1 experts against the base model's own:

# %%
layer = 1
ours_experts, base_experts = model.model.layers[layer].mlp.experts, tiny.model.layers[layer].mlp.experts
g = torch.Generator().manual_seed(2)
hidden = torch.randn(6, MOE["hidden_size"], generator=g)
chosen = torch.stack([torch.randperm(MOE["num_local_experts"], generator=g)[:2] for _ in range(6)])
weights = torch.rand(6, 2, generator=g)
for name in ("r8", "r4"):
    slots_now = pool.prepare_lora_batch([name])
    context.set_batch(batch_info_from_requests([name], [6], slots_now, pool.lora_ranks_host, pool.scalings_host, "cpu"))
    with torch.no_grad():
        same = torch.equal(ours_experts(hidden, chosen, weights), base_experts(hidden, chosen, weights))
    print(f"adapter {name}: layer-{layer} experts output bit-identical to the base experts: {same}")

# %% [markdown]
# ## 7. The Triton kernel
#
# `reference.moe.fused_moe_lora` implements the op of section 3 with the layout of section 2:
# virtual expert ids, `moe_align_block_size` with the rank-0 groups skipped, then two launches over
# the sorted blocks. The shrink runs one program per (block of `BLOCK_M` pairs, slice): it gathers the
# block's rows (`x[pair]` or `x[pair // top_k]`, padding entries masked), loads the one A of the
# block's (slot, expert) and writes the intermediate. The expand runs one program per (block, column
# tile, slice) and adds `scaling * weight * h @ B.T` into `out`. It runs here through Triton's
# interpreter (on a GPU, compiled) and agrees with the torch reference:

# %%
from reference.moe.fused_moe_lora import fused_moe_lora as fused_moe_lora_triton

g = torch.Generator().manual_seed(7)
T, E, k, S, r, H, I = 12, 4, 2, 3, 8, 32, 24
A = torch.randn(S, E, 2 * r, H, generator=g) * H ** -0.5
B = torch.randn(S, E, 2 * I, r, generator=g) * r ** -0.5
ranks = torch.tensor([[0] * E, [8, 8, 0, 8], [4, 4, 4, 4]], dtype=torch.int32)
sc = torch.tensor([0.0, 2.0, 1.0])
x = torch.randn(T, H, generator=g)
ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
slots = torch.arange(T, dtype=torch.int32) % S
base_out = torch.randn(T * k, 2 * I, generator=g)
args = (ids, slots, ranks, sc, k, False, (0, I, 2 * I))
want = moe_lora.fused_moe_lora_torch(x, A, B, base_out.clone(), *args)
got = fused_moe_lora_triton(x.to(device), A.to(device), B.to(device), base_out.clone().to(device),
                            *(a.to(device) if isinstance(a, torch.Tensor) else a for a in args))
print("Triton vs torch reference: max abs difference", f"{(got.cpu() - want).abs().max().item():.2e}")

# %% [markdown]
# Two details matter for serving. The alignment reads the device (`nonzero`, a block count), so it
# cannot run inside a CUDA graph (chapter 08); the op accepts a precomputed alignment (`aligned=`, from
# `reference.moe.fused_moe_lora.align_moe_lora`), computed once per layer for both of its calls
# (gate_up and down route the same pairs), leaving two capturable launches. And the grid follows the
# number of blocks, which changes with the batch's routing; a captured version sizes it for the
# largest possible block count, as vLLM's kernel does.
#
# ## 8. Measuring it
#
# `benchmarks/benchmark_moe_lora.py` times the op at Mixtral-8x7B and Qwen3-30B-A3B sizes (decode of
# 16-256 tokens, prefill of 4 x 2048, 1-32 adapters of rank 16) against the base MoE layer measured in
# the same run, and writes a results JSON naming the device. The two launches (gate_up, down) are
# captured in a CUDA graph and replayed; the alignment runs eagerly, since it reads the device. The
# base layer is a graph-captured torch grouped GEMM (one `torch.mm` per expert), not a fused MoE
# kernel, so "% of base" is measured against a slower base than a production server's. The target
# the chapter set itself: LoRA adds at most 30% to the MoE layer at prefill. The committed results:

# %%
moe_bench = json.loads(Path(reference.__file__).resolve().parents[1].joinpath(
    "benchmarks", "results", "moe_lora_h200.json").read_text())
print(f"device: {moe_bench['device']} (torch {moe_bench['torch']}, triton {moe_bench['triton']}), rank "
      f"{moe_bench['rank']}, copy bandwidth {moe_bench['copy_bandwidth_gbps']:.0f} GB/s; {moe_bench['method']}")
cases = {}
for row in moe_bench["rows"]:
    cases.setdefault((row["model"], row["phase"], row["tokens"], row["adapters"]), {})[row["op"]] = row
print(f"{'case':34s} {'base us':>8} {'gate_up':>8} {'down':>7} {'kernels':>8} {'align us':>9} {'all':>6}")
for (model_name, phase, tokens, adapters), ops in cases.items():
    base_us = ops["gate_up"]["base_layer_us"]
    kernels = ops["gate_up"]["us"] + ops["down"]["us"]
    print(f"{model_name:14s} {phase:7s} {tokens:5d} D={adapters:<3d} {base_us:8.0f} {ops['gate_up']['us']:8.1f} "
          f"{ops['down']['us']:7.1f} {100 * kernels / base_us:7.0f}% {ops['align']['us']:9.0f} "
          f"{100 * ops['align+gate_up+down']['frac_base']:5.0f}%")
prefill_share = {k[0]: [] for k in cases}
for (model_name, phase, _, _), ops in cases.items():
    if phase == "prefill":
        prefill_share[model_name].append((ops["gate_up"]["us"] + ops["down"]["us"]) / ops["gate_up"]["base_layer_us"])
for model_name, shares in prefill_share.items():
    print(f"prefill, {model_name}: the two kernels add {100 * min(shares):.0f}-{100 * max(shares):.0f}% "
          f"(target <= 30%: {'met' if max(shares) <= 0.3 else 'missed'} by the kernels alone)")
decode_share = {k[0]: [] for k in cases}
for (model_name, phase, _, _), ops in cases.items():
    if phase == "decode":
        decode_share[model_name].append((ops["gate_up"]["us"] + ops["down"]["us"]) / ops["gate_up"]["base_layer_us"])
for model_name, shares in decode_share.items():
    if shares:
        print(f"decode, {model_name}: the two kernels add {100 * min(shares):.0f}-{100 * max(shares):.0f}%")
print(f"the alignment, eager: {min(o['align']['us'] for o in cases.values()):.0f}-"
      f"{max(o['align']['us'] for o in cases.values()):.0f} us in every case")

# %% [markdown]
# What the table says:
#
# - **The kernels** ("kernels": gate_up + down over the base layer) add the decode and prefill shares
#   printed above. Mixtral's are larger at decode than at its prefill: a decode MoE layer moves few
#   tokens, so the adapters' A and B bytes weigh against little work. Qwen3-30B-A3B is the harder case: 128 small experts (768
#   wide), so each (adapter, expert) group does little work for the A and B bytes it reads, and with
#   32 adapters its prefill exceeds the target on the kernels alone. The launches are no longer the
#   bottleneck there; the bytes of 32 x 128 groups are.
# - **The alignment** costs close to a millisecond whatever the batch (the last line), as much as a
#   whole decode MoE layer of this torch base for Mixtral: it is a
#   dozen small torch ops with host reads between them (`nonzero`, the block count, the id checks),
#   timed eagerly. That is this book's teaching version (exercise ch09.2). vLLM and SGLang do the same
#   work in one CUDA kernel (`moe_align_block_size` in their custom ops) that writes into buffers
#   sized for the worst case, so it needs no host read and can be captured with the rest of the step.
#   Replacing it, and fusing the alignment of the virtual experts into the base MoE's own alignment
#   pass, is where a faster MoE LoRA starts; so is tuning the block sizes (`fused_moe_lora`'s
#   defaults are still untuned: no sweep has run on the GPU yet).

# %% [markdown]
# ## Sources
#
# - **SGLang**: `python/sglang/srt/lora/` (virtual experts: the (adapter, expert) pair indexed as one
#   expert; 4-D MoE LoRA buffers; `moe_use_local_expert_ids`).
# - **vLLM**: `vllm/model_executor/layers/fused_moe/` (`moe_align_block_size`, the fused MoE kernel
#   and its two GEMMs) and its MoE LoRA ops under `vllm/lora/`.
# - **TensorRT-LLM**: MoE LoRA (per-expert pointer offsets, `expert_index * dim * rank`; one table of
#   where each fused module's parts live).
# - **transformers**: `models/mixtral/modeling_mixtral.py` and `models/qwen2_moe/modeling_qwen2_moe.py`
#   (3-D expert parameters, gate first in `gate_up_proj`, the routing weight applied after down).
#
# ## Summary
#
# - An adapter on a MoE layer holds LoRA per expert: buffers with an expert axis and ranks per
#   (slot, expert); an expert or layer the adapter lacks has rank 0, explicitly.
# - Virtual experts (`slot * E + expert`) turn multi-LoRA MoE into a routed MoE over `S * E` experts,
#   scheduled by the aligned block layout; rank-0 groups get no blocks.
# - gate_up reads token rows, down reads pair rows; the routing weight multiplies the delta once;
#   one table says where gate and up live.
# - Under EP, local ids go with local buffers and global ids with global buffers.
#
# ## Review questions
#
# 1. A decode batch of 64 tokens on 8 adapters, top-2 of 8 experts: how many (slot, expert) groups can
#    there be at most, and why does the padding fraction grow compared with the base MoE layer?
# 2. Why must the rank be per (slot, expert) rather than per slot?
# 3. The down projection's LoRA reads `x[p]`, gate_up's reads `x[p // top_k]`. What goes wrong, and
#    would any shape check notice, if down read `x[p // top_k]` of the activation tensor?
# 4. A server applies the routing weight in the second GEMM's epilogue and also in the model layer.
#    What does the LoRA delta of a pair with weight 0.3 come out as?
