"""Paged attention in Triton: one kernel for decode, prefill, chunked prefill and mixed steps, reading
each sequence's own blocks up to its length, with a split over the KV length (flash-decoding) for
decode batches too small to fill the GPU.

Why a kernel. The torch path (:func:`reference.engine.model_runner.paged_attention`) gathers every
sequence's whole block table into a dense [num_seqs, max_blocks * block_size] tensor, zeroes what is
past each length and runs SDPA with a mask: under a CUDA graph, ``max_blocks`` is the widest table
the cache allows, so a 100-token sequence moves as many bytes as a 2048-token one, twice (gather,
then attention). This kernel walks the block table instead (PagedAttention, Kwon et al., SOSP 2023):
a program loads ``block_tables[s, p // block_size]`` for the positions of one key tile, reads those
keys and values straight from the cache, and stops at the sequence's length, so the bytes it reads
are the bytes the step needs.

The grid (vLLM's unified Triton attention): a program owns ``BLOCK_Q`` consecutive query tokens of
one sequence and one KV head, and all ``G = heads // kv_heads`` query heads that share that KV head
(GQA: the keys are loaded once for the group), so its tile is ``BLOCK_M = BLOCK_Q * G_PAD`` rows of
(token, head). A decode sequence has one query token: ``BLOCK_Q`` rows beyond it are masked. The
flat query stream is cut into sequences by ``query_start_loc`` (cu_seqlens), and a program finds its
sequence by binary search, so the grid size is a function of host ints alone (num_tokens, num_seqs):
the same launch serves any mix of prefill chunks and decode tokens, and a CUDA graph can capture it.

Query token i of sequence s (0-based within its ``query_len``) sits at position
``context_lens[s] - query_len + i``: its keys are already in the cache (the caller writes them first)
and it sees keys at positions <= its own (causal). Keys past ``context_lens[s]`` are never loaded, so
stale or NaN values in the tail of a last block, or in table padding, cannot reach the output.

Split-KV (flash-decoding: Dao et al., "Flash-Decoding for long-context inference", 2023; SGLang
``decode_attention.py``'s stage 1 / stage 2; vLLM ``kernel_unified_attention_3d`` and
``reduce_segments``): with ``num_splits`` S > 1 each program covers 1/S of its key tiles and writes an
unnormalised fp32 partial with its running max and sum; a second kernel rescales and adds the S
partials. It multiplies the programs of a small decode batch by S at the cost of one extra read and
write of [num_tokens, heads, S, head_dim] fp32.

Sources: vLLM ``vllm/attention/ops/triton_unified_attention.py`` (the grid, ``find_seq_idx``, the
segments); SGLang ``python/sglang/srt/layers/attention/triton_ops/decode_attention.py`` and
``extend_attention.py``; FlashAttention-2's online softmax (Dao, 2023).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from reference.ops._triton_util import check_same_device, tl_float32_dot, upcast

__all__ = ["triton_paged_attention", "choose_num_splits", "attention_blocks"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq_idx(query_start_loc_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence s whose q blocks hold global q block ``target``: the largest s with
    query_start_loc[s] // BLOCK_Q + s <= target (sequence s's blocks start there: every sequence
    rounds its own tokens up to whole blocks, hence the + s)."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= target:
            left = mid + 1
        else:
            right = mid
    return left - 1


@triton.jit
def _paged_attention_kernel(
    # pointers
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    # sizes
    num_seqs, num_heads, head_dim, scale_log2,
    # strides
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    stride_pt, stride_ph, stride_ps,
    # constexpr
    CACHE_BLOCK: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # int64 strides: a cache of 2^31 elements or more must not wrap its offsets (Triton passes ints as i32)
    stride_qt, stride_qh = tl.cast(stride_qt, tl.int64), tl.cast(stride_qh, tl.int64)
    stride_ot, stride_oh = tl.cast(stride_ot, tl.int64), tl.cast(stride_oh, tl.int64)
    stride_kb, stride_ks = tl.cast(stride_kb, tl.int64), tl.cast(stride_ks, tl.int64)
    stride_kh, stride_vb = tl.cast(stride_kh, tl.int64), tl.cast(stride_vb, tl.int64)
    stride_vs, stride_vh = tl.cast(stride_vs, tl.int64), tl.cast(stride_vh, tl.int64)
    stride_bt, stride_pt = tl.cast(stride_bt, tl.int64), tl.cast(stride_pt, tl.int64)
    stride_ph, stride_ps = tl.cast(stride_ph, tl.int64), tl.cast(stride_ps, tl.int64)
    # -- map the program to (sequence, q block, kv head, split)
    pid_q, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq = _find_seq_idx(query_start_loc_ptr, pid_q, num_seqs, BLOCK_Q)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    q_block = pid_q - (q_begin // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is sized for the worst rounding: this block holds no token
    ctx_len = tl.load(context_lens_ptr + seq)
    first_pos = ctx_len - q_len  # position of the sequence's first query token

    # -- rows of the tile: (query token, head of the group)
    offs_m = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + offs_m // G_PAD
    head = kv_head * GROUPS + offs_m % G_PAD
    row_ok = (q_local < q_len) & (offs_m % G_PAD < GROUPS)
    q_pos = first_pos + q_local
    token = (q_begin + q_local).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # -- the key tiles this program reads: up to the last query's position, this split's share
    last_q = tl.minimum((q_block + 1) * BLOCK_Q, q_len) - 1
    kv_end = first_pos + last_q + 1
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        # -- walk the block table: position p lives at block bt[p // CACHE_BLOCK], slot p % CACHE_BLOCK
        pos = tile * BLOCK_N + offs_n
        pos_ok = pos < kv_end
        block = tl.load(bt_row + pos // CACHE_BLOCK, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % CACHE_BLOCK
        kv_ok = pos_ok[:, None] & d_ok[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh
                    + offs_d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
                    + offs_d[None, :], mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_FP32:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        # -- online softmax in base 2; a row that sees no key of this tile keeps m = -inf
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out_ok = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_ok)
    else:  # an empty split writes m = -inf, l = 0, acc = 0: the reduction gives it weight 0
        part = token[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
        tl.store(part_out_ptr + part * BLOCK_D + offs_d[None, :], acc, mask=out_ok)
        stat = token * stride_pt + head * stride_ph + split * stride_ps
        tl.store(part_max_ptr + stat, m_i, mask=row_ok)
        tl.store(part_sum_ptr + stat, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    head_dim, stride_ot, stride_oh, stride_pt, stride_ph, stride_ps,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, BLOCK_D: tl.constexpr,
):
    stride_ot, stride_oh = tl.cast(stride_ot, tl.int64), tl.cast(stride_oh, tl.int64)
    stride_pt, stride_ph = tl.cast(stride_pt, tl.int64), tl.cast(stride_ph, tl.int64)
    stride_ps = tl.cast(stride_ps, tl.int64)
    # -- one program per (token, head): rescale every split's partial to the common max and add
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < NUM_SPLITS
    stat = token * stride_pt + head * stride_ph + offs_s * stride_ps
    m = tl.load(part_max_ptr + stat, mask=s_ok, other=float("-inf"))
    l = tl.load(part_sum_ptr + stat, mask=s_ok, other=0.0)
    m_all = tl.max(m, axis=0)  # finite: every query sees at least key 0, in split 0
    w = tl.where(s_ok, tl.exp2(m - m_all), 0.0)
    acc = tl.load(part_out_ptr + stat[:, None] * BLOCK_D + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


def attention_blocks(num_heads: int, num_kv_heads: int, max_query_len: int) -> tuple[int, int, int]:
    """(G_PAD, BLOCK_Q, BLOCK_M) for a step: G_PAD = next_pow2(heads // kv_heads); a decode step
    (max_query_len 1) takes the smallest tile a GPU ``tl.dot`` allows (16 rows), a step with
    longer queries 64 rows, so a prompt's keys are loaded once per 64 // G_PAD query tokens."""
    g_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = max(16 if max_query_len == 1 else 64, g_pad)
    return g_pad, block_m // g_pad, block_m


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = 132,
                      block_n: int = 64) -> int:
    """Splits over the KV length for a decode step: programs up to about two per SM, never
    more splits than a sequence of ``max_context`` positions has key tiles, at most 16, a power of
    two (so a CUDA graph of one bucket has one split count). 1 when the batch fills the GPU alone.

    Running example (H200, 132 SMs): 8 sequences x 8 kv heads = 64 programs, 2048 positions ->
    4 splits (256 programs); 64 sequences -> 1 split (512 programs already).
    """
    programs = max(1, num_seqs * num_kv_heads)
    want = 1 << max(0, (2 * num_sms // programs).bit_length() - 1)  # the largest power of two <= 2 * SMs / programs
    tiles = max(1, -(-max_context // block_n))
    return int(max(1, min(want, 16, triton.next_power_of_2(tiles) if tiles > 1 else 1)))


def triton_paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, head_dim], RoPE applied
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim], the new keys already written
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32 / int64
    context_lens: torch.Tensor,  # [num_seqs] int32 / int64: positions of each sequence after the write
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 / int64: cu_seqlens of the query stream
    out: torch.Tensor,  # [num_tokens, heads, head_dim], q's dtype, written
    max_query_len: int,
    num_splits: int = 1,
    sm_scale: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of every query token over its sequence's paged keys and values; returns ``out``.

    Semantics (s = the sequence of token t, i = t - query_start_loc[s], n = query_start_loc[s+1] -
    query_start_loc[s], pos_t = context_lens[s] - n + i, K_s[p] = k_cache[block_tables[s, p // bs], p % bs]):
        out[t, h] = softmax_p(q[t, h] . K_s[p][h // g] * sm_scale for p <= pos_t) @ V_s[p][h // g]
    g = heads // kv_heads (transformers' ``repeat_kv`` order), sm_scale default 1/sqrt(head_dim),
    fp32 accumulation, output in out's dtype. Only positions < context_lens[s] of table entries
    < ceil(context_lens[s] / bs) are read. ``num_splits`` > 1 splits each program's key tiles
    (flash-decoding) and merges the fp32 partials in a second kernel: same result up to rounding.
    Launch sizes come from host ints only (num_tokens, num_seqs, max_query_len, num_splits): no
    device read, CUDA-graph capturable.

    Raises:
        ValueError: shapes that disagree, heads not a multiple of kv_heads, num_tokens < num_seqs,
        num_splits < 1, tensors on several devices, out not q's dtype.
    """
    T, H, D = q.shape
    _, cache_block, KVH, Dk = k_cache.shape
    S = block_tables.shape[0]
    if k_cache.shape != v_cache.shape or Dk != D or H % KVH:
        raise ValueError(f"q {list(q.shape)}, k_cache {list(k_cache.shape)}, v_cache {list(v_cache.shape)}: "
                         "need equal caches, the same head_dim and heads a multiple of kv_heads")
    if out.shape != q.shape or out.dtype != q.dtype or k_cache.dtype != q.dtype:
        raise ValueError(f"out {list(out.shape)} {out.dtype} and the cache ({k_cache.dtype}) must match q "
                         f"{list(q.shape)} {q.dtype}")
    if context_lens.shape != (S,) or query_start_loc.shape != (S + 1,) or T < S:
        raise ValueError(f"{S} block-table rows need context_lens [{S}] and query_start_loc [{S + 1}] and at "
                         f"least {S} query tokens; got {list(context_lens.shape)}, {list(query_start_loc.shape)}, {T}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or out.stride(2) != 1:
        raise ValueError("q, out and the caches need a contiguous head_dim")
    check_same_device(q, k_cache, v_cache, block_tables, context_lens, query_start_loc, out)
    if T == 0:
        return out
    g_pad, block_q, block_m = attention_blocks(H, KVH, max_query_len)
    block_d = triton.next_power_of_2(D)
    block_n = 64 if block_d <= 128 else 32
    scale = (1.0 / math.sqrt(D)) if sm_scale is None else sm_scale
    parts = None
    if num_splits > 1:
        parts = (torch.empty(T, H, num_splits, block_d, dtype=torch.float32, device=q.device),
                 torch.empty(T, H, num_splits, dtype=torch.float32, device=q.device),
                 torch.empty(T, H, num_splits, dtype=torch.float32, device=q.device))
    p_out, p_max, p_sum = parts if parts is not None else (out, out, out)  # unused when NUM_SPLITS == 1
    p_strides = (H * num_splits, num_splits, 1)
    grid = (T // block_q + S, KVH, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, p_out, p_max, p_sum,
        block_tables, context_lens, query_start_loc,
        S, H, D, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        *p_strides,
        CACHE_BLOCK=cache_block, GROUPS=H // KVH, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        UPCAST=upcast(q), IEEE_FP32=tl_float32_dot(q, k_cache),
        num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _merge_splits_kernel[(T, H)](
            out, p_out, p_max, p_sum, D, out.stride(0), out.stride(1), *p_strides,
            NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK_D=block_d,
            num_warps=4,
        )
    return out
