"""The pool on the grading device: slots loaded through prepare_lora_batch feed the Triton ops.

On a GPU this is the pool's CUDA path (buffers, lora_ranks and scalings on the device, loads by
copy_ into device slots); on the CPU the same test runs the kernels in Triton's interpreter.
"""
import pytest
import torch

from reference.batch_info import build_batch_info
from reference.device import default_device
from reference.mem_pool import LoRAAdapter, LoRAMemoryPool, ModuleSpec
from reference.ops import expand, shrink

QKV = ModuleSpec("qkv_proj", 32, (32, 8, 8))


def _adapter(uid, rank, parts, seed):
    """A fused q/k/v adapter with the listed parts (others zero), packed at its rank."""
    g = torch.Generator().manual_seed(seed)
    A = torch.zeros(3 * rank, 32)
    B = torch.zeros(48, rank)
    offs = QKV.slice_offsets
    for p in parts:
        A[p * rank:(p + 1) * rank] = torch.randn(rank, 32, generator=g) / 6
        B[offs[p]:offs[p + 1]] = torch.randn(offs[p + 1] - offs[p], rank, generator=g) / 2
    return LoRAAdapter(uid, rank, 0.5 * (seed + 1), {(0, "qkv_proj"): (A, B)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pool_slots_drive_the_kernels_on_the_device(dtype):
    device = default_device()
    adapters = {"a": _adapter("a", 4, [0, 1, 2], 0), "b": _adapter("b", 2, [0, 2], 1), "c": _adapter("c", 8, [1], 2)}
    pool = LoRAMemoryPool([QKV], 1, 3, 8, dtype=dtype, device=device, adapter_source=adapters.__getitem__)
    pool.prepare_lora_batch(["a", "c"])
    slots = pool.prepare_lora_batch(["b", None])  # evicts one of a/c: the zero-fill is exercised
    assert pool.A_buffer["qkv_proj"][0].device.type == device.type
    lens, uids = [3, 2, 4], ["b", None, "b"]
    info = build_batch_info(lens, [slots[u] for u in uids], pool.lora_ranks.tolist(), pool.scalings.tolist(), device)
    x = torch.randn(sum(lens), 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    base = torch.randn(sum(lens), 48, generator=torch.Generator().manual_seed(4)).to(dtype)
    t = torch.full((sum(lens), 3 * 8), float("nan"), dtype=dtype, device=device)
    shrink(x.to(device), pool.A_buffer["qkv_proj"][0], info, t, stack_num=3)
    out = expand(t, pool.B_buffer["qkv_proj"][0], info, base.clone().to(device), QKV.slice_offsets).cpu()
    A, B = adapters["b"].weights[(0, "qkv_proj")]
    expected = base.float().clone()
    rows = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
    for p, (lo, hi) in enumerate(zip(QKV.slice_offsets[:-1], QKV.slice_offsets[1:])):
        expected[rows, lo:hi] += 1.0 * (x[rows].float() @ A[p * 2:(p + 1) * 2].T) @ B[lo:hi].T
    tol = 1e-4 if dtype == torch.float32 and device.type == "cpu" else 2e-2
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
    assert torch.equal(out[~rows], base[~rows])  # base rows bit for bit
    assert torch.equal(out[rows, 32:40], base[rows, 32:40])  # b has no k part: its k columns unchanged
