"""The learner's child process: ``python -m graders.runner WORKDIR``.

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
import linecache
import os
import sys
import time
import traceback
import types
from pathlib import Path

import reference  # noqa: F401  (fixes the device choice before anything imports triton)
import torch

from graders.wire import decode, encode, load_tensors, read_json, save_tensors, write_json

#: Executed before the answer cell, as the notebooks' set-up cell does.
PREAMBLE = "import math\nimport torch\n"


def _load_function(source: str, func_name: str, exercise_id: str):
    filename = f"<answer cell {exercise_id}>"
    # @triton.jit and inspect read a function's source through linecache.
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    module = types.ModuleType("__learner__")  # dataclasses and pickle look classes up in sys.modules
    sys.modules["__learner__"] = module
    namespace = module.__dict__
    exec(compile(PREAMBLE, "<preamble>", "exec"), namespace)
    exec(compile(source, filename, "exec"), namespace)
    if func_name not in namespace:
        raise NameError(f"the answer cell defines nothing named {func_name!r}")
    return namespace[func_name]


def _driven(target, driver: str | None):
    """The callable to grade: the learner's function, or a grader's driver bound to their class."""
    if not driver:
        return target
    module, _, name = driver.partition(":")
    return functools.partial(getattr(importlib.import_module(module), name), target)


def _error_text(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    learner = [f for f in frames if f.filename.startswith("<answer cell")]
    where = f" (answer cell line {learner[-1].lineno}: {learner[-1].line})" if learner else ""
    return f"{type(exc).__name__}: {exc}{where}"


#: Set in the child: graders.check does nothing there, so an answer "cell" that is a whole script
#: (graded from a .py file, where the cell is the file) cannot start graders recursively.
CHILD_ENV = "LORA_BOOK_GRADER_CHILD"


def main(workdir: Path) -> None:
    os.environ[CHILD_ENV] = "1"
    job = read_json(workdir / "job.json")
    inputs = load_tensors(workdir / "inputs.safetensors")
    device = torch.device(job["device"])
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            fn = _driven(_load_function(job["source"], job["func_name"], job["exercise_id"]), job.get("driver"))
    except BaseException as exc:  # the cell itself failed: every case fails with this message
        write_json({"error": "running the answer cell failed: " + _error_text(exc)}, workdir / "load.json")
        return
    for i, case in enumerate(job["cases"]):
        args = [decode(a, inputs, device) for a in case["args"]]
        printed = io.StringIO()
        start = time.perf_counter()
        tensors: dict[str, torch.Tensor] = {}
        try:
            with contextlib.redirect_stdout(printed):
                returned = fn(*args)
            if device.type == "cuda":
                torch.cuda.synchronize()
            result = {"returned": encode(returned, "returned", tensors)}
        except Exception as exc:
            result = {"error": _error_text(exc)}
        result["args_after"] = [encode(a, f"arg{j}", tensors) for j, a in enumerate(args)]
        result["seconds"] = time.perf_counter() - start
        result["printed"] = printed.getvalue()[-500:]
        save_tensors(tensors, workdir / f"result_{i}.safetensors")
        write_json(result, workdir / f"result_{i}.json")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
