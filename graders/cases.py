"""Shared case builders for the batched LoRA ops (chapters 02-04): batches in the learner's terms,
slot-stacked weights poisoned past each rank, the op cases (loop, shrink, expand) and the hints they
share. Public names only: a chapter's grader imports from here, never another chapter's privates.

Every batch poisons what an op must not read or may leave alone: weights past a slot's rank and
the whole of a rank-0 slot hold junk (NaN by default, so padding multiplied by a 0/1 mask still
shows: 0 * NaN is NaN), shrink outputs start as NaN, expand inputs carry junk past each token's
rank. An op that forgets to clip to the rank, reads another slot, or leaves a defined element
unwritten fails loudly. Rows of rank-0 tokens must come back bit for bit unchanged.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from graders.core import Case
from reference import batch_info as bi_ref
from reference.batch_info import build_batch_info, stable_sort_by_slot

__all__ = ["JUNK", "FINITE_JUNK", "BatchSpec", "weights", "batch_info_for", "row_labels", "describe", "x_for", "base_rows",
           "loop_case", "shrink_case", "expand_case", "edge_specs", "random_specs", "op_cases", "row_slots",
           "batch_hint", "ignored_permutation", "batch_hint_common"]

JUNK = float("nan")  # what an op must never read
FINITE_JUNK = 3.0e4  # finite poison: survives torch.nan_to_num, and reading it is still far off


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
    junk: float = JUNK  # what padding holds: NaN, or FINITE_JUNK (nan_to_num cannot hide a read)
    chunk: int = 0  # > 0: every segment cut into pieces of at most ``chunk`` tokens (chunked SGMV)


def weights(spec: BatchSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(spec.ranks)
    A = torch.randn(n, spec.max_rank, spec.d_in, generator=gen) * spec.d_in**-0.5
    B = torch.randn(n, spec.d_out, spec.max_rank, generator=gen) * max(spec.max_rank, 1) ** -0.5
    for s, r in enumerate(spec.ranks):
        A[s, r:] = spec.junk
        B[s, :, r:] = spec.junk
    return A.to(spec.dtype), B.to(spec.dtype)


def batch_info_for(spec: BatchSpec):
    """LoRABatchInfo with segments; with ``sort`` the segments are slot groups of sorted tokens."""
    scalings = spec.scalings or [0.0 if r == 0 else (0.5, 2.0, 1.5, 0.25)[s % 4] for s, r in enumerate(spec.ranks)]
    token_slots = torch.repeat_interleave(torch.tensor(list(spec.req_slots), dtype=torch.int32),
                                          torch.tensor(list(spec.req_lens), dtype=torch.int64))
    if not spec.sort:
        lens, slots, permutation = list(spec.req_lens), list(spec.req_slots), None
    else:
        permutation, _ = stable_sort_by_slot(token_slots)
        slots_t, lens_t = torch.unique_consecutive(token_slots[permutation], return_counts=True)
        lens, slots = lens_t.tolist(), slots_t.tolist()
    if spec.chunk > 0:  # seg_lens [7, 2], chunk 3 -> [3, 3, 1, 2], slots repeated per piece
        pieces = [(min(spec.chunk, n - i), s) for n, s in zip(lens, slots) for i in range(0, n, spec.chunk)]
        lens, slots = [n for n, _ in pieces], [s for _, s in pieces]
    info = build_batch_info(lens, slots, spec.ranks, scalings, "cpu", permutation)
    info.bs = len(spec.req_lens)
    # the per-token slots in x's row order, whatever the segments' layout
    info.token_slots = token_slots.clone()
    return info, token_slots


def row_labels(spec: BatchSpec) -> list[str]:
    labels = []
    for j, (n, s) in enumerate(zip(spec.req_lens, spec.req_slots)):
        what = "request" if spec.sort else "segment"
        labels += [f"{what} {j}, slot {s} (rank {spec.ranks[s]})"] * n
    return labels


def describe(spec: BatchSpec, first: str) -> str:
    order = "requests arrive unsorted (permutation given)" if spec.sort else "segments"
    return (f"{first}, {spec.dtype}; {order}: lengths {list(spec.req_lens)} -> slots {list(spec.req_slots)}; "
            f"lora_ranks {list(spec.ranks)}, max_rank {spec.max_rank}")


def x_for(spec, gen):
    return torch.randn(sum(spec.req_lens), spec.d_in, generator=gen).to(spec.dtype)


def base_rows(spec: BatchSpec, width: int) -> torch.Tensor:
    """Mask of output rows whose token uses a rank-0 slot: they must stay bit for bit."""
    per_token = [spec.ranks[s] == 0 for n, s in zip(spec.req_lens, spec.req_slots) for _ in range(n)]
    return torch.tensor(per_token, dtype=torch.bool)[:, None].expand(len(per_token), width)


def loop_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    A, B = weights(spec, gen)
    info, _ = batch_info_for(spec)
    x = x_for(spec, gen)
    out = torch.randn(x.shape[0], spec.d_out, generator=gen).to(spec.dtype)
    first = f"x {list(x.shape)}, A_stack {list(A.shape)}, B_stack {list(B.shape)}, out {list(out.shape)}"
    return Case(spec.name, [x, A, B, info, out], describe(spec, first), out_index=4, row_labels=row_labels(spec),
                exact=base_rows(spec, spec.d_out))


def shrink_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    A, _ = weights(spec, gen)
    info, token_slots = batch_info_for(spec)
    x = x_for(spec, gen)
    out = torch.full((x.shape[0], spec.max_rank), float("nan"), dtype=spec.dtype)
    ranks = torch.tensor(list(spec.ranks))[token_slots.long()]
    defined = torch.arange(spec.max_rank)[None, :] < ranks[:, None]
    first = f"x {list(x.shape)}, A_stack {list(A.shape)}, out {list(out.shape)} (filled with NaN)"
    return Case(spec.name, [x, A, info, out], describe(spec, first), out_index=3, defined=defined,
                row_labels=row_labels(spec))


def expand_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    _, B = weights(spec, gen)
    info, token_slots = batch_info_for(spec)
    n = sum(spec.req_lens)
    t = torch.randn(n, spec.max_rank, generator=gen)
    ranks = torch.tensor(list(spec.ranks))[token_slots.long()]
    past_rank = torch.arange(spec.max_rank)[None, :] >= ranks[:, None]
    t = torch.where(past_rank, spec.junk, t).to(spec.dtype)
    out = torch.randn(n, spec.d_out, generator=gen).to(spec.dtype)
    first = f"t {list(t.shape)}, B_stack {list(B.shape)}, out {list(out.shape)} (the base output)"
    return Case(spec.name, [t, B, info, out], describe(spec, first), out_index=3, row_labels=row_labels(spec),
                exact=base_rows(spec, spec.d_out))


def edge_specs(sgmv: bool) -> list[BatchSpec]:
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


def random_specs(rng: random.Random, hidden: bool, sgmv: bool) -> list[BatchSpec]:
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


def op_cases(make, sgmv: bool, hidden_ok: bool = True):
    def edge() -> list[Case]:
        gen = torch.Generator().manual_seed(7)
        return [make(s, gen) for s in edge_specs(sgmv)]

    def rand(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
        return [make(s, gen) for s in random_specs(rng, hidden, sgmv)]

    return edge, rand


def row_slots(case: Case) -> Optional[torch.Tensor]:
    info = next(a for a in case.args if isinstance(a, bi_ref.LoRABatchInfo))
    return info.token_slots.long().cpu()


def batch_hint(reference_op):
    def hint(case: Case, expected, got) -> Optional[str]:
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
            return None
        return ignored_permutation(reference_op, case, got) or batch_hint_common(case, expected, got)
    return hint


def ignored_permutation(reference_op, case: Case, got) -> Optional[str]:
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


def batch_hint_common(case: Case, expected, got) -> Optional[str]:
    info = next(a for a in case.args if isinstance(a, bi_ref.LoRABatchInfo))
    slots = row_slots(case)
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
