"""The MoE LoRA pool: per-expert slot buffers beside the dense pool's, under ONE slot policy (chapter 09).

A routed-experts module (transformers' ``MixtralExperts`` / ``Qwen2MoeExperts``) has one LoRA pair
per (adapter, expert), so its buffers gain an expert axis (the contract of
:mod:`reference.moe.lora`)::

    moe_A_buffer[m][layer]     [num_slots, num_experts, stack_num * max_rank, in_features]
    moe_B_buffer[m][layer]     [num_slots, num_experts, out_total, max_rank]
    moe_lora_ranks[m][layer]   [num_slots, num_experts] int32   (0: no weights for this expert here)

with ``m`` an :class:`ExpertModuleSpec`: "gate_up_proj" (H -> (I, I), two slices, the halves placed
by ``GATE_UP_HALVES``) and "down_proj" (I -> (H,)). ``scalings`` stay per slot: the dense pool's.

Why a subclass of :class:`~reference.mem_pool.LoRAMemoryPool`: which adapter owns which slot is a
control-plane decision that must be the same for the dense and the expert buffers (a token's slot
indexes both). Re-implementing uid_to_buffer_id, EMPTY_SLOT, LRU, pinning, the CPU cache and
``prepare_lora_batch`` for the experts would be a second policy that can drift from the first. The
subclass changes only the three data-plane hooks every write already goes through:

    validate(adapter)          the dense checks, then every expert entry (never mutates)
    load_to_slot(adapter, s)   the dense write (which validates first), then the expert write:
                               zero-fill every expert buffer of slot s, ranks 0, then copy
    snapshot()                 the dense snapshot plus the expert buffers and ranks

``prepare_lora_batch`` validates fetched adapters through ``self.validate`` before any mutation and
writes through ``self.load_to_slot``, so evictions, reloads and the "validate before any write"
guarantee carry over unchanged: a malformed expert entry leaves ``snapshot()`` exactly as it was.

An adapter's experts live in :class:`MoELoRAAdapter.expert_weights`, keyed (layer, module, expert);
a missing key (a layer or an expert the adapter does not cover) is zeros AND rank 0, so the op
never reads it (:func:`~reference.moe.lora.moe_align_block_size` can skip it) and nothing of an
evicted adapter survives. A plain :class:`~reference.mem_pool.LoRAAdapter` loads with every expert at
rank 0. The base model (None) and empty slots are rank 0 everywhere, as in the dense pool.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence, Union

import torch

from reference.eviction import EvictionPolicy
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec

__all__ = ["ExpertModuleSpec", "MoELoRAAdapter", "MoELoRAMemoryPool"]


@dataclass(frozen=True)
class ExpertModuleSpec(ModuleSpec):
    """A routed-experts parameter of every MoE layer, e.g. ExpertModuleSpec("gate_up_proj", 64, (48, 48), 8).

    Its buffers are A [num_slots, num_experts, stack_num * max_rank, in_features] and
    B [num_slots, num_experts, out_total, max_rank]; ``slice_offsets`` are the op's.
    """

    num_experts: int  # the experts axis of the buffers

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.num_experts, bool) or not isinstance(self.num_experts, int) or self.num_experts < 1:
            raise ValueError(f"{self.name}: num_experts must be a positive int, got {self.num_experts!r}")


@dataclass
class MoELoRAAdapter(LoRAAdapter):
    """A :class:`LoRAAdapter` (dense weights, rank, scaling) plus its routed experts' weights.

    ``expert_weights[(layer, module, expert)] = (A [stack_num * r_e, in], B [out_total, r_e])``, the
    expert's own rank ``r_e = B.shape[1]`` (1..max_lora_rank); stacked part i is rows
    [i*r_e, (i+1)*r_e) of A and the rows of slice i of B. ``scaling`` applies to the experts too.
    """

    expert_weights: dict = field(default_factory=dict)  # (layer, module, expert) -> (A, B)


class MoELoRAMemoryPool(LoRAMemoryPool):
    """:class:`LoRAMemoryPool` plus per-expert buffers written whenever a slot is written.

    Attributes (beside the dense pool's):
        expert_modules: name -> ExpertModuleSpec.
        moe_A_buffer, moe_B_buffer: name -> per layer 4-D buffers (module docstring), dtype.
        moe_lora_ranks: name -> per layer [num_slots, num_experts] int32.
    A layer without a routed-experts module (Qwen2-MoE's ``mlp_only_layers``) keeps rank 0.
    """

    def __init__(self, modules: Sequence[ModuleSpec], num_layers: int, max_loras_per_batch: int,
                 max_lora_rank: int, dtype: torch.dtype = torch.float32,
                 device: Union[str, torch.device] = "cpu",
                 eviction_policy: Union[str, EvictionPolicy] = "lru", *,
                 expert_modules: Sequence[ExpertModuleSpec],
                 adapter_source: Optional[Callable[[Hashable], LoRAAdapter]] = None,
                 max_loaded_loras: Optional[int] = None) -> None:
        """The dense pool (``modules``: attention, a shared expert; at least one), then the expert
        buffers, zero-filled. Raises ValueError as the dense pool does, and for no, duplicate or
        non-ExpertModuleSpec expert modules."""
        names = [getattr(m, "name", None) for m in expert_modules]
        if not names or len(set(names)) != len(names) or not all(isinstance(m, ExpertModuleSpec)
                                                                 for m in expert_modules):
            raise ValueError(f"expert_modules must be non-empty ExpertModuleSpecs with unique names, got {names}")
        super().__init__(modules, num_layers, max_loras_per_batch, max_lora_rank, dtype, device,
                         eviction_policy, adapter_source=adapter_source, max_loaded_loras=max_loaded_loras)
        self.expert_modules = {m.name: m for m in expert_modules}
        s, r, kw = self.num_slots, self.max_lora_rank, dict(dtype=self.dtype, device=self.device)
        self.moe_A_buffer = {m.name: [torch.zeros(s, m.num_experts, m.stack_num * r, m.in_features, **kw)
                                      for _ in range(num_layers)] for m in expert_modules}
        self.moe_B_buffer = {m.name: [torch.zeros(s, m.num_experts, m.out_total, r, **kw)
                                      for _ in range(num_layers)] for m in expert_modules}
        self.moe_lora_ranks = {m.name: [torch.zeros(s, m.num_experts, dtype=torch.int32, device=self.device)
                                        for _ in range(num_layers)] for m in expert_modules}

    # ---- validation: the dense checks, then every expert entry --------------------------------
    def validate(self, adapter: LoRAAdapter) -> None:
        """:meth:`LoRAMemoryPool.validate`, then (for a MoELoRAAdapter) every expert entry; never mutates.

        Raises:
            ValueError: as the dense pool; expert_weights not a dict; a key that is not
            (layer, module, expert) with a known expert module, 0 <= layer < num_layers and
            0 <= expert < num_experts; a value that is not a pair of floating tensors
            A [stack_num * r_e, in], B [out_total, r_e] with 1 <= r_e <= max_lora_rank.
        """
        super().validate(adapter)
        experts = getattr(adapter, "expert_weights", {})
        if not isinstance(experts, dict):
            raise ValueError(f"adapter {adapter.uid!r}: expert_weights must be a dict, got {type(experts).__name__}")
        for key, pair in experts.items():
            self._check_expert_weight(adapter.uid, key, pair)

    def _check_expert_weight(self, uid: Hashable, key, pair) -> None:
        layer, name, expert = key if isinstance(key, tuple) and len(key) == 3 else (None, None, None)
        if name not in self.expert_modules:
            raise ValueError(f"adapter {uid!r}: expert weight key {key!r} is not (layer, module, expert) with "
                             f"an expert module of the pool {sorted(self.expert_modules)}")
        spec = self.expert_modules[name]
        for label, value, bound in (("layer", layer, self.num_layers), ("expert", expert, spec.num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < bound:
                raise ValueError(f"adapter {uid!r}: {label} index {value!r} of experts {name} outside 0..{bound - 1} "
                                 f"(key {key!r}): an adapter made for another model?")
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2
                and all(isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 for t in pair)):
            raise ValueError(f"adapter {uid!r}: expert_weights[{key!r}] must be a pair of 2-D floating tensors (A, B)")
        r = pair[1].shape[1]
        expected = ((spec.stack_num * r, spec.in_features), (spec.out_total, r))
        if not 1 <= r <= self.max_lora_rank or tuple(pair[0].shape) != expected[0] or tuple(pair[1].shape) != expected[1]:
            raise ValueError(f"adapter {uid!r}: experts {name} {key!r} has A {tuple(pair[0].shape)} and B "
                             f"{tuple(pair[1].shape)}, expected {expected[0]} and {expected[1]} with rank 1.."
                             f"{self.max_lora_rank}")

    # ---- the data plane: every slot write also writes the experts -----------------------------
    def load_to_slot(self, adapter: Optional[LoRAAdapter], slot: int) -> None:
        """:meth:`LoRAMemoryPool.load_to_slot` (checks everything, experts included, then writes the
        dense buffers and the maps), then the experts of ``slot``.

        Semantics (after the dense write; nothing here can fail):
            for every expert module m, layer l: moe_A[m][l][slot] = 0; moe_B[m][l][slot] = 0;
                                                moe_lora_ranks[m][l][slot] = 0
            for (l, m, e), (A, B) in adapter.expert_weights: moe_A[m][l][slot, e, :A.shape[0]] = A
                moe_B[m][l][slot, e, :, :r_e] = B;  moe_lora_ranks[m][l][slot, e] = r_e
        """
        super().load_to_slot(adapter, slot)
        for name in self.expert_modules:
            for layer in range(self.num_layers):
                self.moe_A_buffer[name][layer][slot].zero_()
                self.moe_B_buffer[name][layer][slot].zero_()
                self.moe_lora_ranks[name][layer][slot] = 0
        for (layer, name, expert), (a, b) in getattr(adapter, "expert_weights", {}).items():
            r = b.shape[1]
            self.moe_A_buffer[name][layer][slot, expert, : a.shape[0]].copy_(a)
            self.moe_B_buffer[name][layer][slot, expert, :, :r].copy_(b)
            self.moe_lora_ranks[name][layer][slot, expert] = r

    def snapshot(self) -> dict:
        """The dense snapshot plus ``moe_A_buffer``, ``moe_B_buffer`` and ``moe_lora_ranks``, cloned."""
        state = super().snapshot()
        for label in ("moe_A_buffer", "moe_B_buffer", "moe_lora_ranks"):
            state[label] = {m: [t.clone() for t in ts] for m, ts in getattr(self, label).items()}
        return state
