"""Paged KV blocks and the adapter-keyed prefix cache.

The KV cache is ``num_blocks`` fixed-size blocks of ``block_size`` positions (vLLM's PagedAttention:
Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023). A sequence owns a block table; blocks are shared between sequences by reference count
when their prefix is the same, found through the key of every full block (``block_hashes``: chained
over the adapter's uid and the block's tokens, so two adapters never share KV).

Life of a block: free (in the free list, least recently freed first) -> allocated (ref_count >= 1)
-> freed (ref_count 0, back at the end of the free list, its key kept) -> reused by a hit (taken
out of the free list) or evicted (taken for a new block: its key forgotten). A key is registered only
once every position of its block has its KV computed, so a hit never reads KV that is still to be
written (a chunked prefill computes a prompt over several steps).

Source: nano-vllm ``nanovllm/engine/block_manager.py``; vLLM ``vllm/v1/core/block_pool.py`` (the free
queue in eviction order, blocks freed tail first so that a prefix's head stays cached longest).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Hashable, Sequence as Seq

from reference.engine.policies import block_hashes, stable_hash
from reference.engine.sequence import Sequence

__all__ = ["BlockManager"]

HashFn = Callable[[Seq[int], Hashable, int], list]


class BlockManager:
    """Allocates KV blocks to sequences and keeps the prefix cache (control plane, no tensors).

    Attributes:
        ref_count: [num_blocks] how many sequences hold each block.
        block_key: [num_blocks] the registered key of each block, or None.
        key_to_block: key -> block id, for cached (registered) blocks.
        free: free block ids, next to be taken first.
        hit_tokens, query_tokens: prefix-cache statistics over every allocation (hit rate =
            hit_tokens / query_tokens).
    Args:
        hash_fn: ``block_hashes``'s signature (the capstone plugs in the learner's).
    Raises:
        ValueError: num_blocks or block_size < 1.
    """

    def __init__(self, num_blocks: int, block_size: int, hash_fn: HashFn = block_hashes) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size, self.hash_fn = num_blocks, block_size, hash_fn
        self.ref_count = [0] * num_blocks
        self.block_key: list = [None] * num_blocks
        self.key_to_block: dict = {}
        self.free: OrderedDict = OrderedDict((b, None) for b in range(num_blocks))
        self.hit_tokens = self.query_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup_keys(self, seq: Sequence) -> list:
        # all but the last token: at least one token is computed, whose logits give the next token
        if self.hash_fn is block_hashes:
            return self._chained_keys(seq, (seq.num_tokens - 1) // self.block_size)
        return self.hash_fn(seq.tokens[:seq.num_tokens - 1], seq.uid, self.block_size)

    def _chained_keys(self, seq: Sequence, full: int) -> list:
        """The reference ``block_hashes`` of ``seq``'s first ``full`` blocks, extended block by block
        from the keys computed before (kept on the sequence with the uid and block size they were
        computed for): a sequence's tokens only grow, so a key, once computed, never changes.
        Recomputing the whole chain whenever a block fills, and for every waiting request in every
        step, cost O(length) per call and grew with what was running."""
        memo = seq.prefix_keys
        if memo[:2] != [seq.uid, self.block_size]:
            memo[:] = [seq.uid, self.block_size]
        have = len(memo) - 2
        if have < full:
            bs, parent = self.block_size, memo[-1] if have else None
            tokens = seq.token_slice(have * bs, full * bs)
            for j in range(full - have):
                parent = stable_hash((parent, seq.uid, tuple(int(t) for t in tokens[j * bs:(j + 1) * bs])))
                memo.append(parent)
        return memo[2:2 + full]

    def _hits(self, keys: list) -> list[int]:
        hits = []
        for key in keys:
            block = self.key_to_block.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def blocks_needed(self, seq: Sequence) -> int:
        """Free-list blocks that allocating ``seq`` now would take (new blocks, and hits on freed ones)."""
        hits = self._hits(self._lookup_keys(seq))
        new = self.blocks_for(seq.num_tokens) - len(hits)
        return new + sum(1 for b in hits if self.ref_count[b] == 0)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks; sets
        ``seq.block_table``, ``seq.num_computed`` (the hit tokens) and ``seq.num_hashed``.

        Raises:
            ValueError: ``seq`` already holds blocks, or too few free blocks (nothing changes).
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        keys = self._lookup_keys(seq)
        hits = self._hits(keys)
        if self.blocks_needed(seq) > self.num_free:
            raise ValueError(f"sequence {seq.seq_id} needs {self.blocks_needed(seq)} blocks, {self.num_free} free")
        for block in hits:
            self.free.pop(block, None)
            self.ref_count[block] += 1
        seq.block_table = hits + [self._take_new() for _ in range(self.blocks_for(seq.num_tokens) - len(hits))]
        seq.num_computed = seq.num_hashed = len(hits)
        seq.num_computed *= self.block_size
        self.query_tokens += len(keys) * self.block_size
        self.hit_tokens += len(hits) * self.block_size

    def _take_new(self) -> int:
        block, _ = self.free.popitem(last=False)
        key = self.block_key[block]
        if key is not None:  # evict its cached prefix
            if self.key_to_block.get(key) == block:
                del self.key_to_block[key]
            self.block_key[block] = None
        self.ref_count[block] = 1
        return block

    def can_append(self, seq: Sequence) -> bool:
        """Whether the position of ``seq``'s last token has a block, or a free one can be given."""
        return self.blocks_for(seq.num_tokens) <= len(seq.block_table) or self.num_free >= 1

    def append_slot(self, seq: Sequence) -> None:
        """Give ``seq`` one more block if its last token's position needs one.

        Raises:
            ValueError: it needs one and none is free (nothing changes).
        """
        if self.blocks_for(seq.num_tokens) <= len(seq.block_table):
            return
        if not self.free:
            raise ValueError(f"no free block for sequence {seq.seq_id}")
        seq.block_table.append(self._take_new())

    def pending_keys(self, seq: Sequence, num_computed: int) -> list:
        """The keys :meth:`mark_computed` would register (or take over from a free block) for ``seq``
        once ``num_computed`` of its positions are computed; nothing changes."""
        full = num_computed // self.block_size
        if full <= seq.num_hashed:
            return []
        keys = (self._chained_keys(seq, full) if self.hash_fn is block_hashes else
                self.hash_fn(seq.tokens[:full * self.block_size], seq.uid, self.block_size))
        return list(keys[seq.num_hashed:full])

    def looks_up_any(self, seq: Sequence, keys: set) -> bool:
        """Whether allocating ``seq`` would look up one of ``keys`` (its prefix hits could change once
        they are registered)."""
        return bool(keys) and not keys.isdisjoint(self._lookup_keys(seq))

    def mark_computed(self, seq: Sequence) -> None:
        """Register the key of every full block of ``seq`` whose KV is now computed."""
        keys = self.pending_keys(seq, seq.num_computed)
        for j, key in enumerate(keys, start=seq.num_hashed):
            block = seq.block_table[j]
            held = self.key_to_block.get(key)
            # an identical block that a sequence holds keeps its entry; a free one (next in line to be
            # evicted) hands the key to this live block, so the cache does not depend on whether a
            # step's new blocks were taken before or after this registration (the engine's overlapped
            # decode takes step N+1's before it registers step N's: helper-32's fuzz)
            if held is None or (held != block and self.ref_count[held] == 0):
                if held is not None:
                    self.block_key[held] = None
                self.key_to_block[key] = block
                self.block_key[block] = key
        seq.num_hashed += len(keys)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks (tail first into the free list); its table is cleared."""
        for block in reversed(seq.block_table):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
        seq.block_table, seq.num_computed, seq.num_hashed = [], 0, 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
