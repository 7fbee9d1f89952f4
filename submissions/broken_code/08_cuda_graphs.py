# %% ch08.1
def bucket_for(num_seqs, buckets):
    # a description instead of the bucket
    return f"bucket {min(b for b in buckets if b >= num_seqs)}"


# %% ch08.2
import torch
from reference.batch_info import slot_sorted_view
from reference.cuda_graph import StaticLoRABatch as GivenStaticLoRABatch


class StaticLoRABatch(GivenStaticLoRABatch):
    def update(self, seq_slots, bucket, pad_slot, lora_ranks, scalings, ownership_changed):
        # fresh tensors every step: the captured graph keeps reading the old ones
        seqs = list(seq_slots) + [pad_slot] * (bucket - len(seq_slots))
        counts, offsets, order = slot_sorted_view(seqs, self.num_slots, self.tokens_per_seq)
        self.buffers = {**self.buffers, "token_slots": torch.tensor(seqs, dtype=torch.int32),
                        "seg_lens": counts, "seg_indptr": offsets}


# %% ch08.3
class SlotChangeTracker:
    def __init__(self, pool):
        self.pool = pool
        self.seen = 0

    def poll(self):
        # the new events themselves, not whether they changed an owner
        new = self.pool.events[self.seen:]
        self.seen = len(self.pool.events)
        return new


# %% ch08.4
import torch


def write_decode_inputs(input_ids, positions, cache_rows, bucket, scratch_row, static_ids, static_positions,
                        static_rows):
    # loops past the batch: input_ids[q] for q >= n
    for q in range(bucket):
        static_ids[q] = torch.tensor(input_ids[q])
        static_positions[q] = positions[q]
        static_rows[q] = cache_rows[q]
