"""The adapter memory pool (reference/mem_pool.py) and its trace replay (reference/pool_trace.py):
hand-worked event logs, the zero-fill invariant, every rejected input leaving the snapshot unchanged,
and a brute-force model of the slot decisions on random traces."""
import copy
import dataclasses
import json
import pickle
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference.mem_pool import (EMPTY_SLOT, AdapterRegistry, EmptySlot, LoRAAdapter, LoRAMemoryPool,
                                ModuleSpec, events_from_json, events_to_json, snapshot_diff,
                                uid_from_json, uid_sort_key, uid_to_json)
from reference.pool_trace import TraceConfig, make_trace, simulate_trace, zipf_probabilities

HIDDEN = 8
MODULES = [ModuleSpec("q_proj", HIDDEN, (HIDDEN,)), ModuleSpec("v_proj", HIDDEN, (HIDDEN,))]


def lora(uid, rank=2, modules=("q_proj", "v_proj"), layers=(0, 1), seed=0, scaling=0.5):
    """An adapter with seeded random weights for every (layer, module) asked for."""
    g = torch.Generator().manual_seed(seed)
    weights = {(layer, m): (torch.randn(rank, HIDDEN, generator=g), torch.randn(HIDDEN, rank, generator=g))
               for layer in layers for m in modules}
    return LoRAAdapter(uid=uid, rank=rank, scaling=scaling, weights=weights)


def make_pool(slots=2, adapters=(), policy="lru", max_loaded_loras=None, num_layers=2, max_rank=4):
    source = {a.uid: a for a in adapters}
    return LoRAMemoryPool(MODULES, num_layers, slots, max_rank, eviction_policy=policy,
                          adapter_source=source.__getitem__, max_loaded_loras=max_loaded_loras)


def assert_rejected_unchanged(pool, call, match):
    before = pool.snapshot()
    with pytest.raises(ValueError, match=match):
        call()
    assert snapshot_diff(before, pool.snapshot()) == []


def assert_slot_holds(pool, slot, adapter):
    """The slot's buffers are exactly zeros plus the adapter's weights at its own rank."""
    rank = 0 if adapter is None else adapter.rank
    scaling = 0.0 if adapter is None else adapter.scaling
    assert pool.lora_ranks[slot].item() == rank
    assert pool.scalings[slot].item() == torch.tensor(scaling, dtype=torch.float32).item()
    for name in pool.modules:
        for layer in range(pool.num_layers):
            exp_a = torch.zeros_like(pool.A_buffer[name][layer][slot])
            exp_b = torch.zeros_like(pool.B_buffer[name][layer][slot])
            if adapter is not None and (layer, name) in adapter.weights:
                a, b = adapter.weights[(layer, name)]
                exp_a[: a.shape[0]], exp_b[:, :rank] = a, b
            assert torch.equal(pool.A_buffer[name][layer][slot], exp_a), (slot, name, layer)
            assert torch.equal(pool.B_buffer[name][layer][slot], exp_b), (slot, name, layer)


# ---- EMPTY_SLOT and ModuleSpec ----------------------------------------------------------------
def test_empty_slot_is_a_singleton_through_copy_and_pickle():
    assert EmptySlot() is EMPTY_SLOT and repr(EMPTY_SLOT) == "EMPTY_SLOT"
    assert copy.copy(EMPTY_SLOT) is EMPTY_SLOT and copy.deepcopy(EMPTY_SLOT) is EMPTY_SLOT
    table = [EMPTY_SLOT, None, "A"]
    for clone in (copy.deepcopy(table), pickle.loads(pickle.dumps(table))):
        assert clone[0] is EMPTY_SLOT and clone[1] is None
    assert EMPTY_SLOT is not None and EMPTY_SLOT != None  # noqa: E711  (None is the base model)


def test_module_spec_properties_and_errors():
    qkv = ModuleSpec("qkv_proj", 4096, [4096, 1024, 1024])
    assert (qkv.stack_num, qkv.out_total, qkv.slice_offsets) == (3, 6144, (0, 4096, 5120, 6144))
    assert qkv.out_features == (4096, 1024, 1024)
    for args in [("", 8, (8,)), ("q", 0, (8,)), ("q", 8, ()), ("q", 8, (8, -1))]:
        with pytest.raises(ValueError):
            ModuleSpec(*args)


# ---- construction --------------------------------------------------------------------------
def test_buffers_allocated_once_with_contract_shapes():
    qkv = ModuleSpec("qkv_proj", 8, (8, 4, 4))
    pool = LoRAMemoryPool([qkv], 3, 5, 4, dtype=torch.float16)
    assert len(pool.A_buffer["qkv_proj"]) == 3
    assert pool.A_buffer["qkv_proj"][0].shape == (5, 12, 8) and pool.A_buffer["qkv_proj"][0].dtype == torch.float16
    assert pool.B_buffer["qkv_proj"][2].shape == (5, 16, 4)
    assert pool.lora_ranks.dtype == torch.int32 and pool.scalings.dtype == torch.float32
    assert pool.buffer_id_to_uid == [EMPTY_SLOT] * 5 and pool.uid_to_buffer_id == {}


@pytest.mark.parametrize("kwargs, match", [
    (dict(modules=[]), "non-empty"),
    (dict(modules=MODULES + MODULES[:1]), "unique"),
    (dict(num_layers=0), "num_layers"),
    (dict(max_loras_per_batch=0), "max_loras_per_batch"),
    (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loaded_loras=2), r"max_loaded_loras \(2\) must be >= max_loras_per_batch \(3\)"),
    (dict(eviction_policy="lfu"), "unknown eviction policy"),
])
def test_constructor_errors(kwargs, match):
    args = dict(modules=MODULES, num_layers=1, max_loras_per_batch=3, max_lora_rank=2) | kwargs
    with pytest.raises(ValueError, match=match):
        LoRAMemoryPool(**args)


# ---- data plane: load_to_slot ----------------------------------------------------------------
def test_zero_fill_case_missing_module_leaves_no_trace():
    """One slot, hidden 8, r=2, targets q and v; A has q and v, B only q. Serving B after A puts B
    into A's old slot: B's v delta must be exactly 0, not A's leftover."""
    a, b = lora("A", modules=("q_proj", "v_proj"), seed=1), lora("B", modules=("q_proj",), seed=2)
    pool = make_pool(slots=1, adapters=[a, b])
    pool.prepare_lora_batch({"A"})
    assert pool.B_buffer["v_proj"][0][0].abs().sum() > 0  # A's v is really there
    pool.prepare_lora_batch({"B"})
    assert pool.events[-2:] == [("evict", "A", 0), ("load", "B", 0, "disk")]
    x = torch.randn(3, HIDDEN)
    for layer in range(2):
        a_v, b_v = pool.A_buffer["v_proj"][layer][0], pool.B_buffer["v_proj"][layer][0]
        assert torch.equal(pool.scalings[0] * (x @ a_v.T) @ b_v.T, torch.zeros(3, HIDDEN))
        a_q, b_q = b.weights[(layer, "q_proj")]
        got = (x @ pool.A_buffer["q_proj"][layer][0].T) @ pool.B_buffer["q_proj"][layer][0].T
        torch.testing.assert_close(got, (x @ a_q.T) @ b_q.T)
    assert_slot_holds(pool, 0, b)


def test_load_to_slot_stacked_layout_past_the_rank_is_zero():
    qkv = ModuleSpec("qkv_proj", 8, (8, 4, 4))
    pool = LoRAMemoryPool([qkv], 1, 2, 4)
    a, b = torch.randn(6, 8), torch.randn(16, 2)  # 3 parts at rank 2
    adapter = LoRAAdapter("A", 2, 0.25, {(0, "qkv_proj"): (a, b)})
    pool.load_to_slot(adapter, 1)
    assert torch.equal(pool.A_buffer["qkv_proj"][0][1, :6], a)
    assert torch.equal(pool.A_buffer["qkv_proj"][0][1, 6:], torch.zeros(6, 8))
    assert torch.equal(pool.B_buffer["qkv_proj"][0][1, :, :2], b)
    assert torch.equal(pool.B_buffer["qkv_proj"][0][1, :, 2:], torch.zeros(16, 2))
    assert pool.lora_ranks.tolist() == [0, 2] and pool.scalings.tolist() == [0.0, 0.25]
    assert pool.buffer_id_to_uid == [EMPTY_SLOT, "A"] and pool.uid_to_buffer_id == {"A": 1}


def test_load_to_slot_base_and_overwrite_update_maps_and_policy():
    pool = make_pool(slots=2)
    pool.load_to_slot(lora("A", seed=3), 0)
    pool.load_to_slot(None, 0)  # the base model replaces A: zeros, rank 0
    assert_slot_holds(pool, 0, None)
    assert pool.uid_to_buffer_id == {None: 0} and pool.eviction_policy.order() == (None,)
    assert pool.events == []  # events record prepare_lora_batch's decisions only


def test_nan_weights_are_allowed_and_snapshots_compare_bitwise():
    nan = lora("N", seed=4)
    nan.weights[(0, "q_proj")][0][0, 0] = float("nan")
    pool = make_pool(slots=1)
    pool.load_to_slot(nan, 0)
    assert torch.isnan(pool.A_buffer["q_proj"][0][0, 0, 0])
    assert snapshot_diff(pool.snapshot(), pool.snapshot()) == []


def test_snapshot_diff_sees_every_kind_of_change():
    pool = make_pool(slots=2, adapters=[lora("A")])
    before = pool.snapshot()
    pool.A_buffer["v_proj"][1][1, 0, 0] = -0.0  # 0.0 and -0.0 differ in bits
    pool.pin("A")
    diff = snapshot_diff(before, pool.snapshot())
    assert diff == ["['A_buffer']['v_proj'][1]", "['pinned']"]
    assert snapshot_diff([1, 2], (1, 2)) == ["<root>"] and snapshot_diff({"a": [1]}, {"b": [1]}) == ["<root>"]
    assert snapshot_diff({"a": [torch.ones(1)]}, {"a": [torch.ones(1), torch.ones(1)]}) == ["['a']"]
    pool.prepare_lora_batch({"A"})
    changed = {p.split("]")[0] + "]" for p in snapshot_diff(before, pool.snapshot())}
    assert {"['uid_to_buffer_id']", "['buffer_id_to_uid']", "['policy_order']", "['cpu_cache']",
            "['events']", "['lora_ranks']"} <= changed


GOOD = lora("G", seed=5)


def _bad(**change):
    fields = dict(uid="X", rank=2, scaling=1.0, weights=dict(GOOD.weights)) | change
    return LoRAAdapter(**fields)


def _bad_weight(key, a_shape=(2, HIDDEN), b_shape=(HIDDEN, 2), dtype=torch.float32):
    return _bad(weights={key: (torch.zeros(a_shape, dtype=dtype), torch.zeros(b_shape, dtype=dtype))})


BAD_ADAPTERS = [
    (_bad(rank=5), r"rank 5 outside 1..max_lora_rank \(4\)"),
    (_bad(rank=0), "rank 0 outside"),
    (_bad(uid=None), "must not be None"),
    (_bad(uid=EMPTY_SLOT), "must not be EMPTY_SLOT"),
    (_bad(scaling="2"), "scaling must be a number"),
    (_bad(weights=[]), "weights must be a dict"),
    (_bad_weight((0, "k_proj")), r"\(0, 'k_proj'\) is not \(layer, module\) .*\['q_proj', 'v_proj'\]"),
    (_bad_weight("q_proj"), "is not \\(layer, module\\)"),
    (_bad_weight((2, "q_proj")), r"layer index 2 of q_proj outside 0..1"),
    (_bad_weight((-1, "q_proj")), "layer index -1"),
    (_bad_weight((0, "q_proj"), a_shape=(3, HIDDEN)), r"A of \(0, 'q_proj'\) has shape \(3, 8\), expected \(2, 8\)"),
    (_bad_weight((0, "v_proj"), b_shape=(HIDDEN, 3)), r"B of \(0, 'v_proj'\) has shape \(8, 3\), expected \(8, 2\)"),
    (_bad_weight((0, "q_proj"), dtype=torch.int32), "must be a floating tensor"),
    (_bad(weights={(0, "q_proj"): (torch.zeros(2, HIDDEN),)}), "must be a pair"),
    ("not an adapter", "expected a LoRAAdapter"),
]


@pytest.mark.parametrize("adapter, match", BAD_ADAPTERS)
def test_bad_adapter_rejected_by_validate_and_load_to_slot_unchanged(adapter, match):
    pool = make_pool(slots=2, adapters=[lora("A", seed=6)])
    pool.prepare_lora_batch({"A"})  # some state to preserve
    assert_rejected_unchanged(pool, lambda: pool.validate(adapter), match)
    assert_rejected_unchanged(pool, lambda: pool.load_to_slot(adapter, 1), match)
    assert_rejected_unchanged(pool, lambda: pool.load_to_slot(adapter, 0), match)


@pytest.mark.parametrize("adapter, match", [b for b in BAD_ADAPTERS if isinstance(b[0], LoRAAdapter)
                                            and b[0].uid == "X"])
def test_bad_adapter_from_the_source_rejected_before_any_eviction(adapter, match):
    pool = make_pool(slots=2, adapters=[lora("A", seed=7), lora("B", seed=8), adapter])
    pool.prepare_lora_batch({"A", "B"})  # full: serving X would need an eviction
    assert_rejected_unchanged(pool, lambda: pool.prepare_lora_batch({"X"}), match)


@pytest.mark.parametrize("slot, match", [(2, r"slot 2 outside 0..1"), (-1, "slot -1"), (True, "slot True")])
def test_load_to_slot_bad_slot(slot, match):
    pool = make_pool(slots=2)
    assert_rejected_unchanged(pool, lambda: pool.load_to_slot(GOOD, slot), match)


def test_load_to_slot_refuses_a_second_slot_and_pinned_owner():
    pool = make_pool(slots=3)
    pool.load_to_slot(GOOD, 0)
    assert_rejected_unchanged(pool, lambda: pool.load_to_slot(GOOD, 1), "already resident in slot 0")
    pool.pin("G")
    assert_rejected_unchanged(pool, lambda: pool.load_to_slot(None, 0), "holds pinned 'G'")


# ---- serving: hand-worked event logs --------------------------------------------------------
def test_running_example_of_the_module_docstring():
    pool = make_pool(slots=2, adapters=[lora("A"), lora("B", seed=1)])
    assert pool.prepare_lora_batch({"A", None}) == {None: 0, "A": 1}
    assert pool.prepare_lora_batch(["B", None, "B"]) == {None: 0, "B": 1}
    assert pool.events == [("load", None, 0, "base"), ("load", "A", 1, "disk"),
                           ("hit", None, 0), ("evict", "A", 1), ("load", "B", 1, "disk")]
    assert pool.lora_ranks.tolist() == [0, 2]


@pytest.mark.parametrize("policy, tail", [
    ("lru", [("hit", "A", 0), ("evict", "B", 1), ("load", "D", 1, "disk")]),
    ("fifo", [("hit", "A", 0), ("evict", "A", 0), ("load", "D", 0, "disk")]),
])
def test_lru_and_fifo_pick_different_victims(policy, tail):
    pool = make_pool(slots=3, adapters=[lora(u, seed=i) for i, u in enumerate("ABCD")], policy=policy)
    for batch in [{"A"}, {"B"}, {"C"}, {"A"}, {"D"}]:
        pool.prepare_lora_batch(batch)
    assert pool.events == [("load", "A", 0, "disk"), ("load", "B", 1, "disk"), ("load", "C", 2, "disk"),
                           *tail]


def test_base_model_evicted_last():
    pool = make_pool(slots=2, adapters=[lora("A"), lora("B", seed=1)])
    for batch in [{None}, {"A"}, {"B"}, {"A", "B"}]:
        pool.prepare_lora_batch(batch)
    assert pool.events == [
        ("load", None, 0, "base"), ("load", "A", 1, "disk"),
        ("evict", "A", 1), ("load", "B", 1, "disk"),  # None was older, A goes first
        ("evict", None, 0), ("load", "A", 0, "cpu"), ("hit", "B", 1),  # only LoRA requests: base goes
    ]
    assert_slot_holds(pool, 0, pool.adapter_source("A"))


def test_running_adapters_are_never_evicted():
    pool = make_pool(slots=2, adapters=[lora(u, seed=i) for i, u in enumerate("ABC")])
    pool.prepare_lora_batch({"A"})
    pool.prepare_lora_batch({"B"})
    assert pool.prepare_lora_batch({"C"}, running={"A"}) == {"A": 0, "C": 1}  # A is the LRU one
    assert pool.events[-3:] == [("hit", "A", 0), ("evict", "B", 1), ("load", "C", 1, "disk")]


def test_pinned_adapters_are_never_evicted_and_pin_limits():
    pool = make_pool(slots=3, adapters=[lora(u, seed=i) for i, u in enumerate("ABCDE")])
    pool.pin("A")
    pool.pin("A")  # idempotent
    for batch in [{"A"}, {"B"}, {"C"}, {"D"}, {"E"}]:
        pool.prepare_lora_batch(batch)
    assert [e for e in pool.events if e[0] == "evict"] == [("evict", "B", 1), ("evict", "C", 2)]
    pool.pin("E")
    assert_rejected_unchanged(pool, lambda: pool.pin("D"), "2 of 3 slots are pinned")
    assert_rejected_unchanged(pool, lambda: pool.pin(EMPTY_SLOT), "cannot be pinned")
    assert_rejected_unchanged(pool, lambda: pool.unpin("B"), "'B' is not pinned")
    assert_rejected_unchanged(pool, lambda: pool.prepare_lora_batch({"B", "C"}),
                              r"needs 2 slots but 2 of 3 hold pinned adapters it does not use: \['A', 'E'\]")
    pool.unpin("E")
    assert pool.prepare_lora_batch({"B", "C"}) == {"B": 1, "C": 2}


def test_cpu_tier_lru_over_host_copies():
    pool = make_pool(slots=1, adapters=[lora(u, seed=i) for i, u in enumerate("ABC")], max_loaded_loras=2)
    for batch in [{"A"}, {"B"}, {"A"}, {"C"}, {"B"}]:
        pool.prepare_lora_batch(batch)
    assert pool.events == [
        ("load", "A", 0, "disk"),
        ("evict", "A", 0), ("load", "B", 0, "disk"),
        ("evict", "B", 0), ("load", "A", 0, "cpu"),
        ("evict", "A", 0), ("cpu_evict", "B"), ("load", "C", 0, "disk"),
        ("evict", "C", 0), ("cpu_evict", "A"), ("load", "B", 0, "disk"),
    ]
    assert tuple(pool.cpu_cache) == ("C", "B")


def test_cpu_cache_keeps_host_copies_of_gpu_residents():
    """FIFO slots, LRU host copies: the least recently used host copy (B) is resident on the GPU, so
    the copy dropped is A's, the adapter just evicted; GPU residents always keep a host copy."""
    pool = make_pool(slots=2, adapters=[lora(u, seed=i) for i, u in enumerate("ABC")], policy="fifo",
                     max_loaded_loras=2)
    for batch in [{"A"}, {"B"}, {"A"}, {"C"}]:
        pool.prepare_lora_batch(batch)
    assert pool.events[-4:] == [("hit", "A", 0), ("evict", "A", 0), ("cpu_evict", "A"),
                                ("load", "C", 0, "disk")]
    assert set(pool.cpu_cache) == set(pool.uid_to_buffer_id) == {"B", "C"}


def test_a_hit_refreshes_the_host_copy():
    pool = make_pool(slots=2, adapters=[lora(u, seed=i) for i, u in enumerate("ABCD")], max_loaded_loras=3)
    for batch in [{"A"}, {"B"}, {"A"}, {"C"}, {"D"}, {"A"}]:
        pool.prepare_lora_batch(batch)
    assert pool.events == [
        ("load", "A", 0, "disk"), ("load", "B", 1, "disk"), ("hit", "A", 0),
        ("evict", "B", 1), ("load", "C", 1, "disk"),
        ("evict", "A", 0), ("cpu_evict", "B"), ("load", "D", 0, "disk"),  # B, not A: A's hit counted
        ("evict", "C", 1), ("load", "A", 1, "cpu"),
    ]
    assert tuple(pool.cpu_cache) == ("C", "D", "A")


@pytest.mark.parametrize("batch, running, match", [
    ({"A", "B", None}, (), r"needs 3 distinct adapters \(base included\) but the pool has 2 slots"),
    ({"A"}, {"B", "C"}, "needs 3 distinct"),
    ({"Z"}, (), "unknown adapter uid 'Z'"),
    ({EMPTY_SLOT}, (), "EMPTY_SLOT marks a free slot"),
    ({"W"}, (), "adapter_source returned uid 'A' when asked for 'W'"),
])
def test_rejected_batches_leave_the_pool_unchanged(batch, running, match):
    adapters = [lora(u, seed=i) for i, u in enumerate("ABC")]
    source = {a.uid: a for a in adapters} | {"W": adapters[0]}
    pool = LoRAMemoryPool(MODULES, 2, 2, 4, adapter_source=source.__getitem__, max_loaded_loras=2)
    pool.prepare_lora_batch({"A", None})
    assert_rejected_unchanged(pool, lambda: pool.prepare_lora_batch(batch, running=running), match)


def test_no_adapter_source():
    pool = LoRAMemoryPool(MODULES, 1, 2, 2)
    assert pool.prepare_lora_batch({None}) == {None: 0}
    assert_rejected_unchanged(pool, lambda: pool.prepare_lora_batch({"A"}), "has no adapter_source")


def test_admission_under_the_slot_cap():
    pool = make_pool(slots=2, adapters=[lora("P")])
    before = pool.snapshot()
    assert pool.admit(["A", "B", None], []) == ([0, 1], [2])
    assert pool.admit(["A", "B", None, "A"], []) == ([0, 1, 3], [2])  # skip and continue
    assert pool.admit(["B", "C", "A"], {"A"}) == ([0, 2], [1])
    assert pool.admit(["A"], {"B", "C", "D"}) == ([], [0])
    assert snapshot_diff(before, pool.snapshot()) == []  # admission is pure
    pool.pin("P")
    assert pool.admit(["A", "B"], []) == ([0, 1], [])  # P pinned but not resident: no slot taken
    pool.prepare_lora_batch({"P"})
    assert pool.admit(["A", "B", "P"], []) == ([0, 2], [1])


def test_admitted_batches_always_fit():
    pool = make_pool(slots=3, adapters=[lora(u, seed=i) for i, u in enumerate("ABCD")])
    pool.pin("A")
    pool.prepare_lora_batch({"A"})
    requests = ["B", None, "C", "D", "B", None]
    admitted, _ = pool.admit(requests, ())
    pool.prepare_lora_batch([requests[i] for i in admitted])  # no ValueError


# ---- identity: registry, uids, JSON ---------------------------------------------------------
def test_registry_new_weights_get_a_new_uid_and_the_pool_serves_them():
    registry = AdapterRegistry()
    v0, v1 = lora("tmp", seed=10), lora("tmp", seed=11)
    uid0 = registry.register("sql", v0.rank, v0.scaling, v0.weights)
    assert registry.register("sql", v0.rank, v0.scaling, dict(v0.weights)) == uid0  # same weights
    uid1 = registry.register("sql", v1.rank, v1.scaling, v1.weights)
    other = registry.register("chat", v0.rank, v0.scaling, v0.weights)
    assert (uid0, uid1, other) == ("sql@0", "sql@1", "chat@2") and registry.uid_of("sql") == uid1
    pool = LoRAMemoryPool(MODULES, 2, 2, 4, adapter_source=registry.load)
    slots = pool.prepare_lora_batch({registry.uid_of("sql")}, running={uid0})  # old version still running
    assert slots == {"sql@0": 0, "sql@1": 1}
    assert_slot_holds(pool, 0, registry.load(uid0))
    assert torch.equal(pool.A_buffer["q_proj"][0][1, :2], v1.weights[(0, "q_proj")][0])
    with pytest.raises(ValueError, match=r"no adapter named 'code'; registered: \['chat', 'sql'\]"):
        registry.uid_of("code")
    with pytest.raises(KeyError):
        registry.load("sql@7")


def test_events_round_trip_through_json_with_explicit_tags():
    pool = make_pool(slots=2, adapters=[lora("A"), lora("B", seed=1)], max_loaded_loras=2)
    for batch in [{None, "A"}, {"B", "A"}, {None}]:
        pool.prepare_lora_batch(batch)
    data = json.loads(json.dumps(events_to_json(pool.events)))
    assert data[0] == ["load", {"base": True}, 0, "base"]
    assert events_from_json(data) == pool.events
    assert uid_to_json(EMPTY_SLOT) == {"empty": True} and uid_from_json({"empty": True}) is EMPTY_SLOT
    assert pool.events[-2:] == [("evict", "A", 1), ("load", None, 1, "base")]
    assert [uid_to_json(u) for u in pool.buffer_id_to_uid] == ["B", {"base": True}]
    with pytest.raises(ValueError, match="unknown uid tag"):
        uid_from_json({"basis": True})
    with pytest.raises(ValueError, match="only str and int uids"):
        uid_to_json(("A", 1))


# ---- random traces against a brute-force model --------------------------------------------
UNIVERSE = [None, "a", "b", "c", "d", "e"]
TINY = [ModuleSpec("q_proj", 4, (4,)), ModuleSpec("kv_proj", 4, (2, 2))]


def _tiny_adapter(uid, rank, modules, seed):
    g = torch.Generator().manual_seed(seed)
    weights = {(0, m.name): (torch.randn(m.stack_num * rank, 4, generator=g),
                             torch.randn(m.out_total, rank, generator=g)) for m in TINY if m.name in modules}
    return LoRAAdapter(uid, rank, 0.5 + seed, weights)


TINY_ADAPTERS = {
    "a": _tiny_adapter("a", 1, {"q_proj"}, 1), "b": _tiny_adapter("b", 2, {"q_proj", "kv_proj"}, 2),
    "c": _tiny_adapter("c", 2, {"kv_proj"}, 3), "d": _tiny_adapter("d", 1, {"q_proj", "kv_proj"}, 4),
    "e": _tiny_adapter("e", 2, {"q_proj"}, 5), "bad": _tiny_adapter("bad", 3, {"q_proj"}, 6),
}


class SlotModel:
    """Brute force of the slot decisions: a list table and a list order (no tiers, no tensors)."""

    def __init__(self, slots, lru):
        self.table, self.order, self.lru = [EMPTY_SLOT] * slots, [], lru

    def mark(self, uid):
        if self.lru and uid in self.order:
            self.order.remove(uid)
        if uid not in self.order:
            self.order.append(uid)

    def step(self, needed, pinned):
        events = []
        for uid in sorted(needed, key=lambda u: (u is not None, u or "")):
            if uid in self.table:
                events.append(("hit", uid, self.table.index(uid)))
            else:
                if EMPTY_SLOT not in self.table:
                    events.append(self._evict(needed, pinned))
                slot = self.table.index(EMPTY_SLOT)  # lowest free slot (the victim's, after an evict)
                self.table[slot] = uid
                events.append(("load", uid, slot))
            self.mark(uid)
        return events

    def _evict(self, needed, pinned):
        candidates = [u for u in self.order if u not in needed and u not in pinned]
        victim = next((u for u in candidates if u is not None), None)
        slot = self.table.index(victim)
        self.table[slot] = EMPTY_SLOT
        self.order.remove(victim)
        return ("evict", victim, slot)


def _expect_failure(pool, needed):
    blocked = {u for u in pool.pinned if u in pool.uid_to_buffer_id and u not in needed}
    return "bad" in needed or len(needed) + len(blocked) > pool.num_slots


def _check_step(pool, needed, result, events, cache_before):
    assert set(result) == needed and all(pool.buffer_id_to_uid[s] == u for u, s in result.items())
    assert len(pool.uid_to_buffer_id) <= pool.num_slots and EMPTY_SLOT not in pool.uid_to_buffer_id
    assert {s: u for u, s in pool.uid_to_buffer_id.items()} == {
        s: u for s, u in enumerate(pool.buffer_id_to_uid) if u is not EMPTY_SLOT}
    for e in events:
        assert e[1] is not EMPTY_SLOT
        if e[0] == "evict":
            assert e[1] not in needed and e[1] not in pool.pinned
        if e[0] == "load":
            assert e[3] == ("base" if e[1] is None else "cpu" if e[1] in cache_before else "disk")
        if e[0] == "cpu_evict":
            assert e[1] not in pool.uid_to_buffer_id and e[1] not in needed
    if pool.max_loaded_loras is not None:
        assert len(pool.cpu_cache) <= pool.max_loaded_loras
    assert set(pool.uid_to_buffer_id) - {None} <= set(pool.cpu_cache)  # host copies of residents
    for slot, uid in enumerate(pool.buffer_id_to_uid):
        assert_slot_holds(pool, slot, None if uid in (None, EMPTY_SLOT) else TINY_ADAPTERS[uid])


@settings(max_examples=120, deadline=None)
@given(
    slots=st.integers(1, 4),
    policy=st.sampled_from(["lru", "fifo"]),
    extra_host=st.one_of(st.none(), st.integers(0, 2)),
    pins=st.lists(st.sampled_from(UNIVERSE), max_size=3, unique=True),
    data=st.data(),
)
def test_random_traces_match_the_model_and_keep_the_invariants(slots, policy, extra_host, pins, data):
    host = None if extra_host is None else slots + extra_host
    pool = LoRAMemoryPool(TINY, 1, slots, 2, eviction_policy=policy,
                          adapter_source=TINY_ADAPTERS.__getitem__, max_loaded_loras=host)
    for uid in pins[: slots - 1]:
        pool.pin(uid)
    model = SlotModel(slots, lru=policy == "lru")
    uids = st.sampled_from(UNIVERSE)
    steps = data.draw(st.lists(st.tuples(
        st.sets(uids, max_size=slots),  # with running and pins, sometimes over capacity
        st.sets(uids, max_size=1),
        st.integers(0, 7).map(lambda i: i == 0),  # sometimes an invalid adapter
    ), min_size=1, max_size=10))
    for batch, running, with_bad in steps:
        batch = batch | {"bad"} if with_bad else batch
        needed, before = batch | running, pool.snapshot()
        if _expect_failure(pool, needed):
            with pytest.raises(ValueError):
                pool.prepare_lora_batch(batch, running=running)
            assert snapshot_diff(before, pool.snapshot()) == []
            continue
        result = pool.prepare_lora_batch(batch, running=running)
        events = pool.events[len(before["events"]):]
        expected = model.step(needed, pool.pinned)
        assert [e[:3] for e in events if e[0] != "cpu_evict"] == expected
        assert list(pool.eviction_policy.order()) == model.order
        _check_step(pool, needed, result, events, set(before["cpu_cache"]))


def test_slot_model_agrees_on_a_hand_worked_trace():
    """The brute-force model itself, on the base-last example above."""
    model = SlotModel(2, lru=True)
    assert model.step({None}, set()) == [("load", None, 0)]
    assert model.step({"A"}, set()) == [("load", "A", 1)]
    assert model.step({"B"}, set()) == [("evict", "A", 1), ("load", "B", 1)]
    assert model.step({"A", "B"}, set()) == [("evict", None, 0), ("load", "A", 0), ("hit", "B", 1)]


# ---- the trace replay of the chapter's figure -------------------------------------------------
def test_zipf_trace_is_seeded():
    p = zipf_probabilities(5, 1.0)
    assert abs(p.sum() - 1) < 1e-12 and all(p[:-1] > p[1:]) and abs(p[0] / p[1] - 2) < 1e-12
    cfg = TraceConfig(steps=50)
    assert make_trace(cfg) == make_trace(cfg) != make_trace(TraceConfig(steps=50, seed=1))
    uids = [r.uid for step in make_trace(TraceConfig(steps=200)) for r in step]
    assert uids.count("lora-00") > uids.count("lora-09") > 0 and None in uids


def test_simulate_trace_counts_and_speed():
    trace = make_trace(TraceConfig())
    start = time.process_time()  # CPU time: other jobs on the machine do not count
    runs = {p: simulate_trace(trace, p, 12, max_loaded_loras=24) for p in ("lru", "fifo")}
    assert time.process_time() - start < 2.0
    for stats in runs.values():
        assert len(stats.occupancy) == len(trace) and max(stats.occupancy) <= 12
        assert all(e <= n and d <= n for e, n, d in zip(stats.evictions, stats.loads, stats.disk_loads))
    assert runs["lru"].hit_rate() > runs["fifo"].hit_rate()  # the figure's claim, on this seed
    assert simulate_trace(trace, "lru", 12, 24).hits == runs["lru"].hits  # deterministic


# ---- uids need only be hashable ------------------------------------------------------------------
def _old_uid_key(uid):
    """The key before it was total: chapter 05's event logs are compared in its order."""
    return (uid is not None, type(uid).__name__, uid)


_PRIMITIVE = st.none() | st.booleans() | st.integers(-3, 3) | st.floats(-2, 2, width=16) | st.text("ab", max_size=2)
_OLD_KINDS = st.recursive(_PRIMITIVE, lambda inner: st.lists(inner, max_size=3).map(tuple), max_leaves=6)


@settings(max_examples=400, deadline=None)
@given(_OLD_KINDS, _OLD_KINDS)
def test_uid_order_of_none_str_int_float_bool_and_tuples_is_unchanged(a, b):
    """Wherever the old key compared two uids, the new one gives the same answer (so every sort
    that used to succeed gives the same order); where it raised, the new one answers."""
    new = (uid_sort_key(a) < uid_sort_key(b), uid_sort_key(b) < uid_sort_key(a))
    try:
        old = (_old_uid_key(a) < _old_uid_key(b), _old_uid_key(b) < _old_uid_key(a))
    except TypeError:
        return
    assert new == old


def test_uid_order_pinned_for_strings_ints_and_the_base():
    uids = ["b", 10, None, "a", 2, -1, "B", "", ("a", 1), ("a",), 1.5, True, False]
    assert sorted(uids, key=uid_sort_key) == [None, False, True, 1.5, -1, 2, 10, "", "B", "a", "b", ("a",), ("a", 1)]
    pool = make_pool(slots=5, adapters=[lora(u) for u in ["b", 10, "a", 2]])
    pool.prepare_lora_batch(["b", 10, None, "a", 2])
    assert [e[1] for e in pool.events] == [None, 2, 10, "a", "b"]


@dataclasses.dataclass(frozen=True)
class _UidOf:
    """A frozen-dataclass uid (hashable, not orderable), e.g. a (tenant, adapter) pair."""
    tenant: str
    version: int


MIXED_UIDS = [_UidOf("t1", 2), _UidOf("t1", 1), _UidOf("t0", 9), ("a", 1), (1, "a"), (None, 2), ("a", (1, "x")),
              frozenset({"x", 3}), 7, "s"]


def test_uid_key_is_total_and_deterministic_for_any_hashable():
    orders = {tuple(sorted(perm, key=uid_sort_key)) for perm in (MIXED_UIDS, MIXED_UIDS[::-1],
                                                                  MIXED_UIDS[3:] + MIXED_UIDS[:3])}
    assert len(orders) == 1, "the order must not depend on the input order (nor on set order)"
    # by type name first ("_UidOf" < "frozenset" < "int" < "str" < "tuple"), then field by field,
    # element by element (None, then numbers, then strings, then tuples, between kinds)
    assert list(orders.pop()) == [_UidOf("t0", 9), _UidOf("t1", 1), _UidOf("t1", 2), frozenset({"x", 3}), 7, "s",
                                  (None, 2), (1, "a"), ("a", 1), ("a", (1, "x"))]


def test_pool_serves_dataclass_and_mixed_tuple_uids_with_evictions():
    """Frozen-dataclass and mixed-type tuple uids through prepare_lora_batch, 3 slots, LRU: every
    batch evicts, a pinned one blocks, and the capacity error lists the pinned uids (it sorted them
    with the old key and raised TypeError instead)."""
    pool = make_pool(slots=3, adapters=[lora(u, seed=i) for i, u in enumerate(MIXED_UIDS)])
    batches = [[_UidOf("t1", 2), ("a", 1), None], [(1, "a"), _UidOf("t1", 1)], [(None, 2), ("a", (1, "x"))],
               [frozenset({3, "x"}), 7, _UidOf("t1", 2)]]
    for batch in batches:
        start = len(pool.events)
        slots = pool.prepare_lora_batch(batch)
        assert list(slots) == sorted(set(batch), key=uid_sort_key)
        for uid, slot in slots.items():
            assert pool.buffer_id_to_uid[slot] == uid and pool.uid_to_buffer_id[uid] == slot
            if uid is not None:
                assert_slot_holds(pool, slot, pool.cpu_cache[uid])
        assert [e[1] for e in pool.events[start:] if e[0] != "evict"] == list(slots)
    # LRU victims outside the batch, the base model last (the 4th batch needs all three slots)
    assert [e for e in pool.events if e[0] == "evict"] == [
        ("evict", _UidOf("t1", 2), 1), ("evict", ("a", 1), 2), ("evict", _UidOf("t1", 1), 1),
        ("evict", (1, "a"), 2), ("evict", (None, 2), 1), ("evict", ("a", (1, "x")), 2), ("evict", None, 0)]
    pool.pin(_UidOf("t1", 2))
    pool.pin((1, "a"))
    pool.prepare_lora_batch([(1, "a")])
    assert_rejected_unchanged(pool, lambda: pool.prepare_lora_batch([7, "s"]),
                              r"hold pinned adapters it does not use: \[_UidOf\(tenant='t1', version=2\), \(1, 'a'\)\]")
