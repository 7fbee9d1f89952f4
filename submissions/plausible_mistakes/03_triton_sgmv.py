# %% ch03.1
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def _shrink(x, a, o, K, R, seg_indptr, weight_indices, lora_ranks,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, UP: tl.constexpr):
    seg = tl.program_id(1)
    start = tl.load(seg_indptr + seg)
    end = tl.load(seg_indptr + seg + 1)
    slot = tl.load(weight_indices + seg)
    rank = tl.load(lora_ranks + slot)
    # mistake: rows are taken as seg_indptr[seg] + i, the batch's permutation is never applied
    rows = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        xt = tl.load(x + rows[:, None] * K + kk[None, :], mask=(rows < end)[:, None] & (kk < K)[None, :], other=0.0)
        at = tl.load(a + slot * R * K + rs[None, :] * K + kk[:, None], mask=(rs < rank)[None, :] & (kk < K)[:, None], other=0.0)
        if UP:
            xt, at = xt.to(tl.float32), at.to(tl.float32)
        acc += tl.dot(xt, at)
    tl.store(o + rows[:, None] * R + rs[None, :], acc.to(o.dtype.element_ty), mask=(rows < end)[:, None] & (rs < rank)[None, :])


def sgmv_shrink(x, A_stack, batch_info, out):
    if x.shape[0] == 0:
        return out
    R = A_stack.shape[1]
    grid = (triton.cdiv(batch_info.max_len, 32) or 1, batch_info.num_segments)
    _shrink[grid](x, A_stack, out, x.shape[1], R, batch_info.seg_indptr, batch_info.weight_indices,
                  batch_info.lora_ranks, BLOCK_M=32, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK_K=32,
                  UP=interpreting() or x.dtype == torch.float32)
    return out

# %% ch03.2
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def _expand(t, b, o, N, R, seg_indptr, weight_indices, lora_ranks, scalings, permutation,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, HAS_PERM: tl.constexpr, UP: tl.constexpr):
    seg = tl.program_id(1)
    start = tl.load(seg_indptr + seg)
    end = tl.load(seg_indptr + seg + 1)
    slot = tl.load(weight_indices + seg)
    rank = tl.load(lora_ranks + slot)
    if rank == 0:
        return
    i = start + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(permutation + i, mask=i < end, other=0) if HAS_PERM else i
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    tt = tl.load(t + rows[:, None] * R + rs[None, :], mask=(i < end)[:, None] & (rs < rank)[None, :], other=0.0)
    bt = tl.load(b + slot * N * R + cols[None, :] * R + rs[:, None], mask=(rs < rank)[:, None] & (cols < N)[None, :], other=0.0)
    if UP:
        tt, bt = tt.to(tl.float32), bt.to(tl.float32)
    y = tl.load(scalings + slot) * tl.dot(tt, bt)
    # mistake: stores the LoRA delta over the base output instead of adding to it
    tl.store(o + rows[:, None] * N + cols[None, :], y.to(o.dtype.element_ty), mask=(i < end)[:, None] & (cols < N)[None, :])


def sgmv_expand(t, B_stack, batch_info, out):
    if t.shape[0] == 0:
        return out
    N, R = out.shape[1], B_stack.shape[2]
    perm = batch_info.permutation
    grid = (triton.cdiv(batch_info.max_len, 32) or 1, batch_info.num_segments, triton.cdiv(N, 64))
    _expand[grid](t, B_stack, out, N, R, batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks,
                  batch_info.scalings, perm if perm is not None else batch_info.seg_indptr,
                  BLOCK_M=32, BLOCK_N=64, BLOCK_R=max(16, triton.next_power_of_2(R)), HAS_PERM=perm is not None,
                  UP=interpreting() or t.dtype == torch.float32)
    return out

# %% ch03.3
import torch
import triton
import triton.language as tl


@triton.jit
def _fused(x, a, b, o, K, N, R, token_slots, lora_ranks, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(token_slots + tok)
    rank = tl.load(lora_ranks + slot)
    rs = tl.arange(0, BLOCK_R)
    t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        kk = k + tl.arange(0, BLOCK)
        xv = tl.load(x + tok * K + kk, mask=kk < K, other=0.0).to(tl.float32)
        av = tl.load(a + slot * R * K + rs[:, None] * K + kk[None, :], mask=(rs < rank)[:, None] & (kk < K)[None, :], other=0.0)
        t += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)
    t = t.to(x.dtype.element_ty).to(tl.float32)
    for n in range(0, N, BLOCK):
        nn = n + tl.arange(0, BLOCK)
        bv = tl.load(b + slot * N * R + nn[:, None] * R + rs[None, :], mask=(nn < N)[:, None] & (rs < rank)[None, :], other=0.0)
        # mistake: the slot's scaling is never applied (right only when lora_alpha == r)
        y = tl.sum(bv.to(tl.float32) * t[None, :], axis=1)
        old = tl.load(o + tok * N + nn, mask=nn < N, other=0.0).to(tl.float32)
        tl.store(o + tok * N + nn, (old + y).to(o.dtype.element_ty), mask=nn < N)


def fused_decode(x, A_stack, B_stack, batch_info, out):
    if x.shape[0] == 0:
        return out
    R = A_stack.shape[1]
    _fused[(x.shape[0],)](x, A_stack, B_stack, out, x.shape[1], out.shape[1], R, batch_info.token_slots,
                          batch_info.lora_ranks, BLOCK_R=max(16, triton.next_power_of_2(R)), BLOCK=64)
    return out
