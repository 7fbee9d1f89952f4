"""What ``graders.show_reference(exercise_id)`` prints: the book's reference for each exercise, as
``"module:qualname"`` (a Triton kernel's Python source is its ``.fn``). One table, so the notebooks
never print a solution themselves and a test can check that none does."""
from __future__ import annotations

__all__ = ["SHOWN"]

SHOWN: dict[str, tuple[str, ...]] = {
    "ch01.1": ("reference.lora_math:lora_forward",),
    "ch01.2": ("reference.lora_math:merge_lora",),
    "ch01.3": ("reference.lora_math:unmerge_lora",),
    "ch01.4": ("reference.lora_math:lora_scaling",),
    "ch01.5": ("reference.lora_math:projection_shapes", "reference.lora_math:adapter_num_params",
               "reference.lora_math:adapter_num_bytes"),
    "ch01.6": ("reference.lora_math:lora_flop_share",),
    "ch02.1": ("reference.batch_info:seg_indptr_from_seg_lens",),
    "ch02.2": ("reference.batch_info:token_slots_from_segments",),
    "ch02.3": ("reference.ops.torch_ref:lora_loop",),
    "ch02.4": ("reference.ops.torch_ref:bgmv_shrink",),
    "ch02.5": ("reference.ops.torch_ref:bgmv_expand",),
    "ch02.6": ("reference.ops.torch_ref:sgmv_shrink",),
    "ch02.7": ("reference.ops.torch_ref:sgmv_expand",),
    "ch02.8": ("reference.batch_info:stable_sort_by_slot",),
    "ch02.9": ("reference.lora_math:padded_flop_waste",),
    "ch03.1": ("reference.ops.sgmv_shrink:_sgmv_shrink_kernel", "reference.ops.sgmv_shrink:sgmv_shrink"),
    "ch03.2": ("reference.ops.sgmv_expand:_sgmv_expand_kernel", "reference.ops.sgmv_expand:sgmv_expand"),
    "ch03.3": ("reference.ops.fused_decode:_fused_decode_kernel", "reference.ops.fused_decode:fused_decode"),
    "ch04.1": ("reference.packed:stack_lora_parts",),
    "ch04.2": ("reference.ops.sgmv_expand:_sgmv_expand_kernel",),
    "ch04.3": ("reference.chunked:merge_adjacent_segments",),
    "ch04.4": ("reference.chunked:cut_into_chunks",),
    "ch05.1": ("reference.eviction:EvictionPolicy.select_victim", "reference.eviction:LRUEvictionPolicy"),
    "ch05.2": ("reference.eviction:FIFOEvictionPolicy",),
    "ch05.3": ("reference.mem_pool:LoRAMemoryPool.load_to_slot", "reference.mem_pool:LoRAMemoryPool._write_slot"),
    "ch05.4": ("reference.mem_pool:LoRAMemoryPool.admit",),
    "ch05.5": ("reference.mem_pool:LoRAMemoryPool.prepare_lora_batch",),
    "ch06.1": ("reference.adapters:parse_lora_key",),
    "ch06.2": ("reference.adapters:targets_module",),
    "ch06.3": ("reference.adapters:pattern_key", "reference.adapters:module_rank_alpha"),
    "ch06.4": ("reference.adapters:_padded_part", "reference.adapters:_pack"),
    "ch07.1": ("reference.batch_info:batch_info_from_requests",),
    "ch07.2": ("reference.batch_info:slot_sorted_view",),
    "ch07.3": ("reference.layers:LoRALinear.forward", "reference.layers:SharedShrink"),
    "ch08.1": ("reference.cuda_graph:bucket_for",),
    "ch08.2": ("reference.cuda_graph:StaticLoRABatch.update",),
    "ch08.3": ("reference.cuda_graph:SlotChangeTracker",),
    "ch08.4": ("reference.cuda_graph:DecodeGraphRunner._write_inputs",),
}
