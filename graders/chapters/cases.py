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

from graders.machine.exercise import Case
from reference import batch_info as bi_ref
from reference.batch_info import build_batch_info, stable_sort_by_slot

__all__ = ["JUNK", "FINITE_JUNK", "BatchSpec", "weights", "batch_info_for", "row_labels", "describe", "x_for", "base_rows",
           "loop_case", "shrink_case", "expand_case", "edge_specs", "random_specs", "op_cases", "row_slots",
           "batch_hint", "ignored_permutation", "batch_hint_common", "not_in_place", "reads_token_slots",
           "LAYOUTS", "layout_spec", "contract_edge_specs", "contract_random_specs", "contract_op_cases"]

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
    extra_cols: int = 0  # shrink output / expand input with max_rank + extra_cols columns (">= max_rank")
    token_slots: bool = True  # False: batch_info.token_slots is None (ops that never read it: SGMV, the loop)


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
    info.token_slots = token_slots.clone() if spec.token_slots else None
    return info, token_slots


def row_labels(spec: BatchSpec) -> list[str]:
    labels = []
    for j, (n, s) in enumerate(zip(spec.req_lens, spec.req_slots)):
        what = "request" if spec.sort or spec.chunk else "segment"  # the op's segments are not the requests
        labels += [f"{what} {j}, slot {s} (rank {spec.ranks[s]})"] * n
    return labels


def short_list(values: list, keep: int = 24) -> str:
    """A list as printed, or its first and last entries when it is long: [0, 3, ..., 311] (160 entries)."""
    if len(values) <= keep:
        return str(values)
    half = keep // 2
    return f"[{', '.join(map(str, values[:half]))}, ..., {', '.join(map(str, values[-half:]))}] ({len(values)} entries)"


def describe(spec: BatchSpec, first: str) -> str:
    order = "requests arrive unsorted (permutation given)" if spec.sort else "segments"
    text = (f"{first}, {spec.dtype}; {order}: lengths {list(spec.req_lens)} -> slots {list(spec.req_slots)}; "
            f"lora_ranks {list(spec.ranks)}, max_rank {spec.max_rank}")
    if spec.sort or spec.chunk:  # what the op receives differs from the requests: show it
        info, _ = batch_info_for(spec)
        text += (f"; the op gets seg_indptr {short_list(info.seg_indptr.tolist())}, "
                 f"weight_indices {short_list(info.weight_indices.tolist())}"
                 + (f", permutation {short_list(info.permutation.tolist())}" if info.permutation is not None else "")
                 + (f" (segments cut into chunks of at most {spec.chunk})" if spec.chunk else ""))
    extras = []
    if spec.junk == FINITE_JUNK:
        extras.append(f"padding holds the finite {FINITE_JUNK:g} (not NaN)")
    if spec.extra_cols:
        extras.append(f"t/out have max_rank + {spec.extra_cols} columns")
    if not spec.token_slots:
        extras.append("batch_info.token_slots is None (this op never reads it)")
    return text + ("; " + "; ".join(extras) if extras else "")


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
    width = spec.max_rank + spec.extra_cols
    out = torch.full((x.shape[0], width), float("nan"), dtype=spec.dtype)
    ranks = torch.tensor(list(spec.ranks))[token_slots.long()]
    defined = torch.arange(width)[None, :] < ranks[:, None]
    first = f"x {list(x.shape)}, A_stack {list(A.shape)}, out {list(out.shape)} (filled with NaN)"
    return Case(spec.name, [x, A, info, out], describe(spec, first), out_index=3, defined=defined,
                row_labels=row_labels(spec))


def expand_case(spec: BatchSpec, gen: torch.Generator) -> Case:
    _, B = weights(spec, gen)
    info, token_slots = batch_info_for(spec)
    n = sum(spec.req_lens)
    width = spec.max_rank + spec.extra_cols
    t = torch.randn(n, width, generator=gen)
    ranks = torch.tensor(list(spec.ranks))[token_slots.long()]
    past_rank = torch.arange(width)[None, :] >= ranks[:, None]
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


def _info(case: Case) -> bi_ref.LoRABatchInfo:
    return next(a for a in case.args if isinstance(a, bi_ref.LoRABatchInfo))


def row_slots(case: Case) -> Optional[torch.Tensor]:
    """The slot of every row of x (x order), also for a batch that carries no token_slots."""
    info = _info(case)
    if info.token_slots is not None:
        return info.token_slots.long().cpu()
    lens = (info.seg_indptr[1:] - info.seg_indptr[:-1]).long().cpu()
    sorted_slots = torch.repeat_interleave(info.weight_indices.long().cpu(), lens)
    if info.permutation is None:
        return sorted_slots
    slots = torch.empty_like(sorted_slots)
    slots[info.permutation.long().cpu()] = sorted_slots
    return slots


#: Ops that read only token_slots (never the segments or the permutation).
_TOKEN_SLOT_OPS = ("bgmv_shrink", "bgmv_expand", "fused_decode")


def reads_token_slots(reference_op) -> bool:
    """Whether ``reference_op`` is a BGMV-style op (it reads only ``batch_info.token_slots``)."""
    return getattr(reference_op, "__name__", "") in _TOKEN_SLOT_OPS


def batch_hint(reference_op):
    """The hint of a batched op: names the mistake when the result is what a known wrong reading of
    the batch gives (out not written in place, the permutation ignored or inverted, segments read with
    an inclusive end, token slots rebuilt from the segments, slot 0 taken as the base model), else the
    symptoms (padding read, rank-0 rows changed, scaling applied in the shrink)."""
    def hint(case: Case, expected, got) -> Optional[str]:
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
            return None
        return (not_in_place(case, expected, got) or ignored_permutation(reference_op, case, got)
                or _wrong_reading(reference_op, case, got) or batch_hint_common(case, expected, got))
    return hint


def not_in_place(case: Case, expected, got) -> Optional[str]:
    """The hint for an op that computed its result but never wrote it into ``out``."""
    if case.out_index is None:
        return None
    before = case.args[case.out_index].cpu()
    same = lambda a, b: bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())  # noqa: E731
    if got.shape == before.shape and same(got, before) and not same(expected.cpu(), before):
        return ("`out` is exactly as it was before the call: nothing was written into it. Either the result "
                "went into a new tensor (the result must be written into `out` in place: out[rows] = ..., "
                "out.copy_(...), out[...] += ...; a tensor you return is not what the caller reads), or "
                "nothing ran (a launch grid of zero programs, e.g. floor division where triton.cdiv is "
                "needed, or every program returning early)")
    return None


def _rerun(reference_op, case: Case, infos) -> torch.Tensor:
    """``reference_op`` applied once per batch_info of ``infos`` to a copy of the case's inputs."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in case.args]
    idx = next(i for i, a in enumerate(args) if isinstance(a, bi_ref.LoRABatchInfo))
    for info in infos:
        args[idx] = info
        reference_op(*args)
    return args[case.out_index].cpu().double()


def _close(case: Case, got, alt) -> bool:
    mask = case.defined.cpu() if case.defined is not None else torch.ones_like(alt, dtype=torch.bool)
    g = got.double()
    if case.defined is not None and bool(torch.isnan(g[mask]).all()):
        return False  # nothing written at all: other hints say so
    return torch.allclose(torch.where(mask, g, 0.0), torch.where(mask, alt, 0.0), rtol=0.05, atol=0.05, equal_nan=True)


def _with(info, **fields) -> bi_ref.LoRABatchInfo:
    return bi_ref.LoRABatchInfo(**{**vars(info), **fields})


def _wrong_reading(reference_op, case: Case, got) -> Optional[str]:
    """Known wrong readings of the batch, each replayed with the reference: the first whose result
    matches ``got`` names the mistake."""
    info = _info(case)
    if case.out_index is None or info.seg_indptr.numel() == 0:
        return None
    n = case.args[case.out_index].shape[0]
    readings = []
    if reads_token_slots(reference_op):
        lens = (info.seg_indptr[1:] - info.seg_indptr[:-1]).long()
        seg_order = torch.repeat_interleave(info.weight_indices, lens).to(torch.int32)
        if info.token_slots is not None and not torch.equal(seg_order, info.token_slots):
            readings.append(([_with(info, token_slots=seg_order)],
                             "your result is what the segments give in x's row order: this op reads only "
                             "batch_info.token_slots (the slot of every token, in x's order), and the segments "
                             "(seg_indptr, weight_indices) of a permuted batch are in another order"))
    else:
        perm = info.permutation
        if perm is not None:
            inverse = torch.empty_like(perm)
            inverse[perm] = torch.arange(perm.shape[0], device=perm.device)
            if not torch.equal(inverse, perm):
                readings.append(([_with(info, permutation=inverse)],
                                 "your result is what the batch gives with the inverse permutation: sorted row i "
                                 "is row permutation[i] of x, so segment i covers the rows "
                                 "permutation[seg_indptr[i]:seg_indptr[i+1]] of x and out"))
        indptr = info.seg_indptr.tolist()
        dev = info.seg_indptr.device
        pieces = []
        for seg, slot in enumerate(info.weight_indices.tolist()):
            lo, hi = indptr[seg], min(indptr[seg + 1] + 1, n)
            pieces.append(_with(info, num_segments=1, seg_lens=torch.tensor([hi - lo], dtype=torch.int32, device=dev),
                                seg_indptr=torch.tensor([lo, hi], dtype=torch.int32, device=dev),
                                weight_indices=torch.tensor([slot], dtype=torch.int32, device=dev)))
        readings.append((pieces, "your result is what segments with an inclusive end give: segment i is the rows "
                                 "seg_indptr[i] up to but excluding seg_indptr[i+1] (a Python slice lo:hi, or "
                                 "range(lo, hi))"))
    ranks = info.lora_ranks
    if ranks.numel() and int(ranks[0]) > 0:
        readings.append(([_with(info, lora_ranks=torch.cat([ranks[:1] * 0, ranks[1:]]),
                                scalings=torch.cat([info.scalings[:1] * 0, info.scalings[1:]]))],
                         "rows of slot 0 differ, and slot 0 holds an adapter here: the base model is the slot of "
                         "rank 0, wherever it is"))
    for infos, text in readings:
        try:
            alt = _rerun(reference_op, case, infos)
        except Exception:  # a reading the reference cannot replay: no hint from it
            continue
        if _close(case, got, alt):
            return text
    return None


def ignored_permutation(reference_op, case: Case, got) -> Optional[str]:
    """The hint for an SGMV op that walked segments over x's rows directly."""
    info = _info(case)
    if info.permutation is None or reads_token_slots(reference_op):
        return None
    alt = _rerun(reference_op, case, [_with(info, permutation=None)])
    if _close(case, got, alt):
        return ("your result is what the batch gives without its permutation: segment rows are "
                "permutation[seg_indptr[i]:seg_indptr[i+1]] when batch_info.permutation is set")
    return None


def _holds_finite_junk(case: Case) -> bool:
    for a in case.args:
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel():
            if bool((a == torch.tensor(FINITE_JUNK, dtype=a.dtype, device=a.device)).any()):
                return True
    return False


def batch_hint_common(case: Case, expected, got) -> Optional[str]:
    info = _info(case)
    slots = row_slots(case)
    ranks = info.lora_ranks.cpu()[slots]
    e, g = expected.cpu().double(), got.double()
    bad = ~torch.isclose(g, e, rtol=0.05, atol=0.05)
    if case.defined is not None:
        bad &= case.defined.cpu()
    bad_rows = bad.reshape(bad.shape[0], -1).any(dim=1)
    hints = []
    if bool(bad_rows.any()) and bool((ranks[bad_rows] == 0).all()):
        hints.append("only rows of rank-0 slots differ: a slot of rank 0 (the base model) must add exactly nothing")
    if bool(torch.isnan(g).any()) and not bool(torch.isnan(e).any()):
        hints.append("NaN came from padding past a slot's rank (the grader fills it with NaN): clip A to its "
                     "first r rows and B to its first r columns by slicing or torch.where (0 * NaN is NaN)")
    elif _holds_finite_junk(case) and bool(bad.any()) and float((g - e).abs()[bad].max()) > 100.0:
        hints.append(f"values far off came from padding past a slot's rank: this case fills it with the finite "
                     f"{FINITE_JUNK:g} (torch.nan_to_num cannot hide a read), so clip A to its first r rows and B "
                     f"to its first r columns by slicing or torch.where")
    if hints:
        return "; ".join(hints)
    if case.defined is not None:
        scale = info.scalings.cpu().double()[slots][:, None].expand_as(e)
        region = case.defined.cpu() & (scale != 1.0)
        if bool(region.any()) and torch.allclose(g[region], e[region] * scale[region], rtol=0.05, atol=0.05):
            return "your result is the expected one times scalings[slot]: shrink applies no scaling (expand does; doing both scales the delta twice)"
    return None


# ---------------------------------------------------------------------------------------------
# Case families from the contract (chapter 02 and later): every layout the op's contract allows,
# in every group, with the structure that makes each reading visible fixed and only the numbers
# drawn, so a mistake costs the same under any secret.

#: Layout families: (name, sort, chunk). "segments": one segment per request in x order;
#: "permuted": requests out of slot order, segments are slot groups of the sorted tokens reached
#: through the permutation (token_slots stays in x order, so it differs from the segments' order);
#: "chunked": segments cut into pieces; "chunked_permuted": both.
LAYOUTS = (("segments", False, 0), ("permuted", True, 0), ("chunked", False, 2), ("chunked_permuted", True, 3))


def layout_spec(name: str, rng: random.Random, *, layout: str, dtype=torch.float32, junk: float = JUNK,
                extra_cols: int = 0, token_slots: bool = True, slot0_adapter: bool = False,
                d_in: Optional[int] = None, d_out: Optional[int] = None, max_rank: Optional[int] = None) -> BatchSpec:
    """A batch of one layout family whose structure is fixed and whose numbers come from ``rng``.

    Fixed: a full-rank adapter ``hi`` and a partial-rank adapter ``lo`` (``lo`` < ``hi``, distinct
    scalings, every scaling != 1), a rank-0 slot (slot 0 unless ``slot0_adapter``, then slot 0 is
    ``lo``), requests ``hi, base, lo, hi`` in arrival order (out of slot order, an adapter repeated
    non-adjacently, segments of >= 3 tokens so chunks cut them), then up to two random requests
    (one may be empty)."""
    sort, chunk = next((s, c) for n, s, c in LAYOUTS if n == layout)
    n_slots = rng.randint(3, 6)
    max_rank = max_rank or rng.choice([8, 12, 16])
    others = list(range(n_slots))
    if slot0_adapter:
        lo = 0
        base = rng.randrange(1, n_slots)
        hi = rng.choice([s for s in others if s not in (lo, base)])
    else:
        base = 0
        lo, hi = sorted(rng.sample(range(1, n_slots), 2))
    ranks = [rng.choice([1, 2, max_rank // 2, max_rank]) for _ in range(n_slots)]
    ranks[base], ranks[hi], ranks[lo] = 0, max_rank, rng.randint(1, max_rank - 1)
    pool = [0.25, 0.5, 1.5, 2.0, 3.0]
    rng.shuffle(pool)
    scalings = [0.0 if r == 0 else pool.pop() for r in ranks]
    lens = [rng.randint(3, 7), rng.randint(1, 4), rng.randint(3, 7), rng.randint(1, 5)]
    slots = [hi, base, lo, hi]
    for _ in range(rng.randint(0, 2)):
        lens.append(rng.choice([0, 1, 2, 4]))
        slots.append(rng.randrange(n_slots))
    d_in = d_in or rng.choice([16, 24, 40, 72])
    d_out = d_out or rng.choice([8, 24, 40, 56])
    return BatchSpec(name, lens, slots, ranks, max_rank, d_in, d_out, dtype, sort=sort, scalings=scalings,
                     junk=junk, chunk=chunk, extra_cols=extra_cols, token_slots=token_slots)


def _reads(op: str) -> tuple[bool, bool]:
    """(reads the permutation/segments, has a t/out of max_rank columns) for an op kind."""
    if op not in ("loop", "bgmv_shrink", "bgmv_expand", "sgmv_shrink", "sgmv_expand"):
        raise ValueError(f"unknown op kind {op!r}")
    return not op.startswith("bgmv"), op != "loop"


def contract_edge_specs(op: str) -> list[BatchSpec]:
    """The edge batches of an op kind (``loop``, ``bgmv_shrink``, ``bgmv_expand``, ``sgmv_shrink``,
    ``sgmv_expand``): the fixed edge batches of :func:`edge_specs`, requests with zero tokens, every
    layout, finite junk, fp16 and bf16, a t/out wider than max_rank (shrink/expand) and a batch
    without token_slots (ops that read the segments)."""
    segments, wide = _reads(op)
    rng = random.Random(20261201)
    specs = [s for s in edge_specs(sgmv=True)]
    specs.append(BatchSpec("requests_with_zero_tokens", [0, 0], [1, 2], [0, 4, 2], 4, 16, 16))
    specs.append(BatchSpec("finite_junk_in_padding", [3, 2, 2], [1, 2, 0], [0, 16, 4], 16, 32, 40, junk=FINITE_JUNK))
    specs.append(BatchSpec("fp16_mixed_ranks", [2, 3, 1], [2, 1, 0], [0, 3, 8], 8, 24, 20, torch.float16))
    specs.append(BatchSpec("bf16_mixed_ranks", [3, 1, 2], [1, 0, 2], [0, 5, 8], 8, 40, 24, torch.bfloat16))
    for layout, _, _ in LAYOUTS[1:]:
        specs.append(layout_spec(f"layout_{layout}", rng, layout=layout, slot0_adapter=layout == "permuted",
                                 junk=FINITE_JUNK if layout == "chunked" else JUNK))
    if wide:
        specs.append(layout_spec("t_out_wider_than_max_rank", rng, layout="segments", extra_cols=3))
    if segments:
        specs.append(layout_spec("no_token_slots_permuted", rng, layout="permuted", token_slots=False))
    return specs


def contract_random_specs(rng: random.Random, hidden: bool, op: str) -> list[BatchSpec]:
    """The random batches of an op kind: every layout family, each in a fixed dtype and poison (fp32,
    bf16, fp16; NaN and finite junk), slot 0 an adapter in half of them, t/out wider than max_rank
    and token_slots absent where the op allows; only the numbers come from ``rng``."""
    segments, wide = _reads(op)
    families = [  # (layout, dtype, junk, slot 0 holds an adapter)
        ("segments", torch.float32, JUNK, False),
        ("permuted", torch.bfloat16, FINITE_JUNK, True),
        ("chunked", torch.float16, JUNK, True),
        ("chunked_permuted", torch.float32, FINITE_JUNK, False),
        ("permuted", torch.float32, JUNK, False),
    ]
    specs = []
    for i, (layout, dtype, junk, slot0) in enumerate(families):
        specs.append(layout_spec(f"random_{i}_{layout}", rng, layout=layout, dtype=dtype, junk=junk,
                                 slot0_adapter=slot0, extra_cols=rng.randint(1, 4) if wide and i in (1, 3) else 0,
                                 token_slots=not (segments and i in (2, 4))))
    return specs


def contract_op_cases(make, op: str):
    """(edge, random) case makers of an op kind from :func:`contract_edge_specs` and
    :func:`contract_random_specs`; ``make`` is :func:`loop_case`, :func:`shrink_case` or :func:`expand_case`."""
    def edge() -> list[Case]:
        gen = torch.Generator().manual_seed(7)
        return [make(s, gen) for s in contract_edge_specs(op)]

    def rand(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
        return [make(s, gen) for s in contract_random_specs(rng, hidden, op)]

    return edge, rand
