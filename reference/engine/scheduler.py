"""Continuous batching with adapters: which sequences run in each step, and what each computes.

By default every step is a prefill step or a decode step (nano-vllm's rule: prefill first); with
``SchedulerConfig.mixed_steps`` (the engine's default) a step holds every decode and prefill chunks
within the token budget (vLLM V1's scheduler, Sarathi-Serve's stall-free batching). A prefill step
continues the sequences whose prompt is partly computed (chunked prefill), then admits waiting ones
(``admit_requests``: KV blocks, the per-batch adapter cap with the base model as one adapter,
resident adapters first, a drained adapter held back), within ``max_num_batched_tokens`` tokens.
With nothing to prefill, every running sequence decodes one token; when a sequence needs a new
block and none is free, the most recently admitted sequence is preempted (its blocks released, its
tokens recomputed later: vLLM's recompute preemption). A request that waits past
``drain_threshold`` steps while the cap keeps it out starts a drain (``choose_drain``): the chosen
running adapter takes no new requests until the starving request's adapter is running; one that
waited that long while seats or KV blocks kept it out is admitted in arrival order with the resident
adapters' requests (admission stops preferring them over it).

The log ``events`` records every decision as tuples of host values, which chapter 11's graders
compare: ("admit", seq_id), ("prefill", seq_id, start, end), ("decode", seq_id), ("preempt",
seq_id), ("finish", seq_id, reason), ("drain", uid), ("drain_end", uid).

Source: nano-vllm ``nanovllm/engine/scheduler.py``; vLLM ``vllm/v1/core/sched/scheduler.py``
(token budget, chunked prefill, preemption); SGLang ``python/sglang/srt/managers/scheduler.py``
(``max_loras_per_batch`` admission, the LoRA drain).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Hashable, NamedTuple, Optional

from reference.engine.block_manager import BlockManager
from reference.engine.policies import Candidate, admit_requests, choose_drain
from reference.engine.sequence import Sequence, SeqStatus

__all__ = ["SchedulerConfig", "Work", "Scheduler"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one step. ``max_loras_per_batch``: the pool's GPU slots (the base model takes one)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 256  # a prompt longer than this is prefilled in chunks
    max_loras_per_batch: int = 4
    drain_threshold: Optional[int] = None  # steps; None: never drain
    # False: a step is all prefill or all decode (prefill first: nano-vllm). True: mixed steps, every
    # running decode plus prefill chunks within the token budget (vLLM V1, Sarathi-Serve)
    mixed_steps: bool = False
    # Mixed steps only: the prompt tokens a step may carry while it also decodes (None: what the
    # budget leaves). A step's time grows with its prompt tokens, and every decoding sequence waits
    # for the whole step: this bounds the gap between two of its tokens (TPOT p99) while a step with
    # nothing to decode still takes the whole budget of prompt. Sarathi-Serve picks its chunk size
    # from a time-between-tokens target the same way; vLLM's long_prefill_token_threshold caps a
    # single prompt's chunk.
    max_prefill_tokens_while_decoding: Optional[int] = None

    def check(self) -> None:
        """Raises ValueError for a limit < 1 or a negative threshold."""
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_loras_per_batch) < 1:
            raise ValueError(f"limits must be >= 1: {self}")
        if self.drain_threshold is not None and self.drain_threshold < 0:
            raise ValueError(f"drain_threshold must be >= 0, got {self.drain_threshold}")
        if self.max_prefill_tokens_while_decoding is not None and self.max_prefill_tokens_while_decoding < 1:
            raise ValueError("max_prefill_tokens_while_decoding must be >= 1 (or None), got "
                             f"{self.max_prefill_tokens_while_decoding}")


class Work(NamedTuple):
    """What one sequence computes in a step: ``tokens[start:end]`` (its KV, and the logits of the
    last one when ``end`` is the sequence's length)."""

    seq: Sequence
    start: int
    end: int


AdmitFn = Callable[..., list]
DrainFn = Callable[..., tuple]


class Scheduler:
    """Waiting and running queues over a :class:`BlockManager`.

    Args:
        resident: returns the uids resident in GPU slots now (the pool's ``uid_to_buffer_id``).
        admit_fn, drain_fn: ``admit_requests`` / ``choose_drain`` (the capstone plugs in the learner's).
    """

    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 resident: Callable[[], Collection[Hashable]] = tuple,
                 admit_fn: AdmitFn = admit_requests, drain_fn: DrainFn = choose_drain) -> None:
        config.check()
        self.config, self.blocks, self.resident = config, blocks, resident
        self.admit_fn, self.drain_fn = admit_fn, drain_fn
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_no = 0
        self.drain_active, self.draining, self.drain_for = False, None, None
        self.events: list[tuple] = []

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``. Raises ValueError when it could never fit the KV cache."""
        need = self.blocks.blocks_for(seq.num_tokens + seq.params.max_new_tokens - 1)
        if need > self.blocks.num_blocks:
            raise ValueError(f"request {seq.seq_id} needs {need} KV blocks; the cache has {self.blocks.num_blocks}")
        seq.status, seq.enqueued_step = SeqStatus.WAITING, self.step_no
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> tuple[str, list[Work]]:
        """The next step: ("prefill" | "decode" | "mixed", work), or ("idle", []) when nothing can run.

        With ``mixed_steps`` every running sequence past its prompt decodes one token first (decode
        tokens count against ``max_num_batched_tokens`` too), then partly computed prompts take
        chunks of what is left of the budget, then waiting requests are admitted into the rest; the
        step's kind is "mixed" when it holds both decodes and prefill chunks.
        """
        self.step_no += 1
        self._update_drain()
        if self.config.mixed_steps:
            return self._mixed_work()
        work = self._prefill_work()
        if work:
            return "prefill", work
        work = self._decode_work()
        return ("decode", work) if work else ("idle", [])

    def _candidates(self, step_no: Optional[int] = None) -> list[Candidate]:
        step_no = self.step_no if step_no is None else step_no
        return [Candidate(s.seq_id, s.uid, self.blocks.blocks_needed(s), step_no - s.enqueued_step)
                for s in self.waiting]

    def _warm(self, step_no: int) -> set:
        warm = set(self.resident())
        if self.config.drain_threshold is not None:
            # a request that waited past the threshold counts as warm: admission then takes it in
            # arrival order with the resident adapters' requests, so when seats (max_num_seqs) or KV
            # blocks bind rather than the adapter cap, a hot adapter cannot take every freed seat
            # before it (the drain covers the cap; this covers the other limits)
            limit = step_no - self.config.drain_threshold
            warm |= {s.uid for s in self.waiting if s.enqueued_step < limit}
        return warm

    def _prefill_budget(self, decodes: int) -> int:
        """The prompt tokens a mixed step holding ``decodes`` decode rows may carry."""
        budget = self.config.max_num_batched_tokens - decodes
        if decodes and self.config.max_prefill_tokens_while_decoding is not None:
            budget = min(budget, self.config.max_prefill_tokens_while_decoding)
        return budget

    def next_step_admits_none(self, decodes: int, decode_blocks: int) -> bool:
        """Whether the next :meth:`schedule`, with the running sequences as they are, ``decodes`` of
        them decoding and taking ``decode_blocks`` new KV blocks, would admit no waiting request (a
        dry run of :meth:`_admit`'s policy call, one step later; nothing changes). A mixed step admits
        after its decodes took their blocks, a prefill-first step before.

        For a caller that launches the next decode step before the current one is recorded (the
        engine's overlapped decode): it may do so while requests wait only when this is True. The
        drain is not foreseen: such a caller needs ``drain_threshold`` None.
        """
        cfg = self.config
        budget = self._prefill_budget(decodes) if cfg.mixed_steps else cfg.max_num_batched_tokens
        free_blocks = self.blocks.num_free - (decode_blocks if cfg.mixed_steps else 0)
        if budget <= 0 or not self.waiting:
            return True
        step_no = self.step_no + 1
        admitted = self.admit_fn(self._candidates(step_no), [s.uid for s in self.running], self._warm(step_no),
                                 cfg.max_loras_per_batch, free_blocks, cfg.max_num_seqs - len(self.running),
                                 self.draining, self.drain_active)
        if not admitted:
            return True
        first = next(s for s in self.waiting if s.seq_id == admitted[0])
        return self.blocks.blocks_needed(first) > free_blocks  # _admit stops at the first that does not fit

    def _update_drain(self) -> None:
        remaining: dict = {}
        for s in self.running:
            remaining[s.uid] = max(remaining.get(s.uid, 0), s.params.max_new_tokens - len(s.output))
        # a drain lasts until the adapter it frees a slot for is running: ending it when the drained
        # adapter merely stops running would hand the slot straight back to it, since admission
        # prefers resident adapters and the drained one still is
        # ... or once nothing of that adapter waits any more: its request may have finished in the
        # very step that admitted it (max_new_tokens 1), so it is never seen running (LLM._abort's
        # rule; drain_for None is the base model, whose requests have uid None too)
        if self.drain_active and (self.drain_for in remaining
                                  or not any(s.uid == self.drain_for for s in self.waiting)):
            self.events.append(("drain_end", self.draining))
            self.drain_active, self.draining, self.drain_for = False, None, None
        if self.drain_active or self.config.drain_threshold is None:
            return
        candidates = self._candidates()
        active, uid = self.drain_fn(candidates, remaining, self.config.max_loras_per_batch,
                                    self.config.drain_threshold)
        if active:
            starving = [c for c in candidates if c.waited > self.config.drain_threshold and c.uid not in remaining]
            self.drain_for = max(starving, key=lambda c: c.waited).uid if starving else None
            self.drain_active, self.draining = True, uid
            self.events.append(("drain", uid))

    def _mixed_work(self) -> tuple[str, list[Work]]:
        """Sarathi-Serve's stall-free batch: decodes first, so a long prompt never holds them back."""
        decodes = self._decode_work(self.config.max_num_batched_tokens)
        prefills = self._prefill_work(self._prefill_budget(len(decodes)))
        kind = "mixed" if decodes and prefills else "decode" if decodes else "prefill" if prefills else "idle"
        return kind, decodes + prefills

    def _prefill_work(self, budget: Optional[int] = None) -> list[Work]:
        budget = self.config.max_num_batched_tokens if budget is None else budget
        work = []
        for seq in self.running:  # partly computed prompts first (even with one token left)
            if seq.in_prefill and budget > 0:
                work.append(self._chunk(seq, budget))
                budget -= work[-1].end - work[-1].start
        if budget > 0:
            work += self._admit(budget)
        return work

    def _chunk(self, seq: Sequence, budget: int) -> Work:
        end = seq.num_computed + min(seq.num_pending, budget)
        self.events.append(("prefill", seq.seq_id, seq.num_computed, end))
        return Work(seq, seq.num_computed, end)

    def _admit(self, budget: int) -> list[Work]:
        admitted = self.admit_fn(self._candidates(), [s.uid for s in self.running], self._warm(self.step_no),
                                 self.config.max_loras_per_batch, self.blocks.num_free,
                                 self.config.max_num_seqs - len(self.running), self.draining, self.drain_active)
        by_id = {s.seq_id: s for s in self.waiting}
        work = []
        for seq_id in admitted:
            seq = by_id[seq_id]
            if budget == 0 or self.blocks.blocks_needed(seq) > self.blocks.num_free:
                break
            self.blocks.allocate(seq)
            self.waiting.remove(seq)
            seq.status, seq.in_prefill = SeqStatus.RUNNING, True
            self.running.append(seq)
            self.events.append(("admit", seq_id))
            work.append(self._chunk(seq, budget))
            budget -= work[-1].end - work[-1].start
        return work

    def _decode_work(self, budget: Optional[int] = None) -> list[Work]:
        """One token for every running sequence past its prompt, in running order, at most
        ``budget`` of them (None: all); a sequence whose next position needs a block no one has
        preempts the most recently admitted sequence (itself last)."""
        work, i, events, bs = [], 0, self.events, self.blocks.block_size
        while i < len(self.running) and (budget is None or len(work) < budget):
            seq = self.running[i]
            if seq.in_prefill:  # only with mixed steps: its chunk comes from _prefill_work
                i += 1
                continue
            n = seq.num_tokens
            if n <= len(seq.block_table) * bs:  # the common case: its last position has a block already
                events.append(("decode", seq.seq_id))
                work.append(Work(seq, seq.num_computed, n))
                i += 1
                continue
            while not self.blocks.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is SeqStatus.RUNNING:
                self.blocks.append_slot(seq)
                self.events.append(("decode", seq.seq_id))
                work.append(Work(seq, seq.num_computed, seq.num_tokens))
                i += 1
        return work

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.status, seq.enqueued_step, seq.in_prefill = SeqStatus.WAITING, self.step_no, False
        self.waiting.appendleft(seq)
        self.events.append(("preempt", seq.seq_id))

    def postprocess(self, work: list[Work], next_tokens: dict[int, int]) -> list[Sequence]:
        """Record a step's results: KV computed up to each ``end``; ``next_tokens[seq_id]`` appended
        for every sequence whose work reached its last token. Returns the sequences that finished."""
        finished = []
        for seq, _, end in work:
            seq.num_computed = end
            self.blocks.mark_computed(seq)
            if end < seq.num_tokens:
                continue
            seq.in_prefill = False
            token = next_tokens[seq.seq_id]
            seq.output.append(token)
            reason = ("stop" if token in seq.params.stop_token_ids else
                      "length" if len(seq.output) >= seq.params.max_new_tokens else None)
            if reason:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        self.running.remove(seq)
        self.blocks.release(seq)
        self.events.append(("finish", seq.seq_id, reason))
