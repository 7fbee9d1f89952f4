# %% ch09.1
def virtual_expert_ids(topk_ids, token_slots, num_experts):
    # a nested Python list instead of a tensor
    return [[int(s) * num_experts + int(e) for e in row] for s, row in zip(token_slots, topk_ids)]


# %% ch09.2
import torch


def moe_align_block_size(ids, block_size, num_ids, skip=None):
    # forgets num_pairs: a 2-tuple
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order.to(torch.int32), torch.unique(flat).to(torch.int32)


# %% ch09.3
def fused_moe_lora(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k, rows_per_pair,
                   slice_offsets=None, topk_weights=None):
    # the delta of the whole A and B, on every pair, ignoring ranks, experts and slots
    return out + x.float().mean() * 0 + 1


# %% ch09.4
def to_local_expert_ids(topk_ids, ep_rank, ep_size, num_experts):
    # raises for every input
    raise NotImplementedError("expert parallelism is chapter 10's business")


# %% ch09.5
def split_expert_lora(lora_A, lora_B, num_experts):
    # a generator, not a list
    r = lora_A.shape[0] // num_experts
    return ((lora_A[e * r:(e + 1) * r], lora_B[:, e::num_experts]) for e in range(num_experts))
