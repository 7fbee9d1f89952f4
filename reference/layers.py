"""LoRA layers that wrap a model's own linear layers and read the batch's LoRABatchInfo: chapter 07.

A :class:`LoRALinear` holds the base layer and calls it; then it adds the LoRA delta of every token
into that output in place, with the book's ops (``shrink`` then ``expand``) reading the pool's slot
buffers and the current :class:`~reference.batch_info.LoRABatchInfo`. The base layer's forward is
never copied, and a batch without an active adapter runs the base layer alone.

How the batch info reaches the layers: through a :class:`LoRAContext` the caller owns and passes
to :func:`wrap_llama`. ``context.set_batch(batch_info)`` before each forward is the one hook; each
layer reads ``context.batch_info`` when it runs. No module global, no thread-local: two wrapped
models with two contexts never see each other's batches.

Token order (the convention shared with :func:`~reference.batch_info.batch_info_from_requests`):
x [batch, seq, hidden] is flattened row-major to [batch * seq, hidden], and the batch info covers
those rows in that order. A right-padded batch has one request per row with ``req_lens`` all equal
to ``seq`` (the padding belongs to its row's request: with causal attention a real token never reads
a later padding position, and the caller ignores the padding's outputs; PEFT's mixed batch does the
same); a decode step is x [batch, 1, hidden] with ``req_lens`` all 1; an unpadded (packed) batch is
x [1, total, hidden] or [total, hidden] with any ``req_lens``.

Packed projections over separate modules: an engine runs q/k/v (and gate/up) as one GEMM, but a
Hugging Face Llama calls ``q_proj``, ``k_proj`` and ``v_proj`` one after the other on the SAME
input tensor object. The parts of a packed pool module share one :class:`SharedShrink`: the first
part to run computes the stacked shrink ``x @ A[:3r].T`` and keeps it, keyed by the identity of the
input tensor, its version counter (an in-place change invalidates it; tensors made under
``torch.inference_mode`` have none, so there identity alone counts) and the context's batch
generation (a new ``set_batch`` invalidates it); the others reuse it, and it is released once every
part has read it. Each part then runs its own expand into its own output in place, with slice
offsets that give the other parts zero width: part i of (q, k, v) passes B rows [lo_i, hi_i) and
``slice_offsets = (0,) * (i + 1) + (hi_i - lo_i,)``, so slice i reads shrink columns [i*r, (i+1)*r)
of each token's own rank r and writes all of the part's output, while the other slices are empty.
Shrinks drop from 3 to 1 per attention block (2 to 1 per MLP), as in the engine.

Inference only: the Triton ops write in place behind autograd's back (run under ``torch.no_grad``
or ``torch.inference_mode``). The pool's buffers are not registered as module buffers, so
``model.to(...)`` does not move them: put the pool on the model's device.

Sources: SGLang ``python/sglang/srt/lora/layers.py`` (``BaseLayerWithLoRA``: base forward, then
``apply_lora``; ``QKVParallelLinearWithLoRA``) and ``lora_manager.py`` (``set_lora_module``: wrapping
the model's modules in place); vLLM ``vllm/lora/layers`` and ``punica_wrapper`` (the wrapper calls
the base layer, the punica wrapper adds the delta in place).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence, Union

import torch
from torch import nn

from reference import ops
from reference.adapters import layer_index, projection_map
from reference.batch_info import LoRABatchInfo
from reference.mem_pool import LoRAMemoryPool
from reference.ops._triton_util import summed_partials

__all__ = ["LoRAContext", "LoRABackend", "get_backend", "uses_token_slots", "SharedShrink", "LoRALinear",
           "PackedProjection", "pack_projections", "wrap_llama", "unwrap_llama"]


class LoRAContext:
    """The batch info of the forward about to run: the one hook between the engine and the layers.

    The caller sets it before every forward (``set_batch``); layers read ``batch_info`` at forward
    time. Nothing survives from one batch to the next: ``set_batch`` replaces the batch info and
    bumps ``generation``, which invalidates every cached shrink.
    """

    def __init__(self, overlap_shrink: bool = False) -> None:
        self._batch_info: Optional[LoRABatchInfo] = None
        self._generation = 0
        self.overlap_shrink = overlap_shrink
        self._side_streams: dict = {}  # CUDA device -> the stream the shrinks run on (overlap_shrink)

    @property
    def overlap_shrink(self) -> bool:
        """Whether a layer on a CUDA input launches its LoRA shrink on a side stream while its base
        GEMM runs on the current one, joining before the expand (default False; no effect on the CPU).

        Why: a decode step's shrink reads the same x as the base GEMM and nothing the GEMM writes,
        and it is a small, latency-bound launch (a few hundred programs at 256 tokens) while the
        decode GEMM leaves SMs idle (an M = 256 q|k|v GEMM is 48 output tiles on 132 SMs); side by
        side, the shrink's time hides behind the GEMM's. Inside a CUDA-graph capture the fork and
        join become graph edges (``torch.cuda.graph`` captures work on other streams that wait on
        the capturing one). Same results: the shrink computes what it would in line."""
        return self._overlap_shrink

    @overlap_shrink.setter
    def overlap_shrink(self, value: bool) -> None:
        if value is not True and value is not False:  # 1 == True, but is not a flag
            raise ValueError(f"overlap_shrink must be True or False, got {value!r}")
        self._overlap_shrink = value

    def side_stream(self, x: torch.Tensor) -> Optional["torch.cuda.Stream"]:
        """The side stream for the shrink of input x (:attr:`overlap_shrink`), or None where the
        shrink runs in line: overlap off, or x not on a CUDA device. One stream per device."""
        if not self._overlap_shrink or x.device.type != "cuda":
            return None
        key = x.device.index if x.device.index is not None else torch.cuda.current_device()
        if key not in self._side_streams:
            # from the high-priority pool: torch.cuda.Stream() hands out the 32 default-priority pooled
            # streams in turn, so a default-priority side stream could be the one a CUDA-graph capture
            # runs on, and overlap nothing. (In eager launches the priority also lets the shrink's
            # blocks go first; a graph replay may drop it: node priorities need
            # cudaGraphInstantiateFlagUseNodePriority.)
            self._side_streams[key] = torch.cuda.Stream(device=key, priority=-1)
        stream = self._side_streams[key]
        return None if stream == torch.cuda.current_stream(key) else stream

    def set_batch(self, batch_info: Optional[LoRABatchInfo]) -> None:
        """Make ``batch_info`` the batch of the next forward (None clears it)."""
        if batch_info is not None and not isinstance(batch_info, LoRABatchInfo):
            raise TypeError(f"set_batch takes a LoRABatchInfo or None, got {type(batch_info).__name__}")
        self._batch_info = batch_info
        self._generation += 1

    @property
    def batch_info(self) -> LoRABatchInfo:
        """The current batch info. Raises RuntimeError if none is set."""
        if self._batch_info is None:
            raise RuntimeError("no LoRA batch is set: call context.set_batch(batch_info) before each forward")
        return self._batch_info

    @property
    def generation(self) -> int:
        """How many times ``set_batch`` has been called (a host int)."""
        return self._generation


class LoRABackend(NamedTuple):
    """The ops a LoRA layer calls, with the contract's signatures (``reference.ops``).

    ``shrink`` / ``expand`` read the segments (SGMV: prefill, any batch); ``decode_shrink`` /
    ``decode_expand``, when given, read ``token_slots`` (BGMV) and serve batches of one token per
    segment (:func:`uses_token_slots`). A backend without them runs SGMV for every batch.
    """

    name: str
    shrink: Callable  # shrink(x, A_stack, batch_info, out, stack_num=1)
    expand: Callable  # expand(t, B_stack, batch_info, out, slice_offsets=None)
    decode_shrink: Optional[Callable] = None  # same signatures, reading token_slots
    decode_expand: Optional[Callable] = None
    # gemm(x, W, out=None, t=None, B_stack=None, batch_info=None, part=0): when given, a bias-free
    # nn.Linear's whole forward (base GEMM with the expand in its epilogue, reading token_slots)
    gemm: Optional[Callable] = None
    # split_k(num_tokens, in_features, width) -> S: when given, a decode shrink writes S fp32 split-K
    # partials [S, num_tokens, width] that decode_expand sums (S = 1: one [num_tokens, width] output)
    split_k: Optional[Callable[[int, int, int], int]] = None


def get_backend(backend: Union[str, LoRABackend]) -> LoRABackend:
    """"torch" (the plain-PyTorch references) or "triton" (the Triton kernels; in the interpreter on
    the CPU): SGMV for segments, BGMV for one-token-per-segment batches, whose shrink is split over
    the hidden size by batch shape (``ops.decode_splits``: split-K fills the GPU at decode; a
    hidden size under 1024 is never split, so the CPU tests' small models run unsplit unless a
    backend asks); the BGMV ops run the schedules the batch names (``shrink_schedule``,
    ``expand_schedule``: per token, or grouped by slot; ``reference.ops.decode_schedule`` says which
    a graph runner picks per step). "triton_fused": the same
    shrinks, and each bias-free projection's base GEMM is ``ops.lora_gemm`` with the expand in its
    epilogue (no expand kernel; the base rows come from the Triton GEMM, also when the batch has no
    adapter). "torch_fused": its torch reference. A LoRABackend is returned as it is. Raises
    ValueError for another name."""
    if isinstance(backend, LoRABackend):
        return backend
    if backend == "torch":
        return LoRABackend("torch", ops.torch_ref.shrink, ops.torch_ref.expand,
                           ops.torch_ref.bgmv_shrink, ops.torch_ref.bgmv_expand)
    if backend == "triton":
        return LoRABackend("triton", ops.sgmv_shrink, ops.sgmv_expand, ops.bgmv_shrink, ops.bgmv_expand,
                           split_k=ops.decode_splits)
    if backend == "triton_fused":
        return LoRABackend("triton_fused", ops.sgmv_shrink, ops.sgmv_expand, ops.bgmv_shrink, ops.bgmv_expand,
                           ops.lora_gemm, split_k=ops.decode_splits)
    if backend == "torch_fused":
        return LoRABackend("torch_fused", ops.torch_ref.shrink, ops.torch_ref.expand, ops.torch_ref.bgmv_shrink,
                           ops.torch_ref.bgmv_expand, ops.torch_ref.lora_gemm)
    raise ValueError(f"unknown LoRA backend {backend!r}: use 'torch', 'triton', 'triton_fused', 'torch_fused' "
                     "or a LoRABackend")


def uses_token_slots(batch_info: LoRABatchInfo) -> bool:
    """Whether a layer takes the BGMV ops for this batch: every segment has at most one token
    (``max_len <= 1``, a host int) and ``token_slots`` is set (a decode step).

    Why: SGMV tiles rows by segment, so one-token segments leave a 16-128-row tile almost empty,
    one per request; BGMV gives each token its own gather (``benchmarks/benchmark_lora_ops.py``
    times both on decode batches). The choice is read from the batch info, so what the layers will
    do is visible where the batch was built.
    """
    return batch_info.max_len <= 1 and batch_info.token_slots is not None


def _ops_for(backend: LoRABackend, batch_info: LoRABatchInfo) -> tuple[Callable, Callable]:
    if backend.decode_shrink is not None and backend.decode_expand is not None and uses_token_slots(batch_info):
        return backend.decode_shrink, backend.decode_expand
    return backend.shrink, backend.expand


class SharedShrink:
    """The shrink output of one (layer, packed module), computed once per input, read by every part.

    Running example (q, k, v of layer 3, x the attention's input): q_proj(x) computes
    t = shrink(x) and keeps (x, t); k_proj(x) and v_proj(x) find the same x object, same version,
    same batch generation, and reuse t; after the third read the pair is released.
    """

    def __init__(self, num_parts: int) -> None:
        self.num_parts = num_parts
        self._key: Optional[tuple] = None
        self._x: Optional[torch.Tensor] = None
        self._t: Optional[torch.Tensor] = None
        self._reads = 0

    def get(self, x: torch.Tensor, generation: int, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``compute()`` for a new input, the kept result for the same input of the same batch."""
        key = (None if x.is_inference() else x._version, generation)  # inference tensors have no version
        if self._x is not x or self._key != key:
            self._x, self._key, self._t, self._reads = x, key, compute(), 0
        t = self._t
        self._reads += 1
        if self._reads >= self.num_parts:  # every part has read it: let go of x and t
            self._x, self._key, self._t = None, None, None
        return t


def _num_tokens(batch_info: LoRABatchInfo) -> Optional[int]:
    """Rows the batch info covers, when its sizes say so (never a device read); else None."""
    try:
        return batch_info.num_tokens
    except ValueError:
        return None


def _check_pool_matches_base(base: nn.Module, pool: LoRAMemoryPool, where: str) -> None:
    """Raise ValueError if the base layer's weight has another dtype or device than the pool.

    Why at construction: the ops read activations in the base layer's dtype next to the pool's
    buffers; with another dtype the Triton kernels fail at the first forward (a CompilationError
    inside ``tl.dot``), while the torch references silently compute at mixed precision. A weight
    that is not floating (a quantized layer) says nothing about the activations and is not checked.
    """
    weight = getattr(base, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return
    if weight.dtype != pool.dtype:
        raise ValueError(f"{where}: the base layer's weight is {weight.dtype} but the pool stores {pool.dtype}: "
                         f"create the pool with LoRAMemoryPool(..., dtype={weight.dtype}), or cast the model "
                         f"with model.to({pool.dtype}), before wrapping")
    pool_device = pool.lora_ranks.device  # a concrete device (cuda:0, not "cuda")
    if weight.device != pool_device:
        raise ValueError(f"{where}: the base layer's weight is on {weight.device} but the pool's buffers are "
                         f"on {pool_device}: create the pool with device={str(weight.device)!r}, or move the "
                         f"model with model.to({str(pool_device)!r}), before wrapping")


class LoRALinear(nn.Module):
    """A base linear layer plus the LoRA deltas of a mixed batch, added in place into its output.

    ``module_name`` names the pool module (e.g. "qkv_proj" or "o_proj"); ``part`` is this layer's
    part of a packed module (q=0, k=1, v=2; gate=0, up=1). Parts of one packed module share a
    :class:`SharedShrink` (``shared``; a new one when omitted, which is correct but shrinks per part).

    Semantics (x [..., in], rows = x.reshape(-1, in) in the batch info's token order):
        y = base(x)                                              (the base layer's own forward)
        if batch_info.has_active_lora:
            t = shrink(rows, A[slot], stack_num)                 (shared by the packed parts)
            y.view(-1, out)[tok] += scalings[s] * t[tok, part*r:(part+1)*r] @ B[s, lo:hi, :r].T
        return y
    A token in a rank-0 slot (base model, empty slot) gets exactly base(x).
    Raises (at construction):
        ValueError: an unknown module, a layer or part out of range, a base layer whose
        in_features / out_features differ from the pool module's part, or whose (floating) weight
        has another dtype or device than the pool's buffers.
    """

    def __init__(self, base: nn.Module, pool: LoRAMemoryPool, module_name: str, layer: int,
                 context: LoRAContext, backend: Union[str, LoRABackend] = "torch", *, part: int = 0,
                 shared: Optional[SharedShrink] = None) -> None:
        super().__init__()
        if module_name not in pool.modules:
            raise ValueError(f"module {module_name!r} is not a pool module ({sorted(pool.modules)})")
        spec = pool.modules[module_name]
        if not 0 <= layer < pool.num_layers or not 0 <= part < spec.stack_num:
            raise ValueError(f"{module_name}: layer {layer} / part {part} outside the pool's "
                             f"{pool.num_layers} layers / {spec.stack_num} parts")
        lo, hi = spec.slice_offsets[part], spec.slice_offsets[part + 1]
        want = (spec.in_features, hi - lo)
        got = (getattr(base, "in_features", want[0]), getattr(base, "out_features", want[1]))
        if got != want:
            raise ValueError(f"layer {layer} {module_name} part {part}: base layer is {got[0]} -> {got[1]}, "
                             f"the pool's part is {want[0]} -> {want[1]}")
        _check_pool_matches_base(base, pool, f"layer {layer} {module_name} part {part}")
        self.base = base
        self.pool, self.spec, self.layer, self.part, self.context = pool, spec, layer, part, context
        self.backend = get_backend(backend)
        self.shared = shared if shared is not None else SharedShrink(spec.stack_num)
        self.rows_of_B = (lo, hi)  # this part's rows of the packed B (its output columns)
        self.slice_offsets = (0,) * (part + 1) + (hi - lo,)  # earlier parts: zero-width slices
        # the fused path replaces the base forward, so only where that forward is a bias-free x @ W.T
        self.fused = (self.backend.gemm is not None and type(base) is nn.Linear and base.bias is None)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, module={self.spec.name!r}, part={self.part}, backend={self.backend.name!r}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self._fused_forward(x)
        if not self.context.batch_info.has_active_lora:
            return self.base(x)  # no adapter in the batch: the LoRA ops are not even launched
        return self.base_and_delta(x, lambda: self.base(x).contiguous())

    def base_and_delta(self, x: torch.Tensor, base: Callable[[], torch.Tensor], whole_module: bool = False) -> torch.Tensor:
        """``y = base()`` (the base layer's output for x, contiguous) with the batch's LoRA deltas of x
        added in place (:meth:`add_delta`; a batch with an active adapter), returned. With the
        context's :attr:`LoRAContext.overlap_shrink` and a CUDA x, the shrink is launched on the
        side stream first and ``base()`` on the current stream beside it; the current stream waits
        for the shrink before the expand."""
        stream = self.context.side_stream(x)
        if stream is None:
            y = base()
            self.add_delta(x, y.view(-1, y.shape[-1]), whole_module)
            return y
        self._check_rows(x.reshape(-1, x.shape[-1]), self.context.batch_info)  # before the fork: a refusal forks nothing
        main = torch.cuda.current_stream(x.device)
        stream.wait_stream(main)  # x (and the pool's slots) are written on main: the shrink starts after
        try:
            with torch.cuda.stream(stream):
                t = self._delta_input(x, whole_module)
            y = base()
        finally:  # joined whatever raised: a CUDA-graph capture must not end with the side stream forked
            main.wait_stream(stream)
        # no record_stream for t (allocated on the side stream, freed after the expand on main): the
        # side stream's next allocation follows its next wait on main, so after this expand
        self._expand(t, y.view(-1, y.shape[-1]), whole_module)
        return y

    def add_delta(self, x: torch.Tensor, out: torch.Tensor, whole_module: bool = False) -> None:
        """Add the batch's LoRA deltas of input x [..., in] into out [num_tokens, width] in place
        (a batch with an active adapter): this part's slice of the packed module (out = this part's
        output; the shrink shared with the other parts), or with ``whole_module`` every part's
        slice at once (out = the whole module's output, one shrink and one expand:
        :class:`PackedProjection`). Raises ValueError as :meth:`_check_rows`."""
        self._expand(self._delta_input(x, whole_module), out, whole_module)

    def _delta_input(self, x: torch.Tensor, whole_module: bool) -> torch.Tensor:
        """The shrink of x the expand reads: this module's own, or (a part) the one its packed
        parts share. Raises ValueError as :meth:`_check_rows`."""
        info = self.context.batch_info
        rows = x.reshape(-1, x.shape[-1])
        self._check_rows(rows, info)
        shrink, _ = _ops_for(self.backend, info)
        # the "sorted" expand sums split-K partials before its launch (sgmv_expand): summed here instead,
        # once per packed module, q/k/v (gate/up) read one sum rather than reducing the same partials
        # each (at 64 x 8, rank 64 on an H200: 56 reductions, 221 us of a 3961 us base step;
        # benchmarks/results/decode_step_schedule_h200.json)
        reduce = uses_token_slots(info) and info.expand_schedule == "sorted"
        if whole_module:
            return self._shrink(rows, info, shrink, splits=True, reduce=reduce)
        return self.shared.get(x, self.context.generation,
                               lambda: self._shrink(rows, info, shrink, splits=True, reduce=reduce))

    def _expand(self, t: torch.Tensor, out: torch.Tensor, whole_module: bool) -> None:
        """The expand of t into out [num_tokens, width] in place: every slice of the module, or this part's."""
        info = self.context.batch_info
        _, expand = _ops_for(self.backend, info)
        B = self.pool.B_buffer[self.spec.name][self.layer]  # [num_slots, out_total, max_rank]
        if whole_module:
            expand(t, B, info, out, self.spec.slice_offsets)
            return
        lo, hi = self.rows_of_B
        expand(t, B[:, lo:hi], info, out, self.slice_offsets)

    def _check_rows(self, rows: torch.Tensor, info: LoRABatchInfo) -> None:
        """Raise ValueError when the batch info covers another number of tokens than ``rows``."""
        expected = _num_tokens(info)
        if expected is not None and expected != rows.shape[0]:
            raise ValueError(f"layer {self.layer} {self.spec.name}: input has {rows.shape[0]} tokens but the "
                             f"batch info covers {expected}: set this forward's batch with context.set_batch")

    def _fused_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The backend's ``gemm``: base GEMM and, for a batch with an adapter, the expand in its
        epilogue (the shrink still shared by the packed parts)."""
        info = self.context.batch_info
        rows = x.reshape(-1, x.shape[-1])
        W = self.base.weight
        if not info.has_active_lora:
            y = self.backend.gemm(rows, W)
        else:
            self._check_rows(rows, info)
            if info.token_slots is None:
                raise ValueError(f"layer {self.layer} {self.spec.name}: the {self.backend.name} backend reads "
                                 "batch_info.token_slots, which this batch info lacks")
            shrink, _ = _ops_for(self.backend, info)
            t = self.shared.get(x, self.context.generation,
                                # reduced here, once for the packed parts (lora_gemm would reduce per part)
                                lambda: self._shrink(rows, info, shrink, splits=True, reduce=True))
            lo, hi = self.rows_of_B
            B = self.pool.B_buffer[self.spec.name][self.layer][:, lo:hi]
            y = self.backend.gemm(rows, W, t=t, B_stack=B, batch_info=info, part=self.part)
        return y.view(*x.shape[:-1], W.shape[0])

    def _shrink(self, rows: torch.Tensor, info: LoRABatchInfo, shrink: Callable, splits: bool = False,
                reduce: bool = False) -> torch.Tensor:
        """[num_tokens, stack_num * max_rank]; columns past each token's stack_num * r unspecified.

        With ``splits`` (the reader is the backend's decode_expand or its fused GEMM's epilogue, both
        of which sum partials) and a decode batch, the backend's ``split_k`` may ask for
        [S, num_tokens, width] fp32 partials; ``reduce`` sums them here (``summed_partials``: one fp32
        [num_tokens, width] tensor; an unsplit 2-D shrink is returned as it is, in x's dtype)."""
        A = self.pool.A_buffer[self.spec.name][self.layer]  # [num_slots, stack_num * max_rank, in]
        S = 1
        if splits and self.backend.split_k is not None and uses_token_slots(info):
            S = self.backend.split_k(rows.shape[0], A.shape[2], A.shape[1])
        if S > 1:
            t = rows.new_empty(S, rows.shape[0], A.shape[1], dtype=torch.float32)
        else:
            t = rows.new_empty(rows.shape[0], A.shape[1])
        t = shrink(rows, A, info, t, stack_num=self.spec.stack_num)
        return summed_partials(t) if reduce else t


class PackedProjection:
    """The parts of one packed projection (q|k|v, or gate|up, of one layer) as ONE GEMM over a packed
    weight, and, when the parts are :class:`LoRALinear` of one packed pool module, that module's LoRA
    as one shrink and ONE expand over all its slices (the parts' own forwards launch a GEMM and an
    expand each). Built by :func:`pack_projections`, which also makes each part's weight a view of
    the packed one, so the model's own modules keep working and no weight is stored twice.

    Semantics (x [..., in], rows = x.reshape(-1, in); parts p_0..p_{n-1} with outputs [lo_i, hi_i)):
        y = rows @ W.T,  W = cat(p_0.weight, ..., p_{n-1}.weight)   [num_tokens, out_total]
        y[:, lo_i:hi_i] == p_i(x) for every part i (up to the GEMM's rounding: one GEMM, not n)
    returned as [..., out_total]. With LoRA parts: t = shrink(rows, A[slot]) once, then one expand
    with the pool module's ``slice_offsets`` (slice i reads t's columns [i*r, (i+1)*r) and writes
    y[:, lo_i:hi_i]); a batch without an active adapter launches no LoRA op.

    Why: at decode, k_proj and v_proj (1024 columns of Llama-3-8B) are GEMMs of a few microseconds
    each, and every GEMM and expand is a launch; one q|k|v GEMM and one gate|up GEMM per layer is
    how vLLM (``QKVParallelLinear``, ``MergedColumnParallelLinear``) and SGLang load Llama, and
    their LoRA layers (``MergedQKVParallelLinearWithLoRA``; SGLang's ``QKVParallelLinearWithLoRA``)
    expand all slices in one launch, as this does.
    Raises:
        ValueError: (at the call) an input whose last dim is not the parts' in_features; the batch
        info covering another number of tokens than x has (as :class:`LoRALinear`).
    """

    def __init__(self, weight: torch.Tensor, parts: Sequence[nn.Module], lora: Optional[LoRALinear]) -> None:
        self.weight, self.parts, self.lora = weight, tuple(parts), lora
        self.bases = tuple(m.base if isinstance(m, LoRALinear) else m for m in parts)
        self.out_features = weight.shape[0]

    def _in_sync(self) -> bool:
        """Whether every part's weight is still its rows of ``self.weight`` (host pointers only)."""
        at = self.weight.data_ptr()
        for b in self.bases:
            if b.weight.data_ptr() != at:
                return False
            at += b.weight.numel() * b.weight.element_size()
        return True

    def __repr__(self) -> str:
        lora = f", lora={self.lora.spec.name!r} layer {self.lora.layer}" if self.lora is not None else ""
        return f"PackedProjection({self.weight.shape[1]} -> {self.out_features}, {len(self.parts)} parts{lora})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.weight.shape[1]:
            raise ValueError(f"{self!r}: input has {x.shape[-1]} features, not {self.weight.shape[1]}")
        if not self._in_sync():
            # the parts' weights were replaced (model.to(...), load_state_dict(assign=True)): pack again,
            # so the GEMM never runs stale weights (a CUDA graph captured before must be captured again)
            self.weight = _packed_weight(self.bases)
        rows = x.reshape(-1, x.shape[-1])
        if self.lora is not None and self.lora.context.batch_info.has_active_lora:
            y = self.lora.base_and_delta(x, lambda: torch.nn.functional.linear(rows, self.weight), whole_module=True)
        else:
            y = torch.nn.functional.linear(rows, self.weight)
        return y.view(*x.shape[:-1], self.out_features)


def _packed_weight(bases: Sequence[nn.Linear]) -> torch.Tensor:
    """The parts' weights as one [sum(out), in] tensor whose row blocks ARE the parts' weights: the
    view they already share when an earlier call packed them (no copy), else a new one that each
    part's ``weight`` is then re-pointed into (a Parameter over a view of it; values unchanged)."""
    ws = [b.weight for b in bases]
    rows, k = sum(w.shape[0] for w in ws), ws[0].shape[1]
    first, offset = ws[0], ws[0].storage_offset()
    shared = all(w.is_contiguous() and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                 for w in ws)
    for w in ws:
        shared = shared and w.storage_offset() == offset
        offset += w.numel()
    if shared:
        return first.detach().as_strided((rows, k), (k, 1), first.storage_offset())
    # outside inference mode whatever the caller's: the model's parameters must stay ordinary tensors
    # (an inference tensor refuses in-place updates, load_state_dict and autograd afterwards)
    with torch.inference_mode(False), torch.no_grad():
        packed = torch.cat([w.detach() for w in ws])
        lo = 0
        for b, w in zip(bases, ws):
            b.weight = nn.Parameter(packed[lo:lo + w.shape[0]], requires_grad=w.requires_grad)
            lo += w.shape[0]
    return packed


def pack_projections(modules: Sequence[nn.Module]) -> Optional[PackedProjection]:
    """A :class:`PackedProjection` of these projections of one layer, in output order (q, k, v, or
    gate, up), or None when they cannot be packed: fewer than two; a base that is not a bias-free
    ``nn.Linear``; bases of different in_features, dtype or device; LoRA parts that are not all
    :class:`LoRALinear` of one packed pool module of exactly these parts in order (parts 0..n-1 of
    a module with ``stack_num`` n, one layer, one context), or that take their backend's fused GEMM
    (``LoRALinear.fused``: its epilogue expands per part). Modules may be all plain ``nn.Linear``
    (base only) or all LoRALinear. The callers keep the parts' own forwards when it returns None.

    Side effect (when it packs): each base layer's ``weight`` becomes a Parameter over its rows of
    the packed tensor (:func:`_packed_weight`), the same values, and never an inference tensor;
    calling it again on the same modules finds them packed and copies nothing. A model packed so
    shares storage between those parameters: a safetensors save of its state dict refuses shared
    tensors (clone them first), and parameters that were tied (one Parameter in two projections)
    are two afterwards, with equal values. Weights replaced later (``model.to(...)``,
    ``load_state_dict(assign=True)``) are packed again at the next call; an in-place
    ``load_state_dict`` writes into the packed tensor itself.
    """
    modules = list(modules)
    if len(modules) < 2:
        return None
    loras = [m for m in modules if isinstance(m, LoRALinear)]
    if loras and len(loras) != len(modules):
        return None
    bases = [m.base if isinstance(m, LoRALinear) else m for m in modules]
    if any(type(b) is not nn.Linear or b.bias is not None for b in bases):
        return None
    w0 = bases[0].weight
    if any(b.weight.shape[1] != w0.shape[1] or b.weight.dtype != w0.dtype or b.weight.device != w0.device
           for b in bases):
        return None
    lora = loras[0] if loras else None
    if lora is not None:
        same = all(m.spec is lora.spec and m.layer == lora.layer and m.context is lora.context and m.pool is lora.pool
                   and m.backend == lora.backend and not m.fused for m in loras)
        if not same or lora.spec.stack_num != len(modules) or [m.part for m in loras] != list(range(len(modules))):
            return None
    return PackedProjection(_packed_weight(bases), modules, lora)


def _targets(model: nn.Module, pool: LoRAMemoryPool) -> list[tuple[str, int, str, int]]:
    """(path, layer, pool module, part) of every nn.Linear ``...layers.N.<projection>`` the pool serves."""
    served = projection_map(list(pool.modules.values()))
    found = []
    for path, mod in model.named_modules():
        layer, proj = layer_index(path), path.rsplit(".", 1)[-1]
        if layer is not None and proj in served and isinstance(mod, nn.Linear):
            found.append((path, layer, *served[proj]))
    return found


def _replace(model: nn.Module, path: str, new: nn.Module) -> None:
    parent, _, attr = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def wrap_llama(model: nn.Module, pool: LoRAMemoryPool, context: LoRAContext,
               backend: Union[str, LoRABackend] = "torch") -> nn.Module:
    """Wrap, in place, every projection of a Hugging Face Llama (or any model whose linear layers
    are named ``...layers.N.<q|k|v|o|gate|up|down>_proj``) that the pool serves; returns ``model``.

    Fused pool modules ("qkv_proj", "gate_up_proj") map onto the separate projections with one
    :class:`SharedShrink` per (layer, module); per-projection pool modules wrap one to one. Every
    wrapper is built (and checked) before the first module is replaced.

    Example: a 2-layer Llama and a pool of (qkv_proj, o_proj, gate_up_proj, down_proj) -> 14
    LoRALinear modules; ``model.model.layers[0].self_attn.k_proj`` is
    LoRALinear(base=<the original Linear>, module "qkv_proj", part 1).
    Raises:
        ValueError: the model is already wrapped; no linear layer is served by the pool; a layer,
        shape, dtype or device mismatch between a projection and the pool (see :class:`LoRALinear`).
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model is already wrapped; unwrap_llama(model) first")
    targets = _targets(model, pool)
    if not targets:
        raise ValueError(f"no linear layer of the model is served by the pool's modules {sorted(pool.modules)}")
    backend = get_backend(backend)
    parts: dict[tuple[int, str], int] = {}
    for _, layer, name, _ in targets:
        parts[(layer, name)] = parts.get((layer, name), 0) + 1
    shared = {key: SharedShrink(n) for key, n in parts.items()}
    wrappers = [(path, LoRALinear(model.get_submodule(path), pool, name, layer, context, backend,
                                  part=part, shared=shared[(layer, name)]))
                for path, layer, name, part in targets]
    for path, wrapper in wrappers:
        _replace(model, path, wrapper)
    return model


def unwrap_llama(model: nn.Module) -> nn.Module:
    """Put every wrapped layer's base layer back (the original module objects); returns ``model``."""
    wrapped = [path for path, m in model.named_modules() if isinstance(m, LoRALinear)]
    for path in wrapped:
        _replace(model, path, model.get_submodule(path).base)
    return model
