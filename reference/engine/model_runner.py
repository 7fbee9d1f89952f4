"""The engine's model runner: a Llama forward over a paged KV cache, with mixed-adapter LoRA: chapter 11.

Paged KV, and why. Chapter 08's :class:`~reference.static_llama.StaticKVLlama` gives every sequence
a row of ``max_len`` positions, reserved up front: a 20-token chat holds as much memory as a
2000-token one, and the cache fits as many sequences as it has rows, whatever their lengths. vLLM's
PagedAttention (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
PagedAttention", SOSP 2023) cuts the cache into fixed-size *blocks* of ``block_size`` positions, like
pages of virtual memory: a sequence owns a *block table*, a list of physical block ids, and grows one
block at a time, so at most ``block_size - 1`` positions per sequence are wasted, and any free block
serves any sequence (blocks need not be contiguous, nor in order). Position p of a sequence with
block table ``bt`` lives at block ``bt[p // block_size]``, offset ``p % block_size``::

    block_size 4, bt [7, 2, 5]: positions 0-3 -> block 7, 4-7 -> block 2, 8-9 -> block 5 (offsets 0, 1)

Which blocks a sequence owns is control-plane bookkeeping (nano-vllm ``nanovllm/engine/
block_manager.py``: free list, allocation, prefix hashes; the engine's scheduler keeps it). This
module is the data plane: it takes block tables as host lists in :class:`SeqWork`, writes the new
keys and values into their slots and attends over the sequence's blocks (nano-vllm
``nanovllm/engine/model_runner.py``: ``prepare_prefill`` / ``prepare_decode`` build ``slot_mapping``
and ``block_tables``, the attention layer stores and reads through them).

One forward serves a whole engine step: every :class:`SeqWork` is a sequence's tokens to compute now
(a whole prompt, a prefill chunk, or the one last token at decode), all packed into one flat
[num_tokens, hidden] stream in work order, with per-token positions, so prefill chunks and decode
tokens of different sequences mix freely (chunked prefill).

What comes from the Hugging Face model: every module, used as it is (embedding, RMSNorms, the
rotary embedding fed per-token positions, q/k/v/o projections, MLP, final norm, lm_head); only the
attention's cache handling is ours (the math is ``LlamaAttention``'s, GQA as ``repeat_kv`` orders
heads). Where LoRA enters: the projections, which :func:`~reference.layers.wrap_llama` turned into
LoRA layers; before the forward, the runner makes the batch's adapters resident
(``pool.prepare_lora_batch``) and sets the batch's :class:`~reference.batch_info.LoRABatchInfo`,
built from host lists only, on the layers' :class:`~reference.layers.LoRAContext`. A batch of one
token per request (decode) has ``max_len`` 1 and ``token_slots``, so the layers take the BGMV ops
(:func:`~reference.layers.uses_token_slots`); any other batch takes SGMV over one segment per request.

Sources: vLLM ``vllm/attention/ops/paged_attn.py`` (``write_to_paged_cache`` by slot mapping) and
the PagedAttention paper; nano-vllm ``nanovllm/engine/model_runner.py``, ``block_manager.py`` and
``nanovllm/layers/attention.py`` (``store_kvcache``); SGLang ``model_executor/model_runner.py``.
"""
from __future__ import annotations

from typing import Hashable, NamedTuple, Optional, Protocol, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from reference.batch_info import batch_info_from_requests
from reference.layers import LoRABackend, LoRAContext, LoRALinear, get_backend, pack_projections, wrap_llama
from reference.mem_pool import LoRAMemoryPool
from reference.ops.paged_attention import choose_num_splits, triton_paged_attention
from reference.ops.fused_elementwise import rms_norm, rotary_embedding, silu_and_mul
from reference.static_llama import apply_rope

__all__ = ["PagedKVCache", "SeqWork", "AttentionMetadata", "build_attention_metadata", "check_work",
           "paged_attention", "ATTENTION_BACKENDS", "default_attention_backend", "DecodeGraph", "ModelRunner", "sample",
           "sample_batch"]

ATTENTION_BACKENDS = ("torch", "triton")


def default_attention_backend(device: Union[str, torch.device]) -> str:
    """"triton" on CUDA (the kernel that reads only each sequence's blocks), "torch" elsewhere (the
    interpreter runs the kernel too, about 1 ms per program and tile: CI tests it on small shapes)."""
    return "triton" if torch.device(device).type == "cuda" else "torch"


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks, allocated once.

    Attributes:
        k, v: [num_layers, num_blocks, block_size, kv_heads, head_dim], dtype / device as given,
            zero-filled. Position p of a sequence with block table ``bt`` is
            ``k[layer, bt[p // block_size], p % block_size]``.
    Raises:
        ValueError: a size < 1.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu") -> None:
        sizes = dict(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                     num_kv_heads=num_kv_heads, head_dim=head_dim)
        bad = {n: s for n, s in sizes.items() if isinstance(s, bool) or not isinstance(s, int) or s < 1}
        if bad:
            raise ValueError(f"PagedKVCache sizes must be ints >= 1, got {bad}")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @classmethod
    def for_model(cls, model: nn.Module, num_blocks: int, block_size: int) -> "PagedKVCache":
        """A cache shaped for a Hugging Face Llama's config, in its embedding's dtype and device."""
        cfg, weight = model.config, model.get_input_embeddings().weight
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, num_blocks, block_size, kv_heads, head_dim, weight.dtype, weight.device)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def slot(self, block_table: Sequence[int], position: int) -> tuple[int, int]:
        """(block, offset) of ``position``: bt [7, 2, 5], block_size 4, position 9 -> (5, 1)."""
        return block_table[position // self.block_size], position % self.block_size


class SeqWork(NamedTuple):
    """One sequence's share of a forward (host values only: control plane).

    token_ids: the tokens to compute now (a prompt, a prefill chunk, or the last token at decode).
    start: position of token_ids[0] (tokens 0..start-1 are already in the cache).
    block_table: physical block ids; entry j holds positions j*block_size .. (j+1)*block_size - 1,
        and the table covers positions 0 .. start + len(token_ids) - 1 (longer is fine).
    uid: the adapter uid, None for the base model.
    """

    token_ids: list[int]
    start: int
    block_table: list[int]
    uid: Optional[Hashable] = None


class AttentionMetadata(NamedTuple):
    """Per-forward tensors of :func:`paged_attention`, built once for every layer (nano-vllm's Context).

    Running example: block_size 4, work [(3 tokens, start 0, bt [5, 1]), (1 token, start 6, bt [0, 3])]
        positions [0, 1, 2, 6]   slot_mapping [20, 21, 22, 14]   token_seq [0, 0, 0, 1]
        token_local [0, 1, 2, 0]   block_tables [[5], [0, 3]] -> [[5, 0], [0, 3]] (padded with 0)
        context_lens [3, 7]   last_token [2, 3]   max_query_len 3   query_start_loc [0, 3, 4]
    """

    positions: torch.Tensor  # [num_tokens] int64, position of each token in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, block * block_size + offset each token writes
    token_seq: torch.Tensor  # [num_tokens] int64, index of the token's SeqWork
    token_local: torch.Tensor  # [num_tokens] int64, index of the token within its SeqWork
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, the blocks each sequence reads, 0-padded
    context_lens: torch.Tensor  # [num_seqs] int64, start + len: positions the sequence has after the write
    last_token: torch.Tensor  # [num_seqs] int64, flat row of each sequence's last token
    max_query_len: int  # host: longest token_ids
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu_seqlens: sequence s's tokens are rows qsl[s]..qsl[s+1]-1
    num_splits: int = 1  # host: splits over the KV length of the Triton kernel (flash-decoding), 1 = none


def _blocks_needed(length: int, block_size: int) -> int:
    return -(-length // block_size)


def build_attention_metadata(work: Sequence[SeqWork], block_size: int,
                             device: Union[str, torch.device]) -> AttentionMetadata:
    """The :class:`AttentionMetadata` of ``work`` (already checked by :func:`check_work`), from host
    lists: one host->device copy per tensor, no device read."""
    # array ops over the whole step, one Python iteration per sequence (not per token): a mixed step
    # carries thousands of prompt tokens
    q_lens = np.fromiter((len(w.token_ids) for w in work), dtype=np.int64, count=len(work))
    firsts = np.fromiter((w.start for w in work), dtype=np.int64, count=len(work))
    starts = np.zeros(len(work) + 1, dtype=np.int64)
    np.cumsum(q_lens, out=starts[1:])
    seq_of = np.repeat(np.arange(len(work)), q_lens)
    local = np.arange(int(starts[-1])) - starts[:-1][seq_of]
    positions = firsts[seq_of] + local
    lens = firsts + q_lens
    need = -(-lens // block_size)  # only the blocks positions 0..len-1 need
    tables = np.zeros((len(work), int(need.max())), dtype=np.int64)  # padding is masked (and zeroed) when read
    for i, (w, k) in enumerate(zip(work, need.tolist())):
        tables[i, :k] = w.block_table[:k]
    slots = tables[seq_of, positions // block_size] * block_size + positions % block_size

    def send(values: np.ndarray, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.from_numpy(values).to(dtype).to(device, non_blocking=True)

    return AttentionMetadata(send(positions), send(slots), send(seq_of), send(local), send(tables), send(lens),
                             send(starts[1:] - 1), int(q_lens.max()), send(starts, torch.int32))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _ints_in(values: Sequence, lo: int, hi: int) -> bool:
    """Every value an int (not a bool) in lo..hi-1. The common case (plain ints) costs passes in
    C-level builtins only: a step of 256 sequences checks its tables in well under a millisecond."""
    if not values:
        return True
    if set(map(type, values)) == {int}:  # exactly int: bool and other subclasses go the long way
        return lo <= min(values) and max(values) < hi
    return all(_is_int(x) and lo <= x < hi for x in values)


def _check_one(i: int, w: SeqWork, num_blocks: int, block_size: int, max_positions: int, vocab_size: int) -> None:
    if not isinstance(w.token_ids, (list, tuple)) or not w.token_ids:
        raise ValueError(f"work[{i}]: token_ids must be a non-empty list of ints, got {w.token_ids!r}")
    if not _ints_in(w.token_ids, 0, vocab_size):
        raise ValueError(f"work[{i}]: token ids must be ints in 0..{vocab_size - 1}, got {list(w.token_ids)}")
    if not _is_int(w.start) or w.start < 0:
        raise ValueError(f"work[{i}]: start must be an int >= 0, got {w.start!r}")
    end = w.start + len(w.token_ids)
    if end > max_positions:
        raise ValueError(f"work[{i}]: positions {w.start}..{end - 1} reach past the model's "
                         f"max_position_embeddings ({max_positions}): the last position allowed is {max_positions - 1}")
    need = _blocks_needed(end, block_size)
    if len(w.block_table) < need:
        raise ValueError(f"work[{i}]: block table {list(w.block_table)} has {len(w.block_table)} blocks but "
                         f"positions 0..{end - 1} need {need} of block_size {block_size}")
    if not _ints_in(w.block_table, 0, num_blocks):
        raise ValueError(f"work[{i}]: block table {list(w.block_table)} has ids outside 0..{num_blocks - 1}")


def check_work(work: Sequence[SeqWork], num_blocks: int, block_size: int, max_positions: int,
               vocab_size: int) -> None:
    """Raise ValueError (naming the SeqWork) unless every item can run; reads host values only.

    Refused: an empty batch; empty token_ids or a token id outside the vocabulary; start < 0; a
    position >= max_positions; a block table shorter than start + len needs, or with an id outside
    0..num_blocks-1; two tokens of the batch writing the same cache slot (two sequences given the
    same block for new positions: the second write would silently win). Reading a shared block is
    allowed (prefix sharing); writing one twice is not.
    """
    if not work:
        raise ValueError("empty batch: give at least one SeqWork")
    written: dict[int, int] = {}
    for i, w in enumerate(work):
        _check_one(i, w, num_blocks, block_size, max_positions, vocab_size)
        table, start = w.block_table, w.start
        for p in range(start, start + len(w.token_ids)):
            slot = table[p // block_size] * block_size + p % block_size
            if written.setdefault(slot, i) != i:
                raise ValueError(f"work[{written[slot]}] and work[{i}] both write block "
                                 f"{slot // block_size} offset {slot % block_size}")


def _write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
    """cache.view(num_blocks * block_size, kv_heads, hd)[slot_mapping[t]] = k[t] (nano-vllm's store_kvcache)."""
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, slot_mapping, k)
    v_cache.view(flat_shape).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """[num_seqs, max_blocks * block_size, kv_heads, hd]: each sequence's positions in order, zero past
    its length (padding blocks and the tail of its last block hold stale values, even NaN)."""
    seq = cache[meta.block_tables].flatten(1, 2)
    valid = torch.arange(seq.shape[1], device=seq.device)[None, :] < meta.context_lens[:, None]
    return seq.where(valid[:, :, None, None], seq.new_zeros(()))


def paged_attention(
    q: torch.Tensor,  # [num_tokens, heads, hd], RoPE applied
    k: torch.Tensor,  # [num_tokens, kv_heads, hd], RoPE applied
    v: torch.Tensor,  # [num_tokens, kv_heads, hd]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, hd], one layer's cache, contiguous (written)
    v_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, hd]
    meta: AttentionMetadata,
    backend: str = "torch",
) -> torch.Tensor:
    """Write the new keys and values into their slots, then causal attention over each token's
    sequence: [num_tokens, heads * hd] in q's dtype.

    ``backend`` "torch" (below: gather, mask, SDPA; written for clarity, the CPU's default) or
    "triton" (:func:`~reference.ops.paged_attention.triton_paged_attention`: walks each block table
    up to the sequence's length, ``meta.num_splits`` splits over the KV length; the GPU's default).
    Both compute the same Semantics.

    Semantics (s = token_seq[t], K_s[p] = k_cache[block_tables[s, p // bs], p % bs]):
        k_cache[slot_mapping[t] // bs, slot_mapping[t] % bs] = k[t]        (same for v), then
        out[t, h] = softmax(q[t, h] . K_s[p][h // g] / sqrt(hd) for p <= positions[t]) V_s[p][h // g]
    with g = heads // kv_heads (query head h reads kv head h // g, transformers' ``repeat_kv`` order).
    Positions >= context_lens[s] are never read: masked, and zeroed before the product, so stale or
    NaN values there cannot leak. Tokens are padded into [num_seqs, max_query_len] so each sequence's
    blocks are gathered once, not once per query token.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    _write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if backend == "triton":
        out = triton_paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.query_start_loc,
                                     torch.empty_like(q), meta.max_query_len, meta.num_splits)
        return out.view(q.shape[0], -1)
    keys, values = _gather(k_cache, meta), _gather(v_cache, meta)  # [S, L, kv_heads, hd]
    S, L, kv_heads, hd = keys.shape
    heads, T = q.shape[1], meta.max_query_len
    groups = heads // kv_heads
    qpad = q.new_zeros(S, T, heads, hd)
    qpad[meta.token_seq, meta.token_local] = q
    pos = torch.zeros(S, T, dtype=torch.int64, device=q.device)  # padding queries see position 0 only
    pos[meta.token_seq, meta.token_local] = meta.positions
    # GQA as in static_kv_attention: the `groups` query heads of one kv head become extra query rows
    qg = qpad.view(S, T, kv_heads, groups, hd).permute(0, 2, 3, 1, 4).reshape(S, kv_heads, groups * T, hd)
    visible = torch.arange(L, device=q.device).view(1, 1, 1, L) <= pos.view(S, 1, T, 1)
    mask = visible.repeat(1, 1, groups, 1)  # [S, 1, groups * T, L]
    out = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask)
    out = out.view(S, kv_heads, groups, T, hd).permute(0, 3, 1, 2, 4).reshape(S, T, heads * hd)
    return out[meta.token_seq, meta.token_local]


def _is_wrapped(model: nn.Module) -> bool:
    return any(isinstance(m, LoRALinear) for m in model.modules())


class DecodeGraph(Protocol):
    """What :meth:`ModelRunner.forward` asks of a static decode path
    (:class:`~reference.engine.cuda_graph_runner.PagedDecodeGraphRunner`)."""

    def eager_reason(self, work: Sequence["SeqWork"], uid_to_slot: dict) -> Optional[str]:
        """Why this step must run eagerly, or None when the static path takes it."""

    def run(self, work: Sequence["SeqWork"], uid_to_slot: dict) -> torch.Tensor:
        """The step's logits, [len(work), vocab] float32."""


class ModelRunner:
    """Runs engine steps of a Hugging Face ``LlamaForCausalLM`` over a :class:`PagedKVCache`.

    ``forward(work)`` computes every SeqWork's tokens in one packed forward (work order), writes
    their keys and values into the cache and returns the logits of each SeqWork's LAST token,
    [len(work), vocab] float32. A sequence's tokens must reach the cache in order (its earlier
    positions written by earlier calls, as an engine does).

    Two paths compute a step: the eager one (any work: prefill, chunks, decode, mixed) and, after
    :func:`reference.engine.cuda_graph_runner.enable_graph_decode`, the static-shape decode path of
    :class:`~reference.engine.cuda_graph_runner.PagedDecodeGraphRunner` (a CUDA graph replayed on a
    GPU, the same code called on the CPU) for steps whose every SeqWork computes one token. Both
    give the same logits (tested in fp32 with NaN in every unwritten cache entry).

    Args:
        model: a LlamaForCausalLM, in its dtype and on its device. With a pool: wrapped by
            ``wrap_llama(model, pool, context, backend)`` already, or not yet (then wrapped here, in
            place, with ``backend``). With ``pool=None``: unwrapped, base model only.
        pool, context: the LoRA memory pool and the context the layers read (None, None: base only).
        num_blocks, block_size: the blocks a SeqWork may use (ids 0..num_blocks-1) and their size.
            ``self.kv_cache`` has one block more, ``scratch_block`` (= num_blocks), which only the
            padding rows of graph decode write (``cuda_graph_runner.enable_graph_decode``).
        backend: the LoRA ops, when the runner wraps the model (see ``reference.layers.get_backend``).
        attention_backend: "torch" or "triton" (see :func:`paged_attention`); None: "triton" on
            CUDA, "torch" elsewhere (:func:`default_attention_backend`).
        fused_ops: each layer's residual add and RMSNorm, rotary embedding and SiLU-and-mul as one
            Triton kernel each (:mod:`reference.ops.fused_elementwise`: about thirty launches of a
            layer's torch ops become four) instead of the Hugging Face modules' torch ops; the
            projections (and their LoRA) are the model's own either way. None: on CUDA for a SiLU
            model with a power-of-two head_dim (the CPU interpreter would run them a program at a time).
        packed_projections: with ``fused_ops``, each layer's q|k|v and gate|up as one GEMM each over
            packed weights, and each packed LoRA module as one expand over its slices
            (:func:`reference.layers.pack_projections`; vLLM's ``QKVParallelLinear`` /
            ``MergedColumnParallelLinear``): 7 GEMMs and 7 expands of a layer become 4 and 4. The
            model's q/k/v and gate/up weights become views of the packed ones (same values). A layer
            whose projections cannot be packed (biases, per-projection pool modules, a fused-GEMM
            backend) keeps its separate calls. None: on with ``fused_ops``.
        sort_lora_by_slot: a step with prompt tokens gives the LoRA ops its rows grouped by adapter
            slot (``batch_info_from_requests(sort_by_slot=True)``: one SGMV segment per slot, the
            rows reached through a permutation), as vLLM V1's LoRA kernels take tokens sorted by
            LoRA id; False: one segment per SeqWork, so a mixed step's hundreds of one-token decode
            rows are hundreds of segments, each launching whole row blocks for one row (H100
            profile, engine_packed_h100.json: the expand took 10.7 ms of a 7.7k-token step).
            Off by default here; ``EngineConfig.sort_lora_by_slot`` turns it on (measured there).
            The results are the same either way.
    Raises:
        ValueError: a wrapped model without a pool, a pool without a context, a wrapped model whose
        layers use another backend, cache sizes < 1 (see :class:`PagedKVCache`), an unknown
        attention backend, ``fused_ops`` not None / True / False, or True for a model whose MLP
        activation is not SiLU or whose head_dim is not a power of two (None then keeps the torch ops);
        ``packed_projections`` not None / True / False, or True without ``fused_ops``.
    """

    def __init__(self, model: nn.Module, pool: Optional[LoRAMemoryPool], context: Optional[LoRAContext],
                 num_blocks: int, block_size: int, backend: Union[str, LoRABackend] = "torch",
                 attention_backend: Optional[str] = None, fused_ops: Optional[bool] = None,
                 packed_projections: Optional[bool] = None, sort_lora_by_slot: bool = False) -> None:
        self._check_lora_setup(model, pool, context, get_backend(backend))
        device = model.get_input_embeddings().weight.device
        self.attention_backend = default_attention_backend(device) if attention_backend is None else attention_backend
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS} or None, got {attention_backend!r}")
        if fused_ops not in (None, True, False):
            raise ValueError(f"fused_ops must be None, True or False, got {fused_ops!r}")
        act = getattr(model.config, "hidden_act", None)
        head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        # what the kernels compute: SiLU-and-mul, and rope over two halves of a power-of-two head_dim
        unfit = ([f"the MLP's activation is {act!r}, not SiLU"] if act not in ("silu", "swish") else []) + \
            ([f"head_dim {head_dim} is not a power of two"] if head_dim < 2 or head_dim & (head_dim - 1) else [])
        if fused_ops and unfit:
            raise ValueError(f"fused_ops cannot run this model: {'; '.join(unfit)}")
        self.fused_ops = (device.type == "cuda" and not unfit) if fused_ops is None else fused_ops
        if not any(packed_projections is v for v in (None, True, False)):  # 1 == True, but is not a flag
            raise ValueError(f"packed_projections must be None, True or False, got {packed_projections!r}")
        if packed_projections and not self.fused_ops:
            raise ValueError("packed_projections runs in the fused decoder: it needs fused_ops")
        packed = self.fused_ops if packed_projections is None else packed_projections
        if not any(sort_lora_by_slot is v for v in (True, False)):
            raise ValueError(f"sort_lora_by_slot must be True or False, got {sort_lora_by_slot!r}")
        self.sort_lora_by_slot = sort_lora_by_slot
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
        if pool is not None and not _is_wrapped(model):
            wrap_llama(model, pool, context, backend)
        self.model, self.pool, self.context = model, pool, context
        layers = model.model.layers
        # per layer (q|k|v, gate|up): a PackedProjection, or None where that layer's parts cannot pack
        self.packed: list[tuple] = [
            (pack_projections([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj]),
             pack_projections([l.mlp.gate_proj, l.mlp.up_proj])) if packed else (None, None) for l in layers]
        self.packed_projections = any(p is not None for pair in self.packed for p in pair)
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        # one block more than the work may use: the scratch block that padding rows of a graph-decode
        # batch write and read (chapter 08's scratch row), so padding never touches a sequence's blocks
        self.kv_cache = PagedKVCache.for_model(model, num_blocks + 1, block_size)
        self.num_blocks, self.scratch_block = num_blocks, num_blocks
        self.num_kv_heads, self.head_dim = self.kv_cache.k.shape[3], self.kv_cache.k.shape[4]
        self.max_positions, self.vocab_size = cfg.max_position_embeddings, cfg.vocab_size
        self.device = model.get_input_embeddings().weight.device
        # set by cuda_graph_runner.enable_graph_decode: the graph runner builds on this class, so this
        # one knows it only as the two calls forward makes
        self.graph_runner: Optional[DecodeGraph] = None

    @staticmethod
    def _check_lora_setup(model: nn.Module, pool, context, backend: LoRABackend) -> None:
        if pool is None:
            if _is_wrapped(model):
                raise ValueError("the model has LoRA layers but no pool was given: pass its pool and context")
            return
        if context is None:
            raise ValueError("a pool needs the LoRAContext its layers read (or that wrap_llama will give them)")
        names = {m.backend.name for m in model.modules() if isinstance(m, LoRALinear)}
        if names and names != {backend.name}:
            raise ValueError(f"the model's LoRA layers use backend {sorted(names)}, not {backend.name!r}")

    def forward(self, work: Sequence[SeqWork], running: Sequence[Hashable] = (), check: bool = True,
                input_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [len(work), vocab] float32 of each SeqWork's last token (see the class docstring).

        ``running``: uids of sequences that run but compute nothing this step (an engine's decoding
        sequences during a prefill step); the pool keeps them resident beside the batch's own.
        The pool is prepared once per step (``prepare_lora_batch``), whichever path then runs it.

        Everything that can fail is checked first, so a ValueError leaves the cache (and the pool)
        unchanged. ``check=False`` skips :func:`check_work` for a caller whose work is valid by
        construction: the engine's own step (prompts checked when added, tables from its block
        manager, every invariant tested), as vLLM's and SGLang's model runners trust their
        schedulers. That pass was the largest item of a 256-sequence decode step's host time (about
        30% of it, cProfile, CPU, GPU work stubbed out). A learner's step keeps the check.
        ``input_ids``: int64 [len(work)] on the device, one token per SeqWork (a decode step), used
        instead of the SeqWorks' ``token_ids`` (which the host does not know yet): the engine's
        overlapped decode feeds step N's sampled tokens to step N+1 without reading them
        (``EngineConfig.overlap_decode``; SGLang's overlap scheduler does the same). Not checked.
        Raises:
            ValueError: see :func:`check_work` (with ``check``); an adapter uid without a pool; from
            ``pool.prepare_lora_batch`` (an unknown uid, more distinct uids than slots).
        """
        work = list(work)
        if check:
            check_work(work, self.num_blocks, self.kv_cache.block_size, self.max_positions, self.vocab_size)
        with torch.inference_mode():
            uid_to_slot = self._prepare_adapters(work, running)
            graph = self.graph_runner
            if graph is not None and graph.eager_reason(work, uid_to_slot) is None:
                return graph.run(work, uid_to_slot, input_ids=input_ids)
            self._set_lora_batch(work, uid_to_slot)
            meta = self.split_decode(build_attention_metadata(work, self.kv_cache.block_size, self.device),
                                     max(w.start + len(w.token_ids) for w in work))
            ids = (torch.tensor([t for w in work for t in w.token_ids], dtype=torch.int64).to(self.device)
                   if input_ids is None else input_ids)
            return self.run_model(ids, meta)

    __call__ = forward

    def split_decode(self, meta: AttentionMetadata, max_context: int) -> AttentionMetadata:
        """``meta`` with the Triton kernel's KV splits for a decode step (one query per sequence):
        :func:`~reference.ops.paged_attention.choose_num_splits` from host ints; other steps, and
        the torch backend, keep 1 (a prefill's query tiles fill the GPU on their own)."""
        if self.attention_backend != "triton" or meta.max_query_len != 1:
            return meta
        splits = choose_num_splits(len(meta.context_lens), self.num_kv_heads, max_context, self.num_sms)
        return meta._replace(num_splits=splits)

    def _prepare_adapters(self, work: list[SeqWork], running: Sequence[Hashable]) -> dict:
        """Make the batch's adapters resident (``running``'s kept too): {uid: slot}; {} without a pool."""
        uids = [w.uid for w in work]
        if self.pool is None:
            if any(u is not None for u in uids):
                raise ValueError(f"adapter uids {sorted({repr(u) for u in uids if u is not None})} but the "
                                 "runner has no pool (base model only)")
            return {}
        return self.pool.prepare_lora_batch(list(dict.fromkeys(uids)), running=running)

    def _set_lora_batch(self, work: list[SeqWork], uid_to_slot: dict) -> None:
        """Give the layers the batch's LoRABatchInfo, built from host lists only: one segment per
        SeqWork, or, with ``sort_lora_by_slot`` and a step holding a prompt chunk, the rows grouped
        by slot (a decode step keeps one segment per sequence: the BGMV ops read ``token_slots``)."""
        if self.pool is None:
            return
        sort = self.sort_lora_by_slot and any(len(w.token_ids) > 1 for w in work)
        info = batch_info_from_requests([w.uid for w in work], [len(w.token_ids) for w in work], uid_to_slot,
                                        self.pool.lora_ranks_host, self.pool.scalings_host, self.device,
                                        sort_by_slot=sort)
        self.context.set_batch(info)

    def run_model(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embed -> decoder layers (paged attention) -> final norm -> lm_head over the flat token
        stream ``ids`` [num_tokens] int64: logits [len(meta.last_token), vocab] float32 of the rows
        ``meta.last_token``. The LoRA batch info must be set on the context already. Reads no host
        value of a tensor, so it can be captured when ``meta``'s tensors are static buffers."""
        h = self._decoder(ids, meta)  # [num_tokens, hidden]
        return self.model.lm_head(self.model.model.norm(h[meta.last_token])).float()

    def _decoder(self, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """embed -> decoder layers (paged attention) over the flat token stream: [num_tokens, hidden]."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        # HF's rotary embedding takes position_ids [batch, seq] (transformers 5.17 indexes
        # position_ids[:, None, :]; a flat [num_tokens] raised there): one batch row of the stream
        cos, sin = inner.rotary_emb(h[None], meta.positions[None])  # [1, num_tokens, hd]
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [num_tokens, 1, hd]: broadcast over heads
        if self.fused_ops:
            return self._fused_decoder(h, cos, sin, meta)
        for i, layer in enumerate(inner.layers):
            h = h + self._attention(layer.self_attn, layer.input_layernorm(h), cos, sin, i, meta)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return h

    def _fused_decoder(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        """The layers of :meth:`_decoder` with the fused kernels: each sublayer's output is added to the
        residual stream by the next RMSNorm's kernel (vLLM's fused_add_rms_norm), so a layer runs
        norm, projections, rope, attention, o_proj, norm, gate / up, SiLU-and-mul, down."""
        out, residual = h, None
        for i, layer in enumerate(self.model.model.layers):
            ln = layer.input_layernorm
            x, residual = rms_norm(out, ln.weight, ln.variance_epsilon, residual)
            out = self._attention(layer.self_attn, x, cos, sin, i, meta)
            ln, mlp = layer.post_attention_layernorm, layer.mlp
            x, residual = rms_norm(out, ln.weight, ln.variance_epsilon, residual)
            gate_up = self.packed[i][1]
            if gate_up is not None:
                gu = gate_up(x)  # [N, 2 * intermediate]: two column views, no copy
                half = gu.shape[1] // 2
                out = mlp.down_proj(silu_and_mul(gu[:, :half], gu[:, half:]))
            else:
                out = mlp.down_proj(silu_and_mul(mlp.gate_proj(x), mlp.up_proj(x)))
        return out + residual

    def _attention(self, attn: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                   meta: AttentionMetadata) -> torch.Tensor:
        N = x.shape[0]
        qkv = self.packed[layer][0]
        if qkv is not None:  # one GEMM; q, k, v are column views of its output (strided rows)
            y = qkv(x)
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k = rotary_embedding(y[:, :nq].view(N, self.num_heads, self.head_dim),
                                    y[:, nq:nq + nkv].view(N, self.num_kv_heads, self.head_dim), cos, sin)
            v = y[:, nq + nkv:].view(N, self.num_kv_heads, self.head_dim)
        elif self.fused_ops:
            q, k = rotary_embedding(attn.q_proj(x).view(N, self.num_heads, self.head_dim),
                                    attn.k_proj(x).view(N, self.num_kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(x).view(N, self.num_kv_heads, self.head_dim)
        else:
            q = apply_rope(attn.q_proj(x).view(N, self.num_heads, self.head_dim), cos, sin)
            k = apply_rope(attn.k_proj(x).view(N, self.num_kv_heads, self.head_dim), cos, sin)
            v = attn.v_proj(x).view(N, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, self.kv_cache.k[layer], self.kv_cache.v[layer], meta, self.attention_backend)
        return attn.o_proj(out)


_MASK64 = (1 << 64) - 1


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic on negative values)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele et al., OOPSLA 2014) on int64, wrapping: a counter-based hash."""
    x = x ^ _srl(x, 30)
    x = x * _signed64(0xBF58476D1CE4E5B9)
    x = x ^ _srl(x, 27)
    x = x * _signed64(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def _staged(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on ``device`` without waiting for the stream: on CUDA through pinned memory with a
    non-blocking copy (a copy from pageable memory waits for the stream's earlier work, which would
    stall the engine's overlapped decode behind the step in flight); torch's pinned-memory cache
    keeps the buffer until the copy has run."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def sample_batch(logits: torch.Tensor, temperatures: Sequence[float], seeds: Sequence[int],
                 counters: Sequence[int], top_ks: Optional[Sequence[int]] = None,
                 top_ps: Optional[Sequence[float]] = None,
                 banned: Optional[Sequence[Sequence[int]]] = None) -> torch.Tensor:
    """One next token per row of logits [n, vocab], greedy or seeded, in one pass on logits' device:
    int64 [n]. Rows with temperature 0 take the argmax (ties to the lowest id); a row with
    temperature T > 0 draws from softmax(logits / T) by the Gumbel-max trick, its noise a hash of
    (seed, counter, token id), so a request's draw depends on its own seed and how many tokens it
    has drawn (``counters``), never on its batch or row (vLLM's per-request seeded generators give
    the same guarantee with one generator per request; a counter-based hash does it for the whole
    batch at once: Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011).

    Semantics, per row i (``top_ks``/``top_ps``/``banned``: None = off for every row):
        z = logits[i] with z[banned[i]] = -inf          (min_tokens: stop tokens not yet allowed)
        T == 0:  argmax(z)
        T > 0:   z = z / T, then -inf outside the top_ks[i] largest (0: none dropped) and outside
                 the smallest set of largest tokens whose softmax(z) mass reaches top_ps[i] (vLLM's
                 order: temperature, top-k, top-p); argmax(z + G[i]), G[i, v] = -log(-log(U(seed_i,
                 counter_i, v))), U uniform in (0, 1) from SplitMix64 of the three
    A row of logits that is not finite gives whatever argmax gives: the caller checks
    (``LLM`` fails that request alone). Host lists only: nothing on the host reads the device.
    Raises ValueError for lengths that differ from the number of rows, or a negative or
    non-finite temperature.
    """
    n, vocab = logits.shape
    if not len(temperatures) == len(seeds) == len(counters) == n:
        raise ValueError(f"{n} rows but {len(temperatures)} temperatures, {len(seeds)} seeds, {len(counters)} counters")
    if any(len(x) != n for x in (top_ks, top_ps, banned) if x is not None):
        raise ValueError(f"{n} rows but top_ks, top_ps or banned of another length")
    if any(not (0 <= t < float("inf")) for t in temperatures):
        raise ValueError(f"temperatures must be finite and >= 0, got {list(temperatures)}")
    dev = logits.device
    if banned is not None and any(banned):
        rows = [i for i, b in enumerate(banned) for _ in b]
        cols = [t for b in banned for t in b]
        logits = logits.index_put((_staged(rows, torch.int64, dev), _staged(cols, torch.int64, dev)),
                                  torch.tensor(float("-inf"), dtype=logits.dtype, device=dev))
    if all(t == 0 for t in temperatures):
        return logits.argmax(dim=-1)
    temp = _staged([t if t > 0 else 1.0 for t in temperatures], torch.float64, dev)
    keys = _staged([_signed64(s * 0x9E3779B97F4A7C15 + c) for s, c in zip(seeds, counters)], torch.int64, dev)
    hot = _staged([t > 0 for t in temperatures], torch.bool, dev)
    z = logits.double() / temp[:, None]
    if top_ks is not None and any(0 < k < vocab for k in top_ks):
        k_max = max(k for k in top_ks if 0 < k < vocab)
        kth = _staged([min(k, k_max) - 1 if 0 < k < vocab else k_max - 1 for k in top_ks], torch.int64, dev)
        cut = z.topk(k_max, dim=-1).values.gather(1, kth[:, None])
        off = _staged([not 0 < k < vocab for k in top_ks], torch.bool, dev)
        z = torch.where(off[:, None] | (z >= cut), z, float("-inf"))
    if top_ps is not None and any(p < 1 for p in top_ps):
        p = _staged(list(top_ps), torch.float64, dev)
        sorted_z, order = z.sort(dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the tokens ranked above each one
        drop = (before >= p[:, None]) & (p[:, None] < 1)  # the first token always stays
        z = z.scatter(1, order, sorted_z.masked_fill(drop, float("-inf")))
    bits = _splitmix64(_splitmix64(keys[:, None]) ^ torch.arange(vocab, device=dev, dtype=torch.int64)[None, :])
    u = (_srl(bits, 11).double() + 0.5) * 2.0 ** -53  # (0, 1): never log(0)
    scores = z - torch.log(-torch.log(u))
    return torch.where(hot, scores.argmax(dim=-1), logits.argmax(dim=-1))


def sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Next tokens from logits [vocab] or [n, vocab]: int64 of shape logits.shape[:-1].

    Semantics:
        temperature == 0:  argmax(logits, -1)  (greedy; ties go to the lowest id, as torch.argmax)
        temperature > 0:   one draw from softmax(logits.float() / temperature), with ``generator``
                           (a seeded torch.Generator on logits' device makes it reproducible)
    Raises:
        ValueError: a negative or non-finite temperature; logits that are not 1-D or 2-D.
    """
    if logits.dim() not in (1, 2):
        raise ValueError(f"logits must be [vocab] or [n, vocab], got shape {list(logits.shape)}")
    if not (isinstance(temperature, (int, float)) and 0 <= temperature < float("inf")):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    draws = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator)
    return draws.reshape(logits.shape[:-1])
