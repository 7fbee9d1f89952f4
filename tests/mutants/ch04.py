"""Wrong answers for chapter 04 (graders.course.mutation.Mutant): each is the solution cell with one realistic
change. ch04.2's tiling mutants are why its cases cross every grid axis and loop at least twice with
both the chapter's blocks (32 x 64) and the reference's at max_rank 32 / 64 (64 x 128): a segment longer than two row
tiles, slices wider than two column tiles and not multiples of 64, ranks above 16 (a K step of 16
loops) that are not multiples of 16. The old plausible mistakes (git show
3ab8fdb:submissions/plausible_mistakes/04_packed_and_chunked.py) are the ``plausible`` ones.
"""
from graders.course.mutation import Mutant

_LOOP = "for k in range(0, tl.cdiv(rank, BLOCK_K)):"
_BLOCK_K = "block_k = max(16, triton.next_power_of_2(B_stack.shape[2]))"
_KMASK = "k_mask = offs_k < rank - k * BLOCK_K"
_STORE = "(base + scaling * acc)"

MUTANTS = [
    # ---------------------------------------------------------------- ch04.1 stack_lora_parts
    Mutant("ch04.1", "missing-part-shifts-the-others",
           (("A = like.new_zeros(len(out_features) * r, d_in)", "A = like.new_zeros(len(present) * r, d_in)"),
            ("A[i * r:(i + 1) * r] = a", "k = present.index(i)  # only present parts get rows\n        A[k * r:(k + 1) * r] = a")),
           "a missing part still takes its place", "layout", plausible=True),
    Mutant("ch04.1", "A-transposed",
           (("A = like.new_zeros(len(out_features) * r, d_in)", "A = like.new_zeros(d_in, len(out_features) * r)"),
            ("A[i * r:(i + 1) * r] = a", "A[:, i * r:(i + 1) * r] = a.T")),
           "A is stacked along its rows", "layout"),
    Mutant("ch04.1", "dtype-checked-on-A-only",
           ((" or a.dtype != like.dtype or b.dtype != like.dtype:", " or a.dtype != like.dtype:"),),
           "the contract says this input raises ValueError", "error"),
    Mutant("ch04.1", "B-without-A-not-seen",
           (("if A_parts[i] is not None or B_parts[i] is not None]", "if A_parts[i] is not None]"),),
           "the contract says this input raises ValueError", "error"),
    Mutant("ch04.1", "input-width-unchecked",
           (("a.shape != (r, d_in)", "a.shape[0] != r"),),
           "raises ValueError; your function raised RuntimeError", "error"),
    Mutant("ch04.1", "lengths-checked-A-against-B-only",
           (("if not (len(A_parts) == len(B_parts) == len(out_features)):", "if len(A_parts) != len(B_parts):"),),
           "the contract says this input raises ValueError; your function returned normally", "error"),
    Mutant("ch04.1", "one-part-returns-the-inputs",
           (("    like = A_parts[present[0]]\n",
             "    if len(A_parts) == 1:  # nothing to stack\n        return A_parts[0], B_parts[0]\n"
             "    like = A_parts[present[0]]\n"),),
           "shares memory with your input", "clause"),
    Mutant("ch04.1", "zeros-without-dtype",
           (("A = like.new_zeros(len(out_features) * r, d_in)", "A = torch.zeros(len(out_features) * r, d_in, device=like.device)"),),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),

    # ---------------------------------------------------------------- ch04.2 sgmv_expand_sliced
    Mutant("ch04.2", "programs-with-pid-m-above-0-return",
           (("if (rank == 0) | (pid_m * BLOCK_M >= seg_len)", "if (rank == 0) | (pid_m > 0) | (pid_m * BLOCK_M >= seg_len)"),),
           "row tiles after the first are missing", "tiling"),
    Mutant("ch04.2", "programs-with-pid-n-above-0-return",
           (("| (lo + pid_n * BLOCK_N >= hi):", "| (pid_n > 0) | (lo + pid_n * BLOCK_N >= hi):"),),
           "column tiles after the first", "tiling"),
    Mutant("ch04.2", "grid-has-one-row-tile",
           (("grid = (triton.cdiv(batch_info.max_len, block_m) * num_n_tiles,", "grid = (num_n_tiles,"),),
           "row tiles after the first are missing", "tiling"),
    Mutant("ch04.2", "column-tiles-sized-by-the-last-slice",
           (("widest = max(b - a for a, b in zip(offs[:-1], offs[1:]))", "widest = offs[-1] - offs[-2]"),),
           "column tiles after the first", "tiling"),
    Mutant("ch04.2", "rank-block-16-without-k-loop",
           ((_BLOCK_K, "block_k = 16"), (_LOOP, "for k in range(0, 1):")),
           "only rows of slots with rank above 16 differ", "tiling"),
    Mutant("ch04.2", "k-mask-not-moved-with-the-k-step",
           ((_BLOCK_K, "block_k = 16"), (_KMASK, "k_mask = offs_k < rank")),
           "the K loop lacks its mask", "tiling"),
    Mutant("ch04.2", "slice-clipped-to-the-output-end",
           (("n_mask = offs_n < hi", "n_mask = offs_n < OFF3"),),
           "each slice clips to its own end", "tiling"),
    Mutant("ch04.2", "part-read-at-i-times-max-rank",
           (("HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr,",
             "HAS_PERMUTATION: tl.constexpr, UPCAST: tl.constexpr, IEEE_FP32: tl.constexpr, MAX_RANK: tl.constexpr,"),
            ("(part * rank + offs_k)", "(part * MAX_RANK + offs_k)"),
            ("IEEE_FP32=t.dtype == torch.float32,", "IEEE_FP32=t.dtype == torch.float32, MAX_RANK=B_stack.shape[2],")),
           "instead of i * r", "layout", plausible=True),
    Mutant("ch04.2", "slice-columns-not-offset-by-lo",
           (("offs_n = lo + pid_n * BLOCK_N + tl.arange(0, BLOCK_N)", "offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)"),),
           # (in the interpreter the hint also names the offset; on a GPU the slices' programs race on
           # the columns they share, so only the differing slices are certain)
           "the differing columns are in slice(s) q (columns 0..23)", "layout"),
    Mutant("ch04.2", "permutation-ignored",
           (("HAS_PERMUTATION=perm is not None,", "HAS_PERMUTATION=False,"),),
           "without its permutation", "layout"),
    Mutant("ch04.2", "no-k-mask",
           ((_KMASK, "k_mask = offs_k < BLOCK_K"),),
           "NaN", "poison"),
    Mutant("ch04.2", "clip-to-max-rank-and-zero-nan",
           ((_KMASK, "k_mask = offs_k < stride_bn - k * BLOCK_K  # B's row width: max_rank"),
            ("        if UPCAST:\n            t_tile = t_tile.to(tl.float32)",
             "        t_tile = tl.where(t_tile == t_tile, t_tile, 0.0)  # padding is NaN: zero it\n"
             "        b_tile = tl.where(b_tile == b_tile, b_tile, 0.0)\n"
             "        if UPCAST:\n            t_tile = t_tile.to(tl.float32)")),
           "values as large as the padding junk", "poison"),
    Mutant("ch04.2", "scaling-not-applied",
           ((_STORE, "(base + acc)"),),
           "without scalings[slot]", "math"),
    Mutant("ch04.2", "base-output-overwritten",
           ((_STORE, "(scaling * acc)"),),
           "holds the LoRA delta alone", "math"),

    # ---------------------------------------------------------------- ch04.3 merge_adjacent_segments
    Mutant("ch04.3", "merges-non-adjacent-runs",
           (("if out and out[-1] == s:\n            lens[-1] += n", "if s in out:\n            lens[out.index(s)] += n"),),
           "only neighbours merge", "layout", plausible=True),
    Mutant("ch04.3", "zero-lengths-kept",
           (("        if n == 0:\n            continue\n", ""),),
           "a zero-length segment (or chunk) is dropped", "clause"),
    Mutant("ch04.3", "zero-lengths-dropped-after-merging",
           (("        if n == 0:\n            continue\n", ""),
            ("    return lens, out", "    keep = [i for i, n in enumerate(lens) if n]\n"
                                   "    return [lens[i] for i in keep], [out[i] for i in keep]")),
           "drop the zero-length segments first", "clause"),
    Mutant("ch04.3", "negative-length-accepted",
           (("    if any(n < 0 for n in seg_lens):\n        raise ValueError(\"negative segment length\")\n", ""),),
           "the contract says this input raises ValueError; your function returned normally", "error"),
    Mutant("ch04.3", "zero-length-raises",
           (("if any(n < 0 for n in seg_lens):", "if any(n <= 0 for n in seg_lens):"),),
           "raised ValueError", "error"),
    Mutant("ch04.3", "lengths-unchecked",
           (("    if len(seg_lens) != len(slots):\n        raise ValueError(\"seg_lens and slots differ in length\")\n", ""),),
           "the contract says this input raises ValueError; your function returned normally", "error"),

    # ---------------------------------------------------------------- ch04.4 cut_into_chunks
    Mutant("ch04.4", "always-a-last-chunk",
           (("lens += [chunk_size] * full + ([rest] if rest else [])", "lens += [chunk_size] * full + [rest]"),
            ("out += [s] * (full + (1 if rest else 0))", "out += [s] * (full + 1)")),
           "expected [4, 4, 4]", "math", plausible=True),
    Mutant("ch04.4", "tops-up-the-last-chunk-across-segments",
           (("        full, rest = divmod(n, chunk_size)\n",
             "        if lens and lens[-1] < chunk_size and n:  # fill the previous chunk first\n"
             "            take = min(n, chunk_size - lens[-1])\n"
             "            lens[-1] += take\n"
             "            n -= take\n"
             "        full, rest = divmod(n, chunk_size)\n"),),
           "spans two segments", "layout"),
    Mutant("ch04.4", "remainder-first",
           (("lens += [chunk_size] * full + ([rest] if rest else [])", "lens += ([rest] if rest else []) + [chunk_size] * full"),),
           "shorter remainder last", "layout"),
    Mutant("ch04.4", "negative-chunk-size-accepted",
           (("if chunk_size < 1:", "if chunk_size == 0:"),),
           "the contract says this input raises ValueError; your function returned normally", "error"),
    Mutant("ch04.4", "chunk-size-0-divides",
           (("if chunk_size < 1:", "if chunk_size < 0:"),),
           "raised ZeroDivisionError", "error"),
    Mutant("ch04.4", "one-slot-per-segment",
           (("out += [s] * (full + (1 if rest else 0))", "out += [s]"),),
           "returned slots", "clause"),
]
