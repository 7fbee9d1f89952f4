"""What crosses between the comparer and the learner's child process: data only.

Tensors travel through safetensors; everything else as JSON with explicit tags. Nothing is ever
unpickled, so a learner's object cannot run code in the comparer.
"""
from __future__ import annotations

import dataclasses
import json
import numbers
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from reference.batch_info import LoRABatchInfo

__all__ = ["encode", "decode", "save_tensors", "load_tensors", "write_json", "read_json"]



def encode(value: Any, key: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able description of ``value``; its tensors go into ``tensors`` under keys from ``key``."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":  # no data to copy: where it is, its shape and dtype
            return {"tensor": None, "device": "meta", "shape": list(value.shape),
                    "dtype": str(value.dtype).removeprefix("torch.")}
        tensors[key] = value.detach().to("cpu").contiguous().clone()
        return {"tensor": key, "device": value.device.type}
    if isinstance(value, LoRABatchInfo):
        fields = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            fields[f.name] = encode(v, f"{key}.{f.name}", tensors) if v is not None else None
        return {"batch_info": fields}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (tuple, list)):
        return {"sequence": [encode(v, f"{key}.{i}", tensors) for i, v in enumerate(value)],
                "kind": type(value).__name__}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"mapping": {k: encode(v, f"{key}.{k}", tensors) for k, v in value.items()}}
    if isinstance(value, dict):  # keys such as None (the base model's uid) or ints: as pairs
        return {"pairs": [[encode(k, f"{key}.k{i}", tensors), encode(v, f"{key}.v{i}", tensors)]
                          for i, (k, v) in enumerate(value.items())]}
    if value is None or isinstance(value, (bool, str)):
        return {"value": value, "kind": type(value).__name__}
    if isinstance(value, numbers.Integral):  # int, numpy integers
        return {"value": int(value), "kind": "int"}
    if isinstance(value, numbers.Real):  # float, numpy floats
        return {"value": float(value), "kind": "float"}
    return {"unsupported": type(value).__module__ + "." + type(value).__qualname__, "repr": repr(value)[:200]}


def decode(desc: Any, tensors: dict[str, torch.Tensor], device: torch.device | str) -> Any:
    """Inverse of :func:`encode`, placing tensors on ``device``."""
    if "tensor" in desc:
        return meta_tensor(desc) if desc["tensor"] is None else tensors[desc["tensor"]].to(device)
    if "batch_info" in desc:
        kw = {k: (decode(v, tensors, device) if v is not None else None) for k, v in desc["batch_info"].items()}
        return LoRABatchInfo(**kw)
    if "dtype" in desc:
        return getattr(torch, desc["dtype"])
    if "sequence" in desc:
        items = [decode(v, tensors, device) for v in desc["sequence"]]
        return tuple(items) if desc["kind"] == "tuple" else items
    if "mapping" in desc:
        return {k: decode(v, tensors, device) for k, v in desc["mapping"].items()}
    if "pairs" in desc:
        return {decode(k, tensors, device): decode(v, tensors, device) for k, v in desc["pairs"]}
    if "value" in desc:
        return desc["value"]
    raise ValueError(f"cannot decode {desc!r}")


def meta_tensor(desc: dict) -> torch.Tensor:
    """The tensor :func:`encode` described without data (one on the "meta" device), as a meta
    tensor. ``desc`` comes from a process that ran learner code.

    Raises:
        ValueError: a shape that is not a list of non-negative ints, or a dtype torch does not have.
    """
    shape, dtype = desc.get("shape"), getattr(torch, str(desc.get("dtype")), None)
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)) or not isinstance(dtype, torch.dtype):
        raise ValueError(f"cannot decode {desc!r}")
    return torch.empty(shape, dtype=dtype, device="meta")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path)) if tensors else Path(path).write_bytes(b"")


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path)) if Path(path).stat().st_size else {}


def write_json(obj: Any, path: Path) -> None:
    """Write atomically: a reader sees the whole file or none (a killed writer leaves nothing)."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text())
