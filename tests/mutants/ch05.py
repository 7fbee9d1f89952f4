"""Wrong answers for chapter 05, the adapter memory pool (graders.course.mutation.Mutant): each is the
solution cell with one realistic change. The classes are graded through the drivers of graders/chapters/ch05.py
(replayed traces), so these are edits of the class bodies: state (an order, a protected set, a
count), error clauses (both sides), and for load_slot the layout of the zero-fill and its poison."""
from graders.course.mutation import Mutant

_BASE_RULE = "        allowed = set(candidates) - {None} or set(candidates)\n"
_UNTRACKED = ("        if any(uid not in self._order for uid in candidates):\n"
              "            raise ValueError(\"a candidate was never marked used\")\n")
_NEXT = "        return next(uid for uid in self._order if uid in allowed)"


def _policy_mutants(ex: str) -> list:
    """Mistakes of select_victim and remove, the same in both policies."""
    return [
        Mutant(ex, "untracked-candidates-accepted", ((_UNTRACKED, ""),),
               "select_victim raises ValueError, even next to tracked candidates", "error"),
        Mutant(ex, "untracked-only-when-alone",
               (("if any(uid not in self._order", "if all(uid not in self._order"),),
               "even next to tracked candidates", "error"),
        Mutant(ex, "no-candidates-stop-iteration",
               (("        if not candidates:\n            raise ValueError(\"no candidates\")\n", ""),),
               "raised StopIteration", "error"),
        Mutant(ex, "youngest-first", ((_NEXT, "        return next(uid for uid in reversed(self._order) if uid in allowed)"),),
               "the victim is the first uid of order()", "state"),
        Mutant(ex, "select-victim-evicts", ((_NEXT, "        victim = next(uid for uid in self._order if uid in allowed)\n"
                                                    "        del self._order[victim]\n        return victim"),),
               "select_victim changes nothing", "state"),
        Mutant(ex, "remove-untracked-raises", (("        self._order.pop(uid, None)", "        del self._order[uid]"),),
               "raised KeyError", "clause"),
    ]


MUTANTS = [
    # ch05.1 LRUEvictionPolicy
    Mutant("ch05.1", "base-model-like-any-adapter", ((_BASE_RULE, "        allowed = set(candidates)\n"),),
           "only when it is the only candidate", "state", plausible=True),
    Mutant("ch05.1", "hit-does-not-refresh",
           (("        self._order[uid] = None\n        self._order.move_to_end(uid)", "        self._order.setdefault(uid, None)"),),
           "that is FIFO's order", "state"),
    Mutant("ch05.1", "order-youngest-first", (("        return tuple(self._order)", "        return tuple(reversed(self._order))"),),
           "tracks uid at the young end", "state"),
    *_policy_mutants("ch05.1"),
    # ch05.2 FIFOEvictionPolicy
    Mutant("ch05.2", "hit-refreshes-like-lru",
           (("        self._order.setdefault(uid, None)", "        self._order.pop(uid, None)\n        self._order[uid] = None"),),
           "that is LRU's order", "state", plausible=True),
    Mutant("ch05.2", "base-model-like-any-adapter", ((_BASE_RULE, "        allowed = set(candidates)\n"),),
           "only when it is the only candidate", "state"),
    Mutant("ch05.2", "remove-forgets-nothing", (("    def remove(self, uid):\n        self._order.pop(uid, None)",
                                                 "    def remove(self, uid):\n        pass"),),
           "remove(uid) forgets uid", "state"),
    Mutant("ch05.2", "no-candidates-returns-none", (("raise ValueError(\"no candidates\")", "return None"),),
           "select_victim with no candidates raises ValueError", "error"),
    *_policy_mutants("ch05.2"),
    # ch05.3 load_slot
    Mutant("ch05.3", "no-zero-fill",
           (("    for A, B in zip(A_buffers, B_buffers):\n        A[slot].zero_()\n        B[slot].zero_()\n", ""),),
           "zero-fill the whole slot", "layout", plausible=True),
    Mutant("ch05.3", "zero-fill-up-to-rank",
           (("        A[slot].zero_()\n        B[slot].zero_()", "        A[slot, :rank].zero_()\n        B[slot, :, :rank].zero_()"),),
           "rows past the adapter's rank keep old values", "layout"),
    Mutant("ch05.3", "zero-fill-only-present-modules",
           (("    for A, B in zip(A_buffers, B_buffers):\n        A[slot].zero_()\n        B[slot].zero_()\n", ""),
            ("        if w is not None:\n", "        if w is not None:\n            A[slot].zero_()\n            B[slot].zero_()\n")),
           "is absent from this adapter", "layout"),
    Mutant("ch05.3", "writes-into-new-buffers",
           (("    for A, B in zip(A_buffers, B_buffers):\n        A[slot].zero_()",
             "    A_buffers = [A.clone() for A in A_buffers]\n    B_buffers = [B.clone() for B in B_buffers]\n"
             "    for A, B in zip(A_buffers, B_buffers):\n        A[slot].zero_()"),),
           "the buffers you were given are unchanged", "layout"),
    Mutant("ch05.3", "zero-by-multiplying",
           (("        A[slot].zero_()\n        B[slot].zero_()", "        A[slot].mul_(0)\n        B[slot].mul_(0)"),),
           "0 * NaN is NaN", "poison"),
    Mutant("ch05.3", "zero-fill-every-slot",
           (("        A[slot].zero_()\n        B[slot].zero_()", "        A.zero_()\n        B.zero_()"),),
           "only slot", "clause"),
    Mutant("ch05.3", "negative-slot-accepted", (("    if not 0 <= slot < num_slots:", "    if slot >= num_slots:"),),
           "a negative slot would silently write slot", "error"),
    Mutant("ch05.3", "no-slot-check",
           (("    if not 0 <= slot < num_slots:\n        raise ValueError(f\"slot {slot} outside 0..{num_slots - 1}\")\n", ""),),
           "raised IndexError", "error"),
    Mutant("ch05.3", "rank-checked-after-zero-fill",
           (("    if rank > max_rank:\n        raise ValueError(f\"rank {rank} exceeds max_rank {max_rank}\")\n", ""),
            ("        B[slot].zero_()\n", "        B[slot].zero_()\n    if rank > max_rank:\n"
                                        "        raise ValueError(f\"rank {rank} exceeds max_rank {max_rank}\")\n")),
           "a refused load changes nothing", "error"),
    # ch05.4 admit
    Mutant("ch05.4", "running-not-counted", (("set(running_uids), [], []", "set(), [], []"),),
           "adapters of running requests occupy slots", "state", plausible=True),
    Mutant("ch05.4", "every-request-takes-a-new-slot",
           (("        if len(chosen | {uid}) <= num_slots:", "        if len(chosen) + 1 <= num_slots:"),),
           "needs no new slot", "state"),
    Mutant("ch05.4", "a-slot-per-running-request",
           (("set(running_uids), [], []", "set(), [], []"),
            ("        if len(chosen | {uid}) <= num_slots:", "        if len(running_uids) + len(chosen | {uid}) <= num_slots:")),
           "needs no new slot", "state"),
    Mutant("ch05.4", "base-model-free",
           (("        if len(chosen | {uid}) <= num_slots:", "        if uid is None or len(chosen | {uid}) <= num_slots:"),),
           "the base model (None) takes a slot too", "state"),
    Mutant("ch05.4", "stop-at-first-deferral",
           (("            deferred.append(i)", "            deferred.extend(range(i, len(request_uids)))\n            break"),),
           "a deferred request does not stop admission", "state"),
    Mutant("ch05.4", "strictly-fewer-than-slots", (("<= num_slots:", "< num_slots:"),), "fits", "math"),
    Mutant("ch05.4", "no-slot-count-check",
           (("    if num_slots < 1:\n        raise ValueError(f\"num_slots must be >= 1, got {num_slots}\")\n", ""),),
           "the contract says this input raises ValueError", "error"),
    Mutant("ch05.4", "only-zero-slots-refused", (("    if num_slots < 1:", "    if num_slots == 0:"),),
           "the contract says this input raises ValueError", "error"),
    # ch05.5 SlotManager
    Mutant("ch05.5", "running-adapter-evicted", (("self._load(uid, needed)", "self._load(uid, set(uids))"),),
           "belongs to a running request", "state", plausible=True),
    Mutant("ch05.5", "pinned-evicted", ((" and u not in self.pinned}", "}"),), "is pinned and was evicted", "state"),
    Mutant("ch05.5", "hits-not-marked-used",
           (("                self._load(uid, needed)\n            self.policy.mark_used(uid)",
             "                self._load(uid, needed)\n                self.policy.mark_used(uid)"),),
           "every needed uid is marked used, hits included", "state"),
    Mutant("ch05.5", "base-model-evicted-first",
           (("victim = self.policy.select_victim(candidates)", "victim = next(u for u in self.policy.order() if u in candidates)"),),
           "the base model (None) is evicted only when it is the only candidate", "state"),
    Mutant("ch05.5", "fifo-ignored", (("get_eviction_policy(policy)", "get_eviction_policy(\"lru\")"),),
           "the policy's ('fifo') pick", "state"),
    Mutant("ch05.5", "every-pin-blocks-a-slot",
           (("blocked = {u for u in self.pinned if u in self.uid_to_buffer_id and u not in needed}",
             "blocked = self.pinned - needed"),),
           "pinned uids only when resident and not needed", "clause"),
    Mutant("ch05.5", "pins-ignored-in-capacity",
           (("if len(needed) + len(blocked) > len(self.buffer_id_to_uid):", "if len(needed) > len(self.buffer_id_to_uid):"),),
           "a refused batch must leave everything unchanged", "clause"),
    Mutant("ch05.5", "requests-counted-not-uids",
           (("if len(needed) + len(blocked) > len(self.buffer_id_to_uid):",
             "if len(uids) + len(running) + len(blocked) > len(self.buffer_id_to_uid):"),),
           "repeats and running uids counted once", "state"),
    Mutant("ch05.5", "highest-free-slot", (("slot = free[0]", "slot = free[-1]"),), "lowest free slot", "state"),
    Mutant("ch05.5", "sorted-by-str", (("key=lambda u: (u is not None, str(u))", "key=str"),),
           "the base model (None) first, then sorted", "state"),
    Mutant("ch05.5", "evicted-uid-kept-in-map",
           (("slot = self.uid_to_buffer_id.pop(victim)", "slot = self.uid_to_buffer_id[victim]"),),
           "uid_to_buffer_id must stay the inverse", "state"),
    Mutant("ch05.5", "pin-without-limit",
           (("        if uid not in self.pinned and len(self.pinned) + 1 >= len(self.buffer_id_to_uid):\n"
             "            raise ValueError(f\"pinning {uid!r} would leave no slot unpinned\")\n", ""),),
           "at most num_slots - 1 pins", "error"),
    Mutant("ch05.5", "pin-every-slot-allowed", (("len(self.pinned) + 1 >= len(", "len(self.pinned) + 1 > len("),),
           "at most num_slots - 1 pins", "error"),
    Mutant("ch05.5", "pin-not-idempotent", (("if uid not in self.pinned and len(self.pinned)", "if len(self.pinned)"),),
           "pinning is idempotent", "clause"),
    Mutant("ch05.5", "empty-slot-pinned", (("        if uid is EMPTY_SLOT:\n            raise ValueError(\"EMPTY_SLOT is not a uid\")\n"
                                            "        if uid not in self.pinned", "        if uid not in self.pinned"),),
           "pin(EMPTY_SLOT) raises ValueError", "error"),
    Mutant("ch05.5", "empty-slot-in-batch-accepted",
           (("        if EMPTY_SLOT in needed:\n            raise ValueError(\"EMPTY_SLOT is not a uid\")\n", ""),),
           "EMPTY_SLOT among the uids or running", "error"),
    Mutant("ch05.5", "returns-only-batch-uids",
           (("return {uid: self.uid_to_buffer_id[uid] for uid in needed}", "return {uid: self.uid_to_buffer_id[uid] for uid in uids}"),),
           "for every needed uid, running ones included", "clause"),
]
MUTANTS += [
    # found by trying mistakes outside the catalogue: needed a probe (evict, reload, evict again) in every draw
    Mutant("ch05.5", "victim-left-in-policy", (("            self.policy.remove(victim)\n", ""),),
           "the victim is the policy's ('fifo') pick", "state"),
]
MUTANTS += [
    # also found outside the catalogue: needed the edge case pinned_and_needed_blocks_nothing
    Mutant("ch05.5", "pinned-and-needed-blocks-a-slot",
           (("blocked = {u for u in self.pinned if u in self.uid_to_buffer_id and u not in needed}",
             "blocked = {u for u in self.pinned if u in self.uid_to_buffer_id}"),),
           "pinned uids only when resident and not needed", "clause"),
    # and one that passed by chance (set order): four same-batch probes per trace in every draw
    Mutant("ch05.5", "marked-in-set-order",
           (("            self.policy.mark_used(uid)\n        return", "        for uid in needed:\n            self.policy.mark_used(uid)\n        return"),),
           "every needed uid is marked used, hits included, in the fixed order", "state"),
]
