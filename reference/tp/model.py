"""A tensor-parallel Llama forward per rank, with multi-LoRA on every projection (chapter 10).

Each rank holds (Megatron-LM's split, as vLLM's ``LlamaForCausalLM`` and SGLang's ``llama.py`` do):
    qkv_proj, gate_up_proj   column-parallel: its q heads, its kv heads (replicated when there are
                             fewer kv heads than ranks), its intermediate columns of gate and of up
    o_proj, down_proj        row-parallel: the input columns of its heads / its intermediate
                             columns; the partial outputs are all-reduced (two per layer)
    embeddings, norms, lm_head, RoPE   replicated (lm_head is small at these sizes; vLLM splits it
                             by vocabulary and gathers the logits)
so attention runs over the rank's own heads with a KV cache of its own kv heads, and the MLP over
its own intermediate columns, with no communication inside either. The LoRA deltas ride the same
split through :func:`~reference.tp.lora.tp_lora_linear` with the buffers of a
:class:`~reference.tp.pool.TPLoRAMemoryPool` (its modules the fused qkv_proj / o_proj /
gate_up_proj / down_proj; a module the pool lacks runs its base shard only), in the variants the
pool was built with. Every rank returns the full logits.

The base weights come from a :class:`LlamaCheckpoint`, the tensors of a Hugging Face
``LlamaForCausalLM`` (:func:`llama_checkpoint`), not from the model object: a rank loads only its
shard of a checkpoint (vLLM's ``weight_loader`` per parameter), and rank processes need not import
transformers. The cache is StaticKVLlama's (chapter 08): one row per sequence and per-token
positions, so prefill and decode are the same call; its attention is
:func:`~reference.static_llama.static_kv_attention`, run on the rank's heads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.batch_info import LoRABatchInfo, batch_info_from_requests
from reference.layers import LoRABackend
from reference.mem_pool import ModuleSpec
from reference.static_llama import apply_rope, static_kv_attention
from reference.tp.lora import TPLayout, shard_base_weight, tp_lora_linear
from reference.tp.pool import TPLoRAMemoryPool

__all__ = ["LlamaCheckpoint", "llama_checkpoint", "llama_pool_modules", "llama_tp_layouts", "TPLlama",
           "prepare_batch", "greedy_generate"]

_PROJECTIONS = {"qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o_proj": ("self_attn", ("o_proj",)),
                "gate_up_proj": ("mlp", ("gate_proj", "up_proj")), "down_proj": ("mlp", ("down_proj",))}


@dataclass(frozen=True)
class LlamaCheckpoint:
    """The sizes and tensors of a Llama, keyed by Hugging Face's parameter names.

    ``weights`` holds every parameter (``model.layers.{i}.self_attn.q_proj.weight`` [heads*hd, hidden],
    ..., ``model.norm.weight``, ``lm_head.weight`` [vocab, hidden]) and ``model.rotary_emb.inv_freq``
    [head_dim / 2] float32 (a buffer Hugging Face does not save: it carries the RoPE type's scaling).
    """

    hidden: int
    intermediate: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    attention_scaling: float  # RoPE's factor on cos and sin (1.0 for the default RoPE)
    weights: dict


def llama_checkpoint(model) -> LlamaCheckpoint:
    """The :class:`LlamaCheckpoint` of a Hugging Face ``LlamaForCausalLM`` (tensors detached and cloned).

    Raises:
        ValueError: an activation other than SiLU, attention or MLP biases, or a RoPE whose
        frequencies change with the sequence length (dynamic, longrope): what this forward omits.
    """
    cfg, rotary = model.config, model.model.rotary_emb
    refused = {"hidden_act": cfg.hidden_act != "silu", "attention_bias": getattr(cfg, "attention_bias", False),
               "mlp_bias": getattr(cfg, "mlp_bias", False),
               "rope_type": any(t in rotary.rope_type for t in ("dynamic", "longrope"))}
    if any(refused.values()):
        raise ValueError(f"the TP forward serves SiLU MLPs without biases and a fixed RoPE; this model has "
                         f"{ {k: getattr(cfg, k, rotary.rope_type) for k, bad in refused.items() if bad} }")
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights["lm_head.weight"] = model.lm_head.weight.detach().clone()  # tied or not
    weights["model.rotary_emb.inv_freq"] = rotary.inv_freq.detach().float().clone()
    heads = cfg.num_attention_heads
    return LlamaCheckpoint(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, heads,
                           getattr(cfg, "num_key_value_heads", None) or heads,
                           getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, cfg.vocab_size,
                           cfg.rms_norm_eps, float(rotary.attention_scaling), weights)


def llama_pool_modules(ckpt: LlamaCheckpoint) -> tuple[ModuleSpec, ...]:
    """The fused pool modules: qkv_proj (q, kv, kv), o_proj, gate_up_proj (I, I), down_proj."""
    q, kv = ckpt.num_heads * ckpt.head_dim, ckpt.num_kv_heads * ckpt.head_dim
    return (ModuleSpec("qkv_proj", ckpt.hidden, (q, kv, kv)), ModuleSpec("o_proj", q, (ckpt.hidden,)),
            ModuleSpec("gate_up_proj", ckpt.hidden, (ckpt.intermediate, ckpt.intermediate)),
            ModuleSpec("down_proj", ckpt.intermediate, (ckpt.hidden,)))


def llama_tp_layouts(ckpt: LlamaCheckpoint, tp_size: int) -> tuple[TPLayout, ...]:
    """The TP split of each pool module (qkv by heads, gate_up by columns; o, down row-parallel).

    Raises ValueError if the q heads or the intermediate size do not divide by tp_size, or the kv
    heads neither divide by tp_size nor divide it (o_proj's input split must be the q heads' split,
    so q heads are never replicated).
    """
    if ckpt.num_heads % tp_size:
        raise ValueError(f"{ckpt.num_heads} attention heads cannot be split over {tp_size} ranks")
    qkv, o, gate_up, down = llama_pool_modules(ckpt)
    units = (ckpt.num_heads, ckpt.num_kv_heads, ckpt.num_kv_heads)
    return (TPLayout(qkv, "column", tp_size, units), TPLayout(o, "row", tp_size),
            TPLayout(gate_up, "column", tp_size), TPLayout(down, "row", tp_size))


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: normalized in fp32, cast back, then scaled."""
    h32 = h.float()
    return weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


class TPLlama:
    """One rank's forward of a tensor-parallel Llama with multi-LoRA, over a static per-row KV cache.

    ``forward(input_ids [B, T] int64, positions [B, T] int64, cache_rows [B] int64, batch_info)``
    (the three index tensors on any device: they are moved to the pool's):
    as :class:`~reference.static_llama.StaticKVLlama` (keys and values of every token written at
    ``cache[layer, cache_rows[b], positions[b, t]]``, causal attention over the row), with the LoRA
    deltas of ``batch_info``, which covers the B*T tokens row-major (req_lens all T for a padded
    prefill, all 1 for a decode step) and must be the same on every rank. Returns the full logits
    [B, T, vocab] on every rank (bit-identical across ranks: each all-reduce gives every rank the
    same sum). Collective: every rank of the pool's group calls it with the same batch.

    Per rank, on the pool's device: ``base[layer][module]`` the base shards (``shard_base_weight``),
    ``replicated`` the embeddings, norms, lm_head and RoPE frequencies, and k_cache, v_cache
    [layers, max_rows + 1, max_len, local kv heads, head_dim] (row ``max_rows`` is a scratch row, as
    in StaticKVLlama; a replicated kv head is cached on each rank that holds it). A process group is
    needed even at tp_size 1 (the row variants all-reduce through it).
    Raises (at construction):
        ValueError: the pool's layouts, layers or dtype differ from the checkpoint's split; sizes
        that do not split (:func:`llama_tp_layouts`); max_rows or max_len < 1.
    Raises (forward): ValueError when batch_info covers another number of tokens than B*T.
    """

    def __init__(self, ckpt: LlamaCheckpoint, pool: TPLoRAMemoryPool, max_rows: int, max_len: int,
                 backend: Union[str, LoRABackend] = "torch") -> None:
        if max_rows < 1 or max_len < 1:
            raise ValueError(f"max_rows and max_len must be >= 1, got {max_rows}, {max_len}")
        self.layouts = {layout.spec.name: layout for layout in llama_tp_layouts(ckpt, pool.tp_size)}
        self._check_pool(ckpt, pool)
        self.ckpt, self.pool, self.backend, j, device = ckpt, pool, backend, pool.tp_rank, pool.device
        w = ckpt.weights
        self.base = [{name: shard_base_weight(self._packed(w, i, name), self.layouts[name], j).to(device)
                      for name in _PROJECTIONS} for i in range(ckpt.num_layers)]
        self.replicated = {k: v.to(device) for k, v in w.items() if "_proj." not in k}  # embeddings, norms, ...
        self.widths = {name: self.layouts[name].local_out_features(j) for name in ("qkv_proj", "gate_up_proj")}
        kv_local = self.widths["qkv_proj"][1] // ckpt.head_dim  # 1 when the kv heads are replicated
        shape = (ckpt.num_layers, max_rows + 1, max_len, kv_local, ckpt.head_dim)
        kw = dict(dtype=w["model.embed_tokens.weight"].dtype, device=device)
        self.k_cache, self.v_cache = torch.zeros(shape, **kw), torch.zeros(shape, **kw)

    @staticmethod
    def _packed(w: dict, layer: int, name: str) -> torch.Tensor:
        """The unsharded packed weight [out_total, in] of a pool module (q; k; v or gate; up)."""
        block, parts = _PROJECTIONS[name]
        return torch.cat([w[f"model.layers.{layer}.{block}.{p}.weight"] for p in parts])

    def _check_pool(self, ckpt: LlamaCheckpoint, pool: TPLoRAMemoryPool) -> None:
        wrong = [n for n, layout in pool.layouts.items() if self.layouts.get(n) != layout]
        dtype = ckpt.weights["model.embed_tokens.weight"].dtype
        if wrong or pool.num_layers != ckpt.num_layers or pool.dtype != dtype:
            raise ValueError(f"the pool does not fit this checkpoint: modules {wrong} (expected the layouts "
                             f"{list(self.layouts.values())}), {pool.num_layers} layers (model {ckpt.num_layers}), "
                             f"dtype {pool.dtype} (model {dtype})")

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, head_dim], as Hugging Face's LlamaRotaryEmbedding computes them."""
        freqs = positions[..., None].float() * self.replicated["model.rotary_emb.inv_freq"]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.ckpt.attention_scaling
        return (emb.cos() * scale).to(dtype).unsqueeze(2), (emb.sin() * scale).to(dtype).unsqueeze(2)

    def _linear(self, name: str, layer: int, x: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        """The rank's base shard of ``name`` plus its LoRA shard, with the module's collectives."""
        W = self.base[layer][name]

        def base(v: torch.Tensor) -> torch.Tensor:
            return v @ W.T

        if name in self.pool.layouts:
            return tp_lora_linear(x, base, self.pool.shard(name, layer), info, self.pool.group, self.backend)
        y = base(x)
        if self.layouts[name].parallel == "row" and self.pool.tp_size > 1:
            dist.all_reduce(y, group=self.pool.group)
        return y

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor,
                batch_info: LoRABatchInfo) -> torch.Tensor:
        c, w = self.ckpt, self.replicated
        device = self.pool.device
        input_ids, positions, cache_rows = input_ids.to(device), positions.to(device), cache_rows.to(device)
        B, T = input_ids.shape
        if batch_info.num_tokens != B * T:
            raise ValueError(f"input has {B * T} tokens ({B} x {T}) but the batch info covers {batch_info.num_tokens}")
        h = F.embedding(input_ids, w["model.embed_tokens.weight"])
        cos, sin = self._rope(positions, h.dtype)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            x = _rms_norm(h, w[p + "input_layernorm.weight"], c.rms_eps).view(B * T, c.hidden)
            q, k, v = self._linear("qkv_proj", i, x, batch_info).split(self.widths["qkv_proj"], dim=1)
            q = apply_rope(q.reshape(B, T, -1, c.head_dim), cos, sin)
            k = apply_rope(k.reshape(B, T, -1, c.head_dim), cos, sin)
            out = static_kv_attention(q, k, v.reshape(B, T, -1, c.head_dim), self.k_cache[i], self.v_cache[i],
                                      positions, cache_rows)
            h = h + self._linear("o_proj", i, out.view(B * T, -1), batch_info).view(B, T, c.hidden)
            x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], c.rms_eps).view(B * T, c.hidden)
            gate, up = self._linear("gate_up_proj", i, x, batch_info).split(self.widths["gate_up_proj"], dim=1)
            h = h + self._linear("down_proj", i, F.silu(gate) * up, batch_info).view(B, T, c.hidden)
        return _rms_norm(h, w["model.norm.weight"], c.rms_eps) @ w["lm_head.weight"].T

    __call__ = forward


def prepare_batch(pool, uids, lens, **kw) -> LoRABatchInfo:
    """``pool.prepare_lora_batch(uids)``, then the batch info of requests ``uids`` of lengths ``lens``
    (extra keywords to ``batch_info_from_requests``), built from host data on the pool's device: on
    every rank of a TP pool the same calls give the same slots (``TPLoRAMemoryPool``'s determinism)."""
    uid_to_slot = pool.prepare_lora_batch(uids)
    return batch_info_from_requests(uids, lens, uid_to_slot, pool.lora_ranks_host, pool.scalings_host, pool.device,
                                    **kw)


def greedy_generate(run, pool, uids, lens, ids: torch.Tensor, steps: int) -> dict:
    """Prefill the right-padded prompts ``ids`` [B, T] (batch info of req_lens all T), then ``steps``
    greedy decode steps of one token per row; ``prepare_lora_batch`` runs every step, as an engine's
    would (hits), and odd steps build the slot-sorted batch order.

    ``run(ids, positions, cache_rows, batch_info) -> logits`` (a :class:`TPLlama`, or a TP=1 model
    with the same call); ``lens`` are the prompts' real lengths (row b's next token is read at
    position ``lens[b] - 1``). Returns {"prefill": [B, T, V], "decode": [steps, B, V] (empty when
    steps is 0), "tokens": [steps + 1, B] int64 (token s predicted at position lens - 1 + s)}.
    """
    B, T = ids.shape
    rows, last_pos = torch.arange(B), torch.tensor(lens) - 1
    prefill = run(ids, torch.arange(T).expand(B, T), rows, prepare_batch(pool, uids, [T] * B))
    last, decode, tokens = prefill[rows, last_pos], [], []
    for s in range(steps + 1):
        tokens.append(last.argmax(-1))
        if s == steps:
            break
        info = prepare_batch(pool, uids, [1] * B, sort_by_slot=bool(s % 2))  # BGMV order, then slot-sorted
        last = run(tokens[-1][:, None], (last_pos + 1 + s)[:, None], rows, info)[:, 0]
        decode.append(last)
    return {"prefill": prefill, "decode": torch.stack(decode) if decode else torch.empty(0),
            "tokens": torch.stack(tokens)}
