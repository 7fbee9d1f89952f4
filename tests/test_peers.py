"""The peers' decode LoRA ops (benchmarks/peers.py: SGLang 0.5.23 "triton" and "csgmv", vLLM 0.33.0)
compute what the book's fp32 reference computes, alone and inside a Llama decode step: a peer is
timed beside the layers (benchmarks/benchmark_decode_step.py --peers) only if it is right.

Needs the peers cache (``python benchmarks/peers.py fetch``, where PyPI is reachable; ``.peers`` is
carried to a GPU machine); skipped without it. On a machine without CUDA the kernels run in Triton's
interpreter (``import reference`` sets it): SGLang's in fp32; vLLM's in fp16, because its shrink
asserts fp16 / bf16 inputs and the interpreter does not compute bf16 right. All of them run there
(vLLM's take 40-90 s on 2 cores: its default split-K of 64 launches thousands of programs, each
interpreted); on a GPU the same tests run compiled, in bf16 too, and the decode step in CUDA graphs.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import reference
from reference.cuda_graph import DecodeGraphRunner
from reference.layers import LoRAContext, unwrap_llama, wrap_llama
from reference.mem_pool import LoRAMemoryPool

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers  # noqa: E402

if not peers.available():
    pytest.skip("no peers cache (.peers): python benchmarks/peers.py fetch", allow_module_level=True)
CUDA = torch.cuda.is_available()
if not CUDA and not reference.interpreting():
    pytest.skip("no CUDA device and TRITON_INTERPRET is not 1: the peers' kernels cannot run",
                allow_module_level=True)
peers.load()
DEVICE = torch.device("cuda" if CUDA else "cpu")

# relative error (largest |delta - fp32 reference| / largest |reference|) by input dtype; fp32 on a GPU
# is TF32 inside tl.dot (both peers' default)
TOLERANCE = {torch.float32: 5e-3 if CUDA else 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
CASES = [("sglang-triton", torch.float32), ("sglang-csgmv", torch.float32), ("vllm", torch.float16)]
if CUDA:
    CASES += [(name, torch.bfloat16) for name in peers.PEER_NAMES]


def test_cache_holds_only_the_listed_modules_and_stubs():
    """What fetch wrote: the listed files of each wheel, byte for byte as the manifest says, stubs
    marked as the book's, and nothing else; git ignores it."""
    import json

    manifest = json.loads((peers.DEFAULT_DEST / "MANIFEST.json").read_text())
    assert manifest["versions"] == peers.VERSIONS
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {str(p.relative_to(peers.DEFAULT_DEST)) for p in peers.DEFAULT_DEST.rglob("*") if p.is_file()}
    assert on_disk - set(listed) == {"MANIFEST.json", ".gitignore"}
    for path, f in listed.items():
        assert (peers.DEFAULT_DEST / path).stat().st_size == f["bytes"]
        if f["origin"] == "wheel":
            kind, rest = path.split("/", 1)
            name = rest.split("/", 1)[0]
            wanted = peers.LIB_FILES[name] if kind == "lib" else peers.SOURCE_FILES[name]
            assert any(rest == w or (w.endswith("/") and rest.startswith(w)) for w in wanted), path
        else:
            assert (peers.DEFAULT_DEST / path).read_text().startswith('"""Stub written by benchmarks/peers.py')
    assert manifest["total_bytes"] < 2_000_000
    if (ROOT / ".git").exists():  # a device machine may get the working tree without .git
        ignored = subprocess.run(["git", "check-ignore", "-q", str(peers.DEFAULT_DEST / "MANIFEST.json")], cwd=ROOT)
        assert ignored.returncode == 0


def test_the_ops_come_from_the_cache():
    import sglang
    import vllm
    from sglang.kernels.ops.lora.dense import sgemm_lora_a
    from vllm.lora.ops.triton_ops import lora_shrink_op

    lib = str(peers.DEFAULT_DEST.resolve() / "lib")
    for mod in (sglang, vllm, sgemm_lora_a, lora_shrink_op):
        assert mod.__file__.startswith(lib)
    assert (sglang.__version__, vllm.__version__) == (peers.VERSIONS["sglang"], peers.VERSIONS["vllm"])


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_peer_delta_matches_the_fp32_reference(name, dtype):
    """q/k/v (unequal widths), gate/up, o, down; slots of rank 0 (base), full and half rank with
    distinct scalings; NaN past every rank (never read); tokens of every slot interleaved."""
    if name == "vllm" and not CUDA:
        groups = ["qkv_proj", "down_proj"]  # three slices through its pointer tables; one slice, K=96
    else:
        groups = None
    ranks, scalings, slots, data = peers.tiny_case(DEVICE, dtype)
    peer = peers.make_peer(name, len(ranks), 32, 16, DEVICE)
    peer.prepare(slots, ranks, scalings)
    for gname, (group, x, A, B) in data.items():
        if groups is not None and gname not in groups:
            continue
        err = peers.check_delta(peer, x, A, B, group, slots, ranks, scalings, prepared=True)
        assert err <= TOLERANCE[dtype], f"{name} {gname} {dtype}: relative error {err:.3g}"


def test_the_check_sees_wrong_metadata():
    """The same SGLang op with the scalings or ranks its batch was prepared with changed: the check fails."""
    ranks, scalings, slots, data = peers.tiny_case(DEVICE, torch.float32)
    group, x, A, B = data["qkv_proj"]
    peer = peers.make_peer("sglang-triton", len(ranks), 32, 16, DEVICE)
    for bad_ranks, bad_scalings in ((ranks, [0.0, 1.0, 1.0, 1.0]), ([0, 16, 16, 16], scalings)):
        peer.prepare(slots, bad_ranks, bad_scalings)
        assert peers.check_delta(peer, x, A, B, group, slots, ranks, scalings, prepared=True) > 0.1


def _tiny_llama(dtype):
    import transformers

    from benchmark_decode_step import SMOKE, modules, random_adapter

    cfg = transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=16, **SMOKE)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        base = transformers.LlamaForCausalLM(cfg).to(dtype).eval()
    mods = modules(SMOKE)
    gen = torch.Generator().manual_seed(1)
    registry = {f"a{k}": random_adapter(f"a{k}", r, mods, 2, gen) for k, r in enumerate((8, 4, 8, 8))}
    registry["a1"] = dataclasses.replace(registry["a1"], scaling=0.5)  # rank 4 of 8, its own scaling
    pool = LoRAMemoryPool(mods, 2, 4, 8, dtype=dtype, device=DEVICE, adapter_source=registry.__getitem__)
    return base, pool


# step 1: three adapters and the base interleaved; step 2 loads a3 in place of one of them (a slot
# changes owner: vLLM's converted buffers must follow) and reads the cache step 1 wrote
STEPS = [["a0", None, "a1", "a0", "a2", None, "a1", "a2"], ["a3", "a1", None, "a3", "a1", "a1", None, "a3"]]


def _decode(runner):
    outs = []
    for step, uids in enumerate(STEPS):
        n = len(uids)
        outs.append(runner.decode([[3 * i + step] for i in range(n)], [step] * n, list(range(n)), uids).float())
    return outs


@pytest.mark.parametrize("name", peers.PEER_NAMES)
def test_peer_decode_step_matches_the_layers(name):
    """Two decode steps of a 2-layer Llama through the peer's runner (CUDA graphs on a GPU) against
    the book's layers with the torch reference backend on the same pool and inputs: logits agree."""
    if name == "vllm" and not CUDA:
        pytest.skip("vLLM's ops in the interpreter take minutes per step (the op test above covers them)")
    dtype = torch.float16 if name == "vllm" else torch.float32
    base, pool = _tiny_llama(dtype)
    ctx = LoRAContext()
    model = wrap_llama(base, pool, ctx, "torch")
    expected = _decode(DecodeGraphRunner(model, pool, ctx, max_seqs=8, max_len=16, buckets=(8,), use_graphs=False))
    unwrap_llama(model)
    peer = peers.make_peer(name, pool.num_slots, 8, pool.max_lora_rank, DEVICE)
    ctx = LoRAContext()
    model = peers.wrap_llama_peer(base, pool, ctx, peer)
    runner = peers.peer_graph_runner(model, pool, ctx, peer, max_seqs=8, max_len=16, buckets=(8,))
    got = _decode(runner)
    assert runner.replays["lora"] == 2
    tol = 1e-4 if dtype == torch.float32 and not CUDA else 2e-2
    for step, (g, e) in enumerate(zip(got, expected)):
        err = (g - e).abs().max().item() / e.abs().max().item()
        assert err <= tol, f"{name} step {step}: relative error {err:.3g}"
    unwrap_llama(model)
