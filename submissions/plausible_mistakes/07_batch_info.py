# %% ch07.1
import torch
from reference.batch_info import LoRABatchInfo


def batch_info_from_requests(req_uids, req_lens, uid_to_slot, lora_ranks, scalings, device):
    """The per-request LoRABatchInfo of one forward, from host lists only."""
    missing = [u for u in req_uids if u not in uid_to_slot]
    if missing:
        raise ValueError(f"uids not resident: {missing}")
    slots = [uid_to_slot[u] for u in req_uids]
    indptr = [0]
    for n in req_lens:
        indptr.append(indptr[-1] + n)
    token_slots = [s for s, n in zip(slots, req_lens) for _ in range(n)]

    def send(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device)

    return LoRABatchInfo(
        bs=len(slots), num_segments=len(slots), max_len=max(req_lens, default=0),
        # mistake: a request with no tokens this step still counts as active
        has_active_lora=any(lora_ranks[s] > 0 for s in slots),
        seg_lens=send(list(req_lens), torch.int32), seg_indptr=send(indptr, torch.int32),
        weight_indices=send(slots, torch.int32), lora_ranks=send(list(lora_ranks), torch.int32),
        scalings=send(list(scalings), torch.float32), permutation=None,
        token_slots=send(token_slots, torch.int32), req_seg_indptr=send(indptr, torch.int32),
        req_weight_indices=send(slots, torch.int32),
    )


# %% ch07.2
import torch


def slot_sorted_view(token_slots, num_slots, tokens_per_seq):
    """Per-slot token counts, offsets, and token ids grouped by slot (fixed-size segment table)."""
    if any(not 0 <= s < num_slots for s in token_slots):
        raise ValueError("slot out of range")
    counts = [0] * num_slots
    for s in token_slots:
        counts[s] += 1  # mistake: counts sequences, not tokens
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    order = sorted(range(len(token_slots)), key=lambda q: token_slots[q])
    ids = [q * tokens_per_seq + j for q in order for j in range(tokens_per_seq)]
    return (torch.tensor(counts, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int32),
            torch.tensor(ids, dtype=torch.int64))


# %% ch07.3
import torch
from torch import nn
from reference.ops import torch_ref


class LoRALinear(nn.Module):
    """base(x) plus the batch's LoRA deltas, added in place; the batch comes from context."""

    def __init__(self, base, A_buffer, B_buffer, context):
        super().__init__()
        self.base, self.A_buffer, self.B_buffer, self.context = base, A_buffer, B_buffer, context

    def forward(self, x):
        # mistake: copies the base layer's forward instead of calling it
        y = x @ self.base.weight.T + self.base.bias
        info = self.context.batch_info
        if not info.has_active_lora:
            return y
        rows = x.reshape(-1, x.shape[-1])
        t = rows.new_empty(rows.shape[0], self.A_buffer.shape[1])
        torch_ref.shrink(rows, self.A_buffer, info, t)
        torch_ref.expand(t, self.B_buffer, info, y.view(-1, y.shape[-1]))
        return y
