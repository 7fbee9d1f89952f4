"""Cases for chapter 05 (the adapter memory pool).

Stateful exercises (the eviction policies, the slot manager) are graded by replaying seeded traces:
a driver in this module calls the learner's class step by step in the child process and returns
plain data (victims chosen, event logs, slot tables); the same driver on the reference gives the
expected data, and the report names the first step where the two diverge. Uids are strings, and
``None`` is the base model; a free slot is reported as the string "EMPTY_SLOT" only when it holds
the ``EMPTY_SLOT`` singleton of ``reference.mem_pool``.
"""
from __future__ import annotations

import functools
import random
from typing import Any, Optional

import torch

from graders.core import Case, Exercise
from reference.eviction import FIFOEvictionPolicy, LRUEvictionPolicy
from reference.mem_pool import EMPTY_SLOT, LoRAAdapter, LoRAMemoryPool, ModuleSpec

__all__ = ["EXERCISES", "replay_policy", "replay_slots", "reference_slot_manager", "drive_load_slot"]


# ---------------------------------------------------------------------------------------------
# ch05.1 / ch05.2 eviction policies


def replay_policy(policy_cls, trace: list) -> list:
    """Run ``trace`` on ``policy_cls()``: ["use", uid] / ["remove", uid] / ["victim", [uids]].

    Returns one entry per "victim" step (the uid chosen, or "ValueError" when it raised one) and,
    last, the policy's ``order()`` as a list.
    """
    policy, out = policy_cls(), []
    for op, arg in trace:
        if op == "use":
            policy.mark_used(arg)
        elif op == "remove":
            policy.remove(arg)
        else:
            try:
                out.append(policy.select_victim(set(arg)))
            except ValueError:
                out.append("ValueError")
    out.append(list(policy.order()))
    return out


def _policy_case(name: str, trace: list) -> Case:
    steps = "; ".join(f"{op} {arg!r}" for op, arg in trace[:14]) + ("; ..." if len(trace) > 14 else "")
    return Case(name, [trace], f"trace ({len(trace)} steps): {steps}", op="exact")


def _policy_edge() -> list[Case]:
    U, R, V = "use", "remove", "victim"
    return [
        _policy_case("running_example", [[U, "A"], [U, "B"], [U, "C"], [U, "A"], [V, ["A", "C"]]]),
        _policy_case("one_candidate", [[U, "A"], [U, "B"], [V, ["B"]]]),
        _policy_case("base_model_only_as_last_resort", [[U, None], [U, "A"], [V, [None, "A"]], [V, [None]]]),
        _policy_case("removed_uid_forgotten", [[U, "A"], [U, "B"], [R, "A"], [U, "C"], [V, ["B", "C"]]]),
        _policy_case("remove_untracked_is_a_no_op", [[U, "A"], [R, "Z"], [V, ["A"]]]),
        _policy_case("no_candidates_raises_value_error", [[U, "A"], [V, []]]),
        _policy_case("reuse_after_remove_counts_as_new", [[U, "A"], [U, "B"], [R, "A"], [U, "A"], [V, ["A", "B"]]]),
    ]


def _random_trace(rng: random.Random, steps: int) -> list:
    uids = [None, "A", "B", "C", "D", "E"]
    trace, seen = [], []
    for _ in range(steps):
        roll = rng.random()
        if roll < 0.55 or not seen:
            uid = rng.choice(uids)
            trace.append(["use", uid])
            seen.append(uid) if uid not in seen else None
        elif roll < 0.7:
            uid = rng.choice(seen)
            trace.append(["remove", uid])
            seen.remove(uid)
        else:
            trace.append(["victim", rng.sample(seen, rng.randint(1, len(seen)))])
    # every trace ends by testing the base-model rule: the base model is the oldest use, yet not the victim
    if None not in seen:
        trace.append(["use", None])
    others = [u for u in uids if u in seen and u is not None]
    if others:
        trace += [["use", u] for u in others] + [["victim", [None] + others]]
    return trace


def _policy_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    return [_policy_case(f"random_{i}", _random_trace(rng, rng.randint(8, 40))) for i in range(4)]


def _policy_hint(kind: str):
    def hint(case: Case, expected, got) -> Optional[str]:
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return None
        order_exp, order_got = expected[-1], list(got[-1]) if isinstance(got[-1], (list, tuple)) else None
        victims = [(i, e, g) for i, (e, g) in enumerate(zip(expected[:-1], got[:-1])) if e != g]
        if victims:
            i, e, g = victims[0]
            msg = f"victim step {i + 1}: expected {e!r}, got {g!r}"
            if e == "ValueError":
                msg += " (select_victim with no candidates raises ValueError)"
            if e is not None and g is None and e != "ValueError":
                msg += "; the base model (None) is chosen only when it is the only candidate"
            return msg
        if order_got is not None and order_got != order_exp:
            if kind == "fifo" and order_got == replay_policy(LRUEvictionPolicy, case.args[0])[-1]:
                return "that is LRU's order: under FIFO a use of a resident adapter does not make it younger"
            if kind == "lru" and order_got == replay_policy(FIFOEvictionPolicy, case.args[0])[-1]:
                return "that is FIFO's order: under LRU every use moves the uid to the young end"
            return f"order() after the trace: expected {order_exp!r}, got {order_got!r}"
        return None
    return hint


# ---------------------------------------------------------------------------------------------
# ch05.3 load_slot


def _load_case(name: str, gen: torch.Generator, modules: list[tuple[int, int]], slots: int, max_rank: int,
               slot: int, rank: int, present: list[bool], dtype=torch.float32) -> Case:
    """Buffers full of a previous adapter's values (and NaN in other slots' padding), one new adapter."""
    A_buffers = [torch.randn(slots, max_rank, d_in, generator=gen).to(dtype) for d_in, _ in modules]
    B_buffers = [torch.randn(slots, d_out, max_rank, generator=gen).to(dtype) for _, d_out in modules]
    for A in A_buffers:
        if slots > 1:
            A[(slot + 1) % slots, max_rank - 1] = float("nan")  # another slot: must stay bit for bit
        A[slot, max_rank - 1, 0] = float("nan")  # the old adapter's NaN: zero-fill must remove it (0 * NaN is NaN)
    weights = [(torch.randn(rank, d_in, generator=gen).to(dtype), torch.randn(d_out, rank, generator=gen).to(dtype))
               if p else None for (d_in, d_out), p in zip(modules, present)]
    desc = (f"{len(modules)} modules (in, out) {modules}, {slots} slots, max_rank {max_rank}; load a rank-{rank} "
            f"adapter into slot {slot}; modules present {present}; the slot holds a previous adapter's values")
    return Case(name, [A_buffers, B_buffers, slot, weights, rank], desc, op="exact")


def load_slot(A_buffers, B_buffers, slot, weights, rank):
    """Reference for ch05.3: the pool's ``_write_slot`` on plain lists (one layer)."""
    for A, B in zip(A_buffers, B_buffers):
        A[slot].zero_()
        B[slot].zero_()
    for A, B, w in zip(A_buffers, B_buffers, weights):
        if w is not None:
            A[slot, :w[0].shape[0]].copy_(w[0])
            B[slot, :, :rank].copy_(w[1])
    return A_buffers, B_buffers


def drive_load_slot(load_fn, A_buffers, B_buffers, slot, weights, rank):
    """Call the learner's ``load_slot`` and return the buffers it was given (the pool's fixed
    buffers): what it returns is not used, so a version that writes into copies changes nothing."""
    load_fn(A_buffers, B_buffers, slot, weights, rank)
    return A_buffers, B_buffers


def _load_edge() -> list[Case]:
    g = torch.Generator().manual_seed(51)
    return [
        _load_case("q_and_v_present", g, [(8, 8), (8, 8)], 2, 2, 1, 2, [True, True]),
        _load_case("v_missing_after_eviction", g, [(8, 8), (8, 8)], 1, 2, 0, 2, [True, False]),
        _load_case("rank_below_max_rank", g, [(12, 20), (12, 6)], 3, 8, 2, 3, [True, True]),
        _load_case("nothing_present_all_zero", g, [(8, 4)], 2, 4, 0, 1, [False]),
        _load_case("bf16_buffers", g, [(16, 8), (16, 4), (16, 4)], 4, 4, 3, 4, [True, False, True], torch.bfloat16),
    ]


def _load_random(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        n_mod, slots, max_rank = rng.randint(1, 4), rng.randint(1, 5), rng.choice([2, 4, 8, 16])
        modules = [(rng.choice([8, 12, 24]), rng.choice([4, 8, 20])) for _ in range(n_mod)]
        present = [rng.random() < 0.6 for _ in range(n_mod)]
        cases.append(_load_case(f"random_{i}", gen, modules, slots, max_rank, rng.randrange(slots),
                                rng.randint(1, max_rank), present, rng.choice([torch.float32, torch.bfloat16])))
    return cases


def _load_hint(case: Case, expected, got) -> Optional[str]:
    A_buffers, B_buffers, slot, weights, rank = case.args
    if not (isinstance(got, tuple) and len(got) == 2):
        return None
    if all(torch.equal(g.cpu().nan_to_num(7.0), a.cpu().nan_to_num(7.0)) for g, a in zip(got[0], A_buffers)):
        return ("the buffers you were given are unchanged: write into A_buffers[m][slot] in place (the pool's "
                "buffers keep their addresses); a copy changes nothing the kernels read")
    for m, w in enumerate(weights):
        if w is None and isinstance(got[0][m], torch.Tensor) and bool(got[0][m][slot].ne(0).any()):
            return (f"module {m} is absent from this adapter, and its slot still holds the previous "
                    "adapter's weights: zero-fill the whole slot (every module) before copying")
    for m, w in enumerate(weights):
        if w is not None and isinstance(got[0][m], torch.Tensor) and bool(got[0][m][slot, rank:].ne(0).any()):
            return "rows past the adapter's rank keep old values: zero-fill the whole slot first"
    return None


# ---------------------------------------------------------------------------------------------
# ch05.4 admit


def _tiny_pool(num_slots: int, policy: str = "lru") -> LoRAMemoryPool:
    source = functools.partial(_tiny_adapter)
    return LoRAMemoryPool([ModuleSpec("q_proj", 2, (2,))], 1, num_slots, 1, eviction_policy=policy,
                          adapter_source=source)


def _tiny_adapter(uid) -> LoRAAdapter:
    return LoRAAdapter(uid, 1, 1.0, {})


def admit(request_uids, running_uids, num_slots):
    """Reference for ch05.4: the pool's admission rule with nothing pinned."""
    return _tiny_pool(num_slots).admit(list(request_uids), list(running_uids))


def _admit_case(name, requests, running, slots) -> Case:
    return Case(name, [list(requests), list(running), slots],
                f"requests (uids, arrival order) {requests!r}, running {running!r}, {slots} slots", op="exact")


def _admit_edge() -> list[Case]:
    return [
        _admit_case("two_slots_A_B_base", ["A", "B", None], [], 2),
        _admit_case("repeats_need_no_new_slot", ["A", "B", None, "A"], [], 2),
        _admit_case("running_adapters_take_slots", ["C", "A"], ["A", "B"], 3),
        _admit_case("later_requests_still_considered", ["A", "B", "C", "A", "B"], [], 2),
        _admit_case("nothing_fits_beyond_running", ["C", "D"], ["A", None], 2),
        _admit_case("empty", [], ["A"], 1),
    ]


def _admit_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    pool = [None, "A", "B", "C", "D", "E", "F"]
    cases = []
    for i in range(5):
        slots = rng.randint(1, 4)
        running = rng.sample(pool, rng.randint(0, slots))
        requests = [rng.choice(pool) for _ in range(rng.randint(1, 12))]
        cases.append(_admit_case(f"random_{i}", requests, running, slots))
    return cases


def _admit_hint(case: Case, expected, got) -> Optional[str]:
    requests, running, slots = case.args
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], tuple):
        admitted = list(got[0])
        if None in [requests[i] for i in admitted if i < len(requests)] and None not in running and len(
                {requests[i] for i in admitted if i < len(requests)} | set(running)) > slots:
            return "the base model (None) takes a slot too (rank 0): count it among the distinct uids"
        if running and admitted == expected[0][: len(admitted)] and len(admitted) > len(expected[0]):
            return "adapters of running requests occupy slots: start the distinct set from running_uids"
    return None


# ---------------------------------------------------------------------------------------------
# ch05.5 SlotManager: prepare a batch's slots, with eviction


def _slot_label(uid):
    return "EMPTY_SLOT" if uid is EMPTY_SLOT else uid


def replay_slots(manager_cls, num_slots: int, policy: str, steps: list) -> list:
    """Run ``steps`` on ``manager_cls(num_slots, policy)``.

    A step is ["batch", uids, running] (-> prepare(uids, running)) or ["pin", uid]. Returns one entry
    per step: [events of the step, slot table after it] (events as lists; "ValueError" instead of
    the events when prepare raised one, in which case the slot table must be unchanged).
    """
    manager, out = manager_cls(num_slots, policy), []
    for step in steps:
        before = len(manager.events)
        if step[0] == "pin":
            manager.pin(step[1])
            events: Any = []
        else:
            try:
                manager.prepare(list(step[1]), list(step[2]))
                events = [list(e) for e in manager.events[before:]]
            except ValueError:  # refused: nothing may have changed, the event log included
                events = "ValueError" if len(manager.events) == before else \
                    ["ValueError after logging"] + [list(e) for e in manager.events[before:]]
        out.append([events, [_slot_label(u) for u in manager.buffer_id_to_uid]])
    return out


class reference_slot_manager:  # noqa: N801  (named like the learner's class for the driver)
    """The control-plane view of ``LoRAMemoryPool.prepare_lora_batch``: events without tiers."""

    def __init__(self, num_slots: int, policy: str) -> None:
        self._pool = _tiny_pool(num_slots, policy)

    @property
    def events(self) -> list:
        return [e[:3] for e in self._pool.events]

    @property
    def buffer_id_to_uid(self) -> list:
        return self._pool.buffer_id_to_uid

    def pin(self, uid) -> None:
        self._pool.pin(uid)

    def prepare(self, uids, running) -> dict:
        return self._pool.prepare_lora_batch(uids, running)


def _slots_case(name, num_slots, policy, steps) -> Case:
    shown = "; ".join(f"pin {s[1]!r}" if s[0] == "pin" else f"batch {s[1]!r} running {s[2]!r}" for s in steps[:8])
    return Case(name, [num_slots, policy, steps],
                f"{num_slots} slots, {policy}; steps: {shown}{'; ...' if len(steps) > 8 else ''}", op="exact")


def _slots_edge() -> list[Case]:
    B = "batch"
    return [
        _slots_case("running_example_lru", 2, "lru", [[B, ["A", None], []], [B, ["B", None], []]]),
        _slots_case("hits_and_lowest_free_slot", 3, "lru", [[B, ["B"], []], [B, ["A", "B"], []], [B, ["A"], []]]),
        _slots_case("lru_vs_use_order", 2, "lru", [[B, ["A"], []], [B, ["B"], []], [B, ["A"], []], [B, ["C"], []]]),
        _slots_case("fifo_ignores_hits", 2, "fifo", [[B, ["A"], []], [B, ["B"], []], [B, ["A"], []], [B, ["C"], []]]),
        # Z sorts after C: when C's miss is handled, Z (the least recently used) has not been marked yet
        _slots_case("running_never_evicted", 2, "lru", [[B, ["Z"], []], [B, ["B"], []], [B, ["C"], ["Z"]]]),
        _slots_case("base_evicted_last", 2, "lru", [[B, [None], []], [B, ["A"], []], [B, ["B", "C"], []]]),
        _slots_case("over_capacity_refused_unchanged", 2, "lru", [[B, ["A"], []], [B, ["B", "C", None], []],
                                                                  [B, ["B"], []]]),
        _slots_case("pinned_never_evicted", 3, "lru", [[B, ["A"], []], ["pin", "A"], [B, ["B", "C"], []],
                                                       [B, ["D"], []]]),
        # a resident pinned adapter the batch does not use blocks its slot: 3 other uids cannot fit
        _slots_case("pinned_resident_blocks_a_slot", 3, "lru", [[B, ["A"], []], ["pin", "A"], [B, ["B", "C", "D"], []],
                                                                [B, ["B", "C"], []]]),
        # pinning a uid that is not resident reserves nothing yet
        _slots_case("pinned_but_not_resident_takes_no_slot", 2, "lru", [["pin", "Z"], [B, ["A", "B"], []]]),
    ]


def _slots_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    uids = [None, "A", "B", "C", "D", "E", "F", "G"]
    cases = []
    for i, policy in enumerate(["lru", "fifo", "lru", "fifo"]):
        slots = rng.randint(2, 4)
        steps = []
        for _ in range(rng.randint(6, 16)):
            batch = rng.sample(uids, rng.randint(1, slots + (1 if rng.random() < 0.1 else 0)))
            running = rng.sample(batch, rng.randint(0, len(batch) - 1)) if len(batch) > 1 else []
            steps.append(["batch", [u for u in batch if u not in running], running])
        cases.append(_slots_case(f"random_{i}", slots, policy, steps))
    return cases


def _slots_hint(case: Case, expected, got) -> Optional[str]:
    if not isinstance(got, tuple) or len(got) != len(expected):
        return None
    steps = case.args[2]
    for i, (e, g) in enumerate(zip(expected, got)):
        g_events = g[0] if isinstance(g, tuple) and g else None
        g_events = [list(x) for x in g_events] if isinstance(g_events, tuple) else g_events
        g_slots = list(g[1]) if isinstance(g, tuple) and len(g) > 1 and isinstance(g[1], tuple) else g
        if g_events == e[0] and g_slots == e[1]:
            continue
        step = steps[i]
        what = f"pin {step[1]!r}" if step[0] == "pin" else f"batch {step[1]!r} with running {step[2]!r}"
        msg = f"first divergence at step {i + 1} ({what}): expected events {e[0]!r}, slots {e[1]!r}; got events {g_events!r}, slots {g_slots!r}"
        evicted = [x[1] for x in (g_events if isinstance(g_events, list) else []) if x and x[0] == "evict"]
        running = [u for u in evicted if step[0] == "batch" and u in step[2]]
        if running:
            msg += (f"; {running[0]!r} belongs to a running request and was evicted: the set to keep is "
                    "uids | running")
        if e[0] == "ValueError" and g_events != "ValueError":
            msg += "; a refused batch must leave everything unchanged: check capacity before the first event or load"
        elif isinstance(g_slots, list) and None in g_slots and "EMPTY_SLOT" in e[1] and g_slots.count(None) > e[1].count(None):
            msg += "; a free slot holds EMPTY_SLOT, not None (None is the base model, a real uid)"
        return msg
    return None


EXERCISES = [
    Exercise("ch05.1", "LRUEvictionPolicy", ("trace",), functools.partial(replay_policy, LRUEvictionPolicy),
             _policy_edge, _policy_random, _policy_hint("lru"), driver=replay_policy),
    Exercise("ch05.2", "FIFOEvictionPolicy", ("trace",), functools.partial(replay_policy, FIFOEvictionPolicy),
             _policy_edge, _policy_random, _policy_hint("fifo"), driver=replay_policy),
    Exercise("ch05.3", "load_slot", ("A_buffers", "B_buffers", "slot", "weights", "rank"),
             functools.partial(drive_load_slot, load_slot), _load_edge, _load_random, _load_hint,
             driver=drive_load_slot),
    Exercise("ch05.4", "admit", ("request_uids", "running_uids", "num_slots"), admit, _admit_edge, _admit_random,
             _admit_hint),
    Exercise("ch05.5", "SlotManager", ("num_slots", "policy", "steps"),
             functools.partial(replay_slots, reference_slot_manager), _slots_edge, _slots_random, _slots_hint,
             driver=replay_slots),
]
