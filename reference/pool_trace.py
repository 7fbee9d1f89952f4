"""Seeded request traces with Zipf-distributed adapter popularity, replayed through the memory pool.

Chapter 05's figure (figures/src/pool_trace.py) compares eviction policies on such a trace. The replay
uses the real ``LoRAMemoryPool`` bookkeeping (admission, ``prepare_lora_batch``, tiers, event log) with
1 layer of a 2x2 module at rank 1, so a few hundred steps take well under a second on a CPU.

Popularity follows Zipf's law, as in the workloads of S-LoRA (Sheng et al., 2023) and Punica: adapter k
(1-based) is asked for with probability proportional to 1 / k**s. Arrivals per step are Poisson; each
request then decodes for 1..max_decode_steps steps, holding its adapter resident.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional

import numpy as np
import torch

from reference.mem_pool import EMPTY_SLOT, LoRAAdapter, LoRAMemoryPool, ModuleSpec

__all__ = ["TraceConfig", "TraceRequest", "TraceStats", "zipf_probabilities", "make_trace",
           "simulate_trace"]


@dataclass(frozen=True)
class TraceConfig:
    num_adapters: int = 64
    zipf_s: float = 1.1  # popularity exponent: larger = a few adapters take most requests
    steps: int = 400
    arrivals_per_step: float = 2.0  # Poisson mean
    max_decode_steps: int = 3  # a request stays running 1..max_decode_steps steps (uniform)
    base_fraction: float = 0.1  # requests for the base model (uid None)
    seed: int = 0


@dataclass(frozen=True)
class TraceRequest:
    uid: Hashable  # "lora-07", or None for the base model
    decode_steps: int  # steps the request stays running after admission, >= 1


@dataclass
class TraceStats:
    """Per-step counts of one replay (one entry per trace step)."""

    policy: str
    occupancy: list = field(default_factory=list)  # non-empty slots after the step
    hits: list = field(default_factory=list)  # new requests' distinct uids already resident
    loads: list = field(default_factory=list)  # slot loads (misses), any tier
    disk_loads: list = field(default_factory=list)  # loads that missed the CPU cache too
    evictions: list = field(default_factory=list)  # slot evictions
    waiting: list = field(default_factory=list)  # requests deferred by admission

    def hit_rate(self) -> float:
        """Hits / (hits + loads) over the whole replay."""
        total = sum(self.hits) + sum(self.loads)
        return sum(self.hits) / total if total else 0.0


def zipf_probabilities(n: int, s: float) -> np.ndarray:
    """[n] float64 summing to 1: p[k-1] proportional to 1 / k**s."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def make_trace(cfg: TraceConfig) -> list[list[TraceRequest]]:
    """Arrivals per step, reproducible from ``cfg.seed`` (numpy's PCG64 generator)."""
    rng = np.random.default_rng(cfg.seed)
    probs = zipf_probabilities(cfg.num_adapters, cfg.zipf_s)
    trace = []
    for _ in range(cfg.steps):
        n = int(rng.poisson(cfg.arrivals_per_step))
        is_base = rng.random(n) < cfg.base_fraction
        ranks = rng.choice(cfg.num_adapters, size=n, p=probs)
        lengths = rng.integers(1, cfg.max_decode_steps + 1, size=n)
        trace.append([TraceRequest(None if b else f"lora-{k:02d}", int(t))
                      for b, k, t in zip(is_base, ranks, lengths)])
    return trace


def _tiny_pool(trace: list[list[TraceRequest]], policy: str, num_slots: int,
               max_loaded_loras: Optional[int]) -> LoRAMemoryPool:
    """A pool of 1 layer, one 2x2 module, rank 1: the bookkeeping of a real pool at no cost."""
    uids = {r.uid for step in trace for r in step} - {None}
    weights = {(0, "q_proj"): (torch.ones(1, 2), torch.ones(2, 1))}
    adapters = {u: LoRAAdapter(uid=u, rank=1, scaling=1.0, weights=weights) for u in uids}
    return LoRAMemoryPool([ModuleSpec("q_proj", 2, (2,))], 1, num_slots, 1, eviction_policy=policy,
                          adapter_source=adapters.__getitem__, max_loaded_loras=max_loaded_loras)


def _record(stats: TraceStats, pool: LoRAMemoryPool, events: list, new_uids: set, waiting: int) -> None:
    kinds = [e[0] for e in events]
    stats.occupancy.append(sum(u is not EMPTY_SLOT for u in pool.buffer_id_to_uid))
    stats.hits.append(sum(e[0] == "hit" and e[1] in new_uids for e in events))
    stats.loads.append(kinds.count("load"))
    stats.disk_loads.append(sum(e[0] == "load" and e[3] == "disk" for e in events))
    stats.evictions.append(kinds.count("evict"))
    stats.waiting.append(waiting)


def simulate_trace(trace: list[list[TraceRequest]], policy: str, num_slots: int,
                   max_loaded_loras: Optional[int] = None) -> TraceStats:
    """Replay ``trace``: each step admits waiting requests in arrival order (``pool.admit``), makes
    new and running adapters resident (``pool.prepare_lora_batch``), then advances decoding.

    Returns per-step counts; deterministic for a given trace and arguments.
    """
    pool, stats = _tiny_pool(trace, policy, num_slots, max_loaded_loras), TraceStats(policy)
    waiting: list[TraceRequest] = []
    running: list[tuple[TraceRequest, int]] = []  # (request, steps left)
    for arrivals in trace:
        waiting += arrivals
        running_uids = {r.uid for r, _ in running}
        admitted, deferred = pool.admit([r.uid for r in waiting], running_uids)
        new, waiting = [waiting[i] for i in admitted], [waiting[i] for i in deferred]
        start = len(pool.events)
        pool.prepare_lora_batch([r.uid for r in new], running=running_uids)
        _record(stats, pool, pool.events[start:], {r.uid for r in new}, len(waiting))
        running = [(r, left - 1) for r, left in running + [(r, r.decode_steps) for r in new] if left > 1]
    return stats
