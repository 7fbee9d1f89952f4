"""The base GEMM with the LoRA expand in its epilogue (``reference.ops.lora_gemm``) against its torch
reference: every tile and K step crossed at least twice, tiles holding rows of several slots, rank 0
and empty rows, every part of a packed shrink, NaN past each rank and outside the part's columns
(never read), and base rows bit-exact with the same launch without LoRA."""
from __future__ import annotations

import pytest
import torch

import reference  # noqa: F401  (sets TRITON_INTERPRET on a machine without CUDA)
from reference.batch_info import build_batch_info
from reference.ops import lora_gemm, torch_ref

NAN = float("nan")
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (3e-2, 3e-2)}
SMALL = dict(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


def _case(M, N, K, ranks, token_slots, stack, part, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_rank = max(max(ranks), 1)
    x = torch.randn(M, K, generator=g)
    W = torch.randn(N, K, generator=g) * K ** -0.5
    t = torch.randn(M, stack * max_rank, generator=g)
    B = torch.randn(len(ranks), N, max_rank, generator=g) * max_rank ** -0.5
    for m, s in enumerate(token_slots):  # poison every shrink column this row's part must not read
        r = ranks[s]
        t[m, :part * r] = NAN
        t[m, (part + 1) * r:] = NAN
    for s, r in enumerate(ranks):
        B[s, :, r:] = NAN
    scalings = [0.0 if r == 0 else 0.5 + s for s, r in enumerate(ranks)]
    info = build_batch_info([1] * M, token_slots, ranks, scalings, DEVICE)
    return [v.to(dtype).to(DEVICE) for v in (x, W, t, B)] + [info]


def _check(got, exp, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), exp.float(), rtol=rtol, atol=atol)


CASES = [  # (name, M, N, K, ranks, token_slots, stack, part)
    # 3 row tiles x 3 column tiles x 3 K steps of 16; rows of 4 slots interleaved in every tile
    ("mixed_tiles", 40, 40, 40, [0, 4, 16, 7], [m % 4 for m in range(40)], 1, 0),
    # part 2 of a q/k/v shrink: columns [2r, 3r) of each row's own rank
    ("qkv_part_v", 33, 24, 48, [5, 0, 16], [(m * 7) % 3 for m in range(33)], 3, 2),
    ("gate_up_part_up", 20, 50, 35, [3, 16], [1, 0] * 10, 2, 1),
    # a tile whose rows are all base (rank 0): no epilogue pass at all; a tile of one slot
    ("base_tile_then_one_slot", 32, 17, 20, [0, 9], [0] * 16 + [1] * 16, 1, 0),
    ("every_row_its_own_slot", 16, 32, 33, list(range(1, 17)), list(range(16)), 1, 0),
]


@pytest.mark.parametrize("name,M,N,K,ranks,token_slots,stack,part", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["dot", "gather"])
def test_matches_the_torch_reference_and_base_rows_are_bit_exact(name, M, N, K, ranks, token_slots, stack, part,
                                                                 dtype, epilogue):
    x, W, t, B, info = _case(M, N, K, ranks, token_slots, stack, part, dtype)
    got = lora_gemm(x, W, t=t, B_stack=B, batch_info=info, part=part, config={**SMALL, "epilogue": epilogue})
    exp = torch_ref.lora_gemm(x, W, t=t, B_stack=B, batch_info=info, part=part)
    assert not got.isnan().any(), "read a poisoned shrink column or B column past a rank"
    _check(got, exp, dtype)
    base = lora_gemm(x, W, config=SMALL)
    _check(base, torch_ref.lora_gemm(x, W), dtype)
    base_rows = torch.tensor([ranks[s] == 0 for s in token_slots], device=DEVICE)
    assert torch.equal(got[base_rows], base[base_rows]), "a base row differs from the base-only launch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("epilogue", ["dot", "gather"])
def test_split_k_partials_are_summed_by_the_epilogue(dtype, epilogue):
    """t as 3 fp32 split-K partials (the decode shrink's split): the epilogue reads their sum. Part 2
    of a q/k/v shrink over 2 row tiles with 4 slots (ranks 0/5/16/9), NaN wherever the part must not
    read (in every partial), base rows bit-exact with the base-only launch."""
    M, N, K, ranks, part = 33, 24, 48, [0, 5, 16, 9], 2
    slots = [(m * 7) % 4 for m in range(M)]
    x, W, t, B, info = _case(M, N, K, ranks, slots, 3, part, dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    parts = (torch.randn(3, *t.shape, generator=g) * 0.5).to(DEVICE)
    parts[:, torch.isnan(t)] = NAN
    parts[-1] = t.float() - parts[:-1].sum(0)  # the partials sum to t (NaN stays NaN)
    got = lora_gemm(x, W, t=parts, B_stack=B, batch_info=info, part=part, config={**SMALL, "epilogue": epilogue})
    exp = torch_ref.lora_gemm(x, W, t=parts.sum(0).to(dtype), B_stack=B, batch_info=info, part=part)
    assert not got.isnan().any(), "read a poisoned shrink column"
    _check(got, exp, dtype)
    base_rows = torch.tensor([ranks[s] == 0 for s in slots], device=DEVICE)
    assert torch.equal(got[base_rows], lora_gemm(x, W, config=SMALL)[base_rows])
    with pytest.raises(ValueError, match="partials"):
        lora_gemm(x, W, t=parts.to(dtype) if dtype != torch.float32 else parts.double(), B_stack=B,
                  batch_info=info, part=part)


def test_default_config_and_empty_batches():
    x, W, t, B, info = _case(24, 40, 72, [0, 8], [m % 2 for m in range(24)], 1, 0, torch.float32)
    got = lora_gemm(x, W, t=t, B_stack=B, batch_info=info)
    _check(got, torch_ref.lora_gemm(x, W, t=t, B_stack=B, batch_info=info), torch.float32)
    out = torch.empty(0, 40, device=DEVICE)
    assert lora_gemm(x[:0], W, out=out) is out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real sizes need CUDA")
@pytest.mark.parametrize("M", [1, 16, 64, 200, 1030])
@pytest.mark.parametrize("N,K", [(1024, 4096), (4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("epilogue", ["dot", "gather"])
def test_real_sizes_on_the_gpu(M, N, K, epilogue):
    ranks = [0] + [16, 64, 8, 32] * 2
    slots = [(m * 5) % len(ranks) for m in range(M)]
    x, W, t, B, info = _case(M, N, K, ranks, slots, 3, 1, torch.bfloat16, seed=M)
    got = lora_gemm(x, W, t=t, B_stack=B, batch_info=info, part=1, config={"epilogue": epilogue})
    _check(got, torch_ref.lora_gemm(x, W, t=t, B_stack=B, batch_info=info, part=1), torch.bfloat16)
    base_rows = torch.tensor([ranks[s] == 0 for s in slots], device=DEVICE)
    assert torch.equal(got[base_rows], lora_gemm(x, W)[base_rows])


def test_bad_input_raises_a_clear_error():
    x, W, t, B, info = _case(8, 16, 16, [0, 4], [0, 1] * 4, 1, 0, torch.float32)
    with pytest.raises(ValueError, match="together"):
        lora_gemm(x, W, t=t)
    with pytest.raises(ValueError, match="expected x"):
        lora_gemm(x, W[:, :8])
    with pytest.raises(ValueError, match="out is"):
        lora_gemm(x, W, out=torch.empty(8, 15, device=DEVICE))
    with pytest.raises(ValueError, match="part 1"):
        lora_gemm(x, W, t=t, B_stack=B, batch_info=info, part=1)
    with pytest.raises(ValueError, match="B_stack"):
        lora_gemm(x, W, t=t, B_stack=B[:, :8], batch_info=info)
    with pytest.raises(ValueError, match="dtype|is torch"):
        lora_gemm(x, W.double())
    with pytest.raises(ValueError, match="epilogue"):
        lora_gemm(x, W, t=t, B_stack=B, batch_info=info, config={"epilogue": "fused"})
