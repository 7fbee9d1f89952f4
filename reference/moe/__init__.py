"""Chapter 09: LoRA on mixture-of-experts models, one delta per (adapter, expert) pair.

- :mod:`~reference.moe.lora`: the math and the op's contract (virtual experts, block alignment, the
  torch reference ``fused_moe_lora_torch``).
- :mod:`~reference.moe.fused_moe_lora`: the Triton op (reads :mod:`reference.ops`' kernels).
- :mod:`~reference.moe.pool`: per-expert slot buffers beside chapter 05's pool, one slot policy.
- :mod:`~reference.moe.adapters`: loading PEFT adapters with LoRA on routed experts.
- :mod:`~reference.moe.layers`: serving a Mixtral / Qwen2-MoE model from the pool.
- :mod:`~reference.moe.sizes`: an adapter's bytes for published MoE configs.
"""
