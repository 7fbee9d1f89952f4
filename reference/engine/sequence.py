"""A request inside the engine: its tokens, its adapter, its KV blocks and where it stands.

Control plane only (no tensors). Source: nano-vllm ``nanovllm/engine/sequence.py`` (the token list,
``num_cached_tokens``, the block table) and vLLM's ``SamplingParams``.
"""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Hashable, Optional

__all__ = ["SamplingParams", "SeqStatus", "Sequence"]


@dataclass(frozen=True)
class SamplingParams:
    """How a request's tokens are chosen and when it stops (vLLM's names).

    ``temperature`` 0 is greedy (argmax, ties to the lowest token id); above 0, tokens are drawn
    from softmax(logits / temperature), its noise a hash of (``seed``, tokens drawn so far): reproducible
    per request and independent of its batch (``reference.engine.model_runner.sample_batch``).
    ``top_k`` (0: off) keeps the k most likely tokens, ``top_p`` (1.0: off) the smallest set whose
    probability reaches p; neither changes a greedy pick. Generation stops after ``max_new_tokens``
    tokens or at the first token in ``stop_token_ids`` (which is kept in the output), but never
    before ``min_tokens`` tokens: until then the stop tokens cannot be drawn (vLLM's ``min_tokens``).
    ``logprobs``: also report the log-probability of each chosen token (under softmax(logits), the
    model's own distribution, whatever the temperature).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    top_k: int = 0
    top_p: float = 1.0
    min_tokens: int = 0
    logprobs: bool = False

    def check(self) -> None:
        """Raises ValueError: max_new_tokens not an int >= 1; temperature not a finite number >= 0;
        sampling without an int seed, or a seed outside [-2^63, 2^64); stop_token_ids not a tuple or
        list of ints; top_k not an int >= 0; top_p not a number in (0, 1]; min_tokens not an int in
        [0, max_new_tokens]; logprobs not a bool."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature < 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature > 0 and not _is_int(self.seed):
            raise ValueError(f"sampling (temperature > 0) needs an int seed, so every run draws the same tokens; "
                             f"got {self.seed!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -2 ** 63 <= self.seed < 2 ** 64):
            # the sampler hashes the seed as 64 bits: a wider one would alias another seed's draws
            raise ValueError(f"seed must be an int in [-2^63, 2^64), got {self.seed!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of ints, got {self.stop_token_ids!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: every token), got {self.top_k!r}")
        if (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                or not 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens], got {self.min_tokens!r}")
        if not isinstance(self.logprobs, bool):
            raise ValueError(f"logprobs must be a bool, got {self.logprobs!r}")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's state. ``tokens`` = prompt + output; KV exists for ``tokens[:num_computed]``.

    ``block_table[j]`` is the physical KV block of positions ``[j*block_size, (j+1)*block_size)``.
    ``num_hashed`` counts the leading full blocks already registered in the prefix cache.
    ``enqueued_step``: the scheduler step at which it last joined the waiting queue (arrival or
    preemption), from which its waiting time is counted.
    """

    seq_id: int
    prompt: list[int]
    uid: Hashable  # adapter uid; None = the base model
    params: SamplingParams
    enqueued_step: int = 0
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_hashed: int = 0
    finish_reason: Optional[str] = None
    in_prefill: bool = False  # admitted, and its prompt (or recomputed tokens) not all computed yet
    # [uid, block_size, key of block 0, key of block 1, ...]: the reference block keys computed so
    # far (BlockManager extends them as blocks fill; never compared, never printed)
    prefix_keys: list = field(default_factory=list, repr=False, compare=False)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def token_slice(self, start: int, end: int) -> list[int]:
        """``tokens[start:end]`` without building the whole token list (a decode step reads one)."""
        n = len(self.prompt)
        if start >= n:
            return self.output[start - n:end - n]
        return self.prompt[start:end] + self.output[:max(0, end - n)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV is not computed yet (1 for a decoding sequence)."""
        return self.num_tokens - self.num_computed
