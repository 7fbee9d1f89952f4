# %% ch05.1
class LRUEvictionPolicy:
    # no select_victim at all
    def __init__(self):
        self.uids = []

    def mark_used(self, uid):
        self.uids.append(uid)

    def remove(self, uid):
        pass

    def order(self):
        return tuple(self.uids)


# %% ch05.2
class FIFOEvictionPolicy:
    def __init__(self, capacity):  # a constructor argument the interface does not have
        self.capacity = capacity


# %% ch05.3
def load_slot(A_buffers, B_buffers, slot, weights, rank):
    # builds new tensors instead of writing into the pool's buffers, and returns nothing
    A_buffers = [a.clone() for a in A_buffers]


# %% ch05.4
def admit(request_uids, running_uids, num_slots):
    return set(range(min(num_slots, len(request_uids)))), set()


# %% ch05.5
class SlotManager:
    def __init__(self, num_slots, policy):
        raise NotImplementedError("ch05.5: SlotManager")
