"""What an exercise is to the checking machine: a :class:`Case` (one call of the learner's function)
and an :class:`Exercise` (the function's name, its reference, how to make its cases, how to compare).
Each chapter's case library (``graders.chapters.chNN``) declares its exercises with these; the
machine (:mod:`graders.machine.core`) grades any of them without knowing which chapter it is.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["Case", "Exercise"]


@dataclass
class Case:
    """One call of the learner's function. Built on the CPU; moved to the grading device."""

    name: str
    args: list  # positional arguments
    describe: str  # shapes and metadata in the learner's terms
    op: str = "matmul"  # tolerance row (graders.machine.tolerances)
    out_index: Optional[int] = None  # compare args[out_index] after the call, not the return value
    defined: Optional[torch.Tensor] = None  # bool mask of the output elements the contract defines
    row_labels: Optional[list[str]] = None  # per output row: "segment 1, slot 2 (rank 7)"
    exact: Optional[torch.Tensor] = None  # bool mask of output elements that must match bit for bit
    group: str = ""
    secret: Optional[str] = None  # which secret drew a hidden case (mutation tests grade several at once)
    # The child calls the answer with torch's default device set to this one ("meta"): a tensor the
    # answer creates without ``device=`` lands there instead of on the inputs' device
    # (``Exercise.default_device_probe``).
    default_device: Optional[str] = None


@dataclass(frozen=True)
class Exercise:
    """An exercise: the learner's function name, its reference, and how to make its cases."""

    id: str
    func_name: str
    arg_names: tuple[str, ...]
    reference: Callable
    edge_cases: Callable[[], list[Case]]
    random_cases: Callable[[random.Random, torch.Generator, bool], list[Case]]  # (rng, gen, hidden)
    hint: Optional[Callable[[Case, Any, Any], Optional[str]]] = None
    # Stateful exercises: a grader function ``driver(learner_object, *case_args)`` that replays a
    # trace on what the learner defined (a class) and returns plain data (an event log). It runs in
    # the child next to the learner's code; ``reference`` is then ``driver`` applied to the reference.
    driver: Optional[Callable] = None
    # Text the answer cell must contain, and why (e.g. "@triton.jit" for the kernel exercises: a
    # PyTorch loop gives the same numbers but is not the exercise).
    requires: Optional[tuple[str, str]] = None
    # The contract builds its result from host data alone (chapter 07): any read of a tensor's value
    # on the host (.item(), .tolist(), bool(t), int(t), ...) made by the answer cell fails the case.
    no_device_reads: bool = False
    # The contract says "returns a new tensor": a result that shares memory with an input fails.
    # (Exercises with an ``out=`` argument return ``out`` and are not checked.)
    fresh_result: bool = True
    # Names of a returned tuple's fields, in order (e.g. ("permutation", "inverse")): reports say
    # "returned permutation" instead of "returned value[0]".
    result_names: Optional[tuple[str, ...]] = None
    # A device the cases always run on, whatever the grading device: "cpu" for a contract that only
    # the CPU can observe (ch02.8's stable sort: on an H200, torch.sort(stable=False) returned the
    # stable order for every graded case, so an unstable sort passed there by luck).
    grade_on: Optional[str] = None
    # Exercises whose answer cells this one runs too, by id (chapter 11's capstone runs the learner's
    # ch11.1-ch11.3 functions in the engine): it is graded from an answer bundle (graders.machine.needs), the
    # child loads each needed cell on its own, and the driver is called as
    # ``driver(learner_object, pieces, *case_args)`` with ``pieces`` = {id: the needed cell's function,
    # or a graders.machine.needs.PieceUnavailable saying why there is none}.
    needs: tuple[str, ...] = ()
    # Replaces the generic comparison of the returned value: ``compare(case, expected, got)`` with
    # ``got`` decoded as plain data (lists, tuples, dicts, numbers, strings); returns what differs in
    # the learner's terms, or None. The hint runs after it as usual, on the same plain data.
    compare: Optional[Callable[[Case, Any, Any], Optional[str]]] = None
    # Modules the child imports before it runs any answer (once, before it forks the answers of a
    # mutation batch): heavy imports a driver needs (chapter 11's capstone: transformers' Llama).
    child_imports: tuple[str, ...] = ()
    # The contract's results (and everything the answer computes them from) live on the inputs'
    # device: the edge group gets one or two more cases, the first public random case and the first
    # edge case with an empty tensor, called with torch's default device set to "meta"
    # (Case.default_device), so an answer that allocates without
    # ``device=`` fails on the CPU too, where its tensors would otherwise land on the right device by
    # luck. Only for exercises whose contract creates no host tensors and that have no driver (a
    # driver's own allocations would land there as well).
    default_device_probe: bool = False
