"""Chapter 06: real PEFT adapters loaded into the pool, judged by PEFT itself.

A tiny seeded GQA Llama (no downloads), adapters made and saved by PEFT, loaded with
``reference.adapters`` into a ``LoRAMemoryPool`` (fused and per-projection layouts), applied through
forward hooks for a mixed batch and compared with PEFT's own mixed-batch forward
(``model(..., adapter_names=[...])``) per projection and at the logits, in fp32.
"""
import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference.adapters import (
    FUSED_PARTS,
    load_peft_adapter,
    module_rank_alpha,
    parse_lora_key,
    pattern_key,
    resolve_target_modules,
    targets_module,
)
from reference.batch_info import build_batch_info, stable_sort_by_slot
from reference.lora_math import lora_scaling, projection_shapes
from reference.mem_pool import LoRAMemoryPool, ModuleSpec, snapshot_diff
from reference.peft_hooks import pool_lora_hooks

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

CFG = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=96, vocab_size=128, max_position_embeddings=64)
LAYERS, MAX_RANK = CFG["num_hidden_layers"], 10
SHAPES = projection_shapes(CFG)  # q 64->64, k/v 64->32 (GQA), o 64->64, gate/up 64->96, down 96->64
FUSED = (ModuleSpec("qkv_proj", 64, (64, 32, 32)), ModuleSpec("o_proj", 64, (64,)),
         ModuleSpec("gate_up_proj", 64, (96, 96)), ModuleSpec("down_proj", 96, (64,)))
UNFUSED = tuple(ModuleSpec(p, i, (o,)) for p, (i, o) in SHAPES.items())
LAYOUTS = {"fused": FUSED, "per_projection": UNFUSED}

ADAPTERS = {  # name -> LoraConfig kwargs: different ranks, targets, rsLoRA, per-module patterns
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),  # q and v, no k
    "mlp": dict(r=6, lora_alpha=12, target_modules=r".*\.mlp\.(gate|up|down)_proj"),  # a regex
    "rs": dict(r=8, lora_alpha=16, target_modules="all-linear", use_rslora=True),
    "pat": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"],
                rank_pattern={"k_proj": 2, "layers.1.self_attn.o_proj": 7},
                alpha_pattern={"down_proj": 3, "q_proj": 20}),
}
SLOTS = {None: 0, "pat": 1, "qv": 2, "rs": 3, "mlp": 4}  # slot 5 stays empty
LENS = [5, 9, 3, 7, 6, 4]
NAMES = ["qv", "__base__", "mlp", "rs", "pat", "qv"]  # PEFT's mixed-batch names, one per sequence
PAD = max(LENS)


# ---- fixtures: one base model, PEFT adapters on disk, PEFT's mixed-batch reference --------------
@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).eval()


@pytest.fixture(scope="module")
def adapter_dirs(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw))
            model.save_pretrained(root / name)
    return {name: root / name for name in ADAPTERS}


@pytest.fixture(scope="module")
def peft_model(base, adapter_dirs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dirs["qv"], adapter_name="qv")
        for name in ADAPTERS:
            if name != "qv":
                pm.load_adapter(adapter_dirs[name], adapter_name=name)
    return pm.eval()


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, CFG["vocab_size"], (len(LENS), PAD), generator=g)
    mask = (torch.arange(PAD)[None, :] < torch.tensor(LENS)[:, None]).long()  # right padding
    return ids, mask


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _forward_capturing(model, decoder, **inputs):
    """Logits [B, T, vocab] and every projection's output [B, T, out] by (layer, projection),
    captured by forward hooks registered last (so they see the LoRA-updated output)."""
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


@pytest.fixture(scope="module")
def peft_outputs(peft_model, batch):
    ids, mask = batch
    return _forward_capturing(peft_model, peft_model.base_model.model.model,
                              input_ids=ids, attention_mask=mask, adapter_names=NAMES)


def _pool(modules, adapter_dirs, max_rank=MAX_RANK):
    pool = LoRAMemoryPool(modules, LAYERS, max_loras_per_batch=6, max_lora_rank=max_rank)
    for uid, slot in SLOTS.items():
        adapter = None if uid is None else load_peft_adapter(adapter_dirs[uid], modules, LAYERS, max_rank, uid=uid)
        pool.load_to_slot(adapter, slot)
    return pool


def _batch_info(pool, order):
    """Rows are the flattened [B * PAD] tokens. "segments": per sequence, its tokens then its padding
    (base slot), unsorted; "sorted": tokens grouped by slot through a permutation."""
    slot_of = [SLOTS[None if n == "__base__" else n] for n in NAMES]
    ranks, scalings = pool.lora_ranks.tolist(), pool.scalings.tolist()
    if order == "segments":
        seg_lens, w_idx = [], []
        for n, s in zip(LENS, slot_of):
            seg_lens += [n, PAD - n]
            w_idx += [s, SLOTS[None]]
        return build_batch_info(seg_lens, w_idx, ranks, scalings, "cpu")
    token_slots = torch.tensor([s if t < n else SLOTS[None] for n, s in zip(LENS, slot_of) for t in range(PAD)])
    perm, _ = stable_sort_by_slot(token_slots)
    present = sorted(set(token_slots.tolist()))
    seg_lens = [int((token_slots == s).sum()) for s in present]
    return build_batch_info(seg_lens, present, ranks, scalings, "cpu", permutation=perm)


def _assert_close(got, want, what, rtol=1e-5):
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    assert err <= rtol * scale, f"{what}: max abs error {err:.3g}, scale {scale:.3g}"


# ---- end to end: the pool through hooks == PEFT's mixed batch ------------------------------------
@pytest.mark.parametrize("order", ["segments", "sorted"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_batch_matches_peft(layout, order, base, adapter_dirs, batch, peft_outputs):
    ids, mask = batch
    pool = _pool(LAYOUTS[layout], adapter_dirs)
    info = _batch_info(pool, order)
    with pool_lora_hooks(base, pool, LAYOUTS[layout], info) as n_hooks:
        logits, seen = _forward_capturing(base, base.model, input_ids=ids, attention_mask=mask)
    assert n_hooks == 7 * LAYERS
    want_logits, want_seen = peft_outputs
    real = mask.bool()
    for key, want in want_seen.items():
        _assert_close(seen[key][real], want[real], f"{layout}/{order} layer {key[0]} {key[1]}")
    _assert_close(logits[real], want_logits[real], f"{layout}/{order} logits")
    base_logits, _ = _forward_capturing(base, base.model, input_ids=ids, attention_mask=mask)  # hooks gone after the block
    assert torch.equal(logits[1], base_logits[1]), "a base row must be bit-identical to the base model"
    for b, name in enumerate(NAMES):  # the comparison is not vacuous: every adapter changes its rows
        if name != "__base__":
            assert (logits[b, : LENS[b]] - base_logits[b, : LENS[b]]).abs().max() > 1e-3, name


# ---- PEFT's matching rules, judged by PEFT's own functions ---------------------------------------
LINEAR_PATHS = [f"model.layers.{i}.{'self_attn' if p in ATTN else 'mlp'}.{p}"
                for i in range(LAYERS) for p in SHAPES]


@pytest.mark.parametrize("targets", [
    ["q_proj", "v_proj"], r".*\.mlp\.(gate|up|down)_proj", "q_proj", ".*q_proj",
    ["layers.1.self_attn.o_proj"], ["model.layers.0.mlp.up_proj"], ["proj"], r".*layers\.1\..*",
])
def test_targets_module_agrees_with_peft(targets):
    from peft.tuners.tuners_utils import check_target_module_exists
    config = peft.LoraConfig(target_modules=targets)
    for path in LINEAR_PATHS:
        assert targets_module(targets, path) == bool(check_target_module_exists(config, path)), (targets, path)


def test_all_linear_targets_what_peft_resolves(adapter_dirs):
    saved = json.loads((adapter_dirs["rs"] / "adapter_config.json").read_text())["target_modules"]
    assert sorted(saved) == sorted(LINEAR_PATHS)  # PEFT writes "all-linear" out as full paths
    assert all(targets_module("All-Linear", p) for p in LINEAR_PATHS)
    names = [s.name for s in FUSED]
    assert resolve_target_modules("all-linear", names, LAYERS) == names
    assert resolve_target_modules(saved, names, LAYERS) == names


@pytest.mark.parametrize("targets, fused, unfused", [
    (["q_proj", "v_proj"], ["qkv_proj"], ["q_proj", "v_proj"]),
    (r".*\.mlp\.(gate|up|down)_proj", ["gate_up_proj", "down_proj"], ["gate_proj", "up_proj", "down_proj"]),
    (["up_proj"], ["gate_up_proj"], ["up_proj"]),
    ("q_proj", [], []),  # a string is a regex with full-match semantics: matches no full path
    (["lm_head"], [], []),
    (["layers.1.self_attn.o_proj"], ["o_proj"], ["o_proj"]),
])
def test_resolve_target_modules(targets, fused, unfused):
    assert resolve_target_modules(targets, [s.name for s in FUSED], LAYERS) == fused
    assert resolve_target_modules(targets, [s.name for s in UNFUSED], LAYERS) == unfused


@pytest.mark.parametrize("patterns", [
    ["up_proj", "layers.1.mlp.gate_proj"], ["gate_proj", "layers.1.mlp.gate_proj"],
    ["layers.1.mlp.gate_proj", "gate_proj"], ["p_proj", "proj"], [r"layers\.[01]\.self_attn\.(q|k)_proj"],
    ["mlp.down_proj", "down_proj"], ["self_attn"],
])
def test_pattern_key_agrees_with_peft(patterns):
    from peft.utils.other import get_pattern_key
    for path in LINEAR_PATHS:
        want = get_pattern_key(patterns, path)
        assert pattern_key(patterns, path) == (None if want == path else want), (patterns, path)


def test_overlapping_rank_patterns_fail_on_reload_like_peft(base, tmp_path):
    """PEFT saves patterns with sorted keys and takes the first match: overlapping patterns given in
    non-sorted order train layer 1's gate at r=2 and reload it at r=5. PEFT and we both refuse."""
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj"], init_lora_weights=False,
                          rank_pattern={"layers.1.mlp.gate_proj": 2, "gate_proj": 5})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(copy.deepcopy(base), cfg)
        assert model.base_model.model.model.layers[1].mlp.gate_proj.r["default"] == 2
        model.save_pretrained(tmp_path)
        assert list(json.loads((tmp_path / "adapter_config.json").read_text())["rank_pattern"]) == [
            "gate_proj", "layers.1.mlp.gate_proj"]
        with pytest.raises(RuntimeError, match="size mismatch"):
            peft.PeftModel.from_pretrained(copy.deepcopy(base), tmp_path)
    with pytest.raises(ValueError, match=r"gate_proj': lora_A \[2, 64\].*expected \[5, 64\]"):
        load_peft_adapter(tmp_path, UNFUSED, LAYERS, MAX_RANK, uid="order")


def test_ranks_and_scalings_agree_with_peft(peft_model, adapter_dirs):
    from reference.adapters import read_peft_adapter
    checked = 0
    for path, mod in peft_model.base_model.model.named_modules():
        for name in ADAPTERS:
            if isinstance(mod, peft.tuners.lora.LoraLayer) and name in mod.r:
                config, _ = read_peft_adapter(adapter_dirs[name])
                r, alpha = module_rank_alpha(config, path)
                assert (r, lora_scaling(alpha, r, config.use_rslora)) == (mod.r[name], pytest.approx(mod.scaling[name]))
                checked += 1
    assert checked == 2 * 2 + 3 * 2 + 7 * 2 + 5 * 2


# ---- the layout: fused order, missing parts, folded patterns -------------------------------------
def _file(adapter_dirs, name, layer, proj, matrix):
    part = "self_attn" if proj in ATTN else "mlp"
    key = f"base_model.model.model.layers.{layer}.{part}.{proj}.lora_{matrix}.weight"
    return load_file(adapter_dirs[name] / "adapter_model.safetensors")[key]


def test_gate_up_fused_gate_first(adapter_dirs):
    """Convention: gate_up_proj packs gate then up (SGLang/vLLM); TensorRT-LLM swaps B's halves."""
    a = load_peft_adapter(adapter_dirs["mlp"], FUSED, LAYERS, MAX_RANK, uid="mlp")
    assert (a.rank, a.scaling) == (6, 2.0)
    A, B = a.weights[(0, "gate_up_proj")]
    assert A.shape == (12, 64) and B.shape == (192, 6)
    assert torch.equal(A[:6], _file(adapter_dirs, "mlp", 0, "gate_proj", "A"))
    assert torch.equal(A[6:], _file(adapter_dirs, "mlp", 0, "up_proj", "A"))
    assert torch.equal(B[:96], _file(adapter_dirs, "mlp", 0, "gate_proj", "B"))
    assert torch.equal(B[96:], _file(adapter_dirs, "mlp", 0, "up_proj", "B"))
    assert set(a.weights) == {(i, m) for i in range(LAYERS) for m in ("gate_up_proj", "down_proj")}


def test_missing_k_is_zeros_and_per_projection_keys(adapter_dirs):
    a = load_peft_adapter(adapter_dirs["qv"], FUSED, LAYERS, MAX_RANK, uid="qv")
    A, B = a.weights[(1, "qkv_proj")]
    assert torch.equal(A[:4], _file(adapter_dirs, "qv", 1, "q_proj", "A"))
    assert not A[4:8].any() and not B[64:96].any()  # k: zeros in its rows of A and of B
    assert torch.equal(A[8:], _file(adapter_dirs, "qv", 1, "v_proj", "A"))
    assert torch.equal(B[96:], _file(adapter_dirs, "qv", 1, "v_proj", "B"))
    u = load_peft_adapter(adapter_dirs["qv"], UNFUSED, LAYERS, MAX_RANK, uid="qv")
    assert set(u.weights) == {(i, p) for i in range(LAYERS) for p in ("q_proj", "v_proj")}
    assert torch.equal(u.weights[(1, "v_proj")][1], B[96:])


def test_rank_pattern_folded_into_B(adapter_dirs):
    a = load_peft_adapter(adapter_dirs["pat"], FUSED, LAYERS, MAX_RANK, uid="pat")
    assert (a.rank, a.scaling) == (7, 1.0)  # the largest module rank; scalings live in B
    A, B = a.weights[(0, "qkv_proj")]  # q: r 4, alpha 20 -> x5;  k: r 2, alpha 8 -> x4;  no v
    assert torch.equal(A[:4], _file(adapter_dirs, "pat", 0, "q_proj", "A")) and not A[4:7].any()
    torch.testing.assert_close(B[:64, :4], 5 * _file(adapter_dirs, "pat", 0, "q_proj", "B"))
    assert torch.equal(A[7:9], _file(adapter_dirs, "pat", 0, "k_proj", "A")) and not A[9:].any()
    torch.testing.assert_close(B[64:96, :2], 4 * _file(adapter_dirs, "pat", 0, "k_proj", "B"))
    assert not B[:, 4:].any() and not B[96:].any()
    A1, B1 = a.weights[(1, "o_proj")]  # r 7 via the layer-specific pattern: alpha 8 / 7
    torch.testing.assert_close(B1, 8 / 7 * _file(adapter_dirs, "pat", 1, "o_proj", "B"))
    _, Bd = a.weights[(0, "down_proj")]
    torch.testing.assert_close(Bd[:, :4], 3 / 4 * _file(adapter_dirs, "pat", 0, "down_proj", "B"))
    _, Bu = a.weights[(0, "gate_up_proj")]  # up only: gate half zeros
    assert not Bu[:96].any()


def test_rslora_scaling(adapter_dirs):
    a = load_peft_adapter(adapter_dirs["rs"], FUSED, LAYERS, MAX_RANK, uid="rs")
    assert a.rank == 8 and a.scaling == pytest.approx(16 / 8 ** 0.5)  # x2.83 the alpha/r value


def test_all_linear_string_and_no_prefix_keys(adapter_dirs, tmp_path):
    """A hand-written config with "all-linear" and keys without "base_model.model." load the same."""
    d = _copy(adapter_dirs["rs"], tmp_path, config=lambda c: c.update(target_modules="all-linear"),
              tensors=lambda t: {k.removeprefix("base_model.model."): v for k, v in t.items()})
    a = load_peft_adapter(d, FUSED, LAYERS, MAX_RANK, uid="rs2")
    b = load_peft_adapter(adapter_dirs["rs"], FUSED, LAYERS, MAX_RANK, uid="rs")
    assert a.weights.keys() == b.weights.keys()
    assert all(torch.equal(x, y) for k in a.weights for x, y in zip(a.weights[k], b.weights[k]))


def test_parse_lora_key():
    k = parse_lora_key("base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight")
    assert tuple(k) == ("model.layers.3.self_attn.q_proj", 3, "q_proj", "A")
    assert parse_lora_key("base_model.model.lm_head.lora_B.weight").layer is None
    assert FUSED_PARTS["gate_up_proj"] == ("gate_proj", "up_proj")


# ---- malformed adapters: a clear error, and the pool exactly as before --------------------------
def _copy(src, tmp_path, config=None, tensors=None):
    """A copy of the adapter at ``src`` with its config dict and/or tensor dict edited."""
    dst = tmp_path / "adapter"
    dst.mkdir(exist_ok=True)
    raw = json.loads((src / "adapter_config.json").read_text())
    if config is not None:
        config(raw)
    (dst / "adapter_config.json").write_text(json.dumps(raw))
    t = load_file(src / "adapter_model.safetensors")
    save_file(tensors(t) if tensors is not None else t, dst / "adapter_model.safetensors")
    return dst


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def _set(key, value):
    def edit(t):
        t[key] = value
        return t
    return edit


def _drop(key):
    def edit(t):
        del t[key]
        return t
    return edit


def _relayer(t):
    return {k.replace("layers.1.", "layers.5."): v for k, v in t.items()}


BROKEN = {  # case -> (adapter, config edit, tensors edit, file edit, exception, message)
    "missing config": ("qv", None, None, lambda d: (d / "adapter_config.json").unlink(),
                       FileNotFoundError, "adapter_config.json"),
    "missing weights": ("qv", None, None, lambda d: (d / "adapter_model.safetensors").unlink(),
                        FileNotFoundError, "adapter_model.safetensors"),
    "malformed json": ("qv", None, None, lambda d: (d / "adapter_config.json").write_text('{"r": 4,'),
                       ValueError, r"adapter_config.json: malformed JSON"),
    "corrupt safetensors": ("qv", None, None, lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x01" * 20),
                            ValueError, "adapter_model.safetensors: not a readable safetensors file"),
    "json not an object": ("qv", None, None, lambda d: (d / "adapter_config.json").write_text("[4]"),
                           ValueError, "expected a JSON object"),
    "missing r": ("qv", lambda c: c.pop("r"), None, None, ValueError, r"bad or missing LoRA field: KeyError\('r'\)"),
    "dora": ("qv", lambda c: c.update(use_dora=True), None, None, ValueError, "use_dora=True is not supported: DoRA"),
    "not lora": ("qv", lambda c: c.update(peft_type="IA3"), None, None, ValueError, "peft_type 'IA3' is not LORA"),
    "wrong shape": ("qv", None, _set(f"{Q0}.lora_B.weight", torch.zeros(63, 4)), None, ValueError,
                    r"q_proj': lora_A \[4, 64\] and lora_B \[63, 4\], expected \[4, 64\] and \[64, 4\]"),
    "rank differs from config": ("qv", lambda c: c.update(r=5), None, None, ValueError, r"expected \[5, 64\]"),
    "bad key": ("qv", None, _set(f"{Q0}.lora_A.default.weight", torch.zeros(4, 64)), None, ValueError,
                "unrecognised PEFT LoRA key .*lora_A.default.weight"),
    "dora magnitude key": ("qv", None, _set(f"{Q0}.lora_magnitude_vector", torch.zeros(64)), None, ValueError,
                           "unrecognised PEFT LoRA key .*lora_magnitude_vector"),
    "missing B": ("qv", None, _drop(f"{Q0}.lora_B.weight"), None, ValueError, "q_proj' has no lora_B"),
    "layer out of range": ("qv", None, _relayer, None, ValueError, "layer 5 out of range"),
    "weight outside target_modules": (
        "qv", None, _set("base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight", torch.zeros(4, 64)),
        None, ValueError, "o_proj.lora_A.weight' is not selected by target_modules"),
}


@pytest.fixture
def loaded_pool(adapter_dirs):
    """A fused pool with the base model in slot 0 and "qv" in slot 1 (so buffers are not all zero)."""
    pool = LoRAMemoryPool(FUSED, LAYERS, max_loras_per_batch=3, max_lora_rank=MAX_RANK)
    pool.load_to_slot(None, 0)
    pool.load_to_slot(load_peft_adapter(adapter_dirs["qv"], FUSED, LAYERS, MAX_RANK, uid="qv"), 1)
    return pool


def _assert_rejected(pool, load, exc, match):
    before = pool.snapshot()
    with pytest.raises(exc, match=match):
        pool.load_to_slot(load(), 2)
    assert snapshot_diff(before, pool.snapshot()) == []


@pytest.mark.parametrize("case", list(BROKEN))
def test_malformed_adapter_rejected(case, adapter_dirs, loaded_pool, tmp_path):
    name, config, tensors, files, exc, match = BROKEN[case]
    d = _copy(adapter_dirs[name], tmp_path, config, tensors)
    if files is not None:
        files(d)
    _assert_rejected(loaded_pool, lambda: load_peft_adapter(d, FUSED, LAYERS, MAX_RANK, uid="bad"), exc, match)


def test_rank_above_max_rejected(adapter_dirs, loaded_pool):
    _assert_rejected(loaded_pool, lambda: load_peft_adapter(adapter_dirs["rs"], FUSED, LAYERS, 6, uid="rs"),
                     ValueError, "adapter rank 8 exceeds max_lora_rank 6")
    # loaded for a larger max rank than the pool's: the pool's own validation refuses it
    small = LoRAMemoryPool(FUSED, LAYERS, max_loras_per_batch=3, max_lora_rank=6)
    _assert_rejected(small, lambda: load_peft_adapter(adapter_dirs["rs"], FUSED, LAYERS, 16, uid="rs"),
                     ValueError, "rank 8 outside 1..max_lora_rank")


def test_uid_none_rejected(adapter_dirs, loaded_pool):
    _assert_rejected(loaded_pool, lambda: load_peft_adapter(adapter_dirs["qv"], FUSED, LAYERS, MAX_RANK, uid=None),
                     ValueError, "uid None is reserved for the base model")


PARTIAL = (FUSED[0], FUSED[2])  # an engine that serves qkv_proj and gate_up_proj only


def test_unserved_modules_strict(adapter_dirs):
    pool = LoRAMemoryPool(PARTIAL, LAYERS, max_loras_per_batch=2, max_lora_rank=MAX_RANK)
    _assert_rejected(pool, lambda: load_peft_adapter(adapter_dirs["rs"], PARTIAL, LAYERS, MAX_RANK, uid="rs"),
                     ValueError, r"target modules \['down_proj', 'o_proj'\] are not served by this engine")


def test_unserved_modules_lenient_warns_once_listing_every_weight(adapter_dirs):
    with pytest.warns(UserWarning) as record:
        a = load_peft_adapter(adapter_dirs["rs"], PARTIAL, LAYERS, MAX_RANK, strict=False, uid="rs")
    ours = [str(w.message) for w in record if "engine does not serve" in str(w.message)]
    assert len(ours) == 1
    skipped = [f"model.layers.{i}.{part}.{p}.lora_{m}.weight" for i in range(LAYERS)
               for part, p in (("self_attn", "o_proj"), ("mlp", "down_proj")) for m in "AB"]
    assert "skipping 8 weights" in ours[0] and all(f"'{k}'" in ours[0] for k in skipped)
    full = load_peft_adapter(adapter_dirs["rs"], FUSED, LAYERS, MAX_RANK, uid="rs")
    assert set(a.weights) == {(i, m) for i in range(LAYERS) for m in ("qkv_proj", "gate_up_proj")}
    assert all(torch.equal(x, y) for k in a.weights for x, y in zip(a.weights[k], full.weights[k]))
    pool = LoRAMemoryPool(PARTIAL, LAYERS, max_loras_per_batch=2, max_lora_rank=MAX_RANK)
    pool.load_to_slot(a, 1)
    assert pool.lora_ranks.tolist() == [0, 8]


def test_nothing_served_is_an_error_even_lenient(adapter_dirs):
    only_o = (FUSED[1],)
    with pytest.raises(ValueError, match="none of the adapter's modules is served"), pytest.warns(UserWarning):
        load_peft_adapter(adapter_dirs["mlp"], only_o, LAYERS, MAX_RANK, strict=False, uid="mlp")
