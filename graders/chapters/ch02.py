"""Cases for chapter 02 (many adapters in one batch, in PyTorch). The batch builders are shared with
chapters 03-04 (graders.chapters.cases).

Every batch poisons what an op must not read or may leave alone: weights past a slot's rank and
the whole of a rank-0 slot hold junk, NaN or a large finite value that torch.nan_to_num cannot hide
(so padding multiplied by a 0/1 mask still shows: 0 * NaN is NaN), shrink outputs start as NaN,
expand inputs carry junk past each token's rank. An op that forgets to clip to the rank, reads
another slot, or leaves a defined element unwritten fails loudly. Rows of rank-0 tokens must come
back bit for bit unchanged.

Every op sees every layout its contract allows, in every group (graders.chapters.cases.contract_edge_specs and
contract_random_specs): segments in x order, permuted batches whose segments (slot groups reached
through the permutation) are in another order than x's rows and than token_slots, chunked segments,
fp32/bf16/fp16, t/out wider than max_rank, and batches without token_slots for the ops that never
read it. The BGMV ops thus fail when they rebuild token slots from the segments, the SGMV ops and
the loop when they read token_slots.
"""
from __future__ import annotations

import random
from typing import Optional

import torch

from graders.chapters.cases import batch_hint, contract_op_cases, expand_case, loop_case, shrink_case
from graders.machine.drivers import driven_reference, returns_python_float
from graders.machine.exercise import Case, Exercise
from reference import batch_info as bi_ref
from reference import lora_math
from reference.batch_info import stable_sort_by_slot
from reference.ops import torch_ref

__all__ = ["EXERCISES"]

def _indptr_edge() -> list[Case]:
    return [_indptr_case(n, lens) for n, lens in [
        ("no_segments", []), ("one_empty_segment", [0]), ("one_segment", [5]), ("running_example_3_10_5", [3, 10, 5]),
        ("zero_length_in_middle", [2, 0, 3]), ("one_token_each", [1, 1, 1, 1]),
        ("zero_lengths_at_both_ends", [0, 4, 0]), ("all_segments_empty", [0, 0, 0])]] + [
        _indptr_case("int64_seg_lens", [3, 10, 5], torch.int64)]


def _indptr_case(name, lens, dtype=torch.int32) -> Case:
    dt = str(dtype).replace("torch.", "")
    return Case(name, [torch.tensor(lens, dtype=dtype)], f"seg_lens {lens} ({dt})", op="exact")


def _indptr_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_indptr_case(f"random_{i}", [rng.choice([0, 1, 2, 7, 33, 128]) for _ in range(rng.randint(2, 40))],
                         torch.int64 if i == 3 else torch.int32)
            for i in range(4)]


def _indptr_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor):
        return None
    if got.dtype == torch.int64 and case.args[0].dtype == torch.int32:
        return "torch.cumsum of int32 returns int64; the contract's seg_indptr is int32 (.to(torch.int32))"
    if got.dtype != torch.int32:
        return f"the contract's seg_indptr is int32 whatever the dtype of seg_lens (here {case.args[0].dtype}): .to(torch.int32)"
    if got.shape[0] == expected.shape[0] - 1 and torch.equal(got.cpu().long(), expected[1:].cpu().long()):
        return "seg_indptr has num_segments + 1 entries and starts with 0: segment i is rows seg_indptr[i]:seg_indptr[i+1]"
    if got.shape == expected.shape and got.numel() > 1 and torch.equal(got[1:].cpu().long(), expected[:-1].cpu().long()):
        return "shifted by one: seg_indptr[i + 1] is the sum of the first i + 1 lengths (seg_lens[0] + ... + seg_lens[i])"
    return None


def _slots_case(name, lens, slots) -> Case:
    indptr = bi_ref.seg_indptr_from_seg_lens(torch.tensor(lens, dtype=torch.int32))
    return Case(name, [indptr, torch.tensor(slots, dtype=torch.int32)],
                f"seg_indptr {indptr.tolist()}, weight_indices {slots}", op="exact")


def _slots_edge() -> list[Case]:
    return [_slots_case("no_segments", [], []), _slots_case("running_example", [3, 10, 5], [2, 0, 1]),
            _slots_case("zero_length_in_middle", [2, 0, 3], [1, 2, 1]),
            _slots_case("one_token_each", [1, 1, 1], [3, 3, 0]),
            _slots_case("empty_segments_at_both_ends", [0, 2, 3, 0], [4, 1, 0, 2]),
            _slots_case("segments_but_zero_tokens", [0, 0], [1, 2])]


def _slots_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        n = rng.randint(3, 12)
        lens = [rng.choice([0, 1, 3, 8]) for _ in range(n)]
        lens[0], lens[-1] = rng.randint(2, 5), rng.choice([0, 2])  # a segment of several tokens first
        slots = [rng.randrange(6) for _ in range(n)]
        slots[0] = rng.randrange(1, 6)  # the first segment's slot is not its index 0
        cases.append(_slots_case(f"random_{i}", lens, slots))
    return cases


def _slots_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor):
        return None
    if got.shape[0] == case.args[1].shape[0] != expected.shape[0]:
        return "one entry per token (seg_indptr[-1] of them), not one per segment"
    indptr = case.args[0].cpu().long()
    seg_ids = torch.repeat_interleave(torch.arange(indptr.shape[0] - 1), indptr[1:] - indptr[:-1])
    if got.shape == expected.shape and got.numel() and torch.equal(got.cpu().long(), seg_ids) and not torch.equal(seg_ids, expected.cpu().long()):
        return "every token of segment i gets that segment's slot weight_indices[i], not the segment's index i"
    return None


def _sort_case(name, slots) -> Case:
    return Case(name, [torch.tensor(slots, dtype=torch.int32)], f"token_slots {slots}", op="exact")


def _sort_edge() -> list[Case]:
    return [_sort_case("no_tokens", []), _sort_case("one_token", [3]), _sort_case("already_grouped", [0, 0, 1, 1, 1]),
            _sort_case("small_example", [1, 0, 1, 2]), _sort_case("interleaved_stability_matters", [2, 1, 2, 1, 2, 1, 0]),
            _sort_case("rotation_not_its_own_inverse", [2, 0, 1, 1]),
            # torch's CPU argsort happens to be stable below 17 elements: this one is long enough to tell
            _sort_case("interleaved_40_tokens", [(7 * i) % 3 for i in range(40)])]


def _sort_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):  # long enough (> 16) for torch's unstable sort to show, and never a permutation that is its own inverse
        slots = [rng.randrange(5) for _ in range(rng.randint(20, 60))]
        slots[:3] = [2, 0, 1]  # sorted rows 0.. start with the tokens 1, 2, 0: a 3-cycle, not an involution
        cases.append(_sort_case(f"random_{i}", slots))
    return cases


def _sort_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(g, torch.Tensor) for g in got)):
        return None
    perm, inverse = (g.cpu() for g in got)
    slots = case.args[0].cpu()
    exp_perm, exp_inv = (e.cpu() for e in expected)
    if perm.shape != exp_perm.shape or inverse.shape != exp_inv.shape:
        return None
    if torch.equal(perm.long(), exp_perm) and torch.equal(inverse.long(), exp_perm) and not torch.equal(exp_perm, exp_inv):
        return "inverse is not the permutation itself: inverse[permutation[i]] = i (scatter an arange, or argsort the permutation)"
    if torch.equal(perm.long(), exp_inv) and torch.equal(inverse.long(), exp_perm) and not torch.equal(exp_perm, exp_inv):
        return "permutation and inverse are swapped: sorted row i is row permutation[i] of x"
    p = perm.long()
    if p.numel() and bool((p >= 0).all()) and bool((p < slots.numel()).all()):
        s = slots[p].long()
        if bool((s[1:] >= s[:-1]).all()) and not torch.equal(p, exp_perm):
            return "sorted by slot, but tokens of one slot are out of their original order: the sort must be stable (torch.sort(..., stable=True))"
    return None


def _waste_case(name, lens, ranks) -> Case:
    return Case(name, [list(lens), list(ranks)], f"seg_lens {lens}, ranks {ranks}", op="exact")


def _waste_edge() -> list[Case]:
    return [_waste_case("empty_batch", [], []), _waste_case("all_base", [3, 4], [0, 0]),
            _waste_case("same_rank_no_waste", [5, 9], [16, 16]),
            _waste_case("one_r64_three_r16", [100, 100, 100, 100], [64, 16, 16, 16]),
            _waste_case("long_r16_short_r64", [2000, 10], [16, 64]),
            _waste_case("rank_0_request_is_all_padding", [4, 4], [16, 0]),
            _waste_case("requests_but_zero_tokens", [0, 0], [16, 8]),
            _waste_case("largest_rank_on_an_empty_request", [5, 0], [8, 64]),
            _waste_case("more_lengths_than_ranks_raises_value_error", [5, 9, 2], [16, 16]),
            _waste_case("more_ranks_than_lengths_raises_value_error", [5], [16, 64])]


def _waste_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i, k in enumerate([3, 6, 10]):
        lens = [rng.randint(1, 3000) for _ in range(k)]
        ranks = [rng.choice([8, 16, 64, 128]) for _ in range(k)]
        ranks[rng.randrange(k)] = 0  # a base-model request: all padding
        lo = rng.randrange(k)
        ranks[lo] = rng.choice([r for r in (8, 16) if r < max(ranks)] or [1])  # ranks differ
        cases.append(_waste_case(f"random_{i}", lens, ranks))
    return cases


def _waste_hint(case: Case, expected, got) -> Optional[str]:
    lens, ranks = case.args
    if not isinstance(got, (int, float)) or isinstance(got, bool) or not lens or len(lens) != len(ranks):
        return None
    R = max(ranks)
    wasted = sum(n * (R - r) for n, r in zip(lens, ranks))
    useful = sum(n * r for n, r in zip(lens, ranks))
    if useful and abs(got - wasted / useful) < 1e-9 and abs(got - expected) > 1e-9:
        return "that is wasted / useful FLOPs; the contract divides by the padded total, sum_i n_i R"
    kept = [(n, r) for n, r in zip(lens, ranks) if r > 0]
    if kept:
        Rk = max(r for _, r in kept)
        alt = sum(n * (Rk - r) for n, r in kept) / max(sum(n * Rk for n, _ in kept), 1)
        if abs(got - alt) < 1e-9 and abs(got - expected) > 1e-9:
            return "rank-0 requests were left out: a rank-0 request padded to R counts as all padding"
    return None


_LOOP = contract_op_cases(loop_case, "loop")
_BGMV_SHRINK = contract_op_cases(shrink_case, "bgmv_shrink")
_BGMV_EXPAND = contract_op_cases(expand_case, "bgmv_expand")
_SGMV_SHRINK = contract_op_cases(shrink_case, "sgmv_shrink")
_SGMV_EXPAND = contract_op_cases(expand_case, "sgmv_expand")

EXERCISES = [
    Exercise("ch02.1", "seg_indptr_from_seg_lens", ("seg_lens",), bi_ref.seg_indptr_from_seg_lens,
             _indptr_edge, _indptr_random, _indptr_hint, default_device_probe=True),
    Exercise("ch02.2", "token_slots_from_segments", ("seg_indptr", "weight_indices"), bi_ref.token_slots_from_segments,
             _slots_edge, _slots_random, _slots_hint, default_device_probe=True),
    Exercise("ch02.3", "lora_loop", ("x", "A_stack", "B_stack", "batch_info", "out"), torch_ref.lora_loop,
             *_LOOP, batch_hint(torch_ref.lora_loop), default_device_probe=True),
    Exercise("ch02.4", "bgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.bgmv_shrink,
             *_BGMV_SHRINK, batch_hint(torch_ref.bgmv_shrink), default_device_probe=True),
    Exercise("ch02.5", "bgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.bgmv_expand,
             *_BGMV_EXPAND, batch_hint(torch_ref.bgmv_expand), default_device_probe=True),
    Exercise("ch02.6", "sgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.sgmv_shrink,
             *_SGMV_SHRINK, batch_hint(torch_ref.sgmv_shrink), default_device_probe=True),
    Exercise("ch02.7", "sgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.sgmv_expand,
             *_SGMV_EXPAND, batch_hint(torch_ref.sgmv_expand), default_device_probe=True),
    Exercise("ch02.8", "stable_sort_by_slot", ("token_slots",), stable_sort_by_slot, _sort_edge, _sort_random,
             _sort_hint, result_names=("permutation", "inverse"), grade_on="cpu", default_device_probe=True),
    Exercise("ch02.9", "padded_flop_waste", ("seg_lens", "ranks"),
             driven_reference(returns_python_float, lora_math.padded_flop_waste),
             _waste_edge, _waste_random, _waste_hint, driver=returns_python_float),
]
