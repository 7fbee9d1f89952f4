# %% [markdown]
# # 06 · Loading PEFT adapters
#
# Chapters 02 to 05 built what a server needs to *run* many adapters at once: the shrink and expand
# operations, the packed q/k/v and gate/up layout, and a memory pool whose slots are filled and
# emptied while requests come and go. Every adapter so far was a set of random tensors made in the
# notebook. Real adapters come from training, and almost all of them from Hugging Face **PEFT**: a
# directory with a JSON config and a safetensors file. This chapter turns such a directory into the
# contents of a pool slot, and then lets PEFT itself judge the result: the same mixed batch run
# through PEFT's own model and through our pool must give the same outputs, projection by projection
# and at the logits.
#
# Loading is where conventions meet. The file names its tensors one way, the engine another; the
# config says which modules the adapter touches in a small language of its own; the scaling has two
# formulas; some adapters carry a different rank for every module; q/k/v and gate/up must be stacked
# in one agreed order with missing parts filled. Each of these is translated **once, at load time**,
# never on the hot path; and nothing is written into the pool until every check has passed.
#
# **What you will learn**
# - The PEFT format: the fields of `adapter_config.json` that serving reads (`r`, `lora_alpha`,
#   `target_modules`, `use_rslora`, `use_dora`, `rank_pattern`, `alpha_pattern`) and the safetensors
#   key names, on real adapters this notebook creates with `peft` (no downloads).
# - PEFT's rules for `target_modules`: a list (names or dot-separated suffixes), a string (a regex
#   that must match the whole module path) or `"all-linear"`.
# - Scaling: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA, and what reading an rsLoRA adapter with
#   the wrong formula does; per-module ranks and alphas, folded into B at load.
# - The fused layout with real weights: q/k/v and gate/up stacked (gate first), a missing part as
#   zeros.
# - Validation before any buffer is touched: strict and lenient modes, DoRA refused, a rank above
#   the pool's maximum refused, and the pool's full state unchanged after a rejected load.
# - The judge: four PEFT adapters in one pool, a mixed batch served through forward hooks, compared
#   with PEFT's own mixed-batch forward.
#
# **Exercises** (each followed by its grader cell): ch06.1 `parse_lora_key`, ch06.2
# `targets_module`, ch06.3 `module_scaling`, ch06.4 `pack_fused_module`.
#
# As before, each answer cell is graded on its own in a fresh process that has imported `reference`
# and run `import math, torch`: keep every answer self-contained. The text's demonstrations use the
# book's reference package (`reference/adapters.py`), never your answers.

# %%
import copy
import dataclasses
import inspect
import json
import math
import tempfile
import time
import warnings
from pathlib import Path

import reference  # first: it fixes the device choice before anything imports triton
import torch
from safetensors.torch import load_file, save_file

import graders
from reference import adapters
from reference.adapters import (FUSED_PARTS, load_peft_adapter, module_rank_alpha, pattern_key, read_peft_adapter,
                                resolve_target_modules, targets_module)
from reference.batch_info import build_batch_info
from reference.lora_math import lora_scaling, projection_shapes
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec, snapshot_diff
from reference.peft_hooks import pool_lora_hooks

import peft
import transformers

transformers.logging.set_verbosity_error()
t_start = time.perf_counter()
print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}")

# %% [markdown]
# ## 1. A tiny Llama and four real adapters
#
# The base model is a Llama built from a config with random weights: two layers, grouped-query
# attention (fewer key/value heads than query heads, so k and v are narrower than q), small enough
# to run instantly on a CPU. Nothing is downloaded. The projection shapes come from the config:

# %%
CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
LAYERS = CFG["num_hidden_layers"]
SHAPES = projection_shapes(CFG)  # projection -> (in_features, out_features)
torch.manual_seed(0)
base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()
for proj, (d_in, d_out) in SHAPES.items():
    print(f"{proj:9s} {d_in:3d} -> {d_out:3d}")

# %% [markdown]
# Four adapters, made and saved by PEFT exactly as a training script would, each chosen to exercise
# one rule of this chapter:
#
# | name  | target_modules                       | what it tests                                 |
# |-------|--------------------------------------|-----------------------------------------------|
# | `qv`  | a list: q and v                      | a fused q/k/v slot with no k part             |
# | `mlp` | a regex string over the MLP          | the regex language; gate/up order             |
# | `rs`  | `"all-linear"`, `use_rslora=True`    | rsLoRA scaling; every projection              |
# | `pat` | a list, plus `rank_pattern` and `alpha_pattern` | per-module ranks and alphas        |
#
# PEFT initialises B to zeros by default, so a fresh adapter changes nothing and any comparison would
# pass vacuously; `init_lora_weights=False` draws B at random too, standing in for training. The
# directory is a `tempfile.TemporaryDirectory`, removed at the end of the notebook.

# %%
ADAPTERS = {
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=6, lora_alpha=12, target_modules=r".*\.mlp\.(gate|up|down)_proj"),
    "rs": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "pat": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
                rank_pattern={"k_proj": 2, "layers.1.self_attn.o_proj": 7},
                alpha_pattern={"down_proj": 3, "q_proj": 20}),
}
workdir = tempfile.TemporaryDirectory(prefix="ch06-adapters-")
root = Path(workdir.name)
for seed, (name, kw) in enumerate(ADAPTERS.items()):
    torch.manual_seed(100 + seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trained = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw))
        trained.save_pretrained(root / name)
print({name: sorted(p.name for p in (root / name).iterdir()) for name in ADAPTERS})

# %% [markdown]
# PEFT's own model with all four adapters loaded is the judge of section 8. It is built once, here,
# because section 5 also asks it what it thinks.

# %%
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(base), root / "qv", adapter_name="qv")
    for name in ADAPTERS:
        if name != "qv":
            peft_model.load_adapter(root / name, adapter_name=name)
peft_model.eval()
print(type(peft_model).__name__, "with adapters", list(peft_model.peft_config))

# %% [markdown]
# ## 2. The format: a config and named tensors
#
# `adapter_config.json` is PEFT's `LoraConfig` written out: dozens of fields, most of them about
# training. Serving reads a handful; a few others must be *checked* because the book's kernels
# cannot serve them (`use_dora`, `lora_bias`, `modules_to_save`):

# %%
raw = json.loads((root / "qv" / "adapter_config.json").read_text())
print(f"{len(raw)} fields in adapter_config.json; the ones a server reads or refuses:")
for field in ("peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "rank_pattern",
              "alpha_pattern", "lora_bias", "modules_to_save"):
    print(f"  {field:16s} {raw.get(field)!r}")

# %% [markdown]
# `adapter_model.safetensors` holds two matrices per adapted module, named after the module's path in
# the base model with PEFT's wrapper prefix `base_model.model.` in front and `lora_A.weight` /
# `lora_B.weight` behind. A is `[r, in_features]`, B is `[out_features, r]`, exactly the shapes of
# chapter 01. The saved names carry no adapter name: PEFT's in-memory `state_dict` says
# `lora_A.default.weight`, the file says `lora_A.weight`.

# %%
tensors_qv = load_file(root / "qv" / "adapter_model.safetensors")
print(len(tensors_qv), "tensors")
for key, t in sorted(tensors_qv.items()):
    print(f"  {key:62s} {str(list(t.shape)):9s} {t.dtype}")

# %% [markdown]
# ## 3. From a key to (layer, module, matrix)
#
# A loader reads every key, and every key must mean something: which decoder layer, which
# projection, A or B. A key it cannot read is an error, not something to skip: a DoRA magnitude
# vector (`...q_proj.lora_magnitude_vector`), a LoRA bias (`...lora_B.bias`) or an in-memory key
# with an adapter name (`...lora_A.default.weight`) all mean an adapter the kernels would serve
# wrongly if they ignored the extra tensor.
#
# ### Exercise ch06.1: `parse_lora_key`
#
# Write `parse_lora_key(key)` returning `(layer, module, matrix)`:
# - A valid key is `<path>.lora_A.weight` or `<path>.lora_B.weight`, optionally preceded by
#   `base_model.model.`; `<path>` is one or more dot-separated components made of letters, digits
#   and underscores.
# - `layer`: the int `N` of the first `layers.N.` in the path (the component `layers` followed by a
#   number and then another component), or `None` when there is none (`lm_head`, but also
#   `sublayers.3.`, where `layers` is not a whole component); `module`: the path's last component;
#   `matrix`: `"A"` or `"B"`.
# - Raise `ValueError` for anything else: an empty component (`model..q_proj`), a character other
#   than letters, digits and underscores (`self-attn`), a matrix name inside a longer component
#   (`my_lora_A`), an adapter name before `weight`.
#
# Example: `"base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"` gives
# `(3, "q_proj", "A")`; `"model.layers.2.mlp.experts.5.up_proj.lora_B.weight"` gives
# `(2, "up_proj", "B")`.

# %% exercise="ch06.1" role="answer"
import re


def parse_lora_key(key):
    """(layer or None, module, "A" | "B") of one PEFT safetensors key; ValueError otherwise."""
    ### BEGIN SOLUTION
    m = re.match(r"^(?:base_model\.model\.)?(?P<path>\w+(?:\.\w+)*)\.lora_(?P<matrix>[AB])\.weight$", key)
    if m is None:
        raise ValueError(f"not a PEFT LoRA key: {key!r}")
    path = m.group("path")
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", path)
    return (None if layer is None else int(layer.group(1))), path.rsplit(".", 1)[-1], m.group("matrix")
    ### END SOLUTION


# %% exercise="ch06.1" role="test"
graders.check("ch06.1", parse_lora_key)

# %% [markdown]
# The reference (`reference/adapters.py`, shown once your check above passed) returns a named tuple
# that also keeps the module's full path, because the next two rules match on it:

# %%
graders.show_reference("ch06.1")
print(adapters.parse_lora_key("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"))

# %% [markdown]
# ## 4. Which modules does an adapter target?
#
# `target_modules` decides which modules get an adapter when PEFT builds the model, and a loader must
# apply the same rules: to know which pool buffers an adapter needs (SGLang allocates buffers for the
# union of its adapters' targets at start-up), and to reject files whose tensors the config does not
# announce. PEFT's rules (`check_target_module_exists` in `peft/tuners/tuners_utils.py`) are not
# the ones most people guess:
#
# ```
# list of names      path == name  or  path ends with "." + name     ("q_proj", "self_attn.q_proj")
# string             re.fullmatch(string, path)                       (a regex over the WHOLE path)
# "all-linear"       every linear layer except the output layer       (any letter case)
# ```
#
# So `["q_proj"]` selects `model.layers.0.self_attn.q_proj`, but the *string* `"q_proj"` selects
# nothing (it does not match the whole path) while `".*q_proj"` does; `["proj"]` selects nothing (a
# name is a whole component, not a substring). PEFT writes `"all-linear"` out as the list of full
# paths it resolved when it saved the adapter:

# %%
saved = json.loads((root / "rs" / "adapter_config.json").read_text())["target_modules"]
print(f"'all-linear' was saved as {len(saved)} full paths, e.g. {sorted(saved)[:2]}; lm_head among them: "
      f"{any(p.endswith('lm_head') for p in saved)}")

# %% [markdown]
# ### Exercise ch06.2: `targets_module`
#
# Write `targets_module(target_modules, path)` returning a `bool`: does `target_modules` (a list of
# strings, or a string) select the module at `path` (e.g. `"model.layers.0.self_attn.q_proj"`)?
# Use the three rules above: `"all-linear"` in any letter case gives `True` (the engine only asks
# about its linear projections); any other string is a regex that must match the whole path; a list
# entry selects the path when it equals the path or the path ends with `"." + entry`.

# %% exercise="ch06.2" role="answer"
import re


def targets_module(target_modules, path):
    """PEFT's target_modules rule for one module path; returns a bool."""
    ### BEGIN SOLUTION
    if isinstance(target_modules, str):
        return target_modules.lower() == "all-linear" or re.fullmatch(target_modules, path) is not None
    return any(path == t or path.endswith("." + t) for t in target_modules)
    ### END SOLUTION


# %% exercise="ch06.2" role="test"
graders.check("ch06.2", targets_module)

# %% [markdown]
# The reference (shown once your check passed), and PEFT's own function as the judge of the rule on
# a few tricky targets, over every linear projection path of the model:

# %%
graders.show_reference("ch06.2")
from peft.tuners.tuners_utils import check_target_module_exists

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
PATHS = [f"model.layers.{i}.{'self_attn' if p in ATTN else 'mlp'}.{p}" for i in range(LAYERS) for p in SHAPES]
tricky = [["q_proj", "v_proj"], "q_proj", ".*q_proj", ["proj"], ["p_proj"], ["layers.1.self_attn.o_proj"],
          r".*\.mlp\.(gate|up|down)_proj", r".*layers\.1\..*", r".*layers\.1", r".*q_proj|v_proj", ["all-linear"]]
for targets in tricky:
    ours = [adapters.targets_module(targets, p) for p in PATHS]
    theirs = [bool(check_target_module_exists(peft.LoraConfig(target_modules=targets), p)) for p in PATHS]
    print(f"{str(targets):34s} selects {sum(ours):2d} of {len(PATHS)} paths; agrees with PEFT: {ours == theirs}")

# %% [markdown]
# An engine does not see projections one by one: it runs fused modules. `resolve_target_modules`
# maps an adapter's targets to the engine modules it needs (a fused module is needed when any of its
# parts is targeted); a server takes the union over its adapters when it allocates the pool:

# %%
FUSED = (ModuleSpec("qkv_proj", SHAPES["q_proj"][0], tuple(SHAPES[p][1] for p in FUSED_PARTS["qkv_proj"])),
         ModuleSpec("o_proj", SHAPES["o_proj"][0], (SHAPES["o_proj"][1],)),
         ModuleSpec("gate_up_proj", SHAPES["gate_proj"][0], tuple(SHAPES[p][1] for p in FUSED_PARTS["gate_up_proj"])),
         ModuleSpec("down_proj", SHAPES["down_proj"][0], (SHAPES["down_proj"][1],)))
engine_names = [s.name for s in FUSED]
for name in ADAPTERS:
    config, _ = read_peft_adapter(root / name)
    print(f"{name:4s} needs {resolve_target_modules(config.target_modules, engine_names, LAYERS)}")

# %% [markdown]
# ## 5. Scaling: alpha / r, alpha / sqrt(r), and a rank per module
#
# The delta of a LoRA module is `s * x A^T B^T`. Plain LoRA uses `s = alpha / r`; rank-stabilised
# LoRA (rsLoRA, `use_rslora=True`) uses `s = alpha / sqrt(r)`, which keeps the delta's size steady as
# r grows. The config says which one applies, and a loader that ignores `use_rslora` raises no error
# at all: it serves the adapter `sqrt(r)` times too weakly. For the four adapters:

# %%
print(f"{'name':5s} {'r':>3s} {'alpha':>6s} {'rsLoRA':>7s} {'alpha/r':>8s} {'alpha/sqrt(r)':>14s} {'used':>6s}")
for name in ADAPTERS:
    c, _ = read_peft_adapter(root / name)
    used = lora_scaling(c.lora_alpha, c.r, c.use_rslora)
    print(f"{name:5s} {c.r:3d} {c.lora_alpha:6g} {str(c.use_rslora):>7s} {c.lora_alpha / c.r:8.3f} "
          f"{c.lora_alpha / math.sqrt(c.r):14.3f} {used:6.3f}")
rs_cfg, _ = read_peft_adapter(root / "rs")
print(f"read with alpha/r, the rsLoRA adapter would be {lora_scaling(rs_cfg.lora_alpha, rs_cfg.r, True) / lora_scaling(rs_cfg.lora_alpha, rs_cfg.r, False):.3f}"
      f" times too weak (sqrt(r) = {math.sqrt(rs_cfg.r):.3f}); PEFT's own scaling of layer 0's q_proj for 'rs': "
      f"{peft_model.base_model.model.model.layers[0].self_attn.q_proj.scaling['rs']:.3f}")

# %% [markdown]
# `rank_pattern` and `alpha_pattern` give some modules their own rank or alpha. Each is a dict from
# a pattern to a value; PEFT's rule (`get_pattern_key` in `peft/utils/other.py`) takes **the first
# key, in the dict's order, that matches a dot-separated suffix of the module path as a regex**:
# `re.match(rf"(.*\.)?({key})$", path)`. So `"k_proj"` and `"layers.1.self_attn.o_proj"` match as
# expected, `"p_proj"` does not match `up_proj` (a suffix starts at a dot), and with overlapping keys
# the first one wins, not the most specific. The scaling of a module uses its own rank and alpha.
# The `pat` adapter, as PEFT built it and as the reference reads its file:

# %%
pat_cfg, _ = read_peft_adapter(root / "pat")
print("rank_pattern", dict(pat_cfg.rank_pattern), " alpha_pattern", dict(pat_cfg.alpha_pattern))
print(f"{'module path':34s} {'PEFT r':>6s} {'ours':>5s} {'PEFT scaling':>12s} {'ours':>7s}")
for path, mod in peft_model.base_model.model.named_modules():
    if isinstance(mod, peft.tuners.lora.LoraLayer) and "pat" in mod.r:
        r, alpha = module_rank_alpha(pat_cfg, path)
        print(f"{path:34s} {mod.r['pat']:6d} {r:5d} {mod.scaling['pat']:12.4f} {lora_scaling(alpha, r, False):7.4f}")

# %% [markdown]
# "The first key in the dict's order" has a consequence that PEFT itself trips over: it writes the
# config with **sorted keys** (`json.dump(..., sort_keys=True)`), so a file's order need not be the
# order the training script gave. A tiny model with a single `gate_proj` per layer, an adapter with
# `rank_pattern = {"layers.1.mlp.gate_proj": 2, "gate_proj": 5}` (the specific key first), saved and
# loaded again:

# %%
class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"mlp": torch.nn.ModuleDict(
            {"gate_proj": torch.nn.Linear(8, 8)})}) for _ in range(2))


surprise = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj"],
                           rank_pattern={"layers.1.mlp.gate_proj": 2, "gate_proj": 5})
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    created = peft.get_peft_model(TinyMLP(), surprise)
    created.save_pretrained(root / "surprise")
ranks_created = {i: created.base_model.model.layers[i]["mlp"]["gate_proj"].r["default"] for i in range(2)}
print("at creation, ranks by layer:", ranks_created)
print("saved rank_pattern:", json.loads((root / "surprise" / "adapter_config.json").read_text())["rank_pattern"])
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft.PeftModel.from_pretrained(TinyMLP(), root / "surprise")
    print("reloaded without error")
except RuntimeError as err:
    first = next(line.strip() for line in str(err).splitlines() if "size mismatch" in line)
    print("reloading fails:", first[:190], "...")

# %% [markdown]
# At creation layer 1's gate got rank 2 (its key came first); in the file `"gate_proj"` sorts first,
# so PEFT reloading the same adapter builds rank 5 everywhere and the saved rank-2 tensors no longer
# fit. The book's loader reads the file's order too and refuses the shapes in the same way: the
# rule is PEFT's, the lesson is to keep overlapping pattern keys out of adapter configs.
#
# ### Exercise ch06.3: `module_scaling`
#
# Write `module_scaling(config, path)` returning `(r, scaling)` for the module at `path`:
# - `config` is a dict as parsed from `adapter_config.json`: `r`, `lora_alpha`, and optionally
#   `use_rslora` (default `False`), `rank_pattern` and `alpha_pattern` (dicts, possibly empty or
#   absent).
# - The module's rank is the value of the first `rank_pattern` key (in the dict's order) with
#   `re.match(rf"(.*\.)?({key})$", path)`, else `r`; its alpha the same with `alpha_pattern`, else
#   `lora_alpha`.
# - `scaling = alpha / sqrt(rank)` when `use_rslora`, else `alpha / rank`, as a float; the rank as an
#   int. Raise `ValueError` when the module's rank is below 1 (0 or negative; the global `r` does not
#   matter when a pattern gives the module its own rank).

# %% exercise="ch06.3" role="answer"
import math
import re


def module_scaling(config, path):
    """(rank, scaling) of the module at path under PEFT's rank_pattern / alpha_pattern / rsLoRA rules."""
    ### BEGIN SOLUTION
    def first_match(patterns, default):
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", path):
                return value
        return default

    r = first_match(config.get("rank_pattern"), config["r"])
    alpha = first_match(config.get("alpha_pattern"), config["lora_alpha"])
    if r < 1:
        raise ValueError(f"rank must be positive, got {r}")
    return r, float(alpha / math.sqrt(r) if config.get("use_rslora", False) else alpha / r)
    ### END SOLUTION


# %% exercise="ch06.3" role="test"
graders.check("ch06.3", module_scaling)

# %% [markdown]
# The reference splits it in two, `pattern_key` and `module_rank_alpha` (the scaling is chapter 01's
# `lora_scaling`); shown once your check passed:

# %%
graders.show_reference("ch06.3")

# %% [markdown]
# **Folding.** A pool slot has *one* rank and *one* scaling (`lora_ranks[slot]` and
# `scalings[slot]` of chapter 02's `LoRABatchInfo`): the kernels cannot apply a different scaling per
# module. An adapter with patterns therefore gets, at load time, each module's own scaling multiplied
# into its B, the slot scaling `1.0`, and the slot rank set to its largest module rank; smaller
# modules are zero-padded past their rank (the kernels multiply the padding by zero columns of B).
# The loaded `pat` adapter against its file:

# %%
pat = load_peft_adapter(root / "pat", FUSED, LAYERS, max_lora_rank=8, uid="pat")
pat_file = load_file(root / "pat" / "adapter_model.safetensors")
print(f"slot rank {pat.rank}, slot scaling {pat.scaling}")
for (layer, module), (A, B) in sorted(pat.weights.items()):
    spec = next(s for s in FUSED if s.name == module)
    for i, proj in enumerate(FUSED_PARTS.get(module, (module,))):
        path = f"model.layers.{layer}.{'self_attn' if proj in ATTN else 'mlp'}.{proj}"
        key = f"base_model.model.{path}.lora_B.weight"
        rows = slice(spec.slice_offsets[i], spec.slice_offsets[i + 1])
        if key not in pat_file:
            print(f"  layer {layer} {proj:9s} not in the file: its A rows and B rows are zero: "
                  f"{not A[i * pat.rank:(i + 1) * pat.rank].any() and not B[rows].any()}")
            continue
        r, alpha = module_rank_alpha(pat_cfg, path)
        s = lora_scaling(alpha, r, pat_cfg.use_rslora)
        err = (B[rows, :r] - s * pat_file[key]).abs().max().item()
        print(f"  layer {layer} {proj:9s} r {r}  s {s:6.3f}  max |B - s * B_file| {err:.1e}  "
              f"padding zero: {not B[rows, r:].any()}")

# %% [markdown]
# ## 6. The fused layout, with real weights
#
# Chapter 04's packed layout, now filled from a file: for `qkv_proj`, part i (q, k, v) is rows
# `[i*r, (i+1)*r)` of A and the rows of slice i of B; for `gate_up_proj`, **gate comes first**, the
# order of SGLang's and vLLM's fused `gate_up_proj` (TensorRT-LLM's loader swaps the two halves of B
# by default, so a converter must know which convention its source uses). An adapter without a part
# gets zeros in that part's place: the `qv` adapter has no k.

# %%
qv = load_peft_adapter(root / "qv", FUSED, LAYERS, max_lora_rank=8, uid="qv")
A, B = qv.weights[(1, "qkv_proj")]
spec = FUSED[0]
print(f"qv, layer 1, qkv_proj: A {list(A.shape)}, B {list(B.shape)}, rank {qv.rank}, "
      f"slice_offsets {spec.slice_offsets}")
for i, proj in enumerate(FUSED_PARTS["qkv_proj"]):
    a, b = A[i * qv.rank:(i + 1) * qv.rank], B[spec.slice_offsets[i]:spec.slice_offsets[i + 1]]
    print(f"  {proj}: A rows {i * qv.rank}..{(i + 1) * qv.rank - 1} all zero {not a.any()}; "
          f"B rows {spec.slice_offsets[i]}..{spec.slice_offsets[i + 1] - 1} all zero {not b.any()}")
mlp = load_peft_adapter(root / "mlp", FUSED, LAYERS, max_lora_rank=8, uid="mlp")
mlp_file = load_file(root / "mlp" / "adapter_model.safetensors")
A, B = mlp.weights[(0, "gate_up_proj")]
print("mlp, layer 0, gate_up_proj: first half of A is gate_proj's A:",
      torch.equal(A[:mlp.rank], mlp_file["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"]),
      "| first half of B is gate_proj's B:",
      torch.equal(B[:SHAPES["gate_proj"][1]], mlp_file["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"]))

# %% [markdown]
# ### Exercise ch06.4: `pack_fused_module`
#
# Write `pack_fused_module(tensors, prefix, parts, out_features, rank)`: one layer's fused module,
# built from the tensors of a PEFT file.
# - `tensors`: a dict from safetensors key to tensor (the whole file: other layers and modules too);
#   `prefix`: the keys' start for this layer, e.g. `"base_model.model.model.layers.3.self_attn."`, so
#   part `p`'s matrices are `tensors[prefix + p + ".lora_A.weight"]` (`[r_p, in]`) and
#   `... + ".lora_B.weight"` (`[out_p, r_p]`); `parts`: the projections in packing order, e.g.
#   `["q_proj", "k_proj", "v_proj"]` or `["gate_proj", "up_proj"]`; `out_features`: their output
#   widths; `rank`: the slot's rank (a part's own `r_p` may be smaller: rank patterns).
# - Return `(A, B)`: `A [len(parts) * rank, in]`, `B [sum(out_features), rank]`, in the parts' dtype,
#   zeros everywhere except: part i's A in rows `[i*rank, i*rank + r_p)`, its B in the rows of slice
#   i (`[sum(out_features[:i]), sum(out_features[:i+1]))`) and columns `[0, r_p)`. A part absent from
#   `tensors` stays zeros in its place. Return `None` when no part is present.
# - Raise `ValueError` when a part has A but no B (or B but no A), when `r_p` is below 1 or above
#   `rank`, or disagrees between A and B, when a B's width is not its `out_features` entry, or when
#   the present matrices (A and B of every part) disagree on `in` or dtype.

# %% exercise="ch06.4" role="answer"
import torch


def pack_fused_module(tensors, prefix, parts, out_features, rank):
    """One layer's fused (A, B) from PEFT tensors: parts padded to rank, a missing part zeros; None if none."""
    ### BEGIN SOLUTION
    if len(parts) != len(out_features):
        raise ValueError("parts and out_features differ in length")
    found = []
    for p in parts:
        a, b = tensors.get(f"{prefix}{p}.lora_A.weight"), tensors.get(f"{prefix}{p}.lora_B.weight")
        if (a is None) != (b is None):
            raise ValueError(f"{prefix}{p}: lora_A and lora_B come in pairs")
        found.append(None if a is None else (a, b))
    present = [f for f in found if f is not None]
    if not present:
        return None
    like = present[0][0]
    offsets = [0]
    for w in out_features:
        offsets.append(offsets[-1] + w)
    A = like.new_zeros(len(parts) * rank, like.shape[1])
    B = like.new_zeros(offsets[-1], rank)
    for i, f in enumerate(found):
        if f is None:
            continue
        a, b = f
        r = a.shape[0]
        if not 1 <= r <= rank or a.shape[1] != like.shape[1] or tuple(b.shape) != (out_features[i], r):
            raise ValueError(f"{prefix}{parts[i]}: A {list(a.shape)}, B {list(b.shape)} do not fit")
        if a.dtype != like.dtype or b.dtype != like.dtype:
            raise ValueError(f"{prefix}{parts[i]}: dtypes differ")
        A[i * rank:i * rank + r] = a
        B[offsets[i]:offsets[i + 1], :r] = b
    return A, B
    ### END SOLUTION


# %% exercise="ch06.4" role="test"
graders.check("ch06.4", pack_fused_module)

# %% [markdown]
# The reference does the same in two steps, after every check of section 7 has passed: pad (and,
# with patterns, fold the scaling into B), then chapter 04's `stack_lora_parts` (shown once your
# check passed):

# %%
graders.show_reference("ch06.4")

# %% [markdown]
# ## 7. Validate first, write last
#
# A pool slot is shared state: the kernels read it for every request of its adapter. A load that
# fails half-way (q/k/v of layer 0 written, then a bad shape in layer 1) would leave a slot that is
# neither the old adapter nor the new one. So the loader checks **everything** before it returns an
# adapter, and the pool checks the adapter again before it writes a byte (`LoRAMemoryPool.validate`
# in `load_to_slot`). `load_peft_adapter` refuses, with a message that names the file and the
# module:
#
# - a missing or malformed file; an unrecognised key; a weight whose module `target_modules` does not
#   select (config and weights disagree); an A without its B; a layer out of range; a wrong shape
#   (checked against each module's own rank);
# - DoRA (`use_dora`), LoRA biases, `modules_to_save`: features the shrink/expand kernels lack;
# - a rank above the pool's `max_lora_rank`, fixed when the buffers were allocated;
# - target modules the engine does not serve: an error naming them in **strict** mode (the default);
#   in **lenient** mode those weights are skipped with **one** warning that lists every skipped
#   weight, never silently.
#
# A pool with the base model and `qv` resident, its full state snapshotted (chapter 05's
# `snapshot`: buffers, maps, policy order, cache, event log), then a series of bad loads:

# %%
PARTIAL = (FUSED[0], FUSED[2])  # an engine that serves LoRA on qkv_proj and gate_up_proj only
pool = LoRAMemoryPool(FUSED, LAYERS, max_loras_per_batch=3, max_lora_rank=6)
pool.load_to_slot(None, 0)
pool.load_to_slot(load_peft_adapter(root / "qv", FUSED, LAYERS, pool.max_lora_rank, uid="qv"), 1)
before = pool.snapshot()


def edited_copy(src, dst, config_edit=None, tensors_edit=None):
    """A copy of the adapter directory ``src`` with its config dict and/or tensors edited in place."""
    (root / dst).mkdir(exist_ok=True)
    cfg = json.loads((root / src / "adapter_config.json").read_text())
    t = load_file(root / src / "adapter_model.safetensors")
    if config_edit is not None:
        config_edit(cfg)
    if tensors_edit is not None:
        tensors_edit(t)
    (root / dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(t, root / dst / "adapter_model.safetensors")
    return root / dst


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
bad_loads = {
    f"rank {rs_cfg.r} above max_lora_rank {pool.max_lora_rank}": lambda: load_peft_adapter(root / "rs", FUSED, LAYERS, pool.max_lora_rank, uid="rs"),
    "DoRA": lambda: load_peft_adapter(edited_copy("qv", "dora", lambda c: c.update(use_dora=True)),
                                      FUSED, LAYERS, pool.max_lora_rank, uid="dora"),
    "B of the wrong shape": lambda: load_peft_adapter(
        edited_copy("qv", "shape", tensors_edit=lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(63, 4)})),
        FUSED, LAYERS, pool.max_lora_rank, uid="shape"),
    "weight outside target_modules": lambda: load_peft_adapter(
        edited_copy("qv", "extra", tensors_edit=lambda t: t.update(
            {"base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight": torch.zeros(4, 64)})),
        FUSED, LAYERS, pool.max_lora_rank, uid="extra"),
    "strict: modules not served": lambda: load_peft_adapter(root / "mlp", PARTIAL, LAYERS, pool.max_lora_rank, uid="mlp"),
    "a hand-made adapter, wrong A": lambda: LoRAAdapter("hand", 2, 1.0, {(0, "o_proj"): (torch.zeros(3, 64), torch.zeros(64, 2))}),
}
for case, load in bad_loads.items():
    try:
        pool.load_to_slot(load(), 2)
        print(f"{case}: LOADED (unexpected)")
    except ValueError as err:
        msg = str(err).replace(str(root), "<tmp>")
        print(f"{case}:\n    ValueError: {msg[:160]}{' ...' if len(msg) > 160 else ''}")
    print(f"    pool state changed: {snapshot_diff(before, pool.snapshot()) or 'no'}")

# %% [markdown]
# Lenient mode on the same engine: the adapter loads with what the engine serves, and the one
# warning says exactly what was dropped (here captured and printed, so the notebook stays quiet):

# %%
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    partial = load_peft_adapter(root / "mlp", PARTIAL, LAYERS, pool.max_lora_rank, strict=False, uid="mlp")
ours = [str(w.message).replace(str(root), "<tmp>") for w in caught if issubclass(w.category, UserWarning)]
print(f"{len(ours)} warning(s); the first {ours[0][:230]} ...")
print("loaded modules:", sorted({m for _, m in partial.weights}))

# %% [markdown]
# ## 8. The judge: the pool against PEFT's own mixed batch
#
# Now every piece at once. A pool with the base model in slot 0 (rank 0) and the four adapters,
# loaded from their files into the fused layout. A batch of sequences of different lengths, one
# adapter per sequence and one base sequence, right-padded. PEFT runs it with its
# mixed-batch forward, `model(input_ids, adapter_names=[...])` (`"__base__"` for the base row), which
# applies each row's adapter inside its LoRA layers. Our side runs the *plain* base model with a
# forward hook on every projection (`reference/peft_hooks.py`): the hook adds the pool's LoRA delta,
# computed with chapter 02's SGMV shrink and sliced expand from a `LoRABatchInfo` in which each
# sequence is a segment of its slot and the padding a segment of the base slot. (An engine adds the
# fused expand into its fused output; the Hugging Face model has three separate q/k/v modules, so the
# hooks compute the fused delta once per layer and each adds its own column slice.)
#
# Hooks registered last capture every projection's output on both sides, so the comparison is
# per projection and layer as well as at the logits, over the real (unpadded) tokens.

# %%
MAX_RANK = 8
SLOTS = {None: 0, "qv": 1, "mlp": 2, "rs": 3, "pat": 4}
NAMES = ["qv", "__base__", "mlp", "rs", "pat"]  # one per sequence, PEFT's names
LENS = [5, 7, 3, 6, 4]
PAD = max(LENS)
judge_pool = LoRAMemoryPool(FUSED, LAYERS, max_loras_per_batch=len(SLOTS), max_lora_rank=MAX_RANK)
loaded = {uid: load_peft_adapter(root / uid, FUSED, LAYERS, MAX_RANK, uid=uid) for uid in SLOTS if uid is not None}
for uid, slot in SLOTS.items():
    judge_pool.load_to_slot(None if uid is None else loaded[uid], slot)
print("lora_ranks", judge_pool.lora_ranks.tolist(), " scalings", [round(s, 4) for s in judge_pool.scalings.tolist()])

g = torch.Generator().manual_seed(7)
ids = torch.randint(0, CFG["vocab_size"], (len(LENS), PAD), generator=g)
mask = (torch.arange(PAD)[None, :] < torch.tensor(LENS)[:, None]).long()
real = mask.bool()


def batch_info_for(pool):
    """Rows are the flattened [batch * PAD] tokens: per sequence, its tokens then its padding (base slot)."""
    seg_lens, slots = [], []
    for n, name in zip(LENS, NAMES):
        seg_lens += [n, PAD - n]
        slots += [SLOTS[None if name == "__base__" else name], SLOTS[None]]
    return build_batch_info(seg_lens, slots, pool.lora_ranks.tolist(), pool.scalings.tolist(), "cpu")


def forward_capturing(model, decoder, **inputs):
    """Logits and every projection's output by (layer, projection), from hooks registered last."""
    seen, handles = {}, []
    for i, layer in enumerate(decoder.layers):
        for p in SHAPES:
            mod = getattr(layer.self_attn if p in ATTN else layer.mlp, p)
            handles.append(mod.register_forward_hook(lambda m, x, o, key=(i, p): seen.__setitem__(key, o.detach())))
    try:
        with torch.no_grad():
            logits = model(**inputs).logits
    finally:
        for h in handles:
            h.remove()
    return logits, seen


def run_pool(pool):
    with pool_lora_hooks(base, pool, FUSED, batch_info_for(pool)):
        return forward_capturing(base, base.model, input_ids=ids, attention_mask=mask)


want_logits, want_seen = forward_capturing(peft_model, peft_model.base_model.model.model,
                                           input_ids=ids, attention_mask=mask, adapter_names=NAMES)
got_logits, got_seen = run_pool(judge_pool)
print("max |pool - PEFT| over real tokens, per layer and projection (and relative to max |PEFT output|):")
print(f"{'layer':5s} " + " ".join(f"{p:>9s}" for p in SHAPES))
for i in range(LAYERS):
    errs = [(got_seen[(i, p)][real] - want_seen[(i, p)][real]).abs().max().item() for p in SHAPES]
    rel = [e / want_seen[(i, p)][real].abs().max().item() for e, p in zip(errs, SHAPES)]
    print(f"{i:5d} " + " ".join(f"{e:9.1e}" for e in errs))
    print(f"{'rel':>5s} " + " ".join(f"{e:9.1e}" for e in rel))
scale = want_logits[real].abs().max().item()
logit_err = (got_logits[real] - want_logits[real]).abs().max().item()
print(f"logits: max |pool - PEFT| = {logit_err:.2e}, max |logit| = {scale:.2f}, relative {logit_err / scale:.1e}")

# %% [markdown]
# Two checks that the agreement means something. The base row must be the base model *bit for bit*
# (rank 0 adds exactly nothing), and every adapter must move its own rows well beyond the error above:

# %%
base_logits, _ = forward_capturing(base, base.model, input_ids=ids, attention_mask=mask)
b = NAMES.index("__base__")
print("base row identical to the base model, bit for bit:", torch.equal(got_logits[b], base_logits[b]))
for row, name in enumerate(NAMES):
    if name != "__base__":
        moved = (got_logits[row, :LENS[row]] - base_logits[row, :LENS[row]]).abs().max().item()
        print(f"  {name:4s} moves its logits by up to {moved:.3f}")

# %% [markdown]
# And two conventions got wrong on purpose, to see what the judge says. Neither raises an error; both
# silently change what the adapter computes. First, the rsLoRA adapter loaded with `alpha / r`; then
# the `mlp` adapter's gate/up halves of B swapped (a checkpoint in TensorRT-LLM's order read as gate
# first). Each is loaded into its own slot again, replacing the correct copy:

# %%
def rows_error(pool, name):
    logits, _ = run_pool(pool)
    row = NAMES.index(name)
    return (logits[row, :LENS[row]] - want_logits[row, :LENS[row]]).abs().max().item()


rs = loaded["rs"]
weak = dataclasses.replace(rs, scaling=lora_scaling(rs_cfg.lora_alpha, rs_cfg.r, use_rslora=False))
judge_pool.load_to_slot(weak, SLOTS["rs"])
print(f"rs read with alpha/r (scaling {weak.scaling:.3f} instead of {rs.scaling:.3f}): "
      f"max logit error on its row {rows_error(judge_pool, 'rs'):.3f}")
judge_pool.load_to_slot(rs, SLOTS["rs"])

gate = SHAPES["gate_proj"][1]
swapped_weights = {k: (A, torch.cat([B[gate:], B[:gate]]) if k[1] == "gate_up_proj" else B)
                   for k, (A, B) in loaded["mlp"].weights.items()}
judge_pool.load_to_slot(dataclasses.replace(loaded["mlp"], weights=swapped_weights), SLOTS["mlp"])
print(f"mlp with gate/up halves of B swapped: max logit error on its row {rows_error(judge_pool, 'mlp'):.3f}")
judge_pool.load_to_slot(loaded["mlp"], SLOTS["mlp"])
print(f"both restored: max logit error over all real tokens "
      f"{(run_pool(judge_pool)[0][real] - want_logits[real]).abs().max().item():.2e}")

# %% [markdown]
# ## 9. How production systems do it
#
# - **SGLang**, `python/sglang/srt/lora/`: `lora_config.py` reads `adapter_config.json`;
#   `lora.py`'s `LoRAAdapter.initialize_weights` reads the tensors, takes the layer from each name
#   with `re.search(r"layers\.(\d+)\.", name)`, and stacks q/k/v and gate/up in
#   `normalize_qkv_proj` / `normalize_gate_up_proj` (with zeros where an adapter has no k);
#   `lora_manager.py` fixes the target modules and `max_lora_rank` when the server starts (from the
#   adapters given at launch or from `--lora-target-modules`) and checks each new adapter against
#   them; `mem_pool.py` copies an adapter into its slot.
# - **vLLM**, `vllm/lora/`: `peft_helper.py`'s `PEFTHelper` reads the config, computes the scaling
#   (`alpha / sqrt(r)` with `use_rslora`) and refuses what it cannot serve, DoRA among it, and a
#   rank above `max_lora_rank`; `models.py`'s `LoRAModel.from_local_checkpoint` raises when the
#   checkpoint has modules the model does not expect; `worker_manager.py` keeps the CPU-side cache.
# - **TensorRT-LLM**, `tensorrt_llm/lora_manager.py`: `HfLoraLoader` reads PEFT checkpoints and
#   converts them to its own layout; its fused `gate_up` B is swapped by default
#   (`swap_gate_up_proj_lora_b_weight`), the reason this chapter states and tests the order.
#
# ## Summary
#
# - A PEFT adapter is `adapter_config.json` plus `adapter_model.safetensors` with keys
#   `base_model.model.<module path>.lora_A.weight` (`[r, in]`) and `.lora_B.weight` (`[out, r]`);
#   every key must parse, and unknown tensors (DoRA, biases) are errors, not things to skip.
# - `target_modules`: a list matches whole names or dot-separated suffixes; a string is a regex over
#   the whole path; `"all-linear"` is resolved and saved as full paths.
# - Scaling is `alpha / r`, or `alpha / sqrt(r)` with rsLoRA; getting it wrong raises nothing and
#   serves a different adapter. Per-module ranks and alphas (first matching pattern wins) are folded
#   into B at load, with the slot at the largest rank and scaling 1.
# - Fused modules stack their parts at the slot's rank, gate before up, a missing part as zeros.
# - Everything is validated before anything is written; a rejected load leaves the pool's full
#   state unchanged, and lenient mode never skips a weight silently.
# - PEFT's own mixed-batch forward is the judge: the pool, served through hooks with the book's
#   operations, agrees with it per projection and at the logits, and bit for bit on base rows.
#
# ## Review questions
#
# 1. An adapter's config says `target_modules: "q_proj|v_proj"`. Which modules did PEFT adapt when it
#    trained this adapter, and what should a loader conclude from the tensors in its file?
# 2. Why must a loader refuse a `lora_magnitude_vector` tensor instead of ignoring it? What would the
#    served outputs be, compared with the adapter's training?
# 3. An rsLoRA adapter with r = 64 is read with `alpha / r`. By what factor is its delta off, and
#    why does no test that only checks shapes notice?
# 4. With `rank_pattern = {"layers.1.mlp.gate_proj": 2, "gate_proj": 5}`, what rank does PEFT give
#    layer 1's gate projection when it *creates* the model, and what rank when it *loads* the saved
#    adapter? Which order of the same two keys would avoid the surprise, and what would layer 1's
#    rank then be?
# 5. Folding the per-module scaling into B lets one slot serve modules of different ranks and alphas.
#    What does it cost in memory and in shrink work for the `pat` adapter, whose largest module rank
#    is used for every module?
# 6. Lenient mode loads an adapter whose `o_proj` weights the engine does not serve. Is the result
#    still "the adapter"? When would you accept that, and why must the warning list every skipped
#    weight?

# %%
workdir.cleanup()
print(f"notebook body ran in {time.perf_counter() - t_start:.1f} s (after imports)")
