# %% ch05.1
from collections import OrderedDict


class LRUEvictionPolicy:
    """Least recently used first; the base model (None) only as the last resort."""

    def __init__(self):
        self._order = OrderedDict()

    def mark_used(self, uid):
        self._order[uid] = None
        self._order.move_to_end(uid)

    def remove(self, uid):
        self._order.pop(uid, None)

    def order(self):
        return tuple(self._order)

    def select_victim(self, candidates):
        if not candidates:
            raise ValueError("no candidates")
        allowed = set(candidates) - {None} or set(candidates)
        return next(uid for uid in self._order if uid in allowed)


# %% ch05.2
from collections import OrderedDict


class FIFOEvictionPolicy:
    """First loaded, first out; the base model (None) only as the last resort."""

    def __init__(self):
        self._order = OrderedDict()

    def mark_used(self, uid):
        self._order.setdefault(uid, None)

    def remove(self, uid):
        self._order.pop(uid, None)

    def order(self):
        return tuple(self._order)

    def select_victim(self, candidates):
        if not candidates:
            raise ValueError("no candidates")
        allowed = set(candidates) - {None} or set(candidates)
        return next(uid for uid in self._order if uid in allowed)


# %% ch05.3
def load_slot(A_buffers, B_buffers, slot, weights, rank):
    """Zero-fill the slot in every module, then copy the adapter's weights at its rank."""
    for A, B in zip(A_buffers, B_buffers):
        A[slot].zero_()
        B[slot].zero_()
    for A, B, w in zip(A_buffers, B_buffers, weights):
        if w is not None:
            A[slot, :rank].copy_(w[0])
            B[slot, :, :rank].copy_(w[1])
    return A_buffers, B_buffers


# %% ch05.4
def admit(request_uids, running_uids, num_slots):
    """Admit requests in arrival order while their distinct uids fit the slots."""
    chosen, admitted, deferred = set(running_uids), [], []
    for i, uid in enumerate(request_uids):
        if len(chosen | {uid}) <= num_slots:
            chosen.add(uid)
            admitted.append(i)
        else:
            deferred.append(i)
    return admitted, deferred


# %% ch05.5
from reference.eviction import get_eviction_policy
from reference.mem_pool import EMPTY_SLOT


class SlotManager:
    """Which uid lives in which slot; loads and evictions recorded as events."""

    def __init__(self, num_slots, policy):
        self.buffer_id_to_uid = [EMPTY_SLOT] * num_slots
        self.uid_to_buffer_id = {}
        self.events = []
        self.pinned = set()
        self.policy = get_eviction_policy(policy)

    def pin(self, uid):
        self.pinned.add(uid)

    def prepare(self, uids, running):
        needed = set(uids) | set(running)
        blocked = {u for u in self.pinned if u in self.uid_to_buffer_id and u not in needed}
        if len(needed) + len(blocked) > len(self.buffer_id_to_uid):
            raise ValueError(f"{len(needed)} uids do not fit")
        for uid in sorted(needed, key=lambda u: (u is not None, str(u))):
            if uid in self.uid_to_buffer_id:
                self.events.append(("hit", uid, self.uid_to_buffer_id[uid]))
            else:
                self._load(uid, needed)
            self.policy.mark_used(uid)
        return {uid: self.uid_to_buffer_id[uid] for uid in needed}

    def _load(self, uid, needed):
        free = [s for s, u in enumerate(self.buffer_id_to_uid) if u is EMPTY_SLOT]
        if free:
            slot = free[0]
        else:
            candidates = {u for u in self.uid_to_buffer_id if u not in needed and u not in self.pinned}
            victim = self.policy.select_victim(candidates)
            slot = self.uid_to_buffer_id.pop(victim)
            self.policy.remove(victim)
            self.events.append(("evict", victim, slot))
        self.buffer_id_to_uid[slot] = uid
        self.uid_to_buffer_id[uid] = slot
        self.events.append(("load", uid, slot))
