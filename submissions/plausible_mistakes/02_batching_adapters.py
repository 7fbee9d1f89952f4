# %% ch02.1
def seg_indptr_from_seg_lens(seg_lens):
    # mistake: the running sum alone, without the leading 0
    return torch.cumsum(seg_lens, dim=0).to(torch.int32)

# %% ch02.2
def token_slots_from_segments(seg_indptr, weight_indices):
    counts = (seg_indptr[1:] - seg_indptr[:-1]).long()
    return weight_indices.repeat_interleave(counts).int()

# %% ch02.3
def lora_loop(x, A_stack, B_stack, batch_info, out):
    indptr = batch_info.seg_indptr.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        if slot == 0:  # mistake: assumes slot 0 is the base model, then uses the full padded rank
            continue
        rows = slice(indptr[seg], indptr[seg + 1])
        t = x[rows] @ A_stack[slot].T
        out[rows] += batch_info.scalings[slot] * (t @ B_stack[slot].T)
    return out

# %% ch02.4
def bgmv_shrink(x, A_stack, batch_info, out):
    # mistake: gathers one A per segment (weight_indices) instead of one per token (token_slots)
    A = A_stack[batch_info.weight_indices.long()]
    r_max = A_stack.shape[1]
    t = torch.einsum("ti,tri->tr", x.float(), A.float())
    ranks = batch_info.lora_ranks[batch_info.weight_indices.long()]
    mask = torch.arange(r_max, device=x.device)[None] < ranks[:, None]
    out[:, :r_max] = torch.where(mask, t.to(out.dtype), out[:, :r_max])
    return out

# %% ch02.5
def bgmv_expand(t, B_stack, batch_info, out):
    for tok in range(t.shape[0]):
        s = int(batch_info.token_slots[tok])
        r = int(batch_info.lora_ranks[s])
        if r:
            y = t[tok, :r].float() @ B_stack[s, :, :r].float().T
            out[tok] = (out[tok].float() + batch_info.scalings[s] * y).to(out.dtype)
    return out

# %% ch02.6
def sgmv_shrink(x, A_stack, batch_info, out):
    indptr = batch_info.seg_indptr.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = int(batch_info.lora_ranks[slot])
        rows = torch.arange(indptr[seg], indptr[seg + 1], device=x.device)
        if batch_info.permutation is not None:
            rows = batch_info.permutation[rows]
        if r == 0 or rows.numel() == 0:
            continue
        # mistake: scales here as well as in expand, so the delta is scaled twice
        t = batch_info.scalings[slot] * (x[rows].float() @ A_stack[slot, :r].float().T)
        out[rows, :r] = t.to(out.dtype)
    return out

# %% ch02.7
def sgmv_expand(t, B_stack, batch_info, out):
    indptr = batch_info.seg_indptr.tolist()
    for seg, slot in enumerate(batch_info.weight_indices.tolist()):
        r = int(batch_info.lora_ranks[slot])
        if r == 0:
            continue
        # mistake: ignores batch_info.permutation, so unsorted batches update the wrong rows
        lo, hi = indptr[seg], indptr[seg + 1]
        y = t[lo:hi, :r].float() @ B_stack[slot, :, :r].float().T
        out[lo:hi] = (out[lo:hi].float() + batch_info.scalings[slot] * y).to(out.dtype)
    return out

# %% ch02.8
def stable_sort_by_slot(token_slots):
    perm = torch.sort(token_slots, stable=True).indices
    inverse = torch.argsort(perm)
    return perm, inverse

# %% ch02.9
def padded_flop_waste(seg_lens, ranks):
    if not seg_lens or max(ranks) == 0:
        return 0.0
    R = max(ranks)
    wasted = sum(n * (R - r) for n, r in zip(seg_lens, ranks))
    useful = sum(n * r for n, r in zip(seg_lens, ranks))
    return wasted / useful  # mistake: relative to the useful FLOPs, not to the padded total
