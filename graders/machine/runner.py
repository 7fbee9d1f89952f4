"""The learner's child process: ``python -m graders.machine.runner WORKDIR``.

Runs the answer cell's source in a fresh namespace, then calls the exercise's function on every
case in ``WORKDIR/job.json`` (inputs in ``inputs.safetensors``), writing one result per case as soon
as it is computed. Whatever the learner's code does here (raise, hang, exit, patch torch or the
graders) stays in this process: the comparer only reads the files, and kills the process when its
time is up.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import io
import inspect
import linecache
import os
import signal
import sys
import time
import traceback
import types
import warnings
from pathlib import Path
from typing import Callable, Optional

import reference  # noqa: F401  (fixes the device choice before anything imports triton)
import torch
from torch.overrides import TorchFunctionMode

from graders.machine.wire import decode, encode, load_tensors, read_json, save_tensors, write_json

#: Executed before the answer cell, as the notebooks' set-up cell does. ``graders`` is there so an
#: answer cell that ends with its own ``graders.check(...)`` runs (check does nothing in the child).
PREAMBLE = "import math\nimport torch\nimport graders\n"

#: Calls whose result's size is read from the values (a GPU waits for it).
_SHAPE_FROM_DATA = frozenset({"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"})
#: Tensor methods that bring a tensor's value to the host: on a GPU each waits for the device.
HOST_READS = frozenset({"item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__",
                        "__format__", "equal", "allclose", "is_nonzero",
                        # torch runs these without the mode (so what they read inside goes unseen): numpy's
                        # np.asarray / np.array, repr / str / print, `x in t`, complex(t), and a Python
                        # function called on every value (not __dlpack__: torch.from_dlpack is a view)
                        "__array__", "__repr__", "__contains__", "__complex__", "apply_", "map_", "map2_"}
                       ) | _SHAPE_FROM_DATA
#: Functions whose sizes come from their arguments' values: a 0-d integer tensor among them (a shape,
#: a bound, a count) is read on the host in C++, where the mode never sees a method of it (helper-28).
#: The factories, whose first argument is a size too; the methods, whose first argument is the tensor.
_SIZE_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "arange", "randn", "rand", "randint"})
_SIZE_TAKERS = _SIZE_FACTORIES | frozenset({
    "new_empty", "new_zeros", "new_ones", "new_full", "view", "reshape", "narrow", "split", "topk", "expand",
    "repeat", "cumsum", "select", "tensor_split", "chunk", "kthvalue", "roll", "tile", "unflatten", "movedim"})
#: Code whose own host reads and allocations are not the answer's: the graders (drivers, this runner)
#: and the reference package.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_EXEMPT_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                     for m in (sys.modules["graders"], reference))


class HostReadRecorder(TorchFunctionMode):
    """Records every host read of a tensor value made directly by the answer cell's code.

    The CPU has no device to wait for, so ``torch.cuda.set_sync_debug_mode`` sees nothing there; a
    TorchFunctionMode sees the Tensor methods that would synchronize on a GPU. A read is the answer
    cell's when the first frame outside torch is an answer-cell frame (a grader's driver, and the
    reference the learner may call, read what they like). Recorded, not raised: a bare ``except``
    in learner code cannot hide it.
    """

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if len(self.reads) < 5 and _reads_a_value(name, args, kwargs or {}):
            where = _answer_frame()
            if where:
                self.reads.append(f"`{_spelled(name)}` at {where}")
        return func(*args, **(kwargs or {}))


def _spelled(name: str) -> str:
    return {"__bool__": "bool(tensor) / if tensor", "__int__": "int(tensor)", "__float__": "float(tensor)",
            "__index__": "a tensor used as a Python index", "__format__": "a tensor in an f-string",
            "__array__": "np.asarray(tensor) / np.array(tensor)", "__complex__": "complex(tensor)",
            "__dlpack__": "np.from_dlpack(tensor)",
            "__repr__": "print(tensor) / repr / str", "__contains__": "`value in tensor`",
            "repeat_interleave": ".repeat_interleave() without output_size (its size is read from the values)",
            "where": "torch.where(condition) (its size is read from the values)",
            "__getitem__": "a boolean mask, or a tensor as a slice's bound, in t[...]"}.get(name) or (
        f"a tensor's value as a size or count of .{name}()" if name in _SIZE_TAKERS else
        f".{name}() (its size is read from the values)" if name in _SHAPE_FROM_DATA else "." + name + "()")


def _reads_a_value(name: str, args, kwargs) -> bool:
    if name == "__dlpack__":  # numpy's np.from_dlpack reads the memory; torch.from_dlpack makes a view of it
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "__dlpack__":
            frame = frame.f_back
        caller = frame.f_back if frame is not None else None
        return caller is not None and not caller.f_code.co_filename.startswith(_TORCH_DIR)
    """A call whose result's size depends on a tensor's values, read on the host: a name of
    :data:`HOST_READS`; repeat_interleave with tensor repeats and no output_size; t[mask] with a
    boolean mask; one-argument torch.where; a 0-d integer tensor given where a size, a bound or a
    count goes (:data:`_SIZE_TAKERS`, directly or inside a shape or a slice)."""
    if name in HOST_READS:
        return True
    if name == "repeat_interleave":
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    if name == "where":
        return len(args) + len(kwargs) == 1
    if name == "__getitem__" and len(args) > 1:
        # a boolean mask, or a tensor as a slice's bound (a tensor index by itself is a gather: no read)
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        return any((isinstance(i, torch.Tensor) and i.dtype == torch.bool) or (isinstance(i, slice)
                   and _scalar_tensor_in(i)) for i in index)
    if name in _SIZE_TAKERS:
        first = 0 if name in _SIZE_FACTORIES else 1
        return any(_scalar_tensor_in(a) for a in (*args[first:], *kwargs.values()))
    return False


def _scalar_tensor_in(value, depth: int = 0) -> bool:
    """A 0-d integer tensor, or one inside a tuple, list or slice (a shape, an index's bounds)."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0 and not value.is_floating_point() and value.dtype != torch.bool
    if isinstance(value, slice):
        return any(_scalar_tensor_in(v, depth + 1) for v in (value.start, value.stop, value.step))
    if isinstance(value, (tuple, list)) and depth < 2:
        return any(_scalar_tensor_in(v, depth + 1) for v in value)
    return False


def _answer_frame() -> str | None:
    """Where the answer cell made the call being recorded: its innermost answer-cell frame, when no
    frame of the graders or the reference lies between it and the call (a driver, and the reference
    the learner may call, read and allocate what they like); else None.

    Frames of any other code are walked past, torch's and the standard library's alike: a read made
    for the answer by a pure-Python helper it calls (``statistics.fmean(t)`` iterates ``t`` and
    calls ``float`` from statistics.py) is the answer's read.
    """
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith("<answer cell"):
            break
        if name.startswith(_EXEMPT_DIRS):
            return None
        frame = frame.f_back
    if frame is None:
        return None
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"answer cell line {frame.f_lineno}: {line}"


@contextlib.contextmanager
def watching_host_reads(device: torch.device, enabled: bool):
    """Yield a list that fills with the answer cell's host reads during the block."""
    if not enabled:
        yield []
        return
    # Every tensor, on both devices: the contract is "from host data", and a score must not depend on
    # the grading device (on a GPU a read of a CUDA tensor also stalls; of a CPU one it is still a read).
    recorder = HostReadRecorder()
    with warnings.catch_warnings(record=True) as caught, recorder:
        warnings.simplefilter("always")
        previous = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else None
        if previous is not None:  # the device also reports synchronizations the mode cannot see
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield recorder.reads
        finally:
            if previous is not None:
                torch.cuda.set_sync_debug_mode(previous)
            if not recorder.reads:
                recorder.reads += [f"a synchronizing CUDA call at {w.filename} line {w.lineno}" for w in caught
                                   if "synchroniz" in str(w.message) and w.filename.startswith("<answer cell")]


def _alias_of(returned, args) -> int | None:
    """Index of the input argument whose memory a returned tensor shares, if any. Read through
    torch.Tensor's own methods with subclass overrides off: a returned subclass of the answer's
    cannot answer for its storage (helper-27's review)."""
    outs = [returned] if isinstance(returned, torch.Tensor) else [
        v for v in (returned if isinstance(returned, (tuple, list)) else []) if isinstance(v, torch.Tensor)]
    with torch._C.DisableTorchFunctionSubclass():
        def storage(t):
            return torch.Tensor.untyped_storage(t).data_ptr() if torch.Tensor.numel(t) else None
        mine = {storage(o) for o in outs} - {None}
        for j, a in enumerate(args):
            if isinstance(a, torch.Tensor) and storage(a) in mine:
                return j
    return None


@contextlib.contextmanager
def compiled_once_per_dtype():
    """While the answer cell is defined, ``@triton.jit`` kernels do not specialize on their integer
    arguments' values (== 1, divisible by 16) nor on pointer alignment.

    Why: on a GPU Triton compiles a kernel once per such specialization, and the graders' cases
    (every layout, stride and size a contract allows) give about 40 distinct ones per kernel
    exercise: 1-3 s of compilation each made a single check take minutes on an H200 and overrun
    its budget. Specialization changes only speed, never results, so the kernel is compiled once
    per dtype and constexpr combination. Constexpr parameters are left alone. The learner's own
    kernel in the notebook is untouched. In the interpreter (CPU) nothing compiles: no change.
    """
    try:
        import triton
        import triton.language as tl
    except ImportError:  # no Triton (macOS): no kernel to compile
        triton = None
    if triton is None or os.environ.get("TRITON_INTERPRET") == "1":
        yield
        return

    original = triton.jit

    def jit(fn=None, **kwargs):
        def wrap(f):
            params = inspect.signature(f).parameters.values()
            runtime = [p.name for p in params if not _is_constexpr(p.annotation, tl)]
            kwargs.setdefault("do_not_specialize", runtime)
            kwargs.setdefault("do_not_specialize_on_alignment", runtime)
            return original(f, **kwargs)
        return wrap(fn) if fn is not None else wrap

    triton.jit = jit
    try:
        yield
    finally:
        triton.jit = original


def _is_constexpr(annotation, tl) -> bool:
    return annotation is tl.constexpr or isinstance(annotation, str) and "constexpr" in annotation


def _load_function(source: str, func_name: str, exercise_id: str, module_name: str = "__learner__"):
    filename = f"<answer cell {exercise_id}>"
    # @triton.jit and inspect read a function's source through linecache.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType(module_name)  # dataclasses and pickle look classes up in sys.modules
    sys.modules[module_name] = module
    namespace = module.__dict__
    exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
    with compiled_once_per_dtype():
        exec(compile(source, filename, "exec"), namespace)
    if func_name not in namespace:
        raise NameError(f"the answer cell defines nothing named {func_name!r}")
    return namespace[func_name]


def _driven(target, driver: str | None, pieces: dict | None = None):
    """The callable to grade: the learner's function, or a grader's driver bound to their class (and,
    for an exercise with needs, to the needed answers' functions: ``pieces``)."""
    if not driver:
        return target
    module, _, name = driver.partition(":")
    bound = (target,) if pieces is None else (target, pieces)
    return functools.partial(getattr(importlib.import_module(module), name), *bound)


def _load_needed(job: dict) -> dict | None:
    """For an exercise with needs (graders.machine.needs): {id: the function of that needed answer cell, run
    on its own like any answer, or a PieceUnavailable saying why there is none}; else None."""
    if not job.get("needs"):
        return None
    from graders.machine.needs import PieceUnavailable

    given = {piece["id"]: piece for piece in job.get("needed") or []}
    pieces: dict = {}
    for exercise_id in job["needs"]:
        piece = given.get(exercise_id)
        if piece is None:
            pieces[exercise_id] = PieceUnavailable(exercise_id, f"no answer cell of {exercise_id} was given to the grader")
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), _cell_alarm(NEEDED_CELL_SECONDS):
                pieces[exercise_id] = _load_function(piece["source"], piece["func_name"], exercise_id,
                                                     "__learner_" + exercise_id.replace(".", "_") + "__")
        except _CellHung:
            pieces[exercise_id] = PieceUnavailable(
                exercise_id, f"running your {exercise_id} answer cell did not finish within "
                             f"{NEEDED_CELL_SECONDS:g} s (an endless loop at the cell's top level?)")
        except BaseException as exc:  # that cell failed: the driver says so under its id
            pieces[exercise_id] = PieceUnavailable(
                exercise_id, f"running your {exercise_id} answer cell failed: "
                             + _error_text(exc, f"your {exercise_id} answer cell"))
    return pieces


#: Seconds a needed answer cell may take to run (define its function): a cell does no work at its top
#: level, so a hang there is named under its own id instead of using up the whole check's budget.
NEEDED_CELL_SECONDS = 10.0


class _CellHung(BaseException):
    """A needed cell's top level ran past NEEDED_CELL_SECONDS."""


@contextlib.contextmanager
def main_thread_alarm(seconds: float, error: Callable[[], BaseException]):
    """Raise ``error()`` in whatever runs after ``seconds`` (SIGALRM, so in the process's main thread
    only; in another thread, or without ``setitimer``, nothing is armed and the caller's own budget
    still applies). The previous SIGALRM handler is restored on the way out."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def ring(signum, frame):
        raise error()

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _cell_alarm(seconds: float):
    """Raise :class:`_CellHung` after ``seconds`` (see :func:`main_thread_alarm`)."""
    return main_thread_alarm(seconds, _CellHung)


def _error_text(exc: BaseException, cell: str = "answer cell") -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    learner = [f for f in frames if f.filename.startswith("<answer cell")]
    where = f" ({cell} line {learner[-1].lineno}: {learner[-1].line})" if learner else ""
    return f"{type(exc).__name__}: {exc}{where}"


#: Set in the child: graders.check does nothing there, so an answer "cell" that is a whole script
#: (graded from a .py file, where the cell is the file) cannot start graders recursively.
CHILD_ENV = "LORA_BOOK_GRADER_CHILD"


def main(workdir: Path) -> None:
    os.environ[CHILD_ENV] = "1"
    from graders.machine.sandbox import set_parent_death_signal

    set_parent_death_signal()  # a child never outlives the process that waits for it
    job = read_json(workdir / "job.json")
    inputs = load_tensors(workdir / "inputs.safetensors")
    for module in job.get("child_imports") or []:  # heavy imports of a driver, once (before any fork)
        with contextlib.suppress(ImportError):  # missing: the driver's own import says so, per case
            importlib.import_module(module)
    if "sources" in job:
        run_many(job, inputs, workdir)
    else:
        run_one(job, inputs, workdir)


def run_many(job: dict, inputs: dict, workdir: Path) -> None:
    """Grade several answer cells on the same cases (mutation tests), each in a forked process.

    The fork saves each answer the import of torch; CPU only (a CUDA context does not survive a
    fork, and this process never creates one). Each child gets ``job["timeout"]`` seconds, its
    own process group (killed whole when its time is up) and its own folder ``s<k>/``, where
    ``status.json`` records how it ended.
    """
    for k, source in enumerate(job["sources"]):
        out = workdir / f"s{k}"
        out.mkdir()
        pid = os.fork()
        if pid == 0:  # the child: grade one source, never return into this loop
            code = 0
            try:
                os.setpgid(0, 0)
                err = os.open(out / "stderr.txt", os.O_WRONLY | os.O_CREAT, 0o600)
                os.dup2(err, 2)
                needed = job["needed_per_source"][k] if "needed_per_source" in job else []
                run_one({**job, "source": source, "needed": needed}, inputs, out)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        code, timed_out, _ = wait_for_group(pid, job["timeout"])
        write_json({"code": code, "timed_out": timed_out}, out / "status.json")


def wait_for_group(pid: int, timeout: float, stop=None) -> tuple[Optional[int], bool, bool]:
    """Wait for the forked child ``pid`` (the leader of its own process group) for at most
    ``timeout`` seconds, or until ``stop(poll_seconds)`` says so; then kill its whole group
    (whatever the answer left running in it) and reap it.

    Returns:
        (exit code, or None when it did not end by itself; timed out; stopped by ``stop``).
    """
    deadline = time.monotonic() + timeout
    code, timed_out, stopped = None, False, False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        if stop is not None:
            if stop(0.005):
                stopped = True
                break
        else:
            time.sleep(0.005)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    if code is None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return code, timed_out, stopped


#: Said under an error of a default-device case (graders.machine.exercise.Exercise.default_device_probe).
DEFAULT_DEVICE_NOTE = ("\n  this case calls your function with torch's default device set to '{0}' (as "
                       "torch.set_default_device does in a process whose default device is not the inputs'): a "
                       "tensor created without device= lands there. Create every tensor, outputs and "
                       "intermediates alike, on the inputs' device: device=x.device, x.new_zeros(...), "
                       "torch.zeros_like(x), with x one of your tensor arguments")


class DefaultDeviceRecorder(TorchFunctionMode):
    """Records the first torch call made by the answer cell's own code whose result lies on
    ``device`` (the default device of a default-device case). Entered before ``torch.device(device)``,
    so it sees each call with the device already filled in. Recorded, not raised: a tensor there may
    fail loudly (a device mismatch), or silently (``out[meta_index] = ...`` writes nothing), and
    either way the report names the line that made it.
    """

    def __init__(self, device: str):
        super().__init__()
        self.device = device
        self.made: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.made and _has_tensor_on(out, self.device):
            where = _answer_frame()
            if where:
                self.made.append(f"`{getattr(func, '__name__', func)}` at {where}")
        return out


def _has_tensor_on(value, device: str) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == device
    return isinstance(value, (tuple, list)) and any(_has_tensor_on(v, device) for v in value)


class _OnDefaultDevice(Exception):
    """A default-device case: the answer made a tensor on the default device."""


@contextlib.contextmanager
def default_device(device: Optional[str]):
    """Yield a list that names the answer cell's first tensor made on ``device``, torch's default
    device during the block (nothing changes when ``device`` is None)."""
    if device is None:
        yield []
        return
    recorder = DefaultDeviceRecorder(device)
    with recorder, torch.device(device):
        yield recorder.made


def run_one(job: dict, inputs: dict, workdir: Path) -> None:
    device = torch.device(job["device"])
    try:
        pieces = _load_needed(job)  # the needed cells first, as the notebook runs them
        with contextlib.redirect_stdout(io.StringIO()):
            fn = _driven(_load_function(job["source"], job["func_name"], job["exercise_id"]), job.get("driver"),
                         pieces)
    except BaseException as exc:  # the cell itself failed: every case fails with this message
        write_json({"error": "running the answer cell failed: " + _error_text(exc)}, workdir / "load.json")
        return
    for i, case in enumerate(job["cases"]):
        args = [decode(a, inputs, device) for a in case["args"]]
        printed = io.StringIO()
        start = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        returned, reads, made = None, [], []
        elsewhere = case.get("default_device")
        try:
            with contextlib.redirect_stdout(printed), watching_host_reads(device, job.get("no_device_reads")) as reads:
                with default_device(elsewhere) as made:
                    returned = fn(*args)
                if made:
                    raise _OnDefaultDevice(f"your function created a tensor on torch's default device "
                                           f"({elsewhere}), not on the inputs' ({device.type}): {made[0]}")
                if device.type == "cuda":
                    torch.cuda.synchronize()
                # still watched: a value of the answer's own type (an int subclass whose __int__ reads a
                # tensor) is read by the encoder, in the answer's frames (helper-27's review)
                result = {"returned": encode(returned, "returned", tensors)}
            if case.get("out_index") is not None:  # the contract returns out itself (its in-place result)
                out = args[case["out_index"]]
                result["returned_out"] = bool(returned is out or (
                    isinstance(returned, torch.Tensor) and isinstance(out, torch.Tensor) and returned.shape == out.shape
                    and returned.numel() > 0 and returned.data_ptr() == out.data_ptr()) or (
                    isinstance(returned, torch.Tensor) and isinstance(out, torch.Tensor) and out.numel() == 0
                    and returned.shape == out.shape))
        except Exception as exc:
            result = {"error": _error_text(exc)}
            if made:  # the report says this first, whatever torch raised next (graders.machine.core._outcome)
                said = (str(exc) if isinstance(exc, _OnDefaultDevice) else
                        f"your function created a tensor on torch's default device ({elsewhere}), not on the "
                        f"inputs' ({device.type}): {made[0]}; then it raised {result['error']}")
                result["on_default_device"] = said + DEFAULT_DEVICE_NOTE.format(elsewhere)
        if reads:
            result["device_reads"] = reads
        if job.get("fresh_result") and "error" not in result:
            result["aliases"] = _alias_of(returned, args)
        result["args_after"] = [encode(a, f"arg{j}", tensors) for j, a in enumerate(args)]
        result["seconds"] = time.perf_counter() - start
        result["printed"] = printed.getvalue()[-500:]
        save_tensors(tensors, workdir / f"result_{i}.safetensors")
        write_json(result, workdir / f"result_{i}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
