# %% [markdown]
# # 11 · A small multi-LoRA serving engine
#
# The chapters so far built the data plane: LoRA kernels, a slot pool, the batch info, CUDA graphs,
# tensor parallelism. A server also needs a **control plane** that decides, every step, which
# requests run, where their KV cache lives, which adapters occupy the GPU's slots, and (with several
# engine instances) which instance a request goes to. Adapters change each of those decisions: two
# adapters must never share KV, a batch can hold only as many distinct adapters as there are slots,
# a popular adapter can starve a rare one, and a router that ignores adapters makes every instance
# load every adapter. This chapter walks one request through that control plane, on the book's
# engine in `reference/engine/` (Python ints, lists and sets only, no tensors), driven by a fake
# model so every decision can be replayed and checked.
#
# **What you will learn**
# - The engine's two planes and a request's life: waiting, running, finished; prefill, chunked
#   prefill, decode; recompute preemption.
# - Paged KV and the prefix cache: why a block's key is chained over the prompt and must include the
#   adapter's uid, and what an unsafe key (tokens only) shares.
# - Admission under the adapter cap (`max_loras_per_batch`, the base model taking a slot), resident
#   adapters first, KV stopping in arrival order.
# - Starvation and SGLang's drain: a trace where a rare adapter waits forever, and the same trace
#   with the drain.
# - Routing across instances: consistent hashing with bounded load, replicas for hot adapters, and
#   what it saves against round robin on a Zipf trace.
# - The capstone: your block keys, admission and drain as the engine's policies, and the engine step
#   that joins the two planes, judged end to end against PEFT.
# - The engine under load on an H200: throughput and latency against the number of adapters, beside
#   the base model and PEFT's mixed batches; what the prefix-cache key and the drain change there.
#
# **Exercises**: ch11.1 `block_hashes`, ch11.2 `admit_requests`, ch11.3 `choose_drain`, ch11.4
# `route`: pure functions of host values that the scheduler, the block manager and the router call,
# and the graders replay. ch11.5 `engine_step`, the capstone: one step of the engine, run with your
# ch11.1-ch11.3 answers as its policies on a tiny Llama with PEFT adapters.

# %%
import random
import statistics

import reference  # first: device choice

import graders
from reference.engine import policies
from reference.engine.block_manager import BlockManager
from reference.engine.scheduler import Scheduler, SchedulerConfig
from reference.engine.sequence import SamplingParams, Sequence, SeqStatus

V = 97  # the fake model's vocabulary


def fake_next(tokens, uid) -> int:
    """The fake model: its next token is a function of the whole sequence and of the adapter, so a
    scheduling mistake that loses, repeats or reorders a token changes the output."""
    h = policies.stable_hash(uid) % 3
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return h % V


def step(sched):
    """One engine step: schedule, 'run the model' on every sequence that reached its last token, record."""
    kind, work = sched.schedule()
    next_tokens = {w.seq.seq_id: fake_next(w.seq.tokens, w.seq.uid) for w in work if w.end == w.seq.num_tokens}
    sched.postprocess(work, next_tokens)
    return kind, work

# %% [markdown]
# ## 1. Two planes, and a request's life
#
# nano-vllm's split, which this book follows from chapter 02 on:
#
# - the **data plane** is tensors only: the model's forward, the LoRA kernels, the KV cache. It
#   never sees a uid or a policy;
# - the **control plane** is host values only: the adapter registry and slot pool (chapter 05), the
#   block manager (which KV blocks a sequence owns), the scheduler (which sequences run this step and
#   what each computes) and, above several engines, the router. It never sees a tensor.
#
# One struct crosses per step: the scheduler's list of `Work(seq, start, end)` ("compute
# `tokens[start:end]` of this sequence"), from which the engine builds the batch info of chapter 07.
#
# A request (`Sequence`) is **waiting** until the scheduler admits it, then **running** until it
# finishes (a stop token or `max_new_tokens`). Each step is one of two kinds (nano-vllm's rule:
# prefill first):
#
# - a **prefill** step computes prompts: first the rest of prompts that were only partly computed,
#   then newly admitted ones, within `max_num_batched_tokens` tokens. A prompt longer than what is
#   left of that budget is computed in pieces over several steps: **chunked prefill**;
# - a **decode** step, when nothing is left to prefill, computes one token for every running sequence.
#
# When a decoding sequence needs a new KV block and none is free, the most recently admitted one is
# **preempted**: its blocks are freed and it goes back to the front of the waiting queue, to be
# recomputed later (vLLM's recompute preemption). Three requests, a token budget of 8 and a KV cache
# of 6 blocks of 4 positions:

# %%
config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_loras_per_batch=2)
sched = Scheduler(config, BlockManager(num_blocks=6, block_size=4))
prompts = {0: (list(range(1, 14)), "sql@1"), 1: ([5, 6, 7], "sql@1"), 2: ([9, 9], None)}
seqs = [Sequence(seq_id, prompt, uid, SamplingParams(max_new_tokens=6)) for seq_id, (prompt, uid) in prompts.items()]
for seq in seqs:
    sched.add(seq)
print("prompt lengths:", {i: len(p) for i, (p, _) in prompts.items()})
n = 0
while sched.has_unfinished():
    kind, work = step(sched)
    n += 1
    done = ", ".join(f"seq {w.seq.seq_id} [{w.start}:{w.end})" for w in work)
    print(f"step {n:2d} {kind:7s} {done:52s} free blocks {sched.blocks.num_free}")
kinds = [e[0] for e in sched.events]
print("preemptions:", kinds.count("preempt"), "| finished:", [e[1:] for e in sched.events if e[0] == "finish"])


def alone(prompt, uid, max_new_tokens=6):
    """The same request generated on its own, one token at a time."""
    out = []
    while len(out) < max_new_tokens:
        out.append(fake_next(prompt + out, uid))
    return out


print("every output equal to generating its request alone:", all(s.output == alone(s.prompt, s.uid) for s in seqs))

# %% [markdown]
# The 13-token prompt of sequence 0 took two prefill steps (`[0:8)` then `[8:13)`); sequence 1 was
# admitted in the second step, beside the rest of sequence 0, within the budget. When the six blocks
# ran out during decode, the most recently admitted sequences were preempted: their blocks were freed,
# and later they were computed again; these are the prefill steps that come after the first decodes.
# (Section 2's prefix cache lets a preempted sequence skip the full blocks nobody took meanwhile.)
# Every output is still the one the fake model gives
# each request alone: chunking and preemption change when tokens are computed, never what they are
# (tests/test_engine_control.py checks this over seeded traces).
#
# Over a longer run the picture looks like this (made by `figures/src/engine_timeline.py` from the
# same scheduler and block manager, with the pool's real bookkeeping, on a Zipf trace of 36 requests
# over 6 adapters, 3 slots and 32 KV blocks): the waiting queue grows while the KV blocks are full,
# decode steps alternate with prefill steps, preemptions free blocks, and the slots change owner as
# adapters come and go. Freed blocks keep their prefix keys (the light band) until a new block
# needs them.
#
# ![An engine's steps: running and waiting sequences with prefill steps and preemptions, KV blocks held and cached, and the adapter in each GPU slot over time](engine_timeline.png)

# %% [markdown]
# ## 2. Paged KV and the prefix cache
#
# The KV cache is a pool of fixed-size **blocks** (vLLM's PagedAttention); a sequence owns a block
# table, block `j` holding positions `[j B, (j+1) B)`. Requests that start with the same tokens (a
# system prompt, a few-shot header) can share the blocks of that prefix instead of computing them
# again: the **prefix cache** finds a block by a key of its contents, and a sequence whose first
# blocks' keys are cached takes those blocks (reference counted) and starts computing after them.
#
# What must the key contain? Everything the block's KV depends on:
#
# - **every token before it**, not just its own: the K and V of a token are computed from its whole
#   prefix (attention). So the key is **chained**: `h[i] = hash(h[i-1], ..., block i's tokens)`;
# - **the adapter**: LoRA on q, k and v changes K and V themselves, so the same tokens under two
#   adapters have different KV. The key includes the adapter's **uid**, not its display name: a name
#   re-registered with new weights gets a new uid and never hits the old version's blocks;
# - only **full** blocks get a key: a trailing partial block's KV is still being written.
#
# The hash itself must be the same in every process (a router, two engines, a grader and its child):
# Python's `hash` of a string changes with `PYTHONHASHSEED`, so `policies.stable_hash` hashes the
# `repr` with blake2b instead. And a key is registered only once every position of its block has
# been computed, so a hit never reads KV that a chunked prefill has yet to write.
#
# Two requests of adapter `sql@1` with a common 8-token system prompt, then a request of `chat@2`
# with the very same prompt, through `BlockManager` with this key:

# %%
def computed(bm, seq):
    """Allocate ``seq``, note the prompt tokens it found cached (``seq.hit``), and mark its whole
    prompt as computed (as a finished prefill would)."""
    bm.allocate(seq)
    seq.hit = seq.num_computed
    seq.num_computed = seq.num_tokens
    bm.mark_computed(seq)
    return seq


system = [11, 12, 13, 14, 15, 16, 17, 18]
bm = BlockManager(num_blocks=16, block_size=4)
a = computed(bm, Sequence(0, system + [21, 22, 23], "sql@1", SamplingParams()))
b = computed(bm, Sequence(1, system + [31, 32], "sql@1", SamplingParams()))
c = computed(bm, Sequence(2, system + [21, 22, 23], "chat@2", SamplingParams()))
print("block tables:", {s.uid + f"#{s.seq_id}": s.block_table for s in (a, b, c)})
print(f"sql@1 #1 reused {b.hit} prompt tokens of #0; chat@2 reused {c.hit}")

# %% [markdown]
# The second `sql@1` request shares the two blocks of the system prompt; `chat@2` shares nothing.
# With an **unsafe key**, the tokens alone (here: every block keyed as if under one adapter), the
# `chat@2` request finds `sql@1`'s blocks and attends over KV that `sql@1`'s LoRA computed:

# %%
def tokens_only(token_ids, adapter_id, block_size):
    return policies.block_hashes(token_ids, None, block_size)  # the adapter left out of the key


unsafe = BlockManager(num_blocks=16, block_size=4, hash_fn=tokens_only)
a2 = computed(unsafe, Sequence(0, system + [21, 22, 23], "sql@1", SamplingParams()))
c2 = computed(unsafe, Sequence(2, system + [21, 22, 23], "chat@2", SamplingParams()))
shared = sorted(set(a2.block_table) & set(c2.block_table))
print(f"unsafe key: chat@2 reused {c2.hit} tokens; blocks shared with sql@1: {shared}")
print("safe key:   blocks shared between sql@1 and chat@2:", sorted(set(a.block_table) & set(c.block_table)))

# %% [markdown]
# Nothing crashes and the hit rate even looks better; the outputs of `chat@2` are silently computed
# from another adapter's keys and values. And without chaining, a block equal to another in its own
# tokens but after a different prefix would collide:

# %%
p1, p2 = [1, 2, 3, 4, 9, 9, 9, 9], [5, 6, 7, 8, 9, 9, 9, 9]
unchained = [[policies.stable_hash((None, "sql@1", tuple(p[i:i + 4]))) for i in (0, 4)] for p in (p1, p2)]
print("unchained second-block keys equal:", unchained[0][1] == unchained[1][1])
print("chained second-block keys equal:  ", policies.block_hashes(p1, "sql@1", 4)[1] == policies.block_hashes(p2, "sql@1", 4)[1])

# %% [markdown]
# ### Exercise ch11.1: `block_hashes`
#
# Write `block_hashes(token_ids, adapter_id, block_size)`: the prefix-cache key of every **full**
# block of `token_ids` (a sequence of ints) under the adapter with uid `adapter_id` (None is the base
# model), as a list of ints:
#
# ```
# h[-1] = None
# h[i]  = stable_hash((h[i-1], adapter_id, tuple(token_ids[i*B:(i+1)*B])))   for each full block i
# ```
#
# with `stable_hash` from `reference.engine.policies` (imported in the cell). A trailing partial
# block has no key. Raise `ValueError` when `block_size < 1`. Example: block size 2, tokens
# `[5, 6, 7]` give one key, `stable_hash((None, adapter_id, (5, 6)))`.

# %% exercise="ch11.1" role="answer"
from reference.engine.policies import stable_hash


def block_hashes(token_ids, adapter_id, block_size):
    """The prefix-cache key of every full block, chained over (adapter uid, the block's tokens)."""
    ### BEGIN SOLUTION
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    keys, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = tuple(token_ids[start:start + block_size])
        parent = stable_hash((parent, adapter_id, block))
        keys.append(parent)
    return keys
    ### END SOLUTION


# %% exercise="ch11.1" role="test"
graders.check("ch11.1", block_hashes)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch11.1")

# %% [markdown]
# ## 3. Admission: KV blocks and the adapter cap
#
# In a prefill step the scheduler admits waiting requests. Two resources limit it:
#
# - **KV blocks**: a request needs blocks for its whole prompt (fewer when its prefix is cached);
# - **adapter slots**: the pool has `max_loras_per_batch` GPU slots (SGLang's name; vLLM's is
#   `max_loras`), and every adapter of a running request must sit in one for the whole step. The
#   **base model takes a slot** like any adapter (a rank-0 slot: chapter 05), so a batch of the base
#   model and two adapters needs 3.
#
# `policies.admit_requests` decides, in this order:
#
# 1. **Warm first**: candidates whose adapter is running or resident (already in a slot) before the
#    others, each part in arrival order (a stable sort). A warm request costs no load; a cold one may
#    evict an adapter from its slot.
# 2. A candidate of the **drained** adapter (section 4) is skipped.
# 3. A candidate whose uid would push the distinct uids (running, admitted, its own) past the cap is
#    **skipped**, and admission goes on: a later request of an adapter already in the set still fits.
# 4. A candidate that needs more KV blocks than are free **stops** admission: later requests wait
#    too, so a big request is never overtaken forever by small ones (the cap skips; KV stops).
#
# The docstring's example: two slots, the base model running, adapter `a` resident, waiting
# `[b, a, a]`: the order is `a, a, b`; both `a` requests join, and `b` is skipped (the base, `a`
# and `b` would need three slots):

# %%
C = policies.Candidate
waiting = [C(0, "b", 1, 0), C(1, "a", 1, 0), C(2, "a", 1, 0)]
print("admitted:", policies.admit_requests(waiting, [None], {"a"}, max_loras_per_batch=2, free_blocks=10,
                                           max_new_seqs=8))
print("KV stops, the small one behind waits:",
      policies.admit_requests([C(0, "a", 3, 0), C(1, "a", 1, 0)], [], set(), 2, free_blocks=2, max_new_seqs=8))

# %% [markdown]
# ### Exercise ch11.2: `admit_requests`
#
# Write `admit_requests(waiting, running_uids, resident_uids, max_loras_per_batch, free_blocks,
# max_new_seqs, draining=None, drain_active=False)`. `waiting` is a list of `Candidate` (fields
# `seq_id`, `uid`, `blocks_needed`, `waited`) in arrival order; `running_uids` the uids of the running
# requests (a list: a uid may appear more than once); `resident_uids` a set. Return the `seq_id`s of
# the admitted candidates, in the order they are admitted:
#
# ```
# order: candidates whose uid is running or resident first, then the others; each part keeps
#        arrival order
# for c in that order, until max_new_seqs are admitted:
#     skip c if drain_active and c.uid == draining        (None is a real uid: the base model)
#     skip c if the distinct uids of running_uids, the admitted ones and c.uid exceed max_loras_per_batch
#     stop if c.blocks_needed > the blocks still free
#     admit c (the free blocks go down by c.blocks_needed)
# ```
#
# Raise `ValueError` when `max_loras_per_batch < 1`, or `free_blocks` or `max_new_seqs` is negative.

# %% exercise="ch11.2" role="answer"
def admit_requests(waiting, running_uids, resident_uids, max_loras_per_batch, free_blocks, max_new_seqs,
                   draining=None, drain_active=False):
    """The seq_ids of the waiting candidates that start now, in the order they are admitted."""
    ### BEGIN SOLUTION
    if max_loras_per_batch < 1 or free_blocks < 0 or max_new_seqs < 0:
        raise ValueError("need max_loras_per_batch >= 1, free_blocks >= 0 and max_new_seqs >= 0")
    warm = set(running_uids) | set(resident_uids)
    order = sorted(waiting, key=lambda c: c.uid not in warm)  # stable: arrival order in each part
    chosen, admitted = set(running_uids), []
    for c in order:
        if len(admitted) == max_new_seqs:
            break
        if drain_active and c.uid == draining:
            continue
        if len(chosen | {c.uid}) > max_loras_per_batch:
            continue
        if c.blocks_needed > free_blocks:
            break
        admitted.append(c.seq_id)
        chosen.add(c.uid)
        free_blocks -= c.blocks_needed
    return admitted
    ### END SOLUTION


# %% exercise="ch11.2" role="test"
graders.check("ch11.2", admit_requests)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch11.2")

# %% [markdown]
# ## 4. Starvation, and the drain
#
# The cap has a failure mode. Suppose two slots, a long request of adapter `b` decoding for 60
# steps, and a hot adapter `a` whose requests keep arriving. Whenever an `a` request finishes,
# another `a` request is already waiting, and it is warm (its adapter runs), so it is admitted first;
# a request of a third adapter `c` can only start when `a` **or** `b` has no request left running,
# which with this traffic does not happen. Nothing is wrong with any single decision; `c` starves.
#
# SGLang's `LoRADrainer` fixes it. A request **starves** when it has waited more than a threshold and
# the cap is what keeps it out: its adapter is not running and every slot is taken (KV is not the
# reason). Then one running adapter is **drained**: it takes no new requests, so its slot frees once its running ones finish, and the
# drain lasts until the starving adapter is running (ended earlier, the slot would go straight back
# to the drained adapter: it is still resident, and admission prefers resident adapters), or until
# none of its requests waits any more (one that ends in the very step that admits it is never seen
# running). The adapter drained is the one whose requests finish soonest (the smallest
# "most tokens any of its requests still has to generate"), ties broken by `uid_sort_key` (base
# first). This book drains one adapter at a time and holds all of its requests; SGLang may drain one
# per starving adapter and still admits a drained adapter's requests short enough to finish within
# its remaining time.
#
# The trace above, through the `Scheduler` with the fake model, without a drain and with a threshold
# of 4 steps:

# %%
def drain_trace(threshold, steps=90):
    """Cap 2: 'b' decodes for 60 steps, a hot 'a' gets a request every 3 steps, 'c' waits for a slot.
    Returns the scheduler and, per request, (arrival step, admission step, finish step) (None: not
    within the trace)."""
    sched = Scheduler(SchedulerConfig(8, 64, 2, drain_threshold=threshold), BlockManager(256, 4))
    first = [Sequence(0, [0, 1], "a", SamplingParams(max_new_tokens=10)),
             Sequence(100, [5, 5], "b", SamplingParams(max_new_tokens=60)),
             Sequence(101, [7, 7], "c", SamplingParams(max_new_tokens=2))]
    life = {}
    for s in first:
        sched.add(s)
        life[s.seq_id] = [1, None, None]
    for t in range(1, steps):
        if t % 3 == 0:
            sched.add(Sequence(t, [t % 50, 1], "a", SamplingParams(max_new_tokens=10)))
            life[t] = [t, None, None]
        seen = len(sched.events)
        step(sched)
        for e in sched.events[seen:]:
            if e[0] in ("admit", "finish") and life[e[1]][1 if e[0] == "admit" else 2] is None:
                life[e[1]][1 if e[0] == "admit" else 2] = t
    return sched, life


for threshold in (None, 4):
    s, life = drain_trace(threshold)
    arrival, admitted, finished = life[101]
    a_waits = [adm - arr for i, (arr, adm, _) in life.items() if i not in (100, 101) and adm is not None]
    drains = [e for e in s.events if e[0] in ("drain", "drain_end")][:3]
    print(f"drain threshold {threshold}: 'c' admitted at step {admitted}, finished at step {finished} "
          f"(None: not within 89 steps); 'a': {len(a_waits)} requests admitted, longest wait "
          f"{max(a_waits)} steps; first drain events {drains}")


# %% [markdown]
# Without the drain `c` never runs within the trace. With it, `a` is drained (its requests have at
# most 10 tokens left, `b`'s request 60), the new `a` requests wait while the running ones finish,
# `c` is admitted into the freed slot, and then the drain ends. The next event is a drain again, now
# of `c` itself (it runs and `a` waits past the threshold), so the slots keep turning over. The price is a longer
# wait for some of `a`'s requests (the longest `a` wait above): a bounded wait for everyone instead
# of an unbounded one for the rare adapter.

# %% [markdown]
# ### Exercise ch11.3: `choose_drain`
#
# Write `choose_drain(waiting, running_remaining, max_loras_per_batch, threshold)`. `waiting` is a
# list of `Candidate`; `running_remaining` maps each running uid to the most tokens any of its
# requests still has to generate. Return `(True, uid)` to drain `uid`, or `(False, None)`:
#
# ```
# running = the uids of running_remaining
# starved = the waiting candidates with waited > threshold whose uid is not running,
#           and only if len(running) >= max_loras_per_batch (otherwise: none)
# if none: (False, None)
# else: (True, the running uid with the smallest remaining, ties broken by uid_sort_key)
# ```
#
# `uid_sort_key` (from `reference.mem_pool`, imported in the cell) orders any uids: the base model
# (None) first, then by type name, then by value (ints as numbers: 9 before 10, though "10" < "9" as
# text). Raise `ValueError` when `threshold < 0` or `max_loras_per_batch < 1`. Example: cap 2,
# running `{a: 30, b: 4}`, waiting `[c waited 5]`, threshold 4: `(True, "b")`.

# %% exercise="ch11.3" role="answer"
from reference.mem_pool import uid_sort_key


def choose_drain(waiting, running_remaining, max_loras_per_batch, threshold):
    """(True, the running uid to drain) when a request starves behind the adapter cap, else (False, None)."""
    ### BEGIN SOLUTION
    if threshold < 0 or max_loras_per_batch < 1:
        raise ValueError("need threshold >= 0 and max_loras_per_batch >= 1")
    if len(running_remaining) < max_loras_per_batch:
        return False, None
    if not any(c.waited > threshold and c.uid not in running_remaining for c in waiting):
        return False, None
    victim = min(running_remaining, key=lambda u: (running_remaining[u], uid_sort_key(u)))
    return True, victim
    ### END SOLUTION


# %% exercise="ch11.3" role="test"
graders.check("ch11.3", choose_drain)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch11.3")

# %% [markdown]
# ## 5. Routing across instances
#
# With several engine instances (data parallelism: each a whole copy of the model with its own slot
# pool and prefix cache), a router picks the instance of each request. Round robin balances load
# perfectly and ignores adapters: every instance ends up serving every adapter, so each one loads
# adapters into its slots over and over and its prefix cache holds every adapter's prompts.
# **Consistent hashing** on the adapter keeps an adapter on one instance:
#
# - the ring holds `vnodes` points per instance at `stable_hash((instance, v))`; a key sits at
#   `stable_hash(key)` and walks clockwise to the first point at or after it, **wrapping** past the
#   last point to the first; `policies.ring_walk` lists the instances in the order the walk meets
#   them. Adding or removing an instance moves only the keys next to its points;
# - **bounded load** (Mirrokni, Thorup and Zadimoghaddam, 2018): an instance is full when its load
#   reaches `ceil(capacity_factor * (sum(loads) + 1) / n)`, the average load after this request
#   times the factor; a full instance is passed over, so a hot adapter spills to the next instances
#   of its walk instead of overloading its home;
# - **replicas**: a hot adapter can be given several instances, the first `replicas` open ones of its
#   walk, and each request goes to the least loaded of them.

# %%
import math

key = "sql@1"
print("ring walk of", key, "over 4 instances:", policies.ring_walk(key, 4, vnodes=8))
loads = [0, 0, 0, 0]
placed = []
for _ in range(12):  # one hot adapter, nothing finishing: the bound spreads it
    bound = math.ceil(1.25 * (sum(loads) + 1) / len(loads))  # what route computes: the load after this request
    i = policies.route(key, loads, vnodes=8, capacity_factor=1.25)
    loads[i] += 1
    placed.append((i, int(bound)))
print("12 requests of one adapter, (instance, bound):", placed, "-> loads", loads)

# %% [markdown]
# The key's home (the first instance of its walk) takes requests until it reaches the bound, then the
# next instances of the walk take the overflow. The last instance of the walk is never needed here:
# the bound grows with the total load (a factor 1.25 over the average), so three instances stay open
# for all twelve requests. A smaller factor spreads the key wider; a larger one keeps it closer to home.
#
# A small simulation: 4000 requests of 32 adapters whose popularity follows a Zipf law (adapter k
# drawn with weight 1/(k+1)), over N = 4 simulated instances. Each request stays on its instance for
# the next 8 arrivals (its load), and per window of 200 arrivals we count each instance's distinct
# adapters: roughly the adapters it had to load into its slots in that window, and the prompts its
# prefix cache must hold. Round robin against `route` (vnodes 8, capacity factor 1.25), and `route`
# with 2 replicas for the two hottest adapters:

# %%
def simulate(choose, trace, num_instances=4, duration=8, window=200):
    """Route ``trace`` (adapter keys, one per arrival); returns (mean distinct adapters per instance
    per window, the largest load any instance had, requests per instance)."""
    loads, ends, counts = [0] * num_instances, [], [0] * num_instances
    seen, per_window, peak = [set() for _ in range(num_instances)], [], 0
    for t, key in enumerate(trace):
        while ends and ends[0][0] <= t:  # requests that finished by now
            loads[ends.pop(0)[1]] -= 1
        i = choose(key, loads, t)
        loads[i] += 1
        counts[i] += 1
        peak = max(peak, loads[i])
        ends.append((t + duration, i))
        seen[i].add(key)
        if (t + 1) % window == 0:
            per_window += [len(s) for s in seen]
            seen = [set() for _ in range(num_instances)]
    return statistics.mean(per_window), peak, counts


rng = random.Random(0)
adapters = [f"adapter-{k}" for k in range(32)]
trace = rng.choices(adapters, weights=[1 / (k + 1) for k in range(32)], k=4000)
hot = set(adapters[:2])
policies_compared = {
    "round robin": lambda key, loads, t: t % len(loads),
    "route, replicas 1": lambda key, loads, t: policies.route(key, loads, 8, 1.25),
    "route, 2 replicas for the 2 hottest": lambda key, loads, t: policies.route(key, loads, 8, 1.25,
                                                                                replicas=2 if key in hot else 1),
}
print(f"{'policy':38s} {'distinct adapters / instance / window':>38s} {'peak load':>10s}  requests per instance")
results = {}
for name, choose in policies_compared.items():
    results[name] = simulate(choose, trace)
    distinct, peak, counts = results[name]
    print(f"{name:38s} {distinct:38.2f} {peak:10d}  {counts}")
saving = 1 - results["route, replicas 1"][0] / results["round robin"][0]
print(f"route cuts the distinct adapters per instance by {saving:.0%} against round robin")

# %% [markdown]
# Round robin spreads every adapter over every instance; `route` keeps most of each adapter's
# requests on its home instance and spills the rest along its walk only when the home is full, at
# a peak load the bound keeps close to round robin's. How many distinct adapters an instance sees
# is what decides its slot swaps (chapter 05) and whether its prefix cache holds an adapter's
# prompts at all (section 2). Replicas for the two hottest adapters even out the requests per
# instance (compare the smallest count in the last column) at almost no cost in distinct adapters.
#
# Distinct adapters are a proxy. `reference.engine.cluster.simulate_cluster` measures what they cost:
# four instances, each a real scheduler, block manager and slot pool (3 adapter slots, a CPU tier of
# 8 copies) stepped in lockstep with the fake model, fed a Zipf trace whose requests of one adapter
# share that adapter's system prompt. Swap-ins count adapter loads into GPU slots; the prefix-hit
# rate is the share of looked-up prompt tokens found in the cache:

# %%
from reference.engine.cluster import simulate_cluster, zipf_trace

cluster_trace = zipf_trace(240, 24, seed=0)
for policy in ("round_robin", "affinity"):
    r = simulate_cluster(cluster_trace, 4, policy)
    print(f"{policy:12s}: {r['adapters_per_batch']:.2f} adapters per batch, {r['swap_ins']:3d} swap-ins, "
          f"prefix-hit rate {r['prefix_hit_rate']:.2f}, {r['steps']} steps, requests per instance {r['per_instance']}")

# %% [markdown]
# ### Exercise ch11.4: `route`
#
# Write `route(adapter_key, loads, vnodes, capacity_factor, replicas=1)`: the instance (an index
# into `loads`, the current load of each instance) for a request of `adapter_key`:
#
# ```
# walk = ring_walk(adapter_key, len(loads), vnodes)
# bound = ceil(capacity_factor * (sum(loads) + 1) / len(loads))     (the load after this request)
# open = [i for i in walk if loads[i] < bound]
# candidates = open[:replicas]
# return the candidate with the smallest load, ties to the earliest in the walk
# ```
#
# The bound is computed in floating point exactly as written, `math.ceil(capacity_factor * (sum(loads)
# + 1) / len(loads))` (left to right: multiply, then divide), as a router written in Python does. It
# can differ from exact arithmetic: the cell after this one shows factor 1.1 with 5 instances and 49
# requests in flight. The grader uses the floating-point formula.
#
# `ring_walk` is given (imported in the cell). Raise `ValueError` when `loads` is empty,
# `capacity_factor < 1`, `replicas < 1` or a load is negative (`ring_walk` raises for `vnodes < 1`).
# With `capacity_factor >= 1`, `open` is never empty (the least loaded instance is below the
# average, hence below the bound).

# %%
from fractions import Fraction
import math

print("float:", 1.1 * (49 + 1) / 5, "-> bound", math.ceil(1.1 * (49 + 1) / 5))
print("exact:", Fraction(11, 10) * (49 + 1) / 5, "-> bound", math.ceil(Fraction(11, 10) * (49 + 1) / 5))

# %% exercise="ch11.4" role="answer"
import math

from reference.engine.policies import ring_walk


def route(adapter_key, loads, vnodes, capacity_factor, replicas=1):
    """The instance for a request of adapter_key: its ring walk, bounded load, the least loaded of `replicas`."""
    ### BEGIN SOLUTION
    if not loads or capacity_factor < 1 or replicas < 1 or min(loads) < 0:
        raise ValueError("need instances, capacity_factor >= 1, replicas >= 1 and loads >= 0")
    walk = ring_walk(adapter_key, len(loads), vnodes)
    bound = math.ceil(capacity_factor * (sum(loads) + 1) / len(loads))
    candidates = [i for i in walk if loads[i] < bound][:replicas]
    return min(candidates, key=lambda i: (loads[i], candidates.index(i)))
    ### END SOLUTION


# %% exercise="ch11.4" role="test"
graders.check("ch11.4", route)

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch11.4")

# %% [markdown]
# ## 6. The whole engine, against PEFT
#
# `reference.engine.LLM` joins the control plane of this chapter to the data plane of chapters
# 05-07: the pool's GPU slots with their CPU and disk tiers (`prepare_lora_batch`), the LoRA layers
# wrapped around a Hugging Face Llama's projections, and `ModelRunner`, a Llama forward over the
# paged cache (its attention gathers each sequence's blocks through its block table). One step:
# the scheduler picks the work, the pool makes the adapters resident (the running ones kept), the
# runner computes the logits of each sequence's last token, the sampler picks the next tokens, the
# scheduler records them. The API is vLLM's: adapters registered by name from PEFT folders, requests
# as token ids with `SamplingParams`, `generate(prompts, params, lora_request=names)`.
#
# The judge of this chapter (and of the book): every request's greedy tokens equal PEFT's own greedy
# `generate` of that request alone. A tiny Llama, four PEFT adapters of different ranks and targets,
# a pool of 2 GPU slots (the base model takes one while it runs) and a CPU tier of 2 copies, a KV cache of 12
# blocks of 4 positions, prompts that share a prefix:

# %%
import copy
import tempfile
import warnings
from pathlib import Path

import torch

import peft
import transformers

from reference.engine import LLM, EngineConfig, EnginePolicies, SamplingParams
from reference.engine.policies import block_hashes as reference_block_hashes  # yours (ch11.1) keeps its name

torch.manual_seed(0)
tiny = transformers.LlamaForCausalLM(transformers.LlamaConfig(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    vocab_size=128, max_position_embeddings=64)).eval()
adapter_root = Path(tempfile.mkdtemp(prefix="ch11-adapters-"))
adapter_configs = {"qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                   "kv": dict(r=8, lora_alpha=16, target_modules=["k_proj", "v_proj"]),
                   "mlp": dict(r=6, lora_alpha=12, target_modules=["gate_proj", "up_proj", "down_proj"]),
                   "all": dict(r=16, lora_alpha=16, target_modules="all-linear", use_rslora=True)}
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for seed, (name, kw) in enumerate(adapter_configs.items()):
        torch.manual_seed(100 + seed)
        peft.get_peft_model(copy.deepcopy(tiny), peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(
            adapter_root / name)

# overlap_decode=False: the plain loop, one step at a time, so the scheduler's log below reads in order
# (the default overlaps decode steps with the host's work: section 9)
engine_config = EngineConfig(max_loras_per_batch=2, max_lora_rank=16, max_loaded_loras=2, num_kv_blocks=12,
                             block_size=4, max_num_seqs=4, max_num_batched_tokens=16, overlap_decode=False)
llm = LLM(copy.deepcopy(tiny), engine_config)
for name in adapter_configs:
    print(f"registered {name!r} as uid {llm.register_adapter(name, adapter_root / name)!r}")

system = list(range(20, 33))  # 13 tokens every request starts with
requests = [(system + [1, 2, 3], "qv"), (system + [4, 5], "qv"), (system + [1, 2, 3], "kv"), ([7, 8, 9], None),
            (system + [6], "mlp"), (system + [1, 2], "all"), ([7, 8, 9, 10], "qv"), (system + [4, 5, 6, 7], None)]
params = SamplingParams(max_new_tokens=6)
outputs = llm.generate([p for p, _ in requests], params, lora_request=[a for _, a in requests])
for out in outputs:
    print(f"request {out.request_id} ({out.adapter}): {out.token_ids} ({out.finish_reason})")
print({k: v for k, v in llm.stats.items()})

# %% [markdown]
# The same requests through PEFT, one at a time (`set_adapter`, or `disable_adapter` for the base):

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    names = list(adapter_configs)
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(tiny), adapter_root / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapter_root / name, adapter_name=name)
peft_model.eval()


def peft_generate(prompt, adapter, max_new_tokens):
    ids = torch.tensor([prompt])
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if adapter is None:
            with peft_model.disable_adapter():
                return peft_model.generate(input_ids=ids, **kw)[0, len(prompt):].tolist()
        peft_model.set_adapter(adapter)
        return peft_model.generate(input_ids=ids, **kw)[0, len(prompt):].tolist()


agree = [out.token_ids == peft_generate(p, a, params.max_new_tokens) for out, (p, a) in zip(outputs, requests)]
print(f"{sum(agree)} of {len(agree)} requests token for token equal to PEFT's generate")
assert all(agree)

# %% [markdown]
# Everything the chapters built was exercised on the way: the stats above count the steps (prefill,
# decode and mixed: by default the engine puts the running decodes into prefill steps, section 9),
# the preemptions the small KV cache forced, the pool's loads and evictions (the tier of each load
# is in the pool's log below), and the prefix cache's hit tokens: the qv requests share
# the system prompt's blocks, preempted requests re-find their own blocks when they come back, and
# the kv, mlp and all requests with the same prompt share nothing. The base model is a uid like the
# others: it takes one of the two slots only while a base request runs. The scheduler's log tells
# the story of the first steps:

# %%
for event in llm.scheduler.events[:16]:
    print(event)
print("pool loads (uid, slot, tier):", [e[1:] for e in llm.pool.events if e[0] == "load"])
print("pool evictions:", [e[1:] for e in llm.pool.events if e[0] in ("evict", "cpu_evict")])

# %% [markdown]
# What the adapter in the key buys: the same engine with an adapter-blind key (tokens only), two
# requests with one prompt under two adapters, one after the other. The second reuses the first's
# blocks, whose K and V the first adapter's LoRA on k and v computed:

# %%
blind = EnginePolicies(block_hashes=lambda tokens, adapter_id, size: reference_block_hashes(tokens, "any", size))
one_at_a_time = EngineConfig(max_loras_per_batch=3, max_lora_rank=16, num_kv_blocks=12, block_size=4, max_num_seqs=1)
prompt = system + [1, 2, 3, 4]
for label, engine_policies in (("adapter in the key", EnginePolicies()), ("tokens only", blind)):
    engine = LLM(copy.deepcopy(tiny), one_at_a_time, policies=engine_policies)
    for name in ("qv", "kv"):
        engine.register_adapter(name, adapter_root / name)
    second = engine.generate([prompt, prompt], params, lora_request=["qv", "kv"])[1]
    print(f"{label:20s}: kv request -> {second.token_ids}, PEFT {peft_generate(prompt, 'kv', 6)}, "
          f"prefix hit tokens {engine.stats['prefix_hit_tokens']}")

# %% [markdown]
# ## 7. Capstone: your control plane in the engine
#
# Section 6 ran the book's policies. The engine takes others through one hook,
# `EnginePolicies(block_hashes=..., admit_requests=..., choose_drain=...)`: the block manager keys
# its prefix cache with the first, the scheduler admits with the second and drains with the third,
# with exactly the signatures of ch11.1-ch11.3. What is left is the code that joins the two planes
# in every step, the `step` of this chapter's first cell with the fake model replaced by the paged
# runner. Its inputs, on a fresh engine of section 6's configuration with three requests (a short
# prompt of `kv`, a prompt of `qv` longer than the token budget, a base request), over two steps.
# The engine's default mixes decodes into prefill steps (section 9); the capstone's engine keeps
# prefill first (`mixed_steps=False`, nano-vllm's rule), and so does this demo. No model runs here:
# `postprocess` is handed a made-up token 0 for every row that reached its sequence's end, only to
# move the scheduler on:

# %%
import dataclasses

from reference.engine.sequence import Sequence as EngineSequence

demo = LLM(copy.deepcopy(tiny), dataclasses.replace(engine_config, mixed_steps=False))  # the capstone's policy
for name in ("qv", "kv"):
    demo.register_adapter(name, adapter_root / name)
demo_prompts = [([5, 6, 7], "kv", 3), (list(range(40, 60)), "qv", 4), ([9, 9, 9, 9], None, 2)]
for seq_id, (prompt, name, n) in enumerate(demo_prompts):
    uid = None if name is None else demo.registry.uid_of(name)
    demo.scheduler.add(EngineSequence(seq_id, prompt, uid, SamplingParams(max_new_tokens=n)))
print("token budget per step:", engine_config.max_num_batched_tokens, "| GPU slots:", engine_config.max_loras_per_batch)
for step_no in (1, 2):
    kind, work = demo.scheduler.schedule()
    print(f"step {step_no}: schedule() -> {kind!r}")
    for w in work:
        print(f"  Work(seq {w.seq.seq_id}, adapter {w.seq.uid!r}, start {w.start}, end {w.end}): "
              f"{w.end - w.start} of its {w.seq.num_tokens} tokens, blocks {w.seq.block_table}, "
              f"reaches its end: {w.end == w.seq.num_tokens}")
    print(f"  uids of the running sequences: {[s.uid for s in demo.scheduler.running]}; of this step's work: "
          f"{[w.seq.uid for w in work]}; waiting: {[s.seq_id for s in demo.scheduler.waiting]}")
    demo.scheduler.postprocess(work, {w.seq.seq_id: 0 for w in work if w.end == w.seq.num_tokens})

# %% [markdown]
# In the first step the scheduler admitted the short `kv` prompt whole and the `qv` prompt up to the
# budget; the base request waits, as the two slots are taken (the cap of section 3). Every
# `Work(seq, start, end)` asks for `seq.tokens[start:end]`; the runner takes each as a
# `SeqWork(token_ids, start, block_table, uid)` (the tokens, the position of the first one, where
# the sequence's KV lives, its adapter) and returns the logits of each one's last token, one row per
# work item in work order. Only a row whose `end` is its sequence's last token has a next token to
# pick (`reaches its end: True`); the `qv` chunk's row is discarded. `scheduler.postprocess(work,
# next_tokens)` then records the computed KV and appends the picked tokens (`next_tokens[seq_id]`
# for every row that reached its end). In the second step, prefill first: `schedule()` returns
# `'prefill'`, the rest of the `qv` prompt runs, starting where the first chunk ended, and the `kv`
# sequence, which now decodes, computes nothing: it is among the running sequences but not in the
# step's work, so the running uids hold `kv@1` and the work's uids do not.
#
# One more argument: in a prefill step the decoding sequences compute nothing, yet their adapters
# must stay in their slots (the next decode step needs them, and the pool evicts whatever it is not
# told is in use). `runner.forward(batch, running=uids)` keeps the adapters of `running` resident
# beside the batch's own: the uids of every running sequence. (With the engine's default mixed
# steps, `schedule()` would return `'mixed'` in the second step, with the `kv` decode in the work
# beside the `qv` chunk: there every running decode computes, and `running` matters less.)
#
# The judge of section 6 then grades the whole: your three policies and your step in the engine, on
# workloads that exercise each mechanism (chunked prefill beside decodes, one prompt under two
# adapters that both change K and V, equal blocks after different prefixes, more adapters than
# slots with base requests, a KV cache small enough to preempt, a starving adapter with a drain
# threshold, and mixed draws). Every request's tokens must equal PEFT's generate of it alone, and
# the engine's log (one line per step: admissions, chunks with their start, decodes, preemptions,
# drains, finishes, and the adapters the pool kept, loaded and evicted) must equal the reference's
# step by step. A policy mistake that leaves the tokens right still changes the log where it
# changes the schedule: a prefix hit the reference does not make, another admission order, another
# drained adapter. The report names the first step that differs, and which of your functions gave
# another answer than its contract there.
# These workloads do not reach every case of the three policies' contracts (an over-cap request
# whose KV also does not fit, for one): a policy can pass the judge and still be wrong there.
# Exercises ch11.1-ch11.3's own checks grade every case; the judge grades how the pieces fit.
#
# ### Exercise ch11.5: `engine_step` (capstone)
#
# Write `engine_step(scheduler, runner)`: one step of the engine with greedy decoding. `scheduler` is
# the engine's `Scheduler` (its policies are your ch11.1-ch11.3 functions), `runner` its
# `ModelRunner`. Semantics:
#
# ```
# kind, work = scheduler.schedule()       # kind: "prefill", "decode", "mixed" or "idle" (no work: return it)
# for each work item, in work order, the runner computes seq.tokens[start:end]: positions start..end-1,
#     KV written to and read from seq's blocks, under seq's adapter (one SeqWork per item)
# every RUNNING sequence's adapter stays resident during the forward, also if it computes nothing now
# the forward's logits: row i = the next-token logits after work item i's last token
# for each item that reaches its sequence's end (end == seq.num_tokens): next token = argmax of its row
#     (greedy, ties to the lowest token id); an item short of its end gives no token
# scheduler.postprocess(work, {seq_id: next token}); return kind
# ```
#
# `SeqWork(token_ids, start, block_table, uid)` comes from `reference.engine.model_runner` (imported
# in the cell); `runner.forward(batch, running=uids)` takes the step's SeqWorks and the uids to keep
# resident, and returns the logits `[len(batch), vocab]`. The check runs the engine with your
# `block_hashes`, `admit_requests` and `choose_drain` as its policies: their answer cells are re-run
# beside this one, so a mistake there costs the capstone where the judge sees it (wrong tokens,
# another schedule), and a function that raises or hangs is named in the report. Finish
# ch11.1-ch11.3 first.

# %% exercise="ch11.5" role="answer"
from reference.engine.model_runner import SeqWork


def engine_step(scheduler, runner):
    """One engine step: schedule, run the model on the step's work, record each finished row's greedy token."""
    ### BEGIN SOLUTION
    kind, work = scheduler.schedule()
    if not work:
        return kind
    batch = [SeqWork(w.seq.tokens[w.start:w.end], w.start, list(w.seq.block_table), w.seq.uid) for w in work]
    logits = runner.forward(batch, running=[s.uid for s in scheduler.running])
    next_tokens = {}
    for i, w in enumerate(work):
        if w.end == w.seq.num_tokens:  # its last token is the sequence's last: its logits pick the next
            next_tokens[w.seq.seq_id] = int(logits[i].argmax())
    scheduler.postprocess(work, next_tokens)
    return kind
    ### END SOLUTION


# %% exercise="ch11.5" role="test"
graders.check("ch11.5", engine_step, uses=(block_hashes, admit_requests, choose_drain))

# %% [markdown]
# The reference (shown once your check passed):

# %%
graders.show_reference("ch11.5")

# %% [markdown]
# With your answers in place, the engine is yours from the block keys to the step; section 6's
# workload through it, against PEFT (this cell needs ch11.1-ch11.3 and ch11.5 solved):

# %%
mine = LLM(copy.deepcopy(tiny), engine_config, policies=EnginePolicies(
    block_hashes=block_hashes, admit_requests=admit_requests, choose_drain=choose_drain))
for name in adapter_configs:
    mine.register_adapter(name, adapter_root / name)
try:
    my_outputs = mine.generate([p for p, _ in requests], params, lora_request=[a for _, a in requests],
                               step=engine_step)
    agree = [out.token_ids == peft_generate(p, a, params.max_new_tokens) for out, (p, a) in zip(my_outputs, requests)]
    print(f"your engine: {sum(agree)} of {len(agree)} requests token for token equal to PEFT's generate; "
          f"scheduler log equal to the reference engine's: {mine.scheduler.events == llm.scheduler.events}")
except NotImplementedError as exc:
    print(f"not yet: {exc!r} (solve ch11.1-ch11.3 and ch11.5 first)")

# %% [markdown]
# ## 8. The engine under load, measured on an H200
#
# (These rows were measured before section 9's changes: torch attention over padded tables,
# prefill-first steps. Section 9 measures the engine as it is now against the hardware's floor.)
#
# Everything above ran a tiny model on the CPU, where time says nothing. `benchmarks/
# benchmark_engine.py` runs the same engine on a Llama-3-8B-shaped model (its layer shapes, random
# bf16 weights, a few layers: the results say how many) on an H200: a few hundred requests with
# prompts of 128-1024 tokens and 128 new tokens each, every request arriving at once, request i's
# adapter drawn from a Zipf popularity over D adapters of rank 16 on every projection (S-LoRA's and
# Punica's experiment), decode steps replayed from CUDA graphs, the Triton LoRA kernels of chapter 07.
# Beside it: the same requests on the base model alone, and through HF PEFT's own mixed-adapter
# batches (`adapter_names`). The committed results:

# %%
import json

bench = json.loads(Path(reference.__file__).resolve().parents[1].joinpath(
    "benchmarks", "results", "engine_h200.json").read_text())
print(f"device: {bench['device']} (torch {bench['torch']}, triton {bench['triton']}); {bench['layers']} layers; "
      f"{bench['requests']} requests, prompts {bench['prompt_lens'][0]}-{bench['prompt_lens'][1]} tokens, "
      f"{bench['new_tokens']} new tokens; decode: {bench['decode']}; "
      f"max_loras_per_batch {bench['engine_config']['max_loras_per_batch']}")
print(f"{'system':7} {'D':>4} {'distinct':>8} {'tok/s':>8} {'TPOT p50':>9} {'TPOT p99':>9} {'TTFT p50':>9} "
      f"{'TTFT p99':>9} {'steps':>6} {'loads':>6}")
for row in bench["rows"]:
    if row["system"] == "engine":
        print(f"{'engine':7} {row['adapters']:4d} {row['distinct_in_trace']:8d} {row['tokens_per_s']:8.0f} "
              f"{row['tpot_ms_p50']:7.1f}ms {row['tpot_ms_p99']:7.1f}ms {row['ttft_s_p50']:8.2f}s "
              f"{row['ttft_s_p99']:8.2f}s {row['steps']:6d} {row['adapter_loads']:6d}")
    else:
        print(f"{'peft':7} {row['adapters']:4d} {'':8} {row['tokens_per_s']:8.0f}   ({row['requests']} requests, "
              f"batches of {row['batch']})")
engine = {r["adapters"]: r for r in bench["rows"] if r["system"] == "engine"}
peft_rows = {r["adapters"]: r for r in bench["rows"] if r["system"] == "peft"}
print(f"\n64 adapters: {engine[64]['tokens_per_s'] / engine[1]['tokens_per_s']:.2f} of one adapter's throughput, "
      f"{engine[64]['tokens_per_s'] / engine[0]['tokens_per_s']:.2f} of the base model's, "
      f"{engine[64]['tokens_per_s'] / peft_rows[64]['tokens_per_s']:.1f}x PEFT's mixed batches")
print(f"64 adapters: {engine[64]['distinct_in_trace']} distinct in the trace against "
      f"{bench['engine_config']['max_loras_per_batch']} slots: {engine[64]['steps']} steps "
      f"({engine[64]['decode_steps']} decode) against {engine[1]['steps']} ({engine[1]['decode_steps']}) for one adapter")
for t in bench["targets"]:
    print(("met:    " if t["met"] else "missed: ") + t["target"], f"(measured {t['value']})")
print(f"64 adapters against the base model, unrounded: {engine[64]['tokens_per_s'] / engine[0]['tokens_per_s']:.6f}")

# %% [markdown]
# How to read the header and the targets:
#
# - `max_loras_per_batch` is the number of GPU slots, and the base model takes one like any adapter
#   (section 3's cap): 32 adapters plus the base.
# - The torch and Triton printed are the GPU machine's own (its image), not the versions
#   `requirements.txt` pins for the CPU; the engine's source is the same.
# - Each row is one run, with no repeats: differences of about a tenth between neighbouring rows (the
#   D=8 row below both D=1 and D=32) are not explained by this data, and nothing here rests on them.
# - The three targets were written into `benchmarks/benchmark_engine.py` before any H200 run (the
#   commit that added the benchmark), from S-LoRA's and Punica's reports: many adapters should keep
#   most of one adapter's throughput. The base-model target came out at the edge (the unrounded
#   ratio above): met with nothing to spare, and with one run per row, read it as "about 70%".
#
# The same rows as a figure (made by `figures/src/engine_throughput.py` from the committed results;
# both axes of the throughput panel are logarithmic):
#
# ![Throughput and time per output token of the engine against the number of adapters, beside the base model and PEFT's mixed batches, measured on an H200](engine_throughput.png)
#
# Read it the way S-LoRA's paper reads its own figure. Going from the base model to one adapter costs
# the LoRA kernels on every projection (chapter 08 measured their share of a decode step). Going from one
# adapter to many costs little **as long as the adapters fit the slots**: the kernels read each
# distinct adapter's weights once per step, and every step still decodes every running request.
# The step count tells the rest: once a trace holds more distinct adapters than
# `max_loras_per_batch`, admission can no longer run them all at once; the requests of the adapters
# left out wait for a slot, the engine decodes in two (or three) waves, and each wave's batch is
# smaller. That, and not the kernels, is what the rows past the slot count lose; it is also why
# production systems raise the slot count as far as memory allows and route adapters to instances
# (section 5). PEFT's mixed batch has no slots and no grouped kernel: each LoRA layer loops over the
# adapters present in the batch, one masked matmul pair each, so its step grows with the number of
# adapters, and it pads every prompt of a batch to the longest.
#
# The same run measured the two control-plane effects of this chapter, on workloads built for them:

# %%
for row in bench["extras"]:
    if row["experiment"] == "prefix_cache":
        print(f"prefix cache, {row['key']:26}: hit rate {row['prefix_hit_rate']:.3f} of looked-up tokens, "
              f"{row['tokens_per_s']:6.0f} tok/s ({row['system_prompts']} system prompts of "
              f"{row['system_prompt_len']} tokens shared by {row['adapters']} adapters)")
for row in bench["extras"]:
    if row["experiment"] == "drain":
        print(f"drain threshold {row['drain_threshold']!s:>4} ({row['adapters']} adapters, Zipf 1.2, "
              f"{row['max_loras_per_batch']} slots): TTFT p50 {row['ttft_s_p50']:.2f} s, p99 {row['ttft_s_p99']:.2f} s, "
              f"{row['tokens_per_s']:6.0f} tok/s, {row['drains']} drains")

# %% [markdown]
# The unsafe tokens-only key finds more hits because it lets every adapter reuse the system prompt's
# KV computed under another adapter; section 2 showed what those hits serve (another adapter's
# keys and values, wrong tokens). The adapter-keyed cache keeps the hits that are correct: requests
# of the same adapter and system prompt.
#
# The drain did not help here, and the reason is the workload: every request arrived at once. With
# a closed batch the popular adapters' requests run out, a rare adapter gets its slot when they do,
# and nobody starves; a drain only holds back admissions meanwhile, so batches are smaller, the run
# is longer and the tail of the waiting time grows. The drain exists for the open system of
# section 4, where requests of popular adapters keep arriving and a resident-first admission would
# keep a rare adapter out for ever. A benchmark of that needs arrival times, which `generate` (one
# closed batch, vLLM's offline API) does not take.

# %% [markdown]
# ## 9. The engine at the hardware floor
#
# A benchmark of LoRA costs is only as honest as the base step it is measured against. A decode
# step has a floor: it must read every weight once (all but the input embedding, of which it needs
# one row per token) and the keys and values of every position it attends, and a GPU cannot read
# faster than its memory bandwidth. `benchmark_engine.py` measures that bandwidth with a plain
# device-to-device copy and prints, for every row, the median floor of its decode steps and TPOT p50
# over it. Five things kept this engine far above its floor; each has a remedy in the code now.
# The committed measurements at the end of this section show how close the engine comes, and
# what still stands between it and the floor.
#
# **1. Attention that reads what it needs.** The torch attention of section 6 gathers each
# sequence's block table into a dense tensor, zeroes what lies past its length and runs SDPA with a
# mask. Under a CUDA graph every row's table is padded to the widest the model allows
# (`PagedDecodeGraphRunner.max_blocks`), so every row gathers the whole width whatever its length.
# For the benchmark's workload (prompts of 128-1024 tokens, a model whose context holds the longest
# prompt and its new tokens) the bytes per decode step, per layer:

# %%
cfg_kv = dict(kv_heads=8, head_dim=128, dtype_bytes=2, block_size=16)  # Llama-3-8B's KV, bf16
new_tokens = 64  # the benchmark's (benchmarks/results/engine_floor_h200.json: "new_tokens")
context = 1024 + new_tokens + 8  # the benchmark's max_position_embeddings: the longest prompt, its new tokens, 8 spare
max_blocks = -(-context // cfg_kv["block_size"])
per_position = 2 * cfg_kv["kv_heads"] * cfg_kv["head_dim"] * cfg_kv["dtype_bytes"]  # keys and values
rng = random.Random(0)
lens = [rng.randint(128, 1024) + new_tokens // 2 for _ in range(256)]  # prompt plus half of the new tokens
gathered = len(lens) * max_blocks * cfg_kv["block_size"] * per_position  # one dense copy of every padded table
needed = sum(lens) * per_position
# torch path: the gather reads the cache and writes the copy, the masking `where` reads and writes
# it again, SDPA reads it: 5 passes over the padded width. The kernel reads each owned position once.
moved = 5 * gathered
print(f"{len(lens)} sequences of mean length {statistics.mean(lens):.0f} in tables of {max_blocks} blocks "
      f"({max_blocks * cfg_kv['block_size']} positions):")
print(f"  torch path: {moved / 2**20:.0f} MiB moved per layer and step; the sequences own {needed / 2**20:.0f} MiB "
      f"({moved / needed:.1f}x more moved than needed)")

# %% [markdown]
# `reference/ops/paged_attention.py` is a Triton kernel that walks the block table instead
# (PagedAttention's idea, in the grid of vLLM's unified Triton attention). One program owns a few
# query tokens of one sequence and one KV head, and all the query heads that share that KV head
# (GQA: the keys are loaded once for the group). For each tile of key positions it loads
# `block_tables[seq, pos // block_size]`, reads those keys and values straight from the cache, and
# stops at the sequence's length; the online softmax (FlashAttention's running max and sum) never
# materialises the scores. Because a program finds its sequence by a binary search over
# `query_start_loc` (the cumulative query lengths), the launch depends on host ints only: one kernel
# serves decode rows, whole prompts and prefill chunks in one step, and a CUDA graph can capture it.
# A decode batch too small to fill the GPU splits each sequence's keys over several programs and
# merges their partial results (flash-decoding); each graph bucket fixes its split count at capture.

# %%
import inspect

from reference.ops import paged_attention as paged_attention_ops

kernel_source = inspect.getsource(paged_attention_ops._paged_attention_kernel.fn)
print(kernel_source[kernel_source.index("    # -- the key tiles"):kernel_source.index("    out_ok =")])

# %% [markdown]
# The kernel is judged against the torch path on every device: here on this machine's (through
# Triton's interpreter when it has no GPU), on a step that mixes a one-token sequence, a prompt, a chunk of a cached prompt and decode rows, with
# NaN in every cache entry no sequence owns (a kernel that read one position too far would print
# NaN), without and with splits:

# %%
from reference.device import default_device
from reference.engine.model_runner import SeqWork, build_attention_metadata, paged_attention

gen = torch.Generator().manual_seed(0)
heads, kv_heads, head_dim, bs = 8, 2, 16, 4
work = [SeqWork([0], 0, [3]), SeqWork([0] * 9, 0, [5, 0, 8]), SeqWork([0] * 6, 10, [1, 9, 2, 4]),
        SeqWork([0], 6, [6, 7])]
dev = default_device()  # a Triton kernel runs where its tensors are: the GPU, else the interpreter
meta = build_attention_metadata(work, bs, dev)
k_cache = torch.full((10, bs, kv_heads, head_dim), float("nan"))
v_cache = k_cache.clone()
for w in work:  # the cached positions of each sequence get real values; the rest stays NaN
    for p in range(w.start):
        k_cache[w.block_table[p // bs], p % bs] = torch.randn(kv_heads, head_dim, generator=gen)
        v_cache[w.block_table[p // bs], p % bs] = torch.randn(kv_heads, head_dim, generator=gen)
k_cache, v_cache = k_cache.to(dev), v_cache.to(dev)
n = len(meta.positions)
q, k, v = (torch.randn(n, h, head_dim, generator=gen).to(dev) for h in (heads, kv_heads, kv_heads))
want = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, backend="torch")
for splits in (1, 2):
    got = paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta._replace(num_splits=splits), backend="triton")
    print(f"{splits} split(s): max |triton - torch| = {(got - want).abs().max().item():.2e}, NaN: {bool(got.isnan().any())}")

# %% [markdown]
# **2. A step loop that keeps the GPU busy.** A CUDA graph replays a whole decode step with one
# launch, but the host still schedules the step, builds its inputs and reads the sampled tokens,
# and the GPU waits meanwhile. Per-sequence Python in that loop grows with the batch: copying every
# sequence's whole token list to read its last token, copying its block table, checking each id
# with a generator expression, one `torch.multinomial` (and one device read) per sampled request.
# The engine's step now reads one token per decoding sequence and passes the tables as they are. It
# no longer re-checks the work its own scheduler built (`ModelRunner.forward(check=False)`; a step
# function such as the capstone's is still checked, with C-level builtins). It samples every row
# (greedy and seeded together) in one pass on the device with one copy back: a seeded row adds
# Gumbel noise hashed from (seed, tokens drawn so far, token id), so its draw depends on its own
# seed only, not on its batch (`reference.engine.model_runner.sample_batch`). `--profile` reports
# the fraction of the decode steps' wall time during which the GPU ran anything, and where a decode
# step's GPU time goes (section 9).
#
# **3. Overlapped decode.** Even so, the loop builds step N+1 only after it has read step N's
# tokens, and the GPU waits for that. Overlapped decode (`EngineConfig.overlap_decode`, the default;
# SGLang's overlap scheduler, vLLM V1's asynchronous scheduling) launches step N+1 first, with step
# N's sampled tokens as its input ids on the device (`ModelRunner.forward(input_ids=...)`), and
# reads and records step N while the GPU runs N+1. The price: a sequence that stops at step N has
# already been launched into N+1, so that row is computed and thrown away (its KV block for N+1 was
# taken, and its adapter refreshed in the pool's LRU, one step late). It runs only between pure
# decode steps with no prompt in progress and no request asking for logprobs, and with no request
# waiting that the next step could admit: those steps need the host's answer before the next one can
# be built. Section 6 turns it off, so its scheduler log reads one step at a time; the tokens are
# the same either way (the tests compare both loops over random workloads, seeds, stop tokens and
# failing rows).
#
# **4. Fused elementwise kernels.** Hugging Face's Llama layer spells RMSNorm, the residual add,
# rotary embedding and SiLU-and-mul as many small torch ops per layer (casts, a mean of squares, a
# reciprocal square root, multiplies, the rotate-half slices and concatenations). In a decode step
# each of them moves little data, but each is a kernel launch of its own. `reference/ops/fused_elementwise.py` makes them four Triton
# kernels per layer (vLLM's `fused_add_rms_norm`, `rotary_embedding` and `silu_and_mul`): the
# residual add happens inside the next norm's kernel. Each computes in fp32 and rounds where the
# torch ops round, so the results match them up to the order of the variance's sum
# (`tests/test_fused_elementwise.py`). The engine uses them on CUDA (`EngineConfig.fused_ops`); on
# the CPU the interpreter would run them one program at a time, so the torch ops stay there.
#
# **5. Mixed steps.** The scheduler of sections 1-7 runs a step of prefill or a step of decode,
# prefill first (nano-vllm's rule). When a long prompt arrives, every sequence that is decoding
# waits for all of its chunks: its time per output token spikes by the whole prefill. vLLM's V1
# scheduler and Sarathi-Serve ("Taming Throughput-Latency Tradeoff in LLM Inference with
# Sarathi-Serve", OSDI 2024) put every running decode into every step and fill the rest of the
# token budget with prefill chunks, so a prompt slows decoding a little for a few steps instead of
# stopping it. `SchedulerConfig.mixed_steps` does that (the engine's default; the capstone keeps
# prefill first, where `running` matters). The control plane alone shows the difference: two
# sequences decoding, a 60-token prompt arriving, a budget of 16 tokens per step:

# %%
def decode_gaps(mixed: bool) -> list[int]:
    sched = Scheduler(SchedulerConfig(4, 16, 4, mixed_steps=mixed), BlockManager(64, 4))
    for i in range(2):
        sched.add(Sequence(i, [1, 2], None, SamplingParams(max_new_tokens=20)))
    last, gaps = {}, []
    for step in range(60):
        if step == 3:
            sched.add(Sequence(9, list(range(60)), None, SamplingParams(max_new_tokens=2)))
        kind, work = sched.schedule()
        if not work:
            break
        for w in work:
            if w.seq.seq_id < 2 and w.end == w.seq.num_tokens:
                gaps += [step - last[w.seq.seq_id]] if w.seq.seq_id in last else []
                last[w.seq.seq_id] = step
        sched.postprocess(work, {w.seq.seq_id: 5 for w in work if w.end == w.seq.num_tokens})
    return gaps


for mixed in (False, True):
    gaps = decode_gaps(mixed)
    print(f"mixed_steps={mixed!s:5}: the decoding sequences' longest wait between tokens {max(gaps)} steps "
          f"(median {statistics.median(gaps)})")

# %% [markdown]
# Prefill first, the two sequences get no token while the prompt's chunks run; mixed, they get one
# every step, and each step carries up to 16 - 2 prompt tokens. In time, a mixed step costs a decode
# step plus its share of the prompt, so TPOT p99 is bounded by the token budget, not by the longest
# prompt. `benchmark_engine.py --arrival-loads` measures it with requests arriving as a Poisson
# process (`LLM.add_request` and `LLM.step`, vLLM's `LLMEngine` shape: a request joins the running
# batch at the next step).
#
# The committed measurements of the engine as it is now (`benchmarks/results/engine_floor_h200.json`,
# written by `benchmark_engine.py --profile --arrival-loads 0.5 0.8`; section 8's rows were measured
# before the paged kernel, the step-loop changes and mixed steps):

# %%
floor_path = Path(reference.__file__).resolve().parents[1] / "benchmarks" / "results" / "engine_floor_h200.json"
floor_bench = json.loads(floor_path.read_text()) if floor_path.exists() else {"rows": [], "extras": [], "targets": []}
floor_rows = [r for r in floor_bench["rows"] if "tpot_p50_over_floor" in r]
if not floor_rows:
    print(f"{floor_path.name} is not committed yet: run `python benchmarks/benchmark_engine.py --profile "
          f"--out {floor_path}` on a GPU to measure the floor")
else:
    print(f"device: {floor_bench['device']}; copy bandwidth {floor_bench['copy_bandwidth_TBps']} TB/s; "
          f"{floor_bench['layers']} layers, {floor_bench['requests']} requests, {floor_bench['new_tokens']} new tokens")
for r in floor_rows:
    print(f"{r.get('attention', '?'):6} D={r['adapters']:3d}: TPOT p50 {r['tpot_ms_p50']:.2f} ms, floor "
          f"{r['decode_floor_ms_p50']:.2f} ms ({r['tpot_p50_over_floor']}x)")
for r in (e for e in floor_bench["extras"] if e.get("experiment") == "poisson_arrivals"):
    print(f"Poisson arrivals at {r['rate_per_s']} req/s, D={r['adapters']}: TPOT p50 {r['tpot_ms_p50']:.2f} ms, "
          f"p99 {r['tpot_ms_p99']:.2f} ms ({r['tpot_p99_over_p50']}x), TTFT p50 {r['ttft_s_p50']:.3f} s")
for t in floor_bench["targets"]:
    print(("met:    " if t["met"] else "missed: ") + t["target"], f"(measured {t['value']})")

# %% [markdown]
# That file was measured before the overlapped loop and the fused kernels, and most of its targets
# are missed; where a decode step's time goes says why. `--profile` runs the workload once more
# under torch.profiler. Each iteration of `generate`'s loop is one labelled range (with overlapped
# decode an iteration launches step N+1 and records step N, so its length is one TPOT), and the
# benchmark sums, over the decode steps, the GPU time of the kernels by class: attention, the base
# model's GEMMs, the LoRA kernels, and the rest (norms, rotary embedding, activation, copies,
# sampling). Two classes have a floor of their own: the GEMMs must read every weight once, and
# attention the KV of the positions the step attends. In a closed batch every running sequence gets
# one token per step, so TPOT p50 is about one decode step's time, and what the GPU's work leaves of
# it is time in which no kernel runs: the host's.
#
# A note on the file above: its `gpu_busy_decode` column (printed below for the record) is an
# overcount. Kineto mirrors each labelled profiler range on the GPU's timeline as an event of its
# own, and the benchmark counted that event as a kernel. The benchmark now leaves the mirrors out;
# `tests/test_benchmark_engine.py` checks it with a synthetic trace. Five runs after that fix: the
# first three from one H100 session, each adding one change to the last; the last two from another
# H100 session, and they differ from the third in more than the engine. They give the pool 65 slots
# instead of 33. Their profiled call takes prompts the prefix cache does not hold, so it prefills and
# then decodes as the timed call does, where the first three runs' profiled call found every prompt
# cached and decoded all 256 sequences together from its second step (so their decode steps attend
# more positions on average, and their floors are larger). Their step counts are the timed call's
# (the first three runs report the profiled call's: one prefill step). So compare runs 1-3 with each
# other, and runs 4-5 with each other; across the two groups only the TPOT-over-floor ratios, each
# against its own run's floor, are like for like.
#
# One warning before the tables: in the last two runs the D=1 and D=32 rows compiled Triton kernels
# inside their timed call. Triton compiles a kernel anew for every new combination of its
# compile-time constants and of the alignment of its integer and pointer arguments (divisible by 16
# or not), and those depend on what a step holds, so a row can meet variants no earlier call met.
# Their TTFT and throughput show it (read those two rows' tok/s as void); their TPOT p50, a median
# over every token, and their decode breakdown, from a separate profiled call, are not affected. The
# benchmark now warms each row up on its own workload first; these two runs predate that.

# %%
print("the H200 file's overcounted GPU-busy fractions:",
      ", ".join(f"D={r['adapters']} {r['gpu_busy_decode']}" for r in floor_rows if "gpu_busy_decode" in r) or "none")
# five runs, each change on top of the last (README's commands): three of one H100 session, two of another
runs = [("1. Hugging Face's torch ops, plain loop, 33 GPU slots", "engine_unfused_h100.json"),
        ("2. fused elementwise kernels, plain loop", "engine_plain_h100.json"),
        ("3. fused kernels, overlapped decode", "engine_overlap_h100.json"),
        ("4. another session: 65 GPU slots, a cold profiled call", "engine_separate_h100.json"),
        ("5. as 4, with packed q|k|v and gate|up projections", "engine_packed_h100.json")]
loaded = [(label, json.loads(path.read_text())) for label, path in
          ((label, floor_path.with_name(name)) for label, name in runs) if path.exists()]
if not loaded:
    print("the breakdowns are not committed yet: run `python benchmarks/benchmark_engine.py --adapters 1 32 64 "
          "--new-tokens 64 --no-extras --arrival-loads --profile --out benchmarks/results/engine_breakdown_h100.json` "
          "on a GPU (README: the other two runs)")
for label, bench in loaded:
    print(f"{label} ({bench['device']}, copy bandwidth {bench['copy_bandwidth_TBps']} TB/s):")
    for r in (r for r in bench["rows"] if r.get("decode_breakdown")):
        d, tpot = r["decode_breakdown"], r["tpot_ms_p50"]
        floors, gpu = d.get("floor_ms", {}), d["gpu_busy_ms"]
        classes = ", ".join(f"{k} {v:.2f}" + (f" ({v / floors[k]:.2f}x its floor)" if k in floors else "")
                            for k, v in d["gpu_ms"].items())
        print(f"  D={r['adapters']:2d}: TPOT p50 {tpot:.2f} ms = {r['tpot_p50_over_floor']:.2f}x the floor of its median "
              f"decode step; GPU work {gpu:.2f} ms per decode step ({gpu / sum(floors.values()):.2f}x their mean "
              f"floor), busy {gpu / d['wall_ms']:.0%} of the step; {r['tokens_per_s']:.0f} tok/s")
        print(f"         by class (ms): {classes}")
        if "tpot_p50_over_floor_with_lora" in r:
            print(f"         with the {r['distinct_in_trace']} adapters' own bytes in the floor: "
                  f"{r['tpot_p50_over_floor_with_lora']:.2f}x")
breakdown = loaded[-1][1] if loaded else {"rows": [], "targets": []}
rows = [r for r in breakdown["rows"] if r.get("decode_breakdown")]
for t in breakdown["targets"]:
    if t.get("void"):  # marked in the file after the run: a row it divides by was not a fair measurement
        print("void:   " + t["target"], f"(measured {t['value']}: {t['void']})")
    else:
        print(("met:    " if t["met"] else "missed: ") + t["target"], f"(measured {t['value']}, {breakdown['device']})")
if rows:
    cap = breakdown["engine_config"]["max_loras_per_batch"]
    first = rows[0]
    for r in rows:
        if r["distinct_in_trace"] > cap:
            print(f"D={r['adapters']}: {r['distinct_in_trace']} distinct adapters in the trace, {cap} GPU slots: "
                  f"{r['prefill_steps']} waves of prefill, {r['steps'] / first['steps']:.0f}x the steps of D="
                  f"{first['adapters']}, {r['adapter_loads']} adapter loads; its median decode step's floor "
                  f"{r['decode_floor_ms_p50']:.2f} ms against {first['decode_floor_ms_p50']:.2f} ms; throughput "
                  f"{r['tokens_per_s'] / first['tokens_per_s']:.0%} of D={first['adapters']}'s")
if floor_rows:
    budget, longest = floor_bench["engine_config"]["max_num_batched_tokens"], floor_bench["prompt_lens"][1]
    for r in (e for e in floor_bench["extras"] if e.get("experiment") == "poisson_arrivals"):
        print(f"Poisson load {r['load']}, D={r['adapters']} ({floor_bench['device']}): {r['mixed_steps']} of "
              f"{r['steps']} steps mixed ({r['mixed_steps'] / r['steps']:.0%}), TPOT p99 {r['tpot_p99_over_p50']}x p50")
    print(f"token budget {budget} per step = {budget // longest} prompts of the longest length ({longest})")

# %% [markdown]
# What that says, reading the runs top to bottom. In the plain loop, for a large share of every
# decode step no kernel runs: the host schedules step N+1, builds the graph's inputs and launches it
# only after it has read step N's tokens. The fused kernels shrink the "other" class (compare it in
# the first two runs), and TPOT falls by more than the GPU time they save: fewer kernels to launch
# also shorten the host's share of the step. Overlapped decode hides the host's share: the GPU is busy almost the whole step, and
# TPOT p50 comes down to the GPU's own work. With no adapter that is within 1.5x of the floor.
# (The first run's D=1 row compiled Triton's LoRA kernels inside its timed generate: its throughput
# shows that; its TPOT p50, a median over every token, does not.)
#
# What is left is the GPU's work above the floor. Attention comes closest to its floor, because the
# paged kernel reads each sequence's blocks only up to its length. The decode step's GEMMs, one row
# per running sequence, are further from theirs. The last run packs q, k and v into one GEMM, and
# gate and up into another: chapter 04's stacking applied to the base weights, the way vLLM loads
# Llama (`QKVParallelLinear`, `MergedColumnParallelLinear`). `reference.layers.pack_projections`
# concatenates a layer's weights once and makes each projection's weight a view of its rows, so
# nothing is stored twice and the model's own modules still work. A packed LoRA module then needs
# one expand over its slices instead of one per projection (the slice offsets of chapter 04). The
# last two runs differ only in that, so the cell below compares them kernel class by kernel class,
# with the launches per decode step that packing changes, counted from the model's structure:

# %%
by_label = dict(loaded)
separate, packed = by_label.get(runs[3][0]), by_label.get(runs[4][0])


if separate is None or packed is None:
    print("the packed and separate runs are not committed yet (README: engine_separate_h100.json, "
          "engine_packed_h100.json)")
else:
    n = packed["layers"]
    print(f"per decode step: {7 * n + 1} -> {4 * n + 1} GEMM launches (7 -> 4 projections per layer, and the "
          f"LM head); with adapters {7 * n} -> {4 * n} LoRA expands (the shrinks were one per packed module "
          "already: chapter 07's shared shrink)")
    before = {r["adapters"]: r for r in separate["rows"] if r.get("decode_breakdown")}
    for r in (r for r in packed["rows"] if r.get("decode_breakdown") and r["adapters"] in before):
        a, b = before[r["adapters"]], r
        da, db = a["decode_breakdown"], b["decode_breakdown"]
        parts = [f"{kind} {da['gpu_ms'][kind]:.2f} -> {db['gpu_ms'][kind]:.2f} ms" for kind in ("gemm", "lora")
                 if kind in db["gpu_ms"]]
        print(f"D={r['adapters']:2d}: {'; '.join(parts)}; GPU work {da['gpu_busy_ms']:.2f} -> {db['gpu_busy_ms']:.2f} ms, "
              f"TPOT p50 {a['tpot_ms_p50']:.2f} -> {b['tpot_ms_p50']:.2f} ms")
    r32 = next((r for r in packed["rows"] if r["adapters"] == 32 and r.get("decode_breakdown")), None)
    if r32 is not None:
        d = r32["decode_breakdown"]
        print(f"\nD=32, the LoRA kernels of one decode step ({r32['distinct_in_trace']} distinct adapters; the "
              f"floor of their A and B bytes {d['floor_ms'].get('lora', float('nan')):.2f} ms):")
        for k in (k for k in d["top_kernels"] if k["kind"] == "lora"):
            print(f"  {k['name']}: {k['ms']:.3f} ms in {k['launches_per_step']:.1f} launches on average "
                  f"({1e3 * k['ms'] / k['launches_per_step']:.1f} us each)")
        print(f"  GPU work above D=0's: {d['gpu_busy_ms'] - rows[0]['decode_breakdown']['gpu_busy_ms']:.2f} ms")

# %% [markdown]
# The packed GEMMs read the same bytes as the separate ones, in fewer and wider launches, so their
# time comes closer to their floor; the LoRA expands fall from one per projection to one per packed
# module. What stays is chapter 08's LoRA overhead, measured inside the engine: per layer a shrink
# and an expand for each of four packed modules (`_sgmv_expand_kernel` in a decode step is the
# "sorted" decode schedule's expand: SGMV's expand over the slot-sorted view, chapter 08; the
# `_bgmv_*` kernels are the per-token schedule, which the rule picks for some of the steps), each
# expand adding its product into the whole output
# of its projection in place (it reads and writes that output: chapter 08's fused GEMM epilogue
# avoids exactly that traffic). Those kernels take several times the floor of the adapters' own
# bytes, and they are what separates the D=1 and D=32 rows from D=0: the reason D=32 misses 1.7x.
# The D=0 row launches no LoRA kernel, because a base-only decode step skips them.
#
# The earlier runs had 33 GPU slots (32 adapters and the base). Their D=64 row's trace holds more
# distinct adapters than that, so admission ran in waves: more steps, more than one prefill step,
# each step carrying part of the batch, the plain loop while requests waited (a waiting request may
# be admitted as soon as a sequence finishes, and only the host knows when that is). The engine now
# goes on overlapping in that state when it can tell that the next step would admit no one anyway:
# no drain can start, no sequence of the step in flight can end at it (by its length, or by a stop
# token it may sample), and the admission policy, asked with the next step's state, admits nobody
# (`Scheduler.next_step_admits_none`). The last two runs give the pool 65 slots instead, so the 64
# adapters' requests are resident at once, as in S-LoRA's and Punica's figure: the throughput
# targets then measure LoRA, not the slot cap. Throughput is output tokens over the whole call, and
# every request arrives at its start, so a call is a prefill phase (until nearly every request has
# its first token: TTFT p99, the 99th percentile, stands in for the last one) followed by decoding.
# The cell splits each row of the last run that way, then sets the profiled call's steps with prompt
# tokens beside it:

# %%
if packed is not None:
    by_d = {r["adapters"]: r for r in packed["rows"]}
    for r in by_d.values():
        print(f"D={r['adapters']:2d}: {r['wall_s']:.2f} s in all, 99% of first tokens by {r['ttft_s_p99']:.2f} s "
              f"({r['ttft_s_p99'] / r['wall_s']:.0%} of the call), {r['prefill_steps'] + r['mixed_steps']} steps with "
              f"prompt tokens; {r['tokens_per_s']:.0f} tok/s")
    if 0 in by_d and 64 in by_d:
        extra, first = by_d[64]["wall_s"] - by_d[0]["wall_s"], by_d[64]["ttft_s_p99"] - by_d[0]["ttft_s_p99"]
        print(f"D=64 takes {extra:.2f} s longer than the base model; {first:.2f} s of it "
              f"({first / extra:.0%}) before 99% of first tokens")
        a, b = by_d[0].get("prefill_breakdown"), by_d[64].get("prefill_breakdown")
        if a and b:
            longer = (b["wall_ms"] - a["wall_ms"]) * b["steps"] / 1e3
            print(f"the profiled call's steps with prompt tokens: {longer:.2f} s longer in all at D=64 than at D=0 "
                  f"({longer / first:.0%} of that difference); the rest is in the timed call alone, which also "
                  f"loads the adapters into their slots ({by_d[64]['adapter_loads']} loads; the profiled call finds "
                  "them resident)")
    print("a step with prompt tokens (the profiled call's), GPU time by class per step (ms):")
    for r in (r for r in by_d.values() if r.get("prefill_breakdown")):
        b = r["prefill_breakdown"]
        lora = next((k for k in b["top_kernels"] if k["name"] == "_sgmv_expand_kernel"), None)
        print(f"  D={r['adapters']:2d}: {b['steps']} steps, {b['prompt_tokens']:.0f} prompt tokens each on average; "
              + ", ".join(f"{k} {v:.1f}" for k, v in b["gpu_ms"].items())
              + (f"; the expand {lora['ms']:.1f} of the LoRA's" if lora else ""))
    width = 2 * packed["model"]["intermediate_size"]
    tokens = next(r["prefill_breakdown"]["prompt_tokens"] for r in by_d.values() if r.get("prefill_breakdown"))
    print(f"the gate|up output of a step of {tokens:.0f} tokens: {tokens * width * 2 / 1e6:.0f} MB in bf16, "
          f"which its expand reads and writes in each of {packed['layers']} layers")
segments_path = floor_path.with_name("engine_sgmv_segments_h100.json")
if packed is not None and segments_path.exists():
    grid = {r["adapters"]: r.get("prefill_breakdown") for r in json.loads(segments_path.read_text())["rows"]}
    walls = {r["adapters"]: r["wall_s"] for r in json.loads(segments_path.read_text())["rows"]}
    for r in (r for r in packed["rows"] if r["adapters"] and r.get("prefill_breakdown") and grid.get(r["adapters"])):
        print(f"  D={r['adapters']:2d}, the SGMV grid over every (segment, row block) instead (same session): LoRA "
              f"{grid[r['adapters']]['gpu_ms']['lora']:.1f} ms per step against {r['prefill_breakdown']['gpu_ms']['lora']:.1f}; "
              f"the timed call {walls[r['adapters']]:.2f} s against {r['wall_s']:.2f} s")
    same = [b["rows"][0]["tokens_per_s"] for b in (separate, packed, json.loads(segments_path.read_text())) if b]
    print(f"D=0, the same base model in the session's three runs: {', '.join(f'{t:.0f}' for t in same)} tok/s "
          f"(a spread of {(max(same) - min(same)) / min(same):.1%})")

# %% [markdown]
# Most of what the 64-adapter row loses against the base model is in the prefill phase, not in the
# decode steps this section has taken apart. In a step with prompt tokens the GEMMs do the base
# model's work and attention and the rest are small; the LoRA kernels come next, at about the same
# time with one adapter as with 47. The LoRA cost of prefill is per token, not per adapter. Most of
# it is the expand, which adds its product into each projection's whole output in place: the
# gate|up output alone is printed above, read and written once per layer. Chapter 08's fused GEMM
# epilogue adds the product before the output is ever written. The profile accounts for part of
# the D=64 row's longer prefill phase; the rest happened only in the timed call (its adapter loads,
# and perhaps kernels compiled while timed, as in the rows the warning above names), which the next
# run, warmed up row by row, can separate.
#
# A mixed step also holds the running sequences' decode tokens, one segment each, beside the
# prompt chunk. The SGMV kernels' grid gave every segment as many row blocks as the longest
# segment needed, so a step launched the chunk's block count for each of the hundreds of one-token
# decodes, and nearly all of those programs returned at once. Both SGMV kernels now launch each
# segment's own row blocks back to back where that launches fewer (the packed grid of the decode
# path, `_triton_util.packed_blocks`). The last lines above compare the two grids: the LoRA time of a
# step with prompt tokens falls, but the timed calls do not show it, and their wall times differ by
# about what one base-model row differs by from run to run in this session (the last line): whole
# calls of one run each cannot resolve a difference that small. The same holds for the packed run's
# throughput against the separate one's. The busy fractions come from the profiled call, whose mean
# over the steps a few slow ones can move (the last run's D=0 row, the first profiled call of its
# process, shows a low one); TPOT p50 comes from the unprofiled timed call.
#
# A third H100 session went after the two LoRA costs the runs above left: the decode step's LoRA
# kernels, and the LoRA of the steps with prompt tokens. Three changes; the first two were measured
# in whole runs (7 and 8) against the same session's run without them (6), the third by a sweep of
# the kernel alone:
#
# - **The shrink beside the GEMM** (run 7; `EngineConfig.overlap_lora_shrink`,
#   `LoRAContext.overlap_shrink`). A layer's shrink reads the same input x as its base GEMM and
#   nothing the GEMM writes, so it can run on a second CUDA stream at the same time: the side stream
#   first waits for the current one (x is ready), runs the shrink, and the current stream, after
#   launching the GEMM, waits for the side stream before the expand. The expand cannot move: it adds
#   into the GEMM's output in place, so it needs that output finished. At decode the GEMM has one
#   row per running sequence and so few output tiles that SMs stay idle, and the shrink is a small
#   launch; side by side, the shrink's time can hide in the GEMM's. Inside a CUDA graph the wait
#   and the join are captured as edges of the graph. (One hazard for a reimplementation: the
#   shrink's output is allocated on the side stream and read on the other; it is safe to free after
#   the expand only because the side stream's next allocation comes after its next wait.)
# - **Rows grouped by adapter in a step with prompt tokens** (run 8;
#   `EngineConfig.sort_lora_by_slot`). A step's LoRA rows had one SGMV segment per sequence, so a
#   mixed step's hundreds of one-token decodes were hundreds of segments, each given a whole block
#   of rows for its one row. Grouped by slot (chapter 07's `sort_by_slot`; vLLM V1 sorts its tokens
#   by LoRA id the same way), a step has at most one segment per slot: nothing is copied, the hidden
#   states stay in sequence order, and the kernels load row `permutation[i]` for the i-th row of a
#   segment. Only steps that hold a prompt chunk are grouped this way.
# - **The expand's tiles.** The SGMV expand's default tile, 128 rows by 128 columns, was tuned on a
#   few long prompts and one projection (`benchmarks/results/tuned_configs.json`).
#   `benchmarks/sweep_prefill_expand.py` times it at a mixed step's shapes and every output width of
#   a layer, against the floor of the bytes it must move (it reads and writes the projection's
#   output).

# %%
session = [("6. a third session: as 5 (expand tile 128 x 128, each row warmed up on 2 new tokens)",
            "engine_inline_h100.json"),
           ("7. as 6, the shrink beside the GEMM", "engine_overlap_shrink_h100.json"),
           ("8. as 6, rows grouped by adapter in steps with prompt tokens", "engine_sorted_h100.json"),
           ("9. 7 and 8 together, the expand's new tiles, each row warmed up on its whole workload",
            "engine_run9_h100.json"),
           ("10. the default now: 9 with one kernel variant per pool (SEG_BLOCK by slots, num_segments not "
            "specialized)", "engine_breakdown_h100.json")]
third = [(label, json.loads(path.read_text())) for label, path in
         ((label, floor_path.with_name(name)) for label, name in session) if path.exists()]
if not third:
    print("this session's runs are not committed yet (README: engine_inline_h100.json and the lines after it)")
for label, bench in third:
    cfg = bench["engine_config"]
    print(f"{label} ({bench['device']}; sort_lora_by_slot={cfg.get('sort_lora_by_slot', False)}, "
          f"overlap_lora_shrink={cfg.get('overlap_lora_shrink', False)}):")
    for r in (r for r in bench["rows"] if r.get("decode_breakdown")):
        d, p = r["decode_breakdown"], r.get("prefill_breakdown") or {}
        print(f"  D={r['adapters']:2d}: TPOT p50 {r['tpot_ms_p50']:.2f} ms ({r['tpot_p50_over_floor']:.2f}x), decode GPU "
              f"work {d['gpu_busy_ms']:.2f} ms (LoRA kernels {d['gpu_ms'].get('lora', 0):.2f}, GEMMs "
              f"{d['gpu_ms'].get('gemm', 0):.2f}); a step with prompt "
              f"tokens: LoRA {p.get('gpu_ms', {}).get('lora', 0):.1f} ms, GEMMs {p.get('gpu_ms', {}).get('gemm', 0):.1f} ms; "
              f"{r['tokens_per_s']:.0f} tok/s, TTFT p99 {r['ttft_s_p99']:.2f} s")
    for c in bench.get("caveats", []):
        print("  caveat:", c[:c.index(":")] if ":" in c else c)
by_run = {label.split(".")[0]: {r["adapters"]: r for r in bench["rows"]} for label, bench in third}
if {"6", "7", "8"} <= set(by_run):
    for D in sorted(by_run["6"]):
        a, b, c = by_run["6"][D], by_run["7"][D], by_run["8"][D]
        pa, pc = (x.get("prefill_breakdown") or {} for x in (a, c))
        pb = b.get("prefill_breakdown") or {}
        print(f"D={D:2d} against run 6: the shrink beside the GEMM {b['tpot_ms_p50'] - a['tpot_ms_p50']:+.2f} ms of "
              f"TPOT p50, {b['decode_breakdown']['gpu_busy_ms'] - a['decode_breakdown']['gpu_busy_ms']:+.2f} ms of decode "
              f"GPU work, {pb.get('wall_ms', 0) - pa.get('wall_ms', 0):+.1f} ms per step with prompt tokens; "
              f"rows grouped by adapter: a step with prompt tokens "
              f"{pc.get('wall_ms', 0) - pa.get('wall_ms', 0):+.1f} ms (its LoRA "
              f"{pc.get('gpu_ms', {}).get('lora', 0) - pa.get('gpu_ms', {}).get('lora', 0):+.1f} ms)")
sweep_path = floor_path.with_name("prefill_expand_h100.json")
if sweep_path.exists():
    sweep = json.loads(sweep_path.read_text())
    old = sweep["baseline_config"]  # the tile before the sweep (its "defaults" are whatever a re-run finds)
    print(f"\nthe expand at a mixed step ({sweep['device']}: {sweep['tokens']} tokens in {sweep['segments']} segments, "
          f"{sweep['distinct']} adapters of rank {sweep['rank']}), us per launch; the tile before: "
          f"{old['block_m']} x {old['block_n']}:")
    for b in sweep["best"]:
        print(f"  {b['width']:16}: before {b['baseline_us']:.0f}, best {b['best_us']:.0f} "
              f"({b['best']['block_m']} x {b['best']['block_n']}, {b['best']['num_warps']} warps), "
              f"floor of its bytes {b['floor_us']:.0f}")

# %%
if third and third[-1][0].startswith("10."):
    now = third[-1][1]
    for t in now["targets"]:
        if t.get("void"):
            print("void:   " + t["target"], f"(measured {t['value']}: {t['void']})")
        else:
            print(("met:    " if t["met"] else "missed: ") + t["target"], f"(measured {t['value']}, {now['device']})")
else:
    print("run 10, the default now, is not committed yet (README: engine_breakdown_h100.json): no targets of it")
if {"9", "10"} <= set(by_run):
    for D in sorted(by_run["10"]):
        a, b = by_run["9"][D], by_run["10"][D]
        la, lb = ((x.get("prefill_breakdown") or {}).get("gpu_ms", {}).get("lora", 0) for x in (a, b))
        print(f"D={D:2d}, run 9 -> run 10: {a['tokens_per_s']:.0f} -> {b['tokens_per_s']:.0f} tok/s, wall "
              f"{a['wall_s']:.2f} -> {b['wall_s']:.2f} s for {a['steps']} -> {b['steps']} steps, TTFT p50 "
              f"{a['ttft_s_p50']:.2f} -> {b['ttft_s_p50']:.2f} s, TPOT p50 {a['tpot_ms_p50']:.2f} -> {b['tpot_ms_p50']:.2f} ms; "
              f"LoRA of a step with prompt tokens {la:.2f} -> {lb:.2f} ms")
latest = third[-1] if third else None
r32 = next((r for r in latest[1]["rows"] if r["adapters"] == 32), None) if latest else None
if r32 is not None:
    d = r32["decode_breakdown"]
    print(f"run {latest[0].split('.')[0]}, D=32's decode step: GPU work {d['gpu_busy_ms']:.2f} ms of a {d['wall_ms']:.2f} ms step; "
          "by class " + ", ".join(f"{k} {v:.2f}" for k, v in d["gpu_ms"].items())
          + f"; the LoRA kernels' bytes alone {d['floor_ms'].get('lora', float('nan')):.2f} ms at the copy bandwidth")
    for k in (k for k in d["top_kernels"] if k["kind"] == "lora"):
        print(f"  {k['name']}: {k['launches_per_step']:.1f} launches per step, "
              f"{1e3 * k['ms'] / k['launches_per_step']:.1f} us each")

# %% [markdown]
# Each change did what its paragraph said, and where it said. Two terms first: a run's *GPU work*
# is the length of the union of its kernels' intervals on the timeline, while a class's time adds
# its kernels' durations, so kernels that run at the same time count once in the first and twice
# in the second. And the base row (D=0) gives the noise between runs of this session: its TPOT p50
# differs by a few hundredths of a millisecond across runs 6-8 (printed), one run each.
#
# The shrink beside the GEMM changes nothing without adapters (a base-only step launches no
# shrink) and takes a little off the median decode step with them: the GEMM class and the LoRA
# class each take longer than in run 6 (the kernels share the SMs), but their union, the GPU work,
# is shorter, by less than the GEMMs slowed. In a step with prompt tokens the GEMMs leave no SMs
# idle, and there the LoRA kernels only take longer; the flag applies to every step, and whether to
# keep it to decode steps is a measurement this session did not make. Grouping rows by adapter
# leaves the decode steps alone: it acts only on steps with a prompt chunk (a decode step's batch
# carries the slot-sorted view its grouped schedule reads already, chapter 08). It
# cuts the LoRA of a step with prompt tokens, most with one adapter and less with more, which
# bring more segments. The sweep's best tile is shorter and wider (rows x columns printed), faster
# at every width, and the gate|up expand still takes well over the floor of its bytes. The sweep
# has limits: it measured the rows in sequence order, not grouped by adapter as the engine now
# gives them, at rank 16 only (above rank 16 the tile is the H200's earlier one), and its best tile
# lies at the edge of the grid it measured; and no run isolates the new tile inside the engine
# (runs 9 and 10 use it together with the other changes).
#
# Runs 6 and 8 also show why the warm-up now runs each row's whole workload: their warm-up gave
# each row its workload with 2 new tokens, whose mixed steps hold fewer decode rows than the timed
# call's, so the timed call met kernel variants Triton had not compiled (new constants, or
# arguments that are multiples of 16 where they were not) and waited for the compiler. Read the
# tok/s and TTFT of run 6's D=1 row and run 8's D=32 and D=64 rows as void (their caveats); their
# TPOT and breakdowns, from the median and from the separate profiled call, stand.
#
# Run 9 puts the three changes together. Its decode steps are run 7's (the side stream; grouping
# does not touch decode), and its steps with prompt tokens have run 8's LoRA, so the two add up as
# their paragraphs said. Its D=64 row still stalled inside its timed call, after a warm-up on its
# whole workload (its caveat: its steps take about as long as D=32's, yet its requests waited far
# longer for their first token), so both throughput targets of run 9 are void. The likely cause is
# one more kernel variant, and grouping rows by adapter is what made it likely. A grouped step has
# one segment per distinct adapter, so its segment count changes from step to step, and two things
# in the LoRA kernels followed that count: the `SEG_BLOCK` constexpr (a power of two at least the
# count), and the `num_segments` argument, which Triton specializes when it is 1 or a multiple of
# 16. A timed step could meet a count its warm-up never did, and every running request then waited
# for the compiler. Since run 9, `SEG_BLOCK` is sized by the pool's slots and `num_segments` is not
# specialized (`@triton.jit(do_not_specialize=...)`), so whatever their adapter counts, the steps of
# one pool launch the same two variants of each kernel (packed or not): `tests/test_triton_ops.py`
# checks this with Triton's own argument binder. vLLM meets the same problem where a kernel's integer
# argument changes with the batch: its rejection sampler's kernel is declared with
# `do_not_specialize=["max_spec_len"]`, "to prevent unnecessary recompilation"
# (`vllm/v1/sample/rejection_sampler.py`).
#
# Run 10 is run 9's engine with that fix, on an H100 of another session (printed above, run 9 to
# run 10). The stall is gone: the 64-adapter row's wall time and time to first token fell back
# beside the 32-adapter row's, for the same number of steps, and both 64-adapter throughput targets
# are met. The rows that did not stall moved a little, not all one way (printed: TPOT p50 slightly
# lower, throughput slightly lower), and the base row, which launches no LoRA kernel, moved as much
# as the others, so most of that is the two machines and sessions. Not all of it: the fix has a
# cost. Sized by the pool's slots, `SEG_BLOCK` makes every program of a packed launch scan as many
# segment offsets as the pool has slots (`packed_block`), not as many as the step has adapters. The
# LoRA of a step with prompt tokens took longer in the 32-adapter row (printed), whose packed
# launches scan at least four times the offsets they need, and hardly changed in the one-adapter row, whose
# steps are not packed. One run each cannot size that cost; compiling every power of two up to the
# slots once, before serving, would avoid it and keep the compiler out of the timed steps. The
# 32-adapter decode target is still missed.
#
# What still limits the 32-adapter decode step is chapter 08's overhead, kernel by kernel: four
# shrinks and four expands per layer (the latest run's launches printed above; with the shrink on a
# side stream every kernel shares the SMs with another, so each launch takes longer than in line),
# each taking microseconds for little data, far more than the floor of the adapters' bytes, plus
# the expands' read and write of each output. Production engines close the same gap in
# ways the engine does not use at decode: fewer, larger launches (SGLang's and vLLM's fused
# multi-slice kernels), the expand inside the GEMM's epilogue (chapter 08's fused path, where no
# output is read back), and a map from row blocks to segments built once per step (SGLang's
# chunked SGMV, TensorRT-LLM's grouped GEMM), where each program of the packed grid here searches
# `seg_indptr` for its own segment (`_triton_util.packed_block`).

# %% [markdown]
# Under Poisson arrivals (the H200 file above) many steps are mixed. A mixed step carries the
# decodes plus up to the token budget of prompt tokens, and this benchmark's budget holds several of
# its longest prompts. One step can therefore cost the prefill of several whole prompts, and those
# largest mixed steps are the likely source of the p99. The arrival runs below test that. They log
# every step's time and what it carried (`step_log`: milliseconds, decode rows, prompt tokens). Over
# the steps that decoded they fit a line, milliseconds = fixed + per-token cost x prompt tokens, and
# they list the steps at least as long as TPOT p99: a request that decodes every step waits one step
# per token, so its slowest gaps sat in those steps. A token's gap also holds the loop's time outside
# `LLM.step`, so at some loads no single step reaches p99. There are three runs, measured on an H100:
#
# - at this benchmark's token budget;
# - at a quarter of it (`--token-budget`);
# - at the whole budget, with a quarter of it as the cap on the prompt tokens of a step that also
#   decodes (`--prefill-while-decoding`, the engine's `max_prefill_tokens_while_decoding`). A step
#   without decodes still takes the whole budget; Sarathi-Serve sizes its chunks for a
#   time-between-tokens target the same way.

# %%
step_runs = [json.loads(p.read_text()) for p in (floor_path.with_name(n) for n in
             ("engine_steps_h100.json", "engine_steps_tb2048_h100.json", "engine_steps_capped_h100.json"))
             if p.exists()]
if not step_runs:
    print("the step logs are not committed yet: run `python benchmarks/benchmark_engine.py --adapters 1 "
          "--no-extras --out benchmarks/results/engine_steps_h100.json` (and with --token-budget) on a GPU")
for run in step_runs:
    cap = run["engine_config"].get("max_prefill_tokens_while_decoding")
    print(f"{run['device']}, token budget {run['engine_config']['max_num_batched_tokens']}"
          + (f", at most {cap} prompt tokens in a step that decodes" if cap else "") + ":")
    for r in (e for e in run["extras"] if e.get("experiment") == "poisson_arrivals"):
        c = r["step_costs"]
        print(f"  load {r['load']}: TPOT p50 {r['tpot_ms_p50']:.1f} ms, p99 {r['tpot_ms_p99']:.1f} ms "
              f"({r['tpot_p99_over_p50']}x p50), {r['tokens_per_s']:.0f} tok/s; {c['steps']} steps, "
              f"{c['decode_only_steps']} without a prompt (median {c['decode_only_ms_p50']:.1f} ms)")
        if "fixed_ms" in c:  # fitted only when the decoding steps carried at least two prompt sizes
            room = c.get("prefill_tokens_for_p99_3x_p50")
            print(f"    a step that decodes: {c['fixed_ms']:.1f} ms + {c['ms_per_1k_prefill_tokens']:.1f} ms per 1000 "
                  "prompt tokens; " + (f"p99 <= 3x p50 leaves room for about {room} per step" if room is not None
                                       else "the line leaves no room for p99 <= 3x p50"))
        if "steps_at_or_over_tpot_p99" in c:
            lo, hi = c["their_prefill_tokens_min"], c["their_prefill_tokens_max"]
            print(f"    the {c['steps_at_or_over_tpot_p99']} step(s) at least p99 long carried "
                  f"{lo if lo == hi else f'{lo}-{hi}'} prompt tokens")
        else:
            print("    no single step was at least p99 long: the slowest gaps also hold the loop's time between steps")

# %% [markdown]
# At the full budget and load 0.5 the slowest step carried a whole budget of prompt tokens (at load
# 0.8 no single step reached p99: those gaps also hold the loop's time between steps), and the line
# says how many prompt tokens a step could carry and keep p99 within three times p50: fewer than the
# budget allows. At the smaller budget, and with the cap on decoding steps, the target is met. Both
# pay for it the same way: more steps carry a prompt, so every decoding sequence waits through more
# prefill, and the median gap grows (compare each run's p50 with the first run's, at the same load).
# The three runs were made at different times on different states of the engine (their steps
# without a prompt differ by about 2x, printed), and the later two had the faster decode steps, so
# their larger p50 is not the engine getting slower: it is the prefill they wait through. The
# token budget and the cap set where a server sits between a low
# p99 and a low p50 (vLLM and SGLang expose the budget as `max_num_batched_tokens` and
# `chunked_prefill_size`).

# %% [markdown]
# ## How production systems do it
#
# - **vLLM**: `vllm/v1/core/kv_cache_utils.py` (`hash_block_tokens`: the parent block's hash, the
#   block's token ids and *extra keys*, which include the LoRA request's id, so two adapters never
#   share a cached block; multimodal hashes and a cache salt go there too) and
#   `vllm/v1/core/block_pool.py` (the free queue in eviction order, blocks freed tail first);
#   `vllm/v1/core/sched/scheduler.py` (one token budget for prefill and decode, chunked prefill,
#   recompute preemption, and a request skipped when admitting its LoRA would exceed `max_loras`).
# - **SGLang**: `python/sglang/srt/managers/scheduler.py` (admission under `max_loras_per_batch`,
#   the base model counted as an adapter), `python/sglang/srt/lora/lora_drainer.py` (`LoRADrainer`:
#   starvation past a threshold while the slots are full, the running adapter with the smallest
#   maximum remaining tokens drained), and the radix cache, whose keys carry the LoRA id as an
#   `extra_key` so that prefixes of different adapters live in separate subtrees.
# - **nano-vllm**: `nanovllm/engine/block_manager.py` (chained xxhash block keys, reference counts,
#   keys registered once a block is full) and `nanovllm/engine/scheduler.py` (prefill first, then
#   decode; preemption of the most recently admitted sequence). It serves no adapters; this book's
#   engine is its shape with the adapter added to every decision.
# - **Paged attention and mixed steps**: vLLM `vllm/attention/ops/triton_unified_attention.py` (the
#   grid of section 9: q blocks found by binary search over `query_start_loc`, GQA heads in one tile,
#   segments over the KV length merged by `reduce_segments`) and its CUDA/FlashAttention backends;
#   SGLang `python/sglang/srt/layers/attention/triton_ops/decode_attention.py` (flash-decoding's two
#   stages) and `extend_attention.py`; FlashInfer's paged prefill/decode wrappers. vLLM's V1
#   scheduler always mixes decodes and prefill chunks under one token budget; SGLang's
#   `--enable-mixed-chunk` does the same.
#
# ## Summary
#
# - The control plane is host values only; one list of `Work(seq, start, end)` per step crosses to
#   the data plane. Steps are prefill (chunked within a token budget) or decode; a sequence without a
#   KV block to grow into is preempted and recomputed.
# - A prefix-cache key is chained over every earlier block, covers full blocks only, and includes
#   the adapter's uid: a tokens-only key shares KV between adapters without any error.
# - Admission orders warm adapters first, skips a candidate the adapter cap keeps out (the base model
#   takes a slot), and stops at the first that KV cannot hold.
# - A hot adapter can starve a rare one behind the cap; draining the running adapter that finishes
#   soonest bounds the wait.
# - The engine (`reference.engine.LLM`) joins this control plane to chapters 05-07's pool, layers and
#   a paged Llama forward; on a tiny Llama with PEFT adapters, every request's greedy tokens equal
#   PEFT's generate of that request alone, through evictions, preemption and shared prefixes.
# - Consistent hashing with bounded load keeps each adapter on few instances (fewer distinct adapters
#   per instance than round robin), the bound caps the load, and replicas spread a hot adapter.
# - One engine step joins the planes: the scheduler's `Work` becomes the runner's `SeqWork`, the
#   running adapters stay resident, only rows that reach their sequence's end give a token, and
#   `postprocess` records it. With your own policies plugged in through `EnginePolicies`, the same
#   judge holds: tokens equal to PEFT's, and a log equal to the reference's step by step.
# - Under load (an 8B-shaped model on an H200), many adapters cost little while they fit the slots;
#   past the slot count, requests wait for a slot and the engine decodes in waves. The adapter-keyed
#   prefix cache keeps only correct hits; a drain costs throughput on a closed batch and pays off
#   only where new requests of popular adapters keep arriving.
# - A decode step's floor is (weights + attended KV) / bandwidth. Attention that gathers a padded
#   table moves bytes no sequence owns; a paged kernel walks each table up to its length. Host work
#   per step must not grow with the batch, and mixed steps keep decoding while prompts are prefilled.
# - Overlapped decode launches step N+1 with step N's tokens still on the device, so the host's
#   work hides behind the GPU's; it may only run ahead where the host's answer cannot change the
#   next step. Fusing each layer's elementwise ops cuts launches (and the bytes of the intermediates).
#
# ## Review questions
#
# 1. An adapter `sql` is re-registered with retrained weights under the same name. What goes wrong if
#    the block key uses the name, and what does using the uid cost the prefix cache?
# 2. Why is a partly computed block never registered, and what would a chunked prefill of a long
#    prompt read if it were?
# 3. With a cap of 4 slots, the base model and three adapters are running, and the waiting queue is
#    `[d (cold), a (running), d]`. Which are admitted, in which order, and why is `d` skipped rather
#    than stopping admission, while a request too big for the free KV does stop it?
# 4. The drain threshold is 0. What happens to throughput when a rare adapter's requests arrive
#    steadily? What does a very large threshold cost?
# 5. A router uses bounded load with `capacity_factor` 1.0. What happens to adapter locality when
#    every instance is at the average load? What does a factor of 2 trade?
# 6. One adapter receives half of all requests. Compare replicas 1 with a large capacity factor,
#    replicas 1 with factor 1.25, and replicas 2: where do its requests go, and what happens to the
#    other adapters that hash to its home instance?
# 7. In a prefill step, `engine_step` passes `running` to the runner although the decoding sequences
#    compute nothing. Which adapter would the pool evict without it, and what would the next decode
#    step have to do? Would the tokens change, and what in the engine's log would?
# 8. A decode batch of 4 sequences runs on a GPU of 132 SMs with 8 KV heads. Why does the paged
#    kernel split each sequence's keys over several programs, what does the merge cost, and why is
#    the split count fixed per CUDA-graph bucket rather than chosen per step?
# 9. With overlapped decode, a request's stop token is sampled at step N. What has the engine
#    already done for that request at step N+1, what does it throw away, and what can it not undo?
#    Why may it not run ahead while a waiting request could be admitted as soon as that request ends?
# 10. The fused RMSNorm kernel replaces six torch kernels, each of which reads and writes the whole
#    activation. In a decode step of 256 tokens of hidden size 4096, is the saving mostly bytes or
#    launches? And in a prefill step of 8192 tokens?
