"""Cases for chapter 07 (batch metadata from requests, LoRA layers).

ch07.1 compares a whole ``LoRABatchInfo`` field by field (host fields equal, tensors exact in dtype
and value). ch07.3 grades a layer class through a driver that wraps a counting base layer, poisons
every slot's padding with NaN, runs one forward with adapters and one with only the base model, and
reports the output, how often the base layer ran, and whether the base-only forward was exactly the
base layer's output.
"""
from __future__ import annotations

import functools
import random
from types import SimpleNamespace
from typing import Optional

import torch
from torch import nn

from graders.machine.exercise import Case, Exercise
from reference.batch_info import batch_info_from_requests, slot_sorted_view
from reference.device import default_device
from reference.ops import torch_ref

__all__ = ["EXERCISES", "drive_lora_linear", "ReferenceLoRALinear", "batch_info_default"]


# ---------------------------------------------------------------------------------------------
# ch07.1 batch_info_from_requests (the default view: one segment per request)


def batch_info_default(req_uids, req_lens, uid_to_slot, lora_ranks, scalings, device):
    """Reference for ch07.1: the per-request view, no sorting, no chunks."""
    return batch_info_from_requests(req_uids, req_lens, uid_to_slot, lora_ranks, scalings, device)


def _requests_case(name, uids, lens, uid_to_slot, ranks, scalings, device=None) -> Case:
    """``device``: the grading device unless given ("meta": a device that is never the default one, so
    an answer that ignores its ``device`` argument fails on a CPU-only machine too)."""
    device = device or str(default_device())
    desc = (f"req_uids {uids!r}, req_lens {lens}, uid_to_slot {uid_to_slot!r}, lora_ranks {ranks}, "
            f"scalings {scalings}, device {device!r}")
    return Case(name, [list(uids), list(lens), dict(uid_to_slot), list(ranks), list(scalings), device], desc,
                op="exact")


def _requests_edge() -> list[Case]:
    slots = {None: 0, "b": 1, "a": 2}
    ranks, scal = [0, 4, 8], [0.0, 0.5, 2.0]
    return [
        _requests_case("running_example", ["a", None, "b"], [3, 10, 5], slots, ranks, scal),
        _requests_case("empty_batch", [], [], slots, ranks, scal),
        _requests_case("requests_but_zero_tokens", ["a", None, "b"], [0, 0, 0], slots, ranks, scal),
        _requests_case("all_base_no_active_lora", [None, None], [2, 3], slots, ranks, scal),
        _requests_case("zero_length_request_kept", ["a", "b", "a"], [2, 0, 3], slots, ranks, scal),
        _requests_case("decode_one_token_each", ["b", "a", None, "b"], [1, 1, 1, 1], slots, ranks, scal),
        _requests_case("adapter_with_zero_tokens_is_not_active", ["a", None], [0, 4], slots, ranks, scal),
        _requests_case("base_model_in_slot_2", ["x", None], [2, 2], {"x": 0, None: 2}, [4, 0, 0], [1.0, 0.0, 0.0]),
        # an adapter is not a rank: a resident uid whose slot has rank 0 (all its modules zero-filled)
        # computes no LoRA, so a batch of it and the base model has nothing active
        _requests_case("resident_adapter_of_rank_0_is_not_active", ["z", None, "z"], [3, 2, 1],
                       {None: 0, "z": 1}, [0, 0], [0.0, 0.0]),
        _requests_case("uid_not_resident_raises_value_error", ["a", "z"], [1, 1], slots, ranks, scal),
        _requests_case("base_model_not_resident_raises_value_error", ["a", None], [1, 1], {"a": 1}, [0, 4], [0.0, 0.5]),
        _requests_case("zero_token_uid_not_resident_raises_value_error", ["z", "a"], [0, 2], slots, ranks, scal),
        _requests_case("every_tensor_on_the_device_argument", ["a", None, "b"], [3, 10, 5], slots, ranks, scal,
                       device="meta"),
    ]


def _requests_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: mixed lengths with zeros, a decode batch, adapters with zero tokens beside base
    requests (not active), a batch with requests and no tokens, a long batch; the base model in a
    random slot, scalings that are not exact in float16."""
    cases = []
    for i in range(6):
        n_slots = rng.randint(2, 6)
        ranks = [rng.choice([1, 4, 16]) for _ in range(n_slots)]
        base_slot = rng.randrange(n_slots)
        ranks[base_slot] = 0
        uids = [f"u{s}" for s in range(n_slots) if s != base_slot]
        uid_to_slot = {None: base_slot, **{u: s for u, s in zip(uids, [s for s in range(n_slots) if s != base_slot])}}
        scal = [0.0 if r == 0 else rng.choice([0.25, 1.0, 2.0, 0.1, 1 / 3]) for r in ranks]
        n = rng.randint(2, 8) if i != 4 else rng.randint(20, 40)
        req = [rng.choice([None, *uids]) for _ in range(n)]
        req[rng.randrange(n)] = rng.choice(uids)  # at least one adapter request
        if i == 1:
            lens = [1] * n
        elif i == 2:  # adapter requests without tokens, base requests with: nothing active
            req[0], req[-1] = rng.choice(uids), None
            lens = [0 if u is not None else rng.choice([1, 3, 7]) for u in req]
        elif i == 3:
            lens = [0] * n
        else:
            lens = [rng.choice([0, 1, 3, 7, 16]) for _ in range(n)]
            lens[rng.randrange(n)] = 0
            lens[next(j for j, u in enumerate(req) if u is not None)] = rng.choice([2, 5])
        cases.append(_requests_case(f"random_{i}", req, lens, uid_to_slot, ranks, scal))
    return cases


def _requests_hint(case: Case, expected, got) -> Optional[str]:
    if expected is None or got is None or not hasattr(got, "seg_indptr"):
        return None
    if isinstance(got.has_active_lora, torch.Tensor):
        return "has_active_lora is a host bool computed from the host lists; a tensor (or .item()) would read the device"
    if expected.has_active_lora != got.has_active_lora:
        uids, lens, uid_to_slot, ranks = case.args[:4]
        if got.has_active_lora and any(n > 0 and u is not None for u, n in zip(uids, lens)) \
                and not any(n > 0 and ranks[uid_to_slot[u]] > 0 for u, n in zip(uids, lens)):
            return ("has_active_lora asks whether some LoRA computes anything: a request of an adapter whose "
                    "slot has rank 0 (lora_ranks[slot] == 0) computes none, like the base model; decide from "
                    "the slot's rank, not from the uid being None")
        return ("has_active_lora: some request with at least one token uses a slot of rank > 0; the base "
                "model's slot has rank 0, wherever it is")
    return None


# ---------------------------------------------------------------------------------------------
# ch07.2 slot_sorted_view


def _view_case(name, slots, num_slots, tps) -> Case:
    # No device="meta" case here (ch07.1 has one): this contract allows computing on the device
    # (section 3's bincount), and ops that need values cannot run on meta
    device = str(default_device())
    return Case(name, [list(slots), num_slots, tps, device], f"token_slots {slots}, num_slots {num_slots}, "
                f"tokens_per_seq {tps}, device {device!r}", op="exact")


def _view_edge() -> list[Case]:
    return [
        _view_case("example_in_the_text_tps_2", [2, 0, 2, 1], 4, 2),
        _view_case("one_token_per_seq", [1, 0, 1, 1, 0], 3, 1),
        _view_case("empty_slots_give_empty_segments", [3, 3], 5, 1),
        _view_case("last_slot_used", [0, 4, 4, 1], 5, 3),
        _view_case("no_sequences", [], 3, 2),
        _view_case("one_slot", [0, 0, 0], 1, 2),
        _view_case("stable_order_within_a_slot", [1, 0, 1, 0, 1, 0], 2, 3),
        # torch's CPU argsort happens to be stable on short inputs: 40 sequences tell
        _view_case("stable_order_40_sequences", [(7 * q) % 3 for q in range(40)], 3, 1),
        _view_case("slot_equal_to_num_slots_raises_value_error", [0, 4], 4, 1),
        _view_case("negative_slot_raises_value_error", [0, -1], 4, 1),
        _view_case("tokens_per_seq_0_raises_value_error", [0, 1], 2, 0),
        _view_case("negative_tokens_per_seq_raises_value_error", [0, 1], 2, -2),
    ]


def _view_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: tokens_per_seq 1, 2, 3 and 4 (by index), one draw of 40-60 sequences (stability),
    the last slot used and a slot left empty."""
    cases = []
    for i, tps in enumerate([1, 2, 3, 4, 1]):
        s = rng.choice([3, 5, 8])
        n = rng.randint(40, 60) if i == 4 else rng.randint(4, 30)
        slots = [rng.randrange(s - 1) for _ in range(n)]  # slot s - 2 ... and slot s - 1 unused so far
        slots[rng.randrange(n)] = s - 1
        empty = rng.randrange(s - 1)
        slots = [x if x != empty else s - 1 for x in slots]
        cases.append(_view_case(f"random_{i}", slots, s, tps))
    return cases


def _view_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 3 and all(isinstance(t, torch.Tensor) for t in got)):
        return "return (slot_counts, slot_offsets, sorted_token_ids) as three tensors"
    tps = case.args[2]
    if got[0].shape == expected[0].shape and torch.equal(got[0].cpu().long() * tps, expected[0].cpu().long()) and tps > 1:
        return "slot_counts count tokens: each sequence brings tokens_per_seq of them"
    if got[1].shape[0] == expected[1].shape[0] - 1:
        return "slot_offsets has num_slots + 1 entries, starting at 0"
    if torch.equal(got[0].cpu(), expected[0].cpu()) and not torch.equal(got[2].cpu(), expected[2].cpu()):
        return ("sorted_token_ids: sequences of one slot keep their original order (a stable sort), and each "
                "sorted sequence q contributes q*tps .. q*tps + tps - 1 consecutively")
    return None


# ---------------------------------------------------------------------------------------------
# ch07.3 LoRALinear


class _CountingLinear(nn.Linear):
    """The base layer of the driver: an nn.Linear that counts its forward calls."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__(weight.shape[1], weight.shape[0], device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
            self.bias.copy_(bias)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = super().forward(x)
        return self.last


class _OpCounter:
    """Counts calls of the reference ops (reference.ops.torch_ref) while active."""

    SHRINKS = ("shrink", "sgmv_shrink", "bgmv_shrink")  # (x, A_stack, batch_info, out, stack_num=1)
    EXPANDS = ("expand", "sgmv_expand", "bgmv_expand")  # (t, B_stack, batch_info, out, slice_offsets=None)

    def __enter__(self):
        self.calls, self.saved = 0, {n: getattr(torch_ref, n) for n in self.SHRINKS + self.EXPANDS}
        for name, fn in self.saved.items():
            setattr(torch_ref, name, self._shrink(fn) if name in self.SHRINKS else self._expand(fn))
        return self

    def _shrink(self, fn):
        def shrink(x, A_stack, batch_info, out, stack_num=1):
            self.calls += 1
            return fn(x, A_stack, batch_info, out, stack_num)
        return shrink

    def _expand(self, fn):
        def expand(t, B_stack, batch_info, out, slice_offsets=None):
            self.calls += 1
            return fn(t, B_stack, batch_info, out, slice_offsets)
        return expand

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch_ref, name, fn)


#: What drive_lora_linear returns, as the reports name it ("returned check '...': expected True, got False").
LINEAR_CHECKS = ("y (the first forward's output)", "count 'base layer calls in one forward'",
                 "check 'the base-only forward returns exactly base(x)'", "count 'base layer calls in both forwards'",
                 "check 'forward returns the base layer's own output tensor, the delta added in place'",
                 "count 'LoRA op calls in the base-only forward'")


def drive_lora_linear(layer_cls, x, weight, bias, A_buffer, B_buffer, batch_info, base_info):
    """One forward with ``batch_info`` then one with ``base_info`` (no active adapter).

    Returns (y [batch, seq, out], base calls during the first forward, the second forward's output
    equal to the base layer's, bit for bit, base calls in all, the first output being the base
    layer's own tensor (the delta added in place), reference ops called in the base-only forward).
    """
    base = _CountingLinear(weight, bias)
    context = SimpleNamespace(batch_info=batch_info)
    layer = layer_cls(base, A_buffer, B_buffer, context)
    with torch.no_grad():
        y = layer(x)
        first_calls = base.calls
        in_place = y is getattr(base, "last", None)
        context.batch_info = base_info
        with _OpCounter() as ops:
            y_base = layer(x)
        # the base layer's own parameters (same memory, same kernel path; a copy elsewhere could round differently)
        plain = nn.functional.linear(x, base.weight, base.bias)
    base_exact = isinstance(y_base, torch.Tensor) and y_base.shape == plain.shape and bool(torch.equal(y_base, plain))
    return y, first_calls, base_exact, base.calls, in_place, ops.calls


class ReferenceLoRALinear(nn.Module):
    """Reference for ch07.3 (the shape of reference/layers.py's LoRALinear, without packing)."""

    def __init__(self, base, A_buffer, B_buffer, context):
        super().__init__()
        self.base, self.A_buffer, self.B_buffer, self.context = base, A_buffer, B_buffer, context

    def forward(self, x):
        y = self.base(x)
        info = self.context.batch_info
        if not info.has_active_lora:
            return y
        rows = x.reshape(-1, x.shape[-1])
        t = torch_ref.shrink(rows, self.A_buffer, info, rows.new_empty(rows.shape[0], self.A_buffer.shape[1]))
        torch_ref.expand(t, self.B_buffer, info, y.view(-1, y.shape[-1]))
        return y


def _linear_case(name, gen, batch, seq, d_in, d_out, ranks, slots_per_row, dtype=torch.float32,
                 view: str = "per_request") -> Case:
    """``view``: the batch info's segments: "per_request", "sorted" (grouped by slot through a
    permutation) or "chunked" (chunks of 2 tokens); the layer must pass any of them to the ops."""
    max_rank = max(max(ranks), 1)
    A = torch.randn(len(ranks), max_rank, d_in, generator=gen) * d_in**-0.5
    B = torch.randn(len(ranks), d_out, max_rank, generator=gen) * max_rank**-0.5
    for s, r in enumerate(ranks):
        A[s, r:], B[s, :, r:] = float("nan"), float("nan")  # padding past each rank: never read
    W = torch.randn(d_out, d_in, generator=gen) * d_in**-0.5
    bias = torch.randn(d_out, generator=gen) * 0.1
    x = torch.randn(batch, seq, d_in, generator=gen)
    scal = [0.0 if r == 0 else 0.5 + s for s, r in enumerate(ranks)]
    base_slot = ranks.index(0)
    uid_to_slot = {None: base_slot, **{f"s{s}": s for s in range(len(ranks)) if s != base_slot}}
    uids = [None if s == base_slot else f"s{s}" for s in slots_per_row]
    flags = {"per_request": {}, "sorted": {"sort_by_slot": True}, "chunked": {"chunk_size": 2}}[view]
    info = batch_info_from_requests(uids, [seq] * batch, uid_to_slot, ranks, scal, "cpu", **flags)
    base_info = batch_info_from_requests([None] * batch, [seq] * batch, uid_to_slot, ranks, scal, "cpu", **flags)
    args = [t.to(dtype) if isinstance(t, torch.Tensor) else t for t in (x, W, bias, A, B)] + [info, base_info]
    desc = (f"x [{batch}, {seq}, {d_in}] (one request per row), base nn.Linear({d_in}, {d_out}), A_buffer "
            f"{list(A.shape)}, B_buffer {list(B.shape)}, row slots {slots_per_row}, lora_ranks {ranks}, "
            f"{str(dtype).removeprefix('torch.')}, batch info {view.replace('_', ' ')}; then a forward whose "
            f"batch has only the base model")
    return Case(name, args, desc)


def _linear_edge() -> list[Case]:
    g = torch.Generator().manual_seed(71)
    return [
        _linear_case("two_requests_two_adapters", g, 2, 3, 16, 24, [0, 4, 2], [1, 2]),
        _linear_case("base_row_between_adapters", g, 3, 2, 16, 8, [0, 3], [1, 0, 1]),
        _linear_case("one_token", g, 1, 1, 8, 8, [0, 2], [1]),
        _linear_case("base_in_slot_1_rank_7", g, 2, 4, 24, 40, [7, 0, 5], [0, 2]),
        _linear_case("decode_four_requests", g, 4, 1, 16, 24, [0, 4, 2], [2, 0, 1, 2]),
        _linear_case("sorted_view_with_permutation", g, 3, 2, 16, 24, [0, 4, 2], [2, 1, 2], view="sorted"),
        _linear_case("chunked_view", g, 2, 5, 16, 24, [0, 4, 2], [1, 1], view="chunked"),
        _linear_case("fp16", g, 2, 3, 16, 24, [0, 4, 2], [1, 2], torch.float16),
        _linear_case("bf16", g, 3, 2, 16, 24, [0, 3, 2], [2, 0, 1], torch.bfloat16),
    ]


def _linear_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    """Every draw: fp32, fp16 and bf16 (by index), each batch view, a base row beside adapter rows."""
    cases = []
    for i, (dtype, view) in enumerate([(torch.float32, "per_request"), (torch.float16, "sorted"),
                                       (torch.bfloat16, "chunked"), (torch.float32, "sorted")]):
        n_slots = rng.randint(3, 4)
        ranks = [rng.choice([1, 4, 8]) for _ in range(n_slots)]
        base = rng.randrange(n_slots)
        ranks[base] = 0
        batch = rng.randint(2, 4)
        adapters = [s for s in range(n_slots) if s != base]
        rows = [rng.randrange(n_slots) for _ in range(batch)]
        rows[0], rows[-1] = rng.choice(adapters), base  # an adapter row and a base row in every batch
        rng.shuffle(rows)
        seq = rng.randint(2, 5) if i % 2 == 0 else rng.randint(1, 5)  # several tokens per row in some
        cases.append(_linear_case(f"random_{i}", gen, batch, seq, rng.choice([8, 24]),
                                  rng.choice([8, 40]), ranks, rows, dtype, view))
    return cases


def _linear_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 6):
        return None
    y, calls, base_exact, total, in_place, ops = got
    if not isinstance(y, torch.Tensor):
        return "forward must return the output tensor y (base(x) plus the deltas)"
    if calls != 1:
        return f"the base layer ran {calls} times in one forward: call self.base(x) exactly once (wrap it, never copy it)"
    if base_exact is False and ops:
        return ("the base-only forward ran the LoRA ops and changed the output: it used the batch info of an "
                "earlier forward? read self.context.batch_info in every forward (the caller sets a new one per "
                "batch) and return base(x) untouched when its has_active_lora is False")
    if base_exact is False:
        return ("a batch with no active adapter must give exactly the base layer's output: return base(x) "
                "without calling the LoRA ops (batch_info.has_active_lora is False)")
    if ops:
        return (f"the base-only forward called the LoRA ops {ops} times: when batch_info.has_active_lora is "
                "False, return base(x) without launching them")
    if in_place is False:
        return "add the delta in place into the base layer's output (y.view(-1, out) as expand's out) and return that tensor"
    if isinstance(got[0], torch.Tensor) and bool(torch.isnan(got[0]).any()):
        return "NaN: padding past a slot's rank was read (the kernels/ops clip to lora_ranks; a hand-written version must too)"
    return None


EXERCISES = [
    Exercise("ch07.1", "batch_info_from_requests",
             ("req_uids", "req_lens", "uid_to_slot", "lora_ranks", "scalings", "device"), batch_info_default,
             _requests_edge, _requests_random, _requests_hint, no_device_reads=True),
    Exercise("ch07.2", "slot_sorted_view", ("token_slots", "num_slots", "tokens_per_seq", "device"),
             slot_sorted_view, _view_edge, _view_random, _view_hint,
             result_names=("slot_counts", "slot_offsets", "sorted_token_ids")),
    Exercise("ch07.3", "LoRALinear", ("x", "weight", "bias", "A_buffer", "B_buffer", "batch_info", "base_info"),
             functools.partial(drive_lora_linear, ReferenceLoRALinear), _linear_edge, _linear_random, _linear_hint,
             driver=drive_lora_linear, no_device_reads=True, result_names=LINEAR_CHECKS),
]
