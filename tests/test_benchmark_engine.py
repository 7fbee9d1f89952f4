"""The engine benchmark's decode-step breakdown (benchmarks/benchmark_engine.py, issue #30): which
kernels count toward which class and floor, read from a torch.profiler trace's events."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchmark_engine import adapter_bytes, decode_breakdown, decode_ranges, kernel_class, lora_backend  # noqa: E402

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, start, duration, device=CUDA):
    return SimpleNamespace(name=lambda: name, start_ns=lambda: start, duration_ns=lambda: duration,
                           device_type=lambda: device)


def _trace(events):
    return SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))


@pytest.mark.parametrize("name, label", [
    ("_paged_attention_kernel", "attention"), ("flash_fwd_splitkv_kernel", "attention"),
    ("_merge_splits_kernel", "attention"),  # paged attention's flash-decoding merge, not LoRA's
    ("_bgmv_shrink_sorted_kernel", "lora"), ("_sgmv_expand_kernel", "lora"), ("_fused_decode_kernel", "lora"),
    ("nvjet_sm90_tst_112x128_64x7_2x1_v_bz_TNN", "gemm"), ("void cutlass::Kernel2<cutlass_80_tensorop>", "gemm"),
    ("void at::native::reduce_kernel<512, 1, MeanOps>", "other")])
def test_kernel_class_by_name(name, label):
    assert kernel_class(name) == label


def test_decode_breakdown_per_step_clipped_to_the_decode_steps():
    """Two decode steps of 10 us (ns units below) and one prefill step, each an engine_step range: kernels
    of the prefill step do not count, a kernel straddling a range's end counts for its inside part,
    two overlapping kernels count once in the busy time (each in its class), the host time is the wall
    time no kernel covers, and the floors come from the bytes over the bandwidth (the mean KV)."""
    events = [_event("engine_step", 0, 10_000, CPU), _event("engine_step", 20_000, 10_000, CPU),
              _event("engine_step", 40_000, 10_000, CPU),
              _event("_paged_attention_kernel", 1_000, 4_000), _event("nvjet_gemm", 5_000, 2_000),
              _event("_sgmv_shrink_kernel", 6_000, 2_000),  # overlaps the GEMM by 1 us
              _event("_paged_attention_kernel", 21_000, 2_000), _event("_sgmv_shrink_kernel", 28_000, 4_000),
              _event("nvjet_gemm", 41_000, 8_000),  # the prefill step's: not counted
              # kineto's GPU-timeline mirrors of the record_function ranges: neither steps nor kernels
              _event("engine_step", 1_000, 6_000), _event("engine_step", 21_000, 11_000)]
    out = decode_breakdown(_trace(events), [100, 300, None], dict(weights=2e9, kv_per_position=1e6, bandwidth=1e12))
    assert out["decode_steps"] == 2 and out["wall_ms"] == pytest.approx(0.010)
    assert out["gpu_ms"] == {"attention": pytest.approx(0.003), "gemm": pytest.approx(0.001),
                             "lora": pytest.approx(0.002)}  # 6 + 2 + (2 + 2 of 4) us over two steps
    assert out["gpu_busy_ms"] == pytest.approx(0.0055)  # 1..8 and 21..23 and 28..30 us: 11 us over two steps
    assert out["host_ms"] == pytest.approx(0.0045)
    ranges = decode_ranges(_trace(events), [100, 300, None])
    assert ranges == [(0, 10_000), (20_000, 30_000)]
    assert out["gpu_busy_ms"] / out["wall_ms"] == pytest.approx(11 / 20)  # profiled_busy's fraction
    assert out["floor_ms"] == {"gemm": pytest.approx(2.0), "attention": pytest.approx(0.2)}
    # the kernels by time per decode step, their launches per step; the prefill step's GEMM not counted
    assert [(k["name"], k["kind"], k["launches_per_step"]) for k in out["top_kernels"]] == [
        ("_paged_attention_kernel", "attention", 1.0), ("_sgmv_shrink_kernel", "lora", 1.0), ("nvjet_gemm", "gemm", 0.5)]
    assert out["top_kernels"][0]["ms"] == pytest.approx(0.003)
    assert out["launches_per_step"] == {"attention": 1.0, "gemm": 0.5, "lora": 1.0}  # 2, 1 and 2 over two steps
    # with the adapters each decode step reads (the prefill step's entry ignored): their bytes' floor
    lora = decode_breakdown(_trace(events), [100, 300, None], dict(weights=2e9, kv_per_position=1e6, bandwidth=1e12,
                                                                   lora_per_adapter=1e8), step_adapters=[2, 4, 9])
    assert lora["floor_ms"]["lora"] == pytest.approx(0.3)  # (2 + 4) / 2 adapters x 100 MB at 1 TB/s
    assert decode_breakdown(_trace(events), [None, None, None], None) is None  # no decode step
    with pytest.raises(ValueError, match="3 engine_step ranges in the trace but 2 steps"):
        decode_breakdown(_trace(events), [100, 300], None)


@pytest.mark.parametrize("overlap", [False, True])
def test_profiled_busy_labels_every_loop_iteration(overlap):
    """profiled_busy on a real (tiny, CPU) engine: one labelled range per iteration of generate()'s
    loop, plain or overlapped (an overlapped iteration launches step N+1 and records N; before this,
    the overlapped loop was never labelled and the H100 run raised "0 engine_step ranges"), and its
    decode ranges are the iterations that launched a decode step."""
    from benchmark_engine import profiled_busy
    from reference.engine import LLM, EngineConfig, SamplingParams
    from reference.engine.tiny import tiny_llama

    llm = LLM(tiny_llama(), EngineConfig(max_num_seqs=4, num_kv_blocks=32, block_size=4, overlap_decode=overlap),
              device="cpu")
    prompts = [[3, 4, 5], [6, 7, 8, 9, 10]]
    params = SamplingParams(max_new_tokens=6)
    busy, breakdown, prefill = profiled_busy(llm, prompts, params, [None, None])
    launched = llm.stats["decode_steps"]
    # the prompts' steps: one prefill step of both prompts (8 tokens), its own range
    assert prefill["steps"] == llm.stats["prefill_steps"] + llm.stats["mixed_steps"] == 1 and prefill["prompt_tokens"] == 8
    assert "floor_ms" not in prefill and prefill["wall_ms"] > 0
    # plain: every decode step is one range; overlapped: the last one is recorded by an iteration that
    # launches nothing (no decode range of its own)
    assert breakdown["decode_steps"] == launched and launched >= 4
    assert busy == 0.0 and breakdown["host_ms"] == breakdown["wall_ms"] > 0  # no CUDA kernel on the CPU
    assert llm._step.__func__ is LLM._step and llm._overlap_step.__func__ is LLM._overlap_step  # restored


def test_adapter_bytes_counts_a_and_b_of_every_module_and_layer():
    from reference.mem_pool import ModuleSpec

    mods = (ModuleSpec("qkv_proj", 4096, (4096, 1024, 1024)), ModuleSpec("o_proj", 4096, (4096,)),
            ModuleSpec("gate_up_proj", 4096, (14336, 14336)), ModuleSpec("down_proj", 14336, (4096,)))
    # Llama-3-8B, rank 16, bf16: A [3r, 4096] + B [6144, r]; [r, 4096] + [4096, r]; [2r, 4096] + [28672, r];
    # [r, 14336] + [4096, r]
    per_layer = 16 * 2 * ((3 * 4096 + 6144) + (4096 + 4096) + (2 * 4096 + 28672) + (14336 + 4096))
    assert adapter_bytes(mods, 8, 16, 2) == 8 * per_layer == 20 * 2**20


def test_decode_shrink_splits_replace_only_the_split_k_of_the_devices_backend():
    """--decode-shrink-splits S: the device's backend ("triton" on CUDA, "torch" elsewhere) with every
    decode shrink split into S pieces, whatever the shape (tests/test_layers.py checks what a layer
    does with a backend's split_k); without it, the backend's name, so the engine takes its own."""
    from reference.layers import get_backend

    assert lora_backend(torch.device("cpu"), None) == "torch"
    assert lora_backend(torch.device("cuda"), None) == "triton"
    for device, name in (("cpu", "torch"), ("cuda", "triton")):
        for S in (1, 4):
            backend = lora_backend(torch.device(device), S)
            assert backend._replace(split_k=None) == get_backend(name)._replace(split_k=None), "only split_k may differ"
            assert {backend.split_k(n, k, w) for n, k, w in ((1, 64, 16), (256, 4096, 48), (64, 14336, 32))} == {S}
