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

__all__ = ["StaticKVLlama"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


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
        rows = cache_rows.view(B, 1).expand(B, T)
        key_pos = torch.arange(self.max_len, device=h.device)
        # [B, 1, T, max_len]: a query sees its row's keys at positions <= its own
        visible = (key_pos.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1))
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, T, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.k_cache[i].index_put_((rows, positions), k)
            self.v_cache[i].index_put_((rows, positions), v)
            keys = self.k_cache[i][cache_rows].transpose(1, 2)  # [B, kv_heads, max_len, hd]
            values = self.v_cache[i][cache_rows].transpose(1, 2)
            # GQA without copying K and V per query head: the `groups` query heads that share a kv
            # head (heads kv * groups .. kv * groups + groups - 1, as transformers' repeat_kv orders
            # them) become extra query rows of that kv head. Same softmax per row; the cache is read
            # once instead of once per query head (at 64 sequences x 520 positions, 4 layers, the
            # repeated copies were about 2 GB of traffic per step).
            groups = self.num_heads // self.num_kv_heads
            qg = q.view(B, T, self.num_kv_heads, groups, self.head_dim).permute(0, 2, 3, 1, 4)
            qg = qg.reshape(B, self.num_kv_heads, groups * T, self.head_dim)
            mask = visible.expand(B, 1, T, self.max_len).repeat(1, 1, groups, 1)  # [B, 1, groups*T, max_len]
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
            out = out.view(B, self.num_kv_heads, groups, T, self.head_dim).permute(0, 3, 1, 2, 4)
            h = h + attn.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h))
