"""Several engines behind a router, simulated on the control plane: what routing by adapter buys.

Each instance is a real ``Scheduler`` over a real ``BlockManager`` and a real ``LoRAMemoryPool``
(of tiny buffers: only its bookkeeping matters here), stepped in lockstep; the "model" emits a token
that depends on the whole sequence, so the prefix cache and the pool see what a real engine would.
A request is routed when it arrives, by adapter affinity (``route``: consistent hashing with bounded
load, hot adapters given replicas) or round robin. Measured per policy: distinct adapters per
batch (what each step's LoRA kernels and slots serve), swap-ins (pool loads), prefix-cache hit rate.

Source: the LoRA-affinity routing of multi-instance servers (vLLM's production stack and SGLang's
router route by adapter so an instance's set of adapters stays small); the bounded-load rule of
Mirrokni et al. (SODA 2018).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence as Seq

import torch

from reference.engine.block_manager import BlockManager
from reference.engine.policies import route
from reference.engine.scheduler import Scheduler, SchedulerConfig
from reference.engine.sequence import SamplingParams, Sequence
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec

__all__ = ["TraceRequest", "zipf_trace", "SimulatedEngine", "simulate_cluster"]

_SPEC = ModuleSpec("qkv_proj", 4, (4,))


@dataclass(frozen=True)
class TraceRequest:
    arrival: int  # the step at which it reaches the router
    prompt: tuple[int, ...]
    uid: Hashable  # None: the base model
    max_new_tokens: int


def zipf_trace(num_requests: int, num_adapters: int, seed: int = 0, alpha: float = 1.0, per_step: int = 2,
               prefix_len: int = 16, tail: tuple[int, int] = (4, 24), new_tokens: tuple[int, int] = (4, 16)) -> list[TraceRequest]:
    """A trace: ``per_step`` arrivals per step, adapter k chosen with weight 1/(k+1)^alpha, each
    adapter's requests sharing that adapter's system prompt of ``prefix_len`` tokens."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.tensor([1.0 / (k + 1) ** alpha for k in range(num_adapters)])
    picks = torch.multinomial(weights, num_requests, replacement=True, generator=g).tolist()
    systems = {k: tuple(torch.randint(0, 1000, (prefix_len,), generator=g).tolist()) for k in range(num_adapters)}
    out = []
    for i, k in enumerate(picks):
        n_tail = int(torch.randint(tail[0], tail[1] + 1, (1,), generator=g))
        tail_tokens = tuple(torch.randint(0, 1000, (n_tail,), generator=g).tolist())
        new = int(torch.randint(new_tokens[0], new_tokens[1] + 1, (1,), generator=g))
        out.append(TraceRequest(i // per_step, systems[k] + tail_tokens, f"adapter{k}", new))
    return out


def _tiny_adapter(uid) -> LoRAAdapter:
    return LoRAAdapter(uid, 1, 1.0, {(0, "qkv_proj"): (torch.zeros(1, 4), torch.zeros(4, 1))})


def _fake_token(tokens: Seq[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 31 + t + 7) % 1_000_003
    return h % 1000


class SimulatedEngine:
    """One engine's control plane with a fake model (a token that depends on the whole sequence):
    a ``Scheduler`` over a ``BlockManager``, and a ``LoRAMemoryPool`` of tiny buffers whose
    bookkeeping (slots, tiers, events) is the real one. ``step()`` runs one scheduler step."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int, max_loaded: Optional[int]) -> None:
        self.pool = LoRAMemoryPool([_SPEC], 1, config.max_loras_per_batch, 1, adapter_source=_tiny_adapter,
                                   max_loaded_loras=max_loaded)
        self.blocks = BlockManager(num_blocks, block_size)
        self.sched = Scheduler(config, self.blocks, lambda: self.pool.uid_to_buffer_id.keys())
        self.batch_adapters: list[int] = []
        self.last_step: tuple = ("idle", [])

    @property
    def load(self) -> int:
        return len(self.sched.waiting) + len(self.sched.running)

    def step(self) -> None:
        if not self.sched.has_unfinished():
            self.last_step = ("idle", [])
            return
        kind, work = self.sched.schedule()
        self.last_step = (kind, [w.seq.seq_id for w in work])
        uids = [w.seq.uid for w in work]
        self.pool.prepare_lora_batch(uids, running=[s.uid for s in self.sched.running])
        self.batch_adapters.append(len(set(uids)))
        self.sched.postprocess(work, {w.seq.seq_id: _fake_token(w.seq.tokens) for w in work if w.end == w.seq.num_tokens})


def simulate_cluster(trace: Seq[TraceRequest], num_instances: int, policy: str, *, max_loras_per_batch: int = 4,
                     num_blocks: int = 256, block_size: int = 8, max_num_seqs: int = 8, vnodes: int = 16,
                     capacity_factor: float = 1.25, replicas: int = 1, max_loaded_loras: Optional[int] = 8) -> dict:
    """Run ``trace`` through ``num_instances`` simulated engines routed by ``policy``
    ("affinity": :func:`route` on the adapter uid; "round_robin"). Returns the measures:
    ``adapters_per_batch`` (mean distinct uids per step's batch), ``swap_ins`` (pool loads, all
    instances), ``prefix_hit_rate``, ``steps`` (until every request finished), ``per_instance`` requests.
    Raises:
        ValueError: an unknown policy or num_instances < 1.
    """
    if policy not in ("affinity", "round_robin") or num_instances < 1:
        raise ValueError(f"policy 'affinity' or 'round_robin' and num_instances >= 1, got {policy!r}, {num_instances}")
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_loras_per_batch=max_loras_per_batch)
    instances = [SimulatedEngine(config, num_blocks, block_size, max_loaded_loras) for _ in range(num_instances)]
    pending = sorted(enumerate(trace), key=lambda p: (p[1].arrival, p[0]))
    sent, step, rr = Counter(), 0, 0
    while pending or any(i.sched.has_unfinished() for i in instances):
        while pending and pending[0][1].arrival <= step:
            idx, req = pending.pop(0)
            if policy == "affinity":
                target = route(req.uid, [i.load for i in instances], vnodes, capacity_factor, replicas)
            else:
                target, rr = rr % num_instances, rr + 1
            instances[target].sched.add(Sequence(idx, list(req.prompt), req.uid,
                                                 SamplingParams(max_new_tokens=req.max_new_tokens)))
            sent[target] += 1
        for inst in instances:
            inst.step()
        step += 1
    batches = [n for i in instances for n in i.batch_adapters]
    hits = sum(i.blocks.hit_tokens for i in instances)
    queries = sum(i.blocks.query_tokens for i in instances)
    loads = sum(1 for i in instances for e in i.pool.events if e[0] == "load" and e[1] is not None)
    return dict(policy=policy, adapters_per_batch=sum(batches) / len(batches), swap_ins=loads,
                prefix_hit_rate=hits / queries if queries else 0.0, steps=step,
                per_instance=[sent[k] for k in range(num_instances)])
