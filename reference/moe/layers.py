"""MoE LoRA in a Hugging Face model: routed experts with per-(adapter, expert) deltas (chapter 09).

:func:`wrap_moe_model` serves a ``MixtralForCausalLM`` or ``Qwen2MoeForCausalLM`` from a
:class:`~reference.moe.pool.MoELoRAMemoryPool`:
- every ``nn.Linear`` the dense pool serves (q/k/v/o; Qwen2-MoE's ``mlp.shared_expert`` gate/up/down,
  an ordinary MLP applied to every token: dense LoRA, stored apart from the routed experts) is wrapped
  by chapter 07's :func:`~reference.layers.wrap_llama`, which matches ``...layers.N.<proj>`` paths and
  so works on these models unchanged;
- every routed-experts module ``...layers.N.mlp.experts`` is replaced by a :class:`LoRAExperts`.

:class:`LoRAExperts` cannot call the base module's forward: the gate_up delta must be added BEFORE
the activation. It reads the base module's own parameters and activation and follows transformers'
eager loop (experts in ascending order, each expert's (token, choice) pairs in ``torch.where``
order, the routing weight multiplied after down_proj, ``index_add_`` into zeros), so a token whose
slot has rank 0 for its experts gets bit for bit what the base module gives with
``experts_implementation="eager"`` (the grouped_mm default differs from eager by rounding only).
Between the loops, the MoE LoRA op (:mod:`reference.moe.lora`) adds the deltas of all pairs at once:

    Semantics (x [T, H], top_k_index [T, k], w [T, k]; pair p = t*k + j, e = top_k_index[t, j]):
        h[p] = x[t] @ gate_up_proj[e].T                                   base, per pair
        op(x, A_gu, B_gu, h, ids, token_slots, ranks_gu, scalings, k, rows_per_pair=False,
           slice_offsets=(0, I, 2I))                                      h[p] += the gate_up delta
        a[p] = act(h[p, gate half]) * h[p, up half]                       halves from GATE_UP_HALVES
        y[p] = a[p] @ down_proj[e].T
        op(a, A_d, B_d, y, ids, token_slots, ranks_d, scalings, k, rows_per_pair=True)
        out[t] = sum_j w[t, j] * y[t*k + j]                               (topk_weights=None in the op)

The token -> slot map is the batch info's ``token_slots``, read from the same :class:`LoRAContext`
the dense layers read; the op is picked by name from :data:`MOE_LORA_OPS` ("torch": the reference
in :mod:`reference.moe.lora`; "triton": :func:`reference.moe.fused_moe_lora.fused_moe_lora`).

Sources: SGLang ``python/sglang/srt/lora/`` (MoE LoRA layers, virtual experts), vLLM
``vllm/lora/layers/fused_moe.py`` (the LoRA deltas of both GEMMs of a fused MoE); transformers
``integrations/moe.py`` and ``models/mixtral/modeling_mixtral.py`` (the eager experts loop).
"""
from __future__ import annotations

from typing import Callable, Mapping, Union

import torch
from torch import nn

from reference.moe import lora as moe_lora
from reference.adapters import layer_index
from reference.layers import LoRAContext, LoRALinear, unwrap_llama, wrap_llama
from reference.mem_pool import ModuleSpec
from reference.moe.lora import fused_moe_lora_torch
from reference.moe.pool import ExpertModuleSpec, MoELoRAMemoryPool

from reference.moe.fused_moe_lora import fused_moe_lora as _fused_moe_lora_triton

__all__ = ["MOE_LORA_OPS", "get_moe_op", "moe_module_specs", "LoRAExperts", "wrap_moe_model", "unwrap_moe_model"]

#: Backend name -> the MoE LoRA op (the signature of :func:`reference.moe.lora.fused_moe_lora_torch`).
MOE_LORA_OPS: Mapping[str, Callable] = {"torch": fused_moe_lora_torch, "triton": _fused_moe_lora_triton}


def get_moe_op(backend: Union[str, Callable]) -> Callable:
    """The MoE LoRA op of ``backend`` (a name of MOE_LORA_OPS, or an op itself).

    Raises:
        ValueError: an unknown name.
    """
    if callable(backend):
        return backend
    if backend not in MOE_LORA_OPS:
        raise ValueError(f"unknown MoE LoRA backend {backend!r}: use one of {sorted(MOE_LORA_OPS)} or an op")
    return MOE_LORA_OPS[backend]


def moe_module_specs(config, shared_expert: bool = True) -> tuple[tuple[ModuleSpec, ...], tuple[ExpertModuleSpec, ...]]:
    """(dense pool modules, expert modules) of a Mixtral or Qwen2-MoE config.

    Dense: qkv_proj (H -> (q, kv, kv)), o_proj; with a Qwen2-MoE shared expert (and ``shared_expert``)
    also gate_up_proj (H -> (Is, Is)) and down_proj (Is -> H) for it. Experts: gate_up_proj
    (H -> (I, I), E experts) and down_proj (I -> (H,)), with I = ``moe_intermediate_size`` (Qwen2-MoE)
    or ``intermediate_size`` (Mixtral), E = ``num_local_experts`` or ``num_experts``.
    Example: Mixtral hidden 64, 4 heads / 2 kv heads, I 48, 4 experts ->
        (qkv_proj 64 -> (64, 32, 32), o_proj 64 -> (64,)), (gate_up_proj 64 -> (48, 48) x4, down_proj 48 -> (64,) x4)
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, config.num_key_value_heads * head_dim
    dense = [ModuleSpec("qkv_proj", hidden, (q, kv, kv)), ModuleSpec("o_proj", q, (hidden,))]
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    if shared_expert and shared:
        dense += [ModuleSpec("gate_up_proj", hidden, (shared, shared)), ModuleSpec("down_proj", shared, (hidden,))]
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    return tuple(dense), (ExpertModuleSpec("gate_up_proj", hidden, (inter, inter), experts),
                          ExpertModuleSpec("down_proj", inter, (hidden,), experts))


def _expert_groups(top_k_index: torch.Tensor, num_experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, pairs, tokens) in transformers' eager order: experts ascending, then (choice, token).

    Ids outside [0, num_experts) (transformers' expert-parallel sentinel ``num_experts``, or -1) are
    left out. Example, top_k_index [[1, 0], [0, 2]] (k=2; pair = token*2 + choice) ->
    [(0, pairs [2, 1], tokens [1, 0]), (1, [0], [0]), (2, [3], [1])]: expert 0 is choice 0 of token 1,
    then choice 1 of token 0.
    """
    k = top_k_index.shape[1]
    groups = []
    for e in torch.unique(top_k_index).tolist():
        if 0 <= e < num_experts:
            pos, tok = torch.where(top_k_index.T == e)  # [k, T]: by choice, then token (as one_hot.permute)
            groups.append((e, tok * k + pos, tok))
    return groups


class LoRAExperts(nn.Module):
    """A routed-experts module (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I],
    ``experts.act_fn``) plus the MoE LoRA deltas of a mixed batch (Semantics: module docstring).

    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, the base
    module's signature. A batch without an active adapter runs no LoRA op.
    Raises (at construction):
        ValueError: a base module without those parameters, sizes or expert count other than the
        pool's expert modules, another dtype or device than the pool, a layer out of range.
    """

    def __init__(self, base: nn.Module, pool: MoELoRAMemoryPool, layer: int, context: LoRAContext,
                 backend: Union[str, Callable] = "torch") -> None:
        super().__init__()
        gate_up, down = getattr(base, "gate_up_proj", None), getattr(base, "down_proj", None)
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor) or gate_up.dim() != 3:
            raise ValueError(f"layer {layer}: {type(base).__name__} has no 3-D gate_up_proj / down_proj parameters")
        if not {"gate_up_proj", "down_proj"} <= pool.expert_modules.keys() or not 0 <= layer < pool.num_layers:
            raise ValueError(f"layer {layer}: the pool must serve expert modules gate_up_proj and down_proj "
                             f"for layers 0..{pool.num_layers - 1}")
        gu, dn = pool.expert_modules["gate_up_proj"], pool.expert_modules["down_proj"]
        want = ((gu.num_experts, gu.out_total, gu.in_features), (dn.num_experts, dn.out_total, dn.in_features))
        if (tuple(gate_up.shape), tuple(down.shape)) != want or gu.out_features[0] != dn.in_features:
            raise ValueError(f"layer {layer}: experts are {list(gate_up.shape)} / {list(down.shape)}, the pool's "
                             f"expert modules want {list(want[0])} / {list(want[1])}")
        if gate_up.dtype != pool.dtype or gate_up.device != pool.lora_ranks.device:
            raise ValueError(f"layer {layer}: experts are {gate_up.dtype} on {gate_up.device}, the pool stores "
                             f"{pool.dtype} on {pool.lora_ranks.device}")
        self.base, self.pool, self.layer, self.context = base, pool, layer, context
        self.op = get_moe_op(backend)
        self.num_experts, self.intermediate = gu.num_experts, gu.out_features[0]

    def extra_repr(self) -> str:
        return f"layer={self.layer}, experts={self.num_experts}, op={getattr(self.op, '__name__', self.op)!r}"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        info = self.context.batch_info
        active = info.has_active_lora
        if active and (info.token_slots is None or info.token_slots.shape[0] != hidden_states.shape[0]):
            raise ValueError(f"layer {self.layer} experts: {hidden_states.shape[0]} tokens but the batch info's "
                             "token_slots do not cover them: set this forward's batch with context.set_batch")
        groups = _expert_groups(top_k_index, self.num_experts)
        ids = torch.where((top_k_index >= 0) & (top_k_index < self.num_experts), top_k_index,
                          torch.full_like(top_k_index, -1))  # the op's convention: -1 = not here
        num_pairs = top_k_index.numel()
        h = hidden_states.new_zeros(num_pairs, 2 * self.intermediate)
        for e, pairs, tok in groups:
            h[pairs] = nn.functional.linear(hidden_states[tok], self.base.gate_up_proj[e])
        if active:
            self._delta("gate_up_proj", hidden_states, h, ids, info, rows_per_pair=False)
        a = self._activate(h)
        y = hidden_states.new_zeros(num_pairs, hidden_states.shape[1])
        for e, pairs, tok in groups:
            y[pairs] = nn.functional.linear(a[pairs], self.base.down_proj[e])
        if active:
            self._delta("down_proj", a, y, ids, info, rows_per_pair=True)
        out = torch.zeros_like(hidden_states)
        k = top_k_index.shape[1]
        for e, pairs, tok in groups:
            weighted = y[pairs] * top_k_weights[tok, pairs - tok * k, None]
            out.index_add_(0, tok, weighted.to(out.dtype))
        return out

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, the halves where GATE_UP_HALVES puts them."""
        glo, ghi = moe_lora.gate_up_half("gate", self.intermediate)
        ulo, uhi = moe_lora.gate_up_half("up", self.intermediate)
        return self.base.act_fn(h[:, glo:ghi]) * h[:, ulo:uhi]

    def _delta(self, name: str, x: torch.Tensor, out: torch.Tensor, ids: torch.Tensor, info,
               rows_per_pair: bool) -> None:
        spec = self.pool.expert_modules[name]
        self.op(x, self.pool.moe_A_buffer[name][self.layer], self.pool.moe_B_buffer[name][self.layer], out, ids,
                info.token_slots, self.pool.moe_lora_ranks[name][self.layer], info.scalings, ids.shape[1],
                rows_per_pair, spec.slice_offsets)


def _experts_paths(model: nn.Module) -> list[tuple[str, int]]:
    """(path, layer) of every routed-experts module ``...layers.N.mlp.experts``."""
    return [(path, layer_index(path)) for path, mod in model.named_modules()
            if path.endswith(".mlp.experts") and layer_index(path) is not None
            and isinstance(getattr(mod, "gate_up_proj", None), torch.Tensor)]


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent), attr, new)


def wrap_moe_model(model: nn.Module, pool: MoELoRAMemoryPool, context: LoRAContext,
                   backend: str = "torch") -> nn.Module:
    """Wrap, in place, a Mixtral / Qwen2-MoE model: dense projections through :func:`wrap_llama`, routed
    experts through :class:`LoRAExperts`; ``backend`` names both the dense ops and the MoE op. Returns
    ``model``. Every LoRAExperts is built (and checked) before any module is replaced.

    Example: a 2-layer Mixtral, pool (qkv_proj, o_proj) + experts -> 8 LoRALinear and 2 LoRAExperts.
    Raises:
        ValueError: already wrapped; no routed-experts module; a mismatch (see LoRAExperts, LoRALinear).
    """
    if any(isinstance(m, (LoRAExperts, LoRALinear)) for m in model.modules()):
        raise ValueError("the model is already wrapped; unwrap_moe_model(model) first")
    paths = _experts_paths(model)
    if not paths:
        raise ValueError("no routed-experts module (...layers.N.mlp.experts with gate_up_proj) in the model")
    experts = [(path, LoRAExperts(model.get_submodule(path), pool, layer, context, backend)) for path, layer in paths]
    wrap_llama(model, pool, context, backend)
    for path, wrapper in experts:
        _replace(model, path, wrapper)
    return model


def unwrap_moe_model(model: nn.Module) -> nn.Module:
    """Put every wrapped layer's base module back (the original objects); returns ``model``."""
    for path in [p for p, m in model.named_modules() if isinstance(m, LoRAExperts)]:
        _replace(model, path, model.get_submodule(path).base)
    return unwrap_llama(model)
