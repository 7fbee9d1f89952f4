"""What the int64 offsets cost: the book's Triton ops before and after commit 3d279ac (issue #11).

    python benchmarks/benchmark_int64_offsets.py --extract .int32_ops      # in a git checkout, once
    python benchmarks/benchmark_int64_offsets.py --baseline .int32_ops [--out PATH]

Commit 3d279ac made every stride of every reference kernel int64, because an int32 offset wraps past
2^31 elements (out [80000, 28672] bf16 in expand) and the kernel reads or writes a wild address.
``--extract`` writes the ops as they were just before it (``git show 3d279ac^:reference/ops/...``)
into a folder, as a package of their own; the benchmark times both versions on the same tensors
(CUDA graph replay, do_bench median, bf16, each op at its defaults) and reports new / old.
"""
from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "3d279ac"
FILES = ("__init__.py", "_triton_util.py", "bgmv_expand.py", "bgmv_shrink.py", "fused_decode.py",
         "sgmv_expand.py", "sgmv_shrink.py")
PACKAGE = "int32_ops"


def extract(folder: Path) -> None:
    """Write the ops of ``COMMIT^`` into ``folder/int32_ops`` (imports rewritten to the package)."""
    target = folder / PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        try:
            text = subprocess.run(["git", "show", f"{COMMIT}^:reference/ops/{name}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as exc:
            if name == "_triton_util.py":  # not every old tree has it
                continue
            raise SystemExit(f"git show failed for {name}: {exc.stderr.strip()}")
        (target / name).write_text(text.replace("reference.ops.", f"{PACKAGE}."))
    print(f"wrote {target}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extract", type=Path, default=None)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.extract:
        extract(args.extract)
        return
    if args.baseline is None:
        raise SystemExit("give --baseline DIR (made by --extract DIR)")
    import torch
    import triton

    sys.path.insert(0, str(args.baseline.resolve()))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from benchmark_lora_ops import graph_time, problem

    import reference.ops as new

    old = importlib.import_module(PACKAGE)
    cases = [("decode", 64, 1, 8, 4096, 4096, 16), ("decode", 256, 1, 32, 4096, 4096, 16),
             ("decode", 256, 1, 32, 4096, 4096, 64),
             ("prefill", 4, 2048, 4, 4096, 4096, 16), ("prefill", 4, 2048, 4, 4096, 14336, 16)]
    rows = []
    print(f"{'case':36s} {'op':13s} {'int32 us':>9s} {'int64 us':>9s} {'new/old':>8s}")
    for kind, n_req, tokens, D, d_in, d_out, rank in cases:
        p = problem(n_req, tokens, D, d_in, d_out, rank)
        ops = ["bgmv_shrink", "bgmv_expand", "fused_decode"] if kind == "decode" else ["sgmv_shrink", "sgmv_expand"]
        for op in ops:
            def call(mod, op=op):
                if op.endswith("shrink"):
                    return lambda: getattr(mod, op)(p["x"], p["A"], p["info"], p["t"])
                if op.endswith("expand"):
                    return lambda: getattr(mod, op)(p["t"], p["B"], p["info"], p["out"])
                return lambda: mod.fused_decode(p["x"], p["A"], p["B"], p["info"], p["out"])
            t_old, t_new = graph_time(call(old)), graph_time(call(new))
            case = f"{kind} {n_req}x{tokens} D={D} r={rank} {d_in}->{d_out}"
            rows.append(dict(case=case, op=op, int32_us=round(t_old, 2), int64_us=round(t_new, 2),
                             ratio=round(t_new / t_old, 3)))
            print(f"{case:36s} {op:13s} {t_old:9.1f} {t_new:9.1f} {t_new / t_old:8.3f}", flush=True)
    out = args.out or ROOT / "benchmarks" / "results" / "int64_offsets_h200.json"
    out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                   triton=triton.__version__, baseline=f"{COMMIT}^",
                                   method="CUDA graph replay, do_bench median, us; each op at its defaults",
                                   rows=rows), indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
