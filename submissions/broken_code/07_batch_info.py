# %% ch07.1
def batch_info_from_requests(req_uids, req_lens, uid_to_slot, lora_ranks, scalings, device):
    # a dict, not a LoRABatchInfo
    return {"bs": len(req_uids), "seg_lens": list(req_lens)}


# %% ch07.2
def slot_sorted_view(token_slots, num_slots, tokens_per_seq):
    # host lists instead of tensors
    counts = [token_slots.count(s) * tokens_per_seq for s in range(num_slots)]
    return counts, [0] + counts, sorted(range(len(token_slots)), key=lambda q: token_slots[q])


# %% ch07.3
from torch import nn


class LoRALinear(nn.Module):
    def __init__(self, base, A_buffer, B_buffer, context):
        super().__init__()
        self.base = base

    def forward(self, x):
        self.base(x)  # forgets to return the output
