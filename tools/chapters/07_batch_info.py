# %% [markdown]
# # 07 · From requests to kernels, and LoRA layers on a real model
#
# Every piece is now there: kernels that read a `LoRABatchInfo` (chapters 02-04), a pool that decides
# which adapter is in which slot (chapter 05), PEFT adapters loaded into it (chapter 06). This chapter
# connects them. A scheduler hands over a batch of requests, each with an adapter uid and a number
# of tokens; a few host computations turn that into the handful of tensors the kernels read; LoRA
# layers wrapped around a transformers Llama's projections read them during the forward pass. The
# judge, as in chapter 06, is PEFT: prefill, greedy decoding and a sequence of batches whose adapters
# are evicted and reloaded must all match PEFT's own mixed-batch forward.
#
# **What you will learn**
# - Building `LoRABatchInfo` from requests and the pool without a single device read, and why that
#   matters (a device synchronization per layer per step costs more than the LoRA math).
# - The views of one batch: per-request segments, slot-sorted segments with a permutation, chunked
#   segments, and the per-request view kept beside them (`req_seg_indptr`, `req_weight_indices`).
# - The slot-sorted view of CUDA-graph paths (a segment table of fixed size), with several tokens per
#   sequence for speculative decoding.
# - A LoRA linear layer that wraps the base layer, and one documented hook (`LoRAContext.set_batch`)
#   through which the batch reaches every layer; q/k/v and gate/up sharing one shrink.
# - Edge cases that break real servers: an all-base batch, a zero-length request, a base request
#   right after an adapter request.
#
# **Exercises**: ch07.1 `batch_info_from_requests`, ch07.2 `slot_sorted_view`, ch07.3 `LoRALinear`.

# %%
import copy
import inspect
import tempfile
import warnings
from pathlib import Path

import reference  # first: device choice
import torch

import graders
from reference import layers
from reference.adapters import load_peft_adapter
from reference import batch_info as bi  # bi.batch_info_from_requests: the answer cells reuse the names
from reference.device import default_device
from reference.layers import LoRAContext, unwrap_llama, wrap_llama
from reference.mem_pool import LoRAMemoryPool, ModuleSpec

device = default_device()
print("device:", device)

# %% [markdown]
# ## 1. A batch of requests becomes a few tensors
#
# The control plane knows requests: request i uses uid `req_uids[i]` (`None` for the base model) and
# brings `req_lens[i]` tokens to this forward pass (its prompt, or 1 when decoding). After
# `pool.prepare_lora_batch` (chapter 05) every uid has a slot. The data plane needs, per the contract
# of chapter 02: `seg_lens` and `seg_indptr` (where each segment's rows are), `weight_indices` (the
# slot of each segment), `lora_ranks` and `scalings` by slot, `max_len` (the grid's row axis),
# `token_slots` (the slot of every token, for BGMV and decode), and `has_active_lora`.
#
# Running example: requests `["a", None, "b"]` of 3, 10 and 5 tokens, with `None` in slot 0, `b` in
# slot 1 (rank 4) and `a` in slot 2 (rank 8):

# %%
uid_to_slot = {None: 0, "b": 1, "a": 2}
ranks, scalings = [0, 4, 8], [0.0, 0.5, 2.0]
info = bi.batch_info_from_requests(["a", None, "b"], [3, 10, 5], uid_to_slot, ranks, scalings, "cpu")
for field in ("bs", "num_segments", "max_len", "has_active_lora", "seg_lens", "seg_indptr", "weight_indices",
              "token_slots", "req_seg_indptr", "req_weight_indices"):
    value = getattr(info, field)
    print(f"{field:18s} {value.tolist() if isinstance(value, torch.Tensor) else value}")

# %% [markdown]
# The struct itself is a dataclass, `reference.batch_info.LoRABatchInfo`, built with keyword
# arguments, one per field; its constructor (host fields first, then the tensors; the last four
# have defaults):

# %%
print("LoRABatchInfo" + str(inspect.signature(bi.LoRABatchInfo)).replace(", ", ",\n    ").replace("(", "(\n    ", 1))

# %% [markdown]
# **No device reads.** Every field above is computed from host lists and sent with one host-to-device
# copy per tensor. The tempting shortcuts each read the device: `bool((lora_ranks[weight_indices] >
# 0).any())` for `has_active_lora`, `seg_lens.max().item()` for `max_len`, even `torch.tensor(list,
# device="cuda")` (a copy from pageable memory waits for the device). Each such read stalls the host
# until the GPU has finished everything queued before it, so the next kernels cannot be queued in
# advance; at one read per layer per decode step, the GPU then idles between layers while the host
# catches up (chapter 03 measured decode LoRA kernels of a few microseconds each: a stall of the same
# order per layer doubles their cost).
# The pool therefore keeps host copies of its ranks and scalings (`pool.lora_ranks_host`,
# `pool.scalings_host`), updated where it writes a slot, and the builder stages its tensors in pinned
# memory. On a GPU, `torch.cuda.set_sync_debug_mode("error")` turns every synchronizing call into an
# exception; the book's test `tests/test_batch_from_requests.py` builds batches under it on the GPU
# machine. On this device:

# %%
if device.type == "cuda":
    with warnings.catch_warnings():  # torch warns that sync debug mode is a prototype feature (on stderr)
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("error")
        try:
            bi.batch_info_from_requests(["a", None, "b"], [3, 10, 5], uid_to_slot, ranks, scalings, device)
            print("built on the GPU with sync debug mode 'error': no synchronization")
        finally:
            torch.cuda.set_sync_debug_mode("default")
else:
    print("no GPU here: the synchronization check runs in the GPU test suite")

# %% [markdown]
# **Skipping.** `has_active_lora` is False when every request with tokens uses a rank-0 slot. Then the
# layers do not launch the LoRA kernels at all: an all-base batch costs exactly the base model.
#
# ### Exercise ch07.1: `batch_info_from_requests`
#
# Write `batch_info_from_requests(req_uids, req_lens, uid_to_slot, lora_ranks, scalings, device)`
# returning the default view (one segment per request, zero-length requests kept as empty segments):
# a `reference.batch_info.LoRABatchInfo` with
# - `bs` = `num_segments` = the number of requests, `max_len` = the longest request (0 if none);
#   `has_active_lora` = some request with at least one token uses a slot of rank > 0 (a host bool);
# - `seg_lens`, `seg_indptr` (starts at 0), `weight_indices`, `req_seg_indptr` (= `seg_indptr` here),
#   `req_weight_indices` (= `weight_indices` here), `token_slots` (one per token): int32;
#   `lora_ranks` int32 and `scalings` float32 (the given per-slot lists); `permutation` None;
# - every tensor on `device`; raise `ValueError` if a uid (the base model's `None` included) is not in
#   `uid_to_slot`.
# Compute everything from the host lists: no `.item()`, `.tolist()`, `bool(t)`, `int(t)` or `if t:`
# on a tensor, and no `print(t)` or `np.asarray(t)` either (printing a tensor reads its values too:
# debug-print the host lists instead). The grader records every such read your function makes and
# fails the case, on the CPU too. Build each tensor from a host list (`torch.tensor(values, dtype=..., device="cpu")`) and send it
# to `device` with one copy; on CUDA stage it in pinned memory, `host.pin_memory().to(device,
# non_blocking=True)`, since a copy from pageable memory waits for the GPU (the GPU grader records that
# too). One case passes `device="meta"`, PyTorch's device of tensors that have shapes and dtypes but
# no data (every machine has it): results built on the host and sent to `device` land there, so a
# function that ignores `device` shows on a CPU-only machine too.

# %% exercise="ch07.1" role="answer"
import torch
from reference.batch_info import LoRABatchInfo


def batch_info_from_requests(req_uids, req_lens, uid_to_slot, lora_ranks, scalings, device):
    """The per-request LoRABatchInfo of one forward, from host lists only."""
    ### BEGIN SOLUTION
    missing = [u for u in req_uids if u not in uid_to_slot]
    if missing:
        raise ValueError(f"uids not resident: {missing}")
    slots = [uid_to_slot[u] for u in req_uids]
    indptr = [0]
    for n in req_lens:
        indptr.append(indptr[-1] + n)
    token_slots = [s for s, n in zip(slots, req_lens) for _ in range(n)]

    def send(values, dtype):
        host = torch.tensor(values, dtype=dtype)
        if torch.device(device).type == "cuda":  # from pageable memory the copy would wait for the GPU
            return host.pin_memory().to(device, non_blocking=True)
        return host.to(device)

    return LoRABatchInfo(
        bs=len(slots), num_segments=len(slots), max_len=max(req_lens, default=0),
        has_active_lora=any(n > 0 and lora_ranks[s] > 0 for n, s in zip(req_lens, slots)),
        seg_lens=send(list(req_lens), torch.int32), seg_indptr=send(indptr, torch.int32),
        weight_indices=send(slots, torch.int32), lora_ranks=send(list(lora_ranks), torch.int32),
        scalings=send(list(scalings), torch.float32), permutation=None,
        token_slots=send(token_slots, torch.int32), req_seg_indptr=send(indptr, torch.int32),
        req_weight_indices=send(slots, torch.int32),
    )
    ### END SOLUTION


# %% exercise="ch07.1" role="test"
graders.check("ch07.1", batch_info_from_requests)

# %% [markdown]
# The reference (shown once your check above passed) also builds the sorted and chunked views of the
# next section, and checks every host input first:

# %%
graders.show_reference("ch07.1")

# %% [markdown]
# ## 2. Several views of one batch
#
# The reference builds the other views with two flags. `sort_by_slot=True` groups the requests by slot
# (a stable permutation of the tokens, chapter 02) so every adapter is one segment, Punica's SGMV;
# `chunk_size=c` merges neighbours of one slot and cuts them into chunks (chapter 04). In every view
# the **per-request** view stays beside the kernel's segments: `req_seg_indptr` and
# `req_weight_indices`. Chunked or sorted segments no longer say where a request starts and ends, and
# some consumers need exactly that: MoE LoRA routes each request's tokens to experts per request, and
# the sampler needs each request's last token.

# %%
for flags in ({}, {"sort_by_slot": True}, {"chunk_size": 4}):
    v = bi.batch_info_from_requests(["a", None, "b"], [3, 10, 5], uid_to_slot, ranks, scalings, "cpu", **flags)
    perm = None if v.permutation is None else v.permutation.tolist()
    print(f"{str(flags):25s} seg_lens {v.seg_lens.tolist()}, weight_indices {v.weight_indices.tolist()}, "
          f"max_len {v.max_len}, permutation {perm}")
    print(f"{'':25s} req_seg_indptr {v.req_seg_indptr.tolist()}, req_weight_indices {v.req_weight_indices.tolist()}")

# %% [markdown]
# ## 3. The slot-sorted view for CUDA graphs
#
# A CUDA graph replays kernels with the **same grid and the same pointers** every time (chapter 08).
# A segment table whose length is the number of requests changes with every batch, so graph paths use
# a table of fixed size instead: segment s *is* slot s (empty slots give empty segments). Built from
# `token_slots`: per-slot token counts (a bincount with `minlength = num_slots`), slot offsets (a prefix
# sum starting at 0), and the token ids sorted by slot (stable). TensorRT-LLM's LoRA CUDA-graph path
# builds these; SGLang's CUDA-graph LoRA runner sizes its buffers the same way.
#
# With **speculative decoding**, each sequence verifies several draft tokens in one forward: rows
# `q * tps .. q * tps + tps - 1` of x belong to sequence q (`tps` = tokens per sequence), and all of
# them use q's adapter. The view is computed at sequence level and expanded to tokens: counts times
# `tps`, and each sorted sequence q contributes ids `q*tps .. q*tps + tps - 1`. Example: `token_slots
# [2, 0, 2, 1]`, 4 slots, `tps = 2`:

# %%
counts, offsets, ids = bi.slot_sorted_view([2, 0, 2, 1], 4, tokens_per_seq=2, device="cpu")
print("slot_counts", counts.tolist(), " slot_offsets", offsets.tolist(), " sorted_token_ids", ids.tolist())

# %% [markdown]
# ### Exercise ch07.2: `slot_sorted_view`
#
# Write `slot_sorted_view(token_slots, num_slots, tokens_per_seq, device)`: `token_slots` a host list
# of ints, one per **sequence** (with `tokens_per_seq > 1` a sequence has several tokens; the name
# follows the decode case, where they coincide). Return `(slot_counts [num_slots] int32, slot_offsets
# [num_slots + 1] int32, sorted_token_ids [len(token_slots) * tokens_per_seq] int64)` as in the
# example, all on `device`, sequences of one slot in their original order. Raise `ValueError` when a
# slot is outside `0..num_slots-1` (too large or negative) or `tokens_per_seq` is below 1.

# %% exercise="ch07.2" role="answer"
import torch


def slot_sorted_view(token_slots, num_slots, tokens_per_seq, device):
    """Per-slot token counts, offsets, and token ids grouped by slot (fixed-size segment table)."""
    ### BEGIN SOLUTION
    if any(not 0 <= s < num_slots for s in token_slots):
        raise ValueError("slot out of range")
    if tokens_per_seq < 1:
        raise ValueError("tokens_per_seq must be at least 1")
    counts = [0] * num_slots
    for s in token_slots:
        counts[s] += tokens_per_seq
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    order = sorted(range(len(token_slots)), key=lambda q: token_slots[q])
    ids = [q * tokens_per_seq + j for q in order for j in range(tokens_per_seq)]
    return (torch.tensor(counts, dtype=torch.int32).to(device), torch.tensor(offsets, dtype=torch.int32).to(device),
            torch.tensor(ids, dtype=torch.int64).to(device))
    ### END SOLUTION


# %% exercise="ch07.2" role="test"
graders.check("ch07.2", slot_sorted_view)

# %% [markdown]
# The reference also accepts `token_slots` as a device tensor (a graph path builds the view from the
# batch's `token_slots`), and counts with `index_add_` rather than `torch.bincount`, which on CUDA
# reads its input's maximum on the host:

# %%
graders.show_reference("ch07.2")

# %% [markdown]
# ## 4. A LoRA layer wraps the base layer
#
# The LoRA layer owns a reference to the base layer and calls its forward: it never copies the base
# layer's weights or code, so whatever the base layer does (a quantized GEMM, a tensor-parallel
# shard, a fused kernel) stays as it is. Then it adds the LoRA delta **in place** into the output,
# with chapter 02's ops: `t = shrink(rows, A, info, rows.new_empty(n, A.shape[1]))` (columns past a
# token's rank are left as they were, and expand never reads them), then
# `expand(t, B, info, y.view(-1, out))`.
#
# The batch reaches the layers through **one documented hook**: a `LoRAContext` object that every
# wrapped layer holds, and that the serving loop updates with `context.set_batch(info)` before each
# forward. No module global, no thread-local: the dependency is visible in every layer's constructor,
# and two models in one process cannot see each other's batch. (SGLang passes its
# `LoRABatchInfo` through the backend object that every LoRA layer holds, vLLM through the punica
# wrapper; same idea.)
#
# ### Exercise ch07.3: `LoRALinear`
#
# Write the class `LoRALinear(nn.Module)` with `__init__(self, base, A_buffer, B_buffer, context)`
# (`A_buffer [num_slots, max_rank, in]`, `B_buffer [num_slots, out, max_rank]`, `context.batch_info`
# the current `LoRABatchInfo`) and `forward(self, x)` for `x [batch, seq, in]` whose rows, flattened,
# are the batch info's tokens:
# - `y = self.base(x)`, called exactly once;
# - if `batch_info.has_active_lora` is False, return `y` untouched;
# - otherwise add `scalings[slot] * (x A^T) B^T` per token into `y`, in place (use
#   `reference.ops.torch_ref`'s `shrink(rows, A_buffer, info, t)` with a preallocated
#   `t = rows.new_empty(n, max_rank)` on x's device, and `expand(t, B_buffer, info, y.view(-1, out))`),
#   and return `y` itself (in x's dtype, the base layer's). t's dtype is a design choice, not graded:
#   SGLang's shrink returns x's dtype, vLLM keeps t in float32 (`punica_gpu.py`, "We set the buffer
#   to be float32 by default"), one more rounding avoided for twice the bytes of a small tensor;
# - read `batch_info` from `context` at every forward (the caller sets a new one per batch), and no
#   tensor value on the host (the grader records `.item()`, `bool(t)`, ... as in ch07.1).
# The grader runs one forward with adapters and one whose batch has only the base model (in fp32,
# fp16 and bf16, with per-request, slot-sorted and chunked batch infos), counts the base layer's
# calls and the LoRA ops' calls, checks that the returned tensor is the base layer's own output,
# and poisons every slot's padding with NaN.

# %% exercise="ch07.3" role="answer"
import torch
from torch import nn
from reference.ops import torch_ref


class LoRALinear(nn.Module):
    """base(x) plus the batch's LoRA deltas, added in place; the batch comes from context."""

    def __init__(self, base, A_buffer, B_buffer, context):
        super().__init__()
        ### BEGIN SOLUTION
        self.base, self.A_buffer, self.B_buffer, self.context = base, A_buffer, B_buffer, context
        ### END SOLUTION

    def forward(self, x):
        ### BEGIN SOLUTION
        y = self.base(x)
        info = self.context.batch_info
        if not info.has_active_lora:
            return y
        rows = x.reshape(-1, x.shape[-1])
        t = rows.new_empty(rows.shape[0], self.A_buffer.shape[1])
        torch_ref.shrink(rows, self.A_buffer, info, t)
        torch_ref.expand(t, self.B_buffer, info, y.view(-1, y.shape[-1]))
        return y
    ### END SOLUTION


# %% exercise="ch07.3" role="test"
graders.check("ch07.3", LoRALinear)

# %% [markdown]
# The reference layer adds what a real model needs: packed parts. Transformers' Llama has separate
# `q_proj`, `k_proj`, `v_proj` modules, while the pool holds one packed `qkv_proj` slot (chapter 04).
# Each projection gets a `LoRALinear` for its part; the three share a `SharedShrink` that computes the
# stacked shrink (`stack_num = 3`) on the first call and hands it to the others, recognising the shared
# input by the tensor object itself (transformers calls the three on the same hidden states). Each
# part then expands its own rows of B into its own output:

# %%
graders.show_reference("ch07.3")

# %% [markdown]
# ## 5. The whole model, against PEFT
#
# The judge of chapter 06, now with our layers instead of hooks: a tiny seeded Llama (GQA) from a
# config, three PEFT adapters (q and v at rank 4; the MLP at rank 6 with a regex `target_modules`;
# every linear layer at rank 8 with rsLoRA) saved to a temporary folder; a pool in the packed layout;
# `wrap_llama` replaces every target projection by a `LoRALinear`. Requests are rows of a right-padded
# batch (a row's padding belongs to its request, as in PEFT), one adapter per row, one row on the base
# model. PEFT's own forward with `adapter_names=[...]` is the reference; the book's tests
# (`tests/test_layers.py`) require a maximum error of at most 1e-5 times the logits' largest
# magnitude in fp32, for the torch ops and the Triton kernels alike.

# %%
import transformers  # noqa: E402
import peft  # noqa: E402

transformers.logging.set_verbosity_error()  # keep the outputs to what we print

CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
MODULES = (ModuleSpec("qkv_proj", 64, (64, 32, 32)), ModuleSpec("o_proj", 64, (64,)),
           ModuleSpec("gate_up_proj", 64, (96, 96)), ModuleSpec("down_proj", 96, (64,)))
ADAPTERS = {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "mlp": dict(r=6, lora_alpha=12, target_modules=r".*\.mlp\.(gate|up|down)_proj"),
            "rs": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True)}
torch.manual_seed(0)
base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
workdir = Path(tempfile.mkdtemp(prefix="ch07-adapters-"))
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(workdir / name)
    judge = peft.PeftModel.from_pretrained(copy.deepcopy(base), workdir / "qv", adapter_name="qv")
    for name in ("mlp", "rs"):
        judge.load_adapter(workdir / name, adapter_name=name)
judge = judge.to(device).eval()
on_disk = {n: load_peft_adapter(workdir / n, MODULES, CFG["num_hidden_layers"], 8, uid=n) for n in ADAPTERS}


def serve(model, context, pool, names, ids, mask, **flags):
    """The serving loop's three steps: slots (control plane), batch info (host), the hook, then forward."""
    uids = [None if n == "__base__" else n for n in names]
    uid_to_slot = pool.prepare_lora_batch(uids)
    context.set_batch(bi.batch_info_from_requests(uids, [ids.shape[1]] * len(uids), uid_to_slot,
                                               pool.lora_ranks_host, pool.scalings_host, device, **flags))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CFG["vocab_size"], (len(lens), max(lens)), generator=g)
    mask = (torch.arange(max(lens))[None, :] < torch.tensor(lens)[:, None]).long()
    return ids.to(device), mask.to(device)


pool = LoRAMemoryPool(MODULES, CFG["num_hidden_layers"], 4, 8, device=device, adapter_source=on_disk.__getitem__)
context = LoRAContext()
ours = wrap_llama(copy.deepcopy(base).to(device), pool, context, backend="torch")
print(sum(isinstance(m, layers.LoRALinear) for m in ours.modules()), "projections wrapped")
names, lens = ["qv", "__base__", "mlp", "rs"], [5, 7, 3, 6]
ids, mask = prompts(lens, 1)
real = mask.bool()
for flags in ({}, {"sort_by_slot": True}, {"chunk_size": 4}):
    got = serve(ours, context, pool, names, ids, mask, **flags)
    with torch.no_grad():
        want = judge(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    err, scale = (got[real] - want[real]).abs().max().item(), want[real].abs().max().item()
    print(f"prefill {str(flags):25s} max |ours - PEFT| = {err:.2e} (logits up to {scale:.2f}): "
          f"{err / scale:.1e} of the scale, within 1e-5: {err <= 1e-5 * scale}")
plain = unwrap_llama(copy.deepcopy(ours))(input_ids=ids, attention_mask=mask).logits.detach()
print("the base row equals the base model's output bit for bit:", torch.equal(got[1], plain[1]))

# %% [markdown]
# Greedy decoding: after the prefill, each step is a decode batch (one token per request, so
# `max_len` is 1 and `token_slots` is the BGMV view) with the models' KV caches. Both sides must
# generate the same tokens:

# %%
pos = torch.arange(ids.shape[1], device=device).expand_as(ids)
uids = [None if n == "__base__" else n for n in names]
context.set_batch(bi.batch_info_from_requests(uids, [ids.shape[1]] * 4, pool.prepare_lora_batch(uids),
                                           pool.lora_ranks_host, pool.scalings_host, device))
with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    out = ours(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    ref = judge(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, adapter_names=names)
    last = torch.tensor(lens, device=device) - 1
    rows = torch.arange(4, device=device)
    got, want = out.logits[rows, last], ref.logits[rows, last]
    for step in range(3):
        token, ref_token = got.argmax(-1), want.argmax(-1)
        print(f"step {step}: tokens {token.tolist()} vs PEFT {ref_token.tolist()}, "
              f"max logit error {(got - want).abs().max().item():.2e}")
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step_pos = (last + 1 + step)[:, None]
        context.set_batch(bi.batch_info_from_requests(uids, [1] * 4, pool.prepare_lora_batch(uids),
                                                   pool.lora_ranks_host, pool.scalings_host, device))
        out = ours(input_ids=token[:, None], attention_mask=mask, position_ids=step_pos,
                   past_key_values=out.past_key_values, use_cache=True)
        ref = judge(input_ids=ref_token[:, None], attention_mask=mask, position_ids=step_pos,
                    past_key_values=ref.past_key_values, use_cache=True, adapter_names=names)
        got, want = out.logits[:, -1], ref.logits[:, -1]

# %% [markdown]
# Changing adapter sets with fewer slots than adapters: a pool of 2 slots serves batches whose
# adapters (and the base model) come and go, so slots are evicted and reloaded between batches
# (chapter 05's zero-fill and metadata rules at work). Every batch must still match, including a base
# request right after an adapter request on the same slot:

# %%
small = LoRAMemoryPool(MODULES, CFG["num_hidden_layers"], 2, 8, device=device, adapter_source=on_disk.__getitem__)
ctx2 = LoRAContext()
ours2 = wrap_llama(copy.deepcopy(base).to(device), small, ctx2, backend="torch")
for i, names in enumerate([["qv", "mlp"], ["rs"], ["__base__", "qv"], ["mlp", "rs"], ["__base__"]]):
    ids, mask = prompts([4 + i] * len(names), 10 + i)
    start = len(small.events)
    got = serve(ours2, ctx2, small, names, ids, mask)
    with torch.no_grad():
        want = judge(input_ids=ids, attention_mask=mask, adapter_names=names).logits
    print(f"batch {i} {names}: max error {(got - want).abs().max().item():.2e}; events {small.events[start:]}")

# %% [markdown]
# ## 6. How production systems do it
#
# - **SGLang**, `python/sglang/srt/lora/`: `lora_manager.py` (`prepare_lora_batch`: slots, then the
#   batch info, once per forward), `utils.py` (`LoRABatchInfo`), `backend/triton_backend.py` and
#   `backend/chunked_backend.py` (the per-backend metadata: per-request segments, or chunks with a
#   permutation), `layers.py` (`BaseLayerWithLoRA` wrapping the base layer; `QKVParallelLinearWithLoRA`
#   and `MergedColumnParallelLinearWithLoRA` for the packed projections), and a CUDA-graph path whose
#   batch info lives in preallocated buffers updated in place.
# - **vLLM**, `vllm/lora/`: `punica_wrapper/punica_gpu.py` (`PunicaWrapperGPU` builds the per-batch
#   metadata: token-to-adapter mapping, tokens sorted by adapter, per-adapter counts and offsets),
#   `layers/` (one LoRA layer class per base layer type, each calling the base layer and then the
#   punica wrapper's `add_lora_*`).
# - **TensorRT-LLM** (PyTorch backend): the LoRA parameters of a batch (per-request adapter ids,
#   ranks, weight pointers) are prepared once per iteration; its CUDA-graph LoRA path keeps per-slot
#   counts, offsets and sorted token ids in fixed-size buffers, the view of section 3.
#
# ## Summary
#
# - The batch info is built on the host from the requests' uids and lengths and the pool's host
#   copies; one copy per tensor, no device reads. An all-base batch skips the LoRA kernels entirely.
# - Segment views (per request, sorted by slot, chunked) serve the kernels; the per-request view
#   stays beside them for consumers that need request boundaries.
# - CUDA-graph paths use a fixed-size, slot-indexed segment table; speculative decoding expands it to
#   several tokens per sequence.
# - LoRA layers wrap the base layers, add the delta in place, read the batch through one explicit
#   context, and share one shrink per packed group.
# - End to end, the wrapped model matches PEFT for prefill, greedy decode and changing adapter sets.
#
# ## Review questions
#
# 1. `has_active_lora` computed as `bool((info.lora_ranks[info.weight_indices] > 0).any())` gives the
#    same value. What does it cost on a GPU, per layer and per decode step, and why?
# 2. A batch of 3 requests is chunked with `chunk_size = 4`. Which field tells the sampler where
#    request 1's last token is, and why can't it use `seg_indptr`?
# 3. In the slot-sorted view, why must empty slots still have (empty) segments?
# 4. A serving loop forgets to call `context.set_batch` for a base-only batch after a batch with
#    adapters. What does the reference layer do, and what would a layer that cached the last batch
#    info in a module global do?
# 5. `SharedShrink` recognises q, k and v's shared input by the tensor object. Name a model change
#    that would break that assumption, and what the layer would then compute.
