"""The book's autograders (``import graders``).

In a notebook, the test cell under an exercise is ``graders.check("ch02.3", lora_loop)``: it re-runs
the answer cell that defined ``lora_loop`` in a child process, calls it on edge, random and hidden
cases, compares with the reference here, prints a report and returns the score as a float (the
cell's last expression, which nbgrader reads as partial credit). ``show_reference`` prints an
exercise's reference once the learner's own check of it passed in this kernel.

The case design rule (every chapter's grader follows it; tests/test_mutants.py enforces its effect):

- ``edge``: fixed cases that cover every clause the exercise text states, and both sides of every
  stated error (A without B and B without A; r < 0 as well as r = 0; chunk_size 0 and negative; a
  slot id past either bound; requests with zero tokens).
- ``random``: seeded draws of every layout the contract allows (arrival-order, permuted,
  slot-sorted and chunked segments where an op reads segments; batches whose segment order differs
  from x's row order for ops that read only token_slots), sizes that cross every tile and every loop
  of both the chapter's suggested blocks and the reference's blocks at least twice, finite junk as
  well as NaN in padding, non-default dtypes, and overlap in stateful traces (a uid running twice, a
  batch uid also running).
- ``hidden``: the same families drawn from the instructor's secret, so a mistake costs the same
  under any secret; only the numbers change.
- Every exercise keeps a catalogue of realistic wrong answers (tests/mutants/chNN.py, edits of its
  solution cell: graders.course.mutation); each must lose the same points under three secrets (two
  on a CPU-only machine), in a visible group, with a report that names the mistake. Design cases
  from the contract, not from the catalogue, so that mistakes nobody listed fail too.
- Where a contract's tensors all live on the inputs' device, one edge case runs the answer with
  torch's default device set to "meta" (``Exercise.default_device_probe``): a tensor made without
  ``device=`` lands there and the report names the line, so a CPU-only learner learns it too.
- Checks every result's dtype and device, that inputs are unchanged, that a "new tensor" shares no
  memory with an input (``Exercise.fresh_result``), and, where the contract forbids them, host reads
  of tensor values (``Exercise.no_device_reads``).
"""
from __future__ import annotations

import importlib
import inspect
import linecache
import os
import warnings
from typing import Callable, Sequence

import reference  # noqa: F401  (device choice before anything imports triton)

from graders.machine.core import GradeResult, grade_source
from graders.machine.points import POINTS, total_points

__all__ = ["check", "show_reference", "grade_source", "answer_source", "GradeResult", "POINTS", "total_points"]

#: Exercises whose check passed with full marks in this process (this notebook's kernel).
_PASSED: set[str] = set()


def _prestart_in_a_notebook() -> None:
    """In a Jupyter kernel, start the grader's fork server now, in the background, so the first
    ``check`` does not wait for it to import torch (graders.machine.forkserver)."""
    import sys

    if "ipykernel" in sys.modules and not os.environ.get("LORA_BOOK_GRADER_CHILD"):
        from graders.machine import forkserver

        if forkserver.usable():
            forkserver.prestart()


_prestart_in_a_notebook()


def answer_source(fn: Callable) -> str:
    """The source of the cell (or file) that defined ``fn``: what the grader re-runs.

    Raises:
        TypeError: ``fn`` is not a Python function.
        OSError: its source cannot be found.
    """
    code = _first_code(fn)
    if code is None:
        if inspect.isclass(fn):
            raise TypeError(f"your class {fn.__name__} has no method written in your cell (its own or a base "
                            "class's defined beside it): nothing to grade")
        raise TypeError(f"expected your function or class, got {type(fn).__name__}")
    lines = linecache.getlines(code.co_filename)
    return "".join(lines) if lines else inspect.getsource(fn)


def _first_code(obj):
    """The code object of a function, or of a class's first method (a class has none of its own):
    its own, else that of a base class defined in the same module (a learner's ``class
    StaticLoRABatch(_Impl): pass`` keeps its methods in a helper class of the same cell)."""
    if inspect.isfunction(obj):
        return obj.__code__
    if inspect.isclass(obj):
        for klass in inspect.getmro(obj):
            if klass is not obj and klass.__module__ != obj.__module__:
                continue  # a library's base (nn.Module): its file is not the answer's
            for value in vars(klass).values():
                value = getattr(value, "__func__", value)  # staticmethod / classmethod
                if inspect.isfunction(value):
                    return value.__code__
    return None


def _bound_name(fn: Callable, caller_globals: dict, default: str) -> str:
    """The name the answer cell gave ``fn``: its ``__name__``, or for a lambda the global bound to it."""
    name = getattr(fn, "__name__", "")
    if name.isidentifier():
        return name
    return next((k for k, v in caller_globals.items() if v is fn and k.isidentifier()), default)


def check(exercise_id: str, fn: Callable, uses: Sequence[Callable] = ()) -> float:
    """Grade ``fn`` (a function, a lambda, or a class for stateful exercises) for ``exercise_id``;
    print the report (stdout only) and return the score.

    ``uses``: for an exercise that runs your answers of other exercises too (chapter 11's capstone,
    ``graders.check("ch11.5", engine_step, uses=(block_hashes, admit_requests, choose_drain))``),
    those functions, in the order the exercise names them; the grader re-runs the answer cell of
    each (``graders.machine.needs``). Works in the answer cell itself too (the grader re-runs the cell, where
    ``check`` does nothing). Never raises for a learner's mistake: a broken function costs only its
    own exercise.
    """
    if os.environ.get("LORA_BOOK_GRADER_CHILD"):  # inside a grader's child: never grade recursively
        return 0.0
    if exercise_id not in POINTS:
        print(f"graders.check: unknown exercise id {exercise_id!r}; known: {', '.join(POINTS)}")
        return 0.0
    caller = inspect.currentframe().f_back
    caller_globals = caller.f_globals if caller else {}
    try:
        source = answer_source(fn)
        source = _with_uses(exercise_id, source, uses, caller_globals)
    except (TypeError, OSError) as exc:
        print(f"{exercise_id}: 0 / {total_points(exercise_id):g} points: {exc}")
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anything on stderr would zero the cell in nbgrader
        from graders.machine.registry import EXERCISES

        name = _bound_name(fn, caller_globals, EXERCISES[exercise_id].func_name)
        result = grade_source(exercise_id, source, func_name=name)
    print(result.report)
    if result.score == result.max_score:
        _PASSED.add(exercise_id)
    return result.score


def _with_uses(exercise_id: str, source: str, uses: Sequence[Callable], caller_globals: dict) -> str:
    """``source`` as the grader takes it: for an exercise with needs, the answer bundle of ``source``
    and the answer cells of ``uses`` (graders.machine.needs); else ``source`` itself.

    A function of ``uses`` bound under another name than its exercise's gets an alias line, so the
    grader finds it under the exercise's name.
    Raises:
        TypeError: ``uses`` given to an exercise without needs, of the wrong length, or holding
            something that is not a function.
        OSError: the source of a function of ``uses`` cannot be found.
    """
    from graders.machine.needs import bundle
    from graders.machine.registry import EXERCISES

    needs = EXERCISES[exercise_id].needs
    if not needs:
        if uses:
            raise TypeError(f"{exercise_id} runs only its own answer: call graders.check({exercise_id!r}, fn)")
        return source
    names = [EXERCISES[n].func_name for n in needs]
    if isinstance(uses, (str, bytes)) or not isinstance(uses, Sequence) or len(uses) != len(needs):
        raise TypeError(f"{exercise_id} runs your answers of {', '.join(needs)} too: pass them, "
                        f"graders.check({exercise_id!r}, <your function>, uses=({', '.join(names)}))")
    needed = {}
    for need, name, used in zip(needs, names, uses):
        if _first_code(used) is None:
            raise TypeError(f"uses: expected your {need} function {name}, got {type(used).__name__}")
        bound = _bound_name(used, caller_globals, name)
        needed[need] = answer_source(used) + ("" if bound == name else f"\n{name} = {bound}\n")
    return bundle(exercise_id, source, needed)


def show_reference(exercise_id: str, reveal: bool = False) -> None:
    """Print the book's reference for ``exercise_id`` (the objects named in ``graders.chapters.shown``), but
    only once your own answer passed ``check(exercise_id, ...)`` with full marks in this kernel, or
    when you ask for it with ``reveal=True``: "Run All" on an unsolved notebook spoils nothing.
    """
    from graders.chapters.shown import SHOWN

    if exercise_id not in SHOWN:
        print(f"graders.show_reference: unknown exercise id {exercise_id!r}")
        return
    if not (reveal or exercise_id in _PASSED):
        print(f"The reference for {exercise_id} is shown here once your answer passes "
              f"graders.check(\"{exercise_id}\", ...) in this notebook. To read it now anyway, run: "
              f"graders.show_reference(\"{exercise_id}\", reveal=True)")
        return
    for i, name in enumerate(SHOWN[exercise_id]):
        print(("\n" if i else "") + inspect.getsource(_resolve(name)).rstrip())


def _resolve(name: str):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "fn", obj)  # a @triton.jit kernel: its Python function
