# %% [markdown]
# # 05 · The adapter memory pool
#
# Chapters 02 to 04 read adapters from `A_stack` and `B_stack`, indexed by a slot number, and took
# the contents of those slots for granted. A server that knows hundreds of adapters cannot keep all
# of them on the GPU, and cannot allocate a new buffer each time an adapter arrives: CUDA graphs
# (chapter 08) replay kernels on fixed addresses. So the GPU holds a **pool of fixed slots**,
# allocated once, whose contents are swapped. This chapter builds the control plane around those
# slots: which adapter is in which slot, who leaves when a new one is needed, what loading must
# clear, which batches can run at all, and what the CPU and disk tiers behind the slots do.
#
# **What you will learn**
# - The slot table: `uid_to_buffer_id`, `buffer_id_to_uid`, the `EMPTY_SLOT` sentinel for a free
#   slot, and why the base model is the uid `None` in a slot of rank 0 (and how vLLM and TensorRT-LLM
#   chose differently).
# - Eviction policies behind a three-method interface (`mark_used`, `select_victim`, `remove`): LRU and
#   FIFO; who may never be evicted (adapters of running requests, pinned adapters) and why the base
#   model goes last.
# - Loading: zero-fill the whole slot first, or the previous adapter's weights leak into the next.
# - Capacity: refusing a batch before anything changes; admitting requests in arrival order while
#   their adapters fit.
# - Identity: a uid per version, never the display name.
# - Tiers (GPU slots, a CPU cache, disk) and what LRU and FIFO do on a Zipf-distributed trace.
#
# **Exercises**: ch05.1 `LRUEvictionPolicy`, ch05.2 `FIFOEvictionPolicy`, ch05.3 `load_slot`,
# ch05.4 `admit`, ch05.5 `SlotManager`. The classes are graded by replaying seeded traces through
# them and comparing what they return (victims, event logs, slot tables) with the reference, step by
# step; a report names the first step where yours diverges. As before, each answer cell runs on its
# own in a fresh process after `import math, torch`: import what you use inside the cell.

# %%
import copy
import pickle

import reference  # first: device choice
import torch

import graders
from reference import pool_trace
from reference.lora_math import LLAMA3_8B_CONFIG, LLAMA_PROJECTIONS, adapter_num_bytes
from reference.mem_pool import (EMPTY_SLOT, AdapterRegistry, LoRAAdapter, LoRAMemoryPool, ModuleSpec,
                                 snapshot_diff)

# %% [markdown]
# ## 1. Fixed slots, sized at start-up
#
# Per target module and layer the pool holds `A_buffer [num_slots, stack_num * max_rank, in]` and
# `B_buffer [num_slots, out, max_rank]` (SGLang's `LoRAMemoryPool`, `python/sglang/srt/lora/
# mem_pool.py`). Three numbers fixed at start-up decide its size: the number of slots
# (`max_loras_per_batch`), `max_lora_rank` and the set of target modules. An adapter of higher rank,
# or with a module outside the set, cannot be served later without restarting. What the pool costs
# for Llama-3-8B on all seven projections, in bf16 (chapter 01's size function, per slot at the pool's
# `max_rank`):

# %%
for max_rank in (16, 64):
    per_slot = adapter_num_bytes(LLAMA3_8B_CONFIG, LLAMA_PROJECTIONS, max_rank, torch.bfloat16)
    for slots in (8, 32):
        print(f"max_rank {max_rank:2d}, {slots:2d} slots: {per_slot / 2**20:6.1f} MiB per slot, "
              f"{slots * per_slot / 2**30:5.2f} GiB in all")

# %% [markdown]
# Every slot is sized for `max_rank`, whatever rank its adapter has: a rank-8 adapter in a pool of
# `max_rank` 64 uses an eighth of its slot. That is the price of fixed addresses.
#
# ## 2. The slot table: EMPTY_SLOT is not None
#
# Two maps say who is where: `uid_to_buffer_id` (uid -> slot, for residents) and `buffer_id_to_uid`
# (slot -> uid). A request's adapter is identified by a **uid**; the base model is a uid too, `None`,
# and it occupies a slot like any adapter, with rank 0 and scaling 0 so the kernels add exactly
# nothing for its tokens (chapter 02's rank-0 rule). A free slot therefore cannot be marked with
# `None`: the pool needs a third value, the `EMPTY_SLOT` sentinel, a singleton that survives copying
# and pickling as itself (so `is` tests keep working across processes and snapshots).
#
# Systems differ here, which is exactly why the book names the sentinel: SGLang uses `EmptySlot` for
# free slots and `None` for the base model, as here; vLLM marks a free slot with `None` and gives
# base tokens the index -1; TensorRT-LLM maps base requests to an extra slot number equal to the slot
# count, with rank 0. Reading one system's code with another's convention in mind gives bugs that
# no error reports.

# %%
print(repr(EMPTY_SLOT), EMPTY_SLOT is copy.deepcopy(EMPTY_SLOT), EMPTY_SLOT is pickle.loads(pickle.dumps(EMPTY_SLOT)))
print("EMPTY_SLOT == None:", EMPTY_SLOT == None)  # noqa: E711  (the point: they are different values)
pool = LoRAMemoryPool([ModuleSpec("q_proj", 8, (8,))], num_layers=1, max_loras_per_batch=3, max_lora_rank=2)
pool.load_to_slot(None, 0)  # the base model takes a slot
print("buffer_id_to_uid:", pool.buffer_id_to_uid, " uid_to_buffer_id:", pool.uid_to_buffer_id,
      " lora_ranks:", pool.lora_ranks.tolist())

# %% [markdown]
# ## 3. Who leaves: eviction policies
#
# When a batch needs an adapter that is not resident and no slot is free, one resident must go. The
# policy is a small object that only keeps an **order** over the uids it has seen (SGLang's
# `eviction_policy.py`; TensorRT-LLM's `AdapterSlotManager` keeps the same LRU order in an ordered
# map). The pool tells it three things:
#
# - `mark_used(uid)`: uid is used by the current batch (the pool calls it for every uid of a batch,
#   hits included, one at a time in a fixed order: base first, then sorted);
# - `remove(uid)`: uid was evicted (forget it; forgetting an unknown uid does nothing);
# - `select_victim(candidates)`: which of these residents should go. The pool passes only residents it
#   may evict; the policy returns the first of its order among them, **skipping `None` (the base
#   model) while any other candidate exists**: base requests are common and cost nothing to reload,
#   but evicting the base slot for a one-off adapter just moves the miss to the next base request.
#   `select_victim` does not remove anything. It raises `ValueError` if `candidates` is empty (every
#   resident is protected), or if any candidate is a uid the policy does not track (never marked used,
#   or removed since), even next to tracked ones: the pool marks every uid it loads, so an untracked
#   candidate is a bookkeeping bug, better reported than guessed around.
#
# plus `order()`, the tracked uids from next victim to last, which the graders read.
#
# **LRU** (least recently used, SGLang's default) orders by last use: every `mark_used` moves the uid
# to the young end. **FIFO** orders by first use since it was loaded: a `mark_used` of a uid already
# tracked changes nothing, so hits do not protect an adapter. Running example: `mark_used` A, B, C, A
# gives LRU order (B, C, A) and FIFO order (A, B, C); `select_victim({A, C})` is C under LRU, A under
# FIFO. There are no ties: each `mark_used` has its own place in one sequence.
#
# ### Exercise ch05.1: `LRUEvictionPolicy`
#
# Write the class with `__init__(self)` (no arguments), `mark_used(uid)`, `remove(uid)`, `order()`
# (a tuple, next victim first) and `select_victim(candidates)` (a set) as specified above, both
# `ValueError` cases included. `uid` may be any hashable (strings, ints, `None`). The grader reads
# `order()` after every step of its traces. (`collections.OrderedDict` and its `move_to_end` are the
# classic tools.)

# %% exercise="ch05.1" role="answer"
from collections import OrderedDict


class LRUEvictionPolicy:
    """Least recently used first; the base model (None) only as the last resort."""

    def __init__(self):
        ### BEGIN SOLUTION
        self._order = OrderedDict()
        ### END SOLUTION

    def mark_used(self, uid):
        ### BEGIN SOLUTION
        self._order[uid] = None
        self._order.move_to_end(uid)
        ### END SOLUTION

    def remove(self, uid):
        ### BEGIN SOLUTION
        self._order.pop(uid, None)
        ### END SOLUTION

    def order(self):
        ### BEGIN SOLUTION
        return tuple(self._order)
        ### END SOLUTION

    def select_victim(self, candidates):
        ### BEGIN SOLUTION
        if not candidates:
            raise ValueError("no candidates")
        if any(uid not in self._order for uid in candidates):
            raise ValueError("a candidate was never marked used")
        allowed = set(candidates) - {None} or set(candidates)
        return next(uid for uid in self._order if uid in allowed)
        ### END SOLUTION


# %% exercise="ch05.1" role="test"
graders.check("ch05.1", LRUEvictionPolicy)

# %% [markdown]
# ### Exercise ch05.2: `FIFOEvictionPolicy`
#
# The same interface, ordered by the first `mark_used` since the uid was last removed (or first
# seen): later uses of a tracked uid change nothing. `remove` and `select_victim` behave as in
# ch05.1 (the base model last; `ValueError` for no candidates or an untracked one).

# %% exercise="ch05.2" role="answer"
from collections import OrderedDict


class FIFOEvictionPolicy:
    """First loaded, first out; the base model (None) only as the last resort."""

    def __init__(self):
        ### BEGIN SOLUTION
        self._order = OrderedDict()
        ### END SOLUTION

    def mark_used(self, uid):
        ### BEGIN SOLUTION
        self._order.setdefault(uid, None)
        ### END SOLUTION

    def remove(self, uid):
        ### BEGIN SOLUTION
        self._order.pop(uid, None)
        ### END SOLUTION

    def order(self):
        ### BEGIN SOLUTION
        return tuple(self._order)
        ### END SOLUTION

    def select_victim(self, candidates):
        ### BEGIN SOLUTION
        if not candidates:
            raise ValueError("no candidates")
        if any(uid not in self._order for uid in candidates):
            raise ValueError("a candidate was never marked used")
        allowed = set(candidates) - {None} or set(candidates)
        return next(uid for uid in self._order if uid in allowed)
        ### END SOLUTION


# %% exercise="ch05.2" role="test"
graders.check("ch05.2", FIFOEvictionPolicy)

# %% [markdown]
# The reference (`reference/eviction.py`) puts `select_victim` in the abstract base class, so a new
# policy writes only its order (shown once your own answers passed):

# %%
graders.show_reference("ch05.1")
graders.show_reference("ch05.2")

# %% [markdown]
# ## 4. Loading a slot: zero-fill first
#
# Slots are reused. When adapter B is loaded into the slot adapter A just left, every part of the
# slot that B does not write still holds A's values: the rows past B's rank, and whole modules B does
# not have. The kernels clip to the rank (chapter 03), which covers the first case, but nothing
# covers the second: a module B lacks has B's rank in `lora_ranks`, so the kernels read A's leftover
# weights for it and add A's delta to B's requests, silently. The rule (SGLang zero-fills the slot
# in `load_lora_weight_to_buffer`): **zero the whole slot, every module and layer, then copy**.
#
# The smallest case: hidden 8, rank 2, target modules q and v, one free slot. Adapter A has q and
# v; adapter B only q. Serve A, evict it, load B into the same slot, and read B's v delta:

# %%
def tiny_adapter(uid, modules, seed):
    g = torch.Generator().manual_seed(seed)
    return LoRAAdapter(uid, rank=2, scaling=1.0,
                       weights={(0, m): (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g)) for m in modules})


adapters = {"A": tiny_adapter("A", ["q_proj", "v_proj"], 0), "B": tiny_adapter("B", ["q_proj"], 1)}
pool = LoRAMemoryPool([ModuleSpec("q_proj", 8, (8,)), ModuleSpec("v_proj", 8, (8,))], num_layers=1,
                      max_loras_per_batch=1, max_lora_rank=2, adapter_source=adapters.__getitem__)
x = torch.randn(1, 8, generator=torch.Generator().manual_seed(2))


def v_delta(pool, slot):
    A, B = pool.A_buffer["v_proj"][0][slot], pool.B_buffer["v_proj"][0][slot]
    return pool.scalings[slot] * (x @ A.T) @ B.T


print(pool.prepare_lora_batch(["A"]), "A's v delta:", v_delta(pool, 0).abs().max().item())
print(pool.prepare_lora_batch(["B"]), "B's v delta:", v_delta(pool, 0).abs().max().item(), "(must be exactly 0)")
print("events:", pool.events)

# %% [markdown]
# Without the zero-fill (copying B's q weights over A's and leaving the rest), B's v delta would be
# A's, computed here by writing B's weights into a copy of A's slot:

# %%
leaky = LoRAMemoryPool([ModuleSpec("q_proj", 8, (8,)), ModuleSpec("v_proj", 8, (8,))], 1, 1, 2)
leaky.load_to_slot(adapters["A"], 0)
for (layer, name), (a, b) in adapters["B"].weights.items():  # what a loader without zero-fill does
    leaky.A_buffer[name][layer][0, :2], leaky.B_buffer[name][layer][0, :, :2] = a, b
print("B's v delta without zero-fill:", v_delta(leaky, 0).abs().max().item())

# %% [markdown]
# ### Exercise ch05.3: `load_slot`
#
# Write `load_slot(A_buffers, B_buffers, slot, weights, rank)` for one layer:
# - `A_buffers`, `B_buffers` and `weights` are lists with one entry per module m, in the same order:
#   `A_buffers[m]` `[num_slots, max_rank, in_m]`, `B_buffers[m]` `[num_slots, out_m, max_rank]`,
#   `weights[m]` `(A [rank, in_m], B [out_m, rank])` or `None` (the adapter lacks m); `rank`: the
#   adapter's rank.
# - In place, into the tensors you are given (they are the pool's fixed buffers; the grader reads
#   them after your call, not your return value): zero `A_buffers[m][slot]` and `B_buffers[m][slot]`
#   for every module, then copy each present module's A into rows `[0, rank)` and B into columns
#   `[0, rank)` of the slot. Other slots stay bit for bit as they were (NaN included). Return
#   `(A_buffers, B_buffers)` for convenience.
# - `rank` 0 with every `weights[m]` `None` is the base model: the slot ends all zero.
# - Raise `ValueError`, before writing anything, if `slot` is outside `0..num_slots-1` (a negative
#   slot too: Python would index from the end and overwrite another adapter's slot) or `rank` exceeds
#   `max_rank`.
# - The buffers may be fp32, bf16 or fp16; the old contents may hold NaN (zero them with `zero_()`:
#   multiplying by 0 keeps a NaN).

# %% exercise="ch05.3" role="answer"
def load_slot(A_buffers, B_buffers, slot, weights, rank):
    """Zero-fill the slot in every module, then copy the adapter's weights at its rank."""
    ### BEGIN SOLUTION
    num_slots, max_rank = A_buffers[0].shape[0], A_buffers[0].shape[1]
    if not 0 <= slot < num_slots:
        raise ValueError(f"slot {slot} outside 0..{num_slots - 1}")
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
    ### END SOLUTION


# %% exercise="ch05.3" role="test"
graders.check("ch05.3", load_slot)

# %% [markdown]
# The reference pool validates an adapter before it writes anything (`validate`: rank within
# `max_lora_rank`, known modules and layers, shapes), then zero-fills and copies:

# %%
graders.show_reference("ch05.3")

# %% [markdown]
# ## 5. Capacity: refuse before anything changes, admit what fits
#
# A batch can use at most `num_slots` distinct uids, **the base model included**. A batch that needs
# more must be refused, and refused *before* anything is evicted or loaded: a half-prepared pool has
# evicted adapters that running requests may still need. The reference checks everything that can
# fail (capacity, unknown uids, invalid adapters) before its first write; `snapshot_diff` compares
# the pool's full state before and after a refused call:

# %%
qv = [ModuleSpec("q_proj", 8, (8,)), ModuleSpec("v_proj", 8, (8,))]
pool = LoRAMemoryPool(qv, 1, 2, 2, adapter_source=adapters.__getitem__)
pool.prepare_lora_batch(["A"])
before = pool.snapshot()
try:
    pool.prepare_lora_batch(["A", "B", None])
except ValueError as exc:
    print("refused:", exc)
print("differences after the refused call:", snapshot_diff(before, pool.snapshot()))

# %% [markdown]
# A scheduler avoids building such batches: it **admits** waiting requests in arrival order while
# the distinct uids of the running requests plus the admitted ones fit the slots, and defers the
# rest to a later step (SGLang's scheduler checks the adapter count when it adds requests to a new
# batch, and keeps considering later requests). With 2 slots and requests for A, B and the base
# model arriving together, A and B are admitted and the base request waits; a fourth request for A
# would still be admitted, since A is already counted.
#
# ### Exercise ch05.4: `admit`
#
# Write `admit(request_uids, running_uids, num_slots)`: `request_uids` in arrival order (strings, or
# `None` for the base model), `running_uids` the uids of requests already running (they occupy slots
# whatever happens). Go through the requests in order; admit request i if the distinct uids of
# running, admitted-so-far and request i fit in `num_slots`, else defer it and continue. Return
# `(admitted, deferred)`: two lists of indices into `request_uids`, ascending.
# - Each distinct uid counts once: `running_uids` may repeat a uid (two running requests on one
#   adapter), and a request's uid may already be running or admitted (it needs no new slot).
# - Raise `ValueError` if `num_slots` < 1.

# %% exercise="ch05.4" role="answer"
def admit(request_uids, running_uids, num_slots):
    """Admit requests in arrival order while their distinct uids fit the slots."""
    ### BEGIN SOLUTION
    if num_slots < 1:
        raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    chosen, admitted, deferred = set(running_uids), [], []
    for i, uid in enumerate(request_uids):
        if len(chosen | {uid}) <= num_slots:
            chosen.add(uid)
            admitted.append(i)
        else:
            deferred.append(i)
    return admitted, deferred
    ### END SOLUTION


# %% exercise="ch05.4" role="test"
graders.check("ch05.4", admit)

# %% [markdown]
# The reference pool's `admit` also counts the pinned residents outside the chosen set (section 6):

# %%
graders.show_reference("ch05.4")

# %% [markdown]
# ## 6. Preparing a batch: the event log
#
# Before each forward pass the pool makes every uid of the batch resident. The set it must hold is
# the batch's new uids **and** the uids of running requests (a decode step needs its adapter in every
# step; evicting it mid-generation would corrupt that request). The reference's
# `prepare_lora_batch(uids, running)`, and the rules the grader replays:
#
# 1. needed = uids ∪ running, each distinct uid once (running may repeat a uid, or share one with
#    uids); blocked = the pinned uids that are **resident** and not needed (a pinned uid that is not
#    resident holds no slot). If len(needed) + len(blocked) > num_slots, or `EMPTY_SLOT` is among
#    uids or running, raise `ValueError` and change nothing (no event either);
# 2. go through needed in a fixed order (base model first, then uids sorted), so the result never
#    depends on Python's set order;
# 3. a resident uid is a **hit**: event `("hit", uid, slot)`;
# 4. a missing uid takes the **lowest free slot**; if none is free, the policy picks a victim among
#    residents that are not needed now and not pinned: event `("evict", victim, slot)`, the victim is
#    removed from the maps and from the policy, then `("load", uid, slot)`;
# 5. every needed uid is marked used in the policy (hits included, in the same order).
#
# (The reference's load events also name the tier the weights came from, section 8; the grader
# compares the first three fields.) Pinning (`pin(uid)`) protects an adapter from eviction for good,
# e.g. a hot adapter that must never pay a reload. The reference keeps at least one slot unpinned:
# `pin` raises `ValueError` when the uid is not pinned yet and `num_slots - 1` uids (resident or
# not) already are, so at most `num_slots - 1` uids are ever pinned; pinning a pinned uid again
# changes nothing. `pin(EMPTY_SLOT)` raises `ValueError` too.
# The running example, 2 slots, LRU:

# %%
pool = LoRAMemoryPool(qv, 1, 2, 2, adapter_source=adapters.__getitem__)
for batch in (["A", None], ["B", None]):
    start = len(pool.events)
    print(f"batch {batch}: {pool.prepare_lora_batch(batch)}  events {pool.events[start:]}")

# %% [markdown]
# ### Exercise ch05.5: `SlotManager`
#
# Write the control plane of `prepare_lora_batch` without tensors: a class with
# - `__init__(self, num_slots, policy)`: `policy` is `"lru"` or `"fifo"`; use your own policy classes
#   or `reference.eviction.get_eviction_policy(policy)` (its objects have the interface of section 3);
# - attributes `buffer_id_to_uid` (a list, `EMPTY_SLOT` from `reference.mem_pool` for a free slot),
#   `uid_to_buffer_id` (a dict) and `events` (a list of tuples, appended in order);
# - `pin(uid)`: never evict uid (it may or may not be resident yet); raise `ValueError` for
#   `EMPTY_SLOT` or when a new pin would leave no slot unpinned (at most `num_slots - 1` pinned
#   uids); pinning a pinned uid again changes nothing;
# - `prepare(uids, running)`: the five rules above, returning `{uid: slot}` for every needed uid
#   (running ones included); on a capacity error or `EMPTY_SLOT` among uids or running, raise
#   `ValueError` with nothing changed (events included).
# The grader replays batches (with overlap: a uid running twice, a batch uid also running) and pins,
# and compares after every step what each call returned, the step's events, your slot table, and
# whether `uid_to_buffer_id` is its inverse.

# %% exercise="ch05.5" role="answer"
from reference.eviction import get_eviction_policy
from reference.mem_pool import EMPTY_SLOT


class SlotManager:
    """Which uid lives in which slot; loads and evictions recorded as events."""

    def __init__(self, num_slots, policy):
        ### BEGIN SOLUTION
        self.buffer_id_to_uid = [EMPTY_SLOT] * num_slots
        self.uid_to_buffer_id = {}
        self.events = []
        self.pinned = set()
        self.policy = get_eviction_policy(policy)
        ### END SOLUTION

    def pin(self, uid):
        ### BEGIN SOLUTION
        if uid is EMPTY_SLOT:
            raise ValueError("EMPTY_SLOT is not a uid")
        if uid not in self.pinned and len(self.pinned) + 1 >= len(self.buffer_id_to_uid):
            raise ValueError(f"pinning {uid!r} would leave no slot unpinned")
        self.pinned.add(uid)
        ### END SOLUTION

    def prepare(self, uids, running):
        ### BEGIN SOLUTION
        needed = set(uids) | set(running)
        if EMPTY_SLOT in needed:
            raise ValueError("EMPTY_SLOT is not a uid")
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
        ### END SOLUTION

    def _load(self, uid, needed):
        ### BEGIN SOLUTION
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
        ### END SOLUTION


# %% exercise="ch05.5" role="test"
graders.check("ch05.5", SlotManager)

# %% [markdown]
# The reference plans every slot and fetch before its first write, so that an unknown uid or an
# invalid adapter (not only capacity) also leaves the pool unchanged:

# %%
graders.show_reference("ch05.5")

# %% [markdown]
# ## 7. Identity is a uid, not a name
#
# Users name adapters ("support-bot"); the pool must key by something that changes when the weights
# change. If a name is re-registered with new weights while the old version is resident, a pool keyed
# by name would call it a hit and serve the old weights. The reference's `AdapterRegistry` (after
# SGLang's `LoRARef`, which separates `lora_id` from `lora_name`) gives each version its own uid:

# %%
registry = AdapterRegistry()
g = torch.Generator().manual_seed(5)
w_old = {(0, "q_proj"): (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g))}
w_new = {(0, "q_proj"): (torch.randn(2, 8, generator=g), torch.randn(8, 2, generator=g))}
uid_old = registry.register("support-bot", 2, 1.0, w_old)
pool = LoRAMemoryPool([ModuleSpec("q_proj", 8, (8,))], 1, 2, 2, adapter_source=registry.load)
pool.prepare_lora_batch([uid_old])
uid_new = registry.register("support-bot", 2, 1.0, w_new)
slots = pool.prepare_lora_batch([registry.uid_of("support-bot")])
slot = slots[uid_new]
print(f"uids: {uid_old!r} then {uid_new!r}; events {pool.events}")
print("slot holds the new weights:", torch.equal(pool.A_buffer["q_proj"][0][slot, :2], w_new[(0, "q_proj")][0]))

# %% [markdown]
# ## 8. Tiers, and LRU against FIFO on a realistic trace
#
# Behind the GPU slots sit two slower tiers: a bounded **CPU cache** of host copies
# (`max_loaded_loras` in SGLang, `max_cpu_loras` in vLLM; at least the slot count, since every
# resident adapter keeps a host copy) and **disk**. A slot miss that hits the CPU cache costs a
# host-to-device copy; a CPU miss also reads the file. The reference records the tier in each load
# event (`"cpu"`, `"disk"`, or `"base"` for the zero-filled base slot) and `("cpu_evict", uid)` when a
# host copy is dropped.
#
# Which policy is better depends on the workload. Adapter popularity in serving traces is heavily
# skewed; S-LoRA (Sheng et al., 2023) and Punica evaluate with Zipf-like distributions. The
# reference's `pool_trace` replays a seeded trace (64 adapters, Zipf exponent 1.1, Poisson arrivals,
# a tenth of requests for the base model, each request decoding for 1 to 3 steps) through the real
# pool bookkeeping, with admission, running requests and both tiers:

# %%
cfg = pool_trace.TraceConfig()
trace = pool_trace.make_trace(cfg)
print(f"{cfg.steps} steps, {sum(len(s) for s in trace)} requests, {cfg.num_adapters} adapters, Zipf s = {cfg.zipf_s}")
print(f"{'slots':>5s} {'policy':>6s} {'hit rate':>8s} {'loads':>6s} {'from disk':>9s} {'evictions':>9s} {'max waiting':>11s}")
for slots in (4, 8, 16):
    for policy in ("lru", "fifo"):
        st = pool_trace.simulate_trace(trace, policy, slots, max_loaded_loras=2 * slots)
        print(f"{slots:5d} {policy:>6s} {st.hit_rate():8.1%} {sum(st.loads):6d} {sum(st.disk_loads):9d} "
              f"{sum(st.evictions):9d} {max(st.waiting):11d}")

# %% [markdown]
# ![LRU against FIFO on the Zipf trace: windowed hit rate and cumulative evictions at 12 slots, and hit rate against the slot count](pool_trace.png)
#
# (Figure made by `figures/src/pool_trace.py` from the same trace.) Under a skewed workload the few
# popular adapters are used at almost every step; LRU keeps them because each use makes them young
# again, while FIFO evicts them on schedule and reloads them soon after. When slots are scarce the
# policies barely differ: most residents belong to running requests and are not candidates, so there
# is little to choose from. With too few slots both policies thrash: most batches evict and requests
# wait in admission (the `max waiting` column), which a server sees as a long tail of slow requests.
#
# ## 9. How production systems do it
#
# - **SGLang**, `python/sglang/srt/lora/`: `mem_pool.py` (`LoRAMemoryPool`, `EmptySlot`,
#   `prepare_lora_batch` with the running-requests rule and the base model evicted last,
#   `load_lora_weight_to_buffer` zero-filling), `eviction_policy.py` (LRU and FIFO behind one ABC),
#   `lora_manager.py` (`max_loras_per_batch`, `max_loaded_loras`, validation of a batch's adapter
#   count), `lora_registry.py` (`LoRARef`: unique id vs name).
# - **vLLM**, `vllm/lora/`: `models.py` / `worker_manager.py` (`LRUCacheWorkerLoRAManager`: an LRU
#   over GPU slots with `max_loras`, and a CPU cache of `max_cpu_loras`); free slots are `None`, base
#   tokens get index -1.
# - **TensorRT-LLM**: the PyTorch backend's `AdapterSlotManager` keeps slots in an LRU ordered map and
#   returns (slot, evicted task), with a "slots changed" flag so pointer tables are rebuilt only
#   when ownership changes; base requests map to the slot number equal to the slot count.
#
# ## Summary
#
# - A fixed number of slots, each sized for `max_lora_rank` and the target-module set, allocated once:
#   addresses never change, contents are swapped.
# - `EMPTY_SLOT` marks a free slot; `None` is the base model, a uid in a rank-0 slot.
# - Eviction policies are an order plus `select_victim`; LRU (by last use) and FIFO (by load). Running
#   and pinned adapters are never candidates; the base model goes last.
# - Loading zero-fills the whole slot, or a missing module inherits the previous adapter's delta.
# - A batch that needs more distinct uids (base included) than slots is refused before anything
#   changes; admission takes requests in arrival order while their uids fit.
# - A version of an adapter is a uid; names are for people.
# - CPU and disk tiers sit behind the slots; on skewed traffic LRU keeps the hot adapters resident.
#
# ## Review questions
#
# 1. A pool uses `None` for free slots and also for the base model. Write a two-batch sequence in
#    which it serves a base request from a slot that still holds an adapter's weights.
# 2. Why must the running requests' uids join the needed set, even though they are not "new" in this
#    batch? What breaks if a running adapter is evicted between two decode steps?
# 3. The kernels clip to each slot's rank. Which part of a reused slot does that protect, and which
#    part only the zero-fill protects?
# 4. With 3 slots, one pinned adapter, and a batch needing 3 other uids: what does the reference do,
#    and why is that better than evicting the pinned adapter?
# 5. In the table above, the gap between LRU and FIFO grows with the slot count. Why is it small when
#    slots are scarce (hint: how many residents are candidates when most slots hold running
#    adapters)? Construct a request pattern where FIFO beats LRU.
