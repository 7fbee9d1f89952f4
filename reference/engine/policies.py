"""The engine's control-plane decisions as pure functions: chapter 11's exercises.

Each takes plain Python values (ints, uids, lists, mappings; never a tensor) and returns a decision,
so the scheduler, the block manager and the router call them and a grader can replay them:

- :func:`block_hashes`: the prefix cache's key of every full block, chained over (adapter, tokens);
- :func:`admit_requests`: which waiting requests join the running batch (KV blocks, the adapter cap
  with the base model counting as one, resident adapters first, a drained adapter held back);
- :func:`choose_drain`: when a waiting request has starved long enough, which running adapter stops
  taking new requests so that its slot frees (SGLang's LoRA drain);
- :func:`route`: which engine instance a request goes to (consistent hashing on the adapter with
  bounded load, hot adapters spread over replicas).

Sources: vLLM ``vllm/v1/core/kv_cache_utils.py`` (``hash_block_tokens``: parent hash, the block's
token ids, extra keys that include the LoRA id) and nano-vllm ``nanovllm/engine/block_manager.py``;
vLLM ``vllm/v1/core/sched/scheduler.py`` and SGLang ``python/sglang/srt/managers/scheduler.py``
(admission under ``max_loras_per_batch``); Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with
Bounded Loads" (SODA 2018), as used by LoRA-affinity routers.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Collection, Hashable, Mapping, Optional, Sequence

from reference.mem_pool import uid_sort_key

__all__ = ["stable_hash", "block_hashes", "Candidate", "admit_requests", "choose_drain", "ring_walk", "route"]


def stable_hash(obj: Hashable) -> int:
    """A 64-bit hash of ``repr(obj)`` that is the same in every process (Python's ``hash`` of a str
    changes with PYTHONHASHSEED, so two engines, or a grader and its child, would disagree).

    ``obj`` is built from None, ints, strs and tuples of them; ``repr`` quotes strings and separates
    tuple fields, so ``("a1", (2,))`` and ``("a", (12,))`` never collide the way a concatenated
    string "a1" + "2" == "a" + "12" would.
    """
    return int.from_bytes(hashlib.blake2b(repr(obj).encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], adapter_id: Hashable, block_size: int) -> list[int]:
    """The prefix-cache key of every FULL block of ``token_ids`` under one adapter.

    Semantics:
        h[-1] = None
        h[i] = stable_hash((h[i-1], adapter_id, tuple(token_ids[i*B:(i+1)*B])))  for each full block i
    A trailing partial block has no key (its KV is still being written). Chaining makes a block's
    key depend on every token before it (the KV of a token depends on its whole prefix); the adapter
    id in every key keeps two adapters' KV apart (LoRA on q/k/v changes K and V), and it is the
    adapter's uid, not its display name, so a name re-registered with new weights never hits the
    old version's blocks.

    Example: block_size 2, tokens [5, 6, 7] -> one key, stable_hash((None, adapter_id, (5, 6))).
    Raises:
        ValueError: block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes, parent = [], None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = stable_hash((parent, adapter_id, tuple(int(t) for t in token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Candidate:
    """A waiting request as admission sees it (host values only)."""

    seq_id: int
    uid: Hashable  # adapter uid; None = the base model
    blocks_needed: int  # new KV blocks its whole prompt needs, after prefix-cache hits
    waited: int  # scheduler steps since it arrived (or was preempted)


def admit_requests(
    waiting: Sequence[Candidate],  # in arrival order
    running_uids: Collection[Hashable],  # uids of the requests already running (None = base)
    resident_uids: Collection[Hashable],  # uids whose weights sit in a GPU slot now
    max_loras_per_batch: int,  # GPU slots; the base model takes one like any adapter
    free_blocks: int,
    max_new_seqs: int,  # how many more sequences the batch may hold
    draining: Optional[Hashable] = None,  # an adapter that takes no new requests (choose_drain)
    drain_active: bool = False,  # whether ``draining`` is set (None is a real uid: the base model)
) -> list[int]:
    """Which waiting requests start now; their seq_ids in the order they are admitted.

    Semantics:
        order: the candidates whose uid is running or resident first, then the others; each part
               keeps arrival order (a stable sort on "not running and not resident")
        for c in that order, until max_new_seqs are admitted:
            skip c if drain_active and c.uid == draining
            skip c if the distinct uids of running_uids, the admitted ones and c.uid exceed
                max_loras_per_batch  (the cap: one slot per distinct uid, base included; a later
                request of an adapter already in the set still fits)
            stop if c.blocks_needed > the blocks still free (later requests wait too: a big request
                is never overtaken forever by small ones)
            admit c
    Example: 2 slots, running {None}, resident {"a"}, waiting [b(1 block), a(1), a(1)], 10 blocks free
    -> order a, a, b -> [a1, a2] admitted, b skipped (None, a and b would need 3 slots).
    Raises:
        ValueError: max_loras_per_batch < 1, or a negative free_blocks or max_new_seqs.
    """
    if max_loras_per_batch < 1 or free_blocks < 0 or max_new_seqs < 0:
        raise ValueError(f"max_loras_per_batch >= 1 and free_blocks, max_new_seqs >= 0, got "
                         f"{max_loras_per_batch}, {free_blocks}, {max_new_seqs}")
    warm = set(running_uids) | set(resident_uids)
    order = sorted(waiting, key=lambda c: c.uid not in warm)  # stable: arrival order within each part
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


def choose_drain(
    waiting: Sequence[Candidate],
    running_remaining: Mapping[Hashable, int],  # running uid -> the most tokens any of its requests still has to generate
    max_loras_per_batch: int,
    threshold: int,  # steps a request may wait before a drain starts for it
) -> tuple[bool, Optional[Hashable]]:
    """Whether to drain a running adapter now, and which: ``(True, uid)`` or ``(False, None)``.

    Semantics:
        running = the uids of running_remaining
        starved = the waiting candidates with waited > threshold whose uid is not running,
                  and only if len(running) >= max_loras_per_batch (the cap, not KV, keeps them
                  out; otherwise none)
        if none: (False, None)
        else: drain the running uid whose requests finish soonest (the smallest remaining), ties
              broken by ``uid_sort_key`` (base first, then by value) -> (True, that uid)
    While a drain lasts, admission takes no new request of the drained uid; the scheduler ends it
    once the starving request's adapter is running, or once none of its requests waits (one may
    finish in the step that admits it) (ending it as soon as the drained uid stops running would
    give the slot straight back to it: it is still resident, and admission prefers resident
    adapters), then asks again.
    Source: SGLang ``python/sglang/srt/lora/lora_drainer.py`` (``LoRADrainer``: an adapter is starving
    when a request of it waited past the threshold and the slots are full; the running adapter with
    the smallest maximum remaining tokens is drained for it). SGLang may drain one adapter per
    starving one at once, and still admits a drained adapter's requests that would finish within
    1.2x its remaining tokens; this book drains one adapter at a time and holds all of its requests.
    Example: cap 2, running {a: 30, b: 4} remaining, waiting [c waited 5], threshold 4 -> (True, "b").
    Raises:
        ValueError: threshold < 0 or max_loras_per_batch < 1.
    """
    if threshold < 0 or max_loras_per_batch < 1:
        raise ValueError(f"threshold >= 0 and max_loras_per_batch >= 1, got {threshold}, {max_loras_per_batch}")
    if len(running_remaining) < max_loras_per_batch:
        return False, None
    if not any(c.waited > threshold and c.uid not in running_remaining for c in waiting):
        return False, None
    victim = min(running_remaining, key=lambda u: (running_remaining[u], uid_sort_key(u)))
    return True, victim


def ring_walk(key: Hashable, num_instances: int, vnodes: int) -> list[int]:
    """The instances in the order a key meets them walking clockwise round the hash ring.

    The ring holds ``vnodes`` points per instance at ``stable_hash((instance, v))``; the key sits
    at ``stable_hash(key)`` and walks to the first point at or after it (wrapping), then on; each
    instance is listed once, at its first point met. Example: 3 instances -> a permutation of [0, 1, 2].
    Raises:
        ValueError: num_instances or vnodes < 1.
    """
    if num_instances < 1 or vnodes < 1:
        raise ValueError(f"num_instances and vnodes must be >= 1, got {num_instances}, {vnodes}")
    points = sorted((stable_hash((i, v)), i) for i in range(num_instances) for v in range(vnodes))
    at = stable_hash(key)
    start = next((j for j, (p, _) in enumerate(points) if p >= at), 0)
    order: list[int] = []
    for j in range(len(points)):
        inst = points[(start + j) % len(points)][1]
        if inst not in order:
            order.append(inst)
    return order


def route(adapter_key: Hashable, loads: Sequence[int], vnodes: int, capacity_factor: float, replicas: int = 1) -> int:
    """The instance a request of ``adapter_key`` goes to: consistent hashing with bounded load.

    Semantics:
        walk = ring_walk(adapter_key, len(loads), vnodes)
        bound = ceil(capacity_factor * (sum(loads) + 1) / len(loads))  (the load after this request)
        open = [i for i in walk if loads[i] < bound]   (never empty when capacity_factor >= 1)
        candidates = open[:replicas]   (a hot adapter is given several replicas)
        return the candidate with the smallest load, ties to the earliest in the walk
    With replicas 1 a key keeps its instance until that one is full, which keeps each instance's set
    of adapters small (fewer swap-ins, more prefix hits); the bound keeps a hot key from overloading it.
    Raises:
        ValueError: no instances, capacity_factor < 1, replicas < 1, or a negative load.
    """
    if not loads or capacity_factor < 1 or replicas < 1 or min(loads) < 0:
        raise ValueError(f"need instances, capacity_factor >= 1, replicas >= 1, loads >= 0; got "
                         f"{len(loads)} instances, {capacity_factor}, {replicas}, {list(loads)}")
    walk = ring_walk(adapter_key, len(loads), vnodes)
    bound = math.ceil(capacity_factor * (sum(loads) + 1) / len(loads))
    candidates = [i for i in walk if loads[i] < bound][:replicas]
    return min(candidates, key=lambda i: (loads[i], candidates.index(i)))
