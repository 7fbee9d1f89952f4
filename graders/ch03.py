"""Cases for chapter 03 (shrink and expand in Triton).

The same poisoned batches as chapter 02 (NaN past every slot's rank and in rank-0 slots, shrink
outputs filled with NaN, base rows compared bit for bit), so a kernel that reads out of bounds of
a slot's rank or leaves an element unwritten fails. In Triton's CPU interpreter bf16 arithmetic is
wrong without an error, so there the random cases use fp16 where the GPU uses bf16.
"""
from __future__ import annotations

import dataclasses
import random

import torch

from graders.cases import BatchSpec, batch_hint, edge_specs, random_specs, expand_case, loop_case, shrink_case
from graders.core import Case, Exercise

TRITON_REQUIRED = ("@triton.jit", "this exercise asks for a Triton kernel, and the answer cell defines no @triton.jit "
                   "function: a PyTorch version computes the same numbers, but it is not the exercise")
from reference.device import interpreting
from reference.ops import torch_ref

__all__ = ["EXERCISES"]


def _on_this_device(spec: BatchSpec) -> BatchSpec:
    if interpreting() and spec.dtype == torch.bfloat16:
        return dataclasses.replace(spec, dtype=torch.float16)
    return spec


def _decode_specs(rng: random.Random) -> list[BatchSpec]:
    """One token per request, as in decode: the case BGMV and the fused kernel are for."""
    specs = []
    for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float32]):
        n_slots = rng.randint(2, 5)
        max_rank = rng.choice([4, 7, 16])
        ranks = [rng.choice([0, 1, max_rank]) for _ in range(n_slots)]
        ranks[rng.randrange(n_slots)] = 0
        n = rng.randint(1, 24)
        specs.append(BatchSpec(f"decode_{i}", [1] * n, [rng.randrange(n_slots) for _ in range(n)], ranks,
                               max_rank, rng.choice([16, 72, 96]), rng.choice([24, 40, 64]), dtype))
    return specs


def _triton(case: Case) -> Case:
    case.op = "triton"  # the tolerance row for kernels (TF32 dots on the GPU)
    return case


def _cases(make, edge_specs, random_specs):
    def edge() -> list[Case]:
        gen = torch.Generator().manual_seed(11)
        return [_triton(make(_on_this_device(s), gen)) for s in edge_specs()]

    def rand(rng: random.Random, gen: torch.Generator, hidden: bool) -> list[Case]:
        return [_triton(make(_on_this_device(s), gen)) for s in random_specs(rng)]

    return edge, rand


def _sgmv_random(rng: random.Random) -> list[BatchSpec]:
    return random_specs(rng, hidden=False, sgmv=True)


def _decode_edge() -> list[BatchSpec]:
    return [s for s in edge_specs(sgmv=False)] + [
        BatchSpec("decode_base_in_slot_1", [1] * 5, [0, 1, 2, 1, 0], [7, 0, 16], 16, 72, 40),
    ]


EXERCISES = [
    Exercise("ch03.1", "sgmv_shrink", ("x", "A_stack", "batch_info", "out"), torch_ref.sgmv_shrink,
             *_cases(shrink_case, lambda: edge_specs(sgmv=True), _sgmv_random), batch_hint(torch_ref.sgmv_shrink), requires=TRITON_REQUIRED),
    Exercise("ch03.2", "sgmv_expand", ("t", "B_stack", "batch_info", "out"), torch_ref.sgmv_expand,
             *_cases(expand_case, lambda: edge_specs(sgmv=True), _sgmv_random), batch_hint(torch_ref.sgmv_expand), requires=TRITON_REQUIRED),
    Exercise("ch03.3", "fused_decode", ("x", "A_stack", "B_stack", "batch_info", "out"), torch_ref.fused_decode,
             *_cases(loop_case, _decode_edge, _decode_specs), batch_hint(torch_ref.fused_decode), requires=TRITON_REQUIRED),
]
