"""The base projection GEMM with the LoRA expand in its epilogue: a layer's LoRA adds no expand kernel.

Source: the "LoRA in the base GEMM's epilogue" idea of issue #16 (the decode step's LoRA cost is
7-12 small dependent kernels per layer, not bytes); Punica/S-LoRA add the delta with separate
kernels, vLLM and SGLang likewise (``punica_wrapper``, ``BaseLayerWithLoRA.apply_lora``). The base
GEMM is the classic Triton tiled matmul (the Triton tutorial's grouped ordering).

Call signature::

    lora_gemm(x, W, out=None, t=None, B_stack=None, batch_info=None, part=0, config=None) -> out

Semantics (x [M, K], W [N, K] as ``nn.Linear.weight``, t [M, stack_num * max_rank] the shrink,
B_stack [num_slots, N, max_rank] this part's rows of the pool's B)::

    s = token_slots[m]; r = lora_ranks[s]
    out[m, n] = sum_k x[m, k] W[n, k]                                (fp32 accumulation)
              + scalings[s] * sum_{j<r} t[m, part*r + j] B_stack[s, n, j]     (when r > 0)
    rounded once to out's dtype.

How the epilogue handles a tile of rows from several adapters: it loops over the distinct slots
among the tile's rows (the smallest slot not yet done, each time), adding ``t[rows of s] @ B[s].T``
with one ``tl.dot`` per slot, masked to that slot's rows. A prefill tile (rows sorted into
segments) meets one or two slots; a decode tile of 16 requests over 8 adapters at most 8, and those
passes run one after another on the program's critical path (measured on an H200, the cost grows
with the adapters per tile: chapter 08, section 8). The ``"gather"`` epilogue instead has each row
gather its own slot's B one rank column at a time, with no pass waiting on another. Rows of rank 0
(base model, empty slot) get no term at all, so they are bit-exact with the same kernel launched
without LoRA (same tiles, same K order); ``tests/test_lora_gemm.py`` checks it.

The shrink ``t`` is the separate, cheap half: ``bgmv_shrink`` (decode) or ``sgmv_shrink``
(prefill), shared by the packed parts (one per q/k/v, one per gate/up); see ``reference.layers``.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from reference.batch_info import LoRABatchInfo
from reference.ops._triton_util import (check_same_device, next_pow2_at_least, summed_partials,
                                         tl_float32_dot, upcast)

__all__ = ["lora_gemm", "default_config"]


@triton.jit
def _lora_gemm_kernel(
    # pointers
    x_ptr, w_ptr, out_ptr, t_ptr, b_ptr,
    # sizes
    M, N, K, part,
    # strides
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    stride_tm, stride_tr, stride_bs, stride_bn, stride_br,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    HAS_LORA: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    # offsets in int64: a row index times its stride passes 2^31 elements at real sizes.
    # tl.cast, not .to(): a stride of 1 arrives as a constexpr and stays a constant (contiguous loads).
    stride_xm, stride_xk = tl.cast(stride_xm, tl.int64), tl.cast(stride_xk, tl.int64)
    stride_wn, stride_wk = tl.cast(stride_wn, tl.int64), tl.cast(stride_wk, tl.int64)
    stride_om, stride_on = tl.cast(stride_om, tl.int64), tl.cast(stride_on, tl.int64)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row tiles walk the column tiles together, so a W tile read by one
    # program is still in L2 for the next few (the Triton matmul tutorial's schedule)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            x_tile = x_tile.to(tl.float32)
            w_tile = w_tile.to(tl.float32)
        if IEEE_FP32:
            acc += tl.dot(x_tile, w_tile, input_precision="ieee")
        else:
            acc += tl.dot(x_tile, w_tile)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_LORA:
        stride_tm, stride_tr = tl.cast(stride_tm, tl.int64), tl.cast(stride_tr, tl.int64)
        stride_bs, stride_bn = tl.cast(stride_bs, tl.int64), tl.cast(stride_bn, tl.int64)
        stride_br = tl.cast(stride_br, tl.int64)
        slots = tl.load(token_slots_ptr + offs_m, mask=m_mask, other=0)
        ranks = tl.load(lora_ranks_ptr + slots, mask=m_mask, other=0)
        live = m_mask & (ranks > 0)  # rows that get a LoRA term at all
    if HAS_LORA and GATHER:
        scalings = tl.load(scalings_ptr + slots, mask=m_mask, other=0.0)
        # every row gathers its own slot's B, one rank column at a time: no pass depends on another,
        # so the loads of all columns can be in flight together (the dot variant's passes are serial)
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(0, tl.max(tl.where(live, ranks, 0), axis=0)):
            use = live & (j < ranks)
            t_col = tl.load(t_ptr + offs_m * stride_tm + (part * ranks + j) * stride_tr, mask=use, other=0.0)
            t_col = t_col.to(x_ptr.dtype.element_ty).to(tl.float32)  # t in x's dtype, as a two-kernel path
            b_col = tl.load(b_ptr + slots[:, None] * stride_bs + offs_n[None, :] * stride_bn + j * stride_br,
                            mask=use[:, None] & n_mask[None, :], other=0.0)
            delta += t_col[:, None] * b_col.to(tl.float32)
        acc += tl.where(live[:, None], scalings[:, None] * delta, 0.0)
    if HAS_LORA and not GATHER:
        todo = live
        offs_r = tl.arange(0, BLOCK_R)
        big = 2147483647
        # one pass per distinct slot among this tile's rows: the smallest slot not yet done
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            cur = tl.min(tl.where(todo, slots, big), axis=0)
            rows = todo & (slots == cur)
            rank = tl.load(lora_ranks_ptr + cur)
            scaling = tl.load(scalings_ptr + cur)
            r_mask = offs_r < rank
            t_tile = tl.load(t_ptr + offs_m[:, None] * stride_tm + (part * rank + offs_r)[None, :] * stride_tr,
                             mask=rows[:, None] & r_mask[None, :], other=0.0)
            t_tile = t_tile.to(x_ptr.dtype.element_ty)  # t in x's dtype, as a two-kernel path stores it
            b_tile = tl.load(b_ptr + cur * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                             mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            if UPCAST:
                t_tile = t_tile.to(tl.float32)
                b_tile = b_tile.to(tl.float32)
            if IEEE_FP32:
                delta = tl.dot(t_tile, b_tile, input_precision="ieee")
            else:
                delta = tl.dot(t_tile, b_tile)
            acc += tl.where(rows[:, None], scaling * delta, 0.0)
            todo = todo & (slots != cur)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_config(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The tile config :func:`lora_gemm` uses when none is given: block_m, block_n, block_k,
    group_m, num_warps, num_stages, epilogue.

    A decode step (a few to a few hundred rows) streams W once: the rows fit one or two row tiles,
    and narrow column tiles give enough programs to fill the GPU (N = 1024 at 32 columns: 32
    programs; 4096: 128). Prefill is compute-bound: 128 x 128 tiles. The CPU interpreter takes one
    program per tile per K step (about a millisecond each), so there tiles are as large as the
    shape allows. Depends only on the shape, never on whether LoRA is present, so base rows are
    bit-exact with the base-only launch.

    ``epilogue``: "dot" (one ``tl.dot`` pass per distinct slot of a row tile) is the variant measured
    in ``benchmarks/results/lora_gemm_h200.json``; "gather" (each row gathers its own slot's B, one
    rank column at a time, no pass waiting on another) is selectable and benchmarked beside it by
    ``benchmarks/benchmark_lora_gemm.py``; it becomes a default only where it measures faster.
    """
    from reference.device import interpreting

    if interpreting():
        cfg = dict(block_m=max(16, min(64, triton.next_power_of_2(M))),
                   block_n=max(16, min(128, triton.next_power_of_2(N))),
                   block_k=max(16, min(128, triton.next_power_of_2(K))), group_m=8, num_warps=4, num_stages=1)
    elif M <= 16:
        cfg = dict(block_m=16, block_n=32, block_k=256 if dtype != torch.float32 else 128, group_m=1,
                   num_warps=4, num_stages=4)
    elif M <= 64:
        cfg = dict(block_m=64, block_n=32, block_k=128, group_m=1, num_warps=4, num_stages=4)
    elif M <= 256:
        cfg = dict(block_m=64, block_n=64, block_k=128 if dtype != torch.float32 else 64, group_m=8,
                   num_warps=4, num_stages=4)
    else:  # fp32 tiles take twice the shared memory
        cfg = dict(block_m=128, block_n=128, block_k=64 if dtype != torch.float32 else 32, group_m=8,
                   num_warps=8, num_stages=3)
    return {**cfg, "epilogue": "dot"}


def lora_gemm(
    x: torch.Tensor,  # [M, K]
    W: torch.Tensor,  # [N, K]
    out: Optional[torch.Tensor] = None,  # [M, N]
    t: Optional[torch.Tensor] = None,  # [M, stack_num * max_rank], the shrink; or [S, M, ...] fp32 partials
    B_stack: Optional[torch.Tensor] = None,  # [num_slots, N, max_rank]
    batch_info: Optional[LoRABatchInfo] = None,
    part: int = 0,
    config: Optional[dict] = None,
) -> torch.Tensor:
    """``x @ W.T`` plus, when ``t``/``B_stack``/``batch_info`` are given, each row's LoRA expand in
    the same kernel (module docstring). Returns ``out`` (allocated when None, in x's dtype).

    ``part``: this projection's part of a packed module (q=0, k=1, v=2; gate=0, up=1): the
    epilogue reads shrink columns ``[part*r, (part+1)*r)`` of each row's rank r. ``config``
    overrides :func:`default_config` (keys block_m, block_n, block_k, group_m, num_warps,
    num_stages, epilogue "dot" or "gather"; missing keys keep their defaults). ``t`` may be the
    split-K shrink's fp32 partials [S, M, width] (``bgmv_shrink`` with a 3-D out): they are summed
    first by one torch reduction (``_triton_util.summed_partials``, which says why not in the
    epilogue), and the epilogue rounds the sum to x's dtype.

    Raises:
        ValueError: mismatched shapes, dtypes or devices; only some of t/B_stack/batch_info given;
        a batch info without ``token_slots`` for every row; a negative part; another epilogue.
    """
    lora = (t, B_stack, batch_info)
    if any(v is None for v in lora) and any(v is not None for v in lora):
        raise ValueError("give t, B_stack and batch_info together (or none of them for the base GEMM)")
    has_lora = batch_info is not None
    if x.dim() != 2 or W.dim() != 2 or x.shape[1] != W.shape[1]:
        raise ValueError(f"x {list(x.shape)} and W {list(W.shape)}: expected x [M, K] and W [N, K]")
    M, K = x.shape
    N = W.shape[0]
    if x.dtype != W.dtype:
        raise ValueError(f"x is {x.dtype} but W is {W.dtype}")
    if out is None:
        out = x.new_empty(M, N)
    elif out.shape != (M, N):
        raise ValueError(f"out is {list(out.shape)}, expected [{M}, {N}]")
    check_same_device(x, W, out, t, B_stack)
    if has_lora:
        if batch_info.token_slots is None or batch_info.token_slots.shape[0] != M:
            raise ValueError("lora_gemm needs batch_info.token_slots with one slot per row of x")
        t_rows = summed_partials(t)
        if B_stack.dim() != 3 or B_stack.shape[1] != N or t_rows.shape[0] != M:
            raise ValueError(f"t {list(t.shape)} and B_stack {list(B_stack.shape)}: expected t [{M}, stack*max_rank] "
                             f"(or fp32 split-K partials [S, {M}, stack*max_rank]) and B_stack [num_slots, {N}, max_rank]")
        if part < 0 or (part + 1) * B_stack.shape[2] > t_rows.shape[1]:
            raise ValueError(f"part {part} of a shrink with {t_rows.shape[1]} columns and max rank {B_stack.shape[2]}")
    if M == 0 or N == 0:
        return out
    cfg = {**default_config(M, N, K, x.dtype), **(config or {})}
    if cfg["epilogue"] not in ("dot", "gather"):
        raise ValueError(f"epilogue must be 'dot' or 'gather', got {cfg['epilogue']!r}")
    grid = (triton.cdiv(M, cfg["block_m"]) * triton.cdiv(N, cfg["block_n"]),)
    dummy = x  # never read: HAS_LORA=False prunes every LoRA load
    _lora_gemm_kernel[grid](
        x, W, out, t_rows if has_lora else dummy, B_stack if has_lora else dummy,
        M, N, K, part,
        x.stride(0), x.stride(1), W.stride(0), W.stride(1), out.stride(0), out.stride(1),
        t_rows.stride(0) if has_lora else 0, t_rows.stride(1) if has_lora else 0,
        B_stack.stride(0) if has_lora else 0, B_stack.stride(1) if has_lora else 0,
        B_stack.stride(2) if has_lora else 0,
        batch_info.token_slots if has_lora else dummy, batch_info.lora_ranks if has_lora else dummy,
        batch_info.scalings if has_lora else dummy,
        HAS_LORA=has_lora, GATHER=cfg["epilogue"] == "gather", BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        BLOCK_R=next_pow2_at_least(B_stack.shape[2] if has_lora else 16, floor=16), GROUP_M=cfg["group_m"],
        UPCAST=upcast(x), IEEE_FP32=tl_float32_dot(x, W), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
