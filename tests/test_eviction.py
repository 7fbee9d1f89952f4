"""Eviction policies (reference/eviction.py): hand-worked orders, base-last rule, errors, and a
brute-force model on random operation sequences."""
import pytest
from hypothesis import given, settings, strategies as st

from reference.eviction import (EvictionPolicy, FIFOEvictionPolicy, LRUEvictionPolicy,
                                get_eviction_policy)


def test_running_example_lru_vs_fifo():
    lru, fifo = LRUEvictionPolicy(), FIFOEvictionPolicy()
    for uid in ["A", "B", "C", "A"]:
        lru.mark_used(uid)
        fifo.mark_used(uid)
    assert lru.order() == ("B", "C", "A") and lru.select_victim({"A", "C"}) == "C"
    assert fifo.order() == ("A", "B", "C") and fifo.select_victim({"A", "C"}) == "A"


def test_select_victim_is_pure():
    policy = LRUEvictionPolicy()
    for uid in ["A", "B"]:
        policy.mark_used(uid)
    assert policy.select_victim({"A", "B"}) == "A"
    assert policy.select_victim({"A", "B"}) == "A"
    assert policy.order() == ("A", "B")


@pytest.mark.parametrize("name", ["lru", "fifo"])
def test_base_model_is_the_last_resort(name):
    policy = get_eviction_policy(name)
    for uid in [None, "A", "B"]:  # None is the oldest
        policy.mark_used(uid)
    assert policy.select_victim({None, "B"}) == "B"
    assert policy.select_victim({None, "A", "B"}) == "A"
    assert policy.select_victim({None}) is None


def test_fifo_reinserts_after_remove_and_ignores_hits():
    policy = FIFOEvictionPolicy()
    for uid in ["A", "B", "A", "A"]:
        policy.mark_used(uid)
    assert policy.order() == ("A", "B")
    policy.remove("A")
    policy.mark_used("A")  # reloaded: now the youngest
    assert policy.order() == ("B", "A")


def test_lru_remove_and_remove_untracked():
    policy = LRUEvictionPolicy()
    for uid in ["A", "B", "C"]:
        policy.mark_used(uid)
    policy.remove("B")
    policy.remove("never-seen")  # no-op
    assert policy.order() == ("A", "C")


@pytest.mark.parametrize("candidates, match", [
    (set(), "at least one candidate"),
    ({"A", "Z"}, "never marked used"),
])
def test_select_victim_errors(candidates, match):
    policy = LRUEvictionPolicy()
    policy.mark_used("A")
    with pytest.raises(ValueError, match=match):
        policy.select_victim(candidates)
    assert policy.order() == ("A",)


def test_factory():
    assert isinstance(get_eviction_policy("lru"), LRUEvictionPolicy)
    assert isinstance(get_eviction_policy("fifo"), FIFOEvictionPolicy)
    assert get_eviction_policy("lru") is not get_eviction_policy("lru")  # fresh state each time
    for bad in ["LRU", "lfu", ""]:
        with pytest.raises(ValueError, match=r"unknown eviction policy .*\['fifo', 'lru'\]"):
            get_eviction_policy(bad)


def test_abc_cannot_be_instantiated_and_subclasses_reuse_select_victim():
    with pytest.raises(TypeError):
        EvictionPolicy()

    class MostRecentlyUsed(LRUEvictionPolicy):  # a policy is an order: reversing it is MRU
        def order(self) -> tuple:
            return super().order()[::-1]

    policy = MostRecentlyUsed()
    for uid in [None, "A", "B"]:
        policy.mark_used(uid)
    assert policy.select_victim({None, "A", "B"}) == "B"
    assert policy.select_victim({None}) is None


class _ListModel:
    """Brute force: a plain list, oldest first."""

    def __init__(self, lru: bool):
        self.lru, self.items = lru, []

    def mark_used(self, uid):
        if self.lru and uid in self.items:
            self.items.remove(uid)
        if uid not in self.items:
            self.items.append(uid)

    def remove(self, uid):
        if uid in self.items:
            self.items.remove(uid)

    def victim(self, candidates):
        pool = [u for u in self.items if u in candidates and u is not None]
        return pool[0] if pool else None


UIDS = st.sampled_from([None, "a", "b", "c", "d", 7])
OPS = st.lists(st.tuples(st.sampled_from(["mark", "remove", "select"]), UIDS,
                         st.sets(UIDS, min_size=1)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["lru", "fifo"]), ops=OPS)
def test_policy_matches_brute_force(name, ops):
    policy, model = get_eviction_policy(name), _ListModel(lru=name == "lru")
    for op, uid, candidates in ops:
        if op == "mark":
            policy.mark_used(uid)
            model.mark_used(uid)
        elif op == "remove":
            policy.remove(uid)
            model.remove(uid)
        elif set(candidates) <= set(model.items):
            assert policy.select_victim(candidates) == model.victim(candidates)
        else:
            with pytest.raises(ValueError, match="never marked used"):
                policy.select_victim(candidates)
        assert list(policy.order()) == model.items
