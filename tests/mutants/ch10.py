"""Wrong answers for chapter 10 (which rows a rank owns, the fully sharded A, the row-parallel and the
fully sharded column forwards), each the solution cell with one realistic edit
(graders.course.mutation.Mutant).

The collective mistakes the issue names: "A split where it must be replicated" (ch10.4 reading only
its own slice of the gathered shrink, i.e. B's matching columns: the garbled rule's repair),
"all-reduce missing" (ch10.3 both variants), "all-reduce applied twice" (ch10.3), "kv heads split
past the replication point" (ch10.1). A collective called on one branch only is the ch10.3
hang mutant: the driver must name it, not time out the whole exercise.
"""
from graders.course.mutation import Mutant

_PER = ("        if n >= tp_size and n % tp_size == 0:\n"
        "            per, first = n // tp_size, tp_rank * (n // tp_size)\n"
        "        elif n < tp_size and tp_size % n == 0:\n"
        "            per, first = 1, tp_rank // (tp_size // n)\n")
_COPY = "            out[s, i * w:i * w + hi - lo] = A_buffer[s, i * r + lo:i * r + hi]\n"
_REDUCE_SHRINK = ("    if variant == \"reduce_shrink\":\n"
                  "        dist.all_reduce(y, group=group)\n"
                  "        dist.all_reduce(t, group=group)\n")
_REDUCE_WITH_BASE = ("    if variant == \"reduce_with_base\":\n"
                     "        dist.all_reduce(y, group=group)\n")
_GATHERED = "    t = torch.stack(pieces).view(tp, T, stack, R // tp).permute(1, 2, 0, 3).reshape(T, stack, R)\n"

MUTANTS = [
    # ch10.1 column_part_ranges
    Mutant("ch10.1", "replicated-head-by-modulo",
           (("            per, first = 1, tp_rank // (tp_size // n)\n",
             "            per, first = 1, tp_rank % n\n"),),
           "not", "layout", plausible=True),
    Mutant("ch10.1", "kv-heads-split-past-replication",
           ((_PER, "        if n % tp_size == 0 or tp_size % n == 0:\n"
                   "            per, first = max(n // tp_size, 1), tp_rank * max(n // tp_size, 1)\n"),),
           "replicated", "clause"),
    Mutant("ch10.1", "ranges-relative-to-the-part",
           (("        lo = start + first * head_width\n", "        lo = first * head_width\n"),),
           "PACKED output", "layout"),
    Mutant("ch10.1", "contiguous-slice-of-the-packed-output",
           (("        lo = start + first * head_width\n"
             "        ranges.append((lo, lo + per * head_width))\n",
             "        total = sum(out_features)\n"
             "        lo = start + tp_rank * (total // tp_size) * rows // total\n"
             "        ranges.append((lo, lo + (total // tp_size) * rows // total))\n"),),
           "replicated", "layout"),
    Mutant("ch10.1", "floor-split-of-indivisible-heads",
           ((_PER + "        else:\n            raise ValueError(f\"{n} heads cannot be split over {tp_size} ranks\")\n",
             "        if n >= tp_size:\n"
             "            per, first = n // tp_size, tp_rank * (n // tp_size)\n"
             "        else:\n"
             "            per, first = 1, tp_rank // (tp_size // n)\n"),),
           "heads_not_divisible_by_tp_raises_value_error", "error"),
    Mutant("ch10.1", "no-rank-check",
           (("    if not 0 <= tp_rank < tp_size:\n"
             "        raise ValueError(f\"tp_rank {tp_rank} outside 0..{tp_size - 1}\")\n", ""),),
           "tp_rank_past_tp_size_raises_value_error", "error"),

    Mutant("ch10.1", "negative-rank-accepted",
           (("    if not 0 <= tp_rank < tp_size:\n", "    if tp_rank >= tp_size:\n"),),
           "negative_tp_rank_raises_value_error", "error"),
    # issue #33 (learner report ch10): "width" is a head's rows only; a part's rows are out_features[i]
    Mutant("ch10.1", "start-advanced-by-the-owned-rows",
           (("        start += rows\n", "        start += per * head_width\n"),),
           "FULL out_features[i] rows", "layout"),
    Mutant("ch10.1", "rows-not-checked-against-heads",
           (("        if n < 1 or rows % n:\n", "        if n < 1:\n"),),
           "rows_not_a_multiple_of_heads_raises_value_error", "error"),

    # ch10.2 fully_sharded_A
    Mutant("ch10.2", "parts-read-at-the-max-rank",
           ((_COPY, "            out[s, i * w:i * w + hi - lo] = A_buffer[s, i * R + lo:i * R + hi]\n"),),
           "at ITS rank r", "layout", plausible=True),
    Mutant("ch10.2", "each-adapters-own-rank-split",
           (("    lo = tp_rank * w\n    for s, r in enumerate(lora_ranks):\n        hi = min(lo + w, r)\n",
             "    for s, r in enumerate(lora_ranks):\n"
             "        lo, hi = tp_rank * (r // tp_size), (tp_rank + 1) * (r // tp_size)\n"),),
           "PADDED max rank", "math"),
    Mutant("ch10.2", "copies-past-the-rank",
           (("        hi = min(lo + w, r)\n", "        hi = lo + w\n"),),
           "must be zeros", "poison"),
    Mutant("ch10.2", "max-rank-from-the-adapters",
           (("    R = A_buffer.shape[1] // stack_num\n", "    R = max(max(lora_ranks), 1)\n"),),
           "stack_num * R/tp", "clause"),
    Mutant("ch10.2", "no-divisibility-check",
           (("    if R % tp_size or not 0 <= tp_rank < tp_size:\n", "    if not 0 <= tp_rank < tp_size:\n"),),
           "R_not_divisible_by_tp_raises_value_error", "error"),

    Mutant("ch10.2", "extra-ranks-accepted",
           (("    if len(lora_ranks) != A_buffer.shape[0] or any(not 0 <= r <= R for r in lora_ranks):\n",
             "    if len(lora_ranks) < A_buffer.shape[0] or any(r > R for r in lora_ranks):\n"),),
           "a_rank_too_many_raises_value_error", "error"),

    # ch10.3 row_parallel_lora
    Mutant("ch10.3", "shrink-output-not-reduced",
           ((_REDUCE_SHRINK, "    if variant == \"reduce_shrink\":\n        dist.all_reduce(y, group=group)\n"),),
           "all-reduce t first", "math", plausible=True),
    Mutant("ch10.3", "base-all-reduce-missing",
           ((_REDUCE_WITH_BASE, ""),),
           "the ranks ended with different y", "clause"),
    Mutant("ch10.3", "all-reduce-applied-twice",
           ((_REDUCE_WITH_BASE, "    dist.all_reduce(y, group=group)\n"),),
           "all-reduced twice", "clause"),
    Mutant("ch10.3", "delta-added-after-the-base-all-reduce",
           ((_REDUCE_WITH_BASE + "    return y\n",
             "    return y\n"),
            ("    y = x_local @ W_local.T\n",
             "    y = x_local @ W_local.T\n    if variant == \"reduce_with_base\":\n"
             "        dist.all_reduce(y, group=group)\n")),
           "different y", "math"),
    Mutant("ch10.3", "masked-by-multiplying",
           (("    t = torch.where(keep, t, 0.0)\n    Bt = torch.where(keep.unsqueeze(1), B[slots], 0.0)             # [T, out, R]\n",
             "    t = t * keep\n    Bt = B[slots] * keep.unsqueeze(1)\n"),),
           "NaN * 0 = NaN", "poison"),
    Mutant("ch10.3", "scaling-applied-twice",
           (("    delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", t, Bt)\n",
             "    delta = (scalings[slots].unsqueeze(1) ** 2).to(y.dtype) * torch.einsum(\"tr,tor->to\", t, Bt)\n"),),
           "off by a factor", "math"),
    Mutant("ch10.3", "collective-on-rank-0-only",
           ((_REDUCE_SHRINK, "    if variant == \"reduce_shrink\":\n"
                             "        dist.all_reduce(y, group=group)\n"
                             "        if dist.get_rank(group) == 0:\n"
                             "            dist.all_reduce(t, group=group)\n"),),
           "did not finish", "state"),
    Mutant("ch10.3", "no-variant-check",
           (("    if variant not in (\"reduce_shrink\", \"reduce_with_base\"):\n"
             "        raise ValueError(f\"unknown variant {variant!r}\")\n", ""),),
           "unknown_variant_raises_value_error", "error"),

    # (no mutant that differs only in what its collectives carry: a reduce_with_base that also
    # all-reduces t, a column layer that gathers A instead of t. Outputs cannot tell them apart, and
    # what the collectives carry is not graded: issue #31, it could only be recorded next to learner
    # code, which can forge the record)
    Mutant("ch10.3", "default-group",
           (("        dist.all_reduce(y, group=group)\n        dist.all_reduce(t, group=group)\n",
             "        dist.all_reduce(y)\n        dist.all_reduce(t)\n"),),
           "pass group=group", "clause"),
    Mutant("ch10.3", "scaling-folded-into-B-in-place",
           (("    Bt = torch.where(keep.unsqueeze(1), B[slots], 0.0)             # [T, out, R]\n",
             "    B.mul_(scalings.view(-1, 1, 1).to(B.dtype))\n"
             "    Bt = torch.where(keep.unsqueeze(1), B[slots], 0.0)             # [T, out, R]\n"),
            ("    delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", t, Bt)\n",
             "    delta = torch.einsum(\"tr,tor->to\", t, Bt)\n")),
           "modified its input 'B'", "state"),
    Mutant("ch10.3", "variant-checked-after-the-base-all-reduce",
           (("    if variant not in (\"reduce_shrink\", \"reduce_with_base\"):\n"
             "        raise ValueError(f\"unknown variant {variant!r}\")\n", ""),
            ("    y = x_local @ W_local.T\n",
             "    y = x_local @ W_local.T\n"
             "    dist.all_reduce(y, group=group)\n"
             "    if variant not in (\"reduce_shrink\", \"reduce_with_base\"):\n"
             "        raise ValueError(f\"unknown variant {variant!r}\")\n"
             "    y = y / dist.get_world_size(group)\n")),
           "the grader observed: rank(s) [0, 1] entered a collective without raising first", "error"),
    Mutant("ch10.3", "scaling-left-in-fp32",
           (("    delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", t, Bt)\n",
             "    delta = scalings[slots].unsqueeze(1) * torch.einsum(\"tr,tor->to\", t, Bt)\n"),),
           "scalings is float32, so scalings[slot] * (...) promotes", "dtype"),
    Mutant("ch10.3", "validates-on-rank-0-only",
           (("    if variant not in (\"reduce_shrink\", \"reduce_with_base\"):\n",
             "    if dist.get_rank(group) == 0 and variant not in (\"reduce_shrink\", \"reduce_with_base\"):\n"),),
           "raised on EVERY rank", "error"),

    # ch10.4 fully_sharded_column_lora
    Mutant("ch10.4", "gathered-in-rank-order",
           ((_GATHERED, "    t = torch.cat(pieces, dim=1).view(T, stack, R)\n"),),
           "rank order", "layout", plausible=True),
    Mutant("ch10.4", "no-gather-local-slice-of-B",
           ((_GATHERED, "    t = torch.zeros(T, stack, R)\n"
                        "    w = R // tp\n"
                        "    j = dist.get_rank(group)\n"
                        "    t[:, :, j * w:(j + 1) * w] = t_local.view(T, stack, w)\n"),),
           "all-gather every rank's shrink output", "math"),
    Mutant("ch10.4", "masked-by-multiplying",
           (("        ti = torch.where(keep, t[:, i], 0.0)\n        Bi = torch.where(keep.unsqueeze(1), B_local[slots, lo:hi], 0.0)\n",
             "        ti = t[:, i] * keep\n        Bi = B_local[slots, lo:hi] * keep.unsqueeze(1)\n"),),
           "NaN * 0 = NaN", "poison"),
    Mutant("ch10.4", "scaling-forgotten",
           (("        delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", ti, Bi)\n",
             "        delta = torch.einsum(\"tr,tor->to\", ti, Bi)\n"),),
           "the scaling is not applied", "math"),
    Mutant("ch10.4", "rank-mask-at-the-local-width",
           (("    keep = torch.arange(R, device=x.device) < r.unsqueeze(1)       # [T, R]\n",
             "    keep = torch.arange(R, device=x.device) < torch.clamp(r, max=R // tp).unsqueeze(1)\n"),),
           "not below min(r, R/tp)", "math"),
    Mutant("ch10.4", "default-group",
           (("    tp, stack, R = dist.get_world_size(group), len(slice_offsets) - 1, B_local.shape[2]\n",
             "    tp, stack, R = dist.get_world_size(), len(slice_offsets) - 1, B_local.shape[2]\n"),),
           "pass group=group", "clause"),
    Mutant("ch10.4", "scaling-left-in-fp32",
           (("        delta = scalings[slots].unsqueeze(1).to(y.dtype) * torch.einsum(\"tr,tor->to\", ti, Bi)\n",
             "        delta = scalings[slots].unsqueeze(1) * torch.einsum(\"tr,tor->to\", ti, Bi)\n"
             "        y = y.to(delta.dtype)\n"),),
           "qkv_bf16", "dtype"),
    Mutant("ch10.4", "row-count-checked-after-the-gather",
           (("    if R % tp or A_local.shape[1] != stack * (R // tp):\n"
             "        raise ValueError(f\"A_local must have stack * R / tp = {stack} * {R} / {tp} rows\")\n", ""),
            ("    dist.all_gather(pieces, t_local, group=group)\n",
             "    dist.all_gather(pieces, t_local, group=group)\n"
             "    if R % tp or A_local.shape[1] != stack * (R // tp):\n"
             "        raise ValueError(f\"A_local must have stack * R / tp = {stack} * {R} / {tp} rows\")\n")),
           "the grader observed: rank(s) [0, 1] entered a collective without raising first", "error"),
    Mutant("ch10.4", "no-row-count-check",
           (("    if R % tp or A_local.shape[1] != stack * (R // tp):\n"
             "        raise ValueError(f\"A_local must have stack * R / tp = {stack} * {R} / {tp} rows\")\n", ""),),
           "A_local_rows_not_stack_R_over_tp_raises_value_error", "error"),
]

# issue #33 (outputs follow the inputs' dtype, graded on the CPU too): float32 results for bf16
# inputs, named by a bf16 case in the edge, random and hidden groups alike
MUTANTS += [
    Mutant("ch10.2", "zeros-without-dtype",
           (("    out = A_buffer.new_zeros(A_buffer.shape[0], stack_num * w, A_buffer.shape[2])",
             "    out = torch.zeros(A_buffer.shape[0], stack_num * w, A_buffer.shape[2], device=A_buffer.device)"),),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),
    Mutant("ch10.3", "computes-in-fp32",
           (("    y = x_local @ W_local.T\n    t = torch.einsum(\"ti,tri->tr\", x_local, A_local[slots]).contiguous()\n",
             "    y = x_local.float() @ W_local.float().T\n"
             "    t = torch.einsum(\"ti,tri->tr\", x_local.float(), A_local[slots].float()).contiguous()\n"),
            ("    Bt = torch.where(keep.unsqueeze(1), B[slots], 0.0)", "    Bt = torch.where(keep.unsqueeze(1), B[slots].float(), 0.0)")),
           "the layer was computed in float32", "dtype"),
    Mutant("ch10.4", "computes-in-fp32",
           (("    t_local = torch.einsum(\"ti,tki->tk\", x, A_local[slots]).contiguous()\n",
             "    t_local = torch.einsum(\"ti,tki->tk\", x.float(), A_local[slots].float()).contiguous()\n"),
            ("    y = x @ W_local.T\n", "    y = x.float() @ W_local.float().T\n"),
            ("        Bi = torch.where(keep.unsqueeze(1), B_local[slots, lo:hi], 0.0)",
             "        Bi = torch.where(keep.unsqueeze(1), B_local[slots, lo:hi].float(), 0.0)")),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),
]
