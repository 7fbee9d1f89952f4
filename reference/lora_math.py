"""LoRA from first principles: the forward pass, merging, scaling, adapter size and FLOP share.

Source: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021) for the forward pass
and merging; Kalajdzievski, "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA" (2023)
for rsLoRA's alpha/sqrt(r); PEFT's ``LoraConfig`` for the names (``r``, ``lora_alpha``,
``use_rslora``, ``target_modules``).

Conventions (``torch.nn.Linear``): W [out, in], A [r, in], B [out, r], x [..., in].
"""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import torch

__all__ = [
    "LLAMA_PROJECTIONS",
    "LLAMA3_8B_CONFIG",
    "lora_forward",
    "merge_lora",
    "unmerge_lora",
    "lora_scaling",
    "projection_shapes",
    "adapter_num_params",
    "adapter_num_bytes",
    "lora_flop_share",
    "padded_flop_waste",
]

#: The seven linear projections of a Llama decoder layer, in PEFT's module names.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: The fields of Meta-Llama-3-8B's ``config.json`` that fix its projection shapes.
LLAMA3_8B_CONFIG = {
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
}


def lora_forward(
    x: torch.Tensor,  # [..., in]
    W: torch.Tensor,  # [out, in]
    A: torch.Tensor,  # [r, in]
    B: torch.Tensor,  # [out, r]
    scaling: float,
) -> torch.Tensor:  # [..., out], x.dtype
    """Unmerged LoRA forward of one linear layer.

    Semantics:
        y = x @ W.T + scaling * (x @ A.T) @ B.T

    The base GEMM and the low-rank path are separate: the base weight is never modified, so a batch
    can mix adapters (chapter 02). Computed in x.dtype.
    """
    return x @ W.T + scaling * ((x @ A.T) @ B.T)


def merge_lora(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Return the merged weight ``W + scaling * B @ A`` ([out, in], W.dtype); W is not modified.

    A merged layer runs at exactly the base model's cost but serves one adapter per weight copy.
    The product is formed in fp32 (or the weight's own wider dtype) and rounded once, so merging in bf16 loses as little as it can.
    """
    acc = torch.promote_types(W.dtype, torch.float32)
    delta = scaling * (B.to(acc) @ A.to(acc))
    return (W.to(acc) + delta).to(W.dtype)


def unmerge_lora(W_merged: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """Inverse of :func:`merge_lora`: ``W_merged - scaling * B @ A`` ([out, in], W_merged.dtype).

    Exact in fp32 up to rounding; in bf16 merge-then-unmerge does not give back W bit for bit,
    which is one reason servers keep the base weights untouched and apply LoRA unmerged.
    """
    acc = torch.promote_types(W_merged.dtype, torch.float32)
    delta = scaling * (B.to(acc) @ A.to(acc))
    return (W_merged.to(acc) - delta).to(W_merged.dtype)


def lora_scaling(lora_alpha: float, r: int, use_rslora: bool) -> float:
    """The factor s that multiplies the low-rank product.

    ``lora_alpha / r`` (LoRA), or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (rsLoRA).
    Example: r=16, alpha=16 gives 1.0, and 4.0 with rsLoRA.

    Raises:
        ValueError: if r is not a positive integer.
    """
    if r <= 0:
        raise ValueError(f"rank r must be positive, got {r}")
    return lora_alpha / math.sqrt(r) if use_rslora else lora_alpha / r


def projection_shapes(config: Mapping[str, int]) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each Llama projection, from HF config fields.

    Uses ``head_dim`` when the config has it, else ``hidden_size // num_attention_heads``; with GQA
    (``num_key_value_heads`` < heads) k and v are narrower than q: Llama-3-8B's are 1024 wide.
    """
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (heads * head_dim, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def adapter_num_params(config: Mapping[str, int], target_modules: Sequence[str], r: int) -> int:
    """Parameters of one LoRA adapter: r * (in + out) per targeted projection, times layers.

    Raises:
        KeyError: a target module that is not one of :data:`LLAMA_PROJECTIONS`.
    """
    shapes = projection_shapes(config)
    per_layer = sum(r * sum(shapes[m]) for m in target_modules)
    return per_layer * config["num_hidden_layers"]


def adapter_num_bytes(
    config: Mapping[str, int], target_modules: Sequence[str], r: int, dtype: torch.dtype
) -> int:
    """Bytes of one adapter's weights in ``dtype``: parameters times the element size.

    Llama-3-8B, r=16, all seven projections, bf16: 41,943,040 parameters = 83,886,080 bytes, which is
    80.0 MiB (2**20 bytes) or 83.9 MB (10**6 bytes).
    """
    element_size = torch.empty((), dtype=dtype).element_size()
    return adapter_num_params(config, target_modules, r) * element_size


def lora_flop_share(config: Mapping[str, int], target_modules: Sequence[str], r: int) -> float:
    """LoRA FLOPs per token divided by the base FLOPs of the same projections (a fraction, not %).

    A projection costs 2*in*out FLOPs per token; its LoRA path costs 2*r*(in + out) (shrink, then
    expand). The layer count cancels. Llama-3-8B, r=16, seven projections: about 0.0060.
    """
    shapes = projection_shapes(config)
    lora = sum(r * (i + o) for i, o in (shapes[m] for m in target_modules))
    base = sum(i * o for i, o in (shapes[m] for m in target_modules))
    return lora / base


def padded_flop_waste(seg_lens: Sequence[int], ranks: Sequence[int]) -> float:
    """Fraction of LoRA FLOPs wasted when every request is padded to the batch's largest rank.

    Request i has seg_lens[i] tokens and rank ranks[i]; shrink and expand FLOPs are both linear in
    the rank, so hidden sizes cancel: waste = sum n_i (R - r_i) / sum n_i R with R = max rank.
    Example: 1 request of rank 64 and 3 of rank 16, 100 tokens each: 0.5625.
    Returns 0.0 for an empty batch or one whose ranks are all 0.

    Raises:
        ValueError: if the two lists differ in length.
    """
    if len(seg_lens) != len(ranks):
        raise ValueError(f"{len(seg_lens)} seg_lens but {len(ranks)} ranks")
    padded = sum(n * max(ranks, default=0) for n in seg_lens)
    if padded == 0:
        return 0.0
    return sum(n * (max(ranks) - r) for n, r in zip(seg_lens, ranks)) / padded
