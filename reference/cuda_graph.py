"""CUDA-graph decode with LoRA: static batch buffers updated in place, bucketed graphs: chapter 08.

A CUDA graph records kernel launches with their arguments: every pointer, every shape, every grid
size and every branch the Python code took while capturing. Replaying it reruns exactly those
launches, without Python, on whatever the captured pointers hold *now*. LoRA makes that hard because
the batch's adapters change every step; what makes it possible here:

- the pool's weights live in fixed slots (chapter 05), so a slot's address never changes;
- the per-batch metadata lives in :class:`StaticLoRABatch`: tensors allocated once for the largest
  bucket and overwritten in place before each replay (from pinned host staging, never reallocated),
  with padding rows pointed at a rank-0 slot so a stale slot id is never read;
- batch sizes are bucketed (:func:`bucket_for`): one graph per bucket, captured largest first into
  one shared memory pool; a batch is padded up to its bucket;
- grids are sized for capacity: a captured graph launches the LoRA kernels for every row of its
  bucket whatever adapters were present at capture (``has_active_lora`` is frozen True in the LoRA
  graphs), and the kernels read slot and rank from the buffers at run time;
- a base-only batch replays a separately captured graph without the LoRA launches, while the pool's
  bookkeeping still advances (``prepare_lora_batch`` runs for every step);
- per-slot tables (ranks, scalings) derived from slot ownership are rewritten only when ownership
  changed (:class:`SlotChangeTracker`, TensorRT-LLM's ``slots_changed``); missing the flag is the
  classic stale-adapter bug: the graph keeps the old adapter's rank and scaling for a slot that
  now holds another adapter.

On a machine without CUDA the runner executes the same code: "capture" keeps the step function and
"replay" calls it, so the static-buffer discipline (and every bug in it) is the same.

Sources: TensorRT-LLM ``tensorrt_llm/_torch/peft/lora/cuda_graph_lora_params.py``
(``CudaGraphLoraParams``) and ``adapter_slot_manager.py`` (``slots_changed``); SGLang
``python/sglang/srt/lora/lora_manager.py`` (``init_cuda_graph_batch_info``, batch info updated in
place) and ``model_executor/cuda_graph_runner.py``; vLLM ``vllm/lora/punica_wrapper/punica_gpu.py``
(metadata buffers); nano-vllm ``nanovllm/engine/model_runner.py`` (``capture_cudagraph``: a bucket
list, largest first, one graph pool).
"""
from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch

from reference.batch_info import LoRABatchInfo, slot_sorted_view
from reference.layers import LoRAContext
from reference.mem_pool import LoRAMemoryPool
from reference.ops.decode_schedule import DECODE_SCHEDULES, choose_decode_schedule, reachable_schedules, schedule_parts
from reference.static_llama import StaticKVLlama

__all__ = ["default_buckets", "bucket_for", "SlotChangeTracker", "StaticLoRABatch", "DecodeGraphRunner"]


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """nano-vllm's bucket list: 1, 2, 4, 8, then every multiple of 16, up to ``max_batch`` (included).

    Example: default_buckets(40) -> (1, 2, 4, 8, 16, 32, 40). Raises ValueError if max_batch < 1.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    small = [b for b in (1, 2, 4, 8) if b <= max_batch]
    return tuple(sorted({*small, *range(16, max_batch + 1, 16), max_batch}))


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``num_seqs`` sequences (``buckets`` in any order).

    Example: bucket_for(5, (1, 2, 4, 8, 16)) -> 8; bucket_for(8, ...) -> 8.
    Raises:
        ValueError: num_seqs < 1, no buckets, or more sequences than the largest bucket (such a
        batch must be split or run eagerly).
    """
    if not buckets:
        raise ValueError("no buckets")
    if num_seqs < 1:
        raise ValueError(f"a decode batch has at least one sequence, got {num_seqs}")
    fits = [b for b in buckets if b >= num_seqs]
    if not fits:
        raise ValueError(f"{num_seqs} sequences exceed the largest bucket ({max(buckets)}): split the batch")
    return min(fits)


class SlotChangeTracker:
    """Whether any slot of a pool changed owner since the last :meth:`poll` (TensorRT-LLM's
    ``AdapterSlotManager.slots_changed``).

    It reads the pool's event log (chapter 05; ``reference.mem_pool`` lists every kind). A slot
    changes owner when an adapter arrives in it or leaves it: ``("load", uid, slot, tier)``,
    ``("evict", uid, slot)`` and ``("unload", uid, slot)`` with a slot (a resident adapter removed,
    its slot zeroed and freed: ``LoRAMemoryPool.unload``, the serving engine's adapter removal).
    ``("hit", uid, slot)`` (an LRU refresh), ``("cpu_evict", uid)`` (a host copy dropped) and
    ``("unload", uid, None)`` (an adapter held only as a host copy removed) change no owner.
    The first poll reports every event the pool logged before the tracker was made, so a runner
    started on a warm pool copies its tables once.

    The pool logs each "evict" in the same ``prepare_lora_batch`` call as the "load" into that slot,
    so no poll sees one without the other; an "unload" frees a slot with no load after it (the
    device tables would keep the removed adapter's rank for a slot the pool now reports as rank 0,
    and the engine may pick that slot for its padding).
    """

    def __init__(self, pool: LoRAMemoryPool) -> None:
        self.pool = pool
        self.seen = 0  # events of pool.events already looked at

    @staticmethod
    def changes_owner(event: tuple) -> bool:
        """True for the events that change a slot's owner (see the class docstring)."""
        return event[0] in ("load", "evict") or (event[0] == "unload" and event[2] is not None)

    def poll(self) -> bool:
        """True when a slot changed owner since the previous poll; then forgets it."""
        new = self.pool.events[self.seen:]
        self.seen = len(self.pool.events)
        return any(self.changes_owner(event) for event in new)


class StaticLoRABatch:
    """The LoRA metadata of every captured decode graph: allocated once, updated in place.

    Buffers (on ``device``, sized for ``max_seqs * tokens_per_seq`` tokens and ``num_slots`` slots):
        token_slots [max_tokens] int32: slot of each token (x order); padding -> ``pad_slot``.
        lora_ranks [num_slots] int32, scalings [num_slots] float32: copied from the pool's host
            mirrors only when slot ownership changed.
        seg_indptr [num_slots + 1] int32, seg_lens [num_slots] int32, weight_indices [num_slots]
            int32 (= arange), permutation [max_tokens] int64: the slot-sorted view (TensorRT-LLM's
            per-slot counts, offsets and sorted token ids), read by SGMV when tokens_per_seq > 1
            and, at one token per sequence, by the decode ops' "sorted" schedules
            (``reference.ops.bgmv_expand`` / ``bgmv_shrink``: one B or A tile per slot for all of
            its tokens).
    Each has a pinned host twin (``staging``); :meth:`update` fills the twins on the host and
    copies them with ``non_blocking`` copies, so no device buffer is ever reallocated and no device
    value is read.

    :meth:`batch_info` gives, per bucket, a :class:`LoRABatchInfo` of views into these buffers:
    with one token per sequence it carries ``max_len = 1`` and ``token_slots``, so the layers choose
    BGMV (chapter 07's rule), and the slot-sorted view too, which the BGMV expand may read; with
    several (speculative verification) it carries the slot-sorted segments with ``max_len`` = the
    bucket's token count, so SGMV's grid covers any segment.
    """

    def __init__(self, num_slots: int, max_seqs: int, tokens_per_seq: int = 1,
                 device: torch.device | str = "cpu") -> None:
        if num_slots < 1 or max_seqs < 1 or tokens_per_seq < 1:
            raise ValueError(f"num_slots, max_seqs, tokens_per_seq must be >= 1, got "
                             f"{num_slots}, {max_seqs}, {tokens_per_seq}")
        self.num_slots, self.max_seqs, self.tokens_per_seq = num_slots, max_seqs, tokens_per_seq
        self.device = torch.device(device)
        max_tokens = max_seqs * tokens_per_seq
        specs = {"token_slots": (max_tokens, torch.int32), "lora_ranks": (num_slots, torch.int32),
                 "scalings": (num_slots, torch.float32), "seg_indptr": (num_slots + 1, torch.int32),
                 "seg_lens": (num_slots, torch.int32), "weight_indices": (num_slots, torch.int32),
                 "permutation": (max_tokens, torch.int64)}
        pin = self.device.type == "cuda"
        self.buffers = {k: torch.zeros(n, dtype=dt, device=self.device) for k, (n, dt) in specs.items()}
        self.staging = {k: torch.zeros(n, dtype=dt, pin_memory=pin) for k, (n, dt) in specs.items()}
        self.buffers["weight_indices"].copy_(torch.arange(num_slots, dtype=torch.int32))
        self.buffers["permutation"].copy_(torch.arange(max_tokens, dtype=torch.int64))
        self._views: dict[tuple[int, str], LoRABatchInfo] = {}  # (bucket, decode schedule) -> view
        # the host must not refill the staging while the last step's copies may still read it
        self._copied = torch.cuda.Event() if pin else None

    def update(self, seq_slots: Sequence[int], bucket: int, pad_slot: int, lora_ranks: Sequence[int],
               scalings: Sequence[float], ownership_changed: bool) -> None:
        """Write one step's metadata into the buffers, in place.

        Args:
            seq_slots: slot of each real sequence (host ints), in batch order; n = len(seq_slots).
            bucket: the graph's batch size (n <= bucket <= max_seqs); the slot-sorted view covers
                its ``bucket * tokens_per_seq`` tokens.
            pad_slot: a slot of rank 0 for every padding sequence (n .. max_seqs - 1, so even rows
                past the bucket never hold a stale slot).
            lora_ranks, scalings: the pool's host mirrors (one entry per slot).
            ownership_changed: :meth:`SlotChangeTracker.poll`'s answer; per-slot tables are copied
                only then.
        Raises:
            ValueError: not n <= bucket <= max_seqs; a slot outside 0..num_slots-1; a pad slot
            whose rank is not 0; tables of the wrong length. Nothing is written then.
        """
        n, tps = len(seq_slots), self.tokens_per_seq
        if not n <= bucket <= self.max_seqs:
            raise ValueError(f"{n} sequences in a bucket of {bucket}: need n <= bucket <= {self.max_seqs}")
        if len(lora_ranks) != self.num_slots or len(scalings) != self.num_slots:
            raise ValueError(f"lora_ranks / scalings need {self.num_slots} entries, got "
                             f"{len(lora_ranks)} / {len(scalings)}")
        if any(not 0 <= s < self.num_slots for s in (*seq_slots, pad_slot)):
            raise ValueError(f"slots must lie in 0..{self.num_slots - 1}: {list(seq_slots)}, pad {pad_slot}")
        if lora_ranks[pad_slot] != 0:
            raise ValueError(f"pad slot {pad_slot} has rank {lora_ranks[pad_slot]}: padding must add nothing")
        seqs = list(seq_slots) + [pad_slot] * (bucket - n)
        if self._copied is not None:
            self._copied.synchronize()
        st = self.staging
        st["token_slots"].fill_(pad_slot)
        st["token_slots"][:bucket * tps].copy_(torch.tensor(seqs, dtype=torch.int32).repeat_interleave(tps))
        counts, offsets, order = slot_sorted_view(seqs, self.num_slots, tps)
        st["seg_lens"].copy_(counts)
        st["seg_indptr"].copy_(offsets)
        st["permutation"][:bucket * tps].copy_(order)
        names = ["token_slots", "seg_lens", "seg_indptr", "permutation"]
        if ownership_changed:
            st["lora_ranks"].copy_(torch.tensor(list(lora_ranks), dtype=torch.int32))
            st["scalings"].copy_(torch.tensor(list(scalings), dtype=torch.float32))
            names += ["lora_ranks", "scalings"]
        for name in names:
            self.buffers[name].copy_(st[name], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def batch_info(self, bucket: int, schedule: str = "token") -> LoRABatchInfo:
        """The batch info a graph of ``bucket`` sequences is captured with (views, made once).

        ``has_active_lora`` is True: the LoRA launches are part of the graph whatever the batch.
        Padding sequences (from n to the bucket) sit in the pad slot's segment of the slot-sorted
        view that :meth:`update` wrote for this bucket. ``schedule`` ("token", "sorted" or
        "grouped", ``reference.ops.decode_schedule``) is the decode schedule the graph is captured
        with: the view's ``shrink_schedule`` and ``expand_schedule``; every view reads the same
        buffers. Raises ValueError for a bucket outside 1..max_seqs or another schedule.
        """
        if bucket > self.max_seqs or bucket < 1:
            raise ValueError(f"bucket {bucket} outside 1..{self.max_seqs}")
        if schedule not in DECODE_SCHEDULES:
            raise ValueError(f"schedule must be one of {DECODE_SCHEDULES} (a decode schedule), got {schedule!r}")
        key = (bucket, schedule)
        if key not in self._views:
            b = self.buffers
            tokens = bucket * self.tokens_per_seq
            decode = self.tokens_per_seq == 1
            shrink, expand = schedule_parts(schedule)
            self._views[key] = LoRABatchInfo(
                bs=bucket, num_segments=self.num_slots, max_len=1 if decode else tokens,
                has_active_lora=True, seg_lens=b["seg_lens"], seg_indptr=b["seg_indptr"],
                weight_indices=b["weight_indices"], lora_ranks=b["lora_ranks"], scalings=b["scalings"],
                permutation=b["permutation"][:tokens],
                token_slots=b["token_slots"][:tokens], shrink_schedule=shrink, expand_schedule=expand)
        return self._views[key]

    def data_ptrs(self) -> dict[str, int]:
        """Address of every buffer (a test of the in-place discipline: they never change)."""
        return {k: v.data_ptr() for k, v in self.buffers.items()}


class DecodeGraphRunner:
    """Decode steps of a LoRA-wrapped Llama through captured CUDA graphs, one per bucket.

    ``model`` is a Hugging Face LlamaForCausalLM wrapped by ``reference.layers.wrap_llama(model,
    pool, context, backend)``; the runner owns a :class:`~reference.static_llama.StaticKVLlama`
    over it (``self.llm``: prefill through ``self.llm`` eagerly, decode through :meth:`decode`).

    Per bucket b it captures two graphs over the same static inputs (token ids, positions, cache
    rows, the :class:`StaticLoRABatch`): one with the LoRA launches (``has_active_lora`` frozen
    True) and one base-only. :meth:`decode` pads the batch to its bucket, keeps the pool's
    bookkeeping going for every step (``prepare_lora_batch``, base model kept resident: its slot, of
    rank 0, is where padding rows point), writes the static buffers in place and replays.

    At one token per sequence, the LoRA graph comes in one version per decode schedule that
    ``schedule_rule`` can pick for the bucket's steps (``reference.ops.decode_schedule``: "token",
    "sorted" (the expand grouped by slot), "grouped" (the shrink too)): key ``(bucket, True)`` for
    "token", ``(bucket, "sorted")`` and ``(bucket, "grouped")``, beside the base-only
    ``(bucket, False)``. A graph cannot change its kernels, so the choice by batch shape
    (``schedule_rule(tokens, distinct adapters, the pool's max rank)``, host values) is a choice of
    graph; a bucket captures only the schedules the rule picks for some step of its sizes
    (:func:`~reference.ops.decode_schedule.reachable_schedules`). ``last_key`` is the key of the
    graph the last step replayed.

    On CUDA the layers' ops must launch without reading the device (the Triton backend); the torch
    references read segment tables on the host and cannot be captured. Without CUDA (or with
    ``use_graphs=False``) "capture" keeps the step and "replay" calls it: the same buffers, the same
    code.

    Args:
        model, pool, context: as given to ``wrap_llama``.
        max_seqs: largest decode batch (the largest bucket); max_len: positions per sequence.
        buckets: batch sizes to capture (default :func:`default_buckets`).
        tokens_per_seq: tokens each sequence decodes per step (> 1: speculative verification).
        use_graphs: capture CUDA graphs (default: when the model is on a CUDA device).
        schedule_rule: (num_tokens, num_adapters, max_rank) -> "token" | "sorted" | "grouped", the
            decode schedule of a step (default
            ``reference.ops.decode_schedule.choose_decode_schedule``, the committed H200 runs'
            table; the engine's ``PagedDecodeGraphRunner`` takes the same argument).
    Raises:
        ValueError: a bucket outside 1..max_seqs.
    """

    def __init__(self, model: torch.nn.Module, pool: LoRAMemoryPool, context: LoRAContext, *,
                 max_seqs: int, max_len: int, buckets: Optional[Sequence[int]] = None,
                 tokens_per_seq: int = 1, use_graphs: Optional[bool] = None,
                 schedule_rule: Callable[[int, int, int], str] = choose_decode_schedule) -> None:
        self.pool, self.context = pool, context
        self.llm = StaticKVLlama(model, max_seqs, max_len)
        device = self.llm.k_cache.device
        self.device = device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        self.buckets = tuple(sorted(set(buckets or default_buckets(max_seqs))))
        if self.buckets[0] < 1 or self.buckets[-1] > max_seqs:
            raise ValueError(f"buckets {self.buckets} must lie in 1..{max_seqs}")
        self.max_seqs, self.tokens_per_seq = max_seqs, tokens_per_seq
        self.schedule_rule = schedule_rule
        self.static = StaticLoRABatch(pool.num_slots, max_seqs, tokens_per_seq, device)
        self.tracker = SlotChangeTracker(pool)
        self.input_ids = torch.zeros(max_seqs, tokens_per_seq, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_seqs, tokens_per_seq, dtype=torch.int64, device=device)
        self.cache_rows = torch.full((max_seqs,), self.llm.scratch_row, dtype=torch.int64, device=device)
        self.base_info = {}  # bucket -> the batch info of the base-only graphs (no LoRA launch)
        # (bucket, True | False | "sorted" | "grouped") -> (graph or None, output); see the class docstring
        self.graphs: dict[tuple[int, object], tuple] = {}
        self.last_key: Optional[tuple[int, object]] = None
        self.mempool = None
        self.replays = {"lora": 0, "base": 0}

    # ---- capture ---------------------------------------------------------------------------
    def _step(self, bucket: int, lora) -> torch.Tensor:
        """``lora``: True (the "token" schedule), "sorted", "grouped" or False (base only)."""
        if lora:
            info = self.static.batch_info(bucket, "token" if lora is True else lora)
        else:
            info = self.base_info[bucket]
        self.context.set_batch(info)
        return self.llm(self.input_ids[:bucket], self.positions[:bucket], self.cache_rows[:bucket])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graphs (the base-only one and a LoRA one per schedule ``schedule_rule``
        can pick for it: :meth:`schedules`), largest bucket first (later, smaller graphs reuse the
        shared pool's memory). The padding state the capture runs on: every row on the scratch row
        of the KV cache and on the pad slot."""
        pad = self._pad_slot(self.pool.prepare_lora_batch([], running=[None]))
        self.static.update([], self.max_seqs, pad, self.pool.lora_ranks_host, self.pool.scalings_host,
                           ownership_changed=True)
        self.tracker.poll()
        for bucket in self.buckets:
            info = self.static.batch_info(bucket)
            self.base_info[bucket] = LoRABatchInfo(**{**vars(info), "has_active_lora": False})
        for bucket in reversed(self.buckets):
            loras = [True if s == "token" else s for s in DECODE_SCHEDULES if s in self.schedules(bucket)]
            for lora in (*loras, False):
                if not self.use_graphs:
                    self.graphs[(bucket, lora)] = (None, None)
                    continue
                stream = torch.cuda.Stream(device=self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # warm-up: Triton compiles outside the capture
                    self._step(bucket, lora)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool):
                    out = self._step(bucket, lora)
                if self.mempool is None:
                    self.mempool = graph.pool()
                self.graphs[(bucket, lora)] = (graph, out)
        torch.cuda.synchronize(self.device) if self.use_graphs else None

    def schedules(self, bucket: int) -> set[str]:
        """The decode schedules ``schedule_rule`` picks for some step this bucket serves (its sizes from
        the next smaller bucket's + 1, any number of adapters): the LoRA graphs it captures. More
        than one token per sequence: "token" only (the layers run SGMV then, whatever the schedule)."""
        if self.tokens_per_seq != 1:
            return {"token"}
        smaller = [b for b in self.buckets if b < bucket]
        return {"token"} | reachable_schedules(max(smaller, default=0) + 1, bucket, self.pool.max_lora_rank,
                                               self.schedule_rule)

    # ---- one decode step -------------------------------------------------------------------
    def _pad_slot(self, uid_to_slot: dict) -> int:
        return uid_to_slot[None]

    @torch.inference_mode()
    def decode(self, input_ids: Sequence[Sequence[int]], positions: Sequence[int], cache_rows: Sequence[int],
               req_uids: Sequence[Hashable]) -> torch.Tensor:
        """One decode step of n sequences; returns logits [n, tokens_per_seq, vocab] (a copy).

        Args (host values, one entry per sequence, batch order):
            input_ids: the tokens_per_seq token ids each sequence feeds this step.
            positions: the position of each sequence's first token this step.
            cache_rows: each sequence's KV-cache row (0..max_seqs-1).
            req_uids: each sequence's adapter uid, None for the base model.
        Raises:
            ValueError: more sequences than the largest bucket; lists of different lengths; what
            ``prepare_lora_batch`` raises (nothing has changed then).
        """
        n, tps = len(req_uids), self.tokens_per_seq
        if not (len(input_ids) == len(positions) == len(cache_rows) == n):
            raise ValueError("input_ids, positions, cache_rows and req_uids need one entry per sequence")
        if not self.graphs:
            self.capture()
        bucket = self._bucket(n)
        uid_to_slot = self.pool.prepare_lora_batch(req_uids, running=[None])  # bookkeeping, every step
        slots = [uid_to_slot[u] for u in req_uids]
        ranks = self.pool.lora_ranks_host
        adapters = len({s for s in slots if ranks[s] > 0})
        lora = adapters > 0
        if lora and tps == 1:
            schedule = self.schedule_rule(n, adapters, self.pool.max_lora_rank)
            if schedule != "token" and (bucket, schedule) in self.graphs:
                lora = schedule
        self.static.update(slots, bucket, self._pad_slot(uid_to_slot), ranks, self.pool.scalings_host,
                           ownership_changed=self.tracker.poll())
        self._write_inputs(input_ids, positions, cache_rows, bucket)
        graph, out = self.graphs[(bucket, lora)]
        self.last_key = (bucket, lora)
        self.replays["lora" if lora else "base"] += 1
        if graph is not None:
            graph.replay()
        else:
            out = self._step(bucket, lora)
        return out[:n].clone()

    def _bucket(self, n: int) -> int:
        """The bucket of a step of n sequences (:func:`bucket_for`). Chapter 08 replaces this,
        :attr:`static`, :attr:`tracker` and :meth:`_write_inputs` with the learner's answers."""
        return bucket_for(n, self.buckets)

    def _write_inputs(self, input_ids, positions, cache_rows, bucket: int) -> None:
        n, tps = len(input_ids), self.tokens_per_seq
        ids = torch.zeros(bucket, tps, dtype=torch.int64)
        ids[:n] = torch.tensor([list(t) for t in input_ids], dtype=torch.int64).view(n, tps)
        pos = torch.zeros(bucket, tps, dtype=torch.int64)
        pos[:n] = torch.tensor(list(positions), dtype=torch.int64).view(n, 1) + torch.arange(tps)
        rows = torch.full((bucket,), self.llm.scratch_row, dtype=torch.int64)  # padding: scratch row
        rows[:n] = torch.tensor(list(cache_rows), dtype=torch.int64)
        pin = self.device.type == "cuda"
        for dst, src in ((self.input_ids, ids), (self.positions, pos), (self.cache_rows, rows)):
            dst[:bucket].copy_(src.pin_memory() if pin else src, non_blocking=pin)
