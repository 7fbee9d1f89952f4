# %% ch03.1
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def shrink_kernel(x_ptr, a_ptr, out_ptr, K, sxm, sxk, sas, san, sak, som, son,
                  indptr_ptr, widx_ptr, ranks_ptr, perm_ptr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PERM: tl.constexpr, F32: tl.constexpr):
    seg = tl.program_id(1)
    m0 = tl.program_id(0) * BM
    slot = tl.load(widx_ptr + seg)
    r = tl.load(ranks_ptr + slot)
    lo = tl.load(indptr_ptr + seg)
    n = tl.load(indptr_ptr + seg + 1) - lo
    if r == 0 or m0 >= n:
        return
    m = m0 + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    ks = tl.arange(0, BK)
    if PERM:
        rows = tl.load(perm_ptr + lo + m, mask=m < n, other=0)
    else:
        rows = lo + m
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        xt = tl.load(x_ptr + rows[:, None] * sxm + (k0 + ks)[None, :] * sxk,
                     mask=(m < n)[:, None] & (k0 + ks < K)[None, :], other=0.0)
        at = tl.load(a_ptr + slot * sas + cols[None, :] * san + (k0 + ks)[:, None] * sak,
                     mask=(cols < r)[None, :] & (k0 + ks < K)[:, None], other=0.0)
        if F32:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        acc += tl.dot(xt, at)
    tl.store(out_ptr + rows[:, None] * som + cols[None, :] * son, acc.to(out_ptr.dtype.element_ty),
             mask=(m < n)[:, None] & (cols < r)[None, :])


def sgmv_shrink(x, A_stack, batch_info, out):
    if x.shape[0] == 0 or batch_info.num_segments == 0:
        return out
    BN = max(16, triton.next_power_of_2(A_stack.shape[1]))
    grid = (triton.cdiv(max(batch_info.max_len, 1), 16), batch_info.num_segments)
    perm = batch_info.permutation
    shrink_kernel[grid](x, A_stack, out, x.shape[1], x.stride(0), x.stride(1), A_stack.stride(0),
                        A_stack.stride(1), A_stack.stride(2), out.stride(0), out.stride(1),
                        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks,
                        perm if perm is not None else batch_info.seg_indptr,
                        BM=16, BN=BN, BK=64, PERM=perm is not None,
                        F32=interpreting() or x.dtype == torch.float32)
    return out

# %% ch03.2
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def expand_kernel(t_ptr, b_ptr, out_ptr, N, stm, stk, sbs, sbn, sbk, som, son,
                  indptr_ptr, widx_ptr, ranks_ptr, scal_ptr, perm_ptr,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PERM: tl.constexpr, F32: tl.constexpr):
    seg = tl.program_id(1)
    m0 = tl.program_id(0) * BM
    n0 = tl.program_id(2) * BN
    slot = tl.load(widx_ptr + seg)
    r = tl.load(ranks_ptr + slot)
    lo = tl.load(indptr_ptr + seg)
    cnt = tl.load(indptr_ptr + seg + 1) - lo
    if r == 0 or m0 >= cnt:
        return
    s = tl.load(scal_ptr + slot)
    m = m0 + tl.arange(0, BM)
    cols = n0 + tl.arange(0, BN)
    ks = tl.arange(0, BK)  # K is the rank: one masked block of at least 16
    if PERM:
        rows = tl.load(perm_ptr + lo + m, mask=m < cnt, other=0)
    else:
        rows = lo + m
    tt = tl.load(t_ptr + rows[:, None] * stm + ks[None, :] * stk, mask=(m < cnt)[:, None] & (ks < r)[None, :], other=0.0)
    bt = tl.load(b_ptr + slot * sbs + cols[None, :] * sbn + ks[:, None] * sbk,
                 mask=(ks < r)[:, None] & (cols < N)[None, :], other=0.0)
    if F32:
        tt = tt.to(tl.float32)
        bt = bt.to(tl.float32)
    delta = tl.dot(tt, bt)
    ptrs = out_ptr + rows[:, None] * som + cols[None, :] * son
    mask = (m < cnt)[:, None] & (cols < N)[None, :]
    old = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (old + s * delta).to(out_ptr.dtype.element_ty), mask=mask)


def sgmv_expand(t, B_stack, batch_info, out):
    if t.shape[0] == 0 or batch_info.num_segments == 0:
        return out
    BK = max(16, triton.next_power_of_2(B_stack.shape[2]))
    grid = (triton.cdiv(max(batch_info.max_len, 1), 16), batch_info.num_segments, triton.cdiv(out.shape[1], 64))
    perm = batch_info.permutation
    expand_kernel[grid](t, B_stack, out, out.shape[1], t.stride(0), t.stride(1), B_stack.stride(0),
                        B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
                        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks,
                        batch_info.scalings, perm if perm is not None else batch_info.seg_indptr,
                        BM=16, BN=64, BK=BK, PERM=perm is not None,
                        F32=interpreting() or t.dtype == torch.float32)
    return out

# %% ch03.3
import torch
import triton
import triton.language as tl


@triton.jit
def fused_kernel(x_ptr, a_ptr, b_ptr, out_ptr, K, N, sxm, sas, sar, sbs, sbn, som,
                 slots_ptr, ranks_ptr, scal_ptr, BR: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok)
    r = tl.load(ranks_ptr + slot)
    if r == 0:
        return
    rr = tl.arange(0, BR)
    ks = tl.arange(0, BK)
    t = tl.zeros((BR,), dtype=tl.float32)
    for k0 in range(0, K, BK):  # shrink: a GEMV, kept in registers
        xk = tl.load(x_ptr + tok * sxm + k0 + ks, mask=k0 + ks < K, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * sas + rr[:, None] * sar + (k0 + ks)[None, :],
                    mask=(rr < r)[:, None] & (k0 + ks < K)[None, :], other=0.0).to(tl.float32)
        t += tl.sum(a * xk[None, :], axis=1)
    t = t.to(x_ptr.dtype.element_ty).to(tl.float32)  # as if t had been written in x.dtype
    s = tl.load(scal_ptr + slot)
    for n0 in range(0, N, BN):  # expand, in place
        ns = n0 + tl.arange(0, BN)
        b = tl.load(b_ptr + slot * sbs + ns[:, None] * sbn + rr[None, :],
                    mask=(ns < N)[:, None] & (rr < r)[None, :], other=0.0).to(tl.float32)
        y = tl.sum(b * t[None, :], axis=1)
        old = tl.load(out_ptr + tok * som + ns, mask=ns < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + tok * som + ns, (old + s * y).to(out_ptr.dtype.element_ty), mask=ns < N)


def fused_decode(x, A_stack, B_stack, batch_info, out):
    if x.shape[0] == 0:
        return out
    x, out_c = x.contiguous(), out  # the kernel assumes unit stride along the hidden dimension
    fused_kernel[(x.shape[0],)](x, A_stack, B_stack, out_c, x.shape[1], out.shape[1], x.stride(0),
                                A_stack.stride(0), A_stack.stride(1), B_stack.stride(0), B_stack.stride(1),
                                out.stride(0), batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
                                BR=max(16, triton.next_power_of_2(A_stack.shape[1])), BK=128, BN=64)
    return out
