"""Cases for chapter 10 (tensor-parallel LoRA: which rows a rank owns, the fully sharded A, and the
per-rank forwards with their collectives).

ch10.1 and ch10.2 are plain functions. ch10.3 and ch10.4 are functions one rank runs: the driver
(``graders.chapters.tp_ranks.run_ranks``) forks ``tp`` gloo ranks in the grader's child, gives rank j its
shard (the j-th entry of every ``*_locals`` argument) and ``group``, and stacks what the ranks
return ([tp, ...]); the expected stack is computed in one process from the same shards (the sum
over ranks of the partial products, the gathered shrink output), never by forking.

Case design (graders' rule): every clause of the exercise text and both sides of each stated error.
ch10.1: q and kv parts with more heads than ranks, exactly as many, and fewer (replication) at tp 2,
4 and 8 (so rank // (tp / heads) and rank % heads differ), every rank of a config, a plain layer,
gate_up (two parts, offsets past the first), tp 1, parts of different head widths, and each error.
ch10.2: stack 1, 2 and 3, adapters of rank 0, below R/tp, exactly R/tp, between, odd, and R, at tp
2 and 4, every rank, the rows past each slot's parts filled with NaN (they must not be copied: zeros
there), bf16, and each error. ch10.3 and ch10.4: both row variants, tp 2 and 4, stack 1, 2 and 3
(ch10.4), slots out of order and repeated, a slot at the full max rank, scalings other than 1, a
batch of base tokens only, one token, int32 and int64 token slots, bf16 (edge cases and a draw in
every random and hidden group: y follows x's dtype), A rows and B columns past each slot's rank and
the whole base slot set to NaN; inputs x and W of small integers so the base output
is exact whatever the order of the sums, and tokens of rank-0 slots must match bit for bit (ch10.3's
bf16 cases: non-negative ones, so the ranks' bf16 partials do not cancel and every precision the text
allows passes: see :func:`simulate_row`). Which collectives ch10.3 runs, and how many, is not graded
(the text says so): both variants are held to the one y of their shared formula.
"""
from __future__ import annotations

import random
from typing import Optional

import torch

from graders.chapters.hints import name_matches
from graders.chapters.tp_ranks import run_ranks
from graders.machine.exercise import Case, Exercise
from reference.packed import slice_offsets_for
from reference.tp.lora import VARIANTS, _expand_rows, _per_token, column_part_ranges, fully_sharded_A

__all__ = ["EXERCISES", "drive_row", "drive_column", "simulate_row", "simulate_column"]

NAN = float("nan")


# ---------------------------------------------------------------------------------------------
# ch10.1 column_part_ranges


def _ranges_case(name, out_features, units, tp_rank, tp_size) -> Case:
    return Case(name, [tuple(out_features), tuple(units), tp_rank, tp_size],
                f"out_features {tuple(out_features)}, units (heads) {tuple(units)}, tp_rank {tp_rank}, tp_size {tp_size}",
                op="exact")


def _ranges_edge() -> list[Case]:
    qkv, heads = (16, 8, 8), (4, 2, 2)
    return [
        _ranges_case("example_in_the_text_rank_1", qkv, heads, 1, 2),
        _ranges_case("example_in_the_text_rank_0", qkv, heads, 0, 2),
        _ranges_case("mqa_kv_head_replicated_rank_1", (16, 4, 4), (4, 1, 1), 1, 2),
        _ranges_case("gqa_2_kv_heads_tp4_rank_1", (32, 8, 8), (8, 2, 2), 1, 4),
        _ranges_case("gqa_2_kv_heads_tp4_rank_2", (32, 8, 8), (8, 2, 2), 2, 4),
        _ranges_case("gqa_2_kv_heads_tp8_rank_5", (64, 16, 16), (8, 2, 2), 5, 8),
        _ranges_case("kv_heads_equal_tp", (32, 16, 16), (8, 4, 4), 3, 4),
        _ranges_case("plain_layer_columns", (24,), (24,), 1, 2),
        _ranges_case("gate_up_second_part_offset", (20, 20), (20, 20), 1, 2),
        _ranges_case("tp_1_owns_everything", qkv, heads, 0, 1),
        _ranges_case("different_head_widths", (12, 16), (6, 2), 1, 2),
        _ranges_case("heads_not_divisible_by_tp_raises_value_error", (12, 8, 8), (3, 2, 2), 0, 2),
        _ranges_case("tp_not_divisible_by_heads_raises_value_error", (24, 12, 12), (6, 3, 3), 0, 4),
        _ranges_case("rows_not_a_multiple_of_heads_raises_value_error", (16, 6, 6), (4, 4, 4), 0, 2),
        _ranges_case("tp_rank_past_tp_size_raises_value_error", qkv, heads, 2, 2),
        _ranges_case("tp_rank_far_past_tp_size_raises_value_error", qkv, heads, 5, 2),
        _ranges_case("negative_tp_rank_raises_value_error", qkv, heads, -1, 2),
        _ranges_case("lengths_differ_raises_value_error", qkv, (4, 2), 0, 2),
    ]


def _ranges_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(5):
        tp = rng.choice([4, 8]) if i == 0 else rng.choice([2, 4, 8])
        head_dim = rng.choice([2, 4, 8])
        q_heads = tp * rng.choice([1, 2])
        kv_heads = rng.choice([d for d in (1, 2, 4, 8, 16) if d <= 2 * tp and (tp % d == 0 or d % tp == 0)])
        tp_rank = rng.randrange(tp)
        if i == 0:  # every draw replicates kv heads on a rank where rank // (tp / heads) != rank % heads
            kv_heads = rng.choice([d for d in (2, 4) if d < tp])
            tp_rank = rng.choice([j for j in range(tp) if j % kv_heads != j // (tp // kv_heads)])
        units = (q_heads, kv_heads, kv_heads)
        out = tuple(u * head_dim for u in units)
        cases.append(_ranges_case(f"random_{i}", out, units, tp_rank, tp))
    return cases


def _ranges_hint(case: Case, expected, got) -> Optional[str]:
    out_features, units, j, tp = case.args
    if not isinstance(expected, tuple) or not isinstance(got, (tuple, list)) or len(got) != len(expected):
        return None
    try:
        got = [tuple(int(v) for v in pair) for pair in got]
    except (TypeError, ValueError):
        got = []
    if len(got) != len(expected) or any(len(pair) != 2 for pair in got):
        return "one (lo, hi) pair of ints per part: rows [lo, hi) of the packed output, not a start and a count"
    offsets = slice_offsets_for(out_features)
    local = slice_offsets_for([hi - lo for lo, hi in expected])
    if all(g == (lo - offsets[i] + local[i], hi - offsets[i] + local[i]) for i, (g, (lo, hi)) in
           enumerate(zip(got, expected))) and got != list(expected):
        return ("part i starts at sum(out_features[:i]) of the packed (global) output: advance by each part's FULL "
                "out_features[i] rows, not by the rows this rank owns of it")
    if all(g == (lo - offsets[i], hi - offsets[i]) for i, (g, (lo, hi)) in enumerate(zip(got, expected))) and any(offsets[:-1][1:]):
        return ("the ranges are rows of the PACKED output: part i starts at sum(out_features[:i]) "
                "(k's rows come after all of q's)")
    for i, (n, rows) in enumerate(zip(units, out_features)):
        if n < tp and got[i] != expected[i]:
            head_width = rows // n
            lo = offsets[i] + (j % n) * head_width
            if got[i] == (lo, lo + head_width):
                return (f"part {i} has {n} heads for {tp} ranks: each head is replicated on tp / heads = {tp // n} "
                        f"CONSECUTIVE ranks, so rank {j} takes head {j} // {tp // n} = {j // (tp // n)}, not {j} % {n}")
            if got[i][1] - got[i][0] < head_width:  # the answer's range is narrower than one head
                return (f"part {i} has fewer heads ({n}) than ranks ({tp}): heads are not split further (a head is "
                        f"the attention's unit, {head_width} rows here), each is replicated: rank j takes the whole "
                        "head j // (tp / heads)")
            if got[i][1] - got[i][0] == head_width:
                return (f"part {i} has fewer heads ({n}) than ranks ({tp}): each head is replicated on tp / heads = "
                        f"{tp // n} consecutive ranks, so rank {j} takes the whole head {j // (tp // n)}")
            return None
    return None


# ---------------------------------------------------------------------------------------------
# ch10.2 fully_sharded_A


def _fs_case(name, ranks, stack, R, d_in, tp_rank, tp_size, gen, dtype=torch.float32, rows=None,
             given_ranks=None) -> Case:
    rows = stack * R if rows is None else rows
    given = list(ranks) if given_ranks is None else list(given_ranks)
    A = torch.full((len(ranks), rows, d_in), NAN)
    for s, r in enumerate(ranks):  # the pool packs parts at each slot's own rank; rows past stack*r: junk
        A[s, :min(stack * r, rows)] = torch.randn(min(stack * r, rows), d_in, generator=gen)
    return Case(name, [A.to(dtype), given, stack, tp_rank, tp_size],
                f"A_buffer {list(A.shape)} ({str(dtype)[6:]}; slot s packs its {stack} parts at its rank r, rows past "
                f"stack*r are NaN), lora_ranks {given}, stack_num {stack}, tp_rank {tp_rank}, tp_size {tp_size}",
                op="exact")


def _fs_edge() -> list[Case]:
    g = torch.Generator().manual_seed(21)
    ranks = [0, 4, 16, 8, 5]
    return [
        _fs_case("example_in_the_text_R16_tp2_rank_0", ranks, 3, 16, 5, 0, 2, g),
        _fs_case("example_in_the_text_R16_tp2_rank_1", ranks, 3, 16, 5, 1, 2, g),
        _fs_case("stack_1", [4, 8, 3], 1, 8, 4, 1, 2, g),
        _fs_case("stack_2_gate_up", [2, 6, 8, 0], 2, 8, 4, 0, 2, g),
        _fs_case("tp4_rank_2", [16, 5, 9, 12, 4], 3, 16, 3, 2, 4, g),
        _fs_case("tp4_rank_3", [16, 5, 9, 13], 2, 16, 3, 3, 4, g),
        _fs_case("rank_exactly_R_over_tp_leaves_rank_1_zeros", [8, 8], 3, 16, 4, 1, 2, g),
        _fs_case("odd_rank", [7, 3, 1], 2, 8, 3, 1, 2, g),
        _fs_case("base_slot_only", [0, 0], 3, 8, 3, 0, 2, g),
        _fs_case("tp_1_relays_at_R", [3, 8], 2, 8, 4, 0, 1, g),
        _fs_case("bf16", [4, 8, 2], 3, 8, 6, 1, 2, g, torch.bfloat16),
        _fs_case("R_not_divisible_by_tp_raises_value_error", [2, 4], 1, 6, 3, 0, 4, g),
        _fs_case("rows_not_a_multiple_of_stack_raises_value_error", [2, 4], 3, 8, 3, 0, 2, g, rows=23),
        _fs_case("rank_above_R_raises_value_error", [2, 9], 2, 8, 3, 0, 2, g),
        _fs_case("tp_rank_past_tp_size_raises_value_error", [2, 4], 2, 8, 3, 2, 2, g),
        _fs_case("one_rank_per_slot_missing_raises_value_error", [2, 4], 2, 8, 3, 0, 2, g, given_ranks=[2]),
        _fs_case("a_rank_too_many_raises_value_error", [2, 4], 2, 8, 3, 0, 2, g, given_ranks=[2, 4, 4]),
        _fs_case("negative_rank_raises_value_error", [2, 4], 2, 8, 3, 0, 2, g, given_ranks=[2, -1]),
        _fs_case("negative_tp_rank_raises_value_error", [2, 4], 2, 8, 3, -1, 2, g),
        _fs_2d_case(g),
    ]


def _fs_2d_case(gen) -> Case:
    A = torch.randn(16, 5, generator=gen)
    return Case("two_d_A_buffer_raises_value_error", [A, [4], 2, 0, 2],
                "A_buffer [16, 5] (2-D: one layer of one slot without the slot axis), lora_ranks [4], stack_num 2, "
                "tp_rank 0, tp_size 2", op="exact")


def _fs_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        tp, R = rng.choice([(2, 8), (2, 16), (4, 16), (4, 8)])
        stack = rng.choice([1, 2, 3])
        ranks = [0] + [rng.randint(1, R) for _ in range(rng.randint(2, 5))]
        ranks[1] = rng.choice([R // tp + 1, R - 1, R])  # every draw has a rank that crosses into rank 1's rows
        cases.append(_fs_case(f"random_{i}", ranks, stack, R, rng.choice([3, 5]), rng.randrange(tp), tp, gen,
                              torch.bfloat16 if i == 3 else torch.float32))
    return cases


def _fs_hint(case: Case, expected, got) -> Optional[str]:
    A, ranks, stack, j, tp = case.args
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor) or got.dtype != expected.dtype:
        return None
    R = A.shape[1] // stack
    if got.shape != expected.shape:
        return (f"every rank holds R/tp = {R}/{tp} rows of every part of every slot: [num_slots, stack_num * R/tp, in] "
                f"= {list(expected.shape)}, whatever each slot's own rank (R = A_buffer.shape[1] // stack_num)")
    g, w = got.detach().cpu(), R // tp
    strided = torch.zeros_like(expected).cpu()
    lo = j * w
    for s, r in enumerate(ranks):
        hi = min(lo + w, r)
        for i in range(stack if hi > lo else 0):
            strided[s, i * w:i * w + hi - lo] = A[s, i * R + lo:i * R + hi].cpu()
    same = (g == strided) | (torch.isnan(g) & torch.isnan(strided))
    if bool(same.all()) and not torch.equal(g, expected.cpu()):
        return ("the pool packs slot s's parts at ITS rank r (part i in rows [i*r, (i+1)*r)), not at the max rank R: "
                "read part i's rank-rows from A_buffer[s, i*r + ...]")
    own = torch.zeros_like(expected).cpu()  # each adapter split over the ranks at its own r
    for s, r in enumerate(ranks):
        lo, hi = j * (r // tp), (j + 1) * (r // tp)
        for i in range(stack if hi > lo else 0):
            own[s, i * w:i * w + hi - lo] = A[s, i * r + lo:i * r + hi].cpu()
    if torch.equal(g.nan_to_num(1e30), own.nan_to_num(1e30)) and not torch.equal(own, expected.cpu()):
        return ("the layout asked for: rank j holds rank-rows [j*R/tp, (j+1)*R/tp) of the PADDED max rank R of every "
                "part, the same rows for every slot (not 1/tp of each adapter's own r), and zeros where a slot's rank "
                "ends")
    if torch.isnan(g).any():
        return ("rows past a slot's rank must be zeros: the pool leaves junk past stack_num * r (NaN here), "
                "and a slice A_buffer[s, i*r + lo : i*r + hi] with hi past r reads the NEXT part's rows or that junk")
    e = expected.cpu()
    if bool(((e == 0) & (g != 0)).any()) and torch.equal(g[e != 0], e[e != 0]):
        return "rows past a slot's rank must be zeros (a new tensor: zeros, not torch.empty)"
    return None


# ---------------------------------------------------------------------------------------------
# ch10.3 row_parallel_lora and ch10.4 fully_sharded_column_lora: shared case data


def _ints(shape, gen, low: int = -2) -> torch.Tensor:
    """Small integers as floats, in low..2: sums of their products are exact in any order (the base output)."""
    return torch.randint(low, 3, shape, generator=gen).float()


def _slot_tensors(ranks, scalings) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(ranks, dtype=torch.int32), torch.tensor(scalings, dtype=torch.float32)


def _poison_rank(t: torch.Tensor, ranks, dim: int) -> torch.Tensor:
    """Entries of each slot s past its rank along ``dim`` (and the whole of rank-0 slots) -> NaN."""
    for s, r in enumerate(ranks):
        idx = [s] + [slice(None)] * (t.dim() - 1)
        idx[dim] = slice(r, None)
        t[tuple(idx)] = NAN
        if r == 0:
            t[s] = NAN
    return t


def _exact_rows(token_slots: torch.Tensor, ranks, tp: int, width: int) -> torch.Tensor:
    base = torch.tensor([ranks[int(s)] == 0 for s in token_slots], dtype=torch.bool)
    return base.view(1, -1, 1).expand(tp, -1, width).clone()


def _random_batch(rng: random.Random, crossing, tp=None) -> tuple:
    """(tp, R, lora_ranks, scalings, token slots) of a random mixed batch (tp drawn from 2 and 4
    unless given): slot 0 the base (rank 0, scaling 0), one slot at a rank from ``crossing(tp, R)``,
    the first token on an adapter, the last on the base."""
    tp, R = tp or rng.choice([2, 4]), rng.choice([8, 16])
    S = rng.randint(3, 5)
    ranks = [0] + [rng.randint(1, R) for _ in range(S - 1)]
    ranks[rng.randrange(1, S)] = rng.choice(crossing(tp, R))
    sc = [0.0] + [rng.choice([0.25, 0.5, 1.0, 2.0]) for _ in range(S - 1)]
    tokens = [rng.randrange(S) for _ in range(rng.randint(3, 9))]
    tokens[0], tokens[-1] = rng.randrange(1, S), 0
    return tp, R, ranks, sc, tokens


def _describe_batch(token_slots, ranks, scalings, R) -> str:
    return (f"token_slots {token_slots.tolist()} ({str(token_slots.dtype)[6:]}), lora_ranks {list(ranks)} "
            f"(max rank R {R}), scalings {list(scalings)}")


# ---- ch10.3 -----------------------------------------------------------------------------------

def simulate_row(x_locals, W_locals, A_locals, B, token_slots, lora_ranks, scalings, variant) -> torch.Tensor:
    """Every rank's y of :func:`reference.tp.lora.row_parallel_lora`, [tp, T, out], in one process:
    the formula in float32 (the all-reduces are sums over the ranks' partial products in rank order),
    then rounded once to x's dtype. Both variants get this one y: they are the same formula, summed at
    another place. In bf16 the reference rounds each rank's partials to bf16 before the sum, and
    reduce_with_base rounds its delta at the size of the rank's base partial; the bf16 cases keep
    those partials from cancelling (:func:`_row_case`), so the reference's bf16 sums, either
    variant's order and float32 sums all land within bf16's tolerance of this y (measured over 800
    draws of the random group: at most 0.58 of it), as the exercise text says."""
    if variant not in VARIANTS["row"]:
        raise ValueError(f"variant must be one of {VARIANTS['row']}, got {variant!r}")
    tp, dtype = x_locals.shape[0], x_locals.dtype
    x_locals, W_locals, A_locals, B = (a.float() for a in (x_locals, W_locals, A_locals, B))
    slots, keep, scale = _per_token(token_slots, lora_ranks, scalings, B.shape[2])
    base = sum(x_locals[j] @ W_locals[j].T for j in range(tp))
    t = sum(torch.einsum("ti,tri->tr", x_locals[j], A_locals[j][slots]) for j in range(tp))
    y = torch.where(keep[:, :1], base + _expand_rows(t, B[slots], keep, scale), base).to(dtype)
    return y.unsqueeze(0).expand(tp, -1, -1).clone()


_ROW_NAMES = ("x_local", "W_local", "A_local", "B", "token_slots", "lora_ranks", "scalings", "variant")
_COLUMN_NAMES = ("x", "W_local", "A_local", "B_local", "token_slots", "lora_ranks", "scalings", "slice_offsets")


def drive_row(fn, x_locals, W_locals, A_locals, B, token_slots, lora_ranks, scalings, variant) -> torch.Tensor:
    """The learner's ``row_parallel_lora`` in ``tp`` gloo ranks, rank j given shard j; [tp, T, out].

    Graded on what the ranks return. What the collectives carry, which ones run and how many, is not
    graded (issue #31: it could only be recorded in the rank processes, next to learner code, which
    can forge the record; the exercise text says so), so the two variants are held to their outputs:
    by linearity they give the same numbers up to rounding, and a missing or doubled all-reduce gives
    other ones. Raising before any collective is graded from here (``before_any_collective``)."""
    return run_ranks(x_locals.shape[0], fn, lambda j: (x_locals[j], W_locals[j], A_locals[j], B, token_slots,
                                                        lora_ranks, scalings, variant), _ROW_NAMES,
                     before_any_collective=variant not in VARIANTS["row"])


def _row_case(name, gen, tp, tokens, ranks, scalings, variant, d_in=8, d_out=6, R=16,
              slot_dtype=torch.int32, dtype=torch.float32) -> Case:
    S = len(ranks)
    token_slots = torch.tensor(tokens, dtype=slot_dtype)
    T, in_l = len(tokens), d_in // tp
    # bf16: x and W of non-negative integers, so the ranks' base partials never cancel (the base output
    # is at least each rank's): rounding a partial in bf16 stays within y's tolerance, and y summed in
    # bf16 (the reference), in either variant's order or in float32 all pass, as the exercise text says
    low = 0 if dtype == torch.bfloat16 else -2
    x, W = _ints((T, d_in), gen, low).to(dtype), _ints((d_out, d_in), gen, low).to(dtype)
    A = _poison_rank(torch.randn(S, R, d_in, generator=gen) / d_in ** 0.5, ranks, 1).to(dtype)
    B = _poison_rank(torch.randn(S, d_out, R, generator=gen) / R ** 0.5, ranks, 2).to(dtype)
    x_locals = torch.stack([x[:, j * in_l:(j + 1) * in_l] for j in range(tp)])
    W_locals = torch.stack([W[:, j * in_l:(j + 1) * in_l] for j in range(tp)])
    A_locals = torch.stack([A[:, :, j * in_l:(j + 1) * in_l] for j in range(tp)])
    lora_ranks, sc = _slot_tensors(ranks, scalings)
    return Case(name, [x_locals, W_locals, A_locals, B, token_slots, lora_ranks, sc, variant],
                f"tp {tp}, variant {variant!r}, {str(dtype)[6:]}: rank j gets x_local = x[:, j*{in_l}:(j+1)*{in_l}] of x {[T, d_in]}"
                f"{' (x and W of small non-negative integers)' if low == 0 else ''}, "
                f"W_local [{d_out}, {in_l}], A_local [{S}, {R}, {in_l}], B {list(B.shape)} (whole); "
                + _describe_batch(token_slots, ranks, scalings, R)
                + "; A rows and B columns past each slot's rank are NaN; the result is every rank's y, stacked",
                exact=_exact_rows(token_slots, ranks, tp, d_out))


def _row_edge() -> list[Case]:
    g = torch.Generator().manual_seed(31)
    ranks, sc = [0, 4, 16, 8], [0.0, 0.5, 2.0, 1.25]
    mixed = [1, 0, 2, 3, 3, 0, 1, 2]
    cases = []
    for v in VARIANTS["row"]:
        cases += [
            _row_case(f"{v}_tp2_mixed_batch", g, 2, mixed, ranks, sc, v),
            _row_case(f"{v}_tp4", g, 4, [3, 1, 0, 2, 1], ranks, sc, v),
            _row_case(f"{v}_base_tokens_only", g, 2, [0, 0, 0], ranks, sc, v),
            _row_case(f"{v}_one_token_full_rank", g, 2, [2], ranks, sc, v),
        ]
    cases += [
        _row_case("reduce_shrink_int64_slots_out_of_order", g, 2, [3, 2, 1, 3, 0], ranks, sc, "reduce_shrink",
                  slot_dtype=torch.int64),
        _row_case("reduce_with_base_in_12_out_10", g, 2, [2, 1, 0, 2], ranks, sc, "reduce_with_base", d_in=12, d_out=10),
        _row_case("reduce_shrink_bf16", g, 2, [1, 0, 3, 2], ranks, sc, "reduce_shrink", dtype=torch.bfloat16),
        _row_case("reduce_with_base_bf16_tp4", g, 4, [2, 3, 0, 1], ranks, sc, "reduce_with_base", dtype=torch.bfloat16),
        _row_case("unknown_variant_raises_value_error", g, 2, [1, 0], ranks, sc, "reduce_twice"),
    ]
    return cases


def _row_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: both variants twice in fp32, then both in bf16 (y in x_local's dtype: a float32 y is
    named in the random and hidden groups too, not only by the edge cases)."""
    cases = []
    for i, (v, dtype) in enumerate([(v, torch.float32) for v in VARIANTS["row"] * 2]
                                   + [(v, torch.bfloat16) for v in VARIANTS["row"]]):
        tp, R, ranks, sc, tokens = _random_batch(rng, lambda tp, R: [R], tp=4 if i == 0 else None)
        name = f"random_{i}_{v}" + ("_bf16" if dtype == torch.bfloat16 else "")
        cases.append(_row_case(name, gen, tp, tokens, ranks, sc, v, d_in=4 * tp, d_out=rng.choice([4, 6]), dtype=dtype))
    return cases


def _dtype_hint(name: str, got: torch.dtype, want: torch.dtype, promoted_only: Optional[bool] = None) -> str:
    """The dtype symptom, and its cause where the values tell it (``promoted_only``: True when the values
    are the low-precision layer's, as when only a float32 scaling promoted the sum; False when they are
    the float32 computation's to float32 rounding, as when the whole layer ran in float32; None: unknown)."""
    said = f"{name} is {str(got)[6:]} but the inputs are {str(want)[6:]}: return the inputs' dtype"
    scaling = ("scalings is float32, so scalings[slot] * (...) promotes a {0} delta to float32: cast the scaling "
               "to the output's dtype (.to(y.dtype)) before multiplying").format(str(want)[6:])
    computed = ("y is the float32 computation's, to float32 rounding: the layer was computed in float32 (a "
                ".float() on the inputs?); compute in the inputs' dtype, or cast y back with .to(x_local.dtype)")
    if promoted_only is None:
        return f"{said}. Either {scaling}; or {computed}"
    return f"{said}. {scaling if promoted_only else computed}"


def _row_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor) or got.shape != expected.shape:
        if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor):
            return (f"y is the FULL output [T, out] on every rank (stacked over ranks: {list(expected.shape)}): "
                    "a row-parallel layer ends with the all-reduce")
        return None
    x_locals, W_locals, A_locals, B, token_slots, lora_ranks, scalings, variant = case.args
    if got.dtype != expected.dtype:  # the symptom is the dtype: say that, whatever the values
        promoted_only = None
        if got.dtype == torch.float32 and got.shape == expected.shape:
            g = got.detach().cpu()
            if torch.allclose(g, _row_variant(*case.args), rtol=1e-5, atol=1e-5):
                promoted_only = False  # float32 all the way: no bf16 rounding anywhere
            elif _close(g, expected.cpu().float()):
                promoted_only = True  # the bf16 layer's values, the sum promoted at the end
        return _dtype_hint("y", got.dtype, expected.dtype, promoted_only)
    tp = x_locals.shape[0]
    g, e = got.detach().cpu(), expected.cpu()
    if torch.isnan(g).any():
        return ("NaN in y: columns of t (and B) past a slot's rank are junk here (NaN), and so is the whole base slot; "
                "leave them out with torch.where / slicing (a 0/1 mask multiplies them: NaN * 0 = NaN)")
    if _close(g, tp * e.float()):
        return (f"y is {tp} (tp) times the expected output: the sum over ranks was all-reduced twice (each "
                "variant all-reduces [T, out] once; reduce_shrink also all-reduces t, before the expand)")
    matches = [msg for flags, msg in _ROW_MISTAKES if _close(g, _row_variant(*case.args, **flags))
               and not _close(e, _row_variant(*case.args, **flags))]
    if not torch.equal(g[0], g[-1]):  # the symptom first, then what gives exactly it
        return "the ranks ended with different y: every rank must return the same, fully reduced output" + (
            "; " + name_matches(matches) if matches else "")
    if matches:
        return name_matches(matches)
    base_rows = case.exact[0, :, 0]
    if not torch.equal(g[:, base_rows], e[:, base_rows]):
        return ("the rows of base-model tokens (rank-0 slots) differ too: they are the all-reduced x_local @ "
                "W_local.T alone, bit for bit")
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to the rounding of the inputs' dtype (bf16 cases: a few ulps of the sums)."""
    tol = 2e-2 if a.dtype == torch.bfloat16 or b.dtype == torch.bfloat16 else 1e-4
    return a.shape == b.shape and bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol))


def _row_variant(x_locals, W_locals, A_locals, B, token_slots, lora_ranks, scalings, variant, *, scale_power=1,
                 partial_delta=False, nothing_reduced=False) -> torch.Tensor:
    """Every rank's y with one named mistake (for hints; float32): ``partial_delta``: the delta from
    the rank's own t_j, added to the all-reduced base; ``nothing_reduced``: no collective at all."""
    tp = x_locals.shape[0]
    slots, keep, scale = _per_token(token_slots, lora_ranks, scalings, B.shape[2])
    parts = [x_locals[j].float() @ W_locals[j].float().T for j in range(tp)]
    ts = [torch.einsum("ti,tri->tr", x_locals[j].float(), A_locals[j][slots].float()) for j in range(tp)]
    ys = []
    for j in range(tp):
        base = parts[j] if nothing_reduced else sum(parts)
        t = ts[j] if partial_delta or nothing_reduced else sum(ts)
        delta = _expand_rows(t, B[slots].float(), keep, scale.float() ** scale_power)
        ys.append(torch.where(keep[:, :1], base + delta, base))
    return torch.stack(ys)


_PARTIAL = ("a delta computed from this rank's t_j alone is only its partial delta (reduce_shrink: all-reduce t "
            "first; reduce_with_base: add the delta before the one all-reduce)")
_ROW_MISTAKES = [
    (dict(partial_delta=True), _PARTIAL),
    (dict(nothing_reduced=True), "y was never all-reduced: each rank returned only its own partial x_local @ "
                                 "W_local.T plus its partial delta (a row-parallel layer ends with the all-reduce)"),
    (dict(scale_power=2), "the delta is off by a factor of scalings[slot]: the scaling is applied twice"),
    (dict(scale_power=0), "the delta is off by a factor of scalings[slot]: the scaling is not applied"),
]


# ---- ch10.4 -----------------------------------------------------------------------------------

def simulate_column(x, W_locals, A_locals, B_locals, token_slots, lora_ranks, scalings, slice_offsets) -> torch.Tensor:
    """Every rank's y_local of :func:`reference.tp.lora.fully_sharded_column_lora`, [tp, T, out_local],
    in one process: the all-gather is the list of the ranks' shrink outputs."""
    tp, stack, R = W_locals.shape[0], len(slice_offsets) - 1, B_locals.shape[3]
    if R % tp or A_locals.shape[2] != stack * (R // tp):
        raise ValueError(f"A_local has {A_locals.shape[2]} rows; expected stack_num * R / tp = {stack} * {R} / {tp}")
    slots, keep, scale = _per_token(token_slots, lora_ranks, scalings, R)
    pieces = torch.stack([torch.einsum("ti,tki->tk", x, A_locals[j][slots]) for j in range(tp)])
    t = pieces.view(tp, x.shape[0], stack, R // tp).permute(1, 2, 0, 3).reshape(x.shape[0], stack, R)
    return _column_outputs(x, W_locals, B_locals, t, slots, keep, scale, slice_offsets)


def _column_outputs(x, W_locals, B_locals, t, slots, keep, scale, offsets) -> torch.Tensor:
    """Every rank's x W_j^T plus, per part i, the expand of the gathered t[:, i] with B_j's part rows."""
    ys = []
    for j in range(W_locals.shape[0]):
        y = x @ W_locals[j].T
        for i in range(len(offsets) - 1):
            lo, hi = offsets[i], offsets[i + 1]
            part = y[:, lo:hi]
            y[:, lo:hi] = torch.where(keep[:, :1], part + _expand_rows(t[:, i], B_locals[j][slots, lo:hi], keep, scale), part)
        ys.append(y)
    return torch.stack(ys)


def drive_column(fn, x, W_locals, A_locals, B_locals, token_slots, lora_ranks, scalings, slice_offsets) -> torch.Tensor:
    """The learner's ``fully_sharded_column_lora`` in ``tp`` gloo ranks; [tp, T, out_local].

    Graded on what the ranks return (see :func:`drive_row`: what the collectives carry is not)."""
    tp, stack, R = W_locals.shape[0], len(slice_offsets) - 1, B_locals.shape[3]
    refused = bool(R % tp) or A_locals.shape[2] != stack * (R // tp)  # the contract's ValueError
    return run_ranks(tp, fn, lambda j: (x, W_locals[j], A_locals[j], B_locals[j], token_slots,
                                        lora_ranks, scalings, list(slice_offsets)), _COLUMN_NAMES,
                     before_any_collective=refused)


def _column_case(name, gen, tp, tokens, ranks, scalings, part_widths, d_in=8, R=16, slot_dtype=torch.int32,
                 a_rows=None, dtype=torch.float32) -> Case:
    S, stack, w = len(ranks), len(part_widths), R // tp
    token_slots = torch.tensor(tokens, dtype=slot_dtype)
    T = len(tokens)
    x = _ints((T, d_in), gen).to(dtype)
    W = _ints((sum(part_widths), d_in), gen).to(dtype)
    A = _poison_rank(torch.randn(S, stack, R, d_in, generator=gen) / d_in ** 0.5, ranks, 2).to(dtype)  # rank-rows per part
    B = _poison_rank(torch.randn(S, sum(part_widths), R, generator=gen) / R ** 0.5, ranks, 2).to(dtype)
    offsets = slice_offsets_for(part_widths)
    rows = [torch.cat([torch.arange(offsets[i] + j * (n // tp), offsets[i] + (j + 1) * (n // tp))
                       for i, n in enumerate(part_widths)]) for j in range(tp)]
    A_locals = torch.stack([A[:, :, j * w:(j + 1) * w].reshape(S, stack * w, d_in) for j in range(tp)])
    if a_rows is not None:
        A_locals = A_locals[:, :, :a_rows]
    W_locals = torch.stack([W[r] for r in rows])
    B_locals = torch.stack([B[:, r] for r in rows])
    local = slice_offsets_for([n // tp for n in part_widths])
    lora_ranks, sc = _slot_tensors(ranks, scalings)
    return Case(name, [x, W_locals, A_locals, B_locals, token_slots, lora_ranks, sc, list(local)],
                f"tp {tp}, {str(dtype)[6:]}, {stack} part(s) of widths {list(part_widths)} (local slice_offsets "
                f"{list(local)}): rank j gets "
                f"x {[T, d_in]} (whole), W_local [{W_locals.shape[1]}, {d_in}], A_local {list(A_locals.shape[1:])} "
                f"(its R/tp = {w} rank-rows of each part), B_local {list(B_locals.shape[1:])}; "
                + _describe_batch(token_slots, ranks, scalings, R)
                + "; A rows and B columns past each slot's rank are NaN; the result is every rank's y_local, stacked",
                exact=_exact_rows(token_slots, ranks, tp, W_locals.shape[1]))


def _column_edge() -> list[Case]:
    g = torch.Generator().manual_seed(41)
    ranks, sc = [0, 4, 16, 8, 11], [0.0, 0.5, 2.0, 1.25, 1.0]
    return [
        _column_case("qkv_3_parts_tp2", g, 2, [1, 0, 2, 3, 4, 0, 1], ranks, sc, [8, 4, 4]),
        _column_case("gate_up_2_parts_tp2", g, 2, [2, 4, 1, 0], ranks, sc, [6, 6]),
        _column_case("one_part_tp2", g, 2, [3, 1, 0, 2], ranks, sc, [8]),
        _column_case("qkv_tp4", g, 4, [4, 2, 0, 1, 3], ranks, sc, [8, 4, 4]),
        _column_case("gate_up_tp4_one_token", g, 4, [2], ranks, sc, [8, 8]),
        _column_case("base_tokens_only", g, 2, [0, 0], ranks, sc, [4, 4]),
        _column_case("int64_slots_repeated", g, 2, [4, 4, 1, 1, 2], ranks, sc, [6, 2, 2], slot_dtype=torch.int64),
        _column_case("qkv_bf16", g, 2, [1, 0, 2, 3, 4], ranks, sc, [8, 4, 4], dtype=torch.bfloat16),
        _column_case("A_local_rows_not_stack_R_over_tp_raises_value_error", g, 2, [1, 0], ranks, sc, [4, 4], a_rows=12),
    ]


def _column_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        # every draw has tp 4 with packed parts: rank-major and part-major orders, and 2 and 4 pieces, differ
        tp, R, ranks, sc, tokens = _random_batch(rng, lambda tp, R: [R, R // tp + 1], tp=4 if i == 0 else None)
        parts = rng.choice([[2 * tp, tp, tp], [2 * tp, 2 * tp], [3 * tp, tp, tp], [4 * tp]])
        if i == 0:
            parts = [2 * tp, tp, tp]
        cases.append(_column_case(f"random_{i}", gen, tp, tokens, ranks, sc, parts, d_in=rng.choice([4, 8])))
    # and one in bf16 (y_local in x's dtype: a float32 y_local is named in the random and hidden groups too)
    tp, R, ranks, sc, tokens = _random_batch(rng, lambda tp, R: [R, R // tp + 1])
    cases.append(_column_case("random_4_bf16", gen, tp, tokens, ranks, sc, rng.choice([[2 * tp, tp, tp], [2 * tp, 2 * tp]]),
                              d_in=rng.choice([4, 8]), dtype=torch.bfloat16))
    return cases


def _column_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor) or got.shape != expected.shape:
        if isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor):
            return (f"each rank returns its own output columns y_local [T, out_local] (stacked: {list(expected.shape)}); "
                    "a column-parallel layer does not gather its output")
        return None
    if got.dtype != expected.dtype:
        return _dtype_hint("y_local", got.dtype, expected.dtype)
    g = got.detach().cpu()
    offsets = case.args[7]
    if len(offsets) > 2 and torch.allclose(g, simulate_column_rank_major(*case.args), atol=1e-4, rtol=1e-4,
                                           equal_nan=True):
        return ("the gathered shrink output is in rank order [t_0 | t_1 | ...], but each t_j holds R/tp columns of "
                "EVERY part: part i of the full t is cat over ranks of t_j's columns [i*R/tp, (i+1)*R/tp) "
                "(view [tp, T, stack, R/tp], permute to [T, stack, tp, R/tp])")
    if torch.isnan(g).any():
        return ("NaN in y_local: the gathered t's columns past a slot's rank (and B's) are junk here (NaN), and so is "
                "the whole base slot; leave them out with torch.where / slicing (a 0/1 mask multiplies them: "
                "NaN * 0 = NaN)")
    e = expected.cpu()
    matches = [msg for flags, msg in _COLUMN_MISTAKES if _close(g, _column_variant(*case.args, **flags))
               and not _close(e, _column_variant(*case.args, **flags))]
    if matches:
        return name_matches(matches)
    base_rows = case.exact[0, :, 0]
    if not torch.equal(g[:, base_rows], e[:, base_rows]):
        return ("the rows of base-model tokens (rank-0 slots) differ too: they are x @ W_local.T alone, bit for bit "
                "(the delta is added only where the slot's rank is > 0)")
    return None


def _column_variant(x, W_locals, A_locals, B_locals, token_slots, lora_ranks, scalings, offsets, *, scale_power=1,
                    own_piece_only=False, mask_at_local_width=False) -> torch.Tensor:
    """Every rank's y_local with one named mistake (for hints; float32): ``own_piece_only``: no
    all-gather, the rank's own shrink columns in place and zeros elsewhere; ``mask_at_local_width``:
    each slot's rank clipped to R/tp."""
    tp, stack, R = W_locals.shape[0], len(offsets) - 1, B_locals.shape[3]
    w = R // tp
    ranks = lora_ranks.clamp(max=w) if mask_at_local_width else lora_ranks
    slots, keep, scale = _per_token(token_slots, ranks, scalings, R)
    scale = scale.float() ** scale_power
    x, B_locals = x.float(), B_locals.float()
    pieces = [torch.einsum("ti,tki->tk", x, A_locals[j][slots].float()) for j in range(tp)]
    T = x.shape[0]
    if not own_piece_only:
        t = torch.stack(pieces).view(tp, T, stack, w).permute(1, 2, 0, 3).reshape(T, stack, R)
        return _column_outputs(x, W_locals.float(), B_locals, t, slots, keep, scale, offsets)
    ys = []
    for j in range(tp):
        t = torch.zeros(T, stack, R)
        t[:, :, j * w:(j + 1) * w] = pieces[j].view(T, stack, w)
        ys.append(_column_outputs(x, W_locals[j:j + 1].float(), B_locals[j:j + 1], t, slots, keep, scale, offsets)[0])
    return torch.stack(ys)


_COLUMN_MISTAKES = [
    (dict(own_piece_only=True), "all-gather every rank's shrink output t_j = x A_local[slot]^T: the expand needs "
                                "all R rank-columns of t, and this rank computed only R/tp of them"),
    (dict(mask_at_local_width=True), "after the all-gather t has the full max rank R: keep t's and B's columns "
                                     "below each slot's own rank r (up to R), not below min(r, R/tp)"),
    (dict(scale_power=2), "the delta is off by a factor of scalings[slot]: the scaling is applied twice"),
    (dict(scale_power=0), "the delta is off by a factor of scalings[slot]: the scaling is not applied"),
]


def simulate_column_rank_major(x, W_locals, A_locals, B_locals, token_slots, lora_ranks, scalings, offsets):
    """The mistake the hint names: the gathered pieces concatenated in rank order, then split by part."""
    tp, stack, R = W_locals.shape[0], len(offsets) - 1, B_locals.shape[3]
    slots, keep, scale = _per_token(token_slots, lora_ranks, scalings, R)
    t = torch.cat([torch.einsum("ti,tki->tk", x, A_locals[j][slots]) for j in range(tp)], dim=1).view(-1, stack, R)
    return _column_outputs(x, W_locals, B_locals, t, slots, keep, scale, offsets)


# ---------------------------------------------------------------------------------------------

EXERCISES = [
    Exercise("ch10.1", "column_part_ranges", ("out_features", "units", "tp_rank", "tp_size"), column_part_ranges,
             _ranges_edge, _ranges_random, _ranges_hint),
    Exercise("ch10.2", "fully_sharded_A", ("A_buffer", "lora_ranks", "stack_num", "tp_rank", "tp_size"),
             fully_sharded_A, _fs_edge, _fs_random, _fs_hint, default_device_probe=True),
    Exercise("ch10.3", "row_parallel_lora", ("x_local", "W_local", "A_local", "B", "token_slots", "lora_ranks",
                                             "scalings", "variant"),
             simulate_row, _row_edge, _row_random, _row_hint, driver=drive_row, fresh_result=False, grade_on="cpu"),
    Exercise("ch10.4", "fully_sharded_column_lora", ("x", "W_local", "A_local", "B_local", "token_slots", "lora_ranks",
                                                     "scalings", "slice_offsets"),
             simulate_column, _column_edge, _column_random, _column_hint, driver=drive_column, fresh_result=False,
             grade_on="cpu"),
]
