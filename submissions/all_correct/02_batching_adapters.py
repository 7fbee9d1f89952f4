# %% ch02.1
def seg_indptr_from_seg_lens(seg_lens):
    indptr = torch.zeros(len(seg_lens) + 1, dtype=torch.int32, device=seg_lens.device)
    indptr[1:] = torch.cumsum(seg_lens, 0)  # cumsum gives int64; the slice assignment casts back
    return indptr

# %% ch02.2
def token_slots_from_segments(seg_indptr, weight_indices):
    lens = seg_indptr[1:] - seg_indptr[:-1]
    return torch.repeat_interleave(weight_indices, lens.long()).to(torch.int32)

# %% ch02.3
def lora_loop(x, A_stack, B_stack, batch_info, out):
    starts = batch_info.seg_indptr.tolist()
    for i, slot in enumerate(batch_info.weight_indices.tolist()):
        r = int(batch_info.lora_ranks[slot])
        lo, hi = starts[i], starts[i + 1]
        if r == 0 or lo == hi:
            continue
        a = A_stack[slot, :r].float()
        b = B_stack[slot, :, :r].float()
        t = (x[lo:hi].float() @ a.T).to(x.dtype)
        delta = batch_info.scalings[slot] * (t.float() @ b.T)
        out[lo:hi] = (out[lo:hi].float() + delta).to(out.dtype)
    return out

# %% ch02.4
def bgmv_shrink(x, A_stack, batch_info, out):
    slots = batch_info.token_slots.long()
    A = A_stack[slots].float()                      # [T, R, in], one matrix per token
    t = torch.bmm(A, x.float().unsqueeze(2)).squeeze(2)   # [T, R]
    ranks = batch_info.lora_ranks[slots]
    cols = torch.arange(A_stack.shape[1], device=x.device)
    keep = cols[None, :] < ranks[:, None]
    out[:, :A_stack.shape[1]] = torch.where(keep, t.to(out.dtype), out[:, :A_stack.shape[1]])
    return out

# %% ch02.5
def bgmv_expand(t, B_stack, batch_info, out):
    slots = batch_info.token_slots.long()
    R = B_stack.shape[2]
    ranks = batch_info.lora_ranks[slots]
    keep = torch.arange(R, device=t.device)[None, :] < ranks[:, None]
    tt = torch.where(keep, t[:, :R].float(), 0.0)
    B = torch.where(keep[:, None, :], B_stack[slots].float(), 0.0)   # [T, out, R]
    delta = torch.bmm(B, tt.unsqueeze(2)).squeeze(2) * batch_info.scalings[slots][:, None]
    out.copy_((out.float() + delta).to(out.dtype))
    return out

# %% ch02.6
def sgmv_shrink(x, A_stack, batch_info, out):
    indptr = batch_info.seg_indptr.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = batch_info.lora_ranks[slot].item()
        rows = torch.arange(indptr[seg], indptr[seg + 1], device=x.device)
        if batch_info.permutation is not None:
            rows = batch_info.permutation[rows]
        if r == 0 or len(rows) == 0:
            continue
        out[rows, :r] = (x[rows].float() @ A_stack[slot, :r].float().T).to(out.dtype)
    return out

# %% ch02.7
def sgmv_expand(t, B_stack, batch_info, out):
    indptr = batch_info.seg_indptr.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = batch_info.lora_ranks[slot].item()
        rows = torch.arange(indptr[seg], indptr[seg + 1], device=t.device)
        if batch_info.permutation is not None:
            rows = batch_info.permutation[rows]
        if r == 0 or len(rows) == 0:
            continue
        delta = batch_info.scalings[slot] * (t[rows, :r].float() @ B_stack[slot, :, :r].float().T)
        out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out

# %% ch02.8
def stable_sort_by_slot(token_slots):
    perm = torch.argsort(token_slots, stable=True)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(len(perm), device=perm.device)
    return perm, inv

# %% ch02.9
def padded_flop_waste(seg_lens, ranks):
    if len(seg_lens) != len(ranks):
        raise ValueError("one rank per request")
    if not seg_lens:
        return 0.0
    R = max(ranks)
    padded = sum(n * R for n in seg_lens)
    if padded == 0:
        return 0.0
    used = sum(n * r for n, r in zip(seg_lens, ranks))
    return (padded - used) / padded
