"""Tensor-parallel multi-LoRA: sharding the slot buffers, the per-rank forward and its collectives.

Sources: S-LoRA (Sheng et al., 2023, section 6: "tensor parallelism for LoRA", the partition that
adds only small collectives); vLLM ``vllm/lora/layers/column_parallel_linear.py`` and
``row_parallel_linear.py`` (``ColumnParallelLinearWithLoRA``, ``MergedQKVParallelLinearWithLoRA``,
``RowParallelLinearWithLoRA``, the ``fully_sharded_loras`` option) and
``vllm/lora/fully_sharded_layers.py``; SGLang ``python/sglang/srt/lora/layers.py``
(``slice_lora_a_weights`` / ``slice_lora_b_weights`` per layer kind); TensorRT-LLM's LoRA loader, which
reorders a fused qkv LoRA into rank-major order [q_r0, k_r0, v_r0, ..., q_rN, k_rN, v_rN].

A layer y = x W^T is split over ``tp`` ranks in one of two ways (Megatron-LM's):
    column-parallel (q, k, v, gate, up):  W's output rows split; rank j computes y[:, cols_j] from all of x
    row-parallel    (o, down):            W's input columns split; rank j computes x[:, in_j] W[:, in_j]^T,
                                          a partial sum of the full y, and the ranks all-reduce it.
The LoRA delta s (x A^T) B^T follows the base layer's split. Variants (``VARIANTS``) and what LoRA adds
to the base layer's own communication, for T tokens, a pool of max rank R, stack_num parts:
    column "replicated_A":   A whole, B split on its output rows.             nothing
    column "fully_sharded":  A split along the rank (R/tp rows per part),     all-gather of the shrink
                             B split on its output rows (all R columns).      output: T x stack*R
    row "reduce_shrink":     A split on its input columns, B whole;           all-reduce of the shrink
                             sum_j x_j A_j^T = x A^T (linearity), then        output: T x stack*R
                             expand on every rank after the base all-reduce.
    row "reduce_with_base":  A split on its input columns, B whole; each      nothing (the delta rides
                             rank adds its partial delta (x_j A_j^T) B^T      the base layer's all-reduce
                             into its partial base output before the base     of T x out)
                             layer's all-reduce.
The two row variants do the same work per rank (each rank expands a [T, stack*R] shrink output with
the whole B over all ``out`` columns); they differ in when the delta is added: "reduce_shrink" pays
one more collective, small but latency-bound (a separate launch and synchronization per layer), and
leaves the base layer untouched; "reduce_with_base" sends nothing extra but must add the delta
before the base layer's all-reduce, so the LoRA path sits inside the base layer's forward.

Packed projections (qkv, gate_up) are split per part: each rank takes its heads of q, of k and of v
(``column_part_ranges``), so a rank's B is [q_j; k_j; v_j] and its slice offsets are the local widths.
Under GQA with fewer kv heads than ranks each kv head is replicated: rank j takes kv head
``j // (tp / num_kv_heads)`` (vLLM's ``num_kv_head_replicas``), so two ranks hold the same k and v rows.

Rank padding with the fully sharded variant (our choice, stated because the pool packs parts at each
adapter's own rank r while the split must be the same for every slot): shard the PADDED max rank R.
Every rank holds R/tp rows of every part of every slot: rank j holds rank-rows [j*R/tp, (j+1)*R/tp) of
each part, re-laid at stride R/tp (part i at local rows [i*R/tp, (i+1)*R/tp)), with zeros where the
adapter's rank r does not reach. Running example, R 16, tp 2, an adapter of rank 4: rank 0 holds its 4
rows of each part (and 4 zero rows), rank 1 holds 8 zero rows. All ranks compute R/tp columns per part
(``lora_ranks`` read as R/tp for every active slot), so shapes and work agree across ranks, and the
gathered shrink output, reordered part-major, is the unsharded one zero-padded to R per part; the
expand then reads all R columns of B, whose columns [r, R) are zero. The padding costs FLOPs (an
adapter of rank 4 is computed at 16) and gathered bytes (T x stack*R, not T x stack*r), as a padded
pool does anyway; S-LoRA's unified paging avoids it with per-adapter offsets instead.

Processes: ``spawn_ranks`` runs a function in ``world_size`` processes (torch.multiprocessing.spawn),
one code path for gloo (CPU tensors) and NCCL (one GPU per rank), and returns every rank's result to
the parent through files of tensors (no pickles of objects), so a notebook can call it from a script.
"""
from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from reference.batch_info import LoRABatchInfo
from reference.layers import LoRABackend, get_backend, uses_token_slots
from reference.mem_pool import ModuleSpec
from reference.packed import slice_offsets_for

__all__ = [
    "VARIANTS",
    "TPLayout",
    "LoRAShard",
    "TPModelConfig",
    "CollectiveLog",
    "column_part_ranges",
    "row_in_range",
    "take_rows",
    "interleave_packed",
    "shard_base_weight",
    "shard_pool_buffers",
    "shard_lora_weights",
    "tp_lora_linear",
    "lora_comm_bytes",
    "ring_bytes_per_rank",
    "garbled_column_rule",
    "tp_unavailable_reason",
    "tp_device",
    "spawn_ranks",
    "fully_sharded_A",
    "row_parallel_lora",
    "fully_sharded_column_lora",
]

#: The variants of each parallel kind (see the module docstring for what each communicates).
VARIANTS = {"column": ("replicated_A", "fully_sharded"), "row": ("reduce_shrink", "reduce_with_base")}


# ---- which rows / columns a rank owns -------------------------------------------------------------
def column_part_ranges(out_features: Sequence[int], units: Sequence[int], tp_rank: int,
                       tp_size: int) -> tuple[tuple[int, int], ...]:
    """Rows [lo, hi) of the packed (global) output that ``tp_rank`` owns, one range per part.

    Part i has ``out_features[i]`` rows made of ``units[i]`` heads (or columns), each
    ``out_features[i] // units[i]`` rows wide (the head width). With at least
    as many heads as ranks each rank takes a contiguous ``units[i] / tp`` of them; with fewer (GQA kv
    heads below tp) each head is replicated on ``tp / units[i]`` ranks and rank j takes head
    ``j // (tp / units[i])``.
    Example, (q, k, v) = (16, 8, 8) with heads (4, 2, 2), tp 2, rank 1 -> ((8, 16), (20, 24), (28, 32));
    heads (4, 1, 1) with out_features (16, 4, 4), tp 2, rank 1 -> ((8, 16), (16, 20), (20, 24)).
    Raises:
        ValueError: lengths differ; a part's rows not a multiple of its heads; heads and tp where neither
        divides the other; tp_rank outside 0..tp_size-1.
    """
    if len(out_features) != len(units):
        raise ValueError(f"{len(out_features)} out_features but {len(units)} unit counts")
    _check_rank(tp_rank, tp_size)
    offsets, ranges = slice_offsets_for(out_features), []
    for i, (rows, n) in enumerate(zip(out_features, units)):
        if n < 1 or rows % n:
            raise ValueError(f"part {i}: {rows} rows are not a multiple of its {n} heads")
        if n >= tp_size and n % tp_size == 0:
            per, first = n // tp_size, tp_rank * (n // tp_size)
        elif n < tp_size and tp_size % n == 0:
            per, first = 1, tp_rank // (tp_size // n)  # replicated: tp/n ranks share this head
        else:
            raise ValueError(f"part {i}: {n} heads cannot be split over {tp_size} ranks (neither divides the other)")
        head_width = rows // n
        lo = offsets[i] + first * head_width
        ranges.append((lo, lo + per * head_width))
    return tuple(ranges)


def row_in_range(in_features: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """Input columns [lo, hi) of a row-parallel layer that ``tp_rank`` owns: in 16, tp 2, rank 1 -> (8, 16).

    Raises ValueError if in_features is not divisible by tp_size or tp_rank is out of range.
    """
    _check_rank(tp_rank, tp_size)
    if in_features % tp_size:
        raise ValueError(f"in_features {in_features} is not divisible by tp_size {tp_size}")
    w = in_features // tp_size
    return tp_rank * w, (tp_rank + 1) * w


def _check_rank(tp_rank: int, tp_size: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside 0..{tp_size - 1} (tp_size {tp_size})")


def take_rows(t: torch.Tensor, ranges: Sequence[tuple[int, int]], dim: int = 0) -> torch.Tensor:
    """The concatenation of ``t``'s index ranges along ``dim``: a rank's rows of a packed weight."""
    return torch.cat([t.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim=dim)


@dataclass(frozen=True)
class TPLayout:
    """How one pool module is split over ``tp_size`` ranks.

    ``units`` (column-parallel only): heads per part, e.g. (32, 8, 8) for a GQA qkv; default: every
    output column is a unit (plain layers, gate, up). Raises ValueError (at construction) for an
    unknown ``parallel`` kind, units of the wrong length, or sizes that do not split.
    """

    spec: ModuleSpec
    parallel: str  # "column" | "row"
    tp_size: int
    units: Optional[tuple[int, ...]] = None  # per part: heads the part's output is split by

    def __post_init__(self) -> None:
        if self.parallel not in VARIANTS:
            raise ValueError(f"parallel must be 'column' or 'row', got {self.parallel!r}")
        if self.units is None:
            object.__setattr__(self, "units", tuple(self.spec.out_features))
        for j in range(self.tp_size):  # raises on any size that does not split
            self.part_ranges(j) if self.parallel == "column" else row_in_range(self.spec.in_features, j, self.tp_size)

    def part_ranges(self, tp_rank: int) -> tuple[tuple[int, int], ...]:
        """Global packed-output rows of each part that ``tp_rank`` owns (all rows for row-parallel)."""
        if self.parallel == "row":
            _check_rank(tp_rank, self.tp_size)
            return tuple(zip(self.spec.slice_offsets[:-1], self.spec.slice_offsets[1:]))
        return column_part_ranges(self.spec.out_features, self.units, tp_rank, self.tp_size)

    def local_out_features(self, tp_rank: int) -> tuple[int, ...]:
        """Per-part output widths on ``tp_rank``: (16, 8, 8) at tp 2 -> (8, 4, 4)."""
        return tuple(hi - lo for lo, hi in self.part_ranges(tp_rank))

    def in_range(self, tp_rank: int) -> tuple[int, int]:
        """Input columns of x that ``tp_rank`` reads (all of them for column-parallel)."""
        if self.parallel == "column":
            _check_rank(tp_rank, self.tp_size)
            return 0, self.spec.in_features
        return row_in_range(self.spec.in_features, tp_rank, self.tp_size)


def interleave_packed(W: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """A packed weight reordered rank-major (TensorRT-LLM's fused LoRA order), so rank j's rows are block j.

    Semantics:
        out = cat_j cat_i W[part_ranges(j)[i]]        ([q_r0, k_r0, v_r0, q_r1, k_r1, v_r1, ...])
    Works on any tensor whose dim 0 is the packed output (a LoRA B [out_total, r] or a base weight
    [out_total, in]). With kv-head replication the replicated rows appear once per rank, so the
    result has tp * sum(local_out_features) rows, possibly more than W.
    """
    return torch.cat([take_rows(W, layout.part_ranges(j)) for j in range(layout.tp_size)], dim=0)


def shard_base_weight(W: torch.Tensor, layout: TPLayout, tp_rank: int) -> torch.Tensor:
    """The rank's shard of a base weight W [out_total, in]: its output rows (column) or input columns (row)."""
    if layout.parallel == "column":
        return take_rows(W, layout.part_ranges(tp_rank))
    lo, hi = layout.in_range(tp_rank)
    return W[:, lo:hi].clone()


# ---- sharding the LoRA buffers ------------------------------------------------------------------
@dataclass
class LoRAShard:
    """One rank's LoRA buffers of one module of one layer, and how to run them.

    A's row width per part is ``max_rank`` except in the fully sharded variant (``max_rank // tp``,
    re-laid at that stride, see the module docstring).
    """

    variant: str  # one of VARIANTS[layout.parallel]
    A: torch.Tensor  # [num_slots, stack_num * rows_per_part, in_local]
    B: torch.Tensor  # [num_slots, out_local, max_rank]
    stack_num: int
    slice_offsets: tuple[int, ...]  # local output offsets of the parts, host ints
    max_rank: int
    tp_rank: int
    tp_size: int


def _fully_sharded_A(A: torch.Tensor, lora_ranks: Sequence[int], stack_num: int, max_rank: int,
                     tp_rank: int, tp_size: int) -> torch.Tensor:
    """[slots, stack*R/tp, in]: part i's rank-rows [j*R/tp, (j+1)*R/tp) ∩ [0, r) at local rows i*R/tp + ..."""
    width = max_rank // tp_size
    out = A.new_zeros(A.shape[0], stack_num * width, A.shape[2])
    lo = tp_rank * width
    for slot, r in enumerate(lora_ranks):
        hi = min(lo + width, r)  # this rank's rank-rows of the slot's adapter (none when r <= lo)
        for i in range(stack_num if hi > lo else 0):
            out[slot, i * width:i * width + hi - lo] = A[slot, i * r + lo:i * r + hi]  # pool packs at r
    return out


def _zero_past_rank(B: torch.Tensor, lora_ranks: Sequence[int]) -> torch.Tensor:
    """B with columns [r, max_rank) of each slot zeroed: the fully sharded expand reads all of them."""
    for slot, r in enumerate(lora_ranks):
        B[slot, :, r:] = 0
    return B


def shard_pool_buffers(
    A_buffer: torch.Tensor,  # [num_slots, stack_num * max_rank, in], one layer of a pool module
    B_buffer: torch.Tensor,  # [num_slots, out_total, max_rank]
    lora_ranks: Sequence[int],  # [num_slots] host ints (pool.lora_ranks_host)
    layout: TPLayout,
    variant: str,
    tp_rank: int,
) -> LoRAShard:
    """A rank's shard of every slot of one pool module (new tensors; the pool is not modified).

    Semantics (rows(j) = layout.part_ranges(j), in(j) = layout.in_range(j)):
        column "replicated_A":   A_loc = A;                      B_loc = B[:, rows(j)]
        column "fully_sharded":  A_loc = rank-rows j of the padded R per part (module docstring);
                                 B_loc = B[:, rows(j)] with columns [r, R) of each slot zeroed
        row (either variant):    A_loc = A[:, :, in(j)];         B_loc = B
    Raises:
        ValueError: an unknown variant for the layout's kind; buffer shapes that disagree with the
        layout's module; fully sharded with max_rank not divisible by tp_size; a rank above max_rank.
    """
    if variant not in VARIANTS[layout.parallel]:
        raise ValueError(f"variant {variant!r} is not one of {VARIANTS[layout.parallel]} ({layout.parallel}-parallel)")
    spec, max_rank = layout.spec, B_buffer.shape[2]
    if A_buffer.shape[1:] != (spec.stack_num * max_rank, spec.in_features) or B_buffer.shape[1] != spec.out_total:
        raise ValueError(f"{spec.name}: buffers A {list(A_buffer.shape)} / B {list(B_buffer.shape)} do not match "
                         f"the module ({spec.stack_num} parts, in {spec.in_features}, out {spec.out_total})")
    if len(lora_ranks) != A_buffer.shape[0] or any(not 0 <= r <= max_rank for r in lora_ranks):
        raise ValueError(f"lora_ranks {list(lora_ranks)}: one per slot, each in 0..{max_rank}")
    A, B = A_buffer, take_rows(B_buffer, layout.part_ranges(tp_rank), dim=1)
    if variant == "fully_sharded":
        if max_rank % layout.tp_size:
            raise ValueError(f"fully sharded LoRA splits the padded max rank {max_rank}: it must be divisible "
                             f"by tp_size {layout.tp_size}")
        A = _fully_sharded_A(A_buffer, lora_ranks, spec.stack_num, max_rank, tp_rank, layout.tp_size)
        B = _zero_past_rank(B, lora_ranks)
    elif layout.parallel == "row":
        lo, hi = layout.in_range(tp_rank)
        A = A_buffer[:, :, lo:hi]
    return LoRAShard(variant, A.clone(), B, spec.stack_num, slice_offsets_for(layout.local_out_features(tp_rank)),
                     max_rank, tp_rank, layout.tp_size)


def shard_lora_weights(A: torch.Tensor, B: torch.Tensor, layout: TPLayout, variant: str, tp_rank: int,
                       max_rank: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's shard: A [stack*r, in], B [out_total, r] (the pool's packed layout at rank r).

    The same split as :func:`shard_pool_buffers` for a one-slot pool of ``max_rank`` (default r).
    Returns (A_loc [stack * rows_per_part, in_local], B_loc [out_local, max_rank]); B is padded to
    max_rank with zero columns (rows_per_part = max_rank, or max_rank // tp when fully sharded).
    Raises ValueError as shard_pool_buffers does, and if r exceeds max_rank.
    """
    stack, r = layout.spec.stack_num, B.shape[1]
    R = r if max_rank is None else max_rank
    if r > R or A.shape[0] != stack * r:
        raise ValueError(f"A {list(A.shape)} / B {list(B.shape)}: expected A [{stack}*r, in], B [out, r], r <= {R}")
    A_pool = A.new_zeros(1, stack * R, A.shape[1])
    A_pool[0, :stack * r] = A
    B_pool = B.new_zeros(1, B.shape[0], R)
    B_pool[0, :, :r] = B
    shard = shard_pool_buffers(A_pool, B_pool, [r], layout, variant, tp_rank)
    return shard.A[0], shard.B[0]


# ---- the per-rank forward -------------------------------------------------------------------------
def _ops(backend: LoRABackend, info: LoRABatchInfo) -> tuple[Callable, Callable]:
    """BGMV for decode batches when the backend has it, SGMV otherwise (as LoRALinear chooses)."""
    if backend.decode_shrink is not None and uses_token_slots(info):
        return backend.decode_shrink, backend.decode_expand
    return backend.shrink, backend.expand


def _with_width(info: LoRABatchInfo, width: int) -> LoRABatchInfo:
    """The batch info with every active slot's rank read as ``width`` (computed on the device: no sync)."""
    ranks = torch.where(info.lora_ranks > 0, width, 0).to(info.lora_ranks.dtype)
    return replace(info, lora_ranks=ranks)


def _shrink(x: torch.Tensor, A: torch.Tensor, info: LoRABatchInfo, stack_num: int, shrink: Callable) -> torch.Tensor:
    # zeros, not empty: the collectives move every column, and undefined ones must not carry NaN junk
    t = x.new_zeros(x.shape[0], A.shape[1])
    return shrink(x, A, info, t, stack_num=stack_num)


def _gather_shrink(t_local: torch.Tensor, shard: LoRAShard, group) -> torch.Tensor:
    """[T, stack*R/tp] per rank -> [T, stack*R], part-major: part i = cat_j rank j's columns of part i."""
    pieces = [torch.empty_like(t_local) for _ in range(shard.tp_size)]
    dist.all_gather(pieces, t_local.contiguous(), group=group)
    T, width = t_local.shape[0], shard.max_rank // shard.tp_size
    stacked = torch.stack(pieces).view(shard.tp_size, T, shard.stack_num, width)
    return stacked.permute(1, 2, 0, 3).reshape(T, shard.stack_num * shard.max_rank)


def tp_lora_linear(
    x: torch.Tensor,  # [T, in] (column) or [T, in_local] (row): this rank's input
    base: Callable[[torch.Tensor], torch.Tensor],  # the rank's base shard, without any collective
    shard: LoRAShard,
    batch_info: LoRABatchInfo,  # the same on every rank (the whole batch's tokens)
    group: Optional[dist.ProcessGroup] = None,  # None: the default group
    backend: Union[str, LoRABackend] = "torch",
) -> torch.Tensor:
    """One rank's forward of a tensor-parallel LoRA linear layer, with its collectives.

    Semantics (y_j = base(x) on rank j; t = shrink output; expand adds scalings[s] * t B^T in place):
        "replicated_A":     y_j += expand(shrink(x, A), B_j)                  -> [T, out_local]
        "fully_sharded":    t_j = shrink(x, A_j) at width R/tp; t = all_gather(t_j), part-major;
                            y_j += expand(t, B_j) at width R                  -> [T, out_local]
        "reduce_shrink":    y = all_reduce(y_j); t = all_reduce(shrink(x_j, A_j)); y += expand(t, B)
                                                                              -> [T, out]
        "reduce_with_base": y_j += expand(shrink(x_j, A_j), B); y = all_reduce(y_j)   -> [T, out]
    Column outputs stay sharded (the attention and the MLP consume them per rank: no base gather);
    row outputs are the full, reduced output on every rank. A batch without an active adapter skips
    the LoRA collectives on every rank alike (``has_active_lora`` is a host field of the shared batch
    info). Rows of rank-0 slots get exactly base(x) (column), or exactly the reduced base (row).
    Raises:
        ValueError: an unknown variant; x's width differs from the shard's A.
    """
    backend = get_backend(backend)
    if shard.variant not in VARIANTS["column"] + VARIANTS["row"]:
        raise ValueError(f"unknown variant {shard.variant!r}")
    if x.shape[-1] != shard.A.shape[2]:
        raise ValueError(f"{shard.variant}: x has {x.shape[-1]} columns, this rank's A reads {shard.A.shape[2]}")
    y = base(x).contiguous()
    if shard.variant == "reduce_shrink":
        dist.all_reduce(y, group=group)  # the base layer's own all-reduce
    if batch_info.has_active_lora:
        _add_lora(x, y, shard, batch_info, group, backend)
    if shard.variant == "reduce_with_base":
        dist.all_reduce(y, group=group)  # the base all-reduce now also sums the partial deltas
    return y


def _add_lora(x, y, shard: LoRAShard, info: LoRABatchInfo, group, backend: LoRABackend) -> None:
    shrink, expand = _ops(backend, info)
    if shard.variant == "fully_sharded":
        t_local = _shrink(x, shard.A, _with_width(info, shard.max_rank // shard.tp_size), shard.stack_num, shrink)
        t = _gather_shrink(t_local, shard, group)
        info = _with_width(info, shard.max_rank)  # the gathered t is zero-padded to R per part
    else:
        t = _shrink(x, shard.A, info, shard.stack_num, shrink)
        if shard.variant == "reduce_shrink":
            dist.all_reduce(t, group=group)  # sum_j x_j A_j^T = x A^T: r columns instead of out
    expand(t, shard.B, info, y, shard.slice_offsets)


# ---- communication volume -------------------------------------------------------------------------
class CollectiveLog:
    """Wraps ``torch.distributed.all_reduce`` / ``all_gather`` for the duration of a ``with`` block
    and logs ``(op, bytes)`` per call: what a layer really communicates, to set beside
    :func:`lora_comm_bytes`. Sizes as that function counts them: the tensor each collective produces
    on a rank (for an all-gather, the sum of its outputs). Used inside one rank's process.
    """

    def __init__(self) -> None:
        self.log: list[tuple[str, int]] = []

    def __enter__(self) -> "CollectiveLog":
        self._saved = dist.all_reduce, dist.all_gather
        reduce_, gather = self._saved

        def all_reduce(t, *a, **k):
            self.log.append(("all_reduce", t.numel() * t.element_size()))
            return reduce_(t, *a, **k)

        def all_gather(outs, t, *a, **k):
            self.log.append(("all_gather", sum(o.numel() * o.element_size() for o in outs)))
            return gather(outs, t, *a, **k)

        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce, dist.all_gather = self._saved


@dataclass(frozen=True)
class TPModelConfig:
    """The sizes of one decoder layer (Llama-style: fused qkv and gate_up, o and down)."""

    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int


def lora_comm_bytes(config: TPModelConfig, rank: int, num_tokens: int, dtype_bytes: int,
                    tp_size: int) -> dict:
    """Bytes of the collectives of one decoder layer's forward, per variant, as tensor sizes.

    A collective's size is the size of the tensor it produces on each rank: an all-reduce of
    [T, n] counts T*n*b, an all-gather whose result is [T, n] counts T*n*b (each rank sends 1/tp of
    it). Ring algorithms move about 2(tp-1)/tp (all-reduce) and (tp-1)/tp (all-gather) of that per
    rank (:func:`ring_bytes_per_rank`). ``rank`` is the width the collective carries: a mixed batch
    pads to the pool's max rank, so pass max_rank. Semantics (T tokens, r rank, b dtype bytes):
        "qkv_proj":     {"replicated_A": 0, "fully_sharded": T*3r*b}
        "gate_up_proj": {"replicated_A": 0, "fully_sharded": T*2r*b}
        "o_proj":       {"reduce_shrink": T*r*b, "reduce_with_base": 0}
        "down_proj":    {"reduce_shrink": T*r*b, "reduce_with_base": 0}
        "base":         {"o_proj": T*hidden*b, "down_proj": T*hidden*b}   (the base all-reduces)
    LoRA's part never depends on hidden or heads: only on tokens x rank. With tp_size 1 everything
    is 0 (no collective runs). The sizes are checked for a valid split (q heads, hidden and
    intermediate divisible by tp; kv heads divisible by tp, or tp by the kv heads: replication).
    Raises:
        ValueError: a size below 1, or heads / widths that cannot be split over tp_size.
    """
    sizes = (config.hidden, config.intermediate, config.num_heads, config.num_kv_heads, rank, dtype_bytes, tp_size)
    if min(sizes) < 1 or num_tokens < 0:
        raise ValueError(f"sizes must be >= 1 (tokens >= 0), got {config}, rank {rank}, tokens {num_tokens}, "
                         f"dtype_bytes {dtype_bytes}, tp {tp_size}")
    column_part_ranges((config.num_heads, config.num_kv_heads), (config.num_heads, config.num_kv_heads), 0, tp_size)
    row_in_range(config.hidden, 0, tp_size), row_in_range(config.intermediate, 0, tp_size)  # o / down inputs
    on = 0 if tp_size == 1 else 1
    per_col = num_tokens * rank * dtype_bytes * on
    return {
        "qkv_proj": {"replicated_A": 0, "fully_sharded": 3 * per_col},
        "gate_up_proj": {"replicated_A": 0, "fully_sharded": 2 * per_col},
        "o_proj": {"reduce_shrink": per_col, "reduce_with_base": 0},
        "down_proj": {"reduce_shrink": per_col, "reduce_with_base": 0},
        "base": {"o_proj": num_tokens * config.hidden * dtype_bytes * on,
                 "down_proj": num_tokens * config.hidden * dtype_bytes * on},
    }


def ring_bytes_per_rank(op: str, nbytes: int, tp_size: int) -> float:
    """Bytes each rank sends in a ring: all_reduce 2(tp-1)/tp * n, all_gather (tp-1)/tp * n.

    Raises ValueError for another op name.
    """
    factor = {"all_reduce": 2, "all_gather": 1}
    if op not in factor:
        raise ValueError(f"op must be 'all_reduce' or 'all_gather', got {op!r}")
    return factor[op] * (tp_size - 1) / tp_size * nbytes


# ---- the misstated rule ---------------------------------------------------------------------------
def garbled_column_rule(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, tp_size: int) -> dict:
    """Why "column-parallel: A split on its output dimension, B kept whole" cannot be right.

    x [T, in], A [r, in], B [out, r]; A's output dimension is r. Rank j would hold A_j = A[rank-rows j]
    and all of B, and compute (x A_j^T) B^T: [T, r/tp] times [r, out] does not compose. The only
    communication-free repair, B's matching columns B[:, rank-rows j], gives every rank a PARTIAL
    SUM of every output column, not its own columns: taking rank j's output columns from it is wrong,
    and only summing the partials over ranks (an all-reduce, or the fully sharded all-gather before
    the expand) gives x A^T B^T. The correct column rule splits B's output rows and keeps A whole.
    Returns:
        {"shape_error": the RuntimeError message of (x A_j^T) B^T,
         "repaired_max_error": max |assembled rank columns - x A^T B^T| (large),
         "sum_of_partials_max_error": max |sum_j partial_j - x A^T B^T| (rounding only),
         "correct_rule_max_error": max |cat_j (x A^T) B_j^T - x A^T B^T| with B split on rows (rounding)}
    Raises:
        ValueError: r or out not divisible by tp_size.
    """
    r, out = A.shape[0], B.shape[0]
    if r % tp_size or out % tp_size:
        raise ValueError(f"rank {r} and out {out} must be divisible by tp_size {tp_size}")
    truth = (x @ A.T) @ B.T
    k, n = r // tp_size, out // tp_size
    try:
        (x @ A[:k].T) @ B.T
        shape_error = ""
    except RuntimeError as err:
        shape_error = str(err)
    partials = [(x @ A[j * k:(j + 1) * k].T) @ B[:, j * k:(j + 1) * k].T for j in range(tp_size)]
    assembled = torch.cat([p[:, j * n:(j + 1) * n] for j, p in enumerate(partials)], dim=1)
    correct = torch.cat([(x @ A.T) @ B[j * n:(j + 1) * n].T for j in range(tp_size)], dim=1)
    return {"shape_error": shape_error,
            "repaired_max_error": (assembled - truth).abs().max().item(),
            "sum_of_partials_max_error": (sum(partials) - truth).abs().max().item(),
            "correct_rule_max_error": (correct - truth).abs().max().item()}


# ---- processes ------------------------------------------------------------------------------------
def tp_unavailable_reason(backend: str, world_size: int) -> Optional[str]:
    """Why ``world_size`` processes on ``backend`` cannot run here, or None when they can.

    gloo needs torch.distributed with gloo; NCCL needs CUDA, NCCL and one GPU per rank (a single
    GPU cannot host two NCCL ranks: NCCL refuses two ranks on one device).
    Raises ValueError for a backend other than "gloo" or "nccl", or world_size < 1.
    """
    if backend not in ("gloo", "nccl") or world_size < 1:
        raise ValueError(f"backend must be 'gloo' or 'nccl' and world_size >= 1, got {backend!r}, {world_size}")
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if backend == "gloo":
        return None if dist.is_gloo_available() else "torch.distributed has no gloo backend in this build"
    if not torch.cuda.is_available():
        return "NCCL needs CUDA, and no CUDA device is available"
    if torch.cuda.device_count() < world_size:
        return (f"NCCL with world_size {world_size} needs {world_size} GPUs (one per rank), "
                f"this machine has {torch.cuda.device_count()}")
    return None if dist.is_nccl_available() else "torch.distributed has no NCCL backend in this build"


def tp_device(backend: str, rank: int) -> torch.device:
    """Where rank ``rank``'s tensors live: the CPU for gloo, ``cuda:rank`` for NCCL."""
    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


def _rank_main(rank: int, fn: Callable, world_size: int, backend: str, folder: str, args: tuple) -> None:
    """Body of one spawned process: join the group, run fn, save its result as tensors/plain data."""
    torch.set_num_threads(1)  # world_size processes share the cores: one thread each avoids thrashing
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # a bounded collective timeout: a rank stuck in a collective its peers never call raises after
    # COLLECTIVE_TIMEOUT_S instead of gloo's / NCCL's default of 30 (10) minutes
    dist.init_process_group(backend, init_method=f"file://{os.path.join(folder, 'rendezvous')}",
                            rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(folder, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


#: How long a spawned rank waits in one collective before it raises (seconds).
COLLECTIVE_TIMEOUT_S = 300.0


def spawn_ranks(fn: Callable, world_size: int = 2, backend: str = "gloo", args: tuple = ()) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes joined in one process group.

    ``fn`` must be importable by the children (a module-level function; from a script, guard the
    call with ``if __name__ == "__main__":``). Its result must be data that ``torch.load(...,
    weights_only=True)`` accepts (tensors, numbers, strings, lists, tuples, dicts); CUDA tensors come
    back on the CPU. The process group (rendezvous through a file in a temporary folder, so no port
    can clash) is the default group inside fn; for NCCL rank j uses ``cuda:j``.
    Returns:
        [result of rank 0, ..., result of rank world_size-1].
    Raises:
        RuntimeError: the backend cannot run here (the reason of :func:`tp_unavailable_reason`).
        torch.multiprocessing.ProcessRaisedException: fn raised in a child (its traceback included),
            e.g. a collective that waited more than ``COLLECTIVE_TIMEOUT_S`` for a peer.
    """
    reason = tp_unavailable_reason(backend, world_size)
    if reason is not None:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="tp_lora_") as folder:
        torch.multiprocessing.spawn(_rank_main, args=(fn, world_size, backend, folder, tuple(args)),
                                    nprocs=world_size, join=True)
        return [torch.load(os.path.join(folder, f"rank{j}.pt"), map_location="cpu", weights_only=True)
                for j in range(world_size)]


# ---- chapter 10's exercises: the same rules with plain per-token tensors -------------------------
def fully_sharded_A(A_buffer: torch.Tensor, lora_ranks: Sequence[int], stack_num: int, tp_rank: int,
                    tp_size: int) -> torch.Tensor:
    """One rank's A of every slot in the fully sharded variant (vLLM ``fully_sharded_loras``, S-LoRA).

    A_buffer [num_slots, stack_num * R, in] holds slot s's parts packed at its own rank r = lora_ranks[s]
    (part i in rows [i*r, (i+1)*r), rows past stack_num*r unspecified: chapter 05). The split is of
    the PADDED max rank R = A_buffer.shape[1] // stack_num, the same for every slot, so every rank's
    pieces line up with the same columns of B on every rank. Semantics (w = R / tp_size):
        out = zeros(num_slots, stack_num * w, in)
        out[s, i*w + k] = A_buffer[s, i*r + tp_rank*w + k]   for every part i and 0 <= k < w with
                                                            tp_rank*w + k < r (zeros past r)
    Returns a new tensor of A_buffer's dtype and device.
    Raises:
        ValueError: R not divisible by tp_size; A_buffer's rows not a multiple of stack_num; one
        rank per slot not given, or a rank outside 0..R; tp_rank outside 0..tp_size-1.
    """
    _check_rank(tp_rank, tp_size)
    if A_buffer.dim() != 3 or stack_num < 1 or A_buffer.shape[1] % stack_num:
        raise ValueError(f"A_buffer {list(A_buffer.shape)}: expected [num_slots, stack_num * R, in], stack_num {stack_num}")
    R = A_buffer.shape[1] // stack_num
    if R % tp_size:
        raise ValueError(f"the padded max rank {R} is not divisible by tp_size {tp_size}")
    if len(lora_ranks) != A_buffer.shape[0] or any(not 0 <= int(r) <= R for r in lora_ranks):
        raise ValueError(f"lora_ranks {list(lora_ranks)}: one per slot, each in 0..{R}")
    return _fully_sharded_A(A_buffer, [int(r) for r in lora_ranks], stack_num, R, tp_rank, tp_size)


def _per_token(token_slots: torch.Tensor, lora_ranks: torch.Tensor, scalings: torch.Tensor, width: int):
    """(slot per token int64, mask [T, width] of the columns below each token's rank, scaling per token)."""
    slots = token_slots.long()
    keep = torch.arange(width, device=slots.device) < lora_ranks.to(slots.device).long()[slots].unsqueeze(1)
    return slots, keep, scalings.to(slots.device)[slots]


def _expand_rows(t: torch.Tensor, B_rows: torch.Tensor, keep: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale * t[:, :r] @ B_rows[:, :, :r]^T per token, columns past r read as 0 (they may hold junk)."""
    t = torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))
    B_rows = torch.where(keep.unsqueeze(1), B_rows, torch.zeros((), dtype=B_rows.dtype, device=B_rows.device))
    return scale.unsqueeze(1).to(t.dtype) * torch.einsum("tr,tor->to", t, B_rows)


def row_parallel_lora(x_local: torch.Tensor, W_local: torch.Tensor, A_local: torch.Tensor, B: torch.Tensor,
                      token_slots: torch.Tensor, lora_ranks: torch.Tensor, scalings: torch.Tensor, variant: str,
                      group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """One rank's forward of a row-parallel LoRA layer (o, down), with its collectives; exercise ch10.3.

    Shapes: x_local [T, in/tp] (this rank's input columns), W_local [out, in/tp], A_local
    [num_slots, R, in/tp] (A's matching columns), B [num_slots, out, R] (whole), token_slots [T] int,
    lora_ranks [num_slots] int, scalings [num_slots] float. Columns of A_local's rows past a slot's
    rank and of B past it are unspecified (junk, even NaN): only the first r are read.
    Semantics (t_j = x_local A_local[slot]^T, [T, R]; delta(t) = scalings[slot] * t[:, :r] B[slot, :, :r]^T):
        "reduce_shrink":     y = all_reduce(x_local W_local^T) + delta(all_reduce(t_j))
        "reduce_with_base":  y = all_reduce(x_local W_local^T + delta(t_j))
    (by linearity sum_j delta(t_j) = delta(sum_j t_j): the same y up to rounding). Returns y [T, out],
    the full output, equal on every rank; tokens of rank-0 slots get exactly the reduced base.
    Raises:
        ValueError: an unknown variant (on every rank, before any collective).
    Source: S-LoRA section 6; vLLM ``RowParallelLinearWithLoRA`` (reduce_with_base) and
    ``fully_sharded_loras`` (reduce_shrink).
    """
    if variant not in VARIANTS["row"]:
        raise ValueError(f"variant must be one of {VARIANTS['row']}, got {variant!r}")
    y = x_local @ W_local.T
    slots, keep, scale = _per_token(token_slots, lora_ranks, scalings, B.shape[2])
    t = torch.einsum("ti,tri->tr", x_local, A_local[slots]).contiguous()
    if variant == "reduce_shrink":
        dist.all_reduce(y, group=group)  # the base layer's own all-reduce
        dist.all_reduce(t, group=group)  # sum_j x_j A_j^T = x A^T: R columns, not out
    active = keep[:, :1]  # tokens whose slot has rank >= 1
    y = torch.where(active, y + _expand_rows(t, B[slots], keep, scale), y)
    if variant == "reduce_with_base":
        dist.all_reduce(y, group=group)  # sums the partial bases and the partial deltas at once
    return y


def fully_sharded_column_lora(x: torch.Tensor, W_local: torch.Tensor, A_local: torch.Tensor, B_local: torch.Tensor,
                              token_slots: torch.Tensor, lora_ranks: torch.Tensor, scalings: torch.Tensor,
                              slice_offsets: Sequence[int], group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """One rank's forward of a column-parallel LoRA layer in the fully sharded variant; exercise ch10.4.

    Shapes (tp = the group's size, stack = len(slice_offsets) - 1, w = R / tp): x [T, in] (whole),
    W_local [out_local, in] (this rank's output rows), A_local [num_slots, stack * w, in] (this rank's
    rank-rows of each part, :func:`fully_sharded_A`), B_local [num_slots, out_local, R] (this rank's
    output rows, all R columns), slice_offsets: the parts' local output offsets (host ints).
    Semantics:
        t_j = x A_local[slot]^T                                  [T, stack * w]
        t = all_gather(t_j), reordered PART-major: part i = cat_j (t_j's columns [i*w, (i+1)*w))
        y[:, off_i:off_{i+1}] = x W_local^T ... + scalings[slot] * t_i[:, :r] B_local[slot, off_i:off_{i+1}, :r]^T
    Returns y_local [T, out_local]; tokens of rank-0 slots get exactly x W_local^T. Columns of t and B
    past a slot's rank r are read as zero (A rows and B columns there are unspecified).
    Raises:
        ValueError: A_local's rows are not stack * R / tp (before any collective).
    Source: vLLM ``fully_sharded_loras`` (``ColumnParallelLinearWithShardedLoRA``: all-gather of the
    shrink output), S-LoRA section 6.
    """
    tp, stack, R = dist.get_world_size(group), len(slice_offsets) - 1, B_local.shape[2]
    if R % tp or A_local.shape[1] != stack * (R // tp):
        raise ValueError(f"A_local has {A_local.shape[1]} rows; expected stack_num * R / tp = {stack} * {R} / {tp}")
    y = x @ W_local.T
    slots, keep, scale = _per_token(token_slots, lora_ranks, scalings, R)
    t_local = torch.einsum("ti,tki->tk", x, A_local[slots]).contiguous()
    pieces = [torch.empty_like(t_local) for _ in range(tp)]
    dist.all_gather(pieces, t_local, group=group)
    t = torch.stack(pieces).view(tp, x.shape[0], stack, R // tp).permute(1, 2, 0, 3).reshape(x.shape[0], stack, R)
    active = keep[:, :1]
    for i in range(stack):
        lo, hi = slice_offsets[i], slice_offsets[i + 1]
        part = y[:, lo:hi]
        y[:, lo:hi] = torch.where(active, part + _expand_rows(t[:, i], B_local[slots, lo:hi], keep, scale), part)
    return y
