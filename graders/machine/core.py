"""Grading one exercise: build cases, run the learner's code in a child process, compare, report.

The comparison happens in the calling process, which never calls learner code: in a notebook that
is the learner's kernel (where only the answer cell's definitions ran), in ``graders.course`` (the
trusted re-grade) a process that never ran any learner code at all.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import os
import random
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

import reference  # noqa: F401  (device choice first)
import torch

from graders.machine.exercise import Case, Exercise
from graders.machine.points import POINTS
from graders.machine.tolerances import tolerance
from graders.machine.wire import decode, encode, load_tensors, meta_tensor, read_json, save_tensors, write_json
from reference.batch_info import LoRABatchInfo
from reference.device import default_device

__all__ = ["Case", "Exercise", "GradeResult", "grade_source", "grade_under_secrets", "grade_many_under_secrets", "hidden_seed", "default_timeout", "PUBLIC_SEED"]

PUBLIC_SEED = 20261129
SECRET_ENV = "LORA_BOOK_SECRET"
TIMEOUT_ENV = "LORA_BOOK_GRADER_TIMEOUT"
#: The default device of Exercise.default_device_probe's case: a device no input is on, that holds no
#: data (so nothing computed there can pass for a result) and that every machine has.
DEFAULT_DEVICE_PROBE = "meta"
DEFAULT_TIMEOUT_S = {"cpu": 40.0, "cuda": 90.0}  # the GPU adds Triton compilation of learner kernels


def default_timeout(device: Optional[torch.device] = None) -> float:
    """The grader's hang budget for one exercise, seconds (``LORA_BOOK_GRADER_TIMEOUT`` overrides)."""
    device = device or default_device()
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S[device.type]))


@dataclass
class GradeResult:
    exercise_id: str
    score: float
    max_score: float
    groups: dict[str, bool] = field(default_factory=dict)
    report: str = ""


def hidden_seed(exercise_id: str, secret: Optional[str] = None) -> int:
    """Seed of the hidden cases: from ``secret``, else the instructor's secret when set, else a
    public default."""
    secret = secret if secret is not None else os.environ.get(SECRET_ENV, "self-study")
    return int.from_bytes(hashlib.sha256(f"{secret}:{exercise_id}".encode()).digest()[:8], "little")


def _hidden_cases(ex: Exercise, seed: int) -> list[Case]:
    return ex.random_cases(random.Random(seed), torch.Generator().manual_seed(seed % 2**62), True)


def _build_cases(ex: Exercise, secrets: Optional[Sequence[Optional[str]]] = None) -> list[Case]:
    """Edge, random and hidden cases; with ``secrets``, one hidden group per secret (tagged
    ``case.secret``), so a mutation test grades one child process under several secrets."""
    cases = []
    makers = [("edge", None, ex.edge_cases),
              ("random", None, lambda: ex.random_cases(random.Random(PUBLIC_SEED),
                                                       torch.Generator().manual_seed(PUBLIC_SEED), False))]
    for secret in (secrets if secrets is not None else [None]):
        seed = hidden_seed(ex.id) if secret is None else hidden_seed(ex.id, secret)
        makers.append(("hidden", secret, lambda seed=seed: _hidden_cases(ex, seed)))
    for group, secret, make in makers:
        for case in make():
            case.group, case.secret = group, secret
            cases.append(case)
    if ex.default_device_probe:
        # a sized case, and an empty one where there is one: an answer may allocate only on its
        # early-return path for empty inputs
        empty = [c for c in cases if c.group == "edge" and any(
            isinstance(a, torch.Tensor) and a.numel() == 0 for a in c.args)][:1]
        sized = next(c for c in cases if c.group == "random")  # every exercise has random cases
        at = max((i for i, c in enumerate(cases) if c.group == "edge"), default=-1) + 1
        for case in (sized, *empty):
            cases.insert(at, replace(case, name=f"{case.name}, default device elsewhere", group="edge",
                                     describe=f"{case.describe}; called with torch's default device set to "
                                              f"{DEFAULT_DEVICE_PROBE!r}", default_device=DEFAULT_DEVICE_PROBE))
            at += 1
    return cases


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, LoRABatchInfo):
        return LoRABatchInfo(**{k: _to(v, device) for k, v in vars(value).items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple takes its fields positionally
        return type(value)(*(_to(v, device) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, LoRABatchInfo):
        return LoRABatchInfo(**{k: _clone(v) for k, v in vars(value).items()})
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


@dataclass(frozen=True)
class Raises:
    """The expected outcome of a case whose contract is an exception."""

    name: str  # exception class name, e.g. "ValueError"


def _expected(ex: Exercise, case: Case) -> Any:
    args = _clone(case.args)
    try:
        returned = ex.reference(*args)
    except Exception as exc:  # the contract says: raise
        return Raises(type(exc).__name__)
    return args[case.out_index] if case.out_index is not None else returned


# ---------------------------------------------------------------------------------------------
# Running the learner's code


#: The Triton cache that a grader child on the GPU may share with other checks (see
#: :func:`triton_cache_scope`); None: a private cache that dies with the child.
_TRITON_CACHE: contextvars.ContextVar[Optional[Path]] = contextvars.ContextVar("triton_cache", default=None)


@contextlib.contextmanager
def triton_cache_scope(folder: Path):
    """Checks run in this context (this thread) on a GPU share the Triton cache ``folder``.

    Why: every check's child starts with an empty cache (its private /tmp), so each one compiles
    every kernel of the answer again, 10-30 s per kernel exercise on the H200. The trusted re-grade
    gives each student one folder: a student's checks reuse their own compiled kernels, and no
    student's code can plant a compiled kernel that another student's check loads.
    """
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = _TRITON_CACHE.set(folder)
    try:
        yield folder
    finally:
        _TRITON_CACHE.reset(token)


def _cuda_here() -> bool:
    """Whether grader children run on a GPU machine (the device nodes bound, a shared Triton cache)."""
    return torch.cuda.is_available()


def _child_preexec(sandboxed: bool, cuda: bool) -> None:
    """In the grader's child, before exec: the sandbox's rlimits when sandboxed, and in every case
    SIGKILL when the process that started it dies."""
    from graders.machine import sandbox

    if sandboxed:
        from graders.machine import cgroups

        sandbox.limit_resources(cpu_only=not cuda)
        cgroups.enter()
    sandbox.set_parent_death_signal()


def _run_child(workdir: Path, timeout: float) -> tuple[Optional[int], bool, str]:
    """Run graders.machine.runner on the job in ``workdir``; return (exit code or None, timed out, stderr tail).

    The job goes to a pre-imported fork server of its device's kind (``graders.machine.forkserver``); a
    fresh process when the servers are switched off, or on a GPU whose driver does not allow a
    context in a forked child. Either way in the sandbox
    (``graders.machine.sandbox``) when the policy enables it, and never with the instructor's secret in its
    environment.
    """
    from graders.machine import forkserver, sandbox

    device = str(read_json(workdir / "job.json").get("device", "cpu"))
    cuda = _cuda_here()
    scope = _TRITON_CACHE.get()  # a student's folder in the re-grade: that student's servers only
    cache = scope if cuda else None
    if forkserver.usable(device):
        kind = "cuda" if device.startswith("cuda") else "cpu"
        try:
            return forkserver.run_job(workdir, timeout, kind, scope)
        except forkserver.CudaForkUnsafe:
            pass  # recorded: this process's CUDA checks spawn a fresh child from now on
    command = sandbox.python_argv("graders.machine.runner", str(workdir))
    extra = {"PYTHONUNBUFFERED": "1", **({"TRITON_CACHE_DIR": str(cache)} if cache else {})}
    if sandbox.enabled():
        argv, env = sandbox.bwrap_argv(command, writable=[workdir, *([cache] if cache else [])],
                                       hidden=forkserver.hidden_folders(), gpu=cuda,
                                       env=sandbox.sandbox_env(extra)), None
        preexec = functools.partial(_child_preexec, True, cuda)
    else:
        argv, preexec = command, functools.partial(_child_preexec, False, cuda)
        env = sandbox.sandbox_env({**extra, "HOME": os.environ.get("HOME", "/tmp"),
                                   "TMPDIR": tempfile.gettempdir()})
    # from the spawner thread, with a parent-death signal: a kernel killed (restart, shutdown)
    # while this child runs a hanging answer takes the child with it (the child is in a session
    # of its own, so nothing else would)
    proc = forkserver._spawn(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        start_new_session=True, env=env, preexec_fn=preexec,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
        return proc.returncode, False, err.decode(errors="replace")[-800:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, True, ""
    except BaseException:  # an interrupted kernel: the child must not outlive the check
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


# ---------------------------------------------------------------------------------------------
# Comparing


def _fmt(x: float) -> str:
    return f"{x:.6g}"


#: Said where a CUDA case meets a tensor the answer made on the CPU (on the CPU, the default-device
#: case of Exercise.default_device_probe names the line instead).
DEFAULT_DEVICE_HINT = ("\n  hint: a tensor made without device= (torch.zeros, torch.arange, torch.tensor, ...) lands "
                       "on torch's default device, the CPU here, not the inputs' device: pass device=x.device "
                       "(x an input), or make it from an input (x.new_zeros(...))")


def _index(idx: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(i)) for i in idx) + "]"


def _compare_tensor(name: str, exp: torch.Tensor, desc: Any, tensors: dict, case: Case,
                    device: torch.device) -> Optional[str]:
    if not isinstance(desc, dict) or "tensor" not in desc:
        kind = desc.get("unsupported") or desc.get("kind") or "something else" if isinstance(desc, dict) else "?"
        return f"{name}: expected a torch.Tensor {list(exp.shape)} {exp.dtype}, got {kind}"
    if exp.device.type == "meta" or desc.get("device") == "meta":
        return _compare_placement(name, exp, desc, device)
    got = tensors[desc["tensor"]]
    if tuple(got.shape) != tuple(exp.shape):
        return f"{name}: shape {list(got.shape)}, expected {list(exp.shape)}"
    if got.dtype != exp.dtype:
        return f"{name}: dtype {got.dtype}, expected {exp.dtype}"
    if desc.get("device") != device.type:
        return (f"{name}: tensor on {desc.get('device')}, expected on {device.type} (the inputs' device)"
                + (DEFAULT_DEVICE_HINT if desc.get("device") == "cpu" else ""))
    exp = exp.cpu()
    if not exp.dtype.is_floating_point:
        bad = got != exp
    elif case.op == "exact":  # a copy: bit for bit, and poison left in place stays NaN
        bad = ~((got == exp) | (torch.isnan(got) & torch.isnan(exp)))
    else:
        rtol, atol, _ = tolerance(device.type, exp.dtype, case.op)
        e, g = exp.double(), got.double()
        bad = ~((g - e).abs() <= atol + rtol * e.abs())  # NaN compares False: never passes
    if case.defined is not None:
        bad &= case.defined.cpu()
    if case.exact is not None:  # e.g. rows of rank-0 tokens: "adds exactly nothing"
        bad |= case.exact.cpu() & ~((got == exp) | (torch.isnan(got) & torch.isnan(exp)) if got.is_floating_point() else (got == exp))
    if not bool(bad.any()):
        return None
    return _describe_mismatch(name, exp, got, bad, case)


def _compare_placement(name: str, exp: torch.Tensor, desc: dict, device: torch.device) -> Optional[str]:
    """A tensor of a case whose ``device`` argument is "meta" (a device every machine has and that
    holds no data: chapter 07's host-built metadata), or one the answer put there: its device, shape
    and dtype are all there is to compare. So a CPU-only learner learns that the results go on
    ``device``, which a case on the grading device, the CPU, cannot show."""
    where = desc.get("device")
    if exp.device.type != "meta":
        return f"{name}: tensor on {where}, expected on {device.type} (the inputs' device)"
    if where != "meta":
        return (f"{name}: tensor on {where}, expected on meta: this case passes device='meta' (a device that "
                "holds no data: any machine has it), and the contract puts the results on `device`\n"
                "  hint: build them from your host lists and send each to `device` with one copy "
                "(.to(device); on CUDA from pinned memory, as the chapter says); a tensor made without device= "
                "stays where it was made")
    got = meta_tensor(desc)
    if tuple(got.shape) != tuple(exp.shape):
        return f"{name}: shape {list(got.shape)}, expected {list(exp.shape)}"
    if got.dtype != exp.dtype:
        return f"{name}: dtype {got.dtype}, expected {exp.dtype}"
    return None


def _describe_mismatch(name, exp, got, bad, case) -> str:
    lines = []
    if got.dim() >= 2 and case.row_labels:
        rows = torch.nonzero(bad.reshape(bad.shape[0], -1).any(dim=1)).flatten().tolist()
        spans = _spans(rows)
        parts = [f"rows {a}..{b}" if a != b else f"row {a}" for a, b in spans[:4]]
        labels = list(dict.fromkeys(case.row_labels[r] for r in rows))  # in row order, once each
        lines.append(f"{name}: {len(rows)} of {got.shape[0]} rows differ ({', '.join(parts)}"
                     f"{', ...' if len(spans) > 4 else ''}); they belong to: {'; '.join(labels[:4])}")
    else:
        lines.append(f"{name}: {int(bad.sum())} of {bad.numel()} elements differ")
    nan = got.is_floating_point() and bool((torch.isnan(got) & bad).any())
    if nan:  # true of every exercise: an unwritten element is named only where the case poisons an `out`
        unwritten = (f"an element the contract defines was left unwritten (`{name}` is filled with NaN before the "
                     "call where the case says so), " if case.out_index is not None else "")
        lines.append(f"  NaN in {int((torch.isnan(got) & bad).sum())} element(s) of the result: either {unwritten}"
                     "NaN was read from an input (where the case says an input holds NaN, e.g. padding past a rank), "
                     "or NaN was computed (0 * inf, inf - inf)")
    shown = torch.nonzero(bad & torch.isnan(got))[:3] if nan else torch.nonzero(bad)[:3]  # the NaN ones first
    for idx in shown.tolist():
        e, g = exp[tuple(idx)].item(), got[tuple(idx)].item()
        lines.append(f"  {name}{_index(idx)}: expected {_fmt(e)}, got {_fmt(g)}")
    return "\n".join(lines)


def _spans(rows: list[int]) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for r in rows:
        if spans and spans[-1][1] == r - 1:
            spans[-1] = (spans[-1][0], r)
        else:
            spans.append((r, r))
    return spans


def _compare_number(name: str, exp: float | int, desc: Any, tensors: dict) -> Optional[str]:
    if isinstance(desc, dict) and "tensor" in desc and tensors[desc["tensor"]].numel() == 1:
        got = tensors[desc["tensor"]].item()
        if isinstance(exp, int) and tensors[desc["tensor"]].is_floating_point():
            return f"{name}: expected an integer (a count), got a floating-point tensor"
    elif isinstance(desc, dict) and desc.get("kind") in ("int", "float", "bool") and desc.get("value") is not None:
        got = desc["value"]
    else:
        kind = (desc.get("unsupported") or desc.get("kind")) if isinstance(desc, dict) else "?"
        return f"{name}: expected a number, got {kind}"
    if isinstance(exp, int) and not isinstance(exp, bool):
        if isinstance(got, float):
            return f"{name}: expected an int, got the float {got!r} (use // or int(): an index, a count or a size is whole)"
        if got != exp:
            return f"{name}: expected {exp:,}, got {got:,}" if isinstance(got, (int, float)) else f"{name}: expected {exp}"
        return None
    if not (abs(got - exp) <= 1e-12 + 1e-9 * abs(exp)):
        return f"{name}: expected {exp!r}, got {got!r}"
    return None


def _compare_batch_info(expected: LoRABatchInfo, desc: Any, tensors: dict, case: Case, device: torch.device,
                        name: str) -> Optional[str]:
    """Field by field, in the contract's order: host fields equal, tensors exact (dtype included)."""
    if not isinstance(desc, dict) or "batch_info" not in desc:
        kind = "?"
        if isinstance(desc, dict):
            kind = desc.get("unsupported") or desc.get("kind") or ("a dict" if {"mapping", "pairs"} & set(desc) else "a tensor")
        return f"{name}: expected a LoRABatchInfo (reference.batch_info.LoRABatchInfo), got {kind}"
    for field, exp in vars(expected).items():
        got = desc["batch_info"].get(field)
        if exp is None or got is None:
            if (exp is None) != (got is None):
                return f"{name}.{field}: expected {'None' if exp is None else 'a value'}, got {'None' if got is None else 'a value'}"
            continue
        msg = _compare(exp, got, tensors, case, device, f"{name}.{field}")
        if msg:
            return msg
    return None


def _compare(expected: Any, desc: Any, tensors: dict, case: Case, device: torch.device, name: str) -> Optional[str]:
    if isinstance(expected, LoRABatchInfo):
        return _compare_batch_info(expected, desc, tensors, case, device, name)
    if isinstance(expected, torch.Tensor):
        return _compare_tensor(name, expected, desc, tensors, case, device)
    if isinstance(expected, (tuple, list)):
        if not isinstance(desc, dict) or "sequence" not in desc:
            return f"{name}: expected a tuple of {len(expected)} values"
        if len(desc["sequence"]) != len(expected):
            return f"{name}: expected {len(expected)} values, got {len(desc['sequence'])}" + _both(expected, desc)
        for i, (e, d) in enumerate(zip(expected, desc["sequence"])):
            msg = _compare(e, d, tensors, case, device, f"{name}[{i}]")
            if msg:
                return msg
        return None
    if expected is None or isinstance(expected, (str, bool)):
        return _compare_value(name, expected, desc)
    return _compare_number(name, expected, desc, tensors)


def _compare_value(name: str, expected: Any, desc: Any) -> Optional[str]:
    """Names, flags and None (uids, the base model) compare by equality and type."""
    if isinstance(desc, dict) and "value" in desc and desc.get("kind") == type(expected).__name__:
        return None if desc["value"] == expected else f"{name}: expected {expected!r}, got {desc['value']!r}"
    got = desc.get("value", desc.get("unsupported") or desc.get("kind")) if isinstance(desc, dict) else "?"
    return f"{name}: expected {expected!r}, got {got!r}"


def _both(expected: Sequence, desc: dict) -> str:
    """Short lists of numbers side by side (host metadata such as segment lengths)."""
    got = [d.get("value") for d in desc["sequence"] if isinstance(d, dict)]
    if len(expected) <= 24 and len(got) <= 24 and all(isinstance(v, (int, float)) for v in [*expected, *got]):
        return f"\n  expected {list(expected)}\n  got      {got}"
    return ""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal shapes and values, NaN equal to NaN (the graders' poison)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    return torch.equal(a, b)


def _unchanged_inputs(ex: Exercise, case: Case, result: dict, tensors: dict) -> Optional[str]:
    if len(result["args_after"]) != len(case.args):  # a forged result: zip would skip the check
        raise ValueError("args_after does not hold one entry per argument")
    for j, (before, desc) in enumerate(zip(case.args, result["args_after"])):
        if j == case.out_index:
            continue
        pairs = [(before, desc)]
        if isinstance(before, LoRABatchInfo):
            pairs = [(getattr(before, k), v) for k, v in desc["batch_info"].items() if v is not None]
        for b, d in pairs:
            if isinstance(b, torch.Tensor) and not _same(b.cpu(), tensors[d["tensor"]]):
                return f"your function modified its input {ex.arg_names[j]!r}; inputs must stay unchanged"
    return None


def _case_verdict(ex: Exercise, case: Case, expected: Any, result: dict, tensors: dict,
                  device: torch.device, with_hint: bool = True) -> Optional[str]:
    msg = _outcome(ex, case, expected, result, tensors, device, with_hint)
    if msg and result.get("printed"):
        lines = result["printed"].rstrip().splitlines()
        msg += f"\n  (your function printed {len(lines)} line(s); the last: {lines[-1][:120]!r})"
    return msg


#: A driver raises an exception of a class with this name (e.g. graders.chapters.tp_ranks'
#: GraderObservation) for what it saw the learner's code do (ranks that waited in a collective):
#: reported as the grader's observation, not as "your function raised RuntimeError: ...".
OBSERVED = "GraderObservation"


def _observed(ex: Exercise, error: str) -> Optional[str]:
    """The grader's observation in ``error``, or None: only a driver's (an exercise with one), raised
    outside the answer cell (no answer-cell location); an answer cell that raises a class of that
    name gets "raised ..." like any other exception."""
    if ex.driver is None or not error.startswith(OBSERVED + ": ") or " (answer cell line " in error:
        return None
    return "the grader observed: " + error[len(OBSERVED) + 2:]


def _outcome(ex: Exercise, case: Case, expected: Any, result: dict, tensors: dict,
             device: torch.device, with_hint: bool = True) -> Optional[str]:
    if result.get("on_default_device"):  # a default-device case (Exercise.default_device_probe)
        return result["on_default_device"]
    if result.get("device_reads"):
        reads = result["device_reads"]
        return (f"your function read a tensor's value on the host {len(reads)} time(s); the first: {reads[0]}\n"
                "  this exercise builds everything from host data (Python ints, lists, the host fields) and "
                "never reads a tensor back (.item(), .tolist(), bool(t), int(t), `if t:`, print(t), "
                "np.asarray(t)): on a GPU such a read waits for every queued kernel, and a CUDA graph cannot "
                "contain it")
    if isinstance(expected, Raises):
        if result.get("error", "").startswith(expected.name + ":"):
            return None
        if (observed := _observed(ex, result.get("error", ""))) is not None:  # the driver's, not the answer's
            return f"the contract says this input raises {expected.name}; " + observed
        got = ("raised " + result["error"]) if "error" in result else "returned normally"
        return f"the contract says this input raises {expected.name}; your function {got}"
    if (observed := _observed(ex, result.get("error", ""))) is not None:
        return observed
    if "error" in result:
        if "device 'meta'" in case.describe and "meta" in result["error"].lower():
            # torch's NotImplementedError for an op that needs values, not an unfinished answer
            return ("raised " + result["error"] + "\n  hint: this case passes device='meta', PyTorch's device of "
                    "shapes without data: an operation that needs values (torch.bincount, .tolist(), .item(), "
                    "indexing by a tensor's values) cannot run there. Compute from the host lists, then send "
                    "the results to `device`")
        said, _, where = result["error"].partition(" (answer cell")
        if said.startswith("NotImplementedError") and "raise NotImplementedError" in where:
            # the answer's own raise (nbgrader's stub, or a learner's "not done yet"), not torch's
            message = said.partition(":")[2].strip()
            return ("not implemented yet: NotImplementedError" + (f": {message}" if message else "")
                    + " (answer cell" + where)
        if result["error"].startswith("NameError"):
            return ("raised " + result["error"] + "\n  hint: the grader runs your answer cell on its own "
                    "(after import math, torch): define or import that name inside the cell")
        if "Expected all tensors to be on the same device" in result["error"]:
            return "raised " + result["error"] + DEFAULT_DEVICE_HINT
        return "raised " + result["error"]
    if case.out_index is not None:
        msg = _compare(expected, result["args_after"][case.out_index], tensors, case, device,
                       ex.arg_names[case.out_index])
        if not msg and result.get("returned_out") is False:
            desc = result["returned"] if isinstance(result["returned"], dict) else {}
            got = ("a different tensor (a copy, or a new result)" if "tensor" in desc else
                   "None" if desc.get("kind") == "NoneType" else desc.get("kind") or "something else")
            name = ex.arg_names[case.out_index]
            msg = (f"{name} is right, but the function returned {got}: the contract returns {name} itself, the "
                   f"tensor it updated in place (callers chain it: y = op(..., {name}))")
    elif ex.compare is not None:
        msg = _custom_compare(ex, case, expected, result["returned"], tensors)
    else:
        msg = _compare_returned(ex, case, expected, result["returned"], tensors, device)
    msg = msg or _unchanged_inputs(ex, case, result, tensors)
    if not msg and result.get("aliases") is not None:
        name = ex.arg_names[result["aliases"]] if result["aliases"] < len(ex.arg_names) else "an input"
        msg = (f"the returned tensor shares memory with your input {name!r} (a view or the same tensor); "
               "the contract asks for a new tensor: a caller that later writes one changes the other")
    if msg and with_hint and ex.hint is not None:
        got = result["args_after"][case.out_index] if case.out_index is not None else result["returned"]
        # the hint sees what compare saw (plain data), else the result materialized
        got = _plain(got, tensors) if ex.compare is not None else _materialize(got, tensors)
        try:
            # hints see the case as built, on the CPU: the learner's result comes back there, and a hint
            # that mixed a CUDA input with it would raise and be silently dropped (seen on the H200)
            cpu = torch.device("cpu")
            hint_case = replace(case, args=_to(case.args, cpu), defined=_to(case.defined, cpu),
                                exact=_to(case.exact, cpu))
            hint = ex.hint(hint_case, _to(expected, cpu), _to(got, cpu))
        except Exception:  # a hint is a courtesy: it must never cost a verdict
            hint = None
        if hint:
            msg += "\n  hint: " + hint
    return msg


def _plain(desc: Any, tensors: dict) -> Any:
    """The returned value decoded as data (on the CPU); None when it holds something undecodable."""
    try:
        return decode(desc, tensors, "cpu")
    except (ValueError, KeyError, TypeError):
        return None


def _custom_compare(ex: Exercise, case: Case, expected: Any, desc: Any, tensors: dict) -> Optional[str]:
    if isinstance(desc, dict) and "unsupported" in desc:
        return f"returned a {desc['unsupported']}, which the grader cannot read ({desc.get('repr', '')[:80]})"
    return ex.compare(case, expected, _plain(desc, tensors))


def _compare_returned(ex: Exercise, case: Case, expected: Any, desc: Any, tensors: dict,
                      device: torch.device) -> Optional[str]:
    names = ex.result_names
    if not names or not isinstance(expected, (tuple, list)) or len(names) != len(expected):
        return _compare(expected, desc, tensors, case, device, "returned value")
    if not isinstance(desc, dict) or "sequence" not in desc or len(desc["sequence"]) != len(expected):
        return _compare(expected, desc, tensors, case, device, "returned value")  # says what is off
    for name, e, d in zip(names, expected, desc["sequence"]):
        msg = _compare(e, d, tensors, case, device, f"returned {name}")
        if msg:
            return msg
    return None


def _materialize(desc: Any, tensors: dict) -> Any:
    if isinstance(desc, dict) and "batch_info" in desc:
        return decode(desc, tensors, "cpu")
    if isinstance(desc, dict) and "tensor" in desc:
        return tensors[desc["tensor"]] if desc["tensor"] is not None else None  # None: a meta tensor, no data
    if isinstance(desc, dict) and "sequence" in desc:
        return tuple(_materialize(d, tensors) for d in desc["sequence"])
    if isinstance(desc, dict) and "value" in desc:
        return desc["value"]
    return None


# ---------------------------------------------------------------------------------------------
# The entry point


def grade_source(exercise_id: str, source: str, func_name: Optional[str] = None,
                 device: Optional[torch.device] = None, timeout: Optional[float] = None) -> GradeResult:
    """Grade the answer cell ``source`` for ``exercise_id``.

    Runs the cell in a child process (``graders.machine.runner``) and calls ``func_name`` (default: the
    exercise's function name) on every case; compares with the reference here. For an exercise that
    needs other exercises' answers (``Exercise.needs``: chapter 11's capstone), ``source`` is an
    answer bundle of those cells and its own (``graders.machine.needs.bundle``).

    Returns:
        GradeResult with ``score`` (float, never above the exercise's points) and ``report``.
    Raises:
        KeyError: unknown exercise id.
    """
    return _grade(exercise_id, source, func_name, device, timeout, None)[None]


def grade_under_secrets(exercise_id: str, source: str, secrets: Sequence[str], func_name: Optional[str] = None,
                        device: Optional[torch.device] = None,
                        timeout: Optional[float] = None) -> dict[str, GradeResult]:
    """Grade ``source`` as an instructor holding each of ``secrets`` would, in one child process.

    The edge and random groups are the same for every secret; each secret draws its own hidden
    group. Mutation tests use it to check that a mistake costs the same under any secret.
    """
    return _grade(exercise_id, source, func_name, device, timeout, list(secrets))


def grade_many_under_secrets(exercise_id: str, sources: Sequence[str], secrets: Sequence[str],
                             device: Optional[torch.device] = None) -> list[dict[str, GradeResult]]:
    """:func:`grade_under_secrets` for several answer cells of one exercise (a solution and its
    mutants): the cases and the reference's results are built once, and on the CPU one child
    process imports torch once and forks one grandchild per source (``graders.machine.runner.run_many``).
    On CUDA each source gets its own child (a CUDA context does not survive a fork).
    """
    from graders.machine.registry import EXERCISES

    ex = EXERCISES[exercise_id]
    device = _grading_device(ex, device)
    split = [_split(ex, src) for src in sources]
    if device.type != "cpu" or ex.requires and not all(ex.requires[0] in own for own, _ in split):
        return [grade_under_secrets(exercise_id, src, secrets, device=device) for src in sources]
    timeout = default_timeout(device) * (1 + 0.5 * (len(secrets) - 1))
    cases = _build_cases(ex, list(secrets))
    expected = [_expected(ex, c) for c in cases]
    with tempfile.TemporaryDirectory(prefix=f"grade-many-{exercise_id}-") as tmp:
        workdir = Path(tmp)
        _write_job(ex, cases, workdir, device, {"sources": [own for own, _ in split],
                                                 "needed_per_source": [needed for _, needed in split],
                                                 "func_name": ex.func_name, "timeout": timeout})
        start = time.perf_counter()
        _, job_timed_out, job_stderr = _run_child(workdir, timeout * len(sources) + 60)
        elapsed = (time.perf_counter() - start) / max(len(sources), 1)
        results = []
        for k in range(len(sources)):
            sub = workdir / f"s{k}"
            # no status: the whole batch was stopped (its budget) or its results did not come back
            code, timed_out = _status(sub, job_timed_out)
            stderr = ((sub / "stderr.txt").read_text(errors="replace")[-800:] if (sub / "stderr.txt").exists()
                      else job_stderr)
            verdicts = _verdicts(ex, cases, expected, sub, device, code, timed_out, timeout, stderr)
            results.append({k2: _result(ex, cases, verdicts, device, elapsed, k2) for k2 in secrets})
    return results


def _grading_device(ex: Exercise, device: Optional[torch.device]) -> torch.device:
    return torch.device(ex.grade_on) if ex.grade_on else (device or default_device())


def _split(ex: Exercise, source: str) -> tuple[str, list[dict]]:
    """``(own cell, needed cells as the job lists them)``: for an exercise with ``needs``, ``source``
    is an answer bundle (graders.machine.needs); for any other, its own cell and nothing needed."""
    if not ex.needs:
        return source, []
    from graders.machine.needs import split_bundle
    from graders.machine.registry import EXERCISES

    own, needed = split_bundle(ex.id, source)
    return own, [{"id": i, "source": src, "func_name": EXERCISES[i].func_name} for i, src in needed.items()]


def _write_job(ex: Exercise, cases: list[Case], workdir: Path, device: torch.device, extra: dict) -> None:
    tensors: dict[str, torch.Tensor] = {}
    job_cases = [{"args": [encode(a, f"c{i}.a{j}", tensors) for j, a in enumerate(c.args)], "out_index": c.out_index,
                  "default_device": c.default_device} for i, c in enumerate(cases)]
    save_tensors(tensors, workdir / "inputs.safetensors")
    driver = f"{ex.driver.__module__}:{ex.driver.__qualname__}" if ex.driver else None
    write_json({"exercise_id": ex.id, "driver": driver, "no_device_reads": ex.no_device_reads,
                "fresh_result": ex.fresh_result and all(c.out_index is None for c in cases),
                "device": str(device), "cases": job_cases, "needs": list(ex.needs),
                "child_imports": list(ex.child_imports), **extra}, workdir / "job.json")


def _grade(exercise_id, source, func_name, device, timeout, secrets) -> dict:
    from graders.machine.registry import EXERCISES

    ex = EXERCISES[exercise_id]
    device = _grading_device(ex, device)
    timeout = timeout or default_timeout(device) * (1 + 0.5 * (len(secrets or [None]) - 1))
    cases = _build_cases(ex, secrets)
    for case in cases:
        case.args = _to(case.args, device)
    keys = secrets if secrets is not None else [None]
    own, needed = _split(ex, source)
    if ex.requires and ex.requires[0] not in own:
        verdicts = [ex.requires[1]] * len(cases)
        return {k: _result(ex, cases, verdicts, device, 0.0, k) for k in keys}
    expected = [_expected(ex, c) for c in cases]
    with tempfile.TemporaryDirectory(prefix=f"grade-{exercise_id}-") as tmp:
        workdir = Path(tmp)
        _write_job(ex, cases, workdir, device, {"source": own, "needed": needed,
                                                 "func_name": func_name or ex.func_name})
        start = time.perf_counter()
        code, timed_out, stderr = _run_child(workdir, timeout)
        elapsed = time.perf_counter() - start
        verdicts = _verdicts(ex, cases, expected, workdir, device, code, timed_out, timeout, stderr)
    return {k: _result(ex, cases, verdicts, device, elapsed, k) for k in keys}


def _status(folder: Path, job_timed_out: bool) -> tuple[Optional[int], bool]:
    """(exit code, timed out) from a mutation batch's ``status.json``, read as untrusted data (the
    batch's process ran learner code): absent or malformed, the batch's own outcome."""
    try:
        status = read_json(folder / "status.json")
        code, timed_out = status["code"], status["timed_out"]
        if (code is None or type(code) is int) and type(timed_out) is bool:
            return code, timed_out
    except Exception:  # noqa: BLE001 (anything the child wrote is data, never a reason to stop)
        pass
    return None, job_timed_out


#: What a case fails with when the files its process wrote are not what graders.machine.runner writes.
MALFORMED = ("the grader could not read what your function's process returned for this case ({}): "
             "results that are not in the grader's own format count as wrong (did the answer cell replace "
             "part of the graders in its process?)")


def _load_error(workdir: Path) -> Optional[str]:
    """The message of ``load.json`` (the answer cell failed to run), as text whatever it holds."""
    if not (workdir / "load.json").exists():
        return None
    try:
        msg = read_json(workdir / "load.json")["error"]
    except Exception as exc:  # noqa: BLE001
        return MALFORMED.format(f"load.json: {type(exc).__name__}")
    return msg if isinstance(msg, str) else MALFORMED.format("load.json: not a message")


def _verdicts(ex, cases, expected, workdir, device, code, timed_out, timeout, stderr) -> list[Optional[str]]:
    """One verdict per case (None: passed) from the files the child wrote.

    Everything the child wrote is untrusted data (learner code ran in that process and may have
    replaced the runner, the driver or the encoder there): any exception while reading or comparing
    one case's result fails that case with :data:`MALFORMED`, never the grading run.
    """
    if (msg := _load_error(workdir)) is not None:
        return [msg] * len(cases)
    verdicts: list[Optional[str]] = []
    failed: set = set()
    stopped = False
    for i, case in enumerate(cases):
        path = workdir / f"result_{i}.json"
        if path.exists():
            # a report shows only a group's first failing case: hints (which may replay the
            # reference) are worked out for that one alone
            first = (case.group, case.secret) not in failed
            try:
                result = read_json(path)
                if not isinstance(result, dict):
                    raise TypeError(f"a JSON {type(result).__name__}, not an object")
                verdict = _case_verdict(ex, case, expected[i], result,
                                        load_tensors(workdir / f"result_{i}.safetensors"), device, with_hint=first)
                if verdict is not None and not isinstance(verdict, str):
                    raise TypeError("a verdict that is not text")
            except Exception as exc:  # noqa: BLE001 (see the docstring)
                verdict = MALFORMED.format(f"{type(exc).__name__}: {str(exc)[:160]}")
            if verdict is not None:
                failed.add((case.group, case.secret))
            verdicts.append(verdict)
        elif stopped:
            verdicts.append("not run: an earlier case stopped the process")
        else:
            stopped = True
            if timed_out:
                verdicts.append(f"did not return within the grader's {timeout:.0f} s budget "
                                f"(an endless loop?); the process was stopped")
            else:
                verdicts.append(f"the process ended (exit code {code}) during this case: "
                                f"sys.exit / os._exit / a crash in your function" + _tail(stderr))
    return verdicts


def _tail(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    return ("\n  last output on stderr: " + lines[-1][:300]) if lines else ""


def _result(ex: Exercise, cases: list[Case], verdicts: list[Optional[str]], device, elapsed,
            secret: Optional[str] = None) -> GradeResult:
    keep = [c.group != "hidden" or c.secret == secret for c in cases]
    cases = [c for c, k in zip(cases, keep) if k]
    verdicts = [v for v, k in zip(verdicts, keep) if k]
    points = POINTS[ex.id]
    groups = {g: all(v is None for c, v in zip(cases, verdicts) if c.group == g) for g in points}
    score = float(sum(p for g, p in points.items() if groups[g]))
    max_score = float(sum(points.values()))
    lines = [f"{ex.id} {ex.func_name}: {score:g} / {max_score:g} points  (device: {device.type}, {elapsed:.1f} s)"]
    for g, p in points.items():
        members = [(c, v) for c, v in zip(cases, verdicts) if c.group == g]
        if groups[g]:
            lines.append(f"  {g:<7}[{p:g} pt] passed ({len(members)} cases)")
            continue
        case, verdict = next((c, v) for c, v in members if v is not None)
        if g == "hidden":
            lines.append(f"  {g:<7}[{p:g} pt] FAILED: a hidden case failed (inputs are not shown; "
                         f"the visible groups test the same contract, so fix those first)")
            continue
        lines.append(f"  {g:<7}[{p:g} pt] FAILED at case '{case.name}': {case.describe}")
        lines.extend("    " + l for l in verdict.splitlines())
    return GradeResult(ex.id, score, max_score, groups, "\n".join(lines))
