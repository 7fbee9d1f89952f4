# %% [markdown]
# # 10 · Tensor-parallel multi-LoRA
#
# A model too large for one GPU, or too slow on one, is split over `tp` GPUs with **tensor
# parallelism** (Megatron-LM): every weight matrix is cut into `tp` shards, each GPU (a *rank*)
# multiplies by its shard, and a few collectives (all-reduce, all-gather) put the pieces back together.
# A multi-LoRA server on such a model must cut every adapter the same way, so that each rank's share
# of the LoRA delta lands exactly where its share of the base output is, and it must keep its slot
# pool identical on every rank. This chapter derives where the LoRA weights go from the math, checks
# each rule by computation, and runs the layers on real process groups: gloo between CPU processes
# here, NCCL between GPUs on a multi-GPU machine, one code path.
#
# **What you will learn**
# - The two ways a linear layer is split (column- and row-parallel) and where LoRA's A and B go in
#   each; why the rule stated the other way round (A split, B kept whole) cannot be right.
# - Packed projections under TP: each rank's heads of q, k and v (kv heads replicated when there are
#   fewer than ranks), and the rank-major order TensorRT-LLM stores fused LoRA weights in.
# - The fully sharded variant (vLLM's `fully_sharded_loras`, S-LoRA): A split along the rank, and
#   why the split must be of the pool's padded max rank.
# - The row-parallel layer's two variants, what each communicates, and their cost measured.
# - A sharded adapter pool whose ranks agree on every decision, and the whole model at TP=2 against
#   TP=1 and PEFT.
#
# **Exercises**: ch10.1 `column_part_ranges`, ch10.2 `fully_sharded_A`, ch10.3 `row_parallel_lora`,
# ch10.4 `fully_sharded_column_lora`. The last two run on two (or four) ranks: the grader starts
# the processes and gives each its shard.

# %%
import json
import subprocess
import sys

import reference  # first: device choice
import torch

import graders
from reference.tp import lora as tp_lora
from reference.mem_pool import ModuleSpec

torch.manual_seed(0)

# %% [markdown]
# ## 1. Two ways to split a linear layer
#
# A layer `y = x W^T` with `W [out, in]` can be cut along either dimension:
#
# - **column-parallel** (Megatron's name: `W^T`'s columns): rank j holds `W`'s output rows
#   `W_j = W[rows_j]` and computes `y[:, rows_j] = x W_j^T` from the whole input. Nothing to
#   communicate; the output stays split. Used for q, k, v, gate and up, whose outputs the attention
#   heads and the MLP's activation consume per rank.
# - **row-parallel**: rank j holds `W`'s input columns `W[:, cols_j]` and the matching columns of
#   its input `x_j = x[:, cols_j]` (the split output of the layer before), and computes a *partial
#   sum* `x_j W[:, cols_j]^T` of the whole output; an **all-reduce** adds the ranks' partials. Used
#   for o and down, which bring the split activations back to the full hidden state.
#
# One transformer layer therefore needs two all-reduces (after o and after down) and nothing else.
# Both splits, computed:

# %%
x, W = torch.randn(5, 8), torch.randn(6, 8)
full = x @ W.T
tp = 2
column = torch.cat([x @ W[j * 3:(j + 1) * 3].T for j in range(tp)], dim=1)  # each rank: 3 output columns
row = sum(x[:, j * 4:(j + 1) * 4] @ W[:, j * 4:(j + 1) * 4].T for j in range(tp))  # partials, then all-reduce
print("column-parallel, outputs concatenated:", torch.allclose(column, full, atol=1e-6))
print("row-parallel, partial sums added:     ", torch.allclose(row, full, atol=1e-6))

# %% [markdown]
# ## 2. LoRA on a column-parallel layer
#
# The delta is `s (x A^T) B^T` with `A [r, in]`, `B [out, r]`. Rank j needs the delta's columns
# `rows_j`, and `(x A^T) B^T` restricted to output columns `rows_j` is `(x A^T) B[rows_j]^T`: **B is
# split on its output rows, exactly like W; A is kept whole** on every rank (it reads the whole `x`,
# which every rank has). No communication at all; each rank computes the same small shrink
# `x A^T` ([T, r]) redundantly. That is the "replicated A" variant (`tp_lora.VARIANTS["column"][0]`).
#
# A rule sometimes stated for this layer gets it the other way round: "A split on its output
# dimension, B kept whole". A's output dimension is the rank `r`. `tp_lora.garbled_column_rule` tries it: the shapes do
# not even compose, and the only repair without communication (B's matching columns) gives each
# rank a partial sum of *every* output column, so taking rank j's columns from it is wrong; only
# summing the partials over ranks fixes it, which is a collective the rule said was not needed:

# %%
A, B = torch.randn(4, 8) / 3, torch.randn(6, 4) / 2
print(json.dumps(tp_lora.garbled_column_rule(x, A, B, tp_size=2), indent=1))

# %% [markdown]
# ## 3. Packed projections and GQA
#
# The pool stores q, k and v of a layer as one packed module `qkv_proj` (chapter 04): output rows
# `[q | k | v]`, slice offsets `(0, q, q + k, q + k + v)`. Under TP each rank owns its **heads** of
# each part, not a contiguous `1/tp` of the packed rows: rank j's packed B is `[q_j; k_j; v_j]`. With
# grouped-query attention there are fewer kv heads than q heads, and when there are fewer kv heads
# than ranks a kv head cannot be split further (a head is the attention's unit): it is **replicated**,
# each kv head on `tp / num_kv_heads` consecutive ranks (vLLM's `num_kv_head_replicas`), so two ranks
# hold the same k and v rows.
#
# An example: q of 4 heads, k and v of 2 heads each, head width 4, so `out_features = (16, 8, 8)`
# and `units = (4, 2, 2)`. At tp 2, rank 1 owns q rows 8..16, k rows 16+4..16+8 and v rows 24+4..24+8
# of the packed output.

# %% [markdown]
# ### Exercise ch10.1: `column_part_ranges`
#
# Write `column_part_ranges(out_features, units, tp_rank, tp_size)`: for a packed column-parallel
# layer whose part i has `out_features[i]` output rows made of `units[i]` heads of equal width, return
# one `(lo, hi)` pair of ints per part, as a tuple (a list, of tuples or of lists, compares the
# same): the rows of the **packed** output (part i starts
# at `sum(out_features[:i])`) that rank `tp_rank` owns.
# - With `units[i] >= tp_size` and divisible by it, rank j owns the heads
#   `[j * units[i] / tp_size, (j + 1) * units[i] / tp_size)` of the part.
# - With `units[i] < tp_size` and `tp_size` divisible by it, each head is replicated on
#   `tp_size / units[i]` consecutive ranks: rank j owns head `j // (tp_size / units[i])`.
#
# Raise `ValueError` when `out_features` and `units` differ in length, an `out_features[i]` is not a
# multiple of `units[i]` (its heads would not have one width), neither of `units[i]` and `tp_size`
# divides the other, or `tp_rank` is not in `0..tp_size-1`. The example above gives
# `((8, 16), (20, 24), (28, 32))`; `out_features = (16, 4, 4)` with `units = (4, 1, 1)` (head width 4
# again) at tp 2, rank 1, gives `((8, 16), (16, 20), (20, 24))` (the one kv head on both ranks).

# %% exercise="ch10.1" role="answer"
def column_part_ranges(out_features, units, tp_rank, tp_size):
    """One (lo, hi) per part: the packed output rows tp_rank owns."""
    ### BEGIN SOLUTION
    if len(out_features) != len(units):
        raise ValueError("one unit count per part")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside 0..{tp_size - 1}")
    ranges, start = [], 0
    for rows, n in zip(out_features, units):
        if n < 1 or rows % n:
            raise ValueError(f"{rows} rows are not a multiple of {n} heads")
        if n >= tp_size and n % tp_size == 0:
            per, first = n // tp_size, tp_rank * (n // tp_size)
        elif n < tp_size and tp_size % n == 0:
            per, first = 1, tp_rank // (tp_size // n)
        else:
            raise ValueError(f"{n} heads cannot be split over {tp_size} ranks")
        head_width = rows // n
        lo = start + first * head_width
        ranges.append((lo, lo + per * head_width))
        start += rows
    return tuple(ranges)
    ### END SOLUTION


# %% exercise="ch10.1" role="test"
graders.check("ch10.1", column_part_ranges)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch10.1")

# %% [markdown]
# TensorRT-LLM stores a fused qkv LoRA's B already in this order, **rank-major**:
# `[q_r0, k_r0, v_r0, q_r1, k_r1, v_r1, ...]`, so rank j's rows are one contiguous block and loading
# a shard is a single slice. `tp_lora.interleave_packed` reorders a packed tensor that way (with
# replicated kv heads the shared rows appear once per rank). The packed row indices of the example,
# reordered for tp 2:

# %%
spec = ModuleSpec("qkv_proj", 16, (16, 8, 8))
layout = tp_lora.TPLayout(spec, "column", 2, (4, 2, 2))
rows = torch.arange(spec.out_total, dtype=torch.float32).unsqueeze(1)
print("rank-major row order:", tp_lora.interleave_packed(rows, layout).squeeze(1).long().tolist())
mqa = tp_lora.TPLayout(ModuleSpec("qkv_proj", 16, (16, 4, 4)), "column", 2, (4, 1, 1))
print("one kv head, tp 2:   ", tp_lora.interleave_packed(torch.arange(24.0).unsqueeze(1), mqa).squeeze(1).long().tolist())

# %% [markdown]
# ## 4. The fully sharded variant: A split along the rank
#
# Replicating A costs memory (every rank holds all of A for every slot) and repeats the shrink on
# every rank. vLLM's `fully_sharded_loras` option (following S-LoRA) splits A along the **rank** too:
# rank j holds rank-rows `[j r/tp, (j+1) r/tp)` of A and computes those columns of the shrink output
# `t = x A^T`; an **all-gather** of the pieces gives every rank the whole `t [T, r]`, which it expands
# with its rows of B (all `r` columns). The all-gather carries `T x r` numbers per part, tiny beside
# the base layer's own traffic (`T x hidden` per all-reduce). (In a pool `t` has the padded max rank
# `R` columns, not the adapter's `r`: below.)
#
# In a pool the split meets rank padding. The pool's buffers hold every slot at the same max rank `R`
# but pack each adapter's parts at its *own* rank `r` (chapter 05: part i in rows `[i r, (i+1) r)` of
# `A_buffer[slot]`). Splitting each adapter's own `r` into `tp` pieces would give ranks pieces of
# different widths for different slots, and the gathered pieces would not line up with B's columns.
# So the split is of the **padded** `R`, the same for every slot: every rank holds `R/tp` rows of
# every part of every slot, zeros where the adapter's rank does not reach. Rank j's `A_local[slot]`
# has part i at local rows `[i R/tp, (i+1) R/tp)`, holding global rank-rows `[j R/tp, (j+1) R/tp)` of
# that part. With `R = 16`, tp 2 and an adapter of rank 4, rank 0 holds the adapter's 4 rows of each
# part (and 4 zero rows), rank 1 holds only zeros: it computes zeros for that slot, a cost the padded
# pool pays anyway.

# %% [markdown]
# ### Exercise ch10.2: `fully_sharded_A`
#
# Write `fully_sharded_A(A_buffer, lora_ranks, stack_num, tp_rank, tp_size)`. `A_buffer
# [num_slots, stack_num * R, in]` is one layer of a pool module, slot s packing its `stack_num` parts
# at its rank `r = lora_ranks[s]` (a list of ints; rows past `stack_num * r` hold junk). With
# `R = A_buffer.shape[1] // stack_num` and `w = R // tp_size`, return a **new** tensor
# `[num_slots, stack_num * w, in]` (A_buffer's dtype) whose `[s, i*w + k]` is
# `A_buffer[s, i*r + tp_rank*w + k]` where `tp_rank*w + k < r`, and zero elsewhere.
#
# Raise `ValueError` when `A_buffer` is not 3-D or its rows are not a multiple of `stack_num`, `R` is
# not divisible by `tp_size`, `lora_ranks` does not have one rank per slot in `0..R`, or `tp_rank` is
# not in `0..tp_size-1`.

# %% exercise="ch10.2" role="answer"
def fully_sharded_A(A_buffer, lora_ranks, stack_num, tp_rank, tp_size):
    """[num_slots, stack_num * R / tp, in]: this rank's rank-rows of every part, zeros past each r."""
    ### BEGIN SOLUTION
    if A_buffer.dim() != 3 or stack_num < 1 or A_buffer.shape[1] % stack_num:
        raise ValueError("A_buffer must be [num_slots, stack_num * R, in]")
    R = A_buffer.shape[1] // stack_num
    if R % tp_size or not 0 <= tp_rank < tp_size:
        raise ValueError(f"R {R} must split over tp_size {tp_size}; tp_rank {tp_rank} in range")
    if len(lora_ranks) != A_buffer.shape[0] or any(not 0 <= r <= R for r in lora_ranks):
        raise ValueError("one rank per slot, each in 0..R")
    w = R // tp_size
    out = A_buffer.new_zeros(A_buffer.shape[0], stack_num * w, A_buffer.shape[2])
    lo = tp_rank * w
    for s, r in enumerate(lora_ranks):
        hi = min(lo + w, r)
        if hi <= lo:
            continue
        for i in range(stack_num):
            out[s, i * w:i * w + hi - lo] = A_buffer[s, i * r + lo:i * r + hi]
    return out
    ### END SOLUTION


# %% exercise="ch10.2" role="test"
graders.check("ch10.2", fully_sharded_A)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch10.2")

# %% [markdown]
# ## 5. LoRA on a row-parallel layer
#
# Rank j has `x_j` (its columns of the input) and the base partial `x_j W_j^T`. The delta needs
# `x A^T`, and `x A^T = sum_j x_j A_j^T` where `A_j` is A's matching **input columns**: A is split
# like W, on its input columns, and B (which reads the `r` shrink columns) is kept whole. By
# linearity the sum can be taken at either of two places:
#
# | variant | what rank j does | what LoRA adds to the communication |
# |---|---|---|
# | `reduce_shrink` | all-reduce the base partials; all-reduce `t_j = x_j A_j^T` ([T, R]); expand the full `t` with B | one more all-reduce of `T x R` (R: the pool's max rank) |
# | `reduce_with_base` | add its partial delta `s (x_j A_j^T) B^T` to its base partial; one all-reduce of the sum | nothing (rides the base all-reduce) |
#
# Both do the same expand work on every rank (`T x R x out`). `reduce_with_base` sends nothing
# extra, but the delta must be added *before* the base layer's all-reduce, so the LoRA sits inside
# the base layer's forward (vLLM's `RowParallelLinearWithLoRA` does this). `reduce_shrink` leaves the
# base layer alone and pays a second collective per layer: small, but each collective is a separate
# launch and synchronization, which is what costs at decode (section 7 counts each variant's
# collectives and their bytes).
#
# By linearity the two variants compute the same `y`. They differ only in where the sum is taken,
# hence in what crosses between the GPUs and, in bf16, in rounding.

# %% [markdown]
# ### Exercise ch10.3: `row_parallel_lora` (runs on every rank)
#
# Write `row_parallel_lora(x_local, W_local, A_local, B, token_slots, lora_ranks, scalings, variant,
# group)`, the forward one rank runs:
# - `x_local [T, in/tp]`, `W_local [out, in/tp]`, `A_local [num_slots, R, in/tp]`: this rank's
#   columns; `B [num_slots, out, R]`: whole; `token_slots [T]` (int32 or int64), `lora_ranks
#   [num_slots]` (int32), `scalings [num_slots]` (float32); `group`: the process group to pass to
#   `torch.distributed.all_reduce(t, group=group)` (in place, a sum).
# - Return `y [T, out]` in `x_local`'s dtype (fp32 or bf16), the full output, the same on every rank:
#   `"reduce_shrink"`: `y = all_reduce(x_local W_local^T) + delta(all_reduce(t_j))`;
#   `"reduce_with_base"`: `y = all_reduce(x_local W_local^T + delta(t_j))`, where
#   `t_j = x_local A_local[slot]^T` per token and `delta(t) = scalings[slot] * t[:, :r] B[slot, :, :r]^T`
#   with `r = lora_ranks[slot]`.
# - Rows of A and columns of B past a slot's rank are junk (even NaN): read only the first `r`.
#   Tokens of rank-0 slots (the base model) get **exactly** the reduced base output.
# - Precision: the reference computes each rank's partials (`x_local W_local^T`, `t_j`, the delta) in
#   `x_local`'s dtype and all-reduces tensors of that dtype: in bf16 each partial is rounded to bf16
#   before the sum, as in a server that all-reduces bf16 activations. In bf16 the grader compares `y`
#   with the formula computed in float32 and rounded to bf16, within 3e-2 (relative and absolute); its
#   inputs are chosen so that bf16 partials summed in bf16 (in either variant's order) and partials
#   summed in float32 both land within that. In float32 the tolerance is 1e-5.
# - Raise `ValueError` for another variant, on every rank, before any collective (a rank that raises
#   while the other waits in an all-reduce would hang the group).
#
# **What the grader checks**, on 2 and 4 ranks (gloo, CPU), each with its own shard: every rank's
# `y` (its values, its dtype, the same `y` on every rank, rank-0 tokens bit for bit); that the inputs
# are unchanged and every collective is on `group`; and, for an unknown variant, that every rank
# raises `ValueError` before any collective (the grader makes any collective wait there, and says so).
# It does **not** check which collectives run or how many. The variant names the communication the
# table above describes, but both variants give the same `y` (up to rounding), so an answer that
# all-reduces once for both (`reduce_with_base`'s scheme) scores the same, and so does one that fuses
# `reduce_shrink`'s two all-reduces into one call on `torch.cat([y, t], dim=1)` (the same sums in one
# launch: allowed, though the LoRA then no longer leaves the base layer's all-reduce alone). The
# grader cannot see collectives: it could only record them inside the rank processes, next to your
# code, which could write any record it liked. Implement each variant as the table says; section 7
# counts what the reference's variants send.

# %% exercise="ch10.3" role="answer"
import torch.distributed as dist


def row_parallel_lora(x_local, W_local, A_local, B, token_slots, lora_ranks, scalings, variant, group=None):
    """y [T, out] on every rank: the row-parallel base plus the LoRA delta, all-reduced."""
    ### BEGIN SOLUTION
    if variant not in ("reduce_shrink", "reduce_with_base"):
        raise ValueError(f"unknown variant {variant!r}")
    slots = token_slots.long()
    r = lora_ranks.long()[slots]                                   # [T]
    keep = torch.arange(B.shape[2], device=x_local.device) < r.unsqueeze(1)  # [T, R]: columns below each rank
    y = x_local @ W_local.T
    t = torch.einsum("ti,tri->tr", x_local, A_local[slots]).contiguous()
    if variant == "reduce_shrink":
        dist.all_reduce(y, group=group)
        dist.all_reduce(t, group=group)
    t = torch.where(keep, t, 0.0)
    Bt = torch.where(keep.unsqueeze(1), B[slots], 0.0)             # [T, out, R]
    delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum("tr,tor->to", t, Bt)
    y = torch.where((r > 0).unsqueeze(1), y + delta, y)
    if variant == "reduce_with_base":
        dist.all_reduce(y, group=group)
    return y
    ### END SOLUTION


# %% exercise="ch10.3" role="test"
graders.check("ch10.3", row_parallel_lora)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch10.3")

# %% [markdown]
# ## 6. The fully sharded column layer
#
# Back to a column-parallel layer, now with A split along the rank (section 4). Each rank computes
# its shrink columns `t_j = x A_local[slot]^T`, `[T, stack * R/tp]`: `R/tp` columns **of every
# part**. The all-gather returns the pieces in rank order, `[t_0 | t_1 | ...]`, but part i of the
# full shrink output is the concatenation over ranks of each piece's columns of part i:
# view the gathered `[tp, T, stack, R/tp]`, permute to `[T, stack, tp, R/tp]`. Concatenating in rank
# order is right for one part and wrong for q/k/v and gate/up (the pieces of different parts
# interleave).

# %% [markdown]
# ### Exercise ch10.4: `fully_sharded_column_lora` (runs on every rank)
#
# Write `fully_sharded_column_lora(x, W_local, A_local, B_local, token_slots, lora_ranks, scalings,
# slice_offsets, group)`:
# - `x [T, in]` (whole), `W_local [out_local, in]` (this rank's output rows), `A_local
#   [num_slots, stack * R/tp, in]` (this rank's rank-rows of each part, as `fully_sharded_A` builds
#   it), `B_local [num_slots, out_local, R]`, `slice_offsets`: the parts' local output offsets
#   (`stack = len(slice_offsets) - 1`), `token_slots`, `lora_ranks`, `scalings` as in ch10.3, `group`:
#   the process group (`tp = torch.distributed.get_world_size(group)`).
# - Return `y_local [T, out_local]` in `x`'s dtype (fp32 or bf16, as in ch10.3): `x W_local^T`,
#   plus for each part i and token of slot s with rank r:
#   `scalings[s] * t_i[:, :r] B_local[s, off_i:off_{i+1}, :r]^T`, where `t_i` is part i of the
#   all-gathered shrink output (`torch.distributed.all_gather(list_of_tp_tensors, t_j, group=group)`).
# - Columns of the shrink output and of B past a slot's rank are junk; tokens of rank-0 slots get
#   exactly `x W_local^T`. Raise `ValueError` when `A_local` does not have `stack * R/tp` rows (before
#   any collective).

# %% exercise="ch10.4" role="answer"
import torch.distributed as dist


def fully_sharded_column_lora(x, W_local, A_local, B_local, token_slots, lora_ranks, scalings, slice_offsets,
                              group=None):
    """y_local [T, out_local]: this rank's base columns plus the delta from the gathered shrink."""
    ### BEGIN SOLUTION
    tp, stack, R = dist.get_world_size(group), len(slice_offsets) - 1, B_local.shape[2]
    if R % tp or A_local.shape[1] != stack * (R // tp):
        raise ValueError(f"A_local must have stack * R / tp = {stack} * {R} / {tp} rows")
    slots = token_slots.long()
    r = lora_ranks.long()[slots]
    keep = torch.arange(R, device=x.device) < r.unsqueeze(1)       # [T, R]
    t_local = torch.einsum("ti,tki->tk", x, A_local[slots]).contiguous()
    pieces = [torch.empty_like(t_local) for _ in range(tp)]
    dist.all_gather(pieces, t_local, group=group)
    T = x.shape[0]
    t = torch.stack(pieces).view(tp, T, stack, R // tp).permute(1, 2, 0, 3).reshape(T, stack, R)
    y = x @ W_local.T
    for i in range(stack):
        lo, hi = slice_offsets[i], slice_offsets[i + 1]
        ti = torch.where(keep, t[:, i], 0.0)
        Bi = torch.where(keep.unsqueeze(1), B_local[slots, lo:hi], 0.0)
        delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum("tr,tor->to", ti, Bi)
        y[:, lo:hi] = torch.where((r > 0).unsqueeze(1), y[:, lo:hi] + delta, y[:, lo:hi])
    return y
    ### END SOLUTION


# %% exercise="ch10.4" role="test"
graders.check("ch10.4", fully_sharded_column_lora)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch10.4")

# %% [markdown]
# ## 7. What each variant communicates
#
# `tp_lora.lora_comm_bytes` counts the bytes of one decoder layer's collectives per variant, as the
# size of the tensor each collective produces on a rank. LoRA's share depends only on tokens and the
# pool's max rank (a mixed batch pads to it), never on the hidden size. For Llama-3-8B's layer
# (hidden 4096, intermediate 14336, 32 query and 8 kv heads: its config.json) in bf16 at tp 2, the fully sharded and
# reduce-shrink variants against the base layer's two all-reduces:

# %%
llama3_8b = tp_lora.TPModelConfig(hidden=4096, intermediate=14336, num_heads=32, num_kv_heads=8)
for tokens, what in ((64, "decode, 64 sequences"), (8192, "prefill, 8192 tokens")):
    for rank in (16, 64):
        b = tp_lora.lora_comm_bytes(llama3_8b, rank, tokens, 2, tp_size=2)
        base = sum(b["base"].values())
        lora = (b["qkv_proj"]["fully_sharded"] + b["gate_up_proj"]["fully_sharded"]
                + b["o_proj"]["reduce_shrink"] + b["down_proj"]["reduce_shrink"])
        print(f"{what:22s} max rank {rank:2d}: base all-reduces {base / 2**20:8.2f} MiB, LoRA adds "
              f"{lora / 2**20:6.3f} MiB ({lora / base:.1%}) in 4 more collectives")

# %% [markdown]
# A few percent of the bytes, but four more collectives per layer: at decode, where each collective
# is a latency (a launch and a synchronization of every rank, whatever its size), the count matters more
# than the bytes. (A cost of the design, counted here with the reference; ch10.3's grader checks the
# outputs, not the count.) The replicated-A and reduce-with-base variants add no collective at all and pay in
# memory (A on every rank) and in placement (the delta inside the base layer's forward).
#
# The same layer at a small size on two real processes (gloo on this CPU, through a script:
# `python -m reference.tp.demo layer`), each variant's collectives logged by wrapping
# `torch.distributed`, beside the prediction, the largest difference from the unsharded layer, and the
# median forward time. CPU timings through gloo say nothing about GPUs, and on a shared CPU they vary
# from run to run by more than the variants differ: they are printed for completeness and compared
# nowhere. What the table shows is
# what each variant sends (its collectives, counted, and their bytes against the prediction) and that
# every variant computes the unsharded layer's output:

# %%
run = subprocess.run([sys.executable, "-m", "reference.tp.demo", "layer", "--tp", "2", "--tokens", "16"],
                     capture_output=True, text=True, check=True)
layer_run = json.loads(run.stdout)
print(f"tp {layer_run['tp']}, {layer_run['tokens']} decode tokens, max rank {layer_run['max_rank']}, "
      f"{layer_run['dtype']}, {layer_run['device']}, torch {layer_run['torch']}")
print(f"{'module/variant':28s} {'collectives':34s} {'LoRA bytes':>10s} {'predicted':>10s} {'max err':>9s} {'ms':>6s}")
for key, row in layer_run["rows"].items():
    calls = ", ".join(f"{op} {n}" for op, n in row["collectives"]) or "none"
    print(f"{key:28s} {calls:34s} {row['lora_bytes_logged']:10d} {row['lora_bytes_predicted']:10d} "
          f"{row['max_abs_error_vs_tp1']:9.1e} {row['median_ms']:6.2f}")

# %% [markdown]
# ## 8. A sharded pool, and the whole model at TP=2
#
# `reference.tp.pool.TPLoRAMemoryPool` is chapter 05's pool whose buffers hold only this rank's shard
# of every slot (the shapes of sections 2-6, per module and variant). Three rules keep the ranks in
# step:
#
# - **Loading reads the whole adapter on every rank and keeps its shard.** Each rank validates the
#   full adapter (what the PEFT files say) before writing anything; then one all-reduce of a
#   "did it pass here?" flag. If any rank refused it, every rank raises and no rank writes: a rank
#   that wrote its shard while another refused would serve a half-loaded adapter. (SGLang, whose
#   loads fan out to every scheduler under DP attention, registers an adapter only after every rank
#   succeeded: sgl-project/sglang PR 32708.)
# - **Slot decisions are computed, not communicated.** Every rank runs the same
#   `prepare_lora_batch` on the same batches in the same order with the same policy, so the same
#   victims and slots come out everywhere: no broadcast per batch and no device read. The price is
#   that the ranks must see the same request stream; `check_agreement()` all-gathers an encoding of
#   each rank's slot map, policy order and caches and raises, naming the field, when they differ.
# - **The batch info is the same on every rank**, built from host data as in chapter 07.
#
# `reference.tp.model.TPLlama` is one rank's forward of a Llama: q/k/v and gate/up
# column-parallel, o and down row-parallel (two all-reduces per layer), attention over the rank's own
# heads with a KV cache of its own kv heads, embeddings, norms and lm_head replicated, and every
# projection's LoRA through the variants above. The script runs it on two processes for a tiny Llama
# with three PEFT adapters (ranks 4, 8 with rsLoRA, and 16) and the base model in one batch, prefill
# and greedy decode, against TP=1 (chapter 07's layers) and against PEFT:

# %%
run = subprocess.run([sys.executable, "-m", "reference.tp.demo", "model", "--tp", "2", "--steps", "3"],
                     capture_output=True, text=True, check=True)
model_run = json.loads(run.stdout)
print(f"tp {model_run['tp']}, batch {model_run['batch']} (prompt lengths {model_run['prompt_lens']}), "
      f"{model_run['steps']} greedy decode steps, {model_run['dtype']}, {model_run['device']}")
for pair, row in model_run["rows"].items():
    print(f"\n{pair}: ranks bit-identical {row['ranks_bit_identical']}, greedy tokens equal to TP=1 "
          f"{row['tokens_equal_tp1']}")
    print(f"  max |TP2 - TP1|  prefill {row['prefill_max_error_vs_tp1']:.1e}, decode {row['decode_max_error_vs_tp1']:.1e}")
    print(f"  max |TP2 - PEFT| prefill {row['prefill_max_error_vs_peft']:.1e}, decode {row['decode_max_error_vs_peft']:.1e}")
    print(f"  what the adapters change (max |delta| on their rows): {row['adapter_rows_max_delta_vs_base']:.2e}; "
          f"the base row against the base model: {row['base_row_max_error_vs_base']:.1e}")

# %% [markdown]
# The differences are rounding (fp32: a row-parallel all-reduce adds two partial dot products, a
# different order than one dot product over the whole input), orders of magnitude below what the
# adapters change (the last line of each pair). The base row differs from the base model by rounding
# only (the same reordered sums); against the TP base forward it is bit for bit the same, which
# tests/test_tp_model.py checks. Then a pool of 3 slots through four batches that need evictions, an adapter that
# only rank 1 finds malformed, and two ranks whose request streams differed once:

# %%
for rank, (maps, evictions) in enumerate(zip(model_run["slot_maps"], model_run["evictions"])):
    print(f"rank {rank}: slot maps after each batch {maps}; evictions {evictions}")
for rank, (refused, changed) in enumerate(zip(model_run["refused"], model_run["changed_by_refusal"])):
    print(f"rank {rank} refused: {refused}\n  what the refusal changed in its pool: {changed or 'nothing'}")
demo = model_run["disagreement"]
print("\nslot maps after the streams diverged:", [d["slot_map"] for d in demo])
print(f"output error with rank 0's batch info on every rank: {demo[0]['leader_max_error']:.2f}")
print("check_agreement:", demo[0]["agreement_error"])

# %% [markdown]
# With identical streams the victims are identical on both ranks. A refusal anywhere is a refusal
# everywhere, and nothing changed on either rank. When one request reached rank 0 only, LRU evicted a
# different adapter on each rank: every rank's state is valid on its own, yet rank 0's slots hold a and
# c and rank 1's c and b, so a batch built once (or captured in a CUDA graph) sends c's tokens to slot
# 1 on every rank, and rank 1's output columns get b's delta. Nothing crashes; the agreement check is what notices. `tests/test_tp_model.py`
# holds all four variant pairs to these rules (and to TP=4 with `TP_MODEL_TP4=1`).

# %% [markdown]
# ## Sources
#
# - **Megatron-LM** (Shoeybi et al., 2019): column- and row-parallel linear layers, two all-reduces
#   per transformer layer.
# - **S-LoRA** (Sheng et al., 2023), section 6: tensor parallelism for LoRA that adds only small
#   collectives (the shrink output gathered or reduced).
# - **vLLM**: `vllm/lora/layers/column_parallel_linear.py`, `row_parallel_linear.py` and
#   `fully_sharded_layers.py` (`fully_sharded_loras`, `num_kv_head_replicas`).
# - **SGLang**: `python/sglang/srt/lora/layers.py` (`slice_lora_a_weights` / `slice_lora_b_weights`
#   per layer kind).
# - **TensorRT-LLM**: its LoRA loader's rank-major order of fused qkv weights.
#
# ## Summary
#
# - Column-parallel: B split on its output rows like W, A whole; nothing to communicate. Row-parallel:
#   A split on its input columns like W, B whole; the delta summed over ranks, either as the shrink
#   output (one more all-reduce of T x R, the pool's max rank) or inside the base layer's all-reduce.
# - Packed q/k/v split per head and per part; kv heads replicated below tp; TensorRT-LLM stores fused
#   LoRA weights rank-major.
# - Fully sharded LoRA splits A along the pool's padded max rank, the same for every slot, and
#   all-gathers the shrink output part-major.
# - A sharded pool validates the whole adapter on every rank and writes only if all agree; slot
#   decisions are deterministic given the same request stream, and a check names any divergence.
