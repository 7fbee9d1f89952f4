# %% ch03.1
import triton
import triton.language as tl


@triton.jit
def shrink_kernel(x_ptr, a_ptr, out_ptr, BLOCK: tl.constexpr):
    pass  # to do


def sgmv_shrink(x, A_stack, batch_info, out):
    # launches a kernel that writes nothing: every defined element stays NaN
    shrink_kernel[(1,)](x, A_stack, out, BLOCK=16)
    return out

# %% ch03.2
import triton
import triton.language as tl


@triton.jit
def expand_kernel(t_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(t_ptr + i, mask=i < n), mask=i < n)


def sgmv_expand(t, B_stack, batch_info, out):
    # raises: the launch passes one argument too few
    expand_kernel[(1,)](t, B_stack, out, BLOCK=16)
    return out
