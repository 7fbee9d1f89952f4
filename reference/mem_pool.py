"""The adapter memory pool: fixed GPU slots whose contents are swapped, and the serving logic around it.

Sources: SGLang ``python/sglang/srt/lora/mem_pool.py`` (``EmptySlot``, ``LoRAMemoryPool``,
``prepare_lora_batch``, ``load_lora_weight_to_buffer``), ``lora_manager.py`` (``max_loaded_loras``, the
batch-capacity check), ``lora_registry.py`` (``LoRARef``: a unique id distinct from the display name);
TensorRT-LLM's ``AdapterSlotManager`` (LRU slots, base requests on a sentinel slot); vLLM's
``LRUCacheWorkerLoRAManager`` (a CPU cache in front of the GPU slots).

Conventions differ between systems. Here ``None`` is a real uid, the base model, which occupies a slot
of rank 0, and a free slot holds the ``EMPTY_SLOT`` sentinel (SGLang's choice). vLLM marks a free slot
with ``None`` and gives base tokens index -1; TensorRT-LLM maps base requests to an extra slot number
equal to the slot count.

Three tiers: GPU slots (this pool's buffers, allocated once so their addresses never change), a CPU cache
of host copies (at most ``max_loaded_loras``, LRU, always holding every adapter resident on the GPU that
came through it) and "disk" (``adapter_source``, e.g. ``AdapterRegistry.load``).

Event log ``pool.events`` (plain tuples, appended in the order things happen), four kinds by ``prepare_lora_batch``:
    ("hit", uid, slot)              uid of the batch already resident in slot
    ("evict", uid, slot)            uid leaves slot to make room (its host copy may stay cached)
    ("cpu_evict", uid)              uid's host copy leaves the CPU cache (LRU over host copies)
    ("load", uid, slot, tier)       uid written into slot; tier "cpu" (CPU-cache hit), "disk" (CPU-cache
                                    miss, fetched from adapter_source) or "base" (None: zero-fill, rank 0)
and one by ``unload`` (an adapter removed from the pool, the serving engine's adapter removal):
    ("unload", uid, slot)           slot: the slot it was resident in (now zeroed and free), or None
                                    when only its host copy was held
``events_to_json`` writes them with explicit tags: ``None`` -> {"base": true}, EMPTY_SLOT -> {"empty":
true}. Running example, 2 slots, LRU, adapters A and B on disk:
    prepare_lora_batch({"A", None}) -> ("load", None, 0, "base"), ("load", "A", 1, "disk")
    prepare_lora_batch({"B", None}) -> ("hit", None, 0), ("evict", "A", 1), ("load", "B", 1, "disk")
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Optional, Sequence, Union

import torch

from reference.eviction import EvictionPolicy, get_eviction_policy

__all__ = [
    "EmptySlot",
    "EMPTY_SLOT",
    "ModuleSpec",
    "LoRAAdapter",
    "LoRAMemoryPool",
    "AdapterRegistry",
    "uid_sort_key",
    "uid_to_json",
    "uid_from_json",
    "events_to_json",
    "events_from_json",
    "snapshot_diff",
]


class EmptySlot:
    """The type of ``EMPTY_SLOT``, the marker of a free slot (``None`` is taken: it is the base model).

    A singleton: constructing, copying, deep-copying or unpickling it gives back the same object, so
    ``slot_uid is EMPTY_SLOT`` holds everywhere.
    """

    __slots__ = ()
    _instance: Optional["EmptySlot"] = None

    def __new__(cls) -> "EmptySlot":
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "EMPTY_SLOT"

    def __reduce__(self) -> str:
        return "EMPTY_SLOT"  # pickle and copy look up this module's global: the same object

    def __copy__(self) -> "EmptySlot":
        return self

    def __deepcopy__(self, memo: dict) -> "EmptySlot":
        return self


EMPTY_SLOT = EmptySlot()


@dataclass(frozen=True)
class ModuleSpec:
    """One target module of every layer, e.g. ModuleSpec("qkv_proj", 4096, (4096, 1024, 1024)).

    Its buffers are A [num_slots, stack_num * max_rank, in_features] and
    B [num_slots, out_total, max_rank].
    """

    name: str  # "q_proj", or a fused "qkv_proj" / "gate_up_proj"
    in_features: int
    out_features: tuple[int, ...]  # one entry per stacked part

    def __post_init__(self) -> None:
        object.__setattr__(self, "out_features", tuple(self.out_features))
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"module name must be a non-empty string, got {self.name!r}")
        sizes = (self.in_features, *self.out_features)
        if not self.out_features or any(not isinstance(n, int) or n < 1 for n in sizes):
            raise ValueError(f"{self.name}: sizes must be positive ints, got in={self.in_features}, "
                             f"out={self.out_features}")

    @property
    def stack_num(self) -> int:
        return len(self.out_features)

    @property
    def out_total(self) -> int:
        return sum(self.out_features)

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        """Output column offsets of the parts: (4096, 1024, 1024) -> (0, 4096, 5120, 6144)."""
        offsets = [0]
        for n in self.out_features:
            offsets.append(offsets[-1] + n)
        return tuple(offsets)


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host, already in the pool's layout.

    ``weights[(layer, module)] = (A [stack_num * rank, in_features], B [out_total, rank])``; stacked
    part i is rows [i*r, (i+1)*r) of A and, in B, the rows of slice i (columns [0, r)). An absent
    (layer, module) key means "no such module": its delta is zero.
    """

    uid: Hashable  # unique identity; never None (the base model) nor EMPTY_SLOT
    rank: int  # r, 1 <= r <= the pool's max_lora_rank
    scaling: float  # applied by expand per slot
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, module) -> (A, B)


def uid_sort_key(uid: Hashable) -> tuple:
    """Deterministic processing order of a batch's uids: base first, then by type name, then value.

    Python's set order of strings changes with the hash seed, so the pool never iterates a set.
    A uid need only be hashable, so the key is total over any mix of uids: within one type name,
    values compare by :func:`_value_key` (numbers by value, strings as strings, tuples element by
    element, frozensets as their sorted elements, dataclasses field by field, anything else by
    (qualified type name, repr)). For None, str, int, float, bool and tuples of those the order is
    exactly the one of ``(uid is not None, type(uid).__name__, uid)``, the key before it was total
    (chapter 05's event logs are compared in this order).
    Example: ["b", 2, None, ("x", 1), 1, "a"] -> [None, 1, 2, "a", "b", ("x", 1)].
    """
    return (uid is not None, type(uid).__name__, _value_key(uid))


def _value_key(value) -> tuple:
    """A total order key that agrees with Python's ``<`` wherever ``<`` worked on the kinds above.

    A tag keeps kinds apart (Python's ``<`` raised between them, so any fixed order will do); within
    a tag the payloads always compare. Numbers share one tag, as ``(1, "a") < (1.5, "b")`` and
    ``1 == True`` did; tuples map element by element, so a prefix still sorts first.
    """
    if value is None:
        return (0,)
    if isinstance(value, numbers.Real):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    if isinstance(value, bytes):
        return (3, value)
    if isinstance(value, tuple):
        return (4, tuple(_value_key(v) for v in value))
    if isinstance(value, frozenset):  # its iteration order follows the hash seed: sort it
        return (5, tuple(sorted(_value_key(v) for v in value)))
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (6, kind, tuple(_value_key(getattr(value, f.name)) for f in dataclasses.fields(value)))
    return (7, kind, repr(value))


class LoRAMemoryPool:
    """Fixed LoRA slots (data plane) plus the maps, policy, tiers and log that decide their contents.

    Attributes (contract shared with chapter 06):
        A_buffer: module -> per layer [num_slots, stack_num * max_lora_rank, in_features], dtype.
        B_buffer: module -> per layer [num_slots, out_total, max_lora_rank], dtype.
        lora_ranks: [num_slots] int32, 0 for the base model and empty slots.
        scalings: [num_slots] float32, 0 for the base model and empty slots.
        lora_ranks_host, scalings_host: host lists mirroring lora_ranks / scalings, written at the
            same place (``_write_slot``), so a batch builder reads them without a device read
            (``batch_info_from_requests``, chapter 07).
        uid_to_buffer_id: uid -> slot, for resident uids only.
        buffer_id_to_uid: slot -> uid, EMPTY_SLOT when free.
        events: the event log (see the module docstring).
    """

    def __init__(self, modules: Sequence[ModuleSpec], num_layers: int, max_loras_per_batch: int,
                 max_lora_rank: int, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu",
                 eviction_policy: Union[str, EvictionPolicy] = "lru", *,
                 adapter_source: Optional[Callable[[Hashable], LoRAAdapter]] = None,
                 max_loaded_loras: Optional[int] = None) -> None:
        """Allocate every buffer once, zero-filled; all slots start EMPTY_SLOT.

        Args:
            adapter_source: uid -> LoRAAdapter, the "disk" tier (e.g. ``AdapterRegistry.load``).
            max_loaded_loras: CPU-cache capacity in host copies; None = unbounded.
        Raises:
            ValueError: no or duplicate modules, sizes < 1, max_loaded_loras < max_loras_per_batch,
            an unknown policy name.
        """
        self._check_config(modules, num_layers, max_loras_per_batch, max_lora_rank, max_loaded_loras)
        self.modules = {m.name: m for m in modules}
        self.num_layers, self.max_loras_per_batch = num_layers, max_loras_per_batch
        self.max_lora_rank, self.dtype, self.device = max_lora_rank, dtype, torch.device(device)
        self.eviction_policy = (get_eviction_policy(eviction_policy)
                                if isinstance(eviction_policy, str) else eviction_policy)
        self.adapter_source, self.max_loaded_loras = adapter_source, max_loaded_loras
        self._allocate_buffers()
        self.uid_to_buffer_id: dict = {}
        self.buffer_id_to_uid: list = [EMPTY_SLOT] * max_loras_per_batch
        self.pinned: set = set()
        self.cpu_cache: OrderedDict = OrderedDict()  # uid -> LoRAAdapter, least recently used first
        self.events: list = []

    @staticmethod
    def _check_config(modules, num_layers, max_loras_per_batch, max_lora_rank, max_loaded_loras) -> None:
        names = [m.name for m in modules]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"modules must be non-empty with unique names, got {names}")
        for label, n in [("num_layers", num_layers), ("max_loras_per_batch", max_loras_per_batch),
                         ("max_lora_rank", max_lora_rank)]:
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{label} must be a positive int, got {n!r}")
        if max_loaded_loras is not None and max_loaded_loras < max_loras_per_batch:
            raise ValueError(f"max_loaded_loras ({max_loaded_loras}) must be >= max_loras_per_batch "
                             f"({max_loras_per_batch}): every adapter on the GPU keeps a host copy")

    def _allocate_buffers(self) -> None:
        s, kw = self.max_loras_per_batch, dict(dtype=self.dtype, device=self.device)
        shapes = {m.name: self._buffer_shapes(m) for m in self.modules.values()}
        self.A_buffer = {n: [torch.zeros(a, **kw) for _ in range(self.num_layers)] for n, (a, _) in shapes.items()}
        self.B_buffer = {n: [torch.zeros(b, **kw) for _ in range(self.num_layers)] for n, (_, b) in shapes.items()}
        self.lora_ranks = torch.zeros(s, dtype=torch.int32, device=self.device)
        self.scalings = torch.zeros(s, dtype=torch.float32, device=self.device)
        self.lora_ranks_host: list[int] = [0] * s  # mirrors of the two tensors: no device read needed
        self.scalings_host: list[float] = [0.0] * s

    def _buffer_shapes(self, spec: ModuleSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's (A, B) buffers of ``spec``; a sharded pool (chapter 10) overrides it."""
        s, r = self.max_loras_per_batch, self.max_lora_rank
        return (s, spec.stack_num * r, spec.in_features), (s, spec.out_total, r)

    @property
    def num_slots(self) -> int:
        return self.max_loras_per_batch

    # ---- validation and the data plane -------------------------------------------------------
    def validate(self, adapter: LoRAAdapter) -> None:
        """Check an adapter against the pool's fixed modules, layers and max rank; never mutates.

        NaN or inf values are allowed (they are data, not layout). A and B may be of any floating
        dtype: loading casts them to the pool's dtype (the model's dtype, which ``wrap_llama``
        checks), as a checkpoint saved in fp32 is served in bf16.
        Raises:
            ValueError: not a LoRAAdapter; uid None or EMPTY_SLOT; rank not an int in
            [1, max_lora_rank]; a non-numeric scaling; a key that is not (layer, module) with a known
            module and 0 <= layer < num_layers; A or B not floating tensors of the expected shapes.
        """
        if not isinstance(adapter, LoRAAdapter):
            raise ValueError(f"expected a LoRAAdapter, got {type(adapter).__name__}")
        if adapter.uid is None or adapter.uid is EMPTY_SLOT:
            raise ValueError(f"adapter uid must not be {adapter.uid!r}: None is the base model")
        rank = adapter.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= self.max_lora_rank:
            raise ValueError(f"adapter {adapter.uid!r}: rank {rank!r} outside 1..max_lora_rank "
                             f"({self.max_lora_rank}), fixed when the pool was created")
        if isinstance(adapter.scaling, bool) or not isinstance(adapter.scaling, (int, float)):
            raise ValueError(f"adapter {adapter.uid!r}: scaling must be a number, got {adapter.scaling!r}")
        if not isinstance(adapter.weights, dict):
            raise ValueError(f"adapter {adapter.uid!r}: weights must be a dict, got "
                             f"{type(adapter.weights).__name__}")
        for key, pair in adapter.weights.items():
            self._check_weight(adapter.uid, rank, key, pair)

    def _check_weight(self, uid: Hashable, rank: int, key, pair) -> None:
        layer, name = key if isinstance(key, tuple) and len(key) == 2 else (None, None)
        if name not in self.modules:
            raise ValueError(f"adapter {uid!r}: weight key {key!r} is not (layer, module) with a target "
                             f"module of the pool {sorted(self.modules)}")
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"adapter {uid!r}: layer index {layer!r} of {name} outside "
                             f"0..{self.num_layers - 1}")
        spec = self.modules[name]
        expected = ((spec.stack_num * rank, spec.in_features), (spec.out_total, rank))
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"adapter {uid!r}: weights[{key!r}] must be a pair (A, B)")
        for label, t, shape in zip("AB", pair, expected):
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"adapter {uid!r}: {label} of {key!r} must be a floating tensor")
            if tuple(t.shape) != shape:
                raise ValueError(f"adapter {uid!r}: {label} of {key!r} has shape {tuple(t.shape)}, "
                                 f"expected {shape} (rank {rank})")

    def load_to_slot(self, adapter: Optional[LoRAAdapter], slot: int) -> None:
        """Write ``adapter`` (None = the base model) into ``slot`` and make it the slot's owner.

        Semantics (all checks happen before any write):
            for every module m, layer l: A_buffer[m][l][slot] = 0; B_buffer[m][l][slot] = 0
            for (l, m), (A, B) in adapter.weights: A_buffer[m][l][slot, :A.shape[0]] = A
                                                   B_buffer[m][l][slot, :, :r] = B
            lora_ranks[slot] = r (0 for base); scalings[slot] = scaling (0 for base)
        (A and B are cast to the pool's dtype and device by the copy.)
        The slot's previous owner is dropped from the maps and the policy (no event: events record
        prepare_lora_batch's decisions); the new uid is marked used.
        Raises:
            ValueError: slot out of range; an invalid adapter (see ``validate``); the uid already
            resident in another slot; the slot held a pinned adapter.
        """
        self._check_slot_write(adapter, slot)
        uid = None if adapter is None else adapter.uid
        self._write_slot(adapter, slot)
        old = self.buffer_id_to_uid[slot]
        if old is not EMPTY_SLOT:
            del self.uid_to_buffer_id[old]
            self.eviction_policy.remove(old)
        self.uid_to_buffer_id[uid], self.buffer_id_to_uid[slot] = slot, uid
        self.eviction_policy.mark_used(uid)

    def _check_slot_write(self, adapter: Optional[LoRAAdapter], slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} outside 0..{self.num_slots - 1}")
        if adapter is not None:
            self.validate(adapter)
        uid = None if adapter is None else adapter.uid
        if self.uid_to_buffer_id.get(uid, slot) != slot:
            raise ValueError(f"{uid!r} is already resident in slot {self.uid_to_buffer_id[uid]}")
        old = self.buffer_id_to_uid[slot]
        if old is not EMPTY_SLOT and old != uid and old in self.pinned:
            raise ValueError(f"slot {slot} holds pinned {old!r}; unpin it before overwriting")

    def _write_slot(self, adapter: Optional[LoRAAdapter], slot: int) -> None:
        for name in self.modules:  # zero-fill everything first: nothing of the old owner survives
            for layer in range(self.num_layers):
                self.A_buffer[name][layer][slot].zero_()
                self.B_buffer[name][layer][slot].zero_()
        rank = 0 if adapter is None else adapter.rank
        for (layer, name), (a, b) in ({} if adapter is None else adapter.weights).items():
            self.A_buffer[name][layer][slot, : a.shape[0]].copy_(a)
            self.B_buffer[name][layer][slot, :, :rank].copy_(b)
        scaling = 0.0 if adapter is None else float(adapter.scaling)
        self.lora_ranks[slot], self.scalings[slot] = rank, scaling
        self.lora_ranks_host[slot], self.scalings_host[slot] = rank, scaling

    # ---- pinning and admission ---------------------------------------------------------------
    def pin(self, uid: Hashable) -> None:
        """Never evict ``uid`` once resident (idempotent). One slot always stays unpinned.

        Raises:
            ValueError: uid is EMPTY_SLOT, or pinning it would leave no slot for other adapters.
        """
        if uid is EMPTY_SLOT:
            raise ValueError("EMPTY_SLOT is not a uid and cannot be pinned")
        if uid not in self.pinned and len(self.pinned) + 1 >= self.num_slots:
            raise ValueError(f"cannot pin {uid!r}: {len(self.pinned)} of {self.num_slots} slots are "
                             f"pinned and at least one must stay evictable")
        self.pinned.add(uid)

    def unpin(self, uid: Hashable) -> None:
        """Make ``uid`` evictable again. Raises ValueError if it is not pinned."""
        if uid not in self.pinned:
            raise ValueError(f"{uid!r} is not pinned")
        self.pinned.remove(uid)

    def _blocked(self, needed: set) -> set:
        """Pinned residents outside ``needed``: slots this batch can neither use nor free."""
        return {u for u in self.pinned if u in self.uid_to_buffer_id and u not in needed}

    def admit(self, request_uids: Sequence[Hashable], running_uids: Iterable[Hashable] = ()
              ) -> tuple[list[int], list[int]]:
        """Admission under the slot cap, in arrival order (SGLang's scheduler skips and continues).

        A request is admitted when the distinct uids of running ∪ admitted-so-far ∪ itself, plus the
        pinned residents outside that set, still fit the slots; otherwise it is deferred, and later
        requests are still considered (so a hot adapter can keep a rare one waiting: SGLang can drain
        running adapters for a request waiting past a threshold). Example, 2 slots, nothing running: uids ["A", "B", None, "A"]
        -> admitted [0, 1, 3], deferred [2]. Pure: nothing is mutated.

        Returns:
            (admitted indices, deferred indices) into request_uids, both ascending.
        """
        chosen, admitted, deferred = set(running_uids), [], []
        for i, uid in enumerate(request_uids):
            trial = chosen | {uid}
            fits = len(trial) + len(self._blocked(trial)) <= self.num_slots
            (admitted if fits else deferred).append(i)
            chosen = trial if fits else chosen
        return admitted, deferred

    # ---- serving: make a batch's uids resident -----------------------------------------------
    def prepare_lora_batch(self, uids: Iterable[Hashable], running: Iterable[Hashable] = ()) -> dict:
        """Make every uid of ``uids`` ∪ ``running`` resident and return {uid: slot} for them.

        Uids are processed in ``uid_sort_key`` order. A resident uid is a hit; a missing one takes
        the lowest free slot, else the slot of a victim that the policy picks among residents outside
        uids ∪ running ∪ pinned (the base model only when nothing else can go). Its weights come from
        the CPU cache, else from ``adapter_source`` (then cached, dropping the least recently used
        host copy that is neither needed now nor resident after this call). Every needed uid is marked
        used, hits included. Events are appended to ``self.events``.

        Everything that can fail (capacity, unknown uid, invalid adapter) is checked before any
        mutation, so a ValueError leaves ``snapshot()`` unchanged.
        Raises:
            ValueError: EMPTY_SLOT among the uids; more distinct uids (base included) than slots, or
            than slots left by pinned residents; no adapter_source or an unknown uid; an invalid
            adapter (see ``validate``), or one whose uid differs from the uid asked for.
        """
        needed = set(uids) | set(running)
        self._check_capacity(needed)
        order = sorted(needed, key=uid_sort_key)
        misses = [u for u in order if u not in self.uid_to_buffer_id]
        placements = self._plan_slots(misses, needed)
        keep = (set(self.uid_to_buffer_id) - {v for _, v in placements}) | needed
        fetches, new_cache = self._plan_fetches(order, keep)
        for uid in order:
            if uid in self.uid_to_buffer_id:
                self.events.append(("hit", uid, self.uid_to_buffer_id[uid]))
                self.eviction_policy.mark_used(uid)
            else:
                self._apply_miss(uid, *placements.pop(0), *fetches.pop(0))
        self.cpu_cache = new_cache
        return {uid: self.uid_to_buffer_id[uid] for uid in order}

    def _check_capacity(self, needed: set) -> None:
        if EMPTY_SLOT in needed:
            raise ValueError("EMPTY_SLOT marks a free slot; it is not a uid a request can use")
        if len(needed) > self.num_slots:
            raise ValueError(f"batch needs {len(needed)} distinct adapters (base included) but the pool "
                             f"has {self.num_slots} slots")
        blocked = self._blocked(needed)
        if len(needed) + len(blocked) > self.num_slots:
            raise ValueError(f"batch needs {len(needed)} slots but {len(blocked)} of {self.num_slots} "
                             f"hold pinned adapters it does not use: {sorted(blocked, key=uid_sort_key)}")

    def _plan_slots(self, misses: list, needed: set) -> list[tuple[int, Hashable]]:
        """(slot, previous owner) per miss: lowest free slot (owner EMPTY_SLOT), else a victim's."""
        free = [s for s, u in enumerate(self.buffer_id_to_uid) if u is EMPTY_SLOT]
        candidates = {u for u in self.uid_to_buffer_id if u not in needed and u not in self.pinned}
        plan = []
        for _ in misses:
            if free:
                plan.append((free.pop(0), EMPTY_SLOT))
                continue
            victim = self.eviction_policy.select_victim(candidates)
            candidates.discard(victim)
            plan.append((self.uid_to_buffer_id[victim], victim))
        return plan

    def _plan_fetches(self, order: list, keep: set) -> tuple[list, OrderedDict]:
        """(adapter, tier, dropped host copies) per miss, and the CPU cache after this batch.

        Works on a copy of the cache, so nothing changes if a fetch or validation fails.
        """
        cache, fetches = OrderedDict(self.cpu_cache), []
        for uid in order:
            if uid is None or uid in self.uid_to_buffer_id:
                if uid in cache:
                    cache.move_to_end(uid)  # a hit refreshes the host copy too
                if uid not in self.uid_to_buffer_id:
                    fetches.append((None, "base", []))
                continue
            tier = "cpu" if uid in cache else "disk"
            adapter = cache[uid] if tier == "cpu" else self._fetch(uid)
            dropped = [] if tier == "cpu" else self._make_room(cache, keep)
            cache[uid] = adapter
            cache.move_to_end(uid)
            fetches.append((adapter, tier, dropped))
        return fetches, cache

    def _fetch(self, uid: Hashable) -> LoRAAdapter:
        """Read ``uid`` from the disk tier and validate it (no pool state is touched)."""
        if self.adapter_source is None:
            raise ValueError(f"{uid!r} is not resident and the pool has no adapter_source")
        try:
            adapter = self.adapter_source(uid)
        except KeyError:
            raise ValueError(f"unknown adapter uid {uid!r}: adapter_source has no such adapter") from None
        self.validate(adapter)
        if adapter.uid != uid:
            raise ValueError(f"adapter_source returned uid {adapter.uid!r} when asked for {uid!r}")
        return adapter

    def _make_room(self, cache: OrderedDict, keep: set) -> list:
        """Drop least recently used host copies outside ``keep`` until one more fits."""
        dropped = []
        while self.max_loaded_loras is not None and len(cache) >= self.max_loaded_loras:
            victim = next(u for u in cache if u not in keep)  # exists: |keep| <= slots <= capacity
            del cache[victim]
            dropped.append(victim)
        return dropped

    def _apply_miss(self, uid, slot: int, victim, adapter: Optional[LoRAAdapter], tier: str,
                    dropped: list) -> None:
        if victim is not EMPTY_SLOT:
            del self.uid_to_buffer_id[victim]
            self.buffer_id_to_uid[slot] = EMPTY_SLOT
            self.eviction_policy.remove(victim)
            self.events.append(("evict", victim, slot))
        self.events.extend(("cpu_evict", u) for u in dropped)
        self.load_to_slot(adapter, slot)
        self.events.append(("load", uid, slot, tier))

    def unload(self, uid: Hashable) -> None:
        """Forget ``uid`` everywhere in the pool: its host copy leaves the CPU tier and, if resident,
        its slot is zeroed and freed (a later request of it would load it again from
        ``adapter_source``). The caller makes sure no running request uses it. No-op for a uid the
        pool does not hold. Logs ("unload", uid, slot or None). vLLM ``LRUCacheWorkerLoRAManager.remove_adapter``.
        Raises:
            ValueError: uid is None (the base model is never unloaded) or pinned.
        """
        if uid is None or uid is EMPTY_SLOT:
            raise ValueError("the base model (None) and EMPTY_SLOT cannot be unloaded")
        if uid in self.pinned:
            raise ValueError(f"{uid!r} is pinned: unpin it first")
        slot = self.uid_to_buffer_id.get(uid)
        if slot is None and uid not in self.cpu_cache:
            return
        self.cpu_cache.pop(uid, None)
        if slot is not None:
            self._write_slot(None, slot)  # zeros, rank 0: nothing stale stays on the device
            del self.uid_to_buffer_id[uid]
            self.buffer_id_to_uid[slot] = EMPTY_SLOT
            self.eviction_policy.remove(uid)
        self.events.append(("unload", uid, slot))

    # ---- state for tests and graders ---------------------------------------------------------
    def snapshot(self) -> dict:
        """The full state, copied: buffers cloned, maps, policy order, pins, CPU cache order, events.

        Compare two snapshots with ``snapshot_diff`` (tensors bit for bit, so NaN equals NaN).
        """
        return {
            "A_buffer": {m: [t.clone() for t in ts] for m, ts in self.A_buffer.items()},
            "B_buffer": {m: [t.clone() for t in ts] for m, ts in self.B_buffer.items()},
            "lora_ranks": self.lora_ranks.clone(),
            "scalings": self.scalings.clone(),
            "uid_to_buffer_id": dict(self.uid_to_buffer_id),
            "buffer_id_to_uid": list(self.buffer_id_to_uid),
            "policy_order": self.eviction_policy.order(),
            "pinned": frozenset(self.pinned),
            "cpu_cache": tuple(self.cpu_cache),
            "events": list(self.events),
        }


def _tensors_identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (NaN == NaN, 0.0 != -0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def snapshot_diff(a, b, path: str = "") -> list[str]:
    """Paths where two snapshots (or any nests of dicts, lists, tuples, tensors) differ; [] if equal."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _tensors_identical(a, b)
        return [] if same else [path or "<root>"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [path or "<root>"]
        return [p for k in a for p in snapshot_diff(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return [path or "<root>"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in snapshot_diff(x, y, f"{path}[{i}]")]
    return [] if a == b else [path or "<root>"]


# ---- JSON with explicit tags (graders exchange event logs as data, never pickles) --------------
def uid_to_json(uid: Hashable):
    """None -> {"base": True}; EMPTY_SLOT -> {"empty": True}; a str or int uid as itself."""
    if uid is None:
        return {"base": True}
    if uid is EMPTY_SLOT:
        return {"empty": True}
    if isinstance(uid, bool) or not isinstance(uid, (str, int)):
        raise ValueError(f"only str and int uids round-trip through JSON, got {uid!r}")
    return uid


def uid_from_json(obj) -> Hashable:
    """Inverse of ``uid_to_json``. Raises ValueError on an unknown tag."""
    if isinstance(obj, dict):
        if obj == {"base": True}:
            return None
        if obj == {"empty": True}:
            return EMPTY_SLOT
        raise ValueError(f"unknown uid tag {obj!r}; expected {{'base': true}} or {{'empty': true}}")
    return obj


def events_to_json(events: Sequence[tuple]) -> list[list]:
    """Events as JSON-ready lists, uid tagged: ("load", None, 0, "base") -> ["load", {"base": true},
    0, "base"]."""
    return [[e[0], uid_to_json(e[1]), *e[2:]] for e in events]


def events_from_json(data: Sequence[list]) -> list[tuple]:
    """Inverse of ``events_to_json``: back to tuples with None / EMPTY_SLOT restored."""
    return [(e[0], uid_from_json(e[1]), *e[2:]) for e in data]


# ---- the adapter source: identity is a uid, not a display name ---------------------------------
class AdapterRegistry:
    """Display name -> current uid, and uid -> host adapter (the "disk" tier stand-in).

    Re-registering a name with different weights gives a new uid ``f"{name}@{n}"`` (n counts every
    version the registry created, so uids never repeat); the old uid still loads its old weights, so
    requests already running on it finish on the version they started with, and the pool can never
    serve one version's slot for the other. Re-registering identical weights keeps the current uid.
    A version stays until :meth:`forget` drops it (the engine does once no request uses it).
    Source: SGLang ``lora_registry.py`` (``LoRARef.lora_id`` vs ``lora_name``).
    """

    def __init__(self) -> None:
        self._current: dict[str, str] = {}  # name -> uid of its newest version
        self._adapters: dict[str, LoRAAdapter] = {}  # uid -> adapter (every version not forgotten)
        self._versions = 0  # versions ever created: uids never repeat, even after forget

    def register(self, name: str, rank: int, scaling: float, weights: dict) -> str:
        """Store a version of ``name`` and return its uid (the current one if nothing changed)."""
        uid = self._current.get(name)
        if uid is not None and _same_adapter(self._adapters[uid], rank, scaling, weights):
            return uid
        uid = f"{name}@{self._versions}"
        self._versions += 1
        self._adapters[uid] = LoRAAdapter(uid=uid, rank=rank, scaling=scaling, weights=dict(weights))
        self._current[name] = uid
        return uid

    def current(self, name: str) -> Optional[str]:
        """The current uid of ``name``, or None when no adapter has that name."""
        return self._current.get(name)

    def unregister(self, name: str) -> str:
        """Remove ``name`` (its uid keeps loading until :meth:`forget`); returns that uid.
        Raises ValueError for an unknown name."""
        uid = self.uid_of(name)
        del self._current[name]
        return uid

    def forget(self, uid: str) -> None:
        """Drop the host weights of ``uid``, a version no name points to any more (its later loads
        raise KeyError). Raises ValueError when a name still points to it."""
        if uid in self._current.values():
            raise ValueError(f"{uid!r} is the current version of a registered name: unregister it first")
        self._adapters.pop(uid, None)

    def num_versions(self) -> int:
        """How many versions hold host weights now (current ones and retired ones still in use)."""
        return len(self._adapters)

    def uid_of(self, name: str) -> str:
        """The current uid of ``name``. Raises ValueError for an unknown name."""
        if name not in self._current:
            raise ValueError(f"no adapter named {name!r}; registered: {sorted(self._current)}")
        return self._current[name]

    def load(self, uid: str) -> LoRAAdapter:
        """The adapter of ``uid`` (any version). Raises KeyError for an unknown uid."""
        return self._adapters[uid]

    def names(self) -> list[str]:
        """The registered display names, sorted."""
        return sorted(self._current)


def _same_adapter(old: LoRAAdapter, rank: int, scaling: float, weights: dict) -> bool:
    if (old.rank, old.weights.keys()) != (rank, weights.keys()):
        return False
    if not (old.scaling == scaling or (math.isnan(old.scaling) and math.isnan(scaling))):
        return False
    return all(_tensors_identical(x, y) for k in weights for x, y in zip(old.weights[k], weights[k]))
