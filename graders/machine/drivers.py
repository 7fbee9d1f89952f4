"""Drivers shared by several chapters' graders.

A driver is ``driver(learner_object, *case_args)``: it runs in the grader's child next to the
learner's code (``Exercise.driver``, looked up there by module and name) and returns plain data.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["driven_reference", "returns_python_float"]


def driven_reference(driver, fn):
    """``driver`` bound to the reference ``fn``, still named and placed like ``fn`` (its module is
    where the reference lives, for tools that look the reference's source up)."""
    return functools.update_wrapper(functools.partial(driver, fn), fn)


def returns_python_float(fn, *args):
    """Driver of the exercises whose contract returns a Python float: an int or a tensor that equals
    the number is still the wrong type.

    Raises:
        TypeError: the result is not a ``float`` (a bool, an int, a tensor, a numpy value...).
    """
    value = fn(*args)
    if isinstance(value, bool) or not isinstance(value, float):
        what = f"a tensor ({value!r})" if isinstance(value, torch.Tensor) else f"the {type(value).__name__} {value!r}"
        raise TypeError(f"returned {what}; the contract asks for a Python float (e.g. float(x), or / rather than //)")
    return value
