"""Wrong answers for chapter 08 (buckets, the static LoRA batch, the change flag), each the solution
cell with one realistic edit (graders.course.mutation.Mutant). ch08.2 and ch08.3 are classes graded through
the replay drivers of graders/chapters/ch08.py, so these are edits of the method bodies: the in-place
discipline, padding, the flag, the slot-sorted view, validation order; which events count, how far
the log was read.

Not in the catalogue, because no trace of the book's pool tells it apart from the solution: a
tracker that counts "load" and "unload"-with-a-slot but not "evict" (the pool logs every "evict" in
the same prepare_lora_batch call as the load into that slot, so no poll sees one without the other;
the exercise text says so). A tracker that counts only "load" is caught by the unload of a resident
adapter (a slot freed with no load after it): "only-loads-count" below. "cpu_evict" is also logged
only next to a load by the pool itself, so the graders' traces drop host copies on their own too
(memory pressure), where counting it fails."""
from graders.course.mutation import Mutant

_PAD_CHECK = ("        if lora_ranks[pad_slot] != 0:\n"
              "            raise ValueError(f\"pad slot {pad_slot} has rank {lora_ranks[pad_slot]}, not 0\")\n")
_COPY = "            self.buffers[name].copy_(st[name], non_blocking=True)\n"
_EVENTS = 'return any(event[0] in ("load", "evict") or (event[0] == "unload" and event[2] is not None) for event in new)'
_UNLOAD = ' or (event[0] == "unload" and event[2] is not None)'

MUTANTS = [
    # ch08.1 bucket_for
    Mutant("ch08.1", "first-fit-in-given-order", (("    return min(fits)", "    return fits[0]"),),
           "buckets come in any order", "layout", plausible=True),
    Mutant("ch08.1", "largest-bucket", (("    return min(fits)", "    return max(buckets)"),),
           "not the largest", "math"),
    Mutant("ch08.1", "strict-greater", (("b >= num_seqs", "b > num_seqs"),), "an exact fit is allowed", "clause"),
    Mutant("ch08.1", "returns-an-index", (("    return min(fits)", "    return list(buckets).index(min(fits))"),),
           "not its index", "clause"),
    Mutant("ch08.1", "too-many-returns-the-largest",
           (("    if not fits:\n        raise ValueError(f\"{num_seqs} sequences exceed the largest bucket ({max(buckets)})\")",
             "    if not fits:\n        return max(buckets)"),),
           "more_than_the_largest_raises_value_error", "error"),
    Mutant("ch08.1", "zero-sequences-accepted",
           (("    if num_seqs < 1:\n        raise ValueError(f\"a decode batch has at least one sequence, got {num_seqs}\")\n", ""),),
           "zero_sequences_raises_value_error", "error"),
    Mutant("ch08.1", "only-zero-refused", (("    if num_seqs < 1:", "    if num_seqs == 0:"),),
           "negative_sequences_raises_value_error", "error"),

    # ch08.2 StaticLoRABatch.update
    Mutant("ch08.2", "pads-with-slot-0",
           (("        seqs = list(seq_slots) + [pad_slot] * (bucket - n)", "        seqs = list(seq_slots) + [0] * (bucket - n)"),
            ('        st["token_slots"].fill_(pad_slot)', '        st["token_slots"].fill_(0)')),
           "sit on the pad slot", "clause", plausible=True),
    Mutant("ch08.2", "buffers-reallocated", ((_COPY, "            self.buffers[name] = st[name].clone()\n"),),
           "a buffer was replaced", "state"),
    Mutant("ch08.2", "stale-slots-past-the-bucket", (('        st["token_slots"].fill_(pad_slot)\n', ""),),
           "token_slots past the bucket", "layout"),
    Mutant("ch08.2", "tables-copied-regardless-of-the-flag", (("        if ownership_changed:", "        if True:"),),
           "rewritten only when slot ownership changed", "state"),
    Mutant("ch08.2", "tables-never-copied", (("        if ownership_changed:", "        if False:"),),
           "ownership_changed is True: copy", "state"),
    Mutant("ch08.2", "no-tokens-per-seq-expansion",
           (('        st["token_slots"][:bucket * tps] = torch.tensor(seqs, dtype=torch.int32).repeat_interleave(tps)',
             '        st["token_slots"][:bucket] = torch.tensor(seqs, dtype=torch.int32)'),),
           "tokens in a row", "layout"),
    Mutant("ch08.2", "repeat-not-repeat-interleave", ((".repeat_interleave(tps)", ".repeat(tps)"),),
           "repeat_interleave, not repeat", "layout"),
    Mutant("ch08.2", "slot-sorted-view-over-max-seqs",
           (("slot_sorted_view(seqs, self.num_slots, tps)",
             "slot_sorted_view(seqs + [pad_slot] * (self.max_seqs - bucket), self.num_slots, tps)"),
            ('        st["permutation"][:bucket * tps] = order', '        st["permutation"][:] = order')),
           "not max_seqs", "layout"),
    Mutant("ch08.2", "permutation-not-written", (('        st["permutation"][:bucket * tps] = order\n', ""),),
           "sorted token ids of the padded bucket", "clause"),
    Mutant("ch08.2", "pad-rank-checked-after-the-write",
           ((_PAD_CHECK, ""), (_COPY, _COPY + _PAD_CHECK)),
           "a refused update changes nothing", "error"),
    Mutant("ch08.2", "pad-rank-checked-after-the-staging",
           ((_PAD_CHECK, ""), ('        names = ["token_slots", "seg_lens", "seg_indptr", "permutation"]\n',
                               _PAD_CHECK + '        names = ["token_slots", "seg_lens", "seg_indptr", "permutation"]\n')),
           "not even the pinned staging", "error"),
    Mutant("ch08.2", "pad-rank-unchecked", ((_PAD_CHECK, ""),), "padding must add nothing", "error"),
    Mutant("ch08.2", "more-sequences-than-the-bucket-accepted",
           (("        if not n <= bucket <= self.max_seqs:", "        if not bucket <= self.max_seqs:"),),
           "need n <= bucket", "error"),
    Mutant("ch08.2", "bucket-past-max-seqs-accepted",
           (("        if not n <= bucket <= self.max_seqs:", "        if not n <= bucket:"),),
           "need n <= bucket <= max_seqs", "error"),
    Mutant("ch08.2", "negative-pad-slot-accepted",
           (("for s in [*seq_slots, pad_slot])", "for s in [*seq_slots, pad_slot] if s >= 0)"),),
           "a negative index would silently read another slot", "error"),
    Mutant("ch08.2", "table-lengths-unchecked",
           (("        if len(lora_ranks) != self.num_slots or len(scalings) != self.num_slots:\n"
             "            raise ValueError(f\"lora_ranks and scalings need {self.num_slots} entries\")\n", ""),),
           "one per slot", "error"),

    # ch08.3 SlotChangeTracker
    Mutant("ch08.3", "starts-at-the-end-of-the-log", (("        self.seen = 0", "        self.seen = len(pool.events)"),),
           "the first poll reports the events logged before the tracker was made", "state", plausible=True),
    Mutant("ch08.3", "hits-count-as-changes", (('("load", "evict")' + _UNLOAD, '("load", "evict", "hit")' + _UNLOAD),),
           "a hit is an LRU refresh", "clause"),
    Mutant("ch08.3", "cpu-evict-counts", (('("load", "evict")' + _UNLOAD, '("load", "evict", "cpu_evict")' + _UNLOAD),),
           "cpu_evict drops a host copy", "clause"),
    Mutant("ch08.3", "never-advances", (("        self.seen = len(self.pool.events)\n", ""),),
           "poll() forgets what it reported", "state"),
    Mutant("ch08.3", "only-the-last-event",
           ((_EVENTS, 'return bool(new) and (new[-1][0] in ("load", "evict") or (new[-1][0] == "unload" and new[-1][2] is not None))'),),
           "not only the last one", "state"),
    Mutant("ch08.3", "any-event-counts", ((_EVENTS, "return bool(new)"),), "a hit is an LRU refresh", "clause"),
    Mutant("ch08.3", "returns-the-events",
           ((_EVENTS, 'return [e for e in new if e[0] in ("load", "evict") or (e[0] == "unload" and e[2] is not None)]'),),
           "poll() returns a bool", "clause"),

    # ch08.4 write_decode_inputs
    Mutant("ch08.4", "only-the-real-rows-written", (("        dst[:bucket].copy_(src)", "        dst[:n].copy_(src[:n])"),),
           "padding rows (n .. bucket-1) still hold an earlier step's values", "poison", plausible=True),
    Mutant("ch08.4", "padding-on-row-0",
           (("torch.full((bucket,), scratch_row, dtype=torch.int64)", "torch.zeros(bucket, dtype=torch.int64)"),),
           "must use the scratch row", "clause"),
    Mutant("ch08.4", "padding-on-the-unused-rows",
           (("torch.full((bucket,), scratch_row, dtype=torch.int64)", "torch.arange(bucket, dtype=torch.int64)"),),
           "must use the scratch row", "clause"),
    Mutant("ch08.4", "positions-not-offset-per-token", ((" + torch.arange(tps)", ""),), "positions[q] + j", "layout"),
    Mutant("ch08.4", "stale-padding-positions",
           (("    pos = torch.zeros(bucket, tps, dtype=torch.int64)", "    pos = static_positions[:bucket].clone()"),),
           "padding rows get token 0 at position 0", "poison"),
    Mutant("ch08.4", "new-tensors-returned",
           (("    for dst, src in ((static_ids, ids), (static_positions, pos), (static_rows, rows)):\n"
             "        dst[:bucket].copy_(src)", "    return ids, pos, rows"),),
           "write into them in place", "state"),
    Mutant("ch08.4", "cache-rows-not-written",
           (("(static_positions, pos), (static_rows, rows))", "(static_positions, pos))"),),
           "static_rows[q] is cache_rows[q]", "clause"),

    # ch08.2: the event fence, the caller's lists (found by a learner trial, not by the first catalogue)
    Mutant("ch08.2", "no-fence-on-the-event",
           (("        if self._copied is not None:\n            self._copied.synchronize()  # the previous step's copies may still read the staging\n", ""),
            ("        if self._copied is not None:\n            self._copied.record()\n", "")),
           "never waited on the event", "clause"),
    Mutant("ch08.2", "record-before-the-copies",
           (("        for name in names:\n" + _COPY + "        if self._copied is not None:\n            self._copied.record()\n",
             "        if self._copied is not None:\n            self._copied.record()\n        for name in names:\n" + _COPY),),
           "not recorded after the last copy", "clause"),
    Mutant("ch08.2", "pads-the-callers-list",
           (("        seqs = list(seq_slots) + [pad_slot] * (bucket - n)",
             "        seqs = seq_slots\n        seqs += [pad_slot] * (bucket - n)"),),
           "update changed its arguments", "clause"),
    Mutant("ch08.2", "scalings-as-int32",
           (('st["scalings"].copy_(torch.tensor(list(scalings), dtype=torch.float32))',
             'st["scalings"].copy_(torch.tensor([int(v) for v in scalings], dtype=torch.int32))'),),
           "copied as integers", "dtype"),
    # ch08.3: a snapshot instead of the log; a tracker that empties the log
    Mutant("ch08.3", "owner-snapshot",
           (("        self.seen = 0  # events already looked at: 0, so the first poll sees a warm pool's history",
             "        self.seen = None  # the slot table at the last poll"),
            ("        new = self.pool.events[self.seen:]\n        self.seen = len(self.pool.events)\n        " + _EVENTS,
             "        owners = dict(self.pool.uid_to_buffer_id)\n        changed = owners != self.seen and bool(owners or self.seen)\n"
             "        self.seen = owners\n        return changed")),
           "evicted_and_reloaded_into_the_same_slots", "layout"),
    Mutant("ch08.3", "clears-the-log",
           (("        new = self.pool.events[self.seen:]\n        self.seen = len(self.pool.events)\n",
             "        new = self.pool.events[self.seen:]\n        self.pool.events.clear()\n        self.seen = 0\n"),),
           "poll changed pool.events", "clause"),
    # ch08.4: the scratch row guessed from the tensors
    Mutant("ch08.4", "scratch-row-from-the-shape",
           (("    rows = torch.full((bucket,), scratch_row, dtype=torch.int64)",
             "    rows = torch.full((bucket,), static_rows.shape[0], dtype=torch.int64)"),),
           "scratch row", "clause"),
]

# issue #33 ("feedback that misleads"): a hint chosen from the case named a cause other than the
# answer's (ch08.1's random group told a first fit over unsorted buckets "(>=, not >)"); hints now
# name what returns exactly the answer's result, and the cases tell the mistakes apart
MUTANTS += [
    Mutant("ch08.1", "first-fit-and-strict",
           (("b >= num_seqs", "b > num_seqs"), ("    return min(fits)", "    return fits[0]")),
           "buckets come in any order", "clause"),
]

# issue #33: a tracker that counts only loads scored 3/3 (every "evict" comes with its "load"); the
# pool's unload (a slot freed with no load after it) is now in the exercise's events and its traces
MUTANTS += [
    Mutant("ch08.3", "only-loads-count", ((_EVENTS, 'return any(event[0] == "load" for event in new)'),),
           "a slot changes owner when an adapter leaves it too", "clause"),
    Mutant("ch08.3", "unload-ignored", ((_UNLOAD, ""),), "a slot changes owner when an adapter leaves it too", "clause"),
    Mutant("ch08.3", "unload-of-a-host-copy-counts", ((_UNLOAD, ' or event[0] == "unload"'),),
           "removed an adapter that held no slot", "clause"),
]

# issue #33 ("feedback that misleads"): a static tensor swapped for new memory (`t.data = new`) scored
# 3/3, its values read through the tensor object; one rebound by name was hinted as a padding mistake
# where its real rows happened to keep their values. The driver reads the memory the tensors were
# given and says which tensors were given other memory; hints come from that symptom
MUTANTS += [
    Mutant("ch08.4", "static-memory-swapped",
           (("        dst[:bucket].copy_(src)", "        dst.data = torch.cat([src, dst[bucket:]])"),),
           "you replaced the static buffer", "state"),
    Mutant("ch08.4", "rows-rebound-by-name",
           (("    for dst, src in ((static_ids, ids), (static_positions, pos), (static_rows, rows)):\n"
             "        dst[:bucket].copy_(src)\n",
             "    static_ids[:bucket] = ids\n    static_positions[:bucket] = pos\n    static_rows = rows\n"),),
           "only rebinds your local name", "state"),
]

# learner trial 41: an unload tested by the slot's truthiness (`if event[2]:`, slot 0 missed) passed the
# whole edge group, and a cursor kept as "the index of the last event read" (started at 0, read from
# cursor + 1: the log's first event never read) passed random and hidden; both were hinted as another
# mistake. An edge trace unloads from slot 0, and one draw of every group starts with a lone load
# (the first poll's only event) and its unload from slot 0
MUTANTS += [
    Mutant("ch08.3", "unload-slot-by-truthiness", ((_UNLOAD, ' or (event[0] == "unload" and event[2])'),),
           "slot 0 is a slot", "clause"),
    Mutant("ch08.3", "cursor-as-the-last-index-read",
           (("        self.seen = 0  # events already looked at: 0, so the first poll sees a warm pool's history",
             "        self.seen = 0  # index of the last event looked at"),
            ("        new = self.pool.events[self.seen:]\n        self.seen = len(self.pool.events)\n",
             "        new = self.pool.events[self.seen + 1:]\n        self.seen = len(self.pool.events) - 1\n")),
           "your cursor skips the log's first event", "state"),
]

# learner trial 41: one token per sequence assumed (only column 0 of the real rows written, the other
# columns keep the earlier step's ids and positions) was hinted about positions while the report showed
# token ids; the hint now starts from static_ids and names the columns
MUTANTS += [
    Mutant("ch08.4", "only-token-0-of-each-sequence",
           (("    ids[:n] = torch.tensor([list(t) for t in input_ids], dtype=torch.int64).view(n, tps)\n",
             "    ids[:n] = static_ids[:n]\n    ids[:n, 0] = torch.tensor([t[0] for t in input_ids], dtype=torch.int64)\n"),
            ("    pos[:n] = torch.tensor(list(positions), dtype=torch.int64).view(n, 1) + torch.arange(tps)\n",
             "    pos[:n] = static_positions[:n]\n    pos[:n, 0] = torch.tensor(list(positions), dtype=torch.int64)\n")),
           "not only token 0", "layout"),
]
