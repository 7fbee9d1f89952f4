# %% [markdown]
# # 03 · Shrink and expand in Triton
#
# Chapter 02 defined the batched LoRA ops in plain PyTorch: a host loop over segments that issues a
# few small kernels per segment and reads metadata back to the host to drive the loop. This chapter
# turns the same semantics into Triton kernels: **one launch per op, whatever the batch**. The grid
# is sized from host integers, and every program of the kernel looks up its own segment's slot,
# rank and scaling on the device.
#
# **What you will learn**
# - Triton's programming model, in the four phases every kernel of the book follows: map the program
#   to a tile, build pointers, loop over K, write back.
# - Where Triton's CPU interpreter (which runs this notebook when there is no GPU) and a real GPU
#   disagree, and the four habits that keep one kernel right on both: compute in fp32 after loading
#   16-bit values when interpreting, `tl.dot` blocks of at least 16, a mask on every load, IEEE fp32
#   dots for fp32 inputs.
# - The SGMV shrink kernel (a segment axis in the grid, slot and rank lookups, early exits, the rank
#   clip, a permutation for unsorted batches) and the SGMV expand kernel (K is the rank, a
#   read-modify-write of the base output).
# - BGMV for decode: a matrix-vector product per token, done as multiply and row-sum.
# - Why LoRA in a decode step is launch-bound, in bytes and microseconds, and what fusing shrink and
#   expand into one kernel and capturing CUDA graphs change; a fused decode kernel.
# - What the book's kernels measure on an H200, and how SGLang, vLLM and Punica write theirs.
#
# **Exercises** (each is followed by its grader cell): ch03.1 `sgmv_shrink`, ch03.2 `sgmv_expand`,
# ch03.3 `fused_decode`. In each you write the body of a `@triton.jit` kernel (its signature is
# given) and the body of its wrapper (the grid and the launch).
#
# Each answer cell is graded on its own, in a fresh process that has imported `reference` (so the
# interpreter is on when there is no GPU) and run `import math, torch`: keep every answer
# self-contained, with its imports inside the cell. The text's demonstrations use the book's
# reference package, never your answers, so the notebook runs top to bottom whatever state your
# answers are in. Every number the text states is printed by a code cell, or quoted with its source.
# After each grader cell, a cell prints the book's reference, but only once your own answer has
# passed in this notebook (`graders.show_reference("ch03.1", reveal=True)` shows it anyway).

# %%
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import reference  # first: with no CUDA device it sets TRITON_INTERPRET=1, which triton reads when imported
import torch

import graders
from graders.machine.tolerances import tolerance
from reference import lora_math
from reference.batch_info import build_batch_info, stable_sort_by_slot
from reference.device import default_device, interpreting
from reference.ops import torch_ref

import triton  # after reference, on purpose
import triton.language as tl

# The reference's Triton ops, one module per op (the notebook's answer cells reuse the function names).
ref_sgmv_shrink = importlib.import_module("reference.ops.sgmv_shrink")
ref_sgmv_expand = importlib.import_module("reference.ops.sgmv_expand")
ref_bgmv_shrink = importlib.import_module("reference.ops.bgmv_shrink")
ref_bgmv_expand = importlib.import_module("reference.ops.bgmv_expand")
ref_fused_decode = importlib.import_module("reference.ops.fused_decode")

device = default_device()
NAN = float("nan")
print(f"torch {torch.__version__}, triton {triton.__version__}, device {device}; "
      f"Triton kernels run in the CPU interpreter: {interpreting()}")

# %% [markdown]
# ## 1. From a host loop to one launch
#
# Chapter 02's `torch_ref.sgmv_shrink` walks the segments in Python. Every iteration issues a few
# tensor operations (an index, a matmul, a scatter), and on a GPU each of them is a kernel launch.
# The loop itself needs the metadata on the host (`.tolist()`), which makes the host wait for the
# device. The cell counts the tensor operations one call issues, for batches of 4 and 16 segments.

# %%
from torch.utils._python_dispatch import TorchDispatchMode


class CountOps(TorchDispatchMode):
    """Counts the tensor operations (each a kernel launch on a GPU) issued inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def small_batch(num_segments, tokens=3, d_in=64, rank=8):
    ranks, slots = [0, rank], [1] * num_segments
    info = build_batch_info([tokens] * num_segments, slots, ranks, [0.0, 1.0], "cpu")
    x = torch.randn(tokens * num_segments, d_in)
    A = torch.randn(2, rank, d_in)
    return x, A, info, torch.zeros(x.shape[0], rank)


for segments in (4, 16):
    x, A, info, out = small_batch(segments)
    with CountOps() as counter:
        torch_ref.sgmv_shrink(x, A, info, out)
    print(f"{segments:2d} segments: torch_ref.sgmv_shrink issues {counter.count} tensor operations")

# %% [markdown]
# The count grows with the number of segments. A Triton kernel replaces the whole loop with **one
# launch**: the host computes a grid from integers it already knows (`max_len`, `num_segments`, the
# tensor shapes) and launches it; each program of the grid reads its own segment's metadata from
# device memory. Nothing in the launch waits for the device.
#
# ### Triton in one screen
#
# A Triton kernel is a Python function decorated with `@triton.jit` and launched as
# `kernel[grid](args...)`. The grid is a tuple of up to three integers; the kernel runs once per
# grid point, and each run is a **program** (on a GPU, a block of threads that works on a whole tile
# at once). Inside the kernel:
#
# | construct | meaning |
# | --- | --- |
# | `tl.program_id(axis)` | this program's coordinate along a grid axis |
# | `tl.arange(0, BLOCK)` | the vector `0, 1, ..., BLOCK-1`; `BLOCK` must be a power of two and a `tl.constexpr` |
# | `ptr + offs[:, None] * stride0 + offs2[None, :] * stride1` | a 2-D tile of addresses (broadcasting, as in numpy) |
# | `tl.load(ptrs, mask=m, other=0.0)` | read a tile; lanes where `m` is False read nothing and get `other` |
# | `tl.store(ptrs, value, mask=m)` | write a tile; lanes where `m` is False write nothing |
# | `tl.dot(a, b)` | `[M, K] @ [K, N]` on the tensor cores, accumulating in fp32 |
# | `tl.sum(t, axis=1)`, `a * b`, `.to(tl.float32)` | elementwise arithmetic, reductions, casts |
# | `NAME: tl.constexpr` | a compile-time constant: block sizes and flags; each value compiles its own kernel |
#
# Tensors are passed as pointers (to their first element) plus their **strides**, in elements, so a
# kernel handles any layout. Block sizes are constants; the data sizes are not, so every tile that can
# stick out of the data needs a mask.
#
# A warm-up kernel: the shrink of **one** adapter, `t = x @ A^T` with `x` `[M, K]` and `A` `[N, K]`
# (N = the rank). Its four phases are the ones every kernel of this chapter has.

# %%
@triton.jit
def one_adapter_shrink_kernel(
    # pointers
    x_ptr, a_ptr, t_ptr,
    # sizes
    M, N, K,
    # strides
    stride_xm, stride_xk, stride_an, stride_ak, stride_tm, stride_tn,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # 1. map the program to its tile: rows [pid_m * BLOCK_M, (pid_m + 1) * BLOCK_M) of t, all N columns
    pid_m = tl.program_id(0)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    # 2. build pointers: a [BLOCK_M, BLOCK_K] tile of x and a [BLOCK_K, BLOCK_N] tile of A^T
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + offs_n[None, :] * stride_an + offs_k[:, None] * stride_ak  # element (k, n) is A[n, k]
    # 3. loop over K, one BLOCK_K slice at a time, accumulating in fp32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K  # the last slice may stick out of K
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(x_tile, a_tile)  # for fp32 inputs a GPU uses TF32 here (section 2.4)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    # 4. write back, in t's dtype, only inside [M, N]
    t_ptrs = t_ptr + offs_m[:, None] * stride_tm + offs_n[None, :] * stride_tn
    tl.store(t_ptrs, acc.to(t_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def one_adapter_shrink(x, A, block_m=16, block_k=64):
    t = torch.empty(x.shape[0], A.shape[0], dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x.shape[0], block_m),)  # one program per BLOCK_M rows
    one_adapter_shrink_kernel[grid](
        x, A, t, x.shape[0], A.shape[0], x.shape[1],
        x.stride(0), x.stride(1), A.stride(0), A.stride(1), t.stride(0), t.stride(1),
        BLOCK_M=block_m, BLOCK_N=max(16, triton.next_power_of_2(A.shape[0])), BLOCK_K=block_k,
    )
    return t


x = torch.randn(37, 100, device=device)  # 37 rows and 100 columns: no block size divides them
A = torch.randn(7, 100, device=device) / 10  # rank 7
t = one_adapter_shrink(x, A)
print("t", list(t.shape), " max |t - x @ A.T| =", f"{(t - x @ A.T).abs().max().item():.2e}")

# %% [markdown]
# (On a GPU the printed error is larger, for a reason section 2.4 explains.)
#
# In the interpreter every program runs as a sequence of numpy operations on whole tiles, one program
# after another, so the cost is counted in programs and loop steps, not in elements. The cell times
# grids of 4, 16 and 64 programs doing one K step each, and 16 programs doing four, then splits the
# time into what a program costs with one K step and what each further K step adds.

# %%
def time_warmup(rows, cols, block_m=16, block_k=64):
    xs, As = torch.randn(rows, cols, device=device), torch.randn(8, cols, device=device)
    one_adapter_shrink(xs, As, block_m, block_k)  # warm up (on a GPU: compile)
    start = time.perf_counter()
    one_adapter_shrink(xs, As, block_m, block_k)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


unit, scale = ("ms", 1e3) if interpreting() else ("us", 1e6)
timed = {}
for rows, cols in [(64, 64), (256, 64), (1024, 64), (256, 256)]:
    programs, steps = triton.cdiv(rows, 16), triton.cdiv(cols, 64)
    timed[(programs, steps)] = seconds = time_warmup(rows, cols)
    print(f"{programs:3d} programs x {steps} K steps: {1e3 * seconds:7.1f} ms in all, "
          f"{scale * seconds / programs:.2f} {unit} per program")
per_program = timed[(16, 1)] / 16  # a program with one K step
per_step = (timed[(16, 4)] - timed[(16, 1)]) / (16 * 3)  # what each of the 3 further K steps adds
print(f"per program with one K step: {scale * per_program:.2f} {unit}; "
      f"each further K step of a program: {scale * per_step:.2f} {unit}")

# %% [markdown]
# Read the last line. In the interpreter a program costs milliseconds, and most of that is paid once
# per program (setting up its arguments and tiles), whatever it computes; each further K step adds a
# smaller amount (the exact numbers depend on the machine). On a GPU the same launch takes
# microseconds, all programs at once. Two consequences for this chapter: the grader's batches have
# few tokens (with just enough width and rank to cross every tile and loop of your kernels at least
# twice), and your kernels should use large blocks and return early from programs that have nothing
# to do, so that a grid does not pay for empty programs.
#
# ## 2. The interpreter is not the GPU
#
# `TRITON_INTERPRET=1` runs a kernel's Python code on numpy arrays. It is what makes this chapter
# possible on a laptop, and its results agree with the GPU's, with four exceptions that a kernel meant
# for both must handle.
#
# ### 2.1 bf16 arithmetic is wrong in the interpreter, silently
#
# numpy has no bfloat16. Triton's interpreter stores bf16 values as their raw 16-bit patterns in
# `uint16` arrays (`triton/runtime/interpreter.py`: "bfloat16 types are stored as uint16") and only
# decodes them when a kernel casts them to fp32. Arithmetic and `tl.dot` on bf16 values therefore work
# on integers, without any error. The cell runs `a * b + a` and a `tl.dot` on the same values three
# ways: in bf16, in fp16, and in bf16 cast to fp32 right after loading, and compares each with the
# same computation in fp32 (the elementwise result is stored in the 16-bit dtype, so it carries that
# dtype's rounding).

# %%
@triton.jit
def fma_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr, UPCAST: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    a, b = tl.load(a_ptr + offs), tl.load(b_ptr + offs)
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    tl.store(out_ptr + offs, (a * b + a).to(out_ptr.dtype.element_ty))


@triton.jit
def dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, UPCAST: tl.constexpr):
    om, ok, on = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + om[:, None] * K + ok[None, :])
    b = tl.load(b_ptr + ok[:, None] * N + on[None, :])
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    tl.store(c_ptr + om[:, None] * N + on[None, :], tl.dot(a, b))


gen = torch.Generator().manual_seed(0)
a32, b32 = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
A32, B32 = torch.randn(16, 32, generator=gen), torch.randn(32, 16, generator=gen)
print(f"interpreting: {interpreting()}")
for dtype, upcast in [(torch.bfloat16, False), (torch.float16, False), (torch.bfloat16, True)]:
    a, b = a32.to(dtype).to(device), b32.to(dtype).to(device)
    out = torch.empty_like(a)
    fma_kernel[(1,)](a, b, out, BLOCK=16, UPCAST=upcast)
    fma_err = (out.float() - (a.float() * b.float() + a.float())).abs().max().item()
    A_, B_ = A32.to(dtype).to(device), B32.to(dtype).to(device)
    C = torch.empty(16, 16, device=device)
    dot_kernel[(1,)](A_, B_, C, M=16, K=32, N=16, UPCAST=upcast)
    dot_err = (C - A_.float() @ B_.float()).abs().max().item()
    label = f"{str(dtype).split('.')[1]}{', cast to fp32 after loading' if upcast else ''}"
    print(f"{label:38} max error: a*b+a {fma_err:.3g}, tl.dot {dot_err:.3g}")

# %% [markdown]
# In the interpreter (`interpreting: True`), bf16 arithmetic is off by many orders of magnitude while
# fp16 (which numpy has) and bf16 cast to fp32 are right up to the rounding of a 16-bit result; on a
# GPU all three rows are right. The
# book's kernels therefore take a compile-time flag `UPCAST` and cast their 16-bit tiles to fp32
# right after loading when it is set; the wrapper sets it to `interpreting()`
# (`reference.device.interpreting`). On the GPU `UPCAST` is False and the dot stays a native bf16
# tensor-core dot with fp32 accumulation: fast and right. A kernel that only does elementwise work in
# fp32 (the BGMV kernels of section 5) casts every load to fp32 anyway and needs no flag.
#
# ### 2.2 A GPU `tl.dot` has minimum sizes; the interpreter has none
#
# The interpreter runs `tl.dot` as a numpy matmul of any shape. Triton's GPU compiler asks the target
# for the smallest dot it supports. We can ask it ourselves: Triton compiles for an H200 (CUDA
# compute capability 9.0) on any machine, no GPU needed. `compile_for_h200` below does that in a
# fresh Python process with the interpreter off: while interpreting kernels, Triton patches
# `triton.language` in place, and a process in that state cannot compile for a GPU. The cell compiles
# the dot tile of the previous cell, `[16, K] x [K, 16]` in bf16, with K = 4 and with K = 16, then
# prints the rule from Triton's NVIDIA backend.

# %%
def dot_tile(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr):
    """A plain function, not decorated: we hand it to the GPU compiler ourselves."""
    om, ok, on = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + om[:, None] * K + ok[None, :])
    b = tl.load(b_ptr + ok[:, None] * N + on[None, :])
    tl.store(c_ptr + om[:, None] * N + on[None, :], tl.dot(a, b))


COMPILE_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
import kernels
results = []
for name, signature, constexprs in json.loads(sys.argv[1]):
    try:
        src = ASTSource(JITFunction(getattr(kernels, name)), signature, constexprs)
        results.append({"ptx": triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]})
    except Exception as exc:
        results.append({"error": str(exc).strip().splitlines()[-1]})
print(json.dumps(results))
"""


def compile_for_h200(fn, jobs):
    """Compile `fn` for compute capability 9.0 (H100, H200) with Triton's own compiler: no GPU needed.

    jobs: a list of (signature, constexprs). Runs in a fresh process with the interpreter off (a process
    that has interpreted kernels cannot compile for a GPU). Returns one dict per job: "ptx" or "error".
    """
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "kernels.py").write_text("import triton.language as tl\n\n\n" + inspect.getsource(fn))
        Path(tmp, "compile.py").write_text(COMPILE_SCRIPT)
        proc = subprocess.run([sys.executable, "compile.py", json.dumps([[fn.__name__, s, c] for s, c in jobs])],
                              cwd=tmp, env=dict(os.environ, TRITON_INTERPRET="0"), capture_output=True, text=True)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return [{"error": f"Triton's GPU compiler could not run here ({reason})"}] * len(jobs)
    return json.loads(proc.stdout.strip().splitlines()[-1])


signature = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*fp32", "M": "constexpr", "K": "constexpr", "N": "constexpr"}
jobs = [(signature, {"M": 16, "K": K, "N": 16}) for K in (4, 16)]
for K, result in zip((4, 16), compile_for_h200(dot_tile, jobs)):
    print(f"bf16 dot [16, {K}] x [{K}, 16] for sm_90: " + ("compiles" if "ptx" in result else f"refused: {result['error']}"))

try:
    from triton.backends.nvidia import compiler as nvidia_compiler
    print(inspect.getsource(nvidia_compiler.min_dot_size))
except (ImportError, AttributeError, OSError) as exc:
    print(f"(Triton's NVIDIA backend is not readable here: {exc})")

# %% [markdown]
# The NVIDIA backend of recent Triton (3.6 and 3.7, the book's two stacks) requires K >= 16 for 16-
# and 32-bit inputs (32 for 8-bit ones); older releases also required M and N >= 16. A kernel tested
# only in the interpreter can be fine there and refuse to compile on the GPU. This matters most for
# the **expand** kernel, whose K is the rank: the CPU test cases use ranks like 1 and 7. The fix costs
# nothing: make the K block `max(16, next_power_of_2(max_rank))` and mask it with `offs_k < rank`, so
# the lanes past the rank load zeros. The book keeps every `tl.dot` block at 16 or more on all three
# sides, which every Triton version accepts.
#
# ### 2.3 Unmasked loads read whatever is there
#
# The interpreter reads memory at the addresses a kernel computes and does not check them against the
# tensor's bounds. Below, `view` holds 10 values inside a larger buffer; a 16-lane load without a mask
# reads the 6 values that follow it, and no error is raised. On a GPU an out-of-bounds read is
# undefined behaviour: it may return garbage, fault, or (worst) appear to work.

# %%
@triton.jit
def load16_kernel(src_ptr, dst_ptr, n, MASKED: tl.constexpr):
    offs = tl.arange(0, 16)
    if MASKED:
        values = tl.load(src_ptr + offs, mask=offs < n, other=0.0)
    else:
        values = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, values)


buffer = torch.full((32,), -7.0, device=device)  # the neighbours hold -7
view = buffer[:10]
view.copy_(torch.arange(10.0))
for masked in (False, True):
    dst = torch.empty(16, device=device)
    load16_kernel[(1,)](view, dst, view.numel(), MASKED=masked)
    print(f"{'masked  ' if masked else 'unmasked'} load of a 10-element tensor: {dst.tolist()}")

# %% [markdown]
# In our kernels the neighbours are not harmless -7s: the rows past a slot's rank hold another
# adapter's leftovers (NaN in the graders' pools), the rows past a segment belong to other requests.
# **Every load gets a mask**, and every store too.
#
# ### 2.4 fp32 `tl.dot` is exact in the interpreter and TF32 on the GPU
#
# The interpreter's `tl.dot` is a numpy fp32 matmul. On a GPU, `tl.dot` of fp32 inputs uses the tensor
# cores in TF32 by default, which keep 10 of fp32's 23 mantissa bits. The cell compiles an fp32 dot for
# sm_90 twice, with the default precision and with `input_precision="ieee"`, and looks for TF32 in the
# generated PTX (the GPU's assembly language).

# %%
def fp32_dot_tile(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, IEEE: tl.constexpr):
    om, ok, on = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + om[:, None] * K + ok[None, :])
    b = tl.load(b_ptr + ok[:, None] * N + on[None, :])
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    tl.store(c_ptr + om[:, None] * N + on[None, :], c)


signature = {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "M": "constexpr", "K": "constexpr",
             "N": "constexpr", "IEEE": "constexpr"}
jobs = [(signature, {"M": 64, "K": 16, "N": 64, "IEEE": ieee}) for ieee in (False, True)]
for ieee, result in zip((False, True), compile_for_h200(fp32_dot_tile, jobs)):
    if "ptx" not in result:
        print(result["error"])
        continue
    mma = sorted({word for word in result["ptx"].split() if "mma" in word and "tf32" in word})
    print(f"input_precision={'ieee' if ieee else 'default'}: TF32 tensor-core instructions in the PTX: {mma or 'none'}")


def tf32(t):
    """Drop the 13 low mantissa bits of fp32 values: what a TF32 tensor core reads."""
    return (t.contiguous().view(torch.int32) & -8192).view(torch.float32)


xs = torch.randn(64, 96, generator=gen)
As = torch.randn(16, 96, generator=gen) / 96**0.5  # a shrink: in = 96, rank 16, outputs of size ~1
exact = xs.double() @ As.double().T
print(f"shrink in fp32: max error {(xs @ As.T - exact).abs().max().item():.1e}; "
      f"with TF32 inputs: {(tf32(xs) @ tf32(As).T - exact).abs().max().item():.1e}")
for dev in ("cpu", "cuda"):
    rtol, atol, why = tolerance(dev, torch.float32, "matmul")
    print(f"the graders' fp32 tolerance on {dev}: rtol {rtol:g}, atol {atol:g} ({why})")

# %% [markdown]
# By default the fp32 dot becomes a TF32 `wgmma` instruction; with `input_precision="ieee"` the PTX has
# none and the products are true fp32. TF32's error on this small shrink is far above the graders'
# fp32 tolerance: a kernel that matches in the interpreter would fail on the GPU. The book's kernels
# take a compile-time flag `IEEE_FP32`, True when the inputs are fp32, and pass
# `input_precision="ieee"` then. (Serving runs in bf16 or fp16, where this question does not arise.)
#
# ### The pattern
#
# Every `tl.dot` kernel of the book has this inner loop, and its wrapper passes
# `UPCAST=interpreting()` and `IEEE_FP32=(x.dtype == torch.float32)`:
#
# ```python
# x_tile = tl.load(x_ptrs, mask=..., other=0.0)      # every load masked
# a_tile = tl.load(a_ptrs, mask=..., other=0.0)
# if UPCAST:                                         # interpreter: no 16-bit arithmetic
#     x_tile = x_tile.to(tl.float32)
#     a_tile = a_tile.to(tl.float32)
# if IEEE_FP32:                                      # fp32 inputs: no TF32
#     acc += tl.dot(x_tile, a_tile, input_precision="ieee")
# else:                                              # 16-bit on the GPU: native tensor-core dot
#     acc += tl.dot(x_tile, a_tile)
# ```
#
# with every block of the dot at least 16 wide. `UPCAST` and `IEEE_FP32` are `tl.constexpr`: the
# branch is resolved when the kernel is compiled and costs nothing at run time.
#
# ## 3. SGMV shrink
#
# The shrink computes, for every segment `i` with slot `s = weight_indices[i]` and rank
# `r = lora_ranks[s]`, `t[rows, :r] = x[rows] @ A_stack[s, :r].T`. Each segment is a small GEMM with a
# large K (the hidden size) and a small N (the rank).
#
# **The grid.** Axis 1 is the segment; axis 0 enumerates the output tiles of one segment: row tiles
# of `BLOCK_M` tokens times rank tiles of `BLOCK_N` columns. Segments differ in length, and the grid
# must be the same for all of them, so axis 0 is sized for the longest segment (`max_len`, a host int)
# and the widest slot (`max_rank`):
#
# ```
# grid = (cdiv(max_len, BLOCK_M) * cdiv(max_rank, BLOCK_N), num_segments)
# pid_m, pid_n = program_id(0) // num_n_tiles, program_id(0) % num_n_tiles
# ```
#
# Many programs of that grid have nothing to do: the base model's segments (rank 0), row tiles past
# the end of a short segment, rank tiles past a small rank. They read three or four integers and
# **return at once**. The cell computes what each program of a small batch does: three requests of
# 5, 40 and 12 tokens on slots 1, 0 and 2, with ranks 64 (slot 0), 0 (slot 1, the base model) and
# 16 (slot 2), `BLOCK_M = 16`, `BLOCK_N = 32`.

# %%
def shrink_program_map(seg_lens, weight_indices, lora_ranks, max_rank, block_m, block_n):
    """What every program of the SGMV shrink grid does (computed on the host, for illustration)."""
    num_n_tiles = triton.cdiv(max_rank, block_n)
    grid = (triton.cdiv(max(seg_lens), block_m) * num_n_tiles, len(seg_lens))
    print(f"grid = {grid}: {grid[0] * grid[1]} programs")
    working = 0
    for seg, (n, slot) in enumerate(zip(seg_lens, weight_indices)):
        rank = lora_ranks[slot]
        cells = []
        for pid in range(grid[0]):
            pid_m, pid_n = divmod(pid, num_n_tiles)
            rows, cols = (pid_m * block_m, min(n, (pid_m + 1) * block_m)), (pid_n * block_n, min(rank, (pid_n + 1) * block_n))
            if rank == 0:
                cells.append("rank 0")
            elif rows[0] >= n:
                cells.append("past end")
            elif cols[0] >= rank:
                cells.append("past rank")
            else:
                cells.append(f"{rows[0]}:{rows[1]}x{cols[0]}:{cols[1]}")
                working += 1
        print(f"segment {seg} ({n:2d} tokens, slot {slot}, rank {rank:2d}): " + " | ".join(f"{c:>10}" for c in cells))
    print(f"{working} of {grid[0] * grid[1]} programs compute; the others return after a few loads")


shrink_program_map(seg_lens=[5, 40, 12], weight_indices=[1, 0, 2], lora_ranks=[64, 0, 16], max_rank=64,
                   block_m=16, block_n=32)

# %% [markdown]
# A working program (cells `rows x columns` above) then runs the four phases:
#
# 1. **Map the program to its tile.** `seg = program_id(1)`; `slot = weight_indices[seg]`;
#    `rank = lora_ranks[slot]`; `start = seg_indptr[seg]`, `seg_len = seg_indptr[seg + 1] - start`.
#    Return if `rank == 0`, if `pid_m * BLOCK_M >= seg_len`, or if `pid_n * BLOCK_N >= rank`.
# 2. **Build pointers.** `offs_m = pid_m * BLOCK_M + arange(BLOCK_M)` are positions inside the
#    segment; the tile's rows of `x` are `start + offs_m`, or `permutation[start + offs_m]` when the
#    batch has a permutation (chapter 02, section 8; a `tl.constexpr` flag `HAS_PERMUTATION` removes
#    that load when there is none). The A tile is read transposed: element `(k, n)` at
#    `a_ptr + slot * stride_as + n * stride_ar + k * stride_ak`.
# 3. **Loop over K** (the hidden size) in `BLOCK_K` slices, masks on rows (`offs_m < seg_len`), on K
#    and on columns (`offs_n < rank`: the clip, A past the rank is never read), the pattern of
#    section 2 for the dot.
# 4. **Write back** `acc` in `out`'s dtype to the same rows it loaded: `rows`, that is
#    `permutation[start + offs_m]` when the batch has a permutation, **not** `start + offs_m` (the
#    warm-up kernel has no permutation, so its write-back cannot show this). Mask the store to rows of
#    the segment and columns below the rank: the columns past the rank are not written (the contract
#    leaves them unspecified).
#
# No two programs write the same element (segments cover disjoint rows, tiles disjoint columns), so
# no atomics are needed.
#
# ### Exercise ch03.1: sgmv_shrink
#
# `sgmv_shrink(x, A_stack, batch_info, out) -> out`: the kernel `_sgmv_shrink_kernel` (signature
# given) and its wrapper, in one cell.
#
# - Semantics: exactly chapter 02's `sgmv_shrink` (`reference.ops.torch_ref.sgmv_shrink` with
#   `stack_num=1`). `x`: `[num_tokens, in]`; `A_stack`: `[num_slots, max_rank, in]`; `out`:
#   `[num_tokens, >= max_rank]`, filled with NaN by the graders. fp32 or fp16 in the interpreter;
#   bf16 as well on a GPU.
# - For every segment `i`, with `s = weight_indices[i]`, `r = lora_ranks[s]` and
#   `rows = perm[seg_indptr[i]:seg_indptr[i+1]]` (`perm` is `batch_info.permutation`, or the identity
#   when it is `None`): `out[rows, :r] = x[rows] @ A_stack[s, :r].T`, accumulated in fp32, written in
#   `out.dtype`. **No scaling.** The results go to the permuted rows too: `out[rows]`, the rows of `x`
#   that were loaded. Columns `r:` and the rows of rank-0 segments are unspecified (write them or not:
#   the graders compare only `out[rows, :r]`, and expand never reads the rest). `out` may have more
#   columns than `max_rank`: address it with its strides. Never read `A_stack[s, r:]` (NaN or a large
#   finite junk in the graders' pools). Segments may be empty.
# - The wrapper launches the kernel **once**, with a grid computed from host values
#   (`batch_info.max_len`, `batch_info.num_segments`, tensor shapes); no loop over segments, no
#   `.tolist()` or `.item()`. Return `out` without launching when there are no segments or
#   `max_len == 0`. Pass `batch_info.seg_indptr` for `permutation_ptr` when there is no permutation
#   (the kernel never reads it then).
# - Suggested blocks: `BLOCK_M = 32`, `BLOCK_K = 256` in bf16/fp16 and `128` in fp32 (the same bytes:
#   on a GPU the pipelined x and A tiles sit in shared memory, 227 KiB per SM on an H100/H200, and
#   fp32 tiles at 256 overflow it with a Triton `OutOfResources`),
#   `BLOCK_N = min(64, max(16, triton.next_power_of_2(max_rank)))`, so `num_n_tiles = cdiv(max_rank, BLOCK_N)`.
#   `UPCAST=interpreting()`, `IEEE_FP32=(x.dtype == torch.float32)`. The graders' cases cross every
#   tile and loop of these blocks (and of the reference's) at least twice: `in` above 512, `max_rank`
#   128 with a rank above 64, segments longer than 64 tokens.
# - In place: write into `out` and return it; do not modify the other inputs.

# %% exercise="ch03.1" role="answer"
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def _sgmv_shrink_kernel(
    # pointers
    x_ptr, a_ptr, out_ptr,
    # sizes
    K, num_n_tiles,
    # strides
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_om, stride_on,
    # batch metadata
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, permutation_ptr,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    """Program (pid, seg): rows pid_m*BLOCK_M.. of segment seg, columns pid_n*BLOCK_N.. of out."""
    ### BEGIN SOLUTION
    # 1. map the program to its tile; leave at once when the tile holds no work
    seg = tl.program_id(1)
    pid_m = tl.program_id(0) // num_n_tiles
    pid_n = tl.program_id(0) % num_n_tiles
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)  # N of this segment's GEMM: clip to it
    start = tl.load(seg_indptr_ptr + seg)
    seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    if (rank == 0) | (pid_m * BLOCK_M >= seg_len) | (pid_n * BLOCK_N >= rank):
        return  # base model or empty slot, rows past the segment's end, or columns past the rank
    # 2. build pointers: the tile's rows of x (through the permutation), the slot's A read as A^T
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # positions inside the segment
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len
    n_mask = offs_n < rank  # never read A past the rank
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + start + offs_m, mask=m_mask, other=0)
    else:
        rows = start + offs_m
    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk  # [BLOCK_M, BLOCK_K]
    a_ptrs = a_ptr + slot * stride_as + offs_n[None, :] * stride_ar + offs_k[:, None] * stride_ak  # [BLOCK_K, BLOCK_N]
    # 3. loop over K (the hidden size), accumulating in fp32
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_tile = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        a_tile = tl.load(a_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong: compute in fp32 there
            x_tile = x_tile.to(tl.float32)
            a_tile = a_tile.to(tl.float32)
        if IEEE_FP32:  # fp32 inputs: true fp32 products, not TF32
            acc += tl.dot(x_tile, a_tile, input_precision="ieee")
        else:
            acc += tl.dot(x_tile, a_tile)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    # 4. write back the defined region only: the segment's rows, the columns below the rank
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    ### END SOLUTION


def sgmv_shrink(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, >= max_rank]
) -> torch.Tensor:
    """SGMV shrink in one launch.

    Semantics:
        for seg: rows = perm[seg_indptr[seg]:seg_indptr[seg+1]]; s = weight_indices[seg]; r = lora_ranks[s]
                 out[rows, :r] = x[rows] @ A_stack[s, :r].T      (fp32 accumulation, no scaling)
    Columns past r and rows of rank-0 segments are unspecified (only out[rows, :r] is compared).
    Returns out.
    """
    ### BEGIN SOLUTION
    if batch_info.num_segments == 0 or batch_info.max_len == 0:
        return out  # nothing to launch
    max_rank = A_stack.shape[1]
    block_m, block_k = 32, 256 if x.element_size() <= 2 else 128  # same tile bytes in fp32
    block_n = min(64, max(16, triton.next_power_of_2(max_rank)))  # tl.dot blocks of at least 16
    num_n_tiles = triton.cdiv(max_rank, block_n)
    # host ints only: max_len and num_segments never make the host wait for the device
    grid = (triton.cdiv(batch_info.max_len, block_m) * num_n_tiles, batch_info.num_segments)
    perm = batch_info.permutation
    _sgmv_shrink_kernel[grid](
        x, A_stack, out,
        x.shape[1], num_n_tiles,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks,
        perm if perm is not None else batch_info.seg_indptr,  # any integer tensor: never read then
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_PERMUTATION=perm is not None, UPCAST=interpreting(), IEEE_FP32=x.dtype == torch.float32,
    )
    ### END SOLUTION
    return out


# %% exercise="ch03.1" role="test"
graders.check("ch03.1", sgmv_shrink)

# %% [markdown]
# The book's reference (printed once your answer passed). Its kernel has one more constant,
# `STACK_NUM`, for the fused q/k/v and gate/up projections of a later chapter (N becomes
# `STACK_NUM * rank`), and its wrapper checks shapes and devices before launching:

# %%
graders.show_reference("ch03.1")

# %% [markdown]
# ## 4. SGMV expand
#
# The expand adds, for every segment, `scalings[s] * t[rows, :r] @ B_stack[s, :, :r].T` into the base
# output `out` `[num_tokens, out_dim]`. Its GEMMs have the opposite shape of the shrink's: K is the
# rank (small) and N is the output width (large, 4096 or 14336 for Llama-3-8B). So the grid tiles N
# (`cdiv(out_dim, BLOCK_N)` column tiles, times row tiles, times segments), and the loop over K is
# short, usually a single step.
#
# Three things differ from the shrink:
#
# - **K is the rank, masked.** The K block is `max(16, next_power_of_2(max_rank))` (section 2.2) and
#   the lanes past the slot's rank load zeros (`offs_k < rank`): neither `t[:, r:]` nor
#   `B_stack[s, :, r:]` may enter the sum (they hold NaN in the graders' cases).
# - **Read-modify-write.** The kernel loads the tile of `out`, adds `scaling * acc` in fp32, and stores
#   the sum in `out.dtype`. The base layer computed `out` and never learns that LoRA exists. As in the
#   shrink, every element of `out` belongs to one program, so the read-modify-write needs no atomics.
# - **Rank 0 writes nothing.** A program of a rank-0 segment returns before touching `out`, so the base
#   model's rows keep their bits exactly (adding a computed zero would too, but only if nothing past
#   the rank leaked in, and it costs a read and a write of the whole row).
#
# The scaling is loaded per slot (`scalings[slot]`, fp32) and applied once, here.
#
# ### Exercise ch03.2: sgmv_expand
#
# `sgmv_expand(t, B_stack, batch_info, out) -> out`: the kernel `_sgmv_expand_kernel` (signature
# given) and its wrapper.
#
# - Semantics: chapter 02's `sgmv_expand` (`reference.ops.torch_ref.sgmv_expand` with one slice).
#   `t`: `[num_tokens, >= max_rank]` (junk past each token's rank; it may have more columns than
#   `max_rank`, so address it with its strides); `B_stack`:
#   `[num_slots, out_dim, max_rank]`; `out`: `[num_tokens, out_dim]`, the base output.
# - For every segment `i`, with `s`, `r` and `rows` as in ch03.1:
#   `out[rows] += scalings[s] * t[rows, :r] @ B_stack[s, :, :r].T`, accumulated in fp32, written in
#   `out.dtype`, read and written at the permuted rows `rows` as in ch03.1. Rows of rank-0 segments
#   and of empty segments stay exactly as they were. Never let `t[rows, r:]` or `B_stack[s, :, r:]`
#   into the arithmetic (NaN or a large finite junk there).
# - One launch, grid from host values; return `out` without launching when there are no segments or
#   `max_len == 0`.
# - Suggested blocks: `BLOCK_M = 32`, `BLOCK_N = 128`, `BLOCK_K = max(16, triton.next_power_of_2(max_rank))`,
#   `num_n_tiles = cdiv(out_dim, BLOCK_N)`; `UPCAST` and `IEEE_FP32` as in ch03.1. The graders' cases
#   have `out_dim` of a few hundred (never a multiple of 128), ranks above 16 and 32, and segments
#   longer than 64 tokens.
# - In place: update `out` and return it; do not modify the other inputs.

# %% exercise="ch03.2" role="answer"
import torch
import triton
import triton.language as tl
from reference.device import interpreting


@triton.jit
def _sgmv_expand_kernel(
    # pointers
    t_ptr, b_ptr, out_ptr,
    # sizes
    N, num_n_tiles,
    # strides
    stride_tm, stride_tk, stride_bs, stride_bn, stride_bk, stride_om, stride_on,
    # batch metadata
    seg_indptr_ptr, weight_indices_ptr, lora_ranks_ptr, scalings_ptr, permutation_ptr,
    # constexpr
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,
):
    """Program (pid, seg): rows pid_m*BLOCK_M.. of segment seg, columns pid_n*BLOCK_N.. of out."""
    ### BEGIN SOLUTION
    # 1. map the program to its tile; a rank-0 segment writes nothing at all
    seg = tl.program_id(1)
    pid_m = tl.program_id(0) // num_n_tiles
    pid_n = tl.program_id(0) % num_n_tiles
    slot = tl.load(weight_indices_ptr + seg)
    rank = tl.load(lora_ranks_ptr + slot)  # K of this segment's GEMM
    start = tl.load(seg_indptr_ptr + seg)
    seg_len = tl.load(seg_indptr_ptr + seg + 1) - start
    if (rank == 0) | (pid_m * BLOCK_M >= seg_len):
        return
    scaling = tl.load(scalings_ptr + slot)
    # 2. build pointers: t's first columns, B's first columns read as B^T
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < seg_len
    n_mask = offs_n < N
    if HAS_PERMUTATION:
        rows = tl.load(permutation_ptr + start + offs_m, mask=m_mask, other=0)
    else:
        rows = start + offs_m
    t_ptrs = t_ptr + rows[:, None] * stride_tm + offs_k[None, :] * stride_tk  # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + slot * stride_bs + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk  # [BLOCK_K, BLOCK_N]
    # 3. loop over K = the rank, in masked blocks of at least 16 (usually a single step)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(rank, BLOCK_K)):
        k_mask = offs_k < rank - k * BLOCK_K  # t and B past the rank never enter the sum
        t_tile = tl.load(t_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b_tile = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            t_tile = t_tile.to(tl.float32)
            b_tile = b_tile.to(tl.float32)
        if IEEE_FP32:
            acc += tl.dot(t_tile, b_tile, input_precision="ieee")
        else:
            acc += tl.dot(t_tile, b_tile)
        t_ptrs += BLOCK_K * stride_tk
        b_ptrs += BLOCK_K * stride_bk
    # 4. write back: read the base output, add the scaled delta in fp32, store in out's dtype
    out_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + scaling * acc).to(out_ptr.dtype.element_ty), mask=mask)
    ### END SOLUTION


def sgmv_expand(
    t: torch.Tensor,  # [num_tokens, >= max_rank]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out], the base output, updated in place
) -> torch.Tensor:
    """SGMV expand in one launch.

    Semantics:
        for seg: rows, s, r as in sgmv_shrink
                 out[rows] += scalings[s] * t[rows, :r] @ B_stack[s, :, :r].T
    Rank 0 adds exactly nothing. Returns out.
    """
    ### BEGIN SOLUTION
    if batch_info.num_segments == 0 or batch_info.max_len == 0:
        return out
    n = out.shape[1]
    block_m, block_n = 32, 128
    block_k = max(16, triton.next_power_of_2(B_stack.shape[2]))  # one masked step covers max_rank
    num_n_tiles = triton.cdiv(n, block_n)
    grid = (triton.cdiv(batch_info.max_len, block_m) * num_n_tiles, batch_info.num_segments)
    perm = batch_info.permutation
    _sgmv_expand_kernel[grid](
        t, B_stack, out,
        n, num_n_tiles,
        t.stride(0), t.stride(1), B_stack.stride(0), B_stack.stride(1), B_stack.stride(2),
        out.stride(0), out.stride(1),
        batch_info.seg_indptr, batch_info.weight_indices, batch_info.lora_ranks, batch_info.scalings,
        perm if perm is not None else batch_info.seg_indptr,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_PERMUTATION=perm is not None, UPCAST=interpreting(), IEEE_FP32=t.dtype == torch.float32,
    )
    ### END SOLUTION
    return out


# %% exercise="ch03.2" role="test"
graders.check("ch03.2", sgmv_expand)

# %% [markdown]
# The book's reference (printed once your answer passed) adds slices for fused projections (a third
# grid axis; each slice reads its part of `t` at `part * rank` and writes its own range of output
# columns, given as scalars so that a CUDA graph can capture the launch):

# %%
graders.show_reference("ch03.2")

# %% [markdown]
# Shrink then expand, end to end, with the reference's Triton ops: chapter 02's mixed batch (five slots
# of ranks 16, 4, 0, 8, 0 with NaN in every padding; six requests arriving out of slot order), grouped
# by slot through a permutation, in fp32 and fp16, against `torch_ref.lora_loop`.

# %%
def mixed_batch(dtype, seed=2):
    ranks, scalings, max_rank, d_in, d_out = [16, 4, 0, 8, 0], [0.5, 2.0, 0.0, 1.0, 0.0], 16, 40, 24
    lens, slots = [4, 1, 7, 1, 3, 2], [3, 2, 0, 1, 3, 0]
    g = torch.Generator().manual_seed(seed)
    A = torch.full((len(ranks), max_rank, d_in), NAN)
    B = torch.full((len(ranks), d_out, max_rank), NAN)
    for s, r in enumerate(ranks):
        A[s, :r] = torch.randn(r, d_in, generator=g) / d_in**0.5
        B[s, :, :r] = torch.randn(d_out, r, generator=g) / max(r, 1) ** 0.5
    n = sum(lens)
    x, base = torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
    req_info = build_batch_info(lens, slots, ranks, scalings, "cpu")
    perm, _ = stable_sort_by_slot(req_info.token_slots)
    groups, counts = torch.unique_consecutive(req_info.token_slots[perm], return_counts=True)
    info = build_batch_info(counts.tolist(), groups.tolist(), ranks, scalings, device, perm)
    move = lambda t: t.to(dtype).to(device)  # noqa: E731
    return move(x), move(A), move(B), info, req_info, move(base), max_rank


for dtype in (torch.float32, torch.float16):
    x, A, B, info, req_info, base, max_rank = mixed_batch(dtype)
    t = torch.full((x.shape[0], max_rank), NAN, dtype=dtype, device=device)  # unspecified columns stay NaN
    ref_sgmv_shrink.sgmv_shrink(x, A, info, t)
    got = ref_sgmv_expand.sgmv_expand(t, B, info, base.clone())
    expected = torch_ref.lora_loop(x.cpu(), A.cpu(), B.cpu(), req_info, base.cpu().clone())
    base_rows = req_info.token_slots.to(device) == 2  # slot 2 holds the base model
    print(f"{str(dtype):14} {info.num_segments} slot segments, permutation {info.permutation.tolist()}")
    print(f"{'':14} max |Triton - lora_loop| = {(got.cpu().float() - expected.float()).abs().max().item():.2e}; "
          f"base-model rows unchanged bit for bit: {torch.equal(got[base_rows], base[base_rows])}")

# %% [markdown]
# ## 5. BGMV for decode
#
# In a decode step every request contributes one token, so a "segment" is one row and an SGMV tile of
# `BLOCK_M = 32` rows would hold one useful row. BGMV gives every **token** its own program instead:
# it reads `token_slots[tok]`, the slot's rank, and computes a matrix-vector product (GEMV):
# `t[tok, :r] = A[slot, :r] @ x[tok]` for the shrink, `out[tok] += s * B[slot, :, :r] @ t[tok, :r]` for
# the expand.
#
# With one row per program (M = 1) there is nothing for `tl.dot` to tile: the product is an
# elementwise multiply of a `[BLOCK_N, BLOCK_K]` weight tile by the broadcast row, then a sum over K
# (`tl.sum(a_tile * x_row[None, :], axis=1)`). Padding M to 16 rows for a dot would make the tensor
# cores multiply 15 rows of zeros, and would not help anyway: a GEMV is limited by memory. Every
# weight loaded is used for one multiply-add per token, and at 2 bytes per bf16 weight, the
# arithmetic intensity is about one FLOP per byte. The cell compares that with the H200's balance
# point, from NVIDIA's H200 datasheet (dense bf16 Tensor Core throughput about 989 TFLOP/s, the
# datasheet's 1,979 TFLOP/s being with sparsity; memory bandwidth 4.8 TB/s).

# %%
H200_BF16_DENSE_FLOPS = 1979e12 / 2  # NVIDIA H200 datasheet: 1,979 TFLOPS bf16 "with sparsity"; dense is half
H200_HBM_BYTES_PER_S = 4.8e12  # NVIDIA H200 datasheet: 4.8 TB/s of HBM3e
hidden, rank, el = 4096, 16, 2
flops = 2 * rank * hidden  # one token's shrink
bytes_moved = el * (rank * hidden + hidden + rank)  # its adapter's A, its x row, its t row
print(f"bgmv shrink, one token, hidden {hidden}, rank {rank}: {flops:,} FLOPs / {bytes_moved:,} bytes "
      f"= {flops / bytes_moved:.2f} FLOP per byte")
print(f"H200 balance point: {H200_BF16_DENSE_FLOPS / H200_HBM_BYTES_PER_S:.0f} FLOP per byte "
      "(below it a kernel is limited by memory, not arithmetic)")

# %% [markdown]
# The reference's BGMV shrink. Note that it casts every load to fp32 (so no `UPCAST` flag is needed)
# and that the mask on A's rows is the rank clip:

# %%
print(inspect.getsource(ref_bgmv_shrink._bgmv_shrink_kernel.fn))

# %% [markdown]
# Run on a decode batch: nine tokens (nine requests of one token) on slots of ranks 0, 1, 7 and 16,
# NaN in every padding, shrink and expand as two launches, against the torch references:

# %%
def decode_batch(dtype, seed=1, slots=(1, 2, 0, 3, 3, 2, 0, 1, 3), d_in=72, d_out=40):
    ranks, max_rank = [0, 1, 7, 16], 16
    g = torch.Generator().manual_seed(seed)
    A = torch.full((len(ranks), max_rank, d_in), NAN)
    B = torch.full((len(ranks), d_out, max_rank), NAN)
    for s, r in enumerate(ranks):
        A[s, :r] = torch.randn(r, d_in, generator=g) / d_in**0.5
        B[s, :, :r] = torch.randn(d_out, r, generator=g) / max(r, 1) ** 0.5
    info = build_batch_info([1] * len(slots), list(slots), ranks, [0.0, 2.0, 0.5, 1.0], device)
    x, base = torch.randn(len(slots), d_in, generator=g), torch.randn(len(slots), d_out, generator=g)
    move = lambda t: t.to(dtype).to(device)  # noqa: E731
    return move(x), move(A), move(B), info, move(base), max_rank


x, A, B, info, base, max_rank = decode_batch(torch.float32)
t = ref_bgmv_shrink.bgmv_shrink(x, A, info, torch.full((x.shape[0], max_rank), NAN, device=device))
t_ref = torch_ref.bgmv_shrink(x, A, info, torch.full((x.shape[0], max_rank), NAN, device=device))
defined = ~torch.isnan(t_ref)
print(f"token_slots {info.token_slots.tolist()}, ranks of the slots {info.lora_ranks.tolist()}")
print(f"shrink: same defined region as torch_ref: {torch.equal(~torch.isnan(t), defined)}; "
      f"max error there {(t[defined] - t_ref[defined]).abs().max().item():.2e}")
out = ref_bgmv_expand.bgmv_expand(t_ref, B, info, base.clone())
print(f"expand: max error {(out - torch_ref.bgmv_expand(t_ref, B, info, base.clone())).abs().max().item():.2e}")

# %% [markdown]
# ## 6. Why decode is launch-bound
#
# How long should a decode step's LoRA take? Count the bytes each op must move, each byte once
# (caches ignored), at 64 requests spread over 8 adapters, hidden size 4096, rank 16, bf16:
#
# - shrink: read `x` (64 rows of 4096), read A of each **distinct** adapter (8 of `16 x 4096`),
#   write `t` (64 x 16);
# - expand: read `t`, read B of each distinct adapter (8 of `4096 x 16`), read and write the base
#   output (64 x 4096, twice).
#
# (BGMV reads an adapter once per token in principle; tokens of one adapter find it in the L2 cache
# after the first, so the distinct count is the right one for HBM traffic.) The time at the H200's
# 4.8 TB/s (NVIDIA H200 datasheet) is a lower bound.

# %%
def lora_bytes(n_tokens, n_adapters, d_in, d_out, rank, el=2):
    """Bytes moved by shrink, expand, and a fused kernel (t stays on the chip); every byte once."""
    shrink = el * (n_tokens * d_in + n_adapters * rank * d_in + n_tokens * rank)  # x, distinct A, t written
    expand = el * (n_tokens * rank + n_adapters * d_out * rank + 2 * n_tokens * d_out)  # t, distinct B, out r+w
    fused = shrink + expand - 2 * el * n_tokens * rank  # no t round trip
    return {"shrink": shrink, "expand": expand, "fused": fused}


decode = lora_bytes(n_tokens=64, n_adapters=8, d_in=4096, d_out=4096, rank=16)
for op, b in decode.items():
    print(f"{op:7s} {b:>10,} bytes = {b / 1e6:.2f} MB -> {b / H200_HBM_BYTES_PER_S * 1e6:.2f} us at 4.8 TB/s")
two_kernels = decode["shrink"] + decode["expand"]
print(f"shrink + expand: {two_kernels / H200_HBM_BYTES_PER_S * 1e6:.2f} us of memory traffic; "
      f"fusing saves {two_kernels - decode['fused']:,} bytes ({(two_kernels - decode['fused']) / two_kernels:.2%})")

# %% [markdown]
# Under a microsecond of memory traffic for both kernels together. Against that stands the cost of
# launching a kernel at all: the host's work (Python, the Triton launcher, the driver call) and the
# GPU's gap between two dependent kernels. vLLM's `vllm/lora/ops/triton_ops/lora_fused_op.py` (a
# recent version) puts the "inter-op scheduling gap" between separately launched shrink and expand ops
# at "~5-10us". Whatever the exact figure on a given machine, it is several times the bytes' time:
# **decode LoRA is launch-bound**, and the number of kernels matters more than their bandwidth.
#
# A whole decode step multiplies this: every adapted projection of every layer launches its own
# shrink and expand. The cell sums Llama-3-8B's seven projections over its layers (k and v are 1024
# wide, the MLP 14336) and compares the traffic with the launches, at the low end of vLLM's range.

# %%
cfg = lora_math.LLAMA3_8B_CONFIG
layers = cfg["num_hidden_layers"]
step_bytes = 0
for name, (d_in, d_out) in lora_math.projection_shapes(cfg).items():
    if name in lora_math.LLAMA_PROJECTIONS:
        b = lora_bytes(64, 8, d_in, d_out, 16)
        step_bytes += layers * (b["shrink"] + b["expand"])
launches = 2 * len(lora_math.LLAMA_PROJECTIONS) * layers
gap_us = 5.0  # the low end of vLLM's "~5-10us" (lora_fused_op.py)
print(f"Llama-3-8B decode step, 64 requests, 8 adapters, rank 16: LoRA moves {step_bytes / 1e6:.0f} MB "
      f"-> {step_bytes / H200_HBM_BYTES_PER_S * 1e6:.0f} us at 4.8 TB/s")
print(f"{launches} LoRA launches x {gap_us:g} us = {launches * gap_us:.0f} us; "
      f"fused (one kernel per projection): {launches // 2 * gap_us:.0f} us")

# %% [markdown]
# Two remedies, which combine:
#
# - **Fuse shrink and expand into one kernel.** One launch instead of two per projection, and the
#   second kernel no longer waits for the first. The intermediate `t` stays in registers: the bytes it
#   saves are negligible (printed above), the launch it saves is not. The price: a program must do
#   both GEMVs for its tokens, so the work is split differently (section 7).
# - **Capture CUDA graphs.** A graph records a whole decode step's kernels once and replays them with
#   one host call, so the host's per-launch work disappears (Python and the Triton launcher included).
#   What it freezes must stay put: pointers (preallocated `out`, metadata tensors updated in place),
#   shapes and grids (batch sizes bucketed; our grids come from host ints for exactly this reason).
#   A later chapter captures the book's decode path. The GPU still runs the kernels one after another,
#   so fusing still pays inside a graph.
#
# (vLLM's `lora_fused_op.py`, despite its name, keeps two kernels and overlaps them with Programmatic
# Dependent Launch on Hopper GPUs: the expand starts loading its B weights while the shrink finishes.)
#
# ## 7. A fused decode kernel
#
# `fused_decode(x, A_stack, B_stack, batch_info, out)` does BGMV shrink and BGMV expand in one launch.
# The simplest schedule gives each program one token and a share of the output columns:
#
# ```
# grid = (num_tokens, num_splits)          # num_splits programs share one token's out_dim columns
# program (tok, split):
#     slot = token_slots[tok]; r = lora_ranks[slot]; return if r == 0
#     t = A[slot, :r] @ x[tok]             # GEMV over K = in, fp32, kept in registers
#     t = round(t to x.dtype)              # as the two-kernel path stores t in x.dtype
#     for each BLOCK_N columns of this split, clipped to the split's own end:
#         cols = columns of the block that are < min((split + 1) * n_per_split, out_dim)
#         out[tok, cols] += scalings[slot] * B[slot, cols, :r] @ t      # GEMV over K = r, read-modify-write
# ```
#
# Every split recomputes the token's (small) shrink: `num_splits` programs read the same adapter's A,
# from the L2 cache after the first. In exchange there are `num_tokens * num_splits` programs in flight
# instead of `num_tokens`: 64 programs would be fewer than an H200 has streaming multiprocessors (132
# on the H100 SXM5 by NVIDIA's H100 architecture whitepaper; the H200 uses the same GPU). The
# reference also has a second schedule (`schedule="slot"`), one program per (slot, split), that reads
# each adapter's A once for all its tokens with a masked `tl.dot` over a block of token rows.
#
# ### Exercise ch03.3: fused_decode
#
# `fused_decode(x, A_stack, B_stack, batch_info, out) -> out`: the kernel `_fused_decode_kernel`
# (signature given) and its wrapper.
#
# - Semantics: `reference.ops.torch_ref.fused_decode`: for every token, with
#   `s = token_slots[tok]` and `r = lora_ranks[s]`:
#   `out[tok] += scalings[s] * (x[tok] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T`, both products
#   accumulated in fp32, **the intermediate rounded to `x.dtype`** (as `torch_ref.bgmv_shrink` writes
#   it into a tensor of `x.dtype`), the result written in `out.dtype`. A grader case checks the
#   rounding: in fp16, with `x[:, 0]` near 1000 where fp16 keeps steps of 0.5, a rounded and an
#   unrounded intermediate give results at least 0.125 apart.
# - `x`: `[num_tokens, in]`; `A_stack`: `[num_slots, max_rank, in]`; `B_stack`:
#   `[num_slots, out_dim, max_rank]`; `out`: `[num_tokens, out_dim]`, the base output. Reads only
#   `batch_info.token_slots`, `lora_ranks` and `scalings` (never the segments: in the graders' batches
#   they are grouped by slot or cut into chunks, not in x's row order).
# - Rank-0 tokens: their rows stay exactly as they were. Never read past a slot's rank.
# - **One launch**: shrink and expand in the same kernel; the intermediate never goes to memory.
#   Return `out` without launching when `num_tokens == 0`.
# - Suggested: `BLOCK_R = max(16, triton.next_power_of_2(max_rank))`, `BLOCK_K = 512`,
#   `BLOCK_N = 256`, `num_splits = max(1, min(4, cdiv(out_dim, BLOCK_N)))`,
#   `n_per_split = cdiv(out_dim, num_splits)`. Use multiply and `tl.sum` (M = 1), loads cast to fp32.
# - Program `(tok, split)` owns the columns `[split * n_per_split, min((split + 1) * n_per_split,
#   out_dim))`: **clip every column block to the split's own end**, not only to `out_dim`. A block of
#   `BLOCK_N` columns can stick out of its split (`n_per_split` is rarely a multiple of `BLOCK_N`),
#   and the columns it sticks into belong to the next split, which adds its own delta there. The
#   graders' cases cross this: `out_dim` of about 300 (two splits of fewer than 256 columns) and about
#   1100 (two column blocks per split), `in` above 1024, `max_rank` 32 and 64.
# - In place: update `out` and return it; do not modify the other inputs.

# %% exercise="ch03.3" role="answer"
import torch
import triton
import triton.language as tl
from reference.device import interpreting  # not needed here: a GEMV casts every load to fp32 anyway


@triton.jit
def _fused_decode_kernel(
    # pointers
    x_ptr, a_ptr, b_ptr, out_ptr,
    # sizes
    K, N, n_per_split,
    # strides
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_bs, stride_bn, stride_br,
    stride_om, stride_on,
    # batch metadata
    token_slots_ptr, lora_ranks_ptr, scalings_ptr,
    # constexpr
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program (tok, split): token tok, output columns [split * n_per_split, (split + 1) * n_per_split)."""
    ### BEGIN SOLUTION
    # 1. map the program to (token, column split); a rank-0 token writes nothing
    tok = tl.program_id(0)
    split = tl.program_id(1)
    slot = tl.load(token_slots_ptr + tok)
    rank = tl.load(lora_ranks_ptr + slot)
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank  # A's rows and B's columns past the rank are never read
    # 2-3. shrink: t = A[slot, :r] @ x[tok], a GEMV over K (multiply, then sum the rows)
    offs_k = tl.arange(0, BLOCK_K)
    acc_t = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        x_row = tl.load(x_ptr + tok * stride_xm + (k * BLOCK_K + offs_k) * stride_xk, mask=k_mask, other=0.0)
        a_ptrs = a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + (k * BLOCK_K + offs_k)[None, :] * stride_ak
        a_tile = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_K]
        acc_t += tl.sum(a_tile.to(tl.float32) * x_row.to(tl.float32)[None, :], axis=1)
    t = acc_t.to(x_ptr.dtype.element_ty).to(tl.float32)  # the rounding of the two-kernel path; stays on chip
    scaling = tl.load(scalings_ptr + slot)
    # 2-4. expand this program's columns: out[tok, cols] += scaling * B[slot, cols, :r] @ t, in place
    n_start = split * n_per_split
    for n in range(0, tl.cdiv(n_per_split, BLOCK_N)):
        offs_n = n_start + n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = (offs_n < N) & (offs_n < n_start + n_per_split)
        b_ptrs = b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br  # [BLOCK_N, BLOCK_R]
        b_tile = tl.load(b_ptrs, mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        delta = tl.sum(b_tile.to(tl.float32) * t[None, :], axis=1)
        out_ptrs = out_ptr + tok * stride_om + offs_n * stride_on
        base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (base + scaling * delta).to(out_ptr.dtype.element_ty), mask=n_mask)
    ### END SOLUTION


def fused_decode(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out, max_rank]
    batch_info: "LoRABatchInfo",
    out: torch.Tensor,  # [num_tokens, out], the base output, updated in place
) -> torch.Tensor:
    """Decode LoRA, shrink and expand in one launch.

    Semantics:
        s = token_slots[tok]; r = lora_ranks[s]
        out[tok] += scalings[s] * round_to_x_dtype(x[tok] @ A_stack[s, :r].T) @ B_stack[s, :, :r].T
    Rank 0 adds exactly nothing. Returns out.
    """
    ### BEGIN SOLUTION
    num_tokens, n = x.shape[0], out.shape[1]
    if num_tokens == 0:
        return out
    block_k, block_n = 512, 256
    splits = max(1, min(4, triton.cdiv(n, block_n)))  # more programs in flight; each redoes the small shrink
    n_per_split = triton.cdiv(n, splits)
    _fused_decode_kernel[(num_tokens, splits)](
        x, A_stack, B_stack, out,
        x.shape[1], n, n_per_split,
        x.stride(0), x.stride(1), A_stack.stride(0), A_stack.stride(1), A_stack.stride(2),
        B_stack.stride(0), B_stack.stride(1), B_stack.stride(2), out.stride(0), out.stride(1),
        batch_info.token_slots, batch_info.lora_ranks, batch_info.scalings,
        BLOCK_R=max(16, triton.next_power_of_2(A_stack.shape[1])), BLOCK_K=block_k, BLOCK_N=block_n,
    )
    ### END SOLUTION
    return out


# %% exercise="ch03.3" role="test"
graders.check("ch03.3", fused_decode)

# %% [markdown]
# The book's reference (printed once your answer passed): the per-token schedule and the wrapper that
# chooses between the two schedules:

# %%
graders.show_reference("ch03.3")

# %% [markdown]
# Both schedules against the two-launch path, on the decode batch of section 5 in fp32 and fp16 (the
# slot schedule with 16-token blocks and two column splits so that this small batch exercises them):

# %%
for dtype in (torch.float32, torch.float16):
    x, A, B, info, base, max_rank = decode_batch(dtype)
    expected = torch_ref.fused_decode(x, A, B, info, base.clone())
    rank0 = info.token_slots == 0
    for schedule, kwargs in [("token", {}), ("slot", dict(block_t=16, num_splits=2, block_n=16, block_k=64))]:
        got = ref_fused_decode.fused_decode(x, A, B, info, base.clone(), schedule=schedule, **kwargs)
        print(f"{str(dtype):14} schedule {schedule!r:8}: max error {(got.float() - expected.float()).abs().max().item():.2e}, "
              f"rank-0 rows unchanged: {torch.equal(got[rank0], base[rank0])}")

# %% [markdown]
# ## 8. Measured on an H200
#
# `benchmarks/benchmark_lora_ops.py` times the book's reference kernels on a GPU and writes
# `benchmarks/results/lora_ops_<gpu>.json`; the cell prints what is committed. Method (from the
# script): every op is captured in a CUDA graph and timed by replaying it
# (`triton.testing.do_bench`, median, L2 cleared before every run); bytes by the accounting of
# section 6; GB/s against the bandwidth of a 1 GiB device-to-device copy measured in the same run
# (the fastest of three ways of copying, all printed: a `copy_` captured in a graph becomes a memcpy
# node, which runs well below what a kernel reaches, so it cannot be the ceiling); the LoRA op's time
# against the base projection's own bf16 GEMM, also graph-timed.

# %%
results_dir = Path(reference.__file__).resolve().parents[1] / "benchmarks" / "results"
result_files = sorted(results_dir.glob("lora_ops_*.json"))
if not result_files:
    print(f"No benchmark results are committed yet ({results_dir.name}/lora_ops_*.json not found).")
    print("On a GPU: python benchmarks/benchmark_lora_ops.py writes one.")
for path in result_files:
    res = json.loads(path.read_text())
    print(f"{path.name}: {res['device']}, torch {res.get('torch')}, triton {res.get('triton')}; "
          f"copy bandwidth {res['copy_bandwidth_gbps']:.0f} GB/s ({res.get('method', '')})")
    if res.get("copy_bandwidths_gbps"):
        print("copy, GB/s:", ", ".join(f"{k} {v:.0f}" for k, v in res["copy_bandwidths_gbps"].items()))
    if res.get("note"):
        print("note:", res["note"])
    print(f"{'case':40s} {'op':7s} {'us':>8s} {'MB':>7s} {'GB/s':>7s} {'%copy':>6s} {'%base GEMM':>10s}")
    for row in res["rows"]:
        print(f"{row['case']:40s} {row['op']:7s} {row['us']:8.1f} {row['bytes'] / 1e6:7.2f} {row['gbps']:7.0f} "
              f"{100 * row['frac_copy']:5.0f}% {100 * row['frac_base']:9.0f}%")
    decode = {(r["n_req"], r["adapters"], r["op"]): r for r in res["rows"] if r["kind"] == "decode"}
    cases = sorted({(n, d) for n, d, _ in decode})
    if cases:
        print("\ndecode: two launches against one, and the fused kernel's bytes at the copy bandwidth")
        print(f"{'requests':>8s} {'adapters':>8s} {'shrink + expand us':>18s} {'fused us':>8s} {'bytes-time us':>13s} {'ratio':>6s}")
    for n, d in cases:
        shrink, expand, fused = (decode.get((n, d, op)) for op in ("shrink", "expand", "fused"))
        if not (shrink and expand and fused):
            continue
        floor = fused["bytes"] / (res["copy_bandwidth_gbps"] * 1e9) * 1e6
        print(f"{n:8d} {d:8d} {shrink['us'] + expand['us']:18.1f} {fused['us']:8.1f} {floor:13.2f} "
              f"{fused['us'] / floor:5.0f}x")

# %% [markdown]
# The same results as a figure (made by `figures/src/lora_ops_benchmark.py` from the committed file):
#
# ![The book's Triton LoRA ops on an H200: prefill ops as a fraction of copy bandwidth (left), decode ops in microseconds against the base projection's GEMM (right)](lora_ops_benchmark.png)
#
# How to read the table:
#
# - **Prefill** (thousands of tokens): the kernels move tens of megabytes and should run near the copy
#   bandwidth (the `%copy` column, relative to the copy measured in the same run; the hardware's
#   ceiling is the datasheet's 4.8 TB/s, so read the GB/s column against that too); the LoRA ops
#   should cost a small fraction of the base GEMM (`%base GEMM`).
# - **Decode**: the last table puts the fused kernel's time next to its bytes' time at the copy
#   bandwidth. The ratio measures the launch-bound regime of section 6, inside a CUDA graph, so
#   without the host's share. Then compare the fused kernel with shrink + expand: the gap is what one
#   launch instead of two buys. As requests grow, look at the per-token schedule's cost: the
#   programs of every token read their adapter's whole A again (from the L2 cache at best), so that
#   work grows with the requests instead of the adapters. The wrapper's defaults therefore follow the
#   batch size (several programs per token for a few tokens, one per token for hundreds; from the
#   sweep in `benchmarks/results/fused_decode_sweep_h200.json`); the reference's "slot" schedule,
#   and SGMV for prefill, group tokens by adapter instead, which in that sweep did not pay off at
#   these sizes.
#
# ## 9. How production systems do it
#
# - **Punica** (Chen et al., 2023, arXiv:2310.18547; `punica-ai/punica`) named BGMV and SGMV. Its
#   kernels are CUDA C++, not Triton: `csrc/bgmv/` holds a BGMV kernel template instantiated for a
#   fixed list of (input, output) widths and ranks 8 to 64 (`bgmv_config.h`), `csrc/sgmv/` an SGMV on
#   CUTLASS and `csrc/sgmv_flashinfer/` one from FlashInfer. Fixed widths are the price of hand-written
#   CUDA; Triton compiles a kernel per value of its `constexpr`s on demand.
# - **SGLang**, `python/sglang/srt/lora/triton_ops/`:
#   - `sgemm_lora_a.py`, the SGMV shrink: grid (row tiles of the longest segment x N tiles, `bs`), the
#     segment's slot from `weight_indices`, N clipped to `rank * stack_num`, an early return on rank 0,
#     the permutation behind a compile-time flag (chapter 02).
#   - `sgemm_lora_b.py`, the SGMV expand: adds into `base_output` when one is given
#     (`fuse_scaling_add`, a read-modify-write); in the versions we read, its K block (`BLOCK_R`) is
#     16, the smallest a GPU dot accepts. `qkv_lora_b.py` (and `gate_up_lora_b.py`) expand into the
#     q, k and v column ranges of a fused projection, q wider than k and v under GQA.
#   - `chunked_sgmv_shrink.py` / `chunked_sgmv_expand.py`, the default backend (`csgmv`): segments
#     are cut into chunks, one program covers a whole segment (`BLOCK_M` is the batch's `max_len`, at
#     most one chunk), the grid is (N tiles, segments), and under CUDA graphs the grid is sized for the
#     batch size and a program with `pid_s >= num_segs` returns at once.
# - **vLLM**, `vllm/lora/ops/triton_ops/`:
#   - `lora_shrink_op.py`: grid (`SPLIT_K` x row tiles x N tiles, slices, active adapters), one
#     "segment" per active adapter, rows through `token_indices_sorted_by_lora_ids` (the permutation),
#     an early exit for `lora_id == -1`. The shrink's N is small and its K long, so vLLM splits K
#     across programs and sums their partial results with `tl.atomic_add` into a zeroed output
#     (`kernel_utils.py`, `do_shrink_kernel`). Rows past the end of an adapter's tokens are avoided
#     without a mask: `offset_m = tl.arange(0, BLOCK_M) % cta_m_len` re-reads valid rows instead. The
#     wrapper accepts only fp16 and bf16 inputs.
#   - `lora_expand_op.py`: the expand, with `ADD_INPUTS` for the read-modify-write and no split-K
#     (`do_expand_kernel` in `kernel_utils.py`: "the K dimension is assumed to be small"); a constexpr
#     `EVEN_K` drops the K masks when the K block divides K.
#   - `lora_fused_op.py`: shrink and expand from one custom op, launched back to back with
#     Programmatic Dependent Launch on Hopper, to hide the gap between them (section 6).
#   - Block sizes come from tuned JSON tables per GPU (`configs/NVIDIA_H100_80GB_HBM3_SHRINK.json`
#     and similar), as the book's benchmark writes `benchmarks/results/tuned_configs.json`.
#
# ## Summary
#
# - One Triton launch replaces chapter 02's host loop: the grid comes from host ints (`max_len`,
#   `num_segments`, shapes), and each program finds its own segment's slot, rank and scaling on the
#   device, then runs four phases: map the program to its tile, build pointers, loop over K, write
#   back.
# - SGMV shrink: grid (row tiles x rank tiles, segments); early return on rank 0, on tiles past the
#   segment, on columns past the rank; masks clip N to the rank; an optional permutation maps sorted
#   rows to `x`'s rows. SGMV expand: K is the rank, in a masked block of at least 16; the scaled delta
#   is added into the base output by a read-modify-write; rank 0 writes nothing.
# - BGMV serves decode: a GEMV per token, multiply and row-sum, memory-bound by far.
# - The interpreter differs from the GPU in four ways: bf16 arithmetic (cast to fp32 after loading
#   under `UPCAST`), `tl.dot` sizes (K >= 16 on the GPU), unchecked loads (mask everything), fp32
#   dots (TF32 on the GPU unless `input_precision="ieee"`).
# - Decode LoRA moves a few megabytes per projection, under a microsecond at HBM speed, and is bound
#   by launches: fusing shrink and expand halves them, CUDA graphs remove the host's share.
#
# ## Review questions
#
# 1. Your shrink kernel passes every test in the interpreter, but on the GPU its bf16 results are
#    right while its fp32 results fail the tolerance. What is the most likely cause, and which line
#    fixes it?
# 2. The expand's K block is `max(16, next_power_of_2(max_rank))`. What goes wrong on a GPU if you
#    use `next_power_of_2(max_rank)` and the pool's `max_rank` is 8? What goes wrong in the graders'
#    cases if you use 16 but forget the mask `offs_k < rank`?
# 3. The shrink grid is sized by the longest segment. For a batch of one 4000-token prefill and 63
#    one-token decodes, how many programs of the grid (with `BLOCK_M = 32`, one rank tile) do
#    work, and how many return at once? What does chunked SGMV change?
# 4. Why does neither SGMV kernel need atomics for its writes, while vLLM's split-K shrink does?
# 5. In `fused_decode`, each of the `num_splits` programs of a token recomputes the same shrink. When
#    is that cheaper than a separate shrink kernel, and what would you measure to choose
#    `num_splits`?
# 6. A CUDA graph captured the expand launch (`BLOCK_M = 32`) for a batch whose longest segment had 40
#    tokens. The next batch has a 70-token segment. What happens to rows 64 to 69 of that segment, and
#    how do production systems avoid it?
