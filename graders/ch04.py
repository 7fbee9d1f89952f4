"""Cases for chapter 04 (packed q/k/v and gate/up projections, chunked SGMV segments).

The sliced expand gets chapter 02's poison plus what packing adds: ``t`` holds NaN past each token's
``num_parts * r`` columns (parts are packed at the slot's own rank, not at ``max_rank``), every
slot's B holds NaN past its rank, and where an adapter lacks a part (q and v but no k) that part's
B block is zero and its output columns must come back bit for bit. Widths follow GQA (q wider than
k and v) and are not multiples of any block size.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from graders.cases import JUNK, BatchSpec, base_rows, batch_info_for, describe, row_labels, weights
from graders.core import Case, Exercise

TRITON_REQUIRED = ("@triton.jit", "this exercise asks for a Triton kernel, and the answer cell defines no @triton.jit "
                   "function: a PyTorch version computes the same numbers, but it is not the exercise")
from reference import chunked, packed
from reference.device import interpreting
from reference.ops import torch_ref

__all__ = ["EXERCISES"]


# ---------------------------------------------------------------------------------------------
# ch04.1 stack_lora_parts


def _parts(gen, rank, d_in, out_features, missing, dtype):
    A = [None if i in missing else (torch.randn(rank, d_in, generator=gen)).to(dtype) for i in range(len(out_features))]
    B = [None if i in missing else (torch.randn(w, rank, generator=gen)).to(dtype) for i, w in enumerate(out_features)]
    return A, B


def _stack_case(name, gen, rank, d_in, out_features, missing=(), dtype=torch.float32, break_b: Optional[int] = None) -> Case:
    A, B = _parts(gen, rank, d_in, out_features, set(missing), dtype)
    if break_b is not None:  # a B part of the wrong width: the contract says ValueError
        B[break_b] = torch.randn(out_features[break_b] + 1, rank, generator=gen).to(dtype)
    shape = lambda t: "None" if t is None else str(list(t.shape))  # noqa: E731
    desc = (f"out_features {list(out_features)}, A_parts [{', '.join(shape(a) for a in A)}], "
            f"B_parts [{', '.join(shape(b) for b in B)}], {dtype}")
    return Case(name, [A, B, list(out_features)], desc, op="exact")


def _stack_edge() -> list[Case]:
    g = torch.Generator().manual_seed(41)
    return [
        _stack_case("one_part_rank_1", g, 1, 8, [8]),
        _stack_case("qkv_gqa_24_8_8_rank_2", g, 2, 16, [24, 8, 8]),
        _stack_case("qkv_missing_k", g, 3, 16, [24, 8, 8], missing=[1]),
        _stack_case("gate_up_two_parts", g, 4, 12, [20, 20]),
        _stack_case("only_v_present", g, 2, 8, [16, 4, 4], missing=[0, 1], dtype=torch.bfloat16),
        _stack_case("all_missing_raises_value_error", g, 2, 8, [8, 4, 4], missing=[0, 1, 2]),
        _stack_case("wrong_B_width_raises_value_error", g, 2, 8, [8, 4, 4], break_b=2),
        _bad_stack_case("lengths_differ_raises_value_error", [torch.ones(2, 8)], [torch.ones(8, 2), None], [8, 4]),
        _bad_stack_case("A_without_B_raises_value_error", [torch.ones(2, 8), torch.ones(2, 8)],
                        [torch.ones(8, 2), None], [8, 4]),
        _bad_stack_case("ranks_differ_raises_value_error", [torch.ones(2, 8), torch.ones(3, 8)],
                        [torch.ones(8, 2), torch.ones(4, 3)], [8, 4]),
        _bad_stack_case("B_rank_differs_raises_value_error", [torch.ones(2, 8)], [torch.ones(8, 3)], [8]),
        _bad_stack_case("dtypes_differ_raises_value_error", [torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16)],
                        [torch.ones(8, 2), torch.ones(4, 2, dtype=torch.float16)], [8, 4]),
    ]


def _bad_stack_case(name, A, B, widths) -> Case:
    shape = lambda t: "None" if t is None else f"{list(t.shape)} {t.dtype}"  # noqa: E731
    return Case(name, [A, B, widths], f"out_features {widths}, A_parts [{', '.join(shape(a) for a in A)}], "
                f"B_parts [{', '.join(shape(b) for b in B)}]", op="exact")


def _stack_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        n_parts = rng.choice([2, 3])
        q = rng.choice([8, 24, 40, 72])
        widths = [q] + [rng.choice([q, q // 4 or 1, 8])] * (n_parts - 1) if n_parts == 3 else [q, q]
        missing = [rng.randrange(n_parts)] if i % 2 else []
        cases.append(_stack_case(f"random_{i}", gen, rng.choice([1, 4, 7, 16]), rng.choice([8, 16, 40]), widths,
                                 missing, rng.choice([torch.float32, torch.bfloat16])))
    return cases


def _stack_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(expected, tuple)):
        return None
    A_exp, B_exp = expected
    A_got, B_got = got
    if isinstance(A_got, torch.Tensor) and A_got.shape == A_exp.shape[::-1]:
        return "A is stacked along its rows (the rank axis): [num_parts * r, in], not transposed"
    if isinstance(B_got, torch.Tensor) and B_got.dim() == 2 and B_got.shape[1] == B_exp.shape[1] * len(case.args[2]):
        return "B parts go one under another along the output axis: [q+k+v, r]; only A stacks parts along r"
    if isinstance(A_got, torch.Tensor) and A_got.shape[0] < A_exp.shape[0]:
        return "a missing part still takes its place (zeros): otherwise the parts after it move to the wrong rows"
    return None


# ---------------------------------------------------------------------------------------------
# ch04.2 sgmv_expand_sliced


@dataclass
class PackedSpec:
    """A batch for a fused projection: chapter 02's BatchSpec plus the parts' output widths."""

    batch: BatchSpec
    out_features: Sequence[int]
    missing: dict[int, Sequence[int]] = field(default_factory=dict)  # slot -> parts the adapter lacks


def _packed_weights(spec: PackedSpec, gen: torch.Generator) -> torch.Tensor:
    b = spec.batch
    _, B = weights(b, gen)  # [num_slots, out_total, max_rank], NaN past each rank
    offs = packed.slice_offsets_for(spec.out_features)
    for slot, parts in spec.missing.items():
        for p in parts:
            B[slot, offs[p]:offs[p + 1], :b.ranks[slot]] = 0.0
    return B


def _packed_t(spec: PackedSpec, gen: torch.Generator, token_slots: torch.Tensor) -> torch.Tensor:
    b, n_parts = spec.batch, len(spec.out_features)
    t = torch.randn(sum(b.req_lens), n_parts * b.max_rank, generator=gen)
    width = n_parts * torch.tensor(list(b.ranks))[token_slots.long()]
    return torch.where(torch.arange(t.shape[1])[None, :] >= width[:, None], JUNK, t).to(b.dtype)


def _exact_mask(spec: PackedSpec, token_slots: torch.Tensor) -> torch.Tensor:
    """Rank-0 rows, and the columns of parts an adapter lacks: both must come back bit for bit."""
    b = spec.batch
    exact = base_rows(b, sum(spec.out_features)).clone()
    offs = packed.slice_offsets_for(spec.out_features)
    for slot, parts in spec.missing.items():
        rows = token_slots == slot
        for p in parts:
            exact[rows, offs[p]:offs[p + 1]] = True
    return exact


def sliced_case(spec: PackedSpec, gen: torch.Generator) -> Case:
    b = spec.batch
    B = _packed_weights(spec, gen)
    info, token_slots = batch_info_for(b)
    t = _packed_t(spec, gen, token_slots)
    out = torch.randn(t.shape[0], sum(spec.out_features), generator=gen).to(b.dtype)
    offsets = packed.slice_offsets_for(spec.out_features)
    lacks = "".join(f"; slot {s} lacks part(s) {list(p)} (zeros)" for s, p in spec.missing.items())
    first = (f"t {list(t.shape)}, B_stack {list(B.shape)}, out {list(out.shape)}, "
             f"slice_offsets {offsets}{lacks}")
    return Case(b.name, [t, B, info, out, offsets], describe(b, first), op="triton", out_index=3,
                row_labels=row_labels(b), exact=_exact_mask(spec, token_slots))


def _on_device(spec: PackedSpec) -> PackedSpec:
    if interpreting() and spec.batch.dtype == torch.bfloat16:
        return dataclasses.replace(spec, batch=dataclasses.replace(spec.batch, dtype=torch.float16))
    return spec


def _sliced_specs() -> list[PackedSpec]:
    P, S = PackedSpec, BatchSpec
    return [
        P(S("empty_batch", [], [], [0, 4], 4, 16, 40), (24, 8, 8)),
        P(S("one_slice_is_chapter_03", [2, 3], [1, 2], [0, 4, 2], 4, 16, 24), (24,)),
        P(S("qkv_gqa_24_8_8", [3, 2, 2], [1, 2, 0], [0, 4, 2], 4, 16, 40), (24, 8, 8)),
        P(S("gate_up_20_20", [2, 1, 3], [2, 1, 2], [0, 3, 5], 5, 16, 40), (20, 20)),
        P(S("qkv_adapter_without_k", [2, 3], [1, 2], [0, 4, 4], 4, 16, 40), (24, 8, 8), {1: [1]}),
        P(S("base_model_in_slot_2_rank_1", [2, 2, 1], [0, 2, 1], [1, 3, 0], 3, 16, 40), (24, 8, 8)),
        P(S("q_wider_than_a_block_200_40_40", [3, 1], [1, 2], [0, 7, 16], 16, 16, 280), (200, 40, 40)),
        P(S("unsorted_arrival_permutation", [2, 3, 1, 2], [2, 1, 2, 0], [0, 4, 3], 4, 24, 36, sort=True),
          (20, 8, 8)),
    ]


def _sliced_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32]):
        n_slots = rng.randint(2, 5)
        max_rank = rng.choice([4, 7, 8, 16])
        ranks = [rng.choice([1, max_rank // 2 or 1, max_rank]) for _ in range(n_slots)]
        ranks[rng.randrange(n_slots)] = 0
        q = rng.choice([24, 40, 72, 136])
        widths = (q, q // 4, q // 4) if i != 1 else (q, q)
        n_req = rng.randint(1, 6)
        lens = [rng.choice([0, 1, 2, 5, 9, 17]) for _ in range(n_req)]
        slots = [rng.randrange(n_slots) for _ in range(n_req)]
        missing = {s: [rng.randrange(len(widths))] for s in range(n_slots) if ranks[s] and rng.random() < 0.4}
        batch = BatchSpec(f"random_{i}", lens, slots, ranks, max_rank, 16, sum(widths), dtype, sort=i == 2)
        cases.append(sliced_case(_on_device(PackedSpec(batch, widths, missing)), gen))
    return cases


def _sliced_edge() -> list[Case]:
    gen = torch.Generator().manual_seed(43)
    return [sliced_case(_on_device(s), gen) for s in _sliced_specs()]


def _sliced_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    offsets = case.args[4]
    e, g = expected.cpu().double(), got.double()
    bad = ~torch.isclose(g, e, rtol=0.05, atol=0.05)
    if case.defined is not None:
        bad &= case.defined
    cols = bad.any(dim=0)
    wrong = [i for i in range(len(offsets) - 1) if bool(cols[offsets[i]:offsets[i + 1]].any())]
    if not wrong:
        return None
    names = ["q", "k", "v"] if len(offsets) == 4 else ["gate", "up"] if len(offsets) == 3 else ["the slice"]
    where = ", ".join(f"{names[i]} (columns {offsets[i]}..{offsets[i + 1] - 1})" for i in wrong)
    msg = f"the differing columns are in slice(s) {where}"
    if bool(torch.isnan(g).any()) and len(offsets) > 2:
        msg += ("; NaN in the result: t holds NaN from column num_parts * r on, so either part i was read at "
                "i * max_rank instead of i * r (the slot's own rank), or the K loop lacks its mask offs_k < r")
    elif wrong != list(range(len(offsets) - 1)):
        msg += "; the slices are of different widths (GQA): take each slice's bounds from slice_offsets"
    return msg


def _reference_sliced(t, B_stack, batch_info, out, slice_offsets):
    return torch_ref.sgmv_expand(t, B_stack, batch_info, out, slice_offsets)


# ---------------------------------------------------------------------------------------------
# ch04.3 merge_adjacent_segments and ch04.4 cut_into_chunks


def _runs(values: Sequence[int]) -> str:
    """A list in run-length form when long: [5, 5, 5, 3] -> [5 x3, 3]."""
    if len(values) <= 12:
        return str(list(values))
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return "[" + ", ".join(f"{v} x{n}" if n > 1 else str(v) for v, n in runs) + "]"


def _segments_case(name, lens, slots, chunk: Optional[int] = None) -> Case:
    args = [list(lens), list(slots)] + ([chunk] if chunk is not None else [])
    extra = f", chunk_size {chunk}" if chunk is not None else ""
    return Case(name, args, f"seg_lens {_runs(lens)}, slots {_runs(slots)}{extra}", op="exact")


def _merge_edge() -> list[Case]:
    return [
        _segments_case("empty", [], []),
        _segments_case("running_example", [3, 2, 6, 1], [1, 1, 2, 0]),
        _segments_case("skewed_98_of_100_on_one_adapter", [5] * 49 + [3] + [5] * 49 + [2], [1] * 49 + [2] + [1] * 49 + [3]),
        _segments_case("same_slot_not_adjacent_stays_apart", [2, 2, 2], [1, 2, 1]),
        _segments_case("zero_length_between_same_slots_merges", [2, 0, 3], [1, 2, 1]),
        _segments_case("base_rows_merge_too", [4, 4], [0, 0]),
        _segments_case("lengths_differ_raises_value_error", [1, 2], [1]),
        _segments_case("negative_length_raises_value_error", [2, -1], [1, 1]),
    ]


def _random_segments(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    slots, lens = [], []
    for _ in range(n):
        slots.append(slots[-1] if slots and rng.random() < 0.5 else rng.randrange(4))
        lens.append(rng.choice([0, 1, 2, 5, 16, 33]))
    return lens, slots


def _merge_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_segments_case(f"random_{i}", *_random_segments(rng, rng.randint(1, 30))) for i in range(4)]


def _chunk_edge() -> list[Case]:
    return [
        _segments_case("empty", [], [], 4),
        _segments_case("running_example_chunk_4", [5, 6, 1], [1, 2, 0], 4),
        _segments_case("exact_multiple_no_empty_tail", [8, 4], [1, 2], 4),
        _segments_case("chunk_1_one_token_each", [3, 1], [2, 0], 1),
        _segments_case("chunk_larger_than_everything", [5, 6], [1, 2], 64),
        _segments_case("zero_length_segment_gives_no_chunk", [3, 0, 2], [1, 2, 1], 2),
        _segments_case("chunk_0_raises_value_error", [3], [1], 0),
    ]


def _chunk_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_segments_case(f"random_{i}", [rng.randint(0, 100) for _ in range(k)], [rng.randrange(5) for _ in range(k)],
                           rng.choice([1, 3, 16, 32])) for i, k in enumerate([3, 8, 20])]


def _segments_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, tuple) for v in got)):
        return "return a tuple of two lists of ints: (seg_lens, slots)"
    lens = list(got[0])
    if 0 in lens:
        return "a zero-length segment (or chunk) is dropped: it would launch programs that do nothing"
    if len(case.args) == 3 and lens and sum(lens) == sum(expected[0]) and len(lens) < len(expected[0]):
        return "every piece is at most chunk_size tokens: a long segment becomes several chunks"
    if len(case.args) == 2 and sum(lens) == sum(expected[0]) and len(lens) < len(expected[0]):
        return ("only neighbours merge: a merged segment must be contiguous rows of x, so two runs of one "
                "slot with another slot between them stay two segments")
    return None


EXERCISES = [
    Exercise("ch04.1", "stack_lora_parts", ("A_parts", "B_parts", "out_features"), packed.stack_lora_parts,
             _stack_edge, _stack_random, _stack_hint),
    Exercise("ch04.2", "sgmv_expand_sliced", ("t", "B_stack", "batch_info", "out", "slice_offsets"), _reference_sliced,
             _sliced_edge, _sliced_random, _sliced_hint, requires=TRITON_REQUIRED),
    Exercise("ch04.3", "merge_adjacent_segments", ("seg_lens", "slots"), chunked.merge_adjacent_segments,
             _merge_edge, _merge_random, _segments_hint),
    Exercise("ch04.4", "cut_into_chunks", ("seg_lens", "slots", "chunk_size"), chunked.cut_into_chunks,
             _chunk_edge, _chunk_random, _segments_hint),
]
