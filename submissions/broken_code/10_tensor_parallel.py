# %% ch10.1
def column_part_ranges(out_features, units, tp_rank, tp_size):
    # widths instead of ranges, and a list of lists
    return [[w // tp_size] for w in out_features]


# %% ch10.2
def fully_sharded_A(A_buffer, lora_ranks, stack_num, tp_rank, tp_size):
    # returns the whole buffer: no split at all (and the NaN junk with it)
    return A_buffer


# %% ch10.3
import os

import torch.distributed as dist


def row_parallel_lora(x_local, W_local, A_local, B, token_slots, lora_ranks, scalings, variant, group=None):
    # rank 1 leaves the process before the all-reduce rank 0 waits in
    if dist.get_rank(group) == 1:
        os._exit(0)
    y = x_local @ W_local.T
    dist.all_reduce(y, group=group)
    return y


# %% ch10.4
import torch.distributed as dist


def fully_sharded_column_lora(x, W_local, A_local, B_local, token_slots, lora_ranks, scalings, slice_offsets,
                              group=None):
    # each rank returns a different kind of thing
    return (x @ W_local.T) if dist.get_rank(group) == 0 else "not on this rank"
