"""The decoder layer's elementwise work as one Triton kernel each: RMSNorm with the residual add
before it, rotary embedding of q and k, and SiLU-and-mul.

Why. Hugging Face's Llama layer spells these as torch ops: an RMSNorm is six kernels (upcast,
square, mean, rsqrt, multiply, downcast and weight), the residual add one more, rotary embedding five
per tensor (two slices, a negation, a concatenation, two multiplies and an add), SiLU-and-mul two.
In a decode step of a few hundred tokens each kernel moves a few MB, well under a microsecond of
copy bandwidth, but costs a launch of its own: about thirty per layer, and an 8-layer decode step of
256 sequences on an H100 spent about 1 ms in them, a fifth of its GPU time (the engine benchmark's
``decode_breakdown``, class "other": ``benchmarks/results/engine_unfused_h100.json``). Fused,
a layer runs four, and that class fell to 0.37 ms (``engine_plain_h100.json``, the same run). vLLM (``fused_add_rms_norm``, ``rotary_embedding``, ``silu_and_mul`` in its
``_C`` ops) and SGLang (sgl-kernel's) do the same; so does TensorRT-LLM's plugin layer.

Numerics: each kernel computes in fp32 and rounds where the torch ops it replaces round, so a bf16
result differs from Hugging Face's only by the order of the variance's sum: the residual sum is
stored in the input dtype and normalised from that stored value; the normalised row is rounded
before the weight multiplies it (``LlamaRMSNorm``); ``x * cos`` and ``rotate_half(x) * sin`` are each
rounded before their sum (``apply_rotary_pos_emb``); SiLU's output is rounded before the multiply.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from reference.ops._triton_util import check_same_device

__all__ = ["rms_norm", "rotary_embedding", "silu_and_mul"]


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, hidden, eps,
                     stride_x, stride_res, stride_out, stride_res_out,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row: s = x (+ residual), stored as the new residual; out = w * (s / rms(s))."""
    # int64 offsets: a prefill's rows x hidden can pass 2^31 elements (the book's rule for every kernel)
    stride_x, stride_res = tl.cast(stride_x, tl.int64), tl.cast(stride_res, tl.int64)
    stride_out, stride_res_out = tl.cast(stride_out, tl.int64), tl.cast(stride_res_out, tl.int64)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        s += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # the residual stream lives in the model's dtype: normalise the value stored, as the torch ops do
        s_stored = s.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_res_out + cols, s_stored, mask=mask)
        s = s_stored.to(tl.float32)
    var = tl.sum(s * s, axis=0) / hidden
    normed = (s * tl.rsqrt(var + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` (Zhang & Sennrich, 2019; ``LlamaRMSNorm``), after adding ``residual`` when given.

    Args:
        x: [num_tokens, hidden], fp32 / bf16 / fp16, last dim contiguous.
        weight: [hidden], any float dtype (upcast to fp32 in the kernel).
        eps: added to the mean square before the reciprocal square root.
        residual: optional [num_tokens, hidden] of x's dtype.

    Returns:
        (out, new_residual): out [num_tokens, hidden] in x's dtype, ``weight * s / sqrt(mean(s^2) + eps)``
        with ``s = x + residual`` rounded to x's dtype; new_residual is s (a new tensor), or ``x`` itself
        without ``residual`` (the first layer: its input is the residual stream). Neither input is
        written.

    Raises:
        ValueError: shapes, dtypes or devices that do not match; a last dim that is not contiguous.
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden], got {list(x.shape)} and "
                         f"{list(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({list(x.shape)}, {x.dtype}), got {list(residual.shape)}, "
                         f"{residual.dtype}")
    if x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1) or weight.stride(0) != 1:
        raise ValueError("x, residual and weight need a contiguous last dim")
    check_same_device(x, weight, residual)
    n, hidden = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if n:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(n,)](x, residual if residual is not None else x, weight, out, res_out, hidden, float(eps),
                               x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
                               res_out.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block,
                               num_warps=min(16, max(1, block // 512)))
    return out, res_out


@triton.jit
def _rope_tile(x_ptr, out_ptr, row, stride_x, stride_xh, stride_out, stride_outh, c1, s1, c2, s2, heads,
               HALF: tl.constexpr, H_PAD: tl.constexpr):
    """Rotate one token's [heads, head_dim] tile: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), rotate_half's
    layout (the two halves of each head, not interleaved pairs)."""
    stride_x, stride_xh = tl.cast(stride_x, tl.int64), tl.cast(stride_xh, tl.int64)
    stride_out, stride_outh = tl.cast(stride_out, tl.int64), tl.cast(stride_outh, tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = h < heads
    base = x_ptr + row * stride_x + h * stride_xh + d
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    o1 = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
    o2 = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
    obase = out_ptr + row * stride_out + h * stride_outh + d
    tl.store(obase, o1.to(dt), mask=mask)
    tl.store(obase + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr, q_heads, k_heads,
                 stride_q, stride_qh, stride_k, stride_kh, stride_cs, stride_sn,
                 stride_qo, stride_qoh, stride_ko, stride_koh,
                 HALF: tl.constexpr, QH_PAD: tl.constexpr, KH_PAD: tl.constexpr):
    """One program per token: its cos / sin row once, then every head of q and of k."""
    stride_q, stride_qh = tl.cast(stride_q, tl.int64), tl.cast(stride_qh, tl.int64)
    stride_k, stride_kh = tl.cast(stride_k, tl.int64), tl.cast(stride_kh, tl.int64)
    stride_cs, stride_sn = tl.cast(stride_cs, tl.int64), tl.cast(stride_sn, tl.int64)
    stride_qo, stride_qoh = tl.cast(stride_qo, tl.int64), tl.cast(stride_qoh, tl.int64)
    stride_ko, stride_koh = tl.cast(stride_ko, tl.int64), tl.cast(stride_koh, tl.int64)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    # cos / sin in the model's dtype, as Hugging Face's rotary embedding returns them
    c1 = tl.load(cos_ptr + row * stride_cs + d).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cs + HALF + d).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sn + d).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sn + HALF + d).to(tl.float32)
    _rope_tile(q_ptr, q_out_ptr, row, stride_q, stride_qh, stride_qo, stride_qoh, c1, s1, c2, s2, q_heads,
               HALF, QH_PAD)
    _rope_tile(k_ptr, k_out_ptr, row, stride_k, stride_kh, stride_ko, stride_koh, c1, s1, c2, s2, k_heads,
               HALF, KH_PAD)


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding (RoFormer, Su et al., 2021) of q and k in one launch, in Hugging
    Face's ``rotate_half`` layout: ``x * cos + rotate_half(x) * sin`` per head.

    Args:
        q: [num_tokens, heads, head_dim]; k: [num_tokens, kv_heads, head_dim], same dtype; head_dim
            even and a power of two; the last dim contiguous.
        cos, sin: [num_tokens, head_dim] (or [num_tokens, 1, head_dim]), each row the token's angles
            with both halves equal, as ``LlamaRotaryEmbedding`` returns them; last dim contiguous.

    Returns:
        (q_rot, k_rot), new tensors of q's and k's shapes and dtype. The inputs are not written.

    Raises:
        ValueError: shapes, dtypes or devices that do not match; a head_dim that is odd or not a power
        of two; a last dim that is not contiguous.
    """
    if cos.dim() == 3:
        cos, sin = cos.squeeze(1), sin.squeeze(1)
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q [num_tokens, heads, head_dim] and k [num_tokens, kv_heads, head_dim] must agree, got "
                         f"{list(q.shape)} and {list(k.shape)}")
    n, _, head_dim = q.shape
    if cos.shape != (n, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [{n}, {head_dim}], got {list(cos.shape)} and {list(sin.shape)}")
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be an even power of two, got {head_dim}")
    if k.dtype != q.dtype:
        raise ValueError(f"q and k must share a dtype, got {q.dtype} and {k.dtype}")
    if any(t.stride(-1) != 1 for t in (q, k, cos, sin)):
        raise ValueError("q, k, cos and sin need a contiguous last dim")
    check_same_device(q, k, cos, sin)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if n:
        _rope_kernel[(n,)](q, k, cos, sin, q_out, k_out, q.shape[1], k.shape[1],
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
                           q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
                           HALF=head_dim // 2, QH_PAD=triton.next_power_of_2(q.shape[1]),
                           KH_PAD=triton.next_power_of_2(k.shape[1]), num_warps=4)
    return q_out, k_out


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, out_ptr, width, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    stride_g, stride_u, stride_o = tl.cast(stride_g, tl.int64), tl.cast(stride_u, tl.int64), tl.cast(stride_o, tl.int64)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # SiLU's output, rounded as torch's op rounds it
    tl.store(out_ptr + row * stride_o + cols, (act * u).to(dt), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, the SwiGLU MLP's activation (Shazeer, 2020; ``LlamaMLP``), one kernel.

    Args:
        gate, up: [num_tokens, intermediate], one dtype, last dim contiguous (the two projections'
            outputs; a fused gate_up projection's halves are views of this kind).

    Returns:
        [num_tokens, intermediate] in gate's dtype (a new tensor).

    Raises:
        ValueError: shapes, dtypes or devices that do not match; a last dim that is not contiguous.
    """
    if gate.dim() != 2 or up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must be one [num_tokens, intermediate] shape and dtype, got "
                         f"{list(gate.shape)} {gate.dtype} and {list(up.shape)} {up.dtype}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("gate and up need a contiguous last dim")
    check_same_device(gate, up)
    out = torch.empty_like(gate)
    n, width = gate.shape
    if n and width:
        block = min(4096, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(n, triton.cdiv(width, block))](gate, up, out, width, gate.stride(0), up.stride(0),
                                                             out.stride(0), BLOCK=block, num_warps=4)
    return out
