"""Wrong answers for chapter 02 (graders.course.mutation.Mutant): each is the solution cell with one edit.

Designed from the contracts: the int32 result and the leading 0 of seg_indptr; one slot per token;
every layout the batched ops allow (a BGMV op that rebuilds token slots from the segments, an SGMV op
or loop that ignores, inverts or reads past the permutation's segments, or reads token_slots); the
rank clip against NaN and against finite junk; in-place updates of ``out``; the scaling applied once;
a stable sort and its inverse; a Python float, both sides of the length ValueError and rank-0
requests as padding in padded_flop_waste.
"""
from graders.course.mutation import Mutant

_LOOP_ROWS = "rows = torch.arange(indptr[seg], indptr[seg + 1], device=x.device)"
_LOOP_ROWS_T = "rows = torch.arange(indptr[seg], indptr[seg + 1], device=t.device)"
_INCLUSIVE = "rows = torch.arange(indptr[seg], min(indptr[seg + 1] + 1, {n}), device={d}.device)"
_PERM = "rows = batch_info.permutation[rows]"

MUTANTS = [
    # ch02.1 seg_indptr_from_seg_lens
    Mutant("ch02.1", "no-leading-zero", (("    return seg_indptr\n", "    return seg_indptr[1:]\n"),),
           "starts with 0", "math", plausible=True),
    Mutant("ch02.1", "cat-keeps-cumsum-int64",
           (("    seg_indptr = torch.zeros(seg_lens.shape[0] + 1, dtype=torch.int32, device=seg_lens.device)\n"
             "    seg_indptr[1:] = torch.cumsum(seg_lens, dim=0)",
             "    seg_indptr = torch.cat([seg_lens.new_zeros(1), torch.cumsum(seg_lens, dim=0)])"),),
           "torch.cumsum of int32 returns int64", "dtype"),
    Mutant("ch02.1", "dtype-of-the-input", (("dtype=torch.int32, device=seg_lens.device", "dtype=seg_lens.dtype, device=seg_lens.device"),),
           "whatever the dtype of seg_lens", "dtype"),
    Mutant("ch02.1", "cumsum-in-place-on-input", (("torch.cumsum(seg_lens, dim=0)", "seg_lens.cumsum_(0)"),),
           "modified its input 'seg_lens'", "clause"),
    Mutant("ch02.1", "exclusive-sums", (("torch.cumsum(seg_lens, dim=0)", "torch.cumsum(seg_lens, dim=0) - seg_lens"),),
           "shifted by one", "math"),

    # ch02.2 token_slots_from_segments
    Mutant("ch02.2", "int64-result", (("weight_indices.to(torch.int32), seg_lens", "weight_indices.long(), seg_lens"),),
           "dtype torch.int64, expected torch.int32", "dtype", plausible=True),
    Mutant("ch02.2", "segment-index-not-slot",
           (("weight_indices.to(torch.int32), seg_lens",
             "torch.arange(weight_indices.shape[0], dtype=torch.int32, device=weight_indices.device), seg_lens"),),
           "not the segment's index i", "math"),
    Mutant("ch02.2", "cumulative-not-lengths",
           (("seg_lens = (seg_indptr[1:] - seg_indptr[:-1]).long()", "seg_lens = seg_indptr[1:].long()"),),
           "shape", "math"),
    Mutant("ch02.2", "every-segment-at-least-one-token",
           (("seg_lens = (seg_indptr[1:] - seg_indptr[:-1]).long()", "seg_lens = (seg_indptr[1:] - seg_indptr[:-1]).long().clamp(min=1)"),),
           "shape", "clause"),

    # ch02.3 lora_loop
    Mutant("ch02.3", "slot-0-is-the-base-model", (("if r == 0 or indptr[seg]", "if slot == 0 or indptr[seg]"),),
           "the base model is the slot of rank 0", "clause", plausible=True),
    Mutant("ch02.3", "ignores-permutation", (("            " + _PERM + "\n", "            pass\n"),),
           "without its permutation", "layout"),
    Mutant("ch02.3", "inverse-permutation", ((_PERM, "rows = torch.argsort(batch_info.permutation)[rows]"),),
           "inverse permutation", "layout"),
    Mutant("ch02.3", "inclusive-segment-end", ((_LOOP_ROWS, _INCLUSIVE.format(n="x.shape[0]", d="x")),),
           "inclusive end", "layout"),
    Mutant("ch02.3", "no-rank-clip", (("A_stack[slot, :r]", "A_stack[slot]"), ("B_stack[slot, :, :r]", "B_stack[slot]")),
           "padding past a slot's rank", "poison"),
    Mutant("ch02.3", "nan-to-num-instead-of-clip",
           (("A_stack[slot, :r].float()", "torch.nan_to_num(A_stack[slot]).float()"),
            ("B_stack[slot, :, :r].float()", "torch.nan_to_num(B_stack[slot]).float()")),
           "torch.nan_to_num cannot hide a read", "poison"),
    Mutant("ch02.3", "returns-a-copy", (("    indptr = batch_info.seg_indptr.tolist()\n",
                                         "    out = out.clone()  # keep the caller's tensor intact\n"
                                         "    indptr = batch_info.seg_indptr.tolist()\n"),),
           "must be written into `out` in place", "clause"),

    # ch02.4 bgmv_shrink
    Mutant("ch02.4", "per-segment-gather", (("slots = batch_info.token_slots.long()  # [T]",
                                             "slots = batch_info.weight_indices.long()  # [T]"),),
           "einsum", "layout", plausible=True),
    Mutant("ch02.4", "slots-from-segments",
           (("slots = batch_info.token_slots.long()  # [T]",
             "slots = torch.repeat_interleave(batch_info.weight_indices.long(), batch_info.seg_lens.long())  # [T]"),),
           "what the segments give in x's row order", "layout"),
    Mutant("ch02.4", "scales-in-shrink", (('t = torch.einsum("ti,tri->tr", x.float(), A)',
                                           't = batch_info.scalings[slots].float()[:, None] * torch.einsum("ti,tri->tr", x.float(), A)'),),
           "scales the delta twice", "math"),
    Mutant("ch02.4", "rank-bound-from-out-width", (("max_rank = A_stack.shape[1]", "max_rank = out.shape[1]"),),
           "t_out_wider_than_max_rank", "clause"),
    Mutant("ch02.4", "writes-into-a-copy", (("region = out[:, :max_rank]", "region = out[:, :max_rank].clone()"),),
           "must be written into `out` in place", "clause"),

    # ch02.5 bgmv_expand
    Mutant("ch02.5", "rank-bound-from-t-width", (("max_rank = B_stack.shape[2]", "max_rank = t.shape[1]"),),
           "t_out_wider_than_max_rank", "clause", plausible=True),
    Mutant("ch02.5", "slots-from-segments",
           (("slots = batch_info.token_slots.long()  # [T]",
             "slots = torch.repeat_interleave(batch_info.weight_indices.long(), batch_info.seg_lens.long())  # [T]"),),
           "what the segments give in x's row order", "layout"),
    Mutant("ch02.5", "mask-multiply-t", (("part = torch.where(keep, t[:, :max_rank].float(), 0.0)",
                                          "part = t[:, :max_rank].float() * keep"),),
           "0 * NaN is NaN", "poison"),
    Mutant("ch02.5", "B-not-clipped", (("B = torch.where(keep[:, None, :], B_stack[slots].float(), 0.0)",
                                        "B = B_stack[slots].float()"),),
           "padding past a slot's rank", "poison"),
    Mutant("ch02.5", "nan-to-num-instead-of-clip",
           (("part = torch.where(keep, t[:, :max_rank].float(), 0.0)", "part = torch.nan_to_num(t[:, :max_rank].float())"),
            ("B = torch.where(keep[:, None, :], B_stack[slots].float(), 0.0)", "B = torch.nan_to_num(B_stack[slots].float())")),
           "torch.nan_to_num cannot hide a read", "poison"),
    Mutant("ch02.5", "not-in-place", (("    out.copy_((out.float() + delta).to(out.dtype))",
                                       "    out = (out.float() + delta).to(out.dtype)"),),
           "must be written into `out` in place", "clause"),
    Mutant("ch02.5", "no-scaling", (("delta = scale[:, None] * torch.einsum", "delta = torch.einsum"),),
           "rows differ", "math"),

    # ch02.6 sgmv_shrink
    Mutant("ch02.6", "scales-twice", (("out[rows, :r] = (x[rows].float()", "out[rows, :r] = batch_info.scalings[slot] * (x[rows].float()"),),
           "scales the delta twice", "math", plausible=True),
    Mutant("ch02.6", "ignores-permutation", (("            " + _PERM + "  # sorted row i is row permutation[i] of x\n",
                                              "            pass\n"),),
           "without its permutation", "layout"),
    Mutant("ch02.6", "inverse-permutation", ((_PERM, "rows = torch.argsort(batch_info.permutation)[rows]"),),
           "inverse permutation", "layout"),
    Mutant("ch02.6", "rows-from-token-slots",
           ((_LOOP_ROWS, "rows = torch.nonzero(batch_info.token_slots == slot).flatten()"),
            ("            " + _PERM + "  # sorted row i is row permutation[i] of x\n", "            pass\n")),
           "this op never reads it", "layout"),
    Mutant("ch02.6", "break-at-rank-0", (("            continue  # a rank-0 program returns at once", "            break"),),
           "left unwritten", "clause"),

    # ch02.7 sgmv_expand
    Mutant("ch02.7", "ignores-permutation", (("            " + _PERM + "\n", "            pass\n"),),
           "without its permutation", "layout", plausible=True),
    Mutant("ch02.7", "inverse-permutation", ((_PERM, "rows = torch.argsort(batch_info.permutation)[rows]"),),
           "inverse permutation", "layout"),
    Mutant("ch02.7", "inclusive-segment-end", ((_LOOP_ROWS_T, _INCLUSIVE.format(n="t.shape[0]", d="t")),),
           "inclusive end", "layout"),
    Mutant("ch02.7", "no-rank-clip", (("t[rows, :r].float()", "t[rows, :B_stack.shape[2]].float()"),
                                      ("B_stack[slot, :, :r].float()", "B_stack[slot].float()")),
           "padding past a slot's rank", "poison"),
    Mutant("ch02.7", "nan-to-num-instead-of-clip",
           (("t[rows, :r].float()", "torch.nan_to_num(t[rows, :B_stack.shape[2]]).float()"),
            ("B_stack[slot, :, :r].float()", "torch.nan_to_num(B_stack[slot]).float()")),
           "torch.nan_to_num cannot hide a read", "poison"),
    Mutant("ch02.7", "returns-a-copy", (("    indptr = batch_info.seg_indptr.tolist()\n",
                                         "    out = out.clone()  # keep the caller's tensor intact\n"
                                         "    indptr = batch_info.seg_indptr.tolist()\n"),),
           "must be written into `out` in place", "clause"),
    Mutant("ch02.7", "break-at-rank-0", (("            continue\n", "            break\n"),),
           "rows differ", "clause"),

    # ch02.8 stable_sort_by_slot
    Mutant("ch02.8", "not-stable", (("torch.sort(token_slots, stable=True)", "torch.sort(token_slots)"),),
           "the sort must be stable", "math", plausible=True),
    Mutant("ch02.8", "inverse-is-permutation", (("    return permutation, inverse\n", "    return permutation, permutation.clone()\n"),),
           "inverse is not the permutation itself", "math"),
    Mutant("ch02.8", "swapped", (("    return permutation, inverse\n", "    return inverse, permutation\n"),),
           "swapped", "layout"),
    Mutant("ch02.8", "int32-results", (("    return permutation, inverse\n", "    return permutation.int(), inverse.int()\n"),),
           "returned permutation: dtype torch.int32, expected torch.int64", "dtype"),
    Mutant("ch02.8", "descending", (("torch.sort(token_slots, stable=True)", "torch.sort(token_slots, stable=True, descending=True)"),),
           "returned permutation", "math"),

    # ch02.9 padded_flop_waste
    Mutant("ch02.9", "relative-to-useful", (("    return wasted / padded", "    return wasted / sum(n * r for n, r in zip(seg_lens, ranks))"),),
           "wasted / useful", "math", plausible=True),
    Mutant("ch02.9", "rank-0-left-out",
           (("max_rank = max(ranks, default=0)\n    padded = sum(n * max_rank for n in seg_lens)",
             "max_rank = max(ranks, default=0)\n    padded = sum(n * max_rank for n, r in zip(seg_lens, ranks) if r > 0)"),
            ("for n, r in zip(seg_lens, ranks))\n    return", "for n, r in zip(seg_lens, ranks) if r > 0)\n    return")),
           "rank-0 requests were left out", "clause"),
    Mutant("ch02.9", "no-length-check", (("    if len(seg_lens) != len(ranks):\n        raise ValueError(f\"{len(seg_lens)} seg_lens but {len(ranks)} ranks\")\n", ""),),
           "the contract says this input raises ValueError", "error"),
    Mutant("ch02.9", "length-check-one-side", (("if len(seg_lens) != len(ranks):", "if len(seg_lens) > len(ranks):"),),
           "more_ranks_than_lengths_raises_value_error", "error"),
    Mutant("ch02.9", "int-zero", (("        return 0.0\n", "        return 0\n"),),
           "the contract asks for a Python float", "dtype"),
    Mutant("ch02.9", "max-rank-of-nonempty-requests",
           (("max_rank = max(ranks, default=0)", "max_rank = max((r for n, r in zip(seg_lens, ranks) if n > 0), default=0)"),),
           "largest_rank_on_an_empty_request", "clause"),
]

MUTANTS += [
    # out= ops return out (the contract, so a caller can chain it): a None return loses the case
    Mutant("ch02.4", "returns-nothing", (("    return out\n", "    return None\n"),),
           "the contract returns out itself", "clause"),

    # every exercise whose results live on the inputs' device: a tensor made without device= lands on
    # torch's default device (graders.machine.exercise.Exercise.default_device_probe)
    Mutant("ch02.1", "indptr-on-the-default-device",
           (("dtype=torch.int32, device=seg_lens.device", "dtype=torch.int32"),), "default device", "device"),
    Mutant("ch02.3", "rows-on-the-default-device",
           ((_LOOP_ROWS, "rows = torch.arange(indptr[seg], indptr[seg + 1])"),), "default device", "device"),
    Mutant("ch02.4", "rank-mask-on-the-default-device",
           (("torch.arange(max_rank, device=x.device)", "torch.arange(max_rank)"),), "default device", "device"),
    Mutant("ch02.8", "inverse-ids-on-the-default-device",
           (("torch.arange(permutation.shape[0], device=permutation.device)", "torch.arange(permutation.shape[0])"),),
           "default device", "device"),
]
