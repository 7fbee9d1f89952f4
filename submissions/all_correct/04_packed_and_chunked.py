# %% ch04.1
import torch


def stack_lora_parts(A_parts, B_parts, out_features):
    """Pack per-part LoRA weights into one fused-projection slot (zeros for missing parts)."""
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


# %% ch04.2
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


def sgmv_expand_sliced(
    t: torch.Tensor,  # [num_tokens, >= num_parts * max_rank]
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out_total], the base output, updated in place
    slice_offsets,  # host tuple (0, q, q+k, q+k+v)
) -> torch.Tensor:
    """SGMV expand into the column slices of a fused projection, in one launch. Returns out."""
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
    return out


# %% ch04.3
def merge_adjacent_segments(seg_lens, slots):
    """Merge neighbouring same-slot segments; drop empty ones. Returns (lens, slots) as lists."""
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


# %% ch04.4
def cut_into_chunks(seg_lens, slots, chunk_size):
    """Cut every segment into chunks of at most chunk_size tokens. Returns (lens, slots) as lists."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    lens, out = [], []
    for n, s in zip(seg_lens, slots):
        full, rest = divmod(n, chunk_size)
        lens += [chunk_size] * full + ([rest] if rest else [])
        out += [s] * (full + (1 if rest else 0))
    return lens, out
