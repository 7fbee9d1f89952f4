"""Loading PEFT adapters with LoRA on routed experts (``target_parameters``): chapter 09.

PEFT puts LoRA on transformers' 3-D expert parameters with
``LoraConfig(target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"], ...)``, beside
ordinary ``target_modules`` (attention, Qwen2-MoE's shared expert). What such a folder holds, found by
experiment with transformers 5.24 / peft 0.21.2 and checked numerically against PEFT's own forward
(``tests/test_moe_model.py::test_expert_layout_matches_peft``):

1. Parameters. ``experts.gate_up_proj`` is [E, 2I, H] and ``experts.down_proj`` is [E, H, I]; the
   expert computes ``gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)`` (rows [0, I) are the
   gate), ``y = linear(act(gate) * up, down_proj[e])``, and the model multiplies y by the routing
   weight afterwards.
2. Tensors. PEFT's ``ParamWrapper`` stores, for each targeted parameter of ``E`` experts at rank r,
   ``lora_A [E*r, in]`` and ``lora_B [out, E*r]`` (in / out of ``linear``: H / 2I for gate_up,
   I / H for down). The two axes of E*r are ordered DIFFERENTLY:
       A_e = lora_A[e*r:(e+1)*r]          expert-major: expert e's rows are one block
       B_e = lora_B[:, e::E]              rank-major: column k*E + e is expert e's k-th column
   (PEFT reshapes A to (E, r, in) and B to (out, r, E)). Reading B in blocks like A gives a delta
   that is plausible and wrong.
3. Delta and scaling. PEFT does not add a LoRA branch after the base: it reparametrizes the weight,
   ``W_e' = W_e + s * B_e @ A_e`` (``get_delta_weight`` / ``torch.baddbmm(W, B, A, alpha=s)``), with
   ``s = lora_alpha / r`` (``/ sqrt(r)`` with use_rslora, rank/alpha patterns matched against
   ``model.layers.N.mlp.experts.gate_up_proj``) and runs the base experts forward with W'. So the
   scaling is in weight space, before the activation for gate_up, and the routing weight multiplies
   base and delta alike. Ours is the same function: ``x W_e^T + s (x A_e^T) B_e^T``.
4. Names. The saved keys carry NO parameter name: targeting two parameters of one module nests two
   wrappers, the innermost wrapping the parameter registered first on the module (PEFT walks
   ``named_parameters``: gate_up_proj, then down_proj). The outermost one saves
   ``...mlp.experts.lora_A.weight``, the next ``...mlp.experts.base_layer.lora_A.weight``, and so on.
   So with both targeted, ``experts.lora_*`` is down_proj and ``experts.base_layer.lora_*`` is
   gate_up_proj; with down_proj alone, ``experts.lora_*`` is down_proj. The loader resolves the
   name from the config's targets and the nesting depth, then checks the shapes.
5. PEFT's mixed batch (``adapter_names=``) refuses ParamWrapper layers, and every adapter of one
   PeftModel must target the same parameters: the judge runs PEFT once per adapter.

The pool's layout (:mod:`reference.moe.pool`): per (layer, module, expert) ``(A [stack*r, in],
B [out_total, r])``. PEFT's LoRA on the fused gate_up is ONE pair (A_e shared by both halves), so
gate_up is stored as two parts with the same A and B's gate rows / up rows in the halves that
``GATE_UP_HALVES`` names (one extra shrink; a one-slice layout would avoid it, but two slices also
serve adapters trained with separate gate and up LoRAs). The source rows come from transformers'
layout (``TRANSFORMERS_GATE_UP_ROWS``), the destination from the book's one table: a wrong table
puts the gate's delta on up, and the judge shows that PEFT then disagrees.

Sources: PEFT ``peft/tuners/lora/layer.py`` (``ParamWrapper``: ``update_layer``,
``get_delta_weight``, ``_LoraFactorsProxy``) and ``peft/tuners/tuners_utils.py``
(``_inject_parameters``: the nesting order); SGLang ``python/sglang/srt/lora/`` (per-expert MoE
LoRA buffers).
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path
from types import MappingProxyType
from typing import Hashable, Mapping, Sequence, Union

import torch

from reference.moe import lora as moe_lora
from reference.adapters import (CONFIG_NAME, AdapterConfig, convert_peft_adapter, layer_index,
                                module_rank_alpha, read_peft_files)
from reference.lora_math import lora_scaling
from reference.mem_pool import ModuleSpec
from reference.moe.pool import ExpertModuleSpec, MoELoRAAdapter

__all__ = ["EXPERT_PARAMETERS", "TRANSFORMERS_GATE_UP_ROWS", "split_expert_lora", "expert_lora_parts",
           "load_moe_peft_adapter"]

#: The routed-experts parameters in the order transformers registers them on ``MixtralExperts`` /
#: ``Qwen2MoeExperts``: the order PEFT nests its wrappers in (first = innermost).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")

#: Which half of the rows of transformers' ``gate_up_proj[e]`` is which (``chunk(2)``: gate first):
#: the SOURCE layout of a PEFT gate_up lora_B. Where the halves go in the pool is GATE_UP_HALVES.
TRANSFORMERS_GATE_UP_ROWS = MappingProxyType({"gate": 0, "up": 1})

_WRAPPED = re.compile(r"^(?:base_model\.model\.)?(?P<module>\w+(?:\.\w+)*?)(?P<nest>(?:\.base_layer)*)"
                      r"\.lora_(?P<matrix>[AB])\.weight$")

_Entries = dict[tuple[int, str], dict]  # (layer, parameter) -> {"path", "A", "B"}


def split_expert_lora(lora_A: torch.Tensor, lora_B: torch.Tensor, num_experts: int
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """PEFT's 3-D-parameter LoRA ``lora_A [E*r, in]``, ``lora_B [out, E*r]`` -> [(A_e [r, in], B_e [out, r])].

    Semantics: A_e = lora_A[e*r:(e+1)*r] (expert-major), B_e = lora_B[:, e::E] (rank-major), so that
    PEFT's delta of expert e is ``B_e @ A_e`` (module docstring, point 2).
    Example, E=2, r=2: lora_B columns [c0, c1, c2, c3] -> B_0 = [c0, c2], B_1 = [c1, c3].
    Raises:
        ValueError: E*r that does not split into num_experts, or A and B of different E*r.
    """
    rows = lora_A.shape[0]
    if rows % num_experts or lora_B.shape[1] != rows or rows == 0:
        raise ValueError(f"lora_A {list(lora_A.shape)} / lora_B {list(lora_B.shape)} do not split into "
                         f"{num_experts} experts of one rank (expected [E*r, in] and [out, E*r])")
    r = rows // num_experts
    return [(lora_A[e * r:(e + 1) * r].contiguous(), lora_B[:, e::num_experts].contiguous())
            for e in range(num_experts)]


def expert_lora_parts(A_e: torch.Tensor, B_e: torch.Tensor, spec: ExpertModuleSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's PEFT pair in the pool's layout (A [stack*r, in], B [out_total, r]).

    down_proj (one part): as it is. gate_up_proj (two parts): A_e in both parts; B_e's gate rows
    (``TRANSFORMERS_GATE_UP_ROWS``) into the output columns ``gate_up_half("gate", I)`` and its up rows
    into ``gate_up_half("up", I)`` (``GATE_UP_HALVES``, read at call time).
    """
    if spec.stack_num == 1:
        return A_e, B_e
    inter = spec.out_features[0]
    B = B_e.new_zeros(B_e.shape)
    for name, src in TRANSFORMERS_GATE_UP_ROWS.items():
        lo, hi = moe_lora.gate_up_half(name, inter)
        B[lo:hi] = B_e[src * inter:(src + 1) * inter]
    return torch.cat([A_e, A_e]), B


def _target_parameters(raw: Mapping, source: str) -> tuple[str, ...]:
    targets = raw.get("target_parameters") or ()
    if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{source}: target_parameters must be a list of names, got {targets!r}")
    return tuple(targets)


def _targeted(module: str, targets: Sequence[str]) -> list[str]:
    """The experts parameters of ``module`` that ``targets`` selects (PEFT: equal, or a dotted suffix)."""
    keys = [f"{module}.{p}" for p in EXPERT_PARAMETERS]
    return [p for p, k in zip(EXPERT_PARAMETERS, keys) if any(k == t or k.endswith("." + t) for t in targets)]


def _split_tensors(tensors: Mapping[str, torch.Tensor], targets: Sequence[str], source: str
                   ) -> tuple[_Entries, dict[str, torch.Tensor]]:
    """Expert entries (parameter resolved from the nesting depth) and the remaining (dense) tensors."""
    entries: _Entries = {}
    dense = {}
    for key, t in tensors.items():
        m = _WRAPPED.match(key)
        targeted = _targeted(m.group("module"), targets) if m else []
        if not targeted:
            dense[key] = t
            continue
        depth = m.group("nest").count(".base_layer")
        if depth >= len(targeted):
            raise ValueError(f"{source}: {key!r} is nested {depth} wrappers deep but target_parameters "
                             f"select only {targeted} on {m.group('module')!r}")
        param = targeted[len(targeted) - 1 - depth]
        layer = layer_index(m.group("module"))
        if layer is None or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{source}: {key!r} ({param}) must be a 2-D float tensor inside a decoder layer")
        entry = entries.setdefault((layer, param), {"path": f"{m.group('module')}.{param}"})
        if m.group("matrix") in entry:
            raise ValueError(f"{source}: two lora_{m.group('matrix')} tensors for {entry['path']!r}")
        entry[m.group("matrix")] = t
    for entry in entries.values():
        if not {"A", "B"} <= entry.keys():
            raise ValueError(f"{source}: {entry['path']!r} lacks its lora_{'A' if 'A' not in entry else 'B'} tensor")
    return entries, dense


def _drop_unserved(entries: _Entries, specs: Mapping[str, ExpertModuleSpec], strict: bool, source: str) -> _Entries:
    skipped = sorted(e["path"] for (_, p), e in entries.items() if p not in specs)
    if skipped and strict:
        raise ValueError(f"{source}: expert parameters {skipped} are not served by this engine (it serves "
                         f"{sorted(specs)})")
    if skipped:
        warnings.warn(f"{source}: skipping LoRA on expert parameters this engine does not serve: {skipped}",
                      UserWarning, stacklevel=3)
    return {k: e for k, e in entries.items() if k[1] in specs}


def _check_expert_shapes(entries: _Entries, config: AdapterConfig, specs: Mapping[str, ExpertModuleSpec],
                         num_layers: int, max_lora_rank: int, source: str) -> None:
    """Every layer in range; lora_A [E*r_m, in] and lora_B [out_total, E*r_m]; r_m <= max_lora_rank."""
    for (layer, param), e in sorted(entries.items()):
        spec = specs[param]
        r, _ = module_rank_alpha(config, e["path"])
        if not 0 <= layer < num_layers:
            raise ValueError(f"{source}: {e['path']!r}: layer {layer} out of range (model has {num_layers})")
        want_A, want_B = (spec.num_experts * r, spec.in_features), (spec.out_total, spec.num_experts * r)
        if tuple(e["A"].shape) != want_A or tuple(e["B"].shape) != want_B:
            raise ValueError(f"{source}: {e['path']!r}: lora_A {list(e['A'].shape)} and lora_B {list(e['B'].shape)}, "
                             f"expected {list(want_A)} and {list(want_B)} ({spec.num_experts} experts x r={r}): "
                             "an adapter for a model with another expert count or size?")
        if r > max_lora_rank:
            raise ValueError(f"{source}: {e['path']!r}: rank {r} exceeds max_lora_rank {max_lora_rank}")


def _expert_weights(entries: _Entries, config: AdapterConfig, specs: Mapping[str, ExpertModuleSpec]) -> dict:
    """(layer, parameter, expert) -> the pool-layout pair; a pattern's own scaling folded into B."""
    out = {}
    for (layer, param), e in sorted(entries.items()):
        spec = specs[param]
        r, alpha = module_rank_alpha(config, e["path"])
        B_all = e["B"].float() * lora_scaling(alpha, r, config.use_rslora) if config.folds_scaling else e["B"]
        for expert, (A_e, B_e) in enumerate(split_expert_lora(e["A"], B_all, spec.num_experts)):
            out[(layer, param, expert)] = expert_lora_parts(A_e, B_e, spec)
    return out


def load_moe_peft_adapter(
    path: Union[str, Path],
    modules: Sequence[ModuleSpec],
    expert_modules: Sequence[ExpertModuleSpec],
    num_layers: int,
    max_lora_rank: int,
    *,
    strict: bool = True,
    uid: Hashable,
) -> MoELoRAAdapter:
    """Read, validate and convert a PEFT adapter with LoRA on routed experts (and on ordinary modules).

    ``modules`` are the dense pool modules (attention, a shared expert), converted by chapter 06's
    :func:`~reference.adapters.convert_peft_adapter`; ``expert_modules`` the routed-experts ones.

    Semantics:
        scaling = alpha/r (alpha/sqrt(r) rsLoRA), or 1.0 with rank/alpha patterns (then each module's
            own scaling is folded into its B, experts included), as chapter 06 does
        rank = the dense rank (config.r, or the largest dense pattern rank)
        expert_weights[(layer, p, e)] = expert_lora_parts(split_expert_lora(lora_A, lora_B, E)[e]),
            at the expert module's own rank r_p (its rank_pattern entry, else r)
    Everything is checked before anything is returned.
    Raises:
        FileNotFoundError: a missing file (named).
        ValueError: everything chapter 06's loader refuses (except target_parameters); an expert key
        nested deeper than the targeted parameters; lora_A / lora_B of the wrong shape (another expert
        count, another size: named with the expected shapes); a rank above max_lora_rank; with
        ``strict``, expert parameters the engine does not serve (lenient: one UserWarning).
    """
    if uid is None:
        raise ValueError("uid None is reserved for the base model; give the adapter a real uid")
    source = str(Path(path))
    raw, tensors = read_peft_files(path)
    targets = _target_parameters(raw, source)
    config = AdapterConfig.from_dict({k: v for k, v in raw.items() if k != "target_parameters"},
                                     str(Path(path) / CONFIG_NAME))
    specs = {s.name: s for s in expert_modules}
    entries, dense_tensors = _split_tensors(tensors, targets, source)
    entries = _drop_unserved(entries, specs, strict, source)
    _check_expert_shapes(entries, config, specs, num_layers, max_lora_rank, source)
    experts = _expert_weights(entries, config, specs)
    if dense_tensors:
        dense = convert_peft_adapter(config, dense_tensors, modules, num_layers, max_lora_rank, strict=strict,
                                     uid=uid, source=source)
        rank, scaling, weights = dense.rank, dense.scaling, dense.weights
    elif experts:
        rank = min(config.r, max_lora_rank)  # no dense weights: the dense rank only marks the slot active
        scaling = 1.0 if config.folds_scaling else lora_scaling(config.lora_alpha, config.r, config.use_rslora)
        weights = {}
    else:
        raise ValueError(f"{source}: no LoRA tensors that this engine serves")
    return MoELoRAAdapter(uid=uid, rank=rank, scaling=scaling, weights=weights, expert_weights=experts)
