"""Chapter 09's judge: MoE LoRA on a tiny Mixtral and a tiny Qwen2-MoE against PEFT, one adapter at a time.

Seeded tiny models (built from configs, nothing downloaded) with ``experts_implementation="eager"``
(so a token without LoRA can be compared with the base experts bit for bit), PEFT adapters of ranks
4, 8 and 16 on the routed experts (``target_parameters``) and on attention (and, in Qwen2-MoE, on the
shared expert), plus one adapter whose layer-1 experts were deleted from its file. Ours: ONE mixed
batch served from a ``MoELoRAMemoryPool`` through ``wrap_moe_model``; PEFT cannot mix these adapters
in a batch (``adapter_names=`` refuses ParamWrapper), so the reference runs each adapter's requests
with ``set_adapter`` and the base requests on the plain model. fp32 throughout, the tolerance of
tests/test_layers.py (errors are ~1e-7 of the logits' scale).
"""
import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference.moe import lora as moe_lora
from reference.batch_info import batch_info_from_requests
from reference.layers import LoRAContext, LoRALinear
from reference.mem_pool import snapshot_diff
from reference.moe.adapters import load_moe_peft_adapter, split_expert_lora
from reference.moe.layers import (MOE_LORA_OPS, LoRAExperts, get_moe_op, moe_module_specs, unwrap_moe_model,
                                  wrap_moe_model)
from reference.moe.pool import MoELoRAAdapter, MoELoRAMemoryPool

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

RTOL = 1e-5  # fp32, relative to the largest logit: PEFT folds s*B@A into W, we add it after (~1e-7)
LAYERS, MAX_RANK = 2, 16
COMMON = dict(hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
              num_experts_per_tok=2, vocab_size=128, max_position_embeddings=64, experts_implementation="eager")
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=48, num_local_experts=4, **COMMON)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6, **COMMON)),
}
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHARED = ["gate_proj", "up_proj", "down_proj"]  # Qwen2-MoE's mlp.shared_expert (dense LoRA)
ADAPTERS = {  # name -> (LoraConfig kwargs, extra target_modules for Qwen2-MoE)
    "r4": (dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), []),
    "r8": (dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True), []),
    "r16": (dict(r=16, lora_alpha=32, target_modules=["q_proj", "o_proj"]), SHARED),
    "nolayer1": (dict(r=8, lora_alpha=16, target_modules=["v_proj"]), SHARED),  # layer-1 experts deleted
}
NAMES = ["r8", "__base__", "r4", "r16", "nolayer1", "r8"]  # one request per row
LENS = [5, 7, 3, 6, 4, 2]


# ---- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(MODELS))
def setup(request, tmp_path_factory):
    """One model kind: base model, adapter folders, PEFT with every adapter, our adapters."""
    kind = request.param
    torch.manual_seed(0)
    base = MODELS[kind]().eval()
    root = tmp_path_factory.mktemp(kind)
    dirs = {}
    for seed, (name, (kw, shared)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + seed)
        targets = kw["target_modules"] + (shared if kind == "qwen2_moe" else [])
        config = peft.LoraConfig(init_lora_weights=False, target_parameters=EXPERTS, **{**kw, "target_modules": targets})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.get_peft_model(copy.deepcopy(base), config).save_pretrained(root / name)
        dirs[name] = root / name
    _drop_layer_experts(dirs["nolayer1"], layer=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = peft.PeftModel.from_pretrained(copy.deepcopy(base), dirs["r4"], adapter_name="r4")
        for name in ADAPTERS:
            if name != "r4":
                pm.load_adapter(dirs[name], adapter_name=name)
    dense, experts = moe_module_specs(base.config)
    ours = {name: load_moe_peft_adapter(dirs[name], dense, experts, LAYERS, MAX_RANK, uid=name) for name in ADAPTERS}
    return dict(kind=kind, base=base, dirs=dirs, peft=pm.eval(), adapters=ours, dense=dense, experts=experts)


def _drop_layer_experts(folder, layer):
    """Delete one layer's expert LoRA from a saved adapter; PEFT then initialises it with lora_B = 0
    (init_lora_weights=True), i.e. no delta: the same adapter for PEFT and for us."""
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    kept = {k: v for k, v in tensors.items() if f"layers.{layer}.mlp.experts." not in k}
    assert len(kept) < len(tensors)
    save_file(kept, str(folder / "adapter_model.safetensors"))
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, "init_lora_weights": True}))


def _pool(s, num_slots, adapters=None, **kw):
    adapters = s["adapters"] if adapters is None else adapters
    return MoELoRAMemoryPool(s["dense"], LAYERS, num_slots, MAX_RANK, expert_modules=s["experts"],
                             adapter_source=adapters.__getitem__, **kw)


def _ours(s, pool):
    context = LoRAContext()
    return wrap_moe_model(copy.deepcopy(s["base"]), pool, context), context


def _set_batch(context, pool, names, lens):
    uids = [None if n == "__base__" else n for n in names]
    uid_to_slot = pool.prepare_lora_batch(uids)
    context.set_batch(batch_info_from_requests(uids, lens, uid_to_slot, pool.lora_ranks_host, pool.scalings_host,
                                               "cpu"))
    return uid_to_slot


def _prompts(lens, seed):
    g = torch.Generator().manual_seed(seed)
    pad = max(lens)
    ids = torch.randint(0, 128, (len(lens), pad), generator=g)
    mask = (torch.arange(pad)[None, :] < torch.tensor(lens)[:, None]).long()
    return ids, mask, torch.arange(pad).expand_as(ids)


def _close(got, want, what):
    err, scale = (got - want).abs().max().item(), want.abs().max().item()
    return err <= RTOL * scale, f"{what}: max abs error {err:.3g}, scale {scale:.3g}"


def _reference(s, names, model_inputs):
    """PEFT once per adapter on that adapter's rows (set_adapter), the plain base model for base rows."""
    logits = None
    for name in dict.fromkeys(names):
        rows = [i for i, n in enumerate(names) if n == name]
        if name == "__base__":
            model = s["base"]
        else:
            s["peft"].set_adapter(name)
            model = s["peft"]
        with torch.no_grad():
            out = model(**{k: v[rows] for k, v in model_inputs.items()}).logits
        logits = out.new_zeros(len(names), *out.shape[1:]) if logits is None else logits
        logits[rows] = out
    return logits


def _run_ours(model, **inputs):
    with torch.no_grad():
        return model(**inputs)


# ---- the layout: ours equals PEFT's own per-expert delta --------------------------------------------
def test_expert_layout_matches_peft(setup):
    """Per expert, s * B_e @ A_e from our pool layout equals PEFT's get_delta_weight; reading lora_B in
    expert-major blocks (like lora_A) does not."""
    s = setup
    ad, spec = s["adapters"]["r8"], {m.name: m for m in s["experts"]}
    experts_mod = s["peft"].base_model.model.model.layers[0].mlp.experts  # outer wrapper: down_proj
    wrappers = {experts_mod.parameter_name: experts_mod, experts_mod.base_layer.parameter_name: experts_mod.base_layer}
    assert set(wrappers) == {"gate_up_proj", "down_proj"}
    for name, wrapper in wrappers.items():
        peft_delta = wrapper.get_delta_weight("r8")  # [E, out, in]
        inter = spec[name].out_features[0]
        for e in range(spec[name].num_experts):
            A, B = ad.expert_weights[(0, name, e)]
            r = B.shape[1]
            if name == "gate_up_proj":  # parts: A rows [0, r) gate, [r, 2r) up; B rows by GATE_UP_HALVES
                delta = torch.cat([B[slice(*moe_lora.gate_up_half(h, inter))] @ A[i * r:(i + 1) * r]
                                   for i, h in enumerate(("gate", "up"))])
            else:
                delta = B @ A
            torch.testing.assert_close(ad.scaling * delta, peft_delta[e], rtol=1e-5, atol=1e-6)
        A_all, B_all = wrapper.lora_A["r8"].weight, wrapper.lora_B["r8"].weight
        r = A_all.shape[0] // spec[name].num_experts
        blocked = B_all[:, r:2 * r] @ A_all[r:2 * r]  # the wrong reading of expert 1
        assert (ad.scaling * blocked - peft_delta[1]).abs().max() > 1e-3
        pairs = split_expert_lora(A_all, B_all, spec[name].num_experts)
        torch.testing.assert_close(ad.scaling * pairs[1][1] @ pairs[1][0], peft_delta[1], rtol=1e-5, atol=1e-6)


# ---- the judge: one mixed batch, prefill then greedy decode -------------------------------------------
def test_mixed_batch_prefill_and_decode_match_peft(setup):
    s = setup
    pool = _pool(s, num_slots=len(ADAPTERS) + 1)
    ours, context = _ours(s, pool)
    n_linear = sum(isinstance(m, LoRALinear) for m in ours.modules())
    assert n_linear == LAYERS * (4 + (3 if s["kind"] == "qwen2_moe" else 0))
    assert sum(isinstance(m, LoRAExperts) for m in ours.modules()) == LAYERS
    ids, mask, pos = _prompts(LENS, 7)
    _set_batch(context, pool, NAMES, [ids.shape[1]] * len(NAMES))
    out = _run_ours(ours, input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    want = _reference(s, NAMES, dict(input_ids=ids, attention_mask=mask, position_ids=pos))
    ok, msg = _close(out.logits[mask.bool()], want[mask.bool()], f"{s['kind']} prefill")
    assert ok, msg
    plain = _run_ours(s["base"], input_ids=ids, attention_mask=mask, position_ids=pos).logits
    # close, not bit-equal: other requests' LoRA changes their routing, so each expert's GEMM has another
    # number of rows than in the plain model (the layer-level tests below compare bits on equal inputs)
    ok, msg = _close(out.logits[1], plain[1], "base request vs the plain model")
    assert ok, msg
    for b, name in enumerate(NAMES):  # not vacuous: every adapter changes its row
        if name != "__base__":
            assert (out.logits[b, :LENS[b]] - plain[b, :LENS[b]]).abs().max() > 1e-3, name
    _greedy_decode(s, ours, context, pool, out, ids, mask)


def _greedy_decode(s, ours, context, pool, out, ids, mask, steps=3):
    """Decode steps of one token per request; PEFT per adapter with its own KV cache."""
    groups = {name: [i for i, n in enumerate(NAMES) if n == name] for name in dict.fromkeys(NAMES)}
    last = torch.tensor(LENS) - 1
    rows = torch.arange(len(NAMES))
    caches, ref_logits = {}, torch.zeros(len(NAMES), out.logits.shape[-1])
    for name, rs in groups.items():
        model = s["base"] if name == "__base__" else s["peft"]
        if name != "__base__":
            model.set_adapter(name)
        with torch.no_grad():
            ref = model(input_ids=ids[rs], attention_mask=mask[rs], position_ids=torch.arange(ids.shape[1]).expand(
                len(rs), -1), use_cache=True)
        caches[name], ref_logits[rs] = ref.past_key_values, ref.logits[torch.arange(len(rs)), last[rs]]
    got = out.logits[rows, last]
    for step in range(steps + 1):
        ok, msg = _close(got, ref_logits, f"{s['kind']} decode step {step}")
        assert ok, msg
        token = got.argmax(-1)
        assert torch.equal(token, ref_logits.argmax(-1)), f"step {step}: generated tokens differ"
        if step == steps:
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        step_pos = (last + 1 + step)[:, None]
        _set_batch(context, pool, NAMES, [1] * len(NAMES))
        out = _run_ours(ours, input_ids=token[:, None], attention_mask=mask, position_ids=step_pos,
                        past_key_values=out.past_key_values, use_cache=True)
        got = out.logits[:, -1]
        for name, rs in groups.items():
            model = s["base"] if name == "__base__" else s["peft"]
            if name != "__base__":
                model.set_adapter(name)
            with torch.no_grad():
                ref = model(input_ids=token[rs, None], attention_mask=mask[rs], position_ids=step_pos[rs],
                            past_key_values=caches[name], use_cache=True)
            caches[name], ref_logits[rs] = ref.past_key_values, ref.logits[:, -1]


# ---- evictions: fewer slots than adapters, a later batch reloads -------------------------------------
def test_evictions_between_batches_match_peft(setup):
    """3 slots for 4 uids over three batches: r8 is evicted by r16, then reloaded over r16's slot."""
    s = setup
    pool = _pool(s, num_slots=3, max_loaded_loras=3)
    ours, context = _ours(s, pool)
    batches = [(["r4", "__base__", "r8"], [4, 6, 3]), (["r16", "r4", "r16"], [5, 2, 4]),
               (["r8", "__base__", "r8"], [3, 5, 6])]
    for i, (names, lens) in enumerate(batches):
        ids, mask, pos = _prompts(lens, 20 + i)
        uid_to_slot = _set_batch(context, pool, names, [ids.shape[1]] * len(names))
        got = _run_ours(ours, input_ids=ids, attention_mask=mask, position_ids=pos).logits
        want = _reference(s, names, dict(input_ids=ids, attention_mask=mask, position_ids=pos))
        ok, msg = _close(got[mask.bool()], want[mask.bool()], f"{s['kind']} batch {i}")
        assert ok, msg
    evicted = [e for e in pool.events if e[0] == "evict"]
    assert ("evict", "r8", 2) in evicted and ("evict", "r16", 2) in evicted, pool.events
    assert pool.events[-1][:3] == ("load", "r8", 2)
    slot = uid_to_slot["r8"]  # held r16 before: nothing past r8's rank survives
    for name, spec in {m.name: m for m in s["experts"]}.items():
        for layer in range(LAYERS):
            assert not pool.moe_A_buffer[name][layer][slot, :, spec.stack_num * 8:].any()
            assert not pool.moe_B_buffer[name][layer][slot, :, :, 8:].any()
            assert pool.moe_lora_ranks[name][layer][slot].tolist() == [8] * spec.num_experts


# ---- missing layers and experts contribute exactly nothing ------------------------------------------
def _capture(module):
    seen = []
    handle = module.register_forward_hook(lambda m, args, out: seen.append((args, out)))
    return seen, handle


def test_missing_layer_is_rank_zero_and_bit_exact(setup):
    """nolayer1 has no experts in layer 1: rank 0 and zeros there, and its tokens get the base experts'
    output bit for bit (same inputs); in layer 0 its experts do change the output."""
    s = setup
    pool = _pool(s, num_slots=len(ADAPTERS) + 1)
    ours, context = _ours(s, pool)
    ids, mask, pos = _prompts(LENS, 7)
    uid_to_slot = _set_batch(context, pool, NAMES, [ids.shape[1]] * len(NAMES))
    slot, pad = uid_to_slot["nolayer1"], ids.shape[1]
    for name in pool.expert_modules:
        assert not pool.moe_lora_ranks[name][1][slot].any() and pool.moe_lora_ranks[name][0][slot].all()
        assert not pool.moe_A_buffer[name][1][slot].any() and not pool.moe_B_buffer[name][1][slot].any()
    hooks = [_capture(ours.model.layers[i].mlp.experts) for i in range(LAYERS)]
    _run_ours(ours, input_ids=ids, attention_mask=mask, position_ids=pos)
    b = NAMES.index("nolayer1")
    rows, base_rows = slice(b * pad, (b + 1) * pad), slice(pad, 2 * pad)  # request b; request 1 is the base
    for layer, (seen, handle) in enumerate(hooks):
        handle.remove()
        (args, out), = seen
        with torch.no_grad():
            plain = ours.model.layers[layer].mlp.experts.base(*args)  # transformers' own eager experts
        assert torch.equal(out[base_rows], plain[base_rows]), f"layer {layer}: the base request"
        if layer == 1:
            assert torch.equal(out[rows], plain[rows]), "a layer the adapter lacks must add exactly nothing"
        else:
            assert (out[rows] - plain[rows]).abs().max() > 1e-4


def test_missing_experts_are_rank_zero_and_bit_exact(setup):
    """An adapter without experts 0 and 1 in layer 0: tokens routed only to them get the base output bit
    for bit; a token with one covered expert does not; base-slot tokens never do."""
    s = setup
    full = s["adapters"]["r8"]
    part = MoELoRAAdapter(uid="part", rank=full.rank, scaling=full.scaling, weights=full.weights,
                          expert_weights={k: v for k, v in full.expert_weights.items() if k[0] != 0 or k[2] >= 2})
    pool = _pool(s, num_slots=2, adapters={"part": part})
    pool.prepare_lora_batch(["part", None])
    slot = pool.uid_to_buffer_id["part"]
    E = pool.expert_modules["down_proj"].num_experts
    assert pool.moe_lora_ranks["down_proj"][0][slot].tolist() == [0, 0] + [8] * (E - 2)
    assert not pool.moe_A_buffer["gate_up_proj"][0][slot, :2].any()
    context = LoRAContext()
    base_experts = s["base"].model.layers[0].mlp.experts
    layer = LoRAExperts(base_experts, pool, 0, context)
    uids = ["part"] * 6 + [None] * 2
    context.set_batch(batch_info_from_requests(uids, [1] * 8, pool.uid_to_buffer_id, pool.lora_ranks_host,
                                               pool.scalings_host, "cpu"))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g)
    idx = torch.tensor([[0, 1], [1, 0], [0, 1], [0, 2], [3, 1], [2, 3], [2, 3], [0, 1]])
    w = torch.rand(8, 2, generator=g)
    with torch.no_grad():
        got, want = layer(x, idx, w), base_experts(x, idx, w)
    assert torch.equal(got[:3], want[:3]) and torch.equal(got[6:], want[6:])
    assert all((got[t] - want[t]).abs().max() > 1e-4 for t in (3, 4, 5))


# ---- a malformed adapter: a clear error, the pool exactly as it was -----------------------------------
def test_malformed_adapter_file_is_refused(setup, tmp_path):
    """An expert LoRA for another expert count (3 experts' rows in a 4+-expert model) is named in the error."""
    s = setup
    folder = tmp_path / "bad"
    folder.mkdir()
    tensors = load_file(str(s["dirs"]["r4"] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"  # down_proj (the outer wrapper)
    tensors[key], keyB = tensors[key][:-4], key.replace("lora_A", "lora_B")
    tensors[keyB] = tensors[keyB][:, :-4].contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text((s["dirs"]["r4"] / "adapter_config.json").read_text())
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.down_proj.*another expert count"):
        load_moe_peft_adapter(folder, s["dense"], s["experts"], LAYERS, MAX_RANK, uid="bad")


@pytest.mark.parametrize("defect", ["expert_out_of_range", "wrong_shape", "three_part_key"])
def test_malformed_adapter_leaves_pool_unchanged(setup, defect):
    s = setup
    good = s["adapters"]["r16"]
    experts = dict(good.expert_weights)  # valid entries first: a write-as-you-check pool would write them
    A, B = experts[(1, "down_proj", 0)]
    E = s["experts"][0].num_experts
    bad_entry = {"expert_out_of_range": ((1, "down_proj", E), (A, B)),
                 "wrong_shape": ((1, "down_proj", 1), (A[:, :-1], B)),
                 "three_part_key": ((1, "down_proj"), (A, B))}[defect]
    experts[bad_entry[0]] = bad_entry[1]
    bad = MoELoRAAdapter(uid="bad", rank=good.rank, scaling=good.scaling, weights=good.weights, expert_weights=experts)
    pool = _pool(s, num_slots=3, adapters={**s["adapters"], "bad": bad})
    pool.prepare_lora_batch(["r4", "r8", None])
    before = pool.snapshot()
    with pytest.raises(ValueError, match="adapter 'bad'"):
        pool.prepare_lora_batch(["bad", None])
    assert snapshot_diff(before, pool.snapshot()) == []
    with pytest.raises(ValueError, match="adapter 'bad'"):
        pool.load_to_slot(bad, pool.uid_to_buffer_id["r4"])
    assert snapshot_diff(before, pool.snapshot()) == []


# ---- the gate/up halves: a swapped table makes PEFT disagree ------------------------------------------
def test_swapped_gate_up_halves_disagree_with_peft(setup, monkeypatch):
    s = setup
    dense, experts = s["dense"], s["experts"]
    with monkeypatch.context() as m:  # a loader that puts the gate's delta on up
        m.setattr(moe_lora, "GATE_UP_HALVES", {"gate": 1, "up": 0})
        swapped = load_moe_peft_adapter(s["dirs"]["r4"], dense, experts, LAYERS, MAX_RANK, uid="r4")
    names, lens = ["r4", "r4"], [5, 3]
    ids, mask, pos = _prompts(lens, 31)
    want = _reference(s, names, dict(input_ids=ids, attention_mask=mask, position_ids=pos))
    results = {}
    for label, adapter in {"right": s["adapters"]["r4"], "swapped": swapped}.items():
        pool = _pool(s, num_slots=2, adapters={"r4": adapter})
        ours, context = _ours(s, pool)
        _set_batch(context, pool, names, [ids.shape[1]] * 2)
        got = _run_ours(ours, input_ids=ids, attention_mask=mask, position_ids=pos).logits
        results[label] = _close(got[mask.bool()], want[mask.bool()], label)
    assert results["right"][0], results["right"][1]
    assert not results["swapped"][0], "swapping the gate/up halves must break the comparison with PEFT"


# ---- the op is chosen by name; the wrap is undone -----------------------------------------------------
def test_moe_op_registry_and_unwrap(setup):
    s = setup
    assert get_moe_op("torch") is moe_lora.fused_moe_lora_torch
    with pytest.raises(ValueError, match="unknown MoE LoRA backend"):
        get_moe_op("cuda")
    if MOE_LORA_OPS["triton"] is None:
        with pytest.raises(ValueError, match="not available"):
            get_moe_op("triton")
    pool = _pool(s, num_slots=2)
    model = copy.deepcopy(s["base"])
    originals = {p: m for p, m in model.named_modules() if p.endswith("mlp.experts") or p.endswith("q_proj")}
    wrap_moe_model(model, pool, LoRAContext())
    with pytest.raises(ValueError, match="already wrapped"):
        wrap_moe_model(model, pool, LoRAContext())
    unwrap_moe_model(model)
    assert all(model.get_submodule(p) is m for p, m in originals.items())
