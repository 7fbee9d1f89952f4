"""The fused elementwise kernels of the engine's decoder layer (reference/ops/fused_elementwise.py)
against the torch ops they replace (Hugging Face's LlamaRMSNorm, the runner's apply_rope, silu * up),
on the CPU through the Triton interpreter and on CUDA when present.

Cases cross every clause: with and without the residual; a hidden size that is not a power of two
(the masked tail of the row's block); head counts padded to a power of two (3 -> 4) and one KV head;
q and k as strided views (a fused QKV projection's slices); cos / sin in both accepted shapes; a
SiLU width past one column block (two programs per row); zero rows. Inputs are checked untouched.
The GPU adds Llama-3-8B's shapes in bf16."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from graders.machine.tolerances import tolerance
from reference.ops.fused_elementwise import rms_norm, rotary_embedding, silu_and_mul
from reference.static_llama import apply_rope

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got, want, dtype):
    rtol, atol, why = tolerance(DEVICE.type, dtype, "elementwise")
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{m} ({why})")


def _rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 64), (7, 96), (3, 1000), (0, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_the_residual_add_then_llama_rmsnorm(dtype, rows, hidden, with_residual):
    x, r = _rand(rows, hidden, dtype=dtype, seed=1), _rand(rows, hidden, dtype=dtype, seed=2)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(DEVICE)
    norm.weight.data = _rand(hidden, dtype=dtype, seed=3)
    x0, r0 = x.clone(), r.clone()
    out, res = rms_norm(x, norm.weight, norm.variance_epsilon, r if with_residual else None)
    want_res = x + r if with_residual else x
    if DEVICE.type == "cuda" or dtype == torch.float32:  # the interpreter truncates its 16-bit casts
        assert torch.equal(res, want_res)
    _close(res, want_res, dtype)
    _close(out, norm(want_res), dtype)
    assert torch.equal(x, x0) and torch.equal(r, r0)
    if not with_residual:
        assert res is x  # the first layer's residual stream is its input


def test_rms_norm_reads_rows_by_their_stride():
    """x a slice of a wider buffer (row stride > hidden): each row's own values, not the next row's."""
    wide = _rand(5, 80, dtype=torch.float32, seed=4)
    x = wide[:, 8:72]
    w = _rand(64, dtype=torch.float32, seed=5)
    norm = LlamaRMSNorm(64, eps=1e-6).to(DEVICE)
    norm.weight.data = w
    out, _ = rms_norm(x, w, 1e-6)
    _close(out, norm(x), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, kv_heads, head_dim", [(1, 4, 2, 16), (6, 3, 1, 32), (0, 4, 2, 16)])
@pytest.mark.parametrize("cos_3d", [False, True])
def test_rotary_embedding_equals_rotate_half(dtype, rows, heads, kv_heads, head_dim, cos_3d):
    # q and k as slices of one [rows, (heads + 2 kv_heads) * head_dim] projection, as a fused QKV's are
    qkv = _rand(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=6)
    q = qkv[:, :heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    pos = torch.arange(rows, dtype=torch.float32) * 37 + 5  # angles far from 0: sin and cos both matter
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    emb = torch.cat((pos[:, None] * inv, pos[:, None] * inv), dim=-1)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    before = qkv.clone()
    args = (cos[:, None], sin[:, None]) if cos_3d else (cos, sin)
    q_rot, k_rot = rotary_embedding(q, k, *args)
    _close(q_rot, apply_rope(q, cos[:, None], sin[:, None]), dtype)
    _close(k_rot, apply_rope(k, cos[:, None], sin[:, None]), dtype)
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 48), (5, 96), (2, 4100), (0, 48)])
def test_silu_and_mul_equals_silu_times_up(dtype, rows, width):
    gate, up = _rand(rows, width, dtype=dtype, seed=7) * 4, _rand(rows, width, dtype=dtype, seed=8)
    _close(silu_and_mul(gate, up), F.silu(gate) * up, dtype)


def test_bad_input_raises_before_any_launch():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(x, torch.ones(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm(x, torch.ones(8, device=DEVICE), 1e-6, torch.zeros(2, 8, dtype=torch.float16, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        rms_norm(torch.zeros(8, 2, device=DEVICE).t(), torch.ones(8, device=DEVICE), 1e-6)
    q, k = torch.zeros(2, 4, 16, device=DEVICE), torch.zeros(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="cos and sin"):
        rotary_embedding(q, k, torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 8, device=DEVICE))
    with pytest.raises(ValueError, match="power of two"):
        rotary_embedding(torch.zeros(2, 4, 12, device=DEVICE), torch.zeros(2, 2, 12, device=DEVICE),
                         torch.zeros(2, 12, device=DEVICE), torch.zeros(2, 12, device=DEVICE))
    with pytest.raises(ValueError, match="agree"):
        rotary_embedding(q, torch.zeros(3, 2, 16, device=DEVICE), torch.zeros(2, 16, device=DEVICE),
                         torch.zeros(2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="gate and up"):
        silu_and_mul(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 9, device=DEVICE))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Llama-3-8B's shapes: GPU only")
def test_llama3_8b_shapes_bf16():
    n, hidden, inter, heads, kv, hd = 256, 4096, 14336, 32, 8, 128
    x, r = _rand(n, hidden, dtype=torch.bfloat16, seed=9), _rand(n, hidden, dtype=torch.bfloat16, seed=10)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(DEVICE, torch.bfloat16)
    out, res = rms_norm(x, norm.weight, norm.variance_epsilon, r)
    assert torch.equal(res, x + r)
    _close(out, norm(x + r), torch.bfloat16)
    q, k = _rand(n, heads, hd, dtype=torch.bfloat16, seed=11), _rand(n, kv, hd, dtype=torch.bfloat16, seed=12)
    emb = torch.randn(n, hd // 2, device=DEVICE).repeat(1, 2) * 50
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q_rot, k_rot = rotary_embedding(q, k, cos, sin)
    # the same roundings, but not bit for bit: an H100 run found 1-ulp differences in a few elements
    _close(q_rot, apply_rope(q, cos[:, None], sin[:, None]), torch.bfloat16)
    _close(k_rot, apply_rope(k, cos[:, None], sin[:, None]), torch.bfloat16)
    g, u = _rand(n, inter, dtype=torch.bfloat16, seed=13), _rand(n, inter, dtype=torch.bfloat16, seed=14)
    _close(silu_and_mul(g, u), F.silu(g) * u, torch.bfloat16)  # exp may differ by an ulp from torch's
