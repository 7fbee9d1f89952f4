"""Wrong answers for chapter 09 (virtual experts, the aligned block layout, the MoE LoRA op, EP ids),
each the solution cell with one realistic edit (graders.course.mutation.Mutant).

Not in the catalogue, because the contract's tolerance cannot tell it apart from the solution: a
MoE LoRA op that keeps the shrink in fp32 instead of rounding it to x.dtype (the difference is one
bf16 rounding of an intermediate, well inside the bf16 tolerance row)."""
from graders.course.mutation import Mutant

_VIRTUAL = "    virtual = token_slots.long().view(-1, 1) * num_experts + ids\n"
_PAD = "            sorted_ids += chunk + [num_pairs] * (block_size - len(chunk))\n"
_ROW = "            row = (x[p] if rows_per_pair else x[t]).float()\n"

MUTANTS = [
    # ch09.1 virtual_expert_ids
    Mutant("ch09.1", "expert-major-numbering",
           ((_VIRTUAL, "    virtual = ids * num_experts + token_slots.long().view(-1, 1)\n"),),
           "not expert * num_experts + slot", "layout", plausible=True),
    Mutant("ch09.1", "minus-one-not-kept",
           (("    return torch.where(ids < 0, torch.full_like(virtual, -1), virtual)", "    return virtual"),),
           "gives -1", "clause"),
    Mutant("ch09.1", "dtype-of-the-input",
           (("    ids = topk_ids.long()\n", "    ids = topk_ids\n"),
            (_VIRTUAL, "    virtual = token_slots.view(-1, 1).to(ids.dtype) * num_experts + ids\n")),
           "int64", "dtype"),
    Mutant("ch09.1", "no-range-check",
           (("    if ids.numel() and int(ids.max()) >= num_experts:\n"
             "        raise ValueError(f\"expert id {int(ids.max())} >= num_experts {num_experts}\")\n", ""),),
           "expert_id_past_the_experts_raises_value_error", "error"),
    Mutant("ch09.1", "no-shape-check",
           (("    if topk_ids.dim() != 2 or token_slots.shape != (topk_ids.shape[0],):\n"
             "        raise ValueError(\"topk_ids [num_tokens, top_k] and token_slots [num_tokens]\")\n", ""),),
           "token_slots_of_another_length_raises_value_error", "error"),

    # ch09.2 moe_align_block_size
    Mutant("ch09.2", "pads-with-minus-one",
           ((_PAD, "            sorted_ids += chunk + [-1] * (block_size - len(chunk))\n"),),
           "padding entries hold num_pairs", "clause", plausible=True),
    Mutant("ch09.2", "group-in-reverse-order",
           (("        group = torch.nonzero(flat == v).view(-1).tolist()  # in pair order: stable\n",
             "        group = torch.nonzero(flat == v).view(-1).tolist()[::-1]\n"),),
           "keep their order", "layout"),
    Mutant("ch09.2", "ignores-skip",
           (("        if skip is not None and bool(skip[v]):\n            continue\n", ""),),
           "set in skip gets no blocks", "clause"),
    Mutant("ch09.2", "counts-only-kept-pairs",
           (("    num_pairs = flat.numel()\n", "    num_pairs = int((flat >= 0).sum())\n"),),
           "num_pairs counts every pair", "math"),
    Mutant("ch09.2", "no-id-range-check",
           (("    if num_pairs and int(flat.max()) >= num_ids:\n"
             "        raise ValueError(f\"id {int(flat.max())} >= num_ids {num_ids}\")\n", ""),),
           "id_past_num_ids_raises_value_error", "error"),
    Mutant("ch09.2", "int64-layout",
           (("    return (torch.tensor(sorted_ids, dtype=torch.int32, device=ids.device),\n"
             "            torch.tensor(block_ids, dtype=torch.int32, device=ids.device), num_pairs)",
             "    return (torch.tensor(sorted_ids, dtype=torch.int64, device=ids.device),\n"
             "            torch.tensor(block_ids, dtype=torch.int64, device=ids.device), num_pairs)"),),
           "are int32", "dtype"),

    # ch09.3 fused_moe_lora
    Mutant("ch09.3", "down-reads-token-rows", ((_ROW, "            row = x[t].float()\n"),),
           "rows_per_pair=True", "layout", plausible=True),
    Mutant("ch09.3", "ignores-routing-weights",
           (("(float(topk_weights[t, j]) if topk_weights is not None else 1.0)", "1.0"),),
           "topk_weights given", "clause"),
    Mutant("ch09.3", "slices-at-max-rank-offsets",
           (("                h = (A[s, e, i * r:(i + 1) * r].float() @ row).to(x.dtype).float()\n",
             "                h = (A[s, e, i * B.shape[3]:i * B.shape[3] + r].float() @ row).to(x.dtype).float()\n"),),
           "rows [i*r, (i+1)*r)", "poison"),
    Mutant("ch09.3", "rank-of-the-slot",
           (("            r = int(lora_ranks[s, e])\n", "            r = int(lora_ranks[s].max())\n"),),
           "rank 0", "poison"),
    Mutant("ch09.3", "no-scaling",
           (("            scale = float(scalings[s]) * ", "            scale = "),),
           "scalings[slot]", "math"),
    Mutant("ch09.3", "minus-one-not-skipped",
           (("            if e < 0:\n                continue\n", ""),),
           "bit for bit", "clause"),

    # ch09.4 to_local_expert_ids
    Mutant("ch09.4", "returns-global-ids",
           (("    return torch.where(mine, local, torch.full_like(local, -1))",
             "    return torch.where(mine, topk_ids.long(), torch.full_like(local, -1))"),),
           "minus the rank's first expert", "math", plausible=True),
    Mutant("ch09.4", "strided-experts",
           (("    local = topk_ids.long() - ep_rank * per_rank\n", "    local = topk_ids.long() // ep_size\n"),
            ("    mine = (topk_ids >= 0) & (local >= 0) & (local < per_rank)\n",
             "    mine = (topk_ids >= 0) & (topk_ids.long() % ep_size == ep_rank)\n")),
           "contiguous blocks", "layout"),
    Mutant("ch09.4", "other-ranks-kept",
           (("    return torch.where(mine, local, torch.full_like(local, -1))", "    return local"),),
           "becomes -1", "clause"),
    Mutant("ch09.4", "no-divisibility-check",
           (("num_experts % ep_size != 0 or ", ""),), "ep_size_not_dividing_raises_value_error", "error"),
    Mutant("ch09.4", "no-upper-bound-on-rank",
           (("not 0 <= ep_rank < ep_size", "not 0 <= ep_rank"),), "ep_rank_past_ep_size_raises_value_error", "error"),
]

MUTANTS += [
    # ch09.5 split_expert_lora
    Mutant("ch09.5", "B-in-blocks-like-A",
           (("lora_B[:, e::num_experts]", "lora_B[:, e * r:(e + 1) * r]"),),
           "rank-major", "layout", plausible=True),
    Mutant("ch09.5", "A-strided-like-B",
           (("(lora_A[e * r:(e + 1) * r], ", "(lora_A[e::num_experts], "),),
           "expert-major", "layout"),
    Mutant("ch09.5", "B-transposed",
           (("lora_B[:, e::num_experts])", "lora_B[:, e::num_experts].T)"),),
           "not transposed", "layout"),
    Mutant("ch09.5", "no-shape-check",
           (("    if rows == 0 or rows % num_experts != 0 or lora_B.shape[1] != rows:\n", "    if rows == 0:\n"),),
           "rows_not_a_multiple_of_E_raises_value_error", "error"),
    Mutant("ch09.5", "B-columns-unchecked",
           ((" or lora_B.shape[1] != rows:", ":"),), "A_and_B_of_different_ranks_raises_value_error", "error"),
]

# found by a learner trial (full marks before the cases and hints they prompted)
MUTANTS += [
    Mutant("ch09.1", "only-minus-one-passes",
           (("    return torch.where(ids < 0, torch.full_like(virtual, -1), virtual)",
             "    return torch.where(ids == -1, torch.full_like(virtual, -1), virtual)"),),
           "test ids < 0, not == -1", "clause"),
    Mutant("ch09.1", "counts-token-slots-only",
           (("token_slots.shape != (topk_ids.shape[0],)", "token_slots.numel() != topk_ids.shape[0]"),),
           "token_slots_as_a_column_raises_value_error", "error"),
    Mutant("ch09.2", "padding-before-the-pairs",
           ((_PAD, "            sorted_ids += [num_pairs] * (block_size - len(chunk)) + chunk\n"),),
           "its real pairs first and its padding after them", "layout"),
    Mutant("ch09.2", "choice-major-pair-numbers",
           (("    flat = ids.reshape(-1).long()\n", "    flat = ids.T.reshape(-1).long()\n"),),
           "p = token * top_k + choice", "layout"),
    Mutant("ch09.3", "assigns-the-delta",
           (("                out[p, lo:hi] = (out[p, lo:hi].float() + scale * delta).to(out.dtype)\n",
             "                out[p, lo:hi] = (scale * delta).to(out.dtype)\n"),),
           "add the delta to out", "math"),
    Mutant("ch09.3", "skips-slot-0-as-the-base",
           (("        s = int(token_slots[t])\n", "        s = int(token_slots[t])\n        if s == 0:\n            continue\n"),),
           "slot 0 is a slot like any other", "clause"),
    Mutant("ch09.3", "scaling-twice",
           (("            scale = float(scalings[s]) * ", "            scale = float(scalings[s]) ** 2 * "),),
           "not twice", "math"),
    Mutant("ch09.4", "ep-size-0-divides",
           (("    if ep_size < 1 or num_experts", "    if num_experts"),), "ep_size_0_raises_value_error", "error"),
]

MUTANTS += [
    Mutant("ch09.1", "int32-arithmetic",
           ((_VIRTUAL, "    virtual = (token_slots.int().view(-1, 1) * num_experts + topk_ids.int()).long()\n"),),
           "overflows int32", "dtype"),
]

MUTANTS += [
    Mutant("ch09.3", "returns-nothing", (("    return out\n", "    return None\n"),),
           "the contract returns out itself", "clause"),
]

# issue #33 ("feedback that misleads"): a hint chosen from the case named a cause other than the
# answer's; these are named from what the answer returned
MUTANTS += [
    # the pair index choice-major: rows of rank-0 pairs change, but not because rank 0 was not skipped
    Mutant("ch09.3", "choice-major-pair-index",
           (("            p = t * top_k + j\n", "            p = j * num_tokens + t\n"),),
           "not choice-major (p = j * num_tokens + t)", "layout"),
]

# issue #33 (outputs follow the inputs' dtype, graded on the CPU too): a copy into tensors made
# without dtype= is float32 for bf16 inputs, named by the bf16 case of every group
MUTANTS += [
    Mutant("ch09.5", "copies-into-float32",
           (("    return [(lora_A[e * r:(e + 1) * r], lora_B[:, e::num_experts]) for e in range(num_experts)]",
             "    pairs = []\n"
             "    for e in range(num_experts):\n"
             "        A_e = torch.empty(r, lora_A.shape[1], device=lora_A.device)\n"
             "        B_e = torch.empty(lora_B.shape[0], r, device=lora_B.device)\n"
             "        A_e.copy_(lora_A[e * r:(e + 1) * r])\n"
             "        B_e.copy_(lora_B[:, e::num_experts])\n"
             "        pairs.append((A_e, B_e))\n"
             "    return pairs"),),
           "dtype torch.float32, expected torch.bfloat16", "dtype"),
    # the contract's "on the device of ids": graded on the CPU, a tensor made without device= lands
    # on torch's default device there (graders.machine.exercise.Exercise.default_device_probe)
    Mutant("ch09.2", "blocks-on-the-default-device",
           (("            torch.tensor(block_ids, dtype=torch.int32, device=ids.device), num_pairs)",
             "            torch.tensor(block_ids, dtype=torch.int32), num_pairs)"),),
           "default device", "device"),
]
