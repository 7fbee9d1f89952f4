# %% [markdown]
# # 04 · Packed projections and chunked SGMV
#
# Chapter 03 wrote one shrink and one expand per projection. A Llama layer has seven projections
# that carry adapters, and three of them (q, k, v) read the same input, as do two others (gate, up).
# Production servers do not launch fourteen LoRA kernels per layer: they **pack** the adapters of
# projections that share an input into one slot, so one shrink serves q, k and v together and one
# expand writes all three outputs. This chapter builds that layout, and then changes the other thing
# chapter 03 took for granted: that a segment is a request. **Chunked SGMV** (SGLang's default
# backend) merges neighbouring requests that use the same adapter and cuts the result into chunks of
# equal size, so that a skewed or uneven batch launches the work it needs and no more.
#
# **What you will learn**
# - The packed layout of a fused projection: A stacked to `num_parts * r` rows at the adapter's own
#   rank, B parts one under another along the output axis, `slice_offsets` for the output columns;
#   why grouped-query attention makes the slices unequal (q 4096, k and v 1024 in Llama-3-8B), and
#   what an adapter that has q and v but no k loads.
# - What packing saves, in launches and bytes, computed for Llama-3-8B.
# - An expand kernel with a slice axis: each slice reads its part of `t` and writes its own columns.
# - Chunked SGMV: merge adjacent same-adapter requests, cut into chunks; what it changes in the grid
#   (programs launched, programs with work, adapter reads) and what it measured on an H200 for a
#   skewed batch (98 of 100 requests on one adapter), a uniform one and a long-and-short one; what
#   the chunk size trades.
#
# **Exercises** (each followed by its grader cell): ch04.1 `stack_lora_parts`, ch04.2
# `sgmv_expand_sliced` (Triton), ch04.3 `merge_adjacent_segments`, ch04.4 `cut_into_chunks`.
#
# As in chapter 03, each answer cell is graded on its own in a fresh process that has imported
# `reference` and run `import math, torch`: keep every answer self-contained. The text's
# demonstrations use the book's reference package, never your answers.

# %%
import importlib
import inspect
import json
from pathlib import Path

import reference  # first: with no CUDA device it sets TRITON_INTERPRET=1, which triton reads when imported
import torch

import graders
from reference import chunked, packed
from reference.batch_info import build_batch_info
from reference.device import default_device, interpreting
from reference.lora_math import LLAMA3_8B_CONFIG
from reference.ops import torch_ref

import triton  # after reference, on purpose
import triton.language as tl

ref_sgmv_shrink = importlib.import_module("reference.ops.sgmv_shrink")
ref_sgmv_expand = importlib.import_module("reference.ops.sgmv_expand")
device = default_device()
print(f"device: {device}; Triton interpreter: {interpreting()}")

# %% [markdown]
# ## 1. Why pack: one input, three projections
#
# In attention, `q = x W_q^T`, `k = x W_k^T` and `v = x W_v^T` read the same `x`. Serving engines
# already fuse the base weights into one `qkv_proj` of width `q + k + v` (vLLM's
# `QKVParallelLinear`, SGLang's the same class), so the base path is one GEMM. LoRA follows: the three
# shrinks `x A_q^T`, `x A_k^T`, `x A_v^T` are one shrink with the three A matrices stacked, and the
# three expands are one expand that writes three column ranges. The MLP's `gate_proj` and `up_proj`
# pack the same way, two parts.
#
# The widths come from the model config. Llama-3-8B has 32 query heads and 8 key/value heads of
# dimension 128 (grouped-query attention), so q is four times as wide as k and v:

# %%
cfg = LLAMA3_8B_CONFIG
head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
qkv_widths = (cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim,
              cfg["num_key_value_heads"] * head_dim)
gate_up_widths = (cfg["intermediate_size"], cfg["intermediate_size"])
print("qkv widths", qkv_widths, "-> slice_offsets", packed.slice_offsets_for(qkv_widths))
print("gate_up widths", gate_up_widths, "-> slice_offsets", packed.slice_offsets_for(gate_up_widths))

# %% [markdown]
# What packing saves per layer, counted: launches (a shrink and an expand per LoRA module) and the
# bytes of `x` the shrinks read, for a prefill of 8192 tokens in bf16. Seven separate modules need
# fourteen launches; packed, the four modules `qkv_proj`, `o_proj`, `gate_up_proj` and `down_proj`
# need eight, and the shared input is read once per packed module instead of once per part.

# %%
tokens, el = 8192, 2
hidden = cfg["hidden_size"]
separate = {"launches": 2 * 7, "x_bytes": tokens * el * (3 * hidden + hidden + 2 * hidden + cfg["intermediate_size"])}
fused = {"launches": 2 * 4, "x_bytes": tokens * el * (hidden + hidden + hidden + cfg["intermediate_size"])}
for name, d in (("separate", separate), ("packed", fused)):
    print(f"{name:9s}: {d['launches']:2d} LoRA launches per layer, shrink inputs read {d['x_bytes'] / 2**20:7.1f} MiB")
layers_n = cfg["num_hidden_layers"]
print(f"packing removes {separate['launches'] - fused['launches']} launches and "
      f"{(separate['x_bytes'] - fused['x_bytes']) / 2**20:.1f} MiB of reads per layer; over {layers_n} layers: "
      f"{layers_n * (separate['launches'] - fused['launches'])} launches and "
      f"{layers_n * (separate['x_bytes'] - fused['x_bytes']) / 2**30:.2f} GiB per prefill of {tokens} tokens")

# %% [markdown]
# ## 2. The packed layout
#
# The book's contract (the `Semantics` of `reference/ops/torch_ref.py`; chapter 02 used one part only,
# `stack_num = 1`) packs the parts **at the adapter's own rank r**, not at the pool's `max_rank`:
#
# ```
# A [num_parts * r, in]:   rows [0, r) = A_q,  [r, 2r) = A_k,  [2r, 3r) = A_v
# B [q + k + v, r]:        rows [0, q) = B_q,  [q, q+k) = B_k,  [q+k, q+k+v) = B_v
# slice_offsets:           (0, q, q+k, q+k+v)
# ```
#
# In a pool slot of `max_rank` R, A is `[num_parts * R, in]` and a rank-r adapter fills its first
# `num_parts * r` rows; B is `[q+k+v, R]` and the adapter fills its first r columns. So the shrink
# output of a token has its q part in columns `[0, r)`, k in `[r, 2r)`, v in `[2r, 3r)`: the shrink
# clips N to `num_parts * r` (chapter 03's kernel with `stack_num`), and the expand's part i reads
# columns `[i*r, (i+1)*r)` of `t`. (vLLM instead gives every part its own `max_rank` block and its own
# buffers per slice; SGLang packs as here, `stack_num * r`.)
#
# An adapter trained with `target_modules=["q_proj", "v_proj"]` has no k part. Its k rows of A and
# its k block of B are **zeros**, and its q and v parts keep their places: part 2 (v) still lives at
# rows `[2r, 3r)`. Dropping the missing part and shifting v up would put v's weights where the
# kernels read k. Chapter 05 adds the other half of the rule: a pool zero-fills the whole slot before
# loading, so a k part left by a previous adapter cannot leak into this one.

# %% [markdown]
# ### Exercise ch04.1: `stack_lora_parts`
#
# Write `stack_lora_parts(A_parts, B_parts, out_features)`:
# - `A_parts`, `B_parts`: sequences with one entry per part (q, k, v or gate, up), each a tensor
#   (`A_i [r, in]`, `B_i [out_features[i], r]`) or `None` when the adapter lacks that part;
#   `out_features`: the parts' output widths, e.g. `[24, 8, 8]`.
# - Return `(A, B)`: new tensors `A [num_parts * r, in]` and `B [sum(out_features), r]` in the parts'
#   dtype and device, the packed layout above, zeros for missing parts. New even for a single part
#   (never an input tensor or a view of one). Do not modify the inputs.
# - Raise `ValueError` when: the three sequences differ in length (any one longer or shorter); every
#   part is missing; a part has A but no B (or B but no A); the present parts disagree on r (an A's
#   rows or a B's columns) or on `in`, or a B part's width is not its `out_features` entry (wider or
#   narrower); the present tensors do not all have one dtype (an A and its B, or two parts).

# %% exercise="ch04.1" role="answer"
import torch


def stack_lora_parts(A_parts, B_parts, out_features):
    """Pack per-part LoRA weights into one fused-projection slot (zeros for missing parts)."""
    ### BEGIN SOLUTION
    if not (len(A_parts) == len(B_parts) == len(out_features)):
        raise ValueError("A_parts, B_parts and out_features differ in length")
    present = [i for i in range(len(A_parts)) if A_parts[i] is not None or B_parts[i] is not None]
    if not present:
        raise ValueError("every part is missing")
    if any(A_parts[i] is None or B_parts[i] is None for i in present):
        raise ValueError("a part needs both A and B")
    like = A_parts[present[0]]
    r, d_in = like.shape
    offsets = [0]
    for w in out_features:
        offsets.append(offsets[-1] + w)
    A = like.new_zeros(len(out_features) * r, d_in)
    B = like.new_zeros(offsets[-1], r)
    for i in present:
        a, b = A_parts[i], B_parts[i]
        if a.shape != (r, d_in) or b.shape != (out_features[i], r) or a.dtype != like.dtype or b.dtype != like.dtype:
            raise ValueError(f"part {i}: A {list(a.shape)} {a.dtype}, B {list(b.shape)} {b.dtype} do not fit")
        A[i * r:(i + 1) * r] = a
        B[offsets[i]:offsets[i + 1]] = b
    return A, B
    ### END SOLUTION


# %% exercise="ch04.1" role="test"
graders.check("ch04.1", stack_lora_parts)

# %% [markdown]
# The reference (`reference/packed.py`), shown once your answer passed its check:

# %%
graders.show_reference("ch04.1")

# %% [markdown]
# ## 3. One shrink, one sliced expand: the same result as three projections
#
# A check worth making once with real numbers: a small GQA layer (hidden 32, q 32, k and v 8), a
# pool of three slots (the base model in slot 0 with rank 0, a rank-4 adapter on q, k and v, a
# rank-2 adapter on q and v only), a batch of three requests. The fused path is the reference's
# Triton shrink with `stack_num=3` and its sliced expand; the separate path is chapter 02's torch
# operations, once per projection, with each part's own A and B. The k columns of the q-and-v
# adapter's rows must come back exactly as the base output.

# %%
def gqa_pool(dtype=torch.float32, max_rank=4, d_in=32, widths=(32, 8, 8), seed=0):
    """Slots: 0 base (rank 0), 1 rank-4 on q/k/v, 2 rank-2 on q/v only. Returns pool tensors and parts."""
    g = torch.Generator().manual_seed(seed)
    parts = {1: (4, [0, 1, 2]), 2: (2, [0, 2])}
    A_stack = torch.zeros(3, 3 * max_rank, d_in)
    B_stack = torch.zeros(3, sum(widths), max_rank)
    per_part = {}  # (slot, part) -> (A_i, B_i), None when missing
    for slot, (r, present) in parts.items():
        A_parts = [torch.randn(r, d_in, generator=g) * d_in**-0.5 if i in present else None for i in range(3)]
        B_parts = [torch.randn(w, r, generator=g) * r**-0.5 if i in present else None for i, w in enumerate(widths)]
        A, B = packed.stack_lora_parts(A_parts, B_parts, widths)
        A_stack[slot, :3 * r], B_stack[slot, :, :r] = A, B
        per_part.update({(slot, i): (A_parts[i], B_parts[i]) for i in range(3)})
    return A_stack.to(dtype), B_stack.to(dtype), per_part, [0, 4, 2], [0.0, 2.0, 0.5]


A_stack, B_stack, per_part, ranks, scalings = gqa_pool()
widths, offsets = (32, 8, 8), packed.slice_offsets_for((32, 8, 8))
info = build_batch_info([3, 2, 4], [1, 0, 2], ranks, scalings, device)
x = torch.randn(9, 32, generator=torch.Generator().manual_seed(1))
base = torch.randn(9, sum(widths), generator=torch.Generator().manual_seed(2))

t = torch.full((9, 3 * 4), float("nan"), device=device)  # columns past 3 * r stay NaN: expand never reads them
ref_sgmv_shrink.sgmv_shrink(x.to(device), A_stack.to(device), info, t, stack_num=3)
fused_out = ref_sgmv_expand.sgmv_expand(t, B_stack.to(device), info, base.clone().to(device), offsets).cpu()

separate_out = base.clone()
for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
    for slot, r in enumerate(ranks):
        rows = info.token_slots.cpu() == slot
        A_i, B_i = per_part.get((slot, i), (None, None))
        if r and A_i is not None:
            separate_out[rows, lo:hi] += scalings[slot] * (x[rows] @ A_i.T) @ B_i.T
print("max |fused - separate|:", (fused_out - separate_out).abs().max().item())
k_cols = slice(offsets[1], offsets[2])
rows_qv = info.token_slots.cpu() == 2
print("k columns of the q-and-v adapter's rows unchanged, bit for bit:",
      torch.equal(fused_out[rows_qv, k_cols], base[rows_qv, k_cols]))

# %% [markdown]
# ## 4. An expand with a slice axis
#
# Chapter 03's expand had a grid `(row tiles x column tiles, segments)`. The sliced expand adds a third
# axis, the slice: program `(pid, seg, part)` handles rows of segment `seg` and columns of slice
# `part`. Per program, compared with chapter 03:
#
# 1. the column range is `[lo, hi) = [slice_offsets[part], slice_offsets[part + 1])`; the program's
#    tile is `lo + pid_n * BLOCK_N + arange(BLOCK_N)`, masked by `< hi` (slices are not multiples of
#    the block), and a tile that starts at or past `hi` returns at once (the grid's column tiles are
#    sized by the widest slice);
# 2. `t`'s columns for this part are `part * r + arange(BLOCK_K)`, with r the slot's rank, masked by
#    `< r` (the K loop of chapter 03);
# 3. B's rows are the output columns (`lo..hi`), B's columns `0..r`.
#
# The offsets are host ints. The reference passes them to the kernel as four scalar arguments
# (`OFF0..OFF3`, unused ones repeat the last offset) and picks `lo`/`hi` with `tl.where` on the program
# id: no tensor has to be created and copied to the device per call, so the launch can be captured
# in a CUDA graph (chapter 08) and replayed with new batch contents.
#
# ### Exercise ch04.2: `sgmv_expand_sliced` (Triton)
#
# Write the kernel body and the wrapper `sgmv_expand_sliced(t, B_stack, batch_info, out, slice_offsets)`:
# - `t`: `[num_tokens, >= num_parts * max_rank]`, part i of a token of slot s in columns
#   `[i*r, (i+1)*r)` with `r = lora_ranks[s]`; `B_stack`: `[num_slots, out_total, max_rank]`;
#   `out`: `[num_tokens, out_total]`, the base output; `slice_offsets`: a tuple of 2 to 4 increasing
#   ints starting at 0 (one to three parts). `t`, `B_stack` and `out` share one floating dtype: fp32
#   or fp16 in the interpreter, bf16 as well on a GPU (as in chapter 03).
# - For every segment (rows through `batch_info.permutation` when it is set), slot `s`, rank `r`, and
#   every slice `i` with bounds `lo, hi`:
#   `out[rows, lo:hi] += scalings[s] * t[rows, i*r:(i+1)*r] @ B_stack[s, lo:hi, :r].T`, fp32
#   accumulation, written in `out.dtype`. Rank-0 rows and columns of parts whose B block is zero come
#   back bit for bit; nothing past `num_parts * r` of `t` or past `r` of B may enter the arithmetic
#   (the grader fills them with junk). `t` may be wider than `num_parts * max_rank`: use its strides.
# - One launch; return `out` unchanged without launching when there are no segments or
#   `max_len == 0`. As in chapter 03: `UPCAST` (the interpreter's fp16 dot needs fp32 tiles) and
#   `IEEE_FP32` (fp32 inputs ask `tl.dot` for `input_precision="ieee"`, not TF32) are passed by the
#   wrapper, and every `tl.dot` dimension is at least 16 on a GPU (so `BLOCK_K >= 16`, masked).
# - Sizes: the grader's cases cross every tile and loop, with your blocks and with the reference's
#   (`BLOCK_M` 64, `BLOCK_N` 128 at the cases' max ranks 32 and 64): segments longer than two row tiles, slices wider than two
#   column tiles whose widths are not multiples of any block (so each slice's last tile clips to
#   its own end `hi`, not to the output's), and `max_rank` 32 or 64 with ranks that are not
#   multiples of 16 (a `BLOCK_K` below r loops over K, each step masked by `offs_k < r - k * BLOCK_K`).
#   The junk is NaN in some cases and a large finite value in others, so `nan_to_num` does not
#   replace a mask.

# %% exercise="ch04.2" role="answer"
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def _sliced_expand_kernel(
    # pointers
    t_ptr, b_ptr, out_ptr,
    # sizes: column tiles per slice, and the slice offsets (unused ones repeat the last)
    num_n_tiles, OFF0, OFF1, OFF2, OFF3,
    # strides
    stride_tm, stride_tk, stride_bs, stride_bn, stride_bk, stride_om, stride_on,
    # batch metadata
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, permutation_ptr,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    """Program (pid, seg, part): rows pid_m*BLOCK_M.. of segment seg, columns of slice part."""
    ### BEGIN SOLUTION
    # 1. map the program to (segment, slice, row tile, column tile)
    seg = tl.program_id(1)
    part = tl.program_id(2)
    pid_m = tl.program_id(0) // num_n_tiles
    pid_n = tl.program_id(0) % num_n_tiles
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)
    start = tl.load(seg_indptr_ptr + seg)
    seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    lo = tl.where(part == 0, OFF0, tl.where(part == 1, OFF1, OFF2))
    hi = tl.where(part == 0, OFF1, tl.where(part == 1, OFF2, OFF3))
    if (rank == 0) | (pid_m * BLOCK_M >= seg_len) | (lo + pid_n * BLOCK_N >= hi):
        return
    scaling = tl.load(scalings_ptr + slot)
    # 2. pointers: t's columns [part*r, (part+1)*r), B rows [lo, hi), B columns [0, r)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len
    n_mask = offs_n < hi
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + start + offs_m, mask=m_mask, other=0)
    else:
        rows = start + offs_m
    t_ptrs = t_ptr + rows[:, None] * stride_tm + (part * rank + offs_k)[None, :] * stride_tk
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    # 3. loop over K = the rank, masked
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(rank, BLOCK_K)):
        k_mask = offs_k < rank - k * BLOCK_K
        t_tile = tl.load(t_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            t_tile = t_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        if IEEE_FP32:
            acc += tl.dot(t_tile, b_tile, input_precision="ieee")
        else:
            acc += tl.dot(t_tile, b_tile)
        t_ptrs += BLOCK_K * stride_tk
        b_ptrs += BLOCK_K * stride_bk
    # 4. read-modify-write this slice's columns
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + scaling * acc).to(out_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def sgmv_expand_sliced(
    t: torch.Tensor,  # [num_tokens, >= num_parts * max_rank]
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out_total], the base output, updated in place
    slice_offsets,  # host tuple (0, q, q+k, q+k+v)
) -> torch.Tensor:
    """SGMV expand into the column slices of a fused projection, in one launch. Returns out."""
    ### BEGIN SOLUTION
    if batch_info.num_segments == 0 or batch_info.max_len == 0:
        return out
    offs = tuple(int(o) for o in slice_offsets)
    num_parts = len(offs) - 1
    padded = offs + (offs[-1],) * (4 - len(offs))
    block_m, block_n = 32, 64
    block_k = max(16, triton.next_power_of_2(B_stack.shape[2]))
    widest = max(b - a for a, b in zip(offs[:-1], offs[1:]))
    num_n_tiles = triton.cdiv(widest, block_n)
    grid = (triton.cdiv(batch_info.max_len, block_m) * num_n_tiles, batch_info.num_segments, num_parts)
    perm = batch_info.permutation
    _sliced_expand_kernel[grid](
        t, B_stack, out,
        num_n_tiles, *padded,
        t.stride(0), t.stride(1), B_stack.stride(0), B_stack.stride(1), B_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks, batch_info.scalings,
        perm if perm is not None else batch_info.seg_indptr,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_PERMUTATION=perm is not None, UPCAST=interpreting(), IEEE_FP32=t.dtype == torch.float32,
    )
    ### END SOLUTION
    return out


# %% exercise="ch04.2" role="test"
graders.check("ch04.2", sgmv_expand_sliced)

# %% [markdown]
# The reference is chapter 03's expand, which already has the slice axis (it shipped with it because
# the contract's `expand` takes `slice_offsets`), shown once your answer passed its check:

# %%
graders.show_reference("ch04.2")

# %% [markdown]
# ## 5. Chunked SGMV: segments are not requests
#
# Chapter 03's grid is `(row tiles of the longest segment x column tiles, segments)`, with one
# segment per request. Two kinds of batch make that grid a poor fit:
#
# - **Skewed**: 98 of 100 requests use one adapter. There are 100 segments, each a small GEMM that
#   reads the adapter's A (shrink) or B (expand) again. The 98 requests could be one segment.
# - **Long and short**: one 4000-token prefill beside 63 short requests. The grid's row axis is sized
#   by the longest segment, so every short segment gets the long one's number of row tiles, and
#   nearly all of those programs return at once.
#
# SGLang's default LoRA backend, `csgmv` ("chunked SGMV", `python/sglang/srt/lora/backend/
# chunked_backend.py`), fixes both in the metadata, not in the kernel: it sorts the batch's tokens by
# adapter (a stable argsort, so every adapter's tokens form one run, reached through a permutation as
# in chapter 02), then **cuts** every run into chunks of at most `chunk_size` tokens (16 by default).
# Every program then has one chunk's worth of work: the grid is `(column tiles, chunks)` with one row
# tile per chunk. This chapter splits the first step in two: **merge** requests that are already
# adjacent and use the same slot (no permutation needed), and, optionally, group first
# (`build_chunked_batch_info(..., group_by_slot=True)`, SGLang's behaviour; the reference's default is
# `False`, and the measurements below merge adjacent requests only).
#
# Running example (chunk size 4): `seg_lens [3, 2, 6, 1]` with slots `[1, 1, 2, 0]` merge to
# `[5, 6, 1]` / `[1, 2, 0]` and cut to `[4, 1, 4, 2, 1]` / `[1, 1, 2, 2, 0]`.
#
# ### Exercise ch04.3: `merge_adjacent_segments`
#
# Write `merge_adjacent_segments(seg_lens, slots)` on host lists of ints: return `(lens, slots)`, two
# lists, where neighbouring segments with the same slot are merged (lengths added) and zero-length
# segments are dropped first (so `[2, 0, 3]` / `[1, 2, 1]` becomes `[5]` / `[1]`: with the empty
# segment gone, the two slot-1 segments are neighbours). Raise `ValueError` if the two lists differ
# in length (either one longer) or a length is negative.

# %% exercise="ch04.3" role="answer"
def merge_adjacent_segments(seg_lens, slots):
    """Merge neighbouring same-slot segments; drop empty ones. Returns (lens, slots) as lists."""
    ### BEGIN SOLUTION
    if len(seg_lens) != len(slots):
        raise ValueError("seg_lens and slots differ in length")
    if any(n < 0 for n in seg_lens):
        raise ValueError("negative segment length")
    lens, out = [], []
    for n, s in zip(seg_lens, slots):
        if n == 0:
            continue
        if out and out[-1] == s:
            lens[-1] += n
        else:
            lens.append(n)
            out.append(s)
    return lens, out
    ### END SOLUTION


# %% exercise="ch04.3" role="test"
graders.check("ch04.3", merge_adjacent_segments)

# %%
graders.show_reference("ch04.3")

# %% [markdown]
# ### Exercise ch04.4: `cut_into_chunks`
#
# Write `cut_into_chunks(seg_lens, slots, chunk_size)`: return `(lens, slots)` where every segment of
# `n` tokens becomes `n // chunk_size` chunks of `chunk_size` tokens and, if there is a remainder, one
# last shorter chunk, all with the segment's slot, in order. Every segment is cut on its own: a chunk
# never spans two segments, even two neighbours of one slot (merging is ch04.3's job). A zero-length
# segment gives no chunk. Raise `ValueError` if `chunk_size < 1` (0 or negative).

# %% exercise="ch04.4" role="answer"
def cut_into_chunks(seg_lens, slots, chunk_size):
    """Cut every segment into chunks of at most chunk_size tokens. Returns (lens, slots) as lists."""
    ### BEGIN SOLUTION
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    lens, out = [], []
    for n, s in zip(seg_lens, slots):
        full, rest = divmod(n, chunk_size)
        lens += [chunk_size] * full + ([rest] if rest else [])
        out += [s] * (full + (1 if rest else 0))
    return lens, out
    ### END SOLUTION


# %% exercise="ch04.4" role="test"
graders.check("ch04.4", cut_into_chunks)

# %%
graders.show_reference("ch04.4")

# %% [markdown]
# Besides the two functions, the reference, `reference/chunked.py`, has the builder that turns
# requests into a chunked `LoRABatchInfo` (with an option to group tokens by slot first through a
# permutation):

# %%
print(inspect.getsource(chunked.build_chunked_batch_info))

# %% [markdown]
# Chunked segments change the work split, never the result. The reference's Triton ops on a small
# skewed batch (14 requests of 3 tokens, 12 on slot 1), per-request segments against merged and
# chunked ones (chunk 8):

# %%
g = torch.Generator().manual_seed(3)
req_lens, req_slots = [3] * 14, [1] * 6 + [2] + [1] * 6 + [0]
A_small = torch.randn(3, 4, 24, generator=g) * 24**-0.5
B_small = torch.randn(3, 16, 4, generator=g) * 0.5
ranks_small, scal_small = [0, 4, 4], [0.0, 1.0, 0.5]
x_small = torch.randn(sum(req_lens), 24, generator=g)
results = {}
for name, info in [
    ("per request", build_batch_info(req_lens, req_slots, ranks_small, scal_small, device)),
    ("chunked 8", chunked.build_chunked_batch_info(req_lens, req_slots, ranks_small, scal_small, device, chunk_size=8)),
]:
    t = torch.zeros(x_small.shape[0], 4, device=device)
    ref_sgmv_shrink.sgmv_shrink(x_small.to(device), A_small.to(device), info, t)
    out = ref_sgmv_expand.sgmv_expand(t, B_small.to(device), info, torch.zeros(x_small.shape[0], 16, device=device))
    results[name] = out.cpu()
    print(f"{name:12s}: {info.num_segments:2d} segments, seg_lens {info.seg_lens.tolist()}")
print("max difference:", (results["per request"] - results["chunked 8"]).abs().max().item())

# %% [markdown]
# ## 6. What it changes, counted and measured
#
# Count first. For the shrink (one rank tile at rank 16) with row tiles of `BLOCK_M` tokens, a
# segment layout launches `cdiv(max_len, BLOCK_M) * num_segments` programs, of which
# `sum(cdiv(len_i, BLOCK_M))` have rows to work on; each of those reads its adapter's A once. The
# batches of the book's benchmark, with `BLOCK_M = 32` for the unchunked layouts and, for chunks,
# `BLOCK_M` equal to the chunk size (as SGLang does) up to 128 (`min(c, 128)`: a chunk of 256 then
# takes two row tiles):

# %%
def batches():
    skew = [1] * 100
    skew[33], skew[77] = 2, 3  # 98 of 100 requests on slot 1
    return {"skewed_100x32": ([32] * 100, skew), "skewed_100x256": ([256] * 100, skew),
            "uniform_100x32": ([32] * 100, [1 + i % 8 for i in range(100)]),
            "long_and_short": ([4000] + [8] * 63, [1 + i % 8 for i in range(64)])}


def shrink_work(seg_lens, block_m):
    return triton.cdiv(max(seg_lens), block_m) * len(seg_lens), sum(triton.cdiv(n, block_m) for n in seg_lens)


print(f"{'batch':16s} {'layout':12s} {'segments':>8s} {'programs':>8s} {'with work':>9s}")
for bname, (lens, slots) in batches().items():
    merged = chunked.merge_adjacent_segments(lens, slots)
    layouts = {"per_request": (lens, 32), "merged": (merged[0], 32)}
    layouts.update({f"chunk_{c}": (chunked.cut_into_chunks(*merged, c)[0], min(c, 128)) for c in (16, 64)})
    for lname, (seg_lens, bm) in layouts.items():
        programs, busy = shrink_work(seg_lens, bm)
        print(f"{bname:16s} {lname:12s} {len(seg_lens):8d} {programs:8d} {busy:9d}")

# %% [markdown]
# Then measure. `benchmarks/benchmark_chunked_sgmv.py` runs the same batches through the reference's
# shrink and expand (hidden 4096, rank 16, bf16) on a GPU, each layout captured in a CUDA graph and
# timed by replay (`triton.testing.do_bench`, median), and checks that every layout gives the same
# output. The committed results:

# %%
results_dir = Path(reference.__file__).resolve().parents[1] / "benchmarks" / "results"
bench_files = sorted(results_dir.glob("chunked_sgmv_*.json"))
if not bench_files:
    print("No results committed yet; on a GPU: python benchmarks/benchmark_chunked_sgmv.py")
bench = {}
for path in bench_files:
    bench = json.loads(path.read_text())
    print(f"{path.name}: {bench['device']}, torch {bench['torch']}, triton {bench['triton']}, "
          f"hidden {bench['hidden']}, rank {bench['rank']}, {bench['dtype']}; {bench['method']}")
    print(f"{'batch':16s} {'layout':12s} {'segments':>8s} {'programs':>8s} {'shrink us':>9s} {'expand us':>9s} "
          f"{'total us':>8s} {'vs per-request':>14s}")
    for bname, b in bench["batches"].items():
        per_request = next(r["total_us"] for r in b["rows"] if r["layout"] == "per_request")
        for r in b["rows"]:
            print(f"{bname:16s} {r['layout']:12s} {r['segments']:8d} {r['programs']:8d} {r['shrink_us']:9.1f} "
                  f"{r['expand_us']:9.1f} {r['total_us']:8.1f} {per_request / r['total_us']:13.2f}x")

# %%
tuned = json.loads((results_dir / "tuned_configs.json").read_text())
print("the expand's tile at rank 16 when these runs were made (tuned on 4 x 2048 tokens, tuned_configs.json):",
      tuned["sgmv_expand"])
print("its default now (reference/ops/sgmv_expand.py default_tiles):", ref_sgmv_expand.default_tiles(16),
      "up to rank 16,", ref_sgmv_expand.default_tiles(64), "above")

# %% [markdown]
# ![Chunked SGMV on an H200: shrink + expand time per segment layout, for four batches](chunked_sgmv.png)
#
# (Figure made by `figures/src/chunked_sgmv.py` from the committed results.) How to read them:
#
# - **Long and short** is where chunking matters most in the book's kernels: per-request segments
#   launch a grid sized by the 4000-token request for every one of 64 segments, and almost all of
#   those programs exit at once; chunks launch only programs with work. Compare the `programs` column
#   with the time.
# - **Skewed** batches of short requests gain from merging alone (the `merged` row keeps the default
#   blocks): the expand's row tiles (the reference's default `BLOCK_M` when these runs were made,
#   printed above with the results, was tuned for long prefills) are full over the merged run
#   instead of a quarter full per 32-token request, and each adapter's weights are read once per
#   tile instead of once per request. (The default tile is smaller now, also printed: chapter 11
#   measured it on an engine's mixed steps, whose segments are many and short. These runs predate
#   it.) For long requests (256 tokens each) every
#   layout already has full tiles, and the times are close.
# - **Uniform** batches merge nothing (no two neighbours share an adapter), yet chunks of 16 or 32
#   gain as much as on the skewed batch: cutting at the chunk size also sets the tile height to fit
#   the requests. Part of what chunking buys is this automatic fit of `BLOCK_M` to the work; a
#   per-request layout could get it by choosing `BLOCK_M` per batch, at the price of one compiled
#   variant per choice. A chunk larger than the requests is the per-request layout again.
# - The chunk size trades the number of programs (each with fixed start-up cost, and each re-reading
#   its adapter's weights) against the waste of a last, partial chunk and the balance between
#   programs. The best value moved with the batch in these measurements; SGLang's default of 16 is a
#   choice for small decode-heavy batches, not a universal best.
#
# ## 7. How production systems do it
#
# - **SGLang**, `python/sglang/srt/lora/`: `layers.py` has `QKVParallelLinearWithLoRA` and
#   `MergedColumnParallelLinearWithLoRA` (gate_up), which call the backend's `run_qkv_lora` /
#   `run_gate_up_lora`; `triton_ops/qkv_lora_b.py` and `gate_up_lora_b.py` expand into the q/k/v or
#   gate/up column ranges (`output_offset`), packed at `stack_num * r` as in this chapter.
#   `backend/chunked_backend.py` builds the chunked segments and `triton_ops/chunked_sgmv_shrink.py` /
#   `chunked_sgmv_expand.py` run them with one program per chunk.
# - **vLLM**, `vllm/lora/layers/column_parallel_linear.py`: `MergedColumnParallelLinearWithLoRA` and
#   `MergedQKVParallelLinearWithLoRA` keep one A and one B buffer *per slice* (lists of tensors), and
#   its shrink/expand kernels take a pointer per slice (`_get_lora_a_ptr`, `_get_lora_b_ptr` in
#   `ops/triton_ops/utils.py`), a slice axis in the grid, and `output_slices` for the widths. Its
#   segments are per adapter (tokens sorted by adapter), not chunked.
# - **TensorRT-LLM** stores a fused QKV LoRA as one module whose B is split by the q/k/v output sizes,
#   and its checkpoint converter can swap gate and up halves: the order of packed parts is a
#   convention to state and test (chapter 06).
#
# ## Summary
#
# - Projections that share an input (q, k, v; gate, up) share one LoRA slot: A stacked to
#   `num_parts * r` rows at the adapter's rank, B parts one under another, `slice_offsets` for the
#   output columns. GQA makes the slices unequal. A missing part is zeros in its place, never a
#   shift of the others.
# - Packing turns 14 LoRA launches per Llama layer into 8 and reads the shared input once.
# - The sliced expand adds a slice axis to the grid; slice bounds passed as scalars keep the launch
#   capturable in a CUDA graph.
# - Chunked SGMV merges adjacent same-adapter requests and cuts segments into chunks: the grid then
#   matches the work, which is what long-and-short and skewed short-request batches need. The chunk
#   size trades program count and weight re-reads against partial chunks and balance.
#
# ## Review questions
#
# 1. An adapter was trained on q and v only. A loader packs it as A = [A_q; A_v] (2r rows) and sets
#    `stack_num = 2` for this slot alone. What does the shrink compute for this slot's tokens, and
#    what does the sliced expand write into the k columns?
# 2. With the vLLM-style layout (each part at its own `max_rank` block), what changes in the shrink's
#    N clip and in where the expand reads part i of `t`? What does that layout waste at r = 8 in a pool
#    with `max_rank = 64`?
# 3. For the long-and-short batch, how many programs does the per-request shrink launch with
#    `BLOCK_M = 32`, and how many with chunks of 32? Check your answer against the table above.
# 4. A scheduler sorts requests by adapter before building the batch. Which of the four benchmark
#    batches change, and how many segments does merging then leave for the uniform one?
# 5. Why must a CUDA-graph version of the chunked expand size its grid for the largest number of
#    chunks it may ever see, and what does a program past the batch's chunks do?
