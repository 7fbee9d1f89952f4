"""Wrong answers for chapter 07 (batch info from requests, the slot-sorted view, the LoRA layer),
each the solution cell with one realistic edit (graders.course.mutation.Mutant). The old plausible mistakes
(a zero-token request counted active, sequences counted instead of tokens, the base forward copied)
are the plausible ones. ch07.1 and ch07.3 must read no tensor value on the host: their "device-read"
mutants compute the right numbers through such a read.

Not in the catalogue: ch07.2 with its `device` argument ignored. On a GPU its cases see it (the
results stay on the CPU); on a CPU-only machine only a device="meta" case could, and this contract
allows computing on the device (torch.bincount), which cannot run on meta: ch07.1, built from host
lists, has that case instead."""
from graders.course.mutation import Mutant

MUTANTS = [
    # ch07.1 batch_info_from_requests
    Mutant("ch07.1", "active-when-some-request-is-not-the-base",
           (("any(n > 0 and lora_ranks[s] > 0 for n, s in zip(req_lens, slots))",
             "any(n > 0 and u is not None for n, u in zip(req_lens, req_uids))"),),
           "decide from the slot's rank, not from the uid being None", "clause"),
    Mutant("ch07.1", "zero-token-request-active",
           (("any(n > 0 and lora_ranks[s] > 0 for n, s in zip(req_lens, slots))",
             "any(lora_ranks[s] > 0 for s in slots)"),),
           "has_active_lora: expected False, got True", "clause", plausible=True),
    Mutant("ch07.1", "max-len-from-a-tensor",
           (("max_len=max(req_lens, default=0)", "max_len=int(send([0, *req_lens], torch.int32).max())"),),
           "read a tensor's value on the host", "device-read"),
    Mutant("ch07.1", "has-active-lora-from-a-tensor",
           (("has_active_lora=any(n > 0 and lora_ranks[s] > 0 for n, s in zip(req_lens, slots))",
             "has_active_lora=bool((send(list(lora_ranks), torch.int32)[send(token_slots, torch.long)] > 0).any())"),),
           "read a tensor's value on the host", "device-read"),
    Mutant("ch07.1", "indptr-through-tolist",
           (("    indptr = [0]\n    for n in req_lens:\n        indptr.append(indptr[-1] + n)\n",
             "    indptr = torch.cumsum(torch.tensor([0, *req_lens], device=device), 0).tolist()\n"),),
           "read a tensor's value on the host", "device-read"),
    Mutant("ch07.1", "scalings-in-float64",
           (("scalings=send(list(scalings), torch.float32)", "scalings=send(list(scalings), torch.float64)"),),
           "scalings: dtype torch.float64, expected torch.float32", "dtype"),
    Mutant("ch07.1", "base-model-assumed-resident",
           (("if u not in uid_to_slot]", "if u is not None and u not in uid_to_slot]"),),
           "base_model_not_resident_raises_value_error", "error"),
    Mutant("ch07.1", "max-of-an-empty-batch",
           (("max_len=max(req_lens, default=0)", "max_len=max(req_lens)"),),
           "empty_batch", "clause"),
    Mutant("ch07.1", "token-slots-per-request",
           (("token_slots=send(token_slots, torch.int32)", "token_slots=send(slots, torch.int32)"),),
           "token_slots: shape", "layout"),

    Mutant("ch07.1", "device-argument-ignored",
           (("        return host.to(device)\n", "        return host\n"),),
           "the contract puts the results on `device`", "device"),

    # ch07.2 slot_sorted_view
    Mutant("ch07.2", "counts-sequences",
           (("counts[s] += tokens_per_seq", "counts[s] += 1"),),
           "each sequence brings tokens_per_seq", "math", plausible=True),
    Mutant("ch07.2", "not-stable-within-a-slot",
           (("key=lambda q: token_slots[q])", "key=lambda q: (token_slots[q], -q))"),),
           "a stable sort", "layout"),
    Mutant("ch07.2", "token-major-ids",
           (("for q in order for j in range(tokens_per_seq)]", "for j in range(tokens_per_seq) for q in order]"),),
           "contributes q*tps .. q*tps + tps - 1 consecutively", "layout"),
    Mutant("ch07.2", "offsets-without-the-leading-0",
           (("    offsets = [0]\n    for c in counts:\n        offsets.append(offsets[-1] + c)\n",
             "    offsets = []\n    for c in counts:\n        offsets.append((offsets[-1] if offsets else 0) + c)\n"),),
           "num_slots + 1 entries", "clause"),
    Mutant("ch07.2", "slot-num-slots-accepted",
           (("not 0 <= s < num_slots", "not 0 <= s <= num_slots"),),
           "slot_equal_to_num_slots_raises_value_error", "error"),
    Mutant("ch07.2", "negative-slot-accepted",
           (("not 0 <= s < num_slots", "s >= num_slots"),),
           "negative_slot_raises_value_error", "error"),
    Mutant("ch07.2", "tokens-per-seq-unchecked",
           (('    if tokens_per_seq < 1:\n        raise ValueError("tokens_per_seq must be at least 1")\n', ""),),
           "tokens_per_seq_0_raises_value_error", "error"),
    Mutant("ch07.2", "ids-in-int32",
           (("torch.tensor(ids, dtype=torch.int64)", "torch.tensor(ids, dtype=torch.int32)"),),
           "sorted_token_ids: dtype torch.int32, expected torch.int64", "dtype"),

    # ch07.3 LoRALinear
    Mutant("ch07.3", "base-forward-copied",
           (("y = self.base(x)", "y = nn.functional.linear(x, self.base.weight, self.base.bias)"),),
           "never copy it", "clause", plausible=True),
    Mutant("ch07.3", "skip-test-reads-the-ranks",
           (("if not info.has_active_lora:", "if not bool((info.lora_ranks[info.weight_indices] > 0).any()):"),),
           "read a tensor's value on the host", "device-read"),
    Mutant("ch07.3", "if-tensor-any",
           (("if not info.has_active_lora:", "if not info.lora_ranks.any():"),),
           "read a tensor's value on the host", "device-read"),
    Mutant("ch07.3", "shrink-width-from-max-rank",
           (("t = rows.new_empty(rows.shape[0], self.A_buffer.shape[1])",
             "t = rows.new_empty(rows.shape[0], int(info.lora_ranks.max()))"),),
           "read a tensor's value on the host", "device-read"),
    Mutant("ch07.3", "no-skip-for-a-base-only-batch",
           (("        if not info.has_active_lora:\n            return y\n", ""),),
           "the base-only forward called the LoRA ops", "clause"),
    Mutant("ch07.3", "delta-not-in-place",
           (("        torch_ref.expand(t, self.B_buffer, info, y.view(-1, y.shape[-1]))\n        return y\n",
             "        return torch_ref.expand(t, self.B_buffer, info, y.view(-1, y.shape[-1])).view(y.shape)\n"),),
           "add the delta in place", "clause"),
    Mutant("ch07.3", "batch-info-cached-at-construction",
           (("self.base, self.A_buffer, self.B_buffer, self.context = base, A_buffer, B_buffer, context",
             "self.base, self.A_buffer, self.B_buffer, self.context = base, A_buffer, B_buffer, context\n"
             "        self.info = context.batch_info"),
            ("info = self.context.batch_info", "info = self.info")),
           "read self.context.batch_info in every forward", "state"),
    Mutant("ch07.3", "rows-flattened-seq-major",
           (("rows = x.reshape(-1, x.shape[-1])", "rows = x.transpose(0, 1).reshape(-1, x.shape[-1])"),),
           "elements differ", "layout"),
]

# issue #33 (outputs follow the inputs' dtype, graded on the CPU too): the fp16 and bf16 cases of
# every group name a layer that upcasts its output to add the delta in fp32
MUTANTS += [
    Mutant("ch07.3", "output-upcast-to-fp32",
           (("y = self.base(x)", "y = self.base(x).float()  # add the delta in fp32"),),
           "returned y (the first forward's output): dtype torch.float32, expected torch.float16", "dtype"),
]
