"""Eviction policies of the adapter memory pool: which resident adapter leaves when a slot is needed.

Source: SGLang ``python/sglang/srt/lora/eviction_policy.py`` (``EvictionPolicy``, ``LRUEvictionPolicy``,
``FIFOEvictionPolicy``, ``get_eviction_policy``) and the base-model rule of SGLang
``python/sglang/srt/lora/mem_pool.py`` (``prepare_lora_batch``). TensorRT-LLM's ``AdapterSlotManager``
keeps the same LRU order in an ordered map.

A policy is only an *order* over the uids it tracks (oldest = next victim). The pool calls
``mark_used`` for every uid of a batch (in ``uid_sort_key`` order), ``remove`` when it evicts one and
``select_victim`` with the residents it is allowed to evict. ``None`` is a real uid, the base model:
it is chosen only when no other candidate exists (a batch made only of LoRA requests).

Running example (LRU): mark_used A, B, C, A -> order (B, C, A); select_victim({A, C}) -> C.
The same calls under FIFO: order (A, B, C) (the second A changes nothing); select_victim({A, C}) -> A.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import AbstractSet, Hashable

__all__ = ["EvictionPolicy", "LRUEvictionPolicy", "FIFOEvictionPolicy", "get_eviction_policy",
           "EVICTION_POLICIES"]


class EvictionPolicy(ABC):
    """Orders tracked uids from next victim to last; the pool owns which uids may be evicted.

    Tie-break: there are no ties. Every ``mark_used`` call has its own position in one sequence, so
    two uids are never equally old; a batch's uids are marked one at a time in the pool's
    deterministic order (base first, then sorted), never in set-iteration order.
    """

    @abstractmethod
    def mark_used(self, uid: Hashable) -> None:
        """Record that ``uid`` (``None`` = base model) is used by the current batch."""

    @abstractmethod
    def remove(self, uid: Hashable) -> None:
        """Forget ``uid`` (it was evicted). Forgetting an untracked uid is a no-op."""

    @abstractmethod
    def order(self) -> tuple:
        """Tracked uids, next victim first. Part of the pool's ``snapshot()`` and of graders' logs."""

    def select_victim(self, candidates: AbstractSet[Hashable]) -> Hashable:
        """The first uid of ``order()`` among ``candidates``, skipping ``None`` while another exists.

        Pure: nothing is removed (the pool calls ``remove`` when it really evicts).

        Raises:
            ValueError: ``candidates`` is empty, or holds a uid this policy never saw (the pool marks
            every adapter it loads, so an untracked candidate is a bookkeeping bug).
        """
        if not candidates:
            raise ValueError("select_victim needs at least one candidate; every resident is protected")
        tracked = self.order()
        untracked = [uid for uid in candidates if uid not in tracked]
        if untracked:
            raise ValueError(f"candidates {untracked!r} were never marked used by this policy")
        allowed = set(candidates) - {None} or set(candidates)  # base model only as a last resort
        return next(uid for uid in tracked if uid in allowed)


class LRUEvictionPolicy(EvictionPolicy):
    """Least recently used first: every ``mark_used`` moves the uid to the young end."""

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()  # uid -> None, oldest use first

    def mark_used(self, uid: Hashable) -> None:
        self._order[uid] = None
        self._order.move_to_end(uid)

    def remove(self, uid: Hashable) -> None:
        self._order.pop(uid, None)

    def order(self) -> tuple:
        return tuple(self._order)


class FIFOEvictionPolicy(EvictionPolicy):
    """First loaded first out: only the first ``mark_used`` after a load (or a ``remove``) counts,
    so hits do not rejuvenate an adapter."""

    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()  # uid -> None, earliest insertion first

    def mark_used(self, uid: Hashable) -> None:
        self._order.setdefault(uid, None)

    def remove(self, uid: Hashable) -> None:
        self._order.pop(uid, None)

    def order(self) -> tuple:
        return tuple(self._order)


EVICTION_POLICIES = {"lru": LRUEvictionPolicy, "fifo": FIFOEvictionPolicy}


def get_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh policy by name: ``"lru"`` (SGLang's default) or ``"fifo"``.

    Raises:
        ValueError: an unknown name (the message lists the known ones; names are lower case).
    """
    if name not in EVICTION_POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}; choose one of {sorted(EVICTION_POLICIES)}")
    return EVICTION_POLICIES[name]()
