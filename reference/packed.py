"""Packed (fused) projections: q/k/v and gate/up stacked into one adapter slot.

Source: SGLang ``python/sglang/srt/lora/layers.py`` (``QKVParallelLinearWithLoRA``,
``MergedColumnParallelLinearWithLoRA``) and ``triton_ops/qkv_lora_b.py``; vLLM
``vllm/lora/layers/column_parallel_linear.py`` (``MergedQKVParallelLinearWithLoRA``). The three
projections q, k and v read the same input, so their three shrinks become one with A stacked to
``3 r`` rows; the expand then writes each part into its own column range of the fused output. Under
grouped-query attention q is wider than k and v, so the ranges differ in width.

Layout (the book's contract, see ``reference/ops/torch_ref.py``): for out_features (q, k, v)

    A [3r, in]:       rows [0, r) = A_q, [r, 2r) = A_k, [2r, 3r) = A_v
    B [q+k+v, r]:     rows [0, q) = B_q, [q, q+k) = B_k, [q+k, q+k+v) = B_v
    slice_offsets:    (0, q, q+k, q+k+v)

Running example (GQA, hidden 4096, 32 heads, 8 kv heads, head_dim 128, r 16):
    out_features (4096, 1024, 1024) -> slice_offsets (0, 4096, 5120, 6144); A [48, 4096]; B [6144, 16]
An adapter trained on q and v only gets zeros in A rows [16, 32) and in B rows [4096, 5120): its k
delta is exactly 0 and its q and v parts stay at their offsets. gate/up follow the same rule with
two parts, gate first (the model's ``gate_up_proj`` order; TensorRT-LLM's loader swaps the halves by
default, so a converter must know which convention its source uses).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

__all__ = ["slice_offsets_for", "stack_lora_parts"]


def slice_offsets_for(out_features: Sequence[int]) -> tuple[int, ...]:
    """Output column offsets of the stacked parts: (4096, 1024, 1024) -> (0, 4096, 5120, 6144).

    Raises:
        ValueError: no parts, or a width below 1.
    """
    widths = [int(w) for w in out_features]
    if not widths or min(widths) < 1:
        raise ValueError(f"out_features must be one or more positive widths, got {list(out_features)}")
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    return tuple(offsets)


def _rank_and_like(A_parts, B_parts, out_features) -> tuple[int, torch.Tensor]:
    """Check the parts against each other; return the shared rank and one present A part."""
    if not (len(A_parts) == len(B_parts) == len(out_features)):
        raise ValueError(f"{len(A_parts)} A parts, {len(B_parts)} B parts, {len(out_features)} out_features")
    present = [i for i, (a, b) in enumerate(zip(A_parts, B_parts)) if a is not None or b is not None]
    if not present:
        raise ValueError("every part is missing: there is nothing to stack (the slot would be all zeros)")
    for i in present:
        if A_parts[i] is None or B_parts[i] is None:
            raise ValueError(f"part {i} has {'B' if A_parts[i] is None else 'A'} but not "
                             f"{'A' if A_parts[i] is None else 'B'}: a LoRA part needs both")
    first = A_parts[present[0]]
    rank, d_in = first.shape
    for i in present:
        a, b = A_parts[i], B_parts[i]
        if a.shape != (rank, d_in) or b.shape != (out_features[i], rank):
            raise ValueError(f"part {i}: A {list(a.shape)} and B {list(b.shape)}; expected A [{rank}, {d_in}] "
                             f"and B [{out_features[i]}, {rank}] (one rank and one input width for all parts)")
        if a.dtype != first.dtype or b.dtype != first.dtype:
            raise ValueError(f"part {i}: dtypes {a.dtype}/{b.dtype} differ from part {present[0]}'s {first.dtype}")
    return rank, first


def stack_lora_parts(
    A_parts: Sequence[Optional[torch.Tensor]],  # per part: [r, in] or None (the adapter lacks it)
    B_parts: Sequence[Optional[torch.Tensor]],  # per part: [out_i, r] or None
    out_features: Sequence[int],  # per part output width, e.g. (4096, 1024, 1024)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the parts of one fused projection into the packed layout of the module docstring.

    Semantics:
        r = rank of the present parts;  offs = slice_offsets_for(out_features)
        A = zeros(len(parts) * r, in);  B = zeros(offs[-1], r)
        for each present part i: A[i*r:(i+1)*r] = A_parts[i];  B[offs[i]:offs[i+1]] = B_parts[i]

    Returns:
        (A [num_parts * r, in], B [sum(out_features), r]), new tensors in the parts' dtype and device;
        the inputs are not modified.
    Raises:
        ValueError: lengths differ, every part missing, a part with A but no B (or B but no A), shapes
        that disagree on the rank, the input width or ``out_features``, mixed dtypes.
    """
    rank, like = _rank_and_like(A_parts, B_parts, out_features)
    offsets = slice_offsets_for(out_features)
    A = like.new_zeros(len(out_features) * rank, like.shape[1])
    B = like.new_zeros(offsets[-1], rank)
    for i, (a, b) in enumerate(zip(A_parts, B_parts)):
        if a is not None:
            A[i * rank:(i + 1) * rank] = a
            B[offsets[i]:offsets[i + 1]] = b
    return A, B
