"""The book's LoRA ops.

``reference.ops.torch_ref`` holds the plain-PyTorch references; the Triton ops live one per file
(``sgmv_shrink``, ``sgmv_expand``, ``bgmv_shrink``, ``bgmv_expand``, ``fused_decode``,
``fused_moe_lora``, ``lora_gemm``) and are exported here under the contract's names, so any implementation can be
timed beside them::

    shrink(x, A_stack, batch_info, out, stack_num=1)            # SGMV (prefill)
    bgmv_shrink(x, A_stack, batch_info, out, stack_num=1)       # BGMV (decode); 3-D out: split-K partials
    expand(t, B_stack, batch_info, out, slice_offsets=None)     # SGMV (prefill)
    fused_decode(x, A_stack, B_stack, batch_info, out)          # BGMV shrink+expand, one launch
    fused_moe_lora(x, A, B, out, topk_ids, token_slots, lora_ranks, scalings, top_k,
                   rows_per_pair, slice_offsets=None, topk_weights=None)   # MoE LoRA (chapter 09)
    lora_gemm(x, W, out=None, t=None, B_stack=None, batch_info=None, part=0)  # base GEMM + expand epilogue

The MoE op's contract and torch reference live in ``reference.moe_lora`` (4-D per-expert buffers,
per-expert ranks, virtual experts); ``torch_ref.fused_moe_lora`` is that reference.
"""
from reference.ops import torch_ref
from reference.ops.bgmv_expand import bgmv_expand
from reference.ops.bgmv_shrink import bgmv_shrink, decode_splits
from reference.ops.fused_decode import fused_decode
from reference.ops.fused_moe_lora import fused_moe_lora
from reference.ops.lora_gemm import lora_gemm
from reference.ops.sgmv_expand import sgmv_expand
from reference.ops.sgmv_shrink import sgmv_shrink

shrink = sgmv_shrink
expand = sgmv_expand

__all__ = ["torch_ref", "shrink", "expand", "fused_decode", "sgmv_shrink", "sgmv_expand", "bgmv_shrink",
           "bgmv_expand", "fused_moe_lora", "lora_gemm", "decode_splits"]
