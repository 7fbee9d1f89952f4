"""Serve the pool's slots through a Hugging Face model, with forward hooks: the book's end-to-end
check that adapters loaded by :mod:`reference.adapters` compute what PEFT computes (chapter 06).

Every projection ``nn.Linear`` inside ``model.layers.N`` that the pool serves gets a forward hook.
The hook adds the LoRA delta of each row's slot, computed with the reference SGMV ops
(:func:`reference.ops.torch_ref.sgmv_shrink` / ``sgmv_expand``) from the pool's buffers and a
:class:`~reference.batch_info.LoRABatchInfo`: one adapter per sequence, base rows in a rank-0 slot.
The base model's code is never copied or edited; only its Linear outputs are added to.

Fused modules: an engine runs q, k and v as ONE GEMM (``qkv_proj``) and adds the fused expand into
its output in place. A Hugging Face Llama calls three separate Linear modules on the same input
tensor, so here the fused shrink and expand run once per layer, into a zero buffer
[num_tokens, q+k+v], on the first of the three calls (whichever comes first: the buffer is keyed
by the identity of the input tensor), and each hook adds its own column slice. The shrink is the
engine's (A stacked to 3 * max_rank rows, one GEMM per segment); only the final add is split.

Sources: PEFT ``peft/tuners/lora/layer.py`` (``_mixed_batch_forward``, the behaviour compared
against); SGLang ``python/sglang/srt/lora/layers.py`` (``QKVParallelLinearWithLoRA``); vLLM
``vllm/lora/layers`` (``MergedQKVParallelLinearWithLoRA``).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

from reference.adapters import layer_index, projection_map
from reference.batch_info import LoRABatchInfo
from reference.mem_pool import LoRAMemoryPool, ModuleSpec
from reference.ops.torch_ref import sgmv_expand, sgmv_shrink

__all__ = ["lora_delta", "pool_lora_hooks"]


def lora_delta(
    x: torch.Tensor,  # [num_tokens, in]
    A_stack: torch.Tensor,  # [num_slots, stack_num * max_rank, in]
    B_stack: torch.Tensor,  # [num_slots, out_total, max_rank]
    spec: ModuleSpec,
    batch_info: LoRABatchInfo,
) -> torch.Tensor:  # [num_tokens, out_total], x.dtype
    """The LoRA delta of one (layer, module) for a mixed batch: shrink then sliced expand.

    Semantics:
        t = zeros(num_tokens, stack_num * max_rank);  sgmv_shrink(x, A_stack, batch_info, t, stack_num)
        delta = zeros(num_tokens, out_total);  sgmv_expand(t, B_stack, batch_info, delta, spec.slice_offsets)
        so delta[tok, slice_i] = scalings[s] * (x[tok] @ A[s, i*r:(i+1)*r].T) @ B[s, slice_i, :r].T
    Rows in a rank-0 slot (base model) get exactly zero.
    """
    t = x.new_zeros(x.shape[0], A_stack.shape[1])
    sgmv_shrink(x, A_stack, batch_info, t, stack_num=spec.stack_num)
    delta = x.new_zeros(x.shape[0], spec.out_total)
    return sgmv_expand(t, B_stack, batch_info, delta, slice_offsets=spec.slice_offsets)


class _SharedDelta:
    """The delta of one (layer, engine module), computed once per input tensor and shared by the
    hooks of its parts (q, k, v read the same ``hidden_states`` object)."""

    def __init__(self, pool: LoRAMemoryPool, spec: ModuleSpec, layer: int, batch_info: LoRABatchInfo):
        self.A = pool.A_buffer[spec.name][layer]
        self.B = pool.B_buffer[spec.name][layer]
        self.spec, self.batch_info = spec, batch_info
        self.x, self.delta = None, None

    def get(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [num_tokens, out_total]
        if self.x is not x:
            x2d = x.reshape(-1, x.shape[-1])
            if x2d.shape[0] != self.batch_info.num_tokens:
                raise ValueError(f"{self.spec.name}: input has {x2d.shape[0]} tokens, batch_info "
                                 f"{self.batch_info.num_tokens}")
            self.x, self.delta = x, lora_delta(x2d, self.A, self.B, self.spec, self.batch_info)
        return self.delta


def _part_hook(shared: _SharedDelta, lo: int, hi: int):
    """Forward hook of one part: output + delta[:, lo:hi] (a new tensor, so autograd stays valid)."""
    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + shared.get(inputs[0])[:, lo:hi].reshape(output.shape)
    return hook


@contextmanager
def pool_lora_hooks(
    model: nn.Module,
    pool: LoRAMemoryPool,
    modules: Sequence[ModuleSpec],
    batch_info: LoRABatchInfo,
) -> Iterator[int]:
    """Within the block, every served projection of ``model`` adds its slots' LoRA deltas.

    ``model`` is a plain Hugging Face model (its Linear modules named ``...layers.N.<proj>``);
    ``modules`` are the pool's specs (fused or per projection). Rows are the flattened
    [batch * seq] tokens of the forward's input, in order; ``batch_info`` must cover all of them
    (padding rows: give them a rank-0 slot). Yields the number of hooks; removes them on exit.

    Semantics (per forward, for each served Linear ``...layers.N.<proj>``, part i of engine module m):
        output = output + lora_delta(x, A_buffer[m][N], B_buffer[m][N], spec_m, batch_info)[:, slice_i]
    with the delta of (N, m) computed once per input tensor and shared by m's parts.

    Raises:
        ValueError: no module of the model is served by the pool, or a layer beyond the pool's.
    """
    served, specs = projection_map(modules), {s.name: s for s in modules}
    shared: dict[tuple[int, str], _SharedDelta] = {}
    handles = []
    try:
        for path, mod in model.named_modules():
            layer, proj = layer_index(path), path.rsplit(".", 1)[-1]
            if layer is None or proj not in served or not isinstance(mod, nn.Linear):
                continue
            name, part = served[proj]
            if len(pool.A_buffer[name]) <= layer:
                raise ValueError(f"{path}: layer {layer} but the pool has {len(pool.A_buffer[name])} layers")
            spec = specs[name]
            s = shared.setdefault((layer, name), _SharedDelta(pool, spec, layer, batch_info))
            lo, hi = spec.slice_offsets[part], spec.slice_offsets[part + 1]
            handles.append(mod.register_forward_hook(_part_hook(s, lo, hi)))
        if not handles:
            raise ValueError(f"no Linear module of the model is served by the pool's modules {sorted(specs)}")
        yield len(handles)
    finally:
        for h in handles:
            h.remove()
