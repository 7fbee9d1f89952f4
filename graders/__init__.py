"""The book's autograders (``import graders``).

In a notebook, the test cell under an exercise is ``graders.check("ch02.3", lora_loop)``: it re-runs
the answer cell that defined ``lora_loop`` in a child process, calls it on edge, random and hidden
cases, compares with the reference here, prints a report and returns the score as a float (the
cell's last expression, which nbgrader reads as partial credit).
"""
from __future__ import annotations

import inspect
import linecache
import os
import warnings
from typing import Callable

import reference  # noqa: F401  (device choice before anything imports triton)

from graders.core import GradeResult, grade_source
from graders.points import POINTS, total_points

__all__ = ["check", "grade_source", "answer_source", "GradeResult", "POINTS", "total_points"]


def answer_source(fn: Callable) -> str:
    """The source of the cell (or file) that defined ``fn``: what the grader re-runs.

    Raises:
        TypeError: ``fn`` is not a Python function.
        OSError: its source cannot be found.
    """
    code = _first_code(fn)
    if code is None:
        raise TypeError(f"expected your function or class, got {type(fn).__name__}")
    lines = linecache.getlines(code.co_filename)
    return "".join(lines) if lines else inspect.getsource(fn)


def _first_code(obj):
    """The code object of a function, or of a class's first method (a class has none of its own)."""
    if inspect.isfunction(obj):
        return obj.__code__
    if inspect.isclass(obj):
        for value in vars(obj).values():
            value = getattr(value, "__func__", value)  # staticmethod / classmethod
            if inspect.isfunction(value):
                return value.__code__
    return None


def check(exercise_id: str, fn: Callable) -> float:
    """Grade ``fn`` (a function, or a class for stateful exercises) for ``exercise_id``; print the
    report (stdout only) and return the score.

    Never raises for a learner's mistake: a broken function costs only its own exercise.
    """
    if os.environ.get("LORA_BOOK_GRADER_CHILD"):  # inside a grader's child: never grade recursively
        return 0.0
    if exercise_id not in POINTS:
        print(f"graders.check: unknown exercise id {exercise_id!r}; known: {', '.join(POINTS)}")
        return 0.0
    try:
        source = answer_source(fn)
    except (TypeError, OSError) as exc:
        print(f"{exercise_id}: 0 / {total_points(exercise_id):g} points: {exc}")
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # anything on stderr would zero the cell in nbgrader
        result = grade_source(exercise_id, source, func_name=fn.__name__)
    print(result.report)
    return result.score
