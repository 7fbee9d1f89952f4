"""The tensor-parallel adapter pool: each rank holds only its shard of every slot (chapter 10).

Sources: S-LoRA (Sheng et al., 2023, section 6: each GPU keeps its partition of every adapter, so
adapter memory scales down with tp); vLLM ``vllm/lora/layers`` (each ``*ParallelLinearWithLoRA``
slices the adapter it is handed to its rank, ``slice_lora_a`` / ``slice_lora_b``, and the
``fully_sharded_loras`` option) and ``vllm/lora/worker_manager.py`` (every worker runs its own LRU
over the same requests); SGLang ``python/sglang/srt/lora/mem_pool.py`` and ``lora_manager.py`` (every
TP rank runs the same ``prepare_lora_batch`` on the same batch) and sgl-project/sglang PR #32708
(under DP attention an adapter load fans out to every DP scheduler and the adapter is registered
only when every rank succeeded, with the failed ranks' errors reported together: the agreement
below). Ranks that see different batches (DP attention) cannot rely on identical LRU decisions;
pinning the adapters removes the decisions altogether.

Layout, per module, per layer (``layout = layouts[m]``, j = this rank, R = max_lora_rank):
    column "replicated_A":   A_buffer [slots, stack*R, in]        B_buffer [slots, out_local_j, R]
    column "fully_sharded":  A_buffer [slots, stack*R/tp, in]     B_buffer [slots, out_local_j, R]
    row (either variant):    A_buffer [slots, stack*R, in/tp]     B_buffer [slots, out_total, R]
where out_local_j = sum(layout.local_out_features(j)) (the rank's q, k, v heads or gate, up
columns); the split is :func:`~reference.tp.lora.shard_lora_weights`' (the padded-max-rank layout of
the fully sharded variant included), so ``shard(m, layer)`` equals what
:func:`~reference.tp.lora.shard_pool_buffers` makes of the unsharded pool, without ever holding it.

What stays replicated: the control plane. ``lora_ranks`` / ``scalings`` are the adapters' own (the
fully sharded shrink reads them only as "active or not"), and uid_to_buffer_id, EMPTY_SLOT, the
eviction policy, pins, the CPU cache and the event log are :class:`LoRAMemoryPool`'s, unchanged.

Why ranks decide alone: every rank runs ``prepare_lora_batch`` on the same requests in the same
order, and every decision is a pure function of the pool's state and those requests (uids in
``uid_sort_key`` order, never a set's hash order; lowest free slot; the policy's order, which has no
ties), so every rank reaches the same slot map without a broadcast per batch and without reading
anything from the device. Why they must agree: the ranks compute ONE layer, so a token's slot must
hold the same adapter on every rank; a batch info built on one rank (a leader's, or one captured
in a CUDA graph) indexes every rank's buffers, and the validation collectives below pair up by
order, so a load on one rank only would pair with another rank's unrelated collective.
:meth:`TPLoRAMemoryPool.check_agreement` verifies it (all-gather of the decision state, on demand);
:func:`demonstrate_disagreement` shows what happens without it.

Rank-local failures: each rank reads an adapter itself (``adapter_source``, e.g. a PEFT directory
on its own disk) and validates the FULL adapter, then all ranks agree with one all-reduce before
anything is written; if any rank failed, every rank raises ValueError and no rank writes anything.
A batch whose adapters are all resident sends nothing: collectives happen only on loads (two small
all-reduces per adapter read from ``adapter_source``, the fetch and the slot write; one per adapter
reloaded from the CPU cache; none for the base model), where a disk read or a host-to-device copy
already dominates.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Callable, Hashable, Mapping, Optional, Sequence, TypeVar, Union

import torch
import torch.distributed as dist

from reference.batch_info import batch_info_from_requests
from reference.eviction import EvictionPolicy
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec, uid_sort_key
from reference.packed import slice_offsets_for
from reference.tp.lora import VARIANTS, LoRAShard, TPLayout, shard_base_weight, shard_lora_weights, tp_lora_linear

__all__ = ["TPLoRAMemoryPool", "demonstrate_disagreement"]

T = TypeVar("T")


class TPLoRAMemoryPool(LoRAMemoryPool):
    """A :class:`LoRAMemoryPool` whose buffers hold this rank's shard of every slot (module docstring).

    Args:
        layouts: one :class:`~reference.tp.lora.TPLayout` per pool module (its ``spec`` is the FULL
            module, which adapters are validated against); all with the same ``tp_size``.
        variants: module name -> one of ``VARIANTS[layout.parallel]``.
        group: the tensor-parallel process group (None: the default group); this rank is
            ``dist.get_rank(group)``. Collectives run on the CPU when the group is gloo (vLLM keeps a
            gloo ``cpu_group`` beside the NCCL one for such host decisions), else on ``device``.
        The rest as :class:`LoRAMemoryPool`.
    Attributes (beside the base pool's; A_buffer / B_buffer have the local shapes):
        layouts, variants, tp_rank, tp_size, group.
    Construction is collective: every rank must construct its pool, and all agree (one all-reduce
    of the local checks, then :meth:`check_agreement`) before any rank returns.
    Raises:
        ValueError: layouts that are not TPLayouts or disagree on tp_size; variants that do not name
        every module with a variant of its kind; fully sharded with max_lora_rank not divisible by
        tp_size; tp_size > 1 without an initialized process group of that size; anything the base
        pool refuses; on EVERY rank, a configuration or state that differs between ranks.
    """

    def __init__(self, layouts: Sequence[TPLayout], variants: Mapping[str, str], num_layers: int,
                 max_loras_per_batch: int, max_lora_rank: int, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu",
                 eviction_policy: Union[str, EvictionPolicy] = "lru", *, group: Optional[dist.ProcessGroup] = None,
                 adapter_source: Optional[Callable[[Hashable], LoRAAdapter]] = None,
                 max_loaded_loras: Optional[int] = None) -> None:
        layouts = tuple(layouts)
        if not layouts or not all(isinstance(layout, TPLayout) for layout in layouts):
            raise ValueError(f"layouts must be one or more TPLayouts, got {[type(x).__name__ for x in layouts]}")
        sizes = {layout.tp_size for layout in layouts}
        if len(sizes) != 1:
            raise ValueError(f"every layout must have the same tp_size, got {sorted(sizes)}")
        self.tp_size, self.group = sizes.pop(), group
        self.tp_rank = self._rank_in_group()
        self.layouts = {layout.spec.name: layout for layout in layouts}
        self.variants = dict(variants)
        self.device = torch.device(device)  # the base sets it again; the collectives below need it first
        base_init = super().__init__

        def construct() -> None:  # every rank-local configuration error, then agreed
            self._check_variants(max_lora_rank)
            base_init([layout.spec for layout in layouts], num_layers, max_loras_per_batch, max_lora_rank, dtype,
                      device, eviction_policy, adapter_source=adapter_source, max_loaded_loras=max_loaded_loras)
        self._agreed("the pool's configuration", construct)
        self.check_agreement()

    def _rank_in_group(self) -> int:
        if self.tp_size == 1:
            return 0
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(f"a pool sharded over {self.tp_size} ranks needs an initialized process group "
                             "(torch.distributed.init_process_group, or reference.tp.lora.spawn_ranks)")
        if dist.get_world_size(self.group) != self.tp_size:
            raise ValueError(f"the layouts split over {self.tp_size} ranks but the process group has "
                             f"{dist.get_world_size(self.group)}")
        return dist.get_rank(self.group)

    def _check_variants(self, max_lora_rank: int) -> None:
        if set(self.variants) != set(self.layouts):
            raise ValueError(f"variants must name exactly the modules {sorted(self.layouts)}, "
                             f"got {sorted(self.variants)}")
        for name, layout in self.layouts.items():
            if self.variants[name] not in VARIANTS[layout.parallel]:
                raise ValueError(f"{name}: variant {self.variants[name]!r} is not one of {VARIANTS[layout.parallel]} "
                                 f"({layout.parallel}-parallel)")
            if self.variants[name] == "fully_sharded" and max_lora_rank % self.tp_size:
                raise ValueError(f"{name}: fully sharded LoRA splits the padded max rank {max_lora_rank}, which must "
                                 f"be divisible by tp_size {self.tp_size}")

    # ---- the data plane: local shapes and the rank's shard of each write --------------------------
    def _buffer_shapes(self, spec: ModuleSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        layout, j, R = self.layouts[spec.name], self.tp_rank, self.max_lora_rank
        rows = R // self.tp_size if self.variants[spec.name] == "fully_sharded" else R
        lo, hi = layout.in_range(j)
        return (self.num_slots, spec.stack_num * rows, hi - lo), (self.num_slots, sum(layout.local_out_features(j)), R)

    def _write_slot(self, adapter: Optional[LoRAAdapter], slot: int) -> None:
        """The base write (zero-fill every module of the slot, copy, set rank and scaling) of this rank's
        shard of ``adapter``. Nothing here can fail: the full adapter was validated (and agreed) first."""
        super()._write_slot(None if adapter is None else self._local_adapter(adapter), slot)

    def _local_adapter(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """``adapter`` with each (A, B) replaced by this rank's shard (B cut back to the adapter's rank r:
        the base write copies B into columns [0, r), and the shard's columns past r are zeros)."""
        weights = {}
        for (layer, name), (a, b) in adapter.weights.items():
            A_loc, B_loc = shard_lora_weights(a, b, self.layouts[name], self.variants[name], self.tp_rank,
                                              max_rank=self.max_lora_rank)
            weights[(layer, name)] = (A_loc, B_loc[:, :adapter.rank])
        return dataclasses.replace(adapter, weights=weights)

    def shard(self, name: str, layer: int) -> LoRAShard:
        """This rank's buffers of ``name`` at ``layer`` as a :class:`LoRAShard` for ``tp_lora_linear``.

        A view, not a copy: a later load into a slot is seen by the shard. Shapes as the module
        docstring; ``slice_offsets`` are the local part widths (host ints).
        Raises ValueError for an unknown module or a layer out of range.
        """
        if name not in self.layouts or not 0 <= layer < self.num_layers:
            raise ValueError(f"no module {name!r} at layer {layer}: modules {sorted(self.layouts)}, "
                             f"layers 0..{self.num_layers - 1}")
        layout = self.layouts[name]
        return LoRAShard(self.variants[name], self.A_buffer[name][layer], self.B_buffer[name][layer],
                         layout.spec.stack_num, slice_offsets_for(layout.local_out_features(self.tp_rank)),
                         self.max_lora_rank, self.tp_rank, self.tp_size)

    # ---- agreement on rank-local checks ---------------------------------------------------------
    def _fetch(self, uid: Hashable) -> LoRAAdapter:
        """The base fetch (read from ``adapter_source``, validate the full adapter), agreed by all ranks."""
        return self._agreed(f"adapter {uid!r}", functools.partial(super()._fetch, uid))

    def _check_slot_write(self, adapter: Optional[LoRAAdapter], slot: int) -> None:
        """The base checks of ``load_to_slot``, agreed by all ranks when an adapter (rank-local data) is
        involved; the base model's checks read only replicated state, so they need no collective."""
        check = functools.partial(super()._check_slot_write, adapter, slot)
        if adapter is None:
            check()
        else:
            self._agreed(f"adapter {adapter.uid!r} for slot {slot}", check)

    def _agreed(self, what: str, check: Callable[[], T]) -> T:
        """Run a rank-local check, then agree: every rank returns, or every rank raises ValueError.

        One all-reduce (MAX) of a [tp_size] int32 vector whose entry j is 1 where rank j's check
        raised, i.e. the MIN of every rank's ok flag, with the ranks named.
        """
        try:
            result, error = check(), None
        except Exception as err:  # any failure (a missing file too) must reach the others, or they wait forever
            result, error = None, err
        rejected = self._rejecting_ranks(error is not None)
        if not rejected:
            return result
        if error is not None:
            raise ValueError(f"rank {self.tp_rank} rejected {what}: {error} [rejected by rank(s) {rejected} of "
                             f"{self.tp_size}; nothing was written on any rank]") from error
        raise ValueError(f"{what} was rejected by rank(s) {rejected} of {self.tp_size} (their errors say why); it "
                         f"passed on rank {self.tp_rank}, but nothing was written on any rank")

    def _comm_device(self) -> torch.device:
        gloo = self.tp_size == 1 or dist.get_backend(self.group) == "gloo"
        return torch.device("cpu") if gloo else self.device

    def _rejecting_ranks(self, failed: bool) -> list[int]:
        flags = torch.zeros(self.tp_size, dtype=torch.int32, device=self._comm_device())
        flags[self.tp_rank] = int(failed)
        if self.tp_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        return [j for j, f in enumerate(flags.tolist()) if f]

    # ---- agreement on decisions -------------------------------------------------------------------
    def decision_state(self) -> dict[str, str]:
        """What every rank must have identical, as text: configuration, slot map, ranks, scalings, policy
        order, pins and CPU-cache order (uids by ``repr``, which is stable across processes where
        ``hash`` of a str is not)."""
        layouts = [(n, lay.parallel, lay.units, lay.spec, self.variants[n]) for n, lay in self.layouts.items()]
        fields = {"eviction_policy": type(self.eviction_policy).__name__, "num_slots": self.num_slots,
                  "max_lora_rank": self.max_lora_rank, "num_layers": self.num_layers, "dtype": str(self.dtype),
                  "max_loaded_loras": self.max_loaded_loras, "tp_size": self.tp_size, "layouts": layouts,
                  "buffer_id_to_uid": self.buffer_id_to_uid, "lora_ranks": self.lora_ranks_host,
                  "scalings": self.scalings_host, "policy_order": self.eviction_policy.order(),
                  "pinned": sorted(self.pinned, key=uid_sort_key), "cpu_cache": tuple(self.cpu_cache)}
        return {k: repr(v) for k, v in fields.items()}

    def check_agreement(self) -> None:
        """Raise ValueError on every rank unless every rank's :meth:`decision_state` equals rank 0's.

        Collective (two all-gathers: the encodings' lengths, then the encodings); call it where a
        divergence would be costly to find later (after construction it runs once; a test or a
        debug mode may call it every step; a server every N steps), not inside every batch.
        The message names each differing rank and field with both values.
        """
        states = [json.loads(s) for s in self._all_gather_text(json.dumps(self.decision_state()))]
        diffs = [f"rank {j} {field}: {state[field]} (rank 0: {states[0][field]})"
                 for j, state in enumerate(states) for field in state if state[field] != states[0][field]]
        if diffs:
            raise ValueError("tensor-parallel ranks disagree on the adapter pool, so a token's slot would hold "
                             "different adapters on different ranks: " + "; ".join(diffs))

    def _all_gather_text(self, text: str) -> list[str]:
        if self.tp_size == 1:
            return [text]
        device = self._comm_device()
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.tp_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], device=device), group=self.group)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data
        pieces = [torch.empty_like(padded) for _ in range(self.tp_size)]
        dist.all_gather(pieces, padded, group=self.group)
        return [bytes(p[:int(n)].tolist()).decode() for p, n in zip(pieces, sizes)]


# ---- what goes wrong when ranks disagree ----------------------------------------------------------
def demonstrate_disagreement(tp_rank: int, tp_size: int) -> dict:
    """One column-parallel LoRA layer on ranks whose request streams differed once (run it with
    ``spawn_ranks(demonstrate_disagreement, 2)``; every rank must call it).

    A pool of 2 slots, adapters a, b, c. Batches [a, b], then [a] (a request that reached rank 0
    only: LRU now holds b as the older), then [c]: rank 0 evicts b and puts c in slot 1, every other
    rank evicts a and puts c in slot 0. Both loaded c once, so the load collectives still pair up and
    nothing hangs, and every rank's state looks valid on its own. Then a batch of c:
        "leader_max_error":  max |TP output - truth| with rank 0's batch info used on every rank (as a
                             batch built once and sent, or captured in a CUDA graph, would be): the
                             other ranks' slot 1 holds b, so their output columns are b's delta: garbage
        "own_max_error":     the same with each rank's own batch info (self-consistent here: each
                             rank reads c from its own slot), rounding only; the divergence is still
                             there, and the next load on one rank only would pair its collectives
                             with another rank's unrelated ones
        "agreement_error":   check_agreement's message (it raises on every rank), naming the field
        "slot_map":          this rank's buffer_id_to_uid, as strings
    CPU tensors (gloo, spawn_ranks' default). Returns that dict (plain data for spawn_ranks).
    Raises ValueError if tp_size < 2.
    """
    if tp_size < 2:
        raise ValueError(f"the demonstration needs at least 2 ranks, got {tp_size}")
    g = torch.Generator().manual_seed(0)
    spec, r, tokens = ModuleSpec("proj", 16, (8 * tp_size,)), 4, 3
    adapters = {u: LoRAAdapter(u, r, 0.5, {(0, "proj"): (torch.randn(r, 16, generator=g),
                                                        torch.randn(spec.out_total, r, generator=g))})
                for u in "abc"}
    layout = TPLayout(spec, "column", tp_size)
    pool = TPLoRAMemoryPool([layout], {"proj": "replicated_A"}, 1, 2, r, adapter_source=adapters.__getitem__)
    for batch in (["a", "b"], ["a"], ["c"]):
        if batch != ["a"] or tp_rank == 0:
            pool.prepare_lora_batch(batch)
    W, x = torch.randn(spec.out_total, 16, generator=g), torch.randn(tokens, 16, generator=g)
    W_local = shard_base_weight(W, layout, tp_rank)
    A, B = adapters["c"].weights[(0, "proj")]
    truth = x @ W.T + 0.5 * (x @ A.T) @ B.T
    leader = torch.tensor([pool.uid_to_buffer_id["c"]])
    dist.broadcast(leader, src=0)
    errors = {}
    for label, slot in (("leader_max_error", int(leader)), ("own_max_error", pool.uid_to_buffer_id["c"])):
        info = batch_info_from_requests(["c"], [tokens], {"c": slot}, pool.lora_ranks_host, pool.scalings_host, "cpu")
        local = tp_lora_linear(x, lambda v: v @ W_local.T, pool.shard("proj", 0), info)
        pieces = [torch.empty_like(local) for _ in range(tp_size)]
        dist.all_gather(pieces, local)
        errors[label] = (torch.cat(pieces, dim=1) - truth).abs().max().item()
    try:
        pool.check_agreement()
        message = ""
    except ValueError as err:
        message = str(err)
    return {**errors, "agreement_error": message, "slot_map": [str(u) for u in pool.buffer_id_to_uid]}

