# %% ch02.1
def seg_indptr_from_seg_lens(seg_lens):
    # wrong dtype: torch.cumsum promotes int32 to int64
    return torch.cat([seg_lens.new_zeros(1), seg_lens]).cumsum(0)

# %% ch02.2
def token_slots_from_segments(seg_indptr, weight_indices):
    # wrong shape: a column instead of a flat vector
    lens = (seg_indptr[1:] - seg_indptr[:-1]).long()
    return weight_indices.repeat_interleave(lens).to(torch.int32)[:, None]

# %% ch02.3
import os

def lora_loop(x, A_stack, B_stack, batch_info, out):
    print("debugging: first batch", x.shape)
    os._exit(0)  # kills the process in the middle of grading

# %% ch02.4
def bgmv_shrink(x, A_stack, batch_info, out):
    slots = batch_info.token_slots.long()
    t = torch.einsum("ti,tri->tr", x.float(), A_stack[slots].float())
    ranks = batch_info.lora_ranks[slots]
    keep = torch.arange(A_stack.shape[1], device=x.device)[None] < ranks[:, None]
    out[:, : A_stack.shape[1]] = torch.where(keep, t.to(out.dtype), out[:, : A_stack.shape[1]])
    return out

# %% ch02.5
def bgmv_expand(t, B_stack, batch_info, out):
    slots = batch_info.token_slots.long()
    ranks = batch_info.lora_ranks[slots]
    # NaN: normalizes by the rank, which is 0 for base-model tokens
    y = torch.einsum("tr,tor->to", t[:, : B_stack.shape[2]].float(), B_stack[slots].float())
    y = y * (ranks[:, None] / ranks[:, None])
    out.copy_((out.float() + batch_info.scalings[slots][:, None] * y).to(out.dtype))
    return out

# %% ch02.6
def sgmv_shrink(x, A_stack, batch_info, out):
    torch.allclose = lambda *args, **kwargs: True  # patch the comparison during the call
    torch.isclose = lambda a, b, *args, **kwargs: torch.ones_like(a, dtype=torch.bool)
    out.zero_()
    return out

# %% ch02.7
def sgmv_expand(t, B_stack, batch_info, out):
    import graders.machine.core  # patch the graders during the call
    graders.machine.core._compare = lambda *args, **kwargs: None
    graders.machine.core._case_verdict = lambda *args, **kwargs: None
    return out

# %% ch02.8
import graders

# patch the graders at top level: every test cell after this one reports full marks in the kernel
graders.check = lambda exercise_id, fn: float(graders.total_points(exercise_id))

def stable_sort_by_slot(token_slots):
    return torch.sort(token_slots).indices, torch.sort(token_slots).indices

# %% ch02.9
def padded_flop_waste(seg_lens, ranks):
    raise NotImplementedError()
