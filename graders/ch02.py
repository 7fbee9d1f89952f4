"""Cases for chapter 02 (many adapters in one batch, in PyTorch).

Every batch poisons what an op must not read or may leave alone: weights past a slot's rank and
the whole of a rank-0 slot hold NaN (so padding multiplied by a 0/1 mask still shows: 0 * NaN is
NaN), shrink outputs start as NaN, expand inputs carry NaN past each token's rank. An op that forgets
to clip to the rank, reads another slot, or leaves a defined element unwritten fails loudly. Rows of
rank-0 tokens must come back bit for bit unchanged.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from graders.core import Case, Exercise
from reference import batch_info as bi_ref
from reference import lora_math
from reference.batch_info import build_batch_info, stable_sort_by_slot
from reference.ops import torch_ref

__all__ = ["EXERCISES"]

JUNK = float("nan")  # what an op must never read


@dataclass
class BatchSpec:
    """A batch in the learner's terms: requests (tokens, slot) in arrival order and the slots."""

    name: str
    req_lens: Sequence[int]
    req_slots: Sequence[int]
    ranks: Sequence[int]  # per slot; 0 = base model / empty
    max_rank: int
    d_in: int
    d_out: int
    dtype: torch.dtype = torch.float32
    sort: bool = False  # requests arrive unsorted: SGMV groups tokens through a permutation
    scalings: Optional[Sequence[float]] = None


def _weights(spec: BatchSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(spec.ranks)
    A = torch.randn(n, spec.max_rank, spec.d_in, generator=gen) * spec.d_in**-0.5
    B = torch.randn(n, spec.d_out, spec.max_rank, generator=gen) * max(spec.max_rank, 1) ** -0.5
    for s, r in enumerate(spec.ranks):
        A[s, r:] = JUNK
        B[s, :, r:] = JUNK
    return A.to(spec.dtype), B.to(spec.dtype)


def _batch_info(spec: BatchSpec):
    """LoRABatchInfo with segments; with ``sort`` the segments are slot groups of sorted tokens."""
    scalings = spec.scalings or [0.0 if r == 0 else (0.5, 2.0, 1.5, 0.25)[s % 4] for s, r in enumerate(spec.ranks)]
    token_slots = torch.repeat_interleave(torch.tensor(list(spec.req_slots), dtype=torch.int32),
                                          torch.tensor(list(spec.req_lens), dtype=torch.int64))
    if not spec.sort:
        return build_batch_info(spec.req_lens, spec.req_slots, spec.ranks, scalings, "cpu"), token_slots
    permutation, _ = stable_sort_by_slot(token_slots)
    slots, lens = torch.unique_consecutive(token_slots[permutation], return_counts=True)
    info = build_batch_info(lens.tolist(), slots.tolist(), spec.ranks, scalings, "cpu", permutation)
    info.bs = len(spec.req_lens)
    return info, token_slots


def _row_labels(spec: BatchSpec) -> list[str]:
    labels = []
    for j, (n, s) in enumerate(zip(spec.req_lens, spec.req_slots)):
        what = "request" if spec.sort else "segment"
        labels += [f"{what} {j}, slot {s} (rank {spec.ranks[s]})"] * n
    return labels


def _describe(spec: BatchSpec, first: str) -> str:
    order = "requests arrive unsorted (permutation given)" if spec.sort else "segments"
    return (f"{first}, {spec.dtype}; {order}: lengths {list(spec.req_lens)} -> slots {list(spec.req_slots)}; "
            f"lora_ranks {list(spec.ranks)}, max_rank {spec.max_rank}")


def _x(spec, gen):
    return torch.randn(sum(spec.req_lens), spec.d_in, generator=gen).to(spec.dtype)


def _base_rows(spec: BatchSpec, width: int) -> torch.Tensor:
    """Mask of output rows whose token uses a rank-0 slot: they must stay bit for bit."""
    per_token = [spec.ranks[s] == 0 for n, s in zip(spec.req_lens, spec.req_slots) for _ in range(n)]
    return torch.tensor(per_token, dtype=torch.bool)[:, None].expand(len(per_token), width)


def loop_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    A, B = _weights(spec, gen)
    info, _ = _batch_info(spec)
    x = _x(spec, gen)
    out = torch.randn(x.shape[0], spec.d_out, generator=gen).to(spec.dtype)
    first = f"x {list(x.shape)}, A_stack {list(A.shape)}, B_stack {list(B.shape)}, out {list(out.shape)}"
    return Case(spec.name, [x, A, B, info, out], _describe(spec, first), out_index=4, row_labels=_row_labels(spec),
                exact=_base_rows(spec, spec.d_out))


def shrink_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    A, _ = _weights(spec, gen)
    info, token_slots = _batch_info(spec)
    x = _x(spec, gen)
    out = torch.full((x.shape[0], spec.max_rank), float("nan"), dtype=spec.dtype)
    ranks = torch.tensor(list(spec.ranks))[token_slots.long()]
    defined = torch.arange(spec.max_rank)[None, :] < ranks[:, None]
    first = f"x {list(x.shape)}, A_stack {list(A.shape)}, out {list(out.shape)} (filled with NaN)"
    return Case(spec.name, [x, A, info, out], _describe(spec, first), out_index=3, defined=defined,
                row_labels=_row_labels(spec))


def expand_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    _, B = _weights(spec, gen)
    info, token_slots = _batch_info(spec)
    n = sum(spec.req_lens)
    t = torch.randn(n, spec.max_rank, generator=gen)
    ranks = torch.tensor(list(spec.ranks))[token_slots.long()]
    past_rank = torch.arange(spec.max_rank)[None, :] >= ranks[:, None]
    t = torch.where(past_rank, JUNK, t).to(spec.dtype)
    out = torch.randn(n, spec.d_out, generator=gen).to(spec.dtype)
    first = f"t {list(t.shape)}, B_stack {list(B.shape)}, out {list(out.shape)} (the base output)"
    return Case(spec.name, [t, B, info, out], _describe(spec, first), out_index=3, row_labels=_row_labels(spec),
                exact=_base_rows(spec, spec.d_out))


def _edge_specs(sgmv: bool) -> list[BatchSpec]:
    specs = [
        BatchSpec("empty_batch", [], [], [0, 4], 4, 16, 16),
        BatchSpec("one_token_segments", [1, 1, 1], [1, 2, 1], [0, 4, 2], 4, 16, 24),
        BatchSpec("x_3x64_two_adapters_indptr_0_1_3", [1, 2], [1, 2], [0, 4, 8], 8, 64, 64),
        BatchSpec("zero_length_segment_in_middle", [2, 0, 3], [1, 2, 1], [0, 3, 5], 5, 24, 16),
        BatchSpec("base_model_in_slot_2", [2, 3, 2], [0, 2, 1], [5, 3, 0], 6, 20, 18),
        BatchSpec("mixed_ranks_16_and_4_padded", [3, 2, 2], [1, 2, 0], [0, 16, 4], 16, 32, 40),
        BatchSpec("adapter_repeated_non_adjacent", [2, 1, 3, 2], [1, 2, 1, 2], [0, 3, 6], 6, 16, 16),
        BatchSpec("non_power_of_two_sizes", [5, 3], [1, 2], [0, 7, 1], 7, 72, 40),
    ]
    if sgmv:
        specs.append(BatchSpec("unsorted_arrival_permutation", [2, 3, 1, 2], [2, 1, 2, 0], [0, 4, 3], 4, 24, 20,
                               sort=True))
    return specs


def _random_specs(rng: random.Random, hidden: bool, sgmv: bool) -> list[BatchSpec]:
    specs = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32, torch.float16]):
        n_slots = rng.randint(2, 6)
        max_rank = rng.choice([4, 7, 8, 16])
        ranks = [rng.choice([0, 1, max_rank // 2 or 1, max_rank]) for _ in range(n_slots)]
        ranks[rng.randrange(n_slots)] = 0  # a base-model slot, anywhere
        n_req = rng.randint(1, 7)
        lens = [rng.choice([0, 1, 1, 2, 5, 9, 17]) for _ in range(n_req)]
        slots = [rng.randrange(n_slots) for _ in range(n_req)]
        d_in, d_out = rng.choice([16, 40, 72, 96]), rng.choice([8, 24, 56, 72])
        sort = sgmv and i % 2 == 0
        if sort:  # make the arrival order really unsorted: two non-empty requests out of slot order
            lo, hi = sorted(rng.sample(range(n_slots), 2))
            lens, slots = [rng.randint(1, 9), rng.randint(1, 9), *lens], [hi, lo, *slots]
        specs.append(BatchSpec(f"random_{i}", lens, slots, ranks, max_rank, d_in, d_out, dtype, sort=sort))
    return specs


def _op_cases(make, sgmv: bool, hidden_ok: bool = True):
    def edge() -> list[Case]:
        gen = torch.Generator().manual_seed(7)
        return [make(s, gen) for s in _edge_specs(sgmv)]

    def rand(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
        return [make(s, gen) for s in _random_specs(rng, hidden, sgmv)]

    return edge, rand


def _row_slots(case: Case) -> Optional[torch.Tensor]:
    info = next(a for a in case.args if isinstance(a, bi_ref.LoRABatchInfo))
    return info.token_slots.long().cpu()


def _batch_hint(reference_op):
    def hint(case: Case, expected, got) -> Optional[str]:
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
            return None
        return _ignored_permutation(reference_op, case, got) or _batch_hint_common(case, expected, got)
    return hint


def _ignored_permutation(reference_op, case: Case, got) -> Optional[str]:
    """The hint for an SGMV op that walked segments over x's rows directly."""
    info = next(a for a in case.args if isinstance(a, bi_ref.LoRABatchInfo))
    if info.permutation is None:
        return None
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in case.args]
    idx = next(i for i, a in enumerate(args) if a is info)
    args[idx] = bi_ref.LoRABatchInfo(**{**vars(info), "permutation": None})
    reference_op(*args)
    alt = args[case.out_index].cpu().double()
    mask = case.defined if case.defined is not None else torch.ones_like(alt, dtype=torch.bool)
    g = got.double()
    if case.defined is not None and bool(torch.isnan(g[mask]).all()):
        return None  # the shrink wrote nothing at all: the NaN note says so
    if torch.allclose(torch.where(mask, g, 0.0), torch.where(mask, alt, 0.0), rtol=0.05, atol=0.05, equal_nan=True):
        return ("your result is what the batch gives without its permutation: segment rows are "
                "permutation[seg_indptr[i]:seg_indptr[i+1]] when batch_info.permutation is set")
    return None


def _batch_hint_common(case: Case, expected, got) -> Optional[str]:
    info = next(a for a in case.args if isinstance(a, bi_ref.LoRABatchInfo))
    slots = _row_slots(case)
    ranks = info.lora_ranks.cpu()[slots]
    e, g = expected.cpu().double(), got.double()
    bad = ~torch.isclose(g, e, rtol=0.05, atol=0.05)
    if case.defined is not None:
        bad &= case.defined
    bad_rows = bad.reshape(bad.shape[0], -1).any(dim=1)
    hints = []
    finite_bad = bad_rows & torch.isfinite(g.reshape(g.shape[0], -1)).all(dim=1)
    if bool(finite_bad.any()) and bool((slots[finite_bad] == 0).all()) and int(info.lora_ranks[0]) > 0:
        hints.append("rows of slot 0 differ, and slot 0 holds an adapter here: the base model is the slot "
                     "of rank 0, wherever it is")
    if bool(bad_rows.any()) and bool((ranks[bad_rows] == 0).all()):
        hints.append("only rows of rank-0 slots differ: a slot of rank 0 (the base model) must add exactly nothing")
    if bool(torch.isnan(g).any()) and not bool(torch.isnan(e).any()):
        hints.append("NaN came from padding past a slot's rank (the grader fills it with NaN): clip A to its "
                     "first r rows and B to its first r columns by slicing or torch.where (0 * NaN is NaN)")
    if hints:
        return "; ".join(hints)
    if case.defined is not None:
        scale = info.scalings.cpu().double()[slots][:, None].expand_as(e)
        region = case.defined & (scale != 1.0)
        if bool(region.any()) and torch.allclose(g[region], e[region] * scale[region], rtol=0.05, atol=0.05):
            return "your result is the expected one times scalings[slot]: shrink applies no scaling (expand does; doing both scales the delta twice)"
    return None


def _indptr_edge() -> list[Case]:
    return [_indptr_case(n, lens) for n, lens in [
        ("no_segments", []), ("one_empty_segment", [0]), ("one_segment", [5]), ("running_example_3_10_5", [3, 10, 5]),
        ("zero_length_in_middle", [2, 0, 3]), ("one_token_each", [1, 1, 1, 1])]]


def _indptr_case(name, lens) -> Case:
    return Case(name, [torch.tensor(lens, dtype=torch.int32)], f"seg_lens {lens} (int32)", op="exact")


def _indptr_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_indptr_case(f"random_{i}", [rng.choice([0, 1, 2, 7, 33, 128]) for _ in range(rng.randint(1, 40))])
            for i in range(4)]


def _indptr_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor):
        return None
    if got.dtype == torch.int64:
        return "torch.cumsum of int32 returns int64; the contract's seg_indptr is int32 (.to(torch.int32))"
    if got.shape[0] == expected.shape[0] - 1 and torch.equal(got.cpu().long(), expected[1:].cpu().long()):
        return "seg_indptr has num_segments + 1 entries and starts with 0: segment i is rows seg_indptr[i]:seg_indptr[i+1]"
    return None


def _slots_case(name, lens, slots) -> Case:
    indptr = bi_ref.seg_indptr_from_seg_lens(torch.tensor(lens, dtype=torch.int32))
    return Case(name, [indptr, torch.tensor(slots, dtype=torch.int32)],
                f"seg_indptr {indptr.tolist()}, weight_indices {slots}", op="exact")


def _slots_edge() -> list[Case]:
    return [_slots_case("no_segments", [], []), _slots_case("running_example", [3, 10, 5], [2, 0, 1]),
            _slots_case("zero_length_in_middle", [2, 0, 3], [1, 2, 1]),
            _slots_case("one_token_each", [1, 1, 1], [3, 3, 0])]


def _slots_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        n = rng.randint(1, 12)
        cases.append(_slots_case(f"random_{i}", [rng.choice([0, 1, 3, 8]) for _ in range(n)],
                                 [rng.randrange(6) for _ in range(n)]))
    return cases


def _slots_hint(case: Case, expected, got) -> Optional[str]:
    if isinstance(got, torch.Tensor) and got.shape[0] == case.args[1].shape[0] != expected.shape[0]:
        return "one entry per token (seg_indptr[-1] of them), not one per segment"
    return None


def _sort_case(name, slots) -> Case:
    return Case(name, [torch.tensor(slots, dtype=torch.int32)], f"token_slots {slots}", op="exact")


def _sort_edge() -> list[Case]:
    return [_sort_case("no_tokens", []), _sort_case("one_token", [3]), _sort_case("already_grouped", [0, 0, 1, 1, 1]),
            _sort_case("small_example", [1, 0, 1, 2]), _sort_case("interleaved_stability_matters", [2, 1, 2, 1, 2, 1, 0]),
            # torch's CPU argsort happens to be stable below 17 elements: this one is long enough to tell
            _sort_case("interleaved_40_tokens", [(7 * i) % 3 for i in range(40)])]


def _sort_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_sort_case(f"random_{i}", [rng.randrange(5) for _ in range(rng.randint(1, 60))]) for i in range(4)]


def _waste_case(name, lens, ranks) -> Case:
    return Case(name, [list(lens), list(ranks)], f"seg_lens {lens}, ranks {ranks}", op="exact")


def _waste_edge() -> list[Case]:
    return [_waste_case("empty_batch", [], []), _waste_case("all_base", [3, 4], [0, 0]),
            _waste_case("same_rank_no_waste", [5, 9], [16, 16]),
            _waste_case("one_r64_three_r16", [100, 100, 100, 100], [64, 16, 16, 16]),
            _waste_case("long_r16_short_r64", [2000, 10], [16, 64]),
            _waste_case("lengths_differ_raises_value_error", [5, 9, 2], [16, 16])]


def _waste_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_waste_case(f"random_{i}", [rng.randint(0, 3000) for _ in range(k)], [rng.choice([0, 8, 16, 64, 128]) for _ in range(k)])
            for i, k in enumerate([3, 6, 10])]


_LOOP = _op_cases(loop_case, sgmv=False)
_BGMV_SHRINK = _op_cases(shrink_case, sgmv=False)
_BGMV_EXPAND = _op_cases(expand_case, sgmv=False)
_SGMV_SHRINK = _op_cases(shrink_case, sgmv=True)
_SGMV_EXPAND = _op_cases(expand_case, sgmv=True)

EXERCISES = [
    Exercise("ch02.1", "seg_indptr_from_seg_lens", ("seg_lens",), bi_ref.seg_indptr_from_seg_lens,
             _indptr_edge, _indptr_random, _indptr_hint),
    Exercise("ch02.2", "token_slots_from_segments", ("seg_indptr", "weight_indices"), bi_ref.token_slots_from_segments,
             _slots_edge, _slots_random, _slots_hint),
    Exercise("ch02.3", "lora_loop", ("x", "A_stack", "B_stack", "batch_info", "out"), torch_ref.lora_loop,
             *_LOOP, _batch_hint(torch_ref.lora_loop)),
    Exercise("ch02.4", "bgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.bgmv_shrink,
             *_BGMV_SHRINK, _batch_hint(torch_ref.bgmv_shrink)),
    Exercise("ch02.5", "bgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.bgmv_expand,
             *_BGMV_EXPAND, _batch_hint(torch_ref.bgmv_expand)),
    Exercise("ch02.6", "sgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.sgmv_shrink,
             *_SGMV_SHRINK, _batch_hint(torch_ref.sgmv_shrink)),
    Exercise("ch02.7", "sgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.sgmv_expand,
             *_SGMV_EXPAND, _batch_hint(torch_ref.sgmv_expand)),
    Exercise("ch02.8", "stable_sort_by_slot", ("token_slots",), stable_sort_by_slot, _sort_edge, _sort_random),
    Exercise("ch02.9", "padded_flop_waste", ("seg_lens", "ranks"), lora_math.padded_flop_waste,
             _waste_edge, _waste_random),
]
