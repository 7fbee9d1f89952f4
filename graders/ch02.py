"""Cases for chapter 02 (many adapters in one batch, in PyTorch). The batch builders are shared with
chapters 03-04 (graders.cases).

Every batch poisons what an op must not read or may leave alone: weights past a slot's rank and
the whole of a rank-0 slot hold NaN (so padding multiplied by a 0/1 mask still shows: 0 * NaN is
NaN), shrink outputs start as NaN, expand inputs carry NaN past each token's rank. An op that forgets
to clip to the rank, reads another slot, or leaves a defined element unwritten fails loudly. Rows of
rank-0 tokens must come back bit for bit unchanged.
"""
from __future__ import annotations

import random
from typing import Optional

import torch

from graders.cases import batch_hint, expand_case, loop_case, op_cases, shrink_case
from graders.core import Case, Exercise
from reference import batch_info as bi_ref
from reference import lora_math
from reference.batch_info import stable_sort_by_slot
from reference.ops import torch_ref

__all__ = ["EXERCISES"]

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


_LOOP = op_cases(loop_case, sgmv=False)
_BGMV_SHRINK = op_cases(shrink_case, sgmv=False)
_BGMV_EXPAND = op_cases(expand_case, sgmv=False)
_SGMV_SHRINK = op_cases(shrink_case, sgmv=True)
_SGMV_EXPAND = op_cases(expand_case, sgmv=True)

EXERCISES = [
    Exercise("ch02.1", "seg_indptr_from_seg_lens", ("seg_lens",), bi_ref.seg_indptr_from_seg_lens,
             _indptr_edge, _indptr_random, _indptr_hint),
    Exercise("ch02.2", "token_slots_from_segments", ("seg_indptr", "weight_indices"), bi_ref.token_slots_from_segments,
             _slots_edge, _slots_random, _slots_hint),
    Exercise("ch02.3", "lora_loop", ("x", "A_stack", "B_stack", "batch_info", "out"), torch_ref.lora_loop,
             *_LOOP, batch_hint(torch_ref.lora_loop)),
    Exercise("ch02.4", "bgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.bgmv_shrink,
             *_BGMV_SHRINK, batch_hint(torch_ref.bgmv_shrink)),
    Exercise("ch02.5", "bgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.bgmv_expand,
             *_BGMV_EXPAND, batch_hint(torch_ref.bgmv_expand)),
    Exercise("ch02.6", "sgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.sgmv_shrink,
             *_SGMV_SHRINK, batch_hint(torch_ref.sgmv_shrink)),
    Exercise("ch02.7", "sgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.sgmv_expand,
             *_SGMV_EXPAND, batch_hint(torch_ref.sgmv_expand)),
    Exercise("ch02.8", "stable_sort_by_slot", ("token_slots",), stable_sort_by_slot, _sort_edge, _sort_random),
    Exercise("ch02.9", "padded_flop_waste", ("seg_lens", "ranks"), lora_math.padded_flop_waste,
             _waste_edge, _waste_random),
]
