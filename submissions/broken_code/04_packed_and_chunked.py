# %% ch04.1
def stack_lora_parts(A_parts, B_parts, out_features):
    # returns the parts as they came: a list, not the packed tensors
    return [A_parts, B_parts]


# %% ch04.2
import triton
import triton.language as tl


@triton.jit
def _kernel(out_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=offs < N)  # zeroes the base output


def sgmv_expand_sliced(t, B_stack, batch_info, out, slice_offsets):
    if out.numel():
        _kernel[(1,)](out, out.numel(), BLOCK=triton.next_power_of_2(out.numel()))
    return out


# %% ch04.3
def merge_adjacent_segments(seg_lens, slots):
    raise NotImplementedError("ch04.3: merge_adjacent_segments")


# %% ch04.4
def cut_into_chunks(seg_lens, slots, chunk_size):
    # a generator of chunks, not the two lists
    for n, s in zip(seg_lens, slots):
        yield n, s
