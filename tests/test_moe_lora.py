"""MoE LoRA (chapter 09): the contract's helpers in ``reference.moe.lora``, the Triton op
``reference.moe.fused_moe_lora`` against the torch reference, expert parallelism, adapter sizes.

Triton runs where the rest of the suite runs it (CUDA when present, else the CPU interpreter). CPU
shapes are small but cross every tile and loop with small blocks (block_m 16: a group of 36 pairs
takes 3 blocks; block_n 16 over 40-wide slices: 3 N tiles; block_k 16 over 40 inputs: 3 K steps).
Padding past every group's rank (and the whole of a rank-0 group) is NaN, so reading it fails.
"""
from __future__ import annotations

import math

import pytest
import torch

from reference.moe import lora as moe_lora_module
from reference.moe.lora import (GATE_UP_HALVES, fused_moe_lora_torch, gate_up_half, moe_align_block_size,
                                to_local_expert_ids, virtual_expert_ids)
from reference.moe.sizes import DEEPSEEK_V3, MIXTRAL_8X7B, QWEN3_30B_A3B, lora_bytes, moe_adapter_bytes
from reference.moe.fused_moe_lora import fused_moe_lora
from reference.moe.fused_moe_lora import align_moe_lora

NAN = float("nan")
TRITON_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (3e-2, 3e-2)}
SMALL_BLOCKS = dict(block_m=16, block_n=16, block_k=16)


# ---- reference.moe.lora: virtual expert ids ------------------------------------------------------
def test_virtual_expert_ids_are_slot_times_experts_plus_expert_and_keep_minus_one():
    ids = torch.tensor([[0, 3], [2, -1], [-1, 1]])
    slots = torch.tensor([1, 0, 2], dtype=torch.int32)
    got = virtual_expert_ids(ids, slots, 4)
    assert got.dtype == torch.int64
    assert got.tolist() == [[4, 7], [2, -1], [-1, 9]]


def test_virtual_expert_ids_reject_out_of_range_and_bad_shapes():
    with pytest.raises(ValueError, match="out of range"):
        virtual_expert_ids(torch.tensor([[0, 4]]), torch.tensor([0]), 4)
    with pytest.raises(ValueError):
        virtual_expert_ids(torch.tensor([[0, 1]]), torch.tensor([0, 1]), 4)
    with pytest.raises(ValueError):
        virtual_expert_ids(torch.tensor([0, 1]), torch.tensor([0, 1]), 4)
    assert virtual_expert_ids(torch.zeros(0, 2, dtype=torch.long), torch.zeros(0), 4).shape == (0, 2)


# ---- reference.moe.lora: moe_align_block_size -----------------------------------------------------
def _check_aligned(ids: torch.Tensor, block_size: int, num_ids: int, skip=None) -> None:
    """Every clause of AlignedBlocks' docstring, checked against a plain Python recount."""
    aligned = moe_align_block_size(ids, block_size, num_ids, skip)
    flat = ids.reshape(-1).tolist()
    n = len(flat)
    assert aligned.num_pairs == n
    sorted_ids, block_ids = aligned.sorted_pair_ids, aligned.block_ids
    assert sorted_ids.dtype == torch.int32 and block_ids.dtype == torch.int32
    assert sorted_ids.numel() == block_ids.numel() * block_size
    skipped = set() if skip is None else {i for i in range(num_ids) if bool(skip[i])}
    kept = [p for p, v in enumerate(flat) if v >= 0 and v not in skipped]
    real = [p for p in sorted_ids.tolist() if p != n]
    assert sorted(real) == kept  # every real, kept pair exactly once; padding is the sentinel n
    assert all(0 <= p <= n for p in sorted_ids.tolist())
    expected_blocks = []
    for v in range(num_ids):
        group = [p for p in kept if flat[p] == v]
        expected_blocks += [v] * math.ceil(len(group) / block_size)
    assert block_ids.tolist() == expected_blocks  # ids in order, ceil(count / block) blocks each, none for empty
    for b, v in enumerate(block_ids.tolist()):
        entries = sorted_ids[b * block_size:(b + 1) * block_size].tolist()
        pairs = [p for p in entries if p != n]
        assert pairs and all(flat[p] == v for p in pairs)  # one id per block, no empty block
        assert entries == pairs + [n] * (block_size - len(pairs))  # padding only at a group's end
    for v in set(expected_blocks):  # stable: a group's pairs keep their order
        group = [p for p in real if flat[p] == v]
        assert group == sorted(group)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_moe_align_block_size_sorts_pads_and_counts(block_size):
    g = torch.Generator().manual_seed(block_size)
    ids = torch.randint(-1, 6, (13, 3), generator=g)
    ids[0] = torch.tensor([5, 5, 5])  # a group larger than a few blocks
    ids[1:5, 0] = 5
    _check_aligned(ids, block_size, 7)  # id 6 has no pairs: no blocks


def test_moe_align_block_size_skip_leaves_groups_out():
    ids = torch.tensor([[0, 1], [1, 2], [2, 0], [-1, 1]])
    skip = torch.tensor([False, True, False])
    _check_aligned(ids, 2, 3, skip)
    aligned = moe_align_block_size(ids, 2, 3, skip)
    assert aligned.block_ids.tolist() == [0, 2]
    assert aligned.sorted_pair_ids.tolist() == [0, 5, 3, 4]
    assert moe_align_block_size(ids, 2, 3, torch.ones(3, dtype=torch.bool)).block_ids.numel() == 0


def test_moe_align_block_size_running_example():
    # pairs 0..5 with ids [2, 0, 2, 2, -1, 0], block 2: id 0 -> [1, 5]; id 2 -> [0, 2], [3, pad]
    aligned = moe_align_block_size(torch.tensor([[2, 0], [2, 2], [-1, 0]]), 2, 3)
    assert aligned.sorted_pair_ids.tolist() == [1, 5, 0, 2, 3, 6]
    assert aligned.block_ids.tolist() == [0, 2, 2]
    assert aligned.num_pairs == 6


def test_moe_align_block_size_empty_and_errors():
    empty = moe_align_block_size(torch.zeros(0, 2, dtype=torch.long), 4, 3)
    assert empty.sorted_pair_ids.numel() == 0 and empty.block_ids.numel() == 0 and empty.num_pairs == 0
    none_kept = moe_align_block_size(torch.full((2, 2), -1), 4, 3)
    assert none_kept.block_ids.numel() == 0 and none_kept.num_pairs == 4
    with pytest.raises(ValueError):
        moe_align_block_size(torch.tensor([[0, 1]]), 0, 3)
    with pytest.raises(ValueError):
        moe_align_block_size(torch.tensor([[0, 3]]), 2, 3)


# ---- reference.moe.lora: expert parallelism and the gate_up halves --------------------------------
def test_to_local_expert_ids():
    ids = torch.tensor([[0, 5], [3, 4], [7, -1]])
    assert to_local_expert_ids(ids, 0, 2, 8).tolist() == [[0, -1], [3, -1], [-1, -1]]
    assert to_local_expert_ids(ids, 1, 2, 8).tolist() == [[-1, 1], [-1, 0], [3, -1]]
    assert to_local_expert_ids(ids, 0, 1, 8).tolist() == ids.tolist()
    for bad in [(0, 3, 8), (2, 2, 8), (-1, 2, 8), (0, 0, 8)]:
        with pytest.raises(ValueError):
            to_local_expert_ids(ids, *bad)


def test_gate_up_half():
    assert GATE_UP_HALVES == {"gate": 0, "up": 1}
    assert gate_up_half("gate", 768) == (0, 768)
    assert gate_up_half("up", 768) == (768, 1536)
    with pytest.raises(KeyError):
        gate_up_half("down", 768)


# ---- the Triton op against the torch reference ----------------------------------------------------
# slot 0 is the base model (rank 0 everywhere); each adapter has experts it does not train (rank 0)
RANKS = [[0, 0, 0, 0], [16, 0, 3, 7], [1, 5, 0, 16]]
SCALINGS = [NAN, 0.5, 2.0]  # the base slot's scaling is never read: rank 0 adds exactly nothing


def _pool(g, ranks, stack, d_in, d_out, dtype, device, max_rank=16):
    """A [S, E, stack*max_rank, in], B [S, E, out, max_rank]; NaN past each group's rank."""
    S, E = len(ranks), len(ranks[0])
    A = torch.randn(S, E, stack * max_rank, d_in, generator=g) * d_in ** -0.5
    B = torch.randn(S, E, d_out, max_rank, generator=g) * max_rank ** -0.5
    for s in range(S):
        for e in range(E):
            A[s, e, stack * ranks[s][e]:] = NAN
            B[s, e, :, ranks[s][e]:] = NAN
    return A.to(dtype).to(device), B.to(dtype).to(device)


def _routing(g, num_tokens, top_k, num_experts, num_slots, crowd=36):
    """topk_ids (distinct experts per token, some -1) and slots; the first ``crowd`` tokens run
    (slot 1, expert 0) first, so that group spans more than two blocks of 16."""
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]) \
        if num_tokens else torch.zeros(0, top_k, dtype=torch.long)
    slots = torch.randint(0, num_slots, (num_tokens,), generator=g, dtype=torch.int32)
    crowd = min(crowd, num_tokens * 3 // 4)
    ids[:crowd] = torch.where(ids[:crowd] == 0, ids[:crowd, :1], ids[:crowd])  # keep experts distinct
    ids[:crowd, 0] = 0
    slots[:crowd] = 1
    ids[1::5, -1] = -1  # experts held by another EP rank
    return ids, slots


def _untouched(ids, slots, ranks):
    """[num_pairs] bool: pairs that must add exactly nothing (expert -1, rank 0, the base slot)."""
    r = torch.tensor(ranks)
    rank = r[slots.long().view(-1, 1).expand_as(ids), ids.clamp(min=0)]
    return ((ids < 0) | (rank == 0)).view(-1)


def _problem(seed, dtype, rows_per_pair, stack, weighted, num_tokens=48, top_k=2, width=40, d_in=40):
    g = torch.Generator().manual_seed(seed)
    device = TRITON_DEVICE
    E, S = len(RANKS[0]), len(RANKS)
    ids, slots = _routing(g, num_tokens, top_k, E, S)
    A, B = _pool(g, RANKS, stack, d_in, stack * width, dtype, device)
    pairs = num_tokens * top_k
    x = torch.randn(pairs if rows_per_pair else num_tokens, d_in, generator=g).to(dtype).to(device)
    base = torch.randn(pairs, stack * width, generator=g).to(dtype).to(device)
    weights = torch.rand(num_tokens, top_k, generator=g).to(device) if weighted else None
    offsets = tuple(range(0, stack * width + 1, width)) if stack > 1 else None
    args = dict(x=x, A=A, B=B, topk_ids=ids.to(device), token_slots=slots.to(device),
                lora_ranks=torch.tensor(RANKS, dtype=torch.int32, device=device),
                scalings=torch.tensor(SCALINGS, device=device), top_k=top_k, rows_per_pair=rows_per_pair,
                slice_offsets=offsets, topk_weights=weights)
    return args, base


def _close(got, exp, dtype):
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), exp.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["no_weights", "topk_weights"])
@pytest.mark.parametrize("stack", [1, 2], ids=["one_slice", "gate_up"])
@pytest.mark.parametrize("rows_per_pair", [False, True], ids=["token_rows", "pair_rows"])
def test_fused_moe_lora_matches_torch_ref(rows_per_pair, stack, weighted, dtype):
    args, base = _problem(7 + 2 * stack + rows_per_pair, dtype, rows_per_pair, stack, weighted)
    expected = fused_moe_lora_torch(out=base.clone(), **args)
    got = fused_moe_lora(out=base.clone(), **args, **SMALL_BLOCKS)
    assert not torch.isnan(expected).any()  # the reference never reads the NaN padding either
    _close(got, expected, dtype)
    untouched = _untouched(args["topk_ids"].cpu(), args["token_slots"].cpu(), RANKS).to(base.device)
    assert untouched.any() and (~untouched).any()
    assert torch.equal(got[untouched], base[untouched])  # base slot, rank-0 experts, expert -1: bit-exact
    aligned = align_moe_lora(args["topk_ids"], args["token_slots"], args["lora_ranks"], 16)
    assert (aligned.block_ids == 1 * len(RANKS[0]) + 0).sum() >= 3  # the crowded group spans >= 3 blocks
    flat_ranks = args["lora_ranks"].reshape(-1)
    assert bool((flat_ranks[aligned.block_ids.long()] > 0).all())  # no program for a rank-0 group


def test_fused_moe_lora_default_blocks_and_precomputed_alignment():
    args, base = _problem(3, torch.float32, False, 2, True)
    expected = fused_moe_lora_torch(out=base.clone(), **args)
    _close(fused_moe_lora(out=base.clone(), **args), expected, torch.float32)
    aligned = align_moe_lora(args["topk_ids"], args["token_slots"], args["lora_ranks"], 32)
    _close(fused_moe_lora(out=base.clone(), **args, aligned=aligned), expected, torch.float32)
    with pytest.raises(ValueError, match="block_m"):
        fused_moe_lora(out=base.clone(), **args, aligned=aligned, block_m=16)


def test_align_moe_lora_checks_slots_so_an_aligned_launch_reads_no_device_value(monkeypatch):
    """align_moe_lora validates token_slots (it synchronizes anyway); a launch given its alignment
    does not read them again, which is what lets it run inside a CUDA graph capture."""
    args, base = _problem(4, torch.float32, False, 2, True, num_tokens=8)
    for bad in (-1, args["A"].shape[0]):
        with pytest.raises(ValueError, match="token_slots"):
            align_moe_lora(args["topk_ids"], torch.full_like(args["token_slots"], bad), args["lora_ranks"], 16)
    aligned = align_moe_lora(args["topk_ids"], args["token_slots"], args["lora_ranks"], 16)
    expected = fused_moe_lora_torch(out=base.clone(), **args)

    def no_device_read(*_):
        raise AssertionError("the launch read token_slots although an alignment was given")
    monkeypatch.setattr(moe_lora_module, "check_token_slots", no_device_read)
    _close(fused_moe_lora(out=base.clone(), **args, aligned=aligned), expected, torch.float32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_fused_moe_lora_captured_in_a_cuda_graph_replays_new_values():
    args, base = _problem(9, torch.bfloat16, True, 1, True)
    aligned = align_moe_lora(args["topk_ids"], args["token_slots"], args["lora_ranks"], 16)
    out = base.clone()
    fused_moe_lora(out=out, **args, aligned=aligned)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    out.copy_(base)
    with torch.cuda.graph(graph):
        fused_moe_lora(out=out, **args, aligned=aligned)
    args["x"].copy_(torch.randn_like(args["x"]))  # new activations, same routing: replay reads them in place
    out.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    _close(out, fused_moe_lora_torch(out=base.clone(), **args), torch.bfloat16)


def test_align_moe_lora_running_example():
    aligned = align_moe_lora(torch.tensor([[1], [0], [1]]), torch.tensor([1, 0, 1]), torch.tensor([[0, 0], [4, 4]]), 2)
    assert aligned.sorted_pair_ids.tolist() == [0, 2] and aligned.block_ids.tolist() == [3]


def test_moe_backends_are_the_torch_reference_and_the_triton_op():
    from reference.moe.layers import MOE_LORA_OPS

    assert dict(MOE_LORA_OPS) == {"torch": fused_moe_lora_torch, "triton": fused_moe_lora}


def test_fused_moe_lora_distinct_ranks_per_slice_layout():
    """Two slices of unequal width (a gate|up table need not be symmetric) and an adapter whose
    rank-16 expert is the only one: parts are packed at the group's own rank."""
    args, base = _problem(11, torch.float32, False, 2, False, num_tokens=20, width=40)
    args["slice_offsets"] = (0, 24, 80)
    _close(fused_moe_lora(out=base.clone(), **args, **SMALL_BLOCKS), fused_moe_lora_torch(out=base.clone(), **args),
           torch.float32)


def test_fused_moe_lora_empty_batch_and_all_base():
    args, base = _problem(5, torch.float32, False, 1, True, num_tokens=0)
    assert fused_moe_lora(out=base, **args).shape == (0, 40)
    args, base = _problem(5, torch.float32, True, 1, False, num_tokens=6)
    args["token_slots"] = torch.zeros_like(args["token_slots"])  # every token on the base model
    assert torch.equal(fused_moe_lora(out=base.clone(), **args), base)


def test_fused_moe_lora_rejects_bad_arguments():
    args, base = _problem(6, torch.float32, False, 2, True, num_tokens=4)
    bad = [
        dict(x=args["x"][:, :-1]),  # x's width != A's input
        dict(x=args["x"][:-1]),  # token rows != num_tokens
        dict(rows_per_pair=True),  # x has token rows, not pair rows
        dict(top_k=3),
        dict(slice_offsets=(0, 40)),  # A holds two slices
        dict(slice_offsets=(0, 50, 40)),
        dict(topk_weights=torch.rand(4, 3)),
        dict(lora_ranks=args["lora_ranks"][:, :2]),
        dict(scalings=args["scalings"][:2]),
        dict(topk_ids=torch.full_like(args["topk_ids"], 4)),  # expert id past the buffers' 4 experts
        dict(A=args["A"].double()),  # A of another dtype than x
        dict(token_slots=torch.full_like(args["token_slots"], args["A"].shape[0])),  # a slot past the buffers
        dict(token_slots=torch.full_like(args["token_slots"], -1)),
        dict(block_m=8),
        dict(block_n=24),
    ]
    for change in bad:
        with pytest.raises(ValueError):
            fused_moe_lora(out=base.clone(), **{**args, **change})
    with pytest.raises(ValueError):
        fused_moe_lora(out=base[:, :-1].clone(), **args)


# ---- expert parallelism: two simulated ranks ------------------------------------------------------
def test_expert_parallel_local_and_global_conventions_sum_to_the_single_rank_result():
    """Each EP rank holds half the experts' LoRA weights. (a) local ids: buffers of E/2 experts,
    ids from to_local_expert_ids; (b) global ids: buffers of all E experts, only the rank's half
    filled (the rest zero, rank 0), ids global with the other half set to -1. Both sum over the
    ranks to the single-rank result; local ids into global buffers read other experts' weights."""
    dtype, ep_size = torch.float32, 2
    args, base = _problem(21, dtype, False, 2, True, num_tokens=24)
    A, B, ranks, ids = args["A"].nan_to_num(0.0), args["B"].nan_to_num(0.0), args["lora_ranks"], args["topk_ids"]
    args.update(A=A, B=B)
    E = A.shape[1]
    per = E // ep_size
    single = fused_moe_lora(out=base.clone(), **args)
    zeros = torch.zeros_like(base)
    local_sum, global_sum, wrong_sum = base.clone(), base.clone(), base.clone()
    for q in range(ep_size):
        mine = slice(q * per, (q + 1) * per)
        local_ids = to_local_expert_ids(ids, q, ep_size, E)
        local = dict(args, A=A[:, mine].contiguous(), B=B[:, mine].contiguous(),
                     lora_ranks=ranks[:, mine].contiguous(), topk_ids=local_ids)
        local_sum += fused_moe_lora(out=zeros.clone(), **local)
        held = torch.zeros(E, dtype=torch.bool, device=A.device)
        held[mine] = True
        glob = dict(args, A=A * held.view(1, E, 1, 1), B=B * held.view(1, E, 1, 1),
                    lora_ranks=ranks * held.view(1, E), topk_ids=torch.where(local_ids >= 0, ids, -1))
        global_sum += fused_moe_lora(out=zeros.clone(), **glob)
        wrong_sum += fused_moe_lora(out=zeros.clone(), **dict(glob, topk_ids=local_ids))
        assert torch.equal(torch.where(local_ids >= 0, local_ids + q * per, -1), glob["topk_ids"])
    _close(local_sum, single, dtype)
    _close(global_sum, single, dtype)
    assert (wrong_sum - single).abs().max() > 1e-2  # the wrong pairing gives another result


# Offsets past 2^31 elements: tests/test_triton_ops.py::test_offsets_past_2_31_elements_in_every_kernel_and_argument
# lays out every tensor argument of the MoE op (both roles) far along each dimension, with the other ops.


# ---- adapter sizes ---------------------------------------------------------------------------------
TINY = dict(hidden_size=8, intermediate_size=10, moe_intermediate_size=6, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1)


def test_moe_adapter_bytes_by_hand_for_a_tiny_config():
    # head_dim 4: q 8->8, k 8->4, v 8->4, o 8->8; experts 8->6 (gate, up), 6->8 (down); dense 8->10, 10->8
    r, el = 2, 2
    got = moe_adapter_bytes(TINY, r, ["q_proj", "v_proj", "gate_proj", "down_proj"], dtype_bytes=el)
    attn = 3 * (r * (8 + 8) + r * (8 + 4)) * el  # 3 layers
    routed = 2 * 4 * (r * (8 + 6) + r * (6 + 8)) * el  # 2 MoE layers x 4 experts
    shared = 2 * (r * (8 + 6) + r * (6 + 8)) * el  # 1 shared expert of width 1 x 6
    dense = 1 * (r * (8 + 10) + r * (10 + 8)) * el  # first_k_dense_replace = 1
    assert got == dict(attention=attn, routed_experts=routed, shared_experts=shared, dense_mlp=dense,
                       total=attn + routed + shared + dense)
    assert lora_bytes((8, 6), r, el) == r * 14 * el
    assert moe_adapter_bytes(TINY, r, [])["total"] == 0
    assert moe_adapter_bytes(dict(TINY, head_dim=16), 1, ["o_proj"], 1)["attention"] == 3 * (32 + 8)


def test_moe_adapter_bytes_of_published_configs():
    mlp = ["gate_proj", "up_proj", "down_proj"]
    mixtral = moe_adapter_bytes(MIXTRAL_8X7B, 16, mlp)
    assert mixtral["routed_experts"] == 32 * 8 * 3 * 16 * (4096 + 14336) * 2  # 453 MB
    assert mixtral["shared_experts"] == mixtral["dense_mlp"] == mixtral["attention"] == 0
    assert moe_adapter_bytes(MIXTRAL_8X7B, 16, ["k_proj"])["attention"] == 32 * 16 * (4096 + 1024) * 2
    assert moe_adapter_bytes(QWEN3_30B_A3B, 16, ["q_proj"])["attention"] == 48 * 16 * (2048 + 4096) * 2
    assert moe_adapter_bytes(QWEN3_30B_A3B, 16, mlp)["total"] == 48 * 128 * 3 * 16 * (2048 + 768) * 2
    ds = moe_adapter_bytes(DEEPSEEK_V3, 16, mlp + ["q_a_proj", "kv_b_proj"])
    assert ds["dense_mlp"] == 3 * 3 * 16 * (7168 + 18432) * 2
    assert ds["routed_experts"] == 58 * 256 * 3 * 16 * (7168 + 2048) * 2
    assert ds["shared_experts"] == 58 * 3 * 16 * (7168 + 2048) * 2
    assert ds["attention"] == 61 * 16 * ((7168 + 1536) + (512 + 128 * 256)) * 2
    with pytest.raises(ValueError):
        moe_adapter_bytes(DEEPSEEK_V3, 16, ["q_proj"])  # MLA with a q LoRA rank has no q_proj
    with pytest.raises(ValueError):
        moe_adapter_bytes(MIXTRAL_8X7B, 16, ["gate"])  # the router is not a target
