"""Cases for chapter 11 (the serving engine's control plane: block keys, admission, the drain, routing).

All four exercises are pure functions of host values (reference/engine/policies.py). ch11.1
``block_hashes`` and ch11.4 ``route`` take only lists, ints and uids, which cross to the child as
they are. ch11.2 ``admit_requests`` and ch11.3 ``choose_drain`` take ``Candidate`` objects: the
case holds each candidate as a row ``(seq_id, uid, blocks_needed, waited)`` and a driver in this
module (``drive_admit`` / ``drive_drain``) builds the ``Candidate`` list in the child, next to the
learner's function, and calls it as the scheduler does (running uids as a list, which may repeat a
uid; resident uids as a set; running_remaining as a dict in the given insertion order).

Case design (graders' rule): every clause of each ``Semantics:`` block, both sides of every rule,
and each error. ch11.1: the docstring example, full blocks only (an exact multiple and a trailing
partial block, fewer tokens than a block, no tokens), chaining (repeated identical blocks), the
base model (None) and an int uid 0 as adapter ids, a tuple uid, block size 1 and a large block,
tokens given as a tuple, each error. ch11.2: the docstring example, both parts of the order
(running counts as warm as well as resident), the cap's skip-and-go-on, a later request of an
adapter already in the set, the base taking a slot, the cap checked before KV, KV stopping in
arrival order with an exact fit and a zero-block request, free blocks decremented, max_new_seqs
counting admissions only, a drained adapter (and the base drained as None; None not drained when
the flag is off), a uid running twice, each error. ch11.3: the docstring example, waited equal to
the threshold and one past it, a free slot, more running than the cap, a starving uid that runs,
a starving base request (at the cap and past it), ties broken by uid_sort_key (base first, ints by
value, int before str) against the dict's insertion order, the smallest uid_sort_key with the middle
remaining, each error (a negative threshold with a free slot too); every group has int uids tied whose text order
differs from their value order (9 before 10), inserted so that the first inserted, the smallest as
text and the largest are three other uids. ch11.4: idle instances, the bound's "+1" (the first
instance of the walk exactly one below the bound), capacity factors 1, 1.25, 1.5, 2 and large, a
key past every ring point (the walk wraps), replicas 2 and 3 with the lighter one second in the
walk, ties to the earlier one in the walk where that is the higher index, replicas taken after the
bound filter, replicas past the instance count, one instance, each error. The random and hidden
groups draw the same families with seeded names, sizes and loads, plus free draws.
Capacity factors and instance counts are drawn so that every order of the bound's float arithmetic
gives the same bound (a correct answer never fails by rounding), except in the cases built on the
text's order ("in floating point as written, left to right: multiply, then divide"): the float bound
against exact arithmetic, and against dividing first (``_DIVIDE_FIRST``).
"""
from __future__ import annotations

import functools
import math
import random
from fractions import Fraction
from typing import Optional

from graders.chapters.hints import first_difference, name_matches, symptom_hint
from graders.machine.exercise import Case, Exercise
from reference.engine.policies import (Candidate, admit_requests, block_hashes, choose_drain, ring_walk, route,
                                       stable_hash)
from reference.mem_pool import uid_sort_key

__all__ = ["EXERCISES", "drive_admit", "drive_drain"]

_UIDS = (None, 0, 1, 9, 10, "a", "b", "c", "sql@1", "chat@2", ("lora", 3))


# ---------------------------------------------------------------------------------------------
# ch11.1 block_hashes


def _hash_case(name, tokens, adapter_id, block_size) -> Case:
    shown = tokens if len(tokens) <= 24 else f"{list(tokens[:24])[:-1]} ... ({len(tokens)} tokens)"
    return Case(name, [tokens, adapter_id, block_size],
                f"token_ids {shown!s}, adapter_id {adapter_id!r}, block_size {block_size}", op="exact")


def _hash_edge() -> list[Case]:
    return [
        _hash_case("example_in_the_text", [5, 6, 7], "a@0", 2),
        _hash_case("two_full_blocks_and_a_partial_one", [5, 6, 7, 8, 9], "a@0", 2),
        _hash_case("exact_multiple_of_the_block", [5, 6, 7, 8], "a@0", 2),
        _hash_case("repeated_identical_blocks_are_chained", [7, 7, 7, 7, 7, 7], "a@0", 2),
        _hash_case("fewer_tokens_than_one_block", [1, 2, 3], "a@0", 4),
        _hash_case("no_tokens", [], "a@0", 4),
        _hash_case("base_model_uid_none", [1, 2, 3, 4, 5], None, 2),
        _hash_case("int_uid_0_is_not_the_base", [1, 2, 3, 4, 5], 0, 2),
        _hash_case("tuple_uid", [3, 1, 4, 1, 5, 9], ("lora", 3), 3),
        _hash_case("block_size_1", [3, 1, 4, 1, 5], "b@1", 1),
        _hash_case("block_of_16_over_40_tokens", list(range(100, 140)), "sql@1", 16),
        _hash_case("tokens_as_a_tuple", (5, 6, 7, 8, 9), "a@0", 2),
        _hash_case("block_size_0_raises_value_error", [1, 2], "a@0", 0),
        _hash_case("negative_block_size_raises_value_error", [1, 2], "a@0", -2),
        _hash_case("block_size_0_no_tokens_raises", [], None, 0),
    ]


def _hash_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: one adapter's prompts that share a prefix (an exact multiple of the block, a
    trailing partial block, repeated blocks), the same tokens under another uid and under the base."""
    cases = []
    for i in range(4):
        bs = rng.choice([1, 2, 3, 4, 5, 8]) if i else rng.choice([2, 3, 4])
        uid, other = rng.sample([u for u in _UIDS if u is not None], 2)
        prefix = [rng.randrange(32000) for _ in range(bs * rng.randint(1, 3))]
        exact = prefix + [rng.randrange(32000) for _ in range(bs * rng.randint(1, 2))]
        partial = exact + [rng.randrange(32000) for _ in range(rng.randint(1, bs) if bs > 1 else 0)]
        repeated = [rng.randrange(50)] * (bs * rng.randint(2, 4) + rng.randrange(bs))
        cases += [_hash_case(f"random_{i}_exact_multiple", exact, uid, bs),
                  _hash_case(f"random_{i}_partial_block", partial, uid, bs),
                  _hash_case(f"random_{i}_same_tokens_other_uid", partial, other, bs),
                  _hash_case(f"random_{i}_same_tokens_base", exact, None, bs),
                  _hash_case(f"random_{i}_repeated_blocks", repeated, uid, bs),
                  _hash_case(f"random_{i}_short", prefix[:rng.randrange(bs)] if bs > 1 else [], uid, bs)]
    cases.append(_hash_case("random_block_size_0", [1, 2, 3], rng.choice(_UIDS), 0))
    cases.append(_hash_case("random_negative_block_size", [1, 2, 3], rng.choice(_UIDS), -rng.randint(1, 3)))
    return cases


def _chained(tokens, adapter_id, bs, key, partial=False, chain=True) -> list:
    out, parent = [], None
    stop = len(tokens) if partial else len(tokens) - bs + 1
    for start in range(0, max(stop, 0), bs):
        parent = key(parent if chain else None, adapter_id, tokens[start:start + bs])
        out.append(parent)
    return out


def _hash_hint(case: Case, expected, got) -> Optional[str]:
    tokens, adapter_id, bs = case.args
    if not isinstance(expected, list) or not isinstance(got, (tuple, list)):
        return None
    got = list(got)
    if got and not all(isinstance(v, int) and not isinstance(v, bool) for v in got):
        return "return a list of ints: the stable_hash value of each full block's key"
    ok = lambda p, a, blk: stable_hash((p, a, tuple(blk)))  # noqa: E731
    variants = [
        (_chained(tokens, adapter_id, bs, ok, partial=True),
         "a trailing partial block has no key (its KV is still being written): hash FULL blocks only"),
        (_chained(tokens, adapter_id, bs, ok, chain=False),
         "chain the keys: block i's key includes h[i-1], the previous block's key (a token's KV depends on its "
         "whole prefix), so equal tokens after different prefixes get different keys"),
        (_chained(tokens, adapter_id, bs, lambda p, a, blk: stable_hash((p, tuple(blk)))),
         "the adapter's uid belongs in every key: stable_hash((h[i-1], adapter_id, block)); without it two "
         "adapters share KV that LoRA on q/k/v made different"),
        (_chained(tokens, adapter_id, bs, lambda p, a, blk: stable_hash((p, a, list(blk)))),
         "hash the block as a tuple: stable_hash hashes repr, and a list's repr [5, 6] is not a tuple's (5, 6)"),
        (_chained(tokens, adapter_id, bs, lambda p, a, blk: stable_hash(f"{p}{a}{tuple(blk)}")),
         "hash the tuple (h[i-1], adapter_id, block), not a concatenated string: 'a1' + '2' == 'a' + '12'"),
    ]
    hint = name_matches([msg for value, msg in variants if got == value and value != expected])
    if hint:
        return hint
    full = len(tokens) // bs if bs >= 1 else 0
    if len(got) == full - 1:
        return f"{len(tokens)} tokens hold {full} full blocks of {bs}: the last full block needs its key too"
    if got and expected and got[0] != expected[0]:
        return ("the first key already differs: it is stable_hash((None, adapter_id, tuple(token_ids[:block_size]))) "
                "exactly: the parent None first, then the uid as given (not str(uid), not `uid or None`), then the "
                "block as a tuple of ints; and stable_hash, not hash() (Python's hash of a str changes with "
                "PYTHONHASHSEED, so two engines, or the grader and your process, would disagree)")
    return None


def _ints(got, what: str) -> tuple[Optional[list], Optional[str]]:
    """``got`` as a list of ints, or why it is not one (a tuple is fine; a bool or a float is not an int)."""
    if not isinstance(got, (list, tuple)):
        return None, f"returned {type(got).__name__} {str(got)[:60]}: expected a list of {what}"
    for i, v in enumerate(got):
        if not isinstance(v, int) or isinstance(v, bool):
            return None, f"returned value[{i}] is {type(v).__name__} {str(v)[:60]}: expected {what}"
    return list(got), None


def _hash_compare(case: Case, expected, got) -> Optional[str]:
    """Which block's key first differs (or is missing, or extra), with that block's tokens."""
    tokens, adapter_id, bs = case.args
    got, why = _ints(got, "ints (one key per full block)")
    if why:
        return why
    k = first_difference(expected, got)
    if k is None:
        return None
    full = f"{len(tokens)} tokens hold {len(expected)} full block(s) of {bs}"
    block = tuple(tokens[k * bs:(k + 1) * bs])
    where = f"block {k} (tokens [{k * bs}:{k * bs + len(block)}) = {block})"
    right = f"; keys 0..{k - 1} are right" if k else ""
    if k >= len(got):
        return f"returned {len(got)} key(s), expected {len(expected)} ({full}): {where} has no key{right}"
    if k >= len(expected):
        return (f"returned {len(got)} key(s), expected {len(expected)} ({full}): key {k} is extra, for "
                f"{'the partial ' + where if block else 'tokens past the end'}{right}")
    return f"returned value[{k}], the key of {where}: expected {expected[k]:,}, got {got[k]:,}{right}"


# ---------------------------------------------------------------------------------------------
# ch11.2 admit_requests


def drive_admit(fn, rows, running_uids, resident_uids, max_loras_per_batch, free_blocks, max_new_seqs,
                draining, drain_active):
    """Call ``fn`` as the scheduler does: Candidates from ``rows``, running uids as a list, resident
    uids as a set."""
    waiting = [Candidate(*row) for row in rows]
    if isinstance(draining, tuple):  # equal to the rows' uid, not the same object (a scheduler may rebuild it)
        draining = tuple(list(draining))
    return fn(waiting, list(running_uids), set(resident_uids), max_loras_per_batch, free_blocks, max_new_seqs,
              draining, drain_active)


def _admit_case(name, rows, running, resident, cap, free, max_new, draining=None, active=False) -> Case:
    rows = [tuple(r) for r in rows]
    describe = (f"waiting (seq_id, uid, blocks_needed, waited) {rows}; running_uids {list(running)}; "
                f"resident_uids {set(resident) or '{}'}; max_loras_per_batch {cap}; free_blocks {free}; "
                f"max_new_seqs {max_new}; draining {draining!r}, drain_active {active}")
    return Case(name, [rows, list(running), list(resident), cap, free, max_new, draining, active], describe, op="exact")


def _r(i, uid, blocks=1, waited=0):
    return (i, uid, blocks, waited)


def _admit_edge() -> list[Case]:
    c = _admit_case
    return [
        c("example_in_the_text", [_r(0, "b"), _r(1, "a"), _r(2, "a")], [None], ["a"], 2, 10, 8),
        c("arrival_is_list_order_not_seq_id", [_r(7, "a", 2), _r(3, "a", 2)], [], [], 2, 2, 8),
        # arrival order, not the longest wait: a preempted request waits less than the one behind it
        c("arrival_order_not_the_longest_wait", [_r(4, "a", 1, 1), _r(5, "a", 1, 6)], [], [], 2, 10, 1),
        # an admitted uid joins the set the cap counts: b then c cannot both fit a cap of 2 beside a
        c("each_admitted_uid_joins_the_set", [_r(0, "b"), _r(1, "c")], ["a"], [], 2, 10, 8),
        c("preempted_at_the_front_keeps_its_place", [_r(9, "b"), _r(2, "a"), _r(5, "b")], [], ["b"], 2, 10, 8),
        c("resident_adapters_take_no_slot_until_they_run", [_r(0, "c"), _r(1, "d")], [], ["a", "b"], 2, 10, 8),
        c("draining_a_tuple_uid_compares_by_value", [_r(0, ("lora", 3)), _r(1, "b")], [], [], 3, 10, 8,
          ("lora", 3), True),
        c("all_cold_arrival_order", [_r(0, "b"), _r(1, "a")], [], [], 2, 10, 8),
        c("warm_first_each_part_in_arrival_order", [_r(0, "c"), _r(1, "a"), _r(2, "b"), _r(3, "a")], ["b"], ["a"],
          3, 10, 8),
        c("a_running_uid_is_warm_too", [_r(0, "a"), _r(1, "b")], ["b"], [], 2, 10, 8),
        c("cap_skips_and_goes_on", [_r(0, "a"), _r(1, "b"), _r(2, "c"), _r(3, "a")], [], [], 2, 10, 8),
        c("later_request_of_an_adapter_in_the_set_fits", [_r(0, "c"), _r(1, "a")], ["a", "b"], [], 2, 10, 8),
        c("the_base_takes_a_slot", [_r(0, None), _r(1, "b")], ["a"], [], 2, 10, 8),
        c("the_base_alone_fills_a_cap_of_1", [_r(0, None), _r(1, "a"), _r(2, None)], [], [], 1, 10, 8),
        c("int_uid_0_is_not_the_base", [_r(0, 0), _r(1, None)], [None], [], 1, 10, 8),
        # an over-cap candidate that fits (d) before one that does not (c): stopping at the cap, checking
        # KV first and never adding admitted uids each return something else
        c("cap_checked_before_kv", [_r(0, "a"), _r(1, "b"), _r(2, "d"), _r(3, "a"), _r(4, "c", 9), _r(5, "a")], [], [],
          2, 5, 8),
        c("kv_stops_no_overtaking", [_r(0, "a", 3), _r(1, "a", 1)], [], [], 2, 2, 8),
        c("kv_stops_later_ones_wait_too", [_r(0, "a", 2), _r(1, "b", 1)], [], [], 4, 2, 8),
        c("kv_exact_fit_is_admitted", [_r(0, "a", 2), _r(1, "a", 3)], [], [], 2, 5, 8),
        c("free_blocks_go_down_with_each_admission", [_r(0, "a", 2), _r(1, "a", 2), _r(2, "a", 2)], [], [], 2, 5, 8),
        c("zero_blocks_with_none_free", [_r(0, "a", 0), _r(1, "a", 1)], ["a"], [], 2, 0, 8),
        c("max_new_seqs_limits_admissions", [_r(0, "a"), _r(1, "a"), _r(2, "a")], [], [], 2, 10, 2),
        c("max_new_seqs_counts_admissions_not_skips", [_r(0, "a"), _r(1, "b"), _r(2, "c"), _r(3, "a")], [], [],
          2, 10, 3),
        c("max_new_seqs_0", [_r(0, "a")], [], [], 2, 10, 0),
        c("drained_adapter_held_back", [_r(0, "a"), _r(1, "b")], [], [], 3, 10, 8, "a", True),
        c("drained_resident_adapter_held_back", [_r(0, "b"), _r(1, "a")], ["a"], ["a"], 3, 10, 8, "a", True),
        c("drained_skipped_before_kv", [_r(0, "a", 5), _r(1, "b", 1)], [], [], 3, 2, 8, "a", True),
        c("draining_the_base", [_r(0, None), _r(1, "b")], [], [], 3, 10, 8, None, True),
        c("none_is_not_drained_when_inactive", [_r(0, None), _r(1, "b")], [], [], 3, 10, 8, None, False),
        c("draining_set_but_inactive", [_r(0, "a"), _r(1, "b")], [], [], 3, 10, 8, "a", False),
        c("a_uid_running_twice_takes_one_slot", [_r(0, "b"), _r(1, "c")], ["a", "a"], [], 2, 10, 8),
        c("no_waiting_requests", [], ["a"], ["a"], 2, 10, 8),
        c("cap_0_raises_value_error", [_r(0, "a")], [], [], 0, 10, 8),
        c("cap_0_no_waiting_raises", [], [], [], 0, 10, 8),
        c("negative_free_blocks_raises_value_error", [_r(0, "a")], [], [], 2, -1, 8),
        c("negative_max_new_seqs_raises_value_error", [_r(0, "a")], [], [], 2, 10, -1),
    ]


def _admit_families(rng: random.Random, tag: str) -> list[Case]:
    """One case of each clause's family, with drawn names, sizes and queue lengths."""
    u = rng.sample([x for x in _UIDS if x is not None], 5)
    big = rng.randint(3, 6)
    fill = [_r(100 + k, u[4], 0) for k in range(rng.randint(0, 2))]  # warm zero-block filler
    c = _admit_case
    return [
        c(f"{tag}_warm_first", [_r(0, u[0]), _r(1, u[1]), _r(2, u[2]), _r(3, u[1])], [u[2]], [u[1]], 2, 10, 8),
        c(f"{tag}_cap_skip_go_on", [_r(0, u[0]), _r(1, u[1]), _r(2, u[2]), _r(3, u[0])], [u[0]], [], 2, 10, 8),
        c(f"{tag}_base_counted", [_r(0, None), _r(1, u[1]), _r(2, u[0])], [u[0]], [], 2, 10, 8),
        c(f"{tag}_kv_stops", [_r(0, u[0], big), _r(1, u[0], 1), _r(2, u[1], 1)], [], [], 3, big - 1, 8),
        c(f"{tag}_cap_before_kv", [_r(0, u[0]), _r(1, u[2]), _r(2, u[0]), _r(3, u[1], big + 4), _r(4, u[0])], [], [],
          1, 4, 8),
        c(f"{tag}_decrement", [_r(k, u[0], 2) for k in range(4)], [u[0]], [], 2, 2 * rng.randint(1, 3) + 1, 8),
        c(f"{tag}_exact_fit", [_r(0, u[0], big), _r(1, u[0], 1)], [], [], 2, big, 8),
        c(f"{tag}_max_new_seqs", [_r(0, u[0]), _r(1, u[1]), _r(2, u[2]), _r(3, u[0]), _r(4, u[0])], [], [], 2, 10, 3),
        c(f"{tag}_drain_none", [_r(0, None), _r(1, u[1])] + fill, [u[4]], [], 4, 10, 8, None, True),
        c(f"{tag}_none_inactive", [_r(0, None), _r(1, u[1])], [], [], 3, 10, 8, None, False),
        c(f"{tag}_drained", [_r(0, u[0], big + 9), _r(1, u[1])], [u[0]], [u[0]], 3, 2, 8, u[0], True),
        c(f"{tag}_running_twice", [_r(0, u[1]), _r(1, u[2])], [u[0], u[0]], [], 2, 10, 8),
    ]


def _admit_draw(rng: random.Random, name: str) -> Case:
    pool = rng.sample(_UIDS, rng.randint(3, 6))
    cap = rng.randint(1, 4)
    running = [rng.choice(pool) for _ in range(rng.randint(0, 4))]
    while len(set(running)) > cap:
        running.pop()
    if rng.random() < 0.5 and running:
        running.append(rng.choice(running))  # a uid running twice
    resident = rng.sample(pool, rng.randint(0, len(pool)))
    n = rng.randint(3, 12)
    ids = rng.sample(range(100), n)  # arrival order is the list's, never the ids'
    rows = [_r(ids[i], rng.choice(pool), rng.choice([0, 1, 1, 2, 3, 5]), rng.randint(0, 9)) for i in range(n)]
    draining, active = (rng.choice(pool), rng.random() < 0.7) if rng.random() < 0.5 else (None, rng.random() < 0.3)
    return _admit_case(name, rows, running, resident, cap, rng.randint(0, 14), rng.randint(0, 9), draining, active)


def _admit_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    bad = [(0, 5, 5), (2, -rng.randint(1, 9), 5), (2, 5, -rng.randint(1, 9))]
    return _admit_families(rng, "family") + [_admit_draw(rng, f"random_{i}") for i in range(12)] + [
        _admit_case(f"random_bad_limits_{k}", [_r(0, rng.choice(_UIDS))], [], [], *b) for k, b in enumerate(bad)]


def _admit_variant(rows, running, resident, cap, free, max_new, draining, active, **wrong) -> list:
    """``admit_requests`` with one named mistake switched on (for hints)."""
    warm = set(running) | set(resident)
    if wrong.get("resident_only"):
        warm = set(resident)
    if wrong.get("running_only"):
        warm = set(running)
    order = rows if wrong.get("no_order") else sorted(rows, key=lambda r: r[1] not in warm)
    if wrong.get("longest_wait"):
        order = sorted(rows, key=lambda r: (r[1] not in warm, -r[3]))
    if wrong.get("by_seq_id"):
        order = sorted(rows, key=lambda r: (r[1] not in warm, r[0]))
    chosen, admitted, seen = set(running) | (set(resident) if wrong.get("resident_counted") else set()), [], 0
    added = []  # the admitted uids, one per admission (for admitted_twice)
    for seq_id, uid, blocks, _ in order:
        if len(admitted) == max_new + wrong.get("off", 0) or wrong.get("count_seen") and seen == max_new:
            break
        seen += 1
        if wrong.get("kv_first") and blocks > free:
            break
        held = (uid == draining) and (active or wrong.get("flag_ignored"))
        if wrong.get("none_ignored"):
            held = held and draining is not None
        if held:
            continue
        distinct = {x for x in chosen | {uid} if not (wrong.get("base_free") and x is None)}
        taken = len(distinct) + (len(running) - len(set(running)) if wrong.get("repeats") else 0)
        if wrong.get("admitted_twice"):  # the admitted uids kept in a list: a repeated one counted again
            taken = len(set(running)) + len(added) + (uid not in set(running) | set(added))
        if taken > cap:
            if wrong.get("break_on_cap"):
                break
            continue
        if blocks > free:
            if wrong.get("skip_on_kv"):
                continue
            break
        if wrong.get("ge_kv") and blocks == free:
            break
        admitted.append(seq_id)
        added.append(uid)
        if not wrong.get("no_add"):
            chosen.add(uid)
        free -= 0 if wrong.get("no_decrement") else blocks
    return admitted


_ADMIT_MISTAKES = [
    (dict(by_seq_id=True), "arrival order is the order of the waiting list, not of seq_id (a preempted request "
                           "goes back to the FRONT of the queue): sort stably on \"not warm\" only"),
    (dict(resident_counted=True), "only RUNNING uids (and the ones admitted now) take slots in the cap; a resident "
                                  "adapter with no running request can be evicted, so it takes none"),
    (dict(no_order=True), "candidates whose uid is running or resident go first (a stable sort on \"not running "
                          "and not resident\"), then the others, each part in arrival order"),
    (dict(resident_only=True), "a uid that is RUNNING is warm too (its weights are in a slot): order running or "
                               "resident uids first, not only the resident ones"),
    (dict(running_only=True), "a RESIDENT uid is warm too (its weights sit in a slot already): order running or "
                              "resident uids first"),
    (dict(kv_first=True), "check the drain and the adapter cap before KV: a candidate the cap skips must not stop "
                          "admission because it would not fit"),
    (dict(break_on_cap=True), "a candidate over the adapter cap is skipped, not a reason to stop: a later request "
                              "of an adapter already in the set still fits"),
    (dict(skip_on_kv=True), "when a candidate needs more blocks than are free, STOP (break): later requests wait "
                            "too, so a big request is never overtaken forever by small ones"),
    (dict(base_free=True), "the base model (uid None) takes a slot like any adapter: count None among the distinct "
                           "uids"),
    (dict(none_ignored=True), "None is a real uid (the base model): when drain_active is True and draining is None, "
                              "hold back the base model's requests"),
    (dict(flag_ignored=True), "hold back the drained uid only while drain_active is True (draining None with the "
                              "flag off means no drain, not \"drain the base model\")"),
    (dict(no_decrement=True), "subtract each admitted candidate's blocks_needed from the free blocks"),
    (dict(longest_wait=True), "within each part, ARRIVAL order (the waiting list's order), not the longest wait: "
                              "the drain is what helps a request that waited long"),
    (dict(no_add=True), "add each admitted candidate's uid to the set the cap counts (running uids plus the ones "
                        "admitted so far): otherwise two new adapters both fit the last free slot"),
    (dict(ge_kv=True), "a candidate that needs exactly the free blocks fits: stop only when blocks_needed > free"),
    (dict(off=1), "at most max_new_seqs admissions: one too many"),
    (dict(off=-1), "up to max_new_seqs admissions: one too few"),
    (dict(count_seen=True), "max_new_seqs counts ADMITTED requests, not candidates looked at (skipped ones do not "
                            "count)"),
    (dict(repeats=True), "the cap counts DISTINCT uids: a uid running twice takes one slot"),
    (dict(admitted_twice=True), "the cap counts DISTINCT uids: a uid admitted twice (or admitted while it runs) takes "
                                "one slot, so keep the running and admitted uids in a set, not a list"),
]


def _admit_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(expected, list) or not isinstance(got, (tuple, list)):
        return None
    got = list(got)
    ids = [r[0] for r in case.args[0]]
    if any(g not in ids for g in got):
        return "return the seq_ids of the admitted candidates (ints from the waiting list), not candidates or uids"
    hint = symptom_hint(_ADMIT_MISTAKES, _admit_variant, case.args, expected, got)
    if hint:
        return hint
    if sorted(got) == sorted(expected):
        return ("the right requests in the wrong order: return seq_ids in the order they are admitted (running or "
                "resident uids first, each part in arrival order)")
    return None


def _admit_compare(case: Case, expected, got) -> Optional[str]:
    """The admitted seq_ids, and the first position where they differ, with those candidates."""
    rows = {r[0]: r for r in case.args[0]}
    got, why = _ints(got, "seq_ids (ints from the waiting list)")
    if why:
        return why
    k = first_difference(expected, got)
    if k is None:
        return None

    def who(i: int, ids: list, whose: str) -> str:
        if i >= len(ids):
            return f"nothing more ({whose} {len(ids)} seq_id(s) in all)"
        sid = ids[i]
        if sid not in rows:
            return f"{sid}, which is no waiting candidate's seq_id"
        _, uid, blocks, waited = rows[sid]
        return f"seq {sid} (uid {uid!r}, {blocks} block(s), waited {waited})"
    return (f"admitted seq_ids: expected {expected}, got {got}; they first differ at position {k}: expected "
            f"{who(k, expected, 'the contract admits')}, got {who(k, got, 'your answer returned')}")


# ---------------------------------------------------------------------------------------------
# ch11.3 choose_drain


def drive_drain(fn, rows, remaining_pairs, max_loras_per_batch, threshold):
    """Call ``fn`` with Candidates from ``rows`` and ``running_remaining`` as a dict in the given order."""
    return fn([Candidate(*row) for row in rows], dict(remaining_pairs), max_loras_per_batch, threshold)


def _drain_case(name, rows, remaining, cap, threshold) -> Case:
    rows, pairs = [tuple(r) for r in rows], [tuple(p) for p in remaining]
    describe = (f"waiting (seq_id, uid, blocks_needed, waited) {rows}; running_remaining "
                f"{{{', '.join(f'{k!r}: {v}' for k, v in pairs)}}}; max_loras_per_batch {cap}; threshold {threshold}")
    return Case(name, [rows, pairs, cap, threshold], describe, op="exact")


def _w(i, uid, waited):
    return (i, uid, 1, waited)


def _drain_edge() -> list[Case]:
    c = _drain_case
    return [
        # first: the smallest uid_sort_key has the middle remaining, so the uid compared before the
        # remaining ("a") and the most remaining ("c") fail here apart (on the docstring's example both
        # return "a")
        c("smallest_uid_has_the_middle_remaining", [_w(9, "z", 9)], [("a", 5), ("b", 1), ("c", 9)], 3, 4),
        c("example_in_the_text", [_w(9, "c", 5)], [("a", 30), ("b", 4)], 2, 4),
        c("waited_equal_to_threshold_is_not_starved", [_w(9, "c", 4)], [("a", 30), ("b", 4)], 2, 4),
        c("waited_one_past_threshold", [_w(9, "c", 5), _w(8, "d", 2)], [("b", 4), ("a", 30)], 2, 4),
        c("a_slot_is_free", [_w(9, "c", 9)], [("a", 30), ("b", 4)], 3, 4),
        c("more_running_than_the_cap", [_w(9, "d", 9)], [("a", 30), ("b", 12), ("c", 7)], 2, 4),
        c("the_starving_uid_runs", [_w(9, "a", 9)], [("a", 30), ("b", 4)], 2, 4),
        c("one_starving_among_many", [_w(1, "a", 9), _w(2, "c", 1), _w(3, "d", 7)], [("a", 3), ("b", 8)], 2, 6),
        # more running than the cap first: a cap read as strict (full only past it) drains here, so
        # only a base request left out of "starved" returns (False, None)
        c("a_starving_base_request_over_the_cap", [_w(9, None, 9)], [("a", 8), ("b", 6), ("c", 7)], 2, 4),
        c("a_starving_base_request", [_w(9, None, 9)], [("a", 8), ("b", 6)], 2, 4),
        c("the_base_runs_and_a_base_request_waits", [_w(9, None, 9)], [("a", 8), (None, 2)], 2, 4),
        # ties whose first inserted uid is neither the smallest nor the largest uid_sort_key, beside a
        # busier uid: insertion order, the largest key and the most loaded each return another uid
        c("the_base_drained_on_a_tie", [_w(9, "c", 9)], [("a", 5), ("b", 5), (None, 5), ("z", 9)], 4, 4),
        c("tie_by_uid_sort_key_not_insertion", [_w(9, "c", 9)], [("b", 5), ("a", 5), ("x", 9)], 3, 4),
        c("tie_int_by_value_not_as_text", [_w(9, "c", 9)], [(50, 5), (100, 5), (9, 5), (10, 5), (7, 9)], 5, 4),
        c("tie_int_before_str", [_w(9, "c", 9)], [("a", 5), (2, 5)], 2, 4),
        c("smallest_remaining_wins_over_uid_order", [_w(9, "z", 9)], [(None, 7), ("a", 6), ("b", 3)], 3, 0),
        c("threshold_0_waited_1", [_w(9, "c", 1)], [("a", 3), ("b", 4)], 2, 0),
        c("threshold_0_waited_0", [_w(9, "c", 0)], [("a", 3), ("b", 4)], 2, 0),
        c("cap_1_one_running", [_w(9, "b", 3)], [("a", 40)], 1, 2),
        c("nothing_runs_cap_1", [_w(9, "b", 30)], [], 1, 2),
        c("no_waiting_requests", [], [("a", 3), ("b", 4)], 2, 4),
        c("negative_threshold_raises_value_error", [_w(9, "c", 5)], [("a", 30), ("b", 4)], 2, -1),
        # a free slot: the arguments are checked before the "no drain needed" answer
        c("negative_threshold_with_a_free_slot_raises", [_w(9, "c", 5)], [("a", 30)], 2, -1),
        c("cap_0_raises_value_error", [_w(9, "c", 5)], [("a", 30)], 0, 4),
        c("cap_0_nothing_waits_raises", [], [], 0, 0),
    ]


def _drain_families(rng: random.Random, tag: str) -> list[Case]:
    u = rng.sample([x for x in _UIDS if x is not None and not isinstance(x, int)], 4)
    t = rng.randint(0, 6)
    lo, hi = rng.randint(1, 8), rng.randint(10, 40)
    # four int uids tied on lo, whose text order differs from their value order: the smallest value
    # (one digit, 3-9) is drained; the smallest as text ("1x") is another, the largest ("1xy")
    # another, the first inserted (20-99) another, and a busier uid beside them
    smallest = rng.randint(3, 9)
    text_first = rng.randint(10, 19)
    largest = 10 * text_first + rng.randint(0, 9)
    first = rng.randint(20, 99)
    mid = (lo + hi) // 2
    by_key = sorted(u[:3], key=uid_sort_key)  # the smallest uid_sort_key gets the middle remaining
    c = _drain_case
    return [
        c(f"{tag}_smallest_uid_has_the_middle_remaining", [_w(1, u[3], t + 2)],
          [(by_key[0], mid), (by_key[1], lo), (by_key[2], hi)], 3, t),
        c(f"{tag}_smallest_drained", [_w(1, u[2], t + 1)], [(u[0], hi), (u[1], lo)], 2, t),
        c(f"{tag}_at_threshold", [_w(1, u[2], t)], [(u[0], hi), (u[1], lo)], 2, t),
        c(f"{tag}_slot_free", [_w(1, u[2], t + 5)], [(u[0], hi)], 2, t),
        c(f"{tag}_over_cap", [_w(1, u[3], t + 5)], [(u[0], hi), (u[1], lo), (u[2], lo + 1)], 2, t),
        c(f"{tag}_uid_runs", [_w(1, u[0], t + 5)], [(u[0], hi), (u[1], lo)], 2, t),
        c(f"{tag}_tie_base", [_w(1, u[2], t + 3)], [(u[1], lo), (None, lo)], 2, t),
        c(f"{tag}_tie_ints_by_value_not_as_text", [_w(1, u[3], t + 3)],
          [(first, lo), (largest, lo), (smallest, lo), (text_first, lo), (u[0], hi)], 5, t),
        c(f"{tag}_tie_strs", [_w(1, u[3], t + 3)], sorted([(u[0], lo), (u[1], lo), (u[2], hi)],
                                                            key=lambda p: str(p[0]), reverse=True), 3, t),
        c(f"{tag}_base_starves_over_the_cap", [_w(1, None, t + 2)], [(u[0], hi), (u[1], lo), (u[2], lo + 1)], 2, t),
        c(f"{tag}_base_starves", [_w(1, None, t + 2)], [(u[0], hi), (u[1], lo)], 2, t),
    ]


def _drain_draw(rng: random.Random, name: str) -> Case:
    pool = rng.sample(_UIDS, rng.randint(3, 7))
    cap = rng.randint(1, 4)
    running = rng.sample(pool, min(len(pool), rng.choice([cap, cap, cap + 1, max(cap - 1, 0)])))
    rem = rng.randint(1, 12)
    remaining = [(x, rem if rng.random() < 0.4 else rng.randint(1, 40)) for x in running]  # ties
    t = rng.randint(0, 8)
    rows = [_w(i, rng.choice(pool), rng.choice([t, t + 1, rng.randint(0, 15)])) for i in range(rng.randint(0, 6))]
    return _drain_case(name, rows, remaining, cap, t)


def _drain_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    # a negative threshold with the slots full (cap 1, one adapter running) and with a slot free
    # (cap 2-3): an answer that checks its arguments after the free-slot answer fails only the
    # second, so every draw holds both (a draw of cap 1 alone let it pass one secret's hidden group)
    bad = [(0, rng.randint(0, 5)), (1, -rng.randint(1, 5)), (rng.randint(2, 3), -rng.randint(1, 5))]
    return _drain_families(rng, "family") + [_drain_draw(rng, f"random_{i}") for i in range(12)] + [
        _drain_case(f"random_bad_limits_{k}", [_w(1, "c", 9)], [("a", 3)], *b) for k, b in enumerate(bad)]


def _drain_variant(rows, pairs, cap, threshold, **wrong):
    remaining = dict(pairs)
    if not wrong.get("no_cap") and (len(remaining) <= cap if wrong.get("cap_strict") else len(remaining) < cap):
        return (False, None)
    past = (lambda w: w >= threshold) if wrong.get("ge") else (lambda w: w > threshold)
    if not any(past(r[3]) and (wrong.get("uid_ignored") or r[1] not in remaining)
               and not (wrong.get("base_never_starves") and r[1] is None) for r in rows):
        return (False, None)
    if not remaining:
        return (False, None)
    if wrong.get("most"):
        return (True, max(remaining, key=lambda x: (remaining[x], uid_sort_key(x))))
    if wrong.get("insertion"):
        return (True, min(remaining, key=remaining.get))
    if wrong.get("as_text"):
        return (True, min(remaining, key=lambda x: (remaining[x], str(x))))
    if wrong.get("uid_first"):
        return (True, min(remaining, key=lambda x: (uid_sort_key(x), remaining[x])))
    if wrong.get("last"):
        return (True, max(remaining, key=lambda x: (-remaining[x], uid_sort_key(x))))
    return (True, min(remaining, key=lambda x: (remaining[x], uid_sort_key(x))))


_DRAIN_MISTAKES = [
    (dict(ge=True), "a request is starved once waited > threshold (strictly): waiting exactly threshold steps is "
                    "still within it"),
    (dict(no_cap=True), "drain only while the slots are full (len(running_remaining) >= max_loras_per_batch): with a "
                        "free slot the starving request is admitted without a drain"),
    (dict(cap_strict=True), "the slots are full when len(running_remaining) >= max_loras_per_batch: at the cap (not "
                            "only past it) a starving request can get no slot without a drain"),
    (dict(base_never_starves=True), "None is a real uid: a waiting base-model request (uid None) starves like any "
                                    "other when waited > threshold and None is not running (the base model takes a "
                                    "slot like an adapter)"),
    (dict(uid_ignored=True), "a waiting request whose uid is already running is not starved by the cap (it can "
                             "join its adapter's slot): only uids not in running_remaining count"),
    (dict(as_text=True), "ties go by uid_sort_key (ints compare by value, base first), not by the uids as text"),
    (dict(insertion=True), "ties on the remaining tokens go by uid_sort_key (base first, then type name, then "
                           "value), not by the dict's insertion order"),
    (dict(last=True), "ties go to the SMALLEST uid_sort_key (base first)"),
    # last: on a tie, the most-loaded uid is also the largest uid_sort_key
    (dict(most=True), "drain the running uid whose requests finish SOONEST (the smallest remaining), not the one "
                      "with the most left"),
    # uid_first: where the smallest uid_sort_key also has the most left, "most" returns the same
    (dict(uid_first=True), "compare the remaining tokens first; uid_sort_key only breaks ties: key (running_remaining"
                           "[u], uid_sort_key(u)), not (uid_sort_key(u), running_remaining[u])"),
]


def _drain_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return "return a pair: (True, the uid to drain) or (False, None)"
    got = tuple(got)
    if not isinstance(got[0], bool):
        return "the first element is a bool (whether to drain), the second the uid or None"
    hint = symptom_hint(_DRAIN_MISTAKES, _drain_variant, case.args, expected, got)
    if hint:
        return hint
    if got[0] is False and got[1] is not None:
        return "no drain is (False, None)"
    return None


def _drain_compare(case: Case, expected, got) -> Optional[str]:
    """Which of (drain, uid) differs, with the running uids' remaining tokens."""
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"returned {type(got).__name__} {str(got)[:60]}: expected a pair (drain, uid)"
    remaining = dict(case.args[1])

    def left(uid) -> str:
        if uid in remaining:
            return f" ({remaining[uid]} token{'' if remaining[uid] == 1 else 's'} left)"
        return " (not running)" if uid is not None else ""
    for name, e, g in zip(("drain", "uid"), expected, got):
        if type(e) is not type(g) or e != g:
            extra = f"{left(e)}" if name == "uid" else ""
            return (f"returned {name}: expected {e!r}{extra}, got {g!r}" + (left(g) if name == "uid" else "")
                    + (f"; running_remaining {remaining}" if name == "uid" else ""))
    return None


# ---------------------------------------------------------------------------------------------
# ch11.4 route


def _route_case(name, key, loads, vnodes, cf, replicas=None) -> Case:
    args = [key, list(loads), vnodes, cf] + ([] if replicas is None else [replicas])
    walk = ring_walk(key, len(loads), vnodes) if loads and vnodes >= 1 else "-"
    bound = f"; bound ceil({cf} * ({sum(loads)} + 1) / {len(loads)}) = {_bound(loads, cf)}" if loads else ""
    describe = (f"adapter_key {key!r}, loads {list(loads)}, vnodes {vnodes}, capacity_factor {cf}"
                f"{'' if replicas is None else f', replicas {replicas}'} (ring_walk of the key: {walk}{bound})")
    return Case(name, args, describe, op="exact")


def _bounds_agree(loads, cf) -> bool:
    """Every order of the bound's float arithmetic gives the same ceiling (so rounding never decides)."""
    s, n = sum(loads) + 1, len(loads)
    forms = {math.ceil(cf * s / n), math.ceil(cf * (s / n)), math.ceil(s * cf / n), math.ceil(s / n * cf),
             math.ceil((cf * s) / n)}
    return len(forms) == 1


def _bound(loads, cf) -> int:
    return math.ceil(cf * (sum(loads) + 1) / len(loads))


def _exact_bound(loads, cf, binary: bool) -> int:
    """The bound in exact arithmetic: on the float's binary value (Fraction(cf)) or on its decimal
    text (Fraction(repr(cf)))."""
    factor = Fraction(cf) if binary else Fraction(repr(cf))
    return math.ceil(factor * (sum(loads) + 1) / len(loads))


def _float_not_exact(rng: random.Random, key, n, vnodes, binary: bool) -> tuple:
    """(loads, vnodes, capacity_factor, replicas 1) where the contract's floating-point bound and the
    exact one (binary: Fraction(cf), else Fraction(repr(cf))) differ by one, every float order agrees,
    and the walk's first instance sits at the smaller of the two: open under one, full under the other."""
    walk = ring_walk(key, n, vnodes)
    factors = [k / 100 for k in range(101, 200)]
    rng.shuffle(factors)
    for cf in factors:
        for total in range(n + 1, 16 * n):  # total = sum(loads) + 1
            loads = [0] * n
            loads[0] = total - 1  # the bound depends on the sum alone
            b, e = _bound(loads, cf), _exact_bound(loads, cf, binary)
            v = min(b, e)
            if b == e or v > total - 1 or not _bounds_agree(loads, cf):
                continue
            for _ in range(20):
                loads = [0] * n
                loads[walk[0]] = v
                for _ in range(total - 1 - v):  # the rest spread over the other instances
                    loads[rng.choice(walk[1:])] += 1
                if route(key, loads, vnodes, cf) != _route_variant(key, loads, vnodes, cf, exact_binary=binary,
                                                                   exact=not binary):
                    return loads, vnodes, cf, 1
    raise RuntimeError("no loads found")  # pragma: no cover


def _wrapping_key(rng: random.Random, n: int, vnodes: int):
    """A key whose hash lies past every ring point: its walk starts over at the first point."""
    top = max(stable_hash((i, v)) for i in range(n) for v in range(vnodes))
    base = rng.randrange(10**6)
    return next(f"adapter-{base + k}" for k in range(10**6) if stable_hash(f"adapter-{base + k}") > top)


def _plus_one_loads(rng: random.Random, key, n, vnodes, cf):
    """Loads whose first instance of the walk is one below the bound (and at least 1), where the
    bound without the request's own +1 (even floored at 1) would call it full."""
    walk = ring_walk(key, n, vnodes)
    for _ in range(500):
        loads = [rng.randint(0, 6) for _ in range(n)]
        for v in range(0, 30):
            loads[walk[0]] = v
            b = _bound(loads, cf)
            if v >= 1 and v == b - 1 and math.ceil(cf * sum(loads) / n) <= v and _bounds_agree(loads, cf):
                return loads
    raise RuntimeError("no loads found")  # pragma: no cover


def _tie(n: int, vnodes: int, higher: bool, prefix: str = "tie"):
    """A key whose walk starts with a higher (or lower) instance index than its second, and loads
    that tie those two below everything else."""
    key = next(f"{prefix}-{k}" for k in range(10**5)
               if (ring_walk(f"{prefix}-{k}", n, vnodes)[0] > ring_walk(f"{prefix}-{k}", n, vnodes)[1]) == higher)
    w = ring_walk(key, n, vnodes)
    loads = [4] * n
    loads[w[0]] = loads[w[1]] = 1
    return key, loads


def _wrap_replica_case(rng: random.Random, n: int, vnodes: int):
    """(key, loads, vnodes, capacity_factor, replicas) for a key after which every instance but one
    has a ring point: that one comes only from the wrap, last in the walk, and is the least loaded."""
    points = sorted((stable_hash((i, v)), i) for i in range(n) for v in range(vnodes))
    base = rng.randrange(10**6)
    for k in range(10**6):
        key = f"adapter-{base + k}"
        at = stable_hash(key)
        if len({i for p, i in points if p >= at}) == n - 1:
            w = ring_walk(key, n, vnodes)
            loads = [1] * n
            loads[w[0]], loads[w[-1]] = 2, 0
            return key, loads, vnodes, 2.0, n
    raise RuntimeError("no key found")  # pragma: no cover


def _at_bound_loads(rng: random.Random, key, n, vnodes, cf):
    """Loads whose first instance of the walk is exactly at the bound (full), the others below it."""
    walk = ring_walk(key, n, vnodes)
    for _ in range(500):
        loads = [rng.randint(0, 3) for _ in range(n)]
        for v in range(0, 30):
            loads[walk[0]] = v
            if v == _bound(loads, cf) and _bounds_agree(loads, cf):
                return loads
    raise RuntimeError("no loads found")  # pragma: no cover


def _at_whole_bound(rng: random.Random, key, n, vnodes, cf) -> tuple[list, float]:
    """(loads, capacity_factor) where capacity_factor * (sum(loads) + 1) / n is a whole number, the
    bound itself, and the walk's first instance sits exactly at it: a ceiling written as int(x) + 1
    (one more there) calls it open. Falls back to factor 1.0 if ``cf`` gives no such loads."""
    walk = ring_walk(key, n, vnodes)
    for factor in (cf, 1.0):
        for _ in range(500):
            loads = [rng.randint(0, 4) for _ in range(n)]
            for v in range(1, 30):
                loads[walk[0]] = v
                x = factor * (sum(loads) + 1) / n
                if v == _bound(loads, factor) and x == int(x) and _bounds_agree(loads, factor):
                    return loads, factor
    raise RuntimeError("no loads found")  # pragma: no cover


def _factor_inside_loads(key, n, vnodes) -> list:
    """Loads where ceil(1.25 * (S + 1) / n) = 2 but 1.25 * ceil((S + 1) / n) = 2.5: the walk's first
    instance at load 2 is full under the contract and open under the wrong order of operations."""
    w = ring_walk(key, n, vnodes)
    loads = [1] * n
    loads[w[0]], loads[w[-1]] = 2, 0  # S + 1 = n + 1
    return loads


#: (capacity_factor, n, sum(loads) + 1) where the formula as written, capacity_factor * s / n, is a
#: whole number c in floats and exactly (so exact arithmetic gives the same bound), and the other
#: order, capacity_factor * (s / n), lands just above it: its bound is c + 1 (2.625 * 72 / 7 is 27.0,
#: 2.625 * (72 / 7) is 27.000000000000004); capacity_factor * ceil(s / n) is above c + 1 (the factor
#: outside the ceiling opens one more load). Factors exact in binary.
_DIVIDE_FIRST = ((2.625, 7, 72), (1.375, 11, 200), (2.75, 11, 100), (2.625, 7, 144), (3.125, 10, 176),
                 (2.75, 11, 200))


def _divide_first_case(rng: random.Random, key, vnodes: int, pick: Optional[int] = None) -> tuple:
    """(loads, vnodes, capacity_factor, replicas 1) from ``_DIVIDE_FIRST``: the walk's first instance
    one over the contract's bound c (full under either order; open with no bound or the factor
    outside the ceiling), its second at c (full as written, open divided first), the others below
    c. Dividing first returns the second, the contract a later one."""
    cf, n, total = _DIVIDE_FIRST[rng.randrange(len(_DIVIDE_FIRST)) if pick is None else pick]
    walk = ring_walk(key, n, vnodes)
    bound = math.ceil(cf * total / n)
    for _ in range(200):
        loads = [0] * n
        loads[walk[0]], loads[walk[1]] = bound + 1, bound
        for _ in range(total - 1 - sum(loads)):
            loads[rng.choice(walk[2:])] += 1
        divided = _route_variant(key, loads, vnodes, cf, divide_first=True)
        if (max(loads[i] for i in walk[2:]) < bound and bound == _exact_bound(loads, cf, False)
                == _exact_bound(loads, cf, True) and divided == walk[1] != route(key, loads, vnodes, cf)
                and divided not in (_route_variant(key, loads, vnodes, cf, factor_outside=True),
                                    _route_variant(key, loads, vnodes, cf, no_bound=True))):
            return loads, vnodes, cf, 1
    raise RuntimeError("no loads found")  # pragma: no cover


def _route_edge() -> list[Case]:
    c = _route_case
    k4 = "a@0"
    w = ring_walk(k4, 4, 8)  # the walk of the docstring key decides the constructed loads
    full_first = [0] * 4
    full_first[w[0]] = 3
    two = [5] * 4
    two[w[0]], two[w[1]] = 2, 1
    tie = [4] * 4
    tie[w[0]] = tie[w[1]] = 1
    tie_hi_key, tie_hi = _tie(4, 8, higher=True)
    tie_lo_key, tie_lo = _tie(4, 8, higher=False)
    after = [1] * 4
    after[w[0]], after[w[1]], after[w[2]] = 9, 3, 0
    wrap = next(f"adapter-{k}" for k in range(10**5)
                if stable_hash(f"adapter-{k}") > max(stable_hash((i, v)) for i in range(3) for v in range(2)))
    ww = ring_walk(wrap, 3, 2)
    wrap_loads = [2, 2, 2]
    wrap_loads[ww[0]] = 0
    w5 = ring_walk(k4, 5, 8)
    floaty = [0] * 5  # 49 in flight, factor 1.1: 1.1 * 50 / 5 = 11.000000000000002, bound 12 (exact: 11)
    for i, load in zip(w5, (11, 10, 9, 9, 10)):
        floaty[i] = load
    return [
        # multiply, then divide: the other order lands above the whole number (first: where it fails
        # alone, the exact forms pass, so no exact-arithmetic hint is named for it)
        c("multiply_then_divide", k4, *_divide_first_case(random.Random(8), k4, 8, pick=0)),
        c("bound_in_floating_point_as_written", k4, floaty, 8, 1.1, 1),
        c("float_bound_not_the_decimal_one", "chat@2", *_float_not_exact(random.Random(6), "chat@2", 4, 8, False)),
        c("float_bound_not_the_binary_one", "chat@2", *_float_not_exact(random.Random(7), "chat@2", 4, 8, True)),
        c("idle_instances_first_of_the_walk", k4, [0, 0, 0, 0], 8, 1.25),
        c("replicas_default_1", k4, [1, 0, 2, 1], 8, 1.25),
        c("first_of_the_walk_full", k4, full_first, 8, 1.0, 1),
        c("first_of_the_walk_one_below_the_bound", k4, _plus_one_loads(random.Random(1), k4, 4, 8, 1.0), 8, 1.0, 1),
        c("one_below_the_bound_factor_1_25", "chat@2", _plus_one_loads(random.Random(2), "chat@2", 4, 8, 1.25), 8,
          1.25, 1),
        c("first_of_the_walk_exactly_at_the_bound", k4, _at_bound_loads(random.Random(4), k4, 4, 8, 1.0), 8, 1.0, 1),
        c("at_the_bound_factor_1_5", "chat@2", _at_bound_loads(random.Random(5), "chat@2", 4, 8, 1.5), 8, 1.5, 1),
        c("bound_with_factor_2", k4, [6, 0, 0, 0], 8, 2.0, 1),
        c("factor_inside_the_ceiling", k4, _factor_inside_loads(k4, 4, 8), 8, 1.25, 1),
        c("a_large_factor_keeps_the_key_home", k4, [40, 0, 7, 3], 8, 64.0, 1),
        c("the_walk_wraps_past_the_last_point", *_wrap_replica_case(random.Random(3), 3, 2)),
        c("key_past_every_ring_point_wraps", wrap, wrap_loads, 2, 1.0, 1),
        c("replicas_2_lighter_second", k4, two, 8, 2.0, 2),
        c("replicas_3", k4, [3, 3, 3, 3], 8, 2.0, 3),
        c("replicas_tie_to_earlier_in_the_walk_higher_index", tie_hi_key, tie_hi, 8, 2.0, 2),
        c("replicas_tie_to_earlier_in_the_walk_lower_index", tie_lo_key, tie_lo, 8, 2.0, 2),
        c("replicas_taken_after_the_bound", k4, after, 8, 1.0, 2),
        c("replicas_past_the_instance_count", "sql@1", [4, 2, 3], 4, 2.0, 7),
        c("one_instance", "sql@1", [12], 4, 1.0, 1),
        c("base_model_key_none", None, [0, 1, 0, 1], 4, 1.5, 1),
        c("tuple_key", ("lora", 3), [2, 0, 1, 5, 0], 3, 1.5, 2),
        c("no_instances_raises_value_error", k4, [], 8, 1.25, 1),
        c("capacity_factor_below_1_raises_value_error", k4, [0, 0], 8, 0.99, 1),
        c("replicas_0_raises_value_error", k4, [0, 0], 8, 1.25, 0),
        c("negative_load_raises_value_error", k4, [0, -1, 2], 8, 1.25, 1),
        c("vnodes_0_raises_value_error", k4, [0, 0], 0, 1.25, 1),
    ]


def _route_families(rng: random.Random, tag: str) -> list[Case]:
    n = rng.choice([3, 4, 5, 8])
    vn = rng.choice([2, 4, 8, 16])
    cf = rng.choice([1.0, 1.25, 1.5, 2.0])
    key = rng.choice(["a@", "sql@", "chat@"]) + str(rng.randrange(1000))
    w = ring_walk(key, n, vn)
    two = [rng.randint(5, 8)] * n
    two[w[0]], two[w[1]] = 3, 1
    tie_hi_key, tie_hi = _tie(n, vn, True, key)
    tie_lo_key, tie_lo = _tie(n, vn, False, key)
    after = [rng.randint(1, 2)] * n
    after[w[0]], after[w[1]], after[w[2]] = 30, 3, 0
    wrap = _wrapping_key(rng, n, 2)
    ww = ring_walk(wrap, n, 2)
    wrap_loads = [3] * n
    wrap_loads[ww[0]] = 0
    whole_loads, whole_cf = _at_whole_bound(rng, key, n, vn, cf)
    c = _route_case
    cases = [
        c(f"{tag}_idle", key, [0] * n, vn, cf, 1),
        c(f"{tag}_plus_one", key, _plus_one_loads(rng, key, n, vn, cf), vn, cf, 1),
        c(f"{tag}_at_the_bound", key, _at_bound_loads(rng, key, n, vn, cf), vn, cf, 1),
        c(f"{tag}_at_a_whole_bound", key, whole_loads, vn, whole_cf, 1),
        c(f"{tag}_factor_inside_the_ceiling", key, _factor_inside_loads(key, n, vn), vn, 1.25, 1),
        c(f"{tag}_replicas_lighter_second", key, two, vn, 2.0, 2),
        c(f"{tag}_replicas_tie_higher_index_first", tie_hi_key, tie_hi, vn, 2.0, 2),
        c(f"{tag}_replicas_tie_lower_index_first", tie_lo_key, tie_lo, vn, 2.0, 2),
        c(f"{tag}_after_the_bound", key, after, vn, 1.0, 2),
        c(f"{tag}_wrap_replicas", *_wrap_replica_case(rng, n, 2)),
        c(f"{tag}_wrap", wrap, wrap_loads, 2, 1.0, 1),
        c(f"{tag}_more_replicas_than_instances", key, [rng.randint(0, 5) for _ in range(n)], vn, 2.0, n + rng.randint(1, 3)),
    ]
    cases = [cs for cs in cases if _bounds_agree(cs.args[1], cs.args[3])]
    # the contract's floating-point bound against exact arithmetic (decimal text, binary value): each
    # lands one off the float somewhere, so an exact bound loses these (their float orders all agree)
    # (n of 3 or 5 has no such case whose float orders agree: those take 4 instances)
    n_fe = n if n in (2, 4, 8) else 4
    return cases + [c(f"{tag}_float_bound_not_the_{form}_one", key,
                      *_float_not_exact(rng, key, n_fe, vn, binary))
                    for form, binary in (("decimal", False), ("binary", True))] + [
        c(f"{tag}_multiply_then_divide", key, *_divide_first_case(rng, key, vn))]


def _route_draw(rng: random.Random, name: str) -> Case:
    while True:
        n = rng.randint(1, 8)
        loads = [rng.randint(0, 12) for _ in range(n)]
        cf = rng.choice([1.0, 1.25, 1.5, 2.0, 3.0])
        if _bounds_agree(loads, cf):
            break
    key = rng.choice([None, rng.randrange(100), f"a@{rng.randrange(100)}", ("lora", rng.randrange(9))])
    return _route_case(name, key, loads, rng.choice([1, 2, 4, 8, 16]), cf, rng.randint(1, n + 1))


def _route_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    bad = [([], 4, 1.5, 1), ([1, 2], 4, rng.choice([0.5, 0.99]), 1), ([1, 2], 4, 1.5, 0),
           ([rng.randint(0, 3), -rng.randint(1, 3)], 4, 1.5, 1), ([1, 2], 0, 1.5, 1)]
    return _route_families(rng, "family") + [_route_draw(rng, f"random_{i}") for i in range(14)] + [
        _route_case(f"random_bad_arguments_{k}", f"k{rng.randrange(99)}", *b) for k, b in enumerate(bad)]


def _route_variant(key, loads, vnodes, cf, replicas=1, **wrong):
    n = len(loads)
    walk = ring_walk(key, n, vnodes)
    if wrong.get("no_wrap"):
        points = sorted((stable_hash((i, v)), i) for i in range(n) for v in range(vnodes))
        walk = list(dict.fromkeys(i for p, i in points if p >= stable_hash(key)))
    if wrong.get("by_index"):
        walk = list(range(n))
    s = sum(loads) + (0 if wrong.get("no_plus_one") or wrong.get("patched") else 1)
    bound = math.inf if wrong.get("no_bound") else math.ceil(cf * s / n)
    if "bound_at" in wrong:  # the contract's selection under another bound (for the hint's symptom)
        bound = wrong["bound_at"]
    if wrong.get("factor_outside"):
        bound = cf * math.ceil(s / n)
    if wrong.get("no_factor"):
        bound = math.ceil(s / n)
    if wrong.get("divide_first"):  # capacity_factor * ((sum + 1) / n): another rounding
        bound = math.ceil(cf * (s / n))
    if wrong.get("int_plus_one"):  # a ceiling written as int(x) + 1 (one too many when x is whole)
        bound = int(cf * s / n) + 1
    if wrong.get("rounded"):
        bound = round(cf * s / n)
    if wrong.get("floored"):
        bound = math.floor(cf * s / n)
    if wrong.get("exact"):
        bound = math.ceil(Fraction(repr(cf)) * s / n)
    if wrong.get("exact_binary"):
        bound = math.ceil(Fraction(cf) * s / n)
    if wrong.get("patched"):
        bound = max(bound, 1)
    if wrong.get("le"):
        bound += 1
    reps = 1 if wrong.get("no_replicas") else replicas
    if wrong.get("slice_first"):
        cands = [i for i in walk[:reps] if loads[i] < bound] or [i for i in walk if loads[i] < bound][:1]
    else:
        cands = [i for i in walk if loads[i] < bound][:reps]
    if not cands:
        return None
    if wrong.get("least_loaded"):
        return min(range(n), key=lambda i: (loads[i], i))
    if wrong.get("all_open"):
        opened = [i for i in walk if loads[i] < bound]
        return min(opened, key=lambda i: (loads[i], opened.index(i)))
    if wrong.get("tie_last"):
        return min(cands, key=lambda i: (loads[i], -cands.index(i)))
    if wrong.get("tie_high"):
        return max(cands, key=lambda i: (-loads[i], i))
    if wrong.get("tie_low"):
        return min(cands, key=lambda i: (loads[i], i))
    if wrong.get("first"):
        return cands[0]
    return min(cands, key=lambda i: (loads[i], cands.index(i)))


#: Mistakes in the bound (the selection right); named after the symptom "your answer acts as if the
#: bound were ...". Messages are templates of the case's numbers (``_route_numbers``).
_ROUTE_BOUND_MISTAKES = [
    (dict(exact=True), "exact arithmetic (Fraction, Decimal, integer tricks) instead of the floating-point formula "
                       "as written: where the float lands just above a whole number its ceiling is one more (here "
                       "{cf} * {s} / {n} is {x!r} in floats: bound {bound}; exactly, on the decimal {cf}: {exact})"),
    (dict(exact_binary=True), "exact arithmetic on the float's binary value (Fraction(capacity_factor)) instead of "
                              "the floating-point formula as written: where the float product rounds to a whole "
                              "number the exact one lies just above it, and its ceiling is one more (here {cf} * "
                              "{s} / {n} is {x!r} in floats: bound {bound}; Fraction({cf}) * {s} / {n}: "
                              "{exact_binary})"),
    (dict(divide_first=True), "multiply, then divide, left to right: capacity_factor * (sum(loads) + 1) / "
                              "len(loads); dividing first rounds differently (here {cf} * ({s} / {n}) is {y!r}, "
                              "bound {divided}; {cf} * {s} / {n} is {x!r}, bound {bound})"),
    (dict(no_plus_one=True), "no +1 for this request (the bound counts the load AFTER it is placed)"),
    (dict(patched=True), "no +1 for this request, floored at 1 instead (the bound counts the load AFTER it is placed, "
                         "so it is never 0)"),
    (dict(factor_outside=True), "capacity_factor * ceil((sum(loads) + 1) / n): the factor goes inside the ceiling"),
    (dict(le=True), "open while loads[i] <= bound: an instance is open while loads[i] < bound (strictly), at the "
                    "bound it is full"),
    (dict(int_plus_one=True), "int(x) + 1 as the ceiling (one more than math.ceil(x) when x is whole)"),
    (dict(rounded=True), "round() instead of math.ceil"),
    (dict(floored=True), "floor, int() or // instead of math.ceil"),
    (dict(no_factor=True), "no capacity factor in the bound"),
    (dict(no_bound=True), "no bound at all: skip the instances at or over the bound (without it a hot adapter "
                          "overloads its home)"),
]
#: Mistakes in the selection (the walk, the replicas, the ties), the bound right.
_ROUTE_MISTAKES = [
    (dict(least_loaded=True), "follow the key's walk round the ring (consistent hashing), not the least loaded "
                              "instance overall: a key must keep its instance while it has room"),
    (dict(no_replicas=True), "with replicas > 1 the candidates are the first `replicas` open instances of the walk; "
                             "return the least loaded of them"),
    (dict(first=True), "among the candidates (open[:replicas]) return the one with the SMALLEST load"),
    (dict(slice_first=True), "filter by the bound first, then take [:replicas]: a full instance does not use up a "
                             "replica"),
    (dict(no_wrap=True), "the walk wraps round the ring: use ring_walk (a key past the last point starts at the "
                         "first)"),
    (dict(by_index=True), "walk the instances in ring_walk(adapter_key, ...) order, not 0, 1, 2, ..."),
    (dict(tie_high=True), "ties go to the earliest candidate in the walk, not the highest instance index"),
    (dict(tie_low=True), "ties go to the earliest candidate in the WALK, not the lowest instance index"),
    (dict(all_open=True), "the candidates are only the first `replicas` open instances of the walk "
                          "(open[:replicas]), not every open instance"),
    (dict(tie_last=True), "on equal loads take the candidate EARLIEST in the walk (a strict <, or min over "
                          "(load, position in the walk))"),
]


def _route_compare(case: Case, expected, got) -> Optional[str]:
    """The instance returned against the expected one, each with its load against the bound and its
    place in the key's walk."""
    key, loads, vnodes, cf = case.args[:4]
    if not isinstance(got, int) or isinstance(got, bool):
        return f"returned {type(got).__name__} {str(got)[:60]}: expected an instance index (an int)"
    if got == expected:
        return None
    bound, walk = _bound(loads, cf), ring_walk(key, len(loads), vnodes)

    def which(i: int) -> str:
        if not 0 <= i < len(loads):
            return f"{i}, which is no instance (0..{len(loads) - 1})"
        state = "full: at or over" if loads[i] >= bound else "open: below"
        return f"instance {i} (load {loads[i]}, {state} the bound {bound}; position {walk.index(i)} in the walk {walk})"
    return f"returned {which(got)}, expected {which(expected)}"


def _route_numbers(loads, cf) -> dict:
    """The case's numbers for the bound messages' templates."""
    s, n = sum(loads) + 1, len(loads)
    return dict(cf=cf, s=s, n=n, x=cf * s / n, y=cf * (s / n), bound=_bound(loads, cf), divided=math.ceil(cf * (s / n)),
                exact=_exact_bound(loads, cf, False), exact_binary=_exact_bound(loads, cf, True))


def _route_hint(case: Case, expected, got) -> Optional[str]:
    """The known mistakes that return exactly the answer's instance; where none of the selection's
    does, first the bound the answer acts on, when it is not the contract's (which instances it
    counted as full). (A selection mistake that returns the answer's instance under the contract's
    bound is never told "your answer acts as if the bound were ...": its bound may well be right.)"""
    if not isinstance(got, int) or isinstance(got, bool) or not isinstance(expected, int):
        return None
    key, loads, vnodes, cf = case.args[:4]
    bound, top = _bound(loads, cf), max(loads) + 1  # any bound above the largest load: nothing is full
    implied = [b for b in range(0, top + 1) if _route_variant(*case.args, bound_at=b) == got]
    numbers = _route_numbers(loads, cf)
    by_bound = [msg.format(**numbers) for flags, msg in _ROUTE_BOUND_MISTAKES
                if _route_variant(*case.args, **flags) == got != expected]
    by_selection = [msg for flags, msg in _ROUTE_MISTAKES
                    if _route_variant(*case.args, **flags) == got != expected]
    if not implied or bound in implied or min(bound, top) in implied or by_selection:
        return name_matches(by_selection + by_bound)
    lo, hi = min(implied), max(implied)
    acts = (f"at least {lo}, with no instance full" if hi == top else f"{lo}" if lo == hi else f"{lo}..{hi}")
    full = [i for i in range(len(loads)) if max(implied) <= loads[i] < bound]
    open_ = [i for i in range(len(loads)) if bound <= loads[i] < min(implied)]
    seen = (f"it counted instance(s) {full} as full" if full else f"it counted instance(s) {open_} as open")
    symptom = (f"your answer acts as if the bound were {acts} ({seen}); the contract's bound is {bound} = "
               f"math.ceil({cf} * ({sum(loads)} + 1) / {len(loads)}), in floating point as written "
               f"({cf} * {sum(loads) + 1} / {len(loads)} = {cf * (sum(loads) + 1) / len(loads)!r})")
    named = name_matches(by_bound + by_selection)
    return symptom + (f"; {named}" if named else "")


EXERCISES = [
    Exercise("ch11.1", "block_hashes", ("token_ids", "adapter_id", "block_size"), block_hashes, _hash_edge,
             _hash_random, _hash_hint, grade_on="cpu", compare=_hash_compare),
    Exercise("ch11.2", "admit_requests", ("waiting", "running_uids", "resident_uids", "max_loras_per_batch",
                                          "free_blocks", "max_new_seqs", "draining", "drain_active"),
             functools.partial(drive_admit, admit_requests), _admit_edge, _admit_random, _admit_hint,
             driver=drive_admit, grade_on="cpu", compare=_admit_compare),
    Exercise("ch11.3", "choose_drain", ("waiting", "running_remaining", "max_loras_per_batch", "threshold"),
             functools.partial(drive_drain, choose_drain), _drain_edge, _drain_random, _drain_hint,
             driver=drive_drain, grade_on="cpu", result_names=("drain", "uid"), compare=_drain_compare),
    Exercise("ch11.4", "route", ("adapter_key", "loads", "vnodes", "capacity_factor", "replicas"), route, _route_edge,
             _route_random, _route_hint, grade_on="cpu", compare=_route_compare),
]
