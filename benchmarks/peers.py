"""The peers' decode LoRA kernels (SGLang 0.5.23, vLLM 0.33.0), fetched at run time (issue #35).

    python benchmarks/peers.py fetch [--wheels DIR] [--dest .peers]   # where PyPI is reachable (this machine)
    python benchmarks/peers.py check [--dest .peers]                  # every peer's delta against the fp32 reference

``fetch`` runs ``pip download --no-deps sglang==0.5.23 vllm==0.33.0`` into a temporary folder (or reads
the wheels already in ``--wheels``), extracts only the peers' dense LoRA op modules into ``.peers/lib``
(importable; about 0.1 MB of their code), the few framework files whose functions the adapters below
execute into ``.peers/sources`` (read as text, never imported; with the two layer files whose calls the
adapters mirror, SGLang's ``srt/lora/layers.py`` and vLLM's ``lora/layers/base_linear.py``, for
reading), writes small stubs of the book's own
for the framework modules the ops import, and ``.peers/MANIFEST.json`` (versions, wheel hashes, every
file and its origin). The wheels (375 MB) are deleted unless they were given. ``.peers`` is ignored by
git and is what a GPU machine without PyPI needs (carry it: ``run(..., carry=[".peers"])``). Nothing of
the peers is committed to this repository.

What is theirs and what is the book's: their Triton kernels and host launchers run unchanged, imported
from the wheel's files. The metadata preparation and the calls into the ops are their own methods too:
:func:`peer_class` compiles the named methods of their backend classes from the wheel's source
(SGLang's ``TritonLoRABackend`` / ``ChunkedSgmvLoRABackend``: ``init_decode_cuda_graph_batch_info``,
``prepare_lora_batch``, ``run_qkv_lora``, ...; vLLM's ``PunicaWrapperGPU``: ``add_lora_linear``,
``add_shrink``, ``add_expand``) onto a small shim class that stands for the framework around them
(server arguments, the forward batch, DP attention, MoE and lm_head LoRA, none of which a dense decode
step of a Llama uses). The stubs (``STUBS`` below): module skeletons, environment flags read with the
peers' defaults, ``get_device_name``, the device-capability questions of vLLM's ``current_platform``,
``async_tensor_h2d``, and two deliberate differences, both host-side only (a CUDA graph replays the
same kernels either way): vLLM's ops are called as plain functions, not through ``torch.ops.vllm``
custom-op registration (vLLM's own fallback when registration is unavailable), and SGLang's
``cached_triton_kernel`` is Triton's own launch cache (SGLang's fallback off CUDA; its CachedKernel only
skips Triton's Python dispatch).

Every peer is used through one interface (:class:`Peer`): ``weights(pool, module, layer)`` gives the
(module, layer) buffers in the peer's layout, converted from the book's pool (SGLang's layout is the
book's: the same tensors; vLLM's per-slice ``lora_a_stacked`` [max_loras, 1, max_rank, in] and
``lora_b_stacked`` [max_loras, 1, out_i, max_rank] with the scaling folded into B, as vLLM's
``LoRALayerWeights.optimize`` does, copied into fixed buffers on every slot change, as its ``set_lora``
does); ``prepare(token_slots, ranks, scalings)`` runs the peer's per-batch metadata preparation once per
step, outside the graph, into static buffers (graph mode, as both serve decode); ``apply(x, w, y)``
adds ``scaling * (x A^T) B^T`` of every token's slot into y [tokens, out_total] in place, the way the
peer's layer calls its ops for that projection group:

- vLLM (``vllm/lora/layers/base_linear.py`` ``_apply_lora_to_output``): ``punica_wrapper.add_lora_linear(
  y, x, lora_a_stacked, lora_b_stacked, 1.0, output_slices)``: ``lora_shrink`` of every slice into an
  fp32 buffer [slices, tokens, max_rank] (split-K with atomics, its default config by batch size), then
  one ``lora_expand`` of every slice into y; metadata from ``LoRAKernelMeta.prepare_tensors``
  (token_lora_mapping, tokens sorted by LoRA, counts, active ids), ``specialize_active_lora`` off.
- SGLang "triton" (``TritonLoRABackend``): at decode its ``prepare_lora_batch`` builds the
  adapter-merged segments (``_build_sgemm_routing``: argsort by slot, one segment per slot, a
  permutation); q/k/v: ``sgemm_lora_a_fwd`` (stack 3) + ``qkv_lora_b_fwd``; gate/up: ``sgemm_lora_a_fwd``
  (stack 2) + ``gate_up_lora_b_fwd``; o/down: ``sgemm_lora_a_fwd`` + ``sgemm_lora_b_fwd``.
- SGLang "csgmv" (``ChunkedSgmvLoRABackend``, SGLang's default backend): segments sorted by adapter and
  cut into chunks of ``max_lora_chunk_size`` (16, its default) on the host, ``chunked_sgmv_lora_shrink_
  forward`` + ``chunked_sgmv_lora_expand_forward`` for every projection group.

A projection group writes one output [tokens, out_total] (q|k|v, gate|up), as the peers' fused layers
do; :func:`wrap_llama_peer` gives the Hugging Face Llama's separate projections that layout for the
peers' rows of ``benchmarks/benchmark_decode_step.py --peers``: the first part's call runs every part's
own cuBLAS GEMM into its column slice of one buffer (``torch.mm(..., out=slice)``), then the peer's
group op, and each part returns its slice (the book's layers run one expand per part instead).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

import reference  # noqa: F401  (TRITON_INTERPRET without CUDA, before any kernel is decorated)
from reference.layers import LoRALinear, SharedShrink, _replace, _targets

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DEST = ROOT / ".peers"
VERSIONS = {"sglang": "0.5.23", "vllm": "0.33.0"}
PEER_NAMES = ("vllm", "sglang-triton", "sglang-csgmv")

# Imported from .peers/lib, extracted unchanged from the wheels ("dir/" = every file under it).
LIB_FILES = {
    "sglang": [
        "sglang/kernels/ops/lora/dense/__init__.py",
        "sglang/kernels/ops/lora/dense/kernel_utils.py",
        "sglang/kernels/ops/lora/dense/sgemm_lora_a.py",
        "sglang/kernels/ops/lora/dense/sgemm_lora_b.py",
        "sglang/kernels/ops/lora/dense/qkv_lora_b.py",
        "sglang/kernels/ops/lora/dense/gate_up_lora_b.py",
        "sglang/kernels/ops/lora/dense/chunked_sgmv_shrink.py",
        "sglang/kernels/ops/lora/dense/chunked_sgmv_expand.py",
        "sglang/kernels/ops/lora/dense/lora_tuning_config.py",
        "sglang/kernels/ops/lora/dense/csgmv_configs/",
    ],
    "vllm": [
        "vllm/lora/ops/triton_ops/lora_shrink_op.py",
        "vllm/lora/ops/triton_ops/lora_expand_op.py",
        "vllm/lora/ops/triton_ops/kernel_utils.py",
        "vllm/lora/ops/triton_ops/utils.py",
        "vllm/lora/ops/triton_ops/lora_kernel_metadata.py",
    ],
}
# Kept in .peers/sources as text: the adapters compile named functions out of them (peer_class).
SOURCE_FILES = {
    "sglang": [
        "sglang/srt/lora/backend/triton_backend.py",
        "sglang/srt/lora/backend/chunked_backend.py",
        "sglang/srt/lora/utils.py",
        "sglang/srt/lora/layers.py",
    ],
    "vllm": [
        "vllm/lora/punica_wrapper/punica_gpu.py",
        "vllm/lora/utils.py",
        "vllm/lora/layers/base_linear.py",
        "vllm/utils/math_utils.py",
    ],
}


# ---- fetch: wheels -> .peers ------------------------------------------------------------------------
def _top_level_defs(source: str, names: Sequence[str]) -> str:
    """The source text (decorators included) of the module-level classes / functions ``names``, in
    file order. Raises KeyError for a name the source does not define."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    found = {}
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name in names:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            found[node.name] = (start, "".join(lines[start - 1:node.end_lineno]))
    missing = set(names) - set(found)
    if missing:
        raise KeyError(f"not defined at the top level: {sorted(missing)}")
    return "\n\n".join(text for _, text in sorted(found.values()))


def _stubs(read: Callable[[str], str]) -> dict[str, str]:
    """Stub modules (path under lib/ -> text). ``read(path)`` gives a wheel file's text: the few
    definitions of theirs a stub carries (SGLang's LoRABatchInfo dataclass, two token-count helpers,
    vLLM's next_power_of_2) are copied from the wheel at fetch time, never committed."""
    head = '"""Stub written by benchmarks/peers.py (issue #35): {}"""\n'
    pkg = lambda what: head.format(what)  # noqa: E731
    sg_utils = _top_level_defs(read("sglang/srt/lora/utils.py"),
                               ["MoELoRABatchInfo", "LoRABatchInfo", "get_batch_token_counts",
                                "generate_sequence_lengths"])
    v_math = _top_level_defs(read("vllm/utils/math_utils.py"), ["next_power_of_2"])
    return {
        "sglang/__init__.py": pkg("the package skeleton.") + f'__version__ = "{VERSIONS["sglang"]}"\n',
        "sglang/kernels/__init__.py": pkg("the package skeleton."),
        "sglang/kernels/ops/__init__.py": pkg("the package skeleton."),
        "sglang/kernels/ops/lora/__init__.py": pkg("the package skeleton (SGLang's registers its kernels "
                                                   "in a kernel inventory, which nothing here reads)."),
        "sglang/srt/__init__.py": pkg("the package skeleton."),
        "sglang/srt/lora/__init__.py": pkg("the package skeleton."),
        "sglang/srt/lora/utils.py": pkg("SGLang's LoRABatchInfo (copied from the wheel at fetch time) and "
                                        "the two token-count helpers its backends' decode path calls.")
        + "from __future__ import annotations\n\nfrom dataclasses import dataclass\n"
          "from typing import List, Optional, Tuple\n\nimport torch\n\nForwardBatch = object\n\n\n"
        + sg_utils + "\n",
        "sglang/srt/environ.py": pkg("the environment flags the extracted ops read, with SGLang's "
                                     "defaults (sglang/srt/environ.py: EnvBool(False)).") + textwrap.dedent('''\
            import os


            class _EnvBool:
                def __init__(self, name, default):
                    self.name, self.default = name, default

                def get(self):
                    value = os.getenv(self.name)
                    if value is None:
                        return self.default
                    return value.lower() in ("true", "1", "yes", "y")

                def is_set(self):
                    return self.name in os.environ


            class envs:
                SGLANG_ENABLE_LORA_CSGMV_SPLIT_K = _EnvBool("SGLANG_ENABLE_LORA_CSGMV_SPLIT_K", False)
                SGLANG_ENABLE_DETERMINISTIC_INFERENCE = _EnvBool("SGLANG_ENABLE_DETERMINISTIC_INFERENCE", False)
                SGLANG_USE_CUSTOM_TRITON_KERNEL_CACHE = _EnvBool("SGLANG_USE_CUSTOM_TRITON_KERNEL_CACHE", False)
            '''),
        "sglang/srt/utils/__init__.py": pkg("get_device_name and cached_triton_kernel. cached_triton_kernel "
                                            "returns the kernel itself: Triton's own launch cache, SGLang's "
                                            "fallback off CUDA (its CachedKernel skips Triton's host-side "
                                            "dispatch only; a CUDA graph replays the same launches).")
        + textwrap.dedent('''\
            import torch


            def get_device_name(device_id: int = 0) -> str:
                return torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"


            def cached_triton_kernel(key_fn=None):
                return lambda fn: fn
            '''),
        "vllm/__init__.py": pkg("the package skeleton.") + f'__version__ = "{VERSIONS["vllm"]}"\n',
        "vllm/envs.py": pkg("the environment flags the extracted ops read, with vLLM's defaults "
                            "(vllm/envs.py).") + textwrap.dedent('''\
            import os

            VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
            VLLM_TUNED_CONFIG_FOLDER = os.getenv("VLLM_TUNED_CONFIG_FOLDER", None)
            VLLM_LORA_DISABLE_PDL = bool(int(os.getenv("VLLM_LORA_DISABLE_PDL", "0")))
            VLLM_LORA_ENABLE_DUAL_STREAM = bool(int(os.getenv("VLLM_LORA_ENABLE_DUAL_STREAM", "0")))
            '''),
        "vllm/logger.py": pkg("init_logger with vLLM's *_once methods.") + textwrap.dedent('''\
            import functools
            import logging


            class _Logger(logging.LoggerAdapter):
                @functools.lru_cache(maxsize=None)
                def warning_once(self, msg, *args):
                    self.warning(msg, *args)

                @functools.lru_cache(maxsize=None)
                def info_once(self, msg, *args):
                    self.info(msg, *args)


            def init_logger(name):
                return _Logger(logging.getLogger(name), {})
            '''),
        "vllm/platforms/__init__.py": pkg("current_platform: the CUDA and compute-capability questions the "
                                          "extracted ops ask.") + textwrap.dedent('''\
            import torch


            class _Platform:
                def is_cuda(self):
                    return torch.cuda.is_available() and torch.version.hip is None

                def get_device_capability(self):
                    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None

                def is_device_capability(self, capability):
                    cap = self.get_device_capability()
                    return cap is not None and cap[0] * 10 + cap[1] == capability

                def has_device_capability(self, capability):
                    cap = self.get_device_capability()
                    return cap is not None and cap[0] * 10 + cap[1] >= capability


            current_platform = _Platform()
            '''),
        "vllm/triton_utils/__init__.py": pkg("Triton itself.") + textwrap.dedent('''\
            import triton
            import triton.language as tl

            HAS_TRITON = True
            '''),
        "vllm/utils/__init__.py": pkg("the package skeleton."),
        "vllm/utils/math_utils.py": pkg("next_power_of_2, copied from the wheel at fetch time.") + v_math + "\n",
        "vllm/utils/torch_utils.py": pkg("async_tensor_h2d (a pinned host copy, copied without blocking) and "
                                         "direct_register_custom_op, which declines: the ops' modules then "
                                         "bind their plain functions (their own except-AttributeError "
                                         "fallback), without torch.ops.vllm dispatch.") + textwrap.dedent('''\
            import torch


            def async_tensor_h2d(data, device=None, dtype=None, out=None):
                if dtype is None and out is not None:
                    dtype = out.dtype
                pin = torch.cuda.is_available()
                t = torch.tensor(data, dtype=dtype, device="cpu", pin_memory=pin)
                if out is not None:
                    return out.copy_(t, non_blocking=True)
                return t.to(device=device, non_blocking=True)


            def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, target_lib=None):
                raise AttributeError("no custom-op registration in the book's stub")
            '''),
        "vllm/lora/__init__.py": pkg("the package skeleton."),
        "vllm/lora/ops/__init__.py": pkg("the package skeleton."),
        "vllm/lora/ops/triton_ops/__init__.py": pkg("the dense ops only (vLLM's also imports its MoE and fp8 "
                                                    "LoRA ops).") + textwrap.dedent('''\
            from vllm.lora.ops.triton_ops.lora_expand_op import lora_expand
            from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta
            from vllm.lora.ops.triton_ops.lora_shrink_op import lora_shrink

            __all__ = ["lora_expand", "lora_shrink", "LoRAKernelMeta"]
            '''),
    }


def _safe_to_replace(dest: Path) -> bool:
    return not dest.exists() or (dest / "MANIFEST.json").exists() or not any(dest.iterdir())


def fetch(dest: Path = DEFAULT_DEST, wheels: Optional[Path] = None) -> dict:
    """Download (or read from ``wheels``) the two wheels and write ``dest`` (lib/, sources/, MANIFEST.json).
    Returns the manifest. Raises SystemExit when ``dest`` holds something that is not a peers cache,
    or a wheel is missing."""
    dest = Path(dest)
    if not _safe_to_replace(dest):
        raise SystemExit(f"{dest} exists and is not a peers cache (no MANIFEST.json): not touching it")
    tmp = None
    if wheels is None:
        tmp = Path(tempfile.mkdtemp(prefix="peer-wheels-"))
        wheels = tmp
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(tmp),
               *(f"{name}=={version}" for name, version in VERSIONS.items())]
        print("running:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    try:
        files, wheel_info = {}, {}
        for name, version in VERSIONS.items():
            found = sorted(Path(wheels).glob(f"{name}-{version}-*.whl"))
            if not found:
                raise SystemExit(f"no {name}-{version}-*.whl in {wheels}")
            path = found[0]
            wheel_info[name] = dict(wheel=path.name, sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                                    bytes=path.stat().st_size)
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
                for kind, wanted in (("lib", LIB_FILES[name]), ("sources", SOURCE_FILES[name])):
                    for want in wanted:
                        hits = [n for n in names if (n.startswith(want) and not n.endswith("/"))
                                ] if want.endswith("/") else [want]
                        if not hits or any(h not in names for h in hits):
                            raise SystemExit(f"{want} is not in {path.name}")
                        for h in hits:
                            files[(kind, h)] = z.read(h)
        if dest.exists():
            shutil.rmtree(dest)
        by_path = {path: data for (kind, path), data in files.items() if kind == "sources"}
        stubs = _stubs(lambda p: by_path[p].decode())
        manifest_files = []
        for (kind, path), data in sorted(files.items()):
            out = dest / kind / path
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
            manifest_files.append(dict(path=f"{kind}/{path}", origin="wheel", bytes=len(data)))
        for path, text in sorted(stubs.items()):
            out = dest / "lib" / path
            if out.exists():
                raise SystemExit(f"a stub would replace the wheel's {path}")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text)
            manifest_files.append(dict(path=f"lib/{path}", origin="stub (benchmarks/peers.py)", bytes=len(text)))
        manifest = dict(versions=VERSIONS, wheels=wheel_info, files=manifest_files,
                        total_bytes=sum(f["bytes"] for f in manifest_files),
                        note="written by benchmarks/peers.py fetch; not part of the repository")
        (dest / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
        (dest / ".gitignore").write_text("*\n")
        return manifest
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# ---- load: .peers on sys.path, their methods on shims ---------------------------------------------
def available(dest: Path = DEFAULT_DEST) -> bool:
    """Whether ``dest`` holds a fetched peers cache."""
    return (Path(dest) / "MANIFEST.json").exists()


def load(dest: Path = DEFAULT_DEST) -> dict:
    """Put ``dest/lib`` first on sys.path and import both peers' op modules from it; returns the
    manifest. Must run after ``import reference`` (which sets TRITON_INTERPRET on a machine without
    CUDA before any kernel is decorated). Raises RuntimeError if sglang / vllm were already imported
    from elsewhere (an installed peer would shadow or mix with the extracted files)."""
    dest = Path(dest).resolve()
    if not available(dest):
        raise RuntimeError(f"no peers cache at {dest}: run python benchmarks/peers.py fetch")
    lib = str(dest / "lib")
    for name in VERSIONS:
        mod = sys.modules.get(name)
        if mod is not None and not str(getattr(mod, "__file__", "")).startswith(lib):
            raise RuntimeError(f"{name} is already imported from {mod.__file__}, not from {lib}")
    if lib not in sys.path:
        sys.path.insert(0, lib)
    import sglang.kernels.ops.lora.dense.chunked_sgmv_expand  # noqa: F401
    import sglang.kernels.ops.lora.dense.chunked_sgmv_shrink  # noqa: F401
    import vllm.lora.ops.triton_ops  # noqa: F401
    return json.loads((dest / "MANIFEST.json").read_text())


def peer_class(dest: Path, source: str, class_name: str, methods: Sequence[str], base: type,
               namespace: dict, constants: Sequence[str] = ()) -> type:
    """A class named ``class_name`` deriving from ``base`` (the book's shim) whose ``methods`` are the
    peer's own: compiled from ``dest/sources/source`` (the wheel's file) with ``namespace`` as their
    globals (it gets the module-level ``constants`` of the file and the new class under its name, for
    methods that call ``ClassName.helper``). Raises KeyError for a method or constant the file lacks."""
    import __future__

    text = (Path(dest) / "sources" / source).read_text()
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if getattr(target, "id", None) in constants:
            namespace[target.id] = ast.literal_eval(node.value)
    missing_constants = set(constants) - set(namespace)
    cls_node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name), None)
    if cls_node is None or missing_constants:
        raise KeyError(f"{source}: no class {class_name} or constants {sorted(missing_constants)}")
    body = {}
    for node in cls_node.body:
        if isinstance(node, ast.FunctionDef) and node.name in methods:
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            code = textwrap.dedent("".join(lines[start - 1:node.end_lineno]))
            local: dict = {}
            # annotations stay strings (ForwardBatch and friends are never resolved)
            exec(compile(code, f"{source}:{class_name}.{node.name}", "exec",
                         flags=__future__.annotations.compiler_flag, dont_inherit=True), namespace, local)
            body[node.name] = local[node.name]
    missing = set(methods) - set(body)
    if missing:
        raise KeyError(f"{source}: {class_name} has no {sorted(missing)}")
    cls = type(class_name, (base,), body)
    namespace[class_name] = cls
    return cls


class _NoPinTorch(types.ModuleType):
    """``torch`` for the peers' methods on a machine without CUDA: ``pin_memory=True`` is dropped
    (pinning needs an accelerator); everything else is torch."""

    def __init__(self):
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name):
        attr = getattr(self._torch, name)
        if name in ("tensor", "empty", "zeros", "ones", "full", "arange"):
            def no_pin(*args, **kwargs):
                kwargs.pop("pin_memory", None)
                return attr(*args, **kwargs)
            return no_pin
        return attr


def _torch_for_peers():
    return torch if torch.cuda.is_available() else _NoPinTorch()


# ---- the common interface -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Group:
    """A projection group of the book's pool (``reference.mem_pool.ModuleSpec``): its name, input
    width and the output widths of its parts (q, k, v or gate, up or one)."""
    name: str
    in_features: int
    out_features: tuple[int, ...]

    @property
    def offsets(self) -> tuple[int, ...]:
        out = [0]
        for w in self.out_features:
            out.append(out[-1] + w)
        return tuple(out)

    @classmethod
    def of(cls, spec) -> "Group":
        return cls(spec.name, spec.in_features, tuple(spec.out_features))


class Peer:
    """One peer's decode LoRA path. Subclasses: :class:`VLLMPeer`, :class:`SGLangPeer`.

    ``num_slots``: the book's pool slots (slot s of the book is the peer's adapter index s; a slot of
    rank 0 is "no LoRA"); ``max_tokens``: the largest decode batch (the graph's static buffers);
    ``max_rank``: the pool's max rank.
    """

    name = "peer"
    version = ""

    def __init__(self, num_slots: int, max_tokens: int, max_rank: int, device) -> None:
        self.num_slots, self.max_tokens, self.max_rank = num_slots, max_tokens, max_rank
        self.device = torch.device(device)

    def weights(self, A, B, group: Group, ranks: Sequence[int], scalings: Sequence[float]) -> Any:
        """The peer's buffers of one (module, layer) from the book's A [slots, stack*R, in] and B
        [slots, out_total, R] (ranks / scalings: the pool's host lists)."""
        raise NotImplementedError

    def reload(self, w: Any, A, B, group: Group, ranks, scalings) -> None:
        """After a slot changed owner: bring ``w`` up to date, in place (addresses fixed for graphs)."""

    def prepare(self, token_slots: Sequence[int], ranks: Sequence[int], scalings: Sequence[float],
                capture_tokens: Optional[int] = None) -> None:
        """The peer's per-batch metadata preparation for one decode step (one token per sequence),
        into its static buffers. ``capture_tokens``: instead, the state the peer captures a graph of
        that many tokens in (``token_slots`` ignored)."""
        raise NotImplementedError

    def apply(self, x, w: Any, y, group: Group) -> None:
        """y [tokens, out_total] += per token: scaling * (x A^T) B^T of its slot, for every part, as the
        peer's layer calls its ops (x [tokens, in], contiguous)."""
        raise NotImplementedError


class VLLMPeer(Peer):
    """vLLM 0.33.0: ``PunicaWrapperGPU.add_lora_linear`` over ``LoRAKernelMeta`` (see the module docstring)."""

    name = "vllm"
    version = VERSIONS["vllm"]

    def __init__(self, num_slots, max_tokens, max_rank, device, dest: Path = DEFAULT_DEST) -> None:
        super().__init__(num_slots, max_tokens, max_rank, device)
        from vllm.lora.ops.triton_ops import LoRAKernelMeta, lora_expand, lora_shrink

        ns = dict(torch=torch, Any=Any, lora_shrink=lora_shrink, lora_expand=lora_expand)
        helpers = dict(torch=torch)
        exec(compile(_top_level_defs((Path(dest) / "sources/vllm/lora/utils.py").read_text(),
                                     ["get_captured_lora_counts"]), "vllm/lora/utils.py", "exec"), helpers)

        class _PunicaShim:
            """PunicaWrapperGPU's state for dense decode LoRA (its __init__ and update_metadata)."""

        cls = peer_class(dest, "vllm/lora/punica_wrapper/punica_gpu.py", "PunicaWrapperGPU",
                         ["add_shrink", "add_expand", "add_lora_linear"], _PunicaShim, ns)
        self.punica = cls()
        # PunicaWrapperGPU.__init__: max_loras = lora_config.max_loras; specialize_active_lora=False (default)
        self.punica.lora_config = types.SimpleNamespace(max_loras=num_slots, specialize_active_lora=False)
        self.punica.max_loras = num_slots
        self.punica.token_mapping_meta = LoRAKernelMeta.make(
            num_slots, max_tokens, device=self.device,
            captured_lora_counts=helpers["get_captured_lora_counts"](num_slots, False))
        self.dtype = None

    def weights(self, A, B, group, ranks, scalings):
        R = B.shape[2]
        a = tuple(torch.zeros(self.num_slots, 1, R, group.in_features, dtype=A.dtype, device=A.device)
                  for _ in group.out_features)
        b = tuple(torch.zeros(self.num_slots, 1, w, R, dtype=B.dtype, device=B.device)
                  for w in group.out_features)
        w = (a, b, tuple(group.out_features))
        self.reload(w, A, B, group, ranks, scalings)
        return w

    def reload(self, w, A, B, group, ranks, scalings):
        """vLLM's set_lora for every slot: part i of a rank-r slot is A rows [i*r, (i+1)*r) (the book's
        packing) into lora_a_stacked[i][slot, 0, :r]; B's part columns scaled (optimize()) into
        lora_b_stacked[i][slot, 0, :, :r]; the rest zero (reset_lora)."""
        a, b, _ = w
        offsets = group.offsets
        for s in range(self.num_slots):
            r = int(ranks[s])
            for i in range(len(group.out_features)):
                a[i][s].zero_()
                b[i][s].zero_()
                if r:
                    a[i][s, 0, :r].copy_(A[s, i * r:(i + 1) * r])
                    b[i][s, 0, :, :r].copy_(B[s, offsets[i]:offsets[i + 1], :r] * float(scalings[s]))

    def prepare(self, token_slots, ranks, scalings, capture_tokens=None):
        if capture_tokens is not None:
            # vLLM captures its graphs with dummy LoRAs active (every token on some adapter), so the
            # captured launches exist; which adapters does not matter to the launches
            mapping = [i % self.num_slots for i in range(capture_tokens)]
        else:
            # convert_mapping: an adapter's index, -1 where no LoRA applies (a rank-0 slot)
            mapping = [s if ranks[s] > 0 else -1 for s in token_slots]
        self.punica.token_mapping_meta.prepare_tensors(
            torch.tensor(mapping, dtype=torch.long).to(self.device))

    def apply(self, x, w, y, group):
        a, b, output_slices = w
        # vllm/lora/layers/base_linear.py: _apply_lora_to_output
        self.punica.add_lora_linear(y, x, a, b, 1.0, output_slices)


class _SGLangBackendShim:
    """What SGLang's BaseLoRABackend and the server give the backends' decode methods: their state
    (``__init__``s of BaseLoRABackend, TritonLoRABackend, ChunkedSgmvLoRABackend), ``get_batch_info``
    without DP attention, no MoE LoRA (``_add_moe_lora_info`` returns the batch info as SGLang's
    does then) and no lm_head LoRA (``get_lm_head_pruned_lens`` is None at decode)."""

    is_moe_lora = False

    def __init__(self, max_loras_per_batch: int, device, max_chunk_size: int = 16) -> None:
        self.max_loras_per_batch, self.device = max_loras_per_batch, device
        self.batch_info = None
        self.sgemm_batch_info = None
        self.global_batch_info = self.global_sgemm_batch_info = None
        self.cuda_graph_global_batch_info = self.cuda_graph_global_sgemm_batch_info = None
        self.has_global_active_lora = False
        self._no_lora_weight_index = 0
        self.max_chunk_size = max_chunk_size  # server_args.max_lora_chunk_size (default 16)
        self.lm_head_batch_info = self.lm_head_pass_batch_infos = None

    def get_batch_info(self, layout=None):
        return self.batch_info

    def _add_moe_lora_info(self, forward_batch, batch_info):
        return batch_info

    def _prepare_lm_head_batch_info(self, *args):
        return None, None


class _DecodeMode:
    """ForwardMode of a decode batch."""

    def is_decode(self):
        return True

    def is_idle(self):
        return False

    def is_extend(self):
        return False

    def is_target_verify(self):
        return False


class SGLangPeer(Peer):
    """SGLang 0.5.23, backend "triton" or "csgmv" (see the module docstring)."""

    version = VERSIONS["sglang"]
    METHODS = {
        "triton": ("sglang/srt/lora/backend/triton_backend.py", "TritonLoRABackend",
                   ["_allocate_cuda_graph_sgemm_batch_info", "init_decode_cuda_graph_batch_info",
                    "_build_sgemm_routing", "prepare_lora_batch", "_sgemm_info", "run_lora_a_sgemm",
                    "run_lora_b_sgemm", "run_qkv_lora", "run_gate_up_lora"],
                   ["PREFILL_CUDA_GRAPH_LORA_CHUNK_SIZE"]),
        "csgmv": ("sglang/srt/lora/backend/chunked_backend.py", "ChunkedSgmvLoRABackend",
                  ["init_decode_cuda_graph_batch_info", "prepare_lora_batch", "_determine_chunk_size",
                   "_determine_chunk_size_for_tokens", "_build_req_seg_indptr", "_get_permutation",
                   "_get_segments_info", "run_lora_a_sgemm", "run_lora_b_sgemm", "run_qkv_lora",
                   "run_gate_up_lora"],
                  ["MIN_CHUNK_SIZE"]),
    }

    def __init__(self, num_slots, max_tokens, max_rank, device, backend: str = "triton",
                 dest: Path = DEFAULT_DEST, max_chunk_size: int = 16) -> None:
        super().__init__(num_slots, max_tokens, max_rank, device)
        import typing

        from sglang.kernels.ops.lora.dense import chunked_sgmv_expand, chunked_sgmv_shrink
        from sglang.kernels.ops.lora.dense.gate_up_lora_b import gate_up_lora_b_fwd
        from sglang.kernels.ops.lora.dense.qkv_lora_b import qkv_lora_b_fwd
        from sglang.kernels.ops.lora.dense.sgemm_lora_a import sgemm_lora_a_fwd
        from sglang.kernels.ops.lora.dense.sgemm_lora_b import sgemm_lora_b_fwd
        from sglang.srt.environ import envs
        from sglang.srt.lora import utils

        if backend not in self.METHODS:
            raise ValueError(f"SGLang backend {backend!r}: 'triton' or 'csgmv'")
        self.backend_name, self.name = backend, f"sglang-{backend}"
        ns = dict(torch=_torch_for_peers(), dataclasses=dataclasses, envs=envs,
                  LoRABatchInfo=utils.LoRABatchInfo, get_batch_token_counts=utils.get_batch_token_counts,
                  generate_sequence_lengths=utils.generate_sequence_lengths,
                  sgemm_lora_a_fwd=sgemm_lora_a_fwd, sgemm_lora_b_fwd=sgemm_lora_b_fwd,
                  qkv_lora_b_fwd=qkv_lora_b_fwd, gate_up_lora_b_fwd=gate_up_lora_b_fwd,
                  chunked_sgmv_lora_shrink_forward=chunked_sgmv_shrink.chunked_sgmv_lora_shrink_forward,
                  chunked_sgmv_lora_expand_forward=chunked_sgmv_expand.chunked_sgmv_lora_expand_forward,
                  **{k: getattr(typing, k) for k in ("Optional", "List", "Tuple")})
        source, cls_name, methods, constants = self.METHODS[backend]
        cls = peer_class(dest, source, cls_name, methods, _SGLangBackendShim, ns, constants)
        self.backend = cls(num_slots, self.device, max_chunk_size)
        # LoRAManager.init_cuda_graph_batch_info: sized for the largest captured batch, 1 token per request
        with torch.device(self.device):
            self.backend.init_decode_cuda_graph_batch_info(max_bs_in_cuda_graph=max_tokens, num_tokens_per_req=1)
        self._offsets: dict = {}

    def weights(self, A, B, group, ranks, scalings):
        """SGLang's layout is the book's (A [slots, stack*R, in] packed by each slot's rank, B
        [slots, out_total, R]): the pool's own tensors; ranks and scalings travel in the batch info."""
        assert A.is_contiguous() and B.is_contiguous() and B.shape[1] == sum(group.out_features)
        return A, B

    def _offsets_for(self, group: Group):
        key = group.out_features
        if key not in self._offsets:
            offsets = list(group.offsets)
            pin = torch.cuda.is_available()
            # the layers' output_offset (device) and output_offset_cpu (pinned host)
            self._offsets[key] = (torch.tensor(offsets, dtype=torch.int32, device=self.device),
                                  torch.tensor(offsets, dtype=torch.int32, pin_memory=pin), max(group.out_features))
        return self._offsets[key]

    def prepare(self, token_slots, ranks, scalings, capture_tokens=None):
        if capture_tokens is not None:
            # CudaGraphRunner captures with every request on the base model (slot of rank 0)
            base = next((s for s, r in enumerate(ranks) if r == 0), 0)
            token_slots = [base] * capture_tokens
        fb = types.SimpleNamespace(batch_size=len(token_slots), forward_mode=_DecodeMode(), spec_info=None)
        self.backend.prepare_lora_batch(fb, [int(s) for s in token_slots], [int(r) for r in ranks],
                                        [float(c) for c in scalings], use_cuda_graph=True)

    def apply(self, x, w, y, group):
        A, B = w
        offsets, offsets_cpu, max_out = self._offsets_for(group)
        be = self.backend
        parts = len(group.out_features)
        if parts == 3:  # QKVParallelLinearWithLoRA.apply_lora
            be.run_qkv_lora(x=x, qkv_lora_a=A, qkv_lora_b=B, base_output=y, output_offset=offsets,
                            output_offset_cpu=offsets_cpu, max_qkv_out_dim=max_out)
        elif parts == 2 and group.out_features[0] == group.out_features[1]:
            # MergedColumnParallelLinearWithLoRA.apply_lora (use_gate_up_lora)
            be.run_gate_up_lora(x=x, gate_up_lora_a=A, gate_up_lora_b=B, output_offset=offsets,
                                output_offset_cpu=offsets_cpu, base_output=y)
        elif parts == 1:  # RowParallelLinearWithLoRA / ColumnParallelLinearWithLoRA.apply_lora
            t = be.run_lora_a_sgemm(x, A)
            be.run_lora_b_sgemm(x=t, weights=B, output_offset=offsets, output_offset_cpu=offsets_cpu,
                                base_output=y)
        else:
            raise ValueError(f"{group.name}: {parts} unequal parts is not a Llama projection group")


def make_peer(name: str, num_slots: int, max_tokens: int, max_rank: int, device, dest: Path = DEFAULT_DEST) -> Peer:
    """"vllm", "sglang-triton" or "sglang-csgmv" (``load(dest)`` first)."""
    if name == "vllm":
        return VLLMPeer(num_slots, max_tokens, max_rank, device, dest)
    if name in ("sglang-triton", "sglang-csgmv"):
        return SGLangPeer(num_slots, max_tokens, max_rank, device, name.split("-", 1)[1], dest)
    raise ValueError(f"unknown peer {name!r}: {', '.join(PEER_NAMES)}")


# ---- the fp32 reference --------------------------------------------------------------------------
def reference_delta(x, A, B, group: Group, token_slots: Sequence[int], ranks: Sequence[int],
                    scalings: Sequence[float], chunk: int = 64):
    """fp32 [tokens, out_total]: the book's torch references (``reference.ops.torch_ref.bgmv_shrink``
    then ``bgmv_expand`` with the group's slice offsets), ``chunk`` tokens at a time (their per-token
    gather of A is [tokens, stack*R, in])."""
    from reference.batch_info import LoRABatchInfo
    from reference.ops import torch_ref

    dev = x.device
    ranks_t = torch.tensor(list(ranks), dtype=torch.int32, device=dev)
    scal_t = torch.tensor(list(scalings), dtype=torch.float32, device=dev)
    out = torch.zeros(x.shape[0], sum(group.out_features), dtype=torch.float32, device=dev)
    stack = len(group.out_features)
    A32, B32 = A.float(), B.float()
    for lo in range(0, x.shape[0], chunk):
        slots = torch.tensor(list(token_slots[lo:lo + chunk]), dtype=torch.int32, device=dev)
        n = slots.numel()
        info = LoRABatchInfo(bs=n, num_segments=n, max_len=1, has_active_lora=True,
                             seg_lens=torch.ones(n, dtype=torch.int32, device=dev),
                             seg_indptr=torch.arange(n + 1, dtype=torch.int32, device=dev),
                             weight_indices=slots, lora_ranks=ranks_t, scalings=scal_t, token_slots=slots)
        t = torch.zeros(n, A.shape[1], dtype=torch.float32, device=dev)
        torch_ref.bgmv_shrink(x[lo:lo + n].float(), A32, info, t, stack_num=stack)
        torch_ref.bgmv_expand(t, B32, info, out[lo:lo + n], group.offsets)
    return out


def check_delta(peer: Peer, x, A, B, group: Group, token_slots, ranks, scalings, w=None,
                prepared: bool = False) -> float:
    """The peer's delta (``apply`` into zeros of x's dtype) against :func:`reference_delta`: the
    largest absolute error over the largest |reference| (0 when both are 0; inf for a non-finite delta). ``w``: the peer's
    buffers (made here when None); ``prepared``: the batch's metadata is already in the peer."""
    if w is None:
        w = peer.weights(A, B, group, ranks, scalings)
    if not prepared:
        peer.prepare(token_slots, ranks, scalings)
    y = torch.zeros(x.shape[0], sum(group.out_features), dtype=x.dtype, device=x.device)
    with torch.inference_mode():
        peer.apply(x.contiguous(), w, y, group)
    ref = reference_delta(x, A, B, group, token_slots, ranks, scalings)
    if not torch.isfinite(y).all():
        return float("inf")  # a NaN / inf the reference does not have: read past a rank, or garbage
    scale = ref.abs().max().item()
    err = (y.float() - ref).abs().max().item()
    return err / scale if scale > 0 else err


# ---- the peers inside a Hugging Face Llama --------------------------------------------------------
def wrap_llama_peer(model, pool, context, peer: Peer):
    """Wrap every projection the pool serves (as ``reference.layers.wrap_llama``) with
    :class:`PeerLinear` modules running ``peer``; returns the model. ``reference.layers.unwrap_llama``
    unwraps it (the wrappers are LoRALinear subclasses). The peer's buffers of every (module, layer)
    are made here from the pool's current contents: call :meth:`PeerLoRA.reload` after a slot changes
    owner (:class:`PeerGraphRunner` does)."""
    state = PeerLoRA(peer, pool)
    targets = _targets(model, pool)
    if not targets:
        raise ValueError("no linear layer of the model is served by the pool")
    groups: dict = {}
    for path, layer, name, part in targets:
        groups.setdefault((layer, name), []).append((part, path))
    wrappers = []
    for (layer, name), parts in groups.items():
        parts.sort()
        bases = [model.get_submodule(p) for _, p in parts]
        g = PeerGroupState(state, name, layer, bases)
        for (part, path), base in zip(parts, bases):
            wrappers.append((path, PeerLinear(base, pool, name, layer, context, g, part)))
    for path, wrapper in wrappers:
        _replace(model, path, wrapper)
    model._peer_lora = state
    return model


class PeerLoRA:
    """The peer's buffers of every (module, layer) of a pool."""

    def __init__(self, peer: Peer, pool) -> None:
        self.peer, self.pool = peer, pool
        self.weights: dict = {}

    def group(self, name: str) -> Group:
        return Group.of(self.pool.modules[name])

    def get(self, name: str, layer: int):
        if (name, layer) not in self.weights:
            p = self.pool
            self.weights[(name, layer)] = self.peer.weights(p.A_buffer[name][layer], p.B_buffer[name][layer],
                                                            self.group(name), p.lora_ranks_host, p.scalings_host)
        return self.weights[(name, layer)]

    def reload(self) -> None:
        p = self.pool
        for (name, layer), w in self.weights.items():
            self.peer.reload(w, p.A_buffer[name][layer], p.B_buffer[name][layer], self.group(name),
                             p.lora_ranks_host, p.scalings_host)


class PeerGroupState:
    """One (layer, module): the parts' base layers and the group's output of the current input."""

    def __init__(self, state: PeerLoRA, name: str, layer: int, bases: list) -> None:
        self.state, self.name, self.layer, self.bases = state, name, layer, bases
        self.shared = SharedShrink(len(bases))

    def outputs(self, x, generation: int) -> list:
        return self.shared.get(x, generation, lambda: self._compute(x))

    def _compute(self, x) -> list:
        group = self.state.group(self.name)
        rows = x.reshape(-1, x.shape[-1])
        offsets = group.offsets
        if len(self.bases) == 1:
            y = self.bases[0](rows)
        else:  # every part's own GEMM into its columns of the group's output (the peers' fused layout)
            y = rows.new_empty(rows.shape[0], offsets[-1])
            for i, base in enumerate(self.bases):
                torch.mm(rows, base.weight.t(), out=y[:, offsets[i]:offsets[i + 1]])
        self.state.peer.apply(rows.contiguous(), self.state.get(self.name, self.layer), y, group)
        return [y[:, offsets[i]:offsets[i + 1]].view(*x.shape[:-1], offsets[i + 1] - offsets[i])
                for i in range(len(self.bases))]


class PeerLinear(LoRALinear):
    """A projection whose LoRA is a peer's (its base layer alone for a batch without adapters)."""

    def __init__(self, base, pool, module_name, layer, context, group_state: PeerGroupState, part: int):
        super().__init__(base, pool, module_name, layer, context, "torch", part=part)
        if getattr(base, "bias", None) is not None:
            raise ValueError("the peers' wrapper runs bias-free projections (a Llama's)")
        self.group_state = group_state

    def extra_repr(self) -> str:
        return (f"layer={self.layer}, module={self.spec.name!r}, part={self.part}, "
                f"peer={self.group_state.state.peer.name!r}")

    def forward(self, x):
        if not self.context.batch_info.has_active_lora:
            return self.base(x)
        return self.group_state.outputs(x, self.context.generation)[self.part]


def peer_graph_runner(model, pool, context, peer: Peer, **kwargs):
    """A ``reference.cuda_graph.DecodeGraphRunner`` over a peer-wrapped model whose steps also run the
    peer's metadata preparation: per captured bucket the peer's capture state (before the warm-up
    step that precedes the capture, outside the captured stream), per decode step its ``prepare`` of the step's slots (outside the graph, after the
    runner's own static buffers), and its ``reload`` of the converted buffers when a slot changed
    owner. Its expand rule is "token" (the peers have no sorted graph)."""
    from reference.cuda_graph import DecodeGraphRunner, StaticLoRABatch

    state: PeerLoRA = model._peer_lora

    class PeerStatic(StaticLoRABatch):
        def update(self, seq_slots, bucket, pad_slot, lora_ranks, scalings, ownership_changed):
            super().update(seq_slots, bucket, pad_slot, lora_ranks, scalings, ownership_changed)
            if ownership_changed:
                state.reload()
            # the real sequences only: SGLang points the graph's padded rows at its no-LoRA index itself,
            # vLLM's kernels read only the tokens its sorted mapping lists. capture() writes an empty
            # batch first: the peer's capture state is set per bucket (PeerRunner._step)
            if seq_slots:
                peer.prepare(list(seq_slots), lora_ranks, scalings)

    class PeerRunner(DecodeGraphRunner):
        def _step(self, bucket, lora):
            # the warm-up before each capture (never inside it: the peer's host-to-device copies would
            # be recorded and replayed over every later step's metadata)
            if lora and self._capturing and not torch.cuda.is_current_stream_capturing():
                peer.prepare([], self.pool.lora_ranks_host, self.pool.scalings_host, capture_tokens=bucket)
            return super()._step(bucket, lora)

        def capture(self):
            self._capturing = True
            try:
                super().capture()
            finally:
                self._capturing = False

    kwargs.setdefault("schedule_rule", lambda tokens, adapters, rank: "token")
    runner = PeerRunner(model, pool, context, **kwargs)
    runner._capturing = False
    old = runner.static
    runner.static = PeerStatic(old.num_slots, old.max_seqs, old.tokens_per_seq, old.device)
    for (name, layer) in [(n, l) for n in pool.modules for l in range(pool.num_layers)]:
        state.get(name, layer)  # every buffer exists before capture (fixed addresses)
    return runner


# ---- check ------------------------------------------------------------------------------------------
def self_check(dest: Path = DEFAULT_DEST, device=None, peers: Sequence[str] = PEER_NAMES, dtype=None) -> dict:
    """Every peer's delta against the fp32 reference on tiny shapes: three groups (q/k/v of unequal
    widths, gate/up, one part), slots of ranks 0 (base), full and partial rank with distinct
    scalings, NaN past every rank (never read). Returns {peer: {group: relative error}}."""
    load(dest)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results = {}
    for name in peers:
        results[name] = check_peer(name, device, dest=dest, dtype=dtype)
    return results


def tiny_case(device, dtype, R: int = 16, seed: int = 0):
    """Inputs of :func:`check_peer`: slots [base, rank R, rank R/2, rank R] with scalings [0, 2, 0.5, 1],
    tokens spread over them (the base slot too), groups with hidden 64."""
    g = torch.Generator().manual_seed(seed)
    ranks, scalings = [0, R, R // 2, R], [0.0, 2.0, 0.5, 1.0]
    groups = [Group("qkv_proj", 64, (64, 32, 32)), Group("gate_up_proj", 64, (96, 96)),
              Group("o_proj", 64, (64,)), Group("down_proj", 96, (64,))]
    tokens = 24
    token_slots = [(5 * i + 1) % 4 for i in range(tokens)]
    data = {}
    for grp in groups:
        stack = len(grp.out_features)
        A = torch.randn(4, stack * R, grp.in_features, generator=g) * grp.in_features ** -0.5
        B = torch.randn(4, sum(grp.out_features), R, generator=g) * R ** -0.5
        for s, r in enumerate(ranks):  # past each slot's rank: never read
            A[s, stack * r:] = float("nan")
            B[s, :, r:] = float("nan")
        x = torch.randn(tokens, grp.in_features, generator=g)
        data[grp.name] = (grp, x.to(device, dtype), A.to(device, dtype), B.to(device, dtype))
    return ranks, scalings, token_slots, data


def check_peer(name: str, device, dest: Path = DEFAULT_DEST, dtype=None, R: int = 16) -> dict:
    """:func:`check_delta` of one peer on :func:`tiny_case`; {group: relative error}. dtype: fp32
    where the peer takes it (SGLang), fp16 for vLLM (its shrink accepts fp16 / bf16 only; bf16 is
    not computed right by the Triton interpreter)."""
    if dtype is None:
        dtype = torch.float16 if name == "vllm" else torch.float32
    ranks, scalings, token_slots, data = tiny_case(device, dtype, R)
    peer = make_peer(name, len(ranks), 32, R, device, dest)
    peer.prepare(token_slots, ranks, scalings)
    out = {}
    for gname, (grp, x, A, B) in data.items():
        out[gname] = check_delta(peer, x, A, B, grp, token_slots, ranks, scalings, prepared=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download the wheels (or read --wheels) and write the cache")
    f.add_argument("--wheels", type=Path, default=None, help="a folder holding the two wheels (kept)")
    f.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    c = sub.add_parser("check", help="every peer's delta against the fp32 reference, tiny shapes")
    c.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    c.add_argument("--peers", nargs="+", default=list(PEER_NAMES))
    args = ap.parse_args()
    if args.cmd == "fetch":
        m = fetch(args.dest, args.wheels)
        print(f"wrote {args.dest}: {len(m['files'])} files, {m['total_bytes'] / 1e6:.2f} MB "
              f"({', '.join(f'{k} {v}' for k, v in m['versions'].items())})")
    else:
        res = self_check(args.dest, peers=args.peers)
        for name, groups in res.items():
            print(name, " ".join(f"{g}={e:.2e}" for g, e in groups.items()))


if __name__ == "__main__":
    main()
