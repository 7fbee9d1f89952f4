"""The book's LoRA ops.

``reference.ops.torch_ref`` holds the plain-PyTorch references; the Triton ops live one per file
(``sgmv_shrink``, ``sgmv_expand``, ``bgmv_shrink``, ``bgmv_expand``, ``fused_decode``, ``lora_gemm``,
``paged_attention``) and the LoRA ones are exported here under the contract's names, so any
implementation can be timed beside them::

    shrink(x, A_stack, batch_info, out, stack_num=1)            # SGMV (prefill)
    bgmv_shrink(x, A_stack, batch_info, out, stack_num=1)       # BGMV (decode); 3-D out: split-K partials
    expand(t, B_stack, batch_info, out, slice_offsets=None)     # SGMV (prefill)
    fused_decode(x, A_stack, B_stack, batch_info, out)          # BGMV shrink+expand, one launch
    lora_gemm(x, W, out=None, t=None, B_stack=None, batch_info=None, part=0)  # base GEMM + expand epilogue

Chapter 09's MoE LoRA op lives with its contract in :mod:`reference.moe` (4-D per-expert buffers,
per-expert ranks, virtual experts): ``reference.moe.fused_moe_lora`` is the Triton op and
``reference.moe.lora.fused_moe_lora_torch`` its reference; it reads this package's kernels, never
the other way round.
"""
from reference.ops import torch_ref
from reference.ops.bgmv_expand import bgmv_expand
from reference.ops.bgmv_shrink import bgmv_shrink, decode_splits
from reference.ops.fused_decode import fused_decode
from reference.ops.lora_gemm import lora_gemm
from reference.ops.sgmv_expand import sgmv_expand
from reference.ops.sgmv_shrink import sgmv_shrink

shrink = sgmv_shrink
expand = sgmv_expand

__all__ = ["torch_ref", "shrink", "expand", "fused_decode", "sgmv_shrink", "sgmv_expand", "bgmv_shrink",
           "bgmv_expand", "lora_gemm", "decode_splits"]
