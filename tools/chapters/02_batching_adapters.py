# %% [markdown]
# # 02 · Many adapters in one batch, in PyTorch
#
# Chapter 01 computed one adapter's LoRA output, `y = x W^T + s (x A^T) B^T`. A server that hosts many
# adapters gets requests for different adapters at the same time. It runs the base GEMM `x W^T` once
# for the whole batch and then adds every token's *own* adapter delta on top. This chapter builds that
# second part in plain PyTorch: the weight layout, the per-batch metadata, and the exact semantics of
# the two batched kernels, BGMV and SGMV, that chapters 03 and 04 turn into Triton.
#
# **What you will learn**
# - the slot-stacked layout of many adapters' weights, and the two rules that keep it correct:
#   a slot of rank 0 adds exactly nothing, and padding past a slot's rank is never read;
# - `LoRABatchInfo`, the one struct the ops read: segments (`seg_lens`, `seg_indptr`, `weight_indices`),
#   per-token slots, and a permutation for requests that arrive in any order;
# - the shrink / expand split, and where the scaling goes;
# - BGMV (every token gathers its adapter: decode) and SGMV (one small GEMM per segment: prefill);
# - what padding mixed ranks to the largest one costs, and how clipping to each slot's rank avoids it.
#
# **Exercises** (each is followed by its grader cell): ch02.1 `seg_indptr_from_seg_lens`,
# ch02.2 `token_slots_from_segments`, ch02.3 `lora_loop`, ch02.4 `bgmv_shrink`, ch02.5 `bgmv_expand`,
# ch02.6 `sgmv_shrink`, ch02.7 `sgmv_expand`, ch02.8 `stable_sort_by_slot`, ch02.9 `padded_flop_waste`.
#
# Each answer cell is graded on its own, in a fresh process that has run only `import math, torch`:
# keep every answer self-contained (its imports inside the cell, no calls to functions of other
# cells). The text's demonstrations use the book's reference package (`reference`), never your
# answers, so the notebook runs top to bottom whatever state your answers are in. Every number the
# text states is printed by a code cell, or quoted with its source. After each grader cell, a cell
# shows the book's reference, once your own answer has passed (`graders.show_reference("ch02.3",
# reveal=True)` shows it anyway).

# %%
import inspect
import math

import torch

import graders
from reference import batch_info as ref_batch_info
from reference import lora_math
from reference.batch_info import LoRABatchInfo, build_batch_info
from reference.ops import torch_ref

# %% [markdown]
# ## 1. Why batch adapters at all
#
# The simplest multi-adapter server loops over the requests of a batch and runs each request's LoRA
# path on its own: two small matmuls (`x A^T`, then `· B^T`) per request, per adapted projection, per
# layer. The cell below counts them for a decode step of Llama-3-8B with 64 requests and LoRA on all
# seven projections, and compares with a batched kernel that needs two launches per projection
# whatever the number of requests. It also prints the LoRA FLOPs as a fraction of those projections'
# base FLOPs (chapter 01's `lora_flop_share`).

# %%
cfg = lora_math.LLAMA3_8B_CONFIG
layers = cfg["num_hidden_layers"]
projections = len(lora_math.LLAMA_PROJECTIONS)
requests = 64
loop_matmuls = requests * 2 * projections * layers
batched_launches = 2 * projections * layers
share = lora_math.lora_flop_share(cfg, lora_math.LLAMA_PROJECTIONS, r=16)
print(f"Llama-3-8B: {layers} layers x {projections} adapted projections")
print(f"per-request loop, {requests} requests:   {loop_matmuls:,} small matmuls per decode step")
print(f"batched shrink + expand kernels: {batched_launches:,} launches per decode step")
print(f"LoRA FLOPs / base FLOPs of the same projections at rank 16: {share:.4f}")

# %% [markdown]
# The LoRA arithmetic is a small fraction of the work (last line). What a naive server pays for is
# the number of tiny kernels, each of which reads its adapter from memory and keeps the GPU mostly
# idle. Batching adapters means: one launch serves every request of the batch, whichever adapter each
# one uses. For that, the kernels need the adapters' weights in one indexable tensor, and a small
# description of which token uses which adapter.
#
# ## 2. The slot-stacked layout
#
# The server allocates a fixed number of **slots** once, at start-up (a later chapter builds this
# memory pool). Slot `s` holds one adapter:
#
# | tensor | shape | slot `s` of rank `r` uses |
# | --- | --- | --- |
# | `A_stack` | `[num_slots, max_rank, in]` | rows `A_stack[s, :r]` |
# | `B_stack` | `[num_slots, out, max_rank]` | columns `B_stack[s, :, :r]` |
# | `lora_ranks` | `[num_slots]` int32 | `r` |
# | `scalings` | `[num_slots]` float32 | the factor `lora_alpha / r` (chapter 01) |
#
# Every slot is sized for the largest rank the server accepts (`max_rank`); an adapter of a smaller
# rank leaves **padding**: rows `r:` of its A, columns `r:` of its B.
#
# **Rank 0** marks a slot that contributes nothing. A request without an adapter (the base model)
# still needs a slot id, so the base model occupies a slot of rank 0 (SGLang's convention, used in
# this book); an empty slot also has rank 0. It can be any slot, not only slot 0.
#
# Two rules every op in this chapter obeys:
# 1. a slot of rank 0 adds **exactly** nothing (the output rows of its tokens keep their bits);
# 2. padding past a slot's rank is **never read**. The pool zero-fills a slot when it loads an adapter,
#    but an op must not rely on that: here we fill the padding with NaN, so any op that lets it into
#    its arithmetic returns NaN. (The graders fill it with NaN too.)
#
# A small pool: slot 0 holds the base model, slot 1 an adapter of rank 4, slot 2 one of rank 8,
# slot 3 is empty.

# %%
num_slots, max_rank, d_in, d_out = 4, 8, 16, 12
lora_ranks = [0, 4, 8, 0]  # slot 0: base model, 1: rank-4 adapter, 2: rank-8 adapter, 3: empty
# lora_scaling(lora_alpha, r, use_rslora): slot 1 has alpha 8 at rank 4, slot 2 alpha 4 at rank 8
scalings = [0.0, lora_math.lora_scaling(8, 4, use_rslora=False), lora_math.lora_scaling(4, 8, use_rslora=False), 0.0]

gen = torch.Generator().manual_seed(0)
A_stack = torch.full((num_slots, max_rank, d_in), float("nan"))
B_stack = torch.full((num_slots, d_out, max_rank), float("nan"))
for s, r in enumerate(lora_ranks):
    A_stack[s, :r] = torch.randn(r, d_in, generator=gen) / math.sqrt(d_in)
    B_stack[s, :, :r] = torch.randn(d_out, r, generator=gen) / math.sqrt(max(r, 1))

print("A_stack", list(A_stack.shape), " B_stack", list(B_stack.shape))
print("lora_ranks", lora_ranks)
print("scalings  ", scalings)
print(f"rows of A_stack that are padding (NaN here): {1 - sum(lora_ranks) / (num_slots * max_rank):.3f}")

# %% [markdown]
# ## 3. The batch: `LoRABatchInfo`
#
# A forward pass flattens its requests into one activation matrix `x` `[num_tokens, in]`: request
# `i`'s tokens are contiguous rows, a **segment**. Everything the ops know about the batch is in one
# dataclass, `LoRABatchInfo`, passed explicitly to every op (the book's contract; SGLang's struct of
# the same name is the model). Its host fields are Python values; its tensors live on `x`'s device.

# %%
print(inspect.getsource(LoRABatchInfo))

# %% [markdown]
# The running example of this chapter: three requests of 3, 10 and 5 tokens using slots 2, 0 (the
# base model) and 1. `build_batch_info` (from the reference) fills the struct from host lists.

# %%
seg_lens = [3, 10, 5]
weight_indices = [2, 0, 1]  # request 0 -> slot 2, request 1 -> the base model (slot 0), request 2 -> slot 1
info = build_batch_info(seg_lens, weight_indices, lora_ranks, scalings, "cpu")
for name in ["bs", "num_segments", "max_len", "has_active_lora"]:
    print(f"{name:16} {getattr(info, name)!r}")
for name in ["seg_lens", "seg_indptr", "weight_indices", "lora_ranks", "scalings", "token_slots"]:
    print(f"{name:16} {getattr(info, name).tolist()}")
print(f"{'permutation':16} {info.permutation}")

# %% [markdown]
# Reading the printout:
# - `seg_indptr` holds the segments' offsets in CSR style: segment `i` is rows
#   `seg_indptr[i]:seg_indptr[i+1]`, and its last entry is the number of tokens.
# - `weight_indices` gives the slot of each segment (SGMV reads segments); `token_slots` gives the slot
#   of each token, in `x` order (BGMV reads only this).
# - `lora_ranks` and `scalings` are per slot, not per request: several requests can share a slot.
# - `has_active_lora`, `bs`, `max_len` are host values computed from the Python lists. Reading a
#   device tensor on the host (`.item()`, `bool(t)`, `.tolist()`) makes the CPU wait for the GPU; the
#   kernels' launch grids come from host ints so that a forward pass never waits.
# - `permutation` is `None` here: the tokens are already in segment order (section 8 changes that).
#
# `torch.cumsum` builds the offsets, with one catch: its result dtype.

# %%
lens32 = torch.tensor(seg_lens, dtype=torch.int32)
print("seg_lens dtype:", lens32.dtype, "-> torch.cumsum dtype:", torch.cumsum(lens32, dim=0).dtype)

# %% [markdown]
# ### Exercise ch02.1: seg_indptr_from_seg_lens
#
# `seg_indptr_from_seg_lens(seg_lens) -> seg_indptr`
#
# - `seg_lens`: `[num_segments]` integer tensor (int32 in the book; the grader passes int64 too),
#   every length `>= 0`, on any device. `num_segments` may be 0. Do not modify it.
# - Return a new `[num_segments + 1]` tensor of dtype **int32** on `seg_lens`' device with
#   `seg_indptr[0] = 0` and `seg_indptr[i + 1] = seg_lens[0] + ... + seg_lens[i]`.
# - Running example: `seg_lens [3, 10, 5] -> seg_indptr [0, 3, 13, 18]`.
# - The result must be int32 whatever the dtype of `seg_lens` (printed above: `torch.cumsum` of
#   int32 gives int64).

# %% exercise="ch02.1" role="answer"
import torch


def seg_indptr_from_seg_lens(seg_lens: torch.Tensor) -> torch.Tensor:
    """CSR offsets of segments: seg_lens [3, 10, 5] -> seg_indptr [0, 3, 13, 18].

    Args:
        seg_lens: [num_segments] integer tensor, lengths >= 0 (not modified).
    Returns:
        [num_segments + 1] int32 tensor on seg_lens' device, seg_indptr[0] == 0; segment i covers
        rows seg_indptr[i]:seg_indptr[i+1].
    """
    ### BEGIN SOLUTION
    seg_indptr = torch.zeros(seg_lens.shape[0] + 1, dtype=torch.int32, device=seg_lens.device)
    seg_indptr[1:] = torch.cumsum(seg_lens, dim=0)  # cumsum returns int64; copying into int32 casts
    return seg_indptr
    ### END SOLUTION


# %% exercise="ch02.1" role="test"
graders.check("ch02.1", seg_indptr_from_seg_lens)

# %% [markdown]
# The book's reference:

# %%
graders.show_reference("ch02.1")

# %% [markdown]
# ### Exercise ch02.2: token_slots_from_segments
#
# `token_slots_from_segments(seg_indptr, weight_indices) -> token_slots`, the per-token view that
# BGMV reads.
#
# - `seg_indptr`: `[num_segments + 1]` int32, starting at 0, non-decreasing (segments may be empty).
# - `weight_indices`: `[num_segments]` int32, the slot of each segment.
# - Return a new `[seg_indptr[-1]]` (= `num_tokens`) **int32** tensor on `weight_indices`' device:
#   every token of segment `i` gets `weight_indices[i]`; an empty segment contributes no entry; no
#   segments give an empty tensor. Do not modify the inputs.
# - Running example: `seg_indptr [0, 3, 13, 18]`, `weight_indices [2, 0, 1]` ->
#   `[2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]`.
# - `torch.repeat_interleave(values, repeats)` repeats `values[i]` `repeats[i]` times (older torch
#   versions want int64 `repeats`, so casting with `.long()` is the portable choice).

# %% exercise="ch02.2" role="answer"
import torch


def token_slots_from_segments(seg_indptr: torch.Tensor, weight_indices: torch.Tensor) -> torch.Tensor:
    """Slot of every token: segment i's slot repeated seg_lens[i] times.

    Args:
        seg_indptr: [num_segments + 1] int32, starting at 0.
        weight_indices: [num_segments] int32, slot per segment.
    Returns:
        [seg_indptr[-1]] int32 on weight_indices' device.
    """
    ### BEGIN SOLUTION
    seg_lens = (seg_indptr[1:] - seg_indptr[:-1]).long()  # int64 repeats work on every torch version
    return torch.repeat_interleave(weight_indices.to(torch.int32), seg_lens)
    ### END SOLUTION


# %% exercise="ch02.2" role="test"
graders.check("ch02.2", token_slots_from_segments)

# %%
graders.show_reference("ch02.2")

# %% [markdown]
# ## 4. The per-request loop
#
# The simplest correct multi-adapter LoRA walks the segments on the host and runs two matmuls per
# segment. It is slow (a Python iteration and two small kernels per request), but it is the
# definition that every faster op must agree with:
#
# ```
# for seg in segments:
#     rows = seg_indptr[seg] : seg_indptr[seg + 1]
#     s = weight_indices[seg];  r = lora_ranks[s]
#     out[rows] += scalings[s] * (x[rows] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
# ```
#
# `out` is the base layer's output `x W^T`, computed for the whole batch beforehand; the LoRA path
# adds into it in place. Slicing `[:r]` is what "never read the padding" means in PyTorch, and it makes
# rank 0 add nothing (an empty slice).
#
# **Precision.** Products are accumulated in fp32 (`.float()` before `@`). The intermediate
# `x @ A^T` is rounded to `x.dtype`, as it is when a shrink kernel writes it to memory for an expand
# kernel to read (section 5); the sum is formed in fp32 and rounded once to `out.dtype`. This is how
# the reference and the kernels of later chapters round; the graders' tolerances cannot tell one
# rounding more or less from it, so it is a recommendation, not something the grader checks.

# %% [markdown]
# ### Exercise ch02.3: lora_loop
#
# `lora_loop(x, A_stack, B_stack, batch_info, out) -> out`
#
# - `x`: `[num_tokens, in]`; `A_stack`: `[num_slots, max_rank, in]`; `B_stack`: `[num_slots, out_dim, max_rank]`;
#   `out`: `[num_tokens, out_dim]`, the base output. All of one floating dtype (fp32, fp16 or bf16).
# - Reads `batch_info.seg_indptr`, `weight_indices`, `lora_ranks`, `scalings`, and `permutation`: when
#   it is not `None`, segment `i`'s rows of `x` and `out` are `permutation[seg_indptr[i]:seg_indptr[i+1]]`
#   instead of `seg_indptr[i]:seg_indptr[i+1]` (section 8). The graders pass both kinds of batch, and
#   batches whose segments are cut into chunks (several segments of one request); the loop never
#   reads `token_slots` (some batches carry `None` there).
# - For every segment with slot `s` and `r = lora_ranks[s] > 0`:
#   `out[rows] += scalings[s] * (x[rows] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T`,
#   accumulating in fp32, the intermediate rounded to `x.dtype`, the result written in `out.dtype`.
# - Rank 0 (base model or empty slot) and empty segments: their rows of `out` stay exactly as they were.
# - Read only `A_stack[s, :r]` and `B_stack[s, :, :r]`: everything past the rank holds NaN in the graders' pools.
# - In place: update `out` and return it. Do not modify any other input.

# %% exercise="ch02.3" role="answer"
import torch


def lora_loop(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out], the base output, updated in place
) -> torch.Tensor:
    """Per-request multi-adapter LoRA, one segment at a time.

    Semantics:
        for seg: rows = seg_indptr[seg]:seg_indptr[seg+1] (through permutation if set)
                 s = weight_indices[seg]; r = lora_ranks[s]
                 out[rows] += scalings[s] * (x[rows] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
    Rank 0 adds nothing. Returns out.
    """
    ### BEGIN SOLUTION
    indptr = batch_info.seg_indptr.tolist()
    ranks = batch_info.lora_ranks.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = ranks[slot]
        if r == 0 or indptr[seg] == indptr[seg + 1]:
            continue  # base model, empty slot or empty segment: nothing to add
        rows = torch.arange(indptr[seg], indptr[seg + 1], device=x.device)
        if batch_info.permutation is not None:
            rows = batch_info.permutation[rows]
        t = (x[rows].float() @ A_stack[slot, :r].float().T).to(x.dtype)  # shrink, rounded like a kernel's output
        delta = batch_info.scalings[slot].float() * (t.float() @ B_stack[slot, :, :r].float().T)
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
    ### END SOLUTION


# %% exercise="ch02.3" role="test"
graders.check("ch02.3", lora_loop)

# %%
graders.show_reference("ch02.3")

# %% [markdown]
# ## 5. Two ops: shrink, then expand
#
# Batched kernels split the LoRA path in two, with a small intermediate `t` `[num_tokens, max_rank]`
# in memory between them:
#
# | op | computes, for a token of slot `s`, rank `r` | GEMM shape |
# | --- | --- | --- |
# | shrink | `t[tok, :r] = x[tok] @ A_stack[s, :r].T` | K = `in` (large), N = `r` (small) |
# | expand | `out[tok] += scalings[s] * t[tok, :r] @ B_stack[s, :, :r].T` | K = `r` (small), N = `out` (large) |
#
# - **Shrink applies no scaling; expand applies it once.** Scaling in both would scale the delta twice.
# - **Shrink defines only columns `:r`** of its row. Columns `r:` of `t` are unspecified: shrink may
#   leave them or write anything there, and expand never reads them. The graders fill `t` with NaN
#   before calling a shrink, and put NaN past each token's rank in the `t` they give an expand.
# - **Expand adds in place** into the base output (read, add, write). The base layer never knows that
#   LoRA exists; callers preallocate `out` (CUDA graphs, in a later chapter, need fixed buffers).
# - The two GEMMs have opposite shapes (small N against small K), so their best tilings differ
#   (chapters 03-04). `t` is small: for Llama-3-8B at `max_rank` 16 it holds this many values per token,
#   against the hidden size of `x`:

# %%
hidden, llama_max_rank = cfg["hidden_size"], 16
print(f"t: {llama_max_rank} values per token; x: {hidden} per token; ratio {llama_max_rank / hidden:.4f}")

# %% [markdown]
# The two batched ways to run shrink and expand differ in how a program of the kernel finds its
# tokens' adapter. The figure draws the running example (slot 0 base model, rank 0; slot 1 rank 4;
# slot 2 rank 8; slot 3 empty):
#
# ![BGMV gathers one copy of the adapter per token; SGMV runs one GEMM per segment](bgmv_vs_sgmv.png)
#
# ## 6. BGMV: every token gathers its own adapter
#
# Punica's **BGMV** (batched gather matrix-vector multiplication) gives every token its own program:
# it reads `token_slots[tok]` and multiplies the token's row by that slot's A (shrink) or B (expand).
# In a decode step every request contributes exactly one token, so there is nothing to group: BGMV is
# the decode kernel. BGMV reads only `token_slots` (and `lora_ranks`, `scalings`), never the segments.
#
# In PyTorch the per-token gather is an indexing: `A_stack[token_slots]` is a
# `[num_tokens, max_rank, in]` tensor, one copy of the adapter per token (the Triton kernel reads
# instead of copying). The ranks differ from token to token, so the clip becomes a mask. Use
# `torch.where` to clip, not a multiplication by a 0/1 mask: `where` *selects*, so a NaN or a huge
# value in the padding never enters the arithmetic (in the shrink the padding of A only reaches
# columns past the rank, which nobody reads; in the expand it reaches the output), whereas
# multiplying gives:

# %%
print("nan * 0 =", float("nan") * 0.0, "   inf * 0 =", float("inf") * 0.0)
ranks_of_tokens = info.lora_ranks.long()[info.token_slots.long()]
keep = torch.arange(max_rank)[None, :] < ranks_of_tokens[:, None]  # [num_tokens, max_rank]: column < rank
print("ranks of the running example's tokens:", ranks_of_tokens.tolist())
print("defined columns of t for tokens 0, 3 and 13:\n", keep[[0, 3, 13]].int())

# %% [markdown]
# ### Exercise ch02.4: bgmv_shrink
#
# `bgmv_shrink(x, A_stack, batch_info, out) -> out`
#
# - `x`: `[num_tokens, in]`; `A_stack`: `[num_slots, max_rank, in]`; `out`: `[num_tokens, >= max_rank]`
#   (the graders pass `max_rank` columns or a few more, filled with NaN). One floating dtype (fp32,
#   fp16 or bf16). `num_tokens` may be 0.
# - Reads only `batch_info.token_slots` (`[num_tokens]` int32, in `x` order) and `lora_ranks`. The
#   graders' batches include permuted and chunked ones (section 8), whose segments are in another
#   order than `x`'s rows: slots rebuilt from `seg_indptr` and `weight_indices` are wrong there.
# - For every token, with `s = token_slots[tok]` and `r = lora_ranks[s]`:
#   `out[tok, :r] = x[tok] @ A_stack[s, :r].T`, accumulated in fp32, written in `out.dtype`.
#   **No scaling.**
# - `out[tok, r:]` is unspecified: the graders compare only columns `:r` (a token of rank 0 defines
#   nothing), so whatever lands there is fine. Rows of `A_stack` past the rank hold NaN in the
#   graders' pools; they may only reach those unspecified columns.
# - In place: write into `out` and return it; do not modify the other inputs.
# - Only one stacked part here (`stack_num = 1`; a later chapter fuses q, k and v).

# %% exercise="ch02.4" role="answer"
import torch


def bgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, >= max_rank]
) -> torch.Tensor:
    """BGMV shrink: every token gathers its own slot's A.

    Semantics:
        s = token_slots[tok]; r = lora_ranks[s]
        out[tok, :r] = x[tok] @ A_stack[s, :r].T      (fp32 accumulation, no scaling)
    Columns past r are unspecified. Reads only token_slots. Returns out.
    """
    ### BEGIN SOLUTION
    slots = batch_info.token_slots.long()  # [T]
    ranks = batch_info.lora_ranks.long()[slots]  # [T], rank of each token's slot
    max_rank = A_stack.shape[1]
    keep = torch.arange(max_rank, device=x.device)[None, :] < ranks[:, None]  # [T, max_rank]
    A = torch.where(keep[:, :, None], A_stack[slots].float(), 0.0)  # per-token gather, clipped to the rank
    t = torch.einsum("ti,tri->tr", x.float(), A)  # [T, max_rank], fp32
    region = out[:, :max_rank]
    region.copy_(torch.where(keep, t.to(out.dtype), region))  # write the defined columns only
    return out
    ### END SOLUTION


# %% exercise="ch02.4" role="test"
graders.check("ch02.4", bgmv_shrink)

# %% [markdown]
# The reference computes the product from the whole gathered A and then keeps only the defined
# columns; the padding's NaN lands in columns that `torch.where` throws away:

# %%
graders.show_reference("ch02.4")

# %% [markdown]
# ### Exercise ch02.5: bgmv_expand
#
# `bgmv_expand(t, B_stack, batch_info, out) -> out`
#
# - `t`: `[num_tokens, >= max_rank]`, the shrink output (columns past each token's rank hold junk;
#   the graders pass `max_rank` columns or a few more);
#   `B_stack`: `[num_slots, out_dim, max_rank]`; `out`: `[num_tokens, out_dim]`, the base output.
# - Reads only `batch_info.token_slots`, `lora_ranks` and `scalings` (permuted and chunked batches
#   too, as in ch02.4).
# - For every token, with `s = token_slots[tok]` and `r = lora_ranks[s]`:
#   `out[tok] += scalings[s] * t[tok, :r] @ B_stack[s, :, :r].T`, accumulated in fp32, written in
#   `out.dtype`.
# - Rank 0: the row of `out` stays exactly as it was. Never let `t[tok, r:]` or `B_stack[s, :, r:]`
#   into the arithmetic.
# - In place: update `out` and return it; do not modify the other inputs. One output slice
#   (the reference's optional `slice_offsets` comes with the fused projections of a later chapter).

# %% exercise="ch02.5" role="answer"
import torch


def bgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= max_rank]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out], updated in place
) -> torch.Tensor:
    """BGMV expand: every token gathers its own slot's B and adds its scaled product in place.

    Semantics:
        s = token_slots[tok]; r = lora_ranks[s]
        out[tok] += scalings[s] * t[tok, :r] @ B_stack[s, :, :r].T
    Rank 0 adds exactly nothing. Reads only token_slots. Returns out.
    """
    ### BEGIN SOLUTION
    slots = batch_info.token_slots.long()  # [T]
    ranks = batch_info.lora_ranks.long()[slots]  # [T]
    scale = batch_info.scalings.float()[slots]  # [T]
    max_rank = B_stack.shape[2]
    keep = torch.arange(max_rank, device=t.device)[None, :] < ranks[:, None]  # [T, max_rank]
    part = torch.where(keep, t[:, :max_rank].float(), 0.0)  # t clipped to each token's rank
    B = torch.where(keep[:, None, :], B_stack[slots].float(), 0.0)  # [T, out, max_rank], gathered and clipped
    delta = scale[:, None] * torch.einsum("tr,tor->to", part, B)  # [T, out], zero for rank-0 tokens
    out.copy_((out.float() + delta).to(out.dtype))
    return out
    ### END SOLUTION


# %% exercise="ch02.5" role="test"
graders.check("ch02.5", bgmv_expand)

# %%
graders.show_reference("ch02.5")

# %% [markdown]
# ## 7. SGMV: one small GEMM per segment
#
# In a prefill step a request brings many tokens, all with the same adapter. BGMV would fetch that
# adapter once per token. Punica's **SGMV** (segmented gather matrix-vector multiplication) gives each
# *segment* its programs instead: a program reads `weight_indices[seg]`, then `lora_ranks` and
# `scalings` of that slot, returns at once when the rank is 0, and otherwise runs a small GEMM
# `[seg_len, in] x [in, r]` that loads the adapter once for all the segment's tokens. The cell
# below counts the bytes of A each approach reads for a prefill of three requests of 512 tokens at
# rank 16 on one Llama-3-8B `q_proj` (4096 inputs) in bf16 (2 bytes per value), ignoring caches:

# %%
prefill_lens, prefill_rank, bytes_per_value = [512, 512, 512], 16, 2
bgmv_bytes = sum(prefill_lens) * prefill_rank * hidden * bytes_per_value  # one fetch per token
sgmv_bytes = len(prefill_lens) * prefill_rank * hidden * bytes_per_value  # one fetch per segment
print(f"requests of {prefill_lens} tokens, rank {prefill_rank}, in = {hidden}, {bytes_per_value} bytes per value")
print(f"A read by BGMV: {bgmv_bytes / 2**20:.1f} MiB;  by SGMV: {sgmv_bytes / 2**20:.3f} MiB;  "
      f"ratio {bgmv_bytes // sgmv_bytes} (the tokens per segment)")

# %% [markdown]
# In PyTorch, SGMV is a host loop over segments, like `lora_loop`, split into shrink and expand.
# Segments need not be sorted by slot, and the same slot can appear in several segments. When
# `batch_info.permutation` is set, segment `i` covers the rows `permutation[seg_indptr[i]:seg_indptr[i+1]]`
# of `x`, `t` and `out` (section 8 explains why); with `None` it covers `seg_indptr[i]:seg_indptr[i+1]`.
# Either way the results land in `x`'s row order.

# %% [markdown]
# ### Exercise ch02.6: sgmv_shrink
#
# `sgmv_shrink(x, A_stack, batch_info, out) -> out`
#
# - `x`: `[num_tokens, in]`; `A_stack`: `[num_slots, max_rank, in]`; `out`: `[num_tokens, >= max_rank]`
#   (filled with NaN by the graders, `max_rank` columns or a few more). One floating dtype.
# - Reads `batch_info.seg_indptr`, `weight_indices`, `lora_ranks` and `permutation` (never
#   `token_slots`: some of the graders' batches carry `None` there). Segments may be chunks, several
#   of one request.
# - For every segment `i` with `s = weight_indices[i]`, `r = lora_ranks[s]`, and
#   `rows = perm[seg_indptr[i]:seg_indptr[i+1]]` (`perm` = `permutation`, or the identity when it is
#   `None`): `out[rows, :r] = x[rows] @ A_stack[s, :r].T`, accumulated in fp32, written in `out.dtype`.
#   **No scaling.**
# - Columns `r:` and the rows of rank-0 segments are unspecified: leave them or write anything
#   there. Segments may be empty.
#   Never read `A_stack[s, r:]`.
# - In place: write into `out` and return it; do not modify the other inputs. `stack_num = 1`.

# %% exercise="ch02.6" role="answer"
import torch


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, >= max_rank]
) -> torch.Tensor:
    """SGMV shrink: one small GEMM per segment of tokens that share a slot.

    Semantics:
        for seg: rows = perm[seg_indptr[seg]:seg_indptr[seg+1]]; s = weight_indices[seg]; r = lora_ranks[s]
                 out[rows, :r] = x[rows] @ A_stack[s, :r].T      (fp32 accumulation, no scaling)
    perm is batch_info.permutation or the identity. Columns past r are unspecified. Returns out.
    """
    ### BEGIN SOLUTION
    indptr = batch_info.seg_indptr.tolist()
    ranks = batch_info.lora_ranks.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = ranks[slot]
        if r == 0 or indptr[seg] == indptr[seg + 1]:
            continue  # a rank-0 program returns at once
        rows = torch.arange(indptr[seg], indptr[seg + 1], device=x.device)
        if batch_info.permutation is not None:
            rows = batch_info.permutation[rows]  # sorted row i is row permutation[i] of x
        out[rows, :r] = (x[rows].float() @ A_stack[slot, :r].float().T).to(out.dtype)
    return out
    ### END SOLUTION


# %% exercise="ch02.6" role="test"
graders.check("ch02.6", sgmv_shrink)

# %%
graders.show_reference("ch02.6")

# %% [markdown]
# ### Exercise ch02.7: sgmv_expand
#
# `sgmv_expand(t, B_stack, batch_info, out) -> out`
#
# - `t`: `[num_tokens, >= max_rank]` (NaN past each token's rank); `B_stack`: `[num_slots, out_dim, max_rank]`;
#   `out`: `[num_tokens, out_dim]`, the base output.
# - Reads `batch_info.seg_indptr`, `weight_indices`, `lora_ranks`, `scalings` and `permutation`
#   (never `token_slots`, as in ch02.6).
# - For every segment `i`, with `s`, `r` and `rows` as in ch02.6:
#   `out[rows] += scalings[s] * t[rows, :r] @ B_stack[s, :, :r].T`, accumulated in fp32, written in
#   `out.dtype`.
# - Rank-0 segments and empty segments: their rows stay exactly as they were. Never read `t[:, r:]`
#   of a segment or `B_stack[s, :, r:]`.
# - In place: update `out` and return it; do not modify the other inputs. One output slice.

# %% exercise="ch02.7" role="answer"
import torch


def sgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= max_rank]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out], updated in place
) -> torch.Tensor:
    """SGMV expand: per segment, add the scaled low-rank product into the base output in place.

    Semantics:
        for seg: rows, s, r as in sgmv_shrink
                 out[rows] += scalings[s] * t[rows, :r] @ B_stack[s, :, :r].T
    Rank 0 adds exactly nothing. Returns out.
    """
    ### BEGIN SOLUTION
    indptr = batch_info.seg_indptr.tolist()
    ranks = batch_info.lora_ranks.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = ranks[slot]
        if r == 0 or indptr[seg] == indptr[seg + 1]:
            continue
        rows = torch.arange(indptr[seg], indptr[seg + 1], device=t.device)
        if batch_info.permutation is not None:
            rows = batch_info.permutation[rows]
        delta = batch_info.scalings[slot].float() * (t[rows, :r].float() @ B_stack[slot, :, :r].float().T)
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
    ### END SOLUTION


# %% exercise="ch02.7" role="test"
graders.check("ch02.7", sgmv_expand)

# %%
graders.show_reference("ch02.7")

# %% [markdown]
# ## 8. Requests in any order: a permutation
#
# Requests arrive in any order, and a scheduler keeps them in that order (moving activations around
# would cost a copy of `x` per layer). SGMV already works on such a batch with one segment per request,
# but two requests of the same adapter then make two small GEMMs where one bigger GEMM would do
# (chunked SGMV, in a later chapter, merges and cuts segments for that reason). Instead of moving rows, we compute a
# **permutation**: the order in which the rows *would* be if they were grouped by slot.
#
# - Row `i` of the sorted order is row `permutation[i]` of `x`. A kernel reads `x[permutation[i]]`
#   and writes `out[permutation[i]]`, so the outputs stay in `x`'s order.
# - The sort is **stable**: tokens of one slot keep their original order, so every request's tokens
#   stay in sequence and the result is deterministic.
# - The inverse maps back: row `j` of `x` is sorted row `inverse[j]`, and `inverse[permutation[i]] = i`.
#
# `torch.sort(..., stable=True)` returns the sorted values and the indices that sort: those indices
# are the permutation.

# %% [markdown]
# ### Exercise ch02.8: stable_sort_by_slot
#
# `stable_sort_by_slot(token_slots) -> (permutation, inverse)`
#
# - `token_slots`: `[num_tokens]` int32, the slot of every token in `x` order; `num_tokens` may be 0.
#   Do not modify it.
# - Return a tuple of two new `[num_tokens]` **int64** tensors on `token_slots`' device:
#   `permutation`, the stable sorting permutation (`token_slots[permutation]` is non-decreasing and
#   equal slots keep their original order), and `inverse`, with `inverse[permutation[i]] = i`.
# - Example: `token_slots [2, 0, 1, 1] -> permutation [1, 2, 3, 0], inverse [3, 0, 1, 2]`
#   (sorted row 0 is token 1, of slot 0; token 0, of slot 2, becomes sorted row 3).
# - Graded on the CPU even on a GPU machine: on CUDA, `torch.sort` happened to return the stable
#   order for every graded case, so only the CPU tells a stable sort from a lucky one.

# %% exercise="ch02.8" role="answer"
import torch


def stable_sort_by_slot(token_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Group tokens by slot: sorted row i is row permutation[i] of x; row j of x is sorted row inverse[j].

    Returns:
        (permutation, inverse), both [num_tokens] int64 on token_slots' device.
    """
    ### BEGIN SOLUTION
    permutation = torch.sort(token_slots, stable=True).indices  # int64
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.shape[0], device=permutation.device)
    return permutation, inverse
    ### END SOLUTION


# %% exercise="ch02.8" role="test"
graders.check("ch02.8", stable_sort_by_slot)

# %%
graders.show_reference("ch02.8")

# %% [markdown]
# Putting it together on a batch whose requests arrive out of slot order: four requests of 2, 3, 1
# and 2 tokens using slots 1, 2, 1 and 0. We sort the tokens by slot, cut the sorted order into one
# segment per slot (`torch.unique_consecutive` counts each run), and pass the permutation to
# `build_batch_info`, which stores `token_slots` in `x` order.

# %%
req_lens, req_slots = [2, 3, 1, 2], [1, 2, 1, 0]
arrival_slots = torch.repeat_interleave(torch.tensor(req_slots, dtype=torch.int32), torch.tensor(req_lens))
permutation, inverse = ref_batch_info.stable_sort_by_slot(arrival_slots)
group_slots, group_lens = torch.unique_consecutive(arrival_slots[permutation], return_counts=True)
sorted_info = build_batch_info(group_lens.tolist(), group_slots.tolist(), lora_ranks, scalings, "cpu", permutation)

print("token_slots (x order)    ", arrival_slots.tolist())
print("permutation              ", permutation.tolist())
print("inverse                  ", inverse.tolist())
print("token_slots[permutation] ", arrival_slots[permutation].tolist())
print("segments: seg_lens", sorted_info.seg_lens.tolist(), " seg_indptr", sorted_info.seg_indptr.tolist(),
      " weight_indices", sorted_info.weight_indices.tolist())
print("batch_info.token_slots equals the x-order slots:", torch.equal(sorted_info.token_slots, arrival_slots))

x_demo = torch.arange(arrival_slots.shape[0]).float()[:, None]  # row j holds the value j
print("sorted row i is x[permutation[i]]:", x_demo[permutation].flatten().tolist())
print("x[permutation][inverse] == x:", torch.equal(x_demo[permutation][inverse], x_demo))

# %% [markdown]
# The slot-1 tokens of the first and the third request now form one segment, and the four requests
# became one segment per slot (printed above).
#
# ## 9. Four paths, one answer
#
# A mixed batch: five slots with ranks 16, 4, 0 (the base model, in slot 2 this time), 8 and 0
# (empty), `max_rank` 16, NaN in every padding; six requests in arrival order, two adapters used
# twice, non-adjacent. The **definition** is a per-row computation that knows nothing about segments:
# for every token, look up its slot and add that adapter's delta. Then we run the four batched paths of
# this chapter (the reference's ops) and compare.

# %%
def dense_per_row(x, A_stack, B_stack, token_slots, lora_ranks, scalings, base):
    """The definition, one token at a time: out[tok] = base[tok] + s * (x[tok] @ A[:r].T) @ B[:, :r].T."""
    out = base.clone()
    for tok, slot in enumerate(token_slots.tolist()):
        r = lora_ranks[slot]
        if r > 0:
            out[tok] += scalings[slot] * (x[tok] @ A_stack[slot, :r].T) @ B_stack[slot, :, :r].T
    return out


mix_ranks = [16, 4, 0, 8, 0]  # slot 2: base model; slot 4: empty
mix_scalings = [0.5, 2.0, 0.0, 1.0, 0.0]
mix_max_rank, mix_in, mix_out = 16, 40, 24
mix_lens, mix_slots = [4, 1, 7, 1, 3, 2], [3, 2, 0, 1, 3, 0]

gen = torch.Generator().manual_seed(2)
A_mix = torch.full((len(mix_ranks), mix_max_rank, mix_in), float("nan"))
B_mix = torch.full((len(mix_ranks), mix_out, mix_max_rank), float("nan"))
for s, r in enumerate(mix_ranks):
    A_mix[s, :r] = torch.randn(r, mix_in, generator=gen) / math.sqrt(mix_in)
    B_mix[s, :, :r] = torch.randn(mix_out, r, generator=gen) / math.sqrt(max(r, 1))
num_tokens = sum(mix_lens)
x_mix = torch.randn(num_tokens, mix_in, generator=gen)
base_out = torch.randn(num_tokens, mix_out, generator=gen)  # stands for x @ W.T

# one segment per request, in arrival order
req_info = build_batch_info(mix_lens, mix_slots, mix_ranks, mix_scalings, "cpu")
# one segment per slot, through a permutation
perm, _ = ref_batch_info.stable_sort_by_slot(req_info.token_slots)
g_slots, g_lens = torch.unique_consecutive(req_info.token_slots[perm], return_counts=True)
grp_info = build_batch_info(g_lens.tolist(), g_slots.tolist(), mix_ranks, mix_scalings, "cpu", perm)

expected = dense_per_row(x_mix, A_mix, B_mix, req_info.token_slots, mix_ranks, mix_scalings, base_out)


def shrink_then_expand(shrink, expand, batch_info):
    t = torch.full((num_tokens, mix_max_rank), float("nan"))  # unspecified columns stay NaN
    shrink(x_mix, A_mix, batch_info, t)
    return expand(t, B_mix, batch_info, base_out.clone())


paths = {
    "lora_loop, request segments": torch_ref.lora_loop(x_mix, A_mix, B_mix, req_info, base_out.clone()),
    "bgmv shrink + expand": shrink_then_expand(torch_ref.bgmv_shrink, torch_ref.bgmv_expand, req_info),
    "sgmv, request segments": shrink_then_expand(torch_ref.sgmv_shrink, torch_ref.sgmv_expand, req_info),
    "sgmv, slot segments + permutation": shrink_then_expand(torch_ref.sgmv_shrink, torch_ref.sgmv_expand, grp_info),
}
print(f"lora_ranks {mix_ranks}, scalings {mix_scalings}, max_rank {mix_max_rank}")
print(f"requests: lengths {mix_lens} -> slots {mix_slots}")
print(f"{num_tokens} tokens; {req_info.num_segments} request segments; {grp_info.num_segments} slot segments")
for name, got in paths.items():
    print(f"{name:36} finite: {bool(torch.isfinite(got).all())}   "
          f"max |got - definition| = {(got - expected).abs().max().item():.2e}")
base_rows = req_info.token_slots == 2
print("rows of the base model (slot 2) unchanged, bit for bit:",
      all(torch.equal(got[base_rows], base_out[base_rows]) for got in paths.values()))

# %% [markdown]
# All four agree with the definition to fp32 rounding, no NaN from the padding reached any output, and
# the base model's rows kept their exact bits. The batched paths differ only in how they find each
# token's adapter: per token (BGMV, `token_slots`), per request segment (SGMV), or per slot segment
# through a permutation (SGMV with `permutation`).
#
# ## 10. Mixed ranks: what padding costs
#
# A slot is sized for `max_rank`. A kernel that ignores `lora_ranks` and computes all `max_rank`
# columns for every token gets the right answer only when the padding is zero, and then it spends
# FLOPs multiplying zeros. vLLM works this way: it zero-fills a slot before loading an adapter into it
# and its kernels run over the full `max_lora_rank` (section 11). SGLang's kernels clip each program
# to its slot's rank, as every op of this chapter does. The other way out is grouping requests by rank
# so that a batch never mixes them.
#
# Below, the unclipped computation on the mixed batch of section 9: with zero padding it matches the
# definition, with NaN padding (stale data of an evicted adapter, say) it does not.

# %%
def unclipped_delta(x, A_stack, B_stack, token_slots, scalings):
    """Every token computes all max_rank columns of its slot: right only if the padding is zero."""
    slots = token_slots.long()
    t = torch.einsum("ti,tri->tr", x, A_stack[slots])
    return torch.tensor(scalings)[slots][:, None] * torch.einsum("tr,tor->to", t, B_stack[slots])


zero_A, zero_B = torch.nan_to_num(A_mix, nan=0.0), torch.nan_to_num(B_mix, nan=0.0)
with_zeros = base_out + unclipped_delta(x_mix, zero_A, zero_B, req_info.token_slots, mix_scalings)
with_nans = base_out + unclipped_delta(x_mix, A_mix, B_mix, req_info.token_slots, mix_scalings)
print(f"zero padding: max |got - definition| = {(with_zeros - expected).abs().max().item():.2e}")
print(f"NaN padding:  rows containing NaN = {int(torch.isnan(with_nans).any(dim=1).sum())} of {num_tokens}")

# %% [markdown]
# The cost of padding, in FLOPs: shrink costs `2 * in * rank` FLOPs per token and expand
# `2 * rank * out`, both linear in the rank, so the hidden sizes cancel. For requests with `n_i` tokens
# and rank `r_i`, padded to `R = max r_i`:
#
# `waste = sum_i n_i (R - r_i) / sum_i n_i R`
#
# ### Exercise ch02.9: padded_flop_waste
#
# `padded_flop_waste(seg_lens, ranks) -> float`
#
# - `seg_lens`, `ranks`: Python lists of ints of the same length: request `i` has `seg_lens[i] >= 0`
#   tokens and rank `ranks[i] >= 0` (0 = the base model).
# - Return, as a Python float, the fraction of LoRA FLOPs that a kernel padding every request to
#   `R = max(ranks)` spends on padding: `sum_i n_i (R - r_i) / sum_i n_i R`. `R` is the largest rank of
#   all requests (an empty one too). A rank-0 request padded to `R` counts as all padding.
# - Return `0.0` when the denominator is 0 (no requests, no tokens, or all ranks 0).
# - Raise `ValueError` when the two lists differ in length (either one longer).

# %% exercise="ch02.9" role="answer"
def padded_flop_waste(seg_lens: list[int], ranks: list[int]) -> float:
    """Fraction of LoRA FLOPs wasted when every request is padded to the batch's largest rank.

    waste = sum n_i (R - r_i) / sum n_i R, R = max rank; 0.0 when that denominator is 0.
    Raises ValueError if the lists differ in length.
    """
    ### BEGIN SOLUTION
    if len(seg_lens) != len(ranks):
        raise ValueError(f"{len(seg_lens)} seg_lens but {len(ranks)} ranks")
    max_rank = max(ranks, default=0)
    padded = sum(n * max_rank for n in seg_lens)
    if padded == 0:
        return 0.0
    wasted = sum(n * (max_rank - r) for n, r in zip(seg_lens, ranks))
    return wasted / padded
    ### END SOLUTION


# %% exercise="ch02.9" role="test"
graders.check("ch02.9", padded_flop_waste)

# %%
graders.show_reference("ch02.9")

# %% [markdown]
# A stated batch: one request with a rank-64 adapter and three with rank-16 adapters, 100 tokens each.
# The cell prints the wasted fraction and the LoRA FLOPs of one Llama-3-8B `q_proj` (4096 x 4096) for
# this batch, padded and clipped; then a skewed batch, a 2000-token rank-16 prefill next to a
# 10-token rank-64 request.

# %%
def lora_flops(lens, ranks, d_in, d_out):
    """Shrink + expand FLOPs: 2 * r * (in + out) per token."""
    return sum(n * 2 * r * (d_in + d_out) for n, r in zip(lens, ranks))


q_in, q_out = lora_math.projection_shapes(cfg)["q_proj"]
print(f"Llama-3-8B q_proj: in {q_in}, out {q_out}")
for lens, ranks in [([100, 100, 100, 100], [64, 16, 16, 16]), ([2000, 10], [16, 64])]:
    waste = lora_math.padded_flop_waste(lens, ranks)
    padded = lora_flops(lens, [max(ranks)] * len(ranks), q_in, q_out)
    clipped = lora_flops(lens, ranks, q_in, q_out)
    print(f"seg_lens {lens}, ranks {ranks}: waste {waste:.4f}; "
          f"q_proj LoRA GFLOP padded {padded / 1e9:.3f}, clipped {clipped / 1e9:.3f}")

# %% [markdown]
# In the first batch more than half of the padded work multiplies zeros; in the second, one short
# request of a large rank makes the long prefill pay for that rank. Decode is memory-bound, so FLOPs are
# not the whole story: a padded kernel also loads the padding of every slot
# it touches, which costs bandwidth in the same proportion.
#
# ## 11. How production systems do it
#
# - **Punica** (Chen et al., "Punica: Multi-Tenant LoRA Serving", 2023, arXiv:2310.18547) introduced
#   the names and the split used here: BGMV for decode, SGMV for prefill, each a shrink and an expand.
#   vLLM's Triton LoRA ops cite it in their module docstrings.
# - **SGLang**, `python/sglang/srt/lora/`:
#   - `utils.py` defines `LoRABatchInfo` with the fields of this chapter (`bs`, `num_segments`,
#     `seg_indptr`, `weight_indices`, `lora_ranks`, `scalings`, `max_len`, `seg_lens`, `permutation`,
#     and `has_active_lora`, documented there as computed from Python lists to avoid a GPU sync).
#   - `triton_ops/sgemm_lora_a.py` is the SGMV shrink: the launch grid is
#     (tiles of the longest segment, `bs`); a program loads `weight_indices[batch_id]`, then
#     `lora_ranks` of that slot, returns when the rank is 0, and clips N with
#     `tl.minimum(N, rank * stack_num)`. Whether rows go through a permutation is a compile-time
#     constant, `SORTED_BY_ADAPTER = batch_info.permutation is not None`, resolved by
#     `triton_ops/kernel_utils.py` (`_resolve_token_positions`), so an unpermuted batch pays nothing.
#   - `triton_ops/sgemm_lora_b.py` is the SGMV expand: in recent versions it loads
#     `scalings[w_index]`, clips K to the rank, and adds into the base output (`base_output`,
#     `fuse_scaling_add`). `qkv_lora_b.py` and `gate_up_lora_b.py` are sliced expands for fused
#     projections, and `chunked_sgmv_shrink.py` / `chunked_sgmv_expand.py` the chunked SGMV (SGLang's
#     default backend, `csgmv`).
#   - `mem_pool.py` marks a free slot with a singleton `EmptySlot` (`EMPTY_SLOT`), because `None` is a
#     real adapter id there: the base model, which occupies a slot of rank 0.
# - **vLLM**, `vllm/lora/`:
#   - `punica_wrapper/punica_base.py` is the interface (`add_shrink`, `add_expand`, `add_lora_linear`)
#     with docstrings in pseudo-code; `punica_wrapper/punica_gpu.py` implements it with the Triton ops
#     in `ops/triton_ops/` (`lora_shrink_op.py`, `lora_expand_op.py`; older versions had separate
#     `bgmv_*` and `sgmv_*` files; `ops/torch_ops/` holds plain-PyTorch versions).
#   - `ops/triton_ops/lora_kernel_metadata.py` (`LoRAKernelMeta.prepare_tensors`) takes
#     `token_lora_mapping`, one slot index per token with **-1 for tokens without LoRA**, skips the
#     LoRA path when all are -1, and computes `token_indices_sorted_by_lora_ids` with
#     `torch.sort(token_lora_mapping, stable=True)`: this chapter's permutation, with one group per
#     active adapter.
#   - `model_manager.py` keeps `lora_index_to_id`, a list with **`None` for a free slot**: the
#     opposite convention from SGLang's.
#   - `layers/base_linear.py` allocates `lora_a_stacked` as zeros of shape
#     `[max_loras, 1, max_lora_rank, in]`; `set_lora` zeroes the slot (`reset_lora`) and copies the
#     adapter into its first `r` rows. The shrink takes N from that buffer's shape (`max_lora_rank`):
#     padded with zeros, computed, not clipped.
#   - vLLM folds the scaling into B when it loads an adapter (`LoRALayerWeights.optimize`,
#     `lora_weights.py`; `lora.py` in older versions), so its layers pass a scale of 1.0.
#
# ## Summary
#
# - Many adapters live in one slot-stacked pair `A_stack [num_slots, max_rank, in]`,
#   `B_stack [num_slots, out, max_rank]`, with `lora_ranks` and `scalings` per slot. Rank 0 (base
#   model, empty slot) adds exactly nothing; padding past a slot's rank is never read.
# - `LoRABatchInfo` is everything an op knows about a batch: segments (`seg_indptr` from `seg_lens`,
#   `weight_indices`), `token_slots` for BGMV, an optional `permutation`, host fields that never
#   synchronize the device.
# - Shrink writes `x @ A^T` clipped to the rank, unscaled; expand adds `scalings[slot] * t @ B^T` into
#   the base output in place.
# - BGMV gathers per token (decode); SGMV runs one GEMM per segment (prefill); a stable sort groups
#   tokens of one adapter without moving them, and outputs stay in `x` order.
# - Padding mixed ranks to the largest wastes FLOPs in proportion `sum n_i (R - r_i) / sum n_i R`;
#   clipping avoids it (SGLang), zero padding computes it (vLLM).
#
# ## Review questions
#
# 1. A batch holds only requests for the base model. Which field of `LoRABatchInfo` lets the server
#    skip the LoRA path, and why must it be computed from host lists rather than from `lora_ranks` on
#    the GPU?
# 2. Your shrink scales by `scalings[slot]` and your expand does too. Which outputs are wrong, by what
#    factor, and which outputs are still right?
# 3. An adapter of rank 8 is evicted and one of rank 4 is loaded into its slot without zero-filling.
#    What does a clipping kernel compute for that slot's tokens? What does a kernel that pads to
#    `max_rank` compute?
# 4. Why is `stable_sort_by_slot` stable, and what would go wrong in a prefill if the sort reordered
#    the tokens of one request?
# 5. A decode batch has 64 requests spread over 8 adapters. Which kernel, BGMV or SGMV with a
#    permutation, reads each adapter fewer times, and why is BGMV still the usual choice for decode?
