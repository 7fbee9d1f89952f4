"""Cases for chapter 03 (shrink, expand and fused decode in Triton).

The same poisoned batches as chapter 02 (NaN past every slot's rank and in rank-0 slots, or a large
finite junk that ``torch.nan_to_num`` cannot hide; shrink outputs filled with NaN; base rows compared
bit for bit), so a kernel that reads out of bounds of a slot's rank or leaves an element unwritten
fails. In Triton's CPU interpreter bf16 arithmetic is wrong without an error, so there the cases use
fp16 where the GPU uses bf16.

Tiles and loops (the case design rule of ``graders``): every exercise has "tiles" cases, in the edge
group and in every random and hidden draw, that cross every grid axis and every loop of the kernel
at least twice, both with the blocks the chapter suggests and with the reference's defaults as the
CPU path picks them (``reference/ops/*.py``, ``benchmarks/results/tuned_configs.json``):

- ch03.1 shrink (suggested BLOCK_M 32, BLOCK_N <= 64, BLOCK_K 256; reference BLOCK_M 64 for ranks
  above 16, BLOCK_N 64, BLOCK_K 256): in > 512 (three K steps), max_rank 128 with a rank above 64
  (two rank tiles), a segment longer than 64 tokens (two or three row tiles), and max_rank 32 with a
  rank above 16 (a rank block fixed at 16 is too small); ``out`` wider than max_rank (its row stride
  is not max_rank).
- ch03.2 expand (suggested BLOCK_M 32, BLOCK_N 128, one masked K step; reference BLOCK_M 32, BLOCK_N
  256 up to max_rank 16, BLOCK_M 64, BLOCK_N 128 above): out_dim 129..250 and 260..380 (two or three column tiles), ranks above 16 and 32 (a K block
  fixed at 16 needs a loop), a segment longer than 64 tokens; the numbers of row tiles and of column
  tiles differ (a pid_m / pid_n mix-up misses tiles); ``t`` wider than max_rank.
- ch03.3 fused decode (suggested BLOCK_K 512, BLOCK_N 256, up to 4 splits; reference for <= 16
  tokens: 8 splits, BLOCK_K 1024 / 512 and BLOCK_N 256 / 128 at max_rank 32 / 64): in 1030..1200 at
  max_rank 32 and 520..700 at max_rank 64 (two K steps or more under both), out_dim 257..380 (two
  splits of fewer columns than a block: a split must clip to its own end) and 1030..1200 at max_rank
  64 (two column steps inside every split under both). Output widths are odd and not multiples of 3,
  so no block or split count divides them. Plus a case whose intermediate, rounded to
  x.dtype (fp16) or not, gives results far apart, with exact dyadic values so that every correct
  accumulation order agrees.

Every batch stays small in tokens (a few to ~100): the interpreter costs a few milliseconds per
program (less per further loop step), so each grading takes about 8 s of CPU on the CPU path.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Callable, Optional

import torch

from graders.chapters.cases import (FINITE_JUNK, BatchSpec, base_rows, batch_hint, batch_hint_common, batch_info_for,
                           contract_edge_specs, contract_random_specs, describe, edge_specs, expand_case, loop_case,
                           row_labels, shrink_case)
from graders.machine.exercise import Case, Exercise
from reference.batch_info import LoRABatchInfo
from reference.device import interpreting
from reference.ops import torch_ref

__all__ = ["EXERCISES"]

TRITON_REQUIRED = ("@triton.jit", "this exercise asks for a Triton kernel, and the answer cell defines no @triton.jit "
                   "function: a PyTorch version computes the same numbers, but it is not the exercise")


def _on_this_device(spec: BatchSpec) -> BatchSpec:
    if interpreting() and spec.dtype == torch.bfloat16:
        return dataclasses.replace(spec, dtype=torch.float16)
    return spec


def _triton(case: Case) -> Case:
    case.op = "triton"  # the tolerance row for kernels (TF32 dots on the GPU)
    return case


# ---------------------------------------------------------------------------------------------
# Case builders of this chapter (on top of graders.chapters.cases)


def _rounding_case(name: str, rng: random.Random) -> Case:
    """fused_decode in fp16 where rounding the intermediate to x.dtype changes the result by >= 0.125.

    Exact dyadic values (x[:, 0] an integer near 1000, x[:, 1] = 3/8 or 5/8; A rows e0 + e1 and e0,
    zero elsewhere within the rank; B columns +b and -b): t = (x0 + f, x0) is exact in fp32 in any
    order, fp16 has a spacing of 0.5 there, so t0 - t1 is f unrounded and 0.5 (or 1.0) rounded.
    """
    dtype, max_rank, d_in, d_out = torch.float16, 16, 64, 40
    ranks, scalings = [2, 0, 3], [2.0, 0.0, 1.0]
    slots = [2, 0, 1, 0, 2]
    rng.shuffle(slots)
    n = len(slots)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    x = torch.randn(n, d_in, generator=gen)
    x[:, 0] = torch.tensor([float(rng.randrange(1000, 1020)) for _ in range(n)])
    x[:, 1] = torch.tensor([rng.choice([0.375, 0.625]) for _ in range(n)])
    A = torch.full((3, max_rank, d_in), float("nan"))
    B = torch.full((3, d_out, max_rank), float("nan"))
    for s, r in enumerate(ranks):
        if r == 0:
            continue
        A[s, :r] = 0.0
        A[s, 0, :2] = 1.0
        A[s, 1:r, 0] = 1.0
        b = torch.tensor([rng.choice([-2.0, -1.0, 1.0, 2.0]) for _ in range(d_out)])
        B[s, :, :r] = 0.0
        B[s, :, 0], B[s, :, 1] = b, -b
    spec = BatchSpec(name, [1] * n, slots, ranks, max_rank, d_in, d_out, dtype, scalings=scalings)
    info, _ = batch_info_for(spec)
    out = torch.randn(n, d_out, generator=gen)
    first = (f"x {list(x.shape)} with x[:, 0] near 1000 (fp16 keeps steps of 0.5 there), A_stack {list(A.shape)}, "
             f"B_stack {list(B.shape)}, out {list(out.shape)}")
    return Case(name, [x.to(dtype), A.to(dtype), B.to(dtype), info, out.to(dtype)], describe(spec, first),
                out_index=4, row_labels=row_labels(spec), exact=base_rows(spec, d_out))


# ---------------------------------------------------------------------------------------------
# Batch families. Every draw has the same structure; only the numbers change (a mistake that one
# draw catches, every draw catches).


def _width(rng: random.Random, lo: int, hi: int) -> int:
    """An output width in [lo, hi] that is odd and not a multiple of 3: no block and no split count
    (powers of two, or 3) divides it, so every last tile, split and block sticks out."""
    while True:
        w = rng.randint(lo, hi)
        if w % 2 and w % 3:
            return w


def _shrink_tile_specs(rng: Optional[random.Random]) -> list[BatchSpec]:
    """Two batches that cross every tile and loop of the shrink (see the module docstring)."""
    r = rng or random.Random(3)
    long_len = r.randint(65, 90)
    # 16-bit at max_rank 128: the reference's fp32 tiles at that rank (64 x 256 and 256 x 64, two
    # stages) need 256 KiB of shared memory, more than an H200 has; fp32 is crossed at max_rank 32.
    a = BatchSpec("tiles_rank128_in_600_permuted", [r.randint(2, 9), long_len, r.randint(1, 5), r.randint(1, 9)],
                  [2, 0, 1, 3], [r.randint(65, 127), 0, r.randint(17, 64), r.randint(1, 16)], 128,
                  r.randint(513, 700), 16, torch.bfloat16, sort=True)
    b = BatchSpec("tiles_rank32_fp32_finite_junk_wide_out", [r.randint(65, 80), r.randint(1, 5), r.randint(2, 9)],
                  [0, 2, 1], [r.randint(17, 32), r.randint(1, 16), 0], 32, r.randint(257, 500), 16,
                  torch.float32, junk=FINITE_JUNK, extra_cols=r.randint(5, 9))
    return [a, b]


def _expand_tile_specs(rng: Optional[random.Random]) -> list[BatchSpec]:
    r = rng or random.Random(4)
    a = BatchSpec("tiles_rank64_out_200_permuted", [r.randint(2, 9), r.randint(65, 90), r.randint(1, 5), r.randint(1, 9)],
                  [2, 0, 1, 3], [r.randint(33, 64), 0, r.randint(17, 40), r.randint(1, 16)], 64, 16,
                  _width(r, 129, 250), torch.float32, sort=True)
    b = BatchSpec("tiles_rank32_out_300_fp16_finite_junk_chunked_wide_t", [r.randint(65, 80), r.randint(1, 5), r.randint(2, 9)],
                  [0, 2, 1], [r.randint(17, 32), r.randint(1, 16), 0], 32, 16, _width(r, 260, 380),
                  torch.bfloat16, sort=True, chunk=r.randint(33, 48), junk=FINITE_JUNK, extra_cols=r.randint(5, 9))
    return [a, b]


def _decode_tile_specs(rng: Optional[random.Random]) -> list[BatchSpec]:
    r = rng or random.Random(5)
    slots_a = [2, 0, 1, 3] + [r.randrange(4) for _ in range(r.randint(0, 2))]
    a = BatchSpec("tiles_rank32_in_1100_out_300", [1] * len(slots_a), slots_a,
                  [r.randint(17, 32), 0, r.randint(1, 16), r.randint(17, 32)], 32, r.randint(1030, 1200),
                  _width(r, 257, 380), torch.bfloat16, sort=True)
    slots_b = [1, 0, 2] + [r.randrange(3) for _ in range(r.randint(0, 1))]
    b = BatchSpec("tiles_rank64_in_600_out_1100_finite_junk", [1] * len(slots_b), slots_b,
                  [r.randint(33, 64), r.randint(1, 16), 0], 64, r.randint(520, 700), _width(r, 1030, 1200),
                  torch.float32, sort=True, chunk=2, junk=FINITE_JUNK)
    return [a, b]


def _small_decode_specs(rng: random.Random) -> list[BatchSpec]:
    """Decode batches (one token per request): arrival order, slot-grouped segments, chunked."""
    specs = []
    for i, (dtype, sort, chunk, junk) in enumerate([(torch.float32, False, 0, float("nan")),
                                                    (torch.bfloat16, True, 0, float("nan")),
                                                    (torch.float32, True, 2, FINITE_JUNK)]):
        max_rank = rng.choice([4, 7, 16])
        base = rng.randint(1, 3)
        ranks = [rng.choice([1, max_rank // 2 or 1, max_rank]) for _ in range(4)]
        ranks[0], ranks[base] = max_rank, 0
        slots = [3, 0, base, 1, 2] + [rng.randrange(4) for _ in range(rng.randint(0, 3))]
        specs.append(BatchSpec(f"decode_{['arrival', 'slot_grouped', 'chunked_finite_junk'][i]}", [1] * len(slots),
                               slots, ranks, max_rank, rng.choice([16, 72, 96]), rng.choice([24, 40, 64]), dtype,
                               sort=sort, chunk=chunk, junk=junk))
    return specs


# ---------------------------------------------------------------------------------------------
# Case groups


def _cases(make: Callable, specs: list[BatchSpec], gen: torch.Generator) -> list[Case]:
    return [_triton(make(_on_this_device(s), gen)) for s in specs]


def _shrink_edge() -> list[Case]:
    gen = torch.Generator().manual_seed(11)
    return _cases(shrink_case, contract_edge_specs("sgmv_shrink") + _shrink_tile_specs(None), gen)


def _shrink_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    return _cases(shrink_case, contract_random_specs(rng, hidden, "sgmv_shrink") + _shrink_tile_specs(rng), gen)


def _expand_edge() -> list[Case]:
    gen = torch.Generator().manual_seed(12)
    return _cases(expand_case, contract_edge_specs("sgmv_expand") + _expand_tile_specs(None), gen)


def _expand_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    return _cases(expand_case, contract_random_specs(rng, hidden, "sgmv_expand") + _expand_tile_specs(rng), gen)


def _decode_edge() -> list[Case]:
    gen = torch.Generator().manual_seed(13)
    specs = edge_specs(sgmv=False) + [
        BatchSpec("decode_base_in_slot_1", [1] * 5, [0, 1, 2, 1, 0], [7, 0, 16], 16, 72, 40),
        BatchSpec("decode_slot_grouped_segments", [1] * 6, [2, 0, 1, 2, 0, 2], [5, 0, 3], 8, 40, 24, sort=True),
    ]
    cases = [_triton(loop_case(_on_this_device(s), gen)) for s in specs]
    cases.append(_triton(_rounding_case("intermediate_rounded_to_x_dtype_fp16", random.Random(6))))
    return cases + [_triton(loop_case(_on_this_device(s), gen)) for s in _decode_tile_specs(None)]


def _decode_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = [_triton(loop_case(_on_this_device(s), gen)) for s in _small_decode_specs(rng)]
    cases.append(_triton(_rounding_case("random_intermediate_rounding_fp16", rng)))
    return cases + [_triton(loop_case(_on_this_device(s), gen)) for s in _decode_tile_specs(rng)]


# ---------------------------------------------------------------------------------------------
# Hints: each compares the learner's result with what one specific mistake would give


def _cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, LoRABatchInfo):
        return LoRABatchInfo(**{k: _cpu(v) for k, v in vars(value).items()})
    return value


def _info(case: Case) -> LoRABatchInfo:
    return next(a for a in case.args if isinstance(a, LoRABatchInfo))


def _alt(reference_op, case: Case, change: Callable[[list], None]) -> torch.Tensor:
    """The reference's result on a copy of the case's inputs after ``change(args)``."""
    args = [_cpu(a) for a in case.args]
    change(args)
    reference_op(*args)
    return args[case.out_index].double()


def _same(a: torch.Tensor, b: torch.Tensor, mask: Optional[torch.Tensor], tol: float = 0.05) -> bool:
    a, b = a.double(), b.double()
    close = ((a - b).abs() <= tol + tol * b.abs()) | (torch.isnan(a) & torch.isnan(b))
    return bool(close[mask].all()) if mask is not None else bool(close.all())


def _segment_positions(info: LoRABatchInfo, n: int) -> torch.Tensor:
    """Per row of x: its position inside its segment (-1 for rows of no segment)."""
    pos = torch.full((n,), -1, dtype=torch.long)
    indptr = info.seg_indptr.cpu().tolist()
    perm = info.permutation.cpu() if info.permutation is not None else None
    for lo, hi in zip(indptr[:-1], indptr[1:]):
        rows = perm[lo:hi] if perm is not None else torch.arange(lo, hi)
        pos[rows] = torch.arange(hi - lo)
    return pos


def _spans_text(idx: list[int]) -> str:
    spans: list[list[int]] = []
    for i in idx:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    text = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans[:4])
    return text + (", ..." if len(spans) > 4 else "")


def _where_hint(case: Case, expected: torch.Tensor, got: torch.Tensor, sgmv: bool) -> Optional[str]:
    """Which columns (and positions inside segments) differ, when the others agree: a tile, split
    or loop step that is wrong while the first one is right."""
    e, g = expected.cpu().double(), got.double()
    bad = ~(((g - e).abs() <= 0.05 + 0.05 * e.abs()) | (torch.isnan(g) & torch.isnan(e)))
    if case.defined is not None:
        bad &= case.defined.cpu()
    if not bool(bad.any()) or g.dim() != 2:
        return None
    notes = []
    cols = torch.nonzero(bad.any(dim=0)).flatten().tolist()
    width = int(case.defined.cpu().any(dim=0).sum()) if case.defined is not None else g.shape[1]
    if len(cols) < width:
        notes.append(f"only columns {_spans_text(cols)} differ (of {width}); the other columns agree: look at the "
                     f"programs or loop steps that cover those columns")
    if sgmv:
        pos = _segment_positions(_info(case), g.shape[0])
        rows_bad = bad.any(dim=1)
        first = int(pos[rows_bad].min()) if bool(rows_bad.any()) else 0
        if first > 0:
            notes.append(f"in every segment the first {first} rows agree and only later rows differ: look at the "
                         f"row tiles past the first (pid_m > 0)")
    return "; ".join(notes) or None


def _sorted_rows_hint(reference_op, case, expected, got) -> Optional[str]:
    """SGMV: results written to the sorted positions seg_indptr[i] + j instead of permutation[...]."""
    info = _info(case)
    if info.permutation is None:
        return None
    perm = info.permutation.cpu().long()
    e = expected.cpu().double()
    if case.defined is not None:  # shrink: out[j] should be what belongs to row perm[j]
        mask = case.defined.cpu()[perm]
        ok = _same(got, e[perm], mask)
    else:  # expand: out[j] = base[j] + the delta of row perm[j]
        base = case.args[case.out_index].cpu().double()
        ok = _same(got.double() - base, (e - base)[perm], None)
    if ok and not bool((perm == torch.arange(len(perm))).all()):
        return ("your kernel wrote each result to its sorted position seg_indptr[i] + j: the store goes to the "
                "permuted rows too, out[permutation[seg_indptr[i] + j]], the rows it loaded")
    return None


def _token_slots_from_segments_hint(reference_op, case, expected, got) -> Optional[str]:
    info = _info(case)

    def rebuilt(args):
        i = next(k for k, a in enumerate(args) if isinstance(a, LoRABatchInfo))
        args[i].token_slots = torch.repeat_interleave(args[i].weight_indices, args[i].seg_lens.long())
    if info.token_slots is None or torch.equal(info.token_slots.cpu(),
                                               torch.repeat_interleave(info.weight_indices.cpu(), info.seg_lens.cpu().long())):
        return None
    if _same(got, _alt(reference_op, case, rebuilt), None):
        return ("your result is what token slots rebuilt from the segments give: the segments are grouped by slot "
                "here, not in x's row order; read batch_info.token_slots (one slot per row of x)")
    return None


def _delta_only_hint(reference_op, case, expected, got) -> Optional[str]:
    base = case.args[case.out_index].cpu().double()
    delta = expected.cpu().double() - base
    adapter_rows = delta.abs().sum(dim=1) > 0
    if bool(adapter_rows.any()) and _same(got.double()[adapter_rows], delta[adapter_rows], None):
        return ("your result is the LoRA delta alone: out holds the base output, and the kernel adds into it "
                "(load the tile of out, add scaling * acc in fp32, store)")
    return None


def _scaling_hint(reference_op, case, expected, got) -> Optional[str]:
    info = _info(case)
    for how, f in (("without scalings[slot]", lambda s: torch.ones_like(s)), ("with scalings[slot] applied twice", lambda s: s * s)):
        def rescale(args, f=f):
            i = next(k for k, a in enumerate(args) if isinstance(a, LoRABatchInfo))
            args[i].scalings = torch.where(args[i].lora_ranks > 0, f(args[i].scalings), args[i].scalings)
        if not bool((info.scalings.cpu() == f(info.scalings.cpu())).all()) and _same(got, _alt(reference_op, case, rescale), None):
            return f"your result is the expected one {how}: the delta is multiplied by scalings[slot] exactly once"
    return None


def _unrounded_hint(reference_op, case, expected, got) -> Optional[str]:
    x, A, B, info, out = (_cpu(a) for a in case.args)
    if x.dtype == torch.float32:
        return None
    slots = info.token_slots.long()
    ranks = info.lora_ranks[slots].long()
    keep = torch.arange(A.shape[1])[None, :] < ranks[:, None]
    Ag = torch.where(keep[:, :, None], A[slots].double(), 0.0)
    Bg = torch.where(keep[:, None, :], B[slots].double(), 0.0)
    t = torch.einsum("ti,tri->tr", x.double(), Ag)  # not rounded
    alt = (out.double() + info.scalings[slots].double()[:, None] * torch.einsum("tr,tor->to", t, Bg)).to(out.dtype)
    if _same(got, alt.double(), None, tol=0.01) and not _same(got, expected.cpu(), None, tol=0.01):
        return ("your result keeps the intermediate t = x @ A.T unrounded: the contract rounds it to x.dtype "
                "(as a two-kernel path stores t in a tensor of x.dtype) before the expand")
    return None


def _k_truncated_hint(reference_op, case, expected, got, what: str) -> Optional[str]:
    """The result of only some K blocks: the first kb columns of x (shrink, fused) or ranks of t
    (expand); x's first block read at every step; the last step alone (acc = instead of acc +=)."""
    width = case.args[0].shape[1]
    mask = case.defined.cpu() if case.defined is not None else None
    for kb in (16, 32, 64, 128, 256, 512, 1024):
        if kb >= width:
            break
        last = (width - 1) // kb * kb

        def first(args, kb=kb):
            args[0] = args[0].clone()
            args[0][:, kb:] = 0.0

        def repeated(args, kb=kb):
            args[0] = args[0][:, torch.arange(args[0].shape[1]) % kb].clone()

        def only_last(args, last=last):
            args[0] = args[0].clone()
            args[0][:, :last] = 0.0
        if _same(got, _alt(reference_op, case, first), mask):
            return (f"your result is what the first {kb} {what} give: the loop over K stops after one block of {kb} "
                    f"(or the block is fixed at {kb} with no loop)")
        if what.startswith("columns of x") and _same(got, _alt(reference_op, case, repeated), mask):
            return (f"your result is what x gives if every K step reads its first {kb} columns again: the x "
                    f"pointers (or offsets) do not move on by BLOCK_K at each step")
        if what.startswith("columns of x") and last > 0 and _same(got, _alt(reference_op, case, only_last), mask):
            return ("your result is what the last K step alone gives: each step must add its product into the "
                    "accumulator (acc += tl.dot(...)), not replace it")
    return None


def _row_stride_hint(case, expected, got, kind: str) -> Optional[str]:
    """A row stride taken as max_rank: out (shrink) or t (expand) is wider than max_rank here."""
    if kind == "shrink":
        x, A, info, out = case.args
        T, mr = out.shape[0], A.shape[1]
        if out.shape[1] == mr or T < 2:
            return None
        view = got.flatten()[: T * mr].view(T, mr)
        if _same(view, expected.cpu()[:, :mr], case.defined.cpu()[:, :mr]):
            return (f"your kernel wrote out as if its rows were max_rank = {mr} long; out has {out.shape[1]} columns "
                    f"here (the contract: at least max_rank): use out.stride(0)")
    return None


def _t_stride_hint(reference_op, case, expected, got) -> Optional[str]:
    t, B = case.args[0], case.args[1]
    T, mr = t.shape[0], B.shape[2]
    if t.shape[1] == mr or T < 2:
        return None

    def narrow(args):
        flat = args[0].contiguous().flatten()[: T * mr].view(T, mr)
        args[0] = torch.cat([flat, args[0][:, mr:]], dim=1)
    if _same(got, _alt(reference_op, case, narrow), None):
        return (f"your kernel read t as if its rows were max_rank = {mr} long; t has {t.shape[1]} columns here "
                f"(the contract: at least max_rank): use t.stride(0)")
    return None


def _rank_truncated_hint(reference_op, case, expected, got) -> Optional[str]:
    """fused_decode with the rank block fixed below the pool's max_rank."""
    max_rank = case.args[1].shape[1]
    for rb in (16, 32):
        if rb >= max_rank:
            break

        def cut(args, rb=rb):
            args[2] = args[2].clone()
            args[2][:, :, rb:] = 0.0
            i = next(k for k, a in enumerate(args) if isinstance(a, LoRABatchInfo))
            args[i].lora_ranks = args[i].lora_ranks.clamp(max=rb)
        if _same(got, _alt(reference_op, case, cut), None):
            return (f"your result uses only the first {rb} ranks of every slot: the rank block must cover "
                    f"max_rank (max(16, next_power_of_2(max_rank)))")
    return None


def _slot0_hint(case, expected, got) -> Optional[str]:
    """Rows of slot 0 differ (NaN included: a shrink that skipped them) while slot 0 holds an adapter."""
    info = _info(case)
    slots = info.token_slots.long().cpu()
    e, g = expected.cpu().double(), got.double()
    bad = ~(((g - e).abs() <= 0.05 + 0.05 * e.abs()) | (torch.isnan(g) & torch.isnan(e)))
    if case.defined is not None:
        bad &= case.defined.cpu()
    rows = bad.any(dim=1)
    region = case.defined.cpu() if case.defined is not None else torch.ones_like(bad)
    slot0 = (slots == 0)[:, None] & region
    whole = bool(slot0.any()) and float(bad[slot0].double().mean()) > 0.9  # nearly every element of slot 0
    if bool(rows.any()) and bool((slots[rows] == 0).all()) and int(info.lora_ranks[0]) > 0 and whole:
        return ("only rows of slot 0 differ, and slot 0 holds an adapter here: the base model is the slot of "
                "rank 0, wherever it is")
    return None


def _hint(reference_op, kind: str):
    sgmv_hint = batch_hint(reference_op)

    def hint(case: Case, expected, got) -> Optional[str]:
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape or got.dtype != expected.dtype:
            return None
        specific = []
        if kind in ("shrink", "expand"):
            specific += [lambda: _sorted_rows_hint(reference_op, case, expected, got)]
        if kind == "fused":
            specific += [lambda: _token_slots_from_segments_hint(reference_op, case, expected, got)]
        if kind in ("expand", "fused"):
            specific += [lambda: _delta_only_hint(reference_op, case, expected, got),
                         lambda: _scaling_hint(reference_op, case, expected, got)]
        if kind == "fused":
            specific += [lambda: _unrounded_hint(reference_op, case, expected, got),
                         lambda: _rank_truncated_hint(reference_op, case, expected, got)]
        if kind in ("shrink", "fused"):
            specific += [lambda: _k_truncated_hint(reference_op, case, expected, got, "columns of x")]
        if kind == "expand":
            specific += [lambda: _k_truncated_hint(reference_op, case, expected, got, "ranks (columns of t)"),
                         lambda: _t_stride_hint(reference_op, case, expected, got)]
        if kind == "shrink":
            specific += [lambda: _row_stride_hint(case, expected, got, kind)]
        specific += [lambda: _slot0_hint(case, expected, got)]
        for make in specific:
            try:
                found = make()
            except Exception:  # one courtesy failing must not hide the others
                found = None
            if found:
                return found
        general = sgmv_hint(case, expected, got) if kind != "fused" else batch_hint_common(case, expected, got)
        where = _where_hint(case, expected, got, sgmv=kind != "fused")
        return "; ".join(h for h in (general, where) if h) or None

    return hint


EXERCISES = [
    Exercise("ch03.1", "sgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.sgmv_shrink,
             _shrink_edge, _shrink_random, _hint(torch_ref.sgmv_shrink, "shrink"), requires=TRITON_REQUIRED),
    Exercise("ch03.2", "sgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.sgmv_expand,
             _expand_edge, _expand_random, _hint(torch_ref.sgmv_expand, "expand"), requires=TRITON_REQUIRED),
    Exercise("ch03.3", "fused_decode", ("x", "A_stack", "B_stack", "batch_info", "out"), torch_ref.fused_decode,
             _decode_edge, _decode_random, _hint(torch_ref.fused_decode, "fused"), requires=TRITON_REQUIRED),
]
