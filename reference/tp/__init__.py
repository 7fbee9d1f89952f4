"""Chapter 10: tensor-parallel multi-LoRA.

- :mod:`~reference.tp.lora`: sharding the slot buffers, the per-rank LoRA forward and its collectives.
- :mod:`~reference.tp.pool`: the pool each rank holds (its shard of every slot).
- :mod:`~reference.tp.model`: a tensor-parallel Llama forward per rank, LoRA on every projection.
- :mod:`~reference.tp.demo`: the chapter's multi-process runs (``python -m reference.tp.demo``).
"""
