"""Chapter 01 reference against independent computations."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from reference import lora_math as lm

ALL = lm.LLAMA_PROJECTIONS


def test_llama3_8b_rank16_all_seven_is_80_mib():
    assert lm.adapter_num_params(lm.LLAMA3_8B_CONFIG, ALL, 16) == 41_943_040
    n_bytes = lm.adapter_num_bytes(lm.LLAMA3_8B_CONFIG, ALL, 16, torch.bfloat16)
    assert n_bytes == 83_886_080
    assert n_bytes / 2**20 == 80.0  # the handbook's "~80 MB" is MiB
    square = 32 * 7 * 16 * (4096 + 4096) * 2  # every projection 4096 x 4096: the "58 MB" estimate
    assert square == 58_720_256  # 58.7 MB: too small, k/v and the MLP are not 4096 x 4096


def test_flop_share_is_about_0_6_percent():
    share = lm.lora_flop_share(lm.LLAMA3_8B_CONFIG, ALL, 16)
    per_layer_lora = 16 * (8192 + 5120 + 5120 + 8192 + 3 * 18432)
    per_layer_base = 4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336
    assert share == pytest.approx(per_layer_lora / per_layer_base)
    assert 0.0059 < share < 0.0061


def test_gqa_and_head_dim_shapes():
    shapes = lm.projection_shapes(lm.LLAMA3_8B_CONFIG)
    assert shapes["k_proj"] == (4096, 1024) and shapes["down_proj"] == (14336, 4096)
    nemo = {"hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 14336, "num_hidden_layers": 40}
    assert lm.projection_shapes(nemo)["q_proj"] == (5120, 4096)
    assert lm.projection_shapes(nemo)["o_proj"] == (4096, 5120)


def test_scaling_rslora():
    assert lm.lora_scaling(16, 16, use_rslora=True) == 4.0
    assert lm.lora_scaling(16, 16, use_rslora=False) == 1.0
    assert lm.lora_scaling(8, 64, use_rslora=True) == 1.0
    with pytest.raises(ValueError):
        lm.lora_scaling(16, 0, use_rslora=False)


@settings(max_examples=25, deadline=None)
@given(d_in=st.integers(1, 40), d_out=st.integers(1, 40), r=st.integers(1, 8), n=st.integers(0, 5),
       scaling=st.floats(-4, 4), seed=st.integers(0, 2**16))
def test_unmerged_forward_equals_merged_weight(d_in, d_out, r, n, scaling, seed):
    g = torch.Generator().manual_seed(seed)
    x, W = torch.randn(n, d_in, generator=g, dtype=torch.float64), torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    A, B = torch.randn(r, d_in, generator=g, dtype=torch.float64), torch.randn(d_out, r, generator=g, dtype=torch.float64)
    merged = lm.merge_lora(W, A, B, scaling)
    torch.testing.assert_close(lm.lora_forward(x, W, A, B, scaling), x @ merged.T)
    torch.testing.assert_close(lm.unmerge_lora(merged, A, B, scaling), W)


def test_merge_leaves_w_untouched_and_bf16_roundtrip_is_lossy():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(64, 64, generator=g).bfloat16()
    A, B = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(64, 8, generator=g).bfloat16()
    W0 = W.clone()
    back = lm.unmerge_lora(lm.merge_lora(W, A, B, 2.0), A, B, 2.0)
    assert torch.equal(W, W0)
    assert not torch.equal(back, W0)  # bf16 merge-then-unmerge is not exact


def test_padded_flop_waste():
    assert lm.padded_flop_waste([100] * 4, [64, 16, 16, 16]) == 0.5625
    assert lm.padded_flop_waste([], []) == 0.0
    assert lm.padded_flop_waste([3, 4], [0, 0]) == 0.0
    lens, ranks = [5, 7, 11], [8, 64, 16]
    flops_padded = sum(n * 64 for n in lens)
    assert lm.padded_flop_waste(lens, ranks) == pytest.approx(1 - sum(n * r for n, r in zip(lens, ranks)) / flops_padded)
    with pytest.raises(ValueError):
        lm.padded_flop_waste([1], [])
    assert math.isclose(lm.padded_flop_waste([1, 1], [16, 16]), 0.0)
