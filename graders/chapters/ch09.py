"""Cases for chapter 09 (MoE LoRA: virtual experts, the aligned block layout, the MoE LoRA op, EP ids).

Case design (graders' rule): every clause of the exercise text, both sides of each stated error,
every layout the contract allows.

ch09.1 ``virtual_expert_ids``: slot 0 and slots past 0, expert ids that are not in order, -1 ids
(kept -1, whatever the slot), int32 and int64 inputs (the result is int64), top_k 1 and 8, no
tokens, more slots than experts and more experts than slots (so slot * E + e and e * S + s differ),
and each error (an id past the experts, mismatched shapes).

ch09.2 ``moe_align_block_size``: groups that fill whole blocks, that need padding, of one pair,
ids with no pairs (no blocks), -1 ids (left out), repeated ids in one token's choices, the stable
order inside a group, block size 1 and larger than every group, the ``skip`` mask (a group of rank 0
gets no blocks, even when it has pairs), no pairs at all, ids given as [num_tokens, top_k] with
top_k > 1, and both errors. The result is compared field by field, exactly.

ch09.3 ``fused_moe_lora``: one and two output slices (gate|up), rows per token (gate_up) and per
pair (down), topk_weights given and None, per-expert ranks below max_rank with A rows and B columns
past each group's rank set to NaN, (slot, expert) groups of rank 0 and a whole base slot poisoned
with NaN (those pairs' rows must come back bit for bit), expert ids -1 (another EP rank's: also bit
for bit), fp32 and bf16, top_k 1, 2 and 4, scalings other than 1, an expert chosen by several tokens
of several slots, a token choosing one expert under two slots' adapters in one batch, slices of
unequal widths in the random cases too.

ch09.4 ``to_local_expert_ids``: every rank of ep_size 2 and 4, ids at the edges of a rank's block,
-1 ids, int32 ids, ep_size 1 (every id local), and each error.

ch09.5 ``split_expert_lora``: E = 1 (both orders agree), E = 2 and 4 at ranks 1, 2, 3 (so blocks and
strides differ, and r = 1 makes B's two orders coincide while A's still matter), in != out, bf16,
and each error (rows not a multiple of E, A and B of different E*r, no rows).
"""
from __future__ import annotations

import random
from typing import Optional, Sequence

import torch

from graders.machine.exercise import Case, Exercise
from reference.moe.adapters import split_expert_lora
from reference.moe.lora import fused_moe_lora_torch, moe_align_block_size, to_local_expert_ids, virtual_expert_ids

__all__ = ["EXERCISES"]

NAN = float("nan")


# ---------------------------------------------------------------------------------------------
# ch09.1 virtual_expert_ids


def _ids(rows, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(rows, dtype=dtype).reshape(len(rows), -1) if rows else torch.zeros(0, 2, dtype=dtype)


def _virtual_case(name, topk, slots, num_experts, dtype=torch.int64, slot_dtype=torch.int32, column=False) -> Case:
    ids = _ids(topk, dtype)
    ts = torch.tensor(slots, dtype=slot_dtype)
    ts = ts.view(-1, 1) if column else ts
    return Case(name, [ids, ts, num_experts],
                f"topk_ids {ids.tolist()} ({str(dtype)[6:]}), token_slots {slots}, num_experts {num_experts}",
                op="exact")


def _virtual_edge() -> list[Case]:
    return [
        _virtual_case("example_in_the_text_3_tokens_top2", [[1, 3], [0, 2], [3, 1]], [0, 2, 1], 4),
        _virtual_case("slot_0_is_just_the_expert", [[2, 0]], [0], 4),
        _virtual_case("more_slots_than_experts", [[1, 0], [0, 1]], [3, 5], 2),
        _virtual_case("more_experts_than_slots", [[7, 2], [5, 6]], [1, 0], 8),
        _virtual_case("minus_one_stays_minus_one", [[-1, 2], [3, -1]], [2, 1], 4),
        _virtual_case("minus_one_under_slot_0", [[-1, 1]], [0], 4),
        _virtual_case("int32_ids_give_int64", [[1, 2], [0, 3]], [1, 2], 4, torch.int32),
        _virtual_case("top_k_1", [[3], [0], [2]], [1, 1, 0], 4),
        _virtual_case("top_k_8_of_128_experts", [[127, 5, 64, 0, 1, 99, 32, 7]], [3], 128),
        _virtual_case("ids_past_2_31_int32_inputs", [[5, 2**30 - 1]], [3], 2**30, torch.int32),
        _virtual_case("no_tokens", [], [], 4),
        _virtual_case("expert_id_past_the_experts_raises_value_error", [[1, 4]], [0], 4),
        _virtual_case("token_slots_of_another_length_raises_value_error", [[1, 2], [0, 1]], [0, 1, 2], 4),
        _virtual_case("any_negative_id_gives_minus_one", [[-2, 1], [3, -5]], [2, 1], 4),
        _virtual_case("token_slots_as_a_column_raises_value_error", [[1, 2], [0, 1]], [1, 2], 4, column=True),
    ]


def _virtual_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        E, k, T = rng.choice([4, 8, 16, 60]), rng.choice([1, 2, 4]), rng.randint(3, 12)
        S = rng.randint(2, 9)
        topk = [[rng.randrange(E) if rng.random() > 0.15 else -1 for _ in range(k)] for _ in range(T)]
        slots = [rng.randrange(S) for _ in range(T)]
        slots[0] = rng.randrange(1, S)
        cases.append(_virtual_case(f"random_{i}", topk, slots, E, torch.int32 if i % 2 else torch.int64))
    return cases


def _virtual_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor):
        return None
    ids, slots, E = case.args
    if got.dtype != torch.int64:
        return f"the virtual ids are int64 whatever the dtype of topk_ids (here {ids.dtype}): .long()"
    if got.shape != expected.shape:
        return "one virtual id per (token, choice): the result has the shape of topk_ids"
    g, e = got.cpu(), expected.cpu()
    swapped = ids.long() * E + slots.long().view(-1, 1)
    if torch.equal(g[ids >= 0], swapped[ids >= 0]) and not torch.equal(g, e):
        return ("slot * num_experts + expert, not expert * num_experts + slot: the experts of one slot are "
                "consecutive, so virtual id v is A.view(-1, ...)[v] = A[v // num_experts, v % num_experts]")
    if not torch.equal(g[ids < 0], e[ids < 0]):
        if torch.equal(g[ids == -1], e[ids == -1]):  # -1 handled, other negative ids not
            return ("any negative id gives -1 (test ids < 0, not == -1): it names an expert of another EP rank, "
                    "which has no slot's weights on this rank")
        return ("a negative id (-1: an expert of another EP rank) gives -1: it has no slot's weights on this rank, "
                "so slot * num_experts + (-1) would name another slot's expert")
    if torch.equal(g, ids.long()) or torch.equal(g[ids >= 0], ids.long()[ids >= 0]):
        return "the virtual id includes the token's slot: slot * num_experts + expert"
    wrapped = (slots.view(-1, 1).to(torch.int32) * E + ids.to(torch.int32)).long()
    if ids.dtype == torch.int32 and torch.equal(g[ids >= 0], wrapped[ids >= 0]):
        return ("slot * num_experts + expert overflows int32 here: convert to int64 (.long()) BEFORE multiplying, "
                "not after")
    return None


# ---------------------------------------------------------------------------------------------
# ch09.2 moe_align_block_size


def _align_case(name, ids, block_size, num_ids, skip=None, dtype=torch.int64) -> Case:
    t = _ids(ids, dtype)
    sk = None if skip is None else torch.tensor(skip, dtype=torch.bool)
    text = f"ids {t.tolist()}, block_size {block_size}, num_ids {num_ids}" + (f", skip {skip}" if skip else "")
    return Case(name, [t, block_size, num_ids, sk], text, op="exact")


def _align_edge() -> list[Case]:
    return [
        _align_case("example_in_the_text", [[2, 0], [1, 2], [0, 2]], 2, 3),
        _align_case("groups_fill_whole_blocks", [[0, 1], [1, 0]], 2, 2),
        _align_case("one_pair_groups_pad_to_a_block", [[3], [1], [0]], 4, 4),
        _align_case("ids_with_no_pairs_get_no_blocks", [[5, 1], [5, 1]], 2, 8),
        _align_case("minus_one_left_out", [[1, -1], [-1, 1], [0, 1]], 2, 2),
        _align_case("all_minus_one", [[-1, -1]], 2, 3),
        _align_case("stable_order_in_a_group", [[2, 2], [2, 0], [2, 2]], 8, 3),
        _align_case("stable_order_over_many_pairs", [[(7 * t + j) % 3 for j in range(4)] for t in range(24)], 64, 3),
        _align_case("block_size_1", [[1, 0], [0, 1], [2, 0]], 1, 3),
        _align_case("block_larger_than_every_group", [[0, 1], [2, 3]], 16, 4),
        _align_case("three_blocks_in_one_group", [[0], [0], [0], [0], [0], [1], [0]], 2, 2),
        _align_case("skip_rank_0_group", [[0, 1], [1, 2], [2, 0]], 2, 3, [False, True, False]),
        _align_case("skip_everything", [[0, 1]], 2, 2, [True, True]),
        _align_case("skip_a_group_with_no_pairs", [[0, 0]], 4, 3, [False, False, True]),
        _align_case("no_pairs", [], 4, 3),
        _align_case("int32_ids", [[1, 0], [0, 0]], 2, 2, dtype=torch.int32),
        _align_case("block_size_0_raises_value_error", [[0, 1]], 0, 2),
        _align_case("negative_block_size_raises_value_error", [[0, 1]], -2, 2),
        _align_case("id_past_num_ids_raises_value_error", [[0, 3]], 2, 3),
    ]


def _align_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        n_ids, k, T = rng.randint(3, 24), rng.choice([1, 2, 4]), rng.randint(4, 30)
        hot = rng.sample(range(n_ids), min(3, n_ids))  # a few ids take many pairs: groups of several blocks
        ids = [[rng.choice(hot) if rng.random() < 0.5 else (rng.randrange(n_ids) if rng.random() > 0.1 else -1)
                for _ in range(k)] for _ in range(T)]
        skip = [rng.random() < 0.2 for _ in range(n_ids)] if i % 2 else None
        cases.append(_align_case(f"random_{i}", ids, rng.choice([1, 2, 3, 4, 8]), n_ids, skip,
                                 torch.int32 if i == 3 else torch.int64))
    return cases


def _align_hint(case: Case, expected, got) -> Optional[str]:
    if not (isinstance(got, tuple) and len(got) == 3 and isinstance(expected, tuple)):
        return "return (sorted_pair_ids, block_ids, num_pairs): an AlignedBlocks or a plain 3-tuple"
    ids, block, num_ids, skip = case.args
    e_sorted, e_blocks, n = expected
    g_sorted, g_blocks, g_n = got
    if not isinstance(g_sorted, torch.Tensor) or not isinstance(g_blocks, torch.Tensor):
        return None
    if g_sorted.dtype != torch.int32 or g_blocks.dtype != torch.int32:
        return "sorted_pair_ids and block_ids are int32"
    if isinstance(g_n, int) and g_n != n:
        return "num_pairs counts every pair, num_tokens * top_k, including those left out (it is the padding sentinel)"
    gs, es = g_sorted.cpu().long(), e_sorted.cpu().long()
    if block and gs.numel() % block:
        return f"sorted_pair_ids holds whole blocks: num_blocks * block_size entries ({block} per block)"
    is_real = (gs >= 0) & (gs < n)
    real, e_real = gs[is_real], es[es < n]
    if gs.numel() == es.numel() and real.numel() == e_real.numel() and bool((gs[~is_real] != n).any()):
        return f"padding entries hold num_pairs ({n}), a pair index past the last one, so a kernel masks them"
    flat = ids.reshape(-1).long()
    if torch.equal(real, e_real) and not torch.equal(gs, es):
        return ("the real pairs are right but the padding is misplaced: each group takes ceil(count / block_size) "
                "blocks of its own, its real pairs first and its padding after them (at the end of its last block)")
    top_k = ids.shape[1] if ids.dim() == 2 else 1
    T = flat.numel() // top_k if top_k else 0
    if T and block and gs.numel() == es.numel() and real.numel() == e_real.numel() and not torch.equal(gs, es):
        # the learner's entries read as choice * num_tokens + token: the same pairs in every group?
        as_p = torch.where(is_real, (gs % T) * top_k + gs // T, gs)

        def by_group(entries, blocks):
            groups: dict = {}
            for b, v in enumerate(blocks.tolist()):
                groups.setdefault(v, []).extend(p for p in entries[b * block:(b + 1) * block].tolist() if p < n)
            return {v: sorted(ps) for v, ps in groups.items()}
        if g_blocks.numel() * block == gs.numel() and by_group(as_p, g_blocks.cpu()) == by_group(es, e_blocks.cpu()):
            return "pair p is ids.reshape(-1)[p], i.e. p = token * top_k + choice (not choice * num_tokens + token)"
    extra = set(real.tolist()) - set(e_real.tolist())  # pairs the answer placed that the contract leaves out
    if extra and all(0 <= p < flat.numel() and int(flat[p]) < 0 for p in extra):
        return "pairs with id -1 are left out: no block, no entry"
    if extra and skip is not None and all(0 <= p < flat.numel() and int(flat[p]) >= 0 and bool(skip[int(flat[p])])
                                          for p in extra):
        return "a group whose id is set in skip gets no blocks at all (no program reads its absent weights)"
    if gs.numel() < es.numel() and real.numel() == e_real.numel():
        return "each id's group is padded to a whole number of blocks on its own (a block holds one id only)"
    if torch.equal(g_blocks.cpu(), e_blocks.cpu()) and torch.equal(torch.sort(real).values, torch.sort(e_real).values):
        return "inside a group the pairs keep their order (a stable sort by id): pair t * top_k + j before later ones"
    if g_blocks.numel() == gs.numel() and gs.numel() != e_blocks.numel():
        return "block_ids has one entry per block (num_blocks), not one per pair"
    return None


# ---------------------------------------------------------------------------------------------
# ch09.3 fused_moe_lora


def _moe_case(name, gen, *, tokens, top_k, num_experts, slots, ranks, max_rank, d_in, slices, rows_per_pair,
              weights, dtype=torch.float32, minus_one=0.0, scalings=None, topk=None, token_slots=None,
              rng: Optional[random.Random] = None) -> Case:
    """``ranks``: [slots][experts] (rank 0: no weights; slot 0 may be the base model, all 0).
    ``slices``: the output widths of the stacked slices (one width, or gate and up)."""
    rng = rng or random.Random(len(name))
    S, E = len(ranks), num_experts
    offsets = [0]
    for w in slices:
        offsets.append(offsets[-1] + w)
    stack = len(slices)
    A = torch.randn(S, E, stack * max_rank, d_in, generator=gen) * d_in ** -0.5
    B = torch.randn(S, E, offsets[-1], max_rank, generator=gen) * max(max_rank, 1) ** -0.5
    for s in range(S):
        for e in range(E):
            r = ranks[s][e]
            A[s, e, stack * r:] = NAN  # slice i uses rows [i*r, (i+1)*r): everything past stack*r is padding
            B[s, e, :, r:] = NAN
    if topk is None:
        topk = [rng.sample(range(E), top_k) for _ in range(tokens)]
        for t in range(tokens):
            for j in range(top_k):
                if rng.random() < minus_one:
                    topk[t][j] = -1
    if token_slots is None:
        token_slots = [rng.randrange(S) for _ in range(tokens)]
        if tokens > 1:
            token_slots[0], token_slots[1] = 1, S - 1  # adapters present whatever the draw
    if minus_one and tokens:  # an adapter's token with an expert of another rank, whatever the draw
        adapter_tokens = [t for t in range(tokens) if any(ranks[token_slots[t]])] or [0]
        topk[adapter_tokens[0]][0] = -1
    ids = torch.tensor(topk, dtype=torch.int64).reshape(tokens, top_k)
    ts = torch.tensor(token_slots, dtype=torch.int32)
    rank_t = torch.tensor(ranks, dtype=torch.int32).reshape(S, E)
    sc = torch.tensor(scalings if scalings is not None else [0.5 + 0.25 * s for s in range(S)], dtype=torch.float32)
    pairs = tokens * top_k
    x = torch.randn(pairs if rows_per_pair else tokens, d_in, generator=gen).to(dtype)
    out = torch.randn(pairs, offsets[-1], generator=gen).to(dtype)
    w = torch.rand(tokens, top_k, generator=gen) + 0.25 if weights else None
    labels, exact = [], torch.zeros(pairs, offsets[-1], dtype=torch.bool)
    for p in range(pairs):
        t, j = divmod(p, top_k)
        s, e = token_slots[t], int(ids[t, j])
        r = ranks[s][e] if e >= 0 else 0
        where = "expert -1 (another EP rank)" if e < 0 else f"slot {s}, expert {e} (rank {r})"
        labels.append(f"pair {p} = token {t}, choice {j}: {where}")
        if r == 0:
            exact[p] = True
    args = [x, A.to(dtype), B.to(dtype), out, ids, ts, rank_t, sc, top_k, rows_per_pair,
            tuple(offsets) if stack > 1 else None, w]
    text = (f"x {list(x.shape)} ({'one row per pair' if rows_per_pair else 'one row per token'}), A {list(A.shape)}, "
            f"B {list(B.shape)}, out {list(out.shape)} (the base output), topk_ids {ids.tolist()}, token_slots "
            f"{token_slots}, lora_ranks {ranks}, scalings {[round(v, 3) for v in sc.tolist()]}, top_k {top_k}, "
            f"slice_offsets {tuple(offsets) if stack > 1 else None}, topk_weights "
            f"{'given' if weights else 'None'}, {str(dtype)[6:]}; A rows / B columns past each rank hold NaN")
    return Case(name, args, text, out_index=3, row_labels=labels, exact=exact)


def _moe_edge() -> list[Case]:
    g = torch.Generator().manual_seed(9)
    base = dict(d_in=24, max_rank=8)
    return [
        _moe_case("gate_up_two_slices_rows_per_token", g, tokens=5, top_k=2, num_experts=4,
                  ranks=[[0] * 4, [8, 8, 8, 8], [4, 4, 4, 4]], slices=(12, 12), rows_per_pair=False, weights=False,
                  slots=3, **base),
        _moe_case("down_one_slice_rows_per_pair", g, tokens=5, top_k=2, num_experts=4,
                  ranks=[[0] * 4, [8, 8, 8, 8], [4, 4, 4, 4]], slices=(16,), rows_per_pair=True, weights=False,
                  slots=3, **base),
        _moe_case("routing_weights_given", g, tokens=4, top_k=2, num_experts=4,
                  ranks=[[0] * 4, [6, 6, 6, 6], [8, 8, 8, 8]], slices=(16,), rows_per_pair=True, weights=True,
                  slots=3, **base),
        _moe_case("routing_weights_given_two_slices", g, tokens=4, top_k=2, num_experts=3,
                  ranks=[[0] * 3, [5, 5, 5], [8, 8, 8]], slices=(10, 10), rows_per_pair=False, weights=True,
                  slots=3, **base),
        _moe_case("experts_an_adapter_lacks_are_rank_0", g, tokens=6, top_k=2, num_experts=4,
                  ranks=[[0] * 4, [8, 0, 8, 0], [0, 3, 3, 0]], slices=(9, 9), rows_per_pair=False, weights=False,
                  slots=3, **base),
        _moe_case("gate_and_up_of_different_widths", g, tokens=4, top_k=2, num_experts=3,
                  ranks=[[0] * 3, [4, 4, 4], [8, 8, 8]], slices=(8, 20), rows_per_pair=False, weights=False,
                  slots=3, **base),
        _moe_case("expert_ids_minus_one", g, tokens=6, top_k=2, num_experts=4,
                  ranks=[[0] * 4, [8, 8, 8, 8], [4, 4, 4, 4]], slices=(16,), rows_per_pair=True, weights=True,
                  slots=3, minus_one=0.4, token_slots=[1, 2, 1, 2, 0, 1], **base),
        _moe_case("one_expert_under_two_adapters", g, tokens=4, top_k=1, num_experts=2,
                  ranks=[[0, 0], [7, 7], [3, 3]], slices=(16,), rows_per_pair=False, weights=False, slots=3,
                  topk=[[1], [1], [1], [0]], token_slots=[1, 2, 0, 1], **base),
        _moe_case("top_k_1", g, tokens=5, top_k=1, num_experts=4,
                  ranks=[[0] * 4, [8, 8, 8, 8], [2, 2, 2, 2]], slices=(16,), rows_per_pair=True, weights=False,
                  slots=3, **base),
        _moe_case("top_k_4_of_8_experts", g, tokens=3, top_k=4, num_experts=8,
                  ranks=[[0] * 8, [8] * 8, [6, 0, 6, 0, 6, 0, 6, 0]], slices=(6, 6), rows_per_pair=False,
                  weights=True, slots=3, **base),
        _moe_case("base_model_in_slot_2", g, tokens=5, top_k=2, num_experts=4,
                  ranks=[[8, 8, 8, 8], [4, 4, 4, 4], [0] * 4], slices=(16,), rows_per_pair=True, weights=False,
                  slots=3, **base),
        _moe_case("bf16", g, tokens=5, top_k=2, num_experts=4, ranks=[[0] * 4, [8, 8, 8, 8], [4, 4, 4, 4]],
                  slices=(12, 12), rows_per_pair=False, weights=True, slots=3, dtype=torch.bfloat16, **base),
        _moe_case("no_tokens", g, tokens=0, top_k=2, num_experts=4, ranks=[[0] * 4, [8] * 4], slices=(16,),
                  rows_per_pair=True, weights=False, slots=2, **base),
    ]


def _moe_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32, torch.float32]):
        E, k = rng.choice([(4, 2), (8, 2), (8, 4), (6, 1)])
        S, max_rank = rng.randint(2, 5), rng.choice([4, 8, 16])
        ranks = [[0] * E] + [[rng.choice([0, 1, max_rank // 2, max_rank, max_rank]) for _ in range(E)]
                             for _ in range(S - 1)]
        ranks[1][rng.randrange(E)] = max_rank
        two = i % 2 == 0
        width, other = rng.choice([8, 12, 20]), rng.choice([4, 10, 16])
        cases.append(_moe_case(f"random_{i}", gen, tokens=rng.randint(4, 12), top_k=k, num_experts=E, slots=S,
                               ranks=ranks, max_rank=max_rank, d_in=rng.choice([16, 24, 40]),
                               slices=(width, other if i == 2 else width) if two else (width,), rows_per_pair=not two,
                               weights=i in (1, 2), dtype=dtype, minus_one=0.15 if i == 3 else 0.0, rng=rng,
                               scalings=[rng.choice([0.5, 1.0, 2.0, 0.125]) for _ in range(S)]))
    return cases


def _moe_variant(case: Case, *, per_token_rows=None, ignore_weights=False, max_rank_offsets=False,
                 slot_ranks=False, ignore_scaling=False, scale_power=1, weight_power=1, assign=False,
                 skip_slot_0=False, choice_major=False) -> torch.Tensor:
    """The result of one specific mistake, for the hints (computed on the CPU in fp64)."""
    x, A, B, out, ids, ts, ranks, sc, k, rpp, offs, w = case.args
    pairs = ids.shape[0] * k
    offsets = offs or (0, out.shape[1])
    res = out.double().clone()
    max_rank = B.shape[3]
    for p in range(pairs):
        t, j = (p % ids.shape[0], p // ids.shape[0]) if choice_major else divmod(p, k)
        s, e = int(ts[t]), int(ids[t, j])
        if e < 0:
            continue
        r = int(ranks[s].max()) if slot_ranks else int(ranks[s, e])
        if r == 0 or (skip_slot_0 and s == 0):
            continue
        use_pair = rpp if per_token_rows is None else not per_token_rows
        row = x[min(p if use_pair else t, x.shape[0] - 1)].double()
        scale = ((1.0 if ignore_scaling else float(sc[s])) ** scale_power
                 * (float(w[t, j]) ** weight_power if w is not None and not ignore_weights else 1.0))
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            base = i * (max_rank if max_rank_offsets else r)
            h = A[s, e, base:base + r].double() @ row
            delta = scale * (B[s, e, lo:hi, :r].double() @ h)
            res[p, lo:hi] = delta if assign else res[p, lo:hi] + delta
    return res


def _moe_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    x, A, B, out, ids, ts, ranks, sc, k, rpp, offs, w = case.args
    g = got.cpu().double()
    exact = case.exact.cpu()
    if bool(torch.isnan(g).any()):
        if bool(torch.isnan(g[exact]).any()):
            return ("rows of pairs whose (slot, expert) has rank 0, or whose expert id is -1, must come back unchanged: "
                    "skip them (their A and B are poison here: an adapter without that expert has no weights)")
        return ("NaN read: a group of rank r uses rows [i*r, (i+1)*r) of A[slot, expert] for slice i and columns "
                "[:r] of B; the rest is padding (NaN in these cases)")

    def near(v):
        return bool(torch.allclose(g.nan_to_num(0), v.nan_to_num(0), rtol=2e-2, atol=2e-2)) and not bool(
            torch.allclose(expected.cpu().double(), v.nan_to_num(0), rtol=2e-2, atol=2e-2))
    if k > 1 and ids.shape[0] > 1 and near(_moe_variant(case, choice_major=True)):
        return (f"pair p is token p // top_k, choice p % top_k (p = t * top_k + j, the row order of "
                f"topk_ids.reshape(-1)), not choice-major (p = j * num_tokens + t): yours reads and writes other "
                "pairs' rows")
    if not torch.equal(got.cpu()[exact], out.cpu()[exact]) if got.is_floating_point() else False:
        return "rows of pairs with no LoRA (rank 0 or expert -1) must come back bit for bit: add nothing to them"
    if w is not None and near(_moe_variant(case, ignore_weights=True)):
        return "topk_weights given: multiply each pair's delta by topk_weights[token, choice] (and by the slot's scaling)"
    if x.shape[0] != ids.shape[0] or k > 1:
        if rpp and x.shape[0] == ids.shape[0] * k and near(_moe_variant(case, per_token_rows=True)):
            return "rows_per_pair=True: x has one row per pair (down reads the pair's own activation): x[pair], not x[token]"
    if offs is not None and near(_moe_variant(case, max_rank_offsets=True)):
        return ("slice i of a group of rank r is rows [i*r, (i+1)*r) of A[slot, expert] (the adapter's rank), "
                "not [i*max_rank, ...)")
    if near(_moe_variant(case, assign=True)):
        return "add the delta to out (out[pair] += delta): out holds the base output, which must stay in the sum"
    if near(_moe_variant(case, scale_power=2)):
        return "the slot's scaling multiplies each delta once (scalings[slot]), not twice"
    if w is not None and near(_moe_variant(case, weight_power=2)):
        return "the routing weight multiplies each delta once (topk_weights[token, choice]), not twice"
    if near(_moe_variant(case, skip_slot_0=True)):
        return ("slot 0 is a slot like any other: whether a pair gets a delta is decided by lora_ranks[slot, expert] "
                "alone (the base model is rank 0 wherever it sits)")
    if near(_moe_variant(case, ignore_scaling=True)):
        return "multiply each delta by the token's slot's scaling, scalings[slot] (alpha / r, or rsLoRA's)"
    if near(_moe_variant(case, slot_ranks=True)):
        return "the rank is per (slot, expert): lora_ranks[slot, expert], not the slot's largest"
    if bool((g - out.cpu().double()).abs().max() == 0) and bool((expected.cpu().double() - out.cpu().double()).abs().max() > 0):
        return "out is updated in place: out[pair] += the delta (and out is returned)"
    return None


# ---------------------------------------------------------------------------------------------
# ch09.4 to_local_expert_ids


def _local_case(name, topk, ep_rank, ep_size, E, dtype=torch.int64) -> Case:
    ids = _ids(topk, dtype)
    return Case(name, [ids, ep_rank, ep_size, E],
                f"topk_ids {ids.tolist()} ({str(dtype)[6:]}), ep_rank {ep_rank}, ep_size {ep_size}, num_experts {E}",
                op="exact")


def _local_edge() -> list[Case]:
    ids = [[0, 3], [4, 7], [2, 5], [6, 1]]
    return [
        _local_case("rank_0_of_2", ids, 0, 2, 8),
        _local_case("rank_1_of_2", ids, 1, 2, 8),
        _local_case("rank_3_of_4_block_edges", [[5, 6], [7, 4], [0, 3]], 3, 4, 8),
        _local_case("rank_2_of_4", [[4, 5], [3, 6]], 2, 4, 8),
        _local_case("minus_one_stays", [[-1, 1], [5, -1]], 0, 2, 8),
        _local_case("ep_size_1_every_expert_local", ids, 0, 1, 8),
        _local_case("int32_ids", ids, 1, 2, 8, torch.int32),
        _local_case("no_tokens", [], 1, 2, 8),
        _local_case("ep_size_not_dividing_raises_value_error", ids, 0, 3, 8),
        _local_case("ep_size_0_raises_value_error", ids, 0, 0, 8),
        _local_case("ep_rank_past_ep_size_raises_value_error", ids, 2, 2, 8),
        _local_case("negative_ep_rank_raises_value_error", ids, -1, 2, 8),
    ]


def _local_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        size = rng.choice([2, 4, 8])
        E = size * rng.choice([1, 2, 4, 16])
        k = rng.choice([1, 2, 8 if E >= 8 else 2])
        topk = [[rng.randrange(E) if rng.random() > 0.1 else -1 for _ in range(k)] for _ in range(rng.randint(2, 9))]
        cases.append(_local_case(f"random_{i}", topk, rng.randrange(1, size), size, E))
    return cases


def _local_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return None
    ids, q, size, E = case.args
    if got.dtype != expected.dtype:
        return f"return the local ids as int64 (.long()), whatever the dtype of topk_ids (here {str(ids.dtype)[6:]})"
    g, e, flat = got.cpu().long(), expected.cpu().long(), ids.long()
    per = E // size
    if torch.equal(g[e >= 0], flat[e >= 0]) and q > 0:
        return f"a local id is the global id minus the rank's first expert ({q} * {per}): it indexes a buffer of {per} experts"
    strided = torch.where(flat % size == q, flat // size, -1)
    if torch.equal(g[flat >= 0], strided[flat >= 0]) and not torch.equal(strided, e):
        return (f"experts are split in contiguous blocks: rank {q} holds [{q * per}, {(q + 1) * per}), "
                "not every ep_size-th expert")
    if not torch.equal(g[e < 0], e[e < 0]):
        return ("an expert another rank holds becomes -1 (this rank has no weights for it): exactly -1, whatever "
                "global id - first it would give")
    return None


# ---------------------------------------------------------------------------------------------
# ch09.5 split_expert_lora


def _split_case(name, E, r, d_in, d_out, gen, dtype=torch.float32, a_rows=None, b_cols=None) -> Case:
    rows = E * r if a_rows is None else a_rows
    A = torch.randn(rows, d_in, generator=gen).to(dtype)
    B = torch.randn(d_out, rows if b_cols is None else b_cols, generator=gen).to(dtype)
    return Case(name, [A, B, E], f"lora_A {list(A.shape)}, lora_B {list(B.shape)}, num_experts {E} "
                f"({str(dtype)[6:]}; PEFT's layout of a 3-D expert parameter's LoRA)", op="exact")


def _split_edge() -> list[Case]:
    g = torch.Generator().manual_seed(5)
    return [
        _split_case("example_in_the_text_E2_r2", 2, 2, 3, 4, g),
        _split_case("one_expert", 1, 4, 6, 5, g),
        _split_case("E4_r3_gate_up_shaped", 4, 3, 8, 12, g),
        _split_case("rank_1", 3, 1, 5, 7, g),
        _split_case("E8_r2_down_shaped", 8, 2, 12, 8, g),
        _split_case("bf16", 2, 4, 6, 6, g, torch.bfloat16),
        _split_case("rows_not_a_multiple_of_E_raises_value_error", 4, 1, 6, 6, g, a_rows=6, b_cols=6),
        _split_case("A_and_B_of_different_ranks_raises_value_error", 2, 2, 6, 6, g, b_cols=6),
        _split_case("no_rows_raises_value_error", 2, 0, 6, 6, g),
    ]


def _split_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_split_case(f"random_{i}", rng.choice([2, 3, 4, 8]), rng.choice([2, 3, 4, 8]), rng.choice([5, 8, 16]),
                        rng.choice([6, 12, 24]), gen, torch.bfloat16 if i == 2 else torch.float32)
            for i in range(4)]


def _split_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        return (f"return a list of num_experts ({len(expected)}) pairs (A_e [r, in], B_e [out, r])"
                if isinstance(expected, (list, tuple)) else None)
    A, B, E = case.args
    r = A.shape[0] // E
    try:
        blocks_b = [B[:, e * r:(e + 1) * r] for e in range(E)]
        strided_a = [A[e::E] for e in range(E)]
        got_a = [g[0].cpu() for g in got]
        got_b = [g[1].cpu() for g in got]
    except (TypeError, IndexError):
        return None
    if all(torch.equal(a, e[0].cpu()) for a, e in zip(got_a, expected)) and all(
            b.shape == x.shape and torch.equal(b, x) for b, x in zip(got_b, blocks_b)):
        return ("lora_B's columns are rank-major: column k * E + e is expert e's k-th column, so B_e = lora_B[:, e::E]; "
                "only lora_A is expert-major (one block of r rows per expert)")
    if all(a.shape == x.shape and torch.equal(a, x) for a, x in zip(got_a, strided_a)):
        return "lora_A is expert-major: expert e's rows are lora_A[e*r:(e+1)*r], one block (only B is strided)"
    if any(tuple(b.shape) == (r, B.shape[0]) for b in got_b):
        return "B_e is [out, r] (lora_B's rows are the output features), not transposed"
    return None


# ---------------------------------------------------------------------------------------------


def _align_ref(ids, block_size, num_ids, skip=None):
    return tuple(moe_align_block_size(ids, block_size, num_ids, skip))


EXERCISES = [
    Exercise("ch09.1", "virtual_expert_ids", ("topk_ids", "token_slots", "num_experts"), virtual_expert_ids,
             _virtual_edge, _virtual_random, _virtual_hint, default_device_probe=True),
    Exercise("ch09.2", "moe_align_block_size", ("ids", "block_size", "num_ids", "skip"), _align_ref,
             _align_edge, _align_random, _align_hint, result_names=("sorted_pair_ids", "block_ids", "num_pairs"),
             grade_on="cpu", default_device_probe=True),
    Exercise("ch09.3", "fused_moe_lora", ("x", "A", "B", "out", "topk_ids", "token_slots", "lora_ranks", "scalings",
                                          "top_k", "rows_per_pair", "slice_offsets", "topk_weights"),
             fused_moe_lora_torch, _moe_edge, _moe_random, _moe_hint, default_device_probe=True),
    Exercise("ch09.4", "to_local_expert_ids", ("topk_ids", "ep_rank", "ep_size", "num_experts"), to_local_expert_ids,
             _local_edge, _local_random, _local_hint, default_device_probe=True),
    Exercise("ch09.5", "split_expert_lora", ("lora_A", "lora_B", "num_experts"), split_expert_lora,
             _split_edge, _split_random, _split_hint, fresh_result=False, default_device_probe=True),
]
