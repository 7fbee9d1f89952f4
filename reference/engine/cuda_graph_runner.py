"""CUDA-graph decode for the paged engine: chapter 08's graphs over chapter 11's paged KV cache.

The engine's eager step builds its tensors for the batch it has: as many rows as sequences, block
tables as wide as the longest sequence needs. A CUDA graph freezes every shape and pointer it
captures, so the decode step it replays must read tensors that exist before capture, never move and
never change shape (chapter 08). For a paged cache that means (vLLM's and SGLang's decode graphs):

- batch sizes are bucketed (chapter 08's :func:`~reference.cuda_graph.bucket_for`): a step of n
  sequences replays the graph of the smallest bucket b >= n; rows n..b-1 are *padding*;
- every per-step input lives in a static buffer with one row per sequence of the largest bucket
  (:class:`StaticDecodeInputs`): token id, position, ``slot_mapping`` (where the new K/V go),
  ``context_lens`` and the block table, padded to a fixed ``max_blocks`` per sequence;
- padding is safe by construction: a padding row feeds token 0 at position 0, writes its K/V into
  the runner's *scratch block* (a block no sequence owns: ``ModelRunner.scratch_block``) and reads
  only that block; a real row's table is padded with the scratch block too, and every position at
  or past a row's ``context_lens`` is masked and zeroed before the product (``paged_attention``),
  so stale or NaN values there never reach a logit;
- the LoRA metadata lives in chapter 08's :class:`~reference.cuda_graph.StaticLoRABatch`: the
  rows' slots, padding rows on a rank-0 slot, per-slot ranks and scalings rewritten only when
  :class:`~reference.cuda_graph.SlotChangeTracker` says a slot changed owner; each bucket has a
  base-only graph and a LoRA graph (``has_active_lora`` frozen True) per decode schedule the rule
  can pick for its steps (chapter 08's :func:`~reference.ops.decode_schedule.choose_decode_schedule`,
  as its runner does: the per-token ops, or the expand, or shrink and expand, grouped by slot);
- each step writes the host values into pinned staging and copies each buffer with one
  ``non_blocking`` copy (no device read, no device allocation), replays, and returns the logits of
  the real rows only.

The attention is the eager path's own :func:`~reference.engine.model_runner.paged_attention`, run
over the static buffers: with one query per row and a table ``max_blocks`` wide, its shapes depend
on the bucket alone. With the torch backend each row gathers ``max_blocks * block_size`` positions
whatever its length (so ``max_blocks`` is bounded by the cache and by the model's context); with the
Triton backend (the default on CUDA: :mod:`reference.ops.paged_attention`) each row's program walks
its table only up to its ``context_lens``, so the padded width costs nothing but host memory, and
each bucket's graph splits the KV length ``runner.split_decode`` ways (flash-decoding), chosen for
the bucket's size at capture.

Without CUDA (or with ``use_graphs=False``) "capture" keeps the step and "replay" calls it, as
chapter 08's runner does: the same buffers, the same code, so the CPU tests check the static path.

Sources: nano-vllm ``nanovllm/engine/model_runner.py`` (``capture_cudagraph``: buckets 1, 2, 4, 8,
16, 32, ..., captured largest first into one graph pool; static ``slot_mapping``, ``context_lens``
and ``block_tables`` of ``max_num_blocks`` columns; ``run_model`` replays for decode, runs eagerly
for prefill or a batch past the largest bucket); vLLM ``vllm/worker/model_runner.py`` /
``vllm/v1/worker/gpu_model_runner.py`` (CUDA-graph capture of decode at padded batch sizes, block
tables padded to the maximum, padding slots that write nowhere real); SGLang
``python/sglang/srt/model_executor/cuda_graph_runner.py`` (``capture_one_batch_size``, replay after
copying the batch into the static buffers; LoRA batch info prepared before replay).
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Mapping, Optional, Sequence

import torch

from reference.batch_info import LoRABatchInfo
from reference.cuda_graph import SlotChangeTracker, StaticLoRABatch, bucket_for, default_buckets
from reference.ops.decode_schedule import DECODE_SCHEDULES, choose_decode_schedule, reachable_schedules
from reference.engine.model_runner import AttentionMetadata, ModelRunner, SeqWork

__all__ = ["StaticDecodeInputs", "PagedDecodeGraphRunner", "enable_graph_decode"]

_FIELDS = ("input_ids", "positions", "slot_mapping", "context_lens", "block_tables")


class StaticDecodeInputs:
    """The attention inputs of every decode graph: allocated once, updated in place.

    Buffers (on ``device``, int64, one row per sequence of the largest bucket):
        input_ids [max_seqs]: each row's one token
        positions [max_seqs]: its position
        slot_mapping [max_seqs]: block * block_size + offset its new K/V are written to
        context_lens [max_seqs]: position + 1, the positions the row reads
        block_tables [max_seqs, max_blocks]: the row's blocks, then ``scratch_block`` up to max_blocks
    Each has a pinned host twin (``staging``, pinned on CUDA); :meth:`update` fills the twins on the
    host and copies rows 0..bucket-1 of each with one ``non_blocking`` copy. :meth:`metadata` gives
    a bucket's :class:`~reference.engine.model_runner.AttentionMetadata` of views into the buffers.

    Raises:
        ValueError: a size < 1, or a scratch block id < 0.
    """

    def __init__(self, max_seqs: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: torch.device | str = "cpu") -> None:
        if min(max_seqs, max_blocks, block_size) < 1 or scratch_block < 0:
            raise ValueError(f"max_seqs, max_blocks, block_size must be >= 1 and scratch_block >= 0, got "
                             f"{max_seqs}, {max_blocks}, {block_size}, {scratch_block}")
        self.max_seqs, self.max_blocks, self.block_size = max_seqs, max_blocks, block_size
        self.scratch_block, self.device = scratch_block, torch.device(device)
        shapes = {name: (max_seqs,) for name in _FIELDS[:-1]} | {"block_tables": (max_seqs, max_blocks)}
        pin = self.device.type == "cuda"
        self.buffers = {k: torch.zeros(s, dtype=torch.int64, device=self.device) for k, s in shapes.items()}
        self.staging = {k: torch.zeros(s, dtype=torch.int64, pin_memory=pin) for k, s in shapes.items()}
        self._host = {k: v.numpy() for k, v in self.staging.items()}  # numpy views: filled without torch ops
        self.rows = torch.arange(max_seqs, dtype=torch.int64, device=self.device)  # token_seq, last_token
        self.zeros = torch.zeros(max_seqs, dtype=torch.int64, device=self.device)  # token_local
        self.query_start = torch.arange(max_seqs + 1, dtype=torch.int32, device=self.device)  # one query per row
        self._views: dict[int, AttentionMetadata] = {}
        self._copied = torch.cuda.Event() if pin else None  # staging is refilled only after its copies ran

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The metadata a graph of ``bucket`` rows is captured with (views, made once per bucket).

        One query per row: token_seq = last_token = arange(bucket), token_local = 0, max_query_len 1,
        query_start_loc = arange(bucket + 1).
        Raises ValueError for a bucket outside 1..max_seqs.
        """
        if not 1 <= bucket <= self.max_seqs:
            raise ValueError(f"bucket {bucket} outside 1..{self.max_seqs}")
        if bucket not in self._views:
            b = self.buffers
            self._views[bucket] = AttentionMetadata(
                positions=b["positions"][:bucket], slot_mapping=b["slot_mapping"][:bucket],
                token_seq=self.rows[:bucket], token_local=self.zeros[:bucket],
                block_tables=b["block_tables"][:bucket], context_lens=b["context_lens"][:bucket],
                last_token=self.rows[:bucket], max_query_len=1, query_start_loc=self.query_start[:bucket + 1])
        return self._views[bucket]

    def update(self, work: Sequence[SeqWork], bucket: int) -> None:
        """Write one decode step (one token per SeqWork, checked by the caller) into rows 0..bucket-1.

        Running example: block_size 4, max_blocks 3, scratch block 9, bucket 4,
        work [(token 5, start 6, bt [2, 7]), (token 8, start 0, bt [4, 1])]:
            input_ids [5, 8, 0, 0]     positions [6, 0, 0, 0]     slot_mapping [30, 16, 36, 36]
            context_lens [7, 1, 1, 1]  block_tables [[2, 7, 9], [4, 9, 9], [9, 9, 9], [9, 9, 9]]
        (a table keeps only the blocks positions 0..start need, so bt [4, 1] -> [4, 9, 9]).
        Raises:
            ValueError: not len(work) <= bucket <= max_seqs; a sequence that needs more than
            max_blocks blocks. Nothing is written then.
        """
        n, bs, scratch = len(work), self.block_size, self.scratch_block
        if not n <= bucket <= self.max_seqs:
            raise ValueError(f"{n} sequences in a bucket of {bucket}: need n <= bucket <= {self.max_seqs}")
        need = [w.start // bs + 1 for w in work]
        if any(k > self.max_blocks for k in need):
            raise ValueError(f"a sequence needs {max(need)} blocks, past max_blocks {self.max_blocks}")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copies have read the staging
        h = self._host
        h["input_ids"][:n] = [w.token_ids[0] for w in work]
        h["positions"][:n] = [w.start for w in work]
        h["slot_mapping"][:n] = [w.block_table[w.start // bs] * bs + w.start % bs for w in work]
        h["context_lens"][:n] = [w.start + 1 for w in work]
        tables = h["block_tables"]
        tables[:bucket] = scratch  # padding of every table, and every padding row's table
        for i, (w, k) in enumerate(zip(work, need)):
            tables[i, :k] = w.block_table[:k]
        h["input_ids"][n:bucket], h["positions"][n:bucket] = 0, 0  # padding: token 0 at position 0,
        h["slot_mapping"][n:bucket], h["context_lens"][n:bucket] = scratch * bs, 1  # in the scratch block
        pin = self._copied is not None
        for name in _FIELDS:
            self.buffers[name][:bucket].copy_(self.staging[name][:bucket], non_blocking=pin)
        if self._copied is not None:
            self._copied.record()

    def data_ptrs(self) -> dict[str, int]:
        """Address of every buffer (a test of the in-place discipline: they never change)."""
        return {k: v.data_ptr() for k, v in self.buffers.items()}


class PagedDecodeGraphRunner:
    """Decode steps of a :class:`~reference.engine.model_runner.ModelRunner` through captured CUDA
    graphs per batch-size bucket (base-only, and LoRA in each decode schedule the rule can pick for
    the bucket), over its paged KV cache.

    The runner's ``forward`` asks :meth:`eager_reason` whether a step can take this path and then
    calls :meth:`run`; the pool has been prepared for the step already (one ``prepare_lora_batch``
    per step, whichever path runs), so :meth:`run` only reads the pool's host mirrors.

    Args:
        runner: the ModelRunner (its model, pool, context, cache and scratch block are used as they are).
        max_seqs: the largest decode batch (the largest bucket).
        buckets: batch sizes to capture (default :func:`~reference.cuda_graph.default_buckets`).
        use_graphs: capture CUDA graphs (default: when the runner's device is CUDA); without them
            the static path is called directly (the CPU's way to test it).
        schedule_rule: (num_tokens, num_adapters, max_rank) -> "token" | "sorted" | "grouped", a
            step's decode schedule (default :func:`~reference.ops.decode_schedule.choose_decode_schedule`,
            the rule of chapter 08's runner).
    Attributes:
        max_blocks: columns of the static block tables: ceil(min(max_positions, num_blocks *
            block_size) / block_size), every block a sequence can hold.
        replays: Counter of (bucket, lora) graphs replayed (called, without CUDA graphs): lora is
            False (base only), True (the "token" schedule), "sorted" or "grouped"; ``steps``
            is their total. padding_rows: padding rows replayed in all. eager: Counter of the
            reasons steps were sent back to the eager path.
        graphs: (bucket, lora) -> (CUDAGraph or None, its output logits [bucket, vocab] float32 or None);
            a bucket's LoRA schedules are :meth:`schedules`.
    Raises:
        ValueError: max_seqs < 1; a bucket outside 1..max_seqs; use_graphs on a device that is not CUDA.
    """

    def __init__(self, runner: ModelRunner, max_seqs: int, buckets: Optional[Sequence[int]] = None,
                 use_graphs: Optional[bool] = None,
                 schedule_rule: Callable[[int, int, int], str] = choose_decode_schedule) -> None:
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be an int >= 1, got {max_seqs!r}")
        self.runner, self.pool, self.context, self.device = runner, runner.pool, runner.context, runner.device
        self.use_graphs = self.device.type == "cuda" if use_graphs is None else bool(use_graphs)
        if self.use_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device; the runner is on {self.device}")
        self.buckets = tuple(sorted(set(buckets or default_buckets(max_seqs))))
        if self.buckets[0] < 1 or self.buckets[-1] > max_seqs:
            raise ValueError(f"buckets {self.buckets} must lie in 1..{max_seqs}")
        bs = runner.kv_cache.block_size
        self.max_blocks = -(-min(runner.max_positions, runner.num_blocks * bs) // bs)
        top = self.buckets[-1]
        self.inputs = StaticDecodeInputs(top, self.max_blocks, bs, runner.scratch_block, self.device)
        self.static = None if self.pool is None else StaticLoRABatch(self.pool.num_slots, top, 1, self.device)
        self.tracker = None if self.pool is None else SlotChangeTracker(self.pool)
        # an owner change the tracker saw before the pool's log was emptied (:meth:`trim_pool_events`)
        self._owner_changed = False
        self.schedule_rule = schedule_rule
        self.base_info: dict[int, LoRABatchInfo] = {}  # bucket -> batch info of the base-only graph
        self.graphs: dict[tuple[int, object], tuple] = {}
        self.mempool = None  # one graph memory pool shared by every bucket
        self.replays, self.eager, self.padding_rows = Counter(), Counter(), 0

    @property
    def steps(self) -> int:
        """Decode steps this runner served."""
        return sum(self.replays.values())

    # ---- which steps --------------------------------------------------------------------------
    def pad_slot(self) -> Optional[int]:
        """A slot of rank 0 (the base model's or an empty one) for the padding rows; None if every
        slot holds an adapter (or 0 without a pool, where no LoRA runs)."""
        if self.pool is None:
            return 0
        return next((s for s, r in enumerate(self.pool.lora_ranks_host) if r == 0), None)

    def eager_reason(self, work: Sequence[SeqWork], uid_to_slot: Mapping[Hashable, int]) -> Optional[str]:
        """None when :meth:`run` serves this step, else why the eager path must (also counted in
        ``self.eager``): "prefill" (a SeqWork of more than one token), "batch past the largest
        bucket", "no rank-0 slot for padding", "context past max_blocks". Reads host values only."""
        reason = None
        if any(len(w.token_ids) != 1 for w in work):
            reason = "prefill"
        elif len(work) > self.buckets[-1]:
            reason = "batch past the largest bucket"
        elif self.pad_slot() is None:
            reason = "no rank-0 slot for padding"
        elif any(w.start // self.inputs.block_size >= self.max_blocks for w in work):
            reason = "context past max_blocks"
        if reason is not None:
            self.eager[reason] += 1
        return reason

    # ---- capture ------------------------------------------------------------------------------
    def schedules(self, bucket: int) -> set[str]:
        """The decode schedules the rule picks for some step this bucket serves (its sizes from the
        next smaller bucket's + 1, any number of adapters); "token" always (host calls only)."""
        smaller = [b for b in self.buckets if b < bucket]
        return {"token"} | reachable_schedules(max(smaller, default=0) + 1, bucket, self.pool.max_lora_rank,
                                               self.schedule_rule)

    def _step(self, bucket: int, lora) -> torch.Tensor:
        """The captured function: logits [bucket, vocab] float32 from the static buffers. ``lora``:
        False (base only), True (the "token" schedule), "sorted" or "grouped"."""
        if self.static is not None:
            self.context.set_batch(self.static.batch_info(bucket, "token" if lora is True else lora) if lora
                                   else self.base_info[bucket])
        # the KV splits are frozen per bucket, for the longest context a row can have
        meta = self.runner.split_decode(self.inputs.metadata(bucket), self.max_blocks * self.inputs.block_size)
        return self.runner.run_model(self.inputs.buffers["input_ids"][:bucket], meta)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket's graphs (base-only, and LoRA in each of its :meth:`schedules`),
        largest bucket first into one shared memory pool (nano-vllm's order: smaller graphs reuse the
        largest one's memory). Capture runs on padding only: every row writes and reads the scratch
        block, on a rank-0 slot.
        Raises:
            ValueError: every slot of the pool holds an adapter (no rank-0 slot for the padding).
        """
        pad, top = self.pad_slot(), self.buckets[-1]
        if pad is None:
            raise ValueError("every pool slot holds an adapter: padding needs a slot of rank 0 "
                             "(keep the base model resident, or leave a slot empty)")
        self.inputs.update([], top)
        if self.static is not None:
            self.static.update([], top, pad, self.pool.lora_ranks_host, self.pool.scalings_host,
                               ownership_changed=True)
            self.tracker.poll()
            self._owner_changed = False
            for bucket in self.buckets:
                info = self.static.batch_info(bucket)
                self.base_info[bucket] = LoRABatchInfo(**{**vars(info), "has_active_lora": False})
        for bucket in reversed(self.buckets):
            loras = ([True if s == "token" else s for s in DECODE_SCHEDULES if s in self.schedules(bucket)]
                     if self.static is not None else [])
            for lora in (*loras, False):
                self.graphs[(bucket, lora)] = self._capture_one(bucket, lora) if self.use_graphs else (None, None)
        if self.use_graphs:
            torch.cuda.synchronize(self.device)

    def _capture_one(self, bucket: int, lora) -> tuple:
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up outside the capture: Triton compiles, cuBLAS picks kernels
            self._step(bucket, lora)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            out = self._step(bucket, lora)
        if self.mempool is None:
            self.mempool = graph.pool()
        return graph, out

    def trim_pool_events(self) -> None:
        """Empty the pool's event log (``pool.events``) without losing an owner change.

        The tracker reads the log from the position of its last poll; a log emptied under it (a
        long-running server trims it between requests) would hide every later load until the log
        grew past that position again, and the graphs would keep a reloaded slot's old rank and
        scaling. So the tracker polls first (a change it finds is kept for the next :meth:`run`),
        the log is emptied, and the tracker starts again at its beginning.
        """
        if self.tracker is not None:
            self._owner_changed |= self.tracker.poll()
        del self.pool.events[:]
        if self.tracker is not None:
            self.tracker.seen = 0

    # ---- one decode step ----------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, work: Sequence[SeqWork], uid_to_slot: Mapping[Hashable, int],
            input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One decode step (one token per SeqWork, :meth:`eager_reason` None): logits
        [len(work), vocab] float32 of the real rows (a copy: the graph's output is reused).

        ``uid_to_slot``: the step's ``pool.prepare_lora_batch`` answer. Captures first if nothing
        was captured yet. Updates the static buffers in place (no device read), then replays the
        bucket's LoRA graph of the step's decode schedule (the rule's, from the real rows' count and
        distinct adapters), or its base-only graph when every row is on a rank-0 slot.
        ``input_ids``: int64 [len(work)] on the device, copied over the token ids the host wrote
        (``ModelRunner.forward``'s overlapped decode: the last step's samples, never read here).
        """
        if not self.graphs:
            self.capture()
        n = len(work)
        bucket = bucket_for(n, self.buckets)
        lora = False
        if self.static is not None:
            ranks = self.pool.lora_ranks_host
            slots = [uid_to_slot[w.uid] for w in work]
            adapters = len({s for s in slots if ranks[s] > 0})
            lora = adapters > 0
            if lora:
                schedule = self.schedule_rule(n, adapters, self.pool.max_lora_rank)
                if schedule != "token" and (bucket, schedule) in self.graphs:
                    lora = schedule
            changed = self.tracker.poll() or self._owner_changed
            self._owner_changed = False
            self.static.update(slots, bucket, self.pad_slot(), ranks, self.pool.scalings_host,
                               ownership_changed=changed)
        self.inputs.update(work, bucket)
        if input_ids is not None:  # after update's copies, in stream order: the device's tokens win
            self.inputs.buffers["input_ids"][:n].copy_(input_ids)
        graph, out = self.graphs[(bucket, lora)]
        if graph is not None:
            graph.replay()
        else:
            out = self._step(bucket, lora)
        self.replays[(bucket, lora)] += 1
        self.padding_rows += bucket - n
        return out[:n].clone()


def enable_graph_decode(runner: ModelRunner, max_seqs: int, buckets: Optional[Sequence[int]] = None,
                        use_graphs: Optional[bool] = None,
                        schedule_rule: Callable[[int, int, int], str] = choose_decode_schedule
                        ) -> PagedDecodeGraphRunner:
    """Serve ``runner``'s decode steps of up to ``max_seqs`` sequences through a
    :class:`PagedDecodeGraphRunner` (returned, and kept as ``runner.graph_runner``); every other step
    stays eager. ``use_graphs`` (default: on CUDA) captures CUDA graphs; without them the static
    path is called as it is; ``schedule_rule`` picks each step's decode schedule (see the class).
    The graphs are captured by the returned runner's ``capture()``.

    Raises:
        ValueError: see :class:`PagedDecodeGraphRunner`.
    """
    runner.graph_runner = PagedDecodeGraphRunner(runner, max_seqs, buckets, use_graphs, schedule_rule)
    return runner.graph_runner
