"""A Llama forward over a static KV cache, built from a Hugging Face Llama's own modules: chapter 08.

Why our own forward: a CUDA graph freezes every pointer and shape it captures, so the decode step
must read and write tensors that exist before capture and never move. Hugging Face's cache grows
(``DynamicCache``) or keeps one position for the whole batch (``StaticCache``'s ``cache_position``),
while a serving batch mixes sequences of different lengths. This module keeps one cache row per
sequence, [layers, rows, max_len, kv_heads, head_dim], and takes per-token positions, so a decode
batch of any composition is one fixed-shape call. The model's modules are used as they are (its
embedding, norms, rotary embedding, MLP and every projection, which ``wrap_llama`` may have turned
into LoRA layers); only the attention's cache handling is ours. Chapter 11's engine replaces the
static rows with paged blocks.

Source: nano-vllm ``nanovllm/engine/model_runner.py`` (static decode inputs captured per batch-size
bucket) and vLLM / SGLang model runners; the math is Hugging Face's ``LlamaAttention``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["StaticKVLlama", "apply_rope", "static_kv_attention"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Hugging Face's ``apply_rotary_pos_emb``: x [B, T, heads, hd], cos/sin [B, T, 1, hd]."""
    return x * cos + _rotate_half(x) * sin


def static_kv_attention(
    q: torch.Tensor,  # [B, T, heads, hd], RoPE applied
    k: torch.Tensor,  # [B, T, kv_heads, hd], RoPE applied
    v: torch.Tensor,  # [B, T, kv_heads, hd]
    k_cache: torch.Tensor,  # [rows, max_len, kv_heads, hd], one layer's cache (written in place)
    v_cache: torch.Tensor,  # [rows, max_len, kv_heads, hd]
    positions: torch.Tensor,  # [B, T] int64
    cache_rows: torch.Tensor,  # [B] int64
) -> torch.Tensor:
    """Write k, v at ``cache[cache_rows[b], positions[b, t]]``, then causal attention over the row: [B, T, heads*hd].

    Semantics: out[b, t, h] = softmax(q[b, t, h] . K[row_b, p]^T / sqrt(hd) for p <= positions[b, t]) V[row_b, p],
    with query head h reading kv head h // (heads / kv_heads) (transformers' ``repeat_kv`` order).
    """
    B, T, heads, hd = q.shape
    kv_heads, max_len = k.shape[2], k_cache.shape[1]
    rows = cache_rows.view(B, 1).expand(B, T)
    k_cache.index_put_((rows, positions), k)
    v_cache.index_put_((rows, positions), v)
    keys = k_cache[cache_rows].transpose(1, 2)  # [B, kv_heads, max_len, hd]
    values = v_cache[cache_rows].transpose(1, 2)
    # a query sees its row's keys at positions <= its own (stale entries past a row's length never)
    visible = torch.arange(max_len, device=q.device).view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)
    # GQA without copying K and V per query head: the `groups` query heads that share a kv head
    # (heads kv * groups .. kv * groups + groups - 1, as transformers' repeat_kv orders them) become
    # extra query rows of that kv head. Same softmax per row; the cache is read once instead of once
    # per query head (at 64 sequences x 520 positions, 4 layers, the repeated copies were about 2 GB
    # of traffic per step).
    groups = heads // kv_heads
    qg = q.view(B, T, kv_heads, groups, hd).permute(0, 2, 3, 1, 4).reshape(B, kv_heads, groups * T, hd)
    mask = visible.expand(B, 1, T, max_len).repeat(1, 1, groups, 1)  # [B, 1, groups*T, max_len]
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
    out = out.view(B, kv_heads, groups, T, hd).permute(0, 3, 1, 2, 4)
    return out.reshape(B, T, heads * hd)


class StaticKVLlama(nn.Module):
    """Prefill and decode of a Hugging Face ``LlamaForCausalLM`` over a static, per-row KV cache.

    ``forward(input_ids [B, T] int64, positions [B, T] int64, cache_rows [B] int64)`` writes the
    keys and values of every token at ``cache[layer, cache_rows[b], positions[b, t]]`` and attends,
    for each query, to the keys of its row at positions <= its own (so stale entries past a row's
    length are never read); returns logits [B, T, vocab] in the model's dtype. A row's tokens must
    be written in order (prefill positions 0..T-1, then one decode position at a time).

    Shapes never depend on the values: a decode step with B rows and T = 1 has the same shapes every
    step, which is what a CUDA graph needs. Row ``max_rows`` (one past the last) is a scratch row that
    padding of a bucketed batch may point at, so padding never writes into a real sequence.

    Args:
        model: a ``transformers`` LlamaForCausalLM (wrapped by ``reference.layers.wrap_llama`` or not).
        max_rows: sequences the cache holds (plus the scratch row).
        max_len: positions per row.
    Raises:
        ValueError: max_rows or max_len < 1.
    """

    def __init__(self, model: nn.Module, max_rows: int, max_len: int) -> None:
        super().__init__()
        if max_rows < 1 or max_len < 1:
            raise ValueError(f"max_rows and max_len must be >= 1, got {max_rows}, {max_len}")
        self.model = model
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_rows, self.max_len = max_rows, max_len
        weight = model.get_input_embeddings().weight
        shape = (cfg.num_hidden_layers, max_rows + 1, max_len, self.num_kv_heads, self.head_dim)
        # allocated once: a graph captured over them keeps their addresses
        self.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    @property
    def scratch_row(self) -> int:
        """The cache row that padding rows of a bucketed batch use."""
        return self.max_rows

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache_rows: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        B, T = input_ids.shape
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, positions)  # [B, T, head_dim]
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # broadcast over heads ([B, T, heads, hd])
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = apply_rope(attn.q_proj(x).view(B, T, self.num_heads, self.head_dim), cos, sin)
            k = apply_rope(attn.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
            out = static_kv_attention(q, k, v, self.k_cache[i], self.v_cache[i], positions, cache_rows)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h))
