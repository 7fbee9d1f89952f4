"""How many bytes one LoRA adapter of a mixture-of-experts model takes (chapter 09).

A LoRA of rank r on a linear layer ``in -> out`` stores A [r, in] and B [out, r]: ``r * (in + out)``
elements. A MoE model multiplies that by its experts: every routed expert of every MoE layer has its
own gate, up and down LoRA, so an adapter that targets the experts is tens of times larger than one
that targets attention only (the numbers that size the chapter's memory pool)::

    moe_adapter_bytes(MIXTRAL_8X7B, 16, ["q_proj", "v_proj"])["total"]   # attention only
    moe_adapter_bytes(MIXTRAL_8X7B, 16, ["gate_proj", "up_proj", "down_proj"])   # every expert

Target names are the Hugging Face module names that PEFT's ``target_modules`` uses: attention
``q_proj k_proj v_proj o_proj`` (multi-head latent attention, DeepSeek-V2/V3: ``q_a_proj q_b_proj
kv_a_proj_with_mqa kv_b_proj o_proj``, and ``q_proj`` when ``q_lora_rank`` is None), MLP
``gate_proj up_proj down_proj``; an MLP target applies to every routed expert, to the shared
expert(s) and to the dense MLP of the first ``first_k_dense_replace`` layers alike.

Config keys (as in each model's config.json): ``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads`` (default: the heads), ``head_dim`` (default
hidden / heads); experts ``num_local_experts`` (Mixtral) / ``num_experts`` (Qwen-MoE) /
``n_routed_experts`` (DeepSeek); expert width ``moe_intermediate_size``, else ``intermediate_size``
(Mixtral); shared expert ``shared_expert_intermediate_size`` (Qwen2-MoE) or ``n_shared_experts *
moe_intermediate_size`` (DeepSeek); dense layers ``first_k_dense_replace`` of width
``intermediate_size`` (DeepSeek). The router (``gate``) is never a LoRA target here.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["MIXTRAL_8X7B", "QWEN3_30B_A3B", "DEEPSEEK_V3", "ATTENTION_TARGETS", "MLP_TARGETS",
           "attention_shapes", "mlp_shapes", "lora_bytes", "moe_adapter_bytes"]

#: mistralai/Mixtral-8x7B-v0.1 config.json (the fields these sizes read).
MIXTRAL_8X7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
#: Qwen/Qwen3-30B-A3B config.json: head_dim 128 x 32 heads = 4096 != hidden 2048; every layer is MoE
#: (decoder_sparse_step 1, mlp_only_layers []); no shared expert.
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8)
#: deepseek-ai/DeepSeek-V3 config.json: multi-head latent attention, 256 routed experts + 1 shared,
#: the first 3 of 61 layers dense.
DEEPSEEK_V3 = dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
                   num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
                   num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536, kv_lora_rank=512,
                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def attention_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of each attention projection of one layer."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    if "kv_lora_rank" in config:  # multi-head latent attention (DeepSeek-V2/V3)
        qk = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        kv, q_rank = config["kv_lora_rank"], config.get("q_lora_rank")
        shapes = {"q_proj": (h, heads * qk)} if q_rank is None else {"q_a_proj": (h, q_rank), "q_b_proj": (q_rank, heads * qk)}
        return {**shapes, "kv_a_proj_with_mqa": (h, kv + config["qk_rope_head_dim"]),
                "kv_b_proj": (kv, heads * (config["qk_nope_head_dim"] + config["v_head_dim"])),
                "o_proj": (heads * config["v_head_dim"], h)}
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads") or heads
    return {"q_proj": (h, heads * head_dim), "k_proj": (h, kv * head_dim), "v_proj": (h, kv * head_dim),
            "o_proj": (heads * head_dim, h)}


def mlp_shapes(hidden: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(in, out) of gate_proj, up_proj and down_proj of one MLP (one expert)."""
    return {"gate_proj": (hidden, intermediate), "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}


def lora_bytes(shape: tuple[int, int], rank: int, dtype_bytes: int = 2) -> int:
    """Bytes of one LoRA (A [r, in] and B [out, r]) on a linear layer of (in, out)."""
    return rank * (shape[0] + shape[1]) * dtype_bytes


def _experts(config: dict) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if config.get(key):
            return config[key]
    raise ValueError("a MoE config needs num_local_experts, num_experts or n_routed_experts")


def _shared_width(config: dict) -> int:
    if config.get("shared_expert_intermediate_size"):
        return config["shared_expert_intermediate_size"]
    return (config.get("n_shared_experts") or 0) * config.get("moe_intermediate_size", 0)


def _group(shapes: dict[str, tuple[int, int]], targets: Sequence[str], rank: int, dtype_bytes: int) -> int:
    return sum(lora_bytes(shapes[t], rank, dtype_bytes) for t in targets if t in shapes)


def moe_adapter_bytes(config: dict, rank: int, targets: Sequence[str], dtype_bytes: int = 2) -> dict:
    """Bytes of one adapter of ``rank`` on ``targets``, per group of layers, for a MoE config.

    Returns ``{"attention", "routed_experts", "shared_experts", "dense_mlp", "total"}`` in bytes:
    attention over all layers; routed experts over the MoE layers (``num_hidden_layers -
    first_k_dense_replace``) times the experts; the shared expert over the MoE layers; the dense
    MLP over the first ``first_k_dense_replace`` layers.

    Example (the tests' tiny config): hidden 8, 2 heads, 1 kv head (head_dim 4), 2 layers of 4
    experts of width 6, rank 2, targets q_proj and down_proj, 2 bytes -> attention 2 * 2*(8+8)*2 =
    128; routed 2 * 4 * 2*(6+8)*2 = 448.

    Raises:
        ValueError: a target that is not an attention projection of this config nor an MLP one,
            rank < 0, or a config without an expert count.
    """
    attn = attention_shapes(config)
    unknown = [t for t in targets if t not in attn and t not in MLP_TARGETS]
    if unknown or rank < 0:
        raise ValueError(f"targets must be among {sorted(attn) + list(MLP_TARGETS)} and rank >= 0, "
                         f"got {unknown} and {rank}")
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    dense_layers = config.get("first_k_dense_replace") or 0
    moe_layers = layers - dense_layers
    expert_width = config.get("moe_intermediate_size") or config["intermediate_size"]
    sizes = {
        "attention": layers * _group(attn, targets, rank, dtype_bytes),
        "routed_experts": moe_layers * _experts(config) * _group(mlp_shapes(h, expert_width), targets, rank, dtype_bytes),
        "shared_experts": moe_layers * _group(mlp_shapes(h, _shared_width(config)), targets, rank, dtype_bytes)
        if _shared_width(config) else 0,
        "dense_mlp": dense_layers * _group(mlp_shapes(h, config["intermediate_size"]), targets, rank, dtype_bytes),
    }
    return {**sizes, "total": sum(sizes.values())}
