"""Cases for chapter 04 (packed q/k/v and gate/up projections, chunked SGMV segments).

The sliced expand gets chapter 02's poison plus what packing adds: ``t`` holds junk past each token's
``num_parts * r`` columns (parts are packed at the slot's own rank, not at ``max_rank``), every
slot's B holds junk past its rank (NaN, or in some families a large finite value that
``torch.nan_to_num`` leaves in place), and where an adapter lacks a part (q and v but no k) that
part's B block is zero and its output columns must come back bit for bit. Widths follow GQA (q wider
than k and v) and are not multiples of any block size.

Tiles (the case design rule of ``graders``): the edge group and every random and hidden draw cross
every grid axis and loop at least twice with the chapter's suggested blocks (BLOCK_M 32, BLOCK_N 64,
BLOCK_K 16 or more) and the reference's at these max ranks (BLOCK_M 64, BLOCK_N 128, BLOCK_K = max_rank;
32 x 256 up to max_rank 16, ``sgmv_expand.default_tiles``): a
segment of 130-160 tokens (permuted, so its rows come through the permutation), slices of 260-316
columns that are not multiples of 64 (GQA k and v of 65-79: two tiles of 64), max_rank 32 or 64
with a rank above 16 that is not a multiple of 16. Few tokens elsewhere keep the interpreter fast.

stack_lora_parts is graded through a driver (``drive_stack``) that also checks, in the child, what
the comparer cannot see inside lists: the input parts stay unchanged and the result is new memory.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from graders.chapters.cases import FINITE_JUNK, JUNK, BatchSpec, base_rows, batch_info_for, describe, ignored_permutation, row_labels, weights
from graders.machine.exercise import Case, Exercise

TRITON_REQUIRED = ("@triton.jit", "this exercise asks for a Triton kernel, and the answer cell defines no @triton.jit "
                   "function: a PyTorch version computes the same numbers, but it is not the exercise")
from reference import chunked, packed
from reference.device import interpreting
from reference.ops import torch_ref

__all__ = ["EXERCISES"]


# ---------------------------------------------------------------------------------------------
# ch04.1 stack_lora_parts


class NotANewTensor(Exception):
    """Raised by the driver when a returned tensor shares memory with an input part."""


class InputModified(Exception):
    """Raised by the driver when the learner's function wrote into an input part."""


def drive_stack(stack_fn, A_parts, B_parts, out_features):
    """Call ``stack_lora_parts`` in the child and check what the comparer cannot see inside lists:
    the input parts stay unchanged and the returned tensors are new memory (not an input part or a
    view of one, as a one-part shortcut ``return A_parts[0], B_parts[0]`` would give)."""
    saved = [[None if t is None else t.clone() for t in parts] for parts in (A_parts, B_parts)]
    result = stack_fn(A_parts, B_parts, out_features)
    named = [("A_parts", A_parts, saved[0]), ("B_parts", B_parts, saved[1])]
    for name, parts, before in named:
        for i, (t, c) in enumerate(zip(parts, before)):
            if isinstance(t, torch.Tensor) and not torch.equal(t, c):
                raise InputModified(f"your function modified its input {name}[{i}]; inputs must stay unchanged")
    for j, r in enumerate(result if isinstance(result, (tuple, list)) else [result]):
        if not isinstance(r, torch.Tensor) or not r.numel():
            continue
        for name, parts, _ in named:
            for i, t in enumerate(parts):
                if isinstance(t, torch.Tensor) and t.numel() and \
                        t.untyped_storage().data_ptr() == r.untyped_storage().data_ptr():
                    raise NotANewTensor(
                        f"the returned {'AB'[j] if j < 2 else j} shares memory with your input {name}[{i}] (the "
                        "same tensor or a view of it); the contract asks for new tensors, even for one part: "
                        "a caller that later writes one changes the other")
    return result


def _parts(gen, rank, d_in, out_features, missing, dtype):
    A = [None if i in missing else (torch.randn(rank, d_in, generator=gen)).to(dtype) for i in range(len(out_features))]
    B = [None if i in missing else (torch.randn(w, rank, generator=gen)).to(dtype) for i, w in enumerate(out_features)]
    return A, B


def _stack_case(name, gen, rank, d_in, out_features, missing=(), dtype=torch.float32, break_b: Optional[int] = None,
                widen: int = 1) -> Case:
    A, B = _parts(gen, rank, d_in, out_features, set(missing), dtype)
    if break_b is not None:  # a B part of the wrong width: the contract says ValueError
        B[break_b] = torch.randn(out_features[break_b] + widen, rank, generator=gen).to(dtype)
    return _bad_stack_case(name, A, B, list(out_features))


def _bad_stack_case(name, A, B, widths) -> Case:
    shape = lambda t: "None" if t is None else f"{list(t.shape)} {t.dtype}"  # noqa: E731
    return Case(name, [A, B, widths], f"out_features {widths}, A_parts [{', '.join(shape(a) for a in A)}], "
                f"B_parts [{', '.join(shape(b) for b in B)}]", op="exact")


def _stack_edge() -> list[Case]:
    g = torch.Generator().manual_seed(41)
    o = torch.ones
    h = torch.float16
    return [
        _stack_case("one_part_rank_1", g, 1, 8, [8]),
        _stack_case("qkv_gqa_24_8_8_rank_2", g, 2, 16, [24, 8, 8]),
        _stack_case("qkv_missing_k", g, 3, 16, [24, 8, 8], missing=[1]),
        _stack_case("qkv_missing_q_first_part", g, 2, 12, [16, 4, 4], missing=[0]),
        _stack_case("gate_up_two_parts", g, 4, 12, [20, 20]),
        _stack_case("only_v_present", g, 2, 8, [16, 4, 4], missing=[0, 1], dtype=torch.bfloat16),
        _stack_case("gate_up_fp16_missing_up", g, 5, 8, [12, 12], missing=[1], dtype=h),
        _stack_case("all_missing_raises_value_error", g, 2, 8, [8, 4, 4], missing=[0, 1, 2]),
        _bad_stack_case("B_parts_longer_raises_value_error", [o(2, 8)], [o(8, 2), None], [8, 4]),
        _bad_stack_case("A_parts_longer_raises_value_error", [o(2, 8), None], [o(8, 2)], [8, 4]),
        _bad_stack_case("out_features_longer_raises_value_error", [o(2, 8), o(2, 8)], [o(8, 2), o(4, 2)], [8, 4, 4]),
        _bad_stack_case("out_features_shorter_raises_value_error", [o(2, 8), o(2, 8)], [o(8, 2), o(4, 2)], [8]),
        _bad_stack_case("A_without_B_raises_value_error", [o(2, 8), o(2, 8)], [o(8, 2), None], [8, 4]),
        _bad_stack_case("B_without_A_raises_value_error", [o(2, 8), None], [o(8, 2), o(4, 2)], [8, 4]),
        _bad_stack_case("A_ranks_differ_raises_value_error", [o(2, 8), o(3, 8)], [o(8, 2), o(4, 3)], [8, 4]),
        _bad_stack_case("B_rank_differs_from_A_raises_value_error", [o(2, 8)], [o(8, 3)], [8]),
        _bad_stack_case("input_widths_differ_raises_value_error", [o(2, 8), o(2, 9)], [o(8, 2), o(4, 2)], [8, 4]),
        _stack_case("B_wider_than_out_features_raises_value_error", g, 2, 8, [8, 4, 4], break_b=2),
        _stack_case("B_narrower_than_out_features_raises_value_error", g, 2, 8, [8, 4, 4], break_b=0, widen=-1),
        _bad_stack_case("A_dtypes_differ_raises_value_error", [o(2, 8), o(2, 8, dtype=h)],
                        [o(8, 2), o(4, 2, dtype=h)], [8, 4]),
        _bad_stack_case("A_fp32_B_fp16_in_one_part_raises_value_error", [o(2, 8)], [o(8, 2, dtype=h)], [8]),
        _bad_stack_case("B_dtypes_differ_raises_value_error", [o(2, 8), o(2, 8)], [o(8, 2), o(4, 2, dtype=h)], [8, 4]),
    ]


def _stack_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    """Every draw: 2 and 3 parts, a missing part that is not the last (so a shift moves others), a
    missing last part, and bf16 / fp16 beside fp32."""
    cases = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32, torch.float16]):
        n_parts = 3 if i < 2 else 2
        q = rng.choice([8, 24, 40, 72])
        kv = rng.choice([q // 4, 8])
        widths = [q, kv, kv] if n_parts == 3 else [q, q]
        missing = {0: [], 1: [rng.randrange(n_parts - 1)], 2: [], 3: [n_parts - 1]}[i]
        cases.append(_stack_case(f"random_{i}", gen, rng.choice([1, 4, 7, 16]), rng.choice([8, 16, 40]), widths,
                                 missing, dtype))
    return cases


def _stack_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(expected, tuple)):
        return None
    A_exp, B_exp = expected
    A_got, B_got = got
    if isinstance(A_got, torch.Tensor) and A_got.shape == A_exp.shape[::-1] and A_exp.shape[0] != A_exp.shape[1]:
        return "A is stacked along its rows (the rank axis): [num_parts * r, in], not transposed"
    if isinstance(B_got, torch.Tensor) and B_got.dim() == 2 and B_got.shape[1] == B_exp.shape[1] * len(case.args[2]) \
            and len(case.args[2]) > 1:
        return "B parts go one under another along the output axis: [q+k+v, r]; only A stacks parts along r"
    missing = [i for i, a in enumerate(case.args[0]) if a is None]
    if missing and isinstance(A_got, torch.Tensor) and A_got.shape[0] < A_exp.shape[0]:
        return "a missing part still takes its place (zeros): otherwise the parts after it move to the wrong rows"
    if missing and isinstance(A_got, torch.Tensor) and A_got.shape == A_exp.shape and A_got.dtype == A_exp.dtype:
        r = A_exp.shape[0] // len(case.args[2])
        present = [i for i, a in enumerate(case.args[0]) if a is not None]
        shifted = A_exp.new_zeros(A_exp.shape)
        for k, i in enumerate(present):
            shifted[k * r:(k + 1) * r] = case.args[0][i].to(shifted.device)
        if torch.equal(A_got.cpu(), shifted.cpu()):
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
    t = torch.randn(sum(b.req_lens), n_parts * b.max_rank + b.extra_cols, generator=gen)  # ">= num_parts * max_rank"
    width = n_parts * torch.tensor(list(b.ranks))[token_slots.long()]
    return torch.where(torch.arange(t.shape[1])[None, :] >= width[:, None], b.junk, t).to(b.dtype)


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
        P(S("qkv_adapter_without_k_t_wider_than_3_max_rank", [2, 3], [1, 2], [0, 4, 4], 4, 16, 40, extra_cols=5),
          (24, 8, 8), {1: [1]}),
        P(S("base_model_in_slot_2_rank_1", [2, 2, 1], [0, 2, 1], [1, 3, 0], 3, 16, 40), (24, 8, 8)),
        P(S("q_wider_than_a_block_200_40_40", [3, 1], [1, 2], [0, 7, 16], 16, 16, 280), (200, 40, 40)),
        P(S("unsorted_arrival_permutation", [2, 3, 1, 2], [2, 1, 2, 0], [0, 4, 3], 4, 24, 36, sort=True),
          (20, 8, 8)),
        # Tiles: every grid axis and loop crossed at least twice with the chapter's blocks (32 x 64,
        # BLOCK_K 16 possible) and the reference's at max_rank 32 / 64 (BLOCK_M 64, BLOCK_N 128, BLOCK_K = max_rank):
        # slices wider than two column tiles and not multiples of either, a segment longer than two
        # row tiles, ranks above 16 that are not multiples of 16.
        P(S("tiles_qkv_gqa_304_76_76_max_rank_32_segment_of_140", [140, 6, 3], [1, 2, 0], [0, 20, 32], 32, 16, 456),
          (304, 76, 76), {2: [1]}),
        P(S("tiles_gate_up_300_300_max_rank_64_fp16", [3, 5, 4], [2, 1, 0], [0, 40, 64], 64, 16, 600,
            torch.float16), (300, 300)),
        P(S("tiles_unsorted_arrival_segment_of_136_finite_junk", [5, 66, 4, 70], [2, 1, 0, 1], [0, 27, 32], 32, 16, 40,
            sort=True, junk=FINITE_JUNK), (24, 8, 8)),
    ]


def _small_spec(rng: random.Random, i: int, dtype, sort: bool, junk: float, extra_cols: int = 0) -> PackedSpec:
    n_slots = rng.randint(2, 5)
    max_rank = rng.choice([4, 7, 8, 16])
    ranks = [rng.choice([1, max_rank // 2 or 1, max_rank]) for _ in range(n_slots)]
    ranks[rng.randrange(n_slots)] = 0
    q = rng.choice([24, 40, 72, 136])
    widths = (q, q // 4, q // 4) if i != 1 else (q, q)
    n_req = rng.randint(1, 6)
    lens = [rng.choice([0, 1, 2, 5, 9, 17]) for _ in range(n_req)]
    slots = [rng.randrange(n_slots) for _ in range(n_req)]
    adapters = [s for s in range(n_slots) if ranks[s]]
    if sort:  # really unsorted: two non-empty requests on adapters, out of slot order
        lo, hi = sorted(rng.sample(adapters, 2)) if len(adapters) > 1 else (0, adapters[0])
        lens, slots = [rng.randint(1, 9), rng.randint(1, 9), *lens], [hi, lo, *slots]
    missing = {s: [rng.randrange(len(widths))] for s in adapters if rng.random() < 0.4}
    return PackedSpec(BatchSpec(f"random_{i}", lens, slots, ranks, max_rank, 16, sum(widths), dtype, sort=sort,
                                junk=junk, extra_cols=extra_cols), widths, missing)


def _tile_ranks(rng: random.Random) -> tuple[int, list[int], int, int, int]:
    """max_rank 32 or 64; slots: the base model, an adapter of rank in (16, max_rank) that is not a
    multiple of 16 (a K step of 16 loops and clips), a full-rank adapter; in a random order."""
    max_rank = rng.choice([32, 64])
    mid = rng.choice([r for r in range(17, max_rank) if r % 16])
    ranks = [0, mid, max_rank]
    rng.shuffle(ranks)
    return max_rank, ranks, ranks.index(0), ranks.index(mid), ranks.index(max_rank)


def _tile_rows_spec(rng: random.Random, name: str, dtype, junk: float) -> PackedSpec:
    """Rows: a segment of 130..160 tokens (more than two row tiles of 64 and one of 128) that arrives
    as two requests with another's between (one segment once sorted: a permutation), narrow slices."""
    max_rank, ranks, base, mid, full = _tile_ranks(rng)
    q = rng.choice([24, 40, 56])
    widths = (q, q // 4, q // 4)
    n_long = rng.randint(130, 160)
    first = rng.randint(60, n_long - 60)
    lens, slots = [rng.randint(1, 6), first, rng.randint(1, 6), n_long - first], [full, mid, base, mid]
    return PackedSpec(BatchSpec(name, lens, slots, ranks, max_rank, 16, sum(widths), dtype, sort=True, junk=junk),
                      widths, {full: [rng.randrange(3)]})


def _tile_cols_spec(rng: random.Random, name: str, parts: int, dtype, junk: float) -> PackedSpec:
    """Columns: slices of 260..316 columns (more than two column tiles of 128, not a multiple of 64),
    GQA k and v of a quarter (65..79: two tiles of 64), short segments."""
    max_rank, ranks, base, mid, full = _tile_ranks(rng)
    q = rng.choice([260, 276, 292, 300, 308, 316])
    widths = (q, q // 4, q // 4) if parts == 3 else (q, q)
    lens, slots = [rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 4)], [mid, full, base]
    return PackedSpec(BatchSpec(name, lens, slots, ranks, max_rank, 16, sum(widths), dtype, junk=junk),
                      widths, {full: [rng.randrange(parts)]})


def _sliced_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    """Every draw (random and each hidden one) has the same families: small q/k/v, gate/up in bf16
    (fp16 in the interpreter), a permuted batch with finite junk and t wider than 3 * max_rank, a segment longer than two row
    tiles (permuted, finite junk), slices wider than two column tiles (q/k/v in fp32, gate/up in
    bf16), all with ranks above 16."""
    specs = [_small_spec(rng, 0, torch.float32, False, JUNK),
             _small_spec(rng, 1, torch.bfloat16, False, JUNK),
             _small_spec(rng, 2, torch.float32, True, FINITE_JUNK, extra_cols=rng.randint(1, 9)),
             _tile_rows_spec(rng, "random_tiles_long_segment_unsorted", torch.float32, FINITE_JUNK),
             _tile_cols_spec(rng, "random_tiles_wide_qkv", 3, torch.float32, JUNK),
             _tile_cols_spec(rng, "random_tiles_wide_gate_up", 2, torch.bfloat16, JUNK)]
    return [sliced_case(_on_device(s), gen) for s in specs]


def _sliced_edge() -> list[Case]:
    gen = torch.Generator().manual_seed(43)
    return [sliced_case(_on_device(s), gen) for s in _sliced_specs()]


def _segment_positions(info, n: int) -> torch.Tensor:
    """Per row of x: its position in its segment (rows through the permutation when set)."""
    indptr = info.seg_indptr.cpu().long()
    order = info.permutation.cpu().long() if info.permutation is not None else torch.arange(n)
    pos = torch.zeros(n, dtype=torch.long)
    for i in range(len(indptr) - 1):
        lo, hi = int(indptr[i]), int(indptr[i + 1])
        pos[order[lo:hi]] = torch.arange(hi - lo)
    return pos


def _tile_note(bad: torch.Tensor, info, offsets, slots: torch.Tensor) -> Optional[str]:
    """Name a tile or loop that did no work: rows past the first row tile of their segment, columns
    past the first column tile of their slice, or ranks past the first K step."""
    bad_rows, bad_cols = bad.any(dim=1), bad.any(dim=0)
    pos = _segment_positions(info, bad.shape[0])
    if bool(bad_rows.any()) and int(pos[bad_rows].min()) >= 16:
        p = int(pos[bad_rows].min())
        return (f"only rows from position {p} of their segment on differ: the row tiles after the first are "
                f"missing; a segment longer than BLOCK_M needs cdiv(max_len, BLOCK_M) row tiles in the grid, "
                f"and the programs with pid_m > 0 must do their rows too")
    col_pos = torch.cat([torch.arange(b - a) for a, b in zip(offsets[:-1], offsets[1:])])
    if bool(bad_cols.any()) and int(col_pos[bad_cols].min()) >= 16:
        p = int(col_pos[bad_cols].min())
        return (f"only columns from position {p} of their slice on differ: the column tiles after the first "
                f"are missing; the grid needs cdiv(widest slice, BLOCK_N) column tiles, and the programs with "
                f"pid_n > 0 must do their columns too")
    ranks = info.lora_ranks.cpu()[slots]
    low = (ranks > 0) & (ranks <= 16)
    if bool(bad_rows.any()) and bool((ranks[bad_rows] > 16).all()):
        seen = sorted({int(r) for r in ranks[bad_rows]})
        return (f"only rows of slots with rank above 16 differ (ranks {seen})"
                f"{'; rows of ranks up to 16 are right' if bool(low.any()) else ''}: the K loop must cover the "
                f"whole rank, cdiv(r, BLOCK_K) steps when BLOCK_K < r, each masked by offs_k < r - k * BLOCK_K")
    return None


def _columns_from_zero(case: Case) -> torch.Tensor:
    """What the batch gives when every slice's columns start at 0 instead of at its offset (slice i
    adds into columns [0, hi_i) with B rows [0, hi_i)): the mistake of a tile offset without lo."""
    t, B, info, base, offsets = case.args
    out = base.cpu().double().clone()
    indptr, slots = info.seg_indptr.cpu().long(), info.weight_indices.cpu().long()
    order = info.permutation.cpu().long() if info.permutation is not None else torch.arange(out.shape[0])
    for seg in range(len(slots)):
        rows, s = order[int(indptr[seg]):int(indptr[seg + 1])], int(slots[seg])
        r, scale = int(info.lora_ranks[s]), float(info.scalings[s])
        for i, hi in enumerate(offsets[1:]):
            if r:
                out[rows, :hi] += scale * t.cpu().double()[rows, i * r:(i + 1) * r] @ B.cpu().double()[s, :hi, :r].T
    return out


def _sliced_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    t, B, info, base, offsets = case.args
    perm = ignored_permutation(_reference_sliced, case, got)
    if perm:
        return perm
    e, g, b0 = expected.cpu().double(), got.double(), base.cpu().double()
    bad = ~torch.isclose(g, e, rtol=0.05, atol=0.05)
    cols = bad.any(dim=0)
    wrong = [i for i in range(len(offsets) - 1) if bool(cols[offsets[i]:offsets[i + 1]].any())]
    if not wrong:
        return None
    slots = info.token_slots.long().cpu()
    lora_rows = info.lora_ranks.cpu()[slots] > 0
    if bool(lora_rows.any()) and torch.allclose(g[lora_rows], (e - b0)[lora_rows], rtol=0.05, atol=0.05):
        return ("your out holds the LoRA delta alone: the expand adds into the base output it is given "
                "(out[rows, lo:hi] += ...), it does not overwrite it")
    scale = info.scalings.cpu().double()[slots][:, None]
    region = lora_rows[:, None] & (scale != 1.0) & ~case.exact.cpu()
    if bool(region.any()) and torch.allclose((g - b0)[region], ((e - b0) / scale.expand_as(e))[region], rtol=0.05,
                                             atol=0.05):
        return "your result adds the delta without scalings[slot]: the expand applies the scaling (the shrink does not)"
    names = ["q", "k", "v"] if len(offsets) == 4 else ["gate", "up"] if len(offsets) == 3 else ["the slice"]
    where = ", ".join(f"{names[i]} (columns {offsets[i]}..{offsets[i + 1] - 1})" for i in wrong)
    msg = f"the differing columns are in slice(s) {where}"
    if len(offsets) > 2 and torch.allclose(g, _columns_from_zero(case), rtol=0.05, atol=0.05):
        return msg + ("; your result is what slices whose columns start at 0 give: slice i must write its own "
                      "columns lo..hi-1 with B rows lo..hi-1, offs_n = lo + pid_n * BLOCK_N + arange(BLOCK_N) "
                      "(lo = slice_offsets[i])")
    read_junk = bool(torch.isnan(g).any()) or bool((g.abs() > 1e3).any())
    tile = None if read_junk else _tile_note(bad, info, offsets, slots)
    if tile:
        return msg + "; " + tile
    if read_junk and len(offsets) > 2:
        what = "NaN" if bool(torch.isnan(g).any()) else "values as large as the padding junk"
        msg += (f"; {what} in the result: t holds junk from column num_parts * r on and B past column r, so either "
                "part i was read at i * max_rank instead of i * r (the slot's own rank), or the K loop lacks its mask "
                "offs_k < r (torch.nan_to_num cannot hide a read of finite junk)")
    elif read_junk:
        msg += ("; padding was read: B holds junk past column r and t past column r; mask the K loop with "
                "offs_k < r - k * BLOCK_K")
    elif wrong != list(range(len(offsets) - 1)):
        untouched = [i for i in wrong if i > 0 and torch.equal(g[lora_rows, offsets[i]:offsets[i + 1]],
                                                               b0[lora_rows, offsets[i]:offsets[i + 1]])]
        if untouched:
            msg += (f"; slice {names[untouched[0]]} came back as the base output: its programs wrote elsewhere; a "
                    "slice's columns start at its own offset, offs_n = lo + pid_n * BLOCK_N + arange(BLOCK_N)")
        elif 0 not in wrong:
            msg += ("; slice " + names[0] + " is right and a later slice differs: did a tile of an earlier slice "
                    "write past that slice's end? each slice clips to its own end (mask offs_n < hi), not the output's")
        else:
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
        _segments_case("zero_length_at_both_ends", [0, 4, 0], [2, 1, 1]),
        _segments_case("only_zero_lengths", [0, 0], [1, 2]),
        _segments_case("base_rows_merge_too", [4, 4], [0, 0]),
        _segments_case("seg_lens_longer_raises_value_error", [1, 2], [1]),
        _segments_case("slots_longer_raises_value_error", [3], [1, 2]),
        _segments_case("negative_length_raises_value_error", [2, -1], [1, 1]),
        _segments_case("negative_length_first_raises_value_error", [-3, 2], [1, 2]),
    ]


def _random_segments(rng: random.Random, n: int) -> tuple[list[int], list[int]]:
    """``n`` random segments, then the families every draw must hold, at random places: a zero-length
    segment between two of one slot (they merge), and one slot's runs with another slot between
    (they stay apart)."""
    slots, lens = [], []
    for _ in range(n):
        slots.append(slots[-1] if slots and rng.random() < 0.5 else rng.randrange(4))
        lens.append(rng.choice([0, 1, 2, 5, 16, 33]))
    a, b = rng.sample(range(4), 2)
    for pattern in ([(rng.randint(1, 9), a), (0, b), (rng.randint(1, 9), a)],
                    [(rng.randint(1, 9), a), (rng.randint(1, 9), b), (rng.randint(1, 9), a)]):
        at = rng.randint(0, len(lens))
        lens[at:at] = [n for n, _ in pattern]
        slots[at:at] = [s for _, s in pattern]
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
        _segments_case("same_slot_neighbours_are_cut_apart", [3, 3], [1, 1], 4),
        _segments_case("chunk_0_raises_value_error", [3], [1], 0),
        _segments_case("negative_chunk_raises_value_error", [3], [1], -2),
    ]


def _chunk_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: chunk sizes of three families (1 or 2; 3..7; 16 or 32), segments with a remainder
    followed by more segments, multiples of the chunk size, and a zero-length segment."""
    cases = []
    for i, (k, chunks) in enumerate([(3, [1, 2]), (8, [3, 5, 7]), (20, [16, 32])]):
        c = rng.choice(chunks)
        lens = [rng.randint(0, 100) for _ in range(k)]
        lens[0] = c * rng.randint(1, 3) + (rng.randint(1, c - 1) if c > 1 else 0)  # a remainder, then more
        lens.insert(rng.randint(1, k), 0)
        lens.insert(rng.randint(1, k), c * rng.randint(1, 3))
        cases.append(_segments_case(f"random_{i}", lens, [rng.randrange(5) for _ in lens], c))
    return cases


def _spanning(case: Case, lens: list) -> Optional[str]:
    """The first returned piece that crosses the end of an input segment, in words."""
    ends, total = [], 0
    for n in case.args[0]:
        total += n
        ends.append(total)
    cuts, total = {0}, 0
    for n in lens:
        if not isinstance(n, int):
            return None
        total += n
        cuts.add(total)
    if not ends or total != ends[-1]:
        return None
    start = 0
    for j, n in enumerate(lens):
        inside = [end for end in ends if start < end < start + n]
        if inside:
            seg = ends.index(inside[0])
            return (f"your piece {j} (tokens {start}..{start + n - 1}) spans two segments: segment {seg} ends at "
                    f"token {inside[0] - 1}; a chunk never crosses a segment boundary: cut every segment on its "
                    f"own, and its last chunk may be shorter than chunk_size")
        start += n
    return None


def _segments_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(v, tuple) for v in got)):
        return "return a tuple of two lists of ints: (seg_lens, slots)"
    lens, slots = list(got[0]), list(got[1])
    shown = (f"expected lens {_runs(expected[0])}, slots {_runs(expected[1])}; "
             f"got lens {_runs(lens)}, slots {_runs(slots)}") if len(lens) == len(expected[0]) <= 40 else ""
    # (lists of different lengths are shown by the comparison itself)
    note = None
    chunked = len(case.args) == 3
    if 0 in lens:
        note = "a zero-length segment (or chunk) is dropped: it would launch programs that do nothing"
    elif chunked and (note := _spanning(case, lens)):
        pass
    elif chunked and lens and sum(lens) == sum(expected[0]) and any(n > case.args[2] for n in lens if isinstance(n, int)):
        note = "every piece is at most chunk_size tokens: a long segment becomes several chunks"
    elif chunked and sorted(lens) == sorted(expected[0]) and lens != list(expected[0]):
        note = ("each segment gives chunk_size-token chunks first and its shorter remainder last, in order "
                "(the rows of x stay in their order)")
    elif chunked and len(lens) == len(expected[0]) and sum(lens) == sum(expected[0]):
        note = ("every chunk but a segment's last holds exactly chunk_size tokens, and the last holds the "
                "remainder (pieces of equal size are not the contract)")
    elif not chunked and sum(lens) == sum(expected[0]) and len(lens) < len(expected[0]):
        note = ("only neighbours merge: a merged segment must be contiguous rows of x, so two runs of one "
                "slot with another slot between them stay two segments")
    elif not chunked and any(a == b for a, b in zip(slots, slots[1:])):
        note = ("two neighbouring segments of your result have the same slot: drop the zero-length segments first, "
                "then merge (with the empty segment gone, the runs around it are neighbours)")
    return "; ".join(m for m in (note, shown) if m) or None


EXERCISES = [
    Exercise("ch04.1", "stack_lora_parts", ("A_parts", "B_parts", "out_features"),
             packed.stack_lora_parts, _stack_edge, _stack_random, _stack_hint,  # the driver returns what it got
             driver=drive_stack, result_names=("A", "B")),
    Exercise("ch04.2", "sgmv_expand_sliced", ("t", "B_stack", "batch_info", "out", "slice_offsets"), _reference_sliced,
             _sliced_edge, _sliced_random, _sliced_hint, requires=TRITON_REQUIRED),
    Exercise("ch04.3", "merge_adjacent_segments", ("seg_lens", "slots"), chunked.merge_adjacent_segments,
             _merge_edge, _merge_random, _segments_hint, result_names=("lens", "slots")),
    Exercise("ch04.4", "cut_into_chunks", ("seg_lens", "slots", "chunk_size"), chunked.cut_into_chunks,
             _chunk_edge, _chunk_random, _segments_hint, result_names=("lens", "slots")),
]
