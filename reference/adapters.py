"""Loading real LoRA adapters (PEFT format) into the memory pool's layout: chapter 06.

A PEFT adapter is a directory with two files:
    adapter_config.json         r, lora_alpha, target_modules, use_rslora, use_dora, rank_pattern, ...
    adapter_model.safetensors   base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight  [r, in]
                                base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight  [out, r]
(saved keys carry no adapter name: ``lora_A.weight``, not PEFT's in-memory ``lora_A.default.weight``).

Everything that differs between the file and the engine is translated once, here, never on the hot
path: which modules an adapter targets (PEFT's matching rules), its scaling (alpha/r, alpha/sqrt(r)
for rsLoRA, per-module ranks and alphas folded into B), q/k/v and gate/up stacked into fused modules
(a missing part = zeros, gate before up), and validation of every name and shape before any pool
buffer is touched, so a rejected adapter leaves the pool exactly as it was.

Sources: PEFT ``peft/tuners/tuners_utils.py`` (``check_target_module_exists``,
``_maybe_include_all_linear_layers``), ``peft/utils/other.py`` (``get_pattern_key``,
``match_target_against_key``), ``peft/tuners/lora/layer.py`` (``update_layer``: the scaling);
SGLang ``python/sglang/srt/lora/lora.py`` (``LoRAAdapter``: ``normalize_qkv_proj``,
``normalize_gate_up_proj``) and ``lora_manager.py`` (target modules fixed at start-up); vLLM
``vllm/lora/models.py`` (``LoRAModel.from_local_checkpoint``: unexpected modules are an error) and
``vllm/lora/peft_helper.py`` (rsLoRA, DoRA); TensorRT-LLM ``tensorrt_llm/lora_manager.py``
(``HfLoraLoader``; ``swap_gate_up_proj_lora_b_weight`` defaults to True, i.e. its fused gate_up B
has up first).

Running example (the tests' tiny GQA Llama: hidden 64, q 64, k/v 32, intermediate 96), an adapter
with r=4 on q_proj and v_proj only, engine modules (qkv_proj (64, 32, 32), ...):
    weights[(3, "qkv_proj")] = (A [12, 64], B [128, 4]):
        A rows [0, 4) = A_q, [4, 8) = 0 (no k), [8, 12) = A_v
        B rows [0, 64) = B_q, [64, 96) = 0,     [96, 128) = B_v
"""
from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Hashable, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from reference.lora_math import lora_scaling
from reference.mem_pool import LoRAAdapter, ModuleSpec
from reference.packed import stack_lora_parts

__all__ = [
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "FUSED_PARTS",
    "LLAMA_MODULE_PATHS",
    "AdapterConfig",
    "LoRAKey",
    "read_peft_files",
    "read_peft_adapter",
    "parse_lora_key",
    "layer_index",
    "targets_module",
    "resolve_target_modules",
    "pattern_key",
    "module_rank_alpha",
    "projection_map",
    "load_peft_adapter",
    "convert_peft_adapter",
]

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

#: Fused engine modules and their parts, in packing order. gate comes before up (the order of
#: SGLang's and vLLM's gate_up_proj); TensorRT-LLM swaps the two halves of B by default.
FUSED_PARTS = MappingProxyType({
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
})

#: Where each projection lives in a Hugging Face Llama (the keys PEFT matches its patterns on).
LLAMA_MODULE_PATHS = MappingProxyType({
    **{p: "model.layers.{layer}.self_attn." + p for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
    **{p: "model.layers.{layer}.mlp." + p for p in ("gate_proj", "up_proj", "down_proj")},
})

_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<path>\w+(?:\.\w+)*)\.lora_(?P<matrix>[AB])\.weight$")
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_REFUSED = {  # config field -> why the book's kernels cannot serve it
    "use_dora": "DoRA adds a magnitude vector and a per-row norm that the shrink/expand kernels lack",
    "lora_bias": "a bias on lora_B is not part of the shrink/expand contract",
    "target_parameters": "LoRA on raw parameters (MoE experts) needs chapter 09's loader "
                         "(reference.moe.adapters.load_moe_peft_adapter)",
    "layer_replication": "layer replication changes the layer indices",
    "modules_to_save": "full copies of modules (modules_to_save) are not low-rank weights",
}


@dataclass(frozen=True)
class AdapterConfig:
    """The fields of ``adapter_config.json`` that serving needs (PEFT ``LoraConfig`` names)."""

    r: int
    lora_alpha: float
    target_modules: Union[str, tuple[str, ...]]  # a regex (full match), "all-linear", or names
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] = field(default_factory=dict)  # pattern -> rank, first match wins
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)  # pattern -> alpha

    @classmethod
    def from_dict(cls, raw: Mapping, source: str) -> "AdapterConfig":
        """Check and convert the parsed JSON; ``source`` names the file in every error.

        Raises:
            ValueError: not a JSON object, a LoRA field missing or of the wrong type, a PEFT type
            other than LORA, or a feature this book refuses (DoRA, lora_bias, ...).
        """
        if not isinstance(raw, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{source}: peft_type {raw['peft_type']!r} is not LORA")
        for name, why in _REFUSED.items():
            if raw.get(name):
                raise ValueError(f"{source}: {name}={raw[name]!r} is not supported: {why}")
        try:
            return cls(
                r=_positive_int(raw["r"]), lora_alpha=float(raw["lora_alpha"]),
                target_modules=_targets(raw["target_modules"]),
                use_rslora=bool(raw.get("use_rslora", False)),
                rank_pattern=_pattern(raw, "rank_pattern", _positive_int),
                alpha_pattern=_pattern(raw, "alpha_pattern", float),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"{source}: bad or missing LoRA field: {err!r}") from err

    @property
    def folds_scaling(self) -> bool:
        """Per-module ranks or alphas: each module's scaling is folded into its B at load."""
        return bool(self.rank_pattern or self.alpha_pattern)


def _positive_int(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"rank must be a positive integer, got {v!r}")
    return v


def _pattern(raw: Mapping, name: str, convert) -> Mapping:
    """A rank_pattern / alpha_pattern as a read-only dict, keeping the file's key order (the order
    PEFT's first-match rule sees when it loads the adapter)."""
    return MappingProxyType({str(k): convert(v) for k, v in (raw.get(name) or {}).items()})


def _targets(v) -> Union[str, tuple[str, ...]]:
    if isinstance(v, str):
        return v
    if isinstance(v, (list, tuple)) and v and all(isinstance(t, str) for t in v):
        return tuple(v)
    raise ValueError(f"target_modules must be a string or a non-empty list of names, got {v!r}")


def read_peft_files(path: Union[str, Path]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a PEFT adapter directory without interpreting its config: (the parsed JSON, its tensors).

    The file-level half of :func:`read_peft_adapter`, for loaders that interpret more of the config
    than :class:`AdapterConfig` does (chapter 09's MoE loader reads ``target_parameters``).
    Raises:
        FileNotFoundError: the directory, ``adapter_config.json`` or ``adapter_model.safetensors``
        is missing (the message names the file).
        ValueError: malformed JSON, or a file that safetensors cannot read.
    """
    path = Path(path)
    config_file, weights_file = path / CONFIG_NAME, path / WEIGHTS_NAME
    for f in (config_file, weights_file):
        if not f.is_file():
            raise FileNotFoundError(f"PEFT adapter file not found: {f}")
    try:
        raw = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_file}: malformed JSON: {err}") from err
    try:
        tensors = load_file(str(weights_file), device="cpu")
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{weights_file}: not a readable safetensors file: {err}") from err
    return raw, tensors


def read_peft_adapter(path: Union[str, Path]) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """Read a PEFT adapter directory: its config and its tensors (on the CPU, dtype as saved).

    Raises:
        FileNotFoundError: the directory, ``adapter_config.json`` or ``adapter_model.safetensors``
        is missing (the message names the file).
        ValueError: malformed JSON, a bad config (see :meth:`AdapterConfig.from_dict`), or a file
        that safetensors cannot read.
    """
    raw, tensors = read_peft_files(path)
    return AdapterConfig.from_dict(raw, str(Path(path) / CONFIG_NAME)), tensors


class LoRAKey(NamedTuple):
    """One parsed tensor name: ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``
    -> LoRAKey(path="model.layers.3.self_attn.q_proj", layer=3, module="q_proj", matrix="A")."""

    path: str  # the module's name in the base model: what PEFT matches target_modules against
    layer: Optional[int]  # decoder layer index, None for modules outside the layers (lm_head)
    module: str  # last component of the path: the projection name
    matrix: str  # "A" or "B"


def layer_index(path: str) -> Optional[int]:
    """Decoder layer of a module path: "model.layers.3.mlp.up_proj" -> 3; "lm_head" -> None."""
    m = _LAYER.search(path)
    return None if m is None else int(m.group(1))


def parse_lora_key(key: str) -> LoRAKey:
    """Parse one safetensors key of a PEFT LoRA adapter (the ``base_model.model.`` prefix optional).

    Raises:
        ValueError: anything other than ``<path>.lora_A.weight`` / ``<path>.lora_B.weight``
        (DoRA's ``lora_magnitude_vector``, embedding LoRA's ``lora_embedding_A``, biases, an
        in-memory key with an adapter name such as ``lora_A.default.weight``).
    """
    m = _KEY.match(key)
    if m is None:
        raise ValueError(f"unrecognised PEFT LoRA key {key!r}: expected "
                         "'base_model.model.<module path>.lora_A.weight' or '.lora_B.weight'")
    path = m.group("path")
    return LoRAKey(path, layer_index(path), path.rsplit(".", 1)[-1], m.group("matrix"))


def targets_module(target_modules: Union[str, Sequence[str]], path: str) -> bool:
    """Does ``target_modules`` select the module at ``path``? PEFT's rules
    (``check_target_module_exists``, without exclude_modules / layers_to_transform):

    Semantics:
        str "all-linear" (any case)  -> True (every linear layer; the engine's modules are all linear)
        other str                   -> re.fullmatch(target_modules, path)        (a regex, full match)
        list                        -> path in list or any(path.endswith("." + t) for t in list)
    Example: ["q_proj"] selects "model.layers.0.self_attn.q_proj"; the regex "q_proj" does not
    (full match), but ".*q_proj" does.
    """
    if isinstance(target_modules, str):
        return target_modules.lower() == "all-linear" or re.fullmatch(target_modules, path) is not None
    return path in target_modules or any(path.endswith("." + t) for t in target_modules)


def projection_map(modules: Sequence[ModuleSpec]) -> dict[str, tuple[str, int]]:
    """Projection name -> (engine module name, part index), from the engine's module specs.

    Fused: ModuleSpec("qkv_proj", ..., (q, k, v)) -> {"q_proj": ("qkv_proj", 0), "k_proj": (.., 1),
    "v_proj": (.., 2)}; per projection: ModuleSpec("q_proj", ...) -> {"q_proj": ("q_proj", 0)}.

    Raises:
        ValueError: a fused spec whose number of out_features differs from its parts, or two specs
        that serve the same projection.
    """
    out: dict[str, tuple[str, int]] = {}
    for spec in modules:
        parts = FUSED_PARTS.get(spec.name, (spec.name,))
        if len(parts) != spec.stack_num:
            raise ValueError(f"module {spec.name!r} stacks {parts} but has out_features {spec.out_features}")
        for i, proj in enumerate(parts):
            if proj in out:
                raise ValueError(f"projection {proj!r} is served by both {out[proj][0]!r} and {spec.name!r}")
            out[proj] = (spec.name, i)
    return out


def resolve_target_modules(
    target_modules: Union[str, Sequence[str]],
    engine_modules: Sequence[str],
    num_layers: int,
    module_paths: Mapping[str, str] = LLAMA_MODULE_PATHS,
) -> list[str]:
    """The engine module names (fused or not) that an adapter's ``target_modules`` selects in at
    least one layer, in the engine's order; what a server unions over its adapters to decide which
    pool buffers to allocate (SGLang ``lora_manager.py``).

    ``module_paths`` maps a projection to its path template in the base model (``{layer}`` is
    replaced), because PEFT matches on full paths: the regex ``.*\\.mlp\\..*`` selects gate/up/down.
    Example: ["q_proj", "v_proj"] with engine ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    -> ["qkv_proj"].
    """
    def selected(proj: str) -> bool:
        template = module_paths.get(proj)
        return template is not None and any(
            targets_module(target_modules, template.format(layer=i)) for i in range(num_layers))

    return [m for m in engine_modules if any(selected(p) for p in FUSED_PARTS.get(m, (m,)))]


def pattern_key(patterns: Sequence[str], path: str) -> Optional[str]:
    """The rank_pattern / alpha_pattern key that applies to ``path``, PEFT's ``get_pattern_key``:
    the FIRST key (in the file's order) that matches a dot-separated suffix of the path as a regex,
    ``re.match(rf"(.*\\.)?({key})$", path)``; None when no key matches.

    Examples for "model.layers.1.mlp.up_proj": "up_proj" and "layers.1.mlp.up_proj" match,
    "p_proj" does not (suffixes start at a dot), "layers\\.[01]\\.mlp\\.up_proj" matches (a regex).
    The first match wins, not the most specific, and PEFT writes the patterns with sorted keys: with
    {"layers.1.mlp.gate_proj": 2, "gate_proj": 5} PEFT trains layer 1's gate at r=2 but reloads it at
    r=5 ("gate_proj" sorts first) and fails on the shapes; so does :func:`load_peft_adapter`.
    """
    return next((k for k in patterns if re.match(rf"(.*\.)?({k})$", path)), None)


def module_rank_alpha(config: AdapterConfig, path: str) -> tuple[int, float]:
    """(r, alpha) that PEFT gives the module at ``path``: pattern values, else the global ones."""
    r_key = pattern_key(list(config.rank_pattern), path)
    a_key = pattern_key(list(config.alpha_pattern), path)
    r = config.r if r_key is None else config.rank_pattern[r_key]
    alpha = config.lora_alpha if a_key is None else config.alpha_pattern[a_key]
    return r, alpha


# ---------------------------------------------------------------------------------------------
# Loading: pair the tensors, validate everything, then pack into the pool's layout.
# ---------------------------------------------------------------------------------------------

_Pairs = dict[tuple[Optional[int], str], dict]  # (layer, projection) -> {"path", "A", "B"}


def _pair_tensors(config: AdapterConfig, tensors: Mapping[str, torch.Tensor], source: str) -> _Pairs:
    """Group A and B per (layer, projection); every key parsed, targeted by the config, 2-D, paired."""
    pairs: _Pairs = {}
    for key, t in tensors.items():
        try:
            k = parse_lora_key(key)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None
        if not targets_module(config.target_modules, k.path):
            raise ValueError(f"{source}: {key!r} is not selected by target_modules="
                             f"{config.target_modules!r}: config and weights disagree")
        if t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{source}: {key!r} must be a 2-D float tensor, got {t.dtype} {list(t.shape)}")
        entry = pairs.setdefault((k.layer, k.module), {"path": k.path})
        if k.matrix in entry:
            raise ValueError(f"{source}: two lora_{k.matrix} tensors for {k.path!r}")
        entry[k.matrix] = t
    for entry in pairs.values():
        missing = {"A", "B"} - entry.keys()
        if missing:
            raise ValueError(f"{source}: {entry['path']!r} has no lora_{missing.pop()} tensor")
    if not pairs:
        raise ValueError(f"{source}: no LoRA tensors")
    return pairs


def _drop_unserved(pairs: _Pairs, served: Mapping[str, tuple[str, int]], strict: bool, source: str) -> _Pairs:
    """Remove modules the engine has no buffer for: strict -> ValueError naming them; lenient -> ONE
    warning listing every skipped weight (never silent)."""
    skipped = sorted(e["path"] for (layer, proj), e in pairs.items() if layer is None or proj not in served)
    if not skipped:
        return pairs
    names = sorted({p.rsplit(".", 1)[-1] for p in skipped})
    if strict:
        raise ValueError(f"{source}: target modules {names} are not served by this engine (it serves "
                         f"{sorted(served)}); {len(skipped)} modules: {skipped}")
    keys = [f"{p}.lora_{m}.weight" for p in skipped for m in "AB"]
    warnings.warn(f"{source}: skipping {len(keys)} weights of modules {names} that this engine does "
                  f"not serve: {keys}", UserWarning, stacklevel=3)
    return {k: e for k, e in pairs.items() if k[0] is not None and k[1] in served}


def _check_shapes(pairs: _Pairs, config: AdapterConfig, specs: Mapping[str, ModuleSpec],
                  served: Mapping[str, tuple[str, int]], num_layers: int, source: str) -> None:
    """Every layer in range; A [r_m, in] and B [out, r_m] with r_m PEFT's rank for that module."""
    for (layer, proj), e in sorted(pairs.items()):
        if not 0 <= layer < num_layers:
            raise ValueError(f"{source}: {e['path']!r}: layer {layer} out of range (model has {num_layers})")
        name, part = served[proj]
        r, _ = module_rank_alpha(config, e["path"])
        want_A, want_B = (r, specs[name].in_features), (specs[name].out_features[part], r)
        if tuple(e["A"].shape) != want_A or tuple(e["B"].shape) != want_B:
            raise ValueError(f"{source}: {e['path']!r}: lora_A {list(e['A'].shape)} and lora_B "
                             f"{list(e['B'].shape)}, expected {list(want_A)} and {list(want_B)} (r={r})")


def _padded_part(e: dict, config: AdapterConfig, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One module's (A [rank, in], B [out, rank]): zero-padded past its own rank, its own scaling
    folded into B (fp32 multiply) when the adapter has rank/alpha patterns."""
    A, B = e["A"], e["B"]
    r, alpha = module_rank_alpha(config, e["path"])
    if config.folds_scaling:
        B = B.float() * lora_scaling(alpha, r, config.use_rslora)
    A_pad, B_pad = A.new_zeros(rank, A.shape[1], dtype=dtype), B.new_zeros(B.shape[0], rank, dtype=dtype)
    A_pad[:r], B_pad[:, :r] = A, B
    return A_pad, B_pad


def _pack(pairs: _Pairs, config: AdapterConfig, modules: Sequence[ModuleSpec], rank: int,
          num_layers: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, engine module) -> (A [stack_num*rank, in], B [out_total, rank]); a missing part is zeros
    (stack_lora_parts), a module with no part at all is left out (the pool zero-fills it)."""
    dtype = _common_dtype(pairs)
    weights = {}
    for layer in range(num_layers):
        for spec in modules:
            entries = [pairs.get((layer, p)) for p in FUSED_PARTS.get(spec.name, (spec.name,))]
            if all(e is None for e in entries):
                continue
            parts = [None if e is None else _padded_part(e, config, rank, dtype) for e in entries]
            A_parts = [None if p is None else p[0] for p in parts]
            B_parts = [None if p is None else p[1] for p in parts]
            weights[(layer, spec.name)] = stack_lora_parts(A_parts, B_parts, spec.out_features)
    return weights


def _common_dtype(pairs: _Pairs) -> torch.dtype:
    dtype = None
    for e in pairs.values():
        for t in (e["A"], e["B"]):
            dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
    return dtype


def load_peft_adapter(
    path: Union[str, Path],
    modules: Sequence[ModuleSpec],
    num_layers: int,
    max_lora_rank: int,
    *,
    strict: bool = True,
    uid: Hashable,
) -> LoRAAdapter:
    """Read, validate and convert a PEFT adapter into the pool's layout (``LoRAAdapter``).

    ``modules`` are the engine's pool modules: fused ("qkv_proj", "gate_up_proj") or per projection
    ("q_proj", ...); the result's weights use the same names. Then ``pool.load_to_slot(adapter, slot)``.

    Semantics:
        plain adapter:  rank = r;  scaling = alpha/r (alpha/sqrt(r) with use_rslora);  A, B as saved
        rank_pattern or alpha_pattern present:  rank = max module rank;  scaling = 1.0;
            B_m *= alpha_m / r_m (or / sqrt(r_m)) per module; A_m, B_m zero-padded to rank
        fused module: parts packed at ``rank`` (part i = A rows [i*rank, (i+1)*rank), B rows
            slice_i); a missing part is zeros; gate before up.
    Tensors keep the file's dtype (one common dtype), on the CPU.

    Everything is checked before anything is returned, so a rejected adapter never reaches the pool.
    Raises:
        FileNotFoundError: a missing file (named).
        ValueError: malformed JSON or safetensors, DoRA or another refused feature, an unrecognised
        key, a weight outside the config's target_modules, a lora_A without lora_B, a layer out of
        range, a wrong shape, a rank above ``max_lora_rank``, a uid of None, nothing left to serve;
        with ``strict``, target modules the engine does not serve (all named). Lenient mode skips
        those weights instead, with one ``UserWarning`` that lists every skipped weight.
    """
    if uid is None:
        raise ValueError("uid None is reserved for the base model; give the adapter a real uid")
    config, tensors = read_peft_adapter(path)
    return convert_peft_adapter(config, tensors, modules, num_layers, max_lora_rank, strict=strict, uid=uid,
                                source=str(Path(path)))


def convert_peft_adapter(
    config: AdapterConfig,
    tensors: Mapping[str, torch.Tensor],
    modules: Sequence[ModuleSpec],
    num_layers: int,
    max_lora_rank: int,
    *,
    strict: bool = True,
    uid: Hashable,
    source: str,
) -> LoRAAdapter:
    """The conversion half of :func:`load_peft_adapter` (same semantics and errors), on a config and
    tensors already read; ``source`` names the adapter in every error."""
    if uid is None:
        raise ValueError("uid None is reserved for the base model; give the adapter a real uid")
    served = projection_map(modules)
    pairs = _drop_unserved(_pair_tensors(config, tensors, source), served, strict, source)
    if not pairs:
        raise ValueError(f"{source}: none of the adapter's modules is served by this engine")
    _check_shapes(pairs, config, {s.name: s for s in modules}, served, num_layers, source)
    ranks = {module_rank_alpha(config, e["path"])[0] for e in pairs.values()}
    rank = max(ranks) if config.folds_scaling else config.r
    if rank > max_lora_rank:
        raise ValueError(f"{source}: adapter rank {rank} exceeds max_lora_rank {max_lora_rank} "
                         "(fixed when the pool was allocated)")
    scaling = 1.0 if config.folds_scaling else lora_scaling(config.lora_alpha, config.r, config.use_rslora)
    return LoRAAdapter(uid=uid, rank=rank, scaling=scaling,
                       weights=_pack(pairs, config, modules, rank, num_layers))
