"""Cases for chapter 05 (the adapter memory pool).

Stateful exercises (the eviction policies, the slot manager) are graded by replaying traces: a driver
in this module calls the learner's class step by step in the child process and returns plain data,
one readable line per step (what was called, what it returned, the state after it); the same driver
on the reference gives the expected lines, so a report shows the first step where the two diverge.
Uids are strings (and one int), ``None`` is the base model; a free slot shows as ``EMPTY_SLOT`` only
when it holds the ``EMPTY_SLOT`` singleton of ``reference.mem_pool`` (in a trace, the string
"EMPTY_SLOT" stands for the singleton).

Case design (graders' rule): the edge group covers every clause of the exercise text and both sides
of each stated error (select_victim with no candidates and with an untracked one, alone or next to
tracked ones, the base model untracked; a slot past the end and a negative one; pin() at the limit
and below it, pinning twice; EMPTY_SLOT among the batch uids and among the running ones). The random
group replays traces with overlap (two running requests on one adapter, a batch uid that is also
running, repeated uids) made of random steps plus *probes*: steps built from the reference's state
at that point so that each rule is exercised in every draw (the base model is the oldest evictable
resident when a miss comes; a running adapter is the policy's next victim; a pinned one is; a hit
on the oldest resident precedes a miss; a batch that fits only when uids are counted once...). The
hidden group draws the same families with the secret's seed, so a mistake costs the same under any
secret.
"""
from __future__ import annotations

import functools
import random
from typing import Any, Optional

import torch

from graders.machine.exercise import Case, Exercise
from reference.eviction import FIFOEvictionPolicy, LRUEvictionPolicy
from reference.mem_pool import EMPTY_SLOT, LoRAAdapter, LoRAMemoryPool, ModuleSpec, uid_sort_key

__all__ = ["EXERCISES", "replay_policy", "replay_slots", "reference_slot_manager", "drive_load_slot",
           "load_slot", "admit"]


def _label(uid) -> str:
    if uid is EMPTY_SLOT:
        return "EMPTY_SLOT"
    text = repr(uid)
    return text + " (not reference.mem_pool.EMPTY_SLOT)" if text == "EMPTY_SLOT" else text


def _sorted(uids) -> list:
    return sorted(uids, key=lambda u: (u is not None, type(u).__name__, str(u)))


def _show(uids) -> str:
    return "[" + ", ".join(_label(u) for u in uids) + "]"


# ---------------------------------------------------------------------------------------------
# ch05.1 / ch05.2 eviction policies


def replay_policy(policy_cls, trace: list) -> list:
    """Run ``trace`` on ``policy_cls()``: ["use", uid] / ["remove", uid] / ["victim", [uids]].

    Returns one line per step: the call, what select_victim returned (or "raised ValueError"), and
    ``order()`` after the step.
    """
    policy, out = policy_cls(), []
    for i, (op, arg) in enumerate(trace, 1):
        if op == "use":
            policy.mark_used(arg)
            what = f"mark_used({_label(arg)})"
        elif op == "remove":
            policy.remove(arg)
            what = f"remove({_label(arg)})"
        else:
            what = f"select_victim({{{_show(_sorted(arg))[1:-1]}}})"
            try:
                what += f" -> {_label(policy.select_victim(set(arg)))}"
            except ValueError:
                what += " -> raised ValueError"
        out.append(f"step {i}: {what}; order() then {_show(policy.order())}")
    return out


def _policy_case(name: str, trace: list) -> Case:
    steps = "; ".join(f"{op} {arg!r}" for op, arg in trace[:12]) + ("; ..." if len(trace) > 12 else "")
    return Case(name, [trace], f"trace ({len(trace)} steps): {steps}", op="exact")


U, R, V = "use", "remove", "victim"


def _policy_edge() -> list[Case]:
    return [
        _policy_case("running_example", [[U, "A"], [U, "B"], [U, "C"], [U, "A"], [V, ["A", "C"]]]),
        _policy_case("one_candidate", [[U, "A"], [U, "B"], [V, ["B"]]]),
        _policy_case("base_model_only_as_last_resort", [[U, None], [U, "A"], [V, [None, "A"]], [V, [None]]]),
        _policy_case("removed_uid_forgotten", [[U, "A"], [U, "B"], [R, "A"], [U, "C"], [V, ["B", "C"]]]),
        _policy_case("remove_base_model", [[U, None], [U, "A"], [R, None], [U, None], [V, [None, "A"]]]),
        _policy_case("remove_untracked_is_a_no_op", [[U, "A"], [R, "Z"], [V, ["A"]]]),
        _policy_case("select_victim_removes_nothing", [[U, "A"], [U, "B"], [V, ["A", "B"]], [V, ["A", "B"]]]),
        _policy_case("no_candidates_raises_value_error", [[U, "A"], [V, []]]),
        _policy_case("untracked_candidate_raises_value_error", [[U, "A"], [V, ["Z"]]]),
        _policy_case("untracked_next_to_tracked_raises", [[U, "A"], [U, "B"], [V, ["B", "Z"]]]),
        _policy_case("removed_candidate_raises", [[U, "A"], [U, "B"], [R, "A"], [V, ["A", "B"]]]),
        _policy_case("untracked_base_model_raises", [[U, "A"], [V, [None, "A"]]]),
        _policy_case("reuse_after_remove_counts_as_new", [[U, "A"], [U, "B"], [R, "A"], [U, "A"], [V, ["A", "B"]]]),
        _policy_case("any_hashable_uid", [[U, 7], [U, "A"], [U, None], [U, 7], [V, [7, "A", None]]]),
    ]


def _random_trace(rng: random.Random, steps: int) -> list:
    """Random uses/removes/victims (candidates always tracked), then probes every draw contains."""
    uids = [None, "A", "B", "C", "D", "E", "F"]
    trace, seen = [], []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.55 or not seen:
            uid = rng.choice(uids)
            trace.append([U, uid])
            seen.append(uid) if uid not in seen else None
        elif roll < 0.7:
            uid = rng.choice(seen)
            trace.append([R, uid])
            seen.remove(uid)
        else:
            trace.append([V, rng.sample(seen, rng.randint(1, len(seen)))])
    x, y, z = rng.sample(uids[1:], 3)
    # a hit decides: use x, y, x from scratch -> LRU's victim is y, FIFO's is x
    trace += [[R, x], [R, y], [U, x], [U, y], [U, x], [V, [y, x]]]
    # from scratch, the base model is the oldest tracked uid, and not the victim while another
    # candidate exists (the oldest of the others is)
    trace += [[U, None]] + [[R, u] for u in uids] + [[U, None], [U, y], [U, x], [V, [None, x, y]], [V, [None]]]
    # removed and never-seen candidates raise, next to tracked ones too
    trace += [[R, z], [V, [z, x]], [V, ["Q", y]], [V, []], [U, z], [V, [z, x]]]
    return trace


def _policy_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_policy_case(f"random_{i}", _random_trace(rng, rng.randint(8, 30))) for i in range(4)]


def _policy_hint(kind: str):
    other_cls = FIFOEvictionPolicy if kind == "lru" else LRUEvictionPolicy
    own_cls = LRUEvictionPolicy if kind == "lru" else FIFOEvictionPolicy

    def hint(case: Case, expected, got) -> Optional[str]:
        trace = case.args[0]
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return None
        diverge = next((i for i, (e, g) in enumerate(zip(expected, got)) if e != g), None)
        if diverge is None:
            return None
        op, arg = trace[diverge]
        other = replay_policy(other_cls, trace)
        if got[diverge] == other[diverge] and op == U:
            return ("that is LRU's order: under FIFO a use of a tracked uid changes nothing (hits do not "
                    "make an adapter younger)" if kind == "fifo" else
                    "that is FIFO's order: under LRU every mark_used moves the uid to the young end, hits included")
        if op == R:
            return "remove(uid) forgets uid (and does nothing for a uid the policy does not track)"
        if op == U:
            return ("mark_used(uid) tracks uid at the young end" + (" (None is a uid like any other)" if arg is None
                                                                    else ""))
        # a victim step: what the policy tracked just before
        before = own_cls()
        for o, a in trace[:diverge]:
            before.mark_used(a) if o == U else before.remove(a) if o == R else None
        tracked = before.order()
        untracked = [u for u in arg if u not in tracked]
        text = str(got[diverge])
        if not arg:
            return "select_victim with no candidates raises ValueError"
        if untracked:
            return (f"candidate {_label(untracked[0])} is not tracked (never marked used, or removed since): "
                    "select_victim raises ValueError, even next to tracked candidates")
        if "-> None;" in text and "-> None;" not in expected[diverge]:
            return "the base model (None) is chosen only when it is the only candidate"
        if "raised" in text:
            return "every candidate is tracked here: return the first of order() among them"
        if text.split("; order()")[1] != expected[diverge].split("; order()")[1]:
            return "select_victim changes nothing: the pool calls remove() when it really evicts"
        return "the victim is the first uid of order() (next victim first) among the candidates"
    return hint


# ---------------------------------------------------------------------------------------------
# ch05.3 load_slot


def _load_case(name: str, gen: torch.Generator, modules: list[tuple[int, int]], slots: int, max_rank: int,
               slot: int, rank: int, present: list[bool], dtype=torch.float32, nan_old: bool = False) -> Case:
    """Buffers full of a previous adapter's values (with ``nan_old``, a NaN among them), NaN in other
    slots, one new adapter."""
    A_buffers = [torch.randn(slots, max_rank, d_in, generator=gen).to(dtype) for d_in, _ in modules]
    B_buffers = [torch.randn(slots, d_out, max_rank, generator=gen).to(dtype) for _, d_out in modules]
    target = slot if 0 <= slot < slots else None
    for A, B in zip(A_buffers, B_buffers):
        if slots > 1:
            other = ((target if target is not None else 0) + 1) % slots
            A[other, max_rank - 1] = float("nan")  # another slot: must stay bit for bit
        if target is not None and nan_old:  # the old adapter's NaN: a zero-fill by multiplying keeps it (0 * NaN is NaN)
            A[target, max_rank - 1, 0] = float("nan")
            B[target, 0, max_rank - 1] = float("nan")
    weights = [[torch.randn(rank, d_in, generator=gen).to(dtype), torch.randn(d_out, rank, generator=gen).to(dtype)]
               if p else None for (d_in, d_out), p in zip(modules, present)]
    desc = (f"{len(modules)} modules (in, out) {modules}, {slots} slots, max_rank {max_rank}, {str(dtype)[6:]}; "
            f"load a rank-{rank} adapter into slot {slot}; modules present {present}; the slot holds a "
            f"previous adapter's values{' (NaN among them)' if nan_old else ''}")
    return Case(name, [A_buffers, B_buffers, slot, weights, rank], desc, op="exact")


def load_slot(A_buffers, B_buffers, slot, weights, rank):
    """Reference for ch05.3: the pool's ``load_to_slot`` checks and ``_write_slot`` on plain lists
    (one layer)."""
    num_slots, max_rank = A_buffers[0].shape[0], A_buffers[0].shape[1]
    if isinstance(slot, bool) or not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot!r} outside 0..{num_slots - 1}")
    if rank > max_rank:
        raise ValueError(f"rank {rank} exceeds max_rank {max_rank}")
    for A, B in zip(A_buffers, B_buffers):
        A[slot].zero_()
        B[slot].zero_()
    for A, B, w in zip(A_buffers, B_buffers, weights):
        if w is not None:
            A[slot, :rank].copy_(w[0])
            B[slot, :, :rank].copy_(w[1])
    return A_buffers, B_buffers


def drive_load_slot(load_fn, A_buffers, B_buffers, slot, weights, rank):
    """Call the learner's ``load_slot`` and return (outcome, the buffers it was given): the pool's
    fixed buffers, not what it returns, so a version that writes into copies changes nothing; a
    refused load must leave them as they were."""
    try:
        load_fn(A_buffers, B_buffers, slot, weights, rank)
        outcome = "returned"
    except ValueError:
        outcome = "raised ValueError"
    return outcome, A_buffers, B_buffers


def _load_edge() -> list[Case]:
    g = torch.Generator().manual_seed(51)
    return [
        _load_case("q_and_v_present_rank_equals_max_rank", g, [(8, 8), (8, 8)], 2, 2, 1, 2, [True, True]),
        _load_case("v_missing_after_eviction", g, [(8, 8), (8, 8)], 1, 2, 0, 2, [True, False]),
        _load_case("rank_below_max_rank", g, [(12, 20), (12, 6)], 3, 8, 2, 3, [True, True]),
        _load_case("q_missing_first_slot", g, [(8, 8), (8, 8)], 3, 4, 0, 2, [False, True]),
        _load_case("base_model_rank_0_all_zero", g, [(8, 4), (8, 6)], 2, 4, 1, 0, [False, False]),
        _load_case("bf16_buffers", g, [(16, 8), (16, 4), (16, 4)], 4, 4, 3, 2, [True, False, True], torch.bfloat16),
        _load_case("fp16_buffers", g, [(16, 8), (16, 4)], 3, 8, 1, 5, [False, True], torch.float16),
        _load_case("old_values_hold_nan", g, [(8, 8), (8, 4)], 3, 4, 1, 2, [True, False], nan_old=True),
        _load_case("slot_past_the_end_raises", g, [(8, 8), (8, 8)], 2, 4, 2, 2, [True, True]),
        _load_case("negative_slot_raises", g, [(8, 8), (8, 8)], 2, 4, -1, 2, [True, True]),
        _load_case("rank_above_max_rank_raises", g, [(8, 8)], 2, 4, 0, 5, [True]),
    ]


def _load_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    """Every draw: each family once (missing modules, rank below/at max_rank, every dtype, first and
    last slots, both sides of the slot range, a rank past max_rank)."""
    cases = []

    def modules(n):
        return [(rng.choice([8, 12, 24, 40]), rng.choice([4, 8, 20, 36])) for _ in range(n)]

    for i, (dtype, at_max) in enumerate([(torch.float32, False), (torch.bfloat16, False), (torch.float16, True),
                                         (torch.float32, True)]):
        n_mod, slots, max_rank = rng.randint(2, 4), rng.randint(2, 5), rng.choice([4, 8, 16])
        present = [True] + [False] + [rng.random() < 0.5 for _ in range(n_mod - 2)]
        rng.shuffle(present)
        rank = max_rank if at_max else rng.randint(1, max_rank - 1)
        slot = [rng.randrange(slots), slots - 1, 0, rng.randrange(slots)][i]
        cases.append(_load_case(f"random_{i}", gen, modules(n_mod), slots, max_rank, slot, rank, present, dtype))
    slots, max_rank = rng.randint(2, 4), rng.choice([4, 8])
    cases.append(_load_case("random_old_values_hold_nan", gen, modules(3), slots, max_rank, rng.randrange(slots),
                            rng.randint(1, max_rank - 1), [True, False, True], rng.choice([torch.float32, torch.float16]),
                            nan_old=True))
    cases.append(_load_case("random_slot_past_the_end", gen, modules(2), slots, max_rank, slots,
                            rng.randint(1, max_rank), [True, True]))
    cases.append(_load_case("random_negative_slot", gen, modules(2), slots, max_rank, -rng.randint(1, slots),
                            rng.randint(1, max_rank), [True, False]))
    cases.append(_load_case("random_rank_past_max_rank", gen, modules(2), slots, max_rank, rng.randrange(slots),
                            max_rank + rng.randint(1, 3), [True, True]))
    return cases


def _load_hint(case: Case, expected, got) -> Optional[str]:
    A_in, B_in, slot, weights, rank = case.args
    if not (isinstance(got, tuple) and len(got) == 3):
        return None
    outcome, A_got, B_got = got
    num_slots, max_rank = A_in[0].shape[0], A_in[0].shape[1]
    if expected[0] != outcome:
        if expected[0] == "returned":
            return f"slot {slot} and rank {rank} are valid here (slots 0..{num_slots - 1}, max_rank {max_rank})"
        if not 0 <= slot < num_slots:
            return (f"slot {slot} is outside 0..{num_slots - 1}: raise ValueError before writing anything"
                    + (f" (a negative slot would silently write slot {num_slots + slot})" if slot < 0 else ""))
        return f"rank {rank} exceeds max_rank {max_rank}: raise ValueError before writing anything"

    def same(a, b):
        return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())

    if all(same(g.cpu(), a.cpu()) for g, a in zip([*A_got, *B_got], [*A_in, *B_in])):
        return ("the buffers you were given are unchanged: write into A_buffers[m][slot] in place (the pool's "
                "buffers keep their addresses); a copy changes nothing the kernels read")
    if outcome.startswith("raised"):
        return "a refused load changes nothing: check slot and rank before the first write"
    for m, (g, a) in enumerate(zip([*A_got, *B_got], [*A_in, *B_in])):
        for s in range(num_slots):
            if s != slot and not same(g[s].cpu(), a[s].cpu()):
                return f"slot {s} changed: only slot {slot} may be written; other slots stay bit for bit"
    exp_A, exp_B = expected[1], expected[2]
    wrong = [(g[slot].cpu(), e[slot].cpu()) for g, e in zip([*A_got, *B_got], [*exp_A, *exp_B])]
    if all(bool((g.isnan() | (g == e)).all()) for g, e in wrong) and any(bool(g.isnan().any()) for g, _ in wrong):
        return ("the old adapter's NaN survived: 0 * NaN is NaN, so zero with .zero_() or fill_(0), "
                "not by multiplying")
    low_ok = all(bool((g[slot, :rank].cpu() == e[slot, :rank].cpu()).all()) for g, e in zip(A_got, exp_A)) and \
        all(bool((g[slot, :, :rank].cpu() == e[slot, :, :rank].cpu()).all()) for g, e in zip(B_got, exp_B))
    if low_ok:
        for a, b in zip(A_got, B_got):
            if a[slot, rank:].cpu().nan_to_num(1.0).ne(0).any():
                return "rows past the adapter's rank keep old values: zero-fill the whole slot first"
            if b[slot, :, rank:].cpu().nan_to_num(1.0).ne(0).any():
                return "columns of B past the adapter's rank keep old values: zero-fill the whole slot first"
    for m, w in enumerate(weights):
        a, b = A_got[m][slot].cpu().nan_to_num(1.0), B_got[m][slot].cpu().nan_to_num(1.0)
        if w is None and (a.ne(0).any() or b.ne(0).any()):
            return (f"module {m} is absent from this adapter, and its slot still holds the previous "
                    "adapter's weights: zero-fill the whole slot (every module) before copying")
    return "A goes into rows [0, rank) of A_buffers[m][slot], B into columns [0, rank) of B_buffers[m][slot]"


# ---------------------------------------------------------------------------------------------
# ch05.4 admit


def _tiny_pool(num_slots: int, policy: str = "lru") -> LoRAMemoryPool:
    return LoRAMemoryPool([ModuleSpec("q_proj", 2, (2,))], 1, num_slots, 1, eviction_policy=policy,
                          adapter_source=_tiny_adapter)


def _tiny_adapter(uid) -> LoRAAdapter:
    return LoRAAdapter(uid, 1, 1.0, {})


def admit(request_uids, running_uids, num_slots):
    """Reference for ch05.4: the pool's admission rule with nothing pinned (the pool refuses
    num_slots < 1 with ValueError)."""
    return _tiny_pool(num_slots).admit(list(request_uids), list(running_uids))


def _admit_case(name, requests, running, slots) -> Case:
    return Case(name, [list(requests), list(running), slots],
                f"requests (uids, arrival order) {requests!r}, running {running!r}, {slots} slots", op="exact")


def _admit_edge() -> list[Case]:
    return [
        _admit_case("two_slots_A_B_base", ["A", "B", None], [], 2),
        _admit_case("request_uid_already_running", ["A", "C", "B"], ["A", "B"], 2),
        _admit_case("repeats_need_no_new_slot", ["A", "B", None, "A"], [], 2),
        _admit_case("running_adapters_take_slots", ["C", "A"], ["A", "B"], 3),
        _admit_case("later_requests_still_considered", ["A", "B", "C", "A", "B"], [], 2),
        _admit_case("nothing_fits_beyond_running", ["C", "D"], ["A", None], 2),
        _admit_case("two_running_requests_on_one_adapter", ["B", "C"], ["A", "A"], 2),
        _admit_case("base_model_running_and_requested", [None, "A", "B"], [None], 2),
        _admit_case("one_slot", [None, "A", None], [], 1),
        _admit_case("empty", [], ["A"], 1),
        _admit_case("zero_slots_raises", ["A"], [], 0),
        _admit_case("negative_slots_raises", ["A"], [], -1),
    ]


def _admit_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: running adapters that fill all but one slot (listed twice), requests for running
    uids once the slots are full, the base model arriving when they are, a deferral followed by
    repeats of admitted uids; plus free-form cases."""
    names = ["A", "B", "C", "D", "E", "F", "G"]
    cases = []
    for i in range(3):
        slots = rng.randint(2, 4)
        pool = rng.sample(names, len(names))
        running = pool[: slots - 1]
        fresh = pool[slots - 1:]
        requests = [fresh[0], fresh[1], running[0], None, fresh[2], fresh[0], running[-1]]
        requests += [rng.choice(names + [None]) for _ in range(rng.randint(0, 4))]
        shown_running = running + [rng.choice(running)]
        rng.shuffle(shown_running)
        cases.append(_admit_case(f"random_running_{i}", requests, shown_running, slots))
    for i in range(2):  # nothing running: base model late, a deferral, then repeats
        slots = rng.randint(1, 3)
        pool = rng.sample(names, slots + 1)
        requests = pool + [None] + [rng.choice(pool[:slots]) for _ in range(2)] + [rng.choice(names) for _ in range(3)]
        cases.append(_admit_case(f"random_idle_{i}", requests, [], slots))
    for i in range(2):
        slots = rng.randint(1, 4)
        running = [rng.choice(names + [None]) for _ in range(rng.randint(0, slots))]
        requests = [rng.choice(names + [None]) for _ in range(rng.randint(1, 12))]
        cases.append(_admit_case(f"random_{i}", requests, running, slots))
    return cases


def _admit_hint(case: Case, expected, got) -> Optional[str]:
    requests, running, slots = case.args
    if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(g, (list, tuple)) for g in got)):
        return "return (admitted, deferred): two lists of indices into request_uids, ascending"
    admitted_exp, admitted_got = set(expected[0]), set(got[0])
    chosen = set(running)
    for i, uid in enumerate(requests):
        if (i in admitted_exp) != (i in admitted_got):
            if i in admitted_exp:
                counted = (f"request {i} ({uid!r}) needs no new slot: its uid is already counted "
                           f"(running or admitted earlier: {_show(_sorted(chosen))})")
                if all(j not in admitted_got for j in range(i, len(requests))) and \
                        any(j not in admitted_got for j in range(i)):
                    return ("a deferred request does not stop admission: later requests are still considered"
                            + (f"; {counted}" if uid in chosen else ""))
                if uid in chosen:
                    return counted
                return (f"request {i} ({uid!r}) fits: the distinct uids so far {_show(_sorted(chosen))} plus "
                        f"{uid!r} are {len(chosen | {uid})} <= {slots} slots")
            if uid is None:
                return "the base model (None) takes a slot too (rank 0): count it among the distinct uids"
            if set(running) - {requests[j] for j in admitted_got if j < i}:
                return ("adapters of running requests occupy slots: start the distinct set from running_uids "
                        f"(here {_show(_sorted(set(running)))}; a uid running twice takes one slot)")
            return f"request {i} ({uid!r}) does not fit: {_show(_sorted(chosen))} already fill the {slots} slots"
        if i in admitted_exp:
            chosen.add(uid)
    return None


# ---------------------------------------------------------------------------------------------
# ch05.5 SlotManager: prepare a batch's slots, with eviction


def _uid(u):
    return EMPTY_SLOT if u == "EMPTY_SLOT" else u


def _events_of(manager, start: int) -> list:
    return [list(e) for e in list(manager.events)[start:]]


def _show_events(events: list) -> str:
    return "[" + ", ".join("(" + ", ".join(_label(x) if j == 1 else repr(x) for j, x in enumerate(e)) + ")"
                           for e in events) + "]"


def _show_mapping(mapping) -> str:
    if not isinstance(mapping, dict):
        return f"{type(mapping).__name__} {mapping!r}"[:120]
    return "{" + ", ".join(f"{_label(k)}: {mapping[k]!r}" for k in _sorted(mapping)) + "}"


def replay_slots(manager_cls, num_slots: int, policy: str, steps: list) -> list:
    """Run ``steps`` on ``manager_cls(num_slots, policy)``.

    A step is ["batch", uids, running] (-> prepare(uids, running)) or ["pin", uid]. Returns one line
    per step (the call, its result or "raised ValueError", the step's events, the slot table after
    it, and whether uid_to_buffer_id agrees with it), then, last, the steps' events as data (for the
    hints).
    """
    manager, lines, data = manager_cls(num_slots, policy), [], []
    for i, step in enumerate(steps, 1):
        before = len(manager.events)
        if step[0] == "pin":
            call = f"pin({_label(_uid(step[1]))})"
            try:
                manager.pin(_uid(step[1]))
                result = "ok"
            except ValueError:
                result = "raised ValueError"
        else:
            uids, running = [_uid(u) for u in step[1]], [_uid(u) for u in step[2]]
            call = f"prepare({_show(uids)}, running={_show(running)})"
            try:
                result = _show_mapping(manager.prepare(uids, running))
            except ValueError:
                result = "raised ValueError"
        events = _events_of(manager, before)
        table = list(manager.buffer_id_to_uid)
        agree = {u: s for s, u in enumerate(table) if u is not EMPTY_SLOT}
        maps = "agrees" if dict(manager.uid_to_buffer_id) == agree else \
            f"is {_show_mapping(dict(manager.uid_to_buffer_id))}, not the inverse of the slot table"
        lines.append(f"step {i}: {call} -> {result}; events {_show_events(events)}; slots {_show(table)}; "
                     f"uid_to_buffer_id {maps}")
        data.append([[[e[0], _label(e[1])] + list(e[2:]) for e in events], result.startswith("raised")])
    return lines + [data]


class reference_slot_manager:  # noqa: N801  (named like the learner's class for the driver)
    """The control-plane view of ``LoRAMemoryPool.prepare_lora_batch``: events without tiers."""

    def __init__(self, num_slots: int, policy: str) -> None:
        self._pool = _tiny_pool(num_slots, policy)

    @property
    def events(self) -> list:
        return [e[:3] for e in self._pool.events if e[0] != "cpu_evict"]

    @property
    def buffer_id_to_uid(self) -> list:
        return self._pool.buffer_id_to_uid

    @property
    def uid_to_buffer_id(self) -> dict:
        return self._pool.uid_to_buffer_id

    def pin(self, uid) -> None:
        self._pool.pin(uid)

    def prepare(self, uids, running) -> dict:
        return self._pool.prepare_lora_batch(uids, running)


def _slots_case(name, num_slots, policy, steps) -> Case:
    shown = "; ".join(f"pin {s[1]!r}" if s[0] == "pin" else f"batch {s[1]!r} running {s[2]!r}" for s in steps[:6])
    return Case(name, [num_slots, policy, steps],
                f"{num_slots} slots, {policy}; steps: {shown}{'; ...' if len(steps) > 6 else ''}", op="exact")


def _slots_edge() -> list[Case]:
    B, P = "batch", "pin"
    return [
        _slots_case("running_example_lru", 2, "lru", [[B, ["A", None], []], [B, ["B", None], []]]),
        _slots_case("hits_and_lowest_free_slot", 3, "lru", [[B, ["B"], []], [B, ["A", "B"], []], [B, ["A"], []]]),
        _slots_case("lru_vs_use_order", 2, "lru", [[B, ["A"], []], [B, ["B"], []], [B, ["A"], []], [B, ["C"], []]]),
        _slots_case("fifo_ignores_hits", 2, "fifo", [[B, ["A"], []], [B, ["B"], []], [B, ["A"], []], [B, ["C"], []]]),
        # Z sorts after C: when C's miss is handled, Z (the least recently used) has not been marked yet
        # the victim leaves the policy: loaded again, A is the youngest, and C goes first
        _slots_case("evicted_then_reloaded_fifo", 2, "fifo", [[B, ["A"], []], [B, ["B"], []], [B, ["C"], []],
                                                              [B, ["A"], []], [B, ["D"], []]]),
        _slots_case("running_never_evicted", 2, "lru", [[B, ["Z"], []], [B, ["B"], []], [B, ["C"], ["Z"]]]),
        _slots_case("running_twice_and_in_the_batch", 3, "lru", [[B, ["A", "B"], []], [B, ["B", "C"], ["A", "A", "B"]],
                                                                 [B, ["D"], ["A", "A"]]]),
        _slots_case("base_evicted_last", 2, "lru", [[B, [None], []], [B, ["A"], []], [B, ["B", "C"], []]]),
        _slots_case("over_capacity_refused_unchanged", 2, "lru", [[B, ["A"], []], [B, ["B", "C", None], []],
                                                                  [B, ["B"], []]]),
        _slots_case("repeated_uids_counted_once", 2, "fifo", [[B, ["A", "A", "B"], ["B", "A"]], [B, ["C", "C"], ["A"]]]),
        _slots_case("pinned_never_evicted", 3, "lru", [[B, ["A"], []], [P, "A"], [B, ["B", "C"], []],
                                                       [B, ["D"], []]]),
        # a resident pinned adapter the batch does not use blocks its slot: 3 other uids cannot fit
        _slots_case("pinned_resident_blocks_a_slot", 3, "lru", [[B, ["A"], []], [P, "A"], [B, ["B", "C", "D"], []],
                                                                [B, ["B", "C"], []]]),
        # a pinned resident that the batch uses blocks nothing
        _slots_case("pinned_and_needed_blocks_nothing", 2, "lru", [[B, ["A"], []], [P, "A"], [B, ["B"], ["A"]]]),
        # pinning a uid that is not resident reserves nothing yet
        _slots_case("pinned_but_not_resident_takes_no_slot", 2, "lru", [[P, "Z"], [B, ["A", "B"], []]]),
        # at most num_slots - 1 pins: 3 slots allow 2; pinning a pinned uid again is allowed
        _slots_case("pin_every_slot_raises", 3, "lru", [[P, "A"], [P, "B"], [P, "B"], [P, "C"], [B, ["C"], []]]),
        _slots_case("one_slot_pin_raises", 1, "fifo", [[P, None], [B, [None], []]]),
        _slots_case("pin_empty_slot_raises", 2, "lru", [[P, "EMPTY_SLOT"], [B, ["A"], []]]),
        _slots_case("empty_slot_in_uids_raises", 3, "lru", [[B, ["A"], []], [B, ["B", "EMPTY_SLOT"], []], [B, ["B"], []]]),
        _slots_case("empty_slot_in_running_raises", 3, "lru", [[B, ["A"], []], [B, ["B"], ["EMPTY_SLOT"]],
                                                               [B, ["B"], []]]),
    ]


class _Trace:
    """Builds a trace step by step, replaying it on the reference to know the state."""

    def __init__(self, rng: random.Random, slots: int, policy: str) -> None:
        self.rng, self.slots, self.policy = rng, slots, policy
        self.ref = reference_slot_manager(slots, policy)
        self.steps: list = []
        self.fresh = iter(f"{c}{k}" for k in range(1, 10) for c in "BCDEFGHJK")
        # names that sort before every earlier one: a miss handled before the batch's hits are marked
        self.early = iter(f"A{k:02d}" for k in range(99, 0, -1))

    def batch(self, uids, running=()) -> None:
        uids, running = list(uids), list(running)
        self.steps.append(["batch", uids, running])
        try:
            self.ref.prepare(uids, running)
        except ValueError:
            pass

    def pin(self, uid) -> None:
        self.steps.append(["pin", uid])
        try:
            self.ref.pin(uid)
        except ValueError:
            pass

    @property
    def residents(self) -> list:
        return [u for u in self.ref.buffer_id_to_uid if u is not EMPTY_SLOT]

    def evictable(self) -> list:
        """Residents the policy could evict now, in its order (next victim first), base model last."""
        pool = self.ref._pool
        order = [u for u in pool.eviction_policy.order() if u in pool.uid_to_buffer_id and u not in pool.pinned]
        return [u for u in order if u is not None] + [u for u in order if u is None]

    def fill(self) -> None:
        """Fill every free slot with new adapters (one batch, some of them also running, one twice)."""
        free = self.slots - len(self.residents)
        if free > 0:
            new = [next(self.fresh) for _ in range(free)]
            running = self.rng.sample(new, self.rng.randint(0, len(new)))
            self.batch(new + new[:1], running + running[:1])

    def noise(self, n: int) -> None:
        """Random batches of residents and new uids with overlap: a uid both new and running, a uid
        running twice; some do not fit and are refused."""
        for _ in range(n):
            pool = self.residents + [next(self.fresh), next(self.fresh), None]
            k = self.rng.randint(1, self.slots)
            batch = self.rng.sample(pool, min(k, len(pool)))
            running = [u for u in batch if self.rng.random() < 0.4]
            running += running[:1] + ([self.rng.choice(self.residents)] if self.residents and self.rng.random() < 0.5 else [])
            self.batch(batch, running)


def _slots_trace(rng: random.Random, slots: int, policy: str) -> list:
    t = _Trace(rng, slots, policy)
    a = next(t.fresh)
    # the base model loads first (into slot 0, the lowest free), then the pool fills; the base model
    # is then the oldest evictable resident when a miss comes, and is not the victim
    t.batch([a, None], [a] if rng.random() < 0.5 else [])
    t.fill()
    t.batch([next(t.fresh)])
    t.noise(rng.randint(1, 3))
    # a running adapter is the policy's next victim: it must stay (running twice, not in the batch)
    t.fill()
    v = t.evictable()[0]
    t.batch([next(t.early)], [v, v])
    t.noise(rng.randint(0, 2))
    # a hit on the oldest evictable resident, then a miss: LRU keeps it, FIFO evicts it
    t.fill()
    t.batch([t.evictable()[0]])
    t.batch([next(t.fresh)])
    # two misses of one batch are marked in the fixed (sorted) order, not in set order: when only
    # they can go, the first of them is the victim (four times: a set order passes each by chance)
    for _ in range(4):
        t.fill()
        p, q = sorted([next(t.fresh), next(t.fresh)])
        t.batch([q, p])
        t.batch([next(t.early)], [u for u in t.residents if u not in (p, q)])
    # the victim leaves the policy too: evicted, then loaded again, it is young (FIFO: not next out)
    t.fill()
    gone = t.evictable()[0]
    t.batch([next(t.fresh)])
    t.batch([gone])
    t.batch([next(t.fresh)])
    # a batch uid that is resident and the policy's next victim, with a miss sorting before it
    t.fill()
    oldest = t.evictable()[0]
    t.batch([oldest, next(t.early)])
    # a batch that fits only when repeated and running uids are counted once
    t.fill()
    keep = t.evictable()[: slots - 1]
    t.batch(keep + keep[:1], keep[::-1])
    # the policy's next victim pinned: not evicted; then a batch of slots uids without it is refused
    t.fill()
    p = t.evictable()[0]
    t.pin(p)
    t.batch([next(t.fresh)])
    others = [u for u in t.residents if u != p][: slots - 1] + [next(t.fresh)]
    t.batch(others)
    t.batch([next(t.fresh) for _ in range(slots + 1)])  # more distinct uids than slots
    t.noise(rng.randint(0, 2))
    # pins up to the limit (num_slots - 1), a repeat pin, and one too many
    for _ in range(slots - 2):
        t.pin(next(t.fresh))
    t.pin(p)
    t.pin(next(t.fresh))
    # only resident pins outside the batch block a slot: this batch of num_slots uids fits
    t.batch([p] + [next(t.fresh) for _ in range(slots - 1)])
    return t.steps


def _slots_random_cases(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i, policy in enumerate(["lru", "fifo", "lru", "fifo"]):
        slots = rng.randint(3, 5)
        cases.append(_slots_case(f"random_{i}_{policy}", slots, policy, _slots_trace(rng, slots, policy)))
    return cases


def _slots_hint(case: Case, expected, got) -> Optional[str]:
    num_slots, policy, steps = case.args
    if not isinstance(got, tuple) or len(got) != len(expected) or not isinstance(got[-1], tuple):
        return None
    diverge = next((i for i, (e, g) in enumerate(zip(expected[:-1], got[:-1])) if e != g), None)
    if diverge is None:
        return None
    step = steps[diverge]
    e_events, e_refused = expected[-1][diverge]
    g_events, g_refused = got[-1][diverge]
    g_events = [list(x) for x in g_events]
    # the reference's state before this step (the learner's matched it up to here)
    ref = reference_slot_manager(num_slots, policy)
    replay_slots(lambda n, p: ref, num_slots, policy, steps[:diverge])
    pool = ref._pool
    if step[0] == "pin":
        uid = _uid(step[1])
        if uid is EMPTY_SLOT:
            return "EMPTY_SLOT is not a uid: pin(EMPTY_SLOT) raises ValueError"
        if e_refused and not g_refused:
            return (f"{len(pool.pinned)} of {num_slots} slots' uids are pinned already: pinning one more would "
                    "leave no slot evictable, so pin() raises ValueError (at most num_slots - 1 pins)")
        if g_refused and not e_refused:
            return ("pinning is idempotent (a pinned uid pinned again changes nothing), and allowed while "
                    "fewer than num_slots - 1 uids are pinned, resident or not")
        return None
    uids, running = [_uid(u) for u in step[1]], [_uid(u) for u in step[2]]
    needed = set(uids) | set(running)
    if e_refused != g_refused:
        if EMPTY_SLOT in needed:
            return "EMPTY_SLOT among the uids or running marks nothing a request can use: raise ValueError"
        if e_refused:
            blocked = pool._blocked(needed)
            return (f"{len(needed)} distinct uids" + (f" plus {len(blocked)} pinned resident(s) not in the batch"
                                                       if blocked else "") + f" do not fit {num_slots} slots: "
                    "raise ValueError before the first event, with nothing changed")
        return (f"the batch needs {len(needed)} distinct uids (repeats and running uids counted once, pinned "
                "uids only when resident and not needed): it fits")
    if e_refused and g_events:
        return "a refused batch must leave everything unchanged: check capacity before the first event or load"
    if g_events == e_events:  # same events: the returned mapping, the table or uid_to_buffer_id differ
        if "uid_to_buffer_id is" in str(got[diverge]):
            return "uid_to_buffer_id must stay the inverse of buffer_id_to_uid (drop an evicted uid from it)"
        if str(got[diverge]).split(" -> ")[1].split("; events")[0] != str(expected[diverge]).split(" -> ")[1].split("; events")[0]:
            return "prepare returns {uid: slot} for every needed uid, running ones included"
        return "a free slot holds EMPTY_SLOT (reference.mem_pool's singleton), not None (the base model)"
    residents = dict(pool.uid_to_buffer_id)
    for e in g_events:
        if e and e[0] == "evict":
            victim = next((u for u in residents if _label(u) == e[1]), e[1])
            if victim in running:
                return (f"{e[1]} belongs to a running request and was evicted: the set to keep is uids | running "
                        "(running may repeat a uid, or share one with the batch)")
            if victim in needed:
                return f"{e[1]} is used by this very batch and was evicted: candidates exclude every needed uid"
            if victim in pool.pinned:
                return f"{e[1]} is pinned and was evicted: candidates exclude pinned uids"
            if victim is None and len(set(residents) - needed - pool.pinned) > 1:
                return "the base model (None) is evicted only when it is the only candidate"
    pairs = sorted(str(x[:2]) for x in e_events if x[0] != "evict")
    if pairs == sorted(str(x[:2]) for x in g_events if x[0] != "evict") and \
            [x[:2] for x in e_events if x[0] != "evict"] != [x[:2] for x in g_events if x[0] != "evict"]:
        return "go through the needed uids in a fixed order: the base model (None) first, then sorted"
    free = [s for s, u in enumerate(pool.buffer_id_to_uid) if u is EMPTY_SLOT]
    for e in g_events:
        if e and e[0] == "load" and len(e) > 2 and free and e[2] != free[0] and e[2] in free:
            return f"a miss takes the lowest free slot ({free[0]} here)"
    if any(e[0] == "evict" for e in e_events) and any(e[0] == "evict" for e in g_events):
        return (f"the victim is the policy's ({policy!r}) pick among residents neither needed nor pinned; "
                "every needed uid is marked used, hits included, in the fixed order")
    return None


EXERCISES = [
    Exercise("ch05.1", "LRUEvictionPolicy", ("trace",), functools.partial(replay_policy, LRUEvictionPolicy),
             _policy_edge, _policy_random, _policy_hint("lru"), driver=replay_policy),
    Exercise("ch05.2", "FIFOEvictionPolicy", ("trace",), functools.partial(replay_policy, FIFOEvictionPolicy),
             _policy_edge, _policy_random, _policy_hint("fifo"), driver=replay_policy),
    Exercise("ch05.3", "load_slot", ("A_buffers", "B_buffers", "slot", "weights", "rank"),
             functools.partial(drive_load_slot, load_slot), _load_edge, _load_random, _load_hint,
             driver=drive_load_slot, result_names=("outcome", "A_buffers", "B_buffers")),
    Exercise("ch05.4", "admit", ("request_uids", "running_uids", "num_slots"), admit, _admit_edge, _admit_random,
             _admit_hint, result_names=("admitted", "deferred")),
    Exercise("ch05.5", "SlotManager", ("num_slots", "policy", "steps"),
             functools.partial(replay_slots, reference_slot_manager), _slots_edge, _slots_random_cases, _slots_hint,
             driver=replay_slots),
]
