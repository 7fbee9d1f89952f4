"""Cases for chapter 08 (CUDA-graph decode with LoRA: buckets, static buffers, the change flag).

ch08.1 ``bucket_for`` is a plain function. ch08.2 (``StaticLoRABatch.update``) and ch08.3
(``SlotChangeTracker``) are classes graded by replaying traces in the child, like chapter 05's: a
driver in this module calls the learner's class step by step and returns one readable line per
step, built from what the learner's object holds after the step; the same driver on the reference
gives the expected lines, so a report shows the first step where the two diverge.

Case design (graders' rule): every clause of the exercise text and both sides of each stated error.
ch08.1: unsorted and repeated buckets, tuples and lists, exact fits, one sequence, between two
buckets, the largest bucket, and each error (too many sequences, none, no buckets). ch08.2: traces
on grader-built instances (several slot counts, max_seqs, one and several tokens per sequence,
buckets below max_seqs, a batch of zero sequences, pad slots other than 0, the flag off with other
tables passed), whose buffers start with finite junk as well as the constructor's zeros; after every
step each buffer's values, whether any buffer was replaced (object or address), and for a refused
update whether anything changed. Every draw has a full bucket followed by a smaller one (stale
slots past the bucket), a first update with the flag off (the junk tables must stay), and one
refused update of each kind. ch08.3: a real ``LoRAMemoryPool`` (tiny adapters, a CPU cache that
drops host copies) replayed with polls between some calls, several calls between others, two polls
in a row, an interval of hits only, a load followed by a hit, a host copy dropped alone, an unload
of a resident adapter (a slot freed with no load after it; from slot 0 too) and of a host copy
alone, a trace whose first event is the first poll's only one, and a tracker made on a warm pool.
ch08.4: static tensors left by an earlier step (real rows, tokens and positions everywhere) or in
the capture state, padding inside the bucket and none, a bucket below max_seqs, one to four tokens
per sequence, cache rows out of order; compared on the first ``bucket`` rows of the memory the
tensors were given (what the bucket's graph reads), and whether each tensor still has that memory
(``t.data = new`` or ``t.set_(new)`` swap it, where a captured graph never looks).
"""
from __future__ import annotations

import copy
import functools
import random
import re
from typing import Optional

import torch

from graders.chapters.hints import first_difference, name_matches, symptom_hint
from graders.machine.exercise import Case, Exercise
from reference.batch_info import slot_sorted_view
from reference.cuda_graph import SlotChangeTracker, StaticLoRABatch, bucket_for
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec, uid_sort_key

__all__ = ["EXERCISES", "drive_static_batch", "replay_tracker", "drive_write_inputs", "write_decode_inputs",
           "BUFFER_ORDER"]


# ---------------------------------------------------------------------------------------------
# ch08.1 bucket_for


def _bucket_case(name, n, buckets) -> Case:
    return Case(name, [n, buckets], f"num_seqs {n}, buckets {buckets!r}", op="exact")


def _bucket_edge() -> list[Case]:
    nano = (1, 2, 4, 8, 16, 32, 40)  # default_buckets(40)
    return [
        _bucket_case("example_in_the_text", 5, (1, 2, 4, 8, 16)),
        _bucket_case("exact_fit", 8, (1, 2, 4, 8, 16, 32)),  # the next bucket up is not the largest
        _bucket_case("one_sequence", 1, (1, 2, 4, 8)),
        _bucket_case("one_sequence_smallest_bucket_4", 1, (4, 8, 16)),
        _bucket_case("largest_bucket_exactly", 16, (1, 2, 4, 8, 16)),
        # the first bucket that fits is neither the smallest that fits nor the largest (nor the
        # smallest above an exact fit): each wrong choice returns something else
        _bucket_case("unsorted_buckets", 5, (16, 1, 32, 8, 4)),
        _bucket_case("unsorted_exact_fit", 4, (16, 4, 32, 8, 1)),
        _bucket_case("repeated_buckets", 3, [4, 4, 2, 8, 2]),
        _bucket_case("buckets_as_a_list", 9, [1, 2, 4, 8, 16]),
        _bucket_case("one_bucket", 3, (3,)),
        _bucket_case("not_powers_of_two", 33, nano),
        _bucket_case("between_16_and_32", 17, nano),
        _bucket_case("more_than_the_largest_raises_value_error", 17, (1, 8, 16)),
        _bucket_case("more_than_the_largest_unsorted_raises", 5, [4, 2]),
        _bucket_case("zero_sequences_raises_value_error", 0, (1, 2, 4)),
        _bucket_case("negative_sequences_raises_value_error", -3, (1, 2, 4)),
        _bucket_case("no_buckets_raises_value_error", 1, ()),
        _bucket_case("no_buckets_as_a_list_raises", 4, []),
    ]


def _bucket_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: a shuffled bucket list with a repeat (tuple or list; the second largest of at
    least four buckets first in draw 0, the largest first in draw 2), each bucket hit exactly, a
    count between two buckets, one sequence, one past the largest, zero and a negative count."""
    cases = []
    for i in range(3):
        buckets = sorted(rng.sample(range(1, 70), rng.randint(4 if i == 0 else 2, 6)))
        listed = buckets + [rng.choice(buckets)]
        rng.shuffle(listed)
        if i != 1:  # the first bucket that fits is not the smallest; in draw 0 neither the largest, and
            # for the smallest bucket neither the next one (each wrong choice returns something else)
            first = buckets[-2] if i == 0 else buckets[-1]
            listed.remove(first)
            listed.insert(0, first)
        listed = tuple(listed) if i % 2 == 0 else listed
        for b in buckets:
            cases.append(_bucket_case(f"random_{i}_exact_{b}", b, listed))
        gaps = [(a, b) for a, b in zip(buckets, buckets[1:]) if b - a > 1]
        if gaps:
            a, b = rng.choice(gaps)
            cases.append(_bucket_case(f"random_{i}_between", rng.randint(a + 1, b - 1), listed))
        cases.append(_bucket_case(f"random_{i}_one_sequence", 1, listed))
        cases.append(_bucket_case(f"random_{i}_past_the_largest", max(buckets) + rng.randint(1, 5), listed))
        cases.append(_bucket_case(f"random_{i}_zero", 0, listed))
        cases.append(_bucket_case(f"random_{i}_negative", -rng.randint(1, 9), listed))
    return cases


def _bucket_variant(n, buckets, strict=False, first_fit=False, largest=False, index=False) -> int:
    """``bucket_for`` with one named mistake switched on (for hints); raises where it finds nothing."""
    fits = [b for b in buckets if (b > n if strict else b >= n)]
    if largest:
        return max(buckets)
    pick = fits[0] if first_fit else min(fits)
    return list(buckets).index(pick) if index else pick


_BUCKET_MISTAKES = [
    (dict(strict=True), "an exact fit is allowed: a bucket of n sequences holds n (>=, not >)"),
    (dict(first_fit=True), "buckets come in any order: the smallest bucket >= num_seqs (min), not the first one "
                           "that fits"),
    (dict(largest=True), "the smallest bucket that holds num_seqs, not the largest (padding rows cost compute)"),
    (dict(index=True), "return the bucket itself (a batch size), not its index in the list"),
]
#: Two mistakes at once, named only when no single one returns what the answer returned.
_BUCKET_TWO_MISTAKES = [
    (dict(first_fit=True, strict=True), "buckets come in any order, and an exact fit is allowed: the smallest "
                                        "bucket >= num_seqs (min over b >= num_seqs)"),
    (dict(index=True, first_fit=True), "return the bucket itself (a batch size), not its index in the list"),
    (dict(index=True, strict=True), "return the bucket itself (a batch size), not its index in the list"),
]


def _bucket_hint(case: Case, expected, got) -> Optional[str]:
    """From what the answer returned: the known mistakes that return exactly ``got`` here, else a
    bucket too small for the batch; nothing else (error cases are reported without a hint)."""
    n, buckets = case.args
    if not isinstance(got, int) or isinstance(got, bool) or not isinstance(expected, int):
        return None
    hint = (symptom_hint(_BUCKET_MISTAKES, _bucket_variant, case.args, expected, got)
            or symptom_hint(_BUCKET_TWO_MISTAKES, _bucket_variant, case.args, expected, got))
    if hint:
        return hint
    if got < n and got in buckets:
        return f"bucket {got} cannot hold {n} sequences: the bucket must be >= num_seqs (an exact fit is allowed)"
    if got not in buckets:
        return f"return one of the given buckets ({got} is none of {sorted(set(buckets))})"
    return None


# ---------------------------------------------------------------------------------------------
# ch08.2 StaticLoRABatch.update

#: The buffers a report shows, in this order ("permutation" only up to bucket * tokens_per_seq: past
#: it the contract says nothing).
BUFFER_ORDER = ("token_slots", "seg_lens", "seg_indptr", "permutation", "lora_ranks", "scalings", "weight_indices")


def _fmt_values(t: torch.Tensor) -> str:
    return "[" + ", ".join(repr(v) for v in t.tolist()) + "]"


def _step_call(step) -> str:
    slots, bucket, pad, ranks, scal, changed = step
    return (f"update(seq_slots={slots}, bucket={bucket}, pad_slot={pad}, lora_ranks={ranks}, scalings={scal}, "
            f"ownership_changed={changed})")


def drive_static_batch(cls, num_slots: int, max_seqs: int, tps: int, poison, steps: list) -> list:
    """Make ``cls(num_slots, max_seqs, tps, "cpu")``, fill its buffers with ``poison`` (a list of
    values per buffer of ``BUFFER_ORDER``'s first six, or None: keep the constructor's), then call
    ``update(*step)`` for every step.

    Returns one line per step: the call, its outcome ("returned" or "raised <Type>"), which buffers
    were replaced (another object or another address than the constructor's), and then, for an
    update that returned, every buffer's values (permutation up to bucket * tps); for one that
    raised, which buffers it changed. Last, per step as data: [outcome, replaced, changed by a
    refused update] (nothing that depends on what the contract leaves open, e.g. the permutation
    past the bucket).
    """
    static = cls(num_slots, max_seqs, tps, "cpu")
    events = _CopyEvent(static)
    static._copied = events  # on the CPU the class has none: a stand-in that records the calls
    original = dict(static.buffers)
    ptrs = {k: v.data_ptr() for k, v in original.items()}
    if poison is not None:
        with torch.no_grad():
            for name, values in zip(BUFFER_ORDER, poison):
                original[name].copy_(torch.tensor(values, dtype=original[name].dtype))
    lines, data = [], []
    for i, step in enumerate(steps, 1):
        before = {k: v.clone() for k, v in static.buffers.items()}
        staging = getattr(static, "staging", None)
        staged = {k: v.clone() for k, v in staging.items()} if isinstance(staging, dict) else {}
        args = copy.deepcopy(step)
        events.start()
        try:
            static.update(*args)
            outcome = "returned"
        except Exception as exc:  # the outcome is data: which exception, if any
            outcome = f"raised {type(exc).__name__}"
        edited = [name for name, a, b in zip(("seq_slots", "bucket", "pad_slot", "lora_ranks", "scalings",
                                              "ownership_changed"), args, step) if a != b]
        bufs = static.buffers
        replaced = [k for k in BUFFER_ORDER if bufs.get(k) is not original[k]
                    or not isinstance(bufs.get(k), torch.Tensor) or bufs[k].data_ptr() != ptrs[k]]
        shown = {k: (bufs[k] if k not in replaced else original[k]) for k in BUFFER_ORDER}
        line = f"step {i}: {_step_call(step)} -> {outcome}; buffers replaced: {', '.join(replaced) or 'none'}"
        line += f"; arguments changed by the call: {', '.join(edited) or 'none'}"
        fence = _fenced(events, outcome)
        line += f"; copies fenced: {fence}"
        changed = [k for k in BUFFER_ORDER if not (isinstance(shown[k], torch.Tensor) and shown[k].shape == before[k].shape
                                                   and torch.equal(shown[k], before[k]))]
        if outcome == "returned":
            width = step[1] * tps
            parts = [f"{k}{'[:' + str(width) + ']' if k == 'permutation' else ''} "
                     f"{_fmt_values(bufs[k][:width] if k == 'permutation' else bufs[k])}"
                     for k in BUFFER_ORDER if k not in replaced]
            line += "; " + "; ".join(parts)
        else:
            line += f"; buffers changed: {', '.join(changed) or 'none'}"
            # "nothing written" covers the pinned staging too: a refused update that filled it has
            # half-written the next step's inputs, and a caller that retries copies them
            now = getattr(static, "staging", None)
            touched = [k for k, v in staged.items() if not (isinstance(now, dict) and isinstance(now.get(k), torch.Tensor)
                                                             and now[k].shape == v.shape and torch.equal(now[k], v))]
            line += f"; staging changed: {', '.join(touched) or 'none'}"
        lines.append(line)
        data.append([outcome, replaced, [] if outcome == "returned" else changed, edited, fence])
    return lines + [data]


class _CopyEvent:
    """Stands in for the CUDA event ``self._copied`` on the CPU and records what update did with it:
    each call, and whether the staging had already been written when ``synchronize`` came (too
    late) or the buffers were still written after ``record`` (too early)."""

    def __init__(self, static) -> None:
        self.static = static
        self.calls: list[str] = []
        self._staging = self._buffers = None

    def start(self) -> None:
        self.calls.clear()
        self.staging_before = {k: v.clone() for k, v in self.static.staging.items()}
        self._buffers = None

    def synchronize(self) -> None:
        late = any(not torch.equal(v, self.staging_before[k]) for k, v in self.static.staging.items()
                   if k in self.staging_before)
        self.calls.append("synchronize after writing the staging" if late else "synchronize")

    def record(self, stream=None) -> None:  # torch.cuda.Event.record(stream=None)
        self.calls.append("record")
        self._buffers = {k: v.clone() for k, v in self.static.buffers.items() if isinstance(v, torch.Tensor)}

    def written_after_record(self) -> bool:
        return self._buffers is not None and any(
            not (isinstance(self.static.buffers.get(k), torch.Tensor) and self.static.buffers[k].shape == v.shape
                 and torch.equal(self.static.buffers[k], v)) for k, v in self._buffers.items())

    def query(self) -> bool:
        return True


def _fenced(events: _CopyEvent, outcome: str) -> str:
    """An update that wrote waits on the event before refilling the staging and records it after
    its last copy; a refused one records nothing (it wrote nothing)."""
    calls = events.calls
    if outcome != "returned":
        return "nothing recorded" if "record" not in calls else "recorded after a refused update"
    if "synchronize" not in calls:
        if any(c.startswith("synchronize") for c in calls):
            return "waited on the event only after refilling the staging"
        return "never waited on the event before refilling the staging"
    if not calls or calls[-1] != "record" or events.written_after_record():
        return "the event was not recorded after the last copy"
    return "waited, then recorded after the copies"


def _static_case(name, num_slots, max_seqs, tps, poison, steps) -> Case:
    shown = "; ".join(_step_call(s) for s in steps[:3])
    start = "finite junk" if poison is not None else "the constructor's values"
    return Case(name, [num_slots, max_seqs, tps, poison, steps],
                f"StaticLoRABatch(num_slots={num_slots}, max_seqs={max_seqs}, tokens_per_seq={tps}), buffers "
                f"starting with {start}; {len(steps)} updates: {shown}{'; ...' if len(steps) > 3 else ''}",
                op="exact")


def _junk(rng: random.Random, num_slots: int, max_seqs: int, tps: int) -> list:
    """Finite junk for token_slots, seg_lens, seg_indptr, permutation, lora_ranks, scalings (values a
    stale buffer could hold: slots in range, counts, real-looking ranks)."""
    t = max_seqs * tps
    return [[rng.randrange(num_slots) for _ in range(t)], [rng.randint(0, t) for _ in range(num_slots)],
            [rng.randint(0, t) for _ in range(num_slots + 1)], [rng.randrange(t) for _ in range(t)],
            [rng.choice([3, 5, 7]) for _ in range(num_slots)], [rng.choice([0.75, 3.0, 1.25]) for _ in range(num_slots)]]


def _static_edge() -> list[Case]:
    r = random.Random(81)
    R, S = [0, 8, 4, 2], [0.0, 2.0, 0.5, 1.5]  # slot 0: the base model
    R2, S2 = [4, 2, 0, 8], [1.0, 0.5, 0.0, 2.0]  # base model in slot 2
    OTHER_R, OTHER_S = [0, 1, 1, 1], [0.0, 9.0, 9.0, 9.0]
    return [
        _static_case("example_in_the_text", 4, 6, 1, None, [[[1, 3, 1], 4, 0, R, S, True]]),
        _static_case("flag_off_keeps_the_tables", 4, 6, 1, None,
                     [[[1, 3, 1], 4, 0, R, S, True], [[2], 2, 0, OTHER_R, OTHER_S, False]]),
        _static_case("first_update_flag_off_keeps_junk_tables", 4, 6, 1, _junk(r, 4, 6, 1),
                     [[[1, 2], 2, 0, R, S, False]]),
        _static_case("pad_slot_2", 4, 5, 1, _junk(r, 4, 5, 1), [[[0, 3, 0], 4, 2, R2, S2, True]]),
        _static_case("pad_slot_2_base_request_in_the_batch", 4, 5, 1, None, [[[2, 0, 2, 3], 4, 2, R2, S2, True]]),
        _static_case("full_bucket_then_a_smaller_one", 4, 6, 1, None,
                     [[[1, 2, 3, 1, 2, 3], 6, 0, R, S, True], [[3], 2, 0, R, S, False]]),
        _static_case("exact_bucket_below_max_seqs", 3, 8, 1, _junk(r, 3, 8, 1), [[[2, 1, 2, 1], 4, 0, [0, 4, 4],
                                                                                   [0.0, 1.0, 0.5], True]]),
        _static_case("zero_sequences_all_padding", 4, 4, 1, _junk(r, 4, 4, 1), [[[], 4, 0, R, S, True]]),
        _static_case("tokens_per_seq_3", 4, 6, 3, None, [[[1, 3, 1], 4, 0, R, S, True]]),
        _static_case("tokens_per_seq_2_pad_slot_2_junk", 4, 5, 2, _junk(r, 4, 5, 2),
                     [[[3, 0, 3], 4, 2, R2, S2, True], [[1], 1, 2, R2, S2, False]]),
        _static_case("one_slot_one_sequence", 1, 1, 1, None, [[[0], 1, 0, [0], [0.0], True]]),
        _static_case("more_sequences_than_the_bucket_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1, 2, 1], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        _static_case("bucket_above_max_seqs_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1], 8, 0, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        _static_case("slot_past_the_end_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1, 3], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        _static_case("negative_slot_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[-1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        # a full bucket: the pad slot pads nothing inside it, only the rows past it
        _static_case("negative_pad_slot_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1, 2], 2, -1, [4, 4, 0], [1.0, 1.0, 0.0], True]]),
        _static_case("pad_slot_past_the_end_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1], 2, 3, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        _static_case("pad_slot_of_rank_4_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[2], 2, 1, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        _static_case("pad_slot_of_rank_4_full_bucket_raises", 3, 4, 1, None,  # pads only the rows past the bucket
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1, 2], 2, 1, [0, 4, 4], [0.0, 1.0, 1.0], True]]),
        _static_case("pad_slot_of_rank_4_flag_off_raises", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[2], 2, 1, [0, 4, 4], [0.0, 1.0, 1.0], False]]),
        _static_case("short_tables_raise", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1], 2, 0, [0, 4], [0.0, 1.0], True]]),
        _static_case("long_tables_flag_off_raise", 3, 4, 1, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1], 2, 0, [0, 4, 4, 4], [0.0, 1.0, 1.0, 1.0], False]]),
        _static_case("scalings_too_short_raise", 3, 4, 2, None,
                     [[[1, 2], 2, 0, [0, 4, 4], [0.0, 1.0, 1.0], True], [[1], 2, 0, [0, 4, 4], [0.0, 1.0], True]]),
    ]


def _tables(rng: random.Random, num_slots: int, pad: int) -> tuple[list, list]:
    ranks = [rng.choice([0, 1, 4, 8, 16]) for _ in range(num_slots)]
    ranks[pad] = 0
    scal = [0.0 if r == 0 else rng.choice([0.25, 0.5, 1.0, 2.0, 1 / 3]) for r in ranks]
    return ranks, scal


def _bad_step(rng: random.Random, kind: str, num_slots: int, max_seqs: int, buckets: list, pad: int,
              ranks: list, scal: list) -> list:
    """One refused update of ``kind``."""
    flag = rng.random() < 0.5
    b = rng.choice(buckets)
    seqs = [rng.randrange(num_slots) for _ in range(rng.randint(0, b))]
    if kind == "n_past_bucket":
        return [[rng.randrange(num_slots) for _ in range(b + rng.randint(1, 2))], b, pad, ranks, scal, flag]
    if kind == "bucket_past_max":
        return [seqs, max_seqs + rng.randint(1, 3), pad, ranks, scal, flag]
    if kind == "slot_out_of_range":
        seqs = seqs or [0]
        seqs[rng.randrange(len(seqs))] = rng.choice([num_slots, num_slots + 2, -1])
        return [seqs, max(b, len(seqs)), pad, ranks, scal, flag]
    if kind == "pad_past_the_end":
        return [seqs, b, num_slots, ranks, scal, flag]
    if kind == "pad_negative":  # a full bucket, the last slot of rank 0: only the range check refuses it
        r2, s2 = list(ranks[:-1]) + [0], list(scal[:-1]) + [0.0]
        return [[rng.randrange(num_slots) for _ in range(b)], b, -1, r2, s2, flag]
    if kind == "pad_rank":
        adapters = [s for s, r in enumerate(ranks) if r > 0] or [pad]
        bad = list(ranks)
        slot = rng.choice(adapters)
        bad[slot] = bad[slot] or 4
        return [seqs, b, slot, bad, scal, flag]
    # tables of the wrong length (ranks, scalings or both)
    cut = rng.choice(["ranks", "scalings", "both"])
    r2 = ranks[:-1] if cut != "scalings" else ranks
    s2 = scal + [0.5] if cut != "ranks" else scal
    return [seqs, b, pad, r2, s2, flag]


BAD_KINDS = ("n_past_bucket", "bucket_past_max", "slot_out_of_range", "pad_past_the_end", "pad_negative", "pad_rank",
             "tables")


def _static_trace(rng: random.Random, num_slots: int, max_seqs: int, tps: int, pad_not_0: bool) -> list:
    buckets = sorted({max_seqs, *rng.sample(range(1, max_seqs + 1), min(max_seqs, rng.randint(1, 3)))})
    # the base model's slot: never 0 in some draws, mostly not 0 in the others
    pad = rng.randrange(1, num_slots) if pad_not_0 or rng.random() < 0.8 else 0
    ranks, scal = _tables(rng, num_slots, pad)
    steps = []

    def ok(n=None, bucket=None, changed=None, new_tables=False):
        nonlocal ranks, scal
        bucket = bucket or rng.choice(buckets)
        n = rng.randint(0, bucket) if n is None else n
        if new_tables:
            ranks, scal = _tables(rng, num_slots, pad)
        if changed is False:  # other tables passed with the flag off: they must not be copied
            r2, s2 = _tables(rng, num_slots, pad)
            steps.append([[rng.randrange(num_slots) for _ in range(n)], bucket, pad, r2, s2, False])
            return
        steps.append([[rng.randrange(num_slots) for _ in range(n)], bucket, pad, ranks, scal,
                      True if changed is None else changed])

    ok(changed=False)  # first: flag off, the starting tables stay
    ok(n=max_seqs, bucket=max_seqs, changed=True, new_tables=True)  # a full bucket of real slots ...
    small = min(buckets)
    ok(n=rng.randint(0, small), bucket=small, changed=False)  # ... then a smaller one: past it, the pad slot
    kinds = list(BAD_KINDS)
    rng.shuffle(kinds)
    for kind in kinds:
        ok(changed=rng.choice([True, False]), new_tables=rng.random() < 0.5)
        steps.append(_bad_step(rng, kind, num_slots, max_seqs, buckets, pad, ranks, scal))
    ok(n=0, changed=True)
    b = rng.choice(buckets)
    ok(n=b, bucket=b, changed=True, new_tables=True)  # an exact fit
    return steps


def _static_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: tokens_per_seq 1, 2, 3 and 1 (by index), junk and zeros at the start (by index),
    a pad slot other than 0 (always in draws 0 and 2), buckets below max_seqs, each refused update
    once."""
    cases = []
    for i, (tps, junk) in enumerate([(1, True), (2, False), (3, True), (1, False)]):
        num_slots, max_seqs = rng.randint(2, 6), rng.randint(3, 8)
        poison = _junk(rng, num_slots, max_seqs, tps) if junk else None
        cases.append(_static_case(f"random_{i}", num_slots, max_seqs, tps, poison,
                                  _static_trace(rng, num_slots, max_seqs, tps, pad_not_0=i % 2 == 0)))
    return cases


def _parse(line: str) -> dict:
    """'step 3: ... -> returned; buffers replaced: none; token_slots [..]; ...' -> {field: text}: a
    label before ': ' names its field ("buffers replaced", "copies fenced", "staging changed"), else
    a buffer's name ("token_slots", "permutation" for "permutation[:4]") precedes its values."""
    head, _, rest = line.partition(" -> ")
    fields = {"outcome": rest.split(";")[0]}
    for part in rest.split("; ")[1:]:
        label, sep, value = part.partition(": ")
        if not sep or "[" in label:
            label, _, value = part.partition(" ")
            label = label.split("[")[0]
        fields[label] = value
    return fields


def _values(text: Optional[str]) -> Optional[list]:
    """'[2, 0, 1]' -> [2.0, 0.0, 1.0]; None when absent or not a list of numbers."""
    try:
        return [float(v) for v in text.strip("[]").split(", ") if v] if text is not None else None
    except ValueError:
        return None


def _static_compare(case: Case, expected, got) -> Optional[str]:
    """The first step whose record differs, and only the fields that differ in it (the whole record
    of a step is a long line; the learner needs the buffer or the outcome that is off). When the
    outcome differs (one raised, the other returned), only the outcome and the arguments: the
    buffers of a step that should not have run (or should have) follow from it."""
    if not isinstance(got, (tuple, list)) or len(got) != len(expected):
        return f"the driver's record has {len(got) if isinstance(got, (tuple, list)) else '?'} entries, expected {len(expected)}"
    k = first_difference(list(expected[:-1]), [str(g) for g in got[:-1]])
    if k is None:
        return None if list(expected[-1]) == list(got[-1]) else "the steps' outcomes differ"
    head = expected[k].partition(" -> ")[0]
    e, g = _parse(expected[k]), _parse(str(got[k]))
    fields = list(dict.fromkeys([*e, *g]))
    if e["outcome"] != g["outcome"]:
        fields = ["outcome", "arguments changed by the call"]
    lines = [f"{head}:"]
    for field in fields:
        if e.get(field) != g.get(field):
            lines.append(f"  {field}: expected {e.get(field, '(absent)')}")
            lines.append(f"  {' ' * len(field)}  got      {g.get(field, '(absent)')}")
    return "\n".join(lines)


def _tables_before(case: Case, expected: list, k: int) -> tuple[Optional[list], Optional[list]]:
    """lora_ranks and scalings as the contract leaves them before step k (the last step that
    returned, else the starting values)."""
    for line in reversed(expected[:k]):
        f = _parse(line)
        if f["outcome"] == "returned":
            return _values(f.get("lora_ranks")), _values(f.get("scalings"))
    num_slots, poison = case.args[0], case.args[3]
    if poison is not None:
        return [float(v) for v in poison[4]], torch.tensor(poison[5], dtype=torch.float32).tolist()
    return [0.0] * num_slots, [0.0] * num_slots


def _tables_hint(case: Case, expected, k: int, e: dict, g: dict) -> Optional[str]:
    """lora_ranks / scalings differ after step k: which tables the answer's buffers hold."""
    slots, bucket, pad, ranks, scal, changed = case.args[4][k]
    passed = [float(v) for v in ranks], torch.tensor([float(v) for v in scal], dtype=torch.float32).tolist()
    before = _tables_before(case, expected, k)
    held = _values(g.get("lora_ranks")), _values(g.get("scalings"))
    if changed:
        if held == before and before != passed:
            return ("ownership_changed is True: copy lora_ranks and scalings into their buffers (yours still hold the "
                    "previous tables)")
        if held[0] == passed[0] and held[1] == [float(int(v)) for v in passed[1]]:
            return ("scalings were copied as integers (0.5 became 0): the scalings buffer is float32, build its "
                    "staging values as float32 (torch.tensor(scalings, dtype=torch.float32))")
        return None
    if held == passed and before != passed:
        return ("ownership_changed is False: the per-slot tables stay as they were (whatever tables are passed); "
                "they are rewritten only when slot ownership changed")
    return None


def _token_slots_hint(case: Case, k: int, e: dict, g: dict) -> Optional[str]:
    """token_slots differ after step k: in the real tokens, the padding, or past the bucket."""
    num_slots, max_seqs, tps = case.args[:3]
    slots, bucket, pad, *_ = case.args[4][k]
    n, width = len(slots), bucket * tps
    exp, got = _values(e.get("token_slots")), _values(g.get("token_slots"))
    if exp is None or got is None or len(got) != len(exp):
        return None
    padded = [float(s) for s in [*slots, *[pad] * (bucket - n)]]
    if exp[:n * tps] != got[:n * tps]:
        if tps > 1 and got[:width] == padded * tps:
            return (f"each sequence has tokens_per_seq={tps} tokens in a row: sequence q's slot fills "
                    f"token_slots[q*{tps} : (q+1)*{tps}] (repeat_interleave, not repeat)")
        if tps > 1 and got[:bucket] == padded:
            return (f"each sequence has tokens_per_seq={tps} tokens in a row: sequence q's slot fills "
                    f"token_slots[q*{tps} : (q+1)*{tps}], {width} tokens for the bucket, not {bucket}")
        return f"token_slots[q*{tps} : (q+1)*{tps}] is seq_slots[q] for the real sequences (q < {n})"
    if exp[n * tps:width] != got[n * tps:width]:
        if pad != 0 and set(got[n * tps:width]) == {0.0}:
            return (f"padding sequences (n .. bucket-1) sit on the pad slot ({pad}), whatever slot number it is "
                    "(yours hold slot 0)")
        return f"padding sequences (n .. bucket-1) sit on the pad slot ({pad})"
    past = f"token {width}" if width == max_seqs * tps - 1 else f"tokens {width} .. {max_seqs * tps - 1}"
    return (f"token_slots past the bucket ({past}) hold the pad slot ({pad}) too (the defensive rule of "
            "section 3: no graph reads them, and none could find a stale slot there if one did)")


def _segments_hint(case: Case, k: int, e: dict, g: dict) -> Optional[str]:
    """seg_lens / seg_indptr differ after step k: the slot-sorted view of which sequences."""
    num_slots, max_seqs, tps = case.args[:3]
    slots, bucket, pad, *_ = case.args[4][k]
    n = len(slots)
    got = _values(g.get("seg_lens")), _values(g.get("seg_indptr"))

    def view(seqs):
        counts, offsets, _ = slot_sorted_view(list(seqs), num_slots, tps)
        return [float(v) for v in counts.tolist()], [float(v) for v in offsets.tolist()]
    padded = [*slots, *[pad] * (bucket - n)]
    if got == view(padded + [pad] * (max_seqs - bucket)) and bucket < max_seqs:
        return (f"seg_lens / seg_indptr are the slot-sorted view of the padded bucket ({bucket} sequences of {tps} "
                f"token(s)), not max_seqs ({max_seqs}): the bucket's graph reads only its {bucket * tps} rows")
    if got == view(slots) and bucket > n:
        return (f"seg_lens / seg_indptr count the padded bucket: seq_slots plus {bucket - n} pad slot(s), {bucket} "
                f"sequences of {tps} token(s) (the padding rows run through the graph too)")
    return (f"seg_lens / seg_indptr are the slot-sorted view (chapter 07's slot_sorted_view) of the padded bucket: "
            f"seq_slots plus {bucket - n} pad slot(s), {bucket} sequences of {tps} token(s)")


def _static_hint(case: Case, expected, got) -> Optional[str]:
    """From the first step whose record differs, the field that differs there, and what the
    answer's buffers hold (not from which case or step it is)."""
    num_slots, max_seqs, tps, poison, steps = case.args
    if not isinstance(got, (tuple, list)) or len(got) != len(expected):
        return None
    k = first_difference(list(expected[:-1]), [str(x) for x in got[:-1]])
    if k is None:
        return None
    e, g = _parse(expected[k]), _parse(str(got[k]))
    slots, bucket, pad, ranks, scal, changed = steps[k]
    n = len(slots)
    if e.get("buffers replaced") == "none" and g.get("buffers replaced") != "none":
        return ("a buffer was replaced (self.buffers[name] = ... or a new tensor): a captured graph keeps reading "
                "the old one. Write into the existing tensors in place (copy_, fill_, slice assignment)")
    if e.get("arguments changed by the call") != g.get("arguments changed by the call"):
        return (f"update changed its arguments ({g.get('arguments changed by the call', '?')}): "
                "the caller's lists are the pool's host mirrors and the batch's slots; build new lists (e.g. "
                "list(seq_slots) + [pad_slot] * (bucket - n)) instead of extending or sorting the given ones")
    if e["outcome"] == g["outcome"] and e.get("copies fenced") != g.get("copies fenced"):
        return ("self._copied (a CUDA event on a GPU; the grader gives it a stand-in on the CPU): when it is not "
                "None, call self._copied.synchronize() before refilling the staging (the last step's non_blocking "
                "copies may still read it) and self._copied.record() after the last copy; a refused update "
                f"records nothing. Yours: {g.get('copies fenced', '?')}")
    if e["outcome"] != g["outcome"]:
        if e["outcome"] == "returned":
            return f"this update is valid (n={n} <= bucket={bucket} <= max_seqs={max_seqs}, slots in range, pad slot of rank 0)"
        why = _refusal(num_slots, max_seqs, steps[k])
        if g["outcome"] == "returned":
            return f"{why}: raise ValueError"
        return f"{why}: raise ValueError before anything fails on its own (you {g['outcome']})"
    if e["outcome"] != "returned":
        if e.get("staging changed") != g.get("staging changed") and e.get("buffers changed") == g.get("buffers changed"):
            return ("a refused update writes nothing, not even the pinned staging (yours changed "
                    f"{g.get('staging changed', '?')}): check every argument before the first write, into a buffer or "
                    "into its staging twin")
        return "a refused update changes nothing: check every argument before the first write into a buffer"
    width = bucket * tps
    if e.get("lora_ranks") != g.get("lora_ranks") or e.get("scalings") != g.get("scalings"):
        return _tables_hint(case, expected, k, e, g)
    if e.get("token_slots") != g.get("token_slots"):
        return _token_slots_hint(case, k, e, g)
    if e.get("seg_lens") != g.get("seg_lens") or e.get("seg_indptr") != g.get("seg_indptr"):
        return _segments_hint(case, k, e, g)
    if e.get("permutation") != g.get("permutation"):
        return (f"permutation[:{width}] is the slot-sorted view's sorted token ids of the padded bucket "
                f"({bucket} sequences of {tps} token(s))")
    if e.get("weight_indices") != g.get("weight_indices"):
        return "weight_indices is arange(num_slots) (segment s is slot s) and update never writes it"
    return None


def _refusal(num_slots: int, max_seqs: int, step) -> str:
    slots, bucket, pad, ranks, scal, _ = step
    if not len(slots) <= bucket <= max_seqs:
        return f"{len(slots)} sequences in a bucket of {bucket}: need n <= bucket <= max_seqs ({max_seqs})"
    if len(ranks) != num_slots or len(scal) != num_slots:
        return f"lora_ranks / scalings need {num_slots} entries (one per slot), got {len(ranks)} / {len(scal)}"
    bad = [s for s in [*slots, pad] if not 0 <= s < num_slots]
    if bad:
        return (f"slot {bad[0]} is outside 0..{num_slots - 1}" +
                (" (a negative index would silently read another slot)" if bad[0] < 0 else ""))
    return f"the pad slot {pad} has rank {ranks[pad]}: padding must add nothing (rank 0)"


# ---------------------------------------------------------------------------------------------
# ch08.3 SlotChangeTracker


def _tiny_adapter(uid) -> LoRAAdapter:
    return LoRAAdapter(uid, 1, 1.0, {})


def _tiny_pool(num_slots: int, max_loaded: int) -> LoRAMemoryPool:
    return LoRAMemoryPool([ModuleSpec("q_proj", 2, (2,))], 1, num_slots, 1, adapter_source=_tiny_adapter,
                          max_loaded_loras=max_loaded)


def _drop_host_copy(pool: LoRAMemoryPool) -> None:
    """Host-memory pressure: the least recently used host copy of an adapter that is not resident
    leaves the CPU cache (what the pool's ``_make_room`` does during a load, here on its own)."""
    victim = next((u for u in pool.cpu_cache if u not in pool.uid_to_buffer_id), None)
    if victim is not None:
        del pool.cpu_cache[victim]
        pool.events.append(("cpu_evict", victim))


def _apply(pool: LoRAMemoryPool, step: list) -> None:
    if step[0] == "batch":
        pool.prepare_lora_batch(step[1])
    elif step[0] == "unload":
        pool.unload(step[1])
    else:
        _drop_host_copy(pool)


def _show_event(e) -> str:
    return "(" + ", ".join(repr(x) for x in e) + ")"


def replay_tracker(cls, num_slots: int, max_loaded: int, warm: list, steps: list) -> list:
    """A pool of ``num_slots`` slots and ``max_loaded`` host copies; the ``warm`` steps run before
    ``cls(pool)`` is made, then ``steps``: ["batch", uids] (prepare_lora_batch), ["unload", uid]
    (``pool.unload``: a resident adapter's slot freed, or a host copy alone removed), ["drop"] (a
    host copy dropped on its own) or ["poll"].

    Returns one line per poll: its number, the events the pool logged since the previous poll (the
    first poll: since the pool was made, warm steps included) and what poll() returned.
    """
    pool = _tiny_pool(num_slots, max_loaded)
    for step in warm:
        _apply(pool, step)
    tracker = cls(pool)
    lines, last, k = [], 0, 0
    for step in steps:
        if step[0] != "poll":
            _apply(pool, step)
            continue
        k += 1
        events = pool.events[last:]
        last = len(pool.events)
        log = list(pool.events)
        try:
            value = tracker.poll()
            shown = repr(value) if isinstance(value, bool) else f"{type(value).__name__} {value!r} (not a bool)"[:80]
        except Exception as exc:  # the outcome is data
            shown = f"raised {type(exc).__name__}: {exc}"[:120]
        if pool.events != log:
            shown += "; poll changed pool.events (the tracker only reads the pool)"
            pool.events[:] = log  # later polls are then judged on the pool's own log
        since = "since the pool was made" if k == 1 else "since the previous poll"
        lines.append(f"poll {k} (events {since}: [{', '.join(_show_event(e) for e in events)}]) -> {shown}")
    return lines


def _tracker_case(name, num_slots, max_loaded, warm, steps) -> Case:
    def short(s):
        return ("poll" if s[0] == "poll" else "drop a host copy" if s[0] == "drop" else
                f"pool.unload({s[1]!r})" if s[0] == "unload" else f"batch {s[1]!r}")
    shown = ", ".join(short(s) for s in steps[:8]) + (", ..." if len(steps) > 8 else "")
    before = f"{len(warm)} batch(es) before the tracker is made ({', '.join(short(s) for s in warm)}); " if warm else ""
    return Case(name, [num_slots, max_loaded, warm, steps],
                f"pool of {num_slots} slots, {max_loaded} host copies; {before}then: {shown}", op="exact")


B, P, D, U = "batch", ["poll"], ["drop"], "unload"


def _tracker_edge() -> list[Case]:
    return [
        _tracker_case("nothing_happened", 2, 3, [], [P]),
        _tracker_case("a_load_then_nothing_new", 2, 3, [], [[B, ["A"]], P, P]),
        _tracker_case("a_hit_changes_no_owner", 2, 3, [], [[B, ["A"]], P, [B, ["A"]], P]),
        _tracker_case("eviction_and_load", 2, 2, [], [[B, ["A", "B"]], P, [B, ["C"]], P, [B, ["C"]], P]),
        _tracker_case("base_model_load", 2, 3, [], [[B, [None]], P, [B, [None]], P]),
        _tracker_case("a_load_then_a_hit_in_one_interval", 3, 4, [], [[B, ["A"]], P, [B, ["B"]], [B, ["A"]], P]),
        _tracker_case("load_and_hit_in_one_batch", 3, 4, [], [[B, ["A"]], P, [B, ["A", "B"]], P]),
        _tracker_case("several_batches_between_polls", 2, 2, [], [[B, ["A"]], [B, ["B"]], [B, ["C"]], [B, ["C"]], P, P]),
        # the slots end as they started (A and B back in their slots): an ownership change all the same
        _tracker_case("evicted_and_reloaded_into_the_same_slots", 2, 3, [],
                      [[B, ["A", "B"]], P, [B, ["C"]], [B, ["A", "B"]], P]),
        _tracker_case("host_copy_dropped_alone", 2, 4, [], [[B, ["A"]], [B, ["B"]], [B, ["C"]], P, D, P]),
        _tracker_case("warm_pool_first_poll_reports_earlier_loads", 2, 3, [[B, ["A", None]]], [P, P]),
        # an adapter leaves its slot with no load after it; then the freed slot is loaded again
        _tracker_case("unload_frees_a_slot", 2, 3, [], [[B, ["A", None]], P, [U, "A"], P, [B, ["B"]], P]),
        # slot 0 is a slot: B leaves slot 1, then A leaves slot 0 ("unload", "A", 0): a test of the
        # slot's truthiness misses the second (and only the second)
        _tracker_case("unload_from_slot_0", 2, 3, [], [[B, ["A", "B"]], P, [U, "B"], P, [U, "A"], P]),
        # A evicted from its slot but its host copy kept: unloading it frees no slot; unloading an
        # adapter the pool never held logs nothing (an interval of hits before: counting every event
        # is told apart from counting every unload)
        _tracker_case("unload_of_a_host_copy_only", 2, 4, [],
                      [[B, ["A", None]], [B, ["B", None]], P, [B, ["B"]], P, [U, "A"], P, [U, "Z"], P]),
        _tracker_case("warm_pool_of_hits_only_after_a_load", 2, 3, [[B, ["A"]], [B, ["A"]]], [P, [B, ["A"]], P]),
        _tracker_case("no_poll_at_all", 2, 3, [[B, ["A"]]], [[B, ["B"]]]),
    ]


def _tracker_trace(rng: random.Random, num_slots: int, max_loaded: int, lone_first: bool = False) -> tuple[list, list]:
    """Warm steps and a trace, built on a reference pool so that hits, misses and drops happen where
    they should; every draw has each family of the module docstring. ``lone_first``: no warm steps, and
    the trace starts with one adapter loaded alone into slot 0 (the pool's first event, the first
    poll's only one), a poll, that adapter unloaded from slot 0 and a poll."""
    pool = _tiny_pool(num_slots, max_loaded)
    names = [None, "A", "B", "C", "D", "E", "F"]
    fresh = iter([f"N{k}" for k in range(1, 40)])
    warm, steps = [], []

    def batch(target, uids):
        uids = list(uids)
        target.append([B, uids])
        pool.prepare_lora_batch(uids)

    def residents():
        return sorted(pool.uid_to_buffer_id, key=uid_sort_key)

    def random_batch(target):
        k = rng.randint(1, num_slots)
        batch(target, rng.sample(names, k))

    if lone_first:  # the log's first event decides the first poll; then slot 0 freed by an unload
        first = rng.choice(names[1:])
        batch(steps, [first])
        steps.append(P)
        steps.append([U, first])
        pool.unload(first)
    else:
        for _ in range(rng.randint(0, 2)):  # some draws start on a warm pool, some not
            random_batch(warm)
    steps.append(P)
    for _ in range(rng.randint(1, 3)):
        random_batch(steps)
    steps.append(P)
    steps.append(P)  # two polls in a row
    batch(steps, rng.sample(residents(), rng.randint(1, len(residents()))))  # hits only
    steps.append(P)
    batch(steps, [next(fresh)])  # a miss (an eviction once full) ...
    batch(steps, rng.sample(residents(), 1))  # ... followed by a hit: the last event is not the change
    steps.append(P)
    for _ in range(12):  # until some host copy is not resident (more host copies than slots)
        if any(u not in pool.uid_to_buffer_id for u in pool.cpu_cache):
            break
        batch(steps, [next(fresh)])
    steps.append(P)
    steps.append(D)  # a host copy dropped alone: no owner changed
    _drop_host_copy(pool)
    steps.append(P)
    while len(pool.uid_to_buffer_id) < num_slots:  # a full pool, then ...
        batch(steps, [next(fresh)])
    full = residents()
    steps.append(P)
    batch(steps, [next(fresh)])  # ... an eviction, and the evicted adapter loaded back into its slot:
    batch(steps, full)  # the slot table ends as it started, owners changed in between
    steps.append(P)
    for _ in range(rng.randint(2, 5)):
        random_batch(steps)
        if rng.random() < 0.5:
            steps.append(P)
    for _ in range(12):  # until some host copy is not resident (more host copies than slots) ...
        cached = [u for u in pool.cpu_cache if u not in pool.uid_to_buffer_id]
        if cached:
            break
        batch(steps, [next(fresh)])
    steps.append(P)
    steps.append([U, cached[0]])  # ... and that adapter removed: no slot changes owner
    pool.unload(cached[0])
    steps.append(P)
    # a resident adapter removed: its slot is freed, with no load after it (a slot other than 0 where
    # one holds an adapter: ignoring unloads is then told apart from missing slot 0's)
    adapters = [u for u in residents() if u is not None]
    gone = rng.choice([u for u in adapters if pool.uid_to_buffer_id[u] != 0] or adapters)
    steps.append([U, gone])
    pool.unload(gone)
    steps.append(P)
    if rng.random() < 0.5:
        batch(steps, [next(fresh)])  # the freed slot loaded again
        steps.append(P)
    batch(steps, residents()[:1])
    steps.append(P)
    return warm, steps


def _tracker_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    cases = []
    for i in range(4):
        num_slots = rng.randint(2, 4)
        max_loaded = num_slots + rng.randint(1, 2)
        warm, steps = _tracker_trace(rng, num_slots, max_loaded, lone_first=i == 1)
        if i == 0 and not warm:  # the first draw always starts on a warm pool
            warm = [[B, ["A", "B"][:num_slots]]]
        cases.append(_tracker_case(f"random_{i}", num_slots, max_loaded, warm, steps))
    return cases


def _tracker_variant(**wrong) -> type:
    """``SlotChangeTracker`` with one named mistake switched on (for hints)."""
    counted = ("load", "evict") + (("hit",) if wrong.get("hits") else ()) + (("cpu_evict",) if wrong.get("cpu") else ())

    def changes(e) -> bool:
        if e[0] == "unload":
            if wrong.get("unload_truthy"):  # `if event[2]:` (slot 0 reads as no slot)
                return bool(e[2])
            return not wrong.get("unload_ignored") and (e[2] is not None or bool(wrong.get("unload_any")))
        return e[0] in counted

    class Variant:
        def __init__(self, pool) -> None:
            self.pool = pool
            # skips_first: a cursor kept as "the index of the last event read", started at 0 and read
            # from cursor + 1 (the first poll never sees event 0; later polls are right)
            self.seen = len(pool.events) if wrong.get("from_the_end") else 1 if wrong.get("skips_first") else 0
            self.owners = None

        def poll(self) -> bool:
            if wrong.get("snapshot"):
                owners = dict(self.pool.uid_to_buffer_id)
                changed = owners != self.owners and bool(owners or self.owners)
                self.owners = owners
                return changed
            new = self.pool.events[self.seen:]
            if not wrong.get("never_advances"):
                self.seen = len(self.pool.events)
            if wrong.get("last_only"):
                return bool(new) and changes(new[-1])
            return bool(new) if wrong.get("any_event") else any(changes(e) for e in new)
    return Variant


_TRACKER_MISTAKES = [
    (dict(from_the_end=True), "the first poll reports the events logged before the tracker was made too (a runner "
                              "started on a warm pool must copy its tables once): start from the beginning of "
                              "pool.events, not its end"),
    (dict(hits=True), "a hit is an LRU refresh: the slot keeps its owner, so the per-slot tables need no rewrite"),
    (dict(cpu=True), "cpu_evict drops a host copy (the CPU cache): no slot changes owner"),
    (dict(any_event=True), "only load, evict and unload-with-a-slot events change a slot's owner: a hit is an LRU "
                           "refresh, a cpu_evict drops a host copy, and (\"unload\", uid, None) removes an adapter "
                           "that held no slot"),
    (dict(unload_ignored=True), "a slot changes owner when an adapter leaves it too, not only when one is loaded: "
                                "(\"unload\", uid, slot) with a slot removed a resident adapter (its slot zeroed and "
                                "freed, no load after it), so return True, as for an \"evict\""),
    (dict(unload_truthy=True), "slot 0 is a slot: (\"unload\", uid, 0) removed the adapter in slot 0, so it changes "
                               "an owner like any unload with a slot; test `event[2] is not None`, not the "
                               "truthiness of event[2] (0 is falsy)"),
    (dict(skips_first=True), "the first poll must read pool.events from index 0: your cursor skips the log's first "
                             "event (an off-by-one between 'how many events were read', the next index to read, and "
                             "'the index of the last one read')"),
    (dict(unload_any=True), "(\"unload\", uid, None) removed an adapter that held no slot (only its host copy was "
                            "cached): no slot changed owner; only an unload that names a slot counts"),
    (dict(never_advances=True), "poll() forgets what it reported: remember how far you have read (the length of "
                                "pool.events at this poll), or every later poll reports the same events again"),
    (dict(last_only=True), "look at every event since the previous poll, not only the last one: a load followed by "
                           "a hit changed an owner"),
    (dict(snapshot=True), "an adapter was evicted and loaded back since the previous poll: the slot table may look "
                          "as it did then, yet slots changed owner in between (and were rewritten); answer from the "
                          "load, evict and unload events, not by comparing snapshots of the slots"),
]


def _tracker_hint(case: Case, expected, got) -> Optional[str]:
    """The known mistakes whose replay of this very trace gives the answer's record; else what the
    first differing poll returned against what its events say."""
    if not isinstance(got, (tuple, list)) or len(got) != len(expected):
        return None
    got, expected = [str(g) for g in got], list(expected)
    k = first_difference(expected, got)
    if k is None:
        return None
    e, g = expected[k], got[k]
    if "poll changed pool.events" in g:
        return ("poll() only reads the pool: pool.events is the pool's log (other readers, the tests, a second "
                "tracker use it); remember how far you have read instead of clearing or trimming it")
    if not (g.endswith("-> True") or g.endswith("-> False")):
        return "poll() returns a bool: True when a slot changed owner since the previous poll"
    hint = symptom_hint(_TRACKER_MISTAKES, lambda *args, **w: replay_tracker(_tracker_variant(**w), *args),
                        case.args, expected, got, same=lambda a, b: list(a) == list(b))
    if hint:
        return hint
    events = e.split("events ", 1)[1].rsplit(") -> ", 1)[0]
    kinds = [x.split(",")[0].strip("('") for x in events.split("[", 1)[1].split("), (")] if "(" in events else []
    if e.endswith("-> True"):
        return ("a load, an evict or an unload that names a slot since the previous poll means a slot changed owner: "
                f"return True (these events: {', '.join(kinds)})")
    if not kinds:
        return "nothing happened since the previous poll (no event), so no slot changed owner: return False"
    return (f"only load, evict and unload-with-a-slot events change a slot's owner (these events: {', '.join(kinds)}): "
            "return False")


# ---------------------------------------------------------------------------------------------
# ch08.4 write_decode_inputs


def write_decode_inputs(input_ids, positions, cache_rows, bucket, scratch_row, static_ids, static_positions,
                        static_rows):
    """Reference for ch08.4: ``DecodeGraphRunner._write_inputs`` on given static tensors (the CPU
    path: no pinned staging)."""
    n, tps = len(input_ids), static_ids.shape[1]
    ids = torch.zeros(bucket, tps, dtype=torch.int64)
    ids[:n] = torch.tensor([list(t) for t in input_ids], dtype=torch.int64).view(n, tps)
    pos = torch.zeros(bucket, tps, dtype=torch.int64)
    pos[:n] = torch.tensor(list(positions), dtype=torch.int64).view(n, 1) + torch.arange(tps)
    rows = torch.full((bucket,), scratch_row, dtype=torch.int64)  # padding: the scratch row
    rows[:n] = torch.tensor(list(cache_rows), dtype=torch.int64)
    for dst, src in ((static_ids, ids), (static_positions, pos), (static_rows, rows)):
        dst[:bucket].copy_(src)


_STATIC_NAMES = ("static_ids", "static_positions", "static_rows")
#: the first value of drive_write_inputs when every static tensor still has the memory it was given
_KEPT = "each with the memory and shape it was given"


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device


def drive_write_inputs(fn, input_ids, positions, cache_rows, bucket, scratch_row, static: list):
    """Call the learner's function on the static tensors ``static`` = [ids, positions, rows] and
    return what the bucket's captured graph reads: whether each tensor still has the memory it was
    given (``_KEPT``, or the tensors that were given other memory: ``t.data = new``, ``t.set_(new)``,
    a reallocating ``resize_``), then the first ``bucket`` rows of that original memory, not what the
    function returns nor what the tensor objects hold after a swap: a version that builds new
    tensors, or swaps them in, changes nothing a captured graph sees. (The static tensors come as
    one list so that the graders' "inputs unchanged" check leaves them alone: writing them is the
    exercise.)"""
    static_ids, static_positions, static_rows = static
    given = [t.view(t.shape) for t in static]  # other tensor objects on the same memory: a swap leaves them there
    where = [_where(t) for t in static]
    fn(input_ids, positions, cache_rows, bucket, scratch_row, static_ids, static_positions, static_rows)
    moved = [name for name, t, w in zip(_STATIC_NAMES, static, where) if _where(t) != w]
    kept = _KEPT if not moved else f"given other memory or another shape: {', '.join(moved)}"
    return (kept, *(t[:bucket].clone() for t in given))


def _inputs_case(name, rng: random.Random, max_seqs, tps, n, bucket, junk=True, scratch=None) -> Case:
    rows = rng.sample(range(max_seqs), n)  # the batch's sequences, in any order of their cache rows
    ids = [[rng.randrange(1, 128) for _ in range(tps)] for _ in range(n)]
    pos = [rng.randint(0, 40) for _ in range(n)]
    # StaticKVLlama's scratch row is one past the last sequence row; a cache with more rows than the
    # runner's max_seqs has it further out
    scratch = max_seqs if scratch is None else scratch
    if junk:  # an earlier, larger step left real rows, tokens and positions everywhere
        s_ids = torch.tensor([[rng.randrange(1, 128) for _ in range(tps)] for _ in range(max_seqs)])
        s_pos = torch.tensor([[rng.randint(1, 60) for _ in range(tps)] for _ in range(max_seqs)])
        s_rows = torch.tensor([rng.randrange(max_seqs) for _ in range(max_seqs)])
    else:
        s_ids, s_pos = torch.zeros(max_seqs, tps, dtype=torch.int64), torch.zeros(max_seqs, tps, dtype=torch.int64)
        s_rows = torch.full((max_seqs,), scratch, dtype=torch.int64)
    desc = (f"{n} sequences (input_ids {ids}, positions {pos}, cache_rows {rows}) in a bucket of {bucket}, "
            f"scratch_row {scratch}; static tensors of {max_seqs} rows x {tps} token(s) holding "
            f"{'an earlier step' if junk else 'the capture state'}: rows {s_rows.tolist()}")
    return Case(name, [ids, pos, rows, bucket, scratch, [s_ids, s_pos, s_rows]], desc, op="exact")


def _inputs_edge() -> list[Case]:
    r = random.Random(84)
    return [
        _inputs_case("three_sequences_bucket_4", r, 6, 1, 3, 4),
        _inputs_case("no_padding", r, 4, 1, 4, 4),
        _inputs_case("one_sequence_bucket_8", r, 8, 1, 1, 8),
        _inputs_case("bucket_below_max_seqs_capture_state", r, 8, 1, 2, 4, junk=False),
        _inputs_case("two_tokens_per_sequence", r, 5, 2, 3, 4),
        _inputs_case("three_tokens_per_sequence_no_padding", r, 3, 3, 3, 3),
        _inputs_case("four_tokens_one_sequence_bucket_2", r, 4, 4, 1, 2),
        _inputs_case("scratch_row_past_a_larger_cache", r, 4, 1, 2, 4, scratch=9),
    ]


def _inputs_random(rng: random.Random, gen, hidden: bool) -> list[Case]:
    """Every draw: tokens_per_seq 1..4 (by index), padding inside the bucket, a bucket below
    max_seqs, cache rows out of order, static tensors left by an earlier step."""
    cases = []
    for i, tps in enumerate([1, 2, 3, 4, 1]):
        max_seqs = rng.randint(3, 9)
        bucket = rng.randint(2, max_seqs - 1)
        scratch = max_seqs + (rng.randint(1, 6) if i % 2 else 0)
        cases.append(_inputs_case(f"random_{i}", rng, max_seqs, tps, rng.randint(1, bucket - 1), bucket,
                                  scratch=scratch))
    return cases


_REBOUND = ("{name} still holds the earlier step's values in every row of the bucket: it was not written. Write "
            "into the tensor you were given, in place ({name}[:bucket].copy_(new) or slice assignment): "
            "`{name} = new` only rebinds your local name, and the captured graph keeps reading the tensor it was given")
_WHAT = {"static_ids": "static_ids[q] is input_ids[q], token 0 in the padding rows",
         "static_positions": "static_positions[q, j] is positions[q] + j, position 0 in the padding rows",
         "static_rows": "static_rows[q] is cache_rows[q], the scratch row {scratch} in the padding rows"}


def _inputs_hint(case: Case, expected, got) -> Optional[str]:
    """From the symptom: a tensor given other memory; tensors left exactly as they were (not
    written: a rebound local name); padding rows left as they were; then which values differ."""
    ids, pos, rows, bucket, scratch = case.args[:5]
    n = len(ids)
    if not (isinstance(got, tuple) and len(got) == 4 and isinstance(got[0], str)
            and all(isinstance(g, torch.Tensor) for g in got[1:])):
        return None
    if got[0] != _KEPT:
        moved = got[0].rsplit(": ", 1)[-1]
        first = moved.split(", ")[0]
        has = "has" if ", " not in moved else "have"
        return (f"you replaced the static buffer: {moved} now {has} other memory (`{first}.data = new`, "
                f"`{first}.set_(new)` or a resize_ swap a tensor's memory); a captured graph keeps reading the old "
                f"memory, at the address it recorded, which still holds the earlier step's values. Update it in place "
                f"with copy_ or slice assignment ({first}[:bucket].copy_(new) or {first}[:bucket] = new)")
    expected, got = expected[1:], got[1:]
    old = [a[:bucket] for a in case.args[5]]
    if all(torch.equal(g, a) for g, a in zip(got, old)):
        return ("the static tensors you were given are unchanged: write into them in place (copy_ or slice "
                "assignment); the captured graph reads those tensors, not new ones (`static_ids = new` only "
                "rebinds your local name)")
    e_ids, e_pos, e_rows = expected
    g_ids, g_pos, g_rows = got
    if n < bucket and all(torch.equal(g[n:], a[n:]) and not torch.equal(x[n:], a[n:]) for g, a, x in zip(got, old, expected)):
        return (f"padding rows (n .. bucket-1) still hold an earlier step's values: write them too, into the tensors "
                f"you were given (token 0 at position 0 on the scratch row {scratch}; any other cache row belongs to "
                "a real sequence, whose cache the padding's key/value writes would overwrite)")
    # a tensor left exactly as it was where the contract changes it: not written at all (a rebound
    # local name), certain when its real rows change too; when they happen to keep their values, its
    # padding rows alone left unwritten returns the same
    for name, g, a, x in zip(_STATIC_NAMES, got, old, expected):
        if torch.equal(g, a) and not torch.equal(x, a):
            rebound = _REBOUND.format(name=name) + " (" + _WHAT[name].format(scratch=scratch) + ")"
            if not torch.equal(x[:n], a[:n]):
                return rebound
            return name_matches([rebound, f"the padding rows (n .. bucket-1) of {name} still hold the earlier step's "
                                          f"values (its real rows happen to hold theirs already): write them too ("
                                          + _WHAT[name].format(scratch=scratch) + ")"])
    if not torch.equal(g_rows[:n], e_rows[:n]):
        return "static_rows[q] is cache_rows[q] for the real sequences"
    if not torch.equal(g_rows, e_rows):
        stale = " (yours still hold the earlier step's rows)" if torch.equal(g_rows[n:], old[2][n:]) else ""
        return (f"padding rows (n .. bucket-1) must use the scratch row ({scratch}){stale}: any other row belongs to "
                "a real sequence (in this batch or not), and the padding's key/value writes would overwrite its "
                "cache")
    tps = e_ids.shape[1]
    if not torch.equal(g_ids[:n], e_ids[:n]):
        # the token ids first (the report shows static_ids first): only token 0 of each real sequence
        # right is one token per sequence assumed (its positions then usually alike: both named)
        if tps > 1 and torch.equal(g_ids[:n, 0], e_ids[:n, 0]):
            also = (f", and static_positions[q, j] is positions[q] + j for every j (yours: only j = 0 right)"
                    if torch.equal(g_pos[:n, 0], e_pos[:n, 0]) and not torch.equal(g_pos[:n], e_pos[:n]) else "")
            return (f"static_ids[q] is all of input_ids[q], its tokens_per_seq = {tps} token ids: write every column "
                    f"j (token j of sequence q), not only token 0{also}")
        return "static_ids[q] holds input_ids[q] (tokens_per_seq tokens) for the real sequences"
    if not torch.equal(g_pos[:n], e_pos[:n]):
        return ("token j of sequence q sits at position positions[q] + j (tokens_per_seq consecutive positions "
                "from the sequence's first)")
    if not torch.equal(g_pos, e_pos) or not torch.equal(g_ids[n:], e_ids[n:]):
        return "padding rows get token 0 at position 0 (a stale position could lie past the cache's max_len)"
    return None


EXERCISES = [
    Exercise("ch08.1", "bucket_for", ("num_seqs", "buckets"), bucket_for, _bucket_edge, _bucket_random,
             _bucket_hint, grade_on="cpu"),
    Exercise("ch08.2", "StaticLoRABatch", ("num_slots", "max_seqs", "tokens_per_seq", "poison", "steps"),
             functools.partial(drive_static_batch, StaticLoRABatch), _static_edge, _static_random, _static_hint,
             driver=drive_static_batch, grade_on="cpu", compare=_static_compare),
    Exercise("ch08.3", "SlotChangeTracker", ("num_slots", "max_loaded_loras", "warm", "steps"),
             functools.partial(replay_tracker, SlotChangeTracker), _tracker_edge, _tracker_random, _tracker_hint,
             driver=replay_tracker, grade_on="cpu"),
    Exercise("ch08.4", "write_decode_inputs", ("input_ids", "positions", "cache_rows", "bucket", "scratch_row",
                                               "[static_ids, static_positions, static_rows]"),
             functools.partial(drive_write_inputs, write_decode_inputs), _inputs_edge, _inputs_random, _inputs_hint,
             driver=drive_write_inputs, grade_on="cpu",
             result_names=("memory of the static tensors", "static_ids[:bucket]", "static_positions[:bucket]",
                           "static_rows[:bucket]")),
]
